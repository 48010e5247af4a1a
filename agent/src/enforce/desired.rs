//! The desired table (ENF-1, ENF-2): a pure function from a `WorkloadPolicy` to a plain-data
//! description of `table inet innerwall` — its input chain, interval sets and rules — plus the
//! nft-syntax rendering of it, the per-family CIDR merge and the exact set-element diff that
//! peer-only updates (ENF-3) are computed from. No I/O here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, ResolvedRule, WorkloadPolicy};
use ipnet::IpNet;

/// The one table the agent owns (ENF-1), in family `inet`.
pub const TABLE: &str = "innerwall";
/// Its only chain: the inbound base chain.
pub const CHAIN: &str = "input";
/// Comment of the enforcement terminal rule (count + drop).
pub const TERMINAL_DROP: &str = "innerwall:drop";
/// Comment of the simulation terminal rule (count + mark + accept).
pub const TERMINAL_WOULD_BLOCK: &str = "innerwall:would-block";
/// Prefix of the comment of a staged rule's counter (FLOW-10): `staged:<rule id>`.
pub const STAGED_PREFIX: &str = "staged:";
/// Conntrack mark bit the simulation terminal sets on connections it would have blocked. Only
/// this bit is written; every other bit of the mark is preserved.
pub const WOULD_BLOCK_CT_MARK: u32 = 0x0100_0000;
/// ICMPv6 neighbour discovery types (router solicit … redirect, RFC 4861) accepted before any
/// policy rule: without them IPv6 stops working under a default drop.
pub const ND_TYPES: (u8, u8) = (133, 137);

/// An address family of peers, and the key type of a peer set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(cidr: &Cidr) -> Family {
        if cidr.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    /// Address width in bits.
    pub fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// The largest address, as a number.
    pub fn max(self) -> u128 {
        match self {
            Family::V4 => u128::from(u32::MAX),
            Family::V6 => u128::MAX,
        }
    }

    pub fn nft(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Family::V4 => "v4",
            Family::V6 => "v6",
        }
    }
}

/// What a set's keys are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyKind {
    Addr(Family),
    Port,
}

impl KeyKind {
    /// Key width in bytes (`NFTA_SET_KEY_LEN`).
    pub fn key_len(self) -> usize {
        match self {
            KeyKind::Addr(Family::V4) => 4,
            KeyKind::Addr(Family::V6) => 16,
            KeyKind::Port => 2,
        }
    }

    /// The nft datatype id (`NFTA_SET_KEY_TYPE`): ipv4_addr 7, ipv6_addr 8, inet_service 13.
    pub fn nft_type(self) -> u32 {
        match self {
            KeyKind::Addr(Family::V4) => 7,
            KeyKind::Addr(Family::V6) => 8,
            KeyKind::Port => 13,
        }
    }

    fn max(self) -> u128 {
        match self {
            KeyKind::Addr(f) => f.max(),
            KeyKind::Port => u128::from(u16::MAX),
        }
    }

    fn nft_name(self) -> &'static str {
        match self {
            KeyKind::Addr(Family::V4) => "ipv4_addr",
            KeyKind::Addr(Family::V6) => "ipv6_addr",
            KeyKind::Port => "inet_service",
        }
    }

    /// The big-endian key bytes of a value, as the kernel stores them.
    pub fn key_bytes(self, value: u128) -> Vec<u8> {
        let bytes = value.to_be_bytes();
        bytes[16 - self.key_len()..].to_vec()
    }
}

/// An inclusive range of keys `[first, last]`. A set holds merged ranges: no two overlap or
/// touch, so every value has exactly one spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Interval {
    pub first: u128,
    pub last: u128,
}

impl Interval {
    pub fn of_cidr(net: IpNet) -> Interval {
        let (addr, bits, prefix) = match net {
            IpNet::V4(n) => (u128::from(u32::from(n.network())), 32, n.prefix_len()),
            IpNet::V6(n) => (u128::from(n.network()), 128, n.prefix_len()),
        };
        let host_bits = bits - u32::from(prefix);
        let span = if host_bits == 128 { u128::MAX } else { (1u128 << host_bits) - 1 };
        Interval { first: addr, last: addr + span }
    }
}

/// Sorts and merges overlapping and adjacent ranges. Element operations are not idempotent
/// (an overlapping add is EEXIST, a delete that is not exactly installed is ENOENT), so sets
/// only ever hold this merged form.
pub fn merge(intervals: impl IntoIterator<Item = Interval>) -> Vec<Interval> {
    let mut sorted: Vec<Interval> = intervals.into_iter().collect();
    sorted.sort();
    let mut merged: Vec<Interval> = Vec::with_capacity(sorted.len());
    for next in sorted {
        match merged.last_mut() {
            Some(last) if last.last == u128::MAX || next.first <= last.last + 1 => {
                last.last = last.last.max(next.last);
            }
            _ => merged.push(next),
        }
    }
    merged
}

/// The merged intervals of one family's peers.
pub fn merge_cidrs<'a>(family: Family, cidrs: impl IntoIterator<Item = &'a Cidr>) -> Vec<Interval> {
    merge(cidrs.into_iter().filter(|c| Family::of(c) == family).map(|c| Interval::of_cidr(c.net())))
}

/// One kernel set element: an interval start, or the (exclusive) end marker of an interval.
/// An interval that reaches the largest key has no end element.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Element {
    pub key: Vec<u8>,
    pub end: bool,
}

/// The exact kernel elements of a list of merged intervals, sorted.
pub fn elements(kind: KeyKind, intervals: &[Interval]) -> Vec<Element> {
    let mut out = Vec::with_capacity(intervals.len() * 2);
    for iv in intervals {
        out.push(Element { key: kind.key_bytes(iv.first), end: false });
        if iv.last < kind.max() {
            out.push(Element { key: kind.key_bytes(iv.last + 1), end: true });
        }
    }
    out.sort();
    out
}

/// What a peer-only update sends for one set: elements to delete, then elements to add.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ElementDiff {
    pub remove: Vec<Element>,
    pub add: Vec<Element>,
}

impl ElementDiff {
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }
}

/// The exact element difference between what is installed and what is wanted.
pub fn element_diff(installed: &[Element], wanted: &[Element]) -> ElementDiff {
    let have: BTreeSet<&Element> = installed.iter().collect();
    let want: BTreeSet<&Element> = wanted.iter().collect();
    ElementDiff {
        remove: have.difference(&want).map(|e| (*e).clone()).collect(),
        add: want.difference(&have).map(|e| (*e).clone()).collect(),
    }
}

/// A named interval set of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    pub name: String,
    pub kind: KeyKind,
    pub intervals: Vec<Interval>,
}

impl SetSpec {
    pub fn elements(&self) -> Vec<Element> {
        elements(self.kind, &self.intervals)
    }
}

/// How a policy rule matches the destination port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortMatch {
    /// ICMP and ICMPv6: no ports.
    None,
    /// One port or one range.
    Range(u16, u16),
    /// Several ranges: a port set of this table.
    Set(String),
}

/// One rule of the input chain, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleSpec {
    /// `iif "lo" accept`
    Loopback,
    /// `ct state established,related accept`
    EstablishedRelated,
    /// ICMPv6 neighbour discovery accept.
    NeighbourDiscovery,
    /// A resolved rule for one address family: source in `set`, protocol, ports → counter,
    /// attribution (the rule id as the comment), accept. A `staged` one (FLOW-10) only counts,
    /// with no verdict of its own, commented `staged:<rule id>`, before every enforced rule.
    Policy { id: String, family: Family, protocol: Protocol, set: String, ports: PortMatch, staged: bool },
    /// The terminal rule of the mode.
    Terminal(Mode),
}

impl RuleSpec {
    /// The comment the rule carries in the kernel, which ties its counter to a rule id.
    pub fn comment(&self) -> Option<String> {
        match self {
            RuleSpec::Policy { id, staged: false, .. } => Some(rule_comment(id)),
            RuleSpec::Policy { id, staged: true, .. } => Some(rule_comment(&format!("{STAGED_PREFIX}{id}"))),
            RuleSpec::Terminal(Mode::Simulation) => Some(TERMINAL_WOULD_BLOCK.to_owned()),
            RuleSpec::Terminal(_) => Some(TERMINAL_DROP.to_owned()),
            _ => None,
        }
    }
}

/// Longest rule comment nft stores (128 bytes with its NUL).
pub const MAX_COMMENT: usize = 127;

/// The comment of a policy rule: its id, or for ids longer than nft allows, a prefix and a
/// hash of the whole id (still unique, still recognizable).
pub fn rule_comment(id: &str) -> String {
    if id.len() <= MAX_COMMENT {
        return id.to_owned();
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(id.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}~{hex}", &id[..100])
}

/// The complete desired content of `table inet innerwall`.
///
/// Its shape (sets, rules) depends only on the mode, the rule ids and their ports; peers only
/// fill the address sets. Every TCP/UDP rule gets a rule and a set for both families (an empty
/// set matches nothing), ICMP only IPv4 and ICMPv6 only IPv6, so a peer-only change is always
/// an element-only change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredTable {
    pub sets: Vec<SetSpec>,
    pub rules: Vec<RuleSpec>,
}

impl DesiredTable {
    pub fn from_policy(policy: &WorkloadPolicy) -> DesiredTable {
        let mut table = DesiredTable {
            sets: Vec::new(),
            rules: vec![RuleSpec::Loopback, RuleSpec::EstablishedRelated, RuleSpec::NeighbourDiscovery],
        };
        if policy.mode() == Mode::Visibility {
            return table;
        }
        // Staged rules count before any enforced rule accepts (FLOW-10).
        if let Some(staged) = policy.staged() {
            for (index, rule) in staged.upserts().enumerate() {
                table.push_rule(&format!("s{index}"), rule, true);
            }
        }
        for (index, rule) in policy.rules().enumerate() {
            table.push_rule(&format!("r{index}"), rule, false);
        }
        table.rules.push(RuleSpec::Terminal(policy.mode()));
        table
    }

    /// Adds the sets and the per-family rules of one resolved rule, its sets named `<prefix>_…`.
    fn push_rule(&mut self, prefix: &str, rule: &ResolvedRule, staged: bool) {
        let families: &[Family] = match rule.protocol() {
            Protocol::Tcp | Protocol::Udp => &[Family::V4, Family::V6],
            Protocol::Icmp => &[Family::V4],
            Protocol::Icmpv6 => &[Family::V6],
        };
        let ports = match rule.ports() {
            [] => PortMatch::None,
            [one] => PortMatch::Range(one.start(), one.end()),
            many => {
                let name = format!("{prefix}_ports");
                self.sets.push(SetSpec {
                    name: name.clone(),
                    kind: KeyKind::Port,
                    intervals: port_intervals(many),
                });
                PortMatch::Set(name)
            }
        };
        for &family in families {
            let name = format!("{prefix}_{}", family.suffix());
            self.sets.push(SetSpec {
                name: name.clone(),
                kind: KeyKind::Addr(family),
                intervals: merge_cidrs(family, rule.peers()),
            });
            self.rules.push(RuleSpec::Policy {
                id: rule.id().to_string(),
                family,
                protocol: rule.protocol(),
                set: name,
                ports: ports.clone(),
                staged,
            });
        }
    }

    /// The same table with every set emptied: equal shapes differ only in set elements.
    pub fn shape(&self) -> DesiredTable {
        let sets = self.sets.iter().map(|s| SetSpec { intervals: Vec::new(), ..s.clone() }).collect();
        DesiredTable { sets, rules: self.rules.clone() }
    }

    /// This table with, half way through its rules, one that looks its peers up in a set the
    /// table does not define: the kernel refuses the whole batch at that rule (for testing that
    /// a refused batch changes nothing).
    #[cfg(feature = "testing")]
    pub fn with_rule_the_kernel_refuses(&self) -> DesiredTable {
        let mut broken = self.clone();
        let refused = RuleSpec::Policy {
            id: "innerwall-test-refused/tcp".to_owned(),
            family: Family::V4,
            protocol: Protocol::Tcp,
            set: "innerwall_no_such_set".to_owned(),
            ports: PortMatch::None,
            staged: false,
        };
        broken.rules.insert(broken.rules.len() / 2, refused);
        broken
    }

    pub fn set(&self, name: &str) -> Option<&SetSpec> {
        self.sets.iter().find(|s| s.name == name)
    }

    /// Per set (by name) the element operations that turn `installed` into `self`, or `None`
    /// when the shapes differ and only a full replace will do.
    pub fn element_update_from(&self, installed: &DesiredTable) -> Option<BTreeMap<String, ElementDiff>> {
        if self.shape() != installed.shape() {
            return None;
        }
        let mut out = BTreeMap::new();
        for (want, have) in self.sets.iter().zip(&installed.sets) {
            let diff = element_diff(&have.elements(), &want.elements());
            if !diff.is_empty() {
                out.insert(want.name.clone(), diff);
            }
        }
        Some(out)
    }

    /// Renders the table in nft syntax, one statement per line, for inspection and tests.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "table inet {TABLE} {{");
        for set in &self.sets {
            let _ = writeln!(w, "\tset {} {{", set.name);
            let _ = writeln!(w, "\t\ttype {}", set.kind.nft_name());
            let _ = writeln!(w, "\t\tflags interval");
            if !set.intervals.is_empty() {
                let items: Vec<String> =
                    set.intervals.iter().map(|iv| render_interval(set.kind, *iv)).collect();
                let _ = writeln!(w, "\t\telements = {{ {} }}", items.join(", "));
            }
            let _ = writeln!(w, "\t}}");
        }
        let _ = writeln!(w, "\tchain {CHAIN} {{");
        let _ = writeln!(w, "\t\ttype filter hook input priority filter; policy accept;");
        for rule in &self.rules {
            let _ = writeln!(w, "\t\t{}", RenderRule(rule));
        }
        let _ = writeln!(w, "\t}}");
        let _ = writeln!(w, "}}");
        out
    }
}

fn port_intervals(ports: &[PortRange]) -> Vec<Interval> {
    merge(ports.iter().map(|p| Interval { first: p.start().into(), last: p.end().into() }))
}

/// nft's spelling of one interval: a bare value, a prefix, or `first-last`.
fn render_interval(kind: KeyKind, iv: Interval) -> String {
    let value = |v: u128| match kind {
        KeyKind::Addr(Family::V4) => Ipv4Addr::from(v as u32).to_string(),
        KeyKind::Addr(Family::V6) => Ipv6Addr::from(v).to_string(),
        KeyKind::Port => v.to_string(),
    };
    if iv.first == iv.last {
        return value(iv.first);
    }
    if let KeyKind::Addr(family) = kind {
        let span = iv.last - iv.first;
        let host_bits = match span.checked_add(1) {
            None => Some(128),
            Some(size) if size.is_power_of_two() && iv.first.is_multiple_of(size) => {
                Some(size.trailing_zeros())
            }
            Some(_) => None,
        };
        if let Some(host_bits) = host_bits {
            let ip: IpAddr = match family {
                Family::V4 => Ipv4Addr::from(iv.first as u32).into(),
                Family::V6 => Ipv6Addr::from(iv.first).into(),
            };
            return format!("{ip}/{}", family.bits() - host_bits);
        }
    }
    format!("{}-{}", value(iv.first), value(iv.last))
}

struct RenderRule<'a>(&'a RuleSpec);

impl fmt::Display for RenderRule<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            RuleSpec::Loopback => f.write_str("iif \"lo\" accept"),
            RuleSpec::EstablishedRelated => f.write_str("ct state established,related accept"),
            RuleSpec::NeighbourDiscovery => write!(
                f,
                "meta nfproto ipv6 meta l4proto ipv6-icmp icmpv6 type {}-{} accept",
                ND_TYPES.0, ND_TYPES.1
            ),
            RuleSpec::Policy { id, family, protocol, set, ports, staged } => {
                let nfproto = match family {
                    Family::V4 => "ipv4",
                    Family::V6 => "ipv6",
                };
                let l4 = match protocol {
                    Protocol::Tcp => "tcp",
                    Protocol::Udp => "udp",
                    Protocol::Icmp => "icmp",
                    Protocol::Icmpv6 => "ipv6-icmp",
                };
                write!(f, "meta nfproto {nfproto} {} saddr @{set} meta l4proto {l4} ", family.nft())?;
                match ports {
                    PortMatch::None => {}
                    PortMatch::Range(a, b) if a == b => write!(f, "{protocol} dport {a} ")?,
                    PortMatch::Range(a, b) => write!(f, "{protocol} dport {a}-{b} ")?,
                    PortMatch::Set(name) => write!(f, "{protocol} dport @{name} ")?,
                }
                match staged {
                    true => {
                        write!(f, "counter comment \"{}\"", rule_comment(&format!("{STAGED_PREFIX}{id}")))
                    }
                    false => write!(f, "counter accept comment \"{}\"", rule_comment(id)),
                }
            }
            RuleSpec::Terminal(Mode::Simulation) => write!(
                f,
                "counter ct mark set ct mark or {WOULD_BLOCK_CT_MARK:#010x} accept comment \"{TERMINAL_WOULD_BLOCK}\""
            ),
            RuleSpec::Terminal(_) => write!(f, "counter drop comment \"{TERMINAL_DROP}\""),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use innerwall_wire::policy::{ResolvedRule, RuleId};

    fn cidr(text: &str) -> Cidr {
        Cidr::parse(text).unwrap()
    }

    fn rule(id: &str, proto: Protocol, ports: &[(u32, u32)], peers: &[&str]) -> ResolvedRule {
        ResolvedRule::new(
            RuleId::new(id, proto).unwrap(),
            ports.iter().map(|&(a, b)| PortRange::new(a, b).unwrap()),
            peers.iter().map(|p| cidr(p)),
        )
        .unwrap()
    }

    fn sample(mode: Mode) -> WorkloadPolicy {
        WorkloadPolicy::new(
            7,
            mode,
            [
                rule(
                    "web",
                    Protocol::Tcp,
                    &[(80, 80), (443, 443)],
                    &["10.0.0.0/24", "10.0.1.0/24", "fd00::/64"],
                ),
                rule("dns", Protocol::Udp, &[(53, 53)], &["192.0.2.7/32"]),
                rule("ping", Protocol::Icmp, &[], &["10.9.0.0/16", "fd00::1/128"]),
                rule("ping", Protocol::Icmpv6, &[], &["fd00::1/128"]),
                rule("all", Protocol::Tcp, &[(1, 65535)], &[]),
            ],
        )
        .unwrap()
    }

    #[test]
    fn enforcement_rendering_snapshot() {
        let text = DesiredTable::from_policy(&sample(Mode::Enforcement)).render();
        let expected = r#"table inet innerwall {
	set r0_v4 {
		type ipv4_addr
		flags interval
	}
	set r0_v6 {
		type ipv6_addr
		flags interval
	}
	set r1_v4 {
		type ipv4_addr
		flags interval
		elements = { 192.0.2.7 }
	}
	set r1_v6 {
		type ipv6_addr
		flags interval
	}
	set r2_v4 {
		type ipv4_addr
		flags interval
		elements = { 10.9.0.0/16 }
	}
	set r3_v6 {
		type ipv6_addr
		flags interval
		elements = { fd00::1 }
	}
	set r4_ports {
		type inet_service
		flags interval
		elements = { 80, 443 }
	}
	set r4_v4 {
		type ipv4_addr
		flags interval
		elements = { 10.0.0.0/23 }
	}
	set r4_v6 {
		type ipv6_addr
		flags interval
		elements = { fd00::/64 }
	}
	chain input {
		type filter hook input priority filter; policy accept;
		iif "lo" accept
		ct state established,related accept
		meta nfproto ipv6 meta l4proto ipv6-icmp icmpv6 type 133-137 accept
		meta nfproto ipv4 ip saddr @r0_v4 meta l4proto tcp tcp dport 1-65535 counter accept comment "all/tcp"
		meta nfproto ipv6 ip6 saddr @r0_v6 meta l4proto tcp tcp dport 1-65535 counter accept comment "all/tcp"
		meta nfproto ipv4 ip saddr @r1_v4 meta l4proto udp udp dport 53 counter accept comment "dns/udp"
		meta nfproto ipv6 ip6 saddr @r1_v6 meta l4proto udp udp dport 53 counter accept comment "dns/udp"
		meta nfproto ipv4 ip saddr @r2_v4 meta l4proto icmp counter accept comment "ping/icmp"
		meta nfproto ipv6 ip6 saddr @r3_v6 meta l4proto ipv6-icmp counter accept comment "ping/icmpv6"
		meta nfproto ipv4 ip saddr @r4_v4 meta l4proto tcp tcp dport @r4_ports counter accept comment "web/tcp"
		meta nfproto ipv6 ip6 saddr @r4_v6 meta l4proto tcp tcp dport @r4_ports counter accept comment "web/tcp"
		counter drop comment "innerwall:drop"
	}
}
"#;
        assert_eq!(text, expected, "actual:\n{text}");
    }

    #[test]
    fn visibility_installs_no_policy_rules() {
        let text = DesiredTable::from_policy(&sample(Mode::Visibility)).render();
        let expected = r#"table inet innerwall {
	chain input {
		type filter hook input priority filter; policy accept;
		iif "lo" accept
		ct state established,related accept
		meta nfproto ipv6 meta l4proto ipv6-icmp icmpv6 type 133-137 accept
	}
}
"#;
        assert_eq!(text, expected, "actual:\n{text}");
    }

    #[test]
    fn simulation_and_enforcement_differ_by_one_line() {
        let enforce = DesiredTable::from_policy(&sample(Mode::Enforcement)).render();
        let simulate = DesiredTable::from_policy(&sample(Mode::Simulation)).render();
        let (e, s): (Vec<&str>, Vec<&str>) = (enforce.lines().collect(), simulate.lines().collect());
        assert_eq!(e.len(), s.len(), "same number of lines");
        let differing: Vec<(&str, &str)> =
            e.iter().zip(&s).filter(|(a, b)| a != b).map(|(a, b)| (*a, *b)).collect();
        assert_eq!(
            differing,
            [(
                "\t\tcounter drop comment \"innerwall:drop\"",
                "\t\tcounter ct mark set ct mark or 0x01000000 accept comment \"innerwall:would-block\""
            )]
        );
    }

    #[test]
    fn cidr_merging_per_family() {
        let check = |family, input: &[&str], expected: &[&str]| {
            let cidrs: Vec<Cidr> = input.iter().map(|c| cidr(c)).collect();
            let merged = merge_cidrs(family, &cidrs);
            let kind = KeyKind::Addr(family);
            let text: Vec<String> = merged.iter().map(|iv| render_interval(kind, *iv)).collect();
            assert_eq!(text, expected, "{input:?}");
        };
        check(Family::V4, &["10.0.0.0/24", "10.0.0.128/25", "fd00::/8"], &["10.0.0.0/24"]);
        check(Family::V4, &["10.0.0.0/24", "10.0.1.0/24"], &["10.0.0.0/23"]);
        check(Family::V4, &["10.0.0.0/24", "10.0.1.0/24", "10.0.2.0/24"], &["10.0.0.0-10.0.2.255"]);
        check(Family::V4, &["10.0.0.1/32", "10.0.0.3/32"], &["10.0.0.1", "10.0.0.3"]);
        check(Family::V4, &["0.0.0.0/0", "10.0.0.0/8"], &["0.0.0.0/0"]);
        check(Family::V4, &["255.255.255.255/32", "255.255.255.254/32"], &["255.255.255.254/31"]);
        check(Family::V6, &["::/0", "fd00::/8", "10.0.0.0/8"], &["::/0"]);
        check(Family::V6, &["fd00::/64", "fd00:0:0:1::/64"], &["fd00::/63"]);
        check(Family::V6, &["10.0.0.0/8"], &[]);
    }

    #[test]
    fn elements_have_end_markers_except_at_the_top() {
        let v4 = KeyKind::Addr(Family::V4);
        let els = elements(v4, &merge_cidrs(Family::V4, &[cidr("10.0.0.0/24"), cidr("255.255.255.0/24")]));
        assert_eq!(
            els,
            [
                Element { key: vec![10, 0, 0, 0], end: false },
                Element { key: vec![10, 0, 1, 0], end: true },
                Element { key: vec![255, 255, 255, 0], end: false },
            ]
        );
        let all6 = elements(KeyKind::Addr(Family::V6), &merge_cidrs(Family::V6, &[cidr("::/0")]));
        assert_eq!(all6, [Element { key: vec![0; 16], end: false }]);
        let ports = elements(
            KeyKind::Port,
            &[Interval { first: 80, last: 80 }, Interval { first: 1000, last: 65535 }],
        );
        assert_eq!(
            ports,
            [
                Element { key: vec![0, 80], end: false },
                Element { key: vec![0, 81], end: true },
                Element { key: vec![3, 232], end: false },
            ]
        );
    }

    #[test]
    fn element_diff_is_exact() {
        let v4 = KeyKind::Addr(Family::V4);
        let els = |list: &[&str]| {
            let cidrs: Vec<Cidr> = list.iter().map(|c| cidr(c)).collect();
            elements(v4, &merge_cidrs(Family::V4, &cidrs))
        };
        // Growing an interval moves only its end marker.
        let d = element_diff(&els(&["10.0.0.0/24"]), &els(&["10.0.0.0/24", "10.0.1.0/24"]));
        assert_eq!(d.remove, [Element { key: vec![10, 0, 1, 0], end: true }]);
        assert_eq!(d.add, [Element { key: vec![10, 0, 2, 0], end: true }]);
        // Filling a gap joins two intervals: the inner markers go.
        let d = element_diff(
            &els(&["10.0.0.0/24", "10.0.2.0/24"]),
            &els(&["10.0.0.0/24", "10.0.1.0/24", "10.0.2.0/24"]),
        );
        assert_eq!(
            d.remove,
            [Element { key: vec![10, 0, 1, 0], end: true }, Element { key: vec![10, 0, 2, 0], end: false }]
        );
        assert!(d.add.is_empty());
        // A covered addition changes nothing.
        assert!(element_diff(&els(&["10.0.0.0/16"]), &els(&["10.0.0.0/16", "10.0.3.0/24"])).is_empty());
        // Applying the diff to the installed set yields exactly the wanted set.
        let (have, want) = (els(&["10.0.0.0/24", "10.5.0.0/16"]), els(&["10.0.0.0/23", "10.7.0.1/32"]));
        let d = element_diff(&have, &want);
        let mut result: BTreeSet<Element> = have.into_iter().collect();
        for e in &d.remove {
            assert!(result.remove(e), "removes only installed elements");
        }
        for e in d.add {
            assert!(result.insert(e), "adds only absent elements");
        }
        assert_eq!(result.into_iter().collect::<Vec<_>>(), want);
    }

    #[test]
    fn peer_only_changes_are_element_updates() {
        let a = sample(Mode::Enforcement);
        let b = WorkloadPolicy::new(
            8,
            Mode::Enforcement,
            a.rules().map(|r| {
                if r.id().as_str() == "dns/udp" {
                    ResolvedRule::new(r.id().clone(), r.ports().iter().copied(), [cidr("192.0.2.8/32")])
                        .unwrap()
                } else {
                    r.clone()
                }
            }),
        )
        .unwrap();
        let (da, db) = (DesiredTable::from_policy(&a), DesiredTable::from_policy(&b));
        let update = db.element_update_from(&da).expect("same shape");
        assert_eq!(update.keys().collect::<Vec<_>>(), ["r1_v4"]);
        let d = &update["r1_v4"];
        assert_eq!(d.remove.len(), 2);
        assert_eq!(d.add.len(), 2);
        // A mode change or a port change is not.
        let sim = a.clone().with_version(9);
        let sim = WorkloadPolicy::new(9, Mode::Simulation, sim.rules().cloned()).unwrap();
        assert!(DesiredTable::from_policy(&sim).element_update_from(&da).is_none());
    }
}
