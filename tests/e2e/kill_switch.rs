//! The kill switch is a state (ENF-6, SYNC-6): after `innerwall-agent down` the real agent holds
//! every policy that reaches it — a resend's snapshot, a restarted agent's snapshot, a new
//! version — persisted but not installed, the control plane shows SUSPENDED instead of SYNCED,
//! and nothing is repaired as drift; `innerwall-agent up` installs the latest and the workload is
//! SYNCED again. And outside it (ENF-7): a real agent whose table is changed from outside
//! repairs it, and the control plane's audit log gets the tamper record from its heartbeat.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::PgPool;

use crate::host::{Agent, Namespace, require_root, wait_until};
use crate::plane::{Plane, fast_gateway};

/// `innerwall-agent <command> --state-dir <state>`, which must succeed; its stdout.
fn agent_cli(command: &str, state: &Path) -> String {
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
        .args([command, "--state-dir"])
        .arg(state)
        .output()
        .expect("running innerwall-agent");
    assert!(out.status.success(), "innerwall-agent {command}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `table inet innerwall` as nft lists it in this thread's namespace, if it exists.
fn table() -> Option<String> {
    let out = Command::new("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What the control plane stores about the stream: state name, applied version, and whether
/// the agent acked after `since` (a database timestamp).
async fn stream(pool: &PgPool, id: WorkloadId, since: chrono::DateTime<chrono::Utc>) -> (String, i64, bool) {
    let (state, applied, acked): (i16, i64, bool) = sqlx::query_as(
        "SELECT sync_state, applied_version, coalesce(last_acked_at > $2, false) FROM workloads WHERE id = $1",
    )
    .bind(id.uuid())
    .bind(since)
    .fetch_one(pool)
    .await
    .expect("workload row");
    (innerwall_wire::sync::SyncState::from_code(state).expect("state").name().to_owned(), applied, acked)
}

/// Modes as the database stores them (protobuf numbers).
const SIMULATION: i16 = 2;
const ENFORCEMENT: i16 = 3;

/// The modes of the stored windows of `version`.
async fn window_modes(pool: &PgPool, id: WorkloadId, version: i64) -> Vec<i16> {
    sqlx::query_scalar("SELECT mode FROM flow_windows WHERE workload_id = $1 AND policy_version = $2")
        .bind(id.uuid())
        .bind(version)
        .fetch_all(pool)
        .await
        .expect("windows")
}

async fn db_now(pool: &PgPool) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT now()").fetch_one(pool).await.expect("now")
}

async fn latest_version(plane: &Plane, id: WorkloadId) -> i64 {
    plane.status(id).await.2.expect("a persisted policy")
}

/// Waits until the agent acked something after `since` and the workload is SUSPENDED at
/// `version`.
async fn wait_held(
    pool: &PgPool,
    id: WorkloadId,
    state: &Path,
    since: chrono::DateTime<chrono::Utc>,
    version: i64,
) {
    wait_until(&format!("SUSPENDED with v{version} held after {since}"), state, async || {
        let (name, applied, acked) = stream(pool, id, since).await;
        (name == "SUSPENDED" && applied == version && acked).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switch_holds_across_reconnects_and_versions() {
    require_root();
    let mut plane = Plane::create(Duration::from_secs(3600), fast_gateway()).await;
    let ns = Namespace::create(format!("iw-kill-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    plane.bump(1).await;
    let (id, config) = plane.enroll("kill", &["app=web"]).await;
    // Enforcement, so the table holds the rules (visibility installs none) and drops.
    plane.set_mode(id, Mode::Enforcement).await;
    let (pool, state, server) = (plane.pool().clone(), config.state_dir.clone(), plane.server());
    let flags = ["--drift-interval-ms", "100"];
    let agent = Agent::start_with(&state, &server, &flags);
    let v1 = latest_version(&plane, id).await;
    plane.wait_synced(id, v1).await;
    assert!(table().is_some_and(|t| t.contains("8001")), "v{v1} installed");

    // Down: the running agent notices at its next drift check and says so at once.
    let out = agent_cli("down", &state);
    assert!(out.contains("removed table inet innerwall") && out.contains(&format!("v{v1}")), "{out}");
    plane.wait(id, |s| s.0 == "SUSPENDED" && s.1 == v1, "SUSPENDED").await;
    assert!(table().is_none(), "the table stays down");

    // A resend: a new stream whose snapshot is held, not installed.
    let since = db_now(&pool).await;
    authoring::request_snapshot(&pool, "test", id).await.expect("resend");
    wait_held(&pool, id, &state, since, v1).await;
    assert!(table().is_none(), "a resend does not undo the kill switch");

    // The agent restarts (a crash): the snapshot of its new stream is held too.
    drop(agent);
    let since = db_now(&pool).await;
    let agent = Agent::start_with(&state, &server, &flags);
    wait_held(&pool, id, &state, since, v1).await;
    assert!(table().is_none(), "a restart and reconnect do not undo the kill switch");

    // A new version is persisted and held.
    let since = db_now(&pool).await;
    plane.bump(2).await;
    let v2 = latest_version(&plane, id).await;
    assert!(v2 > v1);
    wait_held(&pool, id, &state, since, v2).await;
    assert!(table().is_none(), "a new version does not undo the kill switch");
    let status = agent_cli("status", &state);
    assert!(status.contains("kill switch:      engaged"), "{status}");
    // Nothing is enforced: the flows of those moments are judged as would-blocks, not blocks.
    wait_until("a window of v2 judged in simulation", &state, async || {
        (window_modes(&pool, id, v2).await.contains(&SIMULATION)).then_some(())
    })
    .await;

    // Up installs the latest version the agent held, and the workload is SYNCED at it.
    let out = agent_cli("up", &state);
    assert!(out.contains(&format!("installed the persisted policy v{v2}")), "{out}");
    assert!(table().is_some_and(|t| t.contains("8001") && t.contains("8002")), "v{v2} installed");
    plane.wait_synced(id, v2).await;
    wait_until("a window of v2 judged in enforcement", &state, async || {
        (window_modes(&pool, id, v2).await.contains(&ENFORCEMENT)).then_some(())
    })
    .await;
    // Nothing was ever reported as an outside change: the held table was never "repaired".
    let tampers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action = 'workload.tamper' AND subject = $1",
    )
    .bind(id.to_string())
    .fetch_one(&pool)
    .await
    .expect("audit");
    assert_eq!(tampers, 0);
    let log = std::fs::read_to_string(state.join("agent.log")).unwrap_or_default();
    assert!(log.contains("kill switch released"), "the running agent resumed:\n{log}");
    drop(agent);
}

/// The `workload.tamper` audit rows of `id`: actor, the reported detail, and the count.
async fn tamper_rows(pool: &PgPool, id: WorkloadId) -> Vec<(String, String, i64)> {
    sqlx::query_as(
        "SELECT actor, detail->>'detail', count FROM audit_log
         WHERE action = 'workload.tamper' AND subject = $1 ORDER BY id",
    )
    .bind(id.to_string())
    .fetch_all(pool)
    .await
    .expect("audit")
}

/// The handle of the `web` rule of the input chain (the rule allowing port 8001), as `nft -a`
/// lists it in this thread's namespace.
fn rule_handle(port: &str) -> String {
    let out = Command::new("nft")
        .args(["-a", "list", "chain", "inet", "innerwall", "input"])
        .output()
        .expect("running nft");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find(|l| l.contains(port) && l.contains("accept"))
        .and_then(|l| l.rsplit_once("# handle ").map(|(_, h)| h.trim().to_owned()))
        .unwrap_or_else(|| panic!("no rule for port {port} in\n{text}"))
}

/// ENF-7 end to end: the real agent repairs a rule deleted from its table by `nft` and its next
/// heartbeat puts the tamper record in the control plane's audit log, as the workload, with
/// what was found; a second, different change is repaired and audited too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_agent_drift_repair_reaches_the_audit_log() {
    require_root();
    let gateway = GatewayConfig { heartbeat: Duration::from_secs(1), ..GatewayConfig::default() };
    let mut plane = Plane::create(Duration::from_secs(3600), gateway).await;
    let ns = Namespace::create(format!("iw-drift-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    plane.bump(1).await;
    let (id, config) = plane.enroll("drift", &["app=web"]).await;
    plane.set_mode(id, Mode::Enforcement).await;
    let (pool, state) = (plane.pool().clone(), config.state_dir.clone());
    let _agent = Agent::start_with(&state, &plane.server(), &["--drift-interval-ms", "100"]);
    let v1 = latest_version(&plane, id).await;
    plane.wait_synced(id, v1).await;
    let pristine = table().expect("the table is installed");
    assert!(pristine.contains("8001"), "v{v1} installed:\n{pristine}");
    assert!(tamper_rows(&pool, id).await.is_empty(), "no tamper before any change");

    // An outside change: a rule of ours deleted.
    let handle = rule_handle("8001");
    let status = Command::new("nft")
        .args(["delete", "rule", "inet", "innerwall", "input", "handle", &handle])
        .status()
        .expect("running nft");
    assert!(status.success(), "deleting rule {handle}");
    let rows = wait_until("the tamper record in the audit log", &state, async || {
        let rows = tamper_rows(&pool, id).await;
        (!rows.is_empty()).then_some(rows)
    })
    .await;
    let (actor, detail, count) = &rows[0];
    assert_eq!(actor, &format!("workload:{id}"), "{rows:?}");
    assert!(detail.contains("rules differ"), "what was found: {rows:?}");
    assert!(*count >= 1, "{rows:?}");
    // Repaired: the rule is back (counters aside, the table is as installed).
    let strip = |t: &str| t.lines().filter(|l| !l.contains("counter")).collect::<Vec<_>>().join("\n");
    let repaired = table().expect("the table is there");
    assert!(repaired.contains("8001"), "the deleted rule is back:\n{repaired}");
    assert_eq!(strip(&repaired), strip(&pristine));

    // The second time: a whole table deleted is repaired and reported too.
    let before: i64 = tamper_rows(&pool, id).await.iter().map(|r| r.2).sum();
    let status =
        Command::new("nft").args(["delete", "table", "inet", "innerwall"]).status().expect("running nft");
    assert!(status.success(), "deleting the table");
    wait_until("a second tamper count in the audit log", &state, async || {
        let after: i64 = tamper_rows(&pool, id).await.iter().map(|r| r.2).sum();
        (after > before).then_some(())
    })
    .await;
    let repaired = table().expect("the table is restored");
    assert_eq!(strip(&repaired), strip(&pristine));
    plane.wait_synced(id, v1).await;
}
