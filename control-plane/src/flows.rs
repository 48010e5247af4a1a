//! Flow evidence ingest and storage (FLOW-2, FLOW-4, FLOW-5): a window from an agent is
//! validated as a whole (refused with a reason, never stored half), each source address is
//! resolved as it is *now* — workload (with a snapshot of its labels), else the most specific
//! address group, else the bare address — and window, records, gaps and totals are written in
//! one transaction. A window is stored once per (workload, window id), so retries never count
//! twice. Records and gaps live in daily partitions; retention drops whole partitions.

use std::collections::BTreeMap;
use std::net::IpAddr;

use chrono::{DateTime, Duration, NaiveDate, TimeZone, Utc};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::RuleId;
use innerwall_wire::proto;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::store::StoreError;

/// Bounds on one window.
pub const MAX_RECORDS: usize = 100_000;
pub const MAX_GAPS: usize = 1_000;
pub const MAX_WINDOW: Duration = Duration::hours(24);
/// Default retention of flow evidence.
pub const DEFAULT_RETENTION_DAYS: i64 = 30;

/// Key of the transaction-scoped advisory lock partition maintenance takes ("iw-flows").
const PARTITION_LOCK_KEY: i64 = 0x6977_2d66_6c6f_7773;

/// A window after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub id: Uuid,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub policy_version: u64,
    pub mode: i16,
    pub records: Vec<Record>,
    pub gaps: Vec<Gap>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dst_port: u16,
    pub protocol: i16,
    pub decision: i16,
    pub matched_rule_id: String,
    pub packets: u64,
    pub bytes: u64,
    pub new_connections: u64,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Gap {
    pub kind: i16,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub count: u64,
}

fn ms(what: &str, value: i64) -> Result<DateTime<Utc>, String> {
    Utc.timestamp_millis_opt(value).single().ok_or_else(|| format!("{what} {value} is not a valid time"))
}

fn fits_i64(what: &str, n: u64) -> Result<u64, String> {
    i64::try_from(n).map(|_| n).map_err(|_| format!("{what} {n} is out of range"))
}

/// Validates a whole window; the first problem refuses it, naming the record.
pub fn validate(wire: &proto::FlowWindow) -> Result<Window, String> {
    let id = Uuid::parse_str(&wire.window_id)
        .map_err(|_| format!("window id {:?} is not a uuid", wire.window_id))?;
    let (start, end) = (ms("window start", wire.start_unix_ms)?, ms("window end", wire.end_unix_ms)?);
    if start > end || end - start > MAX_WINDOW {
        return Err(format!("window [{start}, {end}) must be ordered and at most 24 h long"));
    }
    let mode = i16::try_from(wire.mode)
        .ok()
        .filter(|m| (1..=3).contains(m))
        .ok_or(format!("unknown mode {}", wire.mode))?;
    if wire.records.len() > MAX_RECORDS || wire.gaps.len() > MAX_GAPS {
        return Err(format!("a window carries at most {MAX_RECORDS} records and {MAX_GAPS} gaps"));
    }
    fits_i64("policy version", wire.policy_version)?;
    let records = wire
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| record(r).map_err(|e| format!("record {i}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let gaps = wire
        .gaps
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let kind = i16::try_from(g.kind)
                .ok()
                .filter(|k| (1..=4).contains(k))
                .ok_or(format!("gap {i}: unknown kind {}", g.kind))?;
            let (from, to) = (ms("gap start", g.from_unix_ms)?, ms("gap end", g.to_unix_ms)?);
            if from > to {
                return Err(format!("gap {i}: interval is reversed"));
            }
            Ok(Gap { kind, from, to, count: fits_i64("gap count", g.count)? })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Window { id, start, end, policy_version: wire.policy_version, mode, records, gaps })
}

fn record(r: &proto::FlowRecord) -> Result<Record, String> {
    let addr = |what: &str, text: &str| {
        text.parse::<IpAddr>().map_err(|_| format!("{what} {text:?} is not an address"))
    };
    let protocol = i16::try_from(r.protocol)
        .ok()
        .filter(|p| (1..=4).contains(p))
        .ok_or(format!("unknown protocol {}", r.protocol))?;
    let decision = i16::try_from(r.decision)
        .ok()
        .filter(|d| (1..=4).contains(d))
        .ok_or(format!("unknown decision {}", r.decision))?;
    let dst_port = u16::try_from(r.dst_port).map_err(|_| format!("port {} is out of range", r.dst_port))?;
    if protocol >= 3 && dst_port != 0 {
        return Err("icmp flows carry no port".into());
    }
    let allowed = decision == proto::FlowDecision::Allowed as i16;
    if allowed == r.matched_rule_id.is_empty() {
        return Err("a matched rule id is required exactly for ALLOWED".into());
    }
    if allowed {
        RuleId::parse(&r.matched_rule_id).map_err(|e| e.to_string())?;
    }
    let (first_seen, last_seen) =
        (ms("first seen", r.first_seen_unix_ms)?, ms("last seen", r.last_seen_unix_ms)?);
    if first_seen > last_seen {
        return Err("first seen is after last seen".into());
    }
    Ok(Record {
        src: addr("source", &r.src_address)?.to_canonical(),
        dst: addr("destination", &r.dst_address)?.to_canonical(),
        dst_port,
        protocol,
        decision,
        matched_rule_id: r.matched_rule_id.clone(),
        packets: fits_i64("packets", r.packets)?,
        bytes: fits_i64("bytes", r.bytes)?,
        new_connections: fits_i64("new connections", r.new_connections)?,
        first_seen,
        last_seen,
    })
}

/// How a source address resolved at ingest.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Peer {
    kind: i16,
    key: String,
    labels: serde_json::Value,
}

async fn resolve(conn: &mut PgConnection, sources: &[String]) -> Result<BTreeMap<String, Peer>, StoreError> {
    let mut peers = BTreeMap::new();
    for row in sqlx::query(
        "SELECT host(a.address), w.id::text,
                COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id), '{}')
         FROM workload_addresses a JOIN workloads w ON w.id = a.workload_id
         WHERE w.retired_at IS NULL AND a.address = ANY($1::inet[])",
    )
    .bind(sources)
    .fetch_all(&mut *conn)
    .await?
    {
        peers.insert(row.get::<String, _>(0), Peer { kind: 1, key: row.get(1), labels: row.get(2) });
    }
    for row in sqlx::query(
        "SELECT DISTINCT ON (s) host(s), g.name
         FROM unnest($1::inet[]) AS s JOIN address_group_cidrs c ON c.cidr >>= s JOIN address_groups g ON g.id = c.group_id
         ORDER BY s, masklen(c.cidr) DESC, g.name",
    )
    .bind(sources)
    .fetch_all(&mut *conn)
    .await?
    {
        peers
            .entry(row.get::<String, _>(0))
            .or_insert_with(|| Peer { kind: 2, key: row.get(1), labels: serde_json::json!({}) });
    }
    Ok(peers)
}

/// Creates the daily partitions covering `[from, to]` if missing.
pub async fn ensure_partitions(
    conn: &mut PgConnection,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *conn).await?;
    let mut day = from.date_naive();
    while day <= to.date_naive() {
        let next = day.succ_opt().expect("dates far from the end of time");
        for table in ["flow_records", "flow_gaps"] {
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS {table}_{} PARTITION OF {table} FOR VALUES FROM ('{day}') TO ('{next}')",
                day.format("%Y%m%d")
            );
            sqlx::query(AssertSqlSafe(sql)).execute(&mut *conn).await?;
        }
        day = next;
    }
    Ok(())
}

/// What an upload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Ingested {
    pub records: usize,
    pub duplicate: bool,
}

/// Stores one validated window from `workload` (identity from its certificate).
pub async fn ingest(pool: &PgPool, workload: WorkloadId, window: &Window) -> Result<Ingested, StoreError> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(
        "INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode, record_count, gap_count)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .bind(window.start)
    .bind(window.end)
    .bind(window.policy_version as i64)
    .bind(window.mode)
    .bind(window.records.len() as i32)
    .bind(window.gaps.len() as i32)
    .execute(&mut *tx)
    .await?;
    if fresh.rows_affected() == 0 {
        return Ok(Ingested { records: 0, duplicate: true });
    }
    ensure_partitions(&mut tx, window.start, window.start).await?;
    let sources: Vec<String> = window.records.iter().map(|r| r.src.to_string()).collect();
    let peers = resolve(&mut tx, &sources).await?;
    let peer_of = |r: &Record| {
        let text = r.src.to_string();
        peers.get(&text).cloned().unwrap_or(Peer { kind: 0, key: text, labels: serde_json::json!({}) })
    };
    let resolved: Vec<Peer> = window.records.iter().map(peer_of).collect();
    let col = |f: &dyn Fn(&Record) -> i64| window.records.iter().map(f).collect::<Vec<i64>>();
    sqlx::query(
        "INSERT INTO flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
            dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
            peer_kind, peer_key, peer_labels)
         SELECT $1, $2, $3, $4, s::inet, d::inet, p, pr, de, m, pk, b, n, f, l, k, key, lab
         FROM unnest($5::text[], $6::text[], $7::int[], $8::smallint[], $9::smallint[], $10::text[], $11::bigint[],
                     $12::bigint[], $13::bigint[], $14::timestamptz[], $15::timestamptz[], $16::smallint[], $17::text[],
                     $18::jsonb[])
              AS t (s, d, p, pr, de, m, pk, b, n, f, l, k, key, lab)",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .bind(window.start)
    .bind(window.policy_version as i64)
    .bind(&sources)
    .bind(window.records.iter().map(|r| r.dst.to_string()).collect::<Vec<_>>())
    .bind(window.records.iter().map(|r| i32::from(r.dst_port)).collect::<Vec<_>>())
    .bind(window.records.iter().map(|r| r.protocol).collect::<Vec<_>>())
    .bind(window.records.iter().map(|r| r.decision).collect::<Vec<_>>())
    .bind(window.records.iter().map(|r| r.matched_rule_id.clone()).collect::<Vec<_>>())
    .bind(col(&|r| r.packets as i64))
    .bind(col(&|r| r.bytes as i64))
    .bind(col(&|r| r.new_connections as i64))
    .bind(window.records.iter().map(|r| r.first_seen).collect::<Vec<_>>())
    .bind(window.records.iter().map(|r| r.last_seen).collect::<Vec<_>>())
    .bind(resolved.iter().map(|p| p.kind).collect::<Vec<_>>())
    .bind(resolved.iter().map(|p| p.key.clone()).collect::<Vec<_>>())
    .bind(resolved.iter().map(|p| p.labels.clone()).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO flow_gaps (workload_id, window_id, window_start, kind, gap_from, gap_to, count)
         SELECT $1, $2, $3, k, f, t, c FROM unnest($4::smallint[], $5::timestamptz[], $6::timestamptz[], $7::bigint[]) AS x (k, f, t, c)",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .bind(window.start)
    .bind(window.gaps.iter().map(|g| g.kind).collect::<Vec<_>>())
    .bind(window.gaps.iter().map(|g| g.from).collect::<Vec<_>>())
    .bind(window.gaps.iter().map(|g| g.to).collect::<Vec<_>>())
    .bind(window.gaps.iter().map(|g| g.count as i64).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO flow_totals (workload_id, peer_key, dst_port, protocol, decision, packets, bytes, new_connections,
            first_seen, last_seen, windows)
         SELECT workload_id, peer_key, dst_port, protocol, decision, sum(packets), sum(bytes), sum(new_connections),
                min(first_seen), max(last_seen), 1
         FROM flow_records WHERE workload_id = $1 AND window_id = $2 AND window_start = $3
         GROUP BY workload_id, peer_key, dst_port, protocol, decision
         ON CONFLICT (workload_id, peer_key, dst_port, protocol, decision) DO UPDATE SET
            packets = flow_totals.packets + excluded.packets, bytes = flow_totals.bytes + excluded.bytes,
            new_connections = flow_totals.new_connections + excluded.new_connections,
            first_seen = least(flow_totals.first_seen, excluded.first_seen),
            last_seen = greatest(flow_totals.last_seen, excluded.last_seen), windows = flow_totals.windows + 1",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .bind(window.start)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ingested { records: window.records.len(), duplicate: false })
}

/// Drops daily partitions entirely older than `days` (FLOW-5), under the partition lock.
/// Returns the dropped partitions.
pub async fn apply_retention(
    pool: &PgPool,
    days: i64,
    now: DateTime<Utc>,
) -> Result<Vec<String>, StoreError> {
    let cutoff: NaiveDate = (now - Duration::days(days)).date_naive();
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *tx).await?;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
         WHERE p.relname IN ('flow_records', 'flow_gaps') ORDER BY 1",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut dropped = Vec::new();
    for name in names {
        let Some(day) = name.rsplit('_').next().and_then(|d| NaiveDate::parse_from_str(d, "%Y%m%d").ok())
        else {
            continue;
        };
        // The partition holds [day, day + 1): drop it once that whole day is past the cutoff.
        if day < cutoff {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {name}"))).execute(&mut *tx).await?;
            dropped.push(name);
        }
    }
    sqlx::query("DELETE FROM flow_windows WHERE window_start < $1")
        .bind(Utc.from_utc_datetime(&cutoff.and_hms_opt(0, 0, 0).expect("midnight exists")))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(dropped)
}

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
    decision: Option<i16>,
    limit: i64,
) -> Result<Vec<FlowRow>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT window_start, policy_version, host(src_address) AS src_address, peer_kind, peer_key, peer_labels,
                dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections
         FROM flow_records WHERE workload_id = $1 AND window_start >= $2 AND ($3::smallint IS NULL OR decision = $3)
         ORDER BY window_start DESC, src_address, dst_port LIMIT $4",
    )
    .bind(workload.uuid())
    .bind(since)
    .bind(decision)
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
}

pub async fn gaps(
    pool: &PgPool,
    workload: Option<WorkloadId>,
    since: DateTime<Utc>,
) -> Result<Vec<GapRow>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT workload_id, kind, gap_from, gap_to, count FROM flow_gaps
         WHERE ($1::uuid IS NULL OR workload_id = $1) AND window_start >= $2 ORDER BY gap_from DESC LIMIT 1000",
    )
    .bind(workload.map(|w| w.uuid()))
    .bind(since)
    .fetch_all(pool)
    .await?)
}

pub fn decision_name(n: i16) -> &'static str {
    match n {
        1 => "observed",
        2 => "allowed",
        3 => "would-block",
        4 => "blocked",
        _ => "unknown",
    }
}

pub fn gap_kind_name(n: i16) -> &'static str {
    match n {
        1 => "map-full",
        2 => "agent-restart",
        3 => "upload-buffer-overflow",
        4 => "window-key-overflow",
        _ => "unknown",
    }
}

/// The telemetry service (SYNC-10: its own connection from the agent; same listener).
#[derive(Debug, Clone)]
pub struct Telemetry {
    pub pool: PgPool,
}

#[tonic::async_trait]
impl proto::telemetry_service_server::TelemetryService for Telemetry {
    async fn report_flows(
        &self,
        request: tonic::Request<proto::ReportFlowsRequest>,
    ) -> Result<tonic::Response<proto::ReportFlowsResponse>, tonic::Status> {
        let workload = crate::server::identity(&request)?;
        let wire = request
            .get_ref()
            .window
            .as_ref()
            .ok_or_else(|| tonic::Status::invalid_argument("window is missing"))?;
        let window =
            validate(wire).map_err(|e| tonic::Status::invalid_argument(format!("window refused: {e}")))?;
        let done = ingest(&self.pool, workload, &window).await.map_err(crate::enroll::status)?;
        Ok(tonic::Response::new(proto::ReportFlowsResponse {
            accepted_records: done.records as u32,
            duplicate: done.duplicate,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(records: Vec<proto::FlowRecord>) -> proto::FlowWindow {
        proto::FlowWindow {
            window_id: Uuid::new_v4().to_string(),
            start_unix_ms: 1_700_000_000_000,
            end_unix_ms: 1_700_000_060_000,
            policy_version: 3,
            mode: 2,
            records,
            gaps: vec![],
        }
    }

    fn rec() -> proto::FlowRecord {
        proto::FlowRecord {
            src_address: "10.0.0.1".into(),
            dst_address: "10.0.0.2".into(),
            dst_port: 5432,
            protocol: 1,
            decision: 3,
            matched_rule_id: String::new(),
            packets: 3,
            bytes: 180,
            new_connections: 1,
            first_seen_unix_ms: 1_700_000_001_000,
            last_seen_unix_ms: 1_700_000_002_000,
        }
    }

    #[test]
    fn windows_are_validated_whole() {
        assert!(validate(&window(vec![rec()])).is_ok());
        type Mutation = Box<dyn Fn(&mut proto::FlowRecord)>;
        let bad: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.src_address = "nope".into()), "record 1: source \"nope\" is not an address"),
            (Box::new(|r| r.dst_port = 70_000), "port 70000 is out of range"),
            (Box::new(|r| r.protocol = 9), "unknown protocol 9"),
            (Box::new(|r| r.decision = 0), "unknown decision 0"),
            (Box::new(|r| r.decision = 2), "matched rule id is required exactly for ALLOWED"),
            (
                Box::new(|r| r.matched_rule_id = "r/tcp".into()),
                "matched rule id is required exactly for ALLOWED",
            ),
            (Box::new(|r| r.first_seen_unix_ms = i64::MAX), "first seen"),
            (Box::new(|r| r.packets = u64::MAX), "packets"),
            (
                Box::new(|r| {
                    r.protocol = 3;
                }),
                "icmp flows carry no port",
            ),
        ];
        for (mutate, want) in bad {
            let mut second = rec();
            mutate(&mut second);
            let err = validate(&window(vec![rec(), second])).unwrap_err();
            assert!(err.contains(want), "{err} lacks {want}");
        }
        let mut w = window(vec![]);
        w.window_id = "x".into();
        assert!(validate(&w).unwrap_err().contains("not a uuid"));
        let mut w = window(vec![]);
        w.end_unix_ms = w.start_unix_ms - 1;
        assert!(validate(&w).is_err());
    }
}
