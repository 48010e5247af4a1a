//! `innerwall estate-range`: the estate's workload address ranges (address trust). A reported
//! address is rendered into other workloads' peer sets only if one of these ranges holds it.
//! On this host's database or through a control plane's API ([`Backend`]), printed alike.

use clap::Subcommand;
use innerwall_control_plane::policy::store::EstateRangeView;
use innerwall_wire::policy::Cidr;

use crate::backend::Backend;
use crate::output::{print_json, print_table, report};

#[derive(Debug, Subcommand)]
pub enum EstateRangeCmd {
    /// Every range, smallest address first (all pages).
    List,
    /// Trust addresses in CIDR as workload addresses (e.g. a public range your hosts use).
    Add {
        #[arg(value_parser = parse_cidr)]
        cidr: Cidr,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Stop trusting addresses in CIDR: those only it held leave every peer set.
    Remove {
        #[arg(value_parser = parse_cidr)]
        cidr: Cidr,
    },
}

/// A CIDR as the CLI takes it: the network address and prefix, e.g. `10.0.0.0/8`.
pub fn parse_cidr(text: &str) -> Result<Cidr, String> {
    Cidr::parse(text).map_err(|e| e.to_string())
}

fn print_ranges(json: bool, all: Vec<EstateRangeView>) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    if all.is_empty() {
        println!("no estate ranges: no reported workload address is rendered into any peer set");
    }
    let rows = all
        .into_iter()
        .map(|r| vec![r.cidr, r.description, r.created_at.format("%F %T").to_string()])
        .collect();
    print_table(&["range", "description", "added"], rows);
    Ok(())
}

pub async fn run(b: &impl Backend, json: bool, cmd: &EstateRangeCmd) -> anyhow::Result<()> {
    match cmd {
        EstateRangeCmd::List => print_ranges(json, b.estate_ranges().await?)?,
        EstateRangeCmd::Add { cidr, description } => report(
            json,
            &format!("estate range {cidr} added"),
            &b.add_estate_range(*cidr, description).await?,
        ),
        EstateRangeCmd::Remove { cidr } => {
            report(json, &format!("estate range {cidr} removed"), &b.remove_estate_range(*cidr).await?)
        }
    }
    Ok(())
}
