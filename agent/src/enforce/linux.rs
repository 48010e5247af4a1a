//! [`LinuxPolicyStore`]: persist, then install into `table inet innerwall` (ENF-1, ENF-4); peer-only
//! changes as one element batch with a full-replace fallback (ENF-3); fail-static restore of
//! the persisted policy (ENF-5); the kill switch (ENF-6); and drift detection and repair
//! (ENF-7). Netlink sockets are opened per operation in the calling thread's network namespace.
//!
//! The kill switch is a state, held on disk by a marker file: `innerwall-agent down` removes the
//! table and leaves the marker; until `innerwall-agent up` removes it, every policy that arrives
//! (a resend, a reconnect's snapshot, a new version, the restore at start) is persisted and held
//! but not installed, and drift repair is off. The running agent reports the state (SUSPENDED).
//! `down`, `up` and the store's own installs and drift checks take one lock on the state
//! directory, so an install in flight cannot put the table back after `down` removed it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use innerwall_wire::policy::WorkloadPolicy;

use super::desired::DesiredTable;
use super::netlink;
use super::nft;
use super::persist::{PersistError, PersistedPolicy};
use super::state::{self, TableState};
use super::store::{EnforceError, Installed, PolicyStore, TamperEvent, now_ms};

/// Marker left by `innerwall-agent down`: while it exists nothing is installed (policies are
/// persisted and held) and drift is not repaired. Only `innerwall-agent up` removes it.
pub const KILL_SWITCH_MARKER: &str = "down";

/// The lock `down`, `up` and the store's installs take, in the state directory.
const ENFORCE_LOCK: &str = "enforce.lock";

#[derive(Debug)]
struct Applied {
    policy: WorkloadPolicy,
    /// The table of the policy as enforced: its simulation once its revert deadline passed.
    desired: DesiredTable,
    /// The revert deadline had passed when `desired` was built (FLOW-11).
    reverted: bool,
    /// Computed on first need (drift check): the table state the kernel should hold.
    expected: Option<TableState>,
}

impl Applied {
    /// `policy` as enforced at `now_ms`.
    fn at(policy: WorkloadPolicy, now_ms: i64) -> Applied {
        let reverted = policy.reverted_at(now_ms);
        let desired = DesiredTable::from_policy(&policy.effective_at(now_ms));
        Applied { policy, desired, reverted, expected: None }
    }
}

/// The Linux enforcement backend.
#[derive(Debug)]
pub struct LinuxPolicyStore {
    file: PersistedPolicy,
    applied: Option<Applied>,
    /// The ruleset generation at which the kernel table was last found equal to the expected
    /// one; `None` forces a full comparison at the next drift check.
    verified_generation: Option<u32>,
    full_comparisons: u64,
    /// The kill switch was engaged when last looked at: once it is released, the held policy is
    /// installed as a resumption, not repaired as drift.
    was_suspended: bool,
    #[cfg(feature = "testing")]
    fault_next_full_replace: bool,
}

/// What [`LinuxPolicyStore::restore_persisted`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// No persisted policy: nothing to enforce yet.
    Nothing,
    /// The kernel already held exactly the persisted policy's table (rules survived the agent).
    AlreadyInstalled { version: u64 },
    /// The persisted policy was installed with a full replace.
    Installed { version: u64 },
    /// The kill switch is engaged: the persisted policy is held, not installed.
    Suspended { version: u64 },
}

impl LinuxPolicyStore {
    /// A store over a state directory; nothing is read or installed until
    /// [`restore_persisted`](Self::restore_persisted) or [`apply`](PolicyStore::apply).
    pub fn new(state_dir: impl Into<PathBuf>) -> LinuxPolicyStore {
        LinuxPolicyStore {
            file: PersistedPolicy::new(state_dir),
            applied: None,
            verified_generation: None,
            full_comparisons: 0,
            was_suspended: false,
            #[cfg(feature = "testing")]
            fault_next_full_replace: false,
        }
    }

    pub fn state_dir(&self) -> &Path {
        self.file.state_dir()
    }

    /// Fail static (ENF-5): load the persisted policy and make the kernel hold it, before the
    /// agent dials anything. A corrupt file is an error naming it; the kernel is left as it is.
    /// With the kill switch engaged the policy is loaded and held, not installed.
    pub fn restore_persisted(&mut self) -> Result<Restored, EnforceError> {
        let _lock = lock(self.state_dir());
        let Some(policy) = self.file.load()? else {
            return Ok(Restored::Nothing);
        };
        let version = policy.version();
        let mut applied = Applied::at(policy, now_ms());
        if applied.reverted {
            tracing::warn!(
                version,
                "the persisted policy's promotion was not confirmed by its deadline: enforcing it as its simulation"
            );
        }
        if self.suspended() {
            self.was_suspended = true;
            self.applied = Some(applied);
            return Ok(Restored::Suspended { version });
        }
        let expected = nft::expected_state(&applied.desired);
        let holds = install_unless_held(&applied.desired, &expected)?;
        applied.expected = Some(expected);
        self.applied = Some(applied);
        self.verified_generation = None;
        Ok(if holds { Restored::AlreadyInstalled { version } } else { Restored::Installed { version } })
    }

    /// Drift (ENF-7), cheap when nothing changed: compares the ruleset generation id with the
    /// last verified one; only when it moved is the table read back and compared in full. A
    /// difference is repaired with a full replace and returned as a tamper event.
    ///
    /// While the kill switch is engaged nothing is checked; once it is released, the held policy
    /// is installed (unless `innerwall-agent up` already did) and that is not drift.
    pub fn check_drift(&mut self, now: SystemTime) -> Result<Option<TamperEvent>, EnforceError> {
        let _lock = lock(self.state_dir());
        let suspended = self.suspended();
        let Some(applied) = self.applied.as_mut() else {
            self.was_suspended = suspended;
            return Ok(None);
        };
        if suspended {
            self.was_suspended = true;
            return Ok(None);
        }
        if self.was_suspended {
            let expected = applied.expected.get_or_insert_with(|| nft::expected_state(&applied.desired));
            install_unless_held(&applied.desired, expected)?;
            self.was_suspended = false;
            self.verified_generation = None;
            tracing::info!(
                version = applied.policy.version(),
                "kill switch released: the held policy is enforced again"
            );
            return Ok(None);
        }
        let generation = netlink::generation().map_err(EnforceError::Read)?;
        if self.verified_generation == Some(generation) {
            return Ok(None);
        }
        self.full_comparisons += 1;
        let expected = applied.expected.get_or_insert_with(|| nft::expected_state(&applied.desired));
        let differences = match state::read_table().map_err(EnforceError::Read)? {
            None => vec!["table inet innerwall is missing".to_owned()],
            Some(state) => state.differences(expected),
        };
        if differences.is_empty() {
            self.verified_generation = Some(generation);
            return Ok(None);
        }
        let detail = differences.join("; ");
        tracing::warn!(
            version = applied.policy.version(),
            %detail,
            "table inet innerwall was changed outside the agent; restoring it"
        );
        nft::full_replace_batch(&applied.desired).send().map_err(EnforceError::Install)?;
        self.verified_generation = None;
        Ok(Some(TamperEvent { at: now, detail }))
    }

    /// The revert deadline (FLOW-11): once the applied policy's deadline passed unconfirmed, its
    /// simulation replaces it in the kernel (held instead while the kill switch is engaged).
    /// Returns the version reverted now, if this call reverted it.
    pub fn check_deadline(&mut self, now_ms: i64) -> Result<Option<u64>, EnforceError> {
        if !self.applied.as_ref().is_some_and(|a| !a.reverted && a.policy.reverted_at(now_ms)) {
            return Ok(None);
        }
        let _lock = lock(self.state_dir());
        let Some(current) = self.applied.as_ref() else { return Ok(None) };
        let next = Applied::at(current.policy.clone(), now_ms);
        if !self.suspended() {
            self.full_replace(&next.desired)?;
            self.verified_generation = None;
        }
        let version = next.policy.version();
        tracing::warn!(
            version,
            "the promotion to enforcement was not confirmed by its deadline: enforcing v{version} as its simulation"
        );
        self.applied = Some(next);
        Ok(Some(version))
    }

    /// Whether the kill switch is engaged (`innerwall-agent down` until `innerwall-agent up`).
    pub fn suspended(&self) -> bool {
        self.state_dir().join(KILL_SWITCH_MARKER).exists()
    }

    /// How many drift checks read the table back (the rest stopped at the generation id).
    pub fn full_comparisons(&self) -> u64 {
        self.full_comparisons
    }

    /// Test hook: the next full replace carries a rule the kernel refuses half way.
    #[cfg(feature = "testing")]
    pub fn inject_fault_in_next_full_replace(&mut self) {
        self.fault_next_full_replace = true;
    }

    fn install(&mut self, next: &WorkloadPolicy, desired: &DesiredTable) -> Result<Installed, EnforceError> {
        if let Some(current) = &self.applied
            && let Some(update) = desired.element_update_from(&current.desired)
        {
            if update.is_empty() {
                return Ok(Installed::Unchanged);
            }
            let removed = update.values().map(|d| d.remove.len()).sum();
            let added = update.values().map(|d| d.add.len()).sum();
            match nft::element_batch(desired, &update).send() {
                Ok(()) => return Ok(Installed::Elements { removed, added }),
                Err(err) => {
                    tracing::warn!(
                        version = next.version(),
                        "kernel refused the element update ({err}); falling back to a full replace"
                    );
                    self.full_replace(desired)?;
                    return Ok(Installed::FullAfterRefusedElements);
                }
            }
        }
        self.full_replace(desired)?;
        Ok(Installed::Full)
    }

    fn full_replace(&mut self, desired: &DesiredTable) -> Result<(), EnforceError> {
        #[cfg(feature = "testing")]
        if std::mem::take(&mut self.fault_next_full_replace) {
            let broken = desired.with_rule_the_kernel_refuses();
            return nft::full_replace_batch(&broken).send().map_err(EnforceError::Install);
        }
        nft::full_replace_batch(desired).send().map_err(EnforceError::Install)
    }
}

impl PolicyStore for LinuxPolicyStore {
    /// Persist (durably), then install; on an install failure the previous policy is
    /// persisted again, so disk and kernel keep agreeing on the last applied policy. With the
    /// kill switch engaged the policy is persisted and held, not installed.
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError> {
        let _lock = lock(self.state_dir());
        self.file.store(next)?;
        let applied = Applied::at(next.clone(), now_ms());
        if self.suspended() {
            self.was_suspended = true;
            self.applied = Some(applied);
            return Ok(Installed::Held);
        }
        match self.install(next, &applied.desired) {
            Ok(how) => {
                self.applied = Some(applied);
                self.verified_generation = None;
                Ok(how)
            }
            Err(err) => {
                let rollback = match &self.applied {
                    Some(previous) => self.file.store(&previous.policy),
                    None => self.file.remove(),
                };
                if let Err(e) = rollback {
                    tracing::error!(
                        "could not restore the previously persisted policy after a failed install: {e}"
                    );
                }
                Err(err)
            }
        }
    }

    fn current(&self) -> Option<&WorkloadPolicy> {
        self.applied.as_ref().map(|a| &a.policy)
    }

    fn suspended(&self) -> bool {
        LinuxPolicyStore::suspended(self)
    }

    /// What the kernel holds says: the version whose simulation replaced it at its deadline.
    fn reverted_version(&self) -> u64 {
        self.applied.as_ref().filter(|a| a.reverted).map_or(0, |a| a.policy.version())
    }
}

/// Installs `desired` with a full replace unless the kernel already holds exactly `expected`;
/// returns whether it did.
fn install_unless_held(desired: &DesiredTable, expected: &TableState) -> Result<bool, EnforceError> {
    let holds =
        state::read_table().map_err(EnforceError::Read)?.is_some_and(|s| s.differences(expected).is_empty());
    if !holds {
        nft::full_replace_batch(desired).send().map_err(EnforceError::Install)?;
    }
    Ok(holds)
}

/// The state directory's enforcement lock, when the directory exists (`down` may run where
/// the agent never did). Without it the operation goes on: a lock that cannot be taken must not
/// stop a kill switch.
fn lock(state_dir: &Path) -> Option<fs::File> {
    if !state_dir.is_dir() {
        return None;
    }
    crate::private::lock(&state_dir.join(ENFORCE_LOCK))
        .map_err(|e| tracing::warn!("could not lock {}: {e}", state_dir.join(ENFORCE_LOCK).display()))
        .ok()
}

/// What `innerwall-agent down` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KillSwitchReport {
    pub table_removed: bool,
    /// The persisted policy's version, kept for the next start (`None`: none persisted).
    pub persisted_version: Option<u64>,
    /// Why the persisted policy could not be read, if it could not.
    pub persisted_error: Option<String>,
}

/// The kill switch (ENF-6): delete `table inet innerwall` and nothing else, keep the persisted
/// policy, and leave the marker that holds every later policy uninstalled until
/// [`release_kill_switch`]. The marker is written first: a table an install puts back in
/// between is removed here, and none comes after it.
pub fn kill_switch(state_dir: &Path) -> Result<KillSwitchReport, EnforceError> {
    let _lock = lock(state_dir);
    if state_dir.is_dir()
        && let Err(e) = crate::private::write(
            &state_dir.join(KILL_SWITCH_MARKER),
            b"table inet innerwall removed by the kill switch; `innerwall-agent up` releases it\n",
        )
    {
        tracing::warn!("could not write the kill switch marker in {}: {e}", state_dir.display());
    }
    let table_removed = nft::delete_table().map_err(EnforceError::Remove)?;
    let (persisted_version, persisted_error) = match PersistedPolicy::new(state_dir).load() {
        Ok(p) => (p.map(|p| p.version()), None),
        Err(e) => (None, Some(e.to_string())),
    };
    Ok(KillSwitchReport { table_removed, persisted_version, persisted_error })
}

/// What `innerwall-agent up` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseReport {
    /// The kill switch was engaged.
    pub was_engaged: bool,
    /// The persisted policy now installed (`None`: none persisted, nothing to install).
    pub installed_version: Option<u64>,
}

/// Releases the kill switch: installs the persisted policy (the latest the agent held while
/// down) and removes the marker. A running agent notices at its next drift check and reports
/// it enforces again. On an install failure the switch stays engaged.
pub fn release_kill_switch(state_dir: &Path) -> Result<ReleaseReport, EnforceError> {
    let _lock = lock(state_dir);
    let marker = state_dir.join(KILL_SWITCH_MARKER);
    let was_engaged = marker.exists();
    let policy = PersistedPolicy::new(state_dir).load()?;
    if let Some(policy) = &policy {
        let desired = DesiredTable::from_policy(&policy.effective_at(now_ms()));
        install_unless_held(&desired, &nft::expected_state(&desired))?;
    }
    match fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            let what = "removing the kill switch marker";
            return Err(EnforceError::Persist(PersistError::Io { what, path: marker, source }));
        }
    }
    Ok(ReleaseReport { was_engaged, installed_version: policy.map(|p| p.version()) })
}
