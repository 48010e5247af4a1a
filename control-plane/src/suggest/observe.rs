//! What a suggestion run reads (FLOW-9): the scope's destinations with their applied versions,
//! labels and evidence; every recorded flow key towards them by day, decided again under the
//! version each host applied now (judged as enforcement: a rule admits it or nothing does); the
//! estate's labels, services and address groups; and the accepted and ignored suggestions.
//! Flows in an hour a gap of their destination touches (a suspect-direction gap included) are
//! excluded and reported by kind. Then `generalise::suggest`, and the suggestions shown are kept
//! so `accept` and `ignore` can name them by id.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, DurationRound, Utc};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::WorkloadPolicy;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use super::generalise::{
    self, DEFAULT_EPHEMERAL, Destination, Estate, Excluded, Ignored, LEARNING_MS, Labels, Managed,
    Observation, Params, Suggestions,
};
use crate::error::Error;
use crate::foresight::Range;
use crate::foresight::impact::{self, Key, Sums};
use crate::foresight::replay::{self, Admission};
use crate::gate::evidence::{self, Scope};
use crate::policy::store;

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 86_400_000;
/// The most suggestions one run shows (each is a row kept for `accept`).
pub const MAX_SUGGESTIONS: usize = 2_000;
/// The most excluded label keys.
pub const MAX_EXCLUDED_KEYS: usize = 64;
/// How long a shown suggestion can be accepted or ignored by id without being shown again.
const SHOWN_FOR: chrono::Duration = chrono::Duration::days(7);

/// What an operator asks for.
#[derive(Debug, Clone)]
pub struct Request {
    /// The destinations (`app=payments-db`).
    pub scope: String,
    pub range: Range,
    /// Label keys that name a host, not a role.
    pub excluded_keys: BTreeSet<String>,
    pub max_breadth: f64,
}

impl Request {
    /// Every check that needs no database: the scope's grammar, the bound, the keys.
    pub fn check(&self) -> Result<Params, Error> {
        Scope::parse_selector(&self.scope)?;
        if !(1.0..=100.0).contains(&self.max_breadth) {
            return Err(Error::Invalid(format!(
                "the breadth bound is between 1 and 100, not {}",
                self.max_breadth
            )));
        }
        if self.excluded_keys.len() > MAX_EXCLUDED_KEYS {
            return Err(Error::Invalid(format!("at most {MAX_EXCLUDED_KEYS} excluded label keys")));
        }
        for key in &self.excluded_keys {
            innerwall_wire::labels::LabelKey::new(key)
                .map_err(|e| Error::Invalid(format!("excluded label key {key:?}: {e}")))?;
        }
        Ok(Params {
            excluded_keys: self.excluded_keys.clone(),
            max_breadth: self.max_breadth,
            from_ms: self.range.from.timestamp_millis(),
            to_ms: self.range.to.timestamp_millis(),
        })
    }
}

fn workload_id(uuid: Uuid) -> Result<WorkloadId, Error> {
    WorkloadId::from_uuid(uuid).ok_or_else(|| Error::Corrupt { what: "workload id", detail: "nil".into() })
}

fn labels_of(value: &serde_json::Value) -> Labels {
    value
        .as_object()
        .map(|o| o.iter().filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned()))).collect())
        .unwrap_or_default()
}

/// Every live workload's labels now.
async fn estate_labels(conn: &mut PgConnection) -> Result<BTreeMap<WorkloadId, Labels>, Error> {
    let mut out: BTreeMap<WorkloadId, Labels> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT w.id, l.key, l.value FROM workloads w LEFT JOIN workload_labels l ON l.workload_id = w.id
         WHERE w.retired_at IS NULL AND w.denied_at IS NULL",
    )
    .fetch_all(&mut *conn)
    .await?
    {
        let labels = out.entry(workload_id(row.get(0))?).or_default();
        if let (Some(k), Some(v)) = (row.get::<Option<String>, _>(1), row.get::<Option<String>, _>(2)) {
            labels.insert(k, v);
        }
    }
    Ok(out)
}

async fn estate(conn: &mut PgConnection) -> Result<Estate, Error> {
    let model = store::load_model(conn).await?;
    Ok(Estate {
        labels: estate_labels(conn).await?,
        address_groups: model.address_groups.into_values().map(|g| (g.name, g.cidrs)).collect(),
        services: model.services.into_values().map(|s| (s.name, s.entries)).collect(),
    })
}

/// The applied policy of each destination (none: nothing applied).
async fn applied(
    conn: &mut PgConnection,
    ids: &[WorkloadId],
) -> Result<BTreeMap<WorkloadId, Option<WorkloadPolicy>>, Error> {
    let uuids: Vec<Uuid> = ids.iter().map(|id| id.uuid()).collect();
    let mut versions = Vec::new();
    for row in sqlx::query("SELECT id, applied_version FROM workloads WHERE id = ANY($1)")
        .bind(&uuids)
        .fetch_all(&mut *conn)
        .await?
    {
        versions.push((workload_id(row.get(0))?, row.get::<i64, _>(1).max(0) as u64));
    }
    let wanted: Vec<(WorkloadId, u64)> = versions.iter().copied().filter(|(_, v)| *v > 0).collect();
    let mut stored = store::policies_at(conn, &wanted).await?;
    Ok(versions.into_iter().map(|(id, v)| (id, stored.remove(&(id, v)))).collect())
}

/// A key's sums and the days it was seen on.
#[derive(Default)]
struct Seen {
    sums: Option<Sums>,
    days: BTreeSet<i64>,
}

/// Reads, decides and generalises: the suggestions for the request, with what was excluded.
/// Reads only, but keeps each suggestion shown (by id) for `accept` and `ignore`.
pub async fn suggest(pool: &PgPool, request: &Request) -> Result<Suggestions, Error> {
    let params = request.check()?;
    let scope = Scope::parse_selector(&request.scope)?;
    let range = request.range;
    let mut conn = pool.acquire().await?;
    let members = evidence::resolve(&mut conn, &scope).await?;
    let ids: Vec<WorkloadId> = members.iter().map(|m| m.id).collect();
    let uuids: Vec<Uuid> = ids.iter().map(|id| id.uuid()).collect();
    let estate = estate(&mut conn).await?;
    let policies = applied(&mut conn, &ids).await?;
    let (windows, gaps) = impact::evidence(&mut conn, &uuids, range).await?;
    let ephemeral: BTreeMap<Uuid, (u16, u16)> = sqlx::query_as::<_, (Uuid, i32, i32)>(
        "SELECT id, ephemeral_low, ephemeral_high FROM workloads WHERE id = ANY($1) AND ephemeral_low IS NOT NULL",
    )
    .bind(&uuids)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .filter_map(|(id, low, high)| Some((id, (u16::try_from(low).ok()?, u16::try_from(high).ok()?))))
    .collect();
    let (from_ms, to_ms) = (params.from_ms, params.to_ms);

    let mut destinations = BTreeMap::new();
    for m in &members {
        let uuid = m.id.uuid();
        let no_windows = Vec::new();
        let no_gaps = Vec::new();
        let w = windows.get(&uuid).unwrap_or(&no_windows);
        let g = gaps.get(&uuid).unwrap_or(&no_gaps);
        let coverage = replay::coverage(from_ms, to_ms, w, g, 0);
        // Gap-free since the later of the first window and the end of the last gap.
        let evidence_from = w.iter().map(|(s, _)| *s).min().unwrap_or(to_ms).max(from_ms);
        let clean_from = g.iter().map(|g| g.to_ms).max().unwrap_or(evidence_from).max(evidence_from);
        destinations.insert(
            m.id,
            Destination {
                // Hostnames are what hosts report, not unique: the id tells them apart.
                hostname: format!("{} ({})", m.hostname, m.id),
                labels: estate.labels.get(&m.id).cloned().unwrap_or_default(),
                ephemeral: ephemeral.get(&uuid).copied().unwrap_or(DEFAULT_EPHEMERAL),
                coverage: coverage.ratio,
                recent_gap_free_ms: (to_ms - clean_from).clamp(0, LEARNING_MS),
                admitted_connections: 0,
                connections: 0,
            },
        );
    }

    // Destinations with a gap are read hour by hour, and the hours a gap touches left out.
    let hourly: Vec<Uuid> =
        uuids.iter().copied().filter(|u| gaps.get(u).is_some_and(|g| !g.is_empty())).collect();
    let daily: Vec<Uuid> = uuids.iter().copied().filter(|u| !hourly.contains(u)).collect();
    let mut seen: BTreeMap<Key, Seen> = BTreeMap::new();
    let mut left_out: BTreeMap<(String, Uuid), (u64, u64)> = BTreeMap::new();
    impact::bucketed_keys(&mut conn, &daily, &hourly, range, |key, sums, bucket| {
        if let Some(gap) = gaps
            .get(&key.0)
            .and_then(|g| g.iter().find(|g| g.from_ms < bucket + HOUR_MS && g.to_ms >= bucket))
        {
            let e = left_out.entry((gap.kind.to_string(), key.0)).or_default();
            e.0 += sums.records;
            e.1 += sums.connections;
            return;
        }
        let entry = seen.entry(key).or_default();
        entry.sums = Some(match entry.sums {
            Some(s) => s.merge(sums),
            None => sums,
        });
        entry.days.insert(bucket.div_euclid(DAY_MS));
    })
    .await?;

    // The label sets the managed sources had when seen.
    let mut wanted: BTreeMap<Uuid, (Uuid, i16, String)> = BTreeMap::new();
    for key in seen.keys().filter(|k| k.2 == 1) {
        wanted.entry(key.4).or_insert_with(|| (key.0, key.2, key.3.clone()));
    }
    let mut sets = BTreeMap::new();
    impact::labels_then(&mut conn, wanted, range, &mut sets).await?;

    let mut observed = Vec::new();
    for (key, seen) in seen {
        let (workload, src, peer_kind, peer_key, digest, port, protocol) = key;
        let id = workload_id(workload)?;
        let Some(sums) = seen.sums else { continue };
        let destination = destinations.get_mut(&id).expect("read for the scope's workloads only");
        destination.connections += sums.connections;
        let policy = policies.get(&id).and_then(Option::as_ref);
        if policy.is_some() && matches!(replay::admission(policy, src, port, protocol), Admission::Rule(_)) {
            destination.admitted_connections += sums.connections;
            continue;
        }
        let managed = match peer_kind {
            1 => Some(Managed {
                id: workload_id(
                    peer_key
                        .parse()
                        .map_err(|_| Error::Corrupt { what: "flow peer key", detail: peer_key.clone() })?,
                )?,
                labels: sets.get(&digest).map(labels_of).unwrap_or_default(),
            }),
            _ => None,
        };
        observed.push(Observation {
            destination: id,
            address: src,
            managed,
            protocol,
            port,
            connections: sums.connections,
            records: sums.records,
            first_seen_ms: sums.first_seen_ms,
            last_seen_ms: sums.last_seen_ms,
            days: seen.days,
        });
    }
    let excluded: Vec<Excluded> = left_out
        .into_iter()
        .map(|((kind, workload), (flows, connections))| Excluded {
            reason: format!("in an hour a {kind} gap touches"),
            destination: workload_id(workload)
                .ok()
                .and_then(|id| destinations.get(&id))
                .map_or_else(|| workload.to_string(), |d| d.hostname.clone()),
            flows,
            connections,
        })
        .collect();

    let (accepted, ignored) = decided(&mut conn).await?;
    let out = generalise::suggest(&observed, &destinations, &estate, &params, &accepted, &ignored, excluded);
    if out.suggestions.len() > MAX_SUGGESTIONS {
        return Err(Error::Invalid(format!(
            "{} suggestions are more than the {MAX_SUGGESTIONS} one run shows: narrow the scope",
            out.suggestions.len()
        )));
    }
    drop(conn);
    keep_shown(pool, &out).await?;
    Ok(out)
}

/// The accepted suggestions (id → draft) and the sources each ignored (group, protocol, port)
/// had.
async fn decided(conn: &mut PgConnection) -> Result<(BTreeMap<String, String>, Ignored), Error> {
    let mut accepted = BTreeMap::new();
    let mut ignored = Ignored::new();
    for row in sqlx::query("SELECT id, state, draft, suggestion FROM suggestions WHERE state <> 'shown'")
        .fetch_all(&mut *conn)
        .await?
    {
        let id: String = row.get(0);
        let state: String = row.get(1);
        let suggestion: generalise::Suggestion = serde_json::from_value(row.get(3))
            .map_err(|e| Error::Corrupt { what: "stored suggestion", detail: format!("{id}: {e}") })?;
        match state.as_str() {
            "accepted" => {
                accepted.insert(id, row.get::<Option<String>, _>(2).unwrap_or_default());
            }
            _ => ignored.entry(suggestion.ignore_key()).or_default().extend(suggestion.evidence.sources),
        }
    }
    Ok((accepted, ignored))
}

/// Keeps every suggestion shown (accepted and ignored ones keep what they were decided on; an
/// ignored one shown again because a new source appeared is open again, with its new sources),
/// and forgets shown ones nobody decided on past [`SHOWN_FOR`].
async fn keep_shown(pool: &PgPool, out: &Suggestions) -> Result<(), Error> {
    let ids: Vec<&str> = out.suggestions.iter().map(|s| s.id.as_str()).collect();
    let bodies: Vec<serde_json::Value> =
        out.suggestions.iter().map(|s| serde_json::to_value(s).expect("plain data serializes")).collect();
    let reopened: Vec<bool> = out.suggestions.iter().map(|s| !s.new_since_ignored.is_empty()).collect();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO suggestions (id, suggestion, shown_at)
         SELECT id, body, now() FROM unnest($1::text[], $2::jsonb[]) AS s (id, body)
         ON CONFLICT (id) DO UPDATE SET suggestion = EXCLUDED.suggestion, shown_at = EXCLUDED.shown_at,
                                        state = 'shown', decided_by = NULL, decided_at = NULL
         WHERE suggestions.state = 'shown'
            OR (suggestions.state = 'ignored' AND EXCLUDED.id = ANY($3::text[]))",
    )
    .bind(&ids)
    .bind(&bodies)
    .bind(ids.iter().zip(&reopened).filter(|(_, r)| **r).map(|(id, _)| *id).collect::<Vec<&str>>())
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM suggestions WHERE state = 'shown' AND shown_at < now() - $1::interval")
        .bind(SHOWN_FOR)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Stored suggestions by id, in the order asked; an unknown id is NotFound.
async fn stored(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<Vec<(generalise::Suggestion, String)>, Error> {
    let mut found = BTreeMap::new();
    for row in sqlx::query("SELECT id, suggestion, state FROM suggestions WHERE id = ANY($1) FOR UPDATE")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?
    {
        let id: String = row.get(0);
        let s: generalise::Suggestion = serde_json::from_value(row.get(1))
            .map_err(|e| Error::Corrupt { what: "stored suggestion", detail: format!("{id}: {e}") })?;
        found.insert(id, (s, row.get::<String, _>(2)));
    }
    ids.iter()
        .map(|id| {
            found.remove(id).ok_or_else(|| Error::NotFound {
                what: "suggestion (run `innerwall suggest` first; shown ones are kept 7 days)",
                name: id.clone(),
            })
        })
        .collect()
}

/// The most ids one accept or ignore names.
pub const MAX_IDS: usize = 100;

fn check_ids(ids: &[String]) -> Result<(), Error> {
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(Error::Invalid(format!("name 1 to {MAX_IDS} suggestion ids")));
    }
    if let Some(bad) = ids.iter().find(|id| id.len() != 12 || !id.bytes().all(|b| b.is_ascii_hexdigit())) {
        return Err(Error::Invalid(format!("{bad:?} is not a suggestion id (12 hex digits)")));
    }
    Ok(())
}

/// What `accept` did: the draft and the objects it changed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Accepted {
    pub draft: String,
    pub ids: Vec<String>,
    pub objects: Vec<String>,
}

/// Writes the suggestions `ids` into the draft `draft` (created if it does not exist): the
/// services they need that do not exist, and per destination group its `suggested-…` ruleset
/// (the one stored or already in the draft, with these rules added, each named by its
/// suggestion and carrying its evidence digest). Marks them accepted and audits
/// `suggestion.accept`. A suggestion that is no rule ("needs an address group") is refused.
pub async fn accept(
    pool: &PgPool,
    actor: &str,
    ids: &[String],
    draft: &str,
    counts: &crate::counts::CountBounds,
) -> Result<Accepted, Error> {
    use crate::foresight::drafts::{self, ChangeFile, ChangeSpec, NamedMembers};
    check_ids(ids)?;
    let mut conn = pool.acquire().await?;
    let chosen = stored(&mut conn, ids).await?;
    if let Some((s, _)) = chosen.iter().find(|(_, state)| state == "ignored") {
        return Err(Error::Invalid(format!(
            "suggestion {} is ignored; it is proposed again when a new source appears",
            s.id
        )));
    }
    if let Some((s, _)) = chosen.iter().find(|(s, _)| !s.is_rule()) {
        return Err(Error::Invalid(format!(
            "suggestion {} is no rule: its {} sources need an address group first",
            s.id,
            s.evidence.sources.len()
        )));
    }
    let existing = match drafts::show(pool, draft).await {
        Ok(view) => Some(view),
        Err(Error::NotFound { .. }) => None,
        Err(e) => return Err(e),
    };
    let mut base = BTreeMap::new();
    for (s, _) in &chosen {
        let name = generalise::ruleset_name(&s.group);
        if base.contains_key(&name) {
            continue;
        }
        let in_draft = existing
            .iter()
            .flat_map(|d| d.changes.iter())
            .find_map(|c| c.change.ruleset.as_ref().filter(|r| r.name == name).cloned());
        let spec = match in_draft {
            Some(spec) => Some(spec),
            None => match store::ruleset_view(&mut conn, &name).await {
                Ok(view) => Some(view.spec),
                Err(Error::NotFound { .. }) => None,
                Err(e) => return Err(e),
            },
        };
        if let Some(spec) = spec {
            base.insert(name, spec);
        }
    }
    drop(conn);
    let suggestions: Vec<&generalise::Suggestion> = chosen.iter().map(|(s, _)| s).collect();
    let mut changes: Vec<ChangeSpec> = Vec::new();
    let mut services = BTreeSet::new();
    for s in suggestions.iter().filter(|s| !s.service.exists) {
        if services.insert(s.service.name.clone()) {
            changes.push(ChangeSpec::service(NamedMembers {
                name: s.service.name.clone(),
                description: format!("suggested from recorded flows ({})", s.service.entry),
                members: vec![s.service.entry.clone()],
            }));
        }
    }
    changes.extend(generalise::rulesets(&suggestions, &base).into_iter().map(ChangeSpec::ruleset));
    let objects: Vec<String> = changes
        .iter()
        .map(|c| match (&c.service, &c.ruleset) {
            (Some(s), _) => format!("service/{}", s.name),
            (_, Some(r)) => format!("ruleset/{}", r.name),
            _ => unreachable!("only services and rulesets are written"),
        })
        .collect();
    if existing.is_none() {
        drafts::create(pool, actor, draft, "suggested rules from recorded flows").await?;
    }
    drafts::add(pool, actor, draft, &ChangeFile { changes }, counts).await?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "UPDATE suggestions SET state = 'accepted', draft = $2, decided_by = $3, decided_at = now()
         WHERE id = ANY($1)",
    )
    .bind(ids)
    .bind(draft)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    let detail = serde_json::json!({
        "ids": ids,
        "objects": objects,
        "evidence": suggestions.iter().map(|s| (s.id.clone(), s.evidence_digest.clone())).collect::<BTreeMap<_, _>>(),
    });
    crate::audit::write(
        &mut tx,
        &crate::audit::Record { detail, ..crate::audit::Record::new(actor, "suggestion.accept", draft) },
    )
    .await?;
    tx.commit().await?;
    Ok(Accepted { draft: draft.to_owned(), ids: ids.to_vec(), objects })
}

/// Marks the suggestions `ids` ignored: not shown again until a source they did not have
/// appears. Audited as `suggestion.ignore`.
pub async fn ignore(pool: &PgPool, actor: &str, ids: &[String]) -> Result<(), Error> {
    check_ids(ids)?;
    let mut tx = pool.begin().await?;
    let chosen = stored(&mut tx, ids).await?;
    if let Some((s, _)) = chosen.iter().find(|(_, state)| state == "accepted") {
        return Err(Error::Invalid(format!("suggestion {} is accepted already (in its draft)", s.id)));
    }
    sqlx::query(
        "UPDATE suggestions SET state = 'ignored', decided_by = $2, decided_at = now() WHERE id = ANY($1)",
    )
    .bind(ids)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    let sources: BTreeMap<&str, &Vec<String>> =
        chosen.iter().map(|(s, _)| (s.id.as_str(), &s.evidence.sources)).collect();
    let detail = serde_json::json!({ "ids": ids, "sources": sources });
    let subject = ids.join(",");
    crate::audit::write(
        &mut tx,
        &crate::audit::Record { detail, ..crate::audit::Record::new(actor, "suggestion.ignore", &subject) },
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The range ending now that `--since` names (default 14 days). Whole days name UTC days,
/// today's included: `14d` is the 13 whole days before today and today so far, so "seen on 2 of
/// 14 days" counts the days of the range; any other length ends now and starts that long ago.
pub fn range_since(now: DateTime<Utc>, since: std::time::Duration) -> Result<Range, Error> {
    let secs = since.as_secs();
    let day = 86_400;
    if since.subsec_nanos() != 0 || secs == 0 || !secs.is_multiple_of(day) {
        return Range::ending_at(now, since);
    }
    let today = now.duration_trunc(chrono::TimeDelta::days(1)).expect("now truncates to a day");
    let from = today - chrono::TimeDelta::days((secs / day) as i64 - 1);
    let range = Range { from, to: now };
    range.check()?;
    Ok(range)
}
