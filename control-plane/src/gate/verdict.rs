//! The verdict (FLOW-7), pure: given what each workload of a scope is now (mode, convergence,
//! latest policy) and the evidence its agent delivered for a range (windows, gaps, flows), is it
//! safe to enforce the version each runs now? SAFE only if every workload is in simulation,
//! SYNCED at its latest version, its windows cover the range with no hole longer than one of its
//! windows, no evidence gap touches the range, at least one window was captured under the latest
//! version itself, and no flow of the range is WOULD_BLOCK under that version. Windows of older
//! versions count by replay: their flows are decided again through the latest version with the
//! one `decide` the agent uses. Otherwise UNSAFE (some flow would be blocked) or INSUFFICIENT
//! (the evidence cannot tell), with every workload's reasons.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::flows::{Decision, EvidenceGap, decide};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol, Version, WorkloadPolicy};
use innerwall_wire::sync::SyncState;
use serde::{Deserialize, Serialize};

/// What the verdict is asked: the evidence range and how much of it is enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Params {
    /// The evidence range, unix milliseconds, `[from_ms, to_ms)`.
    pub from_ms: i64,
    pub to_ms: i64,
    /// A shorter range is not enough evidence, whatever it shows.
    pub min_duration_ms: i64,
    /// How many would-block peers each workload's reasons name.
    pub top_peers: usize,
}

/// The longest evidence range a verdict looks back over (and the longest minimum it asks for).
pub const MAX_EVIDENCE: std::time::Duration = std::time::Duration::from_secs(90 * 86_400);

impl Params {
    /// The evidence from `since` before `to_ms` until `to_ms`, judged enough only if the range is
    /// at least `min` long; refused beyond [`MAX_EVIDENCE`]. The CLI (local or remote) and the
    /// API build their parameters here, with `to_ms` their own now.
    pub fn ending_at(
        to_ms: i64,
        since: std::time::Duration,
        min: std::time::Duration,
    ) -> Result<Params, crate::error::Error> {
        for (what, d) in [("an evidence range", since), ("a minimum evidence range", min)] {
            if d > MAX_EVIDENCE {
                // In days (humantime would say months), the rest as humantime has it.
                let days = d.as_secs() / 86_400;
                let rest = d - std::time::Duration::from_secs(days * 86_400);
                let shown = match rest.is_zero() {
                    true => format!("{days} days"),
                    false => format!("{days} days {}", humantime::format_duration(rest)),
                };
                return Err(crate::error::Error::Invalid(format!(
                    "{what} of {shown} is longer than the {} days a verdict may look back",
                    MAX_EVIDENCE.as_secs() / 86_400
                )));
            }
        }
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Ok(Params { from_ms: to_ms.saturating_sub(ms(since)), to_ms, min_duration_ms: ms(min), top_peers: 5 })
    }
}

/// The most two windows may be apart and still count as abutting (rounding, clock steps).
pub const JOIN_SLACK_MS: i64 = 1_000;

/// How long after its window closed an upload may still be on its way: the end of a range may
/// lack the open window and this much more.
pub const UPLOAD_SLACK_MS: i64 = 5_000;

/// One window the agent delivered: its interval and the version it was captured under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowFacts {
    pub start_ms: i64,
    pub end_ms: i64,
    pub policy_version: Version,
}

/// The flows of one key captured under one version, summed over the range's windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowFacts {
    pub policy_version: Version,
    pub src: IpAddr,
    pub dst_port: u16,
    pub protocol: Protocol,
    /// The decision the agent recorded (under `policy_version`).
    pub decision: Decision,
    pub connections: u64,
    pub packets: u64,
    /// The peer's labels as they were at ingest.
    pub peer_labels: serde_json::Value,
}

/// Everything the verdict needs of one workload.
#[derive(Debug, Clone)]
pub struct WorkloadFacts {
    pub id: WorkloadId,
    pub hostname: String,
    pub mode: Mode,
    pub state: SyncState,
    pub applied_version: Version,
    /// The latest rendered policy (`None`: never rendered).
    pub latest: Option<WorkloadPolicy>,
    /// Windows overlapping the range.
    pub windows: Vec<WindowFacts>,
    /// Gaps overlapping the range.
    pub gaps: Vec<EvidenceGap>,
    pub flows: Vec<FlowFacts>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Outcome {
    Safe,
    Unsafe,
    Insufficient,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Safe => "SAFE",
            Outcome::Unsafe => "UNSAFE",
            Outcome::Insufficient => "INSUFFICIENT",
        }
    }
}

/// How a would-block flow was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Found {
    /// Recorded WOULD_BLOCK by the agent under the latest version itself.
    Native,
    /// Recorded under an older version and decided again through the latest.
    Replay,
}

/// A peer whose flows the latest version would block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedPeer {
    pub src: IpAddr,
    /// Its labels as they were when the flow was ingested.
    pub labels: serde_json::Value,
    /// `protocol/port` it reached, sorted.
    pub services: BTreeSet<String>,
    pub connections: u64,
    pub packets: u64,
    pub found: BTreeSet<Found>,
    /// The versions the flows were captured under.
    pub versions: BTreeSet<Version>,
}

/// Why a workload is not SAFE.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "kebab-case")]
pub enum Reason {
    RangeTooShort {
        range_ms: i64,
        min_ms: i64,
    },
    WrongMode {
        #[serde(deserialize_with = "crate::gate::mode_name")]
        mode: crate::gate::Name,
        /// The mode the verdict judges in: simulation (a promotion's), or enforcement (a
        /// confirmation's, FLOW-11). Records written before it was kept say simulation.
        #[serde(deserialize_with = "crate::gate::mode_name", default = "simulation")]
        expected: crate::gate::Name,
    },
    NoPolicy,
    Offline,
    Degraded,
    Suspended,
    Converging,
    BehindOnVersion {
        applied: Version,
        latest: Version,
    },
    NoWindowUnderLatest {
        latest: Version,
    },
    CoverageHole {
        from_ms: i64,
        to_ms: i64,
    },
    Gap {
        #[serde(deserialize_with = "crate::gate::gap_kind_name")]
        kind: crate::gate::Name,
        from_ms: i64,
        to_ms: i64,
        count: u64,
        detail: String,
    },
    WouldBlock {
        flows: usize,
        connections: u64,
        peers: Vec<BlockedPeer>,
    },
}

impl Reason {
    /// Whether the evidence says traffic would be blocked (UNSAFE), rather than that it cannot
    /// tell (INSUFFICIENT).
    fn is_unsafe(&self) -> bool {
        matches!(self, Reason::WouldBlock { .. })
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::RangeTooShort { range_ms, min_ms } => {
                write!(
                    f,
                    "the evidence range is {} s, less than the minimum {} s",
                    range_ms / 1000,
                    min_ms / 1000
                )
            }
            Reason::WrongMode { mode, expected } => write!(f, "in {mode} mode, not {expected}"),
            Reason::NoPolicy => write!(f, "no rendered policy"),
            Reason::Offline => write!(f, "offline"),
            Reason::Degraded => write!(f, "degraded: its last update failed"),
            Reason::Suspended => write!(f, "suspended: its kill switch is engaged"),
            Reason::Converging => write!(f, "still converging"),
            Reason::BehindOnVersion { applied, latest } => {
                write!(f, "behind on its version: v{applied} applied, v{latest} latest")
            }
            Reason::NoWindowUnderLatest { latest } => write!(f, "no window captured under v{latest} yet"),
            Reason::CoverageHole { from_ms, to_ms } => {
                write!(
                    f,
                    "no evidence from {} to {} ({} s)",
                    time(*from_ms),
                    time(*to_ms),
                    (to_ms - from_ms) / 1000
                )
            }
            Reason::Gap { kind, from_ms, to_ms, count, detail } => {
                write!(f, "{kind} gap from {} to {} (count {count})", time(*from_ms), time(*to_ms))?;
                if !detail.is_empty() {
                    write!(f, ": {detail}")?;
                }
                Ok(())
            }
            Reason::WouldBlock { flows, connections, peers } => {
                write!(f, "would block {flows} flow(s), {connections} connection(s)")?;
                let named: Vec<String> = peers
                    .iter()
                    .map(|p| {
                        let versions: Vec<String> = p.versions.iter().map(|v| format!("v{v}")).collect();
                        let found = match (p.found.contains(&Found::Native), p.found.contains(&Found::Replay))
                        {
                            (true, true) => "native and by replay",
                            (true, false) => "native",
                            _ => "by replay",
                        };
                        let services: Vec<&str> = p.services.iter().map(String::as_str).collect();
                        format!(
                            "{} {} to {} ({found}, captured under {})",
                            p.src,
                            p.labels,
                            services.join(","),
                            versions.join(",")
                        )
                    })
                    .collect();
                if !named.is_empty() {
                    write!(f, " from {}", named.join("; "))?;
                }
                Ok(())
            }
        }
    }
}

fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map_or_else(|| ms.to_string(), |t| t.format("%F %T%.3f").to_string())
}

/// How much evidence a workload has, and where it came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// Windows (and their milliseconds inside the range) captured under the latest version.
    pub native_windows: usize,
    pub native_ms: i64,
    /// Windows of older versions, whose flows were replayed through the latest.
    pub replayed_windows: usize,
    pub replayed_ms: i64,
    pub replayed_from: BTreeSet<Version>,
    /// How much of the range the windows cover.
    pub covered_ms: i64,
    pub range_ms: i64,
    /// Flows (keys) judged, and of them would-block.
    pub flows: usize,
    pub would_block_flows: usize,
}

/// One workload's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadVerdict {
    #[serde(serialize_with = "crate::gate::serialize_id", deserialize_with = "crate::gate::deserialize_id")]
    pub id: WorkloadId,
    pub hostname: String,
    #[serde(deserialize_with = "crate::gate::mode_name")]
    pub mode: crate::gate::Name,
    #[serde(deserialize_with = "crate::gate::state_name")]
    pub state: crate::gate::Name,
    pub applied_version: Version,
    /// The version judged: the latest rendered one.
    pub latest_version: Option<Version>,
    pub evidence: Evidence,
    pub reasons: Vec<Reason>,
}

impl WorkloadVerdict {
    pub fn outcome(&self) -> Outcome {
        if self.reasons.iter().any(Reason::is_unsafe) {
            Outcome::Unsafe
        } else if self.reasons.is_empty() {
            Outcome::Safe
        } else {
            Outcome::Insufficient
        }
    }
}

/// The verdict on a scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub outcome: Outcome,
    pub params: Params,
    pub workloads: Vec<WorkloadVerdict>,
}

impl Verdict {
    /// Every workload's reasons, one line each, for an error or a log.
    pub fn summary(&self) -> String {
        if self.workloads.is_empty() {
            return "the scope matches no workload".into();
        }
        let lines: Vec<String> = self
            .workloads
            .iter()
            .filter(|w| !w.reasons.is_empty())
            .map(|w| {
                let reasons: Vec<String> = w.reasons.iter().map(ToString::to_string).collect();
                format!("{} ({}): {}", w.hostname, w.id, reasons.join("; "))
            })
            .collect();
        lines.join(" | ")
    }
}

fn simulation() -> crate::gate::Name {
    Mode::Simulation.name()
}

/// Judges a scope's workloads over `params`' range. An empty scope is INSUFFICIENT.
pub fn judge(params: &Params, workloads: &[WorkloadFacts]) -> Verdict {
    judge_in(Mode::Simulation, params, workloads)
}

/// The verdict a confirmation of a promotion with a deadline stands on (FLOW-11): the same
/// judgement of workloads now in enforcement, over the range since the promotion, where a flow
/// the promoted version blocked (as recorded, or by replay of the windows before it applied)
/// counts as one it would block.
pub fn judge_enforced(params: &Params, workloads: &[WorkloadFacts]) -> Verdict {
    judge_in(Mode::Enforcement, params, workloads)
}

/// The verdict promoting a staged ruleset stands on (FLOW-10), over facts read by
/// `evidence::staged_facts` (only windows decided under each workload's staged set, a flow
/// counted as blocked when it is allowed now and its pending decision blocks it): each workload
/// judged in its own mode over the range from when it acknowledged its staged set (`acked`, unix
/// milliseconds; a workload missing from it has not: an empty range) to `params.to_ms`. SAFE
/// when no flow the staged rules would block is allowed now, no gap touches the range and the
/// windows cover it.
pub fn judge_staged(
    params: &Params,
    acked: &BTreeMap<WorkloadId, i64>,
    workloads: &[WorkloadFacts],
) -> Verdict {
    let judged = workloads
        .iter()
        .map(|w| {
            let from_ms = acked.get(&w.id).copied().unwrap_or(params.to_ms).min(params.to_ms);
            judge_one(w.mode, &Params { from_ms, ..*params }, w)
        })
        .collect();
    verdict_of(params, judged)
}

fn judge_in(expected: Mode, params: &Params, workloads: &[WorkloadFacts]) -> Verdict {
    verdict_of(params, workloads.iter().map(|w| judge_one(expected, params, w)).collect())
}

fn verdict_of(params: &Params, judged: Vec<WorkloadVerdict>) -> Verdict {
    let outcome = if judged.is_empty() {
        Outcome::Insufficient
    } else if judged.iter().any(|w| w.outcome() == Outcome::Unsafe) {
        Outcome::Unsafe
    } else if judged.iter().all(|w| w.outcome() == Outcome::Safe) {
        Outcome::Safe
    } else {
        Outcome::Insufficient
    };
    Verdict { outcome, params: *params, workloads: judged }
}

fn judge_one(expected: Mode, params: &Params, w: &WorkloadFacts) -> WorkloadVerdict {
    let (from, to) = (params.from_ms, params.to_ms.max(params.from_ms));
    let mut reasons = Vec::new();
    if to - from < params.min_duration_ms {
        reasons.push(Reason::RangeTooShort { range_ms: to - from, min_ms: params.min_duration_ms });
    }
    if w.mode != expected {
        reasons.push(Reason::WrongMode { mode: w.mode.name(), expected: expected.name() });
    }
    let latest_version = w.latest.as_ref().map(WorkloadPolicy::version);
    match (w.state, latest_version) {
        (_, None) => reasons.push(Reason::NoPolicy),
        (SyncState::Offline, _) => reasons.push(Reason::Offline),
        (SyncState::Degraded, _) => reasons.push(Reason::Degraded),
        (SyncState::Suspended, _) => reasons.push(Reason::Suspended),
        (_, Some(latest)) if w.applied_version != latest => {
            reasons.push(Reason::BehindOnVersion { applied: w.applied_version, latest })
        }
        (SyncState::Pending, _) => reasons.push(Reason::Converging),
        (SyncState::Synced, _) => {}
    }

    // Coverage: the windows' union inside the range. An agent's windows abut, so a hole between
    // them (beyond a second of rounding) is evidence lost; at the end of the range only the
    // window still open at the agent, and its upload, may be missing.
    let inside = |s: &WindowFacts| (s.start_ms.max(from), s.end_ms.min(to));
    let mut spans: Vec<(i64, i64)> = w.windows.iter().map(inside).filter(|(a, b)| a < b).collect();
    spans.sort_unstable();
    let longest = w.windows.iter().map(|s| s.end_ms - s.start_ms).max().unwrap_or(0);
    let mut evidence = Evidence { range_ms: to - from, ..Evidence::default() };
    let mut cursor = from;
    for (a, b) in spans {
        if a - cursor > JOIN_SLACK_MS {
            reasons.push(Reason::CoverageHole { from_ms: cursor, to_ms: a });
        }
        evidence.covered_ms += (b - a.max(cursor)).max(0);
        cursor = cursor.max(b);
    }
    if to - cursor > longest + UPLOAD_SLACK_MS || w.windows.is_empty() {
        reasons.push(Reason::CoverageHole { from_ms: cursor, to_ms: to });
    }
    for window in &w.windows {
        let (a, b) = inside(window);
        if Some(window.policy_version) == latest_version {
            evidence.native_windows += 1;
            evidence.native_ms += (b - a).max(0);
        } else {
            evidence.replayed_windows += 1;
            evidence.replayed_ms += (b - a).max(0);
            evidence.replayed_from.insert(window.policy_version);
        }
    }
    if let Some(latest) = latest_version
        && evidence.native_windows == 0
    {
        reasons.push(Reason::NoWindowUnderLatest { latest });
    }
    for gap in w.gaps.iter().filter(|g| g.from_ms < to && g.to_ms > from) {
        reasons.push(Reason::Gap {
            kind: gap.kind.name(),
            from_ms: gap.from_ms,
            to_ms: gap.to_ms,
            count: gap.count,
            detail: gap.detail.clone(),
        });
    }

    // Every flow judged by the latest version: natively as recorded, or by replay.
    let mut blocked: BTreeMap<IpAddr, BlockedPeer> = BTreeMap::new();
    evidence.flows = w.flows.len();
    for flow in &w.flows {
        let native = Some(flow.policy_version) == latest_version;
        let decision = if native {
            flow.decision
        } else {
            decide(w.latest.as_ref(), flow.src, flow.dst_port, flow.protocol).0
        };
        // Under a simulated latest version nothing is BLOCKED natively; under an enforced one
        // (a confirmation) a drop is what a would-block becomes.
        if !matches!(decision, Decision::WouldBlock | Decision::Blocked) {
            continue;
        }
        evidence.would_block_flows += 1;
        let peer = blocked.entry(flow.src).or_insert_with(|| BlockedPeer {
            src: flow.src,
            labels: flow.peer_labels.clone(),
            services: BTreeSet::new(),
            connections: 0,
            packets: 0,
            found: BTreeSet::new(),
            versions: BTreeSet::new(),
        });
        let service = match flow.protocol {
            p if p.has_ports() => format!("{}/{}", p.name(), flow.dst_port),
            p => p.name().to_owned(),
        };
        peer.services.insert(service);
        peer.connections += flow.connections;
        peer.packets += flow.packets;
        peer.found.insert(if native { Found::Native } else { Found::Replay });
        peer.versions.insert(flow.policy_version);
    }
    if !blocked.is_empty() {
        let connections = blocked.values().map(|p| p.connections).sum();
        let mut peers: Vec<BlockedPeer> = blocked.into_values().collect();
        peers.sort_by(|a, b| b.connections.cmp(&a.connections).then(b.packets.cmp(&a.packets)));
        peers.truncate(params.top_peers);
        reasons.push(Reason::WouldBlock { flows: evidence.would_block_flows, connections, peers });
    }
    WorkloadVerdict {
        id: w.id,
        hostname: w.hostname.clone(),
        mode: w.mode.name(),
        state: w.state.name(),
        applied_version: w.applied_version,
        latest_version,
        evidence,
        reasons,
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::flows::GapKind;
    use innerwall_wire::testing::rule;

    use super::*;

    const MIN: i64 = 60_000;

    fn policy(version: Version, peers: &[&str]) -> WorkloadPolicy {
        WorkloadPolicy::new(version, Mode::Simulation, [rule("db", Protocol::Tcp, &[5432], peers)]).unwrap()
    }

    fn params() -> Params {
        Params { from_ms: 0, to_ms: 10 * MIN, min_duration_ms: 10 * MIN, top_peers: 5 }
    }

    fn flow(version: Version, src: &str, decision: Decision) -> FlowFacts {
        FlowFacts {
            policy_version: version,
            src: src.parse().unwrap(),
            dst_port: 5432,
            protocol: Protocol::Tcp,
            decision,
            connections: 3,
            packets: 9,
            peer_labels: serde_json::json!({"app": "batch"}),
        }
    }

    /// A workload in simulation, SYNCED at v2, with windows of a minute under `versions`
    /// covering the range.
    fn workload(versions: &[Version], flows: Vec<FlowFacts>) -> WorkloadFacts {
        let windows = versions
            .iter()
            .enumerate()
            .map(|(i, v)| WindowFacts {
                start_ms: i as i64 * MIN,
                end_ms: (i as i64 + 1) * MIN,
                policy_version: *v,
            })
            .collect();
        WorkloadFacts {
            id: WorkloadId::new_random(),
            hostname: "db-1".into(),
            mode: Mode::Simulation,
            state: SyncState::Synced,
            applied_version: 2,
            latest: Some(policy(2, &["10.0.0.0/24"])),
            windows,
            gaps: Vec::new(),
            flows,
        }
    }

    #[test]
    fn safe_with_native_and_replayed_evidence() {
        let w = workload(&[1, 1, 1, 1, 1, 2, 2, 2, 2, 2], vec![flow(1, "10.0.0.7", Decision::Allowed)]);
        let verdict = judge(&params(), &[w]);
        assert_eq!(verdict.outcome, Outcome::Safe, "{}", verdict.summary());
        let e = &verdict.workloads[0].evidence;
        assert_eq!((e.native_windows, e.replayed_windows, e.covered_ms), (5, 5, 10 * MIN));
        assert_eq!(e.replayed_from, BTreeSet::from([1]));
    }

    #[test]
    fn replay_finds_what_the_latest_version_would_block() {
        // Allowed under v1 (which allowed 10.9/16); v2 no longer does.
        let w = workload(&[1, 1, 1, 1, 1, 2, 2, 2, 2, 2], vec![flow(1, "10.9.0.7", Decision::Allowed)]);
        let verdict = judge(&params(), &[w]);
        assert_eq!(verdict.outcome, Outcome::Unsafe);
        let Reason::WouldBlock { flows, connections, peers } = &verdict.workloads[0].reasons[0] else {
            panic!("{:?}", verdict.workloads[0].reasons)
        };
        assert_eq!((*flows, *connections), (1, 3));
        assert_eq!(peers[0].found, BTreeSet::from([Found::Replay]));
        assert_eq!(peers[0].labels, serde_json::json!({"app": "batch"}));
        assert!(
            verdict
                .summary()
                .contains("10.9.0.7 {\"app\":\"batch\"} to tcp/5432 (by replay, captured under v1)"),
            "{}",
            verdict.summary()
        );
    }

    /// FLOW-10: a staged set is judged in the workload's own mode, over the range since it was
    /// acknowledged: a flow allowed now that its pending rules block (BLOCKED in the facts) is
    /// UNSAFE, an unacknowledged set has no range, and windows before the acknowledgement do not
    /// count.
    #[test]
    fn a_staged_set_is_judged_since_it_was_acknowledged() {
        let mut enforced =
            workload(&[2, 2, 2, 2, 2, 2, 2, 2, 2, 2], vec![flow(2, "10.0.0.7", Decision::Allowed)]);
        enforced.mode = Mode::Enforcement;
        let p = Params { min_duration_ms: 5 * MIN, ..params() };
        let acked = BTreeMap::from([(enforced.id, 4 * MIN)]);
        let verdict = judge_staged(&p, &acked, std::slice::from_ref(&enforced));
        assert_eq!(verdict.outcome, Outcome::Safe, "{}", verdict.summary());
        assert_eq!(verdict.workloads[0].evidence.range_ms, 6 * MIN);
        let mut blocked = enforced.clone();
        blocked.flows.push(flow(2, "10.0.0.9", Decision::Blocked));
        let verdict = judge_staged(&p, &acked, &[blocked]);
        assert_eq!(verdict.outcome, Outcome::Unsafe, "{}", verdict.summary());
        // Not acknowledged: an empty range, too short.
        let verdict = judge_staged(&p, &BTreeMap::new(), std::slice::from_ref(&enforced));
        assert_eq!(verdict.outcome, Outcome::Insufficient);
        assert!(matches!(verdict.workloads[0].reasons[0], Reason::RangeTooShort { range_ms: 0, .. }));
        // Acknowledged too recently for the minimum.
        let verdict = judge_staged(&p, &BTreeMap::from([(enforced.id, 8 * MIN)]), &[enforced]);
        assert_eq!(verdict.outcome, Outcome::Insufficient, "{}", verdict.summary());
    }

    #[test]
    fn every_missing_piece_is_a_reason() {
        let base = || workload(&[2; 10], vec![]);
        let cases: Vec<(WorkloadFacts, &str)> = vec![
            (WorkloadFacts { state: SyncState::Offline, ..base() }, "offline"),
            (WorkloadFacts { state: SyncState::Degraded, ..base() }, "degraded"),
            (WorkloadFacts { state: SyncState::Suspended, ..base() }, "suspended"),
            (WorkloadFacts { state: SyncState::Pending, ..base() }, "still converging"),
            (WorkloadFacts { applied_version: 1, ..base() }, "behind on its version: v1 applied, v2 latest"),
            (WorkloadFacts { mode: Mode::Enforcement, ..base() }, "in enforcement mode"),
            (workload(&[1; 10], vec![]), "no window captured under v2 yet"),
            (
                WorkloadFacts {
                    windows: base().windows.into_iter().filter(|w| w.start_ms != 4 * MIN).collect(),
                    ..base()
                },
                "(60 s)",
            ),
            (
                WorkloadFacts {
                    gaps: vec![EvidenceGap::new(GapKind::AgentRestart, 3 * MIN, 3 * MIN + 5, 0)],
                    ..base()
                },
                "agent-restart gap",
            ),
            (
                WorkloadFacts {
                    gaps: vec![EvidenceGap::new(GapKind::SuspectDirection, 3 * MIN, 3 * MIN + 5, 2)],
                    ..base()
                },
                "suspect-direction gap from",
            ),
            (WorkloadFacts { windows: vec![], ..base() }, "no evidence from"),
        ];
        for (w, expected) in cases {
            let verdict = judge(&params(), &[w]);
            assert_eq!(verdict.outcome, Outcome::Insufficient, "{expected}");
            assert!(verdict.summary().contains(expected), "{expected}: {}", verdict.summary());
        }
        // The open window at the end (a window and its upload) is not a hole; more is.
        let mut w = base();
        w.windows.pop();
        assert_eq!(judge(&params(), &[w.clone()]).outcome, Outcome::Safe);
        let late = Params { to_ms: params().to_ms + UPLOAD_SLACK_MS, ..params() };
        assert_eq!(judge(&late, &[w.clone()]).outcome, Outcome::Safe);
        let later = Params { to_ms: params().to_ms + UPLOAD_SLACK_MS + 1, ..params() };
        assert!(judge(&later, &[w.clone()]).summary().contains("no evidence from"));
        w.windows.pop();
        assert_eq!(judge(&params(), &[w]).outcome, Outcome::Insufficient);
        let short = Params { min_duration_ms: 20 * MIN, ..params() };
        assert!(judge(&short, &[base()]).summary().contains("less than the minimum 1200 s"));
        assert_eq!(judge(&params(), &[]).outcome, Outcome::Insufficient);
    }

    /// The remote CLI prints what it reads back from the API: every kind of reason, the names
    /// from closed sets and the ids survive the trip, and an unknown name is refused.
    #[test]
    fn a_verdict_reads_back_as_written() {
        let base = || workload(&[1, 1, 1, 1, 1, 2, 2, 2, 2], vec![flow(1, "10.9.0.7", Decision::Allowed)]);
        let gap = EvidenceGap::new(GapKind::MapFull, 3 * MIN, 3 * MIN + 5, 7);
        let facts = [
            base(),
            WorkloadFacts { mode: Mode::Visibility, state: SyncState::Degraded, gaps: vec![gap], ..base() },
            WorkloadFacts { latest: None, windows: vec![], ..base() },
        ];
        let verdict = judge(&Params { min_duration_ms: 20 * MIN, ..params() }, &facts);
        let json = serde_json::to_string(&verdict).unwrap();
        let back: Verdict = serde_json::from_str(&json).unwrap();
        assert_eq!(back, verdict);
        assert_eq!(back.summary(), verdict.summary());
        for (from, to) in [("\"visibility\"", "\"sideways\""), ("\"DEGRADED\"", "\"degraded\"")] {
            assert!(json.contains(from), "{json}");
            let err = serde_json::from_str::<Verdict>(&json.replacen(from, to, 1)).unwrap_err();
            assert!(err.to_string().contains("unknown name"), "{err}");
        }
    }

    #[test]
    fn evidence_ranges_are_bounded() {
        let day = std::time::Duration::from_secs(86_400);
        let p = Params::ending_at(100 * MIN, std::time::Duration::from_millis(2 * MIN as u64), day).unwrap();
        assert_eq!((p.from_ms, p.to_ms, p.min_duration_ms), (98 * MIN, 100 * MIN, 86_400_000));
        assert!(Params::ending_at(0, 90 * day, 90 * day).is_ok());
        let err = Params::ending_at(0, 100 * day, day).unwrap_err().to_string();
        assert_eq!(err, "an evidence range of 100 days is longer than the 90 days a verdict may look back");
        let err =
            Params::ending_at(0, day, 90 * day + std::time::Duration::from_secs(1)).unwrap_err().to_string();
        assert!(err.starts_with("a minimum evidence range of 90 days 1s is longer"), "{err}");
    }
}
