//! Bugs planted on purpose, so the simulator can prove it finds them (issue 30). Each is off
//! unless a test turns it on for its own thread; without the `testing` feature [`on`] is a
//! constant `false` and the compiler removes every planted branch.

/// A bug the simulator must find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// Record SYNCED at the version a delta carries when it is sent, before the agent acks it.
    SyncedOnSend,
    /// Answer every failure with a recovery snapshot, stale ones and failed recoveries included.
    SnapshotEveryFailure,
    /// Go on after a state write found a newer stream of the identity (superseded elsewhere).
    KeepSupersededStream,
    /// Answer a failed delta by sending the last delta again instead of a snapshot.
    RetryFailedDelta,
    /// Open a stream with a delta from the version Hello claims instead of a snapshot.
    DeltaFromClaim,
}

#[cfg(feature = "testing")]
thread_local! {
    static PLANTED: std::cell::Cell<Option<Bug>> = const { std::cell::Cell::new(None) };
}

/// Plants `bug` (or none) for the calling thread.
#[cfg(feature = "testing")]
pub fn plant(bug: Option<Bug>) {
    PLANTED.with(|p| p.set(bug));
}

/// Whether `bug` is planted on this thread.
#[inline]
pub fn on(bug: Bug) -> bool {
    #[cfg(feature = "testing")]
    {
        PLANTED.with(|p| p.get() == Some(bug))
    }
    #[cfg(not(feature = "testing"))]
    {
        let _ = bug;
        false
    }
}
