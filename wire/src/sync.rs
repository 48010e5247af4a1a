//! The policy stream's vocabulary (SYNC-2..SYNC-9): the messages an agent sends
//! ([`AgentMessage`]) and the control plane sends ([`ControlMessage`]) as domain types, the one
//! acknowledgement ([`Ack`]), and the convergence state of a workload (SYNC-6) as the control
//! plane records it and operators read it (the database stores it as its protobuf number, see
//! `convert::WireEnum`). Both ends convert at the edge (`convert`) and never see a prost type.

use std::time::Duration;

use crate::identity::{AgentInfo, HostFacts};
use crate::policy::{PolicyDelta, Protocol, Version, WorkloadPolicy};

/// The capability (in Hello's agent info) of an agent that holds a policy's revert deadline
/// (FLOW-11): the control plane gives a confirm deadline only to workloads whose agent says it.
pub const CONFIRM_DEADLINE: &str = "confirm-deadline";

/// Capabilities the control plane keeps of one Hello, and the longest it keeps of each.
pub const MAX_CAPABILITIES: usize = 32;
pub const MAX_CAPABILITY: usize = 64;

/// Distinct tamper details one heartbeat carries; further outside changes are only counted, in
/// one more entry. The control plane audits at most this many plus that one.
pub const MAX_TAMPER_REPORTS: usize = 16;

/// The longest tamper detail an agent sends (characters).
pub const MAX_TAMPER_DETAIL: usize = 1024;

/// The largest message of the policy stream (`AgentService.Sync`, either way), in encoded bytes
/// without gRPC's five-byte prefix. One number for both ends: the control plane's encoder limit
/// and its refusal to send a larger update, and the agent's decoder limit.
pub const MAX_POLICY_MESSAGE: usize = 4 * 1024 * 1024;

/// The default bound on one workload's rendered policy in canonical bytes: a quarter of the
/// stream's largest message, so a snapshot always fits, and so does a delta that replaces every
/// rule (it carries the old rules' ids and the new rules whole), with room for framing.
pub const DEFAULT_MAX_RENDERED_BYTES: usize = MAX_POLICY_MESSAGE / 4;

/// The default bound on one workload's rendered entries (every peer and every port range of
/// every rule, what the agent installs as set elements). A host-route peer is about 10 encoded
/// bytes, so the byte bound is reached first by peers; this one bounds what a policy of many
/// small entries costs the agent to install.
pub const DEFAULT_MAX_RENDERED_ENTRIES: usize = 100_000;

/// The longest failure detail of an ack the control plane keeps (characters).
pub const MAX_ACK_DETAIL: usize = 1024;

/// The longest credential renewal error a heartbeat carries to the control plane (characters).
pub const MAX_RENEWAL_ERROR: usize = 1024;

/// The version a FAILED ack names when the agent could not read the update at all (it was over
/// [`MAX_POLICY_MESSAGE`] as the agent reads it, or not a message): it answers the next update in
/// flight, whatever its version. Policy versions start at 1, so 0 is never a real one. Nothing
/// more is read on that stream: the control plane sends nothing further on it and ends it when a
/// new version is persisted, so the agent redials for that.
pub const UNREADABLE_UPDATE: u64 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SyncState {
    /// An update is in flight.
    Pending,
    /// The latest version sent has been acknowledged as applied.
    Synced,
    /// The agent failed to apply an update.
    Degraded,
    /// No stream is open.
    Offline,
    /// The kill switch is engaged on the host: the agent holds the latest version it was sent
    /// (persisted) but enforces nothing until `innerwall-agent up`.
    Suspended,
}

named_enum!(SyncState, "sync state", {
    Pending => "PENDING",
    Synced => "SYNCED",
    Degraded => "DEGRADED",
    Offline => "OFFLINE",
    Suspended => "SUSPENDED",
});

/// How an agent acknowledged an update (SYNC-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AckStatus {
    /// Installed.
    Applied,
    /// Persisted but not installed: the kill switch is engaged on the host.
    Held,
    /// Not applied; the detail says why.
    Failed,
}

named_enum!(AckStatus, "ack status", {
    Applied => "APPLIED",
    Held => "HELD",
    Failed => "FAILED",
});

/// The acknowledgement of one update: the one vocabulary of both ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    Applied(Version),
    Held(Version),
    /// The version (or [`UNREADABLE_UPDATE`]) and why, at most [`MAX_ACK_DETAIL`] characters.
    Failed(Version, String),
}

impl Ack {
    pub fn version(&self) -> Version {
        match self {
            Ack::Applied(v) | Ack::Held(v) | Ack::Failed(v, _) => *v,
        }
    }

    pub fn status(&self) -> AckStatus {
        match self {
            Ack::Applied(_) => AckStatus::Applied,
            Ack::Held(_) => AckStatus::Held,
            Ack::Failed(..) => AckStatus::Failed,
        }
    }
}

/// The first message of a stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hello {
    /// The version the agent holds (0: none); a claim, recorded, never a delta base (SYNC-2).
    pub applied_version: Version,
    pub agent: AgentInfo,
    pub facts: Option<HostFacts>,
    /// The kill switch is engaged on the host.
    pub suspended: bool,
    /// The held version whose revert deadline passed unconfirmed (FLOW-11): the host enforces it
    /// in simulation. 0: none.
    pub reverted_version: Version,
}

/// The control plane's answer to Hello: the timing the agent keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloAck {
    pub heartbeat: Duration,
    pub inventory: Duration,
    pub flow_window: Duration,
    pub flow_window_max_keys: u32,
}

/// An outside change to the agent's table that the agent repaired (ENF-5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TamperEvent {
    pub detected_at_unix_ms: i64,
    /// At most [`MAX_TAMPER_DETAIL`] characters.
    pub detail: String,
    /// How many changes this entry stands for, at least 1.
    pub count: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    pub uptime: Duration,
    /// Why the last credential renewal failed; empty when it did not (at most
    /// [`MAX_RENEWAL_ERROR`] characters).
    pub credential_renewal_error: String,
    /// At most [`MAX_TAMPER_REPORTS`] details and one entry counting the rest.
    pub tamper_events: Vec<TamperEvent>,
    pub suspended: bool,
    /// As in [`Hello`]; said at once when it changes.
    pub reverted_version: Version,
}

/// A socket listening on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListeningService {
    pub protocol: Protocol,
    pub port: u16,
    /// The local address it is bound to; `None`: any.
    pub address: Option<std::net::IpAddr>,
    pub process_name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// `None`: the agent could not list its interfaces (the last known addresses stand).
    pub facts: Option<HostFacts>,
    pub listening_services: Vec<ListeningService>,
}

/// What an agent sends on its stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMessage {
    /// Boxed, like the inventory: they carry host facts and come once per stream or interval.
    Hello(Box<Hello>),
    Ack(Ack),
    Heartbeat(Heartbeat),
    Inventory(Box<Inventory>),
}

/// An instruction that ends the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Directive {
    /// Reconnect now (a directed resend of the snapshot, SYNC-8).
    Reconnect,
    /// Only a new enrollment can bring this host back (retired or deny-listed).
    Reenroll { reason: String },
}

/// A policy update: the whole policy, or a delta from the version the stream carried before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    Snapshot(WorkloadPolicy),
    Delta(PolicyDelta),
}

impl Update {
    /// The version this update brings the agent to: what its ack names.
    pub fn version(&self) -> Version {
        match self {
            Update::Snapshot(p) => p.version(),
            Update::Delta(d) => d.to_version,
        }
    }
}

/// What the control plane sends on a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlMessage {
    HelloAck(HelloAck),
    Update(Update),
    Directive(Directive),
}
