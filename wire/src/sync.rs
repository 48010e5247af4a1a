//! The convergence state of a workload (SYNC-6), as the control plane records it and operators
//! read it. The database stores it as its protobuf number (see `convert::WireEnum`).

use std::fmt;

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

impl SyncState {
    pub const ALL: [SyncState; 4] =
        [SyncState::Pending, SyncState::Synced, SyncState::Degraded, SyncState::Offline];

    pub fn name(self) -> &'static str {
        match self {
            SyncState::Pending => "PENDING",
            SyncState::Synced => "SYNCED",
            SyncState::Degraded => "DEGRADED",
            SyncState::Offline => "OFFLINE",
        }
    }
}

impl fmt::Display for SyncState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
