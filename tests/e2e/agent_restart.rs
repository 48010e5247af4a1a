//! The agent binary, stopped and started again, leaves AGENT_RESTART evidence gaps of exactly
//! the time it did not cover (FLOW-2): after a crash from the end of the last window it queued,
//! after a clean stop (which queues its open window) from the moment it stopped. The agent and
//! the replica's listener share a network namespace of their own (with a veth pair for the
//! capture to attach to), so the agent's nftables table and tc programs never touch the
//! machine's own namespace.

use std::path::Path;
use std::time::Duration;

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;

use crate::host::{Agent, Namespace, now_ms, require_root, wait_until};
use crate::plane::Plane;

const AGENT_RESTART: i16 = 2;

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
    // A crash: the open window is lost; the gap runs from the end of the last queued one,
    // which is no earlier than the last window stored before the kill.
    let stored_end = windows(&pool, id).await.iter().map(|&(_, end)| end).max().unwrap();
    let killed_at = now_ms();
    drop(agent);
    // Down until the control plane has seen it go (an event, not a pause).
    plane.wait(id, |s| s.0 == "OFFLINE", "OFFLINE after the crash").await;
    let restarted_at = now_ms();
    let agent = Agent::start(&state, &server);
    let crash = wait_until("a restart gap after the crash", &state, async || {
        restart_gaps(&pool, id).await.first().copied()
    })
    .await;
    let seen_at = now_ms();
    // Ordered by events: the gap starts between the last stored window's end and the kill, and
    // ends between the restart and the moment the test read it; windows abut it on both sides.
    assert!(
        (stored_end..=killed_at).contains(&crash.0),
        "gap {crash:?}: stored to {stored_end}, killed at {killed_at}"
    );
    assert!(
        (restarted_at..=seen_at).contains(&crash.1),
        "gap {crash:?}: restarted at {restarted_at}, seen at {seen_at}"
    );
    assert_abuts_windows(&pool, id, &state, crash).await;
    // A clean stop queues the open window first: the gap is the downtime alone.
    let stopped_at = now_ms();
    agent.terminate();
    let exited_at = now_ms();
    plane.wait(id, |s| s.0 == "OFFLINE", "OFFLINE after the clean stop").await;
    let restarted_at = now_ms();
    let _agent = Agent::start(&state, &server);
    let clean = wait_until("a restart gap after the clean stop", &state, async || {
        restart_gaps(&pool, id).await.get(1).copied()
    })
    .await;
    let seen_at = now_ms();
    assert!(
        (stopped_at..=exited_at).contains(&clean.0),
        "gap {clean:?}: it should start when the agent stopped ({stopped_at}..={exited_at})"
    );
    assert!(
        (restarted_at..=seen_at).contains(&clean.1),
        "gap {clean:?}: restarted at {restarted_at}, seen at {seen_at}"
    );
    assert_abuts_windows(&pool, id, &state, clean).await;
    assert_eq!(restart_gaps(&pool, id).await.len(), 2, "one gap per restart");
}
