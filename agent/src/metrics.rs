//! Prometheus metrics of the agent (OPS-3) and the plain-HTTP listener that serves them (`run
//! --metrics-listen`): applies with their duration and result, the applied version, drift
//! repairs, records and gaps per flow window, the flow capture's own counters (its connection
//! table's size and evictions, replies skipped, ICMP errors, reply-like UDP without an entry,
//! map-full drops), the telemetry queue's depth, reconnects, and the seconds the credential has
//! left. Recorded by `sync`, `daemon`, `daemon::windows` and `daemon::renew`; the
//! queue depth and the certificate's remaining life are read when scraped.
//!
//! Every series is registered up front and encoded in a fixed order. The listener is
//! unauthenticated: bind it to loopback or a private address.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::evidence::telemetry::Queue;

/// The `Content-Type` of what `/metrics` answers (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How an update ended, as its ack says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyResult {
    Applied,
    Held,
    Failed,
}

impl ApplyResult {
    const ALL: [ApplyResult; 3] = [ApplyResult::Applied, ApplyResult::Held, ApplyResult::Failed];

    fn value(self) -> &'static str {
        match self {
            ApplyResult::Applied => "APPLIED",
            ApplyResult::Held => "HELD",
            ApplyResult::Failed => "FAILED",
        }
    }
}

/// Apply durations, one histogram per result, encoded in `ApplyResult::ALL` order
/// (prometheus-client's `Family` iterates a hash map). Clones share the histograms.
#[derive(Debug, Clone)]
struct Applies([Histogram; 3]);

impl Applies {
    fn new() -> Applies {
        Applies(ApplyResult::ALL.map(|_| Histogram::new(exponential_buckets(0.0005, 2.0, 16))))
    }

    fn get(&self, result: ApplyResult) -> &Histogram {
        &self.0[ApplyResult::ALL.iter().position(|r| *r == result).expect("every result is in ALL")]
    }
}

impl EncodeMetric for Applies {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (result, histogram) in ApplyResult::ALL.iter().zip(&self.0) {
            histogram.encode(encoder.encode_family(&[("result", result.value())])?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        Histogram::TYPE
    }
}

/// Whole seconds from `now` until `not_after`; negative once it has passed.
pub fn seconds_until(not_after: SystemTime, now: SystemTime) -> i64 {
    match not_after.duration_since(now) {
        Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
        Err(past) => -i64::try_from(past.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// The agent's metrics. Shared through `sync::Agent`; every instrument is atomic.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    applies: Applies,
    applied_version: Gauge,
    drift_repairs: Counter,
    deadline_reverts: Counter,
    window_records: Histogram,
    window_gaps: Histogram,
    capture: CaptureCounters,
    queue_windows: Gauge,
    reconnects: Counter,
    connected: Gauge,
    certificate_expires_in: Gauge,
    /// Read when scraped.
    queue: Mutex<Option<Queue>>,
    not_after: Mutex<Option<SystemTime>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Registry::default(),
            applies: Applies::new(),
            applied_version: Gauge::default(),
            drift_repairs: Counter::default(),
            deadline_reverts: Counter::default(),
            window_records: Histogram::new([0.0, 1.0, 10.0, 100.0, 1_000.0, 10_000.0, 100_000.0]),
            window_gaps: Histogram::new([0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]),
            capture: CaptureCounters::default(),
            queue_windows: Gauge::default(),
            reconnects: Counter::default(),
            connected: Gauge::default(),
            certificate_expires_in: Gauge::default(),
            queue: Mutex::new(None),
            not_after: Mutex::new(None),
        };
        let mut registry = Registry::with_prefix("innerwall_agent");
        let r = &mut registry;
        r.register_with_unit(
            "apply_duration",
            "Time to apply one policy update (persist and install, or persist and hold), by the result its ack carries",
            Unit::Seconds,
            m.applies.clone(),
        );
        r.register("applied_version", "The policy version applied (or held) now", m.applied_version.clone());
        r.register(
            "drift_repairs",
            "Times table inet innerwall was found changed from outside and restored",
            m.drift_repairs.clone(),
        );
        r.register(
            "deadline_reverts",
            "Promotions this host reverted to simulation by itself because no confirmation came before their deadline",
            m.deadline_reverts.clone(),
        );
        r.register("flow_window_records", "Flow records per closed window", m.window_records.clone());
        r.register("flow_window_gaps", "Evidence gaps per closed window", m.window_gaps.clone());
        m.capture.register(r);
        r.register(
            "telemetry_queue_windows",
            "Flow windows queued on disk, not yet delivered",
            m.queue_windows.clone(),
        );
        r.register(
            "reconnects",
            "Dials of the policy stream after the first (a stream that ended, or a dial that failed)",
            m.reconnects.clone(),
        );
        r.register("stream_connected", "1 while the policy stream is established", m.connected.clone());
        r.register_with_unit(
            "certificate_expires_in",
            "Seconds until the agent's certificate expires; negative once it has",
            Unit::Seconds,
            m.certificate_expires_in.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn applied(&self, result: ApplyResult, took: Duration, version: u64) {
        self.applies.get(result).observe(took.as_secs_f64());
        self.set_applied_version(version);
    }

    pub fn set_applied_version(&self, version: u64) {
        self.applied_version.set(i64::try_from(version).unwrap_or(i64::MAX));
    }

    pub fn drift_repaired(&self) {
        self.drift_repairs.inc();
    }

    pub fn reverted_at_deadline(&self) {
        self.deadline_reverts.inc();
    }

    pub fn window_closed(&self, records: usize, gaps: usize) {
        self.window_records.observe(records as f64);
        self.window_gaps.observe(gaps as f64);
    }

    /// The capture program was loaded with a connection table of `entries`.
    pub fn capture_loaded(&self, entries: u32) {
        self.capture.conn_entries.set(i64::from(entries));
    }

    /// Adds one drain's counters (each is the count since the previous drain).
    pub fn capture_drained(&self, drained: &crate::evidence::capture::Drained) {
        let c = &self.capture;
        c.map_full_drops.inc_by(drained.map_full_drops);
        c.replies_skipped.inc_by(drained.replies_skipped);
        c.icmp_errors_related.inc_by(drained.icmp_errors_related);
        c.icmp_errors_unmatched.inc_by(drained.icmp_errors_unmatched);
        c.udp_reply_like_unmatched.inc_by(drained.udp_reply_like_unmatched);
        c.conn_evictions.inc_by(drained.conn_evictions_at_least);
    }

    pub fn reconnecting(&self) {
        self.reconnects.inc();
    }

    pub fn stream_connected(&self, up: bool) {
        self.connected.set(i64::from(up));
    }

    /// The queue whose depth is reported.
    pub fn watch_queue(&self, queue: Queue) {
        *self.queue.lock().unwrap_or_else(PoisonError::into_inner) = Some(queue);
    }

    /// The expiry of the credential in use.
    pub fn certificate(&self, not_after: SystemTime) {
        *self.not_after.lock().unwrap_or_else(PoisonError::into_inner) = Some(not_after);
    }

    /// The metrics at `now`, in the Prometheus text format. Lists the queue's directory.
    pub fn encode(&self, now: SystemTime) -> String {
        if let Some(queue) = &*self.queue.lock().unwrap_or_else(PoisonError::into_inner) {
            self.queue_windows.set(i64::try_from(queue.len()).unwrap_or(i64::MAX));
        }
        if let Some(not_after) = *self.not_after.lock().unwrap_or_else(PoisonError::into_inner) {
            self.certificate_expires_in.set(seconds_until(not_after, now));
        }
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            .expect("writing to a String does not fail");
        text
    }
}

/// The flow capture's diagnostic counters (`innerwall_agent_capture_*`), summed over drains.
#[derive(Debug, Default)]
struct CaptureCounters {
    conn_entries: Gauge,
    conn_evictions: Counter,
    replies_skipped: Counter,
    icmp_errors_related: Counter,
    icmp_errors_unmatched: Counter,
    udp_reply_like_unmatched: Counter,
    map_full_drops: Counter,
}

impl CaptureCounters {
    fn register(&self, r: &mut Registry) {
        r.register(
            "capture_conn_table_entries",
            "Capacity of the flow capture's connection table (run --conn-table-entries, else derived from memory)",
            self.conn_entries.clone(),
        );
        r.register(
            "capture_conn_evictions",
            "Connection-table evictions, at least (connections inserted beyond its capacity)",
            self.conn_evictions.clone(),
        );
        r.register(
            "capture_replies_skipped",
            "Inbound packets skipped as replies to connections this host initiated",
            self.replies_skipped.clone(),
        );
        r.register(
            "capture_icmp_errors_related",
            "ICMP errors about a packet of a known connection (never recorded as flows)",
            self.icmp_errors_related.clone(),
        );
        r.register(
            "capture_icmp_errors_unmatched",
            "ICMP errors about a packet of no known connection: evicted, older than the capture, or forged (not recorded)",
            self.icmp_errors_unmatched.clone(),
        );
        r.register(
            "capture_udp_reply_like_unmatched",
            "UDP datagrams from a service port to an ephemeral local port with no connection entry, recorded as inbound \
             (each window that has some carries a suspect-direction gap)",
            self.udp_reply_like_unmatched.clone(),
        );
        r.register(
            "capture_map_full_drops",
            "Packets whose flow could not be recorded because the flow map was full (each a map-full gap)",
            self.map_full_drops.clone(),
        );
    }
}

/// Scrape connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 8;
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

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    if status == StatusCode::METHOD_NOT_ALLOWED {
        headers.insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET"));
    }
    response
}

async fn answer(metrics: Arc<Metrics>, request: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let text = "text/plain; charset=utf-8";
    match route(request.method(), request.uri().path()) {
        Route::Metrics => {
            // Listing the queue's directory is file system work: off the async workers.
            let body = tokio::task::spawn_blocking(move || metrics.encode(SystemTime::now())).await;
            match body {
                Ok(body) => respond(StatusCode::OK, CONTENT_TYPE, body),
                Err(e) => respond(StatusCode::INTERNAL_SERVER_ERROR, text, format!("encoding failed: {e}\n")),
            }
        }
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
/// dropped: at most [`MAX_CONNECTIONS`] connections, each bounded in time.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait instead of spinning.
                tracing::warn!("metrics listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(answer(metrics, request).await) }
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

    #[test]
    fn families_in_a_fixed_order_with_every_result() {
        let m = Metrics::new();
        m.applied(ApplyResult::Failed, Duration::from_millis(3), 0);
        m.applied(ApplyResult::Applied, Duration::from_millis(2), 7);
        m.window_closed(12, 1);
        m.capture_loaded(4096);
        let drained = crate::evidence::capture::Drained {
            map_full_drops: 1,
            replies_skipped: 2,
            icmp_errors_related: 3,
            icmp_errors_unmatched: 4,
            udp_reply_like_unmatched: 5,
            conn_evictions_at_least: 6,
            ..crate::evidence::capture::Drained::default()
        };
        m.capture_drained(&drained);
        m.capture_drained(&drained);
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        m.certificate(t0 + Duration::from_secs(3_600));
        let text = m.encode(t0);
        let types: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert_eq!(
            types,
            [
                "innerwall_agent_apply_duration_seconds histogram",
                "innerwall_agent_applied_version gauge",
                "innerwall_agent_drift_repairs_total counter",
                "innerwall_agent_deadline_reverts_total counter",
                "innerwall_agent_flow_window_records histogram",
                "innerwall_agent_flow_window_gaps histogram",
                "innerwall_agent_capture_conn_table_entries gauge",
                "innerwall_agent_capture_conn_evictions_total counter",
                "innerwall_agent_capture_replies_skipped_total counter",
                "innerwall_agent_capture_icmp_errors_related_total counter",
                "innerwall_agent_capture_icmp_errors_unmatched_total counter",
                "innerwall_agent_capture_udp_reply_like_unmatched_total counter",
                "innerwall_agent_capture_map_full_drops_total counter",
                "innerwall_agent_telemetry_queue_windows gauge",
                "innerwall_agent_reconnects_total counter",
                "innerwall_agent_stream_connected gauge",
                "innerwall_agent_certificate_expires_in_seconds gauge",
            ]
        );
        let counts: Vec<&str> =
            text.lines().filter(|l| l.starts_with("innerwall_agent_apply_duration_seconds_count")).collect();
        assert_eq!(
            counts,
            [
                "innerwall_agent_apply_duration_seconds_count{result=\"APPLIED\"} 1",
                "innerwall_agent_apply_duration_seconds_count{result=\"HELD\"} 0",
                "innerwall_agent_apply_duration_seconds_count{result=\"FAILED\"} 1",
            ]
        );
        for line in [
            "innerwall_agent_applied_version 7",
            "innerwall_agent_flow_window_records_sum 12.0",
            "innerwall_agent_flow_window_gaps_count 1",
            "innerwall_agent_certificate_expires_in_seconds 3600",
            // Each counter sums the drains, in its own series.
            "innerwall_agent_capture_conn_table_entries 4096",
            "innerwall_agent_capture_map_full_drops_total 2",
            "innerwall_agent_capture_replies_skipped_total 4",
            "innerwall_agent_capture_icmp_errors_related_total 6",
            "innerwall_agent_capture_icmp_errors_unmatched_total 8",
            "innerwall_agent_capture_udp_reply_like_unmatched_total 10",
            "innerwall_agent_capture_conn_evictions_total 12",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn seconds_until_expiry_go_negative_after_it() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(seconds_until(t0 + Duration::from_millis(90_500), t0), 90);
        assert_eq!(seconds_until(t0, t0), 0);
        assert_eq!(seconds_until(t0, t0 + Duration::from_secs(30)), -30);
    }

    #[test]
    fn only_get_metrics_is_served() {
        assert_eq!(route(&Method::GET, "/metrics"), Route::Metrics);
        assert_eq!(route(&Method::PUT, "/metrics"), Route::MethodNotAllowed);
        assert_eq!(route(&Method::GET, "/healthz"), Route::NotFound);
    }
}
