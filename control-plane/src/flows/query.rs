//! What operators read of flow evidence: a workload's records and the evidence gaps.

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::Error;

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FlowRow {
    pub window_start: DateTime<Utc>,
    pub policy_version: i64,
    pub src_address: String,
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
}

/// Records of one workload since `since`, newest first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    workload: WorkloadId,
    since: DateTime<Utc>,
    decision: Option<Decision>,
    limit: i64,
) -> Result<Vec<FlowRow>, Error> {
    Ok(sqlx::query_as(
        "SELECT window_start, policy_version, host(src_address) AS src_address, peer_kind, peer_key, peer_labels,
                dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections
         FROM flow_records WHERE workload_id = $1 AND window_start >= $2 AND ($3::smallint IS NULL OR decision = $3)
         ORDER BY window_start DESC, src_address, dst_port LIMIT $4",
    )
    .bind(workload.uuid())
    .bind(since)
    .bind(decision.map(Decision::code))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct GapRow {
    pub workload_id: Uuid,
    pub kind: i16,
    pub gap_from: DateTime<Utc>,
    pub gap_to: DateTime<Utc>,
    pub count: i64,
    /// Why, where the agent gave a reason.
    pub detail: String,
}

pub async fn gaps(
    pool: &PgPool,
    workload: Option<WorkloadId>,
    since: DateTime<Utc>,
) -> Result<Vec<GapRow>, Error> {
    Ok(sqlx::query_as(
        "SELECT workload_id, kind, gap_from, gap_to, count, detail FROM flow_gaps
         WHERE ($1::uuid IS NULL OR workload_id = $1) AND window_start >= $2 ORDER BY gap_from DESC LIMIT 1000",
    )
    .bind(workload.map(|w| w.uuid()))
    .bind(since)
    .fetch_all(pool)
    .await?)
}
