//! PERF-7: flow ingest into Postgres (target ≥ 100,000 records/s). Registers a workload, 50 peer
//! workloads and two nested address groups, then ingests windows of 10,000 records (10,000
//! distinct sources: 50 of them workloads, 256 address-group members, the rest bare addresses)
//! through the same validate + ingest path the telemetry RPC uses: first one agent's windows one
//! after another (the time of each window printed), then four agents uploading at once, as a
//! fleet's windows arrive. Prints records/s for both.
//!
//! The figure that counts is measured on a private server with the settings the embedded
//! production cluster runs with (durable: `fsync`, `synchronous_commit`, `full_page_writes` on).
//! The test harness's server turns those off, which flatters ingest; its figure is printed
//! second, for comparison only.
//!
//! Run with `cargo bench -p innerwall-control-plane --bench ingest`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Instant;

use anyhow::bail;
use innerwall_control_plane::flows;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::{AddressGroupSpec, NewWorkload};
use innerwall_control_plane::postgres;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;
use innerwall_wire::proto;
use sqlx::PgPool;

#[path = "shared/production_server.rs"]
mod production_server;
use production_server::ProductionServer;

const WINDOWS: i64 = 10;

/// Windows each agent uploads: [`WINDOWS`], or 2 with `INNERWALL_BENCH_QUICK` (a smoke run).
fn windows() -> i64 {
    if std::env::var_os("INNERWALL_BENCH_QUICK").is_some() { 2 } else { WINDOWS }
}
const RECORDS: usize = 10_000;
/// Agents uploading at once in the concurrent run.
const AGENTS: usize = 4;

fn window(n: usize, start_ms: i64) -> proto::FlowWindow {
    let records = (0..n)
        .map(|i| {
            let allowed = i % 4 == 0;
            proto::FlowRecord {
                src_address: format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255),
                dst_address: "10.255.0.1".into(),
                dst_port: 1 + (i % 1000) as u32,
                protocol: proto::Protocol::Tcp.into(),
                decision: if allowed {
                    proto::FlowDecision::Allowed
                } else {
                    proto::FlowDecision::WouldBlock
                }
                .into(),
                matched_rule_id: if allowed { "allow-clients/tcp".into() } else { String::new() },
                packets: 10 + (i % 7) as u64,
                bytes: 600 + (i % 1500) as u64,
                new_connections: 1,
                first_seen_unix_ms: start_ms + 1 + (i % 30_000) as i64,
                last_seen_unix_ms: start_ms + 30_001 + (i % 30_000) as i64,
                ..Default::default()
            }
        })
        .collect();
    proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start_ms,
        end_unix_ms: start_ms + 60_000,
        policy_version: 1,
        mode: proto::EnforcementMode::Simulation.into(),
        records,
        gaps: vec![proto::EvidenceGap {
            kind: 1,
            from_unix_ms: start_ms,
            to_unix_ms: start_ms + 10,
            count: 3,
            detail: String::new(),
        }],
    }
}

async fn register(pool: &PgPool, new: &NewWorkload) -> anyhow::Result<()> {
    innerwall_control_plane::foresight::commit(pool, "bench", "register", "bench", async |c| {
        authoring::register_workload(c, new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await?;
    Ok(())
}

/// Registers 50 peer workloads and two nested address groups the sources resolve to.
async fn setup_peers(pool: &PgPool) -> anyhow::Result<()> {
    for i in 0..50u8 {
        register(
            pool,
            &NewWorkload {
                id: WorkloadId::new_random(),
                hostname: format!("peer-{i}"),
                labels: vec![format!("app=p{i}").parse()?, "env=prod".parse()?],
                addresses: BTreeSet::from([format!("10.0.0.{i}").parse::<IpAddr>()?]),
            },
        )
        .await?;
    }
    // Nested groups: 10.0.32.128/26 resolves to the more specific one.
    for (name, cidr) in [("lab", "10.0.32.0/24"), ("lab-db", "10.0.32.128/26")] {
        let spec = AddressGroupSpec {
            name: name.into(),
            description: String::new(),
            cidrs: BTreeSet::from([Cidr::parse(cidr)?]),
        };
        innerwall_control_plane::foresight::commit(pool, "bench", "group", name, async |c| {
            authoring::create_address_group(c, &spec).await?;
            Ok(((), serde_json::json!({})))
        })
        .await?;
    }
    Ok(())
}

/// Registers an uploading workload (an agent's host).
async fn uploader(pool: &PgPool, n: usize) -> anyhow::Result<WorkloadId> {
    let id = WorkloadId::new_random();
    let labels = vec!["app=db".parse()?];
    register(pool, &NewWorkload { id, hostname: format!("db-{n}"), labels, addresses: BTreeSet::new() })
        .await?;
    // The version its windows claim, installed before them (as its agent's ack would record).
    let since = chrono::Utc::now() - chrono::Duration::hours(1);
    innerwall_control_plane::testing::installed(
        pool,
        id,
        &[(1, innerwall_wire::policy::Mode::Simulation, since)],
    )
    .await?;
    Ok(id)
}

/// One agent's uploads, one after another; prints each window's time when `verbose`.
async fn upload(pool: PgPool, id: WorkloadId, verbose: bool) -> anyhow::Result<usize> {
    let now = chrono::Utc::now().timestamp_millis();
    let wires: Vec<_> = (0..windows()).map(|w| window(RECORDS, now - 600_000 + w * 60_000)).collect();
    let mut total = 0;
    for (w, wire) in wires.iter().enumerate() {
        let t = Instant::now();
        let valid = innerwall_wire::flows::FlowWindow::try_from(wire)?;
        let done = flows::ingest(&pool, id, &valid).await?;
        if done.duplicate || done.records != RECORDS {
            bail!("window {w} was not stored whole: {done:?}");
        }
        total += done.records;
        if verbose {
            println!(
                "  window {w}: {:>6} records in {:>6.1} ms",
                done.records,
                t.elapsed().as_secs_f64() * 1000.0
            );
        }
    }
    Ok(total)
}

/// One agent uploading its windows; returns records/s.
async fn sequential(pool: &PgPool) -> anyhow::Result<f64> {
    let id = uploader(pool, 0).await?;
    let started = Instant::now();
    let total = upload(pool.clone(), id, true).await?;
    let secs = started.elapsed().as_secs_f64();
    let rate = total as f64 / secs;
    println!("  one agent: {total} records in {secs:.2} s: {rate:.0} records/s");
    Ok(rate)
}

/// `agents` agents uploading at the same time, as a fleet's windows arrive; returns records/s.
async fn concurrent(pool: &PgPool, agents: usize) -> anyhow::Result<f64> {
    let mut ids = Vec::new();
    for n in 1..=agents {
        ids.push(uploader(pool, n).await?);
    }
    let started = Instant::now();
    let tasks: Vec<_> = ids.into_iter().map(|id| tokio::spawn(upload(pool.clone(), id, false))).collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let rate = total as f64 / secs;
    println!(
        "  {agents} agents at once: {total} records in {secs:.2} s ({:.1} ms per window): {rate:.0} records/s",
        secs * 1000.0 / (agents as f64 * windows() as f64)
    );
    Ok(rate)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!("PERF-7 flow ingest (target ≥ 100,000 records/s), {} windows of {RECORDS} records", windows());

    println!("production settings (durable; the PERF-7 figure):");
    let server = ProductionServer::start().await?;
    let pool = postgres::connect(&server.url).await?;
    for setting in ["fsync", "synchronous_commit", "full_page_writes"] {
        let value: String =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}"))).fetch_one(&pool).await?;
        anyhow::ensure!(value == "on", "{setting} is {value}: the bench server must run durable");
    }
    let production = async {
        setup_peers(&pool).await?;
        Ok::<_, anyhow::Error>((sequential(&pool).await?, concurrent(&pool, AGENTS).await?))
    }
    .await;
    pool.close().await;
    server.stop()?;
    let (one, many) = production?;

    println!("test-harness server (fsync, synchronous_commit, full_page_writes off; comparison only):");
    let db = fresh_database().await?;
    setup_peers(&db.pool).await?;
    sequential(&db.pool).await?;

    println!(
        "PERF-7 with production settings: {one:.0} records/s from one agent, {many:.0} records/s from {AGENTS} agents at once"
    );
    let context = format!("{{\"windows\":{},\"records_per_window\":{RECORDS}}}", windows());
    println!(
        "FIGURE {{\"id\":\"PERF-7\",\"name\":\"ingest, one agent\",\"value\":{one:.0},\"unit\":\"records/s\",\"goal\":{{\"op\":\">=\",\"bound\":100000}},\"context\":{context}}}"
    );
    println!(
        "FIGURE {{\"id\":\"PERF-7\",\"name\":\"ingest, {AGENTS} agents at once\",\"value\":{many:.0},\"unit\":\"records/s\",\"goal\":null,\"context\":{context}}}"
    );
    Ok(())
}
