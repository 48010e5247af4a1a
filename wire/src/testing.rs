//! Test fixtures shared by every crate's tests (feature `testing`): one builder per fixture, so a
//! change to the policy model changes one place.

use crate::policy::{Cidr, Mode, PortRange, Protocol, ResolvedRule, RuleId, Version, WorkloadPolicy};

/// A policy of TCP rules `r<port>/tcp`, one per port, with no peers: enough for tests of
/// versions, diffs and the stream, where only "something changed" matters.
pub fn policy(version: Version, mode: Mode, ports: &[u16]) -> WorkloadPolicy {
    WorkloadPolicy::new(
        version,
        mode,
        ports.iter().map(|&p| rule(&format!("r{p}"), Protocol::Tcp, &[p], &[])),
    )
    .expect("a valid test policy")
}

/// One resolved rule `<name>/<protocol>` with single ports and canonical peers.
pub fn rule(name: &str, protocol: Protocol, ports: &[u16], peers: &[&str]) -> ResolvedRule {
    ResolvedRule::new(
        RuleId::new(name, protocol).expect("a valid test rule id"),
        ports.iter().map(|&p| PortRange::single(p).expect("a valid test port")),
        peers.iter().map(|c| Cidr::parse(c).expect("a canonical test cidr")),
    )
    .expect("a valid test rule")
}
