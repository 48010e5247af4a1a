//! What the verdict reads from Postgres (FLOW-7): a scope resolved to the live workloads in it
//! now, and for each its state, latest policy and the evidence its agent delivered for a range
//! — windows, gaps and flows summed per key and version. Through one connection, so a
//! promotion reads it inside its own transaction.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{Decision, EvidenceGap, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol};
use innerwall_wire::sync::SyncState;
use serde::Serialize;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::error::Error;
use crate::gate::verdict::{FlowFacts, Params, WindowFacts, WorkloadFacts};
use crate::policy::model::Selector;
use crate::policy::store;

/// The most workloads one verdict or promotion names by id.
pub const MAX_SCOPE_IDS: usize = 1_000;

/// How a verdict or a mode change names its workloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// The live workloads whose labels the selector selects now.
    Selector(Selector),
    /// These workloads, each of which must exist and be live.
    Ids(Vec<WorkloadId>),
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Selector(s) => {
                let terms: Vec<String> = s
                    .matches()
                    .iter()
                    .map(|(k, vs)| {
                        let values: Vec<&str> = vs.iter().map(|v| v.as_str()).collect();
                        format!("{}={}", k.as_str(), values.join("|"))
                    })
                    .collect();
                write!(f, "{}", terms.join(","))
            }
            Scope::Ids(ids) => {
                let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
                write!(f, "{}", ids.join(","))
            }
        }
    }
}

impl Scope {
    /// A selector as operators write it everywhere (`flows::parse_selector`): `key=value`, several
    /// values as `key=v1|v2`, several keys ANDed with commas (`app=web,env=prod|staging`).
    pub fn parse_selector(text: &str) -> Result<Scope, Error> {
        crate::flows::parse_selector(text).map(Scope::Selector)
    }

    /// These workloads, at most [`MAX_SCOPE_IDS`] of them.
    pub fn ids(ids: Vec<WorkloadId>) -> Result<Scope, Error> {
        check_id_count(ids.len())?;
        Ok(Scope::Ids(ids))
    }
}

fn check_id_count(n: usize) -> Result<(), Error> {
    if n > MAX_SCOPE_IDS {
        return Err(Error::Invalid(format!("at most {MAX_SCOPE_IDS} workload ids, not {n}")));
    }
    Ok(())
}

/// A workload a scope resolved to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Member {
    #[serde(serialize_with = "crate::gate::serialize_id", deserialize_with = "crate::gate::deserialize_id")]
    pub id: WorkloadId,
    pub hostname: String,
    #[serde(deserialize_with = "crate::gate::mode_name")]
    pub mode: crate::gate::Name,
}

impl Member {
    pub fn name(&self) -> String {
        format!("{} ({})", self.hostname, self.id)
    }
}

/// The live workloads `scope` names now, in id order.
pub async fn resolve(conn: &mut PgConnection, scope: &Scope) -> Result<Vec<Member>, Error> {
    let live = sqlx::query(
        "SELECT id, hostname, mode FROM workloads WHERE retired_at IS NULL AND denied_at IS NULL ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut members = BTreeMap::new();
    for row in live {
        let id = workload_id(row.get(0))?;
        let mode = Mode::from_code(row.get(2)).map_err(|_| Error::Corrupt {
            what: "workload mode",
            detail: row.get::<i16, _>(2).to_string(),
        })?;
        members.insert(id, Member { id, hostname: row.get(1), mode: mode.name() });
    }
    match scope {
        Scope::Ids(ids) => {
            check_id_count(ids.len())?;
            let mut chosen = BTreeMap::new();
            for id in ids {
                let member = members
                    .get(id)
                    .cloned()
                    .ok_or_else(|| Error::NotFound { what: "live workload", name: id.to_string() })?;
                chosen.insert(*id, member);
            }
            Ok(chosen.into_values().collect())
        }
        Scope::Selector(selector) => {
            let registry = store::load_registry(conn).await?;
            let selected: BTreeSet<WorkloadId> = registry
                .workloads
                .into_iter()
                .filter(|w| selector.selects(&w.labels))
                .map(|w| w.id)
                .collect();
            Ok(members.into_values().filter(|m| selected.contains(&m.id)).collect())
        }
    }
}

fn workload_id(uuid: Uuid) -> Result<WorkloadId, Error> {
    WorkloadId::from_uuid(uuid)
        .ok_or_else(|| Error::Corrupt { what: "workload id", detail: uuid.to_string() })
}

fn time(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}

/// How far before a range a window may start and still reach into it: the longest window an
/// agent may send (`wire::flows::MAX_WINDOW_MS`). Records and gaps are found through their
/// window's start, which their partitions are keyed on.
const WINDOW_REACH: chrono::Duration = chrono::Duration::days(1);

/// Gaps may describe losses older than the window that carries them (windows dropped or
/// refused while the agent was cut off, at most the queue's day of windows).
const GAP_REACH: chrono::Duration = chrono::Duration::days(2);

/// The rows of `sql` for the workloads `ids` over the range `[from, to)`: its `$1` is the ids,
/// `$2` and `$3` the range, `$4` the oldest window start that can reach into it.
async fn in_range(
    conn: &mut PgConnection,
    sql: &'static str,
    ids: &[Uuid],
    (from, to): (DateTime<Utc>, DateTime<Utc>),
    oldest: DateTime<Utc>,
) -> Result<Vec<sqlx::postgres::PgRow>, Error> {
    Ok(sqlx::query(sql).bind(ids).bind(from).bind(to).bind(oldest).fetch_all(&mut *conn).await?)
}

/// Everything the verdict needs of `members` over `params`' range.
pub async fn facts(
    conn: &mut PgConnection,
    members: &[Member],
    params: &Params,
) -> Result<Vec<WorkloadFacts>, Error> {
    read(conn, members, params, None).await
}

/// What the verdict on promoting a staged ruleset (FLOW-10) needs of `members`, each under its
/// staged set (`sets`, in `members`' order): only the windows decided under that set, each
/// counted as captured under the latest version, and their flows summed per key with the
/// decision that matters — BLOCKED where the flow is ALLOWED now and its pending decision
/// blocks it (BLOCKED, or WOULD_BLOCK in simulation), ALLOWED otherwise. Gaps as for
/// [`facts`].
pub async fn staged_facts(
    conn: &mut PgConnection,
    members: &[Member],
    sets: &[String],
    params: &Params,
) -> Result<Vec<WorkloadFacts>, Error> {
    let mut facts = read(conn, members, params, Some(sets)).await?;
    for w in &mut facts {
        let latest = w.latest.as_ref().map_or(0, |p| p.version());
        w.windows.iter_mut().for_each(|window| window.policy_version = latest);
        w.flows.iter_mut().for_each(|flow| flow.policy_version = latest);
    }
    Ok(facts)
}

async fn read(
    conn: &mut PgConnection,
    members: &[Member],
    params: &Params,
    staged: Option<&[String]>,
) -> Result<Vec<WorkloadFacts>, Error> {
    let ids: Vec<Uuid> = members.iter().map(|m| m.id.uuid()).collect();
    let (from, to) = (time(params.from_ms), time(params.to_ms));
    let mut facts = BTreeMap::new();
    // The state as shown (`shown`): a silent workload is judged OFFLINE, swept or not.
    for row in sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT w.id, w.hostname, w.mode, {}, w.applied_version FROM {} WHERE w.id = ANY($1)",
        crate::shown::STATE,
        crate::shown::ROWS
    )))
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?
    {
        let id = workload_id(row.get(0))?;
        let corrupt = |what: &'static str, n: i16| Error::Corrupt { what, detail: n.to_string() };
        let latest = store::persisted_policy(conn, id).await?.map(|(p, _)| p);
        facts.insert(
            id,
            WorkloadFacts {
                id,
                hostname: row.get(1),
                mode: Mode::from_code(row.get(2)).map_err(|_| corrupt("workload mode", row.get(2)))?,
                state: SyncState::from_code(row.get(3)).map_err(|_| corrupt("sync state", row.get(3)))?,
                applied_version: row.get::<i64, _>(4).max(0) as u64,
                latest,
                windows: Vec::new(),
                gaps: Vec::new(),
                flows: Vec::new(),
            },
        );
    }
    let windows = match staged {
        None => {
            let sql = "SELECT workload_id, window_start, window_end, policy_version FROM flow_windows
                 WHERE workload_id = ANY($1) AND window_end > $2 AND window_start < $3 AND window_start >= $4";
            in_range(conn, sql, &ids, (from, to), from - WINDOW_REACH).await?
        }
        Some(sets) => {
            sqlx::query(
                "SELECT w.workload_id, w.window_start, w.window_end, w.policy_version
                 FROM flow_windows w JOIN unnest($1::uuid[], $5::text[]) AS s (id, set) ON s.id = w.workload_id
                 WHERE w.staged_set = s.set AND w.window_end > $2 AND w.window_start < $3 AND w.window_start >= $4",
            )
            .bind(&ids)
            .bind(from)
            .bind(to)
            .bind(from - WINDOW_REACH)
            .bind(sets)
            .fetch_all(&mut *conn)
            .await?
        }
    };
    for row in windows {
        if let Some(w) = facts.get_mut(&workload_id(row.get(0))?) {
            w.windows.push(WindowFacts {
                start_ms: row.get::<DateTime<Utc>, _>(1).timestamp_millis(),
                end_ms: row.get::<DateTime<Utc>, _>(2).timestamp_millis(),
                policy_version: row.get::<i64, _>(3).max(0) as u64,
            });
        }
    }
    let sql = "SELECT workload_id, kind, gap_from, gap_to, count, detail FROM flow_gaps
         WHERE workload_id = ANY($1) AND gap_to >= $2 AND gap_from <= $3 AND window_start >= $4";
    for row in in_range(conn, sql, &ids, (from, to), from - GAP_REACH).await? {
        let kind = GapKind::from_code(row.get(1))
            .map_err(|_| Error::Corrupt { what: "gap kind", detail: row.get::<i16, _>(1).to_string() })?;
        if let Some(w) = facts.get_mut(&workload_id(row.get(0))?) {
            let gap = EvidenceGap::new(
                kind,
                row.get::<DateTime<Utc>, _>(2).timestamp_millis(),
                row.get::<DateTime<Utc>, _>(3).timestamp_millis(),
                row.get::<i64, _>(4).max(0) as u64,
            );
            w.gaps.push(gap.because(row.get::<&str, _>(5)));
        }
    }
    let flows = match staged {
        None => {
            let sql =
                "SELECT r.workload_id, r.policy_version, host(r.src_address), r.dst_port, r.protocol, r.decision,
                        sum(r.new_connections)::bigint, sum(r.packets)::bigint, (array_agg(r.peer_labels))[1]
                 FROM flow_records r
                 JOIN flow_windows w ON w.workload_id = r.workload_id AND w.window_id = r.window_id
                 WHERE r.workload_id = ANY($1) AND r.window_start >= $4 AND r.window_start < $3 AND w.window_end > $2
                 GROUP BY 1, 2, 3, 4, 5, 6";
            in_range(conn, sql, &ids, (from, to), from - WINDOW_REACH).await?
        }
        Some(sets) => {
            let (allowed, blocked) = (Decision::Allowed.code(), Decision::Blocked.code());
            let blocking = [Decision::Blocked.code(), Decision::WouldBlock.code()];
            sqlx::query(
                "SELECT r.workload_id, r.policy_version, host(r.src_address), r.dst_port, r.protocol,
                        CASE WHEN r.decision = $6 AND r.pending_decision = ANY($8) THEN $7 ELSE $6 END,
                        sum(r.new_connections)::bigint, sum(r.packets)::bigint, (array_agg(r.peer_labels))[1]
                 FROM flow_records r
                 JOIN flow_windows w ON w.workload_id = r.workload_id AND w.window_id = r.window_id
                 JOIN unnest($1::uuid[], $5::text[]) AS s (id, set) ON s.id = w.workload_id
                 WHERE r.workload_id = ANY($1) AND w.staged_set = s.set AND r.window_start >= $4 AND r.window_start < $3 AND w.window_end > $2
                 GROUP BY 1, 2, 3, 4, 5, 6",
            )
            .bind(&ids)
            .bind(from)
            .bind(to)
            .bind(from - WINDOW_REACH)
            .bind(sets)
            .bind(allowed)
            .bind(blocked)
            .bind(&blocking[..])
            .fetch_all(&mut *conn)
            .await?
        }
    };
    for row in flows {
        let src: String = row.get(2);
        let corrupt = |what: &'static str, detail: String| Error::Corrupt { what, detail };
        let flow = FlowFacts {
            policy_version: row.get::<i64, _>(1).max(0) as u64,
            src: src.parse().map_err(|_| corrupt("flow source", src.clone()))?,
            dst_port: u16::try_from(row.get::<i32, _>(3)).map_err(|_| corrupt("flow port", String::new()))?,
            protocol: Protocol::from_code(row.get(4))
                .map_err(|_| corrupt("flow protocol", row.get::<i16, _>(4).to_string()))?,
            decision: Decision::from_code(row.get(5))
                .map_err(|_| corrupt("flow decision", row.get::<i16, _>(5).to_string()))?,
            connections: row.get::<i64, _>(6).max(0) as u64,
            packets: row.get::<i64, _>(7).max(0) as u64,
            peer_labels: row.get(8),
        };
        if let Some(w) = facts.get_mut(&workload_id(row.get(0))?) {
            w.flows.push(flow);
        }
    }
    Ok(facts.into_values().collect())
}
