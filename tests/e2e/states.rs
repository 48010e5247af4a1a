//! States judged when read (REL-3, issue 25), with no replica left: the real `innerwall serve`
//! and the real agent, both killed with SIGKILL, so nothing marks the workload OFFLINE and its
//! row says SYNCED for ever. The CLI reads it OFFLINE with the reason once its stream's liveness
//! has passed, the verdict refuses it, and a new `serve` and agent bring it back to SYNCED. The
//! agent and the replica share a network namespace of their own; the database is reached by
//! its socket.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;

use crate::host::{Agent, Namespace, require_root};
use crate::plane::Plane;
use crate::remote::innerwall;

/// `innerwall serve` on the plane's port, heartbeats every second (so a stream's liveness is
/// 3 s); SIGKILLed on drop.
struct Serve(Child);

impl Serve {
    fn start(plane: &Plane) -> Serve {
        let listen = format!("127.0.0.1:{}", plane.port);
        let mut child = Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--database-url", &plane.db.url, "--ca-dir"])
            .arg(plane.dir.join("ca"))
            .args(["serve", "--listen", &listen, "--server-name", "localhost", "--heartbeat-interval", "1s"])
            .stdout(Stdio::null())
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
                Ok(line) if line.contains("listening on") => return Serve(child),
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never said it was listening; it logged:\n{}", seen.join("\n")),
            }
        }
    }

    /// SIGKILL: the replica gets no chance to mark its streams OFFLINE.
    fn kill(mut self) {
        self.0.kill().expect("SIGKILL serve");
        self.0.wait().expect("reaping serve");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `innerwall --json <args>` against the plane's database, parsed.
fn cli(plane: &Plane, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--database-url", &plane.db.url, "--json"];
    all.extend_from_slice(args);
    let (code, out, err) = innerwall(&all, &[]);
    assert_eq!(code, Some(0), "innerwall {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("innerwall {args:?}: not JSON ({e}): {out}"))
}

/// `workload status ID --json`: the one row's state and detail.
fn status(plane: &Plane, id: WorkloadId) -> (String, String) {
    let rows = cli(plane, &["workload", "status", &id.to_string()]);
    let row = &rows[0];
    (
        row["state"].as_str().unwrap_or_default().to_owned(),
        row["detail"].as_str().unwrap_or_default().to_owned(),
    )
}

/// Polls the CLI until the workload reads `state` (a minute at most, with the agent's log).
async fn wait_for(plane: &Plane, id: WorkloadId, state: &str, log: &std::path::Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (now, detail) = status(plane, id);
        if now == state {
            return detail;
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(log.join("agent.log")).unwrap_or_default();
            panic!("the CLI never read {state} (last: {now}: {detail}); agent log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replica_means_offline_not_synced() {
    require_root();
    let plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let ns = Namespace::create(format!("iw-states-{}", std::process::id()));
    ns.enter();
    let serve = Serve::start(&plane);
    let (id, config) = plane.enroll("states", &["app=web"]).await;
    let state = config.state_dir.clone();
    let agent = Agent::start(&state, &plane.server());
    wait_for(&plane, id, "SYNCED", &state).await;

    // Both gone at once, by SIGKILL: the row stays SYNCED, and no replica is left to sweep.
    serve.kill();
    drop(agent);
    let detail = wait_for(&plane, id, "OFFLINE", &state).await;
    assert!(
        detail.starts_with("no heartbeat since ")
            && detail.contains("no replica has swept since ")
            && detail.contains("no heartbeat for three intervals (3 s)"),
        "{detail}"
    );
    let stored: i16 = sqlx::query_scalar("SELECT sync_state FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert_eq!(stored, 2, "the row still says SYNCED: only reading judged it");
    // Every other reader says the same.
    let list = cli(&plane, &["workload", "list"]);
    assert_eq!(list[0]["sync_state"], "OFFLINE", "{list}");
    let show = cli(&plane, &["workload", "show", &id.to_string()]);
    assert_eq!(show[0]["sync_state"], "OFFLINE", "{show}");
    let verdict = cli(&plane, &["workload", "verdict", "--id", &id.to_string()]);
    assert_ne!(verdict["outcome"], "SAFE", "{verdict}");
    let reasons = verdict["workloads"][0]["reasons"].as_array().expect("reasons").clone();
    assert!(reasons.contains(&serde_json::json!({"reason": "offline"})), "{verdict}");

    // A new replica and agent: SYNCED again, from the stream, not from a stale row.
    let _serve = Serve::start(&plane);
    let _agent = Agent::start(&state, &plane.server());
    let detail = wait_for(&plane, id, "SYNCED", &state).await;
    assert!(!detail.contains("no heartbeat since"), "{detail}");
}
