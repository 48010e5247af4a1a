//! The replay of one workload's recorded flows through two policies (POL-8), pure: each flow key
//! (source, peer, protocol, port, summed over the range) is judged by the one `decide` the agent
//! uses, as enforcement would judge it ("some rule admits it"), at both policies; the keys are
//! counted per transition and the heaviest kept. Also pure: the evidence coverage of a range
//! from a workload's windows and gaps, and the (rule, CIDR) admissions the new policy adds that
//! no recorded flow exercised. A flow names its peer's labels by digest while it is folded;
//! only the rows kept are given the label sets themselves (`Replayer::finish`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use innerwall_wire::flows::{Decision, EvidenceGap, decide};
use innerwall_wire::policy::{Cidr, Mode, Protocol, RuleId, WorkloadPolicy};
use serde::{Deserialize, Serialize};

/// Hours of a coverage are this long.
pub const HOUR_MS: i64 = 3_600_000;

/// The most two windows may be apart and still count as abutting (as the verdict has it).
pub const JOIN_SLACK_MS: i64 = crate::gate::verdict::JOIN_SLACK_MS;

/// A label set as flow evidence keys it: the md5 of its canonical jsonb text, as a uuid (the
/// rollups' `peer_digest`). Equal label sets have equal digests: jsonb text is canonical.
pub type LabelDigest = uuid::Uuid;

/// One flow key towards the workload, summed over the range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowSum {
    pub src: IpAddr,
    /// 0 bare address, 1 workload, 2 address group (as ingest resolved it).
    pub peer_kind: i16,
    pub peer_key: String,
    /// The peer's labels when the flow was ingested.
    pub labels_then: LabelDigest,
    /// The peer's labels now, if it is a live workload (`None` otherwise).
    pub labels_now: Option<LabelDigest>,
    pub dst_port: u16,
    pub protocol: Protocol,
    pub connections: u64,
    pub records: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
}

impl FlowSum {
    /// The peer is a workload whose labels now differ from those stored with the flow (or a
    /// workload that is no longer live).
    pub fn relabelled(&self) -> bool {
        self.peer_kind == 1 && self.labels_now != Some(self.labels_then)
    }
}

/// Which way a flow's admission changes between the two policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Transition {
    NewlyBlocked,
    NewlyAllowed,
    Unchanged,
}

/// The rule of `policy` that admits the flow, judged as enforcement would (whatever the
/// policy's mode): `Ok(rule)` admitted by it, `Err(())` dropped. No policy at all admits
/// everything (nothing installed drops a packet).
pub fn admission(policy: Option<&WorkloadPolicy>, src: IpAddr, port: u16, protocol: Protocol) -> Admission {
    let enforced = policy.map(|p| p.clone().with_mode(Mode::Enforcement));
    enforced_admission(enforced.as_ref(), src, port, protocol)
}

/// [`admission`] by a policy already in enforcement mode (a replay converts each once).
fn enforced_admission(
    enforced: Option<&WorkloadPolicy>,
    src: IpAddr,
    port: u16,
    protocol: Protocol,
) -> Admission {
    let Some(enforced) = enforced else { return Admission::NoPolicy };
    match decide(Some(enforced), src, port, protocol) {
        (Decision::Allowed, Some(rule)) => Admission::Rule(rule),
        _ => Admission::Dropped,
    }
}

/// How one policy judges one flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// No policy is applied: nothing drops it.
    NoPolicy,
    /// This rule admits it.
    Rule(RuleId),
    /// No rule admits it.
    Dropped,
}

impl Admission {
    pub fn admitted(&self) -> bool {
        !matches!(self, Admission::Dropped)
    }

    pub fn rule(&self) -> Option<String> {
        match self {
            Admission::Rule(r) => Some(r.to_string()),
            _ => None,
        }
    }
}

/// One flow key of a transition, as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplayRow {
    pub src_address: String,
    pub peer_kind: i16,
    pub peer_key: String,
    #[schema(value_type = Object)]
    pub labels_then: serde_json::Value,
    #[schema(value_type = Option<Object>)]
    pub labels_now: Option<serde_json::Value>,
    pub relabelled: bool,
    pub dst_port: u16,
    pub protocol: String,
    pub connections: u64,
    pub records: u64,
    pub first_seen: chrono::DateTime<chrono::Utc>,
    pub last_seen: chrono::DateTime<chrono::Utc>,
    /// The rule admitting it at the `from` version (`None`: no rule; see `from_applied`).
    pub from_rule: Option<String>,
    pub to_rule: Option<String>,
}

/// Per-workload replay totals with the heaviest rows of each changing transition.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Replayed {
    /// Flow keys (source, peer, protocol, port) per transition.
    pub newly_blocked: u64,
    pub newly_allowed: u64,
    pub unchanged: u64,
    /// The connections of the newly blocked keys.
    pub blocked_connections: u64,
    /// The heaviest `top` keys of each transition, by connections then key.
    pub top_blocked: Vec<ReplayRow>,
    pub top_allowed: Vec<ReplayRow>,
    /// Keys whose peer was relabelled since ingest, and the heaviest `top` of them.
    pub relabelled: u64,
    pub top_relabelled: Vec<ReplayRow>,
}

/// Folds flow keys one at a time (they may stream from the database), keeping only the top
/// rows: memory is bounded by `top`, not by the flows.
#[derive(Debug)]
pub struct Replayer {
    /// Both policies in enforcement mode: admission is judged as enforcement would.
    from: Option<WorkloadPolicy>,
    to: WorkloadPolicy,
    top: usize,
    counts: Replayed,
    /// The rows kept of each kind, with their label digests (then, now) until `finish`.
    top_blocked: Vec<Kept>,
    top_allowed: Vec<Kept>,
    top_relabelled: Vec<Kept>,
    /// The new admissions no flow has exercised yet.
    unseen: Vec<NewAdmission>,
}

/// A row kept, its labels still digests.
#[derive(Debug)]
struct Kept {
    row: ReplayRow,
    then: LabelDigest,
    now: Option<LabelDigest>,
}

impl Replayer {
    pub fn new(from: Option<&WorkloadPolicy>, to: &WorkloadPolicy, top: usize) -> Self {
        let enforced = |p: &WorkloadPolicy| p.clone().with_mode(Mode::Enforcement);
        Replayer {
            from: from.map(enforced),
            to: enforced(to),
            top,
            counts: Replayed::default(),
            top_blocked: Vec::new(),
            top_allowed: Vec::new(),
            top_relabelled: Vec::new(),
            unseen: new_admissions(from, to),
        }
    }

    pub fn add(&mut self, flow: &FlowSum) -> Transition {
        let before = enforced_admission(self.from.as_ref(), flow.src, flow.dst_port, flow.protocol);
        let after = enforced_admission(Some(&self.to), flow.src, flow.dst_port, flow.protocol);
        let transition = match (before.admitted(), after.admitted()) {
            (true, false) => Transition::NewlyBlocked,
            (false, true) => Transition::NewlyAllowed,
            _ => Transition::Unchanged,
        };
        if !self.unseen.is_empty() {
            self.unseen.retain(|a| !a.exercised_by(flow));
        }
        let row = || Kept {
            row: ReplayRow {
                src_address: flow.src.to_string(),
                peer_kind: flow.peer_kind,
                peer_key: flow.peer_key.clone(),
                labels_then: serde_json::Value::Null,
                labels_now: None,
                relabelled: flow.relabelled(),
                dst_port: flow.dst_port,
                protocol: flow.protocol.to_string(),
                connections: flow.connections,
                records: flow.records,
                first_seen: time(flow.first_seen_ms),
                last_seen: time(flow.last_seen_ms),
                from_rule: before.rule(),
                to_rule: after.rule(),
            },
            then: flow.labels_then,
            now: flow.labels_now,
        };
        let top = self.top;
        match transition {
            Transition::NewlyBlocked => {
                self.counts.newly_blocked += 1;
                self.counts.blocked_connections =
                    self.counts.blocked_connections.saturating_add(flow.connections);
                keep(&mut self.top_blocked, flow, row, top);
            }
            Transition::NewlyAllowed => {
                self.counts.newly_allowed += 1;
                keep(&mut self.top_allowed, flow, row, top);
            }
            Transition::Unchanged => self.counts.unchanged += 1,
        }
        if flow.relabelled() {
            self.counts.relabelled += 1;
            keep(&mut self.top_relabelled, flow, row, top);
        }
        transition
    }

    /// Counts `keys` more flow keys as unchanged: keys whose admission is the same at both
    /// policies, whose peer was not relabelled and which exercise no new admission (what
    /// [`Replayer::add`] would do with each of them, without judging them one by one).
    pub fn add_unchanged(&mut self, keys: u64) {
        self.counts.unchanged += keys;
    }

    /// The label sets the rows kept so far name (then and now), each with the peer of its row
    /// (kind, key); a set may come more than once.
    pub fn label_sets(&self) -> impl Iterator<Item = (LabelDigest, i16, &str)> + '_ {
        let kept = self.top_blocked.iter().chain(&self.top_allowed).chain(&self.top_relabelled);
        kept.flat_map(|k| {
            std::iter::once(k.then).chain(k.now).map(|d| (d, k.row.peer_kind, k.row.peer_key.as_str()))
        })
    }

    /// The totals with the rows kept given their label sets from `labels` (which holds every
    /// one of [`Replayer::label_sets`]; one missing reads JSON null), and the new admissions no
    /// flow of the range exercised (at most `top`, and how many there were).
    pub fn finish(
        self,
        labels: &BTreeMap<LabelDigest, serde_json::Value>,
    ) -> (Replayed, Vec<NewAdmission>, u64) {
        let label = |d: &LabelDigest| labels.get(d).cloned().unwrap_or(serde_json::Value::Null);
        let rows = |kept: Vec<Kept>| -> Vec<ReplayRow> {
            kept.into_iter()
                .map(|k| ReplayRow {
                    labels_then: label(&k.then),
                    labels_now: k.now.as_ref().map(label),
                    ..k.row
                })
                .collect()
        };
        let out = Replayed {
            top_blocked: rows(self.top_blocked),
            top_allowed: rows(self.top_allowed),
            top_relabelled: rows(self.top_relabelled),
            ..self.counts
        };
        let unseen = self.unseen.len() as u64;
        (out, self.unseen.into_iter().take(self.top).collect(), unseen)
    }
}

/// Keeps the heaviest `top` rows, heaviest first (ties by source, port, protocol, then peer, so
/// the rows kept do not depend on the order the flows come in). The row is built only when kept.
fn keep(rows: &mut Vec<Kept>, flow: &FlowSum, row: impl FnOnce() -> Kept, top: usize) {
    // A full list whose lightest row is heavier keeps it out without building it.
    if rows.len() >= top && rows.last().is_some_and(|last| last.row.connections > flow.connections) {
        return;
    }
    let kept = row();
    let at = rows.partition_point(|r| order(&r.row) <= order(&kept.row));
    if at < top {
        rows.insert(at, kept);
        rows.truncate(top);
    }
}

fn order(r: &ReplayRow) -> (std::cmp::Reverse<u64>, &str, u16, &str, i16, &str) {
    (
        std::cmp::Reverse(r.connections),
        r.src_address.as_str(),
        r.dst_port,
        r.protocol.as_str(),
        r.peer_kind,
        r.peer_key.as_str(),
    )
}

fn time(ms: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms).unwrap_or(chrono::DateTime::UNIX_EPOCH)
}

/// A peer CIDR of a rule of the new policy that the old one did not admit on the same protocol
/// and ports: sources there become able to reach the workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NewAdmission {
    pub rule: String,
    pub cidr: String,
    pub protocol: String,
    /// `start-end` ranges; empty for ICMP.
    pub ports: Vec<String>,
    #[serde(skip)]
    #[schema(ignore)]
    net: Option<Cidr>,
    #[serde(skip)]
    #[schema(ignore)]
    proto: Option<Protocol>,
    #[serde(skip)]
    #[schema(ignore)]
    port_ranges: Vec<(u16, u16)>,
}

impl NewAdmission {
    fn exercised_by(&self, flow: &FlowSum) -> bool {
        self.proto == Some(flow.protocol)
            && self.net.as_ref().is_some_and(|n| n.contains(&flow.src))
            && (self.port_ranges.is_empty()
                || self.port_ranges.iter().any(|(a, b)| (*a..=*b).contains(&flow.dst_port)))
    }
}

/// The (rule, CIDR) pairs of `to` not covered by the admissions of `from`: no rule of `from`
/// on the protocol has a peer CIDR containing it and ports covering the rule's. With no `from`
/// policy everything was admitted already, so nothing is new.
pub fn new_admissions(from: Option<&WorkloadPolicy>, to: &WorkloadPolicy) -> Vec<NewAdmission> {
    let Some(from) = from else { return Vec::new() };
    let mut out = Vec::new();
    for rule in to.rules() {
        let ranges: Vec<(u16, u16)> = rule.ports().iter().map(|p| (p.start(), p.end())).collect();
        for cidr in rule.peers() {
            let covered = from.rules().any(|old| {
                old.protocol() == rule.protocol()
                    && old.peers().iter().any(|c| ipnet::IpNet::contains(&c.net(), &cidr.net()))
                    && ranges
                        .iter()
                        .all(|(a, b)| old.ports().iter().any(|p| p.start() <= *a && *b <= p.end()))
            });
            if !covered {
                out.push(NewAdmission {
                    rule: rule.id().to_string(),
                    cidr: cidr.text(),
                    protocol: rule.protocol().to_string(),
                    ports: ranges
                        .iter()
                        .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
                        .collect(),
                    net: Some(*cidr),
                    proto: Some(rule.protocol()),
                    port_ranges: ranges.clone(),
                });
            }
        }
    }
    out
}

/// How much of a range the workload's evidence covers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Coverage {
    /// Hours of the range: consecutive hour slots from its start, the last one possibly shorter.
    pub hours: u64,
    /// Slots entirely covered by the workload's windows (abutting within [`JOIN_SLACK_MS`]) and
    /// touched by no evidence gap.
    pub gap_free_hours: u64,
    /// `gap_free_hours / hours` (1 for an empty range).
    pub ratio: f64,
    /// The gaps overlapping the range (at most the bound given), and how many there were.
    pub gaps: Vec<GapRow>,
    pub gap_count: u64,
}

/// One evidence gap as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GapRow {
    pub kind: String,
    pub from: chrono::DateTime<chrono::Utc>,
    pub to: chrono::DateTime<chrono::Utc>,
    pub count: u64,
    pub detail: String,
}

/// The coverage of `[from_ms, to_ms)` by `windows` (`(start_ms, end_ms)`) and `gaps`, naming at
/// most `top` gaps. Defined so: the range is cut into hour slots from `from_ms`; a slot is
/// gap-free when the union of the windows (joined across holes up to [`JOIN_SLACK_MS`]) covers
/// it whole and no gap's interval `[from, to]` overlaps it.
pub fn coverage(
    from_ms: i64,
    to_ms: i64,
    windows: &[(i64, i64)],
    gaps: &[EvidenceGap],
    top: usize,
) -> Coverage {
    let mut spans: Vec<(i64, i64)> = windows.iter().copied().filter(|(s, e)| s < e).collect();
    spans.sort_unstable();
    let mut joined: Vec<(i64, i64)> = Vec::new();
    for (s, e) in spans {
        match joined.last_mut() {
            Some(last) if s <= last.1 + JOIN_SLACK_MS => last.1 = last.1.max(e),
            _ => joined.push((s, e)),
        }
    }
    let overlapping: Vec<&EvidenceGap> =
        gaps.iter().filter(|g| g.to_ms >= from_ms && g.from_ms < to_ms).collect();
    let (mut hours, mut free) = (0u64, 0u64);
    let mut slot = from_ms;
    while slot < to_ms {
        let end = (slot + HOUR_MS).min(to_ms);
        hours += 1;
        let covered = joined.iter().any(|(s, e)| *s <= slot && end <= *e);
        let touched = overlapping.iter().any(|g| g.from_ms < end && g.to_ms >= slot);
        if covered && !touched {
            free += 1;
        }
        slot = end;
    }
    let mut shown: Vec<&EvidenceGap> = overlapping.clone();
    shown.sort_by_key(|g| (g.from_ms, g.to_ms, g.kind));
    Coverage {
        hours,
        gap_free_hours: free,
        ratio: if hours == 0 { 1.0 } else { free as f64 / hours as f64 },
        gap_count: overlapping.len() as u64,
        gaps: shown
            .into_iter()
            .take(top)
            .map(|g| GapRow {
                kind: g.kind.to_string(),
                from: time(g.from_ms),
                to: time(g.to_ms),
                count: g.count,
                detail: g.detail.clone(),
            })
            .collect(),
    }
}

/// The two policies have the same content (their versions aside).
pub fn same_content(a: &WorkloadPolicy, b: &WorkloadPolicy) -> bool {
    a.clone().with_version(0) == b.clone().with_version(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use innerwall_wire::flows::GapKind;
    use innerwall_wire::testing::rule;

    fn flow(src: &str, port: u16, connections: u64) -> FlowSum {
        FlowSum {
            src: src.parse().unwrap(),
            peer_kind: 0,
            peer_key: src.into(),
            labels_then: digest(0),
            labels_now: None,
            dst_port: port,
            protocol: Protocol::Tcp,
            connections,
            records: 1,
            first_seen_ms: 1_000,
            last_seen_ms: 2_000,
        }
    }

    fn digest(n: u128) -> LabelDigest {
        uuid::Uuid::from_u128(n)
    }

    fn policy(mode: Mode, rules: Vec<innerwall_wire::policy::ResolvedRule>) -> WorkloadPolicy {
        WorkloadPolicy::new(3, mode, rules).unwrap()
    }

    #[test]
    fn flows_are_judged_as_enforcement_would_at_both_versions() {
        let web = rule("from-web", Protocol::Tcp, &[5432], &["10.0.1.0/24"]);
        let api = rule("from-api", Protocol::Tcp, &[5432], &["10.0.2.0/24"]);
        // The old policy is in simulation: its would-block flows still count as not admitted.
        let from = policy(Mode::Simulation, vec![web.clone()]);
        let to = policy(Mode::Enforcement, vec![api]);
        let mut r = Replayer::new(Some(&from), &to, 1);
        assert_eq!(r.add(&flow("10.0.1.5", 5432, 3)), Transition::NewlyBlocked);
        assert_eq!(r.add(&flow("10.0.1.6", 5432, 9)), Transition::NewlyBlocked);
        assert_eq!(r.add(&flow("10.0.2.5", 5432, 1)), Transition::NewlyAllowed);
        assert_eq!(r.add(&flow("10.0.9.5", 5432, 1)), Transition::Unchanged);
        assert_eq!(r.add(&flow("10.0.2.5", 22, 1)), Transition::Unchanged);
        let (out, unseen, n) = r.finish(&BTreeMap::new());
        assert_eq!((out.newly_blocked, out.newly_allowed, out.unchanged), (2, 1, 2));
        assert_eq!(out.blocked_connections, 12);
        assert_eq!(out.top_blocked.len(), 1, "top bounds the rows");
        let heaviest = &out.top_blocked[0];
        assert_eq!(heaviest.src_address, "10.0.1.6");
        assert_eq!(heaviest.from_rule.as_deref(), Some("from-web/tcp"));
        assert_eq!(heaviest.to_rule, None);
        assert_eq!(out.top_allowed[0].to_rule.as_deref(), Some("from-api/tcp"));
        assert_eq!((unseen.len(), n), (0, 0), "10.0.2.0/24 was exercised, so none is unseen");
    }

    #[test]
    fn nothing_applied_admits_everything_and_adds_no_admission() {
        let to = policy(Mode::Enforcement, vec![rule("a", Protocol::Tcp, &[80], &["10.0.0.0/8"])]);
        let mut r = Replayer::new(None, &to, 5);
        assert_eq!(r.add(&flow("192.0.2.1", 80, 1)), Transition::NewlyBlocked);
        assert_eq!(r.add(&flow("10.1.1.1", 80, 1)), Transition::Unchanged);
        let (_, unseen, n) = r.finish(&BTreeMap::new());
        assert!(unseen.is_empty() && n == 0);
    }

    #[test]
    fn new_admissions_are_pairs_not_covered_and_not_exercised() {
        let from = policy(Mode::Enforcement, vec![rule("a", Protocol::Tcp, &[80, 81], &["10.0.0.0/8"])]);
        let to = policy(
            Mode::Enforcement,
            vec![
                rule("a", Protocol::Tcp, &[80], &["10.1.0.0/16", "192.0.2.0/24"]),
                rule("b", Protocol::Udp, &[53], &["10.0.0.0/8"]),
            ],
        );
        let names: Vec<String> = new_admissions(Some(&from), &to)
            .iter()
            .map(|a| format!("{} {} {:?}", a.rule, a.cidr, a.ports))
            .collect();
        assert_eq!(names, ["a/tcp 192.0.2.0/24 [\"80\"]", "b/udp 10.0.0.0/8 [\"53\"]"]);
        let mut r = Replayer::new(Some(&from), &to, 5);
        r.add(&flow("192.0.2.9", 80, 1));
        let (_, unseen, n) = r.finish(&BTreeMap::new());
        assert_eq!((unseen[0].rule.as_str(), n), ("b/udp", 1));
    }

    #[test]
    fn relabelled_peers_are_workloads_whose_labels_changed() {
        let mut f = flow("10.0.0.1", 80, 1);
        f.peer_kind = 1;
        f.labels_then = digest(1);
        f.labels_now = Some(digest(1));
        assert!(!f.relabelled());
        f.labels_now = Some(digest(2));
        assert!(f.relabelled());
        f.labels_now = None;
        assert!(f.relabelled(), "a peer no longer live is not what it was");
        f.peer_kind = 0;
        assert!(!f.relabelled(), "bare addresses have no labels to change");
    }

    #[test]
    fn kept_rows_get_their_label_sets_and_do_not_depend_on_the_order_flows_come_in() {
        let from = policy(Mode::Enforcement, vec![rule("a", Protocol::Tcp, &[80], &["10.0.0.0/8"])]);
        let to = policy(Mode::Enforcement, vec![]);
        let peer = |src: &str, key: &str, connections, then, now| {
            let mut f = flow(src, 80, connections);
            (f.peer_kind, f.peer_key, f.labels_then, f.labels_now) =
                (1, key.into(), digest(then), Some(digest(now)));
            f
        };
        // Two keys tie on connections, source, port and protocol; only the peer tells them apart.
        let flows = [
            peer("10.0.0.1", "w-b", 5, 1, 1),
            peer("10.0.0.1", "w-a", 5, 1, 2),
            peer("10.0.0.2", "w-c", 9, 2, 2),
            peer("10.0.0.3", "w-d", 1, 1, 1),
        ];
        let labels = BTreeMap::from([
            (digest(1), serde_json::json!({"app": "web"})),
            (digest(2), serde_json::json!({"app": "api"})),
        ]);
        let replay = |flows: &[FlowSum]| {
            let mut r = Replayer::new(Some(&from), &to, 2);
            for f in flows {
                assert_eq!(r.add(f), Transition::NewlyBlocked);
            }
            let wanted: std::collections::BTreeSet<LabelDigest> = r.label_sets().map(|(d, _, _)| d).collect();
            assert_eq!(wanted, [digest(1), digest(2)].into(), "the kept rows name both label sets");
            r.finish(&labels).0
        };
        let out = replay(&flows);
        let mut reversed = flows.clone();
        reversed.reverse();
        assert_eq!(replay(&reversed), out, "the order flows come in changes nothing");
        let shown: Vec<(&str, &serde_json::Value, Option<&serde_json::Value>)> = out
            .top_blocked
            .iter()
            .map(|r| (r.peer_key.as_str(), &r.labels_then, r.labels_now.as_ref()))
            .collect();
        let (web, api) = (&labels[&digest(1)], &labels[&digest(2)]);
        assert_eq!(shown, [("w-c", api, Some(api)), ("w-a", web, Some(api))]);
        assert_eq!(out.newly_blocked, 4);
        assert_eq!((out.relabelled, out.top_relabelled[0].peer_key.as_str()), (1, "w-a"));
        assert!(out.top_relabelled[0].relabelled);
    }

    #[test]
    fn coverage_counts_hours_whole_under_windows_and_untouched_by_gaps() {
        let h = HOUR_MS;
        // Four hours; windows cover hours 0, 1 and 3 (with a 500 ms seam in hour 0); a gap in hour 1.
        let windows = [(0, h / 2), (h / 2 + 500, 2 * h), (3 * h, 4 * h)];
        let gap = EvidenceGap::new(GapKind::MapFull, h + 10, h + 20, 4);
        let c = coverage(0, 4 * h, &windows, std::slice::from_ref(&gap), 10);
        assert_eq!((c.hours, c.gap_free_hours, c.gap_count), (4, 2, 1));
        assert_eq!(c.ratio, 0.5);
        assert_eq!(c.gaps[0].kind, "map-full");
        // A partial last hour is a slot; a gap outside the range is not reported.
        let c = coverage(0, h + 1, &[(0, h + 1)], &[EvidenceGap::new(GapKind::MapFull, 5 * h, 6 * h, 1)], 10);
        assert_eq!((c.hours, c.gap_free_hours, c.gap_count), (2, 2, 0));
        assert_eq!(coverage(0, 0, &[], &[], 1).ratio, 1.0);
        assert_eq!(coverage(0, 2 * h, &[], &[gap.clone(), gap], 1).gaps.len(), 1, "gaps shown are bounded");
    }
}
