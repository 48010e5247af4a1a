//! PERF-7: flow ingest into Postgres (target ≥ 100,000 records/s). Starts a private Postgres
//! (the test harness), registers a workload and a few peers, and ingests windows of 10,000
//! records through the same validate + ingest path the telemetry RPC uses. Prints records/s.
//! Run with `cargo bench -p innerwall-control-plane --bench ingest`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Instant;

use innerwall_control_plane::authoring::{self, NewWorkload};
use innerwall_control_plane::flows;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;

fn window(n: usize, start_ms: i64) -> proto::FlowWindow {
    let records = (0..n)
        .map(|i| proto::FlowRecord {
            src_address: format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255),
            dst_address: "10.255.0.1".into(),
            dst_port: 1 + (i % 1000) as u32,
            protocol: proto::Protocol::Tcp.into(),
            decision: proto::FlowDecision::WouldBlock.into(),
            matched_rule_id: String::new(),
            packets: 10,
            bytes: 600,
            new_connections: 1,
            first_seen_unix_ms: start_ms + 1,
            last_seen_unix_ms: start_ms + 2,
        })
        .collect();
    proto::FlowWindow {
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start_ms,
        end_unix_ms: start_ms + 60_000,
        policy_version: 1,
        mode: proto::EnforcementMode::Simulation.into(),
        records,
        gaps: vec![],
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let db = fresh_database().await?;
    let id = WorkloadId::new_random();
    let new = NewWorkload {
        id,
        hostname: "bench".into(),
        labels: vec!["app=db".parse()?],
        addresses: BTreeSet::new(),
    };
    authoring::commit(&db.pool, "bench", "register", "bench", async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await?;
    for i in 0..50u8 {
        let peer = NewWorkload {
            id: WorkloadId::new_random(),
            hostname: format!("peer-{i}"),
            labels: vec![format!("app=p{i}").parse()?],
            addresses: BTreeSet::from([format!("10.0.0.{i}").parse::<IpAddr>()?]),
        };
        authoring::commit(&db.pool, "bench", "register", "peer", async |c| {
            authoring::register_workload(c, &peer).await?;
            Ok(((), serde_json::json!({})))
        })
        .await?;
    }
    println!("PERF-7 flow ingest (target ≥ 100,000 records/s), windows of 10,000 records");
    let now = chrono::Utc::now().timestamp_millis();
    let mut total = 0usize;
    let started = Instant::now();
    for w in 0..10 {
        let wire = window(10_000, now - 600_000 + w * 60_000);
        let t = Instant::now();
        let valid = flows::validate(&wire).map_err(anyhow::Error::msg)?;
        let done = flows::ingest(&db.pool, id, &valid).await?;
        total += done.records;
        println!(
            "  window {w}: {:>6} records in {:>6.1} ms",
            done.records,
            t.elapsed().as_secs_f64() * 1000.0
        );
    }
    let secs = started.elapsed().as_secs_f64();
    println!("ingested {total} records in {secs:.2} s: {:.0} records/s", total as f64 / secs);
    Ok(())
}
