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
    // Both sides are summed together by digests (cheap keys: the rolled side's as stored, the
    // waiting side's destinations by their labels now, read once per workload, and its peers'
    // after grouping), at most `$3` sums (`part` 0); each label set the sums name comes once
    // (`part` 1); and the waiting side's record count (`part` 2), read only when at most `$4`.
    // Planned for its range each time, not prepared for reuse: a prepared statement turns to a
    // plan made for no particular range after five runs, and an earlier form of this query then
    // read the waiting side in seconds. The waiting windows meet their destinations before
    // their records (`OFFSET 0`): the planner expects one record a window and would otherwise
    // scan the destinations once per record.
    let rows = sqlx::query(
        "WITH pending AS (
            SELECT workload_id, window_id, window_start, record_count FROM flow_pending_windows
            WHERE window_start >= $1 AND window_start < $2),
         pending_records AS (SELECT COALESCE(sum(record_count), 0)::bigint AS n FROM pending),
         rolled AS (
            SELECT dst_digest, peer_kind, peer_group, decision, sum(new_connections)::bigint AS c,
                   sum(records)::bigint AS n
            FROM flow_edge_hours WHERE hour >= $1 AND hour < $2
            GROUP BY dst_digest, peer_kind, peer_group, decision
            LIMIT $3),
         destinations AS (
            SELECT a.workload_id, w.labels, md5(w.labels::text)::uuid AS digest
            FROM (SELECT DISTINCT workload_id FROM pending) AS a
            CROSS JOIN LATERAL (SELECT COALESCE(jsonb_object_agg(l.key, l.value), '{}'::jsonb) AS labels
                                FROM workload_labels l WHERE l.workload_id = a.workload_id) AS w
            WHERE (SELECT n FROM pending_records) <= $4),
         waiting AS (
            SELECT digest, peer_kind,
                   CASE peer_kind WHEN 1 THEN md5(peer_labels::text)::uuid::text
                                  WHEN 2 THEN peer_key ELSE '' END AS peer_group,
                   peer_labels, decision, c, n
            FROM (SELECT d.digest, r.peer_kind, CASE r.peer_kind WHEN 2 THEN r.peer_key END AS peer_key,
                         CASE r.peer_kind WHEN 1 THEN r.peer_labels END AS peer_labels, r.decision,
                         sum(r.new_connections)::bigint AS c, count(*) AS n
                  FROM (SELECT p.workload_id, p.window_id, p.window_start, d.digest
                        FROM pending p JOIN destinations d ON d.workload_id = p.workload_id
                        OFFSET 0) AS d
                  JOIN flow_records r ON r.workload_id = d.workload_id AND r.window_id = d.window_id
                                     AND r.window_start = d.window_start
                  WHERE r.window_start >= $1 AND r.window_start < $2
                  GROUP BY 1, 2, 3, 4, 5) AS g),
         sums AS (
            SELECT dst_digest AS digest, peer_kind, peer_group, decision, c, n FROM rolled
            UNION ALL
            SELECT digest, peer_kind, peer_group, decision, c, n FROM waiting),
         label_sets AS (
            SELECT digest, labels FROM destinations
            UNION ALL
            SELECT peer_group::uuid, peer_labels FROM waiting WHERE peer_kind = 1
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
    )
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
