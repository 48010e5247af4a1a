//! Prometheus metrics and JSON logs (OPS-3), from outside: a replica's `/metrics` and two real
//! agents' `/metrics` while a commit reaches both agents (each in a network namespace of its
//! own), and the `innerwall serve` and `innerwall-agent` binaries with `--log-format json`,
//! whose every line on stderr must be a JSON object.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;

use crate::host::{Agent, HOST_ADDRESS, Namespace, PEER_ADDRESS, Peer, require_root};
use crate::plane::Plane;

/// A `/metrics` answer: status code, content type, body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) content_type: String,
    pub(crate) body: String,
}

/// One HTTP/1.1 request with a plain socket (in the calling thread's network namespace).
pub(crate) fn http(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<Answer> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type:").map(|v| v.trim().to_owned()))
        .unwrap_or_default();
    Ok(Answer { status, content_type, body: body.to_owned() })
}

/// The value of one series (`name` or `name{labels}`) in a scrape.
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Scrapes `addr` until `done` holds for the text (15 s at most); the last scrape otherwise.
async fn scrape_until(addr: SocketAddr, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let last = match http(addr, "GET", "/metrics") {
            Ok(answer) if answer.status == 200 => answer.body,
            Ok(answer) => format!("status {}: {}", answer.status, answer.body),
            Err(e) => format!("scrape failed: {e}"),
        };
        if done(&last) {
            return last;
        }
        assert!(Instant::now() < deadline, "{addr}/metrics never showed {what}; last scrape:\n{last}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every line `log` holds is a JSON object with a timestamp, a level and fields; how many.
fn json_lines(log: &str, whose: &str) -> usize {
    let mut n = 0;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{whose}: a line that is not JSON ({e}): {line}"));
        assert!(
            event["timestamp"].is_string() && event["level"].is_string() && event["fields"].is_object(),
            "{whose}: not a log event: {line}"
        );
        n += 1;
    }
    n
}

async fn latest(plane: &Plane, id: WorkloadId) -> i64 {
    plane.status(id).await.2.expect("a rendered policy")
}

/// The agents' metrics port, inside their own namespaces (nothing else listens there).
const AGENT_METRICS_PORT: u16 = 9464;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_reflect_the_fleet() {
    require_root();
    let mut plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    // Agent A in the test's namespace, agent B in the peer namespace behind the veth pair; the
    // replica listens in the test's namespace on every address, so B reaches it at HOST_ADDRESS.
    let ns = Namespace::create(format!("iw-metrics-{}", std::process::id()));
    let peer = Peer::create(&ns);
    ns.enter();
    plane.listen_ip = IpAddr::from([0, 0, 0, 0]);
    plane.server_names.push(HOST_ADDRESS.into());
    plane.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    plane.up().await;
    let replica = plane.running.as_ref().unwrap().metrics_addr.expect("a metrics listener");
    let (a, config_a) = plane.enroll("metrics-a", &["app=web"]).await;
    let (b, config_b) = plane.enroll("metrics-b", &["app=web"]).await;
    let (state_a, state_b) = (config_a.state_dir.clone(), config_b.state_dir.clone());
    let port = AGENT_METRICS_PORT.to_string();
    let listen_a = format!("127.0.0.1:{port}");
    let listen_b = format!("{PEER_ADDRESS}:{port}");
    let _agent_a = Agent::start_with(
        &state_a,
        &plane.server(),
        &["--log-format", "json", "--metrics-listen", &listen_a],
    );
    let server_b = format!("{HOST_ADDRESS}:{}", plane.port);
    let _agent_b = peer.inside(|| {
        Agent::start_with(&state_b, &server_b, &["--log-format", "json", "--metrics-listen", &listen_b])
    });
    for id in [a, b] {
        let version = latest(&plane, id).await;
        plane.wait_synced(id, version).await;
    }
    let before =
        scrape_until(replica, "two streams", |t| sample(t, "innerwall_streams_open") == Some(2.0)).await;
    let counter =
        |text: &str, series: &str| sample(text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"));
    let renders = counter(&before, "innerwall_render_duration_seconds_count");
    let changed = counter(&before, "innerwall_render_workloads_changed_sum");
    let applied = counter(&before, "innerwall_acks_total{status=\"APPLIED\"}");

    // The commit: one more port for every app=web workload, one render, a version each.
    plane.bump(1).await;
    let (va, vb) = (latest(&plane, a).await, latest(&plane, b).await);
    plane.wait_synced(a, va).await;
    plane.wait_synced(b, vb).await;
    let after = scrape_until(replica, "the commit applied by both agents", |t| {
        sample(t, "innerwall_acks_total{status=\"APPLIED\"}").is_some_and(|n| n >= applied + 2.0)
            && sample(t, "innerwall_push_applied_latency_seconds_count").is_some_and(|n| n >= 2.0)
    })
    .await;
    assert_eq!(sample(&after, "innerwall_streams_open"), Some(2.0), "{after}");
    assert_eq!(sample(&after, "innerwall_workloads_by_sync_state{state=\"SYNCED\"}"), Some(2.0), "{after}");
    assert_eq!(sample(&after, "innerwall_workloads_by_sync_state{state=\"OFFLINE\"}"), Some(0.0), "{after}");
    assert_eq!(sample(&after, "innerwall_workloads_by_mode{mode=\"visibility\"}"), Some(2.0), "{after}");
    assert_eq!(sample(&after, "innerwall_staged_rulesets"), Some(0.0), "{after}");
    // Renders are counted per process and other tests render in this one too: at least ours.
    assert!(
        counter(&after, "innerwall_render_duration_seconds_count") > renders,
        "no render counted:\n{after}"
    );
    assert!(
        counter(&after, "innerwall_render_workloads_changed_sum") >= changed + 2.0,
        "the render changed both workloads:\n{after}"
    );
    assert!(counter(&after, "innerwall_push_sent_latency_seconds_count") >= 2.0, "{after}");
    assert_eq!(sample(&after, "innerwall_acks_total{status=\"FAILED\"}"), Some(0.0), "{after}");
    assert_eq!(sample(&after, "innerwall_recovery_snapshots_total"), Some(0.0), "{after}");

    // Each agent shows the version the control plane records as its latest, applied.
    for (addr, id, version, state) in [
        (listen_a.parse::<SocketAddr>().unwrap(), a, va, &state_a),
        (listen_b.parse().unwrap(), b, vb, &state_b),
    ] {
        let text = scrape_until(addr, &format!("applied version {version}"), |t| {
            sample(t, "innerwall_agent_applied_version") == Some(version as f64)
        })
        .await;
        assert_eq!(plane.status(id).await.1, version, "the control plane's applied version");
        assert_eq!(sample(&text, "innerwall_agent_stream_connected"), Some(1.0), "{text}");
        let applies = counter(&text, "innerwall_agent_apply_duration_seconds_count{result=\"APPLIED\"}");
        assert!(applies >= 2.0, "the snapshot and the delta:\n{text}");
        let left = counter(&text, "innerwall_agent_certificate_expires_in_seconds");
        assert!((0.0..=3600.0).contains(&left), "a one-hour certificate: {left}");
        let answer = http(addr, "GET", "/").expect("a 404");
        assert_eq!(answer.status, 404, "{answer:?}");
        let log = std::fs::read_to_string(state.join("agent.log")).unwrap();
        assert!(json_lines(&log, "agent") > 0, "the agent logged nothing");
    }
    let answer = http(replica, "POST", "/metrics").expect("a 405");
    assert_eq!(answer.status, 405, "{answer:?}");
}

/// A free loopback port (bound and released; nothing else in the test picks it meanwhile).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `innerwall` with `--log-format json` and the plane's database and CA, its stderr read line by
/// line on a thread; killed by PID when dropped.
struct JsonServe {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl JsonServe {
    fn start(plane: &Plane, args: &[&str]) -> JsonServe {
        let mut child = Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--log-format", "json", "--database-url", &plane.db.url, "--ca-dir"])
            .arg(plane.dir.join("ca"))
            .args(args)
            .env("INNERWALL_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning innerwall");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        JsonServe { child, lines }
    }

    /// Lines until one whose message contains `needle` (30 s at most); all of them.
    fn until(&self, needle: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(needle);
                    seen.push(line);
                    if found {
                        return seen;
                    }
                }
                Err(_) => panic!("innerwall never logged {needle:?}; it logged:\n{}", seen.join("\n")),
            }
        }
    }

    /// SIGTERM, the exit status, and every line logged until then.
    #[allow(unsafe_code)]
    fn stop(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = self.child.wait().expect("wait");
        (status, self.lines.iter().collect())
    }
}

impl Drop for JsonServe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `innerwall <args>` to its end: exit code and stderr.
fn innerwall(args: &[&str], state: &Path) -> (Option<i32>, String) {
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .output()
        .expect("running innerwall");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn serve_logs_json_lines_and_serves_metrics() {
    let plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let listen = metrics.to_string();
    let serve = JsonServe::start(&plane, &["serve", "--listen", "127.0.0.1:0", "--metrics-listen", &listen]);
    let mut lines = serve.until("metrics at http://");
    let answer = http(metrics, "GET", "/metrics").expect("scraping the serve binary");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.content_type, "text/plain; version=0.0.4; charset=utf-8");
    assert_eq!(sample(&answer.body, "innerwall_streams_open"), Some(0.0), "{}", answer.body);
    assert_eq!(sample(&answer.body, "innerwall_workloads_by_sync_state{state=\"SYNCED\"}"), Some(0.0));
    assert_eq!(http(metrics, "GET", "/other").expect("a 404").status, 404);

    // A second replica asking for the same metrics address is refused, in a JSON line that
    // names the address.
    let second = JsonServe::start(&plane, &["serve", "--listen", "127.0.0.1:0", "--metrics-listen", &listen]);
    let (status, refused) = second.stop_when_exited();
    assert_eq!(status.code(), Some(1), "{refused:?}");
    assert_eq!(json_lines(&refused.join("\n"), "second serve"), refused.len());
    let last: serde_json::Value = serde_json::from_str(refused.last().expect("an error line")).unwrap();
    assert_eq!(last["level"], "ERROR");
    let message = last["fields"]["message"].as_str().unwrap();
    assert!(message.starts_with(&format!("error: binding the metrics listener on {listen}")), "{message}");

    let (status, rest) = serve.stop();
    assert!(status.success(), "serve exits cleanly on SIGTERM: {status}");
    lines.extend(rest);
    assert_eq!(json_lines(&lines.join("\n"), "serve"), lines.len());
    let events: Vec<serde_json::Value> = lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(
        events.iter().any(|e| e["fields"]["message"].as_str().is_some_and(|m| m.contains("listening on"))),
        "the start-up notice is a JSON event too: {lines:?}"
    );
    assert!(events.iter().any(|e| e["level"] == "INFO" && e["target"] != "innerwall::notice"), "{lines:?}");

    // Bad values are named, with what would do.
    let state = plane.dir.join("cli");
    let (code, stderr) = innerwall(&["--log-format", "xml", "contract"], &state);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'xml' for '--log-format") && stderr.contains("json"), "{stderr}");
    let (code, stderr) = innerwall(&["serve", "--metrics-listen", "localhost"], &state);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'localhost' for '--metrics-listen <ADDR>'"), "{stderr}");
}

impl JsonServe {
    /// Waits (30 s at most) for a process expected to fail on its own; its status and lines.
    fn stop_when_exited(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "innerwall did not exit");
            std::thread::sleep(Duration::from_millis(50));
        };
        (status, self.lines.iter().collect())
    }
}

#[test]
fn agent_json_error_names_a_taken_metrics_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let state = std::env::temp_dir().join(format!("iw-agent-json-{}", uuid::Uuid::new_v4()));
    // Fails at the bind, before it touches the state directory, nftables or the kernel.
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
        .args(["--log-format", "json", "run", "--server", "127.0.0.1:1", "--metrics-listen", &addr])
        .arg("--state-dir")
        .arg(&state)
        .output()
        .expect("running innerwall-agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(json_lines(&stderr, "agent"), lines.len());
    let last: serde_json::Value = serde_json::from_str(lines.last().expect("an error line")).unwrap();
    assert_eq!(last["level"], "ERROR", "{stderr}");
    let message = last["fields"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("binding the metrics listener on {addr} (--metrics-listen)"))
            && message.contains("in use"),
        "{message}"
    );
    assert!(!state.exists(), "nothing was written before the bind");
    drop(taken);
}
