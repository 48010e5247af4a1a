//! `innerwall workload`: enrolled hosts — listing, labels, mode, rendered policy, convergence
//! status, and the operator's levers on a stream (resend snapshot, release an address, retire,
//! deny). [`run`] is written once against a [`Backend`] (this host's database or a control
//! plane's API) and hands what either answers to one set of printers, so both print the same.

use clap::Subcommand;
use innerwall_control_plane::gate::{self, Promotion, Scope, Verdict};
use innerwall_control_plane::policy::authoring::{LabelsReplaced, ResendRequested};
use innerwall_control_plane::policy::store::{self, PolicyView, SyncStatusView, WorkloadRow, WorkloadView};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::Mode;

use crate::backend::Backend;
use crate::output::{escape, print_json, print_table, report};
use crate::replay;
use crate::requests::{EvidenceArgs, ScopeArgs};
use innerwall_control_plane::gate::promote::Guard;
use innerwall_control_plane::safety::rollback::Target;

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
    /// Replay the flows recorded towards a workload through two of its stored policy versions:
    /// what would become blocked or allowed. Exits 1 if anything becomes newly blocked (unless
    /// --accept-blocks) or the evidence covers less of the range than --min-coverage.
    Replay {
        id: WorkloadId,
        /// The version replayed from (0: nothing applied).
        #[arg(long)]
        from: u64,
        /// The version replayed to.
        #[arg(long)]
        to: u64,
        #[command(flatten)]
        args: replay::ReplayArgs,
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
    /// Roll back to an earlier version's authored source, rendered again as a new version
    /// (against today's registry, in today's mode); the workloads stay pinned to it, whatever
    /// the rulesets say, until `workload unpin`.
    #[command(group = clap::ArgGroup::new("target").required(true).args(["to_last_clean", "to_version"]))]
    Rollback {
        #[command(flatten)]
        scope: ScopeArgs,
        /// How many workloads you expect the scope to name; any other number changes nothing.
        #[arg(long)]
        expect_count: usize,
        /// Each to the newest earlier version a promotion's verdict judged SAFE.
        #[arg(long)]
        to_last_clean: bool,
        /// To this version (one workload).
        #[arg(long)]
        to_version: Option<u64>,
    },
    /// Render from the rulesets again after a rollback.
    Unpin {
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

/// Why a mode changes, and on what evidence.
#[derive(Debug, clap::Args)]
pub struct ChangeArgs {
    /// Why: kept on the promotion record.
    #[arg(long)]
    reason: Option<String>,
    /// Enforce without a SAFE verdict, for this reason (kept on the record).
    #[arg(long = "override")]
    override_reason: Option<String>,
    /// The auto-demotion guard of a move to enforcement: minutes it watches (0: none).
    #[arg(long, default_value_t = Guard::default().minutes)]
    guard_minutes: u32,
    /// New connections blocked from one source, protocol and port, that the evidence range
    /// showed allowed, that demote the workload to simulation.
    #[arg(long, default_value_t = Guard::default().threshold)]
    guard_threshold: u32,
    /// Also demote on blocked sources the evidence range never showed.
    #[arg(long)]
    guard_unseen: bool,
    /// A move to enforcement that reverts to simulation unless `innerwall promotions confirm`
    /// comes within this long (e.g. 10m; 10s to 24h): the agents hold the deadline themselves.
    #[arg(long, value_parser = humantime::parse_duration)]
    confirm_within: Option<std::time::Duration>,
    #[command(flatten)]
    evidence: EvidenceArgs,
}

impl ChangeArgs {
    pub fn guard(&self) -> Guard {
        Guard { minutes: self.guard_minutes, threshold: self.guard_threshold, unseen: self.guard_unseen }
    }
}

/// A mode change as the promotion path takes it: `default_reason` stands in for no `--reason`
/// (none: the change is refused).
fn mode_request(
    scope: Scope,
    expect_count: usize,
    to: Mode,
    change: &ChangeArgs,
    default_reason: &str,
) -> anyhow::Result<gate::Request> {
    Ok(gate::Request {
        scope,
        expect_count,
        to,
        params: change.evidence.params()?,
        reason: change.reason.clone().unwrap_or_else(|| default_reason.to_owned()),
        override_reason: change.override_reason.clone(),
        guard: Some(change.guard()),
        confirm_within: change.confirm_within,
    })
}

pub async fn run(b: &impl Backend, json: bool, cmd: &WorkloadCmd) -> anyhow::Result<()> {
    match cmd {
        WorkloadCmd::List => print_list(json, b.workloads().await?)?,
        WorkloadCmd::Show { id } => print_show(json, b.workload(*id).await?)?,
        WorkloadCmd::Label { id, set, remove, expect_label_version } => {
            let done = b.change_labels(*id, *expect_label_version, set, remove).await?;
            report(json, &labels_changed(*id, &done.result), &done);
        }
        WorkloadCmd::Mode { id, mode, change } => {
            let scope = ScopeArgs { scope: None, ids: vec![*id] };
            let request = mode_request(scope.scope()?, 1, *mode, change, "innerwall workload mode")?;
            print_mode_change(json, &b.promote(&request, &scope, &change.evidence).await?)?;
        }
        WorkloadCmd::Verdict { scope, evidence } => print_verdict(json, &b.verdict(scope, evidence).await?)?,
        WorkloadCmd::Promote { scope, expect_count, to, change } => {
            let request = mode_request(scope.scope()?, *expect_count, *to, change, "")?;
            print_mode_change(json, &b.promote(&request, scope, &change.evidence).await?)?;
        }
        WorkloadCmd::Status { id } => print_status(json, b.sync_status(*id).await?)?,
        WorkloadCmd::ResendSnapshot { id } => print_resend(json, *id, &b.resend_snapshot(*id).await?)?,
        WorkloadCmd::Rollback { scope, expect_count, to_version, .. } => {
            let target = to_version.map_or(Target::LastClean, Target::Version);
            let done = b.rollback(&scope.scope()?, scope, *expect_count, target).await?;
            let lines: Vec<String> = done
                .result
                .iter()
                .map(|r| {
                    let now = r.version.map_or("nothing moved".to_owned(), |v| format!("now v{v}"));
                    format!(
                        "workload {} rolled back from v{} to the source of v{} ({now}); pinned until `workload unpin`",
                        r.workload, r.from_version, r.source_of
                    )
                })
                .collect();
            report(json, &lines.join("\n"), &done);
        }
        WorkloadCmd::Unpin { id } => {
            report(json, &format!("workload {id} renders from the rulesets again"), &b.unpin(*id).await?)
        }
        WorkloadCmd::Retire { id } => report(json, &lifecycle_done(*id, true), &b.retire(*id).await?),
        WorkloadCmd::Deny { id } => report(json, &lifecycle_done(*id, false), &b.deny(*id).await?),
        WorkloadCmd::ReleaseAddress { id, address } => {
            let done = b.release_address(*id, *address).await?;
            report(json, &format!("{id} no longer claims {address}"), &done);
        }
        WorkloadCmd::Policy { id } => print_policy(json, &b.policy(*id).await?)?,
        WorkloadCmd::Replay { id, from, to, args } => {
            replay::print(json, &b.replay(*id, *from, *to, args).await?, args)?;
        }
    }
    Ok(())
}

// ---- printers, fed by the database or by the API --------------------------------------------

fn print_list(json: bool, rows: Vec<WorkloadRow>) -> anyhow::Result<()> {
    if json {
        return print_json(&rows);
    }
    let rows = rows
        .into_iter()
        .map(|w| {
            let labels: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mode = match (w.retired, w.denied) {
                (_, true) => format!("{} (deny-listed)", w.mode),
                (true, false) => format!("{} (retired)", w.mode),
                (false, false) => w.mode,
            };
            vec![
                w.id,
                w.hostname,
                mode,
                w.sync_state,
                labels.join(","),
                w.label_version.to_string(),
                w.addresses.iter().map(|a| a.brief()).collect::<Vec<_>>().join(" "),
                w.latest_version.map_or("-".into(), |v| v.to_string()),
            ]
        })
        .collect();
    print_table(
        &["id", "hostname", "mode", "state", "labels", "label version", "addresses", "policy version"],
        rows,
    );
    Ok(())
}

/// `workload show`: one workload as a list of one (`--json` too), then its addresses.
fn print_show(json: bool, w: WorkloadView) -> anyhow::Result<()> {
    if json {
        return print_json(&[w]);
    }
    let labels: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let row = vec![
        w.id,
        w.hostname,
        if w.retired { format!("{} (retired)", w.mode) } else { w.mode },
        labels.join(","),
        w.label_version.to_string(),
        w.addresses.iter().map(|a| a.brief()).collect::<Vec<_>>().join(" "),
        w.policy_version.map_or("-".into(), |v| v.to_string()),
        w.sync_state,
    ];
    print_table(
        &["id", "hostname", "mode", "labels", "label version", "addresses", "policy version", "state"],
        vec![row],
    );
    if !w.sync_detail.is_empty() {
        println!("state: {}", escape(&w.sync_detail));
    }
    if let Some((id, deadline)) = w.awaiting_confirmation {
        println!(
            "enforced until {} unless confirmed: `innerwall promotions confirm {id}` (the host then reverts to simulation by itself)",
            deadline.format("%F %T UTC")
        );
    }
    if let Some(id) = w.auto_demoted_by {
        println!(
            "auto-demoted to simulation by its enforcement guard: `innerwall promotions show {id}` has the flows"
        );
    }
    if let Some(v) = w.pinned_to_source_of {
        println!(
            "pinned by a rollback to the authored source of v{v}: rulesets do not reach it until `workload unpin`"
        );
    }
    if let Some(f) = &w.facts {
        let when = |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".into(), |t| t.to_rfc3339());
        println!();
        println!(
            "enrolled {} by token {}",
            f.enrolled_at.to_rfc3339(),
            f.enrolled_by_token.map_or("- (deleted)".into(), |t| t.to_string())
        );
        println!(
            "credential {} (issued by root {}), expires {}, last renewed {}",
            f.credential_serial,
            f.credential_issuer.as_deref().unwrap_or("unknown"),
            when(f.credential_expires_at),
            when(f.last_renewed_at)
        );
        if let (Some(at), Some(reason)) = (f.last_renewal_failed_at, &f.last_renewal_error) {
            println!("last renewal failure {}: {}", at.to_rfc3339(), escape(reason));
        }
        if let Some(c) = &f.clone {
            println!("{}", escape(&clone_line(c)));
        }
    }
    if !w.addresses.is_empty() {
        println!();
        print_addresses(w.addresses);
    }
    Ok(())
}

fn labels_changed(id: WorkloadId, done: &LabelsReplaced) -> String {
    match done.set.is_empty() && done.removed.is_empty() {
        true => format!("labels of {id} unchanged (label version {})", done.version),
        false => format!("labels of {id} updated (label version {})", done.version),
    }
}

fn lifecycle_done(id: WorkloadId, retire: bool) -> String {
    let what = if retire {
        "retired: it left every render and its stream is closed"
    } else {
        "deny-listed: refused at the handshake, its stream is cut and it left every render"
    };
    format!("{id} {what}")
}

fn print_mode_change(json: bool, promotion: &Promotion) -> anyhow::Result<()> {
    if json {
        return print_json(promotion);
    }
    let names: Vec<String> =
        promotion.workloads.iter().map(|m| format!("{} (was {})", m.name(), m.mode)).collect();
    println!("{} workload(s) now in {} mode: {}", names.len(), promotion.to_mode, escape(&names.join(", ")));
    if let Some(reason) = &promotion.override_reason {
        println!("OVERRIDE of the evidence gate: {}", escape(reason));
    }
    println!("promotion record {}", promotion.id);
    Ok(())
}

fn print_verdict(json: bool, verdict: &Verdict) -> anyhow::Result<()> {
    if json {
        return print_json(verdict);
    }
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
        println!("{} ({}):", escape(&w.hostname), w.id);
        for reason in &w.reasons {
            println!("  - {}", escape(&reason.to_string()));
        }
    }
    if verdict.workloads.is_empty() {
        println!("the scope matches no workload");
    }
    Ok(())
}

fn print_status(json: bool, all: Vec<SyncStatusView>) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    let when =
        |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".into(), |t| t.format("%F %T").to_string());
    let notes = identity_notes(&all);
    let rows = all
        .into_iter()
        .map(|w| {
            let latest = w.latest_version.map_or("-".into(), |v| v.to_string());
            let behind = match w.latest_version {
                Some(l) if l != w.applied_version => format!("{}/{latest} (behind)", w.applied_version),
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
    if !notes.is_empty() {
        println!();
        for note in notes {
            println!("{note}");
        }
    }
    Ok(())
}

/// One line per clone episode in progress and per failing renewal (IDN-7, IDN-5).
fn identity_notes(all: &[SyncStatusView]) -> Vec<String> {
    let mut notes = Vec::new();
    for w in all {
        if let Some(c) = &w.clone {
            notes.push(format!("{} ({}): {}", w.id, w.hostname, clone_line(c)));
        }
        if let Some(f) = &w.renewal_failure {
            notes.push(format!(
                "{} ({}): renewal failed at {}: {}",
                w.id,
                w.hostname,
                f.at.format("%F %T"),
                f.reason
            ));
        }
    }
    notes
}

fn clone_line(c: &innerwall_control_plane::policy::lifecycle::CloneReport) -> String {
    let presenters: Vec<String> = c
        .presenters
        .iter()
        .map(|p| {
            format!(
                "boot {} key {}… machine {} host {} (last seen {})",
                p.boot_id,
                p.key_sha256.get(..12).unwrap_or(&p.key_sha256),
                p.machine_id,
                p.hostname,
                p.last_seen_at.format("%F %T")
            )
        })
        .collect();
    format!(
        "CLONED IDENTITY since {} (last seen {}), {} presenters: {}; `workload deny` ends them all, then enroll the genuine host again",
        c.since.format("%F %T"),
        c.last_seen_at.format("%F %T"),
        c.presenters.len(),
        presenters.join("; ")
    )
}

fn print_resend(json: bool, id: WorkloadId, requested: &ResendRequested) -> anyhow::Result<()> {
    if json {
        return print_json(requested);
    }
    let at = requested.last_snapshot_sent_at.map_or("never".into(), |t| t.to_rfc3339());
    println!(
        "asked the replica holding {id}'s stream to reconnect it; success shows as last snapshot advancing past {at}"
    );
    Ok(())
}

fn print_policy(json: bool, policy: &PolicyView) -> anyhow::Result<()> {
    if json {
        return print_json(policy);
    }
    println!(
        "workload {}: version {} · mode {} · rendered {}",
        policy.workload, policy.version, policy.mode, policy.rendered_at
    );
    let rows = policy
        .rules
        .iter()
        .map(|r| vec![r.rule_id.clone(), r.protocol.clone(), r.ports.join(","), r.peers.join(" ")])
        .collect();
    print_table(&["rule", "protocol", "ports", "peers"], rows);
    Ok(())
}

/// One workload's reported addresses, each with its standing and why it is not rendered.
fn print_addresses(addresses: Vec<store::AddressView>) {
    let rows = addresses
        .into_iter()
        .map(|a| {
            let mut why = a.reason.unwrap_or_default();
            if !a.also_claimed_by.is_empty() {
                why = format!("also claimed by {}; {why}", a.also_claimed_by.join(", "));
            }
            vec![a.address, a.standing, why]
        })
        .collect();
    print_table(&["address", "standing", "why"], rows);
}
