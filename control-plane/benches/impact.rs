//! PERF-9: the impact of a one-ruleset change on an estate of 1,000 workloads with 7 days of
//! flows (about 10 M records, rolled up): p95 of `foresight::impact` (goal < 2 s); with
//! `INNERWALL_BENCH_DAYS=30`, 30 days of flows at the same rate (about 43 M records; goal
//! < 10 s). Every
//! workload applied version 1 of a policy admitting postgres and https from the estate's peers
//! and ssh from the corporate group; the change narrows the https ruleset's peers and adds a
//! range, so every workload's proposed policy differs from its applied one and is listed; the
//! flow keys the changed ruleset can match (tcp 443 and 8080 from 10.1.0.0/16 or 192.0.2.0/24) are
//! replayed, the others counted (`flow_key_lasts`, migration 0034). Flows are loaded as the `rollup` bench loads them (direct server-side inserts,
//! then `flows::roll_up` and `VACUUM ANALYZE`); policies are stored as a render stores them
//! (contents by digest, history rows, the applied version).
//!
//! `INNERWALL_BENCH_QUICK=1` runs 100 workloads and 100,000 records (it proves the bench works;
//! its figure judges nothing); `INNERWALL_BENCH_RECORDS` sets the records at full size.
//! `INNERWALL_BENCH_KEEP=1` with `INNERWALL_TEST_DATABASE_URL` leaves the loaded database on that
//! server (its URL is printed) to look at plans with `EXPLAIN`; `INNERWALL_BENCH_REUSE=<url>`
//! measures such a database again without loading it (the load and roll-up take minutes).
//! Run with `cargo bench -p innerwall-control-plane --bench impact` or `cargo xtask bench impact`.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::foresight::{self, Range};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};
use innerwall_wire::testing::rule;
use sqlx::PgPool;

#[path = "shared/flow_estate.rs"]
mod flow_estate;
use flow_estate::RECORDS_PER_WINDOW;

/// The ranges PERF-9 sets goals for: (days of flows, p95 goal in ms).
const RANGES: [(i64, u64); 2] = [(7, 2_000), (30, 10_000)];
/// Records a day at full size: 10 M a week.
const RECORDS_PER_DAY: i64 = 10_000_000 / 7;

/// The applied policy (version 1) and the proposed one after the https ruleset changed.
fn policies() -> (WorkloadPolicy, WorkloadPolicy) {
    let db = rule("db", Protocol::Tcp, &[5432, 3306], &["10.1.0.0/16"]);
    let ssh = rule("ssh", Protocol::Tcp, &[22], &["172.16.0.0/12"]);
    let https = rule("https", Protocol::Tcp, &[443, 8080], &["10.1.0.0/16"]);
    let narrowed = rule("https", Protocol::Tcp, &[443, 8080], &["10.1.0.0/26", "192.0.2.0/24"]);
    let applied = WorkloadPolicy::new(1, Mode::Simulation, [db.clone(), ssh.clone(), https]).unwrap();
    let proposed = WorkloadPolicy::new(2, Mode::Simulation, [db, ssh, narrowed]).unwrap();
    (applied, proposed)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = std::env::var_os("INNERWALL_BENCH_QUICK").is_some();
    let days: i64 = match std::env::var("INNERWALL_BENCH_DAYS") {
        Ok(text) => text.parse()?,
        Err(_) => 7,
    };
    let Some(&(days, goal)) = RANGES.iter().find(|(d, _)| *d == days) else {
        anyhow::bail!("INNERWALL_BENCH_DAYS is one of {RANGES:?}'s day counts, not {days}");
    };
    let (workloads, default_records, runs) =
        if quick { (100, 100_000, 3) } else { (1_000, RECORDS_PER_DAY * days, 5) };
    let records: i64 = match std::env::var("INNERWALL_BENCH_RECORDS") {
        Ok(text) => text.parse()?,
        Err(_) => default_records,
    };
    let windows = (records / RECORDS_PER_WINDOW).max(workloads);
    println!(
        "PERF-9 impact of a one-ruleset change (target p95 < {goal} ms): {} records in {windows} windows, {workloads} workloads, {days} days",
        windows * RECORDS_PER_WINDOW
    );
    if let Ok(url) = std::env::var("INNERWALL_BENCH_REUSE") {
        // A database an earlier run kept: its range starts at its first window.
        let pool = PgPool::connect(&url).await?;
        let first: DateTime<Utc> =
            sqlx::query_scalar("SELECT min(window_start) FROM flow_windows").fetch_one(&pool).await?;
        println!("reusing {url}, its range ending {}:", first + TimeDelta::days(days));
        let (workloads, records): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM workloads), (SELECT sum(record_count)::bigint FROM flow_windows)",
        )
        .fetch_one(&pool)
        .await?;
        let range = Range { from: first, to: first + TimeDelta::days(days) };
        return measure(&pool, range, goal, workloads, runs, records).await;
    }
    let (pool, _guard) = flow_estate::database().await?;
    let now = Utc::now();
    let t = Instant::now();
    flow_estate::load(&pool, now - TimeDelta::days(days), days, windows, workloads).await?;
    let (applied, _) = policies();
    flow_estate::store_policies(&pool, &applied).await?;
    let rolled = flows::roll_up(&pool, now).await?;
    flow_estate::vacuum_analyze(&pool).await?;
    println!("loaded and rolled up ({rolled} windows) in {:.1} s", t.elapsed().as_secs_f64());
    let range = Range { from: now - TimeDelta::days(days), to: now };
    measure(&pool, range, goal, workloads, runs, windows * RECORDS_PER_WINDOW).await
}

/// Times `runs` impacts (after one warm-up) over `range` and prints the figures against `goal`
/// (ms).
async fn measure(
    pool: &PgPool,
    range: Range,
    goal: u64,
    workloads: i64,
    runs: usize,
    records: i64,
) -> anyhow::Result<()> {
    let (_, proposed) = policies();
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM workloads").fetch_all(pool).await?;
    let proposal: BTreeMap<WorkloadId, WorkloadPolicy> = ids
        .into_iter()
        .map(|id| (WorkloadId::from_uuid(id).expect("a workload id"), proposed.clone()))
        .collect();
    let mut times = Vec::new();
    let mut conn = pool.acquire().await?;
    for run in 0..runs + 1 {
        let t = Instant::now();
        let impact = foresight::impact(&mut conn, &proposal, range, 10).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if run == 0 {
            let blocked: u64 = impact.newly_blocked();
            let allowed: u64 = impact.workloads.iter().map(|w| w.replayed.newly_allowed).sum();
            println!(
                "  {} workloads listed, {} flow keys in the range: {blocked} newly blocked, {allowed} newly allowed (warm-up {ms:.0} ms)",
                impact.workloads.len(),
                impact.keys
            );
            assert_eq!(impact.workloads.len() as i64, workloads, "every workload's policy changes");
            assert!(blocked > 0, "the narrowed ruleset blocks some recorded https flows");
        } else {
            times.push(ms);
        }
    }
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() as f64 * p).ceil() as usize).saturating_sub(1)];
    let (p50, p95) = (pct(0.50), pct(0.95));
    let days = (range.to - range.from).num_days();
    println!(
        "PERF-9: impact p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs, {days} days (target < {goal} ms)"
    );
    println!(
        "FIGURE {{\"id\":\"PERF-9\",\"name\":\"impact p95, {days} days\",\"value\":{p95:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":{goal}}},\"context\":{{\"workloads\":{workloads},\"records\":{records}}}}}"
    );
    Ok(())
}
