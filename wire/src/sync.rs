//! The convergence state of a workload (SYNC-6), as the control plane records it and operators
//! read it. The database stores it as its protobuf number (see `convert::WireEnum`).

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
