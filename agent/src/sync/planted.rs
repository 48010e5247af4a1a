//! Bugs planted on purpose in the agent's stream core, so the simulator can prove it finds them
//! (issue 30). Each is off unless a test turns it on for its own thread; without the `planted`
//! feature [`on`] is a constant `false` and the compiler removes every planted branch.

/// A bug the simulator must find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// Ack an update as applied when it arrives, before it is persisted and installed.
    AckBeforePersist,
}

#[cfg(feature = "planted")]
thread_local! {
    static PLANTED: std::cell::Cell<Option<Bug>> = const { std::cell::Cell::new(None) };
}

/// Plants `bug` (or none) for the calling thread.
#[cfg(feature = "planted")]
pub fn plant(bug: Option<Bug>) {
    PLANTED.with(|p| p.set(bug));
}

/// Whether `bug` is planted on this thread.
#[inline]
pub fn on(bug: Bug) -> bool {
    #[cfg(feature = "planted")]
    {
        PLANTED.with(|p| p.get() == Some(bug))
    }
    #[cfg(not(feature = "planted"))]
    {
        let _ = bug;
        false
    }
}
