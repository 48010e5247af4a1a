//! Flow evidence ingest (FLOW-2, FLOW-4, FLOW-5) and the TelemetryService: a window from an
//! agent is validated as a whole at the wire boundary (refused with a reason, never stored
//! half), each source address is
//! resolved at ingest — workload (with a snapshot of the labels it had when the flow was seen,
//! from the label history), else the most specific address group, else the bare address — and
//! the window (with its totals), records and gaps are written in one transaction. A window is
//! stored once per (workload, window id), so retries never count twice. Ingests hold the
//! partition lock (`retention`) shared, so uploads from many agents run side by side.

use std::collections::BTreeMap;
use std::net::IpAddr;

use chrono::{DateTime, TimeZone, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{Decision, FlowRecord, FlowWindow};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};

use super::installs;
use super::retention::{create_partitions, hold_partitions};
use crate::copy::{self, copy_in};
use crate::error::Error;
use crate::metrics::{Metrics, Refusal};

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
) -> Result<BTreeMap<IpAddr, Peer>, Error> {
    let texts: Vec<String> = sources.keys().map(IpAddr::to_string).collect();
    let times: Vec<DateTime<Utc>> = sources.values().copied().collect();
    let mut peers = BTreeMap::new();
    // One statement over the distinct sources, each parsed once: workload matches first, then
    // each remaining source's most specific group. A source is a workload's only while that
    // workload holds it now: live (neither retired nor deny-listed) and its claim accepted by
    // address trust (standing 1). At most one workload per source, twice over: the schema accepts
    // an address for one workload at most (`workload_addresses_accepted_once`, and retire and
    // deny clear a workload's standings), and `DISTINCT ON` takes one row per source whatever
    // the rows.
    for row in sqlx::query(
        "WITH s AS MATERIALIZED (SELECT s, at FROM unnest($1::inet[], $2::timestamptz[]) AS t (s, at)),
         w AS MATERIALIZED (
            SELECT DISTINCT ON (s.s) s.s, w.id::text AS key,
                   COALESCE((SELECT h.labels FROM workload_label_history h
                             WHERE h.workload_id = w.id AND h.valid_from <= s.at
                             ORDER BY h.valid_from DESC, h.label_version DESC LIMIT 1),
                            (SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id),
                            '{}')::text AS labels
            FROM s JOIN workload_addresses a ON a.address = s.s AND a.standing = 1
                 JOIN workloads w ON w.id = a.workload_id
            WHERE w.retired_at IS NULL AND w.denied_at IS NULL
            ORDER BY s.s, w.id)
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

fn parse_host(text: String) -> Result<IpAddr, Error> {
    text.parse().map_err(|_| Error::Corrupt { what: "resolved address", detail: text })
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
fn window_totals(records: &[FlowRecord]) -> Result<Totals, Error> {
    let overflow = || Error::Invalid("window refused: its totals overflow 64 bits".into());
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

/// Why an upload was not stored: a window whose claim to a version its host's installs do not
/// bear out (`installs::judge`), or anything else.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("{reason}: {detail}")]
    Evidence { reason: installs::Refusal, detail: String },
    #[error(transparent)]
    Other(#[from] Error),
}

impl From<sqlx::Error> for IngestError {
    fn from(e: sqlx::Error) -> Self {
        IngestError::Other(Error::from(e))
    }
}

impl IngestError {
    /// The reason in the refusal metric.
    pub fn refusal(&self) -> Refusal {
        match self {
            IngestError::Evidence { reason, .. } => match reason {
                installs::Refusal::VersionUnknown => Refusal::VersionUnknown,
                installs::Refusal::VersionNotInstalled => Refusal::VersionNotInstalled,
                installs::Refusal::ModeMismatch => Refusal::ModeMismatch,
                installs::Refusal::Overlap => Refusal::Overlap,
                installs::Refusal::StagedSetMismatch => Refusal::StagedSetMismatch,
                installs::Refusal::VersionPending => Refusal::VersionPending,
            },
            IngestError::Other(e) => Refusal::of(e),
        }
    }
}

/// A refused window is FAILED_PRECONDITION (the agent turns it into an UPLOAD_REFUSED gap and
/// goes on); a pending version UNAVAILABLE (the agent keeps the window and sends it again).
impl From<IngestError> for tonic::Status {
    fn from(e: IngestError) -> Self {
        match e {
            IngestError::Evidence { reason: installs::Refusal::VersionPending, .. } => {
                tonic::Status::unavailable(format!("window not stored yet: {e}"))
            }
            IngestError::Evidence { .. } => {
                tonic::Status::failed_precondition(format!("window refused: {e}"))
            }
            IngestError::Other(e) => tonic::Status::from(e),
        }
    }
}

/// Advisory lock class (the two-key form, apart from the partition lock's one-key space) of a
/// workload's windows: its uploads are checked for overlap one at a time.
const WINDOWS_LOCK_CLASS: i32 = 0x6977_7769;

/// [`ingest_with`] with the default clock skew.
pub async fn ingest(
    pool: &PgPool,
    workload: WorkloadId,
    window: &FlowWindow,
) -> Result<Ingested, IngestError> {
    ingest_with(pool, workload, window, TimeBounds::default().max_ahead).await
}

/// Stores one validated window from `workload` (identity from its certificate), if its version
/// is one the workload had and its host installed, in that version's mode, within the time
/// it was installed (`skew`: the clock skew allowed), and it overlaps none of the workload's
/// windows (a retry of a stored window id is a duplicate, stored once).
///
/// Records go in by binary `COPY` (no text parsing on the server), each source is resolved
/// once per window, and the window's totals are summed here and stored on its row.
pub async fn ingest_with(
    pool: &PgPool,
    workload: WorkloadId,
    window: &FlowWindow,
    skew: chrono::Duration,
) -> Result<Ingested, IngestError> {
    let (start, end) = (time(window.start_ms), time(window.end_ms));
    // Made ahead by the upkeep (`service`), so this normally finds them and locks nothing.
    create_partitions(pool, start, start).await?;

    let totals = window_totals(&window.records).map_err(IngestError::Other)?;
    let mut tx = pool.begin().await?;
    hold_partitions(&mut tx).await?;
    // The workload must be live in this transaction: a retire or deny that committed before it
    // refuses the window even if its notice has not reached this replica's admission yet, and
    // one that comes later waits for it (it locks the row FOR UPDATE; state writes do not).
    let gone: Option<(bool, bool, DateTime<Utc>)> = sqlx::query_as(
        "SELECT retired_at IS NOT NULL, denied_at IS NOT NULL, created_at FROM workloads WHERE id = $1 FOR KEY SHARE",
    )
    .bind(workload.uuid())
    .fetch_optional(&mut *tx)
    .await?;
    // The same words as the admission's refusal, whichever of the two speaks first.
    let created_at = match gone {
        Some((false, false, created_at)) => created_at,
        Some((_, true, _)) => {
            return Err(Error::Refused(format!("workload {workload} is deny-listed")).into());
        }
        Some((true, false, _)) => {
            return Err(
                Error::Refused(format!("workload {workload} is retired; enroll the host again")).into()
            );
        }
        None => return Err(Error::Refused(format!("workload {workload} is unknown")).into()),
    };
    // One upload of this workload at a time from here: two overlapping windows sent side by side
    // cannot both find the other missing.
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2::text))")
        .bind(WINDOWS_LOCK_CLASS)
        .bind(workload.uuid())
        .execute(&mut *tx)
        .await?;
    let stored: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM flow_windows WHERE workload_id = $1 AND window_id = $2)",
    )
    .bind(workload.uuid())
    .bind(window.id)
    .fetch_one(&mut *tx)
    .await?;
    if stored {
        return Ok(Ingested { records: 0, duplicate: true });
    }
    let claim = installs::claim(&mut tx, workload, window.policy_version, created_at).await?;
    installs::judge(window, &claim, skew)
        .map_err(|(reason, detail)| IngestError::Evidence { reason, detail })?;
    // Windows are at most MAX_WINDOW_MS long: one that overlaps starts no earlier than that
    // before this one (which bounds the partitions read).
    let overlapping: Option<(uuid::Uuid, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT window_id, window_start, window_end FROM flow_windows
         WHERE workload_id = $1 AND window_start < $3 AND window_end > $2 AND window_start > $2 - make_interval(secs => $4)
         ORDER BY window_start LIMIT 1",
    )
    .bind(workload.uuid())
    .bind(start)
    .bind(end)
    .bind((innerwall_wire::flows::MAX_WINDOW_MS / 1_000) as f64)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((id, from, to)) = overlapping {
        return Err(IngestError::Evidence {
            reason: installs::Refusal::Overlap,
            detail: format!("the window [{start}, {end}) overlaps window {id} [{from}, {to}) already stored"),
        });
    }
    let fresh = sqlx::query(
        "INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode, record_count,
            gap_count, packets, bytes, new_connections, observed_records, allowed_records, would_block_records,
            blocked_records, staged_set)
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16
         WHERE NOT EXISTS (SELECT 1 FROM flow_windows WHERE workload_id = $1 AND window_id = $2)
         ON CONFLICT DO NOTHING",
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
    .bind(window.staged_set.as_deref())
    .execute(&mut *tx)
    .await?;
    // Windows are partitioned by start, so the key alone only catches a retry of the same start
    // (concurrent retries wait on it); the NOT EXISTS above catches the id reused on another day.
    if fresh.rows_affected() == 0 {
        return Ok(Ingested { records: 0, duplicate: true });
    }
    let mut sources: BTreeMap<IpAddr, DateTime<Utc>> = BTreeMap::new();
    for r in &window.records {
        let seen = time(r.first_seen_ms);
        sources.entry(r.src).and_modify(|at| *at = (*at).min(seen)).or_insert(seen);
    }
    let mut peers = resolve(&mut tx, &sources).await.map_err(IngestError::Other)?;
    for src in sources.keys() {
        peers.entry(*src).or_insert_with(|| Peer { kind: 0, key: src.to_string(), labels: NO_LABELS.into() });
    }
    let resolved: Vec<&Peer> = window.records.iter().map(|r| &peers[&r.src]).collect();

    let mut rows = copy::Rows::default();
    for (ordinal, (r, peer)) in window.records.iter().zip(&resolved).enumerate() {
        rows.row(21);
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
        // At most MAX_RECORDS records: the position fits.
        rows.i32(ordinal as i32);
        match &r.pending {
            Some(pending) => {
                rows.i16(pending.decision.code());
                rows.text(pending.rule.as_ref().map(|id| id.as_str()).unwrap_or_default());
            }
            None => {
                rows.null();
                rows.null();
            }
        }
    }
    copy_in(
        &mut tx,
        "COPY flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
            dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
            peer_kind, peer_key, peer_labels, ordinal, pending_decision, pending_rule_id) FROM STDIN (FORMAT binary)",
        rows,
    )
    .await?;

    if !window.gaps.is_empty() {
        sqlx::query(
            "INSERT INTO flow_gaps (workload_id, window_id, window_start, kind, gap_from, gap_to, count, detail, ordinal)
             SELECT $1, $2, $3, k, f, t, c, d, n - 1
             FROM unnest($4::smallint[], $5::timestamptz[], $6::timestamptz[], $7::bigint[], $8::text[])
                  WITH ORDINALITY AS x (k, f, t, c, d, n)",
        )
        .bind(workload.uuid())
        .bind(window.id)
        .bind(start)
        .bind(window.gaps.iter().map(|g| g.kind.code()).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| time(g.from_ms)).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| time(g.to_ms)).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| g.count as i64).collect::<Vec<_>>())
        .bind(window.gaps.iter().map(|g| g.detail.as_str()).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Ingested { records: window.records.len(), duplicate: false })
}

/// How far the times in an agent's window may be from the control plane's clock (issue 11): a
/// window is never older than retention, whose partitions are gone, nor further ahead than a
/// clock skew, so no agent can make the server create partitions for days it chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeBounds {
    /// Oldest accepted time before now: the retention.
    pub max_age: chrono::Duration,
    /// Furthest accepted time after now: the clock skew tolerated.
    pub max_ahead: chrono::Duration,
}

impl Default for TimeBounds {
    fn default() -> Self {
        TimeBounds {
            max_age: chrono::Duration::days(super::DEFAULT_RETENTION_DAYS),
            max_ahead: chrono::Duration::minutes(5),
        }
    }
}

impl TimeBounds {
    /// Refuses a window whose start, end or record times fall outside `[now - max_age, now +
    /// max_ahead]`, naming the first such time. Gaps describe what is missing rather than what
    /// was seen, and may be old news (windows dropped or refused while the control plane was
    /// away): their intervals are clamped into the range, keeping their counts.
    pub fn check(&self, window: &mut FlowWindow, now: DateTime<Utc>) -> Result<(), String> {
        let (oldest, newest) =
            ((now - self.max_age).timestamp_millis(), (now + self.max_ahead).timestamp_millis());
        let check = |what: &str, ms: i64| {
            if ms < oldest {
                Err(format!(
                    "{what} {} is older than the {} h the control plane keeps",
                    time(ms),
                    self.max_age.num_hours()
                ))
            } else if ms > newest {
                Err(format!(
                    "{what} {} is more than {} s ahead of the control plane's clock ({now}); check the agent's clock",
                    time(ms),
                    self.max_ahead.num_seconds()
                ))
            } else {
                Ok(())
            }
        };
        check("window start", window.start_ms)?;
        check("window end", window.end_ms)?;
        for (i, r) in window.records.iter().enumerate() {
            check("first seen", r.first_seen_ms).map_err(|e| format!("record {i}: {e}"))?;
            check("last seen", r.last_seen_ms).map_err(|e| format!("record {i}: {e}"))?;
        }
        for g in &mut window.gaps {
            g.from_ms = g.from_ms.clamp(oldest, newest);
            g.to_ms = g.to_ms.clamp(oldest, newest);
        }
        Ok(())
    }
}

/// What runs after a window with a BLOCKED record is stored, before the upload is answered:
/// the auto-demotion guard (`safety::guard`), wired in by `service`, so that this module does
/// not depend on what judges its windows. The default does nothing.
#[derive(Clone)]
pub struct OnBlocked(pub std::sync::Arc<dyn Fn(WorkloadId) -> Blocked + Send + Sync>);

/// What an [`OnBlocked`] returns: the judgement, awaited before the upload is answered.
pub type Blocked = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

impl Default for OnBlocked {
    fn default() -> Self {
        OnBlocked(std::sync::Arc::new(|_| Box::pin(async {})))
    }
}

impl std::fmt::Debug for OnBlocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnBlocked")
    }
}

/// The telemetry service (SYNC-10: its own connection from the agent; same listener).
#[derive(Debug, Clone)]
pub struct Telemetry {
    pub pool: PgPool,
    pub bounds: TimeBounds,
    pub metrics: std::sync::Arc<Metrics>,
    /// Per-identity upload rate and bytes (REL-1), shared with the gateway.
    pub rate: crate::rate::Bounds,
    pub on_blocked: OnBlocked,
}

#[tonic::async_trait]
impl proto::telemetry_service_server::TelemetryService for Telemetry {
    async fn report_flows(
        &self,
        request: tonic::Request<proto::ReportFlowsRequest>,
    ) -> Result<tonic::Response<proto::ReportFlowsResponse>, tonic::Status> {
        let workload = crate::identity::listener::identity(&request)?;
        // Over its bound an upload is refused before it is decoded or written; the agent keeps
        // the window queued and sends it after the retry-after.
        let bytes = prost::Message::encoded_len(request.get_ref()) as f64;
        self.rate.take(
            workload,
            &[(crate::rate::Bound::Uploads, 1.0), (crate::rate::Bound::UploadBytes, bytes)],
        )?;
        let Some(wire) = request.get_ref().window.as_ref() else {
            self.metrics.window_refused(Refusal::Invalid, 0, 0);
            return Err(tonic::Status::invalid_argument("window is missing"));
        };
        let refused = |reason: Refusal, e: &dyn std::fmt::Display| {
            self.metrics.window_refused(reason, wire.records.len(), wire.gaps.len());
            tonic::Status::invalid_argument(format!("window refused: {e}"))
        };
        let mut window = FlowWindow::try_from(wire).map_err(|e| refused(Refusal::Invalid, &e))?;
        self.bounds.check(&mut window, Utc::now()).map_err(|e| refused(Refusal::OutOfRange, &e))?;
        let started = std::time::Instant::now();
        let done = match ingest_with(&self.pool, workload, &window, self.bounds.max_ahead).await {
            Ok(done) if done.duplicate => {
                self.metrics.window_duplicate(started.elapsed());
                done
            }
            Ok(done) => {
                self.metrics.window_stored(done.records, window.gaps.len(), started.elapsed());
                // Blocked flows: judged before the answer (the auto-demotion guard), so the
                // agent's next upload finds the decision made.
                if window.records.iter().any(|r| r.decision == Decision::Blocked) {
                    (self.on_blocked.0)(workload).await;
                }
                done
            }
            Err(e) => {
                self.metrics.window_refused(e.refusal(), window.records.len(), window.gaps.len());
                return Err(tonic::Status::from(e));
            }
        };
        Ok(tonic::Response::new(proto::ReportFlowsResponse {
            accepted_records: done.records as u32,
            duplicate: done.duplicate,
        }))
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::flows::{Decision, EvidenceGap, FlowRecord, GapKind};
    use innerwall_wire::policy::{Mode, Protocol};

    use super::*;

    const NOW: i64 = 1_800_000_000_000;
    const MIN: i64 = 60_000;
    const DAY: i64 = 24 * 60 * MIN;

    fn window(start_ms: i64, seen_ms: i64) -> FlowWindow {
        let record = FlowRecord {
            pending: None,
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            dst_port: 22,
            protocol: Protocol::Tcp,
            decision: Decision::Observed,
            matched_rule: None,
            packets: 1,
            bytes: 60,
            new_connections: 1,
            first_seen_ms: seen_ms,
            last_seen_ms: seen_ms,
        };
        FlowWindow {
            staged_set: None,
            id: uuid::Uuid::new_v4(),
            start_ms,
            end_ms: start_ms + MIN,
            policy_version: 1,
            mode: Mode::Visibility,
            records: vec![record],
            gaps: vec![],
        }
    }

    #[test]
    fn times_must_be_near_the_servers_clock() {
        let bounds = TimeBounds::default();
        let now = time(NOW);
        let check = |mut w: FlowWindow| bounds.check(&mut w, now);
        assert_eq!(check(window(NOW - 2 * MIN, NOW - MIN)), Ok(()));
        assert_eq!(check(window(NOW - 30 * DAY, NOW - 30 * DAY + 1)), Ok(()), "exactly at the retention");
        assert_eq!(check(window(NOW + 4 * MIN, NOW + 4 * MIN)), Ok(()), "within the skew");
        let err = check(window(NOW - 31 * DAY, NOW - 31 * DAY)).unwrap_err();
        assert!(
            err.starts_with("window start 2026-12-15 08:00:00") && err.contains("older than the 720 h"),
            "{err}"
        );
        let err = check(window(NOW + 4 * MIN + 1, NOW + 4 * MIN + 1)).unwrap_err();
        assert!(err.starts_with("window end") && err.contains("more than 300 s ahead"), "{err}");
        let err = check(window(NOW - 2 * MIN, NOW + DAY)).unwrap_err();
        assert!(err.starts_with("record 0: first seen") && err.contains("ahead"), "{err}");
        let err = check(window(NOW - 2 * MIN, 0)).unwrap_err();
        assert!(err.starts_with("record 0: first seen 1970-01-01") && err.contains("older"), "{err}");
    }

    #[test]
    fn gaps_are_clamped_not_refused() {
        let mut w = window(NOW - 2 * MIN, NOW - MIN);
        let gap = |from_ms, to_ms| EvidenceGap::new(GapKind::UploadRefused, from_ms, to_ms, 7);
        w.gaps =
            vec![gap(NOW - 90 * DAY, NOW - 60 * DAY), gap(NOW - 40 * DAY, NOW - MIN), gap(NOW, NOW + DAY)];
        TimeBounds::default().check(&mut w, time(NOW)).unwrap();
        let horizon = NOW - 30 * DAY;
        assert_eq!(
            w.gaps,
            [gap(horizon, horizon), gap(horizon, NOW - MIN), gap(NOW, NOW + 5 * MIN)],
            "intervals clamped into the accepted range, counts kept"
        );
    }
}
