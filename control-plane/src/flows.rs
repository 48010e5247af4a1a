//! Flow evidence ingest and storage (FLOW-2, FLOW-4, FLOW-5): a window from an agent is
//! validated as a whole (refused with a reason, never stored half), each source address is
//! resolved at ingest — workload (with a snapshot of the labels it had when the flow was seen,
//! from the label history), else the most specific address group, else the bare address — and
//! the window (with its totals), records and gaps are written in one transaction. A window is
//! stored once per (workload, window id), so retries never count twice. Records and gaps live
//! in daily partitions; retention drops whole partitions. Ingests
//! hold the partition lock shared, so uploads from many agents run side by side; creating and
//! dropping partitions holds it exclusively.

use std::collections::BTreeMap;
use std::net::IpAddr;

use chrono::{DateTime, Duration, NaiveDate, TimeZone, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{Decision, FlowRecord, FlowWindow};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::store::StoreError;

/// Default retention of flow evidence.
pub const DEFAULT_RETENTION_DAYS: i64 = 30;

/// Key of the transaction-scoped advisory lock partition maintenance takes ("iw-flows").
const PARTITION_LOCK_KEY: i64 = 0x6977_2d66_6c6f_7773;

/// A time the wire layer validated (`flows::TIME_RANGE_MS`), as the database stores it.
fn time(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().expect("validated at the wire boundary")
}

/// How a source address resolved at ingest.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Peer {
    kind: i16,
    key: String,
    /// The label snapshot as JSON text, serialized once per distinct peer.
    labels: String,
}

const NO_LABELS: &str = "{}";

/// Resolves each distinct source once: workload, else the most specific address group, else the
/// bare address. A workload's labels are those it had at the source's first packet in the
/// window (`sources` maps each source to that time), from the label history; so a flow seen
/// before a relabel keeps the labels it was seen under, however late it is uploaded.
async fn resolve(
    conn: &mut PgConnection,
    sources: &BTreeMap<IpAddr, DateTime<Utc>>,
) -> Result<BTreeMap<IpAddr, Peer>, StoreError> {
    let texts: Vec<String> = sources.keys().map(IpAddr::to_string).collect();
    let times: Vec<DateTime<Utc>> = sources.values().copied().collect();
    let mut peers = BTreeMap::new();
    // One statement over the distinct sources, each parsed once: workload matches first, then
    // each remaining source's most specific group.
    for row in sqlx::query(
        "WITH s AS MATERIALIZED (SELECT s, at FROM unnest($1::inet[], $2::timestamptz[]) AS t (s, at)),
         w AS MATERIALIZED (
            SELECT s.s, w.id::text AS key,
                   COALESCE((SELECT h.labels FROM workload_label_history h
                             WHERE h.workload_id = w.id AND h.valid_from <= s.at
                             ORDER BY h.valid_from DESC, h.label_version DESC LIMIT 1),
                            (SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id),
                            '{}')::text AS labels
            FROM s JOIN workload_addresses a ON a.address = s.s JOIN workloads w ON w.id = a.workload_id
            WHERE w.retired_at IS NULL)
         SELECT host(s), 1::smallint, key, labels FROM w
         UNION ALL
         SELECT * FROM (
            SELECT DISTINCT ON (s.s) host(s.s), 2::smallint, g.name::text, '{}'
            FROM s JOIN address_group_cidrs c ON c.cidr >>= s.s JOIN address_groups g ON g.id = c.group_id
            WHERE NOT EXISTS (SELECT 1 FROM w WHERE w.s = s.s)
            ORDER BY s.s, masklen(c.cidr) DESC, g.name) AS groups",
    )
    .bind(&texts)
    .bind(&times)
    .fetch_all(&mut *conn)
    .await?
    {
        let addr = parse_host(row.get(0))?;
        peers.insert(addr, Peer { kind: row.get(1), key: row.get(2), labels: row.get(3) });
    }
    Ok(peers)
}

fn parse_host(text: String) -> Result<IpAddr, StoreError> {
    text.parse().map_err(|_| StoreError::Corrupt { what: "resolved address", detail: text })
}

/// The partitioned flow tables, each with a partition a day.
const PARTITIONED: [&str; 2] = ["flow_records", "flow_gaps"];

/// Each partitioned table with the name of its partition for `day`.
fn partitions(day: NaiveDate) -> [(&'static str, String); 2] {
    let suffix = day.format("%Y%m%d");
    PARTITIONED.map(|table| (table, format!("{table}_{suffix}")))
}

/// Creates the daily partitions covering `[from, to]` if missing. Takes the partition lock
/// exclusively (creation and retention exclude each other and every ingest); call it in a
/// transaction of its own, before the one that writes into the partitions.
pub async fn ensure_partitions(
    conn: &mut PgConnection,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *conn).await?;
    let mut day = from.date_naive();
    while day <= to.date_naive() {
        let next = day.succ_opt().expect("dates far from the end of time");
        for (table, partition) in partitions(day) {
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS {partition} PARTITION OF {table} FOR VALUES FROM ('{day}') TO ('{next}')"
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

/// A window's totals, stored on its `flow_windows` row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Totals {
    packets: i64,
    bytes: i64,
    new_connections: i64,
    /// Records per decision, in `Decision::ALL` order.
    records: [i32; 4],
}

/// Sums a window's records. A window whose sums do not fit the columns is refused whole.
fn window_totals(records: &[FlowRecord]) -> Result<Totals, StoreError> {
    let overflow = || StoreError::Invalid("window refused: its totals overflow 64 bits".into());
    let mut t = Totals::default();
    for r in records {
        t.packets = t.packets.checked_add(r.packets as i64).ok_or_else(overflow)?;
        t.bytes = t.bytes.checked_add(r.bytes as i64).ok_or_else(overflow)?;
        t.new_connections = t.new_connections.checked_add(r.new_connections as i64).ok_or_else(overflow)?;
        // At most MAX_RECORDS records: the count fits.
        t.records[Decision::ALL.iter().position(|d| *d == r.decision).expect("every decision is in ALL")] +=
            1;
    }
    Ok(t)
}

/// Stores one validated window from `workload` (identity from its certificate).
///
/// Records go in by binary `COPY` (no text parsing on the server), each source is resolved
/// once per window, and the window's totals are summed here and stored on its row.
pub async fn ingest(
    pool: &PgPool,
    workload: WorkloadId,
    window: &FlowWindow,
) -> Result<Ingested, StoreError> {
    let (start, end) = (time(window.start_ms), time(window.end_ms));
    let names: Vec<String> = partitions(start.date_naive()).into_iter().map(|(_, name)| name).collect();
    let exists: bool =
        sqlx::query_scalar("SELECT bool_and(to_regclass(n) IS NOT NULL) FROM unnest($1::text[]) AS n")
            .bind(&names)
            .fetch_one(pool)
            .await?;
    if !exists {
        let mut tx = pool.begin().await?;
        ensure_partitions(&mut tx, start, start).await?;
        tx.commit().await?;
    }

    let totals = window_totals(&window.records)?;
    let mut tx = pool.begin().await?;
    // Shared: ingests run side by side; retention (exclusive) waits for them and they for it.
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)").bind(PARTITION_LOCK_KEY).execute(&mut *tx).await?;
    let fresh = sqlx::query(
        "INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode, record_count,
            gap_count, packets, bytes, new_connections, observed_records, allowed_records, would_block_records,
            blocked_records)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) ON CONFLICT DO NOTHING",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .bind(start)
    .bind(end)
    .bind(window.policy_version as i64)
    .bind(window.mode.code())
    .bind(window.records.len() as i32)
    .bind(window.gaps.len() as i32)
    .bind(totals.packets)
    .bind(totals.bytes)
    .bind(totals.new_connections)
    .bind(totals.records[0])
    .bind(totals.records[1])
    .bind(totals.records[2])
    .bind(totals.records[3])
    .execute(&mut *tx)
    .await?;
    if fresh.rows_affected() == 0 {
        return Ok(Ingested { records: 0, duplicate: true });
    }
    let mut sources: BTreeMap<IpAddr, DateTime<Utc>> = BTreeMap::new();
    for r in &window.records {
        let seen = time(r.first_seen_ms);
        sources.entry(r.src).and_modify(|at| *at = (*at).min(seen)).or_insert(seen);
    }
    let mut peers = resolve(&mut tx, &sources).await?;
    for src in sources.keys() {
        peers.entry(*src).or_insert_with(|| Peer { kind: 0, key: src.to_string(), labels: NO_LABELS.into() });
    }
    let resolved: Vec<&Peer> = window.records.iter().map(|r| &peers[&r.src]).collect();

    let mut rows = copy::Rows::new();
    for (r, peer) in window.records.iter().zip(&resolved) {
        rows.row(18);
        rows.uuid(workload.uuid());
        rows.uuid(window.id);
        rows.timestamptz(start)?;
        rows.i64(window.policy_version as i64);
        rows.inet(r.src);
        rows.inet(r.dst);
        rows.i32(i32::from(r.dst_port));
        rows.i16(r.protocol.code());
        rows.i16(r.decision.code());
        rows.text(r.matched_rule.as_ref().map(|id| id.as_str()).unwrap_or_default());
        rows.i64(r.packets as i64);
        rows.i64(r.bytes as i64);
        rows.i64(r.new_connections as i64);
        rows.timestamptz(time(r.first_seen_ms))?;
        rows.timestamptz(time(r.last_seen_ms))?;
        rows.i16(peer.kind);
        rows.text(&peer.key);
        rows.jsonb(&peer.labels);
    }
    copy_in(
        &mut tx,
        "COPY flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
            dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
            peer_kind, peer_key, peer_labels) FROM STDIN (FORMAT binary)",
        rows,
    )
    .await?;

    if !window.gaps.is_empty() {
        sqlx::query(
            "INSERT INTO flow_gaps (workload_id, window_id, window_start, kind, gap_from, gap_to, count)
             SELECT $1, $2, $3, k, f, t, c FROM unnest($4::smallint[], $5::timestamptz[], $6::timestamptz[], $7::bigint[]) AS x (k, f, t, c)",
        )
        .bind(workload.uuid())
        .bind(window.id)
        .bind(start)
        .bind(window.gaps.iter().map(|g| g.kind.code()).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| time(g.from_ms)).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| time(g.to_ms)).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| g.count as i64).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Ingested { records: window.records.len(), duplicate: false })
}

/// Sends `rows` with one binary `COPY … FROM STDIN` statement.
async fn copy_in(
    conn: &mut PgConnection,
    statement: &'static str,
    rows: copy::Rows,
) -> Result<(), StoreError> {
    let mut copy = conn.copy_in_raw(statement).await?;
    copy.send(rows.finish()).await?;
    copy.finish().await?;
    Ok(())
}

/// Rows in PostgreSQL's binary `COPY` format
/// (<https://www.postgresql.org/docs/15/sql-copy.html#id-1.9.3.55.9.4>): a header, then per row
/// a field count and length-prefixed fields in each type's binary send format, then a trailer.
mod copy {
    use std::net::IpAddr;

    use chrono::{DateTime, TimeZone, Utc};
    use uuid::Uuid;

    use crate::store::StoreError;

    /// PostgreSQL's `PGSQL_AF_INET` / `PGSQL_AF_INET6` (not the platform's AF_INET6).
    const PGSQL_AF_INET: u8 = 2;
    const PGSQL_AF_INET6: u8 = 3;

    pub struct Rows {
        buf: Vec<u8>,
    }

    impl Rows {
        pub fn new() -> Self {
            let mut buf = Vec::with_capacity(1 << 20);
            buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
            buf.extend_from_slice(&0i32.to_be_bytes()); // flags: no OIDs
            buf.extend_from_slice(&0i32.to_be_bytes()); // no header extension
            Rows { buf }
        }

        pub fn row(&mut self, fields: i16) {
            self.buf.extend_from_slice(&fields.to_be_bytes());
        }

        fn field(&mut self, bytes: &[u8]) {
            let len = i32::try_from(bytes.len()).expect("a field under 2 GiB");
            self.buf.extend_from_slice(&len.to_be_bytes());
            self.buf.extend_from_slice(bytes);
        }

        pub fn i16(&mut self, v: i16) {
            self.field(&v.to_be_bytes());
        }
        pub fn i32(&mut self, v: i32) {
            self.field(&v.to_be_bytes());
        }
        pub fn i64(&mut self, v: i64) {
            self.field(&v.to_be_bytes());
        }
        pub fn uuid(&mut self, v: Uuid) {
            self.field(v.as_bytes());
        }
        pub fn text(&mut self, v: &str) {
            self.field(v.as_bytes());
        }

        /// jsonb's binary format: version 1, then the JSON text.
        pub fn jsonb(&mut self, json: &str) {
            let len = i32::try_from(json.len() + 1).expect("a field under 2 GiB");
            self.buf.extend_from_slice(&len.to_be_bytes());
            self.buf.push(1);
            self.buf.extend_from_slice(json.as_bytes());
        }

        /// Microseconds since 2000-01-01 UTC.
        pub fn timestamptz(&mut self, t: DateTime<Utc>) -> Result<(), StoreError> {
            let epoch = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0).single().expect("a valid date");
            let micros = (t - epoch).num_microseconds().ok_or_else(|| {
                StoreError::Invalid(format!("time {t} is out of the range the database stores"))
            })?;
            self.i64(micros);
            Ok(())
        }

        /// inet: family, prefix length, is-cidr flag, address length, address bytes.
        pub fn inet(&mut self, addr: IpAddr) {
            match addr {
                IpAddr::V4(a) => {
                    self.buf.extend_from_slice(&8i32.to_be_bytes());
                    self.buf.extend_from_slice(&[PGSQL_AF_INET, 32, 0, 4]);
                    self.buf.extend_from_slice(&a.octets());
                }
                IpAddr::V6(a) => {
                    self.buf.extend_from_slice(&20i32.to_be_bytes());
                    self.buf.extend_from_slice(&[PGSQL_AF_INET6, 128, 0, 16]);
                    self.buf.extend_from_slice(&a.octets());
                }
            }
        }

        pub fn finish(mut self) -> Vec<u8> {
            self.buf.extend_from_slice(&(-1i16).to_be_bytes());
            self.buf
        }
    }
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
         WHERE p.relname = ANY($1) ORDER BY 1",
    )
    .bind(PARTITIONED.as_slice())
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
    decision: Option<Decision>,
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
        let window = FlowWindow::try_from(wire)
            .map_err(|e| tonic::Status::invalid_argument(format!("window refused: {e}")))?;
        let done = ingest(&self.pool, workload, &window).await.map_err(crate::enroll::status)?;
        Ok(tonic::Response::new(proto::ReportFlowsResponse {
            accepted_records: done.records as u32,
            duplicate: done.duplicate,
        }))
    }
}
