//! The enforcement contract: [`PolicyStore`] (what the sync loop hands every complete next
//! policy to, applied atomically or not at all), how a policy reached the kernel
//! ([`Installed`]), why it did not ([`EnforceError`]), tamper events (ENF-7), and
//! [`MemoryPolicyStore`], the store that only remembers, for tests of the sync loop.

use std::time::SystemTime;

use innerwall_wire::policy::WorkloadPolicy;

use super::netlink::NetlinkError;
use super::persist::PersistError;

/// How an applied policy reached the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// The kernel already held exactly this table; only the persisted copy changed (if at all).
    Unchanged,
    /// Peer-only change: set elements deleted and added in one batch (ENF-3).
    Elements { removed: usize, added: usize },
    /// The whole table replaced in one batch.
    Full,
    /// The element batch was refused, and a full replace installed the policy instead.
    FullAfterRefusedElements,
    /// The kill switch is engaged: persisted and held, not installed (acked `HELD`).
    Held,
}

/// Why a policy could not be applied. When `apply` returns an error, the previously applied
/// policy is still what the kernel enforces and what is persisted.
#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error("persisting the policy: {0}")]
    Persist(#[from] PersistError),
    #[error("installing the policy into table inet innerwall: {0}")]
    Install(#[source] NetlinkError),
    #[error("reading table inet innerwall: {0}")]
    Read(#[source] NetlinkError),
    #[error("removing table inet innerwall: {0}")]
    Remove(#[source] NetlinkError),
}

/// Takes each complete next policy and makes it the applied one, atomically: on `Ok` it is
/// both persisted and installed (the sync loop acks `APPLIED`), on `Err` nothing changed (the
/// sync loop acks `FAILED` with the error's text).
pub trait PolicyStore {
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError>;

    /// The applied policy (persisted and installed), if any.
    fn current(&self) -> Option<&WorkloadPolicy>;

    /// The applied version, 0 when none (what Hello reports).
    fn applied_version(&self) -> u64 {
        self.current().map_or(0, WorkloadPolicy::version)
    }

    /// Whether the kill switch is engaged: policies are then held, not installed.
    fn suspended(&self) -> bool {
        false
    }

    /// The applied version when its revert deadline passed unconfirmed (FLOW-11): it is enforced
    /// as its simulation. 0 otherwise. By default the deadline and the wall clock say.
    fn reverted_version(&self) -> u64 {
        self.current().filter(|p| p.reverted_at(now_ms())).map_or(0, WorkloadPolicy::version)
    }
}

/// The wall clock in unix milliseconds, the clock revert deadlines are written in.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A change to the owned table that the agent did not make, found and repaired (ENF-7). The
/// sync loop reports it in its next heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TamperEvent {
    pub at: SystemTime,
    /// What differed, e.g. `rules differ (15 installed, 14 expected); extra rule 13: …`.
    pub detail: String,
}

/// A store that only remembers: for the sync loop's unit tests. `fail_next` makes the next
/// apply fail, as a refused batch would.
#[derive(Debug, Default)]
pub struct MemoryPolicyStore {
    current: Option<WorkloadPolicy>,
    applied: Vec<u64>,
    pub fail_next: Option<String>,
}

impl MemoryPolicyStore {
    pub fn new(initial: Option<WorkloadPolicy>) -> MemoryPolicyStore {
        MemoryPolicyStore { current: initial, ..MemoryPolicyStore::default() }
    }

    /// Versions applied so far, in order.
    pub fn history(&self) -> &[u64] {
        &self.applied
    }
}

impl PolicyStore for MemoryPolicyStore {
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError> {
        if let Some(reason) = self.fail_next.take() {
            return Err(EnforceError::Install(NetlinkError::Refused {
                op: reason,
                errno: libc::EINVAL,
                detail: None,
            }));
        }
        let how = if self.current.as_ref() == Some(next) { Installed::Unchanged } else { Installed::Full };
        self.current = Some(next.clone());
        self.applied.push(next.version());
        Ok(how)
    }

    fn current(&self) -> Option<&WorkloadPolicy> {
        self.current.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use innerwall_wire::policy::Mode;

    #[test]
    fn memory_store_applies_or_changes_nothing() {
        let mut store = MemoryPolicyStore::new(None);
        assert_eq!(store.applied_version(), 0);
        let v1 = WorkloadPolicy::new(1, Mode::Simulation, []).unwrap();
        assert_eq!(store.apply(&v1).unwrap(), Installed::Full);
        store.fail_next = Some("a refused batch".into());
        let v2 = v1.clone().with_version(2);
        let err = store.apply(&v2).unwrap_err().to_string();
        assert!(err.contains("a refused batch"), "{err}");
        assert_eq!(store.current(), Some(&v1));
        assert_eq!(store.apply(&v2).unwrap(), Installed::Full);
        assert_eq!(store.history(), [1, 2]);
    }
}
