//! The convergence state of a workload (SYNC-6), as the control plane records it and operators
//! read it. The database stores it as its protobuf number (see `convert::WireEnum`).

/// Distinct tamper details one heartbeat carries; further outside changes are only counted, in
/// one more entry. The control plane audits at most this many plus that one.
pub const MAX_TAMPER_REPORTS: usize = 16;

/// The longest tamper detail an agent sends (characters).
pub const MAX_TAMPER_DETAIL: usize = 1024;

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
