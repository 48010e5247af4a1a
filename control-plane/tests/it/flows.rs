//! Flow storage against real Postgres: daily partitions and retention by dropping them (FLOW-5).

use std::collections::BTreeSet;

use innerwall_control_plane::flows;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::testing::{self, fresh_database};
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
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
    innerwall_control_plane::foresight::commit(&db.pool, "test", "register", "db", async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let now = chrono::Utc::now();
    testing::installed(&db.pool, id, &[(1, Mode::Visibility, now - chrono::Duration::hours(1))])
        .await
        .unwrap();
    let wire = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: now.timestamp_millis() - 60_000,
        end_unix_ms: now.timestamp_millis(),
        policy_version: 1,
        mode: 1,
        records: vec![proto::FlowRecord {
            pending_decision: 0,
            pending_rule_id: String::new(),
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
    let expected = [
        "flow_edge_hours",
        "flow_gaps",
        "flow_key_days",
        "flow_records",
        "flow_rollups",
        "flow_rule_rollups",
        "flow_windows",
    ]
    .map(|t| format!("{t}_{day}"));
    assert_eq!(partitions().await, expected);

    // Within retention nothing goes; 31 days later the whole day's partitions are dropped.
    assert_eq!(flows::apply_retention(&db.pool, 30, now).await.unwrap(), Vec::<String>::new());
    let queued: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_pending_windows), (SELECT count(*) FROM flow_edge_pending)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(queued, (1, 1), "queued for the roll-up and the map, and kept within retention");
    let dropped = flows::apply_retention(&db.pool, 30, now + chrono::Duration::days(32)).await.unwrap();
    assert_eq!(dropped, expected);
    assert!(partitions().await.is_empty());
    // The window's places in the roll-up's and the map's queues went with its day.
    let windows: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_windows), (SELECT count(*) FROM flow_pending_windows),
                (SELECT count(*) FROM flow_edge_pending)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(windows, (0, 0, 0));
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
    // Days [now - 400, now - 31] are wholly before the cutoff day (now - 30): 370 days, seven
    // tables (windows, records, gaps, rollups, rule rollups, key days, edge hours).
    assert_eq!(dropped.len(), 7 * 370);
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
    innerwall_control_plane::foresight::commit(pool, "test", "register", "host", async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    // The version these tests' windows claim by default, as if its agent had acked it long
    // before any of them.
    testing::installed(pool, new.id, &[(1, Mode::Simulation, at(INSTALLED))]).await.unwrap();
    new.id
}

async fn group(pool: &sqlx::PgPool, name: &str, cidr: &str) {
    let spec = innerwall_control_plane::policy::spec::AddressGroupSpec {
        name: name.into(),
        description: String::new(),
        cidrs: BTreeSet::from([innerwall_wire::policy::Cidr::parse(cidr).unwrap()]),
    };
    innerwall_control_plane::foresight::commit(pool, "test", "group", name, async |c| {
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
        pending_decision: 0,
        pending_rule_id: String::new(),
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
    innerwall_control_plane::foresight::commit(
        &db.pool,
        "test",
        "estate-range.add",
        "2001:db8::/32",
        async |c| {
            authoring::add_estate_range(c, innerwall_wire::policy::Cidr::parse("2001:db8::/32")?, "").await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    let peer = register(&db.pool, &["app=web", "env=prod"], &["10.9.0.7", "2001:db8::7"]).await;
    group(&db.pool, "corp", "10.8.0.0/16").await;
    group(&db.pool, "office", "10.8.1.0/24").await;
    let start = 1_767_225_600_123; // 2026-01-01T00:00:00.123Z
    testing::installed(&db.pool, id, &[(9, Mode::Simulation, at(start - 3_600_000))]).await.unwrap();
    let seen = (start + 1_001, start + 59_999);
    use proto::FlowDecision::{Allowed, WouldBlock};
    let wire = |records| proto::FlowWindow {
        staged_set: String::new(),
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
    let second = proto::FlowWindow {
        start_unix_ms: start + 60_000,
        end_unix_ms: start + 120_000,
        ..wire(vec![flow("10.9.0.7", "10.1.0.5", 5432, WouldBlock, 10, (start + 2, start + 3))])
    };
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
    innerwall_control_plane::foresight::commit(
        &db.pool,
        "test",
        "workload.retire",
        &id.to_string(),
        async |c| {
            authoring::retire(c, id).await?;
            Ok(((), serde_json::json!({})))
        },
    )
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
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + 60_000,
        policy_version: 1,
        mode: 2,
        records,
        gaps: vec![],
    }
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
    innerwall_control_plane::foresight::commit(&db.pool, "test", "label", "peer", async |c| {
        Ok((
            authoring::edit_labels(c, peer, 1, &["app=web".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap();
    pause().await;
    let after = chrono::Utc::now().timestamp_millis();
    for (n, (port, seen)) in [(5432, before), (5433, after)].into_iter().enumerate() {
        // One after the other: a workload's windows do not overlap.
        let start = after - 120_000 + n as i64 * 60_000;
        let wire = window_at(start, vec![flow("10.5.0.9", "10.1.0.5", port, WouldBlock, 1, (seen, seen))]);
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

// ---- Review: rollups, pages (FLOW-6) ----

use std::collections::BTreeMap;

use innerwall_control_plane::flows::{Grouping, PageRequest, RollupFilter, RollupRow};

/// One raw record as the oracle reads it back.
#[derive(Debug, sqlx::FromRow)]
struct Raw {
    rule: String,
    peer_kind: i16,
    peer_key: String,
    peer_labels: serde_json::Value,
    src: String,
    workload_id: uuid::Uuid,
    dst: String,
    dst_port: i32,
    protocol: i16,
    policy_version: i64,
    decision: i16,
    new_connections: i64,
    packets: i64,
    bytes: i64,
    first_seen: chrono::DateTime<chrono::Utc>,
    last_seen: chrono::DateTime<chrono::Utc>,
}

/// A group's sums: connections, packets, bytes, records, first and last seen, versions, decisions.
type Sums =
    (i64, i64, i64, i64, chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>, Vec<i64>, Vec<i16>);

fn key_of(by: Grouping, r: &Raw) -> Vec<String> {
    let (kind, labels) = (r.peer_kind.to_string(), r.peer_labels.to_string());
    let (port, proto, w) = (r.dst_port.to_string(), r.protocol.to_string(), r.workload_id.to_string());
    match by {
        Grouping::Rule => vec![r.rule.clone()],
        Grouping::RulePeer => vec![r.rule.clone(), kind, r.peer_key.clone(), labels],
        Grouping::SrcDst => vec![r.src.clone(), kind, r.peer_key.clone(), labels, w, r.dst.clone()],
        Grouping::DstService => vec![w, port, proto],
        Grouping::PeerService => vec![kind, r.peer_key.clone(), labels, port, proto],
    }
}

fn row_key(by: Grouping, r: &RollupRow) -> Vec<String> {
    let s = |v: &Option<String>| v.clone().expect("the grouping's field is present");
    let n = |v: Option<i64>| v.expect("the grouping's field is present").to_string();
    let kind = || n(r.peer_kind.map(i64::from));
    let labels = || r.peer_labels.as_ref().expect("peer labels present").to_string();
    let w = || r.workload_id.expect("workload present").to_string();
    let (port, proto) = (|| n(r.dst_port.map(i64::from)), || n(r.protocol.map(i64::from)));
    match by {
        Grouping::Rule => vec![s(&r.rule)],
        Grouping::RulePeer => vec![s(&r.rule), kind(), s(&r.peer_key), labels()],
        Grouping::SrcDst => vec![s(&r.src_address), kind(), s(&r.peer_key), labels(), w(), s(&r.dst_address)],
        Grouping::DstService => vec![w(), port(), proto()],
        Grouping::PeerService => vec![kind(), s(&r.peer_key), labels(), port(), proto()],
    }
}

/// The raw records of windows that started in `[from, to)`: the source of truth.
async fn raw(
    pool: &sqlx::PgPool,
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> Vec<Raw> {
    sqlx::query_as(
        "SELECT matched_rule_id AS rule, peer_kind, peer_key, peer_labels, host(src_address) AS src, workload_id,
                host(dst_address) AS dst, dst_port, protocol, policy_version, decision, new_connections, packets,
                bytes, first_seen, last_seen
         FROM flow_records WHERE window_start >= $1 AND window_start < $2",
    )
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// What a rollup must say, computed in Rust from the raw records `keep` selects.
fn oracle(by: Grouping, records: &[Raw], keep: impl Fn(&Raw) -> bool) -> BTreeMap<Vec<String>, Sums> {
    let mut groups: BTreeMap<Vec<String>, Sums> = BTreeMap::new();
    for r in records.iter().filter(|r| keep(r)) {
        let g =
            groups.entry(key_of(by, r)).or_insert((0, 0, 0, 0, r.first_seen, r.last_seen, vec![], vec![]));
        g.0 += r.new_connections;
        g.1 += r.packets;
        g.2 += r.bytes;
        g.3 += 1;
        g.4 = g.4.min(r.first_seen);
        g.5 = g.5.max(r.last_seen);
        g.6.push(r.policy_version);
        g.7.push(r.decision);
    }
    for g in groups.values_mut() {
        g.6.sort();
        g.6.dedup();
        g.7.sort();
        g.7.dedup();
    }
    groups
}

/// Walks every page of a rollup, `limit` rows at a time; checks each page's bound and that no
/// group comes twice. Returns the groups and how many pages it took.
async fn walk(
    pool: &sqlx::PgPool,
    by: Grouping,
    filter: &RollupFilter,
    limit: u32,
) -> (BTreeMap<Vec<String>, Sums>, usize) {
    let mut groups = BTreeMap::new();
    let mut request = PageRequest::first(limit);
    for pages in 1.. {
        let page = flows::rollup(pool, by, filter, &request).await.unwrap();
        assert!(page.rows.len() <= limit as usize, "{by}: a page over its bound");
        assert_eq!(
            page.truncated,
            page.next_cursor.is_some(),
            "{by}: truncated exactly when a cursor is given"
        );
        for r in &page.rows {
            let sums = (
                r.connections,
                r.packets,
                r.bytes,
                r.records,
                r.first_seen,
                r.last_seen,
                r.policy_versions.clone(),
                r.decisions.clone(),
            );
            let key = row_key(by, r);
            assert!(groups.insert(key.clone(), sums).is_none(), "{by}: group {key:?} came twice");
        }
        match page.next_cursor {
            Some(cursor) => {
                assert_eq!(page.rows.len(), limit as usize, "{by}: a truncated page is full");
                request.cursor = Some(cursor);
            }
            None => return (groups, pages),
        }
    }
    unreachable!()
}

/// Hours of evidence for the review tests: `dsts` report windows at minutes 0, 20 and 40 of
/// each hour from `base`, from a mix of workload, group and bare-address sources on three
/// ports, allowed (rule allow-web/tcp, port 443) or would-block, under version 1 for the first
/// two hours and 2 after. Returns the number of records ingested.
async fn ingest_hours(pool: &sqlx::PgPool, dsts: &[WorkloadId], base: i64, hours: i64) -> usize {
    use proto::FlowDecision::{Allowed, WouldBlock};
    const SOURCES: [&str; 8] = [
        "10.5.0.1",
        "10.5.0.2",
        "10.8.1.1",
        "10.8.2.2",
        "192.0.2.1",
        "192.0.2.2",
        "192.0.2.3",
        "2001:db8::9",
    ];
    for dst in dsts {
        testing::installed(pool, *dst, &[(2, Mode::Simulation, at(base + 2 * 3_600_000))]).await.unwrap();
    }
    let mut total = 0;
    for hour in 0..hours {
        for (d, dst) in dsts.iter().enumerate() {
            for slot in 0..3i64 {
                let start = base + hour * 3_600_000 + slot * 1_200_000;
                let seen = (start + 1_000, start + 50_000 + hour * 10 + slot);
                let mut records = Vec::new();
                for (i, src) in SOURCES.iter().enumerate() {
                    for (j, port) in [22u32, 443, 5432].into_iter().enumerate() {
                        if (i + j + d + slot as usize).is_multiple_of(3) {
                            continue;
                        }
                        let decision = if port == 443 { Allowed } else { WouldBlock };
                        let dst_address = if src.contains(':') { "2001:db8::5" } else { "10.1.0.5" };
                        let packets = 1 + (i * 7 + j * 3 + hour as usize) as u64;
                        records.push(flow(src, dst_address, port, decision, packets, seen));
                    }
                }
                total += records.len();
                let wire = proto::FlowWindow {
                    policy_version: if hour < 2 { 1 } else { 2 },
                    ..window_at(start, records)
                };
                flows::ingest(pool, *dst, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
            }
        }
    }
    total
}

async fn estate(pool: &sqlx::PgPool) -> (Vec<WorkloadId>, WorkloadId) {
    innerwall_control_plane::foresight::commit(
        pool,
        "test",
        "estate-range.add",
        "2001:db8::/32",
        async |c| {
            authoring::add_estate_range(c, innerwall_wire::policy::Cidr::parse("2001:db8::/32")?, "").await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    let batch = register(pool, &["app=batch", "env=prod"], &["10.5.0.1"]).await;
    register(pool, &["app=web", "env=prod"], &["10.5.0.2", "2001:db8::9"]).await;
    group(pool, "corp", "10.8.0.0/16").await;
    let dsts = vec![
        register(pool, &["app=db", "env=prod"], &[]).await,
        register(pool, &["app=db", "env=prod"], &[]).await,
        register(pool, &["app=cache"], &[]).await,
    ];
    (dsts, batch)
}

const BASE: i64 = 1_767_571_200_000; // 2026-01-05T00:00:00Z
const INSTALLED: i64 = 1_735_689_600_000; // 2025-01-01T00:00:00Z

fn at(ms: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms).unwrap()
}

/// FLOW-6 acceptance: a rollup larger than its bound comes back truncated with a cursor; walking
/// the cursors yields every group exactly once, and each group's sums equal the raw records'
/// (so do the totals), for every grouping, whether the windows are rolled up, not yet, or arrived
/// late into an hour already rolled up, over a range with partial hours at both ends.
#[tokio::test]
async fn rollups_are_bounded_and_paginated() {
    let db = fresh_database().await.unwrap();
    let (dsts, _) = estate(&db.pool).await;
    let records = ingest_hours(&db.pool, &dsts, BASE, 5).await;
    let (from, to) = (at(BASE + 30 * 60_000), at(BASE + 4 * 3_600_000 + 10 * 60_000));
    let filter = RollupFilter::range(from, to);

    let check = async |stage: &str| {
        let truth = raw(&db.pool, from, to).await;
        assert!(truth.len() < records && truth.len() > records / 2, "the range cuts the evidence");
        for by in Grouping::ALL {
            let expected = oracle(by, &truth, |_| true);
            let limit = (expected.len() / 4).max(1) as u32;
            let first = flows::rollup(&db.pool, by, &filter, &PageRequest::first(limit)).await.unwrap();
            assert!(
                first.truncated && first.next_cursor.is_some(),
                "{stage} {by}: more groups than the bound"
            );
            let (walked, pages) = walk(&db.pool, by, &filter, limit).await;
            assert_eq!(
                pages,
                expected.len().div_ceil(limit as usize),
                "{stage} {by}: full pages, then the rest"
            );
            assert_eq!(walked, expected, "{stage} {by}: the walk is the raw records' rollup");
            let total = |g: &BTreeMap<Vec<String>, Sums>| {
                g.values().fold((0, 0, 0, 0), |t, s| (t.0 + s.0, t.1 + s.1, t.2 + s.2, t.3 + s.3))
            };
            let raw_total = truth.iter().fold((0, 0, 0, 0), |t, r| {
                (t.0 + r.new_connections, t.1 + r.packets, t.2 + r.bytes, t.3 + 1)
            });
            assert_eq!(total(&walked), raw_total, "{stage} {by}: sums equal the raw records' sums");
            let whole = flows::rollup(&db.pool, by, &filter, &PageRequest::first(10_000)).await.unwrap();
            assert!(!whole.truncated && whole.next_cursor.is_none(), "{stage} {by}: one page holds all");
            assert_eq!(whole.rows.len(), expected.len());
        }
    };
    check("nothing rolled up").await;

    // Hours 0-2 close: the job rolls up their windows (and only theirs), once.
    let rolled = flows::roll_up(&db.pool, at(BASE + 3 * 3_600_000 + 60_000)).await.unwrap();
    assert_eq!(rolled, 3 * 3 * 3, "three hours of three windows from three workloads");
    assert_eq!(flows::roll_up(&db.pool, at(BASE + 3 * 3_600_000 + 60_000)).await.unwrap(), 0);
    let rollup_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_rollups").fetch_one(&db.pool).await.unwrap();
    assert!(rollup_rows > 0);
    check("three hours rolled up").await;

    // A late window into hour 1, already rolled up: counted from its records until rolled up too.
    let late = proto::FlowWindow {
        policy_version: 1,
        ..window_at(
            BASE + 3_600_000 + 5 * 60_000,
            vec![flow(
                "192.0.2.77",
                "10.1.0.5",
                22,
                proto::FlowDecision::WouldBlock,
                9,
                (BASE + 3_600_000 + 5 * 60_000, BASE + 3_600_000 + 6 * 60_000),
            )],
        )
    };
    flows::ingest(&db.pool, dsts[0], &FlowWindow::try_from(&late).unwrap()).await.unwrap();
    check("a late window pending").await;
    assert_eq!(flows::roll_up(&db.pool, at(BASE + 6 * 3_600_000)).await.unwrap(), 2 * 3 * 3 + 1);
    check("everything rolled up").await;

    // A cursor of another grouping, or not a cursor at all, is refused with what to do.
    let cursor =
        flows::rollup(&db.pool, Grouping::Rule, &filter, &PageRequest::first(1)).await.unwrap().next_cursor;
    for bad in [cursor, Some("garbage".into())] {
        let err = flows::rollup(&db.pool, Grouping::SrcDst, &filter, &PageRequest { limit: 5, cursor: bad })
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("without a cursor"), "{err}");
    }
    let err = flows::rollup(&db.pool, Grouping::Rule, &filter, &PageRequest::first(flows::MAX_PAGE + 1))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("follow the cursor"), "{err}");
}

/// Every filter selects what it says, each checked against the raw records: decision, policy
/// version, workload ids, a scope resolved to the workloads in it now (a workload relabelled
/// into it after its flows brings its history), and a peer label as stored at ingest (a peer
/// relabelled later keeps its old flows under its old labels).
#[tokio::test]
async fn rollup_filters_select_by_decision_version_workload_scope_now_and_peer_labels_then() {
    use proto::FlowDecision::WouldBlock;
    let db = fresh_database().await.unwrap();
    let (dsts, batch) = estate(&db.pool).await;
    ingest_hours(&db.pool, &dsts, BASE, 3).await;
    flows::roll_up(&db.pool, at(BASE + 2 * 3_600_000)).await.unwrap();

    // The batch peer becomes app=etl; its later flows carry the new labels, the old keep theirs.
    innerwall_control_plane::foresight::commit(&db.pool, "test", "label", "batch", async |c| {
        Ok((
            authoring::edit_labels(c, batch, 1, &["app=etl".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap();
    // Seen after the relabel committed (a millisecond on: the label history keeps microseconds).
    let now = chrono::Utc::now().timestamp_millis() + 1;
    testing::installed(&db.pool, dsts[0], &[(3, Mode::Simulation, at(now - 60_000))]).await.unwrap();
    let after = proto::FlowWindow {
        policy_version: 3,
        ..window_at(now - 60_000, vec![flow("10.5.0.1", "10.1.0.5", 5432, WouldBlock, 4, (now, now))])
    };
    flows::ingest(&db.pool, dsts[0], &FlowWindow::try_from(&after).unwrap()).await.unwrap();

    let (from, to) = (at(BASE), at(now + 1));
    let truth = raw(&db.pool, from, to).await;
    let all = RollupFilter::range(from, to);
    let labels = |r: &Raw, k: &str, v: &str| r.peer_labels.get(k).and_then(|x| x.as_str()) == Some(v);
    let check = async |what: &str, by: Grouping, filter: RollupFilter, keep: &dyn Fn(&Raw) -> bool| {
        let expected = oracle(by, &truth, keep);
        assert!(!expected.is_empty(), "{what}: the filter selects something");
        assert!(
            expected.len() < oracle(by, &truth, |_| true).len() || by == Grouping::Rule,
            "{what}: and not everything"
        );
        let (walked, _) = walk(&db.pool, by, &filter, 3).await;
        assert_eq!(walked, expected, "{what}");
    };

    check(
        "would-block only",
        Grouping::RulePeer,
        RollupFilter { decisions: vec![innerwall_wire::flows::Decision::WouldBlock], ..all.clone() },
        &|r| r.decision == 3,
    )
    .await;
    check("version 2", Grouping::PeerService, RollupFilter { versions: vec![2], ..all.clone() }, &|r| {
        r.policy_version == 2
    })
    .await;
    let one: BTreeSet<WorkloadId> = [dsts[1]].into();
    check("one workload", Grouping::DstService, all.clone().within(one.clone()), &|r| {
        r.workload_id == dsts[1].uuid()
    })
    .await;
    // By rule over the whole estate (the rollups summed over workloads and peers), and not.
    let would_block =
        RollupFilter { decisions: vec![innerwall_wire::flows::Decision::WouldBlock], ..all.clone() };
    check("rule, would-block only", Grouping::Rule, would_block, &|r| r.decision == 3).await;
    check("rule, version 2", Grouping::Rule, RollupFilter { versions: vec![2], ..all.clone() }, &|r| {
        r.policy_version == 2
    })
    .await;
    check("rule, one workload", Grouping::Rule, all.clone().within(one), &|r| {
        r.workload_id == dsts[1].uuid()
    })
    .await;

    // A scope of at most an eighth of the estate is read through the workload index and sorted
    // (not in key order): the same groups, every grouping, page by page.
    for n in 0..8 {
        register(&db.pool, &[&format!("app=idle-{n}")], &[]).await;
    }
    let one: BTreeSet<WorkloadId> = [dsts[1]].into();
    for by in Grouping::ALL {
        check("one workload of 13", by, all.clone().within(one.clone()), &|r| {
            r.workload_id == dsts[1].uuid()
        })
        .await;
    }

    // Scope now: app=db is dsts 0 and 1; relabel dsts[2] (app=cache) to app=db and it joins,
    // with all of its history.
    let scope = flows::parse_selector("app=db").unwrap();
    let before = flows::workloads_in(&db.pool, &scope).await.unwrap();
    assert_eq!(before, BTreeSet::from([dsts[0], dsts[1]]));
    check("scope app=db", Grouping::SrcDst, all.clone().within(before), &|r| r.workload_id != dsts[2].uuid())
        .await;
    innerwall_control_plane::foresight::commit(&db.pool, "test", "label", "cache", async |c| {
        Ok((
            authoring::edit_labels(c, dsts[2], 1, &["app=db".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap();
    let now_in = flows::workloads_in(&db.pool, &scope).await.unwrap();
    assert_eq!(
        now_in,
        BTreeSet::from([dsts[0], dsts[1], dsts[2]]),
        "the scope resolves to the workloads in it now"
    );
    let (walked, _) = walk(&db.pool, Grouping::DstService, &all.clone().within(now_in), 3).await;
    assert_eq!(walked, oracle(Grouping::DstService, &truth, |_| true), "its history comes with it");
    let nobody = flows::workloads_in(&db.pool, &flows::parse_selector("app=nothing").unwrap()).await.unwrap();
    let empty = flows::rollup(&db.pool, Grouping::Rule, &all.clone().within(nobody), &PageRequest::first(10))
        .await
        .unwrap();
    assert!(empty.rows.is_empty() && !empty.truncated, "an empty scope matches nothing, not everything");

    // Peer labels then: the batch peer's old flows answer app=batch, its new one app=etl only.
    let then = |l: &str| RollupFilter { peer_labels: vec![l.parse().unwrap()], ..all.clone() };
    check("peer app=batch then", Grouping::RulePeer, then("app=batch"), &|r| labels(r, "app", "batch")).await;
    check("rule, peer app=batch then", Grouping::Rule, then("app=batch"), &|r| labels(r, "app", "batch"))
        .await;
    let (etl, _) = walk(&db.pool, Grouping::RulePeer, &then("app=etl"), 10).await;
    assert_eq!(etl.len(), 1, "only the flow seen after the relabel: {etl:?}");
    let (_, sums) = etl.into_iter().next().unwrap();
    assert_eq!((sums.1, sums.3, sums.6), (4, 1, vec![3]), "its packets, one record, version 3");
    let batch_key = batch.to_string();
    let old = oracle(Grouping::RulePeer, &truth, |r| r.peer_key == batch_key && labels(r, "app", "batch"));
    assert!(old.len() >= 2, "the batch peer's old flows stay under app=batch");
}

/// A window is stored once per (workload, window id) also now that windows are partitioned by
/// day: a retry with the same start, and the same id with another start, are duplicates.
#[tokio::test]
async fn a_window_id_is_stored_once_across_days() {
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    let record =
        |start: i64| flow("192.0.2.1", "10.1.0.5", 22, proto::FlowDecision::WouldBlock, 1, (start, start));
    let first = window_at(BASE, vec![record(BASE)]);
    let ingest = async |w: &proto::FlowWindow| {
        flows::ingest(&db.pool, id, &FlowWindow::try_from(w).unwrap()).await.unwrap()
    };
    assert!(!ingest(&first).await.duplicate);
    assert!(ingest(&first).await.duplicate, "a retry");
    let next_day = window_at(BASE + 86_400_000, vec![record(BASE + 86_400_000)]);
    let reused = proto::FlowWindow { window_id: first.window_id.clone(), ..next_day.clone() };
    assert!(ingest(&reused).await.duplicate, "the same id on another day");
    assert!(!ingest(&next_day).await.duplicate);
    // Each window stored is queued for the roll-up once; a duplicate queues nothing.
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_windows), (SELECT count(*) FROM flow_records),
                (SELECT count(*) FROM flow_pending_windows)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(counts, (2, 2, 2));
}

/// `flows list` and `flows gaps` come a bounded page at a time: walking the cursors yields every
/// record and gap exactly once, also records with the same flow key in one window; the list
/// filters by policy version.
#[tokio::test]
async fn flow_list_and_gaps_page_every_row_once() {
    use proto::FlowDecision::WouldBlock;
    let db = fresh_database().await.unwrap();
    let id = register(&db.pool, &["app=db"], &[]).await;
    let start = chrono::Utc::now().timestamp_millis() - 120_000;
    let installs = [(7, Mode::Simulation, at(start - 1)), (8, Mode::Simulation, at(start + 60_000))];
    testing::installed(&db.pool, id, &installs).await.unwrap();
    for (n, version) in [(0i64, 7u64), (1, 8)] {
        let s = start + n * 60_000;
        let mut records: Vec<_> = (0..11)
            .map(|i| flow(&format!("192.0.2.{i}"), "10.1.0.5", 22, WouldBlock, 1 + i, (s, s)))
            .collect();
        records.push(flow("192.0.2.1", "10.1.0.5", 22, WouldBlock, 100, (s, s))); // the same flow key again
        let gaps = (0..5)
            .map(|k| proto::EvidenceGap {
                kind: 1,
                from_unix_ms: s,
                to_unix_ms: s + 1,
                count: k % 2,
                detail: String::new(),
            })
            .collect();
        let wire = proto::FlowWindow { policy_version: version, gaps, ..window_at(s, records) };
        flows::ingest(&db.pool, id, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
    }
    let since = at(start - 1);
    let filter = |version| flows::RecordFilter { workload: id, since, decision: None, version };
    let mut seen = Vec::new();
    let mut request = PageRequest::first(5);
    loop {
        let page = flows::list(&db.pool, &filter(None), &request).await.unwrap();
        assert!(page.rows.len() <= 5);
        seen.extend(page.rows.iter().map(|r| (r.window_id, r.src_address.clone(), r.packets)));
        match page.next_cursor {
            Some(c) => request.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len(), 24, "every record once: {seen:?}");
    assert_eq!(seen.iter().collect::<BTreeSet<_>>().len(), 24);
    let v8 = flows::list(&db.pool, &filter(Some(8)), &PageRequest::first(100)).await.unwrap();
    assert_eq!(v8.rows.len(), 12);
    assert!(!v8.truncated && v8.rows.iter().all(|r| r.policy_version == 8));

    let mut gaps = 0;
    let mut request = PageRequest::first(3);
    loop {
        let page = flows::gaps(&db.pool, Some(id), since, &request).await.unwrap();
        assert!(page.rows.len() <= 3);
        gaps += page.rows.len();
        match page.next_cursor {
            Some(c) => request.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(gaps, 10, "every gap once, identical ones too");
}

/// FLOW-5: a flow is attributed to the workload that holds its source address now. A host is
/// deny-listed and another live host takes its address: flows from the address are the live
/// host's only, and the schema refuses a second accepted claim of it whatever writes it.
#[tokio::test]
async fn deny_listed_addresses_are_not_attributed() {
    use proto::FlowDecision::WouldBlock;
    let db = fresh_database().await.unwrap();
    let dst = register(&db.pool, &["app=db"], &[]).await;
    let old = register(&db.pool, &["app=web"], &["10.9.0.7"]).await;
    let start = chrono::Utc::now().timestamp_millis() - 180_000;
    let upload = async |n: i64| {
        let s = start + n * 60_000;
        let wire = window_at(s, vec![flow("10.9.0.7", "10.1.0.5", 5432, WouldBlock, 1 + n as u64, (s, s))]);
        flows::ingest(&db.pool, dst, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
    };
    upload(0).await;

    innerwall_control_plane::foresight::commit(
        &db.pool,
        "test",
        "workload.deny",
        &old.to_string(),
        async |c| {
            authoring::deny(c, old).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    let new = register(&db.pool, &["app=batch"], &["10.9.0.7"]).await;
    upload(1).await;
    upload(2).await;

    let peers: Vec<(i64, String)> =
        sqlx::query_as("SELECT packets, peer_key FROM flow_records WHERE workload_id = $1 ORDER BY packets")
            .bind(dst.uuid())
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        peers,
        [(1, old.to_string()), (2, new.to_string()), (3, new.to_string())],
        "before the deny the old host's; after it, the live host's only"
    );
    let accepted: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT workload_id FROM workload_addresses WHERE address = '10.9.0.7' AND standing = 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(accepted, [new.uuid()]);
    // Impossible in the schema too: a second accepted claim does not commit.
    let err = sqlx::query("UPDATE workload_addresses SET standing = 1 WHERE workload_id = $1")
        .bind(old.uuid())
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("workload_addresses_accepted_once"), "{err}");
}

/// (connections, records) per (destination labels, peer group, decision).
type EdgeSums = BTreeMap<(BTreeMap<String, String>, flows::Peer, i16), (i64, i64)>;

/// What the map's edges must say: the raw records of `[from, to)` summed per (destination
/// labels in `labels_of`, peer group, decision) as (connections, records).
fn edge_oracle(records: &[Raw], labels_of: &BTreeMap<uuid::Uuid, BTreeMap<String, String>>) -> EdgeSums {
    let mut sums = BTreeMap::new();
    for r in records {
        let peer = match r.peer_kind {
            1 => flows::Peer::Labelled(serde_json::from_value(r.peer_labels.clone()).unwrap()),
            2 => flows::Peer::Group(r.peer_key.clone()),
            _ => flows::Peer::Other,
        };
        let sum: &mut (i64, i64) =
            sums.entry((labels_of[&r.workload_id].clone(), peer, r.decision)).or_default();
        sum.0 += r.new_connections;
        sum.1 += 1;
    }
    sums
}

fn edge_sums(edges: &flows::Edges) -> EdgeSums {
    use innerwall_wire::convert::WireEnum;
    let mut sums = BTreeMap::new();
    for s in &edges.sums {
        let key = (s.destination.clone(), s.peer.clone(), s.decision.code());
        assert!(sums.insert(key, (s.connections, s.records)).is_none(), "one sum per edge: {s:?}");
    }
    sums
}

/// PERF-11's pre-aggregate is exact: the map's edges over a range (widened to the hour it starts
/// in) equal the raw records' sums whether nothing is summed yet, everything is, or a late window
/// waits in an hour already summed, and whatever the roll-up job has done (it sums no edges);
/// queued windows beyond the bound are left out and counted, never half-read; a destination
/// relabelled keeps the flows summed before under its labels then, and the rest under its new ones.
#[tokio::test]
async fn map_edges_equal_the_raw_records_summed_or_not() {
    let db = fresh_database().await.unwrap();
    let (dsts, _) = estate(&db.pool).await;
    ingest_hours(&db.pool, &dsts, BASE, 4).await;
    let (from, to) = (at(BASE + 30 * 60_000), at(BASE + 4 * 3_600_000));
    let labels_now = async || {
        let ids: Vec<uuid::Uuid> = dsts.iter().map(|d| d.uuid()).collect();
        let mut conn = db.pool.acquire().await.unwrap();
        innerwall_control_plane::policy::store::labels_of(&mut conn, &ids).await.unwrap()
    };
    let check = async |stage: &str, labels: &BTreeMap<uuid::Uuid, BTreeMap<String, String>>| {
        let truth = raw(&db.pool, at(BASE), to).await;
        let edges = flows::edges(&db.pool, from, to, flows::MAX_PENDING_RECORDS).await.unwrap();
        assert_eq!((edges.from, edges.to), (at(BASE), to), "{stage}: whole hours from the first");
        assert_eq!((edges.pending_left_out, edges.truncated), (0, false), "{stage}");
        assert_eq!(edge_sums(&edges), edge_oracle(&truth, labels), "{stage}: the raw records' sums");
        assert!(edges.sums.iter().any(|s| matches!(s.peer, flows::Peer::Group(ref g) if g == "corp")));
        assert!(edges.sums.iter().any(|s| s.peer == flows::Peer::Other));
        assert!(edges.sums.iter().any(|s| matches!(s.peer, flows::Peer::Labelled(ref l) if !l.is_empty())));
        edges
    };
    let queued = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM flow_edge_pending").fetch_one(&db.pool).await.unwrap()
    };
    let labels = labels_now().await;
    check("nothing summed", &labels).await;
    assert!(flows::roll_up(&db.pool, at(BASE + 2 * 3_600_000)).await.unwrap() > 0);
    check("two hours rolled up, nothing summed", &labels).await;
    let windows = queued().await;
    assert_eq!(flows::sum_edges(&db.pool).await.unwrap(), windows as u64, "every queued window");
    assert_eq!(flows::sum_edges(&db.pool).await.unwrap(), 0, "once");
    assert_eq!(queued().await, 0);
    check("everything summed", &labels).await;
    let late = proto::FlowWindow {
        policy_version: 1,
        ..window_at(
            BASE + 5 * 60_000,
            vec![flow(
                "192.0.2.77",
                "10.1.0.7",
                22,
                proto::FlowDecision::WouldBlock,
                9,
                (BASE + 5 * 60_000, BASE + 6 * 60_000),
            )],
        )
    };
    flows::ingest(&db.pool, dsts[2], &FlowWindow::try_from(&late).unwrap()).await.unwrap();
    check("a late window queued", &labels).await;

    // Beyond the bound, what is queued is left out and counted, never read in part.
    let bounded = flows::edges(&db.pool, from, to, 0).await.unwrap();
    assert_eq!(bounded.pending_left_out, 1);
    let summed: Vec<Raw> = sqlx::query_as(
        "SELECT matched_rule_id AS rule, peer_kind, peer_key, peer_labels, host(src_address) AS src, workload_id,
                host(dst_address) AS dst, dst_port, protocol, policy_version, decision, new_connections, packets,
                bytes, first_seen, last_seen
         FROM flow_records r WHERE NOT EXISTS (SELECT 1 FROM flow_edge_pending w
             WHERE w.workload_id = r.workload_id AND w.window_id = r.window_id AND w.window_start = r.window_start)",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(summed.len() + 1, raw(&db.pool, at(BASE), to).await.len());
    assert_eq!(edge_sums(&bounded), edge_oracle(&summed, &labels), "only the summed windows");

    // Relabelled after most of its flows were summed: those keep app=cache, the queued one
    // follows it, and is summed under it.
    innerwall_control_plane::foresight::commit(&db.pool, "test", "label", "cache", async |c| {
        Ok((
            authoring::edit_labels(c, dsts[2], 1, &["app=kv".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap();
    let app_of = |s: &flows::EdgeSum| s.destination.get("app").cloned().unwrap_or_default();
    let apps = |edges: &flows::Edges| edges.sums.iter().map(app_of).collect::<BTreeSet<_>>();
    let queued_app = flows::edges(&db.pool, from, to, flows::MAX_PENDING_RECORDS).await.unwrap();
    assert_eq!(flows::sum_edges(&db.pool).await.unwrap(), 1);
    let summed_app = flows::edges(&db.pool, from, to, flows::MAX_PENDING_RECORDS).await.unwrap();
    assert_eq!(edge_sums(&queued_app), edge_sums(&summed_app), "read queued or summed, the same sums");
    assert!(apps(&summed_app).contains("cache"), "the flows summed before keep app=cache");
    let kv: Vec<_> = summed_app.sums.iter().filter(|s| app_of(s) == "kv").collect();
    assert_eq!(kv.len(), 1, "the late window alone is under app=kv: {kv:?}");
    assert_eq!((kv[0].records, kv[0].connections), (1, 1));
    let truth = raw(&db.pool, at(BASE), to).await;
    let total = |sums: &EdgeSums| sums.values().fold((0, 0), |t, s| (t.0 + s.0, t.1 + s.1));
    assert_eq!(total(&edge_sums(&summed_app)), total(&edge_oracle(&truth, &labels)), "every record once");

    // An empty range is refused.
    let err = flows::edges(&db.pool, to, to, 1).await.unwrap_err().to_string();
    assert!(err.contains("is empty"), "{err}");
}

/// The first migration with the map's own queue of windows (0045).
const EDGE_QUEUE_MIGRATION: i64 = 45;

/// What a replica of the release before migration 0045 does with each roll-up batch, as far as
/// the map goes: it takes the queued windows that started before `$1` off the roll-up's queue and
/// adds their records to `flow_edge_hours` (destinations by their labels now) and their label
/// sets to `flow_label_sets`.
const PREVIOUS_RELEASE_ROLL_UP: &str = "
    WITH taken AS (
        DELETE FROM flow_pending_windows WHERE window_start < $1 RETURNING workload_id, window_id, window_start),
     records AS (SELECT r.* FROM taken t JOIN flow_records r USING (workload_id, window_id, window_start)),
     destinations AS (
        SELECT w.id AS workload_id,
               COALESCE(jsonb_object_agg(l.key, l.value) FILTER (WHERE l.key IS NOT NULL), '{}'::jsonb) AS labels
        FROM workloads w LEFT JOIN workload_labels l ON l.workload_id = w.id GROUP BY w.id),
     label_sets AS (
        INSERT INTO flow_label_sets (digest, labels)
        SELECT md5(labels::text)::uuid, labels FROM destinations
        UNION SELECT md5(peer_labels::text)::uuid, peer_labels FROM records WHERE peer_kind = 1
        ON CONFLICT DO NOTHING)
     INSERT INTO flow_edge_hours AS e (hour, dst_digest, peer_kind, peer_group, decision, records, new_connections)
     SELECT date_trunc('hour', r.window_start, 'UTC'), md5(d.labels::text)::uuid, r.peer_kind,
            CASE r.peer_kind WHEN 1 THEN md5(r.peer_labels::text)::uuid::text WHEN 2 THEN r.peer_key ELSE '' END,
            r.decision, count(*), sum(r.new_connections)
     FROM records r JOIN destinations d ON d.workload_id = r.workload_id
     GROUP BY 1, 2, 3, 4, 5
     ON CONFLICT (hour, dst_digest, peer_kind, peer_group, decision)
     DO UPDATE SET records = e.records + EXCLUDED.records,
                   new_connections = e.new_connections + EXCLUDED.new_connections";

/// Migration 0045's expand/contract: the edges the previous release summed with its roll-ups
/// stay, the windows it had not rolled up yet are queued for the edge job, and what a replica
/// of that release still adds with its roll-ups after the upgrade is dropped (those windows are
/// summed from the new queue): the map counts every record once across the upgrade.
#[tokio::test]
async fn map_edges_stay_exact_across_the_upgrade_to_their_queue() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    sqlx::raw_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public").execute(pool).await.unwrap();
    let all = &innerwall_control_plane::postgres::MIGRATOR;
    let before = sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Owned(
            all.iter().filter(|m| m.version < EDGE_QUEUE_MIGRATION).cloned().collect(),
        ),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    before.run(pool).await.unwrap();
    let (dsts, _) = estate(pool).await;
    ingest_hours(pool, &dsts, BASE, 3).await;
    let roll_up_before = async |horizon: i64| {
        sqlx::query(PREVIOUS_RELEASE_ROLL_UP).bind(at(horizon)).execute(pool).await.unwrap().rows_affected()
    };
    assert!(roll_up_before(BASE + 3_600_000).await > 0, "the first hour's edges, summed the old way");

    all.run(pool).await.unwrap();
    let edge_rows = async || -> Vec<String> {
        sqlx::query_scalar("SELECT e::text FROM flow_edge_hours e ORDER BY 1").fetch_all(pool).await.unwrap()
    };
    let summed_before = edge_rows().await;
    // A late window of the first hour, whose edge has a row there: the previous release would
    // add to it.
    let late = window_at(
        BASE + 5 * 60_000,
        vec![flow(
            "10.8.1.1",
            "10.1.0.7",
            443,
            proto::FlowDecision::Allowed,
            3,
            (BASE + 5 * 60_000, BASE + 6 * 60_000),
        )],
    );
    flows::ingest(pool, dsts[0], &FlowWindow::try_from(&late).unwrap()).await.unwrap();
    let first_hour = flows::edges(pool, at(BASE), at(BASE + 3_600_000), 0).await.unwrap();
    assert!(first_hour.sums.iter().any(|s| s.peer == flows::Peer::Group("corp".into())
        && s.decision == innerwall_wire::flows::Decision::Allowed
        && s.destination.get("app").map(String::as_str) == Some("db")));
    assert_eq!(roll_up_before(BASE + 2 * 3_600_000).await, 0, "the previous release adds no edges now");
    assert_eq!(edge_rows().await, summed_before, "nor adds to the edges there");
    let queued: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_edge_pending),
                (SELECT count(*) FROM flow_windows WHERE window_start >= $1)",
    )
    .bind(at(BASE + 3_600_000))
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(queued.0 > 0);
    assert_eq!(
        queued.0,
        queued.1 + 1,
        "the windows the previous release had not rolled up and the late one, queued once"
    );
    assert_eq!(flows::sum_edges(pool).await.unwrap(), queued.0 as u64);

    let ids: Vec<uuid::Uuid> = dsts.iter().map(|d| d.uuid()).collect();
    let labels = {
        let mut conn = pool.acquire().await.unwrap();
        innerwall_control_plane::policy::store::labels_of(&mut conn, &ids).await.unwrap()
    };
    let to = at(BASE + 3 * 3_600_000);
    let edges = flows::edges(pool, at(BASE), to, flows::MAX_PENDING_RECORDS).await.unwrap();
    assert_eq!(edges.pending_left_out, 0);
    assert_eq!(edge_sums(&edges), edge_oracle(&raw(pool, at(BASE), to).await, &labels), "every record once");
}

/// Creating a day's partitions locks each parent table exclusively in turn. While a reader holds
/// one of them (a records page holds `flow_records`, then reads `flow_windows`), creation must not
/// sit on the tables it already took: it gives them back within its lock timeout, so other readers
/// pass (and none is the victim of a deadlock), and it says busy rather than waiting without end.
#[tokio::test]
async fn partition_changes_yield_to_readers() {
    let db = fresh_database().await.unwrap();
    let day = chrono::Utc::now() + chrono::Duration::days(3);
    // A long read of flow_records, open throughout.
    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM flow_records LIMIT 0").execute(&mut *reader).await.unwrap();

    let creating = tokio::spawn({
        let pool = db.pool.clone();
        async move { flows::create_partitions(&pool, day, day).await }
    });
    // Creation has made the day's flow_windows partition and waits for flow_records.
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'flow_records'::regclass",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(!creating.is_finished(), "creation finished without waiting: {:?}", creating.await);
        tokio::task::yield_now().await;
    }
    // Another reader of flow_windows passes while the first is still open (the bound only guards
    // against a hang: without the lock timeout this waits for ever).
    let windows = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM flow_windows").fetch_one(&db.pool),
    )
    .await
    .expect("a reader of flow_windows queued behind a waiting partition change")
    .unwrap();
    assert_eq!(windows, 0);

    // Creation gives up, busy, with the first reader still open: it never made the day.
    let refused = creating.await.unwrap().expect_err("creation cannot take flow_records");
    assert_eq!(refused.kind(), innerwall_control_plane::error::Kind::Busy, "{refused}");
    let made: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("flow_windows_{}", day.format("%Y%m%d")))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(made, None, "the day's partitions came as a whole or not at all");

    // Once the reader is done, the same call makes them, and a second call finds them.
    reader.commit().await.unwrap();
    flows::create_partitions(&db.pool, day, day).await.unwrap();
    flows::create_partitions(&db.pool, day, day).await.unwrap();
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_' || $1")
        .bind(day.format("%Y%m%d").to_string())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(made, 7, "one partition of each of the seven flow tables");
}

/// PERF-8: an estate larger than one roll-up batch (in windows and in records) is rolled up in
/// several transactions whose cuts fall inside hours and days, and every table the job writes
/// then equals the raw records summed once: the rollups and the estate-wide rule rollups per key
/// (a key cut by a batch has a row per batch), the day sums and each key's last hour. The old
/// single statement wrote the same (compared on the rollup bench's 2 M-record estate); this
/// keeps the batched job honest. So does the map's edge job, in batches of its own: its edges
/// (destinations by their labels) and label sets equal the raw records summed once.
#[tokio::test]
async fn roll_up_in_batches_equals_the_raw_records_summed_once() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let start = at(BASE);
    let mut tx = pool.begin().await.unwrap();
    flows::ensure_partitions(&mut tx, start, start + chrono::Duration::days(3)).await.unwrap();
    tx.commit().await.unwrap();
    // 40 workloads (app=a0..a4), 60,000 windows of 1-7 records over two days, peers of all three
    // kinds, the workload peers with their labels then.
    sqlx::query(
        "INSERT INTO workloads (id, hostname) SELECT md5('w' || n)::uuid, 'host-' || n FROM generate_series(0, 39) n",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO workload_labels (workload_id, key, value)
         SELECT md5('w' || n)::uuid, 'app', 'a' || (n % 5) FROM generate_series(0, 39) n",
    )
    .execute(pool)
    .await
    .unwrap();
    let windows: i64 = 60_000;
    sqlx::query(
        "INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode,
             record_count, gap_count)
         SELECT md5('w' || (i % 40))::uuid, md5('x' || i)::uuid, $1::timestamptz + i * interval '2880 milliseconds',
                $1::timestamptz + i * interval '2880 milliseconds' + interval '60 seconds', 1 + i / 20000, 2,
                1 + i % 7, 0
         FROM generate_series(0, $2 - 1) i",
    )
    .bind(start)
    .bind(windows)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
             dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
             peer_kind, peer_key, peer_labels, ordinal)
         SELECT w.workload_id, w.window_id, w.window_start, w.policy_version,
                CASE WHEN k < 4 THEN '10.1.0.0'::inet + (k * 7 + i % 3) ELSE '198.51.100.0'::inet + (i % 50) END,
                '10.0.0.0'::inet + (i % 40), (ARRAY[22, 443, 5432, 8080, 53, 443, 22])[k + 1], 1 + k % 2,
                CASE WHEN k IN (1, 5) THEN 3 ELSE 2 END, CASE WHEN k IN (1, 5) THEN '' ELSE 'rule-' || k END,
                10 + rn, 1000 + rn, rn % 2, w.window_start + interval '1 second', w.window_start + interval '50 seconds',
                CASE WHEN k < 3 THEN 1 WHEN k = 3 THEN 2 ELSE 0 END,
                CASE WHEN k < 3 THEN md5('w' || ((i + k) % 40))::uuid::text WHEN k = 3 THEN 'corp'
                     ELSE host('198.51.100.0'::inet + (i % 50)) END,
                CASE WHEN k < 3 THEN jsonb_build_object('app', 'a' || ((i + k + i / 30000) % 5)) ELSE '{}' END,
                rn
         FROM (SELECT i, md5('w' || (i % 40))::uuid AS workload_id, md5('x' || i)::uuid AS window_id,
                      $1::timestamptz + i * interval '2880 milliseconds' AS window_start, 1 + i / 20000 AS policy_version
               FROM generate_series(0, $2 - 1) i) w,
              generate_series(0, i % 7) rn, LATERAL (SELECT (i + rn) % 7 AS k) key",
    )
    .bind(start)
    .bind(windows)
    .execute(pool)
    .await
    .unwrap();
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM flow_records").fetch_one(pool).await.unwrap();
    assert!(
        windows > flows::ROLLUP_BATCH_WINDOWS && records > flows::ROLLUP_BATCH_RECORDS,
        "several batches"
    );
    // Every window inserted is queued once. The queue's index on the slice is on the job's very
    // spelling of a slice (so Postgres keeps statistics for it), and a slice's oldest windows are
    // read in order from an index, not every queued window sorted (as when the planner guessed 1
    // window in 200 passes the slice's condition).
    for queue in ["flow_pending_windows", "flow_edge_pending"] {
        let queued: (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT (workload_id, window_id)) FROM {queue}"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(queued, (windows, windows), "{queue}");
    }
    assert!(
        windows > flows::EDGE_BATCH_WINDOWS && records > flows::EDGE_BATCH_RECORDS,
        "several edge batches"
    );
    let index: String =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE indexname = 'flow_pending_windows_slice'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(index.contains(flows::PENDING_SLICE), "{index}");
    sqlx::query("ANALYZE flow_pending_windows").execute(pool).await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN SELECT window_id FROM flow_pending_windows
         WHERE window_start < now() AND {} = 1 ORDER BY window_start LIMIT 100",
        flows::PENDING_SLICE
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        !plan.iter().any(|line| line.contains("Sort") || line.contains("Seq Scan")),
        "read in order from an index:\n{}",
        plan.join("\n")
    );

    let rolled = flows::roll_up(pool, start + chrono::Duration::days(3)).await.unwrap();
    assert_eq!(rolled, windows as u64, "every window, once");
    assert_eq!(flows::roll_up(pool, start + chrono::Duration::days(3)).await.unwrap(), 0);
    let queued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_pending_windows").fetch_one(pool).await.unwrap();
    assert_eq!(queued, 0, "off the queue once rolled up");
    let summed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_edge_hours").fetch_one(pool).await.unwrap();
    assert_eq!(summed, 0, "the roll-up sums no edges");
    assert_eq!(flows::sum_edges(pool).await.unwrap(), windows as u64, "every window, once");
    assert_eq!(flows::sum_edges(pool).await.unwrap(), 0);
    let queued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_edge_pending").fetch_one(pool).await.unwrap();
    assert_eq!(queued, 0, "off the edges' queue once summed");

    // Each pair of queries must hold the same rows; the count of rows in one and not the other.
    let differ = async |what: &str, ours: &str, truth: &str| {
        let sql = format!(
            "SELECT (SELECT count(*) FROM (({ours}) EXCEPT ALL ({truth})) a)
                                + (SELECT count(*) FROM (({truth}) EXCEPT ALL ({ours})) b)"
        );
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap();
        assert_eq!(n, 0, "{what}: rows differ from the raw records summed");
    };
    let key = "workload_id, policy_version, decision, matched_rule_id, peer_kind, peer_key, peer_labels, \
               src_address, dst_address, dst_port, protocol";
    differ(
        "flow_rollups",
        &format!("SELECT hour, {key}, sum(records), sum(new_connections), sum(packets), sum(bytes), min(first_seen),
                         max(last_seen) FROM flow_rollups GROUP BY hour, {key}"),
        &format!("SELECT date_trunc('hour', window_start, 'UTC') AS hour, {key}, count(*), sum(new_connections),
                         sum(packets), sum(bytes), min(first_seen), max(last_seen) FROM flow_records GROUP BY 1, {key}"),
    )
    .await;
    differ(
        "flow_rule_rollups",
        "SELECT hour, policy_version, decision, matched_rule_id, sum(records), sum(new_connections), sum(packets),
                sum(bytes), min(first_seen), max(last_seen) FROM flow_rule_rollups GROUP BY 1, 2, 3, 4",
        "SELECT date_trunc('hour', window_start, 'UTC'), policy_version, decision, matched_rule_id, count(*),
                sum(new_connections), sum(packets), sum(bytes), min(first_seen), max(last_seen)
         FROM flow_records GROUP BY 1, 2, 3, 4",
    )
    .await;
    let flow_key =
        "workload_id, src_address, peer_kind, peer_key, md5(peer_labels::text)::uuid, dst_port, protocol";
    differ(
        "flow_key_days",
        "SELECT day, workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, records,
                new_connections, first_seen, last_seen FROM flow_key_days",
        &format!(
            "SELECT date_trunc('day', window_start, 'UTC'), {flow_key}, count(*), sum(new_connections),
                         min(first_seen), max(last_seen) FROM flow_records GROUP BY 1, {flow_key}"
        ),
    )
    .await;
    differ(
        "flow_key_lasts",
        "SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, last_hour
         FROM flow_key_lasts",
        &format!("SELECT {flow_key}, max(date_trunc('hour', window_start, 'UTC')) FROM flow_records GROUP BY {flow_key}"),
    )
    .await;
    let destinations =
        "SELECT w.id, COALESCE(jsonb_object_agg(l.key, l.value) FILTER (WHERE l.key IS NOT NULL),
                                              '{}'::jsonb) AS labels
                        FROM workloads w LEFT JOIN workload_labels l ON l.workload_id = w.id GROUP BY w.id";
    differ(
        "flow_edge_hours",
        "SELECT hour, dst_digest, peer_kind, peer_group, decision, records, new_connections FROM flow_edge_hours",
        &format!("SELECT date_trunc('hour', r.window_start, 'UTC'), md5(d.labels::text)::uuid, r.peer_kind,
                         CASE r.peer_kind WHEN 1 THEN md5(r.peer_labels::text)::uuid::text
                                          WHEN 2 THEN r.peer_key ELSE '' END,
                         r.decision, count(*), sum(r.new_connections)
                  FROM flow_records r JOIN ({destinations}) d ON d.id = r.workload_id GROUP BY 1, 2, 3, 4, 5"),
    )
    .await;
    differ(
        "flow_label_sets",
        "SELECT digest, labels FROM flow_label_sets",
        &format!(
            "SELECT md5(labels::text)::uuid, labels FROM ({destinations}) d
                  UNION SELECT md5(peer_labels::text)::uuid, peer_labels FROM flow_records WHERE peer_kind = 1
                  -- Migration 0033's empty set.
                  UNION SELECT md5('{{}}'::jsonb::text)::uuid, '{{}}'::jsonb"
        ),
    )
    .await;
}
