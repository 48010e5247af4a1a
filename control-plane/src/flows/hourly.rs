//! Hourly pre-aggregation of flow records (FLOW-6, PERF-8): the records of windows that started
//! before the current hour are summed per (hour, workload, version, decision, rule, peer with its
//! labels then, source, destination, service) into `flow_rollups`, and over the whole estate per
//! (hour, version, decision, rule) into `flow_rule_rollups` and per (UTC day, impact flow key)
//! into `flow_key_days` (added to: late windows of a day join its sums), each key's last hour
//! moves forward in `flow_key_lasts` (what an impact counts its unchanged keys by; migration
//! 0034), and each window leaves the queue of windows to roll up (`flow_pending_windows`, which
//! inserting a window adds it to; migration 0044), all in the same transaction; the job deletes
//! the last hours older than every rollup left. Ingest writes nothing of this but the queue's row
//! (PERF-7), and reviews stay exact at every moment: they read the rollups of the windows no
//! longer queued and the raw records of the rest. The raw records remain the source of truth;
//! rollups expire with them (`retention`).
//!
//! A batch is two statements in one transaction: the first takes the windows off the queue and
//! writes `flow_rollups`, keeping the rows it wrote (without their label sets, which the second
//! does not read) in a temporary table (dropped at commit); the second sums that table into the
//! other three. (The map's edges are summed as windows arrive, by `edges::sum_edges`, from a
//! queue of their own.) Written as one statement (until issue 33), the planner saw the rows a
//! data-modifying CTE returns as one row and joined every rollup row with every destination
//! workload (4 of 6 s in a batch of 35,000 records); a temporary table is planned by its real
//! size. Until migration 0048 a statement trigger on `flow_rollups` moved the last hours, so that
//! the roll-up of the release before 0034 kept them too; that release rolls up nothing since
//! migration 0044 (it finds every window marked rolled up), and the trigger first copied every row
//! it wrote, labels included. What a batch costs now is mostly per rollup row written: the
//! five indexes of `flow_rollups` (half of the job's time; migration 0048 dropped a sixth) and the
//! upserts of the last hours and the day sums (PERF-8 in BENCHMARKS.md), all in one server
//! process; so the job rolls up [`ROLLUP_SLICES`] slices of the workloads at once, in
//! transactions of their own.
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use sqlx::PgPool;

use super::retention::hold_partitions;
use crate::error::Error;

/// At most this many windows are rolled up in one transaction…
pub const ROLLUP_BATCH_WINDOWS: i64 = 50_000;
/// …and at most about this many records (a window is never split): a batch's first statement
/// stays well inside the statement bound of the pool the job runs on (ingest's, 30 s) at the
/// 25,000–40,000 rollup rows/s this machine writes, also when little of a batch compresses.
pub const ROLLUP_BATCH_RECORDS: i64 = 200_000;

/// Key of the transaction-scoped advisory lock ("iw-rollu"): every batch holds it shared, and a
/// batch of the release before (issue 33) took it whole, so the two never roll up at once.
const ROLLUP_LOCK_KEY: i64 = 0x6977_2d72_6f6c_6c75;

/// The job rolls up this many slices of the workloads at once, each on a connection and in
/// transactions of its own (slice `i`: the workloads whose id's last byte is `i` modulo this).
/// A batch's cost is one server process's CPU, so slices use more of the database's cores:
/// two slices on this project's 2-core machine roll up 1.6 times as many records a second in
/// windows of 7 records, but less in windows of 1: the first statement of a batch of 50,000 such
/// windows took 1.8 s alone and 2.5–3.5 s beside the other slice's, each server process on a
/// core of its own (2026-12-06, before the queue; the two cores may share more than they show).
/// Slices write disjoint windows, rollups, day sums and last hours (all keyed by workload); the
/// rule rollups they share are only inserted.
pub const ROLLUP_SLICES: i64 = 2;

/// A window's slice, as the expression of index `flow_pending_windows_slice` (migration 0044),
/// whose modulus is [`ROLLUP_SLICES`].
pub const PENDING_SLICE: &str = "(get_byte(uuid_send(workload_id), 15) % 2)";

/// The start of the hour (UTC) `t` falls in.
pub(super) fn hour_floor(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(TimeDelta::hours(1)).expect("times the database stores truncate to hours")
}

/// Three CTEs that take a batch of windows off queue table `queue` (a window's `workload_id`,
/// `window_id`, `window_start` and `record_count`; `flow_pending_windows` or `flow_edge_pending`):
/// `oldest`, the queued windows that pass `filter`, oldest first, at most `max_windows`;
/// `candidates`, their records before each in that order; and `taken`, those with fewer than
/// `max_records` records before them (so a window is never split), deleted and returned
/// (`workload_id`, `window_id`, `window_start`). The limits are SQL, e.g. parameters (`$2`).
/// They are deleted by their rows' addresses, as one array: a queue's rows are never updated,
/// and the caller's lock keeps any other transaction from taking them, so the address read is the
/// row deleted. Spelled so, the planner cannot choose otherwise: it takes a batch to be a few
/// rows, and joined its own way it hashed the whole queue once a batch (720 ms of a 4.7 s batch
/// of 50,000 windows of 2 M).
pub(super) fn take_oldest(queue: &str, filter: &str, max_windows: &str, max_records: &str) -> String {
    format!(
        "oldest AS (
            SELECT ctid, workload_id, window_id, window_start, record_count FROM {queue}
            WHERE {filter}
            ORDER BY window_start LIMIT {max_windows}),
         candidates AS (
            SELECT ctid, sum(record_count) OVER (ORDER BY window_start, workload_id, window_id) - record_count AS before
            FROM oldest),
         taken AS (
            DELETE FROM {queue}
            WHERE ctid = ANY(ARRAY(SELECT ctid FROM candidates WHERE before < {max_records}))
            RETURNING workload_id, window_id, window_start)"
    )
}

/// Rolls up every window that started before the hour of `now` and is not rolled up yet, in
/// bounded transactions, [`ROLLUP_SLICES`] at once; late windows of hours rolled up before are
/// added as they come. Returns how many windows were rolled up (0 also when another replica is at
/// it: each slice is rolled up by one replica at a time, under a lock of its own).
pub async fn roll_up(pool: &PgPool, now: DateTime<Utc>) -> Result<u64, Error> {
    let horizon = hour_floor(now);
    const _: () = assert!(ROLLUP_SLICES == 2, "roll_up joins one future per slice");
    let (first, second) = tokio::try_join!(roll_up_slice(pool, horizon, 0), roll_up_slice(pool, horizon, 1))?;
    Ok(first + second)
}

async fn roll_up_slice(pool: &PgPool, horizon: DateTime<Utc>, slice: i64) -> Result<u64, Error> {
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        hold_partitions(&mut tx).await?;
        let ours: bool = sqlx::query_scalar(
            "SELECT pg_try_advisory_xact_lock_shared($1) AND pg_try_advisory_xact_lock($1 + 1 + $2)",
        )
        .bind(ROLLUP_LOCK_KEY)
        .bind(slice)
        .fetch_one(&mut *tx)
        .await?;
        if !ours {
            return Ok(total);
        }
        if total == 0 && slice == 0 {
            // The last hours of keys whose every rollup expired with its partition (all of them
            // when no rollup is left).
            sqlx::query(
                "DELETE FROM flow_key_lasts
                 WHERE last_hour < COALESCE((SELECT min(hour) FROM flow_rollups), 'infinity'::timestamptz)",
            )
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("SET LOCAL work_mem = '64MB'").execute(&mut *tx).await?;
        sqlx::query(
            "CREATE TEMPORARY TABLE flow_rollup_batch (
                hour timestamptz, policy_version bigint, decision smallint, matched_rule_id text, records bigint,
                new_connections bigint, packets bigint, bytes bigint, first_seen timestamptz,
                last_seen timestamptz, workload_id uuid, src_address inet, peer_kind smallint, peer_key text,
                peer_digest uuid, dst_port integer, protocol smallint) ON COMMIT DROP",
        )
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        // The slice's oldest queued windows, read in order from an index of the queue (the slice's,
        // migration 0044, whose expression the condition spells; or the start's, the other slice's
        // windows filtered out, where the planner judges it cheaper), taken off as
        // [`take_oldest`] says (no other transaction takes this slice's rows: its lock). Each
        // taken window's records are then looked up through their workload's index, behind
        // `OFFSET 0` in a lateral subquery: the planner takes a batch to be a few rows, and
        // joined its own way it hashed every record of the estate once a batch (1.8 of a 4.7 s
        // batch of 50,000 one-record windows of 2 M).
        let windows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "WITH {},
             added AS (
                INSERT INTO flow_rollups (hour, workload_id, policy_version, decision, matched_rule_id, peer_kind,
                    peer_key, peer_labels, src_address, dst_address, dst_port, protocol, records, new_connections,
                    packets, bytes, first_seen, last_seen)
                SELECT date_trunc('hour', r.window_start, 'UTC'), r.workload_id, r.policy_version, r.decision,
                       r.matched_rule_id, r.peer_kind, r.peer_key, r.peer_labels, r.src_address, r.dst_address,
                       r.dst_port, r.protocol, count(*), sum(r.new_connections), sum(r.packets), sum(r.bytes),
                       min(r.first_seen), max(r.last_seen)
                FROM taken m, LATERAL (
                    SELECT * FROM flow_records r WHERE r.workload_id = m.workload_id
                        AND r.window_start = m.window_start AND r.window_id = m.window_id OFFSET 0) r
                GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
                RETURNING hour, policy_version, decision, matched_rule_id, records, new_connections, packets, bytes,
                          first_seen, last_seen, workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port,
                          protocol),
             staged AS (INSERT INTO pg_temp.flow_rollup_batch SELECT * FROM added)
             SELECT count(*) FROM taken",
            take_oldest("flow_pending_windows", &format!("window_start < $1 AND {PENDING_SLICE} = $4"), "$2", "$3")
        )))
        .bind(horizon)
        .bind(ROLLUP_BATCH_WINDOWS)
        .bind(ROLLUP_BATCH_RECORDS)
        .bind(slice as i32)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        if windows > 0 {
            sqlx::query(
                "WITH lasts AS (
                    INSERT INTO flow_key_lasts AS l (workload_id, src_address, peer_kind, peer_key, peer_digest,
                        dst_port, protocol, last_hour)
                    SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, max(hour)
                    FROM pg_temp.flow_rollup_batch GROUP BY 1, 2, 3, 4, 5, 6, 7
                    ON CONFLICT (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol)
                    DO UPDATE SET last_hour = EXCLUDED.last_hour WHERE l.last_hour < EXCLUDED.last_hour),
                 by_key AS (
                    INSERT INTO flow_key_days AS d (day, workload_id, src_address, peer_kind, peer_key, peer_digest,
                        dst_port, protocol, records, new_connections, first_seen, last_seen)
                    SELECT date_trunc('day', hour, 'UTC'), workload_id, src_address, peer_kind, peer_key,
                           peer_digest, dst_port, protocol, sum(records), sum(new_connections), min(first_seen),
                           max(last_seen)
                    FROM pg_temp.flow_rollup_batch GROUP BY 1, 2, 3, 4, 5, 6, 7, 8
                    ON CONFLICT (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, day)
                    DO UPDATE SET records = d.records + EXCLUDED.records,
                                  new_connections = d.new_connections + EXCLUDED.new_connections,
                                  first_seen = least(d.first_seen, EXCLUDED.first_seen),
                                  last_seen = greatest(d.last_seen, EXCLUDED.last_seen))
                 INSERT INTO flow_rule_rollups (hour, policy_version, decision, matched_rule_id, records,
                    new_connections, packets, bytes, first_seen, last_seen)
                 SELECT hour, policy_version, decision, matched_rule_id, sum(records), sum(new_connections),
                        sum(packets), sum(bytes), min(first_seen), max(last_seen)
                 FROM pg_temp.flow_rollup_batch GROUP BY 1, 2, 3, 4",
            )
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        total += windows as u64;
        if windows == 0 {
            return Ok(total);
        }
    }
}
