//! The convergence state of a workload (SYNC-6), as the control plane records it and operators
//! read it. The database stores it as its protobuf number (see `convert::WireEnum`).

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
}

named_enum!(SyncState, "sync state", {
    Pending => "PENDING",
    Synced => "SYNCED",
    Degraded => "DEGRADED",
    Offline => "OFFLINE",
});
