//! PERF-11: the web console at fleet size — 10,000 workloads in 150 label groups and 10 M flow
//! records over the last day — served by the real API listener over HTTPS with a signed-in
//! session: the fleet page's first page (goal < 200 ms and < 150 KB of HTML), the map of 150
//! groups over 24 h (< 500 ms) and a workload's page (< 200 ms). Times are whole requests from a
//! client on the same machine (TLS, HTTP and the page), so they bound the server time from above.
//! Flows are loaded as the `rollup` bench loads them, summed for the map and rolled up, but for
//! the last minute's windows, which stay queued for the map's edge job as between two of its runs.
//!
//! `INNERWALL_BENCH_QUICK=1` runs 1,000 workloads and 100,000 records (it proves the bench works;
//! its figures judge nothing). `INNERWALL_BENCH_KEEP=1` with `INNERWALL_TEST_DATABASE_URL` leaves
//! the loaded database on that server (its URL is printed) to look at the map's plans with
//! `EXPLAIN` (the load takes minutes; the pages' ranges end now, so there is no reuse). Run with
//! `cargo bench -p innerwall-control-plane --bench console` or `cargo xtask bench console`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{TimeDelta, Utc};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::{ApiConfig, ApiTls, server};
use innerwall_control_plane::flows;
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::operators::{self, Expiry, Role};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};

#[path = "shared/flow_estate.rs"]
mod flow_estate;
use flow_estate::RECORDS_PER_WINDOW;

/// Label groups of the estate (`app=a0..a149`).
const GROUPS: i64 = 150;

/// An HTTPS client of the console with a session cookie.
struct Client {
    addr: std::net::SocketAddr,
    tls: tokio_rustls::TlsConnector,
    cookie: String,
}

impl Client {
    /// One request on a connection of its own: status, body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> anyhow::Result<(u16, hyper::HeaderMap, Vec<u8>)> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let stream = self.tls.connect(ServerName::try_from("localhost")?, tcp).await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let mut request = hyper::Request::builder().method(method).uri(path).header("host", "localhost");
        if !self.cookie.is_empty() {
            request = request.header("cookie", &self.cookie);
        }
        let bytes = match body {
            Some(form) => {
                request = request.header("content-type", "application/x-www-form-urlencoded");
                form.into_bytes()
            }
            None => Vec::new(),
        };
        let response = sender.send_request(request.body(Full::new(Bytes::from(bytes)))?).await?;
        let (parts, body) = response.into_parts();
        Ok((parts.status.as_u16(), parts.headers, body.collect().await?.to_bytes().to_vec()))
    }

    /// `runs` timed GETs of `path` after one warm-up: p50 and p95 (ms) and the page.
    async fn measure(&self, path: &str, runs: usize) -> anyhow::Result<(f64, f64, Vec<u8>)> {
        let (status, _, body) = self.call("GET", path, None).await?;
        anyhow::ensure!(status == 200, "GET {path}: {status}: {}", String::from_utf8_lossy(&body));
        let mut times = Vec::new();
        let mut page = body;
        for _ in 0..runs {
            let t = Instant::now();
            let (status, _, body) = self.call("GET", path, None).await?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(status == 200, "GET {path}: {status}");
            page = body;
        }
        times.sort_by(f64::total_cmp);
        let at = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize];
        Ok((at(0.5), at(0.95), page))
    }
}

fn figure(id: &str, name: &str, value: f64, unit: &str, bound: f64, workloads: i64) {
    println!(
        "FIGURE {}",
        serde_json::json!({"id": id, "name": name, "value": value, "unit": unit,
            "goal": {"op": "<", "bound": bound}, "context": {"workloads": workloads}})
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = std::env::var_os("INNERWALL_BENCH_QUICK").is_some();
    let (workloads, records, runs) = if quick { (1_000, 100_000, 5) } else { (10_000, 10_000_000, 20) };
    let windows = (records / RECORDS_PER_WINDOW).max(workloads);
    println!(
        "PERF-11 console (targets: fleet page < 200 ms and < 150 KB; map of {GROUPS} groups over 24 h < 500 ms; workload page < 200 ms): {workloads} workloads, {} records over 1 day",
        windows * RECORDS_PER_WINDOW
    );
    let (pool, _guard) = flow_estate::database().await?;
    let t = Instant::now();
    let now = Utc::now();
    // Every window but the last minute's worth (a 1,440th of the day's) is summed for the map and
    // the closed hours are rolled up, as the jobs leave them; the last windows come after and stay
    // queued, as between two runs of the edge job (every minute), so the map reads them raw.
    let shape = flow_estate::Shape {
        start: now - TimeDelta::days(1),
        days: 1,
        windows,
        workloads,
        records_per_window: RECORDS_PER_WINDOW,
    };
    let last_minute = windows / (24 * 60);
    flow_estate::add_workloads(&pool, &shape).await?;
    flow_estate::add_windows(&pool, &shape, 0..windows - last_minute).await?;
    // 150 destination groups (the loader labels 50).
    sqlx::query("UPDATE workload_labels SET value = 'a' || (('x' || substr(workload_id::text, 1, 8))::bit(32)::bigint % $1) WHERE key = 'app'")
        .bind(GROUPS)
        .execute(&pool)
        .await?;
    let summed = flows::sum_edges(&pool).await?;
    let rolled = flows::roll_up(&pool, now).await?;
    flow_estate::add_windows(&pool, &shape, windows - last_minute..windows).await?;
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM flow_edge_pending").fetch_one(&pool).await?;
    println!(
        "loaded, summed for the map ({summed} windows) and rolled up ({rolled} windows) in {:.1} s; {queued} windows of the last minute queued",
        t.elapsed().as_secs_f64()
    );

    let dir = std::env::temp_dir().join(format!("iw-bench-console-{}", std::process::id()));
    let signer = Arc::new(FileCa::init(&dir.join("ca"))?);
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse()?,
        tls: ApiTls::FromCa { names: vec!["localhost".into()], lifetime: Duration::from_secs(3600) },
        limits: Default::default(),
    };
    let api = server::start(pool.clone(), signer.clone(), config).await?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(signer.ca_bundle_pem().as_bytes()) {
        roots.add(cert?)?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut client = Client {
        addr: api.local_addr,
        tls: tokio_rustls::TlsConnector::from(Arc::new(tls)),
        cookie: String::new(),
    };
    let token = operators::mint_audited(&pool, "bench", "bench", Role::Viewer, Expiry::Never).await?.token;
    let (status, headers, _) = client.call("POST", "/sign-in", Some(format!("token={token}"))).await?;
    anyhow::ensure!(status == 303, "sign-in: {status}");
    let cookie = headers.get("set-cookie").and_then(|v| v.to_str().ok()).unwrap_or_default();
    client.cookie = cookie.split(';').next().unwrap_or_default().to_owned();

    let (p50, p95, page) = client.measure("/fleet", runs).await?;
    let size = page.len();
    println!(
        "PERF-11: fleet page: p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs, {size} bytes of HTML (targets < 200 ms, < 150 KB)"
    );
    figure("PERF-11", "console fleet page p95", p95, "ms", 200.0, workloads);
    figure("PERF-11", "console fleet page size", size as f64 / 1024.0, "KiB", 150.0, workloads);
    let (p50, p95, page) = client.measure("/map?key=app&since=24h", runs).await?;
    let text = String::from_utf8_lossy(&page);
    let left_out =
        if text.contains("are not summed for the map yet") { ", the queued records left out" } else { "" };
    let drawn =
        text.split("Flows of the whole hours ").nth(1).and_then(|t| t.split(';').next()).unwrap_or("?");
    println!(
        "PERF-11: map of {GROUPS} groups over 24 h: p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs, {} bytes, hours {drawn}{left_out} (target < 500 ms)",
        page.len(),
    );
    figure("PERF-11", "console map p95, 150 groups over 24 h", p95, "ms", 500.0, workloads);
    let workload: uuid::Uuid = sqlx::query_scalar("SELECT md5('w0')::uuid").fetch_one(&pool).await?;
    let (p50, p95, page) = client.measure(&format!("/workloads/{workload}"), runs).await?;
    let size = page.len();
    println!(
        "PERF-11: workload page: p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs, {size} bytes (target < 200 ms)"
    );
    figure("PERF-11", "console workload page p95", p95, "ms", 200.0, workloads);
    api.stop(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
