//! The agent binary, stopped and started again, leaves AGENT_RESTART evidence gaps of exactly
//! the time it did not cover (FLOW-2): after a crash from the end of the last window it queued,
//! after a clean stop (which queues its open window) from the moment it stopped. The agent and
//! the replica's listener share a network namespace of their own (with a veth pair for the
//! capture to attach to), so the agent's nftables table and tc programs never touch the
//! machine's own namespace.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;

use crate::plane::Plane;

const AGENT_RESTART: i16 = 2;

struct Namespace(String);

impl Namespace {
    fn create(name: String) -> Namespace {
        let ns = Namespace(name);
        for args in [
            vec!["netns", "add", &ns.0],
            vec!["-n", &ns.0, "link", "set", "lo", "up"],
            vec!["-n", &ns.0, "link", "add", "iw0", "type", "veth", "peer", "name", "iw1"],
            vec!["-n", &ns.0, "address", "add", "10.81.0.1/24", "dev", "iw0"],
            vec!["-n", &ns.0, "link", "set", "iw0", "up"],
            vec!["-n", &ns.0, "link", "set", "iw1", "up"],
        ] {
            let status = Command::new("ip").args(&args).status().expect("running ip");
            assert!(status.success(), "ip {args:?} failed");
        }
        ns
    }

    /// Moves the calling thread (and so every process and socket it creates) into it.
    #[allow(unsafe_code)]
    fn enter(&self) {
        use std::os::fd::AsRawFd as _;
        let file = File::open(format!("/run/netns/{}", self.0)).expect("netns file");
        // SAFETY: setns(2) on a valid namespace fd; it moves only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A running `innerwall-agent run`; killed by PID on drop.
struct Agent(Child);

impl Agent {
    fn start(state: &Path, server: &str) -> Agent {
        let log = File::options().create(true).append(true).open(state.join("agent.log")).expect("agent log");
        let child = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
            .args(["run", "--state-dir"])
            .arg(state)
            .args(["--server", server])
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .expect("spawning innerwall-agent");
        Agent(child)
    }

    /// SIGTERM, then waits for the agent to exit on its own.
    #[allow(unsafe_code)]
    fn terminate(mut self) {
        let pid = libc::pid_t::try_from(self.0.id()).expect("pid");
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.0.try_wait().expect("wait") {
                assert!(status.success(), "the agent exited with {status} on SIGTERM");
                return;
            }
            assert!(Instant::now() < deadline, "the agent did not exit within 15 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as i64
}

#[allow(unsafe_code)]
fn require_root() {
    // SAFETY: geteuid(2) has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "this test runs the agent in a network namespace and needs root (CI runs as root)");
}

/// Windows stored for the workload: (start, end) in unix ms, ordered.
async fn windows(pool: &PgPool, id: WorkloadId) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT (extract(epoch FROM window_start) * 1000)::bigint, (extract(epoch FROM window_end) * 1000)::bigint
         FROM flow_windows WHERE workload_id = $1 ORDER BY window_start",
    )
    .bind(id.uuid())
    .fetch_all(pool)
    .await
    .expect("windows")
}

/// AGENT_RESTART gaps stored for the workload: (from, to) in unix ms, ordered.
async fn restart_gaps(pool: &PgPool, id: WorkloadId) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT (extract(epoch FROM gap_from) * 1000)::bigint, (extract(epoch FROM gap_to) * 1000)::bigint
         FROM flow_gaps WHERE workload_id = $1 AND kind = $2 ORDER BY gap_from",
    )
    .bind(id.uuid())
    .bind(AGENT_RESTART)
    .fetch_all(pool)
    .await
    .expect("gaps")
}

async fn wait_until<T>(what: &str, state: &Path, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = check().await {
            return found;
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(state.join("agent.log")).unwrap_or_default();
            panic!("timed out waiting for {what}; agent log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The gap is exactly the uncovered time: a stored window ends where it starts, one starts where
/// it ends, and none overlaps it.
async fn assert_abuts_windows(pool: &PgPool, id: WorkloadId, state: &Path, gap: (i64, i64)) {
    let (from, to) = gap;
    wait_until("windows on both sides of the gap", state, async || {
        let w = windows(pool, id).await;
        (w.iter().any(|&(_, end)| end == from) && w.iter().any(|&(start, _)| start == to)).then_some(())
    })
    .await;
    let w = windows(pool, id).await;
    assert!(
        w.iter().all(|&(start, end)| end <= from || start >= to),
        "a window overlaps the gap {gap:?}: {w:?}"
    );
}

#[tokio::test]
async fn agent_restart_becomes_gap() {
    require_root();
    let gateway = GatewayConfig { flow_window: Duration::from_secs(1), ..GatewayConfig::default() };
    // The database first, from the machine's namespace; then the listener in the test's.
    let mut plane = Plane::create(Duration::from_secs(3600), gateway).await;
    let ns = Namespace::create(format!("iw-restart-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    let (id, config) = plane.enroll("restart", &["app=db"]).await;
    let (pool, state, server) = (plane.pool().clone(), config.state_dir.clone(), plane.server());
    let agent = Agent::start(&state, &server);
    wait_until("two stored windows", &state, async || (windows(&pool, id).await.len() >= 2).then_some(()))
        .await;
    // A crash: the open window is lost; the gap runs from the end of the last queued one.
    let killed_at = now_ms();
    drop(agent);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let restarted_at = now_ms();
    let agent = Agent::start(&state, &server);
    let crash = wait_until("a restart gap after the crash", &state, async || {
        restart_gaps(&pool, id).await.first().copied()
    })
    .await;
    assert!(crash.0 <= killed_at && killed_at - crash.0 <= 2_500, "gap {crash:?}, killed at {killed_at}");
    assert!(
        crash.1 >= restarted_at && crash.1 - restarted_at <= 5_000,
        "gap {crash:?}, restarted at {restarted_at}"
    );
    assert_abuts_windows(&pool, id, &state, crash).await;
    // A clean stop queues the open window first: the gap is the downtime alone.
    let stopped_at = now_ms();
    agent.terminate();
    let exited_at = now_ms();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let restarted_at = now_ms();
    let _agent = Agent::start(&state, &server);
    let clean = wait_until("a restart gap after the clean stop", &state, async || {
        restart_gaps(&pool, id).await.get(1).copied()
    })
    .await;
    assert!(
        (stopped_at..=exited_at).contains(&clean.0),
        "gap {clean:?}: it should start when the agent stopped ({stopped_at}..={exited_at})"
    );
    assert!(
        clean.1 >= restarted_at && clean.1 - restarted_at <= 5_000,
        "gap {clean:?}, restarted at {restarted_at}"
    );
    assert_abuts_windows(&pool, id, &state, clean).await;
    assert_eq!(restart_gaps(&pool, id).await.len(), 2, "one gap per restart");
}
