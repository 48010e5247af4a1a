//! Flow windows (FLOW-2, FLOW-3), pure: the window that aggregates drained flow counters under
//! one policy version with a bounded key count (overflow becomes an evidence gap, never
//! silence), closed into the shared `innerwall_wire::flows::FlowWindow` with each record's
//! decision from the one `decide`.

use std::collections::BTreeMap;
use std::net::IpAddr;

use innerwall_wire::flows::{EvidenceGap, FlowRecord, FlowWindow, GapKind, Pending, decide};
use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};

/// The aggregation key of an inbound flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlowKey {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// 0 for ICMP and ICMPv6.
    pub dst_port: u16,
    pub protocol: Protocol,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
    pub new_connections: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
}

impl Counters {
    fn merge(&mut self, other: &Counters) {
        if self.packets == 0 {
            *self = *other;
            return;
        }
        self.packets += other.packets;
        self.bytes += other.bytes;
        self.new_connections += other.new_connections;
        self.first_seen_ms = self.first_seen_ms.min(other.first_seen_ms);
        self.last_seen_ms = self.last_seen_ms.max(other.last_seen_ms);
    }
}

/// What a window's flows are judged under: a policy version and a mode.
pub type JudgedAs = (u64, Mode);

/// What flows are judged under with `policy` (version 0 in visibility when there is none).
pub fn judged_as(policy: Option<&WorkloadPolicy>) -> JudgedAs {
    policy.map_or((0, Mode::Visibility), |p| (p.version(), p.mode()))
}

/// The mode flows are judged in under a policy of `mode`: the same, except that when its drops
/// are held back (`held_back`: the kill switch is engaged, or the revert deadline of an
/// unconfirmed promotion passed) nothing is dropped, so an enforcing policy's drops are judged
/// as what they then are — would-blocks (its simulation).
pub fn judged_mode(mode: Mode, held_back: bool) -> Mode {
    if held_back && mode == Mode::Enforcement { Mode::Simulation } else { mode }
}

/// The policy flows are judged under while `applied` is held ([`judged_mode`]).
pub fn judged(applied: Option<WorkloadPolicy>, held_back: bool) -> Option<WorkloadPolicy> {
    applied.map(|p| {
        let mode = judged_mode(p.mode(), held_back);
        p.with_mode(mode)
    })
}

/// One open window, evaluated against exactly one policy version.
#[derive(Debug, Clone)]
pub struct Window {
    pub id: uuid::Uuid,
    pub start_ms: i64,
    policy: Option<WorkloadPolicy>,
    max_keys: usize,
    flows: BTreeMap<FlowKey, Counters>,
    overflow: u64,
    first_overflow_ms: Option<i64>,
    gaps: Vec<EvidenceGap>,
}

impl Window {
    pub fn open(start_ms: i64, policy: Option<WorkloadPolicy>, max_keys: usize) -> Self {
        Window {
            id: uuid::Uuid::new_v4(),
            start_ms,
            policy,
            max_keys,
            flows: BTreeMap::new(),
            overflow: 0,
            first_overflow_ms: None,
            gaps: Vec::new(),
        }
    }

    pub fn policy_version(&self) -> u64 {
        self.policy.as_ref().map_or(0, WorkloadPolicy::version)
    }

    /// The version and mode this window's flows are judged under.
    pub fn judged_as(&self) -> JudgedAs {
        judged_as(self.policy.as_ref())
    }

    /// Adds drained counters; keys beyond the cap are counted as a gap.
    pub fn add(&mut self, key: FlowKey, counters: Counters, now_ms: i64) {
        if !self.flows.contains_key(&key) && self.flows.len() >= self.max_keys {
            self.overflow += 1;
            self.first_overflow_ms.get_or_insert(now_ms);
            return;
        }
        self.flows.entry(key).or_default().merge(&counters);
    }

    /// Something could not be recorded (map full, agent restart, …). A gap that continues the
    /// last one of its kind (it starts where that one ends) extends it, so a loss that lasts
    /// (capture unavailable for a whole window) is one gap, with the counts summed.
    pub fn gap(&mut self, mut gap: EvidenceGap) {
        gap.to_ms = gap.to_ms.max(gap.from_ms);
        if let Some(last) = self.gaps.iter_mut().rev().find(|g| g.kind == gap.kind)
            && last.to_ms == gap.from_ms
        {
            last.absorb(gap);
            return;
        }
        self.gaps.push(gap);
    }

    /// Closes the window at `end_ms`: every record gets its decision under this window's
    /// policy (and, under a staged set, the decision of its pending rules: FLOW-10; never in
    /// visibility, where no rule is evaluated), and its first and last seen are kept inside the
    /// window. (The kernel's clock is
    /// converted to wall-clock time at each drain and the map switch races a program run by
    /// microseconds, so a time can fall a millisecond past a bound; evidence about one window
    /// never claims a moment outside it.)
    pub fn close(mut self, end_ms: i64) -> FlowWindow {
        let end_ms = end_ms.max(self.start_ms);
        let start_ms = self.start_ms;
        let inside = move |t: i64| t.clamp(start_ms, end_ms);
        if self.overflow > 0 {
            let from = self.first_overflow_ms.unwrap_or(self.start_ms);
            self.gap(EvidenceGap::new(GapKind::WindowKeyOverflow, from, end_ms, self.overflow));
        }
        let pending =
            self.policy.as_ref().filter(|p| p.mode() != Mode::Visibility).and_then(WorkloadPolicy::pending);
        let records = self
            .flows
            .iter()
            .map(|(k, c)| {
                let (decision, matched_rule) = decide(self.policy.as_ref(), k.src, k.dst_port, k.protocol);
                let pending = pending.as_ref().map(|p| {
                    let (decision, rule) = decide(Some(p), k.src, k.dst_port, k.protocol);
                    Pending { decision, rule }
                });
                FlowRecord {
                    src: k.src,
                    dst: k.dst,
                    dst_port: k.dst_port,
                    protocol: k.protocol,
                    decision,
                    matched_rule,
                    packets: c.packets,
                    bytes: c.bytes,
                    new_connections: c.new_connections,
                    first_seen_ms: inside(c.first_seen_ms),
                    last_seen_ms: inside(c.last_seen_ms),
                    pending,
                }
            })
            .collect();
        FlowWindow {
            id: self.id,
            start_ms: self.start_ms,
            end_ms,
            policy_version: self.policy_version(),
            mode: self.policy.as_ref().map_or(Mode::Visibility, WorkloadPolicy::mode),
            records,
            gaps: self.gaps,
            staged_set: pending
                .and(self.policy.as_ref().and_then(|p| p.staged()).map(|s| s.set().to_owned())),
        }
    }
}

/// Why a suspect-direction gap is there (see [`GapKind::SuspectDirection`]).
pub const SUSPECT_DIRECTION_DETAIL: &str = "udp datagrams from a service port (below 32768) to an ephemeral local port \
     matched no connection entry (evicted from the connection table, or older than the capture) and were \
     recorded as inbound: some may be replies to this host's own requests";

/// Adds one drain of the kernel map to the open window: only inbound flows to this host's own
/// addresses (neighbour discovery excluded); the map-full drops as a gap since the previous
/// drain, and the reply-like UDP datagrams that matched no connection entry (recorded as
/// inbound, so some record may have the wrong direction) as a suspect-direction gap. The other
/// counters (replies skipped, ICMP errors, evictions) misclassify nothing: they are metrics.
pub fn absorb(
    window: &mut Window,
    drained: &super::capture::Drained,
    local: &std::collections::BTreeSet<IpAddr>,
    since_ms: i64,
    now_ms: i64,
) {
    for r in &drained.records {
        let protocol = match r.protocol {
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            1 => Protocol::Icmp,
            58 if !(133..=137).contains(&(r.dst_port >> 8)) => Protocol::Icmpv6,
            _ => continue,
        };
        if !local.contains(&r.dst) {
            continue;
        }
        let dst_port = if protocol.has_ports() { r.dst_port } else { 0 };
        let key = FlowKey { src: r.src, dst: r.dst, dst_port, protocol };
        let counters = Counters {
            packets: r.packets,
            bytes: r.bytes,
            new_connections: r.new_connections,
            first_seen_ms: r.first_seen_unix_ms,
            last_seen_ms: r.last_seen_unix_ms,
        };
        window.add(key, counters, now_ms);
    }
    if drained.map_full_drops > 0 {
        window.gap(EvidenceGap::new(GapKind::MapFull, since_ms, now_ms, drained.map_full_drops));
    }
    if drained.udp_reply_like_unmatched > 0 {
        let gap =
            EvidenceGap::new(GapKind::SuspectDirection, since_ms, now_ms, drained.udp_reply_like_unmatched);
        window.gap(gap.because(SUSPECT_DIRECTION_DETAIL));
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::flows::Decision;
    use innerwall_wire::testing::rule;

    use super::*;

    #[test]
    fn with_the_kill_switch_engaged_nothing_is_judged_blocked() {
        for (mode, suspended, expected) in [
            (Mode::Enforcement, true, Mode::Simulation),
            (Mode::Enforcement, false, Mode::Enforcement),
            (Mode::Simulation, true, Mode::Simulation),
            (Mode::Visibility, true, Mode::Visibility),
        ] {
            let held = judged(Some(policy(mode)), suspended).expect("a policy");
            assert_eq!((held.version(), held.mode()), (4, expected), "{mode} suspended={suspended}");
            assert_eq!(judged_mode(mode, suspended), expected);
        }
        assert_eq!(judged(None, true), None);
    }

    #[test]
    fn records_never_claim_a_moment_outside_their_window() {
        let key = FlowKey {
            src: IpAddr::from([10, 0, 0, 1]),
            dst: IpAddr::from([10, 0, 0, 100]),
            dst_port: 5432,
            protocol: Protocol::Tcp,
        };
        let c =
            Counters { packets: 1, bytes: 60, new_connections: 1, first_seen_ms: 999, last_seen_ms: 2_001 };
        let mut w = Window::open(1_000, Some(policy(Mode::Simulation)), 10);
        w.add(key, c, 2_000);
        let closed = w.close(2_000);
        assert_eq!((closed.records[0].first_seen_ms, closed.records[0].last_seen_ms), (1_000, 2_000));
    }

    fn policy(mode: Mode) -> WorkloadPolicy {
        WorkloadPolicy::new(4, mode, [rule("db", Protocol::Tcp, &[5432], &["10.0.0.0/24"])]).unwrap()
    }

    #[test]
    fn windows_merge_cap_keys_and_report_overflow_as_a_gap() {
        let key = |n: u8| FlowKey {
            src: IpAddr::from([10, 0, 0, n]),
            dst: IpAddr::from([10, 0, 0, 100]),
            dst_port: 5432,
            protocol: Protocol::Tcp,
        };
        let c = |p, first, last| Counters {
            packets: p,
            bytes: p * 60,
            new_connections: 1,
            first_seen_ms: first,
            last_seen_ms: last,
        };
        let mut w = Window::open(1_000, Some(policy(Mode::Simulation)), 2);
        w.add(key(1), c(2, 1_100, 1_200), 1_200);
        w.add(key(1), c(3, 1_050, 1_500), 1_500);
        w.add(key(2), c(1, 1_300, 1_300), 1_300);
        w.add(key(3), c(1, 1_400, 1_400), 1_400);
        w.add(key(4), c(1, 1_450, 1_450), 1_450);
        let closed = w.close(2_000);
        assert_eq!(closed.policy_version, 4);
        assert_eq!(closed.records.len(), 2);
        let first = &closed.records[0];
        assert_eq!(
            (first.packets, first.new_connections, first.first_seen_ms, first.last_seen_ms),
            (5, 2, 1_050, 1_500)
        );
        assert_eq!(first.decision, Decision::Allowed);
        assert_eq!(first.matched_rule.as_ref().map(ToString::to_string).as_deref(), Some("db/tcp"));
        assert_eq!(closed.gaps, [EvidenceGap::new(GapKind::WindowKeyOverflow, 1_400, 2_000, 2)]);
    }

    /// A window under a staged set (FLOW-10) names it, and each record carries the decision of
    /// the pending rules beside the enforced one: the narrowed-away peer is enforced-allowed and
    /// pending-blocked; under the kill switch both are judged as the simulation.
    #[test]
    fn records_under_a_staged_set_carry_the_pending_decision() {
        let key = |n: u8| FlowKey {
            src: IpAddr::from([10, 0, 0, n]),
            dst: IpAddr::from([10, 0, 0, 100]),
            dst_port: 5432,
            protocol: Protocol::Tcp,
        };
        let c =
            Counters { packets: 1, bytes: 60, new_connections: 1, first_seen_ms: 1_100, last_seen_ms: 1_100 };
        let narrowed = rule("db", Protocol::Tcp, &[5432], &["10.0.0.0/28"]);
        let staged = innerwall_wire::policy::Staged::new("rs.db:2", [narrowed], []).unwrap();
        let staged_policy = |mode| policy(mode).with_staged(Some(staged.clone()));
        let mut w = Window::open(1_000, Some(staged_policy(Mode::Enforcement)), 10);
        w.add(key(1), c, 1_100);
        w.add(key(200), c, 1_100);
        let closed = w.close(2_000);
        assert_eq!(closed.staged_set.as_deref(), Some("rs.db:2"));
        let pending =
            |i: usize| closed.records[i].pending.clone().map(|p| (p.decision, p.rule.map(|r| r.to_string())));
        assert_eq!(
            (closed.records[0].decision, pending(0)),
            (Decision::Allowed, Some((Decision::Allowed, Some("db/tcp".into()))))
        );
        assert_eq!(
            (closed.records[1].decision, pending(1)),
            (Decision::Allowed, Some((Decision::Blocked, None)))
        );
        let held = judged(Some(staged_policy(Mode::Enforcement)), true);
        let mut w = Window::open(1_000, held, 10);
        w.add(key(200), c, 1_100);
        let closed = w.close(2_000);
        assert_eq!(closed.records[0].pending.as_ref().map(|p| p.decision), Some(Decision::WouldBlock));
        // In visibility nothing is evaluated: no pending decision, no staged set named.
        let mut w = Window::open(1_000, Some(staged_policy(Mode::Visibility)), 10);
        w.add(key(1), c, 1_100);
        let closed = w.close(2_000);
        assert_eq!((closed.staged_set, closed.records[0].pending.clone()), (None, None));
        // Without a staged set: none.
        let mut w = Window::open(1_000, Some(policy(Mode::Enforcement)), 10);
        w.add(key(1), c, 1_100);
        assert_eq!(w.close(2_000).records[0].pending, None);
    }
}
