//! `innerwall flows`: the flow evidence agents reported, the gaps in it, and rollups of it
//! (FLOW-6), each a bounded page that says when more follow and how to ask for them. On this
//! host's database or through a control plane's API ([`Backend`]): the flags are checked the
//! same way before asking, `--limit` and `--cursor` pass through, `--since` is measured back from
//! "now" on the side that holds the database (the API gets the duration, not an instant), and
//! the answer prints with the same functions.

use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::Subcommand;
use innerwall_control_plane::flows::{
    self as f, FlowRow, GapRow, Grouping, MAX_PAGE, Page, PageRequest, RollupRow,
};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{Decision, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Protocol;

use crate::backend::Backend;
use crate::duration::{self};
use crate::output::{print_json, print_table};
use crate::requests::{Range, RecordQuery, Rollup};

#[derive(Debug, Subcommand)]
pub enum FlowsCmd {
    /// Inbound flow records of one workload, newest first.
    List {
        #[arg(long)]
        workload: WorkloadId,
        /// How far back, e.g. 1h, 7d.
        #[arg(long, default_value = "1h", value_parser = duration::arg)]
        since: Duration,
        /// observed, allowed, would-block or blocked.
        #[arg(long)]
        decision: Option<String>,
        /// Only records decided under this policy version.
        #[arg(long)]
        version: Option<u64>,
        #[arg(long, default_value_t = 100, value_parser = limit())]
        limit: u32,
        /// Continue after the page that printed this cursor.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Evidence gaps: what could not be recorded (never silence).
    Gaps {
        #[arg(long)]
        workload: Option<WorkloadId>,
        #[arg(long, default_value = "24h", value_parser = duration::arg)]
        since: Duration,
        #[arg(long, default_value_t = 1000, value_parser = limit())]
        limit: u32,
        /// Continue after the page that printed this cursor.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Flows summed by rule, rule-peer, src-dst, dst-service or peer-service, with the policy
    /// versions that decided them; e.g. `flows rollup --by rule-peer --scope app=db --decision
    /// would-block --since 24h`.
    Rollup {
        /// rule, rule-peer, src-dst, dst-service or peer-service.
        #[arg(long)]
        by: String,
        /// Flows to this workload (repeat for several).
        #[arg(long)]
        workload: Vec<WorkloadId>,
        /// Flows to the workloads the selector matches now, e.g. 'app=web,env=prod|staging'.
        #[arg(long)]
        scope: Option<String>,
        /// The peer had this label when the flow was recorded, e.g. app=batch (repeat: all of them).
        #[arg(long)]
        peer_label: Vec<String>,
        /// observed, allowed, would-block or blocked (repeat for several).
        #[arg(long)]
        decision: Vec<String>,
        /// Decided under this policy version (repeat for several).
        #[arg(long)]
        version: Vec<u64>,
        /// How far back, e.g. 1h, 7d (instead of --from/--to).
        #[arg(long, value_parser = duration::arg, conflicts_with_all = ["from", "to"])]
        since: Option<Duration>,
        /// Start of the range (RFC 3339, e.g. 2026-01-01T00:00:00Z).
        #[arg(long)]
        from: Option<DateTime<Utc>>,
        /// End of the range (RFC 3339); default now.
        #[arg(long, requires = "from")]
        to: Option<DateTime<Utc>>,
        #[arg(long, default_value_t = 100, value_parser = limit())]
        limit: u32,
        /// Continue after the page that printed this cursor.
        #[arg(long)]
        cursor: Option<String>,
    },
}

/// `--limit`: rows per page, within what a query may return (the API may allow fewer).
fn limit() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(1..=i64::from(MAX_PAGE))
}

/// A stored enum number by name; "?" for a number this binary does not know.
fn stored<E: WireEnum + std::fmt::Display>(code: i16) -> String {
    E::from_code(code).map_or_else(|_| "?".to_owned(), |e| e.to_string())
}

fn decision(name: &str) -> anyhow::Result<Decision> {
    name.parse::<Decision>().map_err(|_| {
        anyhow::anyhow!("unknown decision {name:?}: use observed, allowed, would-block or blocked")
    })
}

/// How a peer reads in a table: a workload with its labels then, a group, or an address.
fn peer(kind: i16, key: &str, labels: &serde_json::Value) -> String {
    match kind {
        1 => format!("workload {key} {labels}"),
        2 => format!("group {key}"),
        _ => key.to_owned(),
    }
}

/// The last line under a table: whether the page is the whole answer.
fn print_more<T>(page: &Page<T>, command: &str) {
    if let Some(cursor) = &page.next_cursor {
        println!("truncated: more rows follow; next page: {command} … --cursor {cursor}");
    } else {
        println!("{} row(s), complete", page.rows.len());
    }
}

/// `--json` of `list` and `gaps` stays the array of rows it always was; a page that does not
/// hold every row says so on stderr with the cursor to the rest.
fn print_rows_json<T: serde::Serialize>(page: &Page<T>, command: &str) -> anyhow::Result<()> {
    if let Some(cursor) = &page.next_cursor {
        crate::output::note(format_args!(
            "truncated: more rows follow; next page: {command} … --cursor {cursor}"
        ));
    }
    print_json(&page.rows)
}

/// What a record's staged set decided (FLOW-10): `BLOCKED (set)`, `ALLOWED by rule (set)`, or
/// nothing outside a staged set.
fn pending(r: &FlowRow) -> String {
    let Some(decision) = r.pending_decision else {
        return String::new();
    };
    let set = r.staged_set.as_deref().unwrap_or("?");
    match r.pending_rule_id.as_deref().filter(|rule| !rule.is_empty()) {
        Some(rule) => format!("{} by {rule} ({set})", stored::<Decision>(decision)),
        None => format!("{} ({set})", stored::<Decision>(decision)),
    }
}

/// `flows list`'s page, from either source.
fn print_records(json: bool, page: &Page<FlowRow>) -> anyhow::Result<()> {
    const COMMAND: &str = "innerwall flows list";
    if json {
        return print_rows_json(page, COMMAND);
    }
    let rows = page
        .rows
        .iter()
        .map(|r| {
            vec![
                r.window_start.format("%F %T").to_string(),
                format!("v{}", r.policy_version),
                r.src_address.clone(),
                peer(r.peer_kind, &r.peer_key, &r.peer_labels),
                format!("{}/{}", stored::<Protocol>(r.protocol), r.dst_port),
                stored::<Decision>(r.decision),
                r.matched_rule_id.clone(),
                pending(r),
                r.new_connections.to_string(),
                r.packets.to_string(),
                r.bytes.to_string(),
            ]
        })
        .collect();
    print_table(
        &[
            "window", "policy", "source", "peer", "service", "decision", "rule", "pending", "conns",
            "packets", "bytes",
        ],
        rows,
    );
    print_more(page, COMMAND);
    Ok(())
}

/// `flows gaps`'s page, from either source.
fn print_gaps(json: bool, page: &Page<GapRow>) -> anyhow::Result<()> {
    const COMMAND: &str = "innerwall flows gaps";
    if json {
        return print_rows_json(page, COMMAND);
    }
    let rows = page
        .rows
        .iter()
        .map(|g| {
            vec![
                g.workload_id.to_string(),
                stored::<GapKind>(g.kind),
                g.gap_from.format("%F %T").to_string(),
                g.gap_to.format("%F %T").to_string(),
                g.count.to_string(),
                g.detail.clone(),
            ]
        })
        .collect();
    print_table(&["workload", "kind", "from", "to", "count", "why"], rows);
    print_more(page, COMMAND);
    Ok(())
}

impl Rollup {
    fn from_cmd(cmd: &FlowsCmd) -> anyhow::Result<Rollup> {
        let FlowsCmd::Rollup {
            by,
            workload,
            scope,
            peer_label,
            decision: names,
            version,
            since: back,
            from,
            to,
            ..
        } = cmd
        else {
            unreachable!("only a rollup command is a rollup")
        };
        let by: Grouping = by.parse()?;
        let range = match (back, from) {
            (_, Some(from)) => Range::Between { from: *from, to: *to },
            (Some(back), None) => Range::Since(*back),
            (None, None) => Range::Since(Duration::from_secs(3600)),
        };
        let decisions = names.iter().map(|n| decision(n)).collect::<anyhow::Result<_>>()?;
        let peer_labels = peer_label
            .iter()
            .map(|l| l.parse::<Label>().map_err(|e| anyhow::anyhow!("--peer-label {l:?}: {e}")))
            .collect::<anyhow::Result<_>>()?;
        let scope = match scope {
            Some(text) => Some((text.clone(), f::parse_selector(text)?)),
            None => None,
        };
        Ok(Rollup {
            by,
            range,
            decisions,
            peer_labels,
            versions: version.clone(),
            workloads: workload.clone(),
            scope,
        })
    }
}

fn page_request(limit: u32, cursor: &Option<String>) -> PageRequest {
    PageRequest { limit, cursor: cursor.clone() }
}

pub async fn run(b: &impl Backend, json: bool, cmd: &FlowsCmd) -> anyhow::Result<()> {
    match cmd {
        FlowsCmd::List { workload, since: back, decision: name, version, limit, cursor } => {
            let query = RecordQuery {
                workload: *workload,
                since: *back,
                decision: name.as_deref().map(decision).transpose()?,
                version: *version,
            };
            print_records(json, &b.flow_records(&query, &page_request(*limit, cursor)).await?)
        }
        FlowsCmd::Gaps { workload, since: back, limit, cursor } => {
            print_gaps(json, &b.flow_gaps(*workload, *back, &page_request(*limit, cursor)).await?)
        }
        FlowsCmd::Rollup { limit, cursor, .. } => {
            let rollup = Rollup::from_cmd(cmd)?;
            if let (Some((text, selector)), false) = (&rollup.scope, json)
                && b.scope_is_empty(text, selector).await?
            {
                crate::output::note(format_args!("note: no live workload matches the scope {selector} now"));
            }
            print_rollup(json, rollup.by, &b.flow_rollup(&rollup, &page_request(*limit, cursor)).await?)
        }
    }
}

/// `flows rollup`'s page, from either source: the whole page with `--json`, else a table whose
/// key columns are the grouping's.
fn print_rollup(json: bool, by: Grouping, page: &Page<RollupRow>) -> anyhow::Result<()> {
    if json {
        return print_json(page);
    }
    let key: &[&str] = match by {
        Grouping::Rule => &["rule"],
        Grouping::RulePeer => &["rule", "peer"],
        Grouping::SrcDst => &["source", "peer", "workload", "destination"],
        Grouping::DstService => &["workload", "service"],
        Grouping::PeerService => &["peer", "service"],
    };
    let mut headers = key.to_vec();
    headers.extend([
        "conns",
        "packets",
        "bytes",
        "records",
        "first seen",
        "last seen",
        "versions",
        "decisions",
    ]);
    let text = |v: &Option<String>| v.clone().unwrap_or_default();
    let rows = page
        .rows
        .iter()
        .map(|r| {
            let rule = match r.rule.as_deref() {
                Some("") => "(none)".to_owned(),
                other => other.unwrap_or_default().to_owned(),
            };
            let peer = match (r.peer_kind, &r.peer_key) {
                (Some(kind), Some(key)) => {
                    peer(kind, key, r.peer_labels.as_ref().unwrap_or(&serde_json::json!({})))
                }
                _ => String::new(),
            };
            let service = match (r.protocol, r.dst_port) {
                (Some(protocol), Some(port)) => format!("{}/{port}", stored::<Protocol>(protocol)),
                _ => String::new(),
            };
            let workload = r.workload_id.map(|w| w.to_string()).unwrap_or_default();
            let mut row: Vec<String> = match by {
                Grouping::Rule => vec![rule],
                Grouping::RulePeer => vec![rule, peer],
                Grouping::SrcDst => vec![text(&r.src_address), peer, workload, text(&r.dst_address)],
                Grouping::DstService => vec![workload, service],
                Grouping::PeerService => vec![peer, service],
            };
            let versions: Vec<String> = r.policy_versions.iter().map(|v| format!("v{v}")).collect();
            let decisions: Vec<String> = r.decisions.iter().map(|d| stored::<Decision>(*d)).collect();
            row.extend([
                r.connections.to_string(),
                r.packets.to_string(),
                r.bytes.to_string(),
                r.records.to_string(),
                r.first_seen.format("%F %T").to_string(),
                r.last_seen.format("%F %T").to_string(),
                versions.join(","),
                decisions.join(","),
            ]);
            row
        })
        .collect();
    print_table(&headers, rows);
    print_more(page, "innerwall flows rollup");
    Ok(())
}
