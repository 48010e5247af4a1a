//! PERF-8: review rollups over 10 M flow records (target p95 < 200 ms). 1,000 workloads report
//! over the last 30 days, each from a stable handful of peers (other workloads with their labels,
//! a group, bare addresses) on a few services, allowed or would-block, under policy versions that
//! advance over time. Prints the p50/p95 of each grouping's first page (100 rows) for one
//! workload scope (a selector matching 20 workloads, resolved now) over 24 h, the whole estate
//! over 1 h and the whole estate over 24 h: first with nothing rolled up yet (every record read
//! raw), then after `flows::roll_up` and `flows::sum_edges` (the map's edges, which the roll-up
//! summed until migration 0045; each timed: records/s).
//!
//! Setup loads the tables directly with server-side `INSERT … SELECT generate_series` (workloads,
//! labels, windows with their totals, records with their peers as ingest resolves them), not
//! through ingest: 10 M records through ingest would take minutes and measure PERF-7 instead.
//! Then `VACUUM ANALYZE`, as autovacuum would. Runs on the test harness's server (not durable; reads are
//! what is measured).
//!
//! `INNERWALL_BENCH_RECORDS` sets the size (default 10,000,000; e.g. 200000 for a quick check), in
//! windows of 7 records; `INNERWALL_BENCH_WINDOWS` sets the number of windows instead and
//! `INNERWALL_BENCH_RECORDS_PER_WINDOW` their records (e.g. 10,000,000 windows of 1 record, the
//! "10 M windows" of PERF-8 in a size this machine's disk holds). `INNERWALL_BENCH_DAYS` (1 to 30,
//! default 30) sets the days the windows spread over, and so how often a workload reports: the
//! default 10 M records over 1 day is a window a minute from each workload, as agents report (over
//! 30 days, one every 30 minutes). The roll-up's records/s, both jobs' together (they run one
//! after the other each minute: the records over the sum of their times), is printed as a figure
//! of its own (goal ≥ 200,000), with the records each rollup row sums: what the job writes is
//! rows, and a workload's keys repeat the more often it reports.
//! `INNERWALL_BENCH_KEEP=1` with `INNERWALL_TEST_DATABASE_URL` leaves the loaded database on that
//! server (its URL is printed) to look at plans with `EXPLAIN`; `INNERWALL_BENCH_REUSE=<url>`
//! measures such a database again without loading it, first rolling up (timed) whatever windows
//! it has pending.
//! Run with `cargo bench -p innerwall-control-plane --bench rollup`.

use std::collections::BTreeSet;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_control_plane::flows::{self, Grouping, PageRequest, RollupFilter};
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;

#[path = "shared/flow_estate.rs"]
mod flow_estate;
use flow_estate::RECORDS_PER_WINDOW;

const WORKLOADS: i64 = 1_000;
/// The days the estate spans unless `INNERWALL_BENCH_DAYS` says otherwise.
const DAYS: i64 = 30;
/// Timed runs per query (after two warm-up runs).
const RUNS: usize = 25;

struct Case {
    name: &'static str,
    scope: Option<&'static str>,
    hours: i64,
}

const CASES: [Case; 3] = [
    Case { name: "scope app=a7 (20 workloads), 24 h", scope: Some("app=a7"), hours: 24 },
    Case { name: "whole estate, 1 h", scope: None, hours: 1 },
    Case { name: "whole estate, 24 h", scope: None, hours: 24 },
];

/// p50 and p95 in ms of one case and grouping; the scope is resolved in each run (as the CLI does).
async fn measure(
    pool: &PgPool,
    case: &Case,
    by: Grouping,
    now: DateTime<Utc>,
) -> anyhow::Result<(f64, f64, usize)> {
    let mut times = Vec::new();
    let mut rows = 0;
    for run in 0..RUNS + 2 {
        let t = Instant::now();
        let mut filter = RollupFilter::range(now - TimeDelta::hours(case.hours), now);
        if let Some(scope) = case.scope {
            let ids: BTreeSet<WorkloadId> = flows::workloads_in(pool, &flows::parse_selector(scope)?).await?;
            filter = filter.within(ids);
        }
        let page = flows::rollup(pool, by, &filter, &PageRequest::first(100)).await?;
        if run >= 2 {
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        rows = page.rows.len();
    }
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() as f64 * p).ceil() as usize).saturating_sub(1)];
    Ok((pct(0.50), pct(0.95), rows))
}

async fn report(pool: &PgPool, now: DateTime<Utc>) -> anyhow::Result<Vec<f64>> {
    let mut p95s = Vec::new();
    for case in &CASES {
        println!("  {}:", case.name);
        for by in Grouping::ALL {
            let (p50, p95, rows) = measure(pool, case, by, now).await?;
            println!(
                "    {:<13} p50 {p50:>7.1} ms  p95 {p95:>7.1} ms  ({rows} rows on the first page)",
                by.name()
            );
            p95s.push(p95);
        }
    }
    Ok(p95s)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let records: i64 = match std::env::var("INNERWALL_BENCH_RECORDS") {
        Ok(text) => text.parse()?,
        Err(_) => 10_000_000,
    };
    let per_window: i64 = match std::env::var("INNERWALL_BENCH_RECORDS_PER_WINDOW") {
        Ok(text) => text.parse()?,
        Err(_) => RECORDS_PER_WINDOW,
    };
    anyhow::ensure!(per_window >= 1, "INNERWALL_BENCH_RECORDS_PER_WINDOW must be at least 1");
    let windows = match std::env::var("INNERWALL_BENCH_WINDOWS") {
        Ok(text) => text.parse::<i64>()?,
        Err(_) => records / per_window,
    }
    .max(WORKLOADS);
    let days: i64 = match std::env::var("INNERWALL_BENCH_DAYS") {
        Ok(text) => text.parse()?,
        Err(_) => DAYS,
    };
    anyhow::ensure!((1..=DAYS).contains(&days), "INNERWALL_BENCH_DAYS must be 1 to {DAYS}");
    println!(
        "PERF-8 review rollups (target p95 < 200 ms): {} records in {windows} windows of {per_window}, {WORKLOADS} workloads, {days} days",
        windows * per_window
    );
    if let Ok(url) = std::env::var("INNERWALL_BENCH_REUSE") {
        // A database an earlier run kept: measure its rollups again, as of its latest window.
        // The control plane's pool settings (no JIT, as a replica's job runs).
        let pool = innerwall_control_plane::postgres::pool_options().connect(&url).await?;
        let latest: DateTime<Utc> =
            sqlx::query_scalar("SELECT max(window_start) FROM flow_windows").fetch_one(&pool).await?;
        let t = Instant::now();
        let rolled = flows::roll_up(&pool, Utc::now()).await?;
        let summed = flows::sum_edges(&pool).await?;
        if rolled > 0 || summed > 0 {
            // Kept before its roll-up (e.g. a copy of a loaded database reset to nothing rolled up).
            let secs = t.elapsed().as_secs_f64();
            let (records, rows): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT sum(record_count)::bigint FROM flow_windows), (SELECT count(*) FROM flow_rollups)",
            )
            .fetch_one(&pool)
            .await?;
            println!(
                "roll_up and sum_edges: {rolled} and {summed} windows pending, done in {secs:.1} s, \
                 {rows} rollup rows ({records} records in the database: {:.0} records/s if all were pending)",
                records as f64 / secs
            );
        }
        println!("reusing {url}, as of its latest window {latest}:");
        report(&pool, latest + TimeDelta::minutes(1)).await?;
        return Ok(());
    }
    let db = fresh_database().await?;
    let now = Utc::now();
    let t = Instant::now();
    flow_estate::load_with(&db.pool, now - TimeDelta::days(days), days, windows, WORKLOADS, per_window)
        .await?;
    println!("loaded in {:.1} s (direct inserts, see the header)", t.elapsed().as_secs_f64());

    println!("nothing rolled up yet (raw records only):");
    report(&db.pool, now).await?;

    let t = Instant::now();
    let rolled = flows::roll_up(&db.pool, now).await?;
    let secs = t.elapsed().as_secs_f64();
    let (rollup_rows, pending): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_rollups), (SELECT count(*) FROM flow_pending_windows)",
    )
    .fetch_one(&db.pool)
    .await?;
    let records_rolled = (rolled as i64 * per_window) as f64;
    let per_row = records_rolled / rollup_rows.max(1) as f64;
    println!(
        "roll_up: {rolled} windows ({:.0} records/s) into {rollup_rows} rollup rows ({per_row:.2} records a row) in {secs:.1} s; {pending} windows of the open hour left raw",
        records_rolled / secs
    );
    let t = Instant::now();
    let summed = flows::sum_edges(&db.pool).await?;
    let edge_secs = t.elapsed().as_secs_f64();
    let edge_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_edge_hours").fetch_one(&db.pool).await?;
    let records_summed = (summed as i64 * per_window) as f64;
    println!(
        "sum_edges: {summed} windows ({:.0} records/s) into {edge_rows} edge rows in {edge_secs:.1} s",
        records_summed / edge_secs
    );
    // Both jobs' time per record (each over every record it has to do): what keeping up with
    // ingest takes.
    let rate = 1.0 / (secs / records_rolled.max(1.0) + edge_secs / records_summed.max(1.0));
    flow_estate::vacuum_analyze(&db.pool).await?;

    println!("rolled up (closed hours from flow_rollups):");
    let p95s = report(&db.pool, now).await?;
    let worst = p95s.iter().copied().fold(0.0, f64::max);
    println!("PERF-8: worst p95 over every grouping and range, rolled up: {worst:.1} ms (target < 200 ms)");
    println!(
        "FIGURE {{\"id\":\"PERF-8\",\"name\":\"rollup worst p95\",\"value\":{worst:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":200}},\"context\":{{\"records\":{}}}}}",
        windows * per_window
    );
    println!(
        "FIGURE {{\"id\":\"PERF-8\",\"name\":\"roll-up and edge throughput\",\"value\":{rate:.0},\"unit\":\"records/s\",\"goal\":{{\"op\":\">=\",\"bound\":200000}},\"context\":{{\"records\":{},\"windows\":{windows},\"days\":{days},\"rollup_rows\":{rollup_rows}}}}}",
        windows * per_window
    );
    if std::env::var_os("INNERWALL_BENCH_KEEP").is_some() {
        println!("kept the database: {}", db.url);
        std::mem::forget(db);
    }
    Ok(())
}
