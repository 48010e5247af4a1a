//! The agent gateway (SYNC-2..SYNC-11): the Sync stream and credential renewal. One task per
//! stream hands its [`StreamCore`] the stream's messages, announcements from the NOTIFY bridge,
//! directives and its deadlines, through a [`Driver`] on the Postgres [`PgSyncStore`]; its
//! outbound queue is bounded, so a slow agent only slows itself and its pending announcements
//! coalesce into one delta from its tip to the latest version. This file is only I/O.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use innerwall_wire::sync::{AgentMessage, HelloAck};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::identity::enroll::Enroller;
use crate::identity::listener::{AgentIdentity, agent_identity, identity};
use crate::metrics::Metrics;
use crate::postgres::Pools;
use crate::sync::core::{Control, CoreConfig, Ended, Event, StreamCore};
use crate::sync::driver::{Driver, Gone, Outbox};
use crate::sync::store::{PgSyncStore, SyncStore};

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

/// What a stream's task is told from outside, on one watch channel per stream (PERF-4: an
/// idle stream holds one small channel, not a channel per kind of news).
#[derive(Debug, Default)]
struct Signal {
    /// The newest version a render announced for this workload.
    announced: u64,
    /// How many newer versions were announced: the task counts those it never saw one by one.
    announcements: u64,
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
    /// What streams read and write (Hello, records, heartbeats, reads, inventory renders).
    store: PgSyncStore,
    config: GatewayConfig,
    enroller: Enroller,
    streams: Mutex<BTreeMap<WorkloadId, Handle>>,
    generations: AtomicU64,
    metrics: Arc<Metrics>,
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
                store: PgSyncStore::new(
                    pools.streams.clone(),
                    pools.authoring.clone(),
                    config.inventory_min_interval,
                    config.bounds.report_coalesce,
                ),
                config,
                enroller,
                streams: Mutex::new(BTreeMap::new()),
                generations: AtomicU64::new(0),
                metrics,
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
                signal.announcements += u64::from(newer);
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

/// The stream's queue towards its agent.
struct Queue(Outbound);

impl Outbox for Queue {
    async fn send(&mut self, message: proto::SyncResponse) -> Result<(), Gone> {
        self.0.send(Ok(Box::new(message))).await.map_err(|_| Gone)
    }
}

impl Gateway {
    /// One stream, until it ends: the core decides, this waits for the network, the signal and
    /// the core's next deadline, and hands each to it. Returns why it ended and the epoch.
    async fn run(
        &self,
        id: WorkloadId,
        key_sha256: &str,
        out: Outbound,
        mut inbound: Streaming<proto::SyncRequest>,
        mut signal: watch::Receiver<Signal>,
        credential_expiry: std::time::SystemTime,
    ) -> (Ended, i64) {
        let config = &self.inner.config;
        let origin = tokio::time::Instant::now();
        let now = || origin.elapsed();
        let expires = credential_expiry.duration_since(std::time::SystemTime::now()).unwrap_or_default();
        let hello_ack = HelloAck {
            heartbeat: config.heartbeat,
            inventory: config.inventory,
            flow_window: config.flow_window,
            flow_window_max_keys: config.flow_window_max_keys,
        };
        let mut core = StreamCore::new(CoreConfig { liveness: config.liveness(), hello_ack, expires }, now());
        let mut driver = Driver {
            id,
            key_sha256,
            store: &self.inner.store,
            out: Queue(out),
            epoch: 0,
            liveness: config.liveness(),
            metrics: self.inner.metrics.clone(),
        };
        let mut taken = 0;
        loop {
            let open = core.is_open();
            let event = tokio::select! {
                () = tokio::time::sleep_until(origin + core.next_deadline()) => Event::Tick,
                msg = inbound.message() => match msg {
                    Ok(Some(req)) => match AgentMessage::try_from(req) {
                        Ok(message) => {
                            if matches!(message, AgentMessage::Heartbeat(_)) {
                                // Over its bound the stream ends before anything is written;
                                // the agent reconnects after the retry-after it is told.
                                let bound = [(crate::rate::Bound::Heartbeats, 1.0)];
                                if let Err(status) = self.inner.bounds.take(id, &bound) {
                                    return (Ended::refused(status), driver.epoch);
                                }
                            }
                            Event::Message(message)
                        }
                        Err(e) => return (Ended::refused(Status::invalid_argument(e.to_string())), driver.epoch),
                    },
                    Ok(None) if !open => return (Ended::offline("closed before Hello"), driver.epoch),
                    Err(_) if !open => return (Ended::offline("closed before Hello"), driver.epoch),
                    Ok(None) => return (Ended::offline("agent closed the stream"), driver.epoch),
                    Err(s) => return (Ended::offline(format!("stream error: {}", s.message())), driver.epoch),
                },
                changed = signal.changed(), if open => {
                    if changed.is_err() {
                        return (Ended::offline("gateway dropped the stream"), driver.epoch);
                    }
                    let seen = signal.borrow_and_update();
                    match seen.control.clone() {
                        Some(control) => Event::Control(control),
                        None => {
                            // Announcements made while the task was busy (a full queue towards
                            // a slow agent) fold into this one.
                            let folded = seen.announcements.saturating_sub(taken + 1);
                            if folded > 0 {
                                self.inner.metrics.announcements_coalesced(folded);
                            }
                            taken = seen.announcements;
                            Event::Announced
                        }
                    }
                }
            };
            // Boxed: what a stream does between waits is allocated while it does it, so an idle
            // stream's task holds only its waits (PERF-4: every idle stream holds its task).
            if let Some(ended) = Box::pin(driver.run(&mut core, event, now())).await {
                return (ended, driver.epoch);
            }
        }
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
            let (ended, epoch) = gateway.run(id, &key_sha256, out.clone(), inbound, signal, not_after).await;
            let current = gateway.deregister(id, generation);
            tracing::info!(workload = %id, reason = %ended.reason, "stream ended");
            if ended.offline && current && epoch > 0 {
                gateway.inner.store.mark_offline(id, epoch, &ended.reason).await;
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
