//! Flow storage against real Postgres: daily partitions and retention by dropping them (FLOW-5).

use std::collections::BTreeSet;

use innerwall_control_plane::authoring::{self, NewWorkload};
use innerwall_control_plane::flows;
use innerwall_control_plane::testing::fresh_database;
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
        gaps: vec![proto::EvidenceGap { kind: 2, from_unix_ms: 0, to_unix_ms: 1, count: 0 }],
    };
    flows::ingest(&db.pool, id, &flows::validate(&wire).unwrap()).await.unwrap();
    let partitions = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relkind = 'r' ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let day = (now - chrono::Duration::seconds(60)).format("%Y%m%d").to_string();
    assert_eq!(partitions().await, [format!("flow_gaps_{day}"), format!("flow_records_{day}")]);

    // Within retention nothing goes; 31 days later the whole day's partitions are dropped.
    assert_eq!(flows::apply_retention(&db.pool, 30, now).await.unwrap(), Vec::<String>::new());
    let dropped = flows::apply_retention(&db.pool, 30, now + chrono::Duration::days(32)).await.unwrap();
    assert_eq!(dropped, [format!("flow_gaps_{day}"), format!("flow_records_{day}")]);
    assert!(partitions().await.is_empty());
    let windows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_windows").fetch_one(&db.pool).await.unwrap();
    assert_eq!(windows, 0);
}
