//! `innerwall workload`: enrolled hosts — listing, labels, mode, rendered policy, convergence
//! status, and the operator's levers on a stream (resend snapshot, retire, deny).

use anyhow::bail;
use clap::Subcommand;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::Mode;

use crate::ctx::Ctx;
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
    /// Set the enforcement mode: visibility, simulation or enforcement.
    Mode {
        id: WorkloadId,
        mode: Mode,
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
        WorkloadCmd::Mode { id, mode } => {
            let done = authoring::commit(pool, actor, "workload.mode", &id.to_string(), async |c| {
                authoring::set_mode(c, *id, *mode).await?;
                Ok(((), serde_json::json!({"mode": mode.name()})))
            })
            .await?;
            report(json, &format!("{id} is now in {mode} mode"), done);
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
            let rules: Vec<serde_json::Value> = policy
                .rules()
                .map(|r| {
                    serde_json::json!({
                        "rule_id": r.id().to_string(),
                        "protocol": r.protocol().name(),
                        "ports": r.ports().iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "peers": r.peers().iter().map(ToString::to_string).collect::<Vec<_>>(),
                    })
                })
                .collect();
            if json {
                return print_json(&serde_json::json!({
                    "workload": id.to_string(),
                    "version": policy.version(),
                    "mode": policy.mode().name(),
                    "rendered_at": rendered_at,
                    "rules": rules,
                }));
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
