//! Rendered policy has a size bound (issue 26, item 3; REL-1): a change whose render would pass
//! the bound is refused naming the workload, the rule and the bound, and writes nothing; a policy
//! just under it reaches a real agent (the binary, in a network namespace, real nftables) and is
//! APPLIED; a render that may not refuse
//! (start-up) holds an over-bound workload at its last good version, DEGRADED with why, while the
//! rest of the estate renders; and an update the agent cannot read reads DEGRADED with why, not
//! OFFLINE in a reconnect loop.
//!
//! The bound is process-wide (every render of a process checks it, as `serve` and the local CLI
//! set it from their flags): these tests set it to [`BOUND`], far above any other test's policy.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::error::Error;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::publish;
use innerwall_control_plane::policy::render::Bound;
use innerwall_control_plane::policy::spec::{AddressGroupSpec, PeerSpec, RuleSpec, RulesetSpec, ServiceSpec};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Mode};
use sqlx::PgPool;

use crate::host::{Agent, Namespace, require_root};
use crate::plane::Plane;

/// Entries are what these tests push against; the byte bound stays out of the way (an IPv4 host
/// route is well under 16 bytes in canonical form).
const BOUND: Bound = Bound { entries: 3_000, bytes: 3_000 * 16 };

/// `n` IPv4 host routes from 10.`base`.0.0 on.
fn hosts(base: u8, n: usize) -> std::collections::BTreeSet<Cidr> {
    (0..n)
        .map(|i| {
            let addr = Ipv4Addr::new(10, base, (i / 256) as u8, (i % 256) as u8);
            Cidr::parse(&format!("{addr}/32")).unwrap()
        })
        .collect()
}

async fn create_service(pool: &PgPool) {
    let service = ServiceSpec {
        name: "https".into(),
        description: String::new(),
        entries: vec![ServiceEntry::parse("tcp:443").unwrap()],
    };
    innerwall_control_plane::foresight::commit(pool, "test", "service.create", "https", async |c| {
        authoring::create_service(c, &service).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
}

/// Address group `name` of `cidrs` and ruleset `name`, whose rule `wide` admits https from the
/// group to `scope`: one commit, as the CLI's `ruleset create` with its group.
async fn admit_group(
    pool: &PgPool,
    name: &str,
    scope: (&str, &str),
    cidrs: std::collections::BTreeSet<Cidr>,
) -> Result<(), Error> {
    let group = AddressGroupSpec { name: name.into(), description: String::new(), cidrs };
    let ruleset = RulesetSpec {
        name: name.into(),
        description: String::new(),
        enabled: true,
        scope: [(scope.0.to_owned(), vec![scope.1.to_owned()])].into(),
        rules: vec![RuleSpec {
            name: "wide".into(),
            description: String::new(),
            enabled: true,
            peers: vec![PeerSpec { address_group: Some(name.into()), ..Default::default() }],
            services: vec!["https".into()],
        }],
    };
    innerwall_control_plane::foresight::commit(pool, "test", "ruleset.create", name, async |c| {
        authoring::create_address_group(c, &group).await?;
        authoring::create_ruleset(c, &ruleset).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .map(|_| ())
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// `table inet innerwall` as nft lists it in this thread's namespace, if it exists.
fn table() -> Option<String> {
    let out = Command::new("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The stream epoch of `id`: one more for every stream that said Hello.
async fn epoch(pool: &PgPool, id: WorkloadId) -> i64 {
    sqlx::query_scalar("SELECT stream_epoch FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendered_policy_size_is_bounded() {
    require_root();
    publish::set_bound(BOUND);
    let mut plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let ns = Namespace::create(format!("iw-size-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    // Enforcement, so the table holds the rule's peers.
    plane.set_mode(id, Mode::Enforcement).await;
    let agent = Agent::start(&config.state_dir, &plane.server());
    let v1 = plane.status(id).await.2.unwrap();
    plane.wait_synced(id, v1).await;
    create_service(plane.pool()).await;

    // Just under the bound: 2,998 peers and one port range are 2,999 entries of 3,000. The real
    // agent installs it and acks APPLIED.
    admit_group(plane.pool(), "big", ("app", "web"), hosts(1, 2_998)).await.unwrap();
    let v2 = v1 + 1;
    plane.wait_synced(id, v2).await;
    let installed = table().expect("the agent's table");
    for peer in ["10.1.0.0", "10.1.11.181"] {
        assert!(installed.contains(peer), "{peer} installed: the whole policy");
    }

    // A second rule of two peers passes it (3,002 entries): refused, naming the workload, the
    // largest rule and the bound.
    let before = (
        count(plane.pool(), "SELECT count(*) FROM workload_policy_history").await,
        count(plane.pool(), "SELECT count(*) FROM audit_log").await,
        count(plane.pool(), "SELECT count(*) FROM address_groups").await,
    );
    for attempt in 0..2 {
        let refused = admit_group(plane.pool(), "more", ("app", "web"), hosts(2, 2)).await.unwrap_err();
        let text = refused.to_string();
        assert!(matches!(refused, Error::Invalid(_)), "a refusal of the input, not a failure: {text}");
        for part in [
            format!("workload {id}"),
            "3002 entries".to_owned(),
            "rule \"wide\" of ruleset \"big\"".to_owned(),
            "with 2999 entries".to_owned(),
            "3000 entries (--max-rendered-entries)".to_owned(),
            "nothing was changed".to_owned(),
        ] {
            assert!(text.contains(&part), "attempt {attempt}: {part:?} missing from {text}");
        }
        // Nothing written: no history row, no audit record, no group, the version unchanged.
        let after = (
            count(plane.pool(), "SELECT count(*) FROM workload_policy_history").await,
            count(plane.pool(), "SELECT count(*) FROM audit_log").await,
            count(plane.pool(), "SELECT count(*) FROM address_groups").await,
        );
        assert_eq!(after, before, "attempt {attempt}: the refused change wrote nothing");
        assert_eq!(plane.status(id).await.2, Some(v2));
    }
    assert_eq!(plane.status(id).await.0, "SYNCED", "the agent keeps the version it holds");

    // A start-up render cannot refuse: a change it finds over a bound lowered since (the change
    // made here behind the library's back, as by a replica with the higher bound; one more peer
    // each for web-1 and db-1) holds that workload at its last good version, DEGRADED with why,
    // and the rest of the estate renders.
    let db = plane.register("db-1", &["app=db"], "10.9.0.1").await;
    admit_group(plane.pool(), "small", ("app", "db"), hosts(3, 5)).await.unwrap();
    let db_version = plane.status(db).await.2.unwrap();
    for (group, addr) in [("big", "10.1.200.1"), ("small", "10.3.200.1")] {
        sqlx::query(
            "INSERT INTO address_group_cidrs (group_id, cidr)
             SELECT id, $2::cidr FROM address_groups WHERE name = $1",
        )
        .bind(group)
        .bind(addr)
        .execute(plane.pool())
        .await
        .unwrap();
    }
    publish::set_bound(Bound { entries: 2_500, ..BOUND });
    plane.down().await;
    plane.up().await;
    assert_eq!(plane.running.as_ref().unwrap().startup_changes, 1, "db-1 rendered; web-1 held");
    assert_eq!(plane.status(db).await.2, Some(db_version + 1));
    plane
        .wait(
            id,
            |s| {
                s.0 == "DEGRADED"
                    && s.1 == v2
                    && s.2 == Some(v2)
                    && s.3.contains("held at its last good version")
                    && s.3.contains("3000 entries and")
                    && s.3.contains("2500 entries (--max-rendered-entries)")
            },
            "DEGRADED at v2 with the hold's reason, the agent reconnected",
        )
        .await;
    assert!(table().is_some_and(|t| t.contains("10.1.11.181")), "the agent keeps the last good version");
    // The second time too: another restart holds it again, and starts.
    plane.down().await;
    plane.up().await;
    assert_eq!(plane.running.as_ref().unwrap().startup_changes, 0);
    assert_eq!(plane.status(id).await.2, Some(v2));

    // Raised again, the next render lets it through (3,000 entries) and the hold goes.
    publish::set_bound(BOUND);
    authoring::render_audited(plane.pool(), "test").await.unwrap();
    plane.wait_synced(id, v2 + 1).await;
    assert!(plane.status(id).await.3.is_empty(), "no detail once held no more");
    assert!(table().is_some_and(|t| t.contains("10.1.200.1")), "the peer added behind its back installed");
    agent.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_update_reads_degraded_not_offline() {
    require_root();
    publish::set_bound(BOUND);
    let gateway = GatewayConfig { heartbeat: Duration::from_secs(1), ..GatewayConfig::default() };
    let mut plane = Plane::create(Duration::from_secs(3600), gateway).await;
    let ns = Namespace::create(format!("iw-unread-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    // This agent reads at most 2 KiB a message (a lowered agent-side limit): a policy of 400
    // peers (several KiB) is over it, though well within the server's bound.
    let agent = Agent::start_with(&config.state_dir, &plane.server(), &["--max-policy-message", "2048"]);
    plane.wait_synced(id, 1).await;
    let first = epoch(plane.pool(), id).await;
    create_service(plane.pool()).await;
    admit_group(plane.pool(), "big", ("app", "web"), hosts(1, 400)).await.unwrap();
    plane
        .wait(
            id,
            |s| {
                s.0 == "DEGRADED"
                    && s.1 == 1
                    && s.3.contains("could not read policy version 2")
                    && s.3.contains("decodes at most 2048 bytes")
            },
            "DEGRADED with the agent's reason",
        )
        .await;
    // Not OFFLINE, not redialling: heartbeats go on over the same stream (the stored sighting
    // moves on by several intervals) and it still reads DEGRADED with that reason.
    let seen = || async {
        let at: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT last_seen_at FROM workloads WHERE id = $1")
                .bind(id.uuid())
                .fetch_one(plane.pool())
                .await
                .unwrap();
        at
    };
    let degraded_at = seen().await;
    for _ in 0..100 {
        if seen().await > degraded_at + chrono::Duration::seconds(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen().await > degraded_at + chrono::Duration::seconds(3), "heartbeats went on");
    let (state, applied, _, detail) = plane.status(id).await;
    assert_eq!((state.as_str(), applied), ("DEGRADED", 1), "{detail}");
    assert!(detail.contains("could not read policy version 2"), "{detail}");
    assert_eq!(epoch(plane.pool(), id).await, first, "one stream all along: no reconnect loop");

    // A version it can read ends that stream; the agent redials once and applies it.
    let expected = count(plane.pool(), "SELECT version FROM rulesets WHERE name = 'big'").await;
    innerwall_control_plane::foresight::commit(plane.pool(), "test", "ruleset.delete", "big", async |c| {
        authoring::delete_ruleset(c, "big", expected).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    plane.wait_synced(id, 3).await;
    assert_eq!(epoch(plane.pool(), id).await, first + 1, "one redial");
    agent.terminate();
}
