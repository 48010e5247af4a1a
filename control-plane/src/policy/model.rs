//! The authored policy model (POL-1) and the registry the renderer reads: plain data, validated
//! on construction, no I/O. The store loads these from Postgres; the CLI parses them from flags
//! and files.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelError, LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, PolicyError, PortRange, Protocol, merge_ports};
use uuid::Uuid;

/// Names of services, address groups, rulesets and rules: 1–63 of `[a-z0-9._-]`, starting and
/// ending with a letter or digit, so they are safe in tables, URLs and file names.
pub fn validate_name(what: &'static str, name: &str) -> Result<(), ModelError> {
    let ok_edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c))
        && ok_edge(name.chars().next())
        && ok_edge(name.chars().last());
    if ok { Ok(()) } else { Err(ModelError::Name { what, name: name.to_owned() }) }
}

/// The id of a rule new to its ruleset: derived from the two names (a UUID of RFC 9562's
/// custom version 8, from SHA-256), not drawn at random, so a draft that renders a new rule
/// without committing shows the very rule ids (and so the very deltas) its commit persists. An
/// existing rule keeps its stored id.
pub fn new_rule_id(ruleset: &str, rule: &str) -> Uuid {
    let mut input = Vec::with_capacity(ruleset.len() + rule.len() + 20);
    input.extend_from_slice(b"innerwall-rule\0");
    input.extend_from_slice(ruleset.as_bytes());
    input.push(0);
    input.extend_from_slice(rule.as_bytes());
    let digest = ring::digest::digest(&ring::digest::SHA256, &input);
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest.as_ref()[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// `key in (v1, v2…)` matches, ANDed. The empty selector matches nothing (POL-1).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Selector {
    matches: BTreeMap<LabelKey, BTreeSet<LabelValue>>,
}

impl Selector {
    pub fn new(matches: BTreeMap<LabelKey, BTreeSet<LabelValue>>) -> Result<Self, ModelError> {
        if let Some((key, _)) = matches.iter().find(|(_, values)| values.is_empty()) {
            return Err(ModelError::EmptyMatch { key: key.to_string() });
        }
        Ok(Selector { matches })
    }

    /// Parses `key=v1|v2,key2=v3` … written as a map from key to values by the file format.
    pub fn from_strings(
        matches: impl IntoIterator<Item = (String, Vec<String>)>,
    ) -> Result<Self, ModelError> {
        let mut map: BTreeMap<LabelKey, BTreeSet<LabelValue>> = BTreeMap::new();
        for (key, values) in matches {
            let key = LabelKey::new(&key)?;
            let values = values.iter().map(|v| LabelValue::new(v)).collect::<Result<BTreeSet<_>, _>>()?;
            map.entry(key).or_default().extend(values);
        }
        Self::new(map)
    }

    pub fn matches(&self) -> &BTreeMap<LabelKey, BTreeSet<LabelValue>> {
        &self.matches
    }

    pub fn is_empty(&self) -> bool {
        self.matches.is_empty()
    }

    /// True when every key is present with one of its values. Never true for the empty selector.
    pub fn selects(&self, labels: &BTreeMap<LabelKey, LabelValue>) -> bool {
        !self.matches.is_empty()
            && self.matches.iter().all(|(key, values)| labels.get(key).is_some_and(|v| values.contains(v)))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.matches.is_empty() {
            return f.write_str("(matches nothing)");
        }
        let parts: Vec<String> = self
            .matches
            .iter()
            .map(|(k, vs)| {
                let vs: Vec<&str> = vs.iter().map(LabelValue::as_str).collect();
                format!("{k} in ({})", vs.join(", "))
            })
            .collect();
        f.write_str(&parts.join(" and "))
    }
}

/// One (protocol, port ranges) entry of a service. ICMP and ICMPv6 take no ports.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServiceEntry {
    pub protocol: Protocol,
    pub ports: Vec<PortRange>,
}

impl ServiceEntry {
    pub fn new(protocol: Protocol, ports: Vec<PortRange>) -> Result<Self, ModelError> {
        match (protocol.has_ports(), ports.is_empty()) {
            (true, true) => Err(ModelError::Entry {
                text: protocol.to_string(),
                reason: "tcp and udp need ports (1-65535 for all)",
            }),
            (false, false) => {
                Err(ModelError::Entry { text: protocol.to_string(), reason: "icmp and icmpv6 take no ports" })
            }
            _ => Ok(ServiceEntry { protocol, ports }),
        }
    }

    /// Parses `tcp:80,443,8000-8080`, `udp:53`, `tcp:all`, `icmp`, `icmpv6`.
    pub fn parse(text: &str) -> Result<Self, ModelError> {
        let bad = |reason| ModelError::Entry { text: text.to_owned(), reason };
        let (proto, ports) = match text.split_once(':') {
            Some((p, ports)) => (p, Some(ports)),
            None => (text, None),
        };
        let protocol: Protocol =
            proto.trim().parse().map_err(|_| bad("protocol must be tcp, udp, icmp or icmpv6"))?;
        let ports = match ports {
            None => Vec::new(),
            Some(list) if list.trim() == "all" => vec![PortRange::ALL],
            Some(list) => list.split(',').map(parse_port_range).collect::<Result<Vec<_>, _>>()?,
        };
        Self::new(protocol, ports)
    }
}

impl fmt::Display for ServiceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ports.is_empty() {
            return write!(f, "{}", self.protocol);
        }
        let ports: Vec<String> = self.ports.iter().map(ToString::to_string).collect();
        write!(f, "{}:{}", self.protocol, ports.join(","))
    }
}

fn parse_port_range(text: &str) -> Result<PortRange, ModelError> {
    let text = text.trim();
    let num = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|_| ModelError::Entry { text: text.to_owned(), reason: "ports are numbers 1-65535" })
    };
    let (start, end) = match text.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(text)?, num(text)?),
    };
    Ok(PortRange::new(start, end)?)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub id: Uuid,
    pub name: String,
    pub entries: Vec<ServiceEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressGroup {
    pub id: Uuid,
    pub name: String,
    pub cidrs: BTreeSet<Cidr>,
}

/// Who a rule admits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Peer {
    /// Managed workloads, as host routes of their current addresses.
    Workloads(Selector),
    AddressGroup(Uuid),
    Cidr(Cidr),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Stable across edits of its ruleset (kept by rule name); the prefix of resolved rule ids.
    pub id: Uuid,
    pub name: String,
    pub enabled: bool,
    pub peers: Vec<Peer>,
    pub services: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    pub id: Uuid,
    pub name: String,
    pub enabled: bool,
    pub scope: Selector,
    pub rules: Vec<Rule>,
}

/// Everything an operator authored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthoredModel {
    pub services: BTreeMap<Uuid, Service>,
    pub address_groups: BTreeMap<Uuid, AddressGroup>,
    pub rulesets: Vec<Ruleset>,
    /// The estate's management access (`serve --management-cidr`); none until one is set.
    pub management: Option<Management>,
    /// Workloads whose management access was narrowed from the estate's.
    pub management_of: BTreeMap<WorkloadId, Management>,
    /// Workloads pinned to an earlier version's authored source by a rollback: rendered from it
    /// (against the registry as it is), not from the rulesets above, until unpinned.
    pub pinned: BTreeMap<WorkloadId, Pin>,
    /// Staged rulesets (issue 31, FLOW-10), in name order: evaluated beside the rulesets above,
    /// never enforced, until promoted.
    pub staged: Vec<StagedRuleset>,
}

/// A staged ruleset: the ruleset it would become (or a new one), and its stage number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedRuleset {
    pub stage: i64,
    pub ruleset: Ruleset,
}

/// A rollback's pin: the stored source (by its digest) and the model it renders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub digest: Vec<u8>,
    pub model: AuthoredModel,
}

impl AuthoredModel {
    /// The management access `workload` keeps whatever its policy says: its own narrowing, or
    /// the estate's.
    pub fn management_for(&self, workload: &WorkloadId) -> Option<&Management> {
        self.management_of.get(workload).or(self.management.as_ref())
    }
}

/// The authored id of the failsafe rule every workload's render carries (issue 31, no
/// lock-out): `failsafe:management/<protocol>` in the rendered policy and in flow records. No
/// authored rule can have it (theirs are uuids).
pub const FAILSAFE_RULE: &str = "failsafe:management";
/// Most source ranges management access may name.
pub const MAX_MANAGEMENT_CIDRS: usize = 64;

/// Management access (issue 31, no lock-out): sources and the services they reach on every
/// workload, whatever its policy says, rendered as the failsafe rule. It can be narrowed (fewer
/// or smaller ranges, fewer ports) by an admin, never widened or removed but by whoever holds
/// the database (`innerwall management reset`). Canonical: ports merged per protocol.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Management {
    cidrs: BTreeSet<Cidr>,
    services: BTreeMap<Protocol, Vec<PortRange>>,
}

impl Management {
    pub fn new(
        cidrs: impl IntoIterator<Item = Cidr>,
        services: impl IntoIterator<Item = ServiceEntry>,
    ) -> Result<Self, ModelError> {
        let cidrs: BTreeSet<Cidr> = cidrs.into_iter().collect();
        let mut by_protocol: BTreeMap<Protocol, Vec<PortRange>> = BTreeMap::new();
        for entry in services {
            by_protocol.entry(entry.protocol).or_default().extend(entry.ports);
        }
        let bad = |reason: String| Err(ModelError::Management(reason));
        if cidrs.is_empty() || by_protocol.is_empty() {
            return bad("management access needs at least one source range and one service".into());
        }
        if cidrs.len() > MAX_MANAGEMENT_CIDRS {
            return bad(format!("management access names at most {MAX_MANAGEMENT_CIDRS} source ranges"));
        }
        let services = by_protocol.into_iter().map(|(p, ports)| (p, merge_ports(ports))).collect();
        Ok(Management { cidrs, services })
    }

    pub fn cidrs(&self) -> &BTreeSet<Cidr> {
        &self.cidrs
    }

    /// The services, one entry per protocol, ports merged.
    pub fn services(&self) -> Vec<ServiceEntry> {
        self.services
            .iter()
            .map(|(&protocol, ports)| ServiceEntry { protocol, ports: ports.clone() })
            .collect()
    }

    /// Whether this admits nothing `wider` does not: every range inside one of its ranges, every
    /// service's protocol in it with every port inside one of its port ranges. Otherwise the
    /// first thing outside, said.
    pub fn within(&self, wider: &Management) -> Result<(), String> {
        for cidr in &self.cidrs {
            if !wider.cidrs.iter().any(|w| w.net().contains(&cidr.net())) {
                return Err(format!("source range {cidr} is outside every range of the current set"));
            }
        }
        for (protocol, ports) in &self.services {
            let Some(outer) = wider.services.get(protocol) else {
                return Err(format!("{protocol} is not a service of the current set"));
            };
            if let Some(port) =
                ports.iter().find(|p| !outer.iter().any(|o| o.start() <= p.start() && p.end() <= o.end()))
            {
                return Err(format!("{protocol} port {port} is outside the current set's ports"));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Management {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cidrs: Vec<String> = self.cidrs.iter().map(ToString::to_string).collect();
        let services: Vec<String> = self.services().iter().map(ToString::to_string).collect();
        write!(f, "{} from {}", services.join(" "), cidrs.join(" "))
    }
}

/// A live (not retired) workload as the renderer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredWorkload {
    pub id: WorkloadId,
    pub mode: Mode,
    /// The confirm deadline of a pending promotion to enforcement (FLOW-11), unix milliseconds:
    /// rendered into the policy, held by the agent.
    pub revert_at: Option<i64>,
    pub labels: BTreeMap<LabelKey, LabelValue>,
    pub addresses: BTreeSet<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error(
        "{what} name {name:?} must be 1-63 characters of a-z 0-9 . _ -, starting and ending with a letter or digit"
    )]
    Name { what: &'static str, name: String },
    #[error("selector key {key} lists no values; write at least one")]
    EmptyMatch { key: String },
    #[error("service entry {text:?}: {reason}")]
    Entry { text: String, reason: &'static str },
    #[error("{0}")]
    Management(String),
    #[error(transparent)]
    Label(#[from] LabelError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl From<ModelError> for crate::error::Error {
    fn from(e: ModelError) -> Self {
        crate::error::Error::InvalidInput(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<LabelKey, LabelValue> {
        pairs.iter().map(|(k, v)| (LabelKey::new(k).unwrap(), LabelValue::new(v).unwrap())).collect()
    }

    fn selector(pairs: &[(&str, &[&str])]) -> Selector {
        Selector::from_strings(
            pairs.iter().map(|(k, vs)| (k.to_string(), vs.iter().map(|v| v.to_string()).collect())),
        )
        .unwrap()
    }

    #[test]
    fn selector_semantics() {
        let web = labels(&[("app", "web"), ("env", "prod")]);
        let check = |sel: &Selector, want: bool| assert_eq!(sel.selects(&web), want, "{sel}");
        check(&Selector::default(), false);
        check(&selector(&[("app", &["web"])]), true);
        check(&selector(&[("app", &["db", "web"])]), true);
        check(&selector(&[("app", &["web"]), ("env", &["prod"])]), true);
        check(&selector(&[("app", &["web"]), ("env", &["dev"])]), false);
        check(&selector(&[("tier", &["web"])]), false);
        assert!(matches!(
            Selector::from_strings([("app".to_string(), vec![])]),
            Err(ModelError::EmptyMatch { .. })
        ));
        assert!(Selector::from_strings([("-app".to_string(), vec!["x".into()])]).is_err());
    }

    #[test]
    fn service_entries_parse_and_refuse_nonsense() {
        let ok = |t: &str, shown: &str| assert_eq!(ServiceEntry::parse(t).unwrap().to_string(), shown);
        ok("tcp:443", "tcp:443");
        ok("tcp:80,8000-8080", "tcp:80,8000-8080");
        ok("udp:all", "udp:1-65535");
        ok("icmp", "icmp");
        ok("icmpv6", "icmpv6");
        for (bad, why) in [
            ("tcp", "need ports"),
            ("icmp:8", "take no ports"),
            ("sctp:1", "protocol must be"),
            ("tcp:0", "port 0"),
            ("tcp:65536", "65535"),
            ("tcp:90-80", "start is after end"),
            ("tcp:http", "numbers"),
            ("tcp:", "numbers"),
        ] {
            let e = ServiceEntry::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn names_are_restricted() {
        assert!(validate_name("service", "postgres-15.main_a").is_ok());
        for bad in ["", "Postgres", "-x", "x-", "a b", "ä", &"a".repeat(64)] {
            assert!(validate_name("service", bad).is_err(), "{bad}");
        }
    }
}
