//! The impact of proposed policies on recorded traffic (POL-8): for each workload whose proposed
//! policy differs from the one its agent applied, the recorded flows of a range towards it are
//! replayed through both (`replay`, pure) and reported per transition, with the evidence's
//! coverage of the range, its gaps, the admissions no flow exercised and the relabelled peers.
//! `replay` does the same between two stored versions of one workload. Reads only, through one
//! connection; the flow keys stream from one statement and are folded as they come.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{EvidenceGap, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Protocol, WorkloadPolicy};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Postgres, QueryBuilder, Row};
use tokio_stream::StreamExt;
use uuid::Uuid;

use super::replay::{self, Coverage, FlowSum, NewAdmission, Replayed, Replayer};
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

    fn check(&self) -> Result<(), Error> {
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
    run(conn, jobs, range, top).await
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
    run(conn, vec![job], range, top).await
}

/// Labels now of every live workload, by its peer key (its id as text), as ingest writes them.
async fn labels_now(conn: &mut PgConnection) -> Result<BTreeMap<String, serde_json::Value>, Error> {
    let rows = sqlx::query(
        "SELECT w.id::text, COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l
                                      WHERE l.workload_id = w.id), '{}'::jsonb)
         FROM workloads w WHERE w.retired_at IS NULL AND w.denied_at IS NULL",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Windows `(start, end)` in ms and gaps of `ids` overlapping the range.
#[allow(clippy::type_complexity)]
async fn evidence(
    conn: &mut PgConnection,
    ids: &[Uuid],
    range: Range,
) -> Result<(BTreeMap<Uuid, Vec<(i64, i64)>>, BTreeMap<Uuid, Vec<EvidenceGap>>), Error> {
    let mut windows: BTreeMap<Uuid, Vec<(i64, i64)>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT workload_id, window_start, window_end FROM flow_windows
         WHERE workload_id = ANY($1) AND window_end > $2 AND window_start < $3 AND window_start >= $4",
    )
    .bind(ids)
    .bind(range.from)
    .bind(range.to)
    .bind(range.from - WINDOW_REACH)
    .fetch_all(&mut *conn)
    .await?
    {
        let ms = |i| row.get::<DateTime<Utc>, _>(i).timestamp_millis();
        windows.entry(row.get(0)).or_default().push((ms(1), ms(2)));
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

/// The flow keys towards `ids` over `range`, each source of `flows::sources` (whole hours from
/// the rollups and their pending windows, partial hours raw) summed per key in one statement.
fn flow_statement(ids: &[Uuid], range: Range) -> QueryBuilder<Postgres> {
    let mut q = QueryBuilder::<Postgres>::new(
        "SELECT workload_id, host(src_address), peer_kind, peer_key, (array_agg(peer_labels))[1], dst_port,
                protocol, sum(c)::bigint, sum(r)::bigint, min(first_seen), max(last_seen) FROM (",
    );
    for (n, source) in crate::flows::sources(range.from, range.to).into_iter().enumerate() {
        if n > 0 {
            q.push(" UNION ALL ");
        }
        let raw = "SELECT workload_id, src_address, peer_kind, peer_key, md5(peer_labels::text)::uuid AS peer_digest,
                   peer_labels, dst_port, protocol, new_connections AS c, 1::bigint AS r, first_seen, last_seen
                   FROM flow_records WHERE window_start >= ";
        match source {
            Source::Hours(from, to) => {
                q.push(
                    "SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, peer_labels, dst_port,
                     protocol, new_connections AS c, records AS r, first_seen, last_seen FROM flow_rollups
                     WHERE hour >= ",
                );
                q.push_bind(from).push(" AND hour < ").push_bind(to);
            }
            Source::Raw(from, to) => {
                q.push(raw).push_bind(from).push(" AND window_start < ").push_bind(to);
            }
            Source::Pending(from, to) => {
                q.push(raw).push_bind(from).push(" AND window_start < ").push_bind(to);
                q.push(
                    " AND (workload_id, window_id, window_start) IN (SELECT workload_id, window_id, window_start
                       FROM flow_windows WHERE NOT rolled_up AND window_start >= ",
                );
                q.push_bind(from).push(" AND window_start < ").push_bind(to).push(")");
            }
        }
        q.push(" AND workload_id = ANY(").push_bind(ids.to_vec()).push(")");
    }
    q.push(") AS f GROUP BY workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol");
    q
}

async fn run(conn: &mut PgConnection, jobs: Vec<Job>, range: Range, top: usize) -> Result<Impact, Error> {
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.id.uuid()).collect();
    let mut replayers: BTreeMap<Uuid, Replayer> =
        jobs.iter().map(|j| (j.id.uuid(), Replayer::new(j.from.as_ref(), &j.to, top))).collect();
    let mut keys = 0u64;
    if !ids.is_empty() {
        let now = labels_now(conn).await?;
        let mut q = flow_statement(&ids, range);
        let mut rows = q.build().fetch(&mut *conn);
        while let Some(row) = rows.next().await.transpose()? {
            keys += 1;
            if keys > MAX_KEYS {
                return Err(Error::Invalid(format!(
                    "the range holds more than {MAX_KEYS} flow keys towards these workloads; replay a shorter range or fewer workloads"
                )));
            }
            let corrupt = |what: &'static str, detail: String| Error::Corrupt { what, detail };
            let src: String = row.get(1);
            let peer_key: String = row.get(3);
            let peer_kind: i16 = row.get(2);
            let flow = FlowSum {
                src: src.parse().map_err(|_| corrupt("flow source", src.clone()))?,
                peer_kind,
                labels_now: if peer_kind == 1 { now.get(&peer_key).cloned() } else { None },
                peer_key,
                labels_then: row.get(4),
                dst_port: u16::try_from(row.get::<i32, _>(5))
                    .map_err(|_| corrupt("flow port", String::new()))?,
                protocol: Protocol::from_code(row.get(6))
                    .map_err(|_| corrupt("flow protocol", row.get::<i16, _>(6).to_string()))?,
                connections: row.get::<i64, _>(7).max(0) as u64,
                records: row.get::<i64, _>(8).max(0) as u64,
                first_seen_ms: row.get::<DateTime<Utc>, _>(9).timestamp_millis(),
                last_seen_ms: row.get::<DateTime<Utc>, _>(10).timestamp_millis(),
            };
            if let Some(r) = replayers.get_mut(&row.get::<Uuid, _>(0)) {
                r.add(&flow);
            }
        }
    }
    let (windows, gaps) = evidence(conn, &ids, range).await?;
    let (from_ms, to_ms) = (range.from.timestamp_millis(), range.to.timestamp_millis());
    let mut out = Vec::new();
    for job in &jobs {
        let uuid = job.id.uuid();
        let Some(replayer) = replayers.remove(&uuid) else { continue };
        let (replayed, unseen, unseen_count) = replayer.finish();
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
    Ok(Impact { range, top, workloads: out, keys })
}
