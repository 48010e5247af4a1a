//! `innerwall flows`: the flow evidence agents reported, and the gaps in it.

use clap::Subcommand;
use innerwall_control_plane::flows as f;
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{Decision, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Protocol;

use crate::ctx::Ctx;
use crate::duration;
use crate::output::{print_json, print_table};

#[derive(Debug, Subcommand)]
pub enum FlowsCmd {
    /// Inbound flow records of one workload, newest first.
    List {
        #[arg(long)]
        workload: WorkloadId,
        /// How far back, e.g. 1h, 7d.
        #[arg(long, default_value = "1h", value_parser = duration::arg)]
        since: std::time::Duration,
        /// observed, allowed, would-block or blocked.
        #[arg(long)]
        decision: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Evidence gaps: what could not be recorded (never silence).
    Gaps {
        #[arg(long)]
        workload: Option<WorkloadId>,
        #[arg(long, default_value = "24h", value_parser = duration::arg)]
        since: std::time::Duration,
    },
}

/// A stored enum number by name; "?" for a number this binary does not know.
fn stored<E: WireEnum + std::fmt::Display>(code: i16) -> String {
    E::from_code(code).map_or_else(|_| "?".to_owned(), |e| e.to_string())
}

/// The instant `back` before now; a span reaching past 1970 (no evidence is older) means all.
fn since(back: &std::time::Duration) -> chrono::DateTime<chrono::Utc> {
    chrono::Duration::from_std(*back)
        .ok()
        .and_then(|back| chrono::Utc::now().checked_sub_signed(back))
        .map_or(chrono::DateTime::UNIX_EPOCH, |at| at.max(chrono::DateTime::UNIX_EPOCH))
}

pub async fn run(ctx: &Ctx, cmd: &FlowsCmd) -> anyhow::Result<()> {
    match cmd {
        FlowsCmd::List { workload, since: back, decision, limit } => {
            let decision = match decision.as_deref() {
                None => None,
                Some(name) => Some(name.parse::<Decision>().map_err(|_| {
                    anyhow::anyhow!(
                        "unknown decision {name:?}: use observed, allowed, would-block or blocked"
                    )
                })?),
            };
            if !(1..=10_000).contains(limit) {
                anyhow::bail!("--limit must be between 1 and 10000");
            }
            let rows = f::list(&ctx.pool, *workload, since(back), decision, *limit).await?;
            if ctx.json {
                return print_json(&rows);
            }
            let rows = rows
                .into_iter()
                .map(|r| {
                    let peer = match r.peer_kind {
                        1 => format!("workload {} {}", r.peer_key, r.peer_labels),
                        2 => format!("group {}", r.peer_key),
                        _ => r.peer_key.clone(),
                    };
                    let proto = stored::<Protocol>(r.protocol);
                    vec![
                        r.window_start.format("%F %T").to_string(),
                        format!("v{}", r.policy_version),
                        r.src_address,
                        peer,
                        format!("{proto}/{}", r.dst_port),
                        stored::<Decision>(r.decision),
                        r.matched_rule_id,
                        r.new_connections.to_string(),
                        r.packets.to_string(),
                        r.bytes.to_string(),
                    ]
                })
                .collect();
            print_table(
                &[
                    "window", "policy", "source", "peer", "service", "decision", "rule", "conns", "packets",
                    "bytes",
                ],
                rows,
            );
        }
        FlowsCmd::Gaps { workload, since: back } => {
            let rows = f::gaps(&ctx.pool, *workload, since(back)).await?;
            if ctx.json {
                return print_json(&rows);
            }
            let rows = rows
                .into_iter()
                .map(|g| {
                    vec![
                        g.workload_id.to_string(),
                        stored::<GapKind>(g.kind),
                        g.gap_from.format("%F %T").to_string(),
                        g.gap_to.format("%F %T").to_string(),
                        g.count.to_string(),
                        g.detail,
                    ]
                })
                .collect();
            print_table(&["workload", "kind", "from", "to", "count", "why"], rows);
        }
    }
    Ok(())
}
