//! Flow windows (FLOW-2, FLOW-3), pure: what the installed policy decides about an inbound
//! flow, and the window that aggregates drained flow counters under one policy version with a
//! bounded key count (overflow becomes an evidence gap, never silence).

use std::collections::BTreeMap;
use std::net::IpAddr;

use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};
use innerwall_wire::proto;

/// The decision the policy installed at that moment makes (or would make) about a flow.
pub fn decide(
    policy: Option<&WorkloadPolicy>,
    src: IpAddr,
    dst_port: u16,
    protocol: Protocol,
) -> (proto::FlowDecision, String) {
    let Some(policy) = policy else {
        return (proto::FlowDecision::Observed, String::new());
    };
    if policy.mode() == Mode::Visibility {
        return (proto::FlowDecision::Observed, String::new());
    }
    let matched = policy.rules().find(|r| {
        r.protocol() == protocol
            && (r.ports().is_empty() || r.ports().iter().any(|p| p.contains(dst_port)))
            && r.peers().iter().any(|c| c.contains(&src))
    });
    match (matched, policy.mode()) {
        (Some(rule), _) => (proto::FlowDecision::Allowed, rule.id().to_string()),
        (None, Mode::Simulation) => (proto::FlowDecision::WouldBlock, String::new()),
        (None, _) => (proto::FlowDecision::Blocked, String::new()),
    }
}

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
    gaps: Vec<proto::EvidenceGap>,
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

    /// Adds drained counters; keys beyond the cap are counted as a gap.
    pub fn add(&mut self, key: FlowKey, counters: Counters, now_ms: i64) {
        if !self.flows.contains_key(&key) && self.flows.len() >= self.max_keys {
            self.overflow += 1;
            self.first_overflow_ms.get_or_insert(now_ms);
            return;
        }
        self.flows.entry(key).or_default().merge(&counters);
    }

    /// Something could not be recorded (map full, agent restart, …).
    pub fn gap(&mut self, kind: proto::EvidenceGapKind, from_ms: i64, to_ms: i64, count: u64) {
        self.gaps.push(proto::EvidenceGap {
            kind: kind.into(),
            from_unix_ms: from_ms,
            to_unix_ms: to_ms.max(from_ms),
            count,
        });
    }

    /// Closes the window: every record gets its decision under this window's policy.
    pub fn close(mut self, end_ms: i64) -> proto::FlowWindow {
        if self.overflow > 0 {
            let from = self.first_overflow_ms.unwrap_or(self.start_ms);
            self.gap(proto::EvidenceGapKind::WindowKeyOverflow, from, end_ms, self.overflow);
        }
        let mode = self.policy.as_ref().map_or(Mode::Visibility, WorkloadPolicy::mode);
        let records = self
            .flows
            .iter()
            .map(|(k, c)| {
                let (decision, rule) = decide(self.policy.as_ref(), k.src, k.dst_port, k.protocol);
                proto::FlowRecord {
                    src_address: k.src.to_string(),
                    dst_address: k.dst.to_string(),
                    dst_port: u32::from(k.dst_port),
                    protocol: proto::Protocol::from(k.protocol).into(),
                    decision: decision.into(),
                    matched_rule_id: rule,
                    packets: c.packets,
                    bytes: c.bytes,
                    new_connections: c.new_connections,
                    first_seen_unix_ms: c.first_seen_ms,
                    last_seen_unix_ms: c.last_seen_ms,
                }
            })
            .collect();
        proto::FlowWindow {
            window_id: self.id.to_string(),
            start_unix_ms: self.start_ms,
            end_unix_ms: end_ms.max(self.start_ms),
            policy_version: self.policy_version(),
            mode: proto::EnforcementMode::from(mode).into(),
            records,
            gaps: self.gaps,
        }
    }
}

/// Adds one drain of the kernel map to the open window: only inbound flows to this host's own
/// addresses (neighbour discovery excluded), and the map-full drops as a gap since the previous
/// drain.
pub fn absorb(
    window: &mut Window,
    records: &[crate::capture::FlowRecord],
    map_full_drops: u64,
    local: &std::collections::BTreeSet<IpAddr>,
    since_ms: i64,
    now_ms: i64,
) {
    for r in records {
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
    if map_full_drops > 0 {
        window.gap(proto::EvidenceGapKind::MapFull, since_ms, now_ms, map_full_drops);
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::{Cidr, PortRange, ResolvedRule, RuleId};

    use super::*;

    fn policy(mode: Mode) -> WorkloadPolicy {
        let rule = ResolvedRule::new(
            RuleId::new("db", Protocol::Tcp).unwrap(),
            [PortRange::single(5432).unwrap()],
            [Cidr::parse("10.0.0.0/24").unwrap()],
        )
        .unwrap();
        let ping = ResolvedRule::new(
            RuleId::new("ping", Protocol::Icmp).unwrap(),
            [],
            [Cidr::parse("0.0.0.0/0").unwrap()],
        )
        .unwrap();
        WorkloadPolicy::new(4, mode, [rule, ping]).unwrap()
    }

    #[test]
    fn decisions_follow_mode_and_rules() {
        use proto::FlowDecision::*;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let check = |mode, src, port, proto, want: proto::FlowDecision, rule: &str| {
            let p = policy(mode);
            assert_eq!(
                decide(Some(&p), ip(src), port, proto),
                (want, rule.to_owned()),
                "{mode} {src} {port} {proto}"
            );
        };
        check(Mode::Enforcement, "10.0.0.9", 5432, Protocol::Tcp, Allowed, "db/tcp");
        check(Mode::Enforcement, "10.0.1.9", 5432, Protocol::Tcp, Blocked, "");
        check(Mode::Enforcement, "10.0.0.9", 5433, Protocol::Tcp, Blocked, "");
        check(Mode::Enforcement, "10.0.0.9", 5432, Protocol::Udp, Blocked, "");
        check(Mode::Simulation, "10.0.1.9", 5432, Protocol::Tcp, WouldBlock, "");
        check(Mode::Simulation, "192.0.2.1", 0, Protocol::Icmp, Allowed, "ping/icmp");
        check(Mode::Visibility, "10.0.1.9", 5432, Protocol::Tcp, Observed, "");
        assert_eq!(decide(None, ip("10.0.0.9"), 5432, Protocol::Tcp), (Observed, String::new()));
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
            (first.packets, first.new_connections, first.first_seen_unix_ms, first.last_seen_unix_ms),
            (5, 2, 1_050, 1_500)
        );
        assert_eq!(first.decision, proto::FlowDecision::Allowed as i32);
        assert_eq!(closed.gaps.len(), 1);
        assert_eq!(closed.gaps[0].kind, proto::EvidenceGapKind::WindowKeyOverflow as i32);
        assert_eq!(
            (closed.gaps[0].count, closed.gaps[0].from_unix_ms, closed.gaps[0].to_unix_ms),
            (2, 1_400, 2_000)
        );
    }
}
