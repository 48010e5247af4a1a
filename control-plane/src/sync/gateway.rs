//! The agent gateway (SYNC-2..SYNC-11): the Sync stream and credential renewal. One task per
//! stream drives a pure [`Session`] with the stream's messages, announcements from the NOTIFY
//! bridge and directives; its outbound queue is bounded, so a slow agent only slows itself and
//! its pending announcements coalesce into one delta from its tip to the latest version.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::WorkloadPolicy;
use innerwall_wire::proto;
use innerwall_wire::sync::{
    AgentMessage, ControlMessage, Directive, Heartbeat, Hello, HelloAck, MAX_POLICY_MESSAGE,
};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::audit;
use crate::error::Error;
use crate::identity::enroll::Enroller;
use crate::identity::listener::{AgentIdentity, agent_identity, identity};
use crate::metrics::{AckStatus, Metrics};
use crate::postgres::Pools;
use crate::sync::beats::{Beat, Beats};
use crate::sync::reads::Reads;
use crate::sync::session::{Action, Record, Session, SyncState, Update};

/// Timing the gateway hands each agent in `HelloAck`, and the liveness bound derived from it.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub heartbeat: Duration,
    pub inventory: Duration,
    /// At most one inventory-driven address change per workload renders per interval; reports
    /// in between coalesce into the latest (checked in the database, so reconnecting or a
    /// second stream does not reset it).
    pub inventory_min_interval: Duration,
    pub flow_window: Duration,
    pub flow_window_max_keys: u32,
    /// Updates queued towards one agent before the stream task waits (and coalesces).
    pub outbound_queue: usize,
    /// Per-identity rate bounds (REL-1): heartbeats and stream opens here, uploads in the
    /// telemetry service, which shares this replica's limiter ([`Gateway::bounds`]).
    pub bounds: crate::rate::AgentBounds,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            heartbeat: Duration::from_secs(30),
            inventory: Duration::from_secs(300),
            inventory_min_interval: Duration::from_secs(5),
            flow_window: Duration::from_secs(60),
            flow_window_max_keys: 10_000,
            outbound_queue: 8,
            bounds: crate::rate::AgentBounds::default(),
        }
    }
}

impl GatewayConfig {
    /// A stream silent this long is closed (SYNC-9): three heartbeat intervals.
    pub fn liveness(&self) -> Duration {
        self.heartbeat * 3
    }
}

/// Messages from outside to one stream's task.
#[derive(Debug, Clone)]
enum Control {
    /// Tell the agent to reconnect (directed resend-snapshot, SYNC-8), then end the stream.
    Reconnect,
    /// End the stream: superseded by a newer one from the same identity, or the replica is
    /// shutting down.
    End { reason: String, superseded: bool },
    /// Tell the agent to enroll again (the workload was retired or deny-listed), then end.
    Reenroll { reason: String },
}

/// What a stream's task is told from outside, on one watch channel per stream (PERF-4: an
/// idle stream holds one small channel, not a channel per kind of news).
#[derive(Debug, Default)]
struct Signal {
    /// The newest version a render announced for this workload.
    announced: u64,
    /// The first instruction to end the stream; every one ends it, so later ones are moot.
    control: Option<Control>,
}

#[derive(Debug)]
struct Handle {
    generation: u64,
    signal: watch::Sender<Signal>,
}

impl Handle {
    /// Hands `control` to the stream's task; false if the task is gone.
    fn control(&self, control: Control) -> bool {
        self.signal.send_if_modified(|signal| {
            let first = signal.control.is_none();
            if first {
                signal.control = Some(control);
            }
            first
        });
        !self.signal.is_closed()
    }
}

#[derive(Debug)]
struct Inner {
    /// Stream state: Hello, records, heartbeats (through `beats`), reads of the persisted policy
    /// (through `reads`).
    pool: PgPool,
    /// Renders a stream causes (inventory changes, the repair render).
    renders: PgPool,
    config: GatewayConfig,
    enroller: Enroller,
    streams: Mutex<BTreeMap<WorkloadId, Handle>>,
    generations: AtomicU64,
    metrics: Arc<Metrics>,
    /// Every stream's heartbeats, written in batches on `pool`.
    beats: Beats,
    /// Every stream's reads of its persisted policy, shared on `pool`.
    reads: Reads,
    /// This replica's per-identity rate bounds.
    bounds: crate::rate::Bounds,
}

/// The streams this replica holds. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

/// A stream's queue to its agent. Messages are boxed: the channel allocates its first block of
/// slots whole, and boxed slots keep that block a third of the size (PERF-4).
type Outbound = mpsc::Sender<Result<Box<proto::SyncResponse>, Status>>;

impl Gateway {
    pub fn new(pools: &Pools, config: GatewayConfig, enroller: Enroller, metrics: Arc<Metrics>) -> Self {
        let counted = metrics.clone();
        let bounds = crate::rate::Bounds::new(
            config.bounds.clone(),
            Arc::new(move |bound| counted.agent_refused(bound)),
        );
        Gateway {
            inner: Arc::new(Inner {
                pool: pools.streams.clone(),
                renders: pools.authoring.clone(),
                config,
                enroller,
                streams: Mutex::new(BTreeMap::new()),
                generations: AtomicU64::new(0),
                metrics,
                beats: Beats::start(pools.streams.clone()),
                reads: Reads::start(pools.streams.clone()),
                bounds,
            }),
        }
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, BTreeMap<WorkloadId, Handle>> {
        self.inner.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This replica's per-identity rate bounds, for the telemetry service to share.
    pub fn bounds(&self) -> crate::rate::Bounds {
        self.inner.bounds.clone()
    }

    /// Number of live streams on this replica.
    pub fn stream_count(&self) -> usize {
        self.streams().len()
    }

    /// A render announced `version` for `id`: the stream holding it (if here) catches up.
    pub fn announce(&self, id: WorkloadId, version: u64) {
        if let Some(h) = self.streams().get(&id) {
            h.signal.send_if_modified(|signal| {
                let newer = version > signal.announced;
                signal.announced = signal.announced.max(version);
                newer
            });
        }
    }

    /// After the listener (re)connects: every stream re-reads its persisted policy (SYNC-7).
    pub fn reconcile_all(&self) {
        for h in self.streams().values() {
            h.signal.send_modify(|_| {});
        }
    }

    pub fn reconnect(&self, id: WorkloadId) -> bool {
        self.streams().get(&id).is_some_and(|h| h.control(Control::Reconnect))
    }

    /// Ends the stream of a retired or deny-listed workload, telling its agent that only a new
    /// enrollment can bring it back (`Reenroll`), so it stops reconnecting.
    pub fn cut(&self, id: WorkloadId, reason: &str) {
        if let Some(h) = self.streams().get(&id) {
            h.control(Control::Reenroll { reason: reason.to_owned() });
        }
    }

    /// Ends every stream this replica holds (shutdown); agents reconnect elsewhere.
    pub fn end_all(&self, reason: &str) {
        for h in self.streams().values() {
            h.control(Control::End { reason: reason.to_owned(), superseded: false });
        }
    }

    /// Registers a new stream, superseding any earlier one of the same identity (IDN-7).
    fn register(&self, id: WorkloadId) -> (u64, watch::Receiver<Signal>) {
        let generation = self.inner.generations.fetch_add(1, Ordering::Relaxed);
        let (signal, signal_rx) = watch::channel(Signal::default());
        let old = {
            let mut streams = self.streams();
            let old = streams.insert(id, Handle { generation, signal });
            self.inner.metrics.set_streams_open(streams.len());
            old
        };
        if let Some(old) = old {
            tracing::info!(workload = %id, "a new stream supersedes the previous one");
            old.control(Control::End { reason: "superseded by a newer stream".into(), superseded: true });
        }
        (generation, signal_rx)
    }

    /// Removes the stream if it is still the registered one; true if it was.
    fn deregister(&self, id: WorkloadId, generation: u64) -> bool {
        let mut streams = self.streams();
        if streams.get(&id).is_some_and(|h| h.generation == generation) {
            streams.remove(&id);
            self.inner.metrics.set_streams_open(streams.len());
            true
        } else {
            false
        }
    }
}

/// Why a stream ended, and whether its end means the workload is offline.
struct Ended {
    reason: String,
    offline: bool,
    status: Option<Status>,
}

impl Ended {
    fn offline(reason: impl Into<String>) -> Self {
        Ended { reason: reason.into(), offline: true, status: None }
    }

    fn refused(status: Status) -> Self {
        Ended { reason: status.message().to_owned(), offline: true, status: Some(status) }
    }
}

struct StreamTask {
    gateway: Gateway,
    id: WorkloadId,
    /// The key of the certificate this stream's connection proved the identity with.
    key_sha256: Arc<str>,
    out: Outbound,
    /// This stream's epoch once Hello arrived; its writes apply only while it is the newest.
    epoch: std::sync::atomic::AtomicI64,
    /// The state this stream last recorded (its code; 0 before the first).
    state: std::sync::atomic::AtomicI16,
    /// When the versions this stream sent as deltas were committed, until they are acked.
    pushes: Mutex<Pushes>,
}

impl StreamTask {
    fn pool(&self) -> &PgPool {
        &self.gateway.inner.pool
    }

    fn renders(&self) -> &PgPool {
        &self.gateway.inner.renders
    }

    fn config(&self) -> &GatewayConfig {
        &self.gateway.inner.config
    }

    fn metrics(&self) -> &Metrics {
        &self.gateway.inner.metrics
    }

    fn pushes(&self) -> std::sync::MutexGuard<'_, Pushes> {
        self.pushes.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn send(&self, msg: &ControlMessage) -> Result<(), Ended> {
        self.out.send(Ok(Box::new(msg.into()))).await.map_err(|_| Ended::offline("agent went away"))
    }

    /// Writes the stream's state; false when a newer stream (on any replica) owns the row.
    async fn record(&self, r: &Record) -> Result<bool, Error> {
        let written = sqlx::query(
            "UPDATE workloads SET sync_state = $2,
                applied_version = COALESCE($3, applied_version),
                sync_detail = COALESCE($4, sync_detail),
                last_acked_at = CASE WHEN $5 THEN now() ELSE last_acked_at END,
                last_apply_failed_at = CASE WHEN $6 THEN now() ELSE last_apply_failed_at END,
                last_snapshot_sent_at = CASE WHEN $7 THEN now() ELSE last_snapshot_sent_at END,
                last_seen_at = now()
             WHERE id = $1 AND stream_epoch = $8",
        )
        .bind(self.id.uuid())
        .bind(r.state.code())
        .bind(r.applied.map(|v| v as i64))
        .bind(r.detail.as_deref())
        .bind(r.acked)
        .bind(r.failed)
        .bind(r.snapshot_sent)
        .bind(self.epoch.load(Ordering::Relaxed))
        .execute(self.pool())
        .await?;
        self.state.store(r.state.code(), Ordering::Relaxed);
        Ok(written.rows_affected() == 1)
    }

    /// Carries out `actions` in order. An update over the policy stream's largest message is
    /// never sent (the agent could not read it, and would redial for ever): the session decides
    /// what instead, and its actions go next.
    async fn execute(&self, session: &mut Session, actions: Vec<Action>) -> Result<(), Ended> {
        let mut actions = std::collections::VecDeque::from(actions);
        while let Some(action) = actions.pop_front() {
            match action {
                Action::Send(update) => {
                    let version = update.version();
                    let msg = proto::SyncResponse::from(&ControlMessage::Update(update));
                    let size = prost::Message::encoded_len(&msg);
                    if size > MAX_POLICY_MESSAGE {
                        tracing::warn!(workload = %self.id, version, size, max = MAX_POLICY_MESSAGE,
                            "not sending an update over the policy stream's largest message");
                        for next in session.unsendable(version, size, MAX_POLICY_MESSAGE).into_iter().rev() {
                            actions.push_front(next);
                        }
                        continue;
                    }
                    self.out.send(Ok(Box::new(msg))).await.map_err(|_| Ended::offline("agent went away"))?;
                }
                Action::Record(r) => {
                    if let (Some(mode), Some(version)) = (r.installed, r.applied) {
                        // The evidence the host reports under this version is judged by it.
                        // Before the state: whoever sees the version SYNCED can upload under it.
                        crate::flows::installs::acknowledged(self.pool(), self.id, version, mode)
                            .await
                            .map_err(|e| Ended::offline(format!("recording an install: {e}")))?;
                    }
                    let current =
                        self.record(&r).await.map_err(|e| Ended::offline(format!("recording state: {e}")))?;
                    if !current {
                        // Another replica holds a newer stream of this identity (the agent
                        // reconnected there): this one is stale and must not speak for it.
                        let reason = "superseded by a newer stream on another replica";
                        return Err(Ended {
                            reason: reason.into(),
                            offline: false,
                            status: Some(Status::aborted(reason)),
                        });
                    }
                }
                Action::Close(reason) => return Err(Ended::refused(Status::invalid_argument(reason))),
                Action::Redial(reason) => {
                    let status = Some(Status::aborted(reason.clone()));
                    return Err(Ended { reason, offline: false, status });
                }
            }
        }
        Ok(())
    }

    /// The persisted policy, rendering it first if the workload has none (POL-6 repair).
    async fn persisted(&self) -> Result<WorkloadPolicy, Error> {
        let reads = &self.gateway.inner.reads;
        if let Some((p, _)) = reads.latest(self.id).await? {
            return Ok(p);
        }
        tracing::warn!(workload = %self.id, "no persisted policy when its stream opened: repair render");
        // Audited like any render that moves versions (POL-6, POL-8): who (this workload's
        // stream), why, and the versions it moved.
        let id = self.id;
        crate::policy::authoring::commit_holding(
            self.renders(),
            &format!("workload:{id}"),
            "policy.repair-render",
            &id.to_string(),
            async |_| Ok(((), serde_json::json!({"reason": "no persisted policy when its stream opened"}))),
        )
        .await?;
        reads.latest(self.id).await?.map(|(p, _)| p).ok_or_else(|| {
            Error::Invalid(format!("workload {} has no policy even after a repair render", self.id))
        })
    }

    async fn run(
        &self,
        mut inbound: Streaming<proto::SyncRequest>,
        mut signal: watch::Receiver<Signal>,
        credential_expiry: std::time::SystemTime,
    ) -> Ended {
        // An agent that cannot renew cannot hold a stream (seed 000): it ends when the
        // certificate it was opened with expires (the agent renews well before, and reconnects).
        let expiry = tokio::time::Instant::now()
            + credential_expiry.duration_since(std::time::SystemTime::now()).unwrap_or_default();
        let liveness = self.config().liveness();
        let hello = match tokio::time::timeout(liveness, inbound.message()).await {
            Ok(Ok(Some(req))) => match AgentMessage::try_from(req) {
                Ok(AgentMessage::Hello(h)) => h,
                Ok(_) => return Ended::refused(Status::invalid_argument("the first message must be Hello")),
                Err(e) => return Ended::refused(Status::invalid_argument(e.to_string())),
            },
            Ok(Ok(None)) | Ok(Err(_)) => return Ended::offline("closed before Hello"),
            Err(_) => return Ended::offline("no Hello within the liveness bound"),
        };
        if let Err(e) = Box::pin(self.note_hello(&hello)).await {
            return Ended::refused(Status::from(e));
        }
        // A version applied whose ack was lost with the last connection (FLOW-5).
        if let Err(e) =
            Box::pin(crate::flows::installs::reported(self.pool(), self.id, hello.applied_version)).await
        {
            return Ended::refused(Status::from(e));
        }
        let c = self.config();
        let ack = HelloAck {
            heartbeat: c.heartbeat,
            inventory: c.inventory,
            flow_window: c.flow_window,
            flow_window_max_keys: c.flow_window_max_keys,
        };
        if let Err(e) = self.send(&ControlMessage::HelloAck(ack)).await {
            return e;
        }
        let persisted = match Box::pin(self.persisted()).await {
            Ok(p) => p,
            Err(e) => return Ended::refused(Status::from(e)),
        };
        let (mut session, actions) = Session::open(persisted, hello.applied_version, hello.suspended);
        if let Err(e) = Box::pin(self.execute(&mut session, actions)).await {
            return e;
        }
        let mut inventory = Pending::default();
        loop {
            let due = inventory.due;
            let event = tokio::select! {
                () = tokio::time::sleep_until(expiry) => {
                    let reason = "its client certificate expired: renew before expiry, or enroll again";
                    return Ended {
                        reason: reason.into(),
                        offline: true,
                        status: Some(Status::unauthenticated(format!("the stream ended because {reason}"))),
                    };
                }
                () = sleep_until_due(due) => {
                    if let Err(e) = Box::pin(self.apply_inventory(&mut inventory)).await {
                        return Ended::refused(Status::from(e));
                    }
                    continue;
                }
                msg = tokio::time::timeout(liveness, inbound.message()) => match msg {
                    Err(_) => return Ended::offline("silent for three heartbeat intervals"),
                    Ok(Ok(Some(req))) => Some(req),
                    Ok(Ok(None)) => return Ended::offline("agent closed the stream"),
                    Ok(Err(s)) => return Ended::offline(format!("stream error: {}", s.message())),
                },
                changed = signal.changed() => {
                    if changed.is_err() {
                        return Ended::offline("gateway dropped the stream");
                    }
                    let control = signal.borrow_and_update().control.clone();
                    match control {
                        None => None,
                        Some(Control::Reconnect) => {
                            let _ = self.send(&ControlMessage::Directive(Directive::Reconnect)).await;
                            return Ended::offline("directed reconnect");
                        }
                        Some(Control::Reenroll { reason }) => {
                            let directive = Directive::Reenroll { reason: format!("{reason}: enroll this host again") };
                            let _ = self.send(&ControlMessage::Directive(directive)).await;
                            return Ended { reason, offline: true, status: None };
                        }
                        Some(Control::End { reason, superseded }) => {
                            let status = Status::aborted(reason.clone());
                            return Ended { reason, offline: !superseded, status: Some(status) };
                        }
                    }
                }
            };
            // Boxed: what a stream does between waits is allocated while it does it, so an idle
            // stream's task holds only its waits (PERF-4: every idle stream holds its task).
            let result = match event {
                None => Box::pin(self.catch_up(&mut session)).await,
                Some(req) => Box::pin(self.handle(&mut session, &mut inventory, req)).await,
            };
            if let Err(e) = result {
                return e;
            }
        }
    }

    async fn catch_up(&self, session: &mut Session) -> Result<(), Ended> {
        let latest = self.gateway.inner.reads.latest(self.id).await;
        let latest = latest.map_err(|e| Ended::offline(format!("reading the persisted policy: {e}")))?;
        let Some((p, committed)) = latest else { return Ok(()) };
        let version = p.version();
        let actions = session.persisted(p);
        let delta = actions.iter().any(|a| matches!(a, Action::Send(Update::Delta(_))));
        self.execute(session, actions).await?;
        if delta {
            self.metrics().pushed(committed, chrono::Utc::now());
            self.pushes().sent(version, committed);
        }
        Ok(())
    }

    async fn handle(
        &self,
        session: &mut Session,
        inventory: &mut Pending,
        req: proto::SyncRequest,
    ) -> Result<(), Ended> {
        let msg = AgentMessage::try_from(req)
            .map_err(|e| Ended::refused(Status::invalid_argument(e.to_string())))?;
        match msg {
            AgentMessage::Ack(ack) => {
                let committed = self.pushes().acked(ack.version());
                let status = ack.status();
                self.metrics().ack(status);
                if let (AckStatus::Applied, Some(committed)) = (status, committed) {
                    self.metrics().applied(committed, chrono::Utc::now());
                }
                let actions = session.ack(ack);
                // The only snapshots an ack earns are recovery snapshots (SYNC-5).
                for _ in actions.iter().filter(|a| matches!(a, Action::Send(Update::Snapshot(_)))) {
                    self.metrics().recovery_snapshot();
                }
                self.execute(session, actions).await
            }
            AgentMessage::Heartbeat(h) => {
                // Over its bound the stream ends before anything is written; the agent
                // reconnects after the retry-after it is told.
                let bound = [(crate::rate::Bound::Heartbeats, 1.0)];
                self.gateway.inner.bounds.take(self.id, &bound).map_err(Ended::refused)?;
                self.heartbeat(&h).await.map_err(|e| Ended::refused(Status::from(e)))?;
                let actions = session.suspended(h.suspended);
                self.execute(session, actions).await
            }
            AgentMessage::Inventory(inv) => {
                // A report without facts (the agent could not list its interfaces) says nothing
                // about addresses: the last known set stands, it never becomes "no addresses".
                if let Some(facts) = &inv.facts {
                    let addresses = crate::policy::spec::routable_addresses(facts)
                        .map_err(|e| Ended::refused(Status::from(e)))?;
                    inventory.report(addresses);
                }
                Ok(())
            }
            AgentMessage::Hello(_) => {
                Err(Ended::refused(Status::invalid_argument("Hello may only open a stream")))
            }
        }
    }

    async fn note_hello(&self, hello: &Hello) -> Result<(), Error> {
        let row: Option<bool> = sqlx::query_scalar(
            "SELECT retired_at IS NOT NULL OR denied_at IS NOT NULL FROM workloads WHERE id = $1",
        )
        .bind(self.id.uuid())
        .fetch_optional(self.pool())
        .await?;
        let Some(gone) = row else {
            return Err(Error::NotFound { what: "workload", name: self.id.to_string() });
        };
        if gone {
            return Err(Error::Refused(format!(
                "workload {} is retired or deny-listed; enroll the host again",
                self.id
            )));
        }
        let epoch: i64 = sqlx::query_scalar(
            // A Hello is a sign of life: readers judge silence from `last_seen_at` against the
            // liveness written here (`shown`), so both move together.
            "UPDATE workloads SET stream_epoch = stream_epoch + 1, stream_liveness = make_interval(secs => $2),
                 last_seen_at = now()
             WHERE id = $1 RETURNING stream_epoch",
        )
        .bind(self.id.uuid())
        .bind(self.config().liveness().as_secs_f64())
        .fetch_one(self.pool())
        .await?;
        self.epoch.store(epoch, Ordering::Relaxed);
        // The same identity from a second host: a cloned image or a stolen key (IDN-7), judged
        // by boot id and certificate key, audited once per episode.
        let presenter = crate::identity::clones::Presenter::new(hello.facts.as_ref(), &self.key_sha256);
        crate::identity::clones::observe(self.pool(), self.id, &presenter).await?;
        Ok(())
    }

    async fn heartbeat(&self, h: &Heartbeat) -> Result<(), Error> {
        // A sweep that found this stream silent (a heartbeat write delayed past the bound) is
        // answered by the stream's own state, if it is still the newest stream.
        let beat = Beat {
            workload: self.id.uuid(),
            epoch: self.epoch.load(Ordering::Relaxed),
            state: self.state.load(Ordering::Relaxed),
        };
        self.gateway.inner.beats.write(beat).await?;
        if !h.credential_renewal_error.is_empty() {
            tracing::warn!(workload = %self.id, "agent reports credential renewal failing: {}", truncate(&h.credential_renewal_error, 256));
            crate::identity::enroll::record_reported_renewal_failure(
                self.pool(),
                self.id,
                &h.credential_renewal_error,
            )
            .await?;
        }
        // At most what an agent sends (`convert` bounds it): the distinct details and one entry
        // counting the rest.
        for event in &h.tamper_events {
            let (detail, count) = (&event.detail, event.count);
            tracing::warn!(workload = %self.id, count, "agent repaired its table after an outside change: {}", truncate(detail, 256));
            // One row per workload per coalescing window, counting every change reported.
            let (actor, subject) = (format!("workload:{}", self.id), self.id.to_string());
            let detail = serde_json::json!({"detected_at_unix_ms": event.detected_at_unix_ms, "detail": detail, "count": count});
            let record = audit::Record::new(&actor, "workload.tamper", &subject).detail(detail);
            let mut conn = self.pool().acquire().await?;
            audit::coalesce(&mut conn, &record, self.config().bounds.report_coalesce, u64::from(count))
                .await?;
        }
        Ok(())
    }

    /// Applies the latest pending inventory report, unless this workload's addresses changed
    /// less than the minimum interval ago (on any stream or replica): then it waits until then.
    async fn apply_inventory(&self, inventory: &mut Pending) -> Result<(), Error> {
        let Some(addresses) = inventory.addresses.take() else {
            inventory.due = None;
            return Ok(());
        };
        let wait: Option<f64> = sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM addresses_changed_at + make_interval(secs => $2) - now())::float8
             FROM workloads WHERE id = $1",
        )
        .bind(self.id.uuid())
        .bind(self.config().inventory_min_interval.as_secs_f64())
        .fetch_one(self.pool())
        .await?;
        if let Some(wait) = wait.filter(|w| *w > 0.0) {
            inventory.addresses = Some(addresses);
            inventory.due = Some(tokio::time::Instant::now() + Duration::from_secs_f64(wait));
            return Ok(());
        }
        inventory.due = None;
        match self.commit_inventory(&addresses).await {
            // The render lock stayed busy (a long render queue): keep the report and try again
            // after an interval instead of ending the stream.
            Err(Error::Busy(why)) => {
                tracing::warn!(workload = %self.id, "inventory change deferred: {why}");
                inventory.addresses.get_or_insert(addresses);
                let retry = self.config().inventory_min_interval.max(Duration::from_secs(1));
                inventory.due = Some(tokio::time::Instant::now() + retry);
                Ok(())
            }
            other => other,
        }
    }

    /// Stores `addresses` as the workload's reported addresses and renders, if they changed.
    async fn commit_inventory(
        &self,
        addresses: &std::collections::BTreeSet<std::net::IpAddr>,
    ) -> Result<(), Error> {
        let current: Vec<String> = sqlx::query_scalar(
            "SELECT host(address) FROM workload_addresses WHERE workload_id = $1 ORDER BY 1",
        )
        .bind(self.id.uuid())
        .fetch_all(self.pool())
        .await?;
        let current: std::collections::BTreeSet<std::net::IpAddr> =
            current.iter().filter_map(|a| a.parse().ok()).collect();
        if current == *addresses {
            return Ok(());
        }
        // A change of addresses changes peer sets: it renders like any other change (POL-4),
        // and the render judges the new addresses (address trust).
        let id = self.id;
        crate::policy::authoring::commit_holding(
            self.renders(),
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

/// The commit times of versions a stream sent as deltas and the agent has not acked yet, for
/// the push latencies. Bounded: an agent that never acks cannot grow it.
#[derive(Debug, Default)]
struct Pushes(BTreeMap<u64, chrono::DateTime<chrono::Utc>>);

impl Pushes {
    const MAX: usize = 64;

    fn sent(&mut self, version: u64, committed: chrono::DateTime<chrono::Utc>) {
        self.0.insert(version, committed);
        while self.0.len() > Self::MAX {
            self.0.pop_first();
        }
    }

    /// The commit time of `version` if it was sent as a delta; it and every older version are
    /// settled (acks come in send order).
    fn acked(&mut self, version: u64) -> Option<chrono::DateTime<chrono::Utc>> {
        let later = self.0.split_off(&(version.saturating_add(1)));
        let settled = std::mem::replace(&mut self.0, later);
        settled.get(&version).copied()
    }
}

/// The latest inventory report not yet applied, and when to apply it (coalescing, issue 11).
#[derive(Debug, Default)]
struct Pending {
    addresses: Option<std::collections::BTreeSet<std::net::IpAddr>>,
    due: Option<tokio::time::Instant>,
}

impl Pending {
    /// The latest report replaces any earlier pending one; the first is due at once (the
    /// database decides whether it must wait).
    fn report(&mut self, addresses: std::collections::BTreeSet<std::net::IpAddr>) {
        self.addresses = Some(addresses);
        self.due.get_or_insert_with(tokio::time::Instant::now);
    }
}

async fn sleep_until_due(due: Option<tokio::time::Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn truncate(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// Marks a workload OFFLINE when its stream ends, unless a newer stream (on any replica) has
/// opened since.
async fn mark_offline(pool: &PgPool, id: WorkloadId, epoch: i64, reason: &str) {
    let result = sqlx::query(
        "UPDATE workloads SET sync_state = $2, sync_detail = $3 WHERE id = $1 AND stream_epoch = $4",
    )
    .bind(id.uuid())
    .bind(SyncState::Offline.code())
    .bind(reason)
    .bind(epoch)
    .execute(pool)
    .await;
    if let Err(e) = result {
        tracing::error!(workload = %id, "could not record OFFLINE: {e}");
    }
}

type SyncStream = Pin<Box<dyn Stream<Item = Result<proto::SyncResponse, Status>> + Send>>;

#[tonic::async_trait]
impl proto::agent_service_server::AgentService for Gateway {
    type SyncStream = SyncStream;

    async fn sync(
        &self,
        request: Request<Streaming<proto::SyncRequest>>,
    ) -> Result<Response<SyncStream>, Status> {
        let AgentIdentity { id, not_after, key_sha256 } = agent_identity(&request)?;
        // Before the stream registers: a refused open supersedes nothing and writes nothing.
        self.inner.bounds.take(id, &[(crate::rate::Bound::Hellos, 1.0)])?;
        let inbound = request.into_inner();
        let (out, rx) = mpsc::channel(self.inner.config.outbound_queue.max(1));
        let (generation, signal) = self.register(id);
        let gateway = self.clone();
        tokio::spawn(async move {
            let task = StreamTask {
                gateway: gateway.clone(),
                id,
                key_sha256,
                out: out.clone(),
                epoch: Default::default(),
                state: Default::default(),
                pushes: Default::default(),
            };
            let ended = task.run(inbound, signal, not_after).await;
            let current = gateway.deregister(id, generation);
            tracing::info!(workload = %id, reason = %ended.reason, "stream ended");
            let epoch = task.epoch.load(Ordering::Relaxed);
            if ended.offline && current && epoch > 0 {
                mark_offline(&gateway.inner.pool, id, epoch, &ended.reason).await;
            }
            if let Some(status) = ended.status {
                let _ = out.send(Err(status)).await;
            }
        });
        let responses = tokio_stream::wrappers::ReceiverStream::new(rx).map(|r| r.map(|boxed| *boxed));
        Ok(Response::new(Box::pin(responses)))
    }

    async fn renew_credential(
        &self,
        request: Request<proto::RenewCredentialRequest>,
    ) -> Result<Response<proto::RenewCredentialResponse>, Status> {
        let id = identity(&request)?;
        let enroller = &self.inner.enroller;
        let cert = enroller.renew(id, &request.get_ref().csr_pem).await.map_err(Status::from)?;
        Ok(Response::new(proto::RenewCredentialResponse {
            certificate_pem: cert.pem.into_bytes(),
            ca_bundle_pem: enroller.signer.ca_bundle_pem().into_bytes(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_settle_in_send_order_and_stay_bounded() {
        let at = |s: i64| chrono::DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let mut pushes = Pushes::default();
        pushes.sent(2, at(2));
        pushes.sent(3, at(3));
        pushes.sent(5, at(5));
        assert_eq!(pushes.acked(1), None, "the opening snapshot was no push");
        assert_eq!(pushes.acked(3), Some(at(3)));
        assert_eq!(pushes.acked(2), None, "settled with 3");
        assert_eq!(pushes.acked(5), Some(at(5)));
        for v in 10..200 {
            pushes.sent(v, at(v as i64));
        }
        assert_eq!(pushes.0.len(), Pushes::MAX);
        assert_eq!(pushes.acked(199), Some(at(199)));
        assert!(pushes.0.is_empty());
    }
}
