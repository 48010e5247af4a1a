//! The impact of proposed policies on recorded traffic (POL-8): for each workload whose proposed
//! policy differs from the one its agent applied, the recorded flows of a range towards it are
//! replayed through both (`replay`, pure) and reported per transition, with the evidence's
//! coverage of the range, its gaps, the admissions no flow exercised and the relabelled peers.
//! `replay` does the same between two stored versions of one workload. Reads only, through one
//! connection; the flow keys stream as binary `COPY` and are folded as they come. Where the range
//! ends with the rollups (a range ending now), only the keys a workload's change can affect, or
//! whose peer was relabelled, are read and replayed; the others are counted unchanged from
//! `flow_key_lasts` ([`Read::Narrowed`], exact: the tests compare it with [`Read::Full`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use chrono::{DateTime, DurationRound, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{EvidenceGap, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Change, Cidr, Protocol, ResolvedRule, WorkloadPolicy, diff};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection, Row};
use tokio_stream::StreamExt;
use uuid::Uuid;

use super::replay::{self, Coverage, FlowSum, LabelDigest, NewAdmission, Replayed, Replayer};
use crate::copy::{self, Fields};
use crate::error::Error;
use crate::flows::Source;
use crate::policy::store;

/// The most rows of each kind a workload's report names.
pub const MAX_TOP: usize = 100;

/// The most workloads one impact replays.
pub const MAX_WORKLOADS: usize = 10_000;

/// The most flow keys (destination, source, peer, protocol, port) one impact reads; beyond, it
/// is refused (replay a shorter range or fewer workloads) rather than answered in part.
pub const MAX_KEYS: u64 = 5_000_000;

/// The most gap rows read per workload, earliest first: a workload with more has lost so much
/// evidence that the hours after its last gap read may be counted gap-free wrongly, and its
/// `gap_count` reads this bound (agents fold a window's gaps to 1,000, so it takes ten such
/// windows in the range).
const GAP_ROWS: i64 = 10_000;

/// How far before a range a window may start and still reach into it (the longest window).
const WINDOW_REACH: chrono::Duration = chrono::Duration::days(1);
/// Gaps may describe losses older than the window carrying them.
const GAP_REACH: chrono::Duration = chrono::Duration::days(2);

/// The recorded range replayed, `[from, to)` by window start (as the flow rollups have it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Range {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
}

impl Range {
    /// `since` before `to` until `to`, at most the 90 days a verdict may look back
    /// (`gate::verdict::Params::ending_at`).
    pub fn ending_at(to: DateTime<Utc>, since: std::time::Duration) -> Result<Range, Error> {
        let params =
            crate::gate::verdict::Params::ending_at(to.timestamp_millis(), since, std::time::Duration::ZERO)?;
        let from = DateTime::from_timestamp_millis(params.from_ms).unwrap_or(DateTime::UNIX_EPOCH);
        let range = Range { from, to };
        range.check()?;
        Ok(range)
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        crate::input::instant("from", self.from)?;
        crate::input::instant("to", self.to)?;
        if self.from >= self.to {
            return Err(Error::Invalid(format!(
                "the range from {} to {} is empty; its start must be before its end",
                self.from, self.to
            )));
        }
        if self.to - self.from > chrono::Duration::days(90) {
            return Err(Error::Invalid(format!(
                "a replay range of {} days is longer than the 90 days a replay may look back",
                (self.to - self.from).num_days()
            )));
        }
        Ok(())
    }
}

/// What replaying one workload's flows found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkloadImpact {
    #[schema(value_type = String)]
    #[serde(serialize_with = "crate::gate::serialize_id", deserialize_with = "crate::gate::deserialize_id")]
    pub id: WorkloadId,
    pub hostname: String,
    /// The version replayed as `from`: the applied one for an impact; 0 = nothing applied (then
    /// nothing drops a flow, so everything was admitted).
    pub from_version: u64,
    /// The `from` policy's mode (`None`: nothing applied).
    pub from_mode: Option<String>,
    /// The stored version replayed as `to`, `None` for a proposed policy not stored.
    pub to_version: Option<u64>,
    pub to_mode: String,
    /// Present when there is something to say about `from` (nothing applied).
    pub note: Option<String>,
    #[serde(flatten)]
    pub replayed: Replayed,
    pub coverage: Coverage,
    /// (rule, CIDR) pairs `to` admits that `from` did not and no flow of the range came from
    /// (at most `top`), and how many there were.
    pub unseen_admissions: Vec<NewAdmission>,
    pub unseen_admission_count: u64,
}

/// The impact of proposed policies over a range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Impact {
    pub range: Range,
    pub top: usize,
    /// Workloads whose policy changes, in id order.
    pub workloads: Vec<WorkloadImpact>,
    /// Flow keys read.
    pub keys: u64,
}

impl Impact {
    pub fn newly_blocked(&self) -> u64 {
        self.workloads.iter().map(|w| w.replayed.newly_blocked).sum()
    }

    /// The lowest coverage of any listed workload (1 when none is listed).
    pub fn min_coverage(&self) -> f64 {
        self.workloads.iter().map(|w| w.coverage.ratio).fold(1.0, f64::min)
    }
}

fn check_top(top: usize) -> Result<(), Error> {
    if top == 0 || top > MAX_TOP {
        return Err(Error::Invalid(format!("top must be between 1 and {MAX_TOP}, not {top}")));
    }
    Ok(())
}

fn workload_id(uuid: Uuid) -> Result<WorkloadId, Error> {
    WorkloadId::from_uuid(uuid)
        .ok_or_else(|| Error::Corrupt { what: "workload id", detail: uuid.to_string() })
}

/// One workload to replay: `from` (its version and policy, `None` at version 0), `to`.
struct Job {
    id: WorkloadId,
    hostname: String,
    from_version: u64,
    from: Option<WorkloadPolicy>,
    to_version: Option<u64>,
    to: WorkloadPolicy,
}

/// Hostnames and applied versions of `ids`; an unknown id is NotFound.
async fn workloads(
    conn: &mut PgConnection,
    ids: &[WorkloadId],
) -> Result<BTreeMap<WorkloadId, (String, u64)>, Error> {
    let uuids: Vec<Uuid> = ids.iter().map(|id| id.uuid()).collect();
    let mut found = BTreeMap::new();
    for row in sqlx::query("SELECT id, hostname, applied_version FROM workloads WHERE id = ANY($1)")
        .bind(&uuids)
        .fetch_all(&mut *conn)
        .await?
    {
        found.insert(workload_id(row.get(0))?, (row.get::<String, _>(1), row.get::<i64, _>(2).max(0) as u64));
    }
    if let Some(missing) = ids.iter().find(|id| !found.contains_key(id)) {
        return Err(Error::NotFound { what: "workload", name: missing.to_string() });
    }
    Ok(found)
}

/// The impact of `proposed` (a policy per workload) over `range`: each workload's applied
/// version against its proposed policy; workloads whose proposed content equals the applied
/// content are not listed. `top` (1..=[`MAX_TOP`]) bounds the rows of each kind per workload.
pub async fn impact(
    conn: &mut PgConnection,
    proposed: &BTreeMap<WorkloadId, WorkloadPolicy>,
    range: Range,
    top: usize,
) -> Result<Impact, Error> {
    Ok(impact_read(conn, proposed, range, top, Read::Narrowed).await?.0)
}

/// Which read an impact made of its flow keys (the answer is the same either way).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Every flow key of the range, each replayed.
    Full,
    /// Only the keys whose decision can change or whose peer was relabelled, replayed; the others
    /// counted from `flow_key_lasts` (ranges with nothing rolled up after their whole hours).
    Narrowed,
}

/// [`impact`] with the read asked for (`Narrowed` where it applies, else `Full`) and the one
/// made: the tests compare the two.
#[doc(hidden)]
pub async fn impact_read(
    conn: &mut PgConnection,
    proposed: &BTreeMap<WorkloadId, WorkloadPolicy>,
    range: Range,
    top: usize,
    read: Read,
) -> Result<(Impact, Read), Error> {
    check_top(top)?;
    range.check()?;
    if proposed.len() > MAX_WORKLOADS {
        return Err(Error::Invalid(format!(
            "at most {MAX_WORKLOADS} workloads per impact, not {}",
            proposed.len()
        )));
    }
    let ids: Vec<WorkloadId> = proposed.keys().copied().collect();
    let found = workloads(conn, &ids).await?;
    let wanted: Vec<(WorkloadId, u64)> =
        found.iter().filter(|(_, (_, v))| *v > 0).map(|(id, (_, v))| (*id, *v)).collect();
    let mut applied = store::policies_at(conn, &wanted).await?;
    let mut jobs = Vec::new();
    for (id, to) in proposed {
        let (hostname, version) = found[id].clone();
        let from = match version {
            0 => None,
            v => Some(applied.remove(&(*id, v)).ok_or_else(|| Error::Corrupt {
                what: "applied policy version",
                detail: format!("workload {id} applied version {v}, which is not stored"),
            })?),
        };
        if from.as_ref().is_some_and(|f| replay::same_content(f, to)) {
            continue;
        }
        jobs.push(Job { id: *id, hostname, from_version: version, from, to_version: None, to: to.clone() });
    }
    run(conn, jobs, range, top, read).await
}

/// The replay of `workload`'s recorded flows over `range` between two of its stored versions
/// (`from_version` 0: nothing applied). An unknown version is NotFound naming it.
pub async fn replay(
    conn: &mut PgConnection,
    workload: WorkloadId,
    from_version: u64,
    to_version: u64,
    range: Range,
    top: usize,
) -> Result<Impact, Error> {
    check_top(top)?;
    range.check()?;
    let found = workloads(conn, &[workload]).await?;
    let (hostname, _) = found[&workload].clone();
    let mut wanted = vec![(workload, to_version)];
    if from_version > 0 {
        wanted.push((workload, from_version));
    }
    let mut stored = store::policies_at(conn, &wanted).await?;
    let missing = |v: u64| Error::NotFound {
        what: "policy version of workload",
        name: format!("{workload} version {v}"),
    };
    let to = stored.get(&(workload, to_version)).cloned().ok_or_else(|| missing(to_version))?;
    let from = match from_version {
        0 => None,
        v => Some(stored.remove(&(workload, v)).ok_or_else(|| missing(v))?),
    };
    let job = Job { id: workload, hostname, from_version, from, to_version: Some(to_version), to };
    Ok(run(conn, vec![job], range, top, Read::Narrowed).await?.0)
}

/// Label digests now of every live workload, by its peer key (its id as text), as ingest writes
/// them, and the label sets by digest.
#[allow(clippy::type_complexity)]
pub(crate) async fn labels_now(
    conn: &mut PgConnection,
) -> Result<(BTreeMap<String, LabelDigest>, BTreeMap<LabelDigest, serde_json::Value>), Error> {
    let rows = sqlx::query(
        "SELECT id, labels, md5(labels::text)::uuid FROM (
             SELECT w.id::text AS id, COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l
                                                WHERE l.workload_id = w.id), '{}'::jsonb) AS labels
             FROM workloads w WHERE w.retired_at IS NULL AND w.denied_at IS NULL) AS w",
    )
    .fetch_all(&mut *conn)
    .await?;
    let (mut digests, mut sets) = (BTreeMap::new(), BTreeMap::new());
    for row in rows {
        digests.insert(row.get(0), row.get(2));
        sets.insert(row.get(2), row.get(1));
    }
    Ok((digests, sets))
}

/// The label sets of `wanted` (a digest, and a flow key towards a workload that has it) not in
/// `sets` yet, read from one row of the range that has each: from the rollups by peer (the
/// index `flow_rollups_peer_service` leads with it), else from that workload's raw records.
pub(crate) async fn labels_then(
    conn: &mut PgConnection,
    wanted: BTreeMap<LabelDigest, (Uuid, i16, String)>,
    range: Range,
    sets: &mut BTreeMap<LabelDigest, serde_json::Value>,
) -> Result<(), Error> {
    let wanted: Vec<(LabelDigest, (Uuid, i16, String))> =
        wanted.into_iter().filter(|(d, _)| !sets.contains_key(d)).collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let digests: Vec<Uuid> = wanted.iter().map(|(d, _)| *d).collect();
    let workloads: Vec<Uuid> = wanted.iter().map(|(_, (w, _, _))| *w).collect();
    let kinds: Vec<i16> = wanted.iter().map(|(_, (_, k, _))| *k).collect();
    let keys: Vec<&str> = wanted.iter().map(|(_, (_, _, k))| k.as_str()).collect();
    let rows = sqlx::query(
        "SELECT d.digest, (SELECT l FROM (
             SELECT r.peer_labels AS l FROM flow_rollups r
             WHERE r.peer_kind = d.kind AND r.peer_key = d.key AND r.peer_digest = d.digest
               AND r.hour >= date_trunc('hour', $5::timestamptz, 'UTC') AND r.hour < $6
             UNION ALL
             SELECT r.peer_labels FROM flow_records r
             WHERE r.workload_id = d.workload AND r.window_start >= $5 AND r.window_start < $6
               AND r.peer_key = d.key AND md5(r.peer_labels::text)::uuid = d.digest) AS x LIMIT 1)
         FROM unnest($1::uuid[], $2::uuid[], $3::smallint[], $4::text[]) AS d (digest, workload, kind, key)",
    )
    .bind(&digests)
    .bind(&workloads)
    .bind(&kinds)
    .bind(&keys)
    .bind(range.from)
    .bind(range.to)
    .fetch_all(&mut *conn)
    .await?;
    for row in rows {
        let digest: Uuid = row.get(0);
        let labels: Option<serde_json::Value> = row.get(1);
        let labels = labels.ok_or_else(|| Error::Corrupt {
            what: "flow peer labels",
            detail: format!("no flow of the range has the peer labels of digest {digest}"),
        })?;
        sets.insert(digest, labels);
    }
    Ok(())
}

/// Windows `(start, end)` in ms and gaps of `ids` overlapping the range.
#[allow(clippy::type_complexity)]
pub(crate) async fn evidence(
    conn: &mut PgConnection,
    ids: &[Uuid],
    range: Range,
) -> Result<(BTreeMap<Uuid, Vec<(i64, i64)>>, BTreeMap<Uuid, Vec<EvidenceGap>>), Error> {
    let mut windows: BTreeMap<Uuid, Vec<(i64, i64)>> = BTreeMap::new();
    // A week of a busy estate is millions of windows: binary `COPY` (literals, as `keys_of` has
    // them) from the index that holds their ends (migration 0034).
    let statement = format!(
        "COPY (SELECT workload_id, window_start, window_end FROM flow_windows
               WHERE workload_id = ANY({}) AND window_end > {} AND window_start < {} AND window_start >= {})
         TO STDOUT (FORMAT binary)",
        ids_literal(ids),
        time_literal(range.from),
        time_literal(range.to),
        time_literal(range.from - WINDOW_REACH)
    );
    let mut chunks = conn.copy_out_raw(&statement).await?;
    let mut reader = copy::Reader::default();
    while let Some(chunk) = chunks.next().await.transpose()? {
        reader.feed(&chunk);
        while let Some(mut row) = reader.next_row()? {
            let workload = row.uuid("window workload")?;
            let span = (row.timestamptz_ms("window start")?, row.timestamptz_ms("window end")?);
            if !row.exhausted() {
                return Err(Error::Corrupt {
                    what: "window row",
                    detail: "more fields than a window has".into(),
                });
            }
            windows.entry(workload).or_default().push(span);
        }
    }
    drop(chunks);
    if !reader.finished() {
        return Err(Error::Corrupt { what: "COPY stream", detail: "it ended before its trailer".into() });
    }
    let mut gaps: BTreeMap<Uuid, Vec<EvidenceGap>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT g.workload_id, g.kind, g.gap_from, g.gap_to, g.count, g.detail
         FROM unnest($1::uuid[]) AS w (id)
         CROSS JOIN LATERAL (SELECT * FROM flow_gaps g WHERE g.workload_id = w.id AND g.gap_to >= $2
                             AND g.gap_from < $3 AND g.window_start >= $4 ORDER BY g.gap_from LIMIT $5) AS g",
    )
    .bind(ids)
    .bind(range.from)
    .bind(range.to)
    .bind(range.from - GAP_REACH)
    .bind(GAP_ROWS)
    .fetch_all(&mut *conn)
    .await?
    {
        let kind = GapKind::from_code(row.get(1))
            .map_err(|_| Error::Corrupt { what: "gap kind", detail: row.get::<i16, _>(1).to_string() })?;
        let ms = |i| row.get::<DateTime<Utc>, _>(i).timestamp_millis();
        let gap = EvidenceGap::new(kind, ms(2), ms(3), row.get::<i64, _>(4).max(0) as u64);
        gaps.entry(row.get(0)).or_default().push(gap.because(row.get::<&str, _>(5)));
    }
    Ok((windows, gaps))
}

/// The columns of a flow key and its sums, in the order [`key_fields`] reads them.
const KEY_COLUMNS: &str = "workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol,
     sum(c)::bigint, sum(r)::bigint, min(first_seen), max(last_seen)";
const KEY_GROUPS: &str =
    "GROUP BY workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol";

/// The statements read their rows as binary `COPY` (a fraction of the client's work per row
/// that decoding result rows costs), which takes no parameters: the values are written into the
/// text as literals, each from a type whose text is only digits, hex, `-`, `:`, `+`, `.` and
/// `T` (a uuid, an RFC 3339 time), so nothing can end its quoting.
fn ids_literal(ids: &[Uuid]) -> String {
    let list: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    format!("'{{{}}}'::uuid[]", list.join(","))
}

fn time_literal(t: DateTime<Utc>) -> String {
    format!("'{}'::timestamptz", t.to_rfc3339())
}

/// The binary `COPY` of the flow keys of `parts` (statements of the key's columns and the sums'
/// inputs `c`, `r`, `first_seen`, `last_seen`, and `bucket` when `bucketed`), summed per key (and
/// bucket).
fn keys_of(parts: &[String], bucketed: bool) -> String {
    let (column, group) = if bucketed { (", bucket", ", bucket") } else { ("", "") };
    format!(
        "COPY (SELECT {KEY_COLUMNS}{column} FROM ({}) AS f {KEY_GROUPS}{group}) TO STDOUT (FORMAT binary)",
        parts.join(" UNION ALL ")
    )
}

/// The start of the UTC day `t` falls in.
fn day_floor(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(chrono::TimeDelta::days(1)).expect("times the database stores truncate to days")
}

/// A part of a range's whole hours, read from one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// `flow_key_days` rows of the whole UTC days `[from, to)`.
    Days(DateTime<Utc>, DateTime<Utc>),
    /// `flow_rollups` rows of the hours `[from, to)`.
    Hours(DateTime<Utc>, DateTime<Utc>),
}

/// The whole hours `[from, to)` as the whole UTC days in them and the hours before and after.
/// `tail_whole`: no hour of the day `to` falls in is rolled up at or after `to` (the usual case
/// for a range ending now: the roll-up job has not reached the open hour), so that day's sums
/// hold just its hours before `to` and are read for them.
fn split_days(from: DateTime<Utc>, to: DateTime<Utc>, tail_whole: bool) -> Vec<Part> {
    let day = chrono::TimeDelta::days(1);
    let first = if day_floor(from) == from { from } else { day_floor(from) + day };
    let last = day_floor(to);
    let tail = tail_whole && last < to && from <= last;
    let days_end = if tail { last + day } else { last };
    if first >= days_end {
        return vec![Part::Hours(from, to)];
    }
    let mut parts = vec![Part::Days(first, days_end)];
    if from < first {
        parts.push(Part::Hours(from, first));
    }
    if !tail && last < to {
        parts.push(Part::Hours(last, to));
    }
    parts
}

/// Whether no hour of the UTC day `to` falls in is rolled up at or after `to` ([`split_days`]).
async fn tail_whole(conn: &mut PgConnection, to: DateTime<Utc>) -> Result<bool, Error> {
    let next = day_floor(to) + chrono::TimeDelta::days(1);
    let later: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM flow_rollups WHERE hour >= $1 AND hour < $2)")
            .bind(to)
            .bind(next)
            .fetch_one(&mut *conn)
            .await?;
    Ok(!later)
}

/// The flow keys towards `ids` in `parts` (the whole hours of a range), summed per key in no
/// particular order: whole days from `flow_key_days` (migration 0030), the hours around them
/// from `flow_rollups`, without the rows' label sets.
fn rollup_statement(ids: &[Uuid], parts: Vec<Part>, bucketed: bool) -> String {
    let selection = format!("workload_id = ANY({})", ids_literal(ids));
    keys_of(&rollup_parts(&[selection], &parts, bucketed), bucketed)
}

/// The statements of `parts`, one per part and selection (a condition on a row's key columns).
fn rollup_parts(selections: &[String], parts: &[Part], bucketed: bool) -> Vec<String> {
    let mut out = Vec::new();
    for part in parts {
        let (table, column, from, to) = match *part {
            Part::Days(from, to) => ("flow_key_days", "day", from, to),
            Part::Hours(from, to) => ("flow_rollups", "hour", from, to),
        };
        let bucket = if bucketed { format!(", {column} AS bucket") } else { String::new() };
        for selection in selections {
            out.push(format!(
                "SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol,
                        new_connections AS c, records AS r, first_seen, last_seen{bucket} FROM {table}
                 WHERE {column} >= {} AND {column} < {} AND {selection}",
                time_literal(from),
                time_literal(to)
            ));
        }
    }
    out
}

/// The flow keys towards `ids` in the raw parts of `sources` (the partial hours at the ends and
/// the windows not rolled up yet), summed per key; `None` when there are none.
fn raw_statement(ids: &[Uuid], sources: &[Source], bucketed: bool) -> Option<String> {
    let parts = raw_parts(ids, sources, bucketed);
    (!parts.is_empty()).then(|| keys_of(&parts, bucketed))
}

/// The statements of the raw parts of `sources` towards `ids`.
fn raw_parts(ids: &[Uuid], sources: &[Source], bucketed: bool) -> Vec<String> {
    let ids = ids_literal(ids);
    let bucket = if bucketed { ", date_trunc('hour', window_start, 'UTC') AS bucket" } else { "" };
    sources
        .iter()
        .filter_map(|source| {
            let (from, to, pending) = match *source {
                Source::Hours(..) => return None,
                Source::Raw(from, to) => (from, to, false),
                Source::Pending(from, to) => (from, to, true),
            };
            let (from, to) = (time_literal(from), time_literal(to));
            let pending = match pending {
                true => format!(
                    " AND (workload_id, window_id, window_start) IN (SELECT workload_id, window_id, window_start
                       FROM flow_pending_windows WHERE window_start >= {from} AND window_start < {to})"
                ),
                false => String::new(),
            };
            Some(format!(
                "SELECT workload_id, src_address, peer_kind, peer_key, md5(peer_labels::text)::uuid AS peer_digest,
                        dst_port, protocol, new_connections AS c, 1::bigint AS r, first_seen, last_seen{bucket}
                 FROM flow_records WHERE window_start >= {from} AND window_start < {to}{pending}
                   AND workload_id = ANY({ids})"
            ))
        })
        .collect()
}

/// A flow key: workload, source, peer kind, peer key, label digest, port, protocol.
pub(crate) type Key = (Uuid, IpAddr, i16, String, LabelDigest, u16, Protocol);

/// A key's sums: connections, records, first and last seen (ms).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sums {
    pub connections: u64,
    pub records: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
}

impl Sums {
    pub(crate) fn merge(self, other: Sums) -> Sums {
        Sums {
            connections: self.connections.saturating_add(other.connections),
            records: self.records.saturating_add(other.records),
            first_seen_ms: self.first_seen_ms.min(other.first_seen_ms),
            last_seen_ms: self.last_seen_ms.max(other.last_seen_ms),
        }
    }
}

/// One row of either statement.
fn key_fields(row: &mut Fields<'_>) -> Result<(Key, Sums), Error> {
    let key = (
        row.uuid("flow workload")?,
        row.inet("flow source")?,
        row.i16("flow peer kind")?,
        row.text("flow peer key")?.to_owned(),
        row.uuid("flow peer digest")?,
        u16::try_from(row.i32("flow port")?)
            .map_err(|_| Error::Corrupt { what: "flow port", detail: String::new() })?,
        {
            let code = row.i16("flow protocol")?;
            Protocol::from_code(code)
                .map_err(|_| Error::Corrupt { what: "flow protocol", detail: code.to_string() })?
        },
    );
    let sums = Sums {
        connections: row.i64("flow connections")?.max(0) as u64,
        records: row.i64("flow records")?.max(0) as u64,
        first_seen_ms: row.timestamptz_ms("flow first seen")?,
        last_seen_ms: row.timestamptz_ms("flow last seen")?,
    };
    Ok((key, sums))
}

/// Streams the rows of the binary COPY `statement` into `each`, with the bucket (unix ms) of a
/// bucketed statement.
async fn copy_rows(
    conn: &mut PgConnection,
    statement: &str,
    bucketed: bool,
    mut each: impl FnMut(Key, Sums, Option<i64>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut chunks = conn.copy_out_raw(statement).await?;
    let mut reader = copy::Reader::default();
    while let Some(chunk) = chunks.next().await.transpose()? {
        reader.feed(&chunk);
        while let Some(mut row) = reader.next_row()? {
            let (key, sums) = key_fields(&mut row)?;
            let bucket = match bucketed {
                true => Some(row.timestamptz_ms("flow bucket")?),
                false => None,
            };
            if !row.exhausted() {
                return Err(Error::Corrupt {
                    what: "flow key row",
                    detail: "more fields than a key has".into(),
                });
            }
            each(key, sums, bucket)?;
        }
    }
    match reader.finished() {
        true => Ok(()),
        false => Err(Error::Corrupt { what: "COPY stream", detail: "it ended before its trailer".into() }),
    }
}

fn too_many_keys() -> Error {
    Error::Invalid(format!(
        "the range holds more than {MAX_KEYS} flow keys towards these workloads; replay a shorter range or fewer workloads"
    ))
}

/// The fold of every flow key into its workload's replayer, counting keys against [`MAX_KEYS`]
/// and noting, per label digest of a row kept, one flow key that has it.
struct Keys<'a> {
    replayers: &'a mut BTreeMap<Uuid, Replayer>,
    now: &'a BTreeMap<String, LabelDigest>,
    count: u64,
}

impl Keys<'_> {
    fn add(&mut self, key: Key, sums: Sums) -> Result<(), Error> {
        self.count += 1;
        if self.count > MAX_KEYS {
            return Err(too_many_keys());
        }
        let (workload, src, peer_kind, peer_key, labels_then, dst_port, protocol) = key;
        let Some(replayer) = self.replayers.get_mut(&workload) else { return Ok(()) };
        let labels_now = if peer_kind == 1 { self.now.get(&peer_key).copied() } else { None };
        replayer.add(&FlowSum {
            src,
            peer_kind,
            peer_key,
            labels_then,
            labels_now,
            dst_port,
            protocol,
            connections: sums.connections,
            records: sums.records,
            first_seen_ms: sums.first_seen_ms,
            last_seen_ms: sums.last_seen_ms,
        });
        Ok(())
    }
}

/// One read-only snapshot for the statements of one read (a nested transaction when the caller
/// holds one), with the settings they run best under.
async fn snapshot(conn: &mut PgConnection) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, Error> {
    let mut tx = if conn.is_in_transaction() {
        Connection::begin(&mut *conn).await?
    } else {
        conn.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?
    };
    // The statements sum a few million rows into keys in a hash table (on disk past `work_mem`);
    // compiling them (JIT) costs more than it saves. Reads only: the settings end with the rollback.
    sqlx::query("SET LOCAL work_mem = '64MB'").execute(&mut *tx).await?;
    sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
    Ok(tx)
}

/// The flow keys towards `ids` and `hourly` over `range` by bucket (its start, unix ms): a whole
/// UTC day for rows of the day sums, else an hour; `hourly` are read hour by hour over the whole
/// range (never from the day sums), so the caller can drop hours. One snapshot; a key may come
/// more than once for one bucket (the raw and the rolled-up part of an hour): the caller sums.
/// Refused past [`MAX_KEYS`] rows.
pub(crate) async fn bucketed_keys(
    conn: &mut PgConnection,
    ids: &[Uuid],
    hourly: &[Uuid],
    range: Range,
    mut each: impl FnMut(Key, Sums, i64),
) -> Result<(), Error> {
    range.check()?;
    let mut tx = snapshot(conn).await?;
    let sources = crate::flows::sources(range.from, range.to);
    let mut rows = 0u64;
    let mut take = |key, sums, bucket: Option<i64>| {
        rows += 1;
        if rows > MAX_KEYS {
            return Err(too_many_keys());
        }
        each(key, sums, bucket.expect("a bucketed statement"));
        Ok(())
    };
    for (set, by_day) in [(ids, true), (hourly, false)] {
        if set.is_empty() {
            continue;
        }
        if let Some(statement) = raw_statement(set, &sources, true) {
            copy_rows(&mut tx, &statement, true, &mut take).await?;
        }
        for source in &sources {
            let Source::Hours(from, to) = *source else { continue };
            let parts = match by_day {
                true => split_days(from, to, tail_whole(&mut tx, to).await?),
                false => vec![Part::Hours(from, to)],
            };
            copy_rows(&mut tx, &rollup_statement(set, parts, true), true, &mut take).await?;
        }
    }
    tx.rollback().await?;
    Ok(())
}

/// Folds the flow keys towards `ids` over `range` into `replayers` and returns how many there
/// were: the raw parts' keys (few: partial hours, windows not rolled up yet) are read first and
/// kept by key, then the rollups' keys stream and take up the raw sums of their key; the raw
/// keys no rollup has follow. Each key is added once, with all its sums. Both statements read
/// one snapshot (when the caller's connection is not in a transaction already),
/// so a window the roll-up job marks between them is not counted twice.
async fn fold(
    conn: &mut PgConnection,
    ids: &[Uuid],
    range: Range,
    replayers: &mut BTreeMap<Uuid, Replayer>,
    now: &BTreeMap<String, LabelDigest>,
) -> Result<u64, Error> {
    let mut tx = snapshot(conn).await?;
    let sources = crate::flows::sources(range.from, range.to);
    let mut raw: BTreeMap<Key, Sums> = BTreeMap::new();
    if let Some(statement) = raw_statement(ids, &sources, false) {
        copy_rows(&mut tx, &statement, false, |key, sums, _| {
            if raw.len() as u64 >= MAX_KEYS {
                return Err(too_many_keys());
            }
            raw.insert(key, sums);
            Ok(())
        })
        .await?;
    }
    let mut keys = Keys { replayers, now, count: 0 };
    for source in &sources {
        let Source::Hours(from, to) = *source else { continue };
        let parts = split_days(from, to, tail_whole(&mut tx, to).await?);
        copy_rows(&mut tx, &rollup_statement(ids, parts, false), false, |key, sums, _| {
            let sums = match raw.remove(&key) {
                Some(more) => sums.merge(more),
                None => sums,
            };
            keys.add(key, sums)
        })
        .await?;
    }
    tx.rollback().await?;
    for (key, sums) in raw {
        keys.add(key, sums)?;
    }
    Ok(keys.count)
}

/// The most keys of relabelled peers a narrowed read names one by one; with more it reads every
/// key instead ([`Read::Full`]).
const MAX_RELABELLED: usize = 20_000;

/// What of a flow key a rule the two policies of a workload do not share looks at: its protocol
/// (code), its port (any when `ports` is empty, as for ICMP) and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Matcher {
    protocol: i16,
    ports: Vec<(u16, u16)>,
    peers: BTreeSet<Cidr>,
}

/// A protocol code and port ranges, as rules name them.
type Service = (i16, Vec<(u16, u16)>);

/// The flow keys whose admission can differ between `from` and `to`, both judged as enforcement
/// would (so their modes do not matter): `None` when every key can (nothing applied admits
/// everything), else the keys some rule the two do not share matches, as `diff` finds them: a
/// rule removed, added or given other ports, whole (both of them when changed); the peers a rule
/// lost or gained, with its protocol and ports. A key no such rule matches is matched by the
/// same shared rules at both, so it is admitted at both or at neither; and every admission `to`
/// adds (`replay::new_admissions`) is of such a rule, so no other key exercises one.
fn changed_matchers(from: Option<&WorkloadPolicy>, to: &WorkloadPolicy) -> Option<Vec<Matcher>> {
    let from = from?;
    let mut by_service: BTreeMap<Service, BTreeSet<Cidr>> = BTreeMap::new();
    let mut add = |rule: &ResolvedRule, peers: &BTreeSet<Cidr>| {
        let ports = rule.ports().iter().map(|p| (p.start(), p.end())).collect();
        by_service.entry((rule.protocol().code(), ports)).or_default().extend(peers.iter().copied());
    };
    for change in diff(from, to).changes {
        match change {
            // What is staged is never acted on: it changes no decision of the enforced rules.
            Change::SetMode(_) | Change::SetRevertAt(_) | Change::SetStaged(_) => {}
            Change::RemoveRule(id) => from.rule(&id).into_iter().for_each(|r| add(r, r.peers())),
            Change::UpsertRule(new) => {
                from.rule(new.id()).into_iter().for_each(|r| add(r, r.peers()));
                add(&new, new.peers());
            }
            Change::RemovePeers { rule, peers } => from.rule(&rule).into_iter().for_each(|r| add(r, &peers)),
            Change::AddPeers { rule, peers } => to.rule(&rule).into_iter().for_each(|r| add(r, &peers)),
        }
    }
    Some(
        by_service
            .into_iter()
            .filter(|(_, peers)| !peers.is_empty())
            .map(|((protocol, ports), peers)| Matcher { protocol, ports, peers })
            .collect(),
    )
}

/// `matchers` as a condition on a flow key's columns (`protocol`, `dst_port`, `src_address`),
/// as `decide` matches a rule; `None` is every key. Literals only: codes, ports and canonical
/// CIDR text (digits, hex, `.`, `:`, `/`).
fn matcher_condition(matchers: Option<&[Matcher]>) -> String {
    let Some(matchers) = matchers else { return "true".to_owned() };
    if matchers.is_empty() {
        return "false".to_owned();
    }
    let each: Vec<String> = matchers
        .iter()
        .map(|m| {
            let ports = match m.ports.is_empty() {
                true => "true".to_owned(),
                false => {
                    let ranges: Vec<String> =
                        m.ports.iter().map(|(a, b)| format!("dst_port BETWEEN {a} AND {b}")).collect();
                    ranges.join(" OR ")
                }
            };
            let peers: Vec<String> =
                m.peers.iter().map(|c| format!("src_address <<= '{}'::inet", c.text())).collect();
            format!("(protocol = {} AND ({ports}) AND ({}))", m.protocol, peers.join(" OR "))
        })
        .collect();
    format!("({})", each.join(" OR "))
}

/// A text literal (standard-conforming: only `'` is special).
fn text_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The flow keys of the range towards the jobs' workloads that can change decision, by condition
/// (workloads sharing one condition together).
struct Wanted {
    /// `workload_id = ANY(…) AND condition` per condition that can hold, in parts read apart.
    selections: Vec<String>,
    /// Whether a key (its columns unqualified) is wanted.
    case: String,
}

impl Wanted {
    fn of(jobs: &[Job]) -> Wanted {
        let mut groups: BTreeMap<String, (Vec<Uuid>, BTreeSet<Cidr>)> = BTreeMap::new();
        for job in jobs {
            let matchers = changed_matchers(job.from.as_ref(), &job.to);
            let group = groups.entry(matcher_condition(matchers.as_deref())).or_default();
            group.0.push(job.id.uuid());
            if let Some(matchers) = matchers {
                group.1.extend(matchers.iter().flat_map(|m| m.peers.iter().copied()));
            }
        }
        let mut selections = Vec::new();
        let mut case = String::from("CASE");
        for (condition, (ids, peers)) in &groups {
            if condition == "false" {
                continue;
            }
            let ids = ids_literal(ids);
            case.push_str(&format!(" WHEN workload_id = ANY({ids}) THEN {condition}"));
            if condition == "true" {
                selections.push(format!("workload_id = ANY({ids})"));
                continue;
            }
            // One part per outermost peer CIDR (CIDRs nest or are apart, so these are apart and
            // a key is read by one part at most): each reads a range of the key index per workload.
            let outermost =
                peers.iter().filter(|c| !peers.iter().any(|d| d != *c && d.net().contains(&c.net())));
            for cidr in outermost {
                selections.push(format!(
                    "workload_id = ANY({ids}) AND src_address <<= '{}'::inet AND {condition}",
                    cidr.text()
                ));
            }
        }
        case.push_str(" ELSE false END");
        if selections.is_empty() {
            case = "false".to_owned();
        }
        Wanted { selections, case }
    }
}

/// A key of a relabelled peer as `flow_key_lasts` holds it: workload, source (as text), peer key,
/// label digest then, port, protocol code.
type RelabelledKey = (Uuid, String, String, Uuid, i32, i16);

/// The narrowed read ([`Read::Narrowed`]) of the flow keys towards the jobs' workloads over
/// `range`, folded into `replayers`; the number of keys of the range (as [`fold`] returns it), or
/// `None` when it does not apply (then nothing was folded): the range has no whole hour, something
/// is rolled up at or after its whole hours' end (a range ending in the past), nothing is rolled
/// up at all, or more than [`MAX_RELABELLED`] keys have relabelled peers.
///
/// Exact: each workload's keys are those of `flow_key_lasts` last rolled up in the range's whole
/// hours (every key with a rollup there, as nothing is rolled up after them; from the oldest
/// rollup on, older rows having expired) and the raw parts' keys no rollup of the range has. The
/// keys replayed are those the workload's condition ([`changed_matchers`]) selects and those
/// whose peer was relabelled, with all their sums, as [`fold`] replays them; every other key is
/// `unchanged`, not relabelled and exercises no new admission, so adding it to the replayer
/// would only count it as unchanged, which `Replayer::add_unchanged` does.
async fn narrowed_fold(
    conn: &mut PgConnection,
    jobs: &[Job],
    range: Range,
    replayers: &mut BTreeMap<Uuid, Replayer>,
    now: &BTreeMap<String, LabelDigest>,
) -> Result<Option<u64>, Error> {
    let sources = crate::flows::sources(range.from, range.to);
    let Some((hours_from, hours_to)) = sources.iter().find_map(|s| match *s {
        Source::Hours(from, to) => Some((from, to)),
        _ => None,
    }) else {
        return Ok(None);
    };
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.id.uuid()).collect();
    let wanted = Wanted::of(jobs);
    let mut tx = snapshot(conn).await?;
    let (later, oldest): (bool, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM flow_rollups WHERE hour >= $1), (SELECT min(hour) FROM flow_rollups)",
    )
    .bind(hours_to)
    .fetch_one(&mut *tx)
    .await?;
    let Some(oldest) = oldest.filter(|_| !later) else {
        tx.rollback().await?;
        return Ok(None);
    };
    let since = oldest.max(hours_from);
    // Keys of relabelled peers last rolled up in the range that the conditions do not select.
    let (now_keys, now_digests): (Vec<&str>, Vec<Uuid>) = now.iter().map(|(k, d)| (k.as_str(), *d)).unzip();
    let relabelled: Vec<RelabelledKey> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT workload_id, src_address::text, peer_key, peer_digest, dst_port, protocol FROM flow_key_lasts
         WHERE workload_id = ANY($1) AND last_hour >= $2 AND peer_kind = 1
           AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::uuid[]) AS n (key, digest)
                           WHERE n.key = peer_key AND n.digest = peer_digest)
           AND NOT ({}) LIMIT {}",
        wanted.case,
        MAX_RELABELLED + 1
    )))
    .bind(&ids)
    .bind(since)
    .bind(&now_keys)
    .bind(&now_digests)
    .fetch_all(&mut *tx)
    .await?;
    if relabelled.len() > MAX_RELABELLED {
        tx.rollback().await?;
        return Ok(None);
    }
    let mut totals: BTreeMap<Uuid, u64> = BTreeMap::new();
    for (workload, keys) in sqlx::query_as::<_, (Uuid, i64)>(
        "SELECT workload_id, count(*) FROM flow_key_lasts WHERE workload_id = ANY($1) AND last_hour >= $2
         GROUP BY workload_id",
    )
    .bind(&ids)
    .bind(since)
    .fetch_all(&mut *tx)
    .await?
    {
        totals.insert(workload, keys.max(0) as u64);
    }
    // The raw parts' keys, each with whether it is wanted and whether a rollup of the range has it.
    let mut raw: BTreeMap<Key, (Sums, bool)> = BTreeMap::new();
    let parts = raw_parts(&ids, &sources, false);
    if !parts.is_empty() {
        let statement = format!(
            // A scalar subquery, so each key is one probe of the key index (which holds the
            // hour), never a hash table of every key of the table.
            "COPY (SELECT g.*, ({})::int::smallint, COALESCE((SELECT 1::smallint FROM flow_key_lasts l
                     WHERE l.workload_id = g.workload_id AND l.src_address = g.src_address
                       AND l.peer_kind = g.peer_kind AND l.peer_key = g.peer_key AND l.peer_digest = g.peer_digest
                       AND l.dst_port = g.dst_port AND l.protocol = g.protocol AND l.last_hour >= {}), 0::smallint)
                   FROM (SELECT {KEY_COLUMNS} FROM ({}) AS f {KEY_GROUPS}) AS g) TO STDOUT (FORMAT binary)",
            wanted.case,
            time_literal(since),
            parts.join(" UNION ALL ")
        );
        let mut chunks = tx.copy_out_raw(&statement).await?;
        let mut reader = copy::Reader::default();
        while let Some(chunk) = chunks.next().await.transpose()? {
            reader.feed(&chunk);
            while let Some(mut row) = reader.next_row()? {
                let (key, sums) = key_fields(&mut row)?;
                let selected = row.i16("flow key wanted")? != 0;
                let rolled = row.i16("flow key rolled up")? != 0;
                if !row.exhausted() {
                    return Err(Error::Corrupt {
                        what: "flow key row",
                        detail: "more fields than a key has".into(),
                    });
                }
                if !rolled {
                    *totals.entry(key.0).or_default() += 1;
                }
                let relabelled = key.2 == 1 && now.get(&key.3) != Some(&key.4);
                if selected || relabelled {
                    raw.insert(key, (sums, rolled));
                }
            }
        }
        drop(chunks);
        if !reader.finished() {
            return Err(Error::Corrupt { what: "COPY stream", detail: "it ended before its trailer".into() });
        }
    }
    let total: u64 = totals.values().sum();
    if total > MAX_KEYS {
        return Err(too_many_keys());
    }
    // The rolled-up keys wanted, and those of relabelled peers, with their raw sums.
    let mut selections = wanted.selections.clone();
    if !relabelled.is_empty() {
        let rows: Vec<String> = relabelled
            .iter()
            .map(|(w, src, key, digest, port, protocol)| {
                format!(
                    "('{w}'::uuid, {}::inet, 1::smallint, {}::text, '{digest}'::uuid, {port}, {protocol}::smallint)",
                    text_literal(src),
                    text_literal(key)
                )
            })
            .collect();
        selections.push(format!(
            "(workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol) IN (VALUES {})",
            rows.join(", ")
        ));
    }
    let mut replayed: BTreeMap<Uuid, u64> = BTreeMap::new();
    let mut keys = Keys { replayers, now, count: 0 };
    if !selections.is_empty() {
        let parts = split_days(hours_from, hours_to, tail_whole(&mut tx, hours_to).await?);
        let statement = keys_of(&rollup_parts(&selections, &parts, false), false);
        copy_rows(&mut tx, &statement, false, |key, sums, _| {
            let sums = match raw.remove(&key) {
                Some((more, _)) => sums.merge(more),
                None => sums,
            };
            *replayed.entry(key.0).or_default() += 1;
            keys.add(key, sums)
        })
        .await?;
    }
    tx.rollback().await?;
    for (key, (sums, rolled)) in raw {
        if rolled {
            return Err(Error::Corrupt {
                what: "flow key last hours",
                detail: format!(
                    "a key towards {} is rolled up in the range but no rollup of it was read",
                    key.0
                ),
            });
        }
        *replayed.entry(key.0).or_default() += 1;
        keys.add(key, sums)?;
    }
    for (workload, replayer) in keys.replayers.iter_mut() {
        let all = totals.get(workload).copied().unwrap_or(0);
        let seen = replayed.get(workload).copied().unwrap_or(0);
        if seen > all {
            return Err(Error::Corrupt {
                what: "flow key last hours",
                detail: format!("workload {workload} has {all} keys in the range but {seen} were replayed"),
            });
        }
        replayer.add_unchanged(all - seen);
    }
    Ok(Some(total))
}

async fn run(
    conn: &mut PgConnection,
    jobs: Vec<Job>,
    range: Range,
    top: usize,
    read: Read,
) -> Result<(Impact, Read), Error> {
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.id.uuid()).collect();
    let mut replayers: BTreeMap<Uuid, Replayer> =
        jobs.iter().map(|j| (j.id.uuid(), Replayer::new(j.from.as_ref(), &j.to, top))).collect();
    let mut labels = BTreeMap::new();
    let mut keys = 0u64;
    let mut made = Read::Full;
    if !ids.is_empty() {
        let (now, sets) = labels_now(conn).await?;
        labels = sets;
        let narrowed = match read {
            Read::Narrowed => narrowed_fold(conn, &jobs, range, &mut replayers, &now).await?,
            Read::Full => None,
        };
        keys = match narrowed {
            Some(keys) => {
                made = Read::Narrowed;
                keys
            }
            None => fold(conn, &ids, range, &mut replayers, &now).await?,
        };
        // Every label set a kept row names, once, with a flow key that has it.
        let mut wanted: BTreeMap<LabelDigest, (Uuid, i16, String)> = BTreeMap::new();
        for (workload, replayer) in &replayers {
            for (digest, peer_kind, peer_key) in replayer.label_sets() {
                wanted.entry(digest).or_insert_with(|| (*workload, peer_kind, peer_key.to_owned()));
            }
        }
        labels_then(conn, wanted, range, &mut labels).await?;
    }
    let (windows, gaps) = evidence(conn, &ids, range).await?;
    let (from_ms, to_ms) = (range.from.timestamp_millis(), range.to.timestamp_millis());
    let mut out = Vec::new();
    for job in &jobs {
        let uuid = job.id.uuid();
        let Some(replayer) = replayers.remove(&uuid) else { continue };
        let (replayed, unseen, unseen_count) = replayer.finish(&labels);
        let no_windows = Vec::new();
        let no_gaps = Vec::new();
        out.push(WorkloadImpact {
            id: job.id,
            hostname: job.hostname.clone(),
            from_version: job.from_version,
            from_mode: job.from.as_ref().map(|p| p.mode().to_string()),
            to_version: job.to_version,
            to_mode: job.to.mode().to_string(),
            note: job.from.is_none().then(|| "nothing applied: every recorded flow was admitted".to_owned()),
            replayed,
            coverage: replay::coverage(
                from_ms,
                to_ms,
                windows.get(&uuid).unwrap_or(&no_windows),
                gaps.get(&uuid).unwrap_or(&no_gaps),
                top,
            ),
            unseen_admissions: unseen,
            unseen_admission_count: unseen_count,
        });
    }
    out.sort_by_key(|w| w.id);
    Ok((Impact { range, top, workloads: out, keys }, made))
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use proptest::prelude::*;

    use super::*;

    fn at(hours: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_790_000_000 / 86_400 * 86_400, 0).unwrap() + TimeDelta::hours(hours)
    }

    #[test]
    fn whole_days_come_from_the_day_sums() {
        assert_eq!(
            split_days(at(5), at(24 * 7 + 3), false),
            vec![
                Part::Days(at(24), at(24 * 7)),
                Part::Hours(at(5), at(24)),
                Part::Hours(at(24 * 7), at(24 * 7 + 3)),
            ]
        );
        // Nothing of the last day rolled up after the end: its day sums are its hours before it.
        assert_eq!(
            split_days(at(5), at(24 * 7 + 3), true),
            vec![Part::Days(at(24), at(24 * 8)), Part::Hours(at(5), at(24)),]
        );
        assert_eq!(split_days(at(0), at(48), false), vec![Part::Days(at(0), at(48))]);
        assert_eq!(split_days(at(0), at(48), true), vec![Part::Days(at(0), at(48))]);
        // No whole day inside: hours only, even across midnight; a range from midnight may read
        // its day's sums.
        assert_eq!(split_days(at(5), at(23), true), vec![Part::Hours(at(5), at(23))]);
        assert_eq!(split_days(at(20), at(30), false), vec![Part::Hours(at(20), at(30))]);
        assert_eq!(
            split_days(at(20), at(30), true),
            vec![Part::Days(at(24), at(48)), Part::Hours(at(20), at(24))]
        );
        assert_eq!(split_days(at(24), at(30), true), vec![Part::Days(at(24), at(48))]);
        assert_eq!(split_days(at(24), at(30), false), vec![Part::Hours(at(24), at(30))]);
    }

    proptest! {
        /// The parts cover the whole hours exactly once, days only where whole, except that a
        /// whole tail day may reach past the end to its midnight.
        #[test]
        fn parts_cover_the_hours_once(from in 0i64..24 * 10, len in 1i64..24 * 10, tail in any::<bool>()) {
            let (from, to) = (at(from), at(from + len));
            let mut covered: Vec<(DateTime<Utc>, DateTime<Utc>)> = split_days(from, to, tail)
                .into_iter()
                .map(|part| match part {
                    Part::Days(a, b) => {
                        assert_eq!((a.timestamp() % 86_400, b.timestamp() % 86_400), (0, 0));
                        (a, b)
                    }
                    Part::Hours(a, b) => (a, b),
                })
                .collect();
            covered.sort();
            prop_assert_eq!(covered.first().unwrap().0, from);
            let end = covered.last().unwrap().1;
            let midnight = to.duration_trunc(TimeDelta::days(1)).unwrap() + TimeDelta::days(1);
            prop_assert!(end == to || (tail && end == midnight), "{} {}", end, to);
            for pair in covered.windows(2) {
                prop_assert_eq!(pair[0].1, pair[1].0);
                prop_assert!(pair[0].0 < pair[0].1);
            }
        }
    }
}
