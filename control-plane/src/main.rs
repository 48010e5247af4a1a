//! `innerwall`: the control-plane binary. Its service, store and authoring commands arrive with
//! issues 3–5; today it exposes the contract it speaks.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "innerwall", version, about = "Innerwall control plane and operator CLI")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the agent contract package this build speaks.
    Contract,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Contract => println!("{}", innerwall_wire::CONTRACT_PACKAGE),
    }
    Ok(())
}
