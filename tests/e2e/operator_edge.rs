//! Issue 26 items 1 and 6 against a real `innerwall serve --api-listen`: the API listener holds
//! against clients that hold connections or never read their answers
//! (`api_listener_survives_slot_exhaustion`), a token's requests are bounded per minute with 429
//! and `Retry-After` (`api_requests_are_rate_limited_per_token`), and renders are bounded per
//! token and overall, audited once per repeat-run with a count
//! (`expensive_operations_are_rate_limited`).
//!
//! Sources are told apart by loopback address: the server listens on 127.0.0.1 and each client
//! binds its own 127.0.0.x, which Linux routes over `lo` without set-up.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use innerwall_control_plane::identity::ca::Signer as _;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::plane::Plane;
use crate::remote::innerwall;

/// `innerwall serve` with its API on a free loopback port and `extra` flags; killed on drop.
struct Serve {
    child: Child,
    port: u16,
    _lines: mpsc::Receiver<String>,
}

impl Serve {
    fn start(plane: &Plane, extra: &[&str]) -> Serve {
        std::fs::create_dir_all(&plane.dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let api = format!("127.0.0.1:{port}");
        let mut child = Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--database-url", &plane.db.url, "--ca-dir"])
            .arg(plane.dir.join("ca"))
            .args(["serve", "--listen", "127.0.0.1:0", "--server-name", "localhost", "--api-listen", &api])
            .args(extra)
            .env("INNERWALL_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning innerwall serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("operator API on https://") => break,
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never announced its API; it logged:\n{}", seen.join("\n")),
            }
        }
        Serve { child, port, _lines: lines }
    }

    /// A line of `/proc/<serve>/status` in KiB (`VmHWM`, `VmRSS`).
    fn kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line =
            status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field}: {status}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP connection to the API from the loopback address `from`, optionally with a small
/// receive buffer (so a client that does not read fills it soon).
async fn tcp(port: u16, from: [u8; 4], recv_buffer: Option<u32>) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    if let Some(size) = recv_buffer {
        socket.set_recv_buffer_size(size)?;
    }
    socket.bind(SocketAddr::new(IpAddr::from(from), 0))?;
    socket.connect(SocketAddr::from(([127, 0, 0, 1], port))).await
}

fn tls_config(plane: &Plane) -> Arc<rustls::ClientConfig> {
    let pem = plane.signer.ca_bundle_pem();
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

async fn tls(plane: &Plane, tcp: TcpStream) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(tls_config(plane)).connect(name, tcp).await
}

/// One answer: status, headers (lower-cased names) and body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn problem(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// `method path` on a new connection from `from`, with `token` as the bearer if given.
async fn call(
    plane: &Plane,
    port: u16,
    from: [u8; 4],
    method: &str,
    path: &str,
    token: Option<&str>,
) -> Answer {
    let mut stream = tls(plane, tcp(port, from, None).await.expect("connect")).await.expect("tls");
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let _ =
        tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut raw)).await.expect("an answer");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no answer: {text:?}"));
    let mut lines = head.lines();
    let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer { status, headers, body: body.to_owned() }
}

/// Waits until the peer closes `stream` (a read of 0 or an error), up to `within`.
async fn closed(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline.into(), stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

const OPERATOR: [u8; 4] = [127, 0, 0, 2];
const HOLDER: [u8; 4] = [127, 0, 0, 3];
const PIPELINER: [u8; 4] = [127, 0, 0, 4];

/// The most serve's peak RSS may reach in this test (its start-up is well under 100 MiB).
const MAX_SERVE_HWM_KIB: u64 = 256 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_listener_survives_slot_exhaustion() {
    let plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let serve = Serve::start(
        &plane,
        &[
            "--api-max-connections",
            "24",
            "--api-max-connections-per-source",
            "8",
            "--api-write-timeout",
            "2s",
            "--api-connection-lifetime",
            "5m",
        ],
    );
    let port = serve.port;
    let token = tokio::task::spawn_blocking({
        let url = plane.db.url.clone();
        move || mint_named(&url, "edge-editor")
    })
    .await
    .unwrap();
    let before = serve.kib("VmRSS:");

    // One source holds more connections than its cap, never starting TLS: its first eight are
    // held, every one past them is closed at accept.
    let mut held = Vec::new();
    for _ in 0..20 {
        held.push(tcp(port, HOLDER, None).await.expect("the kernel accepts"));
    }
    let mut refused = 0;
    for stream in &mut held[8..] {
        if closed(stream, Duration::from_secs(30)).await {
            refused += 1;
        }
    }
    assert_eq!(refused, 12, "every connection past the source's cap of 8 is closed");

    // Clients that pipeline requests and never read: each writes until the server stops
    // reading it, and the server closes it once its writes have stalled for 2 s.
    let mut pipeliners = Vec::new();
    for _ in 0..4 {
        let stream = tls(&plane, tcp(port, PIPELINER, Some(4096)).await.unwrap()).await.expect("tls");
        pipeliners.push(tokio::spawn(async move {
            let (_read, mut write) = tokio::io::split(stream);
            let request = b"GET /api/v1/openapi.json HTTP/1.1\r\nHost: localhost\r\n\r\n".repeat(64);
            let started = Instant::now();
            let mut sent = 0usize;
            loop {
                match write.write_all(&request).await {
                    Ok(()) => sent += request.len(),
                    Err(e) => return (started.elapsed(), sent, e.to_string()),
                }
            }
        }));
    }

    // While all that is held, an operator from another source is answered.
    let answer = call(&plane, port, OPERATOR, "GET", "/api/v1/workloads", Some(&token)).await;
    assert_eq!(answer.status, 200, "{answer:?}");

    // Each pipeliner is closed: its writes fail (observed, not timed beyond a generous bound).
    for pipeliner in pipeliners {
        let (took, sent, error) = tokio::time::timeout(Duration::from_secs(120), pipeliner)
            .await
            .expect("a client that never reads is closed")
            .unwrap();
        assert!(sent > 0, "it sent requests before it was closed ({error})");
        eprintln!("pipeliner closed after {took:?} having sent {sent} bytes: {error}");
    }
    // The held connections end too (no TLS within the handshake timeout), and their source
    // gets its places back: a second round is admitted again.
    for stream in &mut held[..8] {
        assert!(closed(stream, Duration::from_secs(60)).await, "a held connection without TLS is closed");
    }
    drop(held);
    let again = call(&plane, port, HOLDER, "GET", "/api/v1/workloads", Some(&token)).await;
    assert_eq!(
        again.status, 200,
        "the holder's source is admitted again once its connections ended: {again:?}"
    );
    let answer = call(&plane, port, OPERATOR, "GET", "/api/v1/workloads", Some(&token)).await;
    assert_eq!(answer.status, 200, "{answer:?}");

    let (after, peak) = (serve.kib("VmRSS:"), serve.kib("VmHWM:"));
    eprintln!("serve RSS {before} KiB before, {after} KiB after, peak {peak} KiB");
    assert!(peak < MAX_SERVE_HWM_KIB, "serve's peak RSS {peak} KiB is over {MAX_SERVE_HWM_KIB} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_requests_are_rate_limited_per_token() {
    let plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let serve =
        Serve::start(&plane, &["--api-requests-per-minute", "4", "--api-unauthenticated-per-minute", "3"]);
    let port = serve.port;
    let (a, b) = tokio::task::spawn_blocking({
        let plane_url = plane.db.url.clone();
        move || (mint_named(&plane_url, "edge-a"), mint_named(&plane_url, "edge-b"))
    })
    .await
    .unwrap();
    for n in 0..4 {
        let answer = call(&plane, port, OPERATOR, "GET", "/api/v1/services", Some(&a)).await;
        assert_eq!(answer.status, 200, "request {n}: {answer:?}");
    }
    // The fifth in the minute, and the one after it (refusals cost nothing, but do not pass).
    for _ in 0..2 {
        let refused = call(&plane, port, OPERATOR, "GET", "/api/v1/services", Some(&a)).await;
        assert_eq!(refused.status, 429, "{refused:?}");
        let wait: u64 = refused.header("retry-after").expect("Retry-After").parse().unwrap();
        assert!((1..=15).contains(&wait), "4 a minute: one every 15 s, so at most 15 s to wait, not {wait}");
        let problem = refused.problem();
        assert_eq!(problem["type"], "urn:innerwall:problem:rate-limited", "{problem}");
        assert_eq!(problem["bound"], "--api-requests-per-minute", "{problem}");
        assert_eq!(problem["retry_after"], wait, "{problem}");
        assert_eq!(refused.header("content-type"), Some("application/problem+json"));
    }
    // Another token from the same source has a bucket of its own.
    let answer = call(&plane, port, OPERATOR, "GET", "/api/v1/services", Some(&b)).await;
    assert_eq!(answer.status, 200, "{answer:?}");

    // Requests without a valid token have their own small share per source: past it they are
    // refused before any token is looked up, and a token holder from elsewhere is not affected,
    // nor one whose token authenticated from that address before (a shared NAT).
    let c = tokio::task::spawn_blocking({
        let plane_url = plane.db.url.clone();
        move || mint_named(&plane_url, "edge-c")
    })
    .await
    .unwrap();
    let answer = call(&plane, port, HOLDER, "GET", "/api/v1/services", Some(&c)).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let bad = "iwo_".to_owned() + &"x".repeat(51);
    for _ in 0..3 {
        let answer = call(&plane, port, HOLDER, "GET", "/api/v1/services", Some(&bad)).await;
        assert_eq!(answer.status, 401, "{answer:?}");
    }
    for path in ["/api/v1/services", "/api/v1/openapi.json"] {
        let answer = call(&plane, port, HOLDER, "GET", path, Some(&bad)).await;
        assert_eq!(answer.status, 429, "{path}: {answer:?}");
        assert_eq!(answer.problem()["bound"], "--api-unauthenticated-per-minute");
        assert!(answer.header("retry-after").is_some());
    }
    let answer = call(&plane, port, PIPELINER, "GET", "/api/v1/services", Some(&b)).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let answer = call(&plane, port, HOLDER, "GET", "/api/v1/services", Some(&c)).await;
    assert_eq!(answer.status, 200, "a token that authenticated from the address still passes: {answer:?}");
    let answer = call(&plane, port, HOLDER, "GET", "/api/v1/services", Some(&bad)).await;
    assert_eq!(answer.status, 429, "and a bad one is still refused: {answer:?}");
}

/// An editor token named `name`, minted by the CLI on `url`.
fn mint_named(url: &str, name: &str) -> String {
    let (code, out, err) = innerwall(
        &["--json", "--database-url", url, "operator", "token", "mint", "--name", name, "--role", "editor"],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["token"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expensive_operations_are_rate_limited() {
    let plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let serve =
        Serve::start(&plane, &["--api-expensive-per-minute", "3", "--api-expensive-overall-per-minute", "5"]);
    let port = serve.port;
    let url = plane.db.url.clone();
    let (a, b) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || (mint_named(&url, "renderer-a"), mint_named(&url, "renderer-b"))
    })
    .await
    .unwrap();
    let render = |token: String| {
        let plane = &plane;
        async move { call(plane, port, OPERATOR, "POST", "/api/v1/render", Some(&token)).await }
    };
    for n in 0..3 {
        assert_eq!(render(a.clone()).await.status, 200, "render {n} of token a");
    }
    let refused = render(a.clone()).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.problem()["type"], "urn:innerwall:problem:rate-limited");
    assert_eq!(refused.problem()["bound"], "--api-expensive-per-minute");
    assert!(
        refused.header("retry-after").is_some_and(|s| s.parse::<u64>().is_ok_and(|s| (1..=20).contains(&s)))
    );
    for n in 0..2 {
        assert_eq!(render(b.clone()).await.status, 200, "render {n} of token b");
    }
    // Five renders in the minute: everyone's bound, whichever token asks next.
    let refused = render(b.clone()).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.problem()["bound"], "--api-expensive-overall-per-minute", "{:?}", refused.problem());

    // One audit row per token's repeat-run, counting its renders; nothing for the refusals.
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT actor, count FROM audit_log WHERE action = 'policy.render' ORDER BY actor")
            .fetch_all(plane.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let mut counts: Vec<i64> = rows.iter().map(|(_, c)| *c).collect();
    counts.sort_unstable();
    assert_eq!(counts, [2, 3], "{rows:?}");
    assert!(rows.iter().all(|(actor, _)| actor.starts_with("operator:renderer-")), "{rows:?}");
}
