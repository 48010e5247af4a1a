//! The one boundary between generated protobuf types and the domain model. Everything that
//! arrives from the wire is validated here; domain code never sees a prost `oneof`, and no
//! code outside this file knows a protobuf enum number (the database stores those numbers, so
//! the store converts through [`WireEnum`] too).

use std::collections::BTreeSet;
use std::net::IpAddr;

use prost::Message;

use crate::flows::{Decision, EvidenceGap, FlowError, FlowRecord, FlowWindow, GapKind};
use crate::identity::{AgentInfo, HostFacts, NetworkInterface, OsInfo};
use crate::policy::{
    Change, Cidr, Mode, PolicyDelta, PolicyError, PortRange, Protocol, ResolvedRule, RuleId, Staged, Version,
    WorkloadPolicy,
};
use crate::proto;
use crate::sync::{
    Ack, AckStatus, AgentMessage, ControlMessage, Directive, Heartbeat, Hello, HelloAck, Inventory,
    ListeningService, MAX_ACK_DETAIL, MAX_CAPABILITIES, MAX_CAPABILITY, MAX_RENEWAL_ERROR, MAX_TAMPER_DETAIL,
    MAX_TAMPER_REPORTS, SyncState, TamperEvent, Update,
};

/// A domain enum with a protobuf counterpart. Its number is what travels on the wire and what
/// the database stores; `UNSPECIFIED` (0) and unknown numbers are refused.
pub trait WireEnum: Sized + Copy {
    /// What the enum is, for error messages ("mode", "protocol", …).
    const WHAT: &'static str;
    fn number(self) -> i32;
    fn from_number(field: &'static str, value: i32) -> Result<Self, PolicyError>;

    /// The number as the schema's `smallint` columns hold it.
    fn code(self) -> i16 {
        i16::try_from(self.number()).expect("protobuf enum numbers here are small")
    }

    /// Decodes a stored `smallint`.
    fn from_code(code: i16) -> Result<Self, PolicyError> {
        Self::from_number(Self::WHAT, i32::from(code))
    }
}

/// Maps a domain enum one to one onto a prost enum (whose `Unspecified` is never a domain value).
macro_rules! wire_enum {
    ($domain:ty, $wire:ty, $what:literal, { $($d:ident <=> $w:ident),+ $(,)? }) => {
        impl From<$domain> for $wire {
            fn from(value: $domain) -> Self {
                match value { $(<$domain>::$d => <$wire>::$w),+ }
            }
        }

        impl WireEnum for $domain {
            const WHAT: &'static str = $what;

            fn number(self) -> i32 {
                <$wire>::from(self) as i32
            }

            fn from_number(field: &'static str, value: i32) -> Result<Self, PolicyError> {
                match <$wire>::try_from(value) {
                    $(Ok(<$wire>::$w) => Ok(<$domain>::$d),)+
                    _ => Err(PolicyError::Enum { field, value }),
                }
            }
        }
    };
}

wire_enum!(Mode, proto::EnforcementMode, "mode", {
    Visibility <=> Visibility, Simulation <=> Simulation, Enforcement <=> Enforcement,
});
wire_enum!(Protocol, proto::Protocol, "protocol", { Tcp <=> Tcp, Udp <=> Udp, Icmp <=> Icmp, Icmpv6 <=> Icmpv6 });
wire_enum!(SyncState, proto::SyncState, "sync state", {
    Pending <=> Pending, Synced <=> Synced, Degraded <=> Degraded, Offline <=> Offline,
    Suspended <=> Suspended,
});
wire_enum!(Decision, proto::FlowDecision, "decision", {
    Observed <=> Observed, Allowed <=> Allowed, WouldBlock <=> WouldBlock, Blocked <=> Blocked,
});
wire_enum!(GapKind, proto::EvidenceGapKind, "gap kind", {
    MapFull <=> MapFull,
    AgentRestart <=> AgentRestart,
    UploadBufferOverflow <=> UploadBufferOverflow,
    WindowKeyOverflow <=> WindowKeyOverflow,
    UploadRefused <=> UploadRefused,
    CaptureUnavailable <=> CaptureUnavailable,
    QueueFailed <=> QueueFailed,
    SuspectDirection <=> SuspectDirection,
});

fn cidrs_to_wire<'a>(cidrs: impl IntoIterator<Item = &'a Cidr>) -> Vec<String> {
    cidrs.into_iter().map(Cidr::text).collect()
}

fn cidrs_from_wire(texts: &[String]) -> Result<BTreeSet<Cidr>, PolicyError> {
    texts.iter().map(|t| Cidr::parse(t)).collect()
}

impl From<&ResolvedRule> for proto::ResolvedRule {
    fn from(rule: &ResolvedRule) -> Self {
        proto::ResolvedRule {
            rule_id: rule.id().as_str().to_owned(),
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
        let protocol = Protocol::from_number("resolved_rule.protocol", wire.protocol)?;
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
            revert_at_unix_ms: policy.revert_at().unwrap_or(0),
            staged: policy.staged().map(Into::into),
        }
    }
}

impl TryFrom<&proto::WorkloadPolicy> for WorkloadPolicy {
    type Error = PolicyError;

    fn try_from(wire: &proto::WorkloadPolicy) -> Result<Self, PolicyError> {
        let rules = wire.inbound_rules.iter().map(ResolvedRule::try_from).collect::<Result<Vec<_>, _>>()?;
        let revert_at = (wire.revert_at_unix_ms != 0).then_some(wire.revert_at_unix_ms);
        let staged = wire.staged.as_ref().map(Staged::try_from).transpose()?;
        Ok(WorkloadPolicy::new(wire.version, Mode::from_number("policy.mode", wire.mode)?, rules)?
            .with_revert_at(revert_at)?
            .with_staged(staged))
    }
}

impl From<&Staged> for proto::StagedRules {
    fn from(staged: &Staged) -> Self {
        proto::StagedRules {
            set: staged.set().to_owned(),
            upserts: staged.upserts().map(Into::into).collect(),
            removals: staged.removals().map(ToString::to_string).collect(),
        }
    }
}

impl TryFrom<&proto::StagedRules> for Staged {
    type Error = PolicyError;

    fn try_from(wire: &proto::StagedRules) -> Result<Self, PolicyError> {
        let upserts = wire.upserts.iter().map(ResolvedRule::try_from).collect::<Result<Vec<_>, _>>()?;
        let removals = wire.removals.iter().map(|id| RuleId::parse(id)).collect::<Result<Vec<_>, _>>()?;
        Staged::new(&wire.set, upserts, removals)
    }
}

/// A delta's staged set: a message with an empty set id clears it.
fn staged_from_wire(wire: &proto::StagedRules) -> Result<Option<Staged>, PolicyError> {
    match wire.set.is_empty() && wire.upserts.is_empty() && wire.removals.is_empty() {
        true => Ok(None),
        false => Staged::try_from(wire).map(Some),
    }
}

impl WorkloadPolicy {
    /// Deterministic serialization of the canonical form (POL-3): equal policies, equal bytes.
    /// Exactly the bytes prost writes for [`proto::WorkloadPolicy`], written by [`canonical`]
    /// without building that message first: a render encodes every policy it renders (10,000
    /// distinct policies are 55 MB), and the message's strings, one per peer, were most of it.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        canonical::policy(self, &mut out);
        out
    }

    /// Whether canonical bytes hold a version. The version is field 1 and encodes first, as its
    /// varint tag (1 << 3 = 8), exactly when it is not 0: the bytes of a policy at version 0
    /// (a content, as stores share it) never start with that byte.
    pub fn canonical_bytes_hold_a_version(bytes: &[u8]) -> bool {
        bytes.first() == Some(&Self::VERSION_TAG)
    }

    /// The first byte of the canonical bytes of a policy whose version is not 0.
    pub const VERSION_TAG: u8 = 1 << 3;

    /// Decodes bytes written by [`WorkloadPolicy::canonical_bytes`], refusing anything else.
    pub fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, PolicyError> {
        let policy = WorkloadPolicy::try_from(&proto::WorkloadPolicy::decode(bytes)?)?;
        if policy.canonical_bytes() != bytes {
            return Err(PolicyError::NotCanonical);
        }
        Ok(policy)
    }
}

/// The protobuf encoding of a [`WorkloadPolicy`] as prost writes [`proto::WorkloadPolicy`]
/// (`policy.proto`; proto3: a scalar at its default is omitted, every element of a repeated field
/// and a present message are written, fields in number order), straight from the domain types.
/// `canonical_bytes_are_what_prost_writes` holds it to prost's bytes.
mod canonical {
    use prost::encoding::{WireType, encode_key, encode_varint};

    use super::proto;
    use crate::policy::{ResolvedRule, Staged, WorkloadPolicy};

    /// Bytes a rule's length usually takes: a rule of a few peers to a few hundred is 128 bytes
    /// to 16 KiB long.
    const RULE: usize = 2;

    pub(super) fn policy(policy: &WorkloadPolicy, out: &mut Vec<u8>) {
        varint(1, policy.version(), out);
        varint(2, proto::EnforcementMode::from(policy.mode()) as u64, out);
        for rule in policy.rules() {
            delimited(3, RULE, out, |out| resolved_rule(rule, out));
        }
        // Negative deadlines are refused by the domain type; an int64 would be sign-extended.
        varint(4, policy.revert_at().unwrap_or(0) as u64, out);
        if let Some(staged) = policy.staged() {
            delimited(5, RULE, out, |out| staged_rules(staged, out));
        }
    }

    fn resolved_rule(rule: &ResolvedRule, out: &mut Vec<u8>) {
        string(1, rule.id().as_str().as_bytes(), out);
        for peer in rule.peers() {
            delimited(2, 1, out, |out| peer.push_text(out));
        }
        varint(3, proto::Protocol::from(rule.protocol()) as u64, out);
        for range in rule.ports() {
            delimited(4, 1, out, |out| {
                varint(1, range.start().into(), out);
                varint(2, range.end().into(), out);
            });
        }
    }

    fn staged_rules(staged: &Staged, out: &mut Vec<u8>) {
        string(1, staged.set().as_bytes(), out);
        for rule in staged.upserts() {
            delimited(2, RULE, out, |out| resolved_rule(rule, out));
        }
        for removal in staged.removals() {
            delimited(3, 1, out, |out| out.extend_from_slice(removal.as_str().as_bytes()));
        }
    }

    /// A varint scalar field, omitted at 0.
    fn varint(tag: u32, value: u64, out: &mut Vec<u8>) {
        if value != 0 {
            encode_key(tag, WireType::Varint, out);
            encode_varint(value, out);
        }
    }

    /// A singular string field, omitted when empty.
    fn string(tag: u32, value: &[u8], out: &mut Vec<u8>) {
        if !value.is_empty() {
            delimited(tag, 1, out, |out| out.extend_from_slice(value));
        }
    }

    /// A length-delimited field whose bytes `body` appends: written in place after `room` bytes
    /// for its length (what its kind of field usually needs), which move if it needs another
    /// number of them.
    fn delimited(tag: u32, room: usize, out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
        encode_key(tag, WireType::LengthDelimited, out);
        let at = out.len();
        out.resize(at + room, 0);
        body(out);
        let len = out.len() - at - room;
        let mut prefix = [0u8; 10];
        let mut free = &mut prefix[..];
        encode_varint(len as u64, &mut free);
        let need = 10 - free.len();
        if need == room {
            out[at..at + room].copy_from_slice(&prefix[..need]);
        } else {
            out.splice(at..at + room, prefix[..need].iter().copied());
        }
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
            Change::SetRevertAt(at) => W::SetRevertAtUnixMs(at.unwrap_or(0)),
            Change::SetStaged(staged) => W::SetStaged(staged.as_ref().map(Into::into).unwrap_or_default()),
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
            W::SetMode(mode) => Change::SetMode(Mode::from_number("delta_change.set_mode", *mode)?),
            W::SetStaged(staged) => Change::SetStaged(staged_from_wire(staged)?),
            W::SetRevertAtUnixMs(at) => Change::SetRevertAt(match *at {
                0 => None,
                at if at < 0 => return Err(PolicyError::RevertDeadline { at_ms: at }),
                at => Some(at),
            }),
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

impl From<&FlowRecord> for proto::FlowRecord {
    fn from(r: &FlowRecord) -> Self {
        proto::FlowRecord {
            src_address: r.src.to_string(),
            dst_address: r.dst.to_string(),
            dst_port: u32::from(r.dst_port),
            protocol: r.protocol.number(),
            decision: r.decision.number(),
            matched_rule_id: r.matched_rule.as_ref().map(ToString::to_string).unwrap_or_default(),
            packets: r.packets,
            bytes: r.bytes,
            new_connections: r.new_connections,
            first_seen_unix_ms: r.first_seen_ms,
            last_seen_unix_ms: r.last_seen_ms,
            pending_decision: r.pending.as_ref().map_or(0, |p| p.decision.number()),
            pending_rule_id: r
                .pending
                .as_ref()
                .and_then(|p| p.rule.as_ref())
                .map(ToString::to_string)
                .unwrap_or_default(),
        }
    }
}

impl From<&EvidenceGap> for proto::EvidenceGap {
    fn from(g: &EvidenceGap) -> Self {
        proto::EvidenceGap {
            kind: g.kind.number(),
            from_unix_ms: g.from_ms,
            to_unix_ms: g.to_ms,
            count: g.count,
            detail: g.detail.clone(),
        }
    }
}

impl From<&FlowWindow> for proto::FlowWindow {
    fn from(w: &FlowWindow) -> Self {
        proto::FlowWindow {
            window_id: w.id.to_string(),
            start_unix_ms: w.start_ms,
            end_unix_ms: w.end_ms,
            policy_version: w.policy_version,
            mode: w.mode.number(),
            records: w.records.iter().map(Into::into).collect(),
            gaps: w.gaps.iter().map(Into::into).collect(),
            staged_set: w.staged_set.clone().unwrap_or_default(),
        }
    }
}

fn time(what: &str, ms: i64) -> Result<i64, String> {
    if crate::flows::TIME_RANGE_MS.contains(&ms) {
        Ok(ms)
    } else {
        Err(format!("{what} {ms} is not a valid time (1970 to 9999)"))
    }
}

/// Counters are stored as signed 64-bit numbers.
fn counter(what: &str, n: u64) -> Result<u64, String> {
    i64::try_from(n).map(|_| n).map_err(|_| format!("{what} {n} is out of range"))
}

fn enum_field<E: WireEnum>(value: i32) -> Result<E, String> {
    E::from_number(E::WHAT, value).map_err(|_| format!("unknown {} {value}", E::WHAT))
}

/// Validates a whole window from an agent; the first problem refuses it, naming the record or
/// gap. Addresses are stored in canonical form (an IPv4-mapped IPv6 source is its IPv4 address).
impl TryFrom<&proto::FlowWindow> for FlowWindow {
    type Error = FlowError;

    fn try_from(wire: &proto::FlowWindow) -> Result<Self, FlowError> {
        use crate::flows::{MAX_GAPS, MAX_RECORDS, MAX_WINDOW_MS};
        let id = uuid::Uuid::parse_str(&wire.window_id)
            .map_err(|_| FlowError::Window(format!("window id {:?} is not a uuid", wire.window_id)))?;
        let start_ms = time("window start", wire.start_unix_ms).map_err(FlowError::Window)?;
        let end_ms = time("window end", wire.end_unix_ms).map_err(FlowError::Window)?;
        if start_ms > end_ms || end_ms - start_ms > MAX_WINDOW_MS {
            return Err(FlowError::Window(format!(
                "window [{start_ms}, {end_ms}) ms must be ordered and at most 24 h long"
            )));
        }
        let mode = enum_field::<Mode>(wire.mode).map_err(FlowError::Window)?;
        if wire.records.len() > MAX_RECORDS || wire.gaps.len() > MAX_GAPS {
            return Err(FlowError::Window(format!(
                "a window carries at most {MAX_RECORDS} records and {MAX_GAPS} gaps, not {} and {}",
                wire.records.len(),
                wire.gaps.len()
            )));
        }
        counter("policy version", wire.policy_version).map_err(FlowError::Window)?;
        let staged_set = match wire.staged_set.as_str() {
            "" => None,
            set => {
                crate::policy::check_staged_set(set).map_err(|e| FlowError::Window(e.to_string()))?;
                Some(set.to_owned())
            }
        };
        let records = wire
            .records
            .iter()
            .enumerate()
            .map(|(index, r)| {
                flow_record(r, staged_set.is_some()).map_err(|reason| FlowError::Record { index, reason })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let gaps = wire
            .gaps
            .iter()
            .enumerate()
            .map(|(index, g)| evidence_gap(g).map_err(|reason| FlowError::Gap { index, reason }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FlowWindow {
            id,
            start_ms,
            end_ms,
            policy_version: wire.policy_version,
            mode,
            records,
            gaps,
            staged_set,
        })
    }
}

/// A decision and the rule id that goes with it: present exactly for ALLOWED.
fn decided_by(decision: Decision, rule: &str, what: &str) -> Result<Option<RuleId>, String> {
    let allowed = decision == Decision::Allowed;
    if allowed == rule.is_empty() {
        return Err(format!("a {what} rule id is required exactly for ALLOWED"));
    }
    match allowed {
        true => Ok(Some(RuleId::parse(rule).map_err(|e| e.to_string())?)),
        false => Ok(None),
    }
}

/// One record of a window; `staged`: the window has a staged set, so the record carries the
/// pending decision (and otherwise none).
fn flow_record(r: &proto::FlowRecord, staged: bool) -> Result<FlowRecord, String> {
    let addr = |what: &str, text: &str| {
        text.parse::<IpAddr>()
            .map(|a| a.to_canonical())
            .map_err(|_| format!("{what} {text:?} is not an address"))
    };
    let protocol: Protocol = enum_field(r.protocol)?;
    let decision: Decision = enum_field(r.decision)?;
    let dst_port = u16::try_from(r.dst_port).map_err(|_| format!("port {} is out of range", r.dst_port))?;
    if !protocol.has_ports() && dst_port != 0 {
        return Err("icmp flows carry no port".into());
    }
    let matched_rule = decided_by(decision, &r.matched_rule_id, "matched")?;
    let pending = match (staged, r.pending_decision) {
        (false, 0) if r.pending_rule_id.is_empty() => None,
        (false, _) => return Err("a pending decision without a staged set".into()),
        (true, 0) => return Err("no pending decision under a staged set".into()),
        (true, code) => {
            let decision: Decision = enum_field(code)?;
            if decision == Decision::Observed {
                return Err("a pending decision is made by rules: it is never OBSERVED".into());
            }
            Some(crate::flows::Pending {
                decision,
                rule: decided_by(decision, &r.pending_rule_id, "pending")?,
            })
        }
    };
    let first_seen_ms = time("first seen", r.first_seen_unix_ms)?;
    let last_seen_ms = time("last seen", r.last_seen_unix_ms)?;
    if first_seen_ms > last_seen_ms {
        return Err("first seen is after last seen".into());
    }
    Ok(FlowRecord {
        src: addr("source", &r.src_address)?,
        dst: addr("destination", &r.dst_address)?,
        dst_port,
        protocol,
        decision,
        matched_rule,
        packets: counter("packets", r.packets)?,
        bytes: counter("bytes", r.bytes)?,
        new_connections: counter("new connections", r.new_connections)?,
        first_seen_ms,
        last_seen_ms,
        pending,
    })
}

/// One gap on its own (as the agent's queue reads back what it wrote).
impl TryFrom<&proto::EvidenceGap> for EvidenceGap {
    type Error = FlowError;

    fn try_from(wire: &proto::EvidenceGap) -> Result<Self, FlowError> {
        evidence_gap(wire).map_err(|reason| FlowError::Gap { index: 0, reason })
    }
}

fn evidence_gap(g: &proto::EvidenceGap) -> Result<EvidenceGap, String> {
    let kind = GapKind::from_number("gap kind", g.kind).map_err(|_| format!("unknown kind {}", g.kind))?;
    let (from_ms, to_ms) = (time("gap start", g.from_unix_ms)?, time("gap end", g.to_unix_ms)?);
    if from_ms > to_ms {
        return Err("interval is reversed".into());
    }
    if g.detail.chars().count() > crate::flows::MAX_GAP_DETAIL {
        return Err(format!("detail is longer than {} characters", crate::flows::MAX_GAP_DETAIL));
    }
    Ok(EvidenceGap { kind, from_ms, to_ms, count: counter("gap count", g.count)?, detail: g.detail.clone() })
}

// ---- the policy stream ----------------------------------------------------------------------

wire_enum!(AckStatus, proto::AckStatus, "ack status", { Applied <=> Applied, Held <=> Held, Failed <=> Failed });

fn truncated(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

impl From<&HostFacts> for proto::HostFacts {
    fn from(f: &HostFacts) -> Self {
        proto::HostFacts {
            hostname: f.hostname.clone(),
            os: f.os.as_ref().map(|os| proto::OsInfo {
                family: os.family.clone(),
                name: os.name.clone(),
                version: os.version.clone(),
                kernel_version: os.kernel_version.clone(),
                architecture: os.architecture.clone(),
            }),
            interfaces: f
                .interfaces
                .iter()
                .map(|i| proto::NetworkInterface {
                    name: i.name.clone(),
                    addresses: i.addresses.clone(),
                    mac_address: i.mac_address.clone(),
                })
                .collect(),
            machine_id: f.machine_id.clone(),
            boot_id: f.boot_id.clone(),
            ephemeral_ports: f
                .ephemeral_ports
                .map(|p| proto::PortRange { start: u32::from(p.start()), end: u32::from(p.end()) }),
        }
    }
}

/// Host facts as an agent reported them: the texts as they came (whoever stores one bounds it),
/// an ephemeral port range only when it is a valid one.
impl From<&proto::HostFacts> for HostFacts {
    fn from(f: &proto::HostFacts) -> Self {
        HostFacts {
            hostname: f.hostname.clone(),
            os: f.os.as_ref().map(|os| OsInfo {
                family: os.family.clone(),
                name: os.name.clone(),
                version: os.version.clone(),
                kernel_version: os.kernel_version.clone(),
                architecture: os.architecture.clone(),
            }),
            interfaces: f
                .interfaces
                .iter()
                .map(|i| NetworkInterface {
                    name: i.name.clone(),
                    addresses: i.addresses.clone(),
                    mac_address: i.mac_address.clone(),
                })
                .collect(),
            machine_id: f.machine_id.clone(),
            boot_id: f.boot_id.clone(),
            ephemeral_ports: f.ephemeral_ports.and_then(|p| PortRange::new(p.start, p.end).ok()),
        }
    }
}

impl From<&AgentInfo> for proto::AgentInfo {
    fn from(a: &AgentInfo) -> Self {
        proto::AgentInfo { version: a.version.clone(), capabilities: a.capabilities.clone() }
    }
}

/// What an agent says of itself, its capabilities bounded ([`MAX_CAPABILITIES`], each at most
/// [`MAX_CAPABILITY`] characters) as every other text it sends.
impl From<&proto::AgentInfo> for AgentInfo {
    fn from(a: &proto::AgentInfo) -> Self {
        let capabilities =
            a.capabilities.iter().take(MAX_CAPABILITIES).map(|c| truncated(c, MAX_CAPABILITY)).collect();
        AgentInfo { version: a.version.clone(), capabilities }
    }
}

fn ack_to_wire(ack: &Ack) -> proto::PolicyAck {
    let detail = match ack {
        Ack::Failed(_, detail) => detail.clone(),
        _ => String::new(),
    };
    proto::PolicyAck { version: ack.version(), status: ack.status().number(), detail }
}

fn listening_to_wire(l: &ListeningService) -> proto::ListeningService {
    proto::ListeningService {
        protocol: l.protocol.number(),
        port: u32::from(l.port),
        address: l.address.map(|a| a.to_string()).unwrap_or_default(),
        process_name: l.process_name.clone(),
    }
}

impl From<&AgentMessage> for proto::SyncRequest {
    fn from(m: &AgentMessage) -> Self {
        use proto::sync_request::Msg;
        let msg = match m {
            AgentMessage::Hello(h) => Msg::Hello(proto::Hello {
                applied_version: h.applied_version,
                agent: Some((&h.agent).into()),
                facts: h.facts.as_ref().map(Into::into),
                suspended: h.suspended,
                reverted_version: h.reverted_version,
            }),
            AgentMessage::Ack(a) => Msg::Ack(ack_to_wire(a)),
            AgentMessage::Heartbeat(h) => Msg::Heartbeat(proto::Heartbeat {
                uptime_seconds: h.uptime.as_secs(),
                credential_renewal_error: h.credential_renewal_error.clone(),
                tamper_events: h
                    .tamper_events
                    .iter()
                    .map(|e| proto::TamperEvent {
                        detected_at_unix_ms: e.detected_at_unix_ms,
                        detail: e.detail.clone(),
                        count: e.count,
                    })
                    .collect(),
                suspended: h.suspended,
                reverted_version: h.reverted_version,
            }),
            AgentMessage::Inventory(i) => Msg::Inventory(proto::InventoryReport {
                facts: i.facts.as_ref().map(Into::into),
                listening_services: i.listening_services.iter().map(listening_to_wire).collect(),
            }),
        };
        proto::SyncRequest { msg: Some(msg) }
    }
}

/// Why a message from an agent was refused: the stream ends with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MessageError(pub String);

fn listening_from_wire(l: &proto::ListeningService) -> Result<ListeningService, MessageError> {
    let protocol = enum_field::<Protocol>(l.protocol).map_err(MessageError)?;
    let port = u16::try_from(l.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| MessageError(format!("listening port {} is not a port", l.port)))?;
    let address = match l.address.as_str() {
        "" => None,
        text => Some(
            text.parse::<IpAddr>()
                .map_err(|_| MessageError(format!("listening address {text:?} is not an address")))?,
        ),
    };
    Ok(ListeningService { protocol, port, address, process_name: truncated(&l.process_name, 256) })
}

/// Validates what an agent sent on its stream: an empty message or an ack of no known status is
/// refused; texts are cut to the bounds the control plane keeps ([`MAX_ACK_DETAIL`],
/// [`MAX_RENEWAL_ERROR`], [`MAX_TAMPER_DETAIL`]) and tamper events to the
/// [`MAX_TAMPER_REPORTS`] and one an agent sends.
impl TryFrom<proto::SyncRequest> for AgentMessage {
    type Error = MessageError;

    fn try_from(req: proto::SyncRequest) -> Result<Self, MessageError> {
        use proto::sync_request::Msg;
        match req.msg {
            Some(Msg::Hello(h)) => Ok(AgentMessage::Hello(Box::new(Hello {
                applied_version: h.applied_version,
                agent: h.agent.as_ref().map(AgentInfo::from).unwrap_or_default(),
                facts: h.facts.as_ref().map(HostFacts::from),
                suspended: h.suspended,
                reverted_version: h.reverted_version,
            }))),
            Some(Msg::Ack(a)) => {
                let status = AckStatus::from_number("ack status", a.status).map_err(|_| {
                    MessageError(format!("ack status {} is not APPLIED, HELD or FAILED", a.status))
                })?;
                Ok(AgentMessage::Ack(match status {
                    AckStatus::Applied => Ack::Applied(a.version),
                    AckStatus::Held => Ack::Held(a.version),
                    AckStatus::Failed => Ack::Failed(a.version, truncated(&a.detail, MAX_ACK_DETAIL)),
                }))
            }
            Some(Msg::Heartbeat(h)) => Ok(AgentMessage::Heartbeat(Heartbeat {
                uptime: std::time::Duration::from_secs(h.uptime_seconds),
                credential_renewal_error: truncated(&h.credential_renewal_error, MAX_RENEWAL_ERROR),
                tamper_events: h
                    .tamper_events
                    .iter()
                    .take(MAX_TAMPER_REPORTS + 1)
                    .map(|e| TamperEvent {
                        detected_at_unix_ms: e.detected_at_unix_ms,
                        detail: truncated(&e.detail, MAX_TAMPER_DETAIL),
                        count: e.count.max(1),
                    })
                    .collect(),
                suspended: h.suspended,
                reverted_version: h.reverted_version,
            })),
            Some(Msg::Inventory(i)) => Ok(AgentMessage::Inventory(Box::new(Inventory {
                facts: i.facts.as_ref().map(HostFacts::from),
                listening_services: i
                    .listening_services
                    .iter()
                    .map(listening_from_wire)
                    .collect::<Result<_, _>>()?,
            }))),
            None => Err(MessageError("empty sync message".into())),
        }
    }
}

fn seconds(d: std::time::Duration) -> u32 {
    u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX)
}

impl From<&ControlMessage> for proto::SyncResponse {
    fn from(m: &ControlMessage) -> Self {
        use proto::sync_response::Msg;
        let msg = match m {
            ControlMessage::HelloAck(a) => Msg::HelloAck(proto::HelloAck {
                heartbeat_interval_seconds: seconds(a.heartbeat),
                inventory_interval_seconds: seconds(a.inventory),
                flow_window_seconds: seconds(a.flow_window),
                flow_window_max_keys: a.flow_window_max_keys,
            }),
            ControlMessage::Update(Update::Snapshot(p)) => {
                Msg::Snapshot(proto::PolicySnapshot { policy: Some(p.into()) })
            }
            ControlMessage::Update(Update::Delta(d)) => Msg::Delta(d.into()),
            ControlMessage::Directive(Directive::Reconnect) => Msg::Directive(proto::Directive {
                directive: Some(proto::directive::Directive::Reconnect(proto::Reconnect {})),
            }),
            ControlMessage::Directive(Directive::Reenroll { reason }) => Msg::Directive(proto::Directive {
                directive: Some(proto::directive::Directive::Reenroll(proto::Reenroll {
                    reason: reason.clone(),
                })),
            }),
        };
        proto::SyncResponse { msg: Some(msg) }
    }
}

/// Why the agent cannot use a message from the control plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlMessageError {
    /// Nothing it knows (an empty message, a directive of a later contract): skipped.
    #[error("a message this agent does not know")]
    Unknown,
    /// A snapshot with no policy: the stream cannot go on.
    #[error("snapshot without a policy")]
    SnapshotWithoutPolicy,
    /// An update that does not validate: acked FAILED, naming its version.
    #[error("malformed snapshot: {error}")]
    MalformedSnapshot { version: Version, error: PolicyError },
    #[error("malformed delta: {error}")]
    MalformedDelta { version: Version, error: PolicyError },
}

/// Validates what the control plane sent (the agent's side of the boundary). Timing is clamped
/// to what the agent can keep (1 s to 1 h windows, at most 1,000,000 keys).
impl TryFrom<proto::SyncResponse> for ControlMessage {
    type Error = ControlMessageError;

    fn try_from(res: proto::SyncResponse) -> Result<Self, ControlMessageError> {
        use proto::sync_response::Msg;
        let every = |secs: u32| std::time::Duration::from_secs(u64::from(secs.max(1)));
        match res.msg {
            Some(Msg::HelloAck(a)) => Ok(ControlMessage::HelloAck(HelloAck {
                heartbeat: every(a.heartbeat_interval_seconds),
                inventory: every(a.inventory_interval_seconds),
                flow_window: every(a.flow_window_seconds.clamp(1, 3600)),
                flow_window_max_keys: a.flow_window_max_keys.clamp(1, 1_000_000),
            })),
            Some(Msg::Snapshot(s)) => {
                let p = s.policy.ok_or(ControlMessageError::SnapshotWithoutPolicy)?;
                let policy = WorkloadPolicy::try_from(&p)
                    .map_err(|error| ControlMessageError::MalformedSnapshot { version: p.version, error })?;
                Ok(ControlMessage::Update(Update::Snapshot(policy)))
            }
            Some(Msg::Delta(d)) => {
                let delta = PolicyDelta::try_from(&d)
                    .map_err(|error| ControlMessageError::MalformedDelta { version: d.to_version, error })?;
                Ok(ControlMessage::Update(Update::Delta(delta)))
            }
            Some(Msg::Directive(d)) => match d.directive {
                Some(proto::directive::Directive::Reconnect(_)) => {
                    Ok(ControlMessage::Directive(Directive::Reconnect))
                }
                Some(proto::directive::Directive::Reenroll(r)) => {
                    Ok(ControlMessage::Directive(Directive::Reenroll { reason: truncated(&r.reason, 1024) }))
                }
                None => Err(ControlMessageError::Unknown),
            },
            None => Err(ControlMessageError::Unknown),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random policies of every shape the domain allows: rules of every protocol with lengths
    /// from a few bytes to over 16 KiB (one, two and three bytes of length), IPv4 and IPv6 peers,
    /// a deadline or none, a staged set or none.
    mod canonical_encoding {
        use std::collections::BTreeMap;

        use proptest::collection::vec;
        use proptest::prelude::*;

        use super::*;
        use crate::policy::Mode;

        const PROTOCOLS: [Protocol; 4] = [Protocol::Tcp, Protocol::Udp, Protocol::Icmp, Protocol::Icmpv6];

        fn cidr(v4: bool, bits: u128, len: u8) -> Cidr {
            let net = match v4 {
                true => {
                    ipnet::IpNet::V4(ipnet::Ipv4Net::new((bits as u32).into(), len % 33).unwrap().trunc())
                }
                false => ipnet::IpNet::V6(ipnet::Ipv6Net::new(bits.into(), len % 129).unwrap().trunc()),
            };
            Cidr::parse(&net.to_string()).unwrap()
        }

        prop_compose! {
            fn rule()(
                name in 0u8..6,
                protocol in 0usize..4,
                peers in prop_oneof![vec(any::<(bool, u128, u8)>(), 0..4), vec(any::<(bool, u128, u8)>(), 0..400)],
                ports in vec((1u16..=65535, 0u16..300), 1..4),
            ) -> ResolvedRule {
                let protocol = PROTOCOLS[protocol];
                let ports: Vec<PortRange> = match protocol.has_ports() {
                    true => ports.into_iter().map(|(a, n)| PortRange::new(a.into(), u32::from(a.saturating_add(n))).unwrap()).collect(),
                    false => Vec::new(),
                };
                let id = RuleId::new(&format!("rule-{name}"), protocol).unwrap();
                ResolvedRule::new(id, ports, peers.into_iter().map(|(v4, bits, len)| cidr(v4, bits, len))).unwrap()
            }
        }

        prop_compose! {
            fn policy()(
                version in prop_oneof![Just(0u64), 1u64..300, any::<u64>()],
                mode in 0usize..3,
                rules in vec(rule(), 0..6),
                revert_at in prop::option::of(prop_oneof![1i64..1_000, 1_000_000_000_000i64..i64::MAX]),
                staged in prop::option::of((vec(rule(), 0..3), vec((0u8..9, 0usize..4), 0..3), "[a-z0-9._:-]{1,12}")),
            ) -> WorkloadPolicy {
                let mode = [Mode::Visibility, Mode::Simulation, Mode::Enforcement][mode];
                let unique: BTreeMap<RuleId, ResolvedRule> = rules.into_iter().map(|r| (r.id().clone(), r)).collect();
                let policy = WorkloadPolicy::new(version, mode, unique.into_values()).unwrap().with_revert_at(revert_at).unwrap();
                let staged = staged.and_then(|(upserts, removals, set)| {
                    let upserts: BTreeMap<RuleId, ResolvedRule> = upserts.into_iter().map(|r| (r.id().clone(), r)).collect();
                    let removals: BTreeSet<RuleId> = removals
                        .into_iter()
                        .map(|(n, p)| RuleId::new(&format!("gone-{n}"), PROTOCOLS[p]).unwrap())
                        .collect();
                    Staged::new(&set, upserts.into_values(), removals).ok()
                });
                policy.with_staged(staged)
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]

            /// POL-3: the canonical bytes are the bytes prost writes for the policy's message,
            /// so every stored digest and every agent's decode stays as it was.
            #[test]
            fn canonical_bytes_are_what_prost_writes(policy in policy()) {
                let bytes = policy.canonical_bytes();
                prop_assert_eq!(&bytes, &proto::WorkloadPolicy::from(&policy).encode_to_vec());
                prop_assert_eq!(WorkloadPolicy::from_canonical_bytes(&bytes), Ok(policy));
            }
        }

        /// A rule over 16 KiB: its length takes three bytes.
        #[test]
        fn a_rule_of_thousands_of_peers_is_encoded_as_prost_encodes_it() {
            let peers = (0..2_000u128).map(|i| cidr(false, (0xfd00 << 112) | (i << 16), 112));
            let rule = ResolvedRule::new(RuleId::new("big", Protocol::Icmpv6).unwrap(), [], peers).unwrap();
            let policy = WorkloadPolicy::new(7, Mode::Enforcement, [rule]).unwrap();
            let bytes = policy.canonical_bytes();
            assert!(bytes.len() > 1 << 14);
            assert_eq!(bytes, proto::WorkloadPolicy::from(&policy).encode_to_vec());
        }
    }

    fn wire_window(records: Vec<proto::FlowRecord>) -> proto::FlowWindow {
        proto::FlowWindow {
            window_id: uuid::Uuid::new_v4().to_string(),
            start_unix_ms: 1_700_000_000_000,
            end_unix_ms: 1_700_000_060_000,
            policy_version: 3,
            mode: proto::EnforcementMode::Simulation.into(),
            records,
            gaps: vec![],
            staged_set: String::new(),
        }
    }

    fn wire_record() -> proto::FlowRecord {
        proto::FlowRecord {
            src_address: "::ffff:10.0.0.1".into(),
            dst_address: "10.0.0.2".into(),
            dst_port: 5432,
            protocol: proto::Protocol::Tcp.into(),
            decision: proto::FlowDecision::WouldBlock.into(),
            matched_rule_id: String::new(),
            packets: 3,
            bytes: 180,
            new_connections: 1,
            first_seen_unix_ms: 1_700_000_001_000,
            last_seen_unix_ms: 1_700_000_002_000,
            pending_decision: 0,
            pending_rule_id: String::new(),
        }
    }

    #[test]
    fn flow_windows_are_validated_whole() {
        let good = FlowWindow::try_from(&wire_window(vec![wire_record()])).unwrap();
        assert_eq!(
            good.records[0].src,
            "10.0.0.1".parse::<IpAddr>().unwrap(),
            "mapped sources are canonical"
        );
        assert_eq!(good.records[0].decision, Decision::WouldBlock);
        type Mutation = Box<dyn Fn(&mut proto::FlowRecord)>;
        let bad: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.src_address = "nope".into()), "record 1: source \"nope\" is not an address"),
            (Box::new(|r| r.dst_port = 70_000), "record 1: port 70000 is out of range"),
            (Box::new(|r| r.protocol = 9), "record 1: unknown protocol 9"),
            (Box::new(|r| r.decision = 0), "record 1: unknown decision 0"),
            (Box::new(|r| r.decision = 2), "matched rule id is required exactly for ALLOWED"),
            (
                Box::new(|r| r.matched_rule_id = "r/tcp".into()),
                "matched rule id is required exactly for ALLOWED",
            ),
            (
                Box::new(|r| {
                    r.decision = 2;
                    r.matched_rule_id = "r/sctp".into();
                }),
                "rule id \"r/sctp\"",
            ),
            (
                Box::new(|r| r.first_seen_unix_ms = i64::MAX),
                "first seen 9223372036854775807 is not a valid time",
            ),
            (Box::new(|r| r.last_seen_unix_ms = -1), "last seen -1 is not a valid time"),
            (Box::new(|r| r.first_seen_unix_ms = r.last_seen_unix_ms + 1), "first seen is after last seen"),
            (Box::new(|r| r.packets = u64::MAX), "packets 18446744073709551615 is out of range"),
            (Box::new(|r| r.protocol = proto::Protocol::Icmp.into()), "icmp flows carry no port"),
            (Box::new(|r| r.pending_decision = 4), "a pending decision without a staged set"),
        ];
        for (mutate, want) in bad {
            let mut second = wire_record();
            mutate(&mut second);
            let err =
                FlowWindow::try_from(&wire_window(vec![wire_record(), second])).unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
        }
        let refused = |w: proto::FlowWindow| FlowWindow::try_from(&w).unwrap_err().to_string();
        // Under a staged set every record carries the pending decision, and its rule exactly
        // when it allows.
        let staged = |records: Vec<proto::FlowRecord>| proto::FlowWindow {
            staged_set: "rs.db:3".into(),
            ..wire_window(records)
        };
        let pending = |decision: proto::FlowDecision, rule: &str| proto::FlowRecord {
            pending_decision: decision.into(),
            pending_rule_id: rule.into(),
            ..wire_record()
        };
        let good =
            FlowWindow::try_from(&staged(vec![pending(proto::FlowDecision::Allowed, "r/tcp")])).unwrap();
        assert_eq!(good.staged_set.as_deref(), Some("rs.db:3"));
        let p = good.records[0].pending.as_ref().unwrap();
        assert_eq!(
            (p.decision, p.rule.as_ref().map(ToString::to_string)),
            (Decision::Allowed, Some("r/tcp".into()))
        );
        assert!(refused(staged(vec![wire_record()])).contains("no pending decision under a staged set"));
        assert!(
            refused(staged(vec![pending(proto::FlowDecision::Blocked, "r/tcp")])).contains("pending rule id")
        );
        assert!(refused(staged(vec![pending(proto::FlowDecision::Observed, "")])).contains("never OBSERVED"));
        let mut w = staged(vec![]);
        w.staged_set = "No Caps".into();
        assert!(refused(w).contains("staged set"));
        // An agent's set id is bounded: 64 characters pass, 65 are refused.
        let mut w = staged(vec![]);
        w.staged_set = "a".repeat(crate::policy::MAX_STAGED_SET);
        assert!(FlowWindow::try_from(&w).is_ok());
        w.staged_set.push('a');
        assert!(refused(w).contains("1 to 64 characters"));
        let mut w = wire_window(vec![]);
        w.window_id = "x".into();
        assert!(refused(w).contains("not a uuid"));
        let mut w = wire_window(vec![]);
        w.end_unix_ms = w.start_unix_ms - 1;
        assert!(refused(w).contains("must be ordered"));
        let mut w = wire_window(vec![]);
        w.end_unix_ms = w.start_unix_ms + crate::flows::MAX_WINDOW_MS + 1;
        assert!(refused(w).contains("at most 24 h"));
        let mut w = wire_window(vec![]);
        w.mode = 0;
        assert!(refused(w).contains("unknown mode 0"));
        let mut w = wire_window(vec![]);
        w.gaps = vec![proto::EvidenceGap {
            kind: 99,
            from_unix_ms: 1,
            to_unix_ms: 2,
            count: 1,
            detail: String::new(),
        }];
        assert!(refused(w).contains("gap 0: unknown kind 99"));
        let mut w = wire_window(vec![]);
        w.gaps = vec![proto::EvidenceGap {
            kind: 1,
            from_unix_ms: 2,
            to_unix_ms: 1,
            count: 1,
            detail: String::new(),
        }];
        assert!(refused(w).contains("gap 0: interval is reversed"));
        let mut w = wire_window(vec![]);
        let detail = "é".repeat(crate::flows::MAX_GAP_DETAIL + 1);
        w.gaps = vec![proto::EvidenceGap { kind: 5, from_unix_ms: 1, to_unix_ms: 2, count: 1, detail }];
        assert!(refused(w).contains("gap 0: detail is longer than 256 characters"));
        let mut w = wire_window(vec![]);
        w.records = vec![wire_record(); crate::flows::MAX_RECORDS + 1];
        assert!(refused(w).contains("at most 100000 records"));
    }

    #[test]
    fn flow_windows_round_trip() {
        let mut allowed = wire_record();
        allowed.src_address = "10.0.0.1".into();
        allowed.decision = proto::FlowDecision::Allowed.into();
        allowed.matched_rule_id = "db/tcp".into();
        let mut wire = wire_window(vec![allowed]);
        wire.gaps = vec![proto::EvidenceGap {
            kind: 4,
            from_unix_ms: 10,
            to_unix_ms: 20,
            count: 3,
            detail: String::new(),
        }];
        let domain = FlowWindow::try_from(&wire).unwrap();
        assert_eq!(
            domain.records[0].matched_rule.as_ref().map(ToString::to_string).as_deref(),
            Some("db/tcp")
        );
        assert_eq!(domain.gaps[0].kind, GapKind::WindowKeyOverflow);
        assert_eq!(proto::FlowWindow::from(&domain), wire);
    }

    #[test]
    fn enum_numbers_round_trip_and_unspecified_is_refused() {
        fn check<E: WireEnum + PartialEq + std::fmt::Debug>(all: &[E]) {
            for &e in all {
                assert_ne!(e.number(), 0);
                assert_eq!(E::from_code(e.code()), Ok(e));
            }
            assert!(E::from_code(0).is_err());
            assert!(E::from_code(99).is_err());
        }
        check(&Mode::ALL);
        check(&Protocol::ALL);
        check(&Decision::ALL);
        check(&GapKind::ALL);
        check(&SyncState::ALL);
    }

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
        check(wire_rule("r/tcp", Tcp, &["10.0.0.1/8"], &[(443, 443)]), "has host bits set; write 10.0.0.0/8");
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
        let before_1970 = proto::PolicyDelta {
            from_version: 1,
            to_version: 2,
            changes: vec![proto::DeltaChange {
                change: Some(proto::delta_change::Change::SetRevertAtUnixMs(-1)),
            }],
        };
        assert_eq!(PolicyDelta::try_from(&before_1970), Err(PolicyError::RevertDeadline { at_ms: -1 }));
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
            revert_at_unix_ms: 0,
            staged: None,
        };
        let bytes = unsorted.encode_to_vec();
        assert_eq!(WorkloadPolicy::from_canonical_bytes(&bytes), Err(PolicyError::NotCanonical));
        let policy = WorkloadPolicy::try_from(&unsorted).unwrap();
        let canonical = policy.canonical_bytes();
        assert_ne!(canonical, bytes);
        assert_eq!(WorkloadPolicy::from_canonical_bytes(&canonical), Ok(policy));
        assert!(matches!(WorkloadPolicy::from_canonical_bytes(&[0xff, 0xff]), Err(PolicyError::Decode(_))));
    }

    #[test]
    fn canonical_bytes_hold_a_version_exactly_when_it_is_not_zero() {
        let modes = [
            proto::EnforcementMode::Visibility,
            proto::EnforcementMode::Simulation,
            proto::EnforcementMode::Enforcement,
        ];
        for (i, mode) in modes.into_iter().enumerate() {
            let wire = proto::WorkloadPolicy {
                version: 0,
                mode: mode.into(),
                inbound_rules: (0..i)
                    .map(|r| {
                        wire_rule(&format!("r{r}/tcp"), proto::Protocol::Tcp, &["10.0.0.0/8"], &[(80, 80)])
                    })
                    .collect(),
                revert_at_unix_ms: if i == 1 { 1_700_000_000_000 } else { 0 },
                staged: None,
            };
            let content = WorkloadPolicy::try_from(&wire).unwrap();
            assert!(!WorkloadPolicy::canonical_bytes_hold_a_version(&content.canonical_bytes()));
            for version in [1, 2, 300, u64::from(u32::MAX) + 1] {
                let bytes = content.clone().with_version(version).canonical_bytes();
                assert!(WorkloadPolicy::canonical_bytes_hold_a_version(&bytes), "version {version}");
                assert_eq!(bytes[0], WorkloadPolicy::VERSION_TAG);
            }
        }
        assert!(!WorkloadPolicy::canonical_bytes_hold_a_version(&[]));
    }

    fn agent_messages() -> Vec<AgentMessage> {
        let facts = HostFacts {
            hostname: "web-1".into(),
            os: Some(OsInfo { family: "linux".into(), name: "Debian".into(), ..Default::default() }),
            interfaces: vec![NetworkInterface {
                name: "eth0".into(),
                addresses: vec!["10.0.0.5/24".into()],
                mac_address: "02:00:00:00:00:01".into(),
            }],
            machine_id: "m".into(),
            boot_id: "b".into(),
            ephemeral_ports: Some(PortRange::new(32_768, 60_999).unwrap()),
        };
        vec![
            AgentMessage::Hello(Box::new(Hello {
                applied_version: 7,
                agent: AgentInfo { version: "1.0".into(), capabilities: vec!["nftables".into()] },
                facts: Some(facts.clone()),
                suspended: true,
                reverted_version: 6,
            })),
            AgentMessage::Ack(Ack::Applied(3)),
            AgentMessage::Ack(Ack::Held(4)),
            AgentMessage::Ack(Ack::Failed(5, "no base".into())),
            AgentMessage::Heartbeat(Heartbeat {
                uptime: std::time::Duration::from_secs(9),
                credential_renewal_error: "refused".into(),
                tamper_events: vec![TamperEvent { detected_at_unix_ms: 1, detail: "flush".into(), count: 2 }],
                suspended: false,
                reverted_version: 4,
            }),
            AgentMessage::Inventory(Box::new(Inventory {
                facts: Some(facts),
                listening_services: vec![ListeningService {
                    protocol: Protocol::Tcp,
                    port: 443,
                    address: Some("10.0.0.5".parse().unwrap()),
                    process_name: "nginx".into(),
                }],
            })),
            AgentMessage::Inventory(Box::default()),
        ]
    }

    #[test]
    fn sync_messages_cross_the_wire_unchanged() {
        for m in agent_messages() {
            let wire = proto::SyncRequest::from(&m);
            let bytes = wire.encode_to_vec();
            let back = AgentMessage::try_from(proto::SyncRequest::decode(bytes.as_slice()).unwrap()).unwrap();
            assert_eq!(back, m);
        }
        let v1 = crate::testing::policy(1, Mode::Enforcement, &[22]);
        let v2 = crate::testing::policy(2, Mode::Enforcement, &[22, 443]);
        let hello_ack = HelloAck {
            heartbeat: std::time::Duration::from_secs(30),
            inventory: std::time::Duration::from_secs(300),
            flow_window: std::time::Duration::from_secs(60),
            flow_window_max_keys: 10_000,
        };
        for m in [
            ControlMessage::HelloAck(hello_ack),
            ControlMessage::Update(Update::Snapshot(v1.clone())),
            ControlMessage::Update(Update::Delta(crate::policy::diff(&v1, &v2))),
            ControlMessage::Directive(Directive::Reconnect),
            ControlMessage::Directive(Directive::Reenroll { reason: "retired".into() }),
        ] {
            let bytes = proto::SyncResponse::from(&m).encode_to_vec();
            let back =
                ControlMessage::try_from(proto::SyncResponse::decode(bytes.as_slice()).unwrap()).unwrap();
            assert_eq!(back, m);
        }
    }

    /// What a hostile agent can send is refused or cut to the bounds the control plane keeps.
    #[test]
    fn hostile_agent_messages_are_refused_or_bounded() {
        use proto::sync_request::Msg;
        let refused =
            |msg: Option<Msg>| AgentMessage::try_from(proto::SyncRequest { msg }).unwrap_err().to_string();
        assert_eq!(refused(None), "empty sync message");
        // A Hello's capabilities: at most MAX_CAPABILITIES kept, each cut to MAX_CAPABILITY.
        let hello = proto::Hello {
            agent: Some(proto::AgentInfo {
                version: "9".into(),
                capabilities: vec!["c".repeat(MAX_CAPABILITY * 4); MAX_CAPABILITIES + 10],
            }),
            ..Default::default()
        };
        let Ok(AgentMessage::Hello(h)) =
            AgentMessage::try_from(proto::SyncRequest { msg: Some(Msg::Hello(hello)) })
        else {
            panic!("a Hello");
        };
        assert_eq!(h.agent.capabilities.len(), MAX_CAPABILITIES);
        assert!(h.agent.capabilities.iter().all(|c| c.chars().count() == MAX_CAPABILITY));
        let ack = |status| Some(Msg::Ack(proto::PolicyAck { version: 1, status, detail: String::new() }));
        assert!(refused(ack(0)).contains("ack status 0 is not APPLIED, HELD or FAILED"));
        assert!(refused(ack(99)).contains("ack status 99"));
        let service = |protocol, port, address: &str| {
            Some(Msg::Inventory(proto::InventoryReport {
                facts: None,
                listening_services: vec![proto::ListeningService {
                    protocol,
                    port,
                    address: address.into(),
                    process_name: String::new(),
                }],
            }))
        };
        assert!(refused(service(1, 0, "")).contains("listening port 0 is not a port"));
        assert!(refused(service(1, 70_000, "")).contains("listening port 70000"));
        assert!(refused(service(1, 22, "nowhere")).contains("\"nowhere\" is not an address"));
        assert!(refused(service(0, 22, "")).contains("unknown protocol 0"));

        let failed = proto::PolicyAck { version: 2, status: 2, detail: "x".repeat(100_000) };
        let Ok(AgentMessage::Ack(Ack::Failed(2, detail))) =
            AgentMessage::try_from(proto::SyncRequest { msg: Some(Msg::Ack(failed)) })
        else {
            panic!("a FAILED ack");
        };
        assert_eq!(detail.chars().count(), MAX_ACK_DETAIL);
        let flood = proto::Heartbeat {
            credential_renewal_error: "e".repeat(100_000),
            tamper_events: (0..10_000)
                .map(|n| proto::TamperEvent { detected_at_unix_ms: n, detail: "d".repeat(5_000), count: 0 })
                .collect(),
            ..Default::default()
        };
        let Ok(AgentMessage::Heartbeat(h)) =
            AgentMessage::try_from(proto::SyncRequest { msg: Some(Msg::Heartbeat(flood)) })
        else {
            panic!("a heartbeat");
        };
        assert_eq!(h.credential_renewal_error.chars().count(), MAX_RENEWAL_ERROR);
        assert_eq!(h.tamper_events.len(), MAX_TAMPER_REPORTS + 1);
        assert!(
            h.tamper_events.iter().all(|e| e.detail.chars().count() == MAX_TAMPER_DETAIL && e.count == 1)
        );
        // An ephemeral range that is not one is dropped, never trusted.
        let facts = proto::HostFacts {
            ephemeral_ports: Some(proto::PortRange { start: 9, end: 2 }),
            ..Default::default()
        };
        assert_eq!(HostFacts::from(&facts).ephemeral_ports, None);
    }

    /// A malformed update names its version, so the agent can ack it FAILED; nothing the agent
    /// does not know ends its stream.
    #[test]
    fn malformed_updates_name_their_version() {
        use proto::sync_response::Msg;
        let control = |msg| ControlMessage::try_from(proto::SyncResponse { msg: Some(msg) });
        let mut bad = proto::WorkloadPolicy::from(&crate::testing::policy(4, Mode::Enforcement, &[22]));
        bad.mode = 42;
        let err = control(Msg::Snapshot(proto::PolicySnapshot { policy: Some(bad) })).unwrap_err();
        assert!(matches!(err, ControlMessageError::MalformedSnapshot { version: 4, .. }), "{err:?}");
        assert!(err.to_string().starts_with("malformed snapshot"), "{err}");
        let delta = proto::PolicyDelta {
            from_version: 4,
            to_version: 5,
            changes: vec![proto::DeltaChange { change: None }],
        };
        let err = control(Msg::Delta(delta)).unwrap_err();
        assert!(matches!(err, ControlMessageError::MalformedDelta { version: 5, .. }), "{err:?}");
        let err = control(Msg::Snapshot(proto::PolicySnapshot { policy: None })).unwrap_err();
        assert_eq!(err, ControlMessageError::SnapshotWithoutPolicy);
        let err = control(Msg::Directive(proto::Directive { directive: None })).unwrap_err();
        assert_eq!(err, ControlMessageError::Unknown);
        let Ok(ControlMessage::HelloAck(ack)) = control(Msg::HelloAck(proto::HelloAck::default())) else {
            panic!("a HelloAck");
        };
        assert_eq!((ack.heartbeat.as_secs(), ack.flow_window.as_secs(), ack.flow_window_max_keys), (1, 1, 1));
    }
}
