//! What operators read of flow evidence: a workload's records and the evidence gaps, a bounded
//! page at a time (`page`), never cut at a limit without saying so.

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::page::{self, Page, PageRequest};
use crate::error::Error;

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct FlowRow {
    pub window_start: DateTime<Utc>,
    pub window_id: Uuid,
    /// Position in its window (0 for records stored before positions were kept).
    #[serde(skip)]
    pub ordinal: i32,
    pub policy_version: i64,
    pub src_address: String,
    pub dst_address: String,
    pub peer_kind: i16,
    pub peer_key: String,
    pub peer_labels: serde_json::Value,
    pub dst_port: i32,
    pub protocol: i16,
    pub decision: i16,
    pub matched_rule_id: String,
    pub packets: i64,
    pub bytes: i64,
    pub new_connections: i64,
    /// Under a staged set (FLOW-10): the set its window was decided under, what the pending
    /// rules decided, and the pending rule that allowed it ('' when none did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged_set: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_decision: Option<i16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_rule_id: Option<String>,
}

/// Which records [`list`] reads: one workload's since `since`, optionally of one decision and one
/// policy version ("which version decided this").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordFilter {
    pub workload: WorkloadId,
    pub since: DateTime<Utc>,
    pub decision: Option<Decision>,
    pub version: Option<u64>,
}

const RECORDS: &str = "records";

/// Records of one workload, newest window first (in upload order within a window), a page at a
/// time. The sort key is (window start, window, position; then the flow key for records stored
/// before positions were kept).
pub async fn list(
    pool: &PgPool,
    filter: &RecordFilter,
    request: &PageRequest,
) -> Result<Page<FlowRow>, Error> {
    let limit = request.checked_limit()?;
    crate::input::instant("since", filter.since)?;
    let mut q = QueryBuilder::<Postgres>::new(
        "SELECT window_start, window_id, ordinal, policy_version, host(src_address) AS src_address,
                host(dst_address) AS dst_address, peer_kind, peer_key, peer_labels, dst_port, protocol, decision,
                matched_rule_id, packets, bytes, new_connections, pending_decision, pending_rule_id,
                CASE WHEN pending_decision IS NOT NULL THEN
                    (SELECT w.staged_set FROM flow_windows w WHERE w.workload_id = r.workload_id
                       AND w.window_id = r.window_id AND w.window_start = r.window_start)
                END AS staged_set
         FROM flow_records r WHERE workload_id = ",
    );
    q.push_bind(filter.workload.uuid()).push(" AND window_start >= ").push_bind(filter.since);
    if let Some(decision) = filter.decision {
        q.push(" AND decision = ").push_bind(decision.code());
    }
    if let Some(version) = filter.version {
        q.push(" AND policy_version = ").push_bind(version_code(version)?);
    }
    let cursor_key = crate::page::cursor_key(pool).await?;
    if let Some(after) = request.after(&cursor_key, RECORDS)? {
        q.push(" AND (window_start, window_id, -ordinal, src_address, dst_address, dst_port, protocol) < (")
            .push_bind(page::field::<DateTime<Utc>>(&after, 0, RECORDS)?)
            .push(", ")
            .push_bind(page::field::<Uuid>(&after, 1, RECORDS)?)
            .push(", ")
            .push_bind(-page::field::<i32>(&after, 2, RECORDS)?)
            .push(", ")
            .push_bind(page::field::<String>(&after, 3, RECORDS)?)
            .push("::inet, ")
            .push_bind(page::field::<String>(&after, 4, RECORDS)?)
            .push("::inet, ")
            .push_bind(page::field::<i32>(&after, 5, RECORDS)?)
            .push(", ")
            .push_bind(page::field::<i16>(&after, 6, RECORDS)?)
            .push(")");
    }
    q.push(
        " ORDER BY window_start DESC, window_id DESC, -ordinal DESC, src_address DESC, dst_address DESC,
                   dst_port DESC, protocol DESC LIMIT ",
    )
    .push_bind(limit + 1);
    let rows: Vec<FlowRow> = q.build_query_as().fetch_all(pool).await?;
    Ok(page::page(&cursor_key, rows, limit, RECORDS, |r| {
        serde_json::json!([
            r.window_start,
            r.window_id,
            r.ordinal,
            r.src_address,
            r.dst_address,
            r.dst_port,
            r.protocol
        ])
    }))
}

/// A policy version as the database stores it.
pub(super) fn version_code(version: u64) -> Result<i64, Error> {
    i64::try_from(version).map_err(|_| Error::Invalid(format!("policy version {version} does not exist")))
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct GapRow {
    pub workload_id: Uuid,
    pub window_id: Uuid,
    #[serde(skip)]
    pub ordinal: i32,
    pub kind: i16,
    pub gap_from: DateTime<Utc>,
    pub gap_to: DateTime<Utc>,
    pub count: i64,
    /// Why, where the agent gave a reason.
    pub detail: String,
}

const GAPS: &str = "gaps";

/// Evidence gaps of windows since `since` (of one workload, or all), latest gap first, a page at
/// a time.
pub async fn gaps(
    pool: &PgPool,
    workload: Option<WorkloadId>,
    since: DateTime<Utc>,
    request: &PageRequest,
) -> Result<Page<GapRow>, Error> {
    let limit = request.checked_limit()?;
    crate::input::instant("since", since)?;
    let mut q = QueryBuilder::<Postgres>::new(
        "SELECT workload_id, window_id, ordinal, kind, gap_from, gap_to, count, detail FROM flow_gaps
         WHERE window_start >= ",
    );
    q.push_bind(since);
    if let Some(workload) = workload {
        q.push(" AND workload_id = ").push_bind(workload.uuid());
    }
    let cursor_key = crate::page::cursor_key(pool).await?;
    if let Some(after) = request.after(&cursor_key, GAPS)? {
        q.push(" AND (gap_from, workload_id, window_id, ordinal, kind, gap_to, count, detail) < (")
            .push_bind(page::field::<DateTime<Utc>>(&after, 0, GAPS)?)
            .push(", ")
            .push_bind(page::field::<Uuid>(&after, 1, GAPS)?)
            .push(", ")
            .push_bind(page::field::<Uuid>(&after, 2, GAPS)?)
            .push(", ")
            .push_bind(page::field::<i32>(&after, 3, GAPS)?)
            .push(", ")
            .push_bind(page::field::<i16>(&after, 4, GAPS)?)
            .push(", ")
            .push_bind(page::field::<DateTime<Utc>>(&after, 5, GAPS)?)
            .push(", ")
            .push_bind(page::field::<i64>(&after, 6, GAPS)?)
            .push(", ")
            .push_bind(page::field::<String>(&after, 7, GAPS)?)
            .push(")");
    }
    q.push(
        " ORDER BY gap_from DESC, workload_id DESC, window_id DESC, ordinal DESC, kind DESC, gap_to DESC,
                   count DESC, detail DESC LIMIT ",
    )
    .push_bind(limit + 1);
    let rows: Vec<GapRow> = q.build_query_as().fetch_all(pool).await?;
    Ok(page::page(&cursor_key, rows, limit, GAPS, |g| {
        serde_json::json!([
            g.gap_from,
            g.workload_id,
            g.window_id,
            g.ordinal,
            g.kind,
            g.gap_to,
            g.count,
            g.detail
        ])
    }))
}

/// What the windows of `ids` that started since `since` say, per workload: the records decided
/// would-block or blocked, and the evidence gaps (the fleet page's attention columns).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowTotals {
    pub blocking_records: i64,
    pub gaps: i64,
}

pub async fn window_totals(
    pool: &PgPool,
    ids: &[Uuid],
    since: DateTime<Utc>,
) -> Result<std::collections::BTreeMap<Uuid, WindowTotals>, Error> {
    let rows: Vec<(Uuid, i64, i64)> = sqlx::query_as(
        "SELECT workload_id, sum(would_block_records + blocked_records)::bigint, sum(gap_count)::bigint
           FROM flow_windows WHERE workload_id = ANY($1) AND window_start >= $2 GROUP BY workload_id",
    )
    .bind(ids)
    .bind(since)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, blocking_records, gaps)| (id, WindowTotals { blocking_records, gaps }))
        .collect())
}
