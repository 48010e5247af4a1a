//! `innerwall audit list`: the audit log read back (POL-8) — every record of who changed what,
//! newest first, filtered by actor, action, object and age; from this host's database or a
//! control plane's API ([`Backend`]), every page walked, printed by the same function.

use std::time::Duration;

use clap::Subcommand;
use innerwall_control_plane::audit::AuditRow;

use crate::backend::Backend;
use crate::duration;
use crate::output::{print_json, print_table};
use crate::requests::AuditQuery;

#[derive(Debug, Subcommand)]
pub enum AuditCmd {
    /// Every record that matches, newest first (all pages).
    List {
        /// Records by this actor exactly (`cli:alice`, `operator:ed/AbCd1234`, `workload:<id>`).
        #[arg(long)]
        actor: Option<String>,
        /// Records of this action exactly (`service.update`, `workload.resend-snapshot`, …).
        #[arg(long)]
        action: Option<String>,
        /// Records about this object exactly (a service's name, a workload id, a token id, …).
        #[arg(long)]
        object: Option<String>,
        /// Only records written within this long (e.g. 1h, 7d).
        #[arg(long, value_parser = duration::arg)]
        since: Option<Duration>,
    },
}

pub async fn run(b: &impl Backend, json: bool, cmd: &AuditCmd) -> anyhow::Result<()> {
    let AuditCmd::List { actor, action, object, since } = cmd;
    let query =
        AuditQuery { actor: actor.clone(), action: action.clone(), object: object.clone(), since: *since };
    print_records(json, &b.audit(&query).await?)
}

fn print_records(json: bool, rows: &[AuditRow]) -> anyhow::Result<()> {
    if json {
        return print_json(&rows);
    }
    let table = rows
        .iter()
        .map(|r| {
            // A render can move every workload: the table counts them, `--json` names them.
            let moved = r.workload_versions.as_object().map_or(0, serde_json::Map::len);
            vec![
                r.id.to_string(),
                r.at.format("%F %T").to_string(),
                r.actor.clone(),
                r.action.clone(),
                r.subject.clone(),
                moved.to_string(),
            ]
        })
        .collect();
    print_table(&["id", "at", "actor", "action", "object", "workloads moved"], table);
    Ok(())
}
