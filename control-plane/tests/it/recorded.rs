//! Recorded flows for the foresight tests (`impact`, `policy_tests`): flow records and windows
//! uploaded through the real ingest path (`flows::ingest`), as an agent's upload is stored.

use chrono::{DateTime, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing;
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, WorkloadPolicy};
use innerwall_wire::proto;

pub const HOUR: i64 = 3_600_000;

/// A flow of `connections` new connections from `src` to `dst` on tcp `port`: ALLOWED by `rule`
/// (a rendered rule id), or would-block without one.
pub fn flow_to(
    src: &str,
    dst: &str,
    port: u32,
    rule: Option<&str>,
    connections: u64,
    at: i64,
) -> proto::FlowRecord {
    let decision = match rule {
        Some(_) => proto::FlowDecision::Allowed,
        None => proto::FlowDecision::WouldBlock,
    };
    proto::FlowRecord {
        pending_decision: 0,
        pending_rule_id: String::new(),
        src_address: src.into(),
        dst_address: dst.into(),
        dst_port: port,
        protocol: proto::Protocol::Tcp.into(),
        decision: decision.into(),
        matched_rule_id: rule.unwrap_or_default().into(),
        packets: connections,
        bytes: connections * 60,
        new_connections: connections,
        first_seen_unix_ms: at + 1_000,
        last_seen_unix_ms: at + 2_000,
    }
}

/// An hour-long simulation window of `id` under `version` from `start`, ingested.
pub async fn ingest(
    pool: &sqlx::PgPool,
    id: WorkloadId,
    version: u64,
    start: i64,
    records: Vec<proto::FlowRecord>,
    gaps: Vec<proto::EvidenceGap>,
) {
    let wire = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + HOUR,
        policy_version: version,
        mode: 2,
        records,
        gaps,
    };
    flows::ingest(pool, id, &FlowWindow::try_from(&wire).unwrap()).await.unwrap();
}

/// The rendered id of the rule of `policy` serving `port`.
pub fn rule_for(policy: &WorkloadPolicy, port: u16) -> String {
    policy.rules().find(|r| r.ports().iter().any(|p| p.contains(port))).unwrap().id().to_string()
}

pub fn at(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap()
}

/// `host`'s latest persisted policy, installed in simulation at `since_ms` and applied, so
/// windows under it are evidence: its id and that policy.
pub async fn applied_in_simulation(
    pool: &sqlx::PgPool,
    host: &str,
    since_ms: i64,
) -> (WorkloadId, WorkloadPolicy) {
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM workloads WHERE hostname = $1")
        .bind(host)
        .fetch_one(pool)
        .await
        .unwrap();
    let id = WorkloadId::from_uuid(id).unwrap();
    let policy = store::persisted_policy(&mut pool.acquire().await.unwrap(), id).await.unwrap().unwrap().0;
    testing::installed(pool, id, &[(policy.version(), Mode::Simulation, at(since_ms))]).await.unwrap();
    sqlx::query("UPDATE workloads SET applied_version = $2 WHERE id = $1")
        .bind(id.uuid())
        .bind(policy.version() as i64)
        .execute(pool)
        .await
        .unwrap();
    (id, policy)
}
