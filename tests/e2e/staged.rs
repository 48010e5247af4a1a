//! Staged rules (issue 31, FLOW-10) on a real host: a real agent in a network namespace, its
//! nftables table and its eBPF capture, against a real control plane and Postgres. A ruleset
//! staged inside an enforced workload changes nothing the host enforces: the narrowing of an allow
//! rule still lets its traffic through, recorded allowed now and pending-blocked, each with its
//! rule; a staged new allow rule admits nothing yet (the default drop holds even though the
//! staged rule comes last), recorded blocked now and pending-allowed by that rule. Promoting the
//! staged ruleset is count-pinned and refused on that evidence without an override; with one, the
//! host enforces the staged rules.

use std::time::Duration;

use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::operations;
use innerwall_control_plane::policy::model::{ServiceEntry, new_rule_id};
use innerwall_control_plane::policy::spec::{self, ServiceSpec};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::safety::staged::{self, PromoteStaged};
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::PgPool;

use crate::failsafe::{connects, counted, plane_across_the_veth};
use crate::host::{Agent, PEER_ADDRESS, require_root, wait_until};

/// Admitted from the peer now; the staged narrowing no longer admits it.
const NARROWED: u16 = 5432;
/// Admitted by no rule now; the staged new rule admits it.
const ADDED: u16 = 2222;

fn ruleset(clients: &str, staged_rule: bool) -> spec::RulesetSpec {
    let mut text = format!(
        "name: vault\nscope: {{app: [vault]}}\nrules:\n  - name: clients\n    peers: [{{cidr: {clients}}}]\n    services: [pg]\n"
    );
    if staged_rule {
        text.push_str(&format!(
            "  - name: ssh\n    peers: [{{cidr: {PEER_ADDRESS}/32}}]\n    services: [alt-ssh]\n"
        ));
    }
    spec::parse_ruleset_file("test", &text).unwrap()
}

/// The records from the peer to `port` under a staged set: (decision, its rule, pending
/// decision, its rule).
async fn decided(pool: &PgPool, id: WorkloadId, port: u16) -> Vec<(i16, String, i16, String)> {
    sqlx::query_as(
        "SELECT r.decision, r.matched_rule_id, r.pending_decision, r.pending_rule_id
         FROM flow_records r JOIN flow_windows w ON w.workload_id = r.workload_id AND w.window_id = r.window_id
         WHERE r.workload_id = $1 AND r.src_address = $2::inet AND r.dst_port = $3 AND w.staged_set IS NOT NULL",
    )
    .bind(id.uuid())
    .bind(PEER_ADDRESS)
    .bind(i32::from(port))
    .fetch_all(pool)
    .await
    .expect("records")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_rule_reports_pending_without_acting() {
    require_root();
    let (mut plane, _ns, peer) = plane_across_the_veth("staged").await;
    let pool = plane.pool().clone();
    let counts = CountBounds::default();
    for (name, entry) in [("pg", "tcp:5432"), ("alt-ssh", "tcp:2222")] {
        let spec = ServiceSpec {
            name: name.into(),
            description: String::new(),
            entries: vec![ServiceEntry::parse(entry).unwrap()],
        };
        operations::create_service(&pool, "alice", &spec, &counts).await.unwrap();
    }
    operations::create_ruleset(&pool, "alice", &ruleset("10.81.0.0/24", false), &counts).await.unwrap();
    let (id, config) = plane.enroll("staged", &["app=vault"]).await;
    let state = config.state_dir.clone();
    let _listeners: Vec<std::net::TcpListener> = [NARROWED, ADDED]
        .iter()
        .map(|p| std::net::TcpListener::bind(("0.0.0.0", *p)).expect("listen"))
        .collect();
    let _agent = Agent::start(&state, &plane.server());
    plane.set_mode(id, Mode::Enforcement).await;
    let enforced = plane.status(id).await.2.expect("a policy");
    plane.wait_synced(id, enforced).await;
    assert!(connects(&peer, PEER_ADDRESS, NARROWED, Duration::from_secs(5)), "admitted by clients");
    assert!(!connects(&peer, PEER_ADDRESS, ADDED, Duration::from_secs(2)), "no rule admits it");

    // Staged: the narrowing of `clients` away from the peer, and a new rule `ssh` for it, last.
    let stage = staged::stage(&pool, "alice", &ruleset("203.0.113.0/24", true)).await.unwrap().value;
    let with_set = plane.status(id).await.2.unwrap();
    assert!(with_set > enforced, "the staged set is a new version");
    plane.wait_synced(id, with_set).await;
    let policy = store::persisted_policy(&mut pool.acquire().await.unwrap(), id).await.unwrap().unwrap().0;
    assert_eq!(policy.staged().map(|s| s.set().to_owned()), Some(format!("vault:{stage}")));
    let clients = format!("{}/tcp", new_rule_id("vault", "clients"));
    let ssh = format!("{}/tcp", new_rule_id("vault", "ssh"));

    // Nothing the host enforces changed: the narrowed traffic still passes, the new rule's is
    // still dropped (the default holds, the staged rule being last), and the staged rules count.
    let dropped = counted("innerwall:drop");
    let staged_ssh = counted(&format!("staged:{ssh}"));
    assert!(connects(&peer, PEER_ADDRESS, NARROWED, Duration::from_secs(5)), "a staged narrowing passes it");
    assert!(!connects(&peer, PEER_ADDRESS, ADDED, Duration::from_secs(2)), "a staged allow admits nothing");
    assert!(counted("innerwall:drop") > dropped, "dropped by the enforced default");
    assert!(counted(&format!("staged:{ssh}")) > staged_ssh, "counted by the staged rule, never accepted");

    // Both decisions are recorded, each with its rule.
    let (allowed, blocked) = (Decision::Allowed.code(), Decision::Blocked.code());
    let narrowed = wait_until("the narrowed flow's record", &state, async || {
        Some(decided(&pool, id, NARROWED).await).filter(|r| !r.is_empty())
    })
    .await;
    assert!(
        narrowed.iter().all(|r| *r == (allowed, clients.clone(), blocked, String::new())),
        "{narrowed:?}"
    );
    let added = wait_until("the new rule's record", &state, async || {
        Some(decided(&pool, id, ADDED).await).filter(|r| !r.is_empty())
    })
    .await;
    assert!(added.iter().all(|r| *r == (blocked, String::new(), allowed, ssh.clone())), "{added:?}");

    // Promoting: the count is pinned, and the evidence (a flow allowed now that the staged
    // rules block) refuses it without an override.
    let promote = |expect_count, override_reason: Option<&str>| PromoteStaged {
        name: "vault".into(),
        expect_count,
        min_evidence: Duration::ZERO,
        override_reason: override_reason.map(str::to_owned),
    };
    let err = staged::promote_staged(&pool, "bob", &promote(2, None)).await.unwrap_err();
    assert!(matches!(err, Error::CountMismatch { expected: 2, matched: 1, .. }), "{err}");
    let err = staged::promote_staged(&pool, "bob", &promote(1, None)).await.unwrap_err();
    assert!(
        matches!(&err, Error::EvidenceInsufficient { outcome: "UNSAFE", reasons } if reasons.contains(PEER_ADDRESS)),
        "{err}"
    );
    assert_eq!(plane.status(id).await.2, Some(with_set), "nothing was changed");

    // With an override, the host enforces the staged rules: the peer loses 5432 and gains 2222.
    let done =
        staged::promote_staged(&pool, "bob", &promote(1, Some("the narrowing is the point"))).await.unwrap();
    assert_eq!(done.value.workloads.len(), 1);
    let promoted = plane.status(id).await.2.unwrap();
    assert!(promoted > with_set);
    plane.wait_synced(id, promoted).await;
    assert!(!connects(&peer, PEER_ADDRESS, NARROWED, Duration::from_secs(2)), "narrowed away");
    assert!(connects(&peer, PEER_ADDRESS, ADDED, Duration::from_secs(5)), "admitted by ssh");
    let shown = store::persisted_policy(&mut pool.acquire().await.unwrap(), id).await.unwrap().unwrap().0;
    assert_eq!(shown.staged(), None, "no staged set is left");
    plane.down().await;
}
