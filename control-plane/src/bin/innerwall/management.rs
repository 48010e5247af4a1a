//! `innerwall management`: the management access every workload keeps whatever its policy
//! says (the failsafe rule). Shown and narrowed on this host's database or through a control
//! plane's API ([`Backend`]); replaced (`reset`) only on the database.

use clap::Subcommand;
use innerwall_control_plane::policy::model::{Management, ServiceEntry};
use innerwall_control_plane::safety::management::{ManagementListing, ManagementView, Scope};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;

use crate::backend::Backend;
use crate::estate::parse_cidr;
use crate::output::{print_json, print_table, report};

#[derive(Debug, Subcommand)]
pub enum ManagementCmd {
    /// The estate's management access and every workload's narrowing of it.
    Show,
    /// Narrow the estate's management access, or one workload's (--workload): every range
    /// inside one of the current set's, every service inside one of its services (admin).
    Narrow {
        #[arg(long)]
        workload: Option<WorkloadId>,
        #[command(flatten)]
        set: SetArgs,
    },
    /// Replace the estate's management access, wider or not, dropping every workload's
    /// narrowing: only on the control plane's host, with its database.
    Reset {
        #[command(flatten)]
        set: SetArgs,
    },
}

#[derive(Debug, clap::Args)]
pub struct SetArgs {
    /// A source range (repeatable, at least one).
    #[arg(long = "cidr", required = true, value_parser = parse_cidr)]
    cidrs: Vec<Cidr>,
    /// A service entry the sources reach (repeatable), e.g. tcp:22.
    #[arg(long = "service", default_value = "tcp:22", value_parser = parse_entry)]
    services: Vec<ServiceEntry>,
}

impl SetArgs {
    fn management(&self) -> anyhow::Result<Management> {
        Ok(Management::new(self.cidrs.iter().copied(), self.services.iter().cloned())?)
    }
}

/// A service entry as the CLI takes it, e.g. `tcp:22`.
pub fn parse_entry(text: &str) -> Result<ServiceEntry, String> {
    ServiceEntry::parse(text).map_err(|e| e.to_string())
}

fn row(scope: String, view: ManagementView) -> Vec<String> {
    vec![
        scope,
        view.services.join(" "),
        view.cidrs.join(" "),
        view.updated_by,
        view.updated_at.format("%F %T").to_string(),
    ]
}

fn print_listing(json: bool, listing: ManagementListing) -> anyhow::Result<()> {
    if json {
        return print_json(&listing);
    }
    if listing.estate.is_none() {
        println!(
            "no management access is set: an enforced host admits only what its policy does; start serve \
             with --management-cidr"
        );
    }
    let rows = listing
        .estate
        .into_iter()
        .map(|v| row("estate".into(), v))
        .chain(listing.workloads.into_iter().map(|v| {
            let scope = v.workload_id.map(|w| w.to_string()).unwrap_or_default();
            row(scope, v)
        }))
        .collect();
    print_table(&["scope", "services", "sources", "by", "updated"], rows);
    Ok(())
}

pub async fn run(b: &impl Backend, json: bool, cmd: &ManagementCmd) -> anyhow::Result<()> {
    match cmd {
        ManagementCmd::Show => print_listing(json, b.management().await?)?,
        ManagementCmd::Narrow { workload, set } => {
            let scope = workload.map_or(Scope::Estate, Scope::Workload);
            let set = set.management()?;
            let done = b.narrow_management(scope, &set).await?;
            report(json, &format!("management access of the {scope} narrowed to {set}"), &done);
        }
        ManagementCmd::Reset { set } => {
            let set = set.management()?;
            let done = b.reset_management(&set).await?;
            report(json, &format!("management access of the estate reset to {set}"), &done);
        }
    }
    Ok(())
}
