//! Flows between label sets (the console's map, PERF-11): a range's flows summed per
//! (destination label set, peer group, decision).
//!
//! [`sum_edges`] writes them: inserting a window queues it in `flow_edge_pending` (migration
//! 0045), and the job (every minute) takes queued windows off in the transaction that adds their
//! records to `flow_edge_hours`, per hour of the window's start, with the destination's labels at
//! that moment (the label sets by digest in `flow_label_sets`). [`edges`] reads them: whole hours
//! from `flow_edge_hours`, and the windows still queued (about the last minute's) from their raw
//! records while they are few enough to read at once; beyond that they are counted and left out,
//! which the answer says. A window is summed exactly when it is no longer queued, so in one
//! snapshot each record is read once, from one side. Reads are bounded in the rows they return.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::hourly::{hour_floor, take_oldest};
use super::retention::hold_partitions;
use crate::error::Error;

/// The most raw records of windows not summed yet the map sums; beyond, they are left out (and
/// counted) until [`sum_edges`] has reached them.
pub const MAX_PENDING_RECORDS: i64 = 100_000;

/// The most (destination label set, peer group, decision) sums one read returns.
pub const MAX_EDGE_SUMS: i64 = 100_000;

/// Who sent flows: a managed workload with its labels then, an address group, or any other
/// address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Peer {
    Labelled(BTreeMap<String, String>),
    Group(String),
    Other,
}

/// The flows of a range from one peer group to the destinations with one label set that got one
/// decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeSum {
    /// The destinations' labels when their flows were summed (now, for flows still queued).
    pub destination: BTreeMap<String, String>,
    pub peer: Peer,
    pub decision: Decision,
    pub connections: i64,
    pub records: i64,
}

/// What [`edges`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edges {
    /// The whole hours read: `[from, to)`, `from` the start of the hour the asked range starts in.
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub sums: Vec<EdgeSum>,
    /// Records of windows in the range not summed yet that were left out (more than
    /// [`MAX_PENDING_RECORDS`]); 0 when every record of the range is summed.
    pub pending_left_out: i64,
    /// More than [`MAX_EDGE_SUMS`] sums: the first ones are returned.
    pub truncated: bool,
}

/// A label set as stored.
type Labels = BTreeMap<String, String>;

fn labels(value: serde_json::Value) -> Result<Labels, Error> {
    serde_json::from_value(value)
        .map_err(|e| Error::Corrupt { what: "flow edge labels", detail: e.to_string() })
}

/// At most this many queued windows are summed in one transaction…
pub const EDGE_BATCH_WINDOWS: i64 = 50_000;
/// …and at most about this many records (a window is never split). A batch writes a row per
/// (hour, destination label set, peer group, decision), far fewer than its records, so it stays
/// well inside the statement bound of the pool the job runs on (ingest's, 30 s).
pub const EDGE_BATCH_RECORDS: i64 = 200_000;

/// Key of the transaction-scoped advisory lock ("iw-edges") under which one replica at a time
/// sums edges: a batch takes the queue's rows by their addresses, which no other may take.
const EDGE_LOCK_KEY: i64 = 0x6977_2d65_6467_6573;

/// Two CTEs over the windows of CTE `windows` (`workload_id`, `window_id`, `window_start`):
/// `destinations`, each of their workloads with its labels now and their digest, and
/// `queued_edges`, their records summed per (hour, destination digest, peer group, decision),
/// with the peer's labels for labelled peers, as `c` connections and `n` records. The windows
/// meet their destinations before their records, whose lookup goes through the workload's index
/// (`OFFSET 0` in both): the planner expects a window to hold one record, and joined its own way
/// it scanned the destinations once a record (19 s in a map of 60,000 records).
fn queued_edges(windows: &str) -> String {
    format!(
        "destinations AS (
            SELECT a.workload_id, w.labels, md5(w.labels::text)::uuid AS digest
            FROM (SELECT DISTINCT workload_id FROM {windows}) AS a
            CROSS JOIN LATERAL (SELECT COALESCE(jsonb_object_agg(l.key, l.value), '{{}}'::jsonb) AS labels
                                FROM workload_labels l WHERE l.workload_id = a.workload_id) AS w),
         queued_edges AS (
            SELECT hour, digest, peer_kind,
                   CASE peer_kind WHEN 1 THEN md5(peer_labels::text)::uuid::text
                                  WHEN 2 THEN peer_key ELSE '' END AS peer_group,
                   peer_labels, decision, c, n
            FROM (SELECT date_trunc('hour', t.window_start, 'UTC') AS hour, t.digest, r.peer_kind,
                         CASE r.peer_kind WHEN 2 THEN r.peer_key END AS peer_key,
                         CASE r.peer_kind WHEN 1 THEN r.peer_labels END AS peer_labels, r.decision,
                         sum(r.new_connections)::bigint AS c, count(*) AS n
                  FROM (SELECT t.workload_id, t.window_id, t.window_start, d.digest
                        FROM {windows} t JOIN destinations d ON d.workload_id = t.workload_id OFFSET 0) AS t,
                       LATERAL (SELECT r.peer_kind, r.peer_key, r.peer_labels, r.decision, r.new_connections
                                FROM flow_records r WHERE r.workload_id = t.workload_id
                                    AND r.window_start = t.window_start AND r.window_id = t.window_id
                                OFFSET 0) AS r
                  GROUP BY 1, 2, 3, 4, 5, 6) AS g)"
    )
}

/// Sums the records of every queued window into `flow_edge_hours` (and the label sets they name
/// into `flow_label_sets`), oldest first, in bounded transactions that each take their windows off
/// the queue. Returns how many windows were summed (0 also when another replica is at it).
pub async fn sum_edges(pool: &PgPool) -> Result<u64, Error> {
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        hold_partitions(&mut tx).await?;
        let ours: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(EDGE_LOCK_KEY)
            .fetch_one(&mut *tx)
            .await?;
        if !ours {
            return Ok(total);
        }
        // `innerwall.edge_writer`: the rows of `flow_edge_hours` come from this job alone
        // (migration 0045 drops those of a previous release's roll-up).
        sqlx::query(
            "SELECT set_config('innerwall.edge_writer', 'queue', true), set_config('work_mem', '64MB', true)",
        )
        .execute(&mut *tx)
        .await?;
        // Taken off the queue as the roll-up takes its windows (no other transaction takes
        // them: the lock above); edges and label sets are written in key order, so a previous
        // release's roll-up writing label sets beside this waits rather than deadlocks.
        let windows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "WITH {},
             {},
             label_sets AS (
                INSERT INTO flow_label_sets (digest, labels)
                SELECT digest, labels FROM destinations
                UNION SELECT peer_group::uuid, peer_labels FROM queued_edges WHERE peer_kind = 1
                ORDER BY 1
                ON CONFLICT DO NOTHING),
             added AS (
                INSERT INTO flow_edge_hours AS e (hour, dst_digest, peer_kind, peer_group, decision, records,
                    new_connections)
                SELECT hour, digest, peer_kind, peer_group, decision, sum(n), sum(c) FROM queued_edges
                GROUP BY 1, 2, 3, 4, 5
                ORDER BY 1, 2, 3, 4, 5
                ON CONFLICT (hour, dst_digest, peer_kind, peer_group, decision)
                DO UPDATE SET records = e.records + EXCLUDED.records,
                              new_connections = e.new_connections + EXCLUDED.new_connections)
             SELECT count(*) FROM taken",
            take_oldest("flow_edge_pending", "true", "$1", "$2"),
            queued_edges("taken")
        )))
        .bind(EDGE_BATCH_WINDOWS)
        .bind(EDGE_BATCH_RECORDS)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        total += windows as u64;
        if windows == 0 {
            return Ok(total);
        }
    }
}

/// The flows of the windows that started in `[from, to)`, widened to whole hours at its start,
/// summed per destination label set, peer group and decision; the records of windows not summed
/// yet are read when there are at most `max_pending` of them (the console passes
/// [`MAX_PENDING_RECORDS`]), else left out and counted.
pub async fn edges(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    max_pending: i64,
) -> Result<Edges, Error> {
    crate::input::instant("from", from)?;
    crate::input::instant("to", to)?;
    if from >= to {
        return Err(Error::Invalid(format!(
            "the range from {from} to {to} is empty; its start must be before its end"
        )));
    }
    let from = hour_floor(from);
    let mut tx = pool.begin().await?;
    // One snapshot: a window the job sums meanwhile is read once, from one side.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY").execute(&mut *tx).await?;
    // Room to sum a day's hourly edges (330,000 rows into 13,000 at 10,000 workloads) in one
    // hash table: in Postgres's default 4 MB the planner sorted them, spilling to disk, and the
    // statement took 600 ms instead of 370 (`EXPLAIN ANALYZE` on the console bench's estate).
    sqlx::query("SELECT set_config('work_mem', '32MB', true)").execute(&mut *tx).await?;
    // Both sides are summed together by digests (cheap keys: the summed side's as stored, the
    // waiting side's as [`queued_edges`] takes them), at most `$3` sums (`part` 0); each label
    // set the sums name comes once (`part` 1); and the waiting side's record count (`part` 2),
    // its records read only when at most `$4`. Planned for its range each time, not prepared
    // for reuse: a prepared statement turns to a plan made for no particular range after five
    // runs, and an earlier form of this query then read the waiting side in seconds.
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH pending AS (
            SELECT workload_id, window_id, window_start, record_count FROM flow_edge_pending
            WHERE window_start >= $1 AND window_start < $2),
         pending_records AS (SELECT COALESCE(sum(record_count), 0)::bigint AS n FROM pending),
         rolled AS (
            SELECT dst_digest, peer_kind, peer_group, decision, sum(new_connections)::bigint AS c,
                   sum(records)::bigint AS n
            FROM flow_edge_hours WHERE hour >= $1 AND hour < $2
            GROUP BY dst_digest, peer_kind, peer_group, decision
            LIMIT $3),
         read AS (SELECT * FROM pending WHERE (SELECT n FROM pending_records) <= $4),
         {},
         sums AS (
            SELECT dst_digest AS digest, peer_kind, peer_group, decision, c, n FROM rolled
            UNION ALL
            SELECT digest, peer_kind, peer_group, decision, c, n FROM queued_edges),
         label_sets AS (
            SELECT digest, labels FROM destinations
            UNION ALL
            SELECT peer_group::uuid, peer_labels FROM queued_edges WHERE peer_kind = 1
            UNION ALL
            SELECT s.digest, s.labels FROM flow_label_sets s
            WHERE s.digest IN (SELECT dst_digest FROM rolled
                               UNION SELECT peer_group::uuid FROM rolled WHERE peer_kind = 1))
         (SELECT 0 AS part, digest, peer_kind, peer_group, decision, sum(c)::bigint, sum(n)::bigint,
                 NULL::jsonb AS labels
          FROM sums GROUP BY digest, peer_kind, peer_group, decision
          LIMIT $3)
         UNION ALL
         SELECT DISTINCT ON (digest) 1, digest, NULL, NULL, NULL, NULL, NULL, labels FROM label_sets
         UNION ALL
         SELECT 2, NULL, NULL, NULL, NULL, NULL, n, NULL FROM pending_records",
        queued_edges("read")
    )))
    .bind(from)
    .bind(to)
    .bind(MAX_EDGE_SUMS + 1)
    .bind(max_pending)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let mut pending = 0;
    let mut by_digest = Vec::new();
    let mut label_sets: BTreeMap<Uuid, Labels> = BTreeMap::new();
    for row in rows {
        match row.get::<i32, _>(0) {
            0 => by_digest.push((
                row.get::<Uuid, _>(1),
                row.get::<i16, _>(2),
                row.get::<String, _>(3),
                row.get::<i16, _>(4),
                row.get::<i64, _>(5),
                row.get::<i64, _>(6),
            )),
            1 => {
                label_sets.insert(row.get(1), labels(row.get(7))?);
            }
            _ => pending = row.get(6),
        }
    }
    let label_set = |digest: &Uuid| {
        label_sets.get(digest).cloned().ok_or_else(|| Error::Corrupt {
            what: "flow edge label set",
            detail: format!("no label set with digest {digest}"),
        })
    };
    let truncated = by_digest.len() as i64 > MAX_EDGE_SUMS;
    let mut sums = Vec::with_capacity(by_digest.len());
    for (digest, peer_kind, peer_group, decision, connections, records) in
        by_digest.into_iter().take(MAX_EDGE_SUMS as usize)
    {
        let peer = match peer_kind {
            1 => Peer::Labelled(label_set(&peer_group.parse::<Uuid>().map_err(|e| Error::Corrupt {
                what: "flow edge peer digest",
                detail: format!("{peer_group:?}: {e}"),
            })?)?),
            2 => Peer::Group(peer_group),
            _ => Peer::Other,
        };
        let decision = Decision::from_code(decision)
            .map_err(|_| Error::Corrupt { what: "flow decision", detail: decision.to_string() })?;
        sums.push(EdgeSum { destination: label_set(&digest)?, peer, decision, connections, records });
    }
    // Each label set has one digest, so the sums are already one per (label set, peer, decision).
    sums.sort_by(|a, b| (&a.destination, &a.peer, a.decision).cmp(&(&b.destination, &b.peer, b.decision)));
    let pending_left_out = if pending <= max_pending { 0 } else { pending };
    Ok(Edges { from, to, sums, pending_left_out, truncated })
}
