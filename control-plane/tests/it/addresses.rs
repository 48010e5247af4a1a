//! Address trust against real Postgres, real mTLS and the real CLI (issue 11): a reported
//! address reaches other workloads' peer sets only inside the estate ranges, inside the
//! enrolling token's ranges, and when no other live workload claims it; every refusal is stored
//! and shown with its reason; inventory re-addressing renders at most once per interval.

use std::time::Duration;

use innerwall_control_plane::identity::tokens;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;
use innerwall_wire::proto::{self, sync_request};
use sqlx::PgPool;

use crate::enrollment::Plane;
use crate::eventually;
use crate::sync::Scripted;

/// `app=db` admits `app=web` on tcp/5432.
pub async fn db_admits_web(pool: &PgPool) {
    innerwall_control_plane::testing::admit(pool, "db", ("app", "db"), ("app", "web"), "tcp:5432")
        .await
        .unwrap();
}

/// The peers of `id`'s persisted policy, and its version.
/// The distinct peers of `id`'s persisted policy, sorted, and its version.
pub async fn peers(pool: &PgPool, id: WorkloadId) -> (Vec<String>, u64) {
    let (policy, _) = store::persisted_policy(&mut pool.acquire().await.unwrap(), id).await.unwrap().unwrap();
    let mut peers: Vec<String> =
        policy.rules().flat_map(|r| r.peers().iter().map(ToString::to_string)).collect();
    peers.sort();
    peers.dedup();
    (peers, policy.version())
}

async fn mint_narrowed(plane: &Plane, label: &str, ranges: &[&str]) -> String {
    let ranges: Vec<Cidr> = ranges.iter().map(|r| Cidr::parse(r).unwrap()).collect();
    let mut conn = plane.db.pool.acquire().await.unwrap();
    tokens::mint(&mut conn, &[label.parse().unwrap()], chrono::Duration::days(1), None, &ranges)
        .await
        .unwrap()
        .secret
}

/// Runs the `innerwall` CLI against the plane's database; returns stdout, or panics with stderr.
fn cli(plane: &Plane, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .args(["--database-url", &plane.db.url])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// An address that is not rendered: (address, standing, also claimed by).
type Issue = (String, String, Vec<String>);

/// `innerwall workload status --json`: each workload's unrendered addresses, by workload id.
fn issues(plane: &Plane) -> std::collections::BTreeMap<String, Vec<Issue>> {
    let status: serde_json::Value =
        serde_json::from_str(&cli(plane, &["--json", "workload", "status"])).unwrap();
    status
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let list = w["address_issues"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| {
                    assert!(a["reason"].as_str().is_some_and(|r| !r.is_empty()), "{a}");
                    let also = a.get("also_claimed_by").map_or(vec![], |v| {
                        v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect()
                    });
                    (
                        a["address"].as_str().unwrap().to_owned(),
                        a["standing"].as_str().unwrap().to_owned(),
                        also,
                    )
                })
                .collect();
            (w["id"].as_str().unwrap().to_owned(), list)
        })
        .collect()
}

fn issues_of(all: &std::collections::BTreeMap<String, Vec<Issue>>, id: WorkloadId) -> Vec<Issue> {
    all.get(&id.to_string()).cloned().unwrap_or_default()
}

fn issue(address: &str, standing: &str, also: &[WorkloadId]) -> Issue {
    (address.into(), standing.into(), also.iter().map(ToString::to_string).collect())
}

/// An inventory report of one interface with `addresses`; `None`: without facts (the agent
/// could not list its interfaces).
pub fn inventory(addresses: Option<&[&str]>) -> proto::SyncRequest {
    let facts = addresses.map(|a| proto::HostFacts {
        interfaces: vec![proto::NetworkInterface {
            name: "eth0".into(),
            addresses: a.iter().map(|s| s.to_string()).collect(),
            mac_address: String::new(),
        }],
        ..Default::default()
    });
    proto::SyncRequest {
        msg: Some(sync_request::Msg::Inventory(proto::InventoryReport { facts, listening_services: vec![] })),
    }
}

/// Addresses outside the estate ranges, outside the enrolling token's ranges, or claimed by two
/// live workloads never reach another workload's peer set, whether reported at enrollment or in
/// inventory; each is shown with its reason and audited; retiring one claimant and adding an
/// estate range are how an operator resolves them.
// Several threads: the test blocks in CLI calls while the replica it started runs its tasks
// (on one thread, a task in the middle of a transaction would hold its locks until the call ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_addresses_never_reach_peer_sets() {
    let plane =
        Plane::start(GatewayConfig { inventory_min_interval: Duration::ZERO, ..Default::default() }).await;
    let pool = &plane.db.pool;
    db_admits_web(pool).await;
    let db_token = plane.mint(&["app=db"], None).await;
    let (db, _, _) = plane.enroll_reporting(&db_token, &["10.1.0.4/24"]).await.unwrap();
    let web_token = plane.mint(&["app=web"], None).await;
    // A public resolver and a documentation address: outside every default estate range.
    let (web1, _, _) =
        plane.enroll_reporting(&web_token, &["10.1.0.9/24", "8.8.8.8/32", "203.0.113.66/24"]).await.unwrap();
    // Its token allows 10.2.0.0/16 only.
    let narrow_token = mint_narrowed(&plane, "app=web", &["10.2.0.0/16"]).await;
    let (web2, cert2, key2) =
        plane.enroll_reporting(&narrow_token, &["10.2.0.9/16", "10.1.0.77/24"]).await.unwrap();
    // A second host claiming web1's address.
    let (web3, _, _) = plane.enroll_reporting(&web_token, &["10.1.0.9/24"]).await.unwrap();
    // A host reporting db's address, outside its token's ranges, and web1's public one: neither
    // claim holds the address, so neither takes it from anyone (its enrollment judges it alone).
    let (web4, _, _) = plane.enroll_reporting(&narrow_token, &["10.1.0.4/24", "8.8.8.8/32"]).await.unwrap();

    assert_eq!(peers(pool, db).await.0, ["10.2.0.9/32"], "only the one trustworthy address is a peer");
    let all = issues(&plane);
    assert_eq!(
        issues_of(&all, web1),
        [
            issue("8.8.8.8", "outside-estate-ranges", &[]),
            issue("10.1.0.9", "conflict", &[web3]),
            issue("203.0.113.66", "outside-estate-ranges", &[]),
        ]
    );
    assert_eq!(issues_of(&all, web2), [issue("10.1.0.77", "outside-token-ranges", &[])]);
    assert_eq!(issues_of(&all, web3), [issue("10.1.0.9", "conflict", &[web1])]);
    assert_eq!(issues_of(&all, db), []);
    assert_eq!(
        issues_of(&all, web4),
        [issue("8.8.8.8", "outside-estate-ranges", &[]), issue("10.1.0.4", "outside-token-ranges", &[])]
    );
    // `workload show` prints each address with its standing and reason.
    let shown = cli(&plane, &["workload", "show", &web2.to_string()]);
    assert!(shown.contains("10.1.0.77") && shown.contains("outside-token-ranges"), "{shown}");
    assert!(shown.contains("not in the address ranges of the token"), "{shown}");
    // The conflict is audited on both claimants, naming the other.
    let audited: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT subject, detail FROM audit_log WHERE action = 'workload.address-standing' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let conflict_of = |w: WorkloadId, other: WorkloadId| {
        audited.iter().any(|(s, d)| {
            *s == w.to_string()
                && d["addresses"].as_array().unwrap().iter().any(|a| {
                    a["address"] == "10.1.0.9"
                        && a["standing"] == "conflict"
                        && a["also_claimed_by"][0] == other.to_string()
                })
        })
    };
    assert!(conflict_of(web1, web3) && conflict_of(web3, web1), "{audited:?}");

    // Inventory is judged the same way: web2 reports a public address and a new one of its range.
    let mut agent = Scripted::open(plane.mutual(&cert2, &key2).await.unwrap(), 0).await;
    agent.update().await;
    agent.tx.send(inventory(Some(&["10.2.0.9/16", "10.2.0.10/16", "8.8.4.4/32"]))).await.unwrap();
    eventually("web2's new address is a peer of db", async || {
        peers(pool, db).await.0.contains(&"10.2.0.10/32".into())
    })
    .await;
    assert_eq!(peers(pool, db).await.0, ["10.2.0.10/32", "10.2.0.9/32"]);
    assert_eq!(issues_of(&issues(&plane), web2), [issue("8.8.4.4", "outside-estate-ranges", &[])]);

    // Resolution: retiring the impostor gives web1 its address back.
    innerwall_control_plane::foresight::commit(
        pool,
        "test",
        "workload.retire",
        &web3.to_string(),
        async |c| {
            authoring::retire(c, web3).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    assert_eq!(peers(pool, db).await.0, ["10.1.0.9/32", "10.2.0.10/32", "10.2.0.9/32"]);
    let all = issues(&plane);
    assert_eq!(
        issues_of(&all, web1),
        [issue("8.8.8.8", "outside-estate-ranges", &[]), issue("203.0.113.66", "outside-estate-ranges", &[])]
    );
    // An operator's explicit range makes a public address a workload address; removing it
    // takes it out again.
    cli(&plane, &["estate-range", "add", "203.0.113.0/24", "--description", "dmz"]);
    assert!(peers(pool, db).await.0.contains(&"203.0.113.66/32".into()));
    assert!(cli(&plane, &["estate-range", "list"]).contains("203.0.113.0/24"));
    cli(&plane, &["estate-range", "remove", "203.0.113.0/24"]);
    assert_eq!(peers(pool, db).await.0, ["10.1.0.9/32", "10.2.0.10/32", "10.2.0.9/32"]);
    // A release drops one claim: web1 forgets 10.1.0.9 until it reports it again.
    cli(&plane, &["workload", "release-address", &web1.to_string(), "10.1.0.9"]);
    assert_eq!(peers(pool, db).await.0, ["10.2.0.10/32", "10.2.0.9/32"]);
}

/// 300 inventory reports in a burst from one agent render at most twice (the first at once,
/// the rest coalesced into the latest), and reconnecting does not reset the interval.
#[tokio::test]
async fn inventory_storm_is_coalesced() {
    let interval = Duration::from_secs(2);
    let plane = Plane::start(GatewayConfig { inventory_min_interval: interval, ..Default::default() }).await;
    let pool = &plane.db.pool;
    db_admits_web(pool).await;
    let db_token = plane.mint(&["app=db"], None).await;
    let (db, _, _) = plane.enroll_reporting(&db_token, &["10.1.0.4/24"]).await.unwrap();
    let web_token = plane.mint(&["app=web"], None).await;
    let (web, cert, key) = plane.enroll(&web_token).await.unwrap();
    let (_, before) = peers(pool, db).await;
    let inventories = async || -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM audit_log WHERE action = 'workload.inventory' AND subject = $1",
        )
        .bind(web.to_string())
        .fetch_one(pool)
        .await
        .unwrap()
    };

    let mut agent = Scripted::open(plane.mutual(&cert, &key).await.unwrap(), 0).await;
    agent.update().await;
    for i in 0..299 {
        agent.tx.send(inventory(Some(&[&format!("10.1.1.{}/24", i % 250 + 1)]))).await.unwrap();
    }
    agent.tx.send(inventory(Some(&["10.1.2.1/24"]))).await.unwrap();
    eventually("the last report is applied", async || peers(pool, db).await.0 == ["10.1.2.1/32"]).await;
    let (_, after) = peers(pool, db).await;
    assert!(after - before <= 2, "300 reports moved db from v{before} to v{after}");
    assert!(inventories().await <= 2, "{} inventory renders", inventories().await);

    // A new stream of the same identity (the storm reconnecting) is held to the same interval.
    drop(agent);
    let mut again = Scripted::open(plane.mutual(&cert, &key).await.unwrap(), 0).await;
    again.update().await;
    for i in 0..99 {
        again.tx.send(inventory(Some(&[&format!("10.1.3.{}/24", i + 1)]))).await.unwrap();
    }
    again.tx.send(inventory(Some(&["10.1.2.2/24"]))).await.unwrap();
    eventually("the reconnected agent's last report is applied", async || {
        peers(pool, db).await.0 == ["10.1.2.2/32"]
    })
    .await;
    let (_, last) = peers(pool, db).await;
    assert!(last - before <= 4, "400 reports over two streams moved db from v{before} to v{last}");
    assert!(inventories().await <= 4, "{} inventory renders", inventories().await);
    let changes: Vec<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT at FROM audit_log WHERE action = 'workload.inventory' AND subject = $1 ORDER BY id",
    )
    .bind(web.to_string())
    .fetch_all(pool)
    .await
    .unwrap();
    // Each inventory render's transaction (its audit time, the database's `now()`, which is
    // also the `addresses_changed_at` it wrote) begins only after the check that found the
    // previous change at least the interval old: no render comes sooner, with no slack.
    assert!(changes.len() >= 2, "{changes:?}");
    for pair in changes.windows(2) {
        let gap = (pair[1] - pair[0]).to_std().unwrap();
        assert!(gap >= interval, "two renders {gap:?} apart: {changes:?}");
    }
}

/// The estate's ranges are bounded: at the bound another one is refused, naming it, and
/// nothing is written.
#[tokio::test]
async fn estate_ranges_are_bounded() {
    use innerwall_control_plane::policy::spec::MAX_ESTATE_RANGES;

    let db = innerwall_control_plane::testing::fresh_database().await.unwrap();
    let count = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM estate_ranges").fetch_one(&db.pool).await.unwrap()
    };
    let seeded = count().await;
    // Fill up to the bound directly (each range a /32 in 100.64.0.0/10).
    sqlx::query(
        "INSERT INTO estate_ranges (cidr) SELECT ('100.64.0.0'::inet + n)::cidr FROM generate_series(1, $1) AS n",
    )
    .bind(MAX_ESTATE_RANGES as i64 - seeded)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(count().await, MAX_ESTATE_RANGES as i64);
    let err = innerwall_control_plane::foresight::commit(
        &db.pool,
        "test",
        "estate-range.add",
        "198.51.100.0/24",
        async |c| {
            authoring::add_estate_range(c, Cidr::parse("198.51.100.0/24")?, "").await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("estate ranges: 1025 is more than the 1024 allowed"), "{err}");
    assert_eq!(count().await, MAX_ESTATE_RANGES as i64, "nothing written");
}
