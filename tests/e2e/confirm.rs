//! Commit-confirmed promotion (issue 31, FLOW-11) on a real host: a real agent in a network
//! namespace, its nftables table and its eBPF capture, against a real control plane and Postgres.
//! A promotion confirmed on a fresh SAFE verdict before its deadline stays enforced past it; a
//! promotion nobody confirms is reverted by the agent itself at its deadline while every replica
//! is down (its table becomes the policy's simulation, its status says so, and what it drops no
//! more is recorded WOULD_BLOCK), and when the control plane returns, the record reads reverted
//! by the deadline, with the agent's own report.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::error::Error;
use innerwall_control_plane::gate::promote::{Guard, Promotion};
use innerwall_control_plane::gate::{self, Params, Scope};
use innerwall_control_plane::safety::confirm;
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::PgPool;

use crate::failsafe::{connects, counted, plane_across_the_veth};
use crate::host::{Agent, PEER_ADDRESS, now_ms, require_root, wait_until};

/// A port the host listens on that no rule admits: dropped under enforcement, admitted (and
/// recorded would-block) under simulation.
const PORT: u16 = 2222;

/// `innerwall-agent status --state-dir <state>`: what the host says of itself.
fn agent_status(state: &Path) -> String {
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
        .args(["status", "--state-dir"])
        .arg(state)
        .output()
        .expect("running innerwall-agent status");
    assert!(out.status.success(), "innerwall-agent status: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The owned table as nft lists it in this thread's namespace.
fn table() -> String {
    let out = Command::new("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    assert!(out.status.success(), "nft list: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A move of `id` to enforcement that reverts unless confirmed within `within`.
fn enforce(id: WorkloadId, within: Duration) -> gate::Request {
    gate::Request {
        scope: Scope::Ids(vec![id]),
        expect_count: 1,
        to: Mode::Enforcement,
        params: Params::ending_at(now_ms(), Duration::from_secs(3600), Duration::ZERO).unwrap(),
        reason: "try enforcing".into(),
        // The promotion's own evidence is not what this test is about.
        override_reason: Some("commit-confirmed test".into()),
        guard: Some(Guard { minutes: 0, ..Guard::default() }),
        confirm_within: Some(within),
    }
}

fn to_simulation(id: WorkloadId) -> gate::Request {
    gate::Request {
        to: Mode::Simulation,
        reason: "back to simulation".into(),
        override_reason: None,
        guard: None,
        confirm_within: None,
        ..enforce(id, Duration::ZERO)
    }
}

/// Records from the peer to [`PORT`] captured under `version`, by decision.
async fn decisions(pool: &PgPool, id: WorkloadId, version: i64) -> Vec<i16> {
    sqlx::query_scalar(
        "SELECT decision FROM flow_records WHERE workload_id = $1 AND src_address = $2::inet AND dst_port = $3
           AND policy_version = $4",
    )
    .bind(id.uuid())
    .bind(PEER_ADDRESS)
    .bind(i32::from(PORT))
    .bind(version)
    .fetch_all(pool)
    .await
    .expect("records")
}

async fn record(pool: &PgPool, id: uuid::Uuid) -> Promotion {
    gate::promote::show(&mut pool.acquire().await.unwrap(), id).await.unwrap()
}

async fn mode(pool: &PgPool, id: WorkloadId) -> i16 {
    sqlx::query_scalar("SELECT mode FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_promotion_reverts_on_the_host() {
    require_root();
    let (mut plane, ns, peer) = plane_across_the_veth("confirm").await;
    let pool = plane.pool().clone();
    let (id, config) = plane.enroll("confirm", &["app=vault"]).await;
    let state = config.state_dir.clone();
    let _listener = std::net::TcpListener::bind(("0.0.0.0", PORT)).expect("listen");
    let _agent = Agent::start(&state, &plane.server());
    let v0 = plane.status(id).await.2.expect("a policy");
    plane.wait_synced(id, v0).await;
    gate::promote(&pool, "alice", &to_simulation(id)).await.unwrap();
    let sim = plane.status(id).await.2.unwrap();
    plane.wait_synced(id, sim).await;

    // 1. Confirmed on a fresh SAFE verdict before its deadline: it stays enforced past it.
    let first = gate::promote(&pool, "alice", &enforce(id, Duration::from_secs(20))).await.unwrap();
    let deadline = first.confirmation.as_ref().expect("a confirm deadline").deadline;
    let v1 = plane.status(id).await.2.unwrap();
    plane.wait_synced(id, v1).await;
    let status = agent_status(&state);
    assert!(status.contains("reverts to simulation then unless confirmed"), "{status}");
    // The verdict needs evidence captured under the promoted version itself.
    wait_until("a window under the promoted version", &state, async || {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM flow_windows WHERE workload_id = $1 AND policy_version = $2)",
        )
        .bind(id.uuid())
        .bind(v1)
        .fetch_one(&pool)
        .await
        .unwrap()
        .then_some(())
    })
    .await;
    let confirmed = confirm::confirm(&pool, "bob", first.id, None).await.unwrap();
    let c = confirmed.confirmation.as_ref().unwrap();
    assert_eq!((c.state.as_str(), c.settled_by.as_deref()), ("confirmed", Some("bob")), "{c:?}");
    assert_eq!(c.verdict.as_ref().unwrap()["outcome"], "SAFE", "{c:?}");
    let v2 = plane.status(id).await.2.unwrap();
    assert!(v2 > v1, "the deadline leaves the policy: a new version");
    plane.wait_synced(id, v2).await;
    assert!(!agent_status(&state).contains("confirm deadline"), "the host holds no deadline any more");
    // The second time: there is nothing left to confirm.
    let again = confirm::confirm(&pool, "bob", first.id, None).await.unwrap_err();
    assert!(matches!(&again, Error::Invalid(m) if m.contains("confirmed by bob")), "{again}");
    // Past the old deadline (a sweep of our own, after it, finds nothing), still enforced.
    wait_until("the first deadline to pass", &state, async || (chrono::Utc::now() > deadline).then_some(()))
        .await;
    assert!(confirm::revert_expired(&pool).await.unwrap().is_empty());
    assert_eq!(mode(&pool, id).await, Mode::Enforcement.code());
    let dropped = counted("innerwall:drop");
    assert!(!connects(&peer, PEER_ADDRESS, PORT, Duration::from_secs(2)), "still enforced");
    assert!(counted("innerwall:drop") > dropped);

    // 2. Not confirmed. The drop above, under the promoted version, makes its verdict UNSAFE.
    gate::promote(&pool, "alice", &to_simulation(id)).await.unwrap();
    let second = gate::promote(&pool, "alice", &enforce(id, Duration::from_secs(15))).await.unwrap();
    let v3 = plane.status(id).await.2.unwrap();
    plane.wait_synced(id, v3).await;
    assert!(!connects(&peer, PEER_ADDRESS, PORT, Duration::from_secs(2)), "enforced until the deadline");
    let blocked = Decision::Blocked.code();
    wait_until("the drop's record", &state, async || {
        decisions(&pool, id, v3).await.contains(&blocked).then_some(())
    })
    .await;
    let unsafe_ = confirm::confirm(&pool, "bob", second.id, None).await.unwrap_err();
    assert!(matches!(&unsafe_, Error::EvidenceInsufficient { outcome: "UNSAFE", .. }), "{unsafe_}");

    // Every replica stops; at the deadline the host reverts by itself.
    plane.down().await;
    let listed = wait_until("the host to revert at the deadline", &state, async || {
        Some(table()).filter(|t| t.contains("innerwall:would-block"))
    })
    .await;
    assert!(!listed.contains("innerwall:drop"), "{listed}");
    let status = agent_status(&state);
    assert!(
        status.contains("PASSED unconfirmed") && status.contains("matches the applied policy"),
        "{status}"
    );
    assert!(connects(&peer, PEER_ADDRESS, PORT, Duration::from_secs(5)), "admitted once reverted");

    // The control plane returns: the record reads reverted by the deadline, with the agent's
    // report; the workload is in simulation at a new version; what the host admitted after the
    // deadline is recorded WOULD_BLOCK under the promoted version.
    peer.enter();
    plane.up().await;
    ns.enter();
    let reverted = wait_until("the record to read reverted, with the agent's report", &state, async || {
        let r = record(&pool, second.id).await;
        let c = r.confirmation.clone().unwrap();
        (c.state == "reverted" && c.workloads[0].agent_reverted_at.is_some()).then_some(c)
    })
    .await;
    assert_eq!(reverted.settled_by.as_deref(), Some(confirm::DEADLINE));
    assert_eq!(reverted.workloads[0].version, Some(v3));
    assert_eq!(mode(&pool, id).await, Mode::Simulation.code());
    let v4 = plane.status(id).await.2.unwrap();
    assert!(v4 > v3);
    plane.wait_synced(id, v4).await;
    let would_block = Decision::WouldBlock.code();
    wait_until("the would-block record under the reverted version", &state, async || {
        decisions(&pool, id, v3).await.contains(&would_block).then_some(())
    })
    .await;
    let late = confirm::confirm(&pool, "bob", second.id, None).await.unwrap_err();
    assert!(
        matches!(&late, Error::Invalid(m) if m.contains("reverted to simulation by its deadline")),
        "{late}"
    );
    let audited: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'promotion.revert'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(audited, 1);
    plane.down().await;
}
