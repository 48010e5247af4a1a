//! `innerwall workload`: enrolled hosts — listing, labels, mode, rendered policy, convergence
//! status, and the operator's levers on a stream (resend snapshot, retire, deny).

use anyhow::bail;
use clap::Subcommand;
use innerwall_control_plane::gate::{self, Params, Scope, Verdict};
use innerwall_control_plane::policy::{authoring, store};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::Mode;

use crate::ctx::Ctx;
use crate::duration;
use crate::output::{print_json, print_table, report};

#[derive(Debug, Subcommand)]
pub enum WorkloadCmd {
    List,
    Show {
        id: WorkloadId,
    },
    /// Set or remove labels, conditional on the label version you read.
    Label {
        id: WorkloadId,
        #[arg(long = "set")]
        set: Vec<Label>,
        #[arg(long = "remove")]
        remove: Vec<LabelKey>,
        /// The label version `workload show` printed; a stale edit is refused.
        #[arg(long)]
        expect_label_version: i64,
    },
    /// Set one workload's mode (visibility, simulation or enforcement), as `promote` does for a
    /// set: enforcement needs a SAFE verdict or --override; every change is recorded.
    Mode {
        id: WorkloadId,
        mode: Mode,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Is it safe to enforce this scope now? Judges the version each workload runs on the
    /// evidence its agent delivered (FLOW-7).
    Verdict {
        #[command(flatten)]
        scope: ScopeArgs,
        #[command(flatten)]
        evidence: EvidenceArgs,
    },
    /// Change the mode of exactly the set a scope names, if it names as many as you expect;
    /// enforcement needs a SAFE verdict or --override (FLOW-8).
    Promote {
        #[command(flatten)]
        scope: ScopeArgs,
        /// How many workloads you expect the scope to name; any other number changes nothing.
        #[arg(long)]
        expect_count: usize,
        #[arg(long)]
        to: Mode,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Show the rendered policy and its version.
    Policy {
        id: WorkloadId,
    },
    /// Convergence: applied vs latest version, sync state, last seen/acked/snapshot.
    Status {
        id: Option<WorkloadId>,
    },
    /// Ask the replica holding the agent's stream to make it reconnect (fresh snapshot).
    ResendSnapshot {
        id: WorkloadId,
    },
    /// Retire: identity and addresses leave every render; its stream is closed.
    Retire {
        id: WorkloadId,
    },
    /// Deny-list: refused at the handshake, stream cut, renewal refused.
    Deny {
        id: WorkloadId,
    },
    /// Drop the workload's claim to an address (resolves a conflict, or forgets an address the
    /// host no longer has); if the host still reports it, its next inventory claims it again.
    ReleaseAddress {
        id: WorkloadId,
        address: std::net::IpAddr,
    },
}

/// The workloads a verdict or mode change is about.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct ScopeArgs {
    /// A label selector, `key=value`, several values `key=v1|v2`, keys ANDed with commas
    /// (`app=web,env=prod|staging`), resolved to the live workloads in it now.
    #[arg(long)]
    scope: Option<String>,
    /// Workload ids (repeat the flag).
    #[arg(long = "id")]
    ids: Vec<WorkloadId>,
}

impl ScopeArgs {
    fn scope(&self) -> anyhow::Result<Scope> {
        Ok(match &self.scope {
            Some(text) => Scope::parse_selector(text)?,
            None => Scope::Ids(self.ids.clone()),
        })
    }
}

/// The evidence a verdict judges.
#[derive(Debug, clap::Args)]
pub struct EvidenceArgs {
    /// The evidence range: from this long ago until now.
    #[arg(long, default_value = "24h", value_parser = duration::arg)]
    evidence_since: std::time::Duration,
    /// A shorter range is never enough evidence.
    #[arg(long, default_value = "24h", value_parser = duration::arg)]
    min_evidence: std::time::Duration,
}

impl EvidenceArgs {
    fn params(&self) -> Params {
        let to = chrono::Utc::now().timestamp_millis();
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Params {
            from_ms: to.saturating_sub(ms(self.evidence_since)),
            to_ms: to,
            min_duration_ms: ms(self.min_evidence),
            top_peers: 5,
        }
    }
}

/// Why a mode changes, and on what evidence.
#[derive(Debug, clap::Args)]
pub struct ChangeArgs {
    /// Why: kept on the promotion record.
    #[arg(long)]
    reason: Option<String>,
    /// Enforce without a SAFE verdict, for this reason (kept on the record).
    #[arg(long = "override")]
    override_reason: Option<String>,
    #[command(flatten)]
    evidence: EvidenceArgs,
}

/// Changes modes through the promotion path and prints the record. Without `--reason`, the
/// reason is `default_reason` (none: the change is refused).
async fn change_mode(
    ctx: &Ctx,
    scope: Scope,
    expect_count: usize,
    to: Mode,
    change: &ChangeArgs,
    default_reason: &str,
) -> anyhow::Result<()> {
    let request = gate::Request {
        scope,
        expect_count,
        to,
        params: change.evidence.params(),
        reason: change.reason.clone().unwrap_or_else(|| default_reason.to_owned()),
        override_reason: change.override_reason.clone(),
    };
    let promotion = gate::promote(&ctx.pool, &ctx.actor, &request).await?;
    if ctx.json {
        return print_json(&promotion);
    }
    let names: Vec<String> =
        promotion.workloads.iter().map(|m| format!("{} (was {})", m.name(), m.mode)).collect();
    println!("{} workload(s) now in {} mode: {}", names.len(), promotion.to_mode, names.join(", "));
    if let Some(reason) = &promotion.override_reason {
        println!("OVERRIDE of the evidence gate: {reason}");
    }
    println!("promotion record {}", promotion.id);
    Ok(())
}

fn print_verdict(verdict: &Verdict) {
    println!("verdict: {}", verdict.outcome.name());
    let rows = verdict
        .workloads
        .iter()
        .map(|w| {
            let e = &w.evidence;
            let replayed: Vec<String> = e.replayed_from.iter().map(|v| format!("v{v}")).collect();
            vec![
                w.id.to_string(),
                w.hostname.clone(),
                w.outcome().name().to_owned(),
                w.latest_version.map_or("-".into(), |v| format!("v{v}")),
                format!("{} · {}", w.mode, w.state),
                format!("{}%", if e.range_ms > 0 { e.covered_ms * 100 / e.range_ms } else { 0 }),
                format!("{} win / {} s", e.native_windows, e.native_ms / 1000),
                if replayed.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{} win / {} s from {}",
                        e.replayed_windows,
                        e.replayed_ms / 1000,
                        replayed.join(",")
                    )
                },
                e.would_block_flows.to_string(),
            ]
        })
        .collect();
    print_table(
        &[
            "id",
            "hostname",
            "verdict",
            "judged",
            "mode · state",
            "covered",
            "native",
            "replayed",
            "would block",
        ],
        rows,
    );
    for w in verdict.workloads.iter().filter(|w| !w.reasons.is_empty()) {
        println!("{} ({}):", w.hostname, w.id);
        for reason in &w.reasons {
            println!("  - {reason}");
        }
    }
    if verdict.workloads.is_empty() {
        println!("the scope matches no workload");
    }
}

pub async fn run(ctx: &Ctx, cmd: &WorkloadCmd) -> anyhow::Result<()> {
    let (json, pool, actor) = (ctx.json, &ctx.pool, ctx.actor.as_str());
    match cmd {
        WorkloadCmd::List | WorkloadCmd::Show { .. } => {
            let only = if let WorkloadCmd::Show { id } = cmd { Some(*id) } else { None };
            let all = store::list_workloads(&mut *pool.acquire().await?, only).await?;
            if let Some(id) = only
                && all.is_empty()
            {
                bail!("workload {id} not found");
            }
            if json {
                return print_json(&all);
            }
            let addresses = match &all[..] {
                [one] if only.is_some() => one.addresses.clone(),
                _ => Vec::new(),
            };
            let rows = all
                .into_iter()
                .map(|w| {
                    let labels: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    vec![
                        w.id,
                        w.hostname,
                        if w.retired { format!("{} (retired)", w.mode) } else { w.mode },
                        labels.join(","),
                        w.label_version.to_string(),
                        w.addresses.iter().map(|a| a.brief()).collect::<Vec<_>>().join(" "),
                        w.policy_version.map_or("-".into(), |v| v.to_string()),
                    ]
                })
                .collect();
            print_table(
                &["id", "hostname", "mode", "labels", "label version", "addresses", "policy version"],
                rows,
            );
            if !addresses.is_empty() {
                println!();
                print_addresses(addresses);
            }
        }
        WorkloadCmd::Label { id, set, remove, expect_label_version } => {
            let done = authoring::commit(pool, actor, "workload.label", &id.to_string(), async |c| {
                let v = authoring::edit_labels(c, *id, *expect_label_version, set, remove).await?;
                let set: Vec<String> = set.iter().map(ToString::to_string).collect();
                let removed: Vec<String> = remove.iter().map(ToString::to_string).collect();
                Ok((v, serde_json::json!({"set": set, "removed": removed})))
            })
            .await?;
            report(json, &format!("labels of {id} updated (label version {})", done.value), done);
        }
        WorkloadCmd::Mode { id, mode, change } => {
            change_mode(ctx, Scope::Ids(vec![*id]), 1, *mode, change, "innerwall workload mode").await?;
        }
        WorkloadCmd::Verdict { scope, evidence } => {
            let verdict = gate::judge(pool, &scope.scope()?, &evidence.params()).await?;
            if json {
                return print_json(&verdict);
            }
            print_verdict(&verdict);
        }
        WorkloadCmd::Promote { scope, expect_count, to, change } => {
            change_mode(ctx, scope.scope()?, *expect_count, *to, change, "").await?;
        }
        WorkloadCmd::Status { id } => {
            let all = store::sync_status(&mut *pool.acquire().await?, *id).await?;
            if let Some(id) = id
                && all.is_empty()
            {
                bail!("workload {id} not found (or retired)");
            }
            if json {
                return print_json(&all);
            }
            let when = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or("-".into(), |t| t.format("%F %T").to_string())
            };
            let rows = all
                .into_iter()
                .map(|w| {
                    let latest = w.latest_version.map_or("-".into(), |v| v.to_string());
                    let behind = match w.latest_version {
                        Some(l) if l != w.applied_version => {
                            format!("{}/{latest} (behind)", w.applied_version)
                        }
                        _ => format!("{}/{latest}", w.applied_version),
                    };
                    vec![
                        w.id.to_string(),
                        w.hostname,
                        behind,
                        w.state.0.name().to_owned(),
                        w.detail,
                        w.address_issues.iter().map(|a| a.brief()).collect::<Vec<_>>().join(" "),
                        when(w.last_seen_at),
                        when(w.last_acked_at),
                        when(w.last_snapshot_sent_at),
                    ]
                })
                .collect();
            print_table(
                &[
                    "id",
                    "hostname",
                    "applied/latest",
                    "state",
                    "detail",
                    "addresses not rendered",
                    "last seen",
                    "last ack",
                    "last snapshot",
                ],
                rows,
            );
        }
        WorkloadCmd::ResendSnapshot { id } => {
            let requested = authoring::request_snapshot(pool, *id).await?;
            if json {
                return print_json(&requested);
            }
            let at = requested.last_snapshot_sent_at.map_or("never".into(), |t| t.to_rfc3339());
            println!(
                "asked the replica holding {id}'s stream to reconnect it; success shows as last snapshot advancing past {at}"
            );
        }
        WorkloadCmd::Retire { id } | WorkloadCmd::Deny { id } => {
            let retire = matches!(cmd, WorkloadCmd::Retire { .. });
            let action = if retire { "workload.retire" } else { "workload.deny" };
            let done = authoring::commit(pool, actor, action, &id.to_string(), async |c| {
                if retire {
                    authoring::retire(c, *id).await?
                } else {
                    authoring::deny(c, *id).await?
                }
                Ok(((), serde_json::json!({})))
            })
            .await?;
            let what = if retire {
                "retired: it left every render and its stream is closed"
            } else {
                "deny-listed: refused at the handshake, its stream is cut and it left every render"
            };
            report(json, &format!("{id} {what}"), done);
        }
        WorkloadCmd::ReleaseAddress { id, address } => {
            let done =
                authoring::commit(pool, actor, "workload.release-address", &id.to_string(), async |c| {
                    authoring::release_address(c, *id, *address).await?;
                    Ok(((), serde_json::json!({"address": address.to_string()})))
                })
                .await?;
            report(json, &format!("{id} no longer claims {address}"), done);
        }
        WorkloadCmd::Policy { id } => {
            let Some((policy, rendered_at)) =
                store::persisted_policy(&mut *pool.acquire().await?, *id).await?
            else {
                bail!("workload {id} has no rendered policy (unknown workload, or not rendered yet)");
            };
            if json {
                return print_json(&store::PolicyView::of(*id, &policy, rendered_at));
            }
            println!(
                "workload {id}: version {} · mode {} · rendered {rendered_at}",
                policy.version(),
                policy.mode()
            );
            let rows = policy
                .rules()
                .map(|r| {
                    let ports: Vec<String> = r.ports().iter().map(ToString::to_string).collect();
                    let peers: Vec<String> = r.peers().iter().map(ToString::to_string).collect();
                    vec![r.id().to_string(), r.protocol().to_string(), ports.join(","), peers.join(" ")]
                })
                .collect();
            print_table(&["rule", "protocol", "ports", "peers"], rows);
        }
    }
    Ok(())
}

/// One workload's reported addresses, each with its standing and why it is not rendered.
fn print_addresses(addresses: Vec<store::AddressView>) {
    let rows = addresses
        .into_iter()
        .map(|a| {
            let mut why = a.reason.unwrap_or("").to_owned();
            if !a.also_claimed_by.is_empty() {
                why = format!("also claimed by {}; {why}", a.also_claimed_by.join(", "));
            }
            vec![a.address, a.standing.to_owned(), why]
        })
        .collect();
    print_table(&["address", "standing", "why"], rows);
}
