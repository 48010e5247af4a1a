//! Flows between label sets (the console's map, PERF-11): a range's flows summed per
//! (destination label set, peer group, decision). Whole rolled-up hours come from
//! `flow_edge_hours` (the roll-up job writes it beside the rollups); the windows of the range not
//! rolled up yet (the current hour, late uploads) are summed from their raw records while they
//! are few enough to read at once, and otherwise are counted and left out, which the answer says.
//! Reads only, bounded in the rows it returns.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::hourly::hour_floor;
use crate::error::Error;

/// The most raw records of windows not rolled up yet the map sums; beyond, they are left out
/// (and counted) until the roll-up job has reached them.
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
    /// The destinations' labels when their flows were rolled up (now, for flows not rolled up).
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
    /// Records of windows in the range not rolled up yet that were left out (more than
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

/// The flows of the windows that started in `[from, to)`, widened to whole hours at its start,
/// summed per destination label set, peer group and decision; the records of windows not rolled
/// up yet are summed when there are at most `max_pending` of them (the console passes
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
    // One snapshot: a window the job rolls up meanwhile is read once, from one side.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY").execute(&mut *tx).await?;
    let pending: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(record_count), 0)::bigint FROM flow_pending_windows
         WHERE window_start >= $1 AND window_start < $2",
    )
    .bind(from)
    .bind(to)
    .fetch_one(&mut *tx)
    .await?;
    let with_pending = pending <= max_pending;
    // Both sides are summed by digests (cheap keys: the rolled side's as stored, the waiting
    // side's destinations by their labels now, read once per workload), and each label set the
    // sums name comes once, in rows of its own (`part` 1). Planned for its range each time, not
    // prepared for reuse: a prepared statement turns to a plan made for no particular range
    // after five runs, and an earlier form of this query then read the waiting side in seconds.
    let rows = sqlx::query(
        "WITH rolled AS (
            SELECT dst_digest, peer_kind, peer_group, decision, sum(new_connections)::bigint AS c,
                   sum(records)::bigint AS n
            FROM flow_edge_hours WHERE hour >= $1 AND hour < $2
            GROUP BY dst_digest, peer_kind, peer_group, decision
            LIMIT $4),
         waiting AS (
            SELECT r.workload_id, r.peer_kind,
                   CASE r.peer_kind WHEN 1 THEN md5(r.peer_labels::text)::uuid::text
                                    WHEN 2 THEN r.peer_key ELSE '' END AS peer_group,
                   r.decision, sum(r.new_connections)::bigint AS c, count(*) AS n,
                   min(CASE r.peer_kind WHEN 1 THEN r.peer_labels::text END) AS peer_labels
            FROM flow_records r
            WHERE $3 AND r.window_start >= $1 AND r.window_start < $2
              AND (r.workload_id, r.window_id, r.window_start) IN (
                  SELECT workload_id, window_id, window_start FROM flow_pending_windows
                  WHERE window_start >= $1 AND window_start < $2)
            GROUP BY 1, 2, 3, 4),
         destinations AS (
            SELECT workload_id, labels, md5(labels::text)::uuid AS digest
            FROM (SELECT a.workload_id,
                         COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l
                                   WHERE l.workload_id = a.workload_id), '{}'::jsonb) AS labels
                  FROM (SELECT DISTINCT workload_id FROM waiting) AS a) AS w),
         label_sets AS (
            SELECT digest, labels FROM destinations
            UNION ALL
            SELECT peer_group::uuid, peer_labels::jsonb FROM waiting WHERE peer_kind = 1
            UNION ALL
            SELECT s.digest, s.labels FROM flow_label_sets s
            WHERE s.digest IN (SELECT dst_digest FROM rolled
                               UNION SELECT peer_group::uuid FROM rolled WHERE peer_kind = 1))
         SELECT 0 AS part, dst_digest, peer_kind, peer_group, decision, c, n, NULL::jsonb AS labels FROM rolled
         UNION ALL
         SELECT 0, d.digest, w.peer_kind, w.peer_group, w.decision, sum(w.c)::bigint, sum(w.n)::bigint, NULL
         FROM waiting w JOIN destinations d ON d.workload_id = w.workload_id
         GROUP BY d.digest, w.peer_kind, w.peer_group, w.decision
         UNION ALL
         SELECT DISTINCT ON (digest) 1, digest, NULL, NULL, NULL, NULL, NULL, labels FROM label_sets",
    )
    .bind(from)
    .bind(to)
    .bind(with_pending)
    .bind(MAX_EDGE_SUMS + 1)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    // The two sides may name the same edge: summed here, then keyed by the label sets.
    let mut by_digest: BTreeMap<(Uuid, i16, String, i16), (i64, i64)> = BTreeMap::new();
    let mut label_sets: BTreeMap<Uuid, Labels> = BTreeMap::new();
    for row in rows {
        let digest: Uuid = row.get(1);
        if row.get::<i32, _>(0) == 1 {
            label_sets.insert(digest, labels(row.get(7))?);
            continue;
        }
        let sum = by_digest.entry((digest, row.get(2), row.get(3), row.get(4))).or_default();
        sum.0 += row.get::<i64, _>(5);
        sum.1 += row.get::<i64, _>(6);
    }
    let label_set = |digest: &Uuid| {
        label_sets.get(digest).cloned().ok_or_else(|| Error::Corrupt {
            what: "flow edge label set",
            detail: format!("no label set with digest {digest}"),
        })
    };
    let mut sums: BTreeMap<(Labels, Peer, Decision), (i64, i64)> = BTreeMap::new();
    for ((digest, peer_kind, peer_group, decision), (connections, records)) in by_digest {
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
        let sum = sums.entry((label_set(&digest)?, peer, decision)).or_default();
        sum.0 += connections;
        sum.1 += records;
    }
    let truncated = sums.len() as i64 > MAX_EDGE_SUMS;
    let sums = sums
        .into_iter()
        .take(MAX_EDGE_SUMS as usize)
        .map(|((destination, peer, decision), (connections, records))| EdgeSum {
            destination,
            peer,
            decision,
            connections,
            records,
        })
        .collect();
    Ok(Edges { from, to, sums, pending_left_out: if with_pending { 0 } else { pending }, truncated })
}
