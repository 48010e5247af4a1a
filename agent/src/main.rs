//! `innerwall-agent`: the privileged host agent. Enrollment, sync, enforcement and flow capture
//! arrive with issues 4–7; today it exposes the contract it speaks.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "innerwall-agent", version, about = "Innerwall host agent")]
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
