//! `innerwall audit list`: the audit log read back (POL-8) — every record of who changed what,
//! newest first, filtered by actor, action, object and age; from this host's database ([`run`])
//! or a control plane's API ([`run_remote`]), every page walked, printed by the same function.

use std::time::Duration;

use clap::Subcommand;
use innerwall_control_plane::audit::{self, AuditFilter, AuditRow};

use crate::api::{ApiClient, with_query};
use crate::ctx::Ctx;
use crate::output::{print_json, print_table};
use crate::{duration, pages};

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

pub async fn run(ctx: &Ctx, cmd: &AuditCmd) -> anyhow::Result<()> {
    let AuditCmd::List { actor, action, object, since } = cmd;
    let filter = AuditFilter {
        actor: actor.clone(),
        action: action.clone(),
        object: object.clone(),
        since: since.as_ref().map(duration::since),
    };
    let mut conn = ctx.pool.acquire().await?;
    let rows = pages::local(ctx.page_size, None, async |r| audit::page(&mut conn, &filter, r).await).await?;
    print_records(ctx.json, &rows)
}

/// [`run`] through a control plane's API.
pub async fn run_remote(api: &ApiClient, json: bool, cmd: &AuditCmd) -> anyhow::Result<()> {
    let AuditCmd::List { actor, action, object, since } = cmd;
    let mut query = Vec::new();
    for (name, value) in [("actor", actor), ("action", action), ("object", object)] {
        if let Some(value) = value {
            query.push((name, value.clone()));
        }
    }
    if let Some(back) = since {
        query.push(("since", duration::since_param(back)));
    }
    let rows: Vec<AuditRow> = pages::remote(api, &with_query("/api/v1/audit", &query), None).await?;
    print_records(json, &rows)
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
