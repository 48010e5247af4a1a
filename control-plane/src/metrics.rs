//! Prometheus metrics of one replica (OPS-3) and the plain-HTTP listener that serves them
//! (`serve --metrics-listen`): streams, acks and push latency (`sync::gateway`), flow ingest
//! (`flows::ingest`), the NOTIFY bridge (`sync::bridge`), renders (`policy::publish`), and the
//! fleet's workloads per sync state and per mode, read from the database at scrape time.
//!
//! Every family is registered up front with every series of its closed label set, encoded in
//! that set's order: nothing here iterates a hash map into the output, and a series exists (at
//! zero) before its first event. The listener is unauthenticated: bind it to a private address.

use std::convert::Infallible;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::policy::Mode;
use innerwall_wire::sync::SyncState;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};
use sqlx::PgPool;
use tokio::net::TcpListener;

/// The `Content-Type` of what `/metrics` answers (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A label whose values are a closed set, each with its own series.
pub trait ClosedLabel: Copy + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    const KEY: &'static str;
    const ALL: &'static [Self];
    fn value(self) -> &'static str;
}

impl ClosedLabel for crate::rate::Bound {
    const KEY: &'static str = "reason";
    const ALL: &'static [Self] = crate::rate::Bound::ALL;
    fn value(self) -> &'static str {
        self.reason()
    }
}

/// One metric per value of a closed label set, encoded in the set's order (prometheus-client's
/// `Family` iterates a hash map). Clones share the metrics.
#[derive(Debug, Clone)]
pub struct Labeled<L, M> {
    series: Vec<(L, M)>,
}

impl<L: ClosedLabel, M> Labeled<L, M> {
    pub fn new(make: impl Fn() -> M) -> Self {
        Labeled { series: L::ALL.iter().map(|l| (*l, make())).collect() }
    }

    pub fn get(&self, label: L) -> &M {
        let (_, metric) = self
            .series
            .iter()
            .find(|(l, _)| *l == label)
            .expect("every value of the closed set has a series");
        metric
    }
}

impl<L: ClosedLabel, M: EncodeMetric + TypedMetric> EncodeMetric for Labeled<L, M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (label, metric) in &self.series {
            metric.encode(encoder.encode_family(&[(L::KEY, label.value())])?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

pub use innerwall_wire::sync::AckStatus;

impl ClosedLabel for AckStatus {
    const KEY: &'static str = "status";
    const ALL: &'static [Self] = &[AckStatus::Applied, AckStatus::Held, AckStatus::Failed];
    fn value(self) -> &'static str {
        self.name()
    }
}

/// Why a flow window was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It broke the wire contract (malformed, over a bound, no window at all).
    Invalid,
    /// Its times are older than the retention or too far ahead of this replica's clock.
    OutOfRange,
    /// Its workload is retired, deny-listed or unknown.
    WorkloadRefused,
    /// Its version is none the workload ever had (FLOW-5).
    VersionUnknown,
    /// Its version was never installed on the host, or not during the window (FLOW-5).
    VersionNotInstalled,
    /// Its mode is not its version's (FLOW-5).
    ModeMismatch,
    /// It overlaps a window the workload already reported (FLOW-5).
    Overlap,
    /// It names a staged set its version did not carry (FLOW-10).
    StagedSetMismatch,
    /// Its version has no acknowledgement yet (one lost with its connection is reported by the
    /// agent's next Hello); the agent sends it again.
    VersionPending,
    /// The database could not take it in time; the agent sends it again.
    Unavailable,
    /// Anything else (logged by the error mapping).
    Internal,
}

impl ClosedLabel for Refusal {
    const KEY: &'static str = "reason";
    const ALL: &'static [Self] = &[
        Refusal::Invalid,
        Refusal::OutOfRange,
        Refusal::WorkloadRefused,
        Refusal::VersionUnknown,
        Refusal::VersionNotInstalled,
        Refusal::ModeMismatch,
        Refusal::Overlap,
        Refusal::StagedSetMismatch,
        Refusal::VersionPending,
        Refusal::Unavailable,
        Refusal::Internal,
    ];
    fn value(self) -> &'static str {
        match self {
            Refusal::Invalid => "invalid",
            Refusal::OutOfRange => "out_of_range",
            Refusal::WorkloadRefused => "workload_refused",
            Refusal::VersionUnknown => "version_unknown",
            Refusal::VersionNotInstalled => "version_not_installed",
            Refusal::ModeMismatch => "mode_mismatch",
            Refusal::Overlap => "overlap",
            Refusal::StagedSetMismatch => "staged_set_mismatch",
            Refusal::VersionPending => "version_pending",
            Refusal::Unavailable => "unavailable",
            Refusal::Internal => "internal",
        }
    }
}

impl Refusal {
    /// The reason an ingest error stands for.
    pub fn of(error: &crate::error::Error) -> Refusal {
        use crate::error::Kind;
        match error.kind() {
            Kind::Invalid => Refusal::Invalid,
            Kind::Refused | Kind::Unauthenticated | Kind::NotFound => Refusal::WorkloadRefused,
            Kind::Busy => Refusal::Unavailable,
            _ => Refusal::Internal,
        }
    }
}

/// Renders performed by this process, whichever path asked for them.
///
/// Process-wide on purpose (the one global here, atomics only): `policy::publish` is reached
/// from every path that changes policy — the replica's own (start-up render, enrollment,
/// inventory, repair), operator changes through the library (the CLI, and the HTTP API that
/// will run them inside the replica), promotions — and counting at that one place sees them all
/// without threading a handle through every authoring signature. Each replica's registry
/// exposes these same histograms; in a test process running several replicas they are shared.
#[derive(Debug)]
struct Renders {
    duration: Histogram,
    changed: Histogram,
    inputs: Labeled<RenderInputs, Counter>,
}

/// How a publish came by its inputs (`innerwall_render_inputs_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenderInputs {
    /// Kept from the last publish; nothing changed since.
    Kept,
    /// Kept, with what this change wrote read again.
    Refreshed,
    /// Loaded whole.
    Loaded,
}

impl RenderInputs {
    pub fn name(self) -> &'static str {
        match self {
            RenderInputs::Kept => "kept",
            RenderInputs::Refreshed => "refreshed",
            RenderInputs::Loaded => "loaded",
        }
    }
}

impl ClosedLabel for RenderInputs {
    const KEY: &'static str = "inputs";
    const ALL: &'static [Self] = &[Self::Kept, Self::Refreshed, Self::Loaded];
    fn value(self) -> &'static str {
        self.name()
    }
}

static RENDERS: LazyLock<Renders> = LazyLock::new(|| Renders {
    duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
    changed: Histogram::new([
        0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10_000.0,
    ]),
    inputs: Labeled::new(Counter::default),
});

/// Records one render: how long it took (without waiting for the render lock) and how many
/// workloads' versions it advanced.
/// Counts how one render came by its inputs (`policy::inputs`).
pub fn count_render_inputs(outcome: RenderInputs) {
    RENDERS.inputs.get(outcome).inc();
}

pub fn observe_render(took: Duration, changed: usize) {
    RENDERS.duration.observe(took.as_secs_f64());
    RENDERS.changed.observe(changed as f64);
}

/// Seconds from `from` to `to`, never negative (the commit time is the database's clock, the
/// send and ack times this replica's: a small skew must not make a latency negative).
pub fn latency_seconds(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    ((to - from).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6).max(0.0)
}

/// Live workloads per sync state and per mode, as one scrape read them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkloadCounts {
    /// In `SyncState::ALL` order.
    pub by_state: [i64; SyncState::ALL.len()],
    /// In `Mode::ALL` order.
    pub by_mode: [i64; Mode::ALL.len()],
    /// Rulesets staged beside the rules in force (FLOW-10), awaiting promotion.
    pub staged_rulesets: i64,
}

impl WorkloadCounts {
    /// From `(sync_state, mode, count)` rows as the database stores the codes. A code this
    /// build does not know is left out (and logged): it is no state a gauge could name.
    pub fn from_rows(rows: &[(i16, i16, i64)]) -> WorkloadCounts {
        let mut counts = WorkloadCounts::default();
        for &(state, mode, n) in rows {
            match (SyncState::from_code(state), Mode::from_code(mode)) {
                (Ok(state), Ok(mode)) => {
                    counts.by_state[SyncState::ALL.iter().position(|s| *s == state).expect("in ALL")] += n;
                    counts.by_mode[Mode::ALL.iter().position(|m| *m == mode).expect("in ALL")] += n;
                }
                _ => tracing::warn!(
                    state,
                    mode,
                    n,
                    "workloads with a sync state or mode this build does not know"
                ),
            }
        }
        counts
    }
}

/// The fleet's workload gauges: what the last scrape read, or nothing at all when it could not
/// (absent series, not stale numbers).
#[derive(Debug, Clone, Default)]
struct Fleet(Arc<Mutex<Option<WorkloadCounts>>>);

impl Collector for Fleet {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(counts) = *self.0.lock().unwrap_or_else(PoisonError::into_inner) else { return Ok(()) };
        let mut family = encoder.encode_descriptor(
            "workloads_by_sync_state",
            "Live workloads of the whole fleet per sync state, read from the database at scrape time \
             (the same on every replica)",
            None,
            MetricType::Gauge,
        )?;
        for (state, n) in SyncState::ALL.iter().zip(counts.by_state) {
            ConstGauge::new(n).encode(family.encode_family(&[("state", state.name())])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "workloads_by_mode",
            "Live workloads of the whole fleet per mode, read from the database at scrape time",
            None,
            MetricType::Gauge,
        )?;
        for (mode, n) in Mode::ALL.iter().zip(counts.by_mode) {
            ConstGauge::new(n).encode(family.encode_family(&[("mode", mode.name())])?)?;
        }
        let family = encoder.encode_descriptor(
            "staged_rulesets",
            "Rulesets staged beside the rules in force and not promoted or unstaged yet, read from the \
             database at scrape time",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(counts.staged_rulesets).encode(family)?;
        Ok(())
    }
}

/// How long a scrape waits for the fleet's counts before answering without them.
const FLEET_QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// One replica's metrics. Cheap to share (`Arc`); every instrument is atomic.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    streams_open: Gauge,
    acks: Labeled<AckStatus, Counter>,
    recovery_snapshots: Counter,
    announcements_coalesced: Counter,
    auto_demotions: Counter,
    deadline_reverts: Counter,
    push_sent: Histogram,
    push_applied: Histogram,
    windows_stored: Counter,
    records_stored: Counter,
    gaps_stored: Counter,
    windows_duplicate: Counter,
    windows_refused: Labeled<Refusal, Counter>,
    records_refused: Labeled<Refusal, Counter>,
    gaps_refused: Labeled<Refusal, Counter>,
    ingest_duration: Histogram,
    /// Agent calls refused for rate (REL-1, `rate`), by bound.
    agent_refusals: Labeled<crate::rate::Bound, Counter>,
    bridge_reconnects: Counter,
    bridge_connected: Gauge,
    fleet: Fleet,
    fleet_failures: Counter,
    /// Connections the metrics listener closed at accept (too many held, overall or per source).
    metrics_refused: Counter,
    /// One scrape at a time reads the database.
    scrape: tokio::sync::Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let latency = || Histogram::new(exponential_buckets(0.005, 2.0, 16));
        let m = Metrics {
            registry: Registry::default(),
            streams_open: Gauge::default(),
            acks: Labeled::new(Counter::default),
            recovery_snapshots: Counter::default(),
            announcements_coalesced: Counter::default(),
            auto_demotions: Counter::default(),
            deadline_reverts: Counter::default(),
            push_sent: latency(),
            push_applied: latency(),
            windows_stored: Counter::default(),
            records_stored: Counter::default(),
            gaps_stored: Counter::default(),
            windows_duplicate: Counter::default(),
            windows_refused: Labeled::new(Counter::default),
            records_refused: Labeled::new(Counter::default),
            gaps_refused: Labeled::new(Counter::default),
            ingest_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            agent_refusals: Labeled::new(Counter::default),
            bridge_reconnects: Counter::default(),
            bridge_connected: Gauge::default(),
            fleet: Fleet::default(),
            fleet_failures: Counter::default(),
            metrics_refused: Counter::default(),
            scrape: tokio::sync::Mutex::new(()),
        };
        let mut registry = Registry::with_prefix("innerwall");
        let r = &mut registry;
        r.register("streams_open", "Agent policy streams open on this replica", m.streams_open.clone());
        r.register_with_unit(
            "render_duration",
            "Renders this process performed (all workloads, persisted and announced), without the wait for the render lock",
            Unit::Seconds,
            RENDERS.duration.clone(),
        );
        r.register(
            "render_workloads_changed",
            "Workloads whose policy version one render advanced",
            RENDERS.changed.clone(),
        );
        r.register(
            "render_inputs",
            "Renders by how they came by the authored model and registry: kept from the last render, kept with what the change wrote read again, or loaded whole",
            RENDERS.inputs.clone(),
        );
        r.register_with_unit(
            "push_sent_latency",
            "From the commit of a new policy version (its render transaction in the database) to its delta sent on an agent's stream",
            Unit::Seconds,
            m.push_sent.clone(),
        );
        r.register_with_unit(
            "push_applied_latency",
            "From the commit of a new policy version to the agent's APPLIED ack for it",
            Unit::Seconds,
            m.push_applied.clone(),
        );
        r.register("acks", "Acks agents sent on this replica's streams, by status", m.acks.clone());
        r.register(
            "recovery_snapshots",
            "Recovery snapshots sent after an agent failed to apply an update",
            m.recovery_snapshots.clone(),
        );
        r.register(
            "announcements_coalesced",
            "New versions announced to a stream that were folded into a later one before its task \
             took them (a slow agent gets one delta from its tip to the latest, not one per version)",
            m.announcements_coalesced.clone(),
        );
        r.register(
            "auto_demotions",
            "Workloads the auto-demotion guard moved back to simulation (blocked flows their evidence showed allowed)",
            m.auto_demotions.clone(),
        );
        r.register(
            "deadline_reverts",
            "Promotions to enforcement reverted to simulation because no confirmation came before their deadline",
            m.deadline_reverts.clone(),
        );
        r.register("flow_windows_ingested", "Flow windows stored", m.windows_stored.clone());
        r.register("flow_records_ingested", "Flow records stored", m.records_stored.clone());
        r.register("flow_gaps_ingested", "Evidence gaps stored", m.gaps_stored.clone());
        r.register(
            "flow_windows_duplicate",
            "Flow windows uploaded again after they were stored (nothing written)",
            m.windows_duplicate.clone(),
        );
        r.register("flow_windows_refused", "Flow windows not stored, by reason", m.windows_refused.clone());
        r.register(
            "flow_records_refused",
            "Flow records in windows not stored, by reason",
            m.records_refused.clone(),
        );
        r.register(
            "flow_gaps_refused",
            "Evidence gaps in windows not stored, by reason",
            m.gaps_refused.clone(),
        );
        r.register_with_unit(
            "flow_ingest_duration",
            "Time to store one flow window (stored or duplicate)",
            Unit::Seconds,
            m.ingest_duration.clone(),
        );
        r.register(
            "agent_refusals",
            "Agent calls refused with RESOURCE_EXHAUSTED for going over a per-identity rate bound, by bound",
            m.agent_refusals.clone(),
        );
        r.register(
            "notify_bridge_reconnects",
            "Times the NOTIFY bridge connected again after losing its LISTEN connection",
            m.bridge_reconnects.clone(),
        );
        r.register(
            "notify_bridge_connected",
            "1 while the NOTIFY bridge holds its LISTEN connection",
            m.bridge_connected.clone(),
        );
        r.register(
            "workload_count_failures",
            "Scrapes that could not read the fleet's workload counts (those gauges are then absent)",
            m.fleet_failures.clone(),
        );
        r.register(
            "metrics_connections_refused",
            "Connections the metrics listener closed at accept: too many held, overall or from one source",
            m.metrics_refused.clone(),
        );
        r.register_collector(Box::new(m.fleet.clone()));
        Metrics { registry, ..m }
    }

    pub fn set_streams_open(&self, n: usize) {
        self.streams_open.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn ack(&self, status: AckStatus) {
        self.acks.get(status).inc();
    }

    pub fn recovery_snapshot(&self) {
        self.recovery_snapshots.inc();
    }

    /// `n` announcements were folded into the one a stream's task took.
    pub fn announcements_coalesced(&self, n: u64) {
        self.announcements_coalesced.inc_by(n);
    }

    pub fn auto_demoted(&self) {
        self.auto_demotions.inc();
    }

    pub fn deadline_reverted(&self) {
        self.deadline_reverts.inc();
    }

    /// A delta to a version committed at `committed` was sent at `now`.
    pub fn pushed(&self, committed: DateTime<Utc>, now: DateTime<Utc>) {
        self.push_sent.observe(latency_seconds(committed, now));
    }

    /// The version committed at `committed` was acked APPLIED at `now`.
    pub fn applied(&self, committed: DateTime<Utc>, now: DateTime<Utc>) {
        self.push_applied.observe(latency_seconds(committed, now));
    }

    pub fn window_stored(&self, records: usize, gaps: usize, took: Duration) {
        self.windows_stored.inc();
        self.records_stored.inc_by(records as u64);
        self.gaps_stored.inc_by(gaps as u64);
        self.ingest_duration.observe(took.as_secs_f64());
    }

    pub fn window_duplicate(&self, took: Duration) {
        self.windows_duplicate.inc();
        self.ingest_duration.observe(took.as_secs_f64());
    }

    pub fn window_refused(&self, reason: Refusal, records: usize, gaps: usize) {
        self.windows_refused.get(reason).inc();
        self.records_refused.get(reason).inc_by(records as u64);
        self.gaps_refused.get(reason).inc_by(gaps as u64);
    }

    pub fn agent_refused(&self, bound: crate::rate::Bound) {
        self.agent_refusals.get(bound).inc();
    }

    /// The bridge holds its LISTEN connection; `again` when it had one before.
    pub fn bridge_connected(&self, again: bool) {
        if again {
            self.bridge_reconnects.inc();
        }
        self.bridge_connected.set(1);
    }

    pub fn bridge_lost(&self) {
        self.bridge_connected.set(0);
    }

    /// The metrics as they stand, in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            .expect("writing to a String does not fail");
        text
    }

    /// Reads the fleet's workload counts (one bounded query, one scrape at a time), then
    /// encodes everything.
    pub async fn scrape(&self, pool: &PgPool) -> String {
        let _one_at_a_time = self.scrape.lock().await;
        let read = async {
            // The state as shown (`shown`), so a fleet with no replica left to sweep
            // counts its silent workloads OFFLINE.
            let rows = sqlx::query_as::<_, (i16, i16, i64)>(sqlx::AssertSqlSafe(format!(
                "SELECT {}, w.mode, count(*) FROM {}
                 WHERE w.retired_at IS NULL AND w.denied_at IS NULL GROUP BY 1, 2",
                crate::shown::STATE,
                crate::shown::ROWS
            )))
            .fetch_all(pool)
            .await?;
            let staged: i64 =
                sqlx::query_scalar("SELECT count(*) FROM staged_rulesets").fetch_one(pool).await?;
            Ok::<_, sqlx::Error>(WorkloadCounts {
                staged_rulesets: staged,
                ..WorkloadCounts::from_rows(&rows)
            })
        };
        let counts = match tokio::time::timeout(FLEET_QUERY_TIMEOUT, read).await {
            Ok(Ok(counts)) => Some(counts),
            Ok(Err(e)) => {
                tracing::warn!("metrics: could not count the fleet's workloads: {e}");
                None
            }
            Err(_) => {
                tracing::warn!("metrics: counting the fleet's workloads took over {FLEET_QUERY_TIMEOUT:?}");
                None
            }
        };
        if counts.is_none() {
            self.fleet_failures.inc();
        }
        *self.fleet.0.lock().unwrap_or_else(PoisonError::into_inner) = counts;
        self.encode()
    }
}

/// Scrape connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 16;
/// Scrape connections served at once from one source address (a Prometheus server uses one).
const MAX_CONNECTIONS_PER_SOURCE: usize = 4;
/// At most one log line about refused connections per this long.
const REFUSED_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// How long a client may take to send its request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is closed after this long, whatever it is doing.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Metrics,
    NotFound,
    MethodNotAllowed,
}

pub fn route(method: &Method, path: &str) -> Route {
    match (path, method) {
        ("/metrics", &Method::GET) => Route::Metrics,
        ("/metrics", _) => Route::MethodNotAllowed,
        _ => Route::NotFound,
    }
}

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    if status == StatusCode::METHOD_NOT_ALLOWED {
        response.headers_mut().insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET"));
    }
    response
}

async fn answer(
    metrics: &Metrics,
    pool: &PgPool,
    request: &Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    let text = "text/plain; charset=utf-8";
    match route(request.method(), request.uri().path()) {
        Route::Metrics => respond(StatusCode::OK, CONTENT_TYPE, metrics.scrape(pool).await),
        Route::MethodNotAllowed => {
            respond(StatusCode::METHOD_NOT_ALLOWED, text, "only GET /metrics is served here\n".into())
        }
        Route::NotFound => respond(
            StatusCode::NOT_FOUND,
            text,
            format!("{} is not served here; metrics are at GET /metrics\n", request.uri().path()),
        ),
    }
}

/// Serves `GET /metrics` (HTTP/1.1, no TLS, no authentication) on `listener` until the task is
/// dropped: at most [`MAX_CONNECTIONS`] connections, [`MAX_CONNECTIONS_PER_SOURCE`] of them from
/// one address, each bounded in time. Connections beyond are closed at accept, counted in
/// `innerwall_metrics_connections_refused_total` and logged at most every 10 s.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, pool: PgPool) {
    let admission = Arc::new(crate::admission::Admission::new(
        [],
        crate::admission::Limits {
            max_connections: MAX_CONNECTIONS,
            max_connections_per_source: MAX_CONNECTIONS_PER_SOURCE,
            ..crate::admission::Limits::default()
        },
    ));
    let mut logged: Option<std::time::Instant> = None;
    let mut refused = 0u64;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: wait instead of spinning.
                tracing::warn!("metrics listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = admission.admit(peer.ip()) else {
            drop(stream);
            metrics.metrics_refused.inc();
            refused += 1;
            if logged.is_none_or(|at| at.elapsed() >= REFUSED_LOG_INTERVAL) {
                tracing::warn!(
                    %peer,
                    refused,
                    max = MAX_CONNECTIONS,
                    max_per_source = MAX_CONNECTIONS_PER_SOURCE,
                    "metrics connections refused: too many held (overall or from this source); count since the last such line"
                );
                logged = Some(std::time::Instant::now());
                refused = 0;
            }
            continue;
        };
        let (metrics, pool) = (metrics.clone(), pool.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let (metrics, pool) = (metrics.clone(), pool.clone());
                async move { Ok::<_, Infallible>(answer(&metrics, &pool, &request).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of `text` for one family (its HELP, TYPE and samples), in order.
    fn family<'t>(text: &'t str, name: &str) -> Vec<&'t str> {
        text.lines()
            .filter(|l| {
                let bare = l.trim_start_matches("# HELP ").trim_start_matches("# TYPE ");
                bare.strip_prefix(name).is_some_and(|rest| rest.starts_with([' ', '{']))
            })
            .collect()
    }

    #[test]
    fn labeled_series_exist_from_the_start_in_the_sets_order() {
        let m = Metrics::new();
        m.ack(AckStatus::Failed);
        m.ack(AckStatus::Applied);
        m.ack(AckStatus::Applied);
        assert_eq!(
            family(&m.encode(), "innerwall_acks_total"),
            [
                "# HELP innerwall_acks_total Acks agents sent on this replica's streams, by status.",
                "# TYPE innerwall_acks_total counter",
                "innerwall_acks_total{status=\"APPLIED\"} 2",
                "innerwall_acks_total{status=\"HELD\"} 0",
                "innerwall_acks_total{status=\"FAILED\"} 1",
            ]
        );
    }

    #[test]
    fn refusals_count_windows_records_and_gaps_by_reason() {
        let m = Metrics::new();
        m.window_refused(Refusal::OutOfRange, 7, 2);
        m.window_stored(3, 1, Duration::from_millis(4));
        m.window_duplicate(Duration::from_millis(1));
        let text = m.encode();
        assert_eq!(
            family(&text, "innerwall_flow_records_refused_total")[2..],
            [
                "innerwall_flow_records_refused_total{reason=\"invalid\"} 0",
                "innerwall_flow_records_refused_total{reason=\"out_of_range\"} 7",
                "innerwall_flow_records_refused_total{reason=\"workload_refused\"} 0",
                "innerwall_flow_records_refused_total{reason=\"version_unknown\"} 0",
                "innerwall_flow_records_refused_total{reason=\"version_not_installed\"} 0",
                "innerwall_flow_records_refused_total{reason=\"mode_mismatch\"} 0",
                "innerwall_flow_records_refused_total{reason=\"overlap\"} 0",
                "innerwall_flow_records_refused_total{reason=\"staged_set_mismatch\"} 0",
                "innerwall_flow_records_refused_total{reason=\"version_pending\"} 0",
                "innerwall_flow_records_refused_total{reason=\"unavailable\"} 0",
                "innerwall_flow_records_refused_total{reason=\"internal\"} 0",
            ]
        );
        assert!(text.contains("\ninnerwall_flow_gaps_refused_total{reason=\"out_of_range\"} 2\n"), "{text}");
        assert!(text.contains("\ninnerwall_flow_records_ingested_total 3\n"), "{text}");
        assert!(text.contains("\ninnerwall_flow_windows_duplicate_total 1\n"), "{text}");
        assert!(text.contains("\ninnerwall_flow_ingest_duration_seconds_count 2\n"), "{text}");
    }

    #[test]
    fn every_family_is_named_once_with_its_type() {
        let text = Metrics::new().encode();
        let types: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert_eq!(
            types,
            [
                "innerwall_streams_open gauge",
                "innerwall_render_duration_seconds histogram",
                "innerwall_render_workloads_changed histogram",
                "innerwall_render_inputs_total counter",
                "innerwall_push_sent_latency_seconds histogram",
                "innerwall_push_applied_latency_seconds histogram",
                "innerwall_acks_total counter",
                "innerwall_recovery_snapshots_total counter",
                "innerwall_announcements_coalesced_total counter",
                "innerwall_auto_demotions_total counter",
                "innerwall_deadline_reverts_total counter",
                "innerwall_flow_windows_ingested_total counter",
                "innerwall_flow_records_ingested_total counter",
                "innerwall_flow_gaps_ingested_total counter",
                "innerwall_flow_windows_duplicate_total counter",
                "innerwall_flow_windows_refused_total counter",
                "innerwall_flow_records_refused_total counter",
                "innerwall_flow_gaps_refused_total counter",
                "innerwall_flow_ingest_duration_seconds histogram",
                "innerwall_agent_refusals_total counter",
                "innerwall_notify_bridge_reconnects_total counter",
                "innerwall_notify_bridge_connected gauge",
                "innerwall_workload_count_failures_total counter",
                "innerwall_metrics_connections_refused_total counter",
            ],
            "the fleet gauges are absent until a scrape read them"
        );
    }

    #[test]
    fn fleet_counts_by_state_and_mode() {
        let (synced, offline) = (SyncState::Synced.code(), SyncState::Offline.code());
        let (vis, enf) = (Mode::Visibility.code(), Mode::Enforcement.code());
        let counts =
            WorkloadCounts::from_rows(&[(synced, vis, 2), (synced, enf, 3), (offline, enf, 1), (99, vis, 8)]);
        assert_eq!(
            counts,
            WorkloadCounts { by_state: [0, 5, 0, 1, 0], by_mode: [2, 0, 4], staged_rulesets: 0 },
            "code 99 is no state"
        );
        let m = Metrics::new();
        *m.fleet.0.lock().unwrap() = Some(WorkloadCounts { staged_rulesets: 2, ..counts });
        let text = m.encode();
        assert_eq!(family(&text, "innerwall_staged_rulesets")[2..], ["innerwall_staged_rulesets 2"]);
        assert_eq!(
            family(&text, "innerwall_workloads_by_sync_state")[2..],
            [
                "innerwall_workloads_by_sync_state{state=\"PENDING\"} 0",
                "innerwall_workloads_by_sync_state{state=\"SYNCED\"} 5",
                "innerwall_workloads_by_sync_state{state=\"DEGRADED\"} 0",
                "innerwall_workloads_by_sync_state{state=\"OFFLINE\"} 1",
                "innerwall_workloads_by_sync_state{state=\"SUSPENDED\"} 0",
            ]
        );
        assert_eq!(
            family(&text, "innerwall_workloads_by_mode")[2..],
            [
                "innerwall_workloads_by_mode{mode=\"visibility\"} 2",
                "innerwall_workloads_by_mode{mode=\"simulation\"} 0",
                "innerwall_workloads_by_mode{mode=\"enforcement\"} 4",
            ]
        );
    }

    #[test]
    fn latencies_are_never_negative() {
        let t = DateTime::from_timestamp_millis(1_800_000_000_000).unwrap();
        assert_eq!(latency_seconds(t, t + chrono::Duration::milliseconds(1_250)), 1.25);
        assert_eq!(latency_seconds(t + chrono::Duration::milliseconds(3), t), 0.0, "clock skew");
    }

    #[test]
    fn bridge_reconnects_count_only_again() {
        let m = Metrics::new();
        m.bridge_connected(false);
        m.bridge_lost();
        m.bridge_connected(true);
        let text = m.encode();
        assert!(text.contains("\ninnerwall_notify_bridge_reconnects_total 1\n"), "{text}");
        assert!(text.contains("\ninnerwall_notify_bridge_connected 1\n"), "{text}");
    }

    #[test]
    fn only_get_metrics_is_served() {
        assert_eq!(route(&Method::GET, "/metrics"), Route::Metrics);
        assert_eq!(route(&Method::POST, "/metrics"), Route::MethodNotAllowed);
        assert_eq!(route(&Method::GET, "/"), Route::NotFound);
        assert_eq!(route(&Method::GET, "/metrics/"), Route::NotFound);
    }

    #[tokio::test]
    async fn the_listener_caps_each_source_and_counts_what_it_refuses() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let pool =
            sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://unused@localhost/unused").unwrap();
        let server = tokio::spawn(serve(listener, metrics.clone(), pool));
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS_PER_SOURCE + 2 {
            held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // The ones past the source's cap are closed at once: their reads end.
        for stream in &mut held[MAX_CONNECTIONS_PER_SOURCE..] {
            let mut buf = [0u8; 16];
            assert!(matches!(stream.read(&mut buf).await, Ok(0) | Err(_)), "closed at accept");
        }
        let text = metrics.encode();
        assert!(text.contains("\ninnerwall_metrics_connections_refused_total 2\n"), "{text}");
        server.abort();
    }
}
