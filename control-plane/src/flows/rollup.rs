//! Flow review rollups (FLOW-6): records summed by rule, rule+peer, source+destination,
//! destination+service or peer+service, over a time range, filtered by decision, workloads (ids,
//! or a scope selector resolved to the workloads in it *now*), the peer's labels as stored at
//! ingest (*then*) and policy version. Each row names the versions and decisions involved.
//!
//! Whole hours of the range are read from `flow_rollups` (windows rolled up by `hourly`), the
//! partial hours at its ends and the windows of whole hours not rolled up yet from the raw
//! records, all in one statement (one snapshot), so a result is exact whatever the roll-up job
//! has done. Results come a bounded page at a time, ordered by the group key (`page`).
//!
//! A page costs what its groups cost, not what the range holds (PERF-8): each source is summed
//! on its own in key order (`flow_rollups` has an index in each grouping's order, migration
//! 0014) and stops after a page of groups; the first page of groups of every source together
//! holds the first page of groups overall, so the statement sorts those few partial groups and
//! [`merge`] adds up the ones several sources share. The rule grouping has a handful of groups,
//! so over the whole estate it reads `flow_rule_rollups`, summed over workloads and peers. Peers
//! order by their labels' digest, not by the labels.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, TimeDelta, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::hourly::hour_floor;
use super::page::{self, Page, PageRequest};
use super::query::version_code;
use crate::error::Error;
use crate::policy::model::Selector;
use crate::policy::store;

/// What a rollup groups records by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Grouping {
    /// The rule that matched (`""`: none, e.g. would-block flows).
    Rule,
    /// The rule and the peer (with its labels then).
    RulePeer,
    /// The source address (with its peer) and the destination workload and address.
    SrcDst,
    /// The destination workload and service (port and protocol).
    DstService,
    /// The peer (with its labels then) and the service.
    PeerService,
}

impl Grouping {
    pub const ALL: [Grouping; 5] =
        [Grouping::Rule, Grouping::RulePeer, Grouping::SrcDst, Grouping::DstService, Grouping::PeerService];

    pub fn name(self) -> &'static str {
        match self {
            Grouping::Rule => "rule",
            Grouping::RulePeer => "rule-peer",
            Grouping::SrcDst => "src-dst",
            Grouping::DstService => "dst-service",
            Grouping::PeerService => "peer-service",
        }
    }

    /// The group key, in sort order.
    fn key(self) -> &'static [Column] {
        use Column::*;
        match self {
            Grouping::Rule => &[Rule],
            Grouping::RulePeer => &[Rule, PeerKind, PeerKey, PeerDigest],
            Grouping::SrcDst => &[Src, PeerKind, PeerKey, PeerDigest, Workload, Dst],
            Grouping::DstService => &[Workload, Port, Protocol],
            Grouping::PeerService => &[PeerKind, PeerKey, PeerDigest, Port, Protocol],
        }
    }
}

impl fmt::Display for Grouping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Grouping {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Grouping::ALL.into_iter().find(|g| g.name() == s).ok_or_else(|| {
            Error::Invalid(format!(
                "unknown grouping {s:?}: use rule, rule-peer, src-dst, dst-service or peer-service"
            ))
        })
    }
}

/// A column of a group key: its name in `flow_rollups` (and the expression over `flow_records`
/// giving it), and in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Rule,
    PeerKind,
    PeerKey,
    /// The digest of the peer's labels then: peers order by it; the labels are output with it.
    PeerDigest,
    Src,
    Workload,
    Dst,
    Port,
    Protocol,
}

/// The digest of a record's peer labels, as `flow_rollups.peer_digest` stores it.
const RAW_PEER_DIGEST: &str = "md5(peer_labels::text)::uuid";

impl Column {
    const ALL: [Column; 9] = [
        Column::Rule,
        Column::PeerKind,
        Column::PeerKey,
        Column::PeerDigest,
        Column::Src,
        Column::Workload,
        Column::Dst,
        Column::Port,
        Column::Protocol,
    ];

    /// Its name in `flow_rollups` and in a source's output.
    fn name(self) -> &'static str {
        match self {
            Column::Rule => "matched_rule_id",
            Column::PeerKind => "peer_kind",
            Column::PeerKey => "peer_key",
            Column::PeerDigest => "peer_digest",
            Column::Src => "src_address",
            Column::Workload => "workload_id",
            Column::Dst => "dst_address",
            Column::Port => "dst_port",
            Column::Protocol => "protocol",
        }
    }

    /// Its value in a source reading `flow_records` (`raw`) or the rollups.
    fn stored(self, raw: bool) -> &'static str {
        match (self, raw) {
            (Column::PeerDigest, true) => RAW_PEER_DIGEST,
            _ => self.name(),
        }
    }

    fn ty(self) -> &'static str {
        match self {
            Column::Rule | Column::PeerKey => "text",
            Column::PeerKind | Column::Protocol => "smallint",
            Column::PeerDigest | Column::Workload => "uuid",
            Column::Src | Column::Dst => "inet",
            Column::Port => "integer",
        }
    }

    /// The output column of the page: the merged sources' column when grouped by it (addresses
    /// as text), NULL of its type otherwise.
    fn output(self, grouped: bool) -> String {
        let name = match self {
            Column::Rule => "rule",
            _ => self.name(),
        };
        match (grouped, self) {
            (false, Column::Src | Column::Dst) => format!("NULL::text AS {name}"),
            (false, _) => format!("NULL::{} AS {name}", self.ty()),
            (true, Column::Src | Column::Dst) => format!("host({}) AS {name}", self.name()),
            (true, _) => format!("{} AS {name}", self.name()),
        }
    }

    /// This column of `row` in a cursor.
    fn of(self, row: &RollupRow) -> serde_json::Value {
        match self {
            Column::Rule => serde_json::json!(row.rule),
            Column::PeerKind => serde_json::json!(row.peer_kind),
            Column::PeerKey => serde_json::json!(row.peer_key),
            Column::PeerDigest => serde_json::json!(row.peer_digest),
            Column::Src => serde_json::json!(row.src_address),
            Column::Workload => serde_json::json!(row.workload_id),
            Column::Dst => serde_json::json!(row.dst_address),
            Column::Port => serde_json::json!(row.dst_port),
            Column::Protocol => serde_json::json!(row.protocol),
        }
    }

    /// Binds field `i` of a cursor key as this column's type.
    fn bind(
        self,
        q: &mut QueryBuilder<Postgres>,
        key: &serde_json::Value,
        i: usize,
        kind: &str,
    ) -> Result<(), Error> {
        match self {
            Column::Rule | Column::PeerKey => q.push_bind(page::field::<String>(key, i, kind)?),
            Column::PeerKind | Column::Protocol => q.push_bind(page::field::<i16>(key, i, kind)?),
            Column::Src | Column::Dst => q.push_bind(page::field::<String>(key, i, kind)?).push("::inet"),
            Column::PeerDigest | Column::Workload => q.push_bind(page::field::<Uuid>(key, i, kind)?),
            Column::Port => q.push_bind(page::field::<i32>(key, i, kind)?),
        };
        Ok(())
    }
}

/// Which records a rollup sums. Times are window starts: a record is in `[from, to)` when the
/// window it was reported in started in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollupFilter {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// Any of these decisions; empty: all.
    pub decisions: Vec<Decision>,
    /// Flows to these workloads only; `None`: the whole estate (an empty set matches nothing).
    pub workloads: Option<BTreeSet<WorkloadId>>,
    /// The peer had all these labels when the flow was ingested (labels *then*).
    pub peer_labels: Vec<Label>,
    /// Decided under any of these policy versions; empty: all.
    pub versions: Vec<u64>,
}

impl RollupFilter {
    /// Everything in `[from, to)`.
    pub fn range(from: DateTime<Utc>, to: DateTime<Utc>) -> Self {
        RollupFilter { from, to, decisions: vec![], workloads: None, peer_labels: vec![], versions: vec![] }
    }

    /// Narrows the workloads to `ids` (intersecting any set already there).
    pub fn within(mut self, ids: BTreeSet<WorkloadId>) -> Self {
        self.workloads = Some(match self.workloads {
            None => ids,
            Some(mine) => mine.intersection(&ids).copied().collect(),
        });
        self
    }
}

/// One group of a rollup: its key (the fields of the grouping; the others absent) and its sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollupRow {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_kind: Option<i16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_key: Option<String>,
    /// The digest of `peer_labels`, by which peers with the same key order (and cursors point).
    #[serde(skip)]
    pub peer_digest: Option<Uuid>,
    /// The peer's labels when its flows were ingested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_labels: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src_address: Option<String>,
    /// The destination workload (the one that reported the flows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst_port: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<i16>,
    /// New connections.
    pub connections: i64,
    pub packets: i64,
    pub bytes: i64,
    /// Raw records summed.
    pub records: i64,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    /// The policy versions that decided these flows, ascending.
    pub policy_versions: Vec<i64>,
    /// The decisions among them (stored numbers), ascending.
    pub decisions: Vec<i16>,
}

/// The live workloads whose labels the selector matches now (FLOW-6: a review scope reads labels
/// at query time). The empty selector matches nothing.
pub async fn workloads_in(pool: &PgPool, selector: &Selector) -> Result<BTreeSet<WorkloadId>, Error> {
    let mut conn = pool.acquire().await?;
    let registry = store::load_registry(&mut conn).await?;
    Ok(registry.workloads.into_iter().filter(|w| selector.selects(&w.labels)).map(|w| w.id).collect())
}

/// Parses a scope as operators write it: `key=value`, several values as `key=v1|v2`, several keys
/// ANDed with commas (`app=web,env=prod|staging`).
pub fn parse_selector(text: &str) -> Result<Selector, Error> {
    let mut matches = Vec::new();
    for part in text.split(',').map(str::trim) {
        let (key, values) = part.split_once('=').ok_or_else(|| {
            Error::Invalid(format!(
                "scope {text:?}: {part:?} is not key=value; write e.g. app=web,env=prod|staging"
            ))
        })?;
        matches.push((key.trim().to_owned(), values.split('|').map(|v| v.trim().to_owned()).collect()));
    }
    Ok(Selector::from_strings(matches)?)
}

/// One source's part of a group, as the statement returns it.
#[derive(sqlx::FromRow)]
struct Part {
    rule: Option<String>,
    peer_kind: Option<i16>,
    peer_key: Option<String>,
    peer_digest: Option<Uuid>,
    peer_labels: Option<serde_json::Value>,
    src_address: Option<String>,
    workload_id: Option<Uuid>,
    dst_address: Option<String>,
    dst_port: Option<i32>,
    protocol: Option<i16>,
    connections: i64,
    packets: i64,
    bytes: i64,
    records: i64,
    first_seen: DateTime<Utc>,
    last_seen: DateTime<Utc>,
    policy_versions: Vec<i64>,
    /// Bit `d` set: decision `d` is among the flows.
    decision_bits: i32,
}

/// A scope of at most 1/8 of the estate's workloads is narrow (see [`rollup`]): beyond, reading
/// in key order and skipping the rest costs less than sorting the scope's rows.
const NARROW_SCOPE: i64 = 8;

/// The sums of one source (`records` is the column or expression counting raw records).
const SUMS: &str = "sum(new_connections)::bigint AS connections, sum(packets)::bigint AS packets,
    sum(bytes)::bigint AS bytes, min(first_seen) AS first_seen, max(last_seen) AS last_seen,
    array_agg(DISTINCT policy_version) AS policy_versions, bit_or(1 << decision) AS decision_bits";

/// Where one part of a rollup's input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// `flow_rollups` rows of the whole hours `[from, to)`.
    Hours(DateTime<Utc>, DateTime<Utc>),
    /// Raw records of every window that started in `[from, to)`.
    Raw(DateTime<Utc>, DateTime<Utc>),
    /// Raw records of the windows not rolled up yet that started in `[from, to)`.
    Pending(DateTime<Utc>, DateTime<Utc>),
}

/// The parts covering `[from, to)` exactly once: whole hours from the rollups (plus the windows
/// in them not rolled up yet), the partial hours at the ends from raw records.
pub(crate) fn sources(from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Source> {
    let first = hour_floor(from);
    let first = if first == from { first } else { first + TimeDelta::hours(1) };
    let last = hour_floor(to);
    if first >= last {
        return vec![Source::Raw(from, to)];
    }
    let mut parts = vec![Source::Hours(first, last), Source::Pending(first, last)];
    if from < first {
        parts.push(Source::Raw(from, first));
    }
    if last < to {
        parts.push(Source::Raw(last, to));
    }
    parts
}

/// A page of the rollup of the records `filter` selects, grouped `by`, in group-key order.
pub async fn rollup(
    pool: &PgPool,
    by: Grouping,
    filter: &RollupFilter,
    request: &PageRequest,
) -> Result<Page<RollupRow>, Error> {
    let limit = request.checked_limit()?;
    let kind = format!("rollup {by}");
    crate::input::instant("from", filter.from)?;
    crate::input::instant("to", filter.to)?;
    let cursor_key = crate::page::cursor_key(pool).await?;
    let after = request.after(&cursor_key, &kind)?;
    if filter.from >= filter.to {
        return Err(Error::Invalid(format!(
            "the range from {} to {} is empty; its start must be before its end",
            filter.from, filter.to
        )));
    }
    if filter.workloads.as_ref().is_some_and(BTreeSet::is_empty) {
        return Ok(Page { rows: vec![], truncated: false, next_cursor: None });
    }
    let labels = label_object(&filter.peer_labels)?;
    let versions = filter.versions.iter().map(|v| version_code(*v)).collect::<Result<Vec<_>, _>>()?;
    let key = by.key();
    // Over the whole estate, whole hours by rule come from the rollups summed over everything else.
    let by_rule = by == Grouping::Rule && filter.workloads.is_none() && labels.is_none();
    // A scope of a small part of the estate is read through the workload index and sorted: a
    // source read in key order would pass over the rest of the estate to fill a page, and the
    // planner, taking the scope's rows to be spread evenly, would choose that (OFFSET 0 keeps
    // the key order out of the scope's scan).
    let narrow = match &filter.workloads {
        Some(ids) => {
            let estate: i64 = sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await?;
            ids.len() as i64 * NARROW_SCOPE <= estate
        }
        None => false,
    };

    let mut q = QueryBuilder::<Postgres>::new("SELECT ");
    for column in Column::ALL {
        q.push(column.output(key.contains(&column))).push(", ");
    }
    let labels_out =
        if key.contains(&Column::PeerDigest) { "peer_labels" } else { "NULL::jsonb AS peer_labels" };
    q.push(format!(
        "{labels_out}, connections, packets, bytes, records, first_seen, last_seen, policy_versions, decision_bits FROM ("
    ));
    for (n, source) in sources(filter.from, filter.to).into_iter().enumerate() {
        if n > 0 {
            q.push(" UNION ALL ");
        }
        let raw = !matches!(source, Source::Hours(..));
        let stored: Vec<&str> = key.iter().map(|c| c.stored(raw)).collect();
        let stored = stored.join(", ");
        q.push("(SELECT ");
        for column in key {
            q.push(format!("{} AS {}, ", column.stored(raw), column.name()));
        }
        if key.contains(&Column::PeerDigest) {
            q.push("(array_agg(peer_labels))[1] AS peer_labels, ");
        }
        q.push(SUMS).push(if raw { ", count(*) AS records" } else { ", sum(records)::bigint AS records" });
        q.push(if narrow { " FROM (SELECT * FROM " } else { " FROM " });
        match source {
            Source::Hours(from, to) => {
                q.push(if by_rule { "flow_rule_rollups" } else { "flow_rollups" });
                q.push(" WHERE hour >= ").push_bind(from).push(" AND hour < ").push_bind(to);
            }
            Source::Raw(from, to) => {
                q.push("flow_records WHERE window_start >= ").push_bind(from);
                q.push(" AND window_start < ").push_bind(to);
            }
            Source::Pending(from, to) => {
                // Driven by the few windows not rolled up (their queue), not by the hours.
                q.push("flow_records WHERE window_start >= ").push_bind(from);
                q.push(" AND window_start < ").push_bind(to);
                q.push(
                    " AND (workload_id, window_id, window_start) IN (SELECT workload_id, window_id, window_start
                       FROM flow_pending_windows WHERE window_start >= ",
                );
                q.push_bind(from).push(" AND window_start < ").push_bind(to).push(")");
            }
        }
        if let Some(ids) = &filter.workloads {
            q.push(" AND workload_id = ANY(")
                .push_bind(ids.iter().map(|id| id.uuid()).collect::<Vec<_>>())
                .push(")");
        }
        if !filter.decisions.is_empty() {
            let codes: Vec<i16> = filter.decisions.iter().map(|d| d.code()).collect();
            q.push(" AND decision = ANY(").push_bind(codes).push(")");
        }
        if !versions.is_empty() {
            q.push(" AND policy_version = ANY(").push_bind(versions.clone()).push(")");
        }
        if let Some(labels) = &labels {
            q.push(" AND peer_labels @> ").push_bind(labels.clone()).push("::jsonb");
        }
        // Groups after the cursor are made of exactly the rows whose key is after it.
        if let Some(after) = &after {
            q.push(format!(" AND ({stored}) > ("));
            for (i, column) in key.iter().enumerate() {
                if i > 0 {
                    q.push(", ");
                }
                column.bind(&mut q, after, i, &kind)?;
            }
            q.push(")");
        }
        if narrow {
            q.push(" OFFSET 0) AS s");
        }
        q.push(format!(" GROUP BY {stored} ORDER BY {stored} LIMIT ")).push_bind(limit + 1).push(")");
    }
    // Qualified: the sources' columns (addresses as inet), not the page's (addresses as text).
    let names: Vec<String> = key.iter().map(|c| format!("f.{}", c.name())).collect();
    q.push(format!(") AS f ORDER BY {}", names.join(", ")));
    let parts: Vec<Part> = q.build_query_as().fetch_all(pool).await?;
    let rows = merge(parts, limit as usize + 1);
    Ok(page::page(&cursor_key, rows, limit, &kind, |row| key.iter().map(|c| c.of(row)).collect()))
}

/// The first `groups` groups of the parts (in key order, a group's parts next to each other),
/// each group's parts added up.
fn merge(parts: Vec<Part>, groups: usize) -> Vec<RollupRow> {
    let mut rows: Vec<RollupRow> = Vec::new();
    for part in parts {
        let decisions: Vec<i16> = (0..16).filter(|d| part.decision_bits & (1 << d) != 0).collect();
        if let Some(last) = rows.last_mut()
            && same_group(last, &part)
        {
            last.connections += part.connections;
            last.packets += part.packets;
            last.bytes += part.bytes;
            last.records += part.records;
            last.first_seen = last.first_seen.min(part.first_seen);
            last.last_seen = last.last_seen.max(part.last_seen);
            last.policy_versions.extend(part.policy_versions);
            last.policy_versions.sort_unstable();
            last.policy_versions.dedup();
            last.decisions.extend(decisions);
            last.decisions.sort_unstable();
            last.decisions.dedup();
            continue;
        }
        if rows.len() == groups {
            break;
        }
        let mut policy_versions = part.policy_versions;
        policy_versions.sort_unstable();
        rows.push(RollupRow {
            rule: part.rule,
            peer_kind: part.peer_kind,
            peer_key: part.peer_key,
            peer_digest: part.peer_digest,
            peer_labels: part.peer_labels,
            src_address: part.src_address,
            workload_id: part.workload_id,
            dst_address: part.dst_address,
            dst_port: part.dst_port,
            protocol: part.protocol,
            connections: part.connections,
            packets: part.packets,
            bytes: part.bytes,
            records: part.records,
            first_seen: part.first_seen,
            last_seen: part.last_seen,
            policy_versions,
            decisions,
        });
    }
    rows
}

/// The part is of the row's group: every key field is equal (absent ones are absent in both).
fn same_group(row: &RollupRow, part: &Part) -> bool {
    row.rule == part.rule
        && row.peer_kind == part.peer_kind
        && row.peer_key == part.peer_key
        && row.peer_digest == part.peer_digest
        && row.src_address == part.src_address
        && row.workload_id == part.workload_id
        && row.dst_address == part.dst_address
        && row.dst_port == part.dst_port
        && row.protocol == part.protocol
}

/// The labels a peer must have had, as the JSON object `peer_labels` must contain.
fn label_object(labels: &[Label]) -> Result<Option<serde_json::Value>, Error> {
    if labels.is_empty() {
        return Ok(None);
    }
    let mut object = serde_json::Map::new();
    for label in labels {
        let value = serde_json::Value::String(label.value.to_string());
        if let Some(other) = object.insert(label.key.to_string(), value.clone())
            && other != value
        {
            return Err(Error::Invalid(format!(
                "peer label {} is given with two values ({other} and {value}); a peer had one value per key",
                label.key
            )));
        }
    }
    Ok(Some(serde_json::Value::Object(object)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        text.parse().unwrap()
    }

    fn check(from: &str, to: &str, expected: &str) {
        let got: Vec<String> = sources(at(from), at(to))
            .into_iter()
            .map(|s| match s {
                Source::Hours(a, b) => format!("hours {}..{}", a.format("%H:%M"), b.format("%H:%M")),
                Source::Pending(a, b) => format!("pending {}..{}", a.format("%H:%M"), b.format("%H:%M")),
                Source::Raw(a, b) => format!("raw {}..{}", a.format("%H:%M"), b.format("%H:%M")),
            })
            .collect();
        assert_eq!(got.join(", "), expected, "{from} .. {to}");
    }

    #[test]
    fn a_range_is_covered_once_by_whole_hours_and_raw_ends() {
        check("2026-01-01T10:00:00Z", "2026-01-01T13:00:00Z", "hours 10:00..13:00, pending 10:00..13:00");
        check(
            "2026-01-01T10:20:00Z",
            "2026-01-01T13:05:00Z",
            "hours 11:00..13:00, pending 11:00..13:00, raw 10:20..11:00, raw 13:00..13:05",
        );
        check("2026-01-01T10:20:00Z", "2026-01-01T11:10:00Z", "raw 10:20..11:10");
        check("2026-01-01T10:20:00Z", "2026-01-01T10:40:00Z", "raw 10:20..10:40");
        check("2026-01-01T10:00:00Z", "2026-01-01T11:00:00Z", "hours 10:00..11:00, pending 10:00..11:00");
        check(
            "2026-01-01T09:59:59Z",
            "2026-01-01T11:00:00Z",
            "hours 10:00..11:00, pending 10:00..11:00, raw 09:59..10:00",
        );
    }

    #[test]
    fn groupings_and_scopes_parse_and_say_what_to_write() {
        for g in Grouping::ALL {
            assert_eq!(g.name().parse::<Grouping>().unwrap(), g);
        }
        let err = "rules".parse::<Grouping>().unwrap_err().to_string();
        assert!(err.contains("\"rules\"") && err.contains("rule-peer"), "{err}");

        let s = parse_selector("app=web,env=prod|staging").unwrap();
        assert_eq!(s.to_string(), "app in (web) and env in (prod, staging)");
        let err = parse_selector("app").unwrap_err().to_string();
        assert!(err.contains("not key=value"), "{err}");
        assert!(parse_selector("app=").is_err());
    }

    #[test]
    fn peer_labels_become_one_object_and_conflicts_are_refused() {
        let labels = |l: &[&str]| l.iter().map(|l| l.parse().unwrap()).collect::<Vec<Label>>();
        assert_eq!(label_object(&[]).unwrap(), None);
        assert_eq!(
            label_object(&labels(&["app=web", "env=prod", "app=web"])).unwrap(),
            Some(serde_json::json!({"app": "web", "env": "prod"}))
        );
        let err = label_object(&labels(&["app=web", "app=db"])).unwrap_err().to_string();
        assert!(err.contains("two values"), "{err}");
    }
}
