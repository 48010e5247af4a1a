//! PERF-10: suggested policy (`suggest::run`) for a 100-workload scope over 14 days of a
//! 1,000-workload estate (about 20 M records, rolled up; goal < 5 s), and for one workload over
//! 24 h (goal < 200 ms). The estate is the flow benches' (`shared/flow_estate.rs`): sources are
//! workloads labelled `app=a0..a49, env=prod`, a corporate group and bare addresses, on nine
//! ports; every workload applied version 1, which admits postgres and mysql from the workloads'
//! range, so the other ports' flows are what the runs generalise.
//!
//! `INNERWALL_BENCH_QUICK=1` runs 100 workloads and 100,000 records (it proves the bench works;
//! its figures judge nothing); `INNERWALL_BENCH_RECORDS` sets the records at full size;
//! `INNERWALL_BENCH_KEEP=1` / `INNERWALL_BENCH_REUSE=<url>` as the `impact` bench.
//! Run with `cargo bench -p innerwall-control-plane --bench suggest` or `cargo xtask bench suggest`.

use std::collections::BTreeSet;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::foresight::Range;
use innerwall_control_plane::suggest::{self, Request};
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};
use innerwall_wire::testing::rule;
use sqlx::PgPool;

#[path = "shared/flow_estate.rs"]
mod flow_estate;
use flow_estate::RECORDS_PER_WINDOW;

const DAYS: i64 = 14;

fn applied() -> WorkloadPolicy {
    let db = rule("db", Protocol::Tcp, &[5432, 3306], &["10.1.0.0/16"]);
    WorkloadPolicy::new(1, Mode::Simulation, [db]).unwrap()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = std::env::var_os("INNERWALL_BENCH_QUICK").is_some();
    let (workloads, default_records, runs) = if quick { (100, 100_000, 3) } else { (1_000, 20_000_000, 5) };
    let records: i64 = match std::env::var("INNERWALL_BENCH_RECORDS") {
        Ok(text) => text.parse()?,
        Err(_) => default_records,
    };
    let windows = (records / RECORDS_PER_WINDOW).max(workloads);
    println!(
        "PERF-10 suggested policy (targets: 100-workload scope over 14 days < 5000 ms; one workload over 24 h < 200 ms): {} records in {windows} windows, {workloads} workloads, {DAYS} days",
        windows * RECORDS_PER_WINDOW
    );
    if let Ok(url) = std::env::var("INNERWALL_BENCH_REUSE") {
        let pool = PgPool::connect(&url).await?;
        let first: DateTime<Utc> =
            sqlx::query_scalar("SELECT min(window_start) FROM flow_windows").fetch_one(&pool).await?;
        println!("reusing {url}, its range ending {}:", first + TimeDelta::days(DAYS));
        return measure(&pool, first + TimeDelta::days(DAYS), workloads, runs).await;
    }
    let db = fresh_database().await?;
    let now = Utc::now();
    let t = Instant::now();
    flow_estate::load(&db.pool, now - TimeDelta::days(DAYS), DAYS, windows, workloads).await?;
    flow_estate::store_policies(&db.pool, &applied()).await?;
    // One workload a scope can name alone.
    sqlx::query(
        "INSERT INTO workload_labels (workload_id, key, value) VALUES (md5('w0')::uuid, 'name', 'host-0')",
    )
    .execute(&db.pool)
    .await?;
    let rolled = flows::roll_up(&db.pool, now).await?;
    sqlx::query("VACUUM ANALYZE").execute(&db.pool).await?;
    println!("loaded and rolled up ({rolled} windows) in {:.1} s", t.elapsed().as_secs_f64());
    measure(&db.pool, now, workloads, runs).await?;
    if std::env::var_os("INNERWALL_BENCH_KEEP").is_some() {
        println!("kept the database: {}", db.url);
        std::mem::forget(db);
    }
    Ok(())
}

/// Times `runs` suggestion runs (after one warm-up) of each shape and prints the figures.
async fn measure(pool: &PgPool, now: DateTime<Utc>, workloads: i64, runs: usize) -> anyhow::Result<()> {
    // Five of the fifty apps: a tenth of the estate (100 workloads at 1,000).
    let shapes = [
        ("100-workload scope over 14 days", "app=a0|a1|a2|a3|a4", DAYS, 5000.0),
        ("one workload over 24 h", "name=host-0", 1, 200.0),
    ];
    for (name, scope, days, bound) in shapes {
        let request = Request {
            scope: scope.into(),
            range: Range { from: now - TimeDelta::days(days), to: now },
            excluded_keys: BTreeSet::new(),
            max_breadth: suggest::DEFAULT_MAX_BREADTH,
        };
        let mut times = Vec::new();
        for run in 0..runs + 1 {
            let t = Instant::now();
            let out = suggest::run(pool, &request).await?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            if run == 0 {
                let excluded: u64 = out.excluded.iter().map(|e| e.flows).sum();
                println!(
                    "  {name}: {} suggestions, {excluded} flows excluded (warm-up {ms:.0} ms)",
                    out.suggestions.len()
                );
                assert!(!out.suggestions.is_empty(), "the estate has flows no rule admits");
            } else {
                times.push(ms);
            }
        }
        times.sort_by(f64::total_cmp);
        let pct = |p: f64| times[((times.len() as f64 * p).ceil() as usize).saturating_sub(1)];
        let (p50, p95) = (pct(0.50), pct(0.95));
        println!("PERF-10: {name}: p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs (target < {bound} ms)");
        println!(
            "FIGURE {{\"id\":\"PERF-10\",\"name\":\"suggestions p95, {name}\",\"value\":{p95:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":{bound}}},\"context\":{{\"workloads\":{workloads}}}}}"
        );
    }
    Ok(())
}
