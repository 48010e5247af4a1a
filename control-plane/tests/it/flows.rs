//! Flow storage against real Postgres: daily partitions and retention by dropping them (FLOW-5).

use std::collections::BTreeSet;

use innerwall_control_plane::flows;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;

#[tokio::test]
async fn retention_drops_whole_expired_partitions() {
    let db = fresh_database().await.unwrap();
    let id = WorkloadId::new_random();
    let new = NewWorkload {
        id,
        hostname: "db".into(),
        labels: vec!["app=db".parse().unwrap()],
        addresses: BTreeSet::new(),
    };
    authoring::commit(&db.pool, "test", "register", "db", async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let now = chrono::Utc::now();
    let wire = proto::FlowWindow {
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: now.timestamp_millis() - 60_000,
        end_unix_ms: now.timestamp_millis(),
        policy_version: 1,
        mode: 1,
        records: vec![proto::FlowRecord {
            src_address: "192.0.2.7".into(),
            dst_address: "10.0.0.1".into(),
            dst_port: 22,
            protocol: 1,
            decision: 1,
            matched_rule_id: String::new(),
            packets: 1,
            bytes: 60,
            new_connections: 1,
            first_seen_unix_ms: now.timestamp_millis() - 1_000,
            last_seen_unix_ms: now.timestamp_millis(),
        }],
        gaps: vec![proto::EvidenceGap {
            kind: 2,
            from_unix_ms: 0,
            to_unix_ms: 1,
            count: 0,
            detail: String::new(),
        }],
    };
    flows::ingest(&db.pool, id, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
    let partitions = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relkind = 'r' ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let day = (now - chrono::Duration::seconds(60)).format("%Y%m%d").to_string();
    let expected = ["flow_gaps", "flow_records"].map(|t| format!("{t}_{day}"));
    assert_eq!(partitions().await, expected);

    // Within retention nothing goes; 31 days later the whole day's partitions are dropped.
    assert_eq!(flows::apply_retention(&db.pool, 30, now).await.unwrap(), Vec::<String>::new());
    let dropped = flows::apply_retention(&db.pool, 30, now + chrono::Duration::days(32)).await.unwrap();
    assert_eq!(dropped, expected);
    assert!(partitions().await.is_empty());
    let windows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_windows").fetch_one(&db.pool).await.unwrap();
    assert_eq!(windows, 0);
}

/// Hundreds of expired partitions (what a year of daily partitions, or a hostile agent before
/// ingest bounded window times, leaves) are dropped in bounded batches, all of them, with the
/// partitions still within retention kept.
#[tokio::test]
async fn retention_drops_many_partitions_in_batches() {
    let db = fresh_database().await.unwrap();
    let now = chrono::Utc::now();
    let mut tx = db.pool.begin().await.unwrap();
    flows::ensure_partitions(&mut tx, now - chrono::Duration::days(400), now).await.unwrap();
    tx.commit().await.unwrap();
    let count = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent
             WHERE p.relname IN ('flow_records', 'flow_gaps')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        n as usize
    };
    assert_eq!(count().await, 2 * 401);
    let dropped = flows::apply_retention(&db.pool, 30, now).await.unwrap();
    // Days [now - 400, now - 31] are wholly before the cutoff day (now - 30): 370 days, two tables.
    assert_eq!(dropped.len(), 2 * 370);
    assert!(dropped.len() > 10 * flows::RETENTION_BATCH, "the test spans many batches");
    assert_eq!(count().await, 2 * 31);
    assert_eq!(flows::apply_retention(&db.pool, 30, now).await.unwrap(), Vec::<String>::new());
}

async fn register(pool: &sqlx::PgPool, labels: &[&str], addresses: &[&str]) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: "host".into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
    };
    authoring::commit(pool, "test", "register", "host", async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    new.id
}

async fn group(pool: &sqlx::PgPool, name: &str, cidr: &str) {
    let spec = innerwall_control_plane::policy::spec::AddressGroupSpec {
        name: name.into(),
        description: String::new(),
        cidrs: BTreeSet::from([innerwall_wire::policy::Cidr::parse(cidr).unwrap()]),
    };
    authoring::commit(pool, "test", "group", name, async |c| {
        authoring::create_address_group(c, &spec).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
}

fn flow(
    src: &str,
    dst: &str,
    port: u32,
    decision: proto::FlowDecision,
    packets: u64,
    seen: (i64, i64),
) -> proto::FlowRecord {
    let allowed = decision == proto::FlowDecision::Allowed;
    proto::FlowRecord {
        src_address: src.into(),
        dst_address: dst.into(),
        dst_port: port,
        protocol: proto::Protocol::Tcp.into(),
        decision: decision.into(),
        matched_rule_id: if allowed { "allow-web/tcp".into() } else { String::new() },
        packets,
        bytes: packets.saturating_mul(100).min(i64::MAX as u64),
        new_connections: 1,
        first_seen_unix_ms: seen.0,
        last_seen_unix_ms: seen.1,
    }
}

/// record_count, packets, bytes, new_connections, then records observed, allowed, would-block, blocked.
type WindowTotals = (i32, i64, i64, i64, i32, i32, i32, i32);

#[derive(Debug, PartialEq, sqlx::FromRow)]
struct Stored {
    window_start: chrono::DateTime<chrono::Utc>,
    policy_version: i64,
    src: String,
    dst: String,
    dst_port: i32,
    decision: i16,
    matched_rule_id: String,
    packets: i64,
    bytes: i64,
    first_seen: chrono::DateTime<chrono::Utc>,
    last_seen: chrono::DateTime<chrono::Utc>,
    peer_kind: i16,
    peer_key: String,
    peer_labels: serde_json::Value,
}

/// Every column survives the binary COPY as sent, sources resolve as FLOW-5 says (workload with
/// its labels then, else the most specific group, else the bare address), the window row
/// carries its totals, and a repeated window counts once.
#[tokio::test]
async fn ingest_stores_records_resolved_and_totals_summed() {
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    // A public (documentation) range is a workload range only once an operator says so.
    authoring::commit(&db.pool, "test", "estate-range.add", "2001:db8::/32", async |c| {
        authoring::add_estate_range(c, innerwall_wire::policy::Cidr::parse("2001:db8::/32")?, "").await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let peer = register(&db.pool, &["app=web", "env=prod"], &["10.9.0.7", "2001:db8::7"]).await;
    group(&db.pool, "corp", "10.8.0.0/16").await;
    group(&db.pool, "office", "10.8.1.0/24").await;
    let start = 1_767_225_600_123; // 2026-01-01T00:00:00.123Z
    let seen = (start + 1_001, start + 59_999);
    use proto::FlowDecision::{Allowed, WouldBlock};
    let wire = |records| proto::FlowWindow {
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + 60_000,
        policy_version: 9,
        mode: 2,
        records,
        gaps: vec![proto::EvidenceGap {
            kind: 1,
            from_unix_ms: start,
            to_unix_ms: start + 5,
            count: 4,
            detail: String::new(),
        }],
    };
    let first = wire(vec![
        flow("10.9.0.7", "10.1.0.5", 5432, WouldBlock, 3, seen),
        flow("2001:db8::7", "2001:db8::5", 5432, WouldBlock, 4, (start + 5, start + 6)),
        flow("10.8.1.1", "10.1.0.5", 443, Allowed, 2, seen),
        flow("10.8.2.2", "10.1.0.5", 443, Allowed, 5, seen),
        flow("::ffff:192.0.2.1", "10.1.0.5", 22, WouldBlock, 1, seen),
    ]);
    let done = flows::ingest(&db.pool, id, &FlowWindow::try_from(&first).unwrap()).await.unwrap();
    assert_eq!(done, flows::Ingested { records: 5, duplicate: false });

    let rows: Vec<Stored> = sqlx::query_as(
        "SELECT window_start, policy_version, host(src_address) AS src, host(dst_address) AS dst, dst_port, decision,
                matched_rule_id, packets, bytes, first_seen, last_seen, peer_kind, peer_key, peer_labels
         FROM flow_records WHERE workload_id = $1 ORDER BY packets",
    )
    .bind(id.uuid())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let at = |ms: i64| chrono::DateTime::from_timestamp_millis(ms).unwrap();
    let (f, l) = (at(seen.0), at(seen.1));
    let row =
        |src: &str, dst: &str, port: i32, rule: &str, packets: i64, peer: (i16, &str, serde_json::Value)| {
            Stored {
                window_start: at(start),
                policy_version: 9,
                src: src.into(),
                dst: dst.into(),
                dst_port: port,
                decision: if rule.is_empty() { 3 } else { 2 },
                matched_rule_id: rule.into(),
                packets,
                bytes: packets * 100,
                first_seen: f,
                last_seen: l,
                peer_kind: peer.0,
                peer_key: peer.1.into(),
                peer_labels: peer.2,
            }
        };
    let p = peer.to_string();
    let workload = || (1, p.as_str(), serde_json::json!({"app": "web", "env": "prod"}));
    let v6 = Stored {
        first_seen: at(start + 5),
        last_seen: at(start + 6),
        ..row("2001:db8::7", "2001:db8::5", 5432, "", 4, workload())
    };
    assert_eq!(
        rows,
        vec![
            row("192.0.2.1", "10.1.0.5", 22, "", 1, (0, "192.0.2.1", serde_json::json!({}))),
            row("10.8.1.1", "10.1.0.5", 443, "allow-web/tcp", 2, (2, "office", serde_json::json!({}))),
            row("10.9.0.7", "10.1.0.5", 5432, "", 3, workload()),
            v6,
            row("10.8.2.2", "10.1.0.5", 443, "allow-web/tcp", 5, (2, "corp", serde_json::json!({}))),
        ]
    );

    // A second window, and the first again (a retry): only the second adds to the totals.
    let second = wire(vec![flow("10.9.0.7", "10.1.0.5", 5432, WouldBlock, 10, (start + 2, start + 3))]);
    flows::ingest(&db.pool, id, &FlowWindow::try_from(&second).unwrap()).await.unwrap();
    let again = flows::ingest(&db.pool, id, &FlowWindow::try_from(&first).unwrap()).await.unwrap();
    assert_eq!(again, flows::Ingested { records: 0, duplicate: true });
    // Each window's totals sit on its row: packets, bytes, connections, records per decision.
    let totals: Vec<WindowTotals> = sqlx::query_as(
        "SELECT record_count, packets, bytes, new_connections, observed_records, allowed_records,
                would_block_records, blocked_records
         FROM flow_windows WHERE workload_id = $1 ORDER BY record_count DESC",
    )
    .bind(id.uuid())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(totals, [(5, 15, 1500, 5, 0, 2, 3, 0), (1, 10, 1000, 1, 0, 0, 1, 0)]);
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_windows WHERE workload_id = $1),
                (SELECT count(*) FROM flow_records WHERE workload_id = $1),
                (SELECT count(*) FROM flow_gaps WHERE workload_id = $1)",
    )
    .bind(id.uuid())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(counts, (2, 6, 2));
}

/// A window whose totals cannot be stored is refused whole: no window, record or gap.
#[tokio::test]
async fn a_window_refused_at_ingest_stores_nothing() {
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    let start = chrono::Utc::now().timestamp_millis() - 60_000;
    let huge = i64::MAX as u64;
    let wire = proto::FlowWindow {
        gaps: vec![proto::EvidenceGap {
            kind: 1,
            from_unix_ms: start,
            to_unix_ms: start,
            count: 1,
            detail: String::new(),
        }],
        ..window_at(
            start,
            vec![
                flow("192.0.2.1", "10.1.0.5", 22, proto::FlowDecision::WouldBlock, huge, (start, start)),
                flow("192.0.2.1", "10.1.0.6", 22, proto::FlowDecision::WouldBlock, huge, (start, start)),
            ],
        )
    };
    let window = FlowWindow::try_from(&wire).unwrap();
    let err = flows::ingest(&db.pool, id, &window).await.unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
    let counts: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_windows), (SELECT count(*) FROM flow_records),
                (SELECT count(*) FROM flow_gaps), (SELECT count(*) FROM flow_records)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(counts, (0, 0, 0, 0));
}

/// Uploads from several agents run side by side (the partition lock is shared by ingests), also
/// when they all find the day's partitions missing and race to create them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_uploads_create_partitions_once_and_all_land() {
    let db = fresh_database().await.unwrap();
    let start = 1_767_312_000_000; // 2026-01-02T00:00:00Z: no partition yet
    let mut tasks = Vec::new();
    for n in 0..4u32 {
        let id = register(&db.pool, &["app=db"], &[]).await;
        let pool = db.pool.clone();
        let wire = window_at(
            start,
            (0..100)
                .map(|i| {
                    flow(
                        &format!("192.0.2.{i}"),
                        "10.1.0.5",
                        1000 + n,
                        proto::FlowDecision::WouldBlock,
                        1,
                        (start, start),
                    )
                })
                .collect(),
        );
        tasks.push(tokio::spawn(async move {
            flows::ingest(&pool, id, &FlowWindow::try_from(&wire).unwrap()).await
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap(), flows::Ingested { records: 100, duplicate: false });
    }
    let (records, packets): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_records_20260102), (SELECT sum(packets)::bigint FROM flow_windows)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((records, packets), (400, 400));
}

/// A one-minute simulation window from `start` (unix ms) with the given records.
/// Ingest checks in its own transaction that the workload is live: a window that arrives after
/// a retire committed is refused even before the retire's notice reaches a replica's admission
/// (the library is called directly here, with no admission in front of it).
#[tokio::test]
async fn ingest_refuses_a_retired_workload_in_its_transaction() {
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    let start = chrono::Utc::now().timestamp_millis() - 60_000;
    let record = || flow("192.0.2.1", "10.1.0.5", 22, proto::FlowDecision::WouldBlock, 1, (start, start));
    let window = |records| FlowWindow::try_from(&window_at(start, records)).unwrap();
    flows::ingest(&db.pool, id, &window(vec![record()])).await.unwrap();
    authoring::commit(&db.pool, "test", "workload.retire", &id.to_string(), async |c| {
        authoring::retire(c, id).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let err = flows::ingest(&db.pool, id, &window(vec![record()])).await.unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::PermissionDenied);
    let windows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_windows").fetch_one(&db.pool).await.unwrap();
    assert_eq!(windows, 1, "only the window from before the retire is stored");
}

fn window_at(start: i64, records: Vec<proto::FlowRecord>) -> proto::FlowWindow {
    proto::FlowWindow {
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + 60_000,
        policy_version: 1,
        mode: 2,
        records,
        gaps: vec![],
    }
}

/// A window with the given records, ending now.
fn window_of(records: Vec<proto::FlowRecord>) -> proto::FlowWindow {
    window_at(chrono::Utc::now().timestamp_millis() - 60_000, records)
}

/// The label snapshot is the peer's labels when the flow was seen, not when it was uploaded:
/// windows seen before and after a relabel, both ingested after it, keep their own labels.
#[tokio::test]
async fn label_snapshot_is_taken_at_the_time_the_flow_was_seen() {
    use proto::FlowDecision::WouldBlock;
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    let peer = register(&db.pool, &["app=batch", "env=prod"], &["10.5.0.9"]).await;
    let pause = || tokio::time::sleep(std::time::Duration::from_millis(20));
    pause().await;
    let before = chrono::Utc::now().timestamp_millis();
    pause().await;
    authoring::commit(&db.pool, "test", "label", "peer", async |c| {
        Ok((
            authoring::edit_labels(c, peer, 1, &["app=web".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap();
    pause().await;
    let after = chrono::Utc::now().timestamp_millis();
    for (port, seen) in [(5432, before), (5433, after)] {
        let wire = window_of(vec![flow("10.5.0.9", "10.1.0.5", port, WouldBlock, 1, (seen, seen))]);
        flows::ingest(&db.pool, id, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
    }
    let snapshots: Vec<(i32, String, serde_json::Value)> = sqlx::query_as(
        "SELECT dst_port, peer_key, peer_labels FROM flow_records WHERE workload_id = $1 ORDER BY dst_port",
    )
    .bind(id.uuid())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let key = peer.to_string();
    assert_eq!(
        snapshots,
        [
            (5432, key.clone(), serde_json::json!({"app": "batch", "env": "prod"})),
            (5433, key, serde_json::json!({"app": "web", "env": "prod"})),
        ]
    );
}
