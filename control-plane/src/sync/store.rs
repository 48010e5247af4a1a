//! What a stream reads and writes, behind one trait (`SyncStore`): Hello's admission with the
//! stream's epoch, state writes that apply only while the stream is the newest, heartbeats,
//! the persisted policy, inventory and OFFLINE at the end. [`PgSyncStore`] is the production
//! one (batched records and beats and shared reads on the streams' pool, renders on the authoring pool);
//! [`MemoryStore`] keeps the same rules in memory for tests and the simulator.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Version, WorkloadPolicy};
use innerwall_wire::sync::{Heartbeat, Hello, SyncState};
use sqlx::PgPool;

use super::beats::{Beat, Beats};
use super::reads::Reads;
use super::records::Records;
use super::session::Record;
use crate::audit;
use crate::error::Error;

/// The stream's side of the database. Every write of a stream names its epoch and applies only
/// while no newer stream of the identity has said Hello.
pub trait SyncStore: Send + Sync {
    /// Admits a stream's Hello: refuses an unknown, retired or deny-listed workload; takes the
    /// next epoch (returned); records the version the agent reports installed and looks for a
    /// clone (the same identity from another host).
    fn hello(
        &self,
        id: WorkloadId,
        key_sha256: &str,
        hello: &Hello,
        liveness: Duration,
    ) -> impl Future<Output = Result<i64, Error>> + Send;

    /// The persisted policy, rendering first if the workload has none (POL-6 repair).
    fn persisted(&self, id: WorkloadId) -> impl Future<Output = Result<WorkloadPolicy, Error>> + Send;

    /// The latest persisted policy and when it was committed, if there is one.
    fn latest(
        &self,
        id: WorkloadId,
    ) -> impl Future<Output = Result<Option<(WorkloadPolicy, DateTime<Utc>)>, Error>> + Send;

    /// Writes the state (an install first, when the record says one happened); false when a
    /// newer stream owns the workload.
    fn record(
        &self,
        id: WorkloadId,
        epoch: i64,
        record: &Record,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// A heartbeat: the stream's liveness (restoring `state` if a sweep marked it OFFLINE), the
    /// renewal trouble and tamper reports it carries.
    fn beat(
        &self,
        id: WorkloadId,
        epoch: i64,
        state: Option<SyncState>,
        heartbeat: &Heartbeat,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Stores reported addresses and renders if they changed, unless they changed less than the
    /// minimum interval ago (on any stream or replica) or the render lock stays busy: then how
    /// long to wait before trying again.
    fn commit_inventory(
        &self,
        id: WorkloadId,
        addresses: &BTreeSet<IpAddr>,
    ) -> impl Future<Output = Result<Option<Duration>, Error>> + Send;

    /// Marks the workload OFFLINE with `reason`, unless a newer stream has opened since.
    fn mark_offline(&self, id: WorkloadId, epoch: i64, reason: &str) -> impl Future<Output = ()> + Send;

    /// The liveness sweep (SYNC-6): every workload silent longer than its stream tolerates is
    /// marked OFFLINE, whichever replica held the stream; returns them.
    fn sweep(&self) -> impl Future<Output = Result<Vec<WorkloadId>, Error>> + Send;

    /// The persisted policy of `version`, if the store keeps it. Only the planted bug that
    /// takes a delta's base from Hello's claim reads it (`planted`); the production store
    /// keeps no such read.
    fn policy_at(
        &self,
        _id: WorkloadId,
        _version: Version,
    ) -> impl Future<Output = Option<WorkloadPolicy>> + Send {
        async { None }
    }
}

/// The production store.
#[derive(Debug)]
pub struct PgSyncStore {
    /// Stream state: Hello, records (through `records`), heartbeats (through `beats`), reads
    /// (through `reads`).
    pool: PgPool,
    /// Renders a stream causes (inventory changes, the repair render).
    renders: PgPool,
    beats: Beats,
    reads: Reads,
    records: Records,
    inventory_min_interval: Duration,
    report_coalesce: Duration,
}

impl PgSyncStore {
    pub fn new(
        pool: PgPool,
        renders: PgPool,
        inventory_min_interval: Duration,
        report_coalesce: Duration,
    ) -> Self {
        PgSyncStore {
            beats: Beats::start(pool.clone()),
            reads: Reads::start(pool.clone()),
            records: Records::start(pool.clone()),
            pool,
            renders,
            inventory_min_interval,
            report_coalesce,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Stores `addresses` as the workload's reported addresses and renders, if they changed.
    async fn store_addresses(&self, id: WorkloadId, addresses: &BTreeSet<IpAddr>) -> Result<(), Error> {
        let current: Vec<String> = sqlx::query_scalar(
            "SELECT host(address) FROM workload_addresses WHERE workload_id = $1 ORDER BY 1",
        )
        .bind(id.uuid())
        .fetch_all(&self.pool)
        .await?;
        let current: BTreeSet<IpAddr> = current.iter().filter_map(|a| a.parse().ok()).collect();
        if current == *addresses {
            return Ok(());
        }
        // A change of addresses changes peer sets: it renders like any other change (POL-4),
        // and the render judges the new addresses (address trust).
        crate::policy::authoring::commit_holding(
            &self.renders,
            &format!("workload:{id}"),
            "workload.inventory",
            &id.to_string(),
            async |c| {
                crate::policy::authoring::set_addresses(c, id, addresses).await?;
                let list: Vec<String> = addresses.iter().map(ToString::to_string).collect();
                Ok(((), serde_json::json!({"addresses": list})))
            },
        )
        .await?;
        Ok(())
    }
}

fn cut(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

impl SyncStore for PgSyncStore {
    async fn hello(
        &self,
        id: WorkloadId,
        key_sha256: &str,
        hello: &Hello,
        liveness: Duration,
    ) -> Result<i64, Error> {
        let row: Option<bool> = sqlx::query_scalar(
            "SELECT retired_at IS NOT NULL OR denied_at IS NOT NULL FROM workloads WHERE id = $1",
        )
        .bind(id.uuid())
        .fetch_optional(&self.pool)
        .await?;
        let Some(gone) = row else {
            return Err(Error::NotFound { what: "workload", name: id.to_string() });
        };
        if gone {
            return Err(Error::Refused(format!(
                "workload {id} is retired or deny-listed; enroll the host again"
            )));
        }
        let epoch: i64 = sqlx::query_scalar(
            // A Hello is a sign of life: readers judge silence from `last_seen_at` against the
            // liveness written here (`shown`), so both move together.
            "UPDATE workloads SET stream_epoch = stream_epoch + 1, stream_liveness = make_interval(secs => $2),
                 last_seen_at = now(), agent_capabilities = $3
             WHERE id = $1 RETURNING stream_epoch",
        )
        .bind(id.uuid())
        .bind(liveness.as_secs_f64())
        // What the agent says it can do, bounded where the Hello was decoded (`wire::convert`).
        .bind(&hello.agent.capabilities)
        .fetch_one(&self.pool)
        .await?;
        // A promotion its host reverted at the deadline while it could not say so (FLOW-11).
        crate::safety::confirm::reported_revert(&self.pool, id, hello.reverted_version).await?;
        // The same identity from a second host: a cloned image or a stolen key (IDN-7), judged
        // by boot id and certificate key, audited once per episode.
        let presenter = crate::identity::clones::Presenter::new(hello.facts.as_ref(), key_sha256);
        crate::identity::clones::observe(&self.pool, id, &presenter).await?;
        // A version applied whose ack was lost with the last connection (FLOW-5).
        crate::flows::installs::reported(&self.pool, id, hello.applied_version).await?;
        Ok(epoch)
    }

    async fn persisted(&self, id: WorkloadId) -> Result<WorkloadPolicy, Error> {
        if let Some((p, _)) = self.reads.latest(id).await? {
            return Ok(p);
        }
        tracing::warn!(workload = %id, "no persisted policy when its stream opened: repair render");
        // Audited like any render that moves versions (POL-6, POL-8): who (this workload's
        // stream), why, and the versions it moved.
        crate::policy::authoring::commit_holding(
            &self.renders,
            &format!("workload:{id}"),
            "policy.repair-render",
            &id.to_string(),
            async |_| Ok(((), serde_json::json!({"reason": "no persisted policy when its stream opened"}))),
        )
        .await?;
        self.reads
            .latest(id)
            .await?
            .map(|(p, _)| p)
            .ok_or_else(|| Error::Invalid(format!("workload {id} has no policy even after a repair render")))
    }

    async fn latest(&self, id: WorkloadId) -> Result<Option<(WorkloadPolicy, DateTime<Utc>)>, Error> {
        self.reads.latest(id).await
    }

    async fn record(&self, id: WorkloadId, epoch: i64, r: &Record) -> Result<bool, Error> {
        self.records.write(id, epoch, r.clone()).await
    }

    async fn beat(
        &self,
        id: WorkloadId,
        epoch: i64,
        state: Option<SyncState>,
        h: &Heartbeat,
    ) -> Result<(), Error> {
        // A sweep that found this stream silent (a heartbeat write delayed past the bound) is
        // answered by the stream's own state, if it is still the newest stream.
        let beat = Beat { workload: id.uuid(), epoch, state: state.map_or(0, |s| s.code()) };
        self.beats.write(beat).await?;
        crate::safety::confirm::reported_revert(&self.pool, id, h.reverted_version).await?;
        if !h.credential_renewal_error.is_empty() {
            tracing::warn!(workload = %id, "agent reports credential renewal failing: {}", cut(&h.credential_renewal_error, 256));
            crate::identity::enroll::record_reported_renewal_failure(
                &self.pool,
                id,
                &h.credential_renewal_error,
            )
            .await?;
        }
        // At most what an agent sends (`convert` bounds it): the distinct details and one entry
        // counting the rest.
        for event in &h.tamper_events {
            let (detail, count) = (&event.detail, event.count);
            tracing::warn!(workload = %id, count, "agent repaired its table after an outside change: {}", cut(detail, 256));
            // One row per workload per coalescing window, counting every change reported.
            let (actor, subject) = (format!("workload:{id}"), id.to_string());
            let detail = serde_json::json!({"detected_at_unix_ms": event.detected_at_unix_ms, "detail": detail, "count": count});
            let record = audit::Record::new(&actor, "workload.tamper", &subject).detail(detail);
            let mut conn = self.pool.acquire().await?;
            audit::coalesce(&mut conn, &record, self.report_coalesce, u64::from(count)).await?;
        }
        Ok(())
    }

    async fn commit_inventory(
        &self,
        id: WorkloadId,
        addresses: &BTreeSet<IpAddr>,
    ) -> Result<Option<Duration>, Error> {
        let wait: Option<f64> = sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM addresses_changed_at + make_interval(secs => $2) - now())::float8
             FROM workloads WHERE id = $1",
        )
        .bind(id.uuid())
        .bind(self.inventory_min_interval.as_secs_f64())
        .fetch_one(&self.pool)
        .await?;
        if let Some(wait) = wait.filter(|w| *w > 0.0) {
            return Ok(Some(Duration::from_secs_f64(wait)));
        }
        match self.store_addresses(id, addresses).await {
            // The render lock stayed busy (a long render queue): keep the report and try again
            // after an interval instead of ending the stream.
            Err(Error::Busy(why)) => {
                tracing::warn!(workload = %id, "inventory change deferred: {why}");
                Ok(Some(self.inventory_min_interval.max(Duration::from_secs(1))))
            }
            other => other.map(|()| None),
        }
    }

    async fn mark_offline(&self, id: WorkloadId, epoch: i64, reason: &str) {
        let result = sqlx::query(
            "UPDATE workloads SET sync_state = $2, sync_detail = $3 WHERE id = $1 AND stream_epoch = $4",
        )
        .bind(id.uuid())
        .bind(SyncState::Offline.code())
        .bind(reason)
        .bind(epoch)
        .execute(&self.pool)
        .await;
        if let Err(e) = result {
            tracing::error!(workload = %id, "could not record OFFLINE: {e}");
        }
    }

    async fn sweep(&self) -> Result<Vec<WorkloadId>, Error> {
        super::liveness::sweep(&self.pool).await
    }
}

/// One workload as [`MemoryStore`] holds it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryWorkload {
    /// Retired or deny-listed.
    pub gone: bool,
    pub epoch: i64,
    /// Every persisted version, oldest first, with when it was committed.
    pub policies: Vec<(WorkloadPolicy, DateTime<Utc>)>,
    pub state: Option<SyncState>,
    pub applied: Option<Version>,
    pub detail: String,
    /// Versions the host installed, with their mode.
    pub installed: BTreeSet<(Version, Mode)>,
    pub addresses: BTreeSet<IpAddr>,
    /// Heartbeats taken from the newest stream.
    pub beats: u64,
    /// Epochs of streams whose state write was refused because a newer stream had opened.
    pub superseded_writes: BTreeSet<i64>,
    /// The last sign of life (Hello, a state write, a heartbeat of the newest stream) and the
    /// silence its stream tolerates, by the store's clock ([`MemoryStore::set_clock`]).
    pub last_seen: Option<DateTime<Utc>>,
    pub liveness: Option<Duration>,
}

impl MemoryWorkload {
    /// The state readers show from the stored facts alone (`shown`, silence aside): SYNCED
    /// behind the latest persisted version reads PENDING.
    pub fn shown_state(&self) -> Option<SyncState> {
        let behind = self.policies.last().is_some_and(|(p, _)| Some(p.version()) > self.applied);
        self.state.map(|stored| crate::shown::shown(stored, false, behind, None, None, DateTime::UNIX_EPOCH))
    }
}

/// The store's rules in memory: epochs, state writes of the newest stream only, persisted
/// versions appended by the test. Renders are the test's (a workload without a policy is
/// refused, not repaired).
#[derive(Debug, Default)]
pub struct MemoryStore {
    workloads: Mutex<BTreeMap<WorkloadId, MemoryWorkload>>,
    /// What `now()` is to the store (the Unix epoch until a test sets it).
    clock: Mutex<DateTime<Utc>>,
}

/// Everything a [`MemoryStore`] holds at a moment ([`MemoryStore::backup`]).
#[derive(Debug, Clone)]
pub struct MemoryBackup(BTreeMap<WorkloadId, MemoryWorkload>);

impl MemoryStore {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<WorkloadId, MemoryWorkload>) -> T) -> T {
        f(&mut self.workloads.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Persists `policy` as `id`'s next version (registering the workload if new).
    pub fn persist(&self, id: WorkloadId, policy: WorkloadPolicy, committed: DateTime<Utc>) {
        self.with(|w| w.entry(id).or_default().policies.push((policy, committed)));
    }

    /// Retires or deny-lists `id`.
    pub fn retire(&self, id: WorkloadId) {
        self.with(|w| w.entry(id).or_default().gone = true);
    }

    /// `id` as stored now.
    pub fn workload(&self, id: WorkloadId) -> Option<MemoryWorkload> {
        self.with(|w| w.get(&id).cloned())
    }

    /// Sets the store's clock: signs of life are stamped with it and the sweep judges by it.
    pub fn set_clock(&self, now: DateTime<Utc>) {
        *self.clock.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }

    fn now(&self) -> DateTime<Utc> {
        *self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Everything stored now.
    pub fn backup(&self) -> MemoryBackup {
        MemoryBackup(self.with(|w| w.clone()))
    }

    /// Replaces everything stored with `backup` (a restore: whatever was written since is gone).
    pub fn restore(&self, backup: &MemoryBackup) {
        self.with(|w| w.clone_from(&backup.0));
    }
}

impl SyncStore for MemoryStore {
    async fn hello(
        &self,
        id: WorkloadId,
        _key: &str,
        hello: &Hello,
        liveness: Duration,
    ) -> Result<i64, Error> {
        let now = self.now();
        self.with(|w| {
            let Some(row) = w.get_mut(&id) else {
                return Err(Error::NotFound { what: "workload", name: id.to_string() });
            };
            if row.gone {
                return Err(Error::Refused(format!(
                    "workload {id} is retired or deny-listed; enroll the host again"
                )));
            }
            row.epoch += 1;
            (row.last_seen, row.liveness) = (Some(now), Some(liveness));
            // A version the host reports it holds counts as installed once it was persisted.
            if let Some((p, _)) = row.policies.iter().find(|(p, _)| p.version() == hello.applied_version) {
                row.installed.insert((p.version(), p.mode()));
            }
            Ok(row.epoch)
        })
    }

    async fn persisted(&self, id: WorkloadId) -> Result<WorkloadPolicy, Error> {
        self.latest(id)
            .await?
            .map(|(p, _)| p)
            .ok_or_else(|| Error::Invalid(format!("workload {id} has no persisted policy")))
    }

    async fn latest(&self, id: WorkloadId) -> Result<Option<(WorkloadPolicy, DateTime<Utc>)>, Error> {
        Ok(self.with(|w| w.get(&id).and_then(|row| row.policies.last().cloned())))
    }

    async fn record(&self, id: WorkloadId, epoch: i64, r: &Record) -> Result<bool, Error> {
        let now = self.now();
        Ok(self.with(|w| {
            let Some(row) = w.get_mut(&id) else { return false };
            if let (Some(mode), Some(version)) = (r.installed, r.applied) {
                row.installed.insert((version, mode));
            }
            if row.epoch != epoch {
                row.superseded_writes.insert(epoch);
                return false;
            }
            row.state = Some(r.state);
            row.last_seen = Some(now);
            row.applied = r.applied.or(row.applied);
            if let Some(detail) = &r.detail {
                row.detail.clone_from(detail);
            }
            true
        }))
    }

    async fn beat(
        &self,
        id: WorkloadId,
        epoch: i64,
        state: Option<SyncState>,
        _h: &Heartbeat,
    ) -> Result<(), Error> {
        let now = self.now();
        self.with(|w| {
            if let Some(row) = w.get_mut(&id).filter(|row| row.epoch == epoch) {
                row.beats += 1;
                row.last_seen = Some(now);
                if row.state == Some(SyncState::Offline) {
                    row.state = state;
                }
            }
        });
        Ok(())
    }

    async fn commit_inventory(
        &self,
        id: WorkloadId,
        addresses: &BTreeSet<IpAddr>,
    ) -> Result<Option<Duration>, Error> {
        self.with(|w| {
            if let Some(row) = w.get_mut(&id) {
                row.addresses.clone_from(addresses);
            }
        });
        Ok(None)
    }

    async fn mark_offline(&self, id: WorkloadId, epoch: i64, reason: &str) {
        self.with(|w| {
            if let Some(row) = w.get_mut(&id).filter(|row| row.epoch == epoch) {
                row.state = Some(SyncState::Offline);
                reason.clone_into(&mut row.detail);
            }
        });
    }

    async fn sweep(&self) -> Result<Vec<WorkloadId>, Error> {
        let now = self.now();
        Ok(self.with(|w| {
            let mut swept = Vec::new();
            for (id, row) in w.iter_mut() {
                let (Some(seen), Some(liveness)) = (row.last_seen, row.liveness) else { continue };
                let silent = chrono::Duration::from_std(liveness).is_ok_and(|l| seen + l < now);
                if silent && row.state != Some(SyncState::Offline) {
                    row.state = Some(SyncState::Offline);
                    row.detail = "silent for longer than its liveness bound".into();
                    swept.push(*id);
                }
            }
            swept
        }))
    }

    async fn policy_at(&self, id: WorkloadId, version: Version) -> Option<WorkloadPolicy> {
        self.with(|w| {
            let row = w.get(&id)?;
            row.policies.iter().find(|(p, _)| p.version() == version).map(|(p, _)| p.clone())
        })
    }
}
