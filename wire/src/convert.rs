//! The one boundary between generated protobuf types and the domain model. Everything that
//! arrives from the wire is validated here; domain code never sees a prost `oneof`.

use std::collections::BTreeSet;

use prost::Message;

use crate::policy::{
    Change, Cidr, Mode, PolicyDelta, PolicyError, PortRange, Protocol, ResolvedRule, RuleId, WorkloadPolicy,
};
use crate::proto;

impl From<Mode> for proto::EnforcementMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Visibility => proto::EnforcementMode::Visibility,
            Mode::Simulation => proto::EnforcementMode::Simulation,
            Mode::Enforcement => proto::EnforcementMode::Enforcement,
        }
    }
}

/// Decodes an enum field, refusing unknown and unspecified values.
pub fn mode_from_wire(field: &'static str, value: i32) -> Result<Mode, PolicyError> {
    match proto::EnforcementMode::try_from(value) {
        Ok(proto::EnforcementMode::Visibility) => Ok(Mode::Visibility),
        Ok(proto::EnforcementMode::Simulation) => Ok(Mode::Simulation),
        Ok(proto::EnforcementMode::Enforcement) => Ok(Mode::Enforcement),
        Ok(proto::EnforcementMode::Unspecified) | Err(_) => Err(PolicyError::Enum { field, value }),
    }
}

impl From<Protocol> for proto::Protocol {
    fn from(protocol: Protocol) -> Self {
        match protocol {
            Protocol::Tcp => proto::Protocol::Tcp,
            Protocol::Udp => proto::Protocol::Udp,
            Protocol::Icmp => proto::Protocol::Icmp,
            Protocol::Icmpv6 => proto::Protocol::Icmpv6,
        }
    }
}

pub fn protocol_from_wire(field: &'static str, value: i32) -> Result<Protocol, PolicyError> {
    match proto::Protocol::try_from(value) {
        Ok(proto::Protocol::Tcp) => Ok(Protocol::Tcp),
        Ok(proto::Protocol::Udp) => Ok(Protocol::Udp),
        Ok(proto::Protocol::Icmp) => Ok(Protocol::Icmp),
        Ok(proto::Protocol::Icmpv6) => Ok(Protocol::Icmpv6),
        Ok(proto::Protocol::Unspecified) | Err(_) => Err(PolicyError::Enum { field, value }),
    }
}

fn cidrs_to_wire<'a>(cidrs: impl IntoIterator<Item = &'a Cidr>) -> Vec<String> {
    cidrs.into_iter().map(ToString::to_string).collect()
}

fn cidrs_from_wire(texts: &[String]) -> Result<BTreeSet<Cidr>, PolicyError> {
    texts.iter().map(|t| Cidr::parse(t)).collect()
}

impl From<&ResolvedRule> for proto::ResolvedRule {
    fn from(rule: &ResolvedRule) -> Self {
        proto::ResolvedRule {
            rule_id: rule.id().to_string(),
            peer_cidrs: cidrs_to_wire(rule.peers()),
            protocol: proto::Protocol::from(rule.protocol()).into(),
            ports: rule
                .ports()
                .iter()
                .map(|p| proto::PortRange { start: p.start().into(), end: p.end().into() })
                .collect(),
        }
    }
}

impl TryFrom<&proto::ResolvedRule> for ResolvedRule {
    type Error = PolicyError;

    fn try_from(wire: &proto::ResolvedRule) -> Result<Self, PolicyError> {
        let id = RuleId::parse(&wire.rule_id)?;
        let protocol = protocol_from_wire("resolved_rule.protocol", wire.protocol)?;
        if protocol != id.protocol() {
            return Err(PolicyError::ProtocolMismatch {
                rule: wire.rule_id.clone(),
                protocol: protocol.to_string(),
            });
        }
        let ports =
            wire.ports.iter().map(|p| PortRange::new(p.start, p.end)).collect::<Result<Vec<_>, _>>()?;
        ResolvedRule::new(id, ports, cidrs_from_wire(&wire.peer_cidrs)?)
    }
}

impl From<&WorkloadPolicy> for proto::WorkloadPolicy {
    fn from(policy: &WorkloadPolicy) -> Self {
        proto::WorkloadPolicy {
            version: policy.version(),
            mode: proto::EnforcementMode::from(policy.mode()).into(),
            inbound_rules: policy.rules().map(Into::into).collect(),
        }
    }
}

impl TryFrom<&proto::WorkloadPolicy> for WorkloadPolicy {
    type Error = PolicyError;

    fn try_from(wire: &proto::WorkloadPolicy) -> Result<Self, PolicyError> {
        let rules = wire.inbound_rules.iter().map(ResolvedRule::try_from).collect::<Result<Vec<_>, _>>()?;
        WorkloadPolicy::new(wire.version, mode_from_wire("policy.mode", wire.mode)?, rules)
    }
}

impl WorkloadPolicy {
    /// Deterministic serialization of the canonical form (POL-3): equal policies, equal bytes.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        proto::WorkloadPolicy::from(self).encode_to_vec()
    }

    /// Decodes bytes written by [`WorkloadPolicy::canonical_bytes`], refusing anything else.
    pub fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, PolicyError> {
        let policy = WorkloadPolicy::try_from(&proto::WorkloadPolicy::decode(bytes)?)?;
        if policy.canonical_bytes() != bytes {
            return Err(PolicyError::NotCanonical);
        }
        Ok(policy)
    }
}

impl From<&Change> for proto::DeltaChange {
    fn from(change: &Change) -> Self {
        use proto::delta_change::Change as W;
        let peer_change = |rule: &RuleId, peers| proto::PeerChange {
            rule_id: rule.to_string(),
            peer_cidrs: cidrs_to_wire(peers),
        };
        let change = match change {
            Change::UpsertRule(rule) => W::UpsertRule(rule.into()),
            Change::RemoveRule(id) => W::RemoveRuleId(id.to_string()),
            Change::AddPeers { rule, peers } => W::AddPeers(peer_change(rule, peers)),
            Change::RemovePeers { rule, peers } => W::RemovePeers(peer_change(rule, peers)),
            Change::SetMode(mode) => W::SetMode(proto::EnforcementMode::from(*mode).into()),
        };
        proto::DeltaChange { change: Some(change) }
    }
}

impl TryFrom<&proto::DeltaChange> for Change {
    type Error = PolicyError;

    fn try_from(wire: &proto::DeltaChange) -> Result<Self, PolicyError> {
        use proto::delta_change::Change as W;
        Ok(match wire.change.as_ref().ok_or(PolicyError::Missing { field: "delta_change.change" })? {
            W::UpsertRule(rule) => Change::UpsertRule(rule.try_into()?),
            W::RemoveRuleId(id) => Change::RemoveRule(RuleId::parse(id)?),
            W::AddPeers(pc) => Change::AddPeers {
                rule: RuleId::parse(&pc.rule_id)?,
                peers: cidrs_from_wire(&pc.peer_cidrs)?,
            },
            W::RemovePeers(pc) => Change::RemovePeers {
                rule: RuleId::parse(&pc.rule_id)?,
                peers: cidrs_from_wire(&pc.peer_cidrs)?,
            },
            W::SetMode(mode) => Change::SetMode(mode_from_wire("delta_change.set_mode", *mode)?),
        })
    }
}

impl From<&PolicyDelta> for proto::PolicyDelta {
    fn from(delta: &PolicyDelta) -> Self {
        proto::PolicyDelta {
            from_version: delta.from_version,
            to_version: delta.to_version,
            changes: delta.changes.iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<&proto::PolicyDelta> for PolicyDelta {
    type Error = PolicyError;

    fn try_from(wire: &proto::PolicyDelta) -> Result<Self, PolicyError> {
        Ok(PolicyDelta {
            from_version: wire.from_version,
            to_version: wire.to_version,
            changes: wire.changes.iter().map(Change::try_from).collect::<Result<_, _>>()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire_rule(
        id: &str,
        protocol: proto::Protocol,
        peers: &[&str],
        ports: &[(u32, u32)],
    ) -> proto::ResolvedRule {
        proto::ResolvedRule {
            rule_id: id.into(),
            peer_cidrs: peers.iter().map(|s| s.to_string()).collect(),
            protocol: protocol.into(),
            ports: ports.iter().map(|&(start, end)| proto::PortRange { start, end }).collect(),
        }
    }

    #[test]
    fn wire_rules_are_validated_at_the_boundary() {
        use proto::Protocol::*;
        let check = |rule: proto::ResolvedRule, want: &str| {
            let got = ResolvedRule::try_from(&rule).map(|_| ()).map_err(|e| e.to_string());
            match got {
                Ok(()) => assert_eq!(want, "", "{rule:?} was accepted"),
                Err(e) => assert!(!want.is_empty() && e.contains(want), "{rule:?}: {e} lacks {want:?}"),
            }
        };
        check(wire_rule("r/tcp", Tcp, &["10.0.0.0/8"], &[(443, 443)]), "");
        check(wire_rule("r/tcp", Tcp, &["10.0.0.1/8"], &[(443, 443)]), "host bits are set");
        check(wire_rule("r/tcp", Tcp, &["banana"], &[(443, 443)]), "cidr \"banana\"");
        check(wire_rule("r/tcp", Udp, &[], &[(443, 443)]), "protocol field says udp");
        check(wire_rule("r/tcp", Unspecified, &[], &[(443, 443)]), "unknown or unspecified enum value 0");
        check(wire_rule("r/tcp", Tcp, &[], &[(0, 10)]), "port 0");
        check(wire_rule("r/tcp", Tcp, &[], &[(10, 70000)]), "up to 65535");
        check(wire_rule("r/tcp", Tcp, &[], &[(20, 10)]), "start is after end");
        check(wire_rule("r/tcp", Tcp, &[], &[]), "need at least one port range");
        check(wire_rule("r/icmp", Icmp, &[], &[(1, 1)]), "take no ports");
        let mut unknown_enum = wire_rule("r/tcp", Tcp, &[], &[(1, 1)]);
        unknown_enum.protocol = 99;
        check(unknown_enum, "enum value 99");
    }

    #[test]
    fn empty_oneof_and_unknown_mode_are_malformed() {
        let delta = proto::PolicyDelta {
            from_version: 1,
            to_version: 2,
            changes: vec![proto::DeltaChange { change: None }],
        };
        assert_eq!(PolicyDelta::try_from(&delta), Err(PolicyError::Missing { field: "delta_change.change" }));
        let delta = proto::PolicyDelta {
            from_version: 1,
            to_version: 2,
            changes: vec![proto::DeltaChange { change: Some(proto::delta_change::Change::SetMode(7)) }],
        };
        assert!(matches!(PolicyDelta::try_from(&delta), Err(PolicyError::Enum { value: 7, .. })));
    }

    #[test]
    fn non_canonical_bytes_are_refused() {
        let unsorted = proto::WorkloadPolicy {
            version: 3,
            mode: proto::EnforcementMode::Enforcement.into(),
            inbound_rules: vec![
                wire_rule("b/tcp", proto::Protocol::Tcp, &[], &[(1, 1)]),
                wire_rule("a/tcp", proto::Protocol::Tcp, &["10.0.0.0/8", "1.0.0.0/8"], &[(2, 2), (1, 1)]),
            ],
        };
        let bytes = unsorted.encode_to_vec();
        assert_eq!(WorkloadPolicy::from_canonical_bytes(&bytes), Err(PolicyError::NotCanonical));
        let policy = WorkloadPolicy::try_from(&unsorted).unwrap();
        let canonical = policy.canonical_bytes();
        assert_ne!(canonical, bytes);
        assert_eq!(WorkloadPolicy::from_canonical_bytes(&canonical), Ok(policy));
        assert!(matches!(WorkloadPolicy::from_canonical_bytes(&[0xff, 0xff]), Err(PolicyError::Decode(_))));
    }
}
