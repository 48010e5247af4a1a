//! PERF-9: the impact of a one-ruleset change on an estate of 1,000 workloads with 7 days of
//! flows (about 10 M records, rolled up): p95 of `foresight::impact` (goal < 2 s). Every
//! workload applied version 1 of a policy admitting postgres and https from the estate's peers
//! and ssh from the corporate group; the change narrows the https ruleset's peers and adds a
//! range, so every workload's proposed policy differs from its applied one and all its flows
//! are replayed. Flows are loaded as the `rollup` bench loads them (direct server-side inserts,
//! then `flows::roll_up` and `VACUUM ANALYZE`); policies are stored as a render stores them
//! (contents by digest, history rows, the applied version).
//!
//! `INNERWALL_BENCH_QUICK=1` runs 100 workloads and 100,000 records (it proves the bench works;
//! its figure judges nothing); `INNERWALL_BENCH_RECORDS` sets the records at full size.
//! Run with `cargo bench -p innerwall-control-plane --bench impact` or `cargo xtask bench impact`.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::foresight::{self, Range};
use innerwall_control_plane::policy::store::Content;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};
use innerwall_wire::testing::rule;
use sqlx::PgPool;

const DAYS: i64 = 7;
const RECORDS_PER_WINDOW: i64 = 7;

/// Workloads, labels (app=a0..a49; env=prod), and `windows` windows of `RECORDS_PER_WINDOW`
/// records spread evenly over `[start, start + DAYS)` (as the PERF-8 bench `rollup` loads them).
async fn load(pool: &PgPool, start: DateTime<Utc>, windows: i64, workloads: i64) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    flows::ensure_partitions(&mut tx, start, start + TimeDelta::days(DAYS)).await?;
    tx.commit().await?;
    sqlx::query(
        "INSERT INTO workloads (id, hostname) SELECT md5('w' || n)::uuid, 'host-' || n FROM generate_series(0, $1 - 1) n",
    )
    .bind(workloads)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO workload_labels (workload_id, key, value)
         SELECT md5('w' || n)::uuid, 'app', 'a' || (n % 50) FROM generate_series(0, $1 - 1) n
         UNION ALL SELECT md5('w' || n)::uuid, 'env', 'prod' FROM generate_series(0, $1 - 1) n",
    )
    .bind(workloads)
    .execute(pool)
    .await?;
    // Window i: workload i % W, its slot i / W, starting at start + slot * spacing + a per-workload
    // offset. Record r of it: flow key k = (w + 3 slot + r) % 9 of that workload's nine.
    let per_workload = (windows + workloads - 1) / workloads;
    let spacing_ms = DAYS * 86_400_000 / per_workload.max(1);
    let chunk = 100_000;
    let mut from = 0;
    while from < windows {
        let to = (from + chunk).min(windows);
        sqlx::query(
            "WITH w AS (
                SELECT i, i % $3 AS wl, i / $3 AS slot,
                       $4::timestamptz + ((i / $3) * $5 + (i % $3) * ($5 / $3 / 2)) * interval '1 millisecond' AS ws
                FROM generate_series($1, $2 - 1) i)
             INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode,
                 record_count, gap_count, packets, bytes, new_connections, allowed_records, would_block_records)
             SELECT md5('w' || wl)::uuid, md5('x' || i)::uuid, ws, ws + interval '60 seconds', 1 + slot / 200, 2,
                    $6, 0, 0, 0, 0, 0, 0
             FROM w",
        )
        .bind(from)
        .bind(to)
        .bind(workloads)
        .bind(start)
        .bind(spacing_ms)
        .bind(RECORDS_PER_WINDOW as i32)
        .execute(pool)
        .await?;
        sqlx::query(
            "WITH w AS (
                SELECT i, i % $3 AS wl, i / $3 AS slot,
                       $4::timestamptz + ((i / $3) * $5 + (i % $3) * ($5 / $3 / 2)) * interval '1 millisecond' AS ws
                FROM generate_series($1, $2 - 1) i),
             r AS (SELECT w.*, rn, (wl + 3 * slot + rn) % 9 AS k, (wl * 37 + ((wl + 3 * slot + rn) % 9) * 101) % $3 AS peer
                   FROM w, generate_series(0, $6 - 1) rn)
             INSERT INTO flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
                 dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
                 peer_kind, peer_key, peer_labels, ordinal)
             SELECT md5('w' || wl)::uuid, md5('x' || i)::uuid, ws, 1 + slot / 200,
                    CASE WHEN k < 6 THEN ('10.1.0.0'::inet + peer)
                         WHEN k = 6 THEN ('172.16.0.0'::inet + (i % 4096))
                         ELSE ('198.51.100.0'::inet + (i % 256)) END,
                    '10.0.0.0'::inet + wl,
                    (ARRAY[5432, 443, 22, 8080, 9090, 6379, 5432, 443, 3306])[k + 1], 1,
                    CASE WHEN k IN (1, 6, 7) THEN 2 ELSE 3 END,
                    CASE WHEN k IN (1, 6, 7) THEN 'rule-' || (k % 4) || '/tcp' ELSE '' END,
                    10 + rn, 1000 + 13 * rn, 1, ws + interval '1 second', ws + interval '50 seconds',
                    CASE WHEN k < 6 THEN 1 WHEN k = 6 THEN 2 ELSE 0 END,
                    CASE WHEN k < 6 THEN md5('w' || peer)::uuid::text WHEN k = 6 THEN 'corp'
                         ELSE host('198.51.100.0'::inet + (i % 256)) END,
                    CASE WHEN k < 6 THEN jsonb_build_object('app', 'a' || (peer % 50), 'env', 'prod') ELSE '{}' END,
                    rn
             FROM r",
        )
        .bind(from)
        .bind(to)
        .bind(workloads)
        .bind(start)
        .bind(spacing_ms)
        .bind(RECORDS_PER_WINDOW as i32)
        .execute(pool)
        .await?;
        from = to;
    }
    sqlx::query("VACUUM ANALYZE").execute(pool).await?;
    Ok(())
}

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

/// Stores `applied` as every workload's version 1, applied.
async fn store_policies(pool: &PgPool, applied: &WorkloadPolicy) -> anyhow::Result<()> {
    let content = Content::of(applied);
    sqlx::query("INSERT INTO policy_contents (digest, policy) VALUES ($1, $2)")
        .bind(&content.digest)
        .bind(&content.bytes)
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
         SELECT id, 1, $1, now() FROM workloads",
    )
    .bind(&content.digest)
    .execute(pool)
    .await?;
    sqlx::query("UPDATE workloads SET applied_version = 1").execute(pool).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = std::env::var_os("INNERWALL_BENCH_QUICK").is_some();
    let (workloads, default_records, runs) = if quick { (100, 100_000, 3) } else { (1_000, 10_000_000, 5) };
    let records: i64 = match std::env::var("INNERWALL_BENCH_RECORDS") {
        Ok(text) => text.parse()?,
        Err(_) => default_records,
    };
    let windows = (records / RECORDS_PER_WINDOW).max(workloads);
    println!(
        "PERF-9 impact of a one-ruleset change (target p95 < 2000 ms): {} records in {windows} windows, {workloads} workloads, {DAYS} days",
        windows * RECORDS_PER_WINDOW
    );
    let db = fresh_database().await?;
    let now = Utc::now();
    let t = Instant::now();
    load(&db.pool, now - TimeDelta::days(DAYS), windows, workloads).await?;
    let (applied, proposed) = policies();
    store_policies(&db.pool, &applied).await?;
    let rolled = flows::roll_up(&db.pool, now).await?;
    sqlx::query("VACUUM ANALYZE").execute(&db.pool).await?;
    println!("loaded and rolled up ({rolled} windows) in {:.1} s", t.elapsed().as_secs_f64());

    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM workloads").fetch_all(&db.pool).await?;
    let proposal: BTreeMap<WorkloadId, WorkloadPolicy> = ids
        .into_iter()
        .map(|id| (WorkloadId::from_uuid(id).expect("a workload id"), proposed.clone()))
        .collect();
    let range = Range { from: now - TimeDelta::days(DAYS), to: now };
    let mut times = Vec::new();
    let mut conn = db.pool.acquire().await?;
    for run in 0..runs + 1 {
        let t = Instant::now();
        let impact = foresight::impact(&mut conn, &proposal, range, 10).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if run == 0 {
            let blocked: u64 = impact.newly_blocked();
            let allowed: u64 = impact.workloads.iter().map(|w| w.replayed.newly_allowed).sum();
            println!(
                "  {} workloads listed, {} flow keys replayed: {blocked} newly blocked, {allowed} newly allowed (warm-up {ms:.0} ms)",
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
    println!("PERF-9: impact p50 {p50:.1} ms, p95 {p95:.1} ms over {runs} runs (target < 2000 ms)");
    println!(
        "FIGURE {{\"id\":\"PERF-9\",\"name\":\"impact p95, 7 days\",\"value\":{p95:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":2000}},\"context\":{{\"workloads\":{workloads},\"records\":{}}}}}",
        windows * RECORDS_PER_WINDOW
    );
    Ok(())
}
