//! The auto-demotion guard (issue 31) end to end: agents running the real sync loop, their
//! windows built by the agent's own window code under the policy each installed and delivered
//! through the real telemetry connection. A relabel blocks a peer the evidence range showed
//! allowed: its blocked connections, past the threshold, demote the workload to simulation,
//! recorded with the flows. A source never seen in the range does not, unless the promotion
//! asked for it.

use innerwall_control_plane::gate::promote::Guard;
use innerwall_control_plane::gate::{self, Outcome, Scope};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use serde_json::Value;

use crate::gate::{BATCH, Host, SECOND, WEB, allow_db_from, db, now_ms, params, set_mode, synced};
use crate::plane::Plane;

/// Never admitted by any rule, never seen in the evidence.
const STRANGER: &str = "10.9.0.99";

async fn mode(plane: &Plane, id: WorkloadId) -> i16 {
    sqlx::query_scalar("SELECT mode FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap()
}

/// The guard's row: tripped, and the flows that tripped it.
async fn guard(plane: &Plane, id: WorkloadId) -> (bool, Value) {
    sqlx::query_as("SELECT tripped_at IS NOT NULL, coalesce(evidence, 'null') FROM enforcement_guards WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap()
}

/// One window from `peer` to tcp/5432 on `host`, after the last one it delivered (2 new
/// connections: the agent's window code decides them under the installed policy).
async fn attempt(host: &Host, at: &mut i64, peer: &str) {
    host.deliver(*at, *at + SECOND, &[peer], &[]).await;
    *at += SECOND;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_demotion_on_previously_allowed_traffic() {
    let plane = Plane::start().await;
    plane.register("web-1", &["app=web"], WEB).await;
    let batch = plane.register("batch-1", &["app=batch"], BATCH).await;
    allow_db_from(&plane, "web").await;
    allow_db_from(&plane, "batch").await;
    let (a, b) = (Host::start(&plane, "db-1").await, Host::start(&plane, "db-2").await);
    set_mode(&plane, db(), 2, Mode::Simulation).await;
    synced(&plane, &[&a, &b]).await;
    let base = now_ms() - 60 * SECOND;
    for host in [&a, &b] {
        host.deliver(base, base + 10 * SECOND, &[WEB, BATCH], &[]).await;
    }
    let range = params(base, base + 10 * SECOND);
    assert_eq!(gate::judge(plane.pool(), &db(), &range).await.unwrap().outcome, Outcome::Safe);
    let enforce = |host: &Host, unseen: bool| gate::Request {
        scope: Scope::Ids(vec![host.id]),
        expect_count: 1,
        to: Mode::Enforcement,
        params: range,
        reason: "evidence is clean".into(),
        override_reason: None,
        guard: Some(Guard { minutes: 30, threshold: 3, unseen }),
        confirm_within: None,
    };
    gate::promote(plane.pool(), "alice", &enforce(&a, false)).await.unwrap();
    gate::promote(plane.pool(), "alice", &enforce(&b, true)).await.unwrap();
    synced(&plane, &[&a, &b]).await;
    let mut at = now_ms();

    // A stranger is blocked, past the threshold: db-1 (seen sources only) stays enforced; db-2
    // (unseen sources too) goes back to simulation. Each upload is judged before it is answered.
    for _ in 0..2 {
        attempt(&a, &mut at, STRANGER).await;
        attempt(&b, &mut at, STRANGER).await;
    }
    assert_eq!(mode(&plane, a.id).await, 3, "a source never seen does not demote by default");
    assert!(!guard(&plane, a.id).await.0, "db-1's guard did not trip");
    assert_eq!(mode(&plane, b.id).await, 2, "--guard-unseen: it does");
    let (tripped, flows) = guard(&plane, b.id).await;
    assert!(tripped, "{flows}");
    assert_eq!(flows[0]["src_address"], STRANGER, "{flows}");
    assert_eq!(flows[0]["allowed_before"], false, "{flows}");

    // The relabel blocks batch, which the evidence showed allowed: one window (2 connections)
    // is under the threshold, the second demotes db-1.
    plane.relabel(batch, 1, "app=other").await;
    synced(&plane, &[&a]).await;
    attempt(&a, &mut at, BATCH).await;
    assert_eq!(mode(&plane, a.id).await, 3, "under the threshold: one packet is not a trend");
    attempt(&a, &mut at, BATCH).await;
    assert_eq!(mode(&plane, a.id).await, 2, "demoted");
    let (tripped, flows) = guard(&plane, a.id).await;
    assert!(tripped);
    let batch_flows: Vec<&Value> =
        flows.as_array().unwrap().iter().filter(|f| f["src_address"] == BATCH).collect();
    assert_eq!(batch_flows.len(), 1, "{flows}");
    assert_eq!(batch_flows[0]["allowed_before"], true, "{flows}");
    assert!(batch_flows[0]["blocked_connections"].as_i64().unwrap() >= 3, "{flows}");
    // Recorded: a promotion record by the guard, an audit record with the flows; and the agent
    // gets its simulation version.
    let (actor, reason): (String, String) = sqlx::query_as(
        "SELECT actor, reason FROM promotions WHERE to_mode = 2 AND actor = 'guard' AND scope LIKE $1",
    )
    .bind(format!("%{}%", a.id))
    .fetch_one(plane.pool())
    .await
    .unwrap();
    assert_eq!(actor, "guard");
    assert!(reason.contains("auto-demotion") && reason.contains(BATCH), "{reason}");
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'workload.auto-demote'")
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert_eq!(audited, 2);
    synced(&plane, &[&a]).await;
    assert_eq!(a.enforcer_current().mode(), Mode::Simulation);
}
