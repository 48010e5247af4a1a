//! The flow estate the flow benches load (PERF-8 `rollup`, PERF-9 `impact`, PERF-10 `suggest`,
//! PERF-11 `console`): included by each with `#[path]`, so all measure the same shape of evidence.

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::policy::store::Content;
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::policy::WorkloadPolicy;
use sqlx::PgPool;

/// Records per flow window.
pub const RECORDS_PER_WINDOW: i64 = 7;

/// `workloads` workloads, labels (app=a0..a49; env=prod), and `windows` windows of
/// `RECORDS_PER_WINDOW` records spread evenly over `[start, start + days)`.
#[allow(dead_code, reason = "the rollup bench loads with `load_with`")]
pub async fn load(
    pool: &PgPool,
    start: DateTime<Utc>,
    days: i64,
    windows: i64,
    workloads: i64,
) -> anyhow::Result<()> {
    load_with(pool, start, days, windows, workloads, RECORDS_PER_WINDOW).await
}

/// [`load`] with `records_per_window` records in each window (records 0..n of the same rotation
/// of each workload's nine flow keys).
pub async fn load_with(
    pool: &PgPool,
    start: DateTime<Utc>,
    days: i64,
    windows: i64,
    workloads: i64,
    records_per_window: i64,
) -> anyhow::Result<()> {
    let shape = Shape { start, days, windows, workloads, records_per_window };
    add_workloads(pool, &shape).await?;
    add_windows(pool, &shape, 0..windows).await
}

/// What [`add_windows`] loads a part of: `windows` windows of `records_per_window` records spread
/// evenly over `[start, start + days)` among `workloads` workloads.
pub struct Shape {
    pub start: DateTime<Utc>,
    pub days: i64,
    pub windows: i64,
    pub workloads: i64,
    pub records_per_window: i64,
}

/// The workloads and labels of `shape` (as [`load`] labels them), and the flow partitions of its
/// days.
pub async fn add_workloads(pool: &PgPool, shape: &Shape) -> anyhow::Result<()> {
    let Shape { start, days, workloads, .. } = *shape;
    let mut tx = pool.begin().await?;
    flows::ensure_partitions(&mut tx, start, start + TimeDelta::days(days)).await?;
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
    Ok(())
}

/// Windows `indices` of `shape` (in the order of their slots: the last are the latest), with their
/// records, then `VACUUM ANALYZE`.
pub async fn add_windows(pool: &PgPool, shape: &Shape, indices: std::ops::Range<i64>) -> anyhow::Result<()> {
    let Shape { start, days, windows, workloads, records_per_window } = *shape;
    // Window i: workload i % W, its slot i / W, starting at start + slot * spacing + a per-workload
    // offset. Record r of it: flow key k = (w + 3 slot + r) % 9 of that workload's nine.
    let per_workload = (windows + workloads - 1) / workloads;
    let spacing_ms = days * 86_400_000 / per_workload.max(1);
    let chunk = 100_000;
    let mut from = indices.start;
    while from < indices.end {
        let to = (from + chunk).min(indices.end);
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
        .bind(records_per_window as i32)
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
        .bind(records_per_window as i32)
        .execute(pool)
        .await?;
        from = to;
    }
    vacuum_analyze(pool).await
}

/// A fresh database and its pool. It is dropped with the returned guard when the bench ends,
/// however it ends; with `INNERWALL_BENCH_KEEP` set the guard is forgotten at once and the
/// database's URL printed, so whatever fails later leaves what was loaded to look at or reuse.
#[allow(dead_code, reason = "the rollup and suggest benches keep their database only on success")]
pub async fn database() -> anyhow::Result<(PgPool, Option<TestDatabase>)> {
    let db = fresh_database().await?;
    let pool = db.pool.clone();
    if std::env::var_os("INNERWALL_BENCH_KEEP").is_some() {
        println!("keeping the database: {}", db.url);
        std::mem::forget(db);
        return Ok((pool, None));
    }
    Ok((pool, Some(db)))
}

/// `VACUUM ANALYZE`, as autovacuum would: a maintenance statement, not a request, so without the
/// pool's statement bound (a whole estate's after a roll-up outlasts it).
pub async fn vacuum_analyze(pool: &PgPool) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    // Two statements: VACUUM cannot run in the implicit transaction of a multi-statement string.
    sqlx::raw_sql("SET statement_timeout = 0").execute(&mut *conn).await?;
    sqlx::raw_sql("VACUUM ANALYZE").execute(&mut *conn).await?;
    sqlx::raw_sql("RESET statement_timeout").execute(&mut *conn).await?;
    Ok(())
}

/// Stores `applied` as every workload's version 1, applied.
#[allow(dead_code, reason = "the rollup bench stores no policies")]
pub async fn store_policies(pool: &PgPool, applied: &WorkloadPolicy) -> anyhow::Result<()> {
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
