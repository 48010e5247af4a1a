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
    // Rolled-up hours grouped by digests (cheap keys), their label sets joined at the end; the
    // windows not rolled up yet carry their label sets themselves.
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
                   CASE r.peer_kind WHEN 1 THEN r.peer_labels ELSE '{}'::jsonb END AS peer_labels,
                   r.decision, sum(r.new_connections) AS c, count(*) AS n
            FROM flow_records r
            WHERE $3 AND r.window_start >= $1 AND r.window_start < $2
              AND (r.workload_id, r.window_id, r.window_start) IN (
                  SELECT workload_id, window_id, window_start FROM flow_pending_windows
                  WHERE window_start >= $1 AND window_start < $2)
            GROUP BY 1, 2, 3, 4, 5)
         SELECT d.labels, r.peer_kind, r.peer_group, COALESCE(p.labels, '{}'::jsonb), r.decision, r.c, r.n
         FROM rolled r JOIN flow_label_sets d ON d.digest = r.dst_digest
              LEFT JOIN flow_label_sets p ON p.digest = CASE WHEN r.peer_kind = 1 THEN r.peer_group::uuid END
         UNION ALL
         SELECT COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l
                          WHERE l.workload_id = w.workload_id), '{}'::jsonb),
                w.peer_kind, w.peer_group, w.peer_labels, w.decision, w.c::bigint, w.n::bigint
         FROM waiting w",
    )
    .bind(from)
    .bind(to)
    .bind(with_pending)
    .bind(MAX_EDGE_SUMS + 1)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    // The two sides may name the same edge: summed here.
    let mut sums: BTreeMap<(Labels, Peer, Decision), (i64, i64)> = BTreeMap::new();
    for row in rows {
        let peer = match row.get::<i16, _>(1) {
            1 => Peer::Labelled(labels(row.get(3))?),
            2 => Peer::Group(row.get(2)),
            _ => Peer::Other,
        };
        let decision = Decision::from_code(row.get(4)).map_err(|_| Error::Corrupt {
            what: "flow decision",
            detail: row.get::<i16, _>(4).to_string(),
        })?;
        let sum = sums.entry((labels(row.get(0))?, peer, decision)).or_default();
        sum.0 += row.get::<i64, _>(5);
        sum.1 += row.get::<i64, _>(6);
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
