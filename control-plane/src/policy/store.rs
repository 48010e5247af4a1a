//! Postgres access for the registry, the authored model and rendered policies. Reads build the
//! plain `model` types the renderer takes; writes validate first and leave rendering to
//! `foresight::commit`, so every mutation reaches `publish` before it is acknowledged.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use chrono::{DateTime, Utc};

use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, WorkloadPolicy};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::error::Error;
use crate::policy::addresses::Standing;
use crate::policy::lifecycle;
use crate::policy::model::{
    AddressGroup, AuthoredModel, Management, ModelError, Peer, Pin, RegisteredWorkload, Rule, Ruleset,
    Selector, Service, ServiceEntry, StagedRuleset,
};
use crate::policy::source::{Part, Source};
use crate::policy::spec::RulesetSpec;

/// A stored enum number (the schema keeps protobuf numbers), refused as corrupt if unknown.
fn stored<E: WireEnum>(n: i16) -> Result<E, Error> {
    E::from_code(n).map_err(|_| Error::Corrupt { what: E::WHAT, detail: n.to_string() })
}

/// A selector as stored: `[{"key": k, "values": [v…]}]`.
#[derive(Debug, Serialize, Deserialize)]
struct StoredMatch {
    key: String,
    values: Vec<String>,
}

pub fn selector_to_json(selector: &Selector) -> serde_json::Value {
    let matches: Vec<StoredMatch> = selector
        .matches()
        .iter()
        .map(|(k, vs)| StoredMatch {
            key: k.to_string(),
            values: vs.iter().map(ToString::to_string).collect(),
        })
        .collect();
    serde_json::to_value(matches).expect("plain data serializes")
}

fn selector_from_json(value: serde_json::Value) -> Result<Selector, Error> {
    let matches: Vec<StoredMatch> = serde_json::from_value(value)
        .map_err(|e| Error::Corrupt { what: "selector", detail: e.to_string() })?;
    Ok(Selector::from_strings(matches.into_iter().map(|m| (m.key, m.values)))?)
}

/// A label set as the label history stores it (a JSON object of key → value).
pub fn labels_from_json(value: serde_json::Value) -> Result<BTreeMap<LabelKey, LabelValue>, Error> {
    let corrupt = |detail: String| Error::Corrupt { what: "label history", detail };
    let map: BTreeMap<String, String> = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
    map.into_iter()
        .map(|(k, v)| {
            let key = LabelKey::new(&k).map_err(|e| corrupt(e.to_string()))?;
            let value = LabelValue::new(&v).map_err(|e| corrupt(e.to_string()))?;
            Ok((key, value))
        })
        .collect()
}

fn service_entry(
    protocol: i16,
    start: Option<i32>,
    end: Option<i32>,
) -> Result<(Protocol, Option<PortRange>), Error> {
    let protocol = stored::<Protocol>(protocol)?;
    let range = match (start, end) {
        (Some(s), Some(e)) => Some(PortRange::new(s as u32, e as u32)?),
        _ => None,
    };
    Ok((protocol, range))
}

/// Groups (protocol, range) rows, in ordinal order, into entries: one per protocol run.
fn entries_from_rows(rows: Vec<(Protocol, Option<PortRange>)>) -> Result<Vec<ServiceEntry>, Error> {
    let mut by_protocol: BTreeMap<Protocol, Vec<PortRange>> = BTreeMap::new();
    for (protocol, range) in rows {
        by_protocol.entry(protocol).or_default().extend(range);
    }
    by_protocol.into_iter().map(|(p, ports)| Ok(ServiceEntry::new(p, ports)?)).collect()
}

/// The whole authored model, in deterministic order.
pub async fn load_model(conn: &mut PgConnection) -> Result<AuthoredModel, Error> {
    let mut model = AuthoredModel {
        services: load_services(conn, None).await?,
        address_groups: load_address_groups(conn, None).await?,
        ..AuthoredModel::default()
    };

    model.rulesets = load_rulesets(conn, None).await?;
    load_management(conn, &mut model).await?;
    load_pins(conn, &mut model).await?;
    for stored in staged_rulesets(conn).await? {
        // One whose references went away since it was staged is left out of the render (its
        // listing says why) rather than failing every render.
        match crate::policy::staged::resolve(&stored.spec, &model) {
            Ok(ruleset) => model.staged.push(StagedRuleset { stage: stored.stage, ruleset }),
            Err(e) => {
                tracing::warn!(ruleset = %stored.spec.name, error = %e, "a staged ruleset no longer resolves")
            }
        }
    }
    Ok(model)
}

/// `text` with its one parameter bound to `filter`, or without one.
fn filtered<'q, T>(
    text: &'static str,
    filter: Option<&'q [T]>,
) -> sqlx::query::Query<'q, sqlx::Postgres, PgArguments>
where
    T: sqlx::Type<sqlx::Postgres> + sqlx::postgres::PgHasArrayType + sqlx::Encode<'q, sqlx::Postgres> + Sync,
{
    match filter {
        Some(filter) => sqlx::query(text).bind(filter),
        None => sqlx::query(text),
    }
}

/// The services of these names (`None`: every service), by id.
pub async fn load_services(
    conn: &mut PgConnection,
    names: Option<&[String]>,
) -> Result<BTreeMap<Uuid, Service>, Error> {
    let mut entry_rows: BTreeMap<Uuid, Vec<(Protocol, Option<PortRange>)>> = BTreeMap::new();
    // Two texts, not `$1 IS NULL OR …`: a prepared statement's generic plan of that scans.
    let (entries, heads) = match names {
        None => (
            "SELECT service_id, protocol, port_start, port_end FROM service_entries ORDER BY service_id, ordinal",
            "SELECT id, name FROM services",
        ),
        Some(_) => (
            "SELECT e.service_id, e.protocol, e.port_start, e.port_end FROM service_entries e
             JOIN services s ON s.id = e.service_id WHERE s.name = ANY($1) ORDER BY e.service_id, e.ordinal",
            "SELECT id, name FROM services WHERE name = ANY($1)",
        ),
    };
    for row in filtered(entries, names).fetch_all(&mut *conn).await? {
        entry_rows.entry(row.get(0)).or_default().push(service_entry(row.get(1), row.get(2), row.get(3))?);
    }
    let mut services = BTreeMap::new();
    for row in filtered(heads, names).fetch_all(&mut *conn).await? {
        let id: Uuid = row.get(0);
        let entries = entries_from_rows(entry_rows.remove(&id).unwrap_or_default())?;
        services.insert(id, Service { id, name: row.get(1), entries });
    }
    Ok(services)
}

/// The rulesets of these names (`None`: every ruleset) with their rules, in name order.
pub async fn load_rulesets(conn: &mut PgConnection, names: Option<&[String]>) -> Result<Vec<Ruleset>, Error> {
    // Two texts each, not `$1 IS NULL OR …`: a prepared statement's generic plan of that scans.
    let (peer_rows, service_rows, rule_rows, heads) = match names {
        None => (
            "SELECT rule_id, selector, address_group_id, cidr::text FROM rule_peers ORDER BY rule_id, ordinal",
            "SELECT rule_id, service_id FROM rule_services ORDER BY rule_id, service_id",
            "SELECT id, ruleset_id, name, enabled FROM rules ORDER BY ruleset_id, ordinal",
            "SELECT id, name, enabled, scope FROM rulesets ORDER BY name",
        ),
        Some(_) => (
            "SELECT p.rule_id, p.selector, p.address_group_id, p.cidr::text FROM rule_peers p
             JOIN rules r ON r.id = p.rule_id JOIN rulesets s ON s.id = r.ruleset_id
             WHERE s.name = ANY($1) ORDER BY p.rule_id, p.ordinal",
            "SELECT v.rule_id, v.service_id FROM rule_services v
             JOIN rules r ON r.id = v.rule_id JOIN rulesets s ON s.id = r.ruleset_id
             WHERE s.name = ANY($1) ORDER BY v.rule_id, v.service_id",
            "SELECT r.id, r.ruleset_id, r.name, r.enabled FROM rules r JOIN rulesets s ON s.id = r.ruleset_id
             WHERE s.name = ANY($1) ORDER BY r.ruleset_id, r.ordinal",
            "SELECT id, name, enabled, scope FROM rulesets WHERE name = ANY($1) ORDER BY name",
        ),
    };
    // The peers, most of the work, are parsed on another core while the rest is read.
    let peers = crate::policy::off_thread({
        let rows = filtered(peer_rows, names).fetch_all(&mut *conn).await?;
        move || peers_of(rows)
    });
    let mut services_of: BTreeMap<Uuid, Vec<Uuid>> = BTreeMap::new();
    for row in filtered(service_rows, names).fetch_all(&mut *conn).await? {
        services_of.entry(row.get(0)).or_default().push(row.get(1));
    }
    let rule_rows = filtered(rule_rows, names).fetch_all(&mut *conn).await?;
    let head_rows = filtered(heads, names).fetch_all(&mut *conn).await?;
    let mut peers = peers.await?;
    let mut rules_of: BTreeMap<Uuid, Vec<Rule>> = BTreeMap::new();
    for row in rule_rows {
        let id: Uuid = row.get(0);
        rules_of.entry(row.get(1)).or_default().push(Rule {
            id,
            name: row.get(2),
            enabled: row.get(3),
            peers: peers.remove(&id).unwrap_or_default(),
            services: services_of.remove(&id).unwrap_or_default(),
        });
    }
    let mut rulesets = Vec::new();
    for row in head_rows {
        let id: Uuid = row.get(0);
        rulesets.push(Ruleset {
            id,
            name: row.get(1),
            enabled: row.get(2),
            scope: selector_from_json(row.get(3))?,
            rules: rules_of.remove(&id).unwrap_or_default(),
        });
    }
    Ok(rulesets)
}

/// Each rule's peers of `rows` (`rule_id, selector, address_group_id, cidr`), in row order.
fn peers_of(rows: Vec<PgRow>) -> Result<BTreeMap<Uuid, Vec<Peer>>, Error> {
    let mut peers: BTreeMap<Uuid, Vec<Peer>> = BTreeMap::new();
    for row in rows {
        let selector: Option<serde_json::Value> = row.get(1);
        let group: Option<Uuid> = row.get(2);
        let cidr: Option<String> = row.get(3);
        let peer = match (selector, group, cidr) {
            (Some(s), None, None) => Peer::Workloads(selector_from_json(s)?),
            (None, Some(g), None) => Peer::AddressGroup(g),
            (None, None, Some(c)) => Peer::Cidr(Cidr::parse_lenient(&c)?),
            _ => {
                return Err(Error::Corrupt { what: "rule peer", detail: "not exactly one kind".into() });
            }
        };
        peers.entry(row.get(0)).or_default().push(peer);
    }
    Ok(peers)
}

/// The address groups of these names (`None`: every group) with their CIDRs, by id.
pub async fn load_address_groups(
    conn: &mut PgConnection,
    names: Option<&[String]>,
) -> Result<BTreeMap<Uuid, AddressGroup>, Error> {
    // Two texts, not `$1 IS NULL OR …`: a prepared statement's generic plan of that scans.
    let (heads, cidrs) = match names {
        None => {
            ("SELECT id, name FROM address_groups", "SELECT group_id, cidr::text FROM address_group_cidrs")
        }
        Some(_) => (
            "SELECT id, name FROM address_groups WHERE name = ANY($1)",
            "SELECT group_id, cidr::text FROM address_group_cidrs WHERE group_id = ANY($1)",
        ),
    };
    let mut groups = BTreeMap::new();
    for row in filtered(heads, names).fetch_all(&mut *conn).await? {
        let id: Uuid = row.get(0);
        groups.insert(id, AddressGroup { id, name: row.get(1), cidrs: BTreeSet::new() });
    }
    let ids: Option<Vec<Uuid>> = names.map(|_| groups.keys().copied().collect());
    for row in filtered(cidrs, ids.as_deref()).fetch_all(&mut *conn).await? {
        let id: Uuid = row.get(0);
        let text: String = row.get(1);
        if let Some(group) = groups.get_mut(&id) {
            group.cidrs.insert(Cidr::parse_lenient(&text)?);
        }
    }
    Ok(groups)
}

/// A staged ruleset as stored (issue 31, FLOW-10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredStaged {
    pub spec: RulesetSpec,
    pub stage: i64,
    /// The ruleset's version when staged; `None`: new to the estate.
    pub base_version: Option<i64>,
    pub staged_by: String,
    pub staged_at: DateTime<Utc>,
}

/// Every staged ruleset, in name order.
pub async fn staged_rulesets(conn: &mut PgConnection) -> Result<Vec<StoredStaged>, Error> {
    type Row = (serde_json::Value, i64, Option<i64>, String, DateTime<Utc>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT spec, stage, base_version, staged_by, staged_at FROM staged_rulesets ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|(spec, stage, base_version, staged_by, staged_at)| {
            let spec = serde_json::from_value(spec)
                .map_err(|e| Error::Corrupt { what: "staged ruleset", detail: e.to_string() })?;
            Ok(StoredStaged { spec, stage, base_version, staged_by, staged_at })
        })
        .collect()
}

/// Reads every stored management access set into `model` (`safety::management`).
async fn load_management(conn: &mut PgConnection, model: &mut AuthoredModel) -> Result<(), Error> {
    let rows = sqlx::query(
        "SELECT m.workload_id, m.cidrs::text[], m.services FROM management_access m
         LEFT JOIN workloads w ON w.id = m.workload_id
         WHERE m.workload_id IS NULL OR w.retired_at IS NULL ORDER BY m.workload_id NULLS FIRST",
    )
    .fetch_all(&mut *conn)
    .await?;
    for row in rows {
        let workload: Option<Uuid> = row.get(0);
        let set = management_set(&row.get::<Vec<String>, _>(1), &row.get::<Vec<String>, _>(2))
            .map_err(|e| Error::Corrupt { what: "management access", detail: e.to_string() })?;
        match workload {
            None => model.management = Some(set),
            Some(id) => {
                let id = WorkloadId::from_uuid(id).ok_or_else(|| Error::Corrupt {
                    what: "management access",
                    detail: format!("{id} is not a workload id"),
                })?;
                model.management_of.insert(id, set);
            }
        }
    }
    Ok(())
}

/// Reads every live workload's rollback pin into `model` (`safety::rollback`).
async fn load_pins(conn: &mut PgConnection, model: &mut AuthoredModel) -> Result<(), Error> {
    let pins: Vec<(Uuid, Vec<u8>, Vec<u8>)> = sqlx::query_as(
        "SELECT w.id, s.digest, s.parts FROM workloads w JOIN policy_sources s ON s.digest = w.pinned_source
         WHERE w.retired_at IS NULL ORDER BY w.id",
    )
    .fetch_all(&mut *conn)
    .await?;
    if pins.is_empty() {
        return Ok(());
    }
    let corrupt = |detail: String| Error::Corrupt { what: "policy source", detail };
    let wanted: Vec<&[u8]> = pins.iter().flat_map(|(_, _, parts)| parts.chunks(32)).collect();
    let stored: BTreeMap<Vec<u8>, String> =
        sqlx::query_as("SELECT digest, part::text FROM policy_source_parts WHERE digest = ANY($1)")
            .bind(&wanted)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect();
    for (id, digest, parts) in pins {
        let id = WorkloadId::from_uuid(id).ok_or_else(|| corrupt("not a workload id".into()))?;
        let parts = parts
            .chunks(32)
            .map(|d| {
                let text = stored
                    .get(d)
                    .ok_or_else(|| corrupt(format!("workload {id}'s pin names a missing part")))?;
                serde_json::from_str::<Part>(text).map_err(|e| corrupt(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pinned = Source::from_parts(parts).model().map_err(|e| corrupt(e.to_string()))?;
        model.pinned.insert(id, Pin { digest, model: pinned });
    }
    Ok(())
}

/// A stored management access set from its texts.
pub fn management_set(cidrs: &[String], services: &[String]) -> Result<Management, Error> {
    let cidrs = cidrs.iter().map(|c| Cidr::parse_lenient(c)).collect::<Result<Vec<_>, _>>()?;
    let services = services.iter().map(|s| ServiceEntry::parse(s)).collect::<Result<Vec<_>, _>>()?;
    Ok(Management::new(cidrs, services)?)
}

/// What a render reads about the registry: every live workload with its labels and every
/// address it reported (accepted or not), and what address trust needs to judge those.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    /// Live (not retired, not deny-listed) workloads in id order.
    pub workloads: Vec<RegisteredWorkload>,
    /// The ranges each workload's enrolling token narrowed it to; absent: not narrowed.
    pub narrowed: Narrowed,
    /// The estate's workload address ranges.
    pub estate: Vec<Cidr>,
    /// The standing each live workload's address has in the database (`None`: not judged yet).
    pub stored: Stored,
}

pub async fn load_registry(conn: &mut PgConnection) -> Result<Registry, Error> {
    let estate = sqlx::query_scalar::<_, String>("SELECT cidr::text FROM estate_ranges ORDER BY cidr")
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(stored_cidr)
        .collect::<Result<_, _>>()?;
    let (workloads, narrowed, stored) = load_workloads(conn, None).await?;
    Ok(Registry { workloads, narrowed, estate, stored })
}

/// The registry's part for these workloads (`None`: for every workload): the live ones in id
/// order, the ranges each is narrowed to (of every one asked for, live or not) and the stored
/// standings of the live ones' addresses.
pub async fn load_workloads(
    conn: &mut PgConnection,
    ids: Option<&[Uuid]>,
) -> Result<(Vec<RegisteredWorkload>, Narrowed, Stored), Error> {
    // The labels are parsed on another core while the rest is read.
    let labels = crate::policy::off_thread({
        let rows = label_rows(conn, ids).await?;
        move || labels_by_workload(rows)
    });
    let mut addresses: BTreeMap<Uuid, BTreeSet<IpAddr>> = BTreeMap::new();
    let mut standings = BTreeMap::new();
    let text = match ids {
        None => "SELECT workload_id, host(address), standing FROM workload_addresses",
        Some(_) => {
            "SELECT workload_id, host(address), standing FROM workload_addresses WHERE workload_id = ANY($1)"
        }
    };
    for row in filtered(text, ids).fetch_all(&mut *conn).await? {
        let text: String = row.get(1);
        let ip =
            text.parse().map_err(|_| Error::Corrupt { what: "workload address", detail: text.clone() })?;
        let standing = row.get::<Option<i16>, _>(2).map(stored_standing).transpose()?;
        standings.insert((workload_id(row.get(0))?, ip), standing);
        addresses.entry(row.get(0)).or_default().insert(ip);
    }
    let mut narrowed: Narrowed = BTreeMap::new();
    let text = match ids {
        None => "SELECT workload_id, cidr::text FROM workload_ranges",
        Some(_) => "SELECT workload_id, cidr::text FROM workload_ranges WHERE workload_id = ANY($1)",
    };
    for row in filtered(text, ids).fetch_all(&mut *conn).await? {
        narrowed.entry(workload_id(row.get(0))?).or_default().push(stored_cidr(row.get(1))?);
    }
    // A pending confirmation's deadline (`gate::promote`, FLOW-11) renders into the policy.
    let text = match ids {
        None => {
            "SELECT w.id, w.mode, (extract(epoch FROM p.confirm_deadline) * 1000)::bigint
             FROM workloads w
             LEFT JOIN promotion_confirmations c ON c.workload_id = w.id AND c.state = 'pending'
             LEFT JOIN promotions p ON p.id = c.promotion_id
             WHERE w.retired_at IS NULL AND w.denied_at IS NULL ORDER BY w.id"
        }
        Some(_) => {
            "SELECT w.id, w.mode, (extract(epoch FROM p.confirm_deadline) * 1000)::bigint
             FROM workloads w
             LEFT JOIN promotion_confirmations c ON c.workload_id = w.id AND c.state = 'pending'
             LEFT JOIN promotions p ON p.id = c.promotion_id
             WHERE w.retired_at IS NULL AND w.denied_at IS NULL AND w.id = ANY($1) ORDER BY w.id"
        }
    };
    let rows = filtered(text, ids).fetch_all(&mut *conn).await?;
    let mut labels = labels.await?;
    let workloads = rows
        .into_iter()
        .map(|row| {
            let uuid: Uuid = row.get(0);
            Ok(RegisteredWorkload {
                id: workload_id(uuid)?,
                mode: stored::<Mode>(row.get(1))?,
                revert_at: row.get(2),
                labels: labels.remove(&uuid).unwrap_or_default(),
                addresses: addresses.remove(&uuid).unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    // Claims of retired and deny-listed workloads are not judged: they are not rendered.
    standings.retain(|(w, _), _| workloads.binary_search_by_key(w, |l| l.id).is_ok());
    Ok((workloads, narrowed, standings))
}

/// The ranges each workload's enrolling token narrowed it to.
pub type Narrowed = BTreeMap<WorkloadId, Vec<Cidr>>;
/// The standing each workload address has in the database (`None`: not judged yet).
pub type Stored = BTreeMap<(WorkloadId, IpAddr), Option<Standing>>;

/// The labels of these workloads (`None`: of every workload) as stored, by workload.
pub async fn load_labels(
    conn: &mut PgConnection,
    ids: Option<&[Uuid]>,
) -> Result<BTreeMap<Uuid, BTreeMap<LabelKey, LabelValue>>, Error> {
    labels_by_workload(label_rows(conn, ids).await?)
}

async fn label_rows(conn: &mut PgConnection, ids: Option<&[Uuid]>) -> Result<Vec<PgRow>, Error> {
    let text = match ids {
        None => "SELECT workload_id, key, value FROM workload_labels",
        Some(_) => "SELECT workload_id, key, value FROM workload_labels WHERE workload_id = ANY($1)",
    };
    Ok(filtered(text, ids).fetch_all(&mut *conn).await?)
}

/// The labels of [`label_rows`], by workload.
fn labels_by_workload(rows: Vec<PgRow>) -> Result<BTreeMap<Uuid, BTreeMap<LabelKey, LabelValue>>, Error> {
    let mut labels: BTreeMap<Uuid, BTreeMap<LabelKey, LabelValue>> = BTreeMap::new();
    for row in rows {
        let key: String = row.get(1);
        let value: String = row.get(2);
        labels.entry(row.get(0)).or_default().insert(
            LabelKey::new(&key).map_err(ModelError::from)?,
            LabelValue::new(&value).map_err(ModelError::from)?,
        );
    }
    Ok(labels)
}

fn stored_cidr(text: String) -> Result<Cidr, Error> {
    Cidr::parse_lenient(&text).map_err(|_| Error::Corrupt { what: "address range", detail: text })
}

fn stored_standing(code: i16) -> Result<Standing, Error> {
    Standing::from_code(code).ok_or(Error::Corrupt { what: "address standing", detail: code.to_string() })
}

/// Writes the standings that changed in a render.
pub async fn save_standings(
    conn: &mut PgConnection,
    changes: &[(WorkloadId, IpAddr, Standing)],
) -> Result<(), Error> {
    if changes.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = changes.iter().map(|(w, _, _)| w.uuid()).collect();
    let addresses: Vec<String> = changes.iter().map(|(_, a, _)| a.to_string()).collect();
    let codes: Vec<i16> = changes.iter().map(|(_, _, s)| s.code()).collect();
    sqlx::query(
        "UPDATE workload_addresses AS a SET standing = t.s
         FROM unnest($1::uuid[], $2::text[], $3::smallint[]) AS t (w, addr, s)
         WHERE a.workload_id = t.w AND a.address = t.addr::inet",
    )
    .bind(&ids)
    .bind(&addresses)
    .bind(&codes)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

fn workload_id(uuid: Uuid) -> Result<WorkloadId, Error> {
    WorkloadId::from_uuid(uuid).ok_or(Error::Corrupt { what: "workload id", detail: "nil uuid".into() })
}

fn decode_policy(bytes: &[u8]) -> Result<WorkloadPolicy, Error> {
    WorkloadPolicy::from_canonical_bytes(bytes)
        .map_err(|e| Error::Corrupt { what: "rendered policy", detail: e.to_string() })
}

/// A policy's content as stored: its canonical bytes at version 0 (the version is the row's that
/// refers to it) and their SHA-256, the key it is stored under once, however many workloads and
/// versions share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Content {
    pub digest: Vec<u8>,
    pub bytes: Vec<u8>,
}

impl Content {
    pub fn of(policy: &WorkloadPolicy) -> Content {
        let bytes = if policy.version() == 0 {
            policy.canonical_bytes()
        } else {
            policy.clone().with_version(0).canonical_bytes()
        };
        Content { digest: ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref().to_vec(), bytes }
    }
}

/// Where a workload's latest persisted policy stands: its version and its content's digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Latest {
    pub version: u64,
    pub digest: Vec<u8>,
}

fn stored_version(version: i64) -> Result<u64, Error> {
    u64::try_from(version)
        .map_err(|_| Error::Corrupt { what: "rendered policy", detail: format!("version {version}") })
}

/// The latest version and content digest of every workload that has a persisted policy (a render
/// compares digests, and reads the content of only those that differ).
pub async fn load_latest(conn: &mut PgConnection) -> Result<BTreeMap<WorkloadId, Latest>, Error> {
    load_latest_of(conn, None).await
}

/// [`load_latest`] of the workloads `ids` only (`None`: all).
pub async fn load_latest_of(
    conn: &mut PgConnection,
    ids: Option<&BTreeSet<WorkloadId>>,
) -> Result<BTreeMap<WorkloadId, Latest>, Error> {
    let ids: Option<Vec<Uuid>> = ids.map(|ids| ids.iter().map(WorkloadId::uuid).collect());
    // Two texts, not `$1 IS NULL OR …`: a prepared statement's generic plan of that scans.
    let text = match ids {
        None => "SELECT workload_id, version, digest FROM workload_policies",
        Some(_) => "SELECT workload_id, version, digest FROM workload_policies WHERE workload_id = ANY($1)",
    };
    let rows = filtered(text, ids.as_deref()).fetch_all(&mut *conn).await?;
    rows.into_iter()
        .map(|row| {
            Ok((
                workload_id(row.get(0))?,
                Latest { version: stored_version(row.get(1))?, digest: row.get(2) },
            ))
        })
        .collect()
}

/// The stored contents with these digests, by digest.
pub async fn load_contents(
    conn: &mut PgConnection,
    digests: &[Vec<u8>],
) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, Error> {
    contents_where(conn, "SELECT digest, policy FROM policy_contents WHERE digest = ANY($1)", digests).await
}

/// The rows of `query` (columns digest, policy; `$1` the digests), by digest.
async fn contents_where(
    conn: &mut PgConnection,
    query: &'static str,
    digests: &[Vec<u8>],
) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, Error> {
    let rows = sqlx::query(query).bind(digests).fetch_all(&mut *conn).await?;
    Ok(rows.into_iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// The stored contents among these digests that hold a version inside them, by digest: rows
/// stored before contents were shared (migration 0017) kept the policy's version in their bytes.
/// Every other content's bytes are one-to-one with the policies it stands for, so a content of
/// another digest is another policy without reading it; only these must be decoded to compare.
pub async fn load_versioned_contents(
    conn: &mut PgConnection,
    digests: &[Vec<u8>],
) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, Error> {
    // The condition is the predicate of the index of versioned contents (migration 0046), so
    // the planner reads that index, which holds only them; the byte is `VERSION_TAG`.
    let versioned = contents_where(
        conn,
        "SELECT digest, policy FROM policy_contents
         WHERE digest = ANY($1) AND substring(policy FROM 1 FOR 1) = '\\x08'::bytea",
        digests,
    )
    .await?;
    debug_assert!(versioned.values().all(|b| WorkloadPolicy::canonical_bytes_hold_a_version(b)));
    Ok(versioned)
}

/// One workload's persisted policy, undecoded: its version and its content's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persisted {
    pub version: u64,
    /// The content [`Content::bytes`]; rows from before contents were shared carry the version
    /// inside them too (the same one).
    pub bytes: Vec<u8>,
}

impl Persisted {
    pub fn decode(&self) -> Result<WorkloadPolicy, Error> {
        Ok(decode_policy(&self.bytes)?.with_version(self.version))
    }
}

/// A policy row joined to its content (columns `version`, `policy`, `rendered_at`), undecoded.
fn persisted_row(row: &PgRow) -> Result<(Persisted, DateTime<Utc>), Error> {
    let persisted = Persisted { version: stored_version(row.get("version"))?, bytes: row.get("policy") };
    Ok((persisted, row.get("rendered_at")))
}

/// [`persisted_row`], decoded.
fn decode_row(row: &PgRow) -> Result<(WorkloadPolicy, DateTime<Utc>), Error> {
    let (persisted, rendered_at) = persisted_row(row)?;
    Ok((persisted.decode()?, rendered_at))
}

/// Where a workload's latest persisted policy stands, with the time it was rendered: what a
/// stream catching up reads first (`sync::reads`), before the contents it does not hold yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persisting {
    pub version: u64,
    pub digest: Vec<u8>,
    pub rendered_at: DateTime<Utc>,
}

/// [`Persisting`] of `ids` (those that have a persisted policy): one query for many streams
/// catching up at once.
pub async fn persisting_of(
    conn: &mut PgConnection,
    ids: &[Uuid],
) -> Result<BTreeMap<WorkloadId, Persisting>, Error> {
    let rows = sqlx::query(
        "SELECT workload_id, version, digest, rendered_at FROM workload_policies WHERE workload_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|row| {
            let persisting = Persisting {
                version: stored_version(row.get("version"))?,
                digest: row.get("digest"),
                rendered_at: row.get("rendered_at"),
            };
            Ok((workload_id(row.get("workload_id"))?, persisting))
        })
        .collect()
}

/// A workload's persisted policy with the time it was rendered.
pub async fn persisted_policy(
    conn: &mut PgConnection,
    id: WorkloadId,
) -> Result<Option<(WorkloadPolicy, DateTime<Utc>)>, Error> {
    sqlx::query(
        "SELECT p.version, c.policy, p.rendered_at
         FROM workload_policies p JOIN policy_contents c ON c.digest = p.digest WHERE p.workload_id = $1",
    )
    .bind(id.uuid())
    .fetch_optional(&mut *conn)
    .await?
    .map(|row| decode_row(&row))
    .transpose()
}

/// Every persisted version of a workload's policy, oldest first.
pub async fn policy_history(conn: &mut PgConnection, id: WorkloadId) -> Result<Vec<WorkloadPolicy>, Error> {
    let rows = sqlx::query(
        "SELECT h.version, c.policy, h.rendered_at
         FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE h.workload_id = $1 ORDER BY h.version",
    )
    .bind(id.uuid())
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(|row| Ok(decode_row(row)?.0)).collect()
}

/// The persisted policies of these (workload, version) pairs, those that exist (a replay reads a
/// workload's applied version, or two versions it names).
pub async fn policies_at(
    conn: &mut PgConnection,
    wanted: &[(WorkloadId, u64)],
) -> Result<BTreeMap<(WorkloadId, u64), WorkloadPolicy>, Error> {
    let ids: Vec<Uuid> = wanted.iter().map(|(id, _)| id.uuid()).collect();
    let versions: Vec<i64> = wanted.iter().map(|(_, v)| i64::try_from(*v).unwrap_or(i64::MAX)).collect();
    let rows = sqlx::query(
        "SELECT h.workload_id, h.version, c.policy, h.rendered_at
         FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE (h.workload_id, h.version) IN (SELECT * FROM unnest($1::uuid[], $2::bigint[]))",
    )
    .bind(&ids)
    .bind(&versions)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|row| {
            let (policy, _) = decode_row(row)?;
            Ok(((workload_id(row.get("workload_id"))?, policy.version()), policy))
        })
        .collect()
}

// ---- read views for the CLI and API ------------------------------------------------------

#[derive(Debug, Clone, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ServiceView {
    pub name: String,
    pub description: String,
    pub version: i64,
    pub entries: Vec<String>,
}

/// Name, description and version of every row of a named-object table, with its members.
async fn list_named(
    conn: &mut PgConnection,
    table: &'static str,
    members: impl Fn(&AuthoredModel, &Uuid) -> Option<Vec<String>>,
) -> Result<Vec<(String, String, i64, Vec<String>)>, Error> {
    let model = load_model(conn).await?;
    let sql = format!("SELECT id, name, description, version FROM {table} ORDER BY name");
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_all(&mut *conn).await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let id: Uuid = row.get(0);
            (row.get(1), row.get(2), row.get(3), members(&model, &id).unwrap_or_default())
        })
        .collect())
}

pub async fn list_services(conn: &mut PgConnection) -> Result<Vec<ServiceView>, Error> {
    let rows = list_named(conn, "services", |m, id| {
        m.services.get(id).map(|s| s.entries.iter().map(ToString::to_string).collect())
    })
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, description, version, entries)| ServiceView { name, description, version, entries })
        .collect())
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AddressGroupView {
    pub name: String,
    pub description: String,
    pub version: i64,
    pub cidrs: Vec<String>,
}

pub async fn list_address_groups(conn: &mut PgConnection) -> Result<Vec<AddressGroupView>, Error> {
    let rows = list_named(conn, "address_groups", |m, id| {
        m.address_groups.get(id).map(|g| g.cidrs.iter().map(ToString::to_string).collect())
    })
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, description, version, cidrs)| AddressGroupView { name, description, version, cidrs })
        .collect())
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RulesetView {
    pub version: i64,
    #[serde(flatten)]
    pub spec: RulesetSpec,
}

/// Every ruleset in the shape an operator writes it, so `show` output can be edited and applied.
pub async fn list_rulesets(conn: &mut PgConnection) -> Result<Vec<RulesetView>, Error> {
    ruleset_views(conn, None).await
}

/// The rulesets with ids in `only` (all without it), by name, as [`list_rulesets`] shows them.
async fn ruleset_views(
    conn: &mut PgConnection,
    only: Option<&BTreeSet<Uuid>>,
) -> Result<Vec<RulesetView>, Error> {
    use crate::policy::spec::{PeerSpec, RuleSpec, RulesetSpec};
    let mut model = load_model(conn).await?;
    if let Some(only) = only {
        model.rulesets.retain(|rs| only.contains(&rs.id));
    }
    let mut meta: BTreeMap<Uuid, (String, i64)> = BTreeMap::new();
    for row in sqlx::query("SELECT id, description, version FROM rulesets").fetch_all(&mut *conn).await? {
        meta.insert(row.get(0), (row.get(1), row.get(2)));
    }
    let mut descriptions: BTreeMap<Uuid, String> = BTreeMap::new();
    for row in sqlx::query("SELECT id, description FROM rules").fetch_all(&mut *conn).await? {
        descriptions.insert(row.get(0), row.get(1));
    }
    let selector_map = |s: &Selector| -> BTreeMap<String, Vec<String>> {
        s.matches()
            .iter()
            .map(|(k, vs)| (k.to_string(), vs.iter().map(ToString::to_string).collect()))
            .collect()
    };
    Ok(model
        .rulesets
        .iter()
        .map(|rs| {
            let rules = rs
                .rules
                .iter()
                .map(|r| RuleSpec {
                    name: r.name.clone(),
                    description: descriptions.get(&r.id).cloned().unwrap_or_default(),
                    enabled: r.enabled,
                    peers: r
                        .peers
                        .iter()
                        .map(|p| match p {
                            Peer::Workloads(s) => PeerSpec::workloads(selector_map(s)),
                            Peer::AddressGroup(id) => PeerSpec::address_group(
                                model.address_groups.get(id).map_or("", |g| g.name.as_str()),
                            ),
                            Peer::Cidr(c) => PeerSpec::cidr(&c.to_string()),
                        })
                        .collect(),
                    // A rule's services are a set: shown by name, the same on every database
                    // (the model holds them in id order, which differs between databases).
                    services: r
                        .services
                        .iter()
                        .filter_map(|id| model.services.get(id).map(|s| s.name.clone()))
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect(),
                })
                .collect();
            let (description, version) = meta.get(&rs.id).cloned().unwrap_or_default();
            RulesetView {
                version,
                spec: RulesetSpec {
                    name: rs.name.clone(),
                    description,
                    enabled: rs.enabled,
                    scope: selector_map(&rs.scope),
                    rules,
                },
            }
        })
        .collect())
}

// ---- pages of the authored model and the estate ranges (OPS-2) -----------------------------
// Keyset pages by each table's unique key (a name, a range), so walking the cursors yields
// every row once; the show of one object reads that row alone.

/// Which named objects a read wants: a page after the cursor's name, or the one named.
enum Named<'a> {
    Page(&'a crate::page::PageRequest),
    One(&'a str),
}

/// (id, name, description, version) of the rows `which` wants from a named-object table, in
/// name order (a page: up to its limit and one more, to tell whether more follow).
async fn named_rows(
    conn: &mut PgConnection,
    table: &'static str,
    kind: &str,
    which: &Named<'_>,
) -> Result<(Vec<(Uuid, String, String, i64)>, i64), Error> {
    let (after, only, limit) = match which {
        Named::Page(request) => {
            let limit = request.checked_limit()?;
            let after = request
                .after(&crate::page::cursor_key(&mut *conn).await?, kind)?
                .map(|a| crate::page::field::<String>(&a, 0, kind))
                .transpose()?;
            (after, None, limit)
        }
        Named::One(name) => (None, Some((*name).to_owned()), 1),
    };
    let sql = format!(
        "SELECT id, name, description, version FROM {table}
         WHERE ($1::text IS NULL OR name > $1) AND ($2::text IS NULL OR name = $2)
         ORDER BY name LIMIT $3"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(after)
        .bind(only)
        .bind(limit + 1)
        .fetch_all(&mut *conn)
        .await?;
    Ok((rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect(), limit))
}

const SERVICES: &str = "service list";
const ADDRESS_GROUPS: &str = "address group list";
const RULESETS: &str = "ruleset list";
const ESTATE_RANGES: &str = "estate range list";

async fn services_of(conn: &mut PgConnection, which: &Named<'_>) -> Result<(Vec<ServiceView>, i64), Error> {
    let (rows, limit) = named_rows(conn, "services", SERVICES, which).await?;
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let mut entry_rows: BTreeMap<Uuid, Vec<(Protocol, Option<PortRange>)>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT service_id, protocol, port_start, port_end FROM service_entries
         WHERE service_id = ANY($1) ORDER BY service_id, ordinal",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?
    {
        entry_rows.entry(row.get(0)).or_default().push(service_entry(row.get(1), row.get(2), row.get(3))?);
    }
    let views = rows
        .into_iter()
        .map(|(id, name, description, version)| {
            let entries = entries_from_rows(entry_rows.remove(&id).unwrap_or_default())?;
            Ok(ServiceView {
                name,
                description,
                version,
                entries: entries.iter().map(ToString::to_string).collect(),
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok((views, limit))
}

/// A page of the services, by name.
pub async fn service_page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<ServiceView>, Error> {
    let (views, limit) = services_of(conn, &Named::Page(request)).await?;
    let cursor_key = crate::page::cursor_key(&mut *conn).await?;
    Ok(crate::page::page(&cursor_key, views, limit, SERVICES, |v| serde_json::json!([v.name])))
}

/// The service named `name`.
pub async fn service_view(conn: &mut PgConnection, name: &str) -> Result<ServiceView, Error> {
    let (views, _) = services_of(conn, &Named::One(name)).await?;
    views.into_iter().next().ok_or_else(|| Error::NotFound { what: "service", name: name.to_owned() })
}

async fn address_groups_of(
    conn: &mut PgConnection,
    which: &Named<'_>,
) -> Result<(Vec<AddressGroupView>, i64, bool), Error> {
    let (mut rows, limit) = named_rows(conn, "address_groups", ADDRESS_GROUPS, which).await?;
    let mut more = false;
    if matches!(which, Named::Page(_)) {
        // A page stops at its byte budget before its members are read: each group's weight as
        // JSON is measured in SQL, from above (every byte of text as if escaped, a quote pair
        // and a comma per address), and only the groups that fit are read.
        let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
        let weights: BTreeMap<Uuid, i64> = sqlx::query_as(
            "SELECT g.id, 128 + 6 * (octet_length(g.name) + octet_length(g.description))
                    + coalesce((SELECT sum(octet_length(c.cidr::text) + 3) FROM address_group_cidrs c
                                WHERE c.group_id = g.id), 0)::bigint
             FROM address_groups g WHERE g.id = ANY($1)",
        )
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
        let budget = i64::try_from(crate::page::PAGE_BYTES).unwrap_or(i64::MAX);
        let mut total = 0i64;
        let fit = rows
            .iter()
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .position(|r| {
                total += weights.get(&r.0).copied().unwrap_or(0);
                total > budget
            })
            .map_or(rows.len(), |over| over.max(1));
        more = rows.len() > fit;
        rows.truncate(fit);
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let mut cidrs: BTreeMap<Uuid, BTreeSet<Cidr>> = BTreeMap::new();
    for row in sqlx::query("SELECT group_id, cidr::text FROM address_group_cidrs WHERE group_id = ANY($1)")
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await?
    {
        let text: String = row.get(1);
        cidrs.entry(row.get(0)).or_default().insert(Cidr::parse_lenient(&text)?);
    }
    let views = rows
        .into_iter()
        .map(|(id, name, description, version)| AddressGroupView {
            name,
            description,
            version,
            cidrs: cidrs.remove(&id).unwrap_or_default().iter().map(ToString::to_string).collect(),
        })
        .collect();
    Ok((views, limit, more))
}

/// A page of the address groups, by name; the members of groups past the page's byte budget
/// are never read.
pub async fn address_group_page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<AddressGroupView>, Error> {
    let (views, limit, more) = address_groups_of(conn, &Named::Page(request)).await?;
    let cursor_key = crate::page::cursor_key(&mut *conn).await?;
    Ok(crate::page::page_more(&cursor_key, views, limit, more, ADDRESS_GROUPS, |v| {
        serde_json::json!([v.name])
    }))
}

/// The address group named `name`.
pub async fn address_group_view(conn: &mut PgConnection, name: &str) -> Result<AddressGroupView, Error> {
    let (views, _, _) = address_groups_of(conn, &Named::One(name)).await?;
    views.into_iter().next().ok_or_else(|| Error::NotFound { what: "address group", name: name.to_owned() })
}

/// The rulesets `which` wants. A ruleset names services and address groups, so the model is
/// read whole (it is what every render reads, and bounded by the authored-object limits).
async fn rulesets_of(conn: &mut PgConnection, which: &Named<'_>) -> Result<(Vec<RulesetView>, i64), Error> {
    let (rows, limit) = named_rows(conn, "rulesets", RULESETS, which).await?;
    let ids: BTreeSet<Uuid> = rows.iter().map(|r| r.0).collect();
    Ok((ruleset_views(conn, Some(&ids)).await?, limit))
}

/// A page of the rulesets, by name.
pub async fn ruleset_page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<RulesetView>, Error> {
    let (views, limit) = rulesets_of(conn, &Named::Page(request)).await?;
    let cursor_key = crate::page::cursor_key(&mut *conn).await?;
    Ok(crate::page::page(&cursor_key, views, limit, RULESETS, |v| serde_json::json!([v.spec.name])))
}

/// The ruleset named `name`.
pub async fn ruleset_view(conn: &mut PgConnection, name: &str) -> Result<RulesetView, Error> {
    let (views, _) = rulesets_of(conn, &Named::One(name)).await?;
    views.into_iter().next().ok_or_else(|| Error::NotFound { what: "ruleset", name: name.to_owned() })
}

/// A page of the estate ranges, smallest address first.
pub async fn estate_range_page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<EstateRangeView>, Error> {
    let limit = request.checked_limit()?;
    let cursor_key = crate::page::cursor_key(&mut *conn).await?;
    let after = request
        .after(&cursor_key, ESTATE_RANGES)?
        .map(|a| crate::page::field::<String>(&a, 0, ESTATE_RANGES))
        .transpose()?;
    let after = after
        .map(|text| {
            Cidr::parse(&text).map(|c| c.to_string()).map_err(|_| {
                Error::Invalid(format!("an {ESTATE_RANGES} cursor names {text:?}, not a range; run the query again without a cursor"))
            })
        })
        .transpose()?;
    let views: Vec<EstateRangeView> = sqlx::query_as(
        "SELECT cidr::text AS cidr, description, created_at FROM estate_ranges
         WHERE $1::cidr IS NULL OR cidr > $1::cidr ORDER BY cidr LIMIT $2",
    )
    .bind(after)
    .bind(limit + 1)
    .fetch_all(&mut *conn)
    .await?;
    Ok(crate::page::page(&cursor_key, views, limit, ESTATE_RANGES, |v| serde_json::json!([v.cidr])))
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkloadView {
    pub id: String,
    pub hostname: String,
    pub mode: String,
    pub labels: BTreeMap<String, String>,
    pub label_version: i64,
    /// Every address the workload reported, with its standing.
    pub addresses: Vec<AddressView>,
    /// The ranges its enrolling token narrowed it to (empty: the estate ranges alone).
    pub address_ranges: Vec<String>,
    pub policy_version: Option<i64>,
    /// Pinned by a rollback to the authored source of this version (`workload unpin` ends it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_to_source_of: Option<i64>,
    /// The demotion record of the auto-demotion guard that moved it back to simulation, while
    /// no promotion since replaced that guard (`promotions show` has the flows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_demoted_by: Option<Uuid>,
    /// A promotion to enforcement awaiting confirmation (FLOW-11): its id and deadline, past
    /// which the host enforces its simulation (`promotions confirm` before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaiting_confirmation: Option<(Uuid, DateTime<Utc>)>,
    pub retired: bool,
    /// `PENDING`, `SYNCED`, `DEGRADED`, `OFFLINE` or `SUSPENDED`, judged when read: a workload
    /// silent longer than its stream tolerates is OFFLINE whatever was stored.
    #[serde(default)]
    pub sync_state: String,
    /// Why it is in that state.
    #[serde(default)]
    pub sync_detail: String,
    /// Lifecycle and credential (`workload show`): who enrolled it, its certificate, renewal
    /// failures, a clone episode. Only a single workload's view carries them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<WorkloadFacts>,
}

/// One reported address and whether it is rendered into peer sets (address trust).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AddressView {
    pub address: String,
    /// `accepted`, `outside-estate-ranges`, `outside-token-ranges`, `conflict`; `pending` until
    /// the next render judges it; `retired` for a retired or deny-listed workload.
    pub standing: String,
    /// Why it is not rendered; absent when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// For a conflict: the other live workloads that claim it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also_claimed_by: Vec<String>,
}

impl AddressView {
    pub fn accepted(&self) -> bool {
        self.standing == Standing::Accepted.name()
    }

    /// `address`, or `address (standing[, with id…])` when it is not rendered.
    pub fn brief(&self) -> String {
        if self.accepted() {
            return self.address.clone();
        }
        let with: Vec<&str> = self.also_claimed_by.iter().map(|id| id.get(..8).unwrap_or(id)).collect();
        match with.is_empty() {
            true => format!("{} ({})", self.address, self.standing),
            false => format!("{} ({} with {})", self.address, self.standing, with.join(", ")),
        }
    }
}

/// Every reported address of the workloads `only` names (or of all), with its standing, by
/// workload.
pub async fn address_views(
    conn: &mut PgConnection,
    only: Option<&[Uuid]>,
) -> Result<BTreeMap<Uuid, Vec<AddressView>>, Error> {
    let rows = sqlx::query(
        "SELECT a.workload_id, host(a.address), a.standing, w.retired_at IS NOT NULL OR w.denied_at IS NOT NULL,
                array_remove(array_agg(b.workload_id::text ORDER BY b.workload_id), NULL)
         FROM workload_addresses a
         JOIN workloads w ON w.id = a.workload_id
         LEFT JOIN workload_addresses b
                ON b.address = a.address AND b.workload_id <> a.workload_id AND a.standing = $2 AND b.standing = $2
         WHERE $1::uuid[] IS NULL OR a.workload_id = ANY($1)
         GROUP BY a.workload_id, a.address, a.standing, w.retired_at, w.denied_at
         ORDER BY a.workload_id, a.address",
    )
    .bind(only)
    .bind(Standing::Conflict.code())
    .fetch_all(&mut *conn)
    .await?;
    let mut out: BTreeMap<Uuid, Vec<AddressView>> = BTreeMap::new();
    for row in rows {
        let standing = row.get::<Option<i16>, _>(2).map(stored_standing).transpose()?;
        let (standing, reason) = match (row.get::<bool, _>(3), standing) {
            (true, _) => ("retired", Some("the workload is retired or deny-listed")),
            (false, None) => ("pending", Some("not judged yet; the next render judges it")),
            (false, Some(Standing::Accepted)) => (Standing::Accepted.name(), None),
            (false, Some(s)) => (s.name(), Some(s.reason())),
        };
        out.entry(row.get(0)).or_default().push(AddressView {
            address: row.get(1),
            standing: standing.to_owned(),
            reason: reason.map(str::to_owned),
            also_claimed_by: row.get(4),
        });
    }
    Ok(out)
}

/// One estate range (address trust): addresses in it may be rendered as workload peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct EstateRangeView {
    pub cidr: String,
    pub description: String,
    pub created_at: DateTime<Utc>,
}

pub async fn list_estate_ranges(conn: &mut PgConnection) -> Result<Vec<EstateRangeView>, Error> {
    Ok(sqlx::query_as("SELECT cidr::text AS cidr, description, created_at FROM estate_ranges ORDER BY cidr")
        .fetch_all(&mut *conn)
        .await?)
}

pub async fn list_workloads(
    conn: &mut PgConnection,
    only: Option<WorkloadId>,
) -> Result<Vec<WorkloadView>, Error> {
    let mut labels: BTreeMap<Uuid, BTreeMap<String, String>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT workload_id, key, value FROM workload_labels WHERE $1::uuid IS NULL OR workload_id = $1",
    )
    .bind(only.map(|id| id.uuid()))
    .fetch_all(&mut *conn)
    .await?
    {
        labels.entry(row.get(0)).or_default().insert(row.get(1), row.get(2));
    }
    let only_ids = only.map(|id| [id.uuid()]);
    let mut addresses = address_views(conn, only_ids.as_ref().map(|ids| &ids[..])).await?;
    let mut ranges: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for row in sqlx::query("SELECT workload_id, cidr::text FROM workload_ranges ORDER BY workload_id, cidr")
        .fetch_all(&mut *conn)
        .await?
    {
        ranges.entry(row.get(0)).or_default().push(row.get(1));
    }
    let sql = format!(
        "SELECT w.id, w.hostname, w.mode, w.label_version, p.version, w.retired_at IS NOT NULL, {}, {},
                w.pinned_version,
                (SELECT g.demotion_id FROM enforcement_guards g WHERE g.workload_id = w.id AND g.tripped_at IS NOT NULL),
                c.promotion_id, pr.confirm_deadline
         FROM {}
         LEFT JOIN promotion_confirmations c ON c.workload_id = w.id AND c.state = 'pending'
         LEFT JOIN promotions pr ON pr.id = c.promotion_id
         WHERE $1::uuid IS NULL OR w.id = $1 ORDER BY w.hostname, w.id",
        crate::shown::STATE,
        crate::shown::DETAIL,
        crate::shown::ROWS
    );
    let rows =
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(only.map(|id| id.uuid())).fetch_all(&mut *conn).await?;
    rows.into_iter()
        .map(|row| {
            let id: Uuid = row.get(0);
            Ok(WorkloadView {
                id: id.to_string(),
                hostname: row.get(1),
                mode: stored::<Mode>(row.get(2))?.to_string(),
                labels: labels.remove(&id).unwrap_or_default(),
                label_version: row.get(3),
                addresses: addresses.remove(&id).unwrap_or_default(),
                address_ranges: ranges.remove(&id).unwrap_or_default(),
                policy_version: row.get(4),
                pinned_to_source_of: row.get(8),
                auto_demoted_by: row.get(9),
                awaiting_confirmation: row
                    .get::<Option<Uuid>, _>(10)
                    .zip(row.get::<Option<DateTime<Utc>>, _>(11)),
                retired: row.get(5),
                sync_state: stored::<innerwall_wire::sync::SyncState>(row.get(6))?.name().to_owned(),
                sync_detail: row.get(7),
                facts: None,
            })
        })
        .collect()
}

/// One workload, retired or not (`workload show`).
pub async fn workload_view(conn: &mut PgConnection, id: WorkloadId) -> Result<WorkloadView, Error> {
    let mut view = list_workloads(conn, Some(id))
        .await?
        .pop()
        .ok_or_else(|| Error::NotFound { what: "workload", name: id.to_string() })?;
    view.facts = workload_facts(conn, id).await?;
    Ok(view)
}

/// Convergence of one workload (SYNC-6): applied against latest, read in one query.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct SyncStatusView {
    pub id: Uuid,
    pub hostname: String,
    pub applied_version: i64,
    pub latest_version: Option<i64>,
    #[sqlx(try_from = "i16")]
    #[schema(value_type = String)]
    pub state: StateName,
    pub detail: String,
    pub last_seen_at: Option<DateTime<Utc>>,
    pub last_acked_at: Option<DateTime<Utc>>,
    pub last_snapshot_sent_at: Option<DateTime<Utc>>,
    pub last_apply_failed_at: Option<DateTime<Utc>>,
    /// Reported addresses that are not rendered, with the reason (address trust).
    #[sqlx(skip)]
    pub address_issues: Vec<AddressView>,
    /// The identity is presented by more than one host now (IDN-7; `identity::clones`).
    #[sqlx(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone: Option<lifecycle::CloneReport>,
    /// The last renewal failure, while no renewal succeeded since.
    #[sqlx(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal_failure: Option<lifecycle::RenewalFailure>,
}

/// A sync state as its name (`PENDING`, `SYNCED`, `DEGRADED`, `OFFLINE`, `SUSPENDED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub struct StateName(pub innerwall_wire::sync::SyncState);

impl TryFrom<String> for StateName {
    type Error = innerwall_wire::policy::PolicyError;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse().map(StateName)
    }
}

impl From<StateName> for &'static str {
    fn from(s: StateName) -> Self {
        s.0.name()
    }
}

impl TryFrom<i16> for StateName {
    type Error = String;
    fn try_from(n: i16) -> Result<Self, String> {
        innerwall_wire::sync::SyncState::from_code(n)
            .map(StateName)
            .map_err(|_| format!("unknown sync state {n}"))
    }
}

/// The columns of a [`SyncStatusView`], for the statements below to complete: the state and
/// detail as shown (`shown`), not as stored.
fn sync_status_sql() -> String {
    use crate::shown;
    format!(
        "SELECT w.id, w.hostname, w.applied_version, p.version AS latest_version, {} AS state,
                {} AS detail, w.last_seen_at, w.last_acked_at, w.last_snapshot_sent_at,
                w.last_apply_failed_at
         FROM {}
         WHERE w.retired_at IS NULL",
        shown::STATE,
        shown::DETAIL,
        shown::ROWS
    )
}

/// The convergence of every workload that is not retired (or of `only`), by hostname.
pub async fn sync_status(
    conn: &mut PgConnection,
    only: Option<WorkloadId>,
) -> Result<Vec<SyncStatusView>, Error> {
    let sql = format!("{} AND ($1::uuid IS NULL OR w.id = $1) ORDER BY w.hostname, w.id", sync_status_sql());
    let mut views: Vec<SyncStatusView> =
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(only.map(|id| id.uuid())).fetch_all(&mut *conn).await?;
    with_address_issues(conn, &mut views).await?;
    with_lifecycle(conn, &mut views).await?;
    Ok(views)
}

/// One workload's convergence; a retired (or unknown) workload has none.
pub async fn sync_status_of(conn: &mut PgConnection, id: WorkloadId) -> Result<SyncStatusView, Error> {
    sync_status(conn, Some(id))
        .await?
        .pop()
        .ok_or_else(|| Error::NotFound { what: "live workload", name: id.to_string() })
}

const SYNC_STATUS_KIND: &str = "sync status";

/// The convergence of the workloads that are not retired, by hostname, a page at a time.
pub async fn sync_status_page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<SyncStatusView>, Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let after = request.after_pair::<String, Uuid>(&cursor_key, SYNC_STATUS_KIND)?;
    let sql = format!(
        "{} AND ($1::text IS NULL OR (w.hostname, w.id) > ($1, $2::uuid))
         ORDER BY w.hostname, w.id LIMIT $3",
        sync_status_sql()
    );
    let mut views: Vec<SyncStatusView> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(after.as_ref().map(|a| &a.0))
        .bind(after.as_ref().map(|a| a.1))
        .bind(limit + 1)
        .fetch_all(&mut *conn)
        .await?;
    with_address_issues(conn, &mut views).await?;
    with_lifecycle(conn, &mut views).await?;
    Ok(page::page(&cursor_key, views, limit, SYNC_STATUS_KIND, |v| serde_json::json!([v.hostname, v.id])))
}

/// Fills in each view's addresses that are not rendered.
async fn with_address_issues(conn: &mut PgConnection, views: &mut [SyncStatusView]) -> Result<(), Error> {
    let ids: Vec<Uuid> = views.iter().map(|v| v.id).collect();
    let mut addresses = address_views(conn, Some(&ids)).await?;
    for view in views {
        view.address_issues =
            addresses.remove(&view.id).unwrap_or_default().into_iter().filter(|a| !a.accepted()).collect();
    }
    Ok(())
}

/// Fills in each status view's clone episode and renewal failure (`workload status`). Most
/// workloads have neither; the two reads are cheap per row and a status page is bounded.
async fn with_lifecycle(conn: &mut PgConnection, views: &mut [SyncStatusView]) -> Result<(), Error> {
    let ids: Vec<Uuid> = views.iter().map(|v| v.id).collect();
    let flagged: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM workloads WHERE id = ANY($1)
           AND (clone_seen_at >= now() - make_interval(secs => $2) OR last_renewal_failed_at IS NOT NULL)",
    )
    .bind(&ids)
    .bind(lifecycle::EPISODE.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?;
    for view in views.iter_mut().filter(|v| flagged.contains(&v.id)) {
        let Some(id) = WorkloadId::from_uuid(view.id) else { continue };
        view.clone = lifecycle::clone_report(conn, id).await?;
        view.renewal_failure = lifecycle::renewal_failure(conn, id).await?;
    }
    Ok(())
}

// ---- the fleet, a page at a time (the HTTP API) ------------------------------------------

/// The sync states in the order a fleet list shows them: what needs attention first.
const ATTENTION: [innerwall_wire::sync::SyncState; 5] = {
    use innerwall_wire::sync::SyncState::*;
    [Degraded, Offline, Suspended, Pending, Synced]
};

/// Which workloads [`workload_page`] lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkloadFilter {
    /// Workloads whose labels the selector selects now.
    pub selector: Option<Selector>,
    pub mode: Option<Mode>,
    pub sync_state: Option<innerwall_wire::sync::SyncState>,
    /// Also retired and deny-listed workloads (by default only live ones).
    pub include_retired: bool,
}

/// One workload in a fleet list: who it is, its labels, mode and addresses, and how far it has
/// converged (`workload list --json` prints these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkloadRow {
    pub id: String,
    pub hostname: String,
    pub mode: String,
    pub labels: BTreeMap<String, String>,
    pub label_version: i64,
    /// `PENDING`, `SYNCED`, `DEGRADED`, `OFFLINE` or `SUSPENDED`.
    pub sync_state: String,
    /// Why it is in that state (`shown::DETAIL`).
    #[serde(default)]
    pub sync_detail: String,
    pub applied_version: i64,
    /// The latest rendered version (absent: never rendered).
    pub latest_version: Option<i64>,
    pub last_seen_at: Option<DateTime<Utc>>,
    /// When its certificate expires (absent: never issued one).
    #[serde(default)]
    pub credential_expires_at: Option<DateTime<Utc>>,
    pub retired: bool,
    pub denied: bool,
    /// Every address it reported, with its standing.
    pub addresses: Vec<AddressView>,
}

const WORKLOADS: &str = "workloads";

/// A page of the fleet in attention order — degraded, offline, suspended, pending, synced; then
/// the most recently seen first; then by id — filtered by `filter`.
pub async fn workload_page(
    conn: &mut PgConnection,
    filter: &WorkloadFilter,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<WorkloadRow>, Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    let attention: Vec<i16> = ATTENTION.iter().map(|s| s.code()).collect();
    let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(
        "SELECT * FROM (SELECT w.id, w.hostname, w.mode, w.label_version, ",
    );
    // The state as shown (`shown`): the filter and the attention order see it too.
    q.push(crate::shown::STATE).push(" AS sync_state, ").push(crate::shown::DETAIL).push(
        " AS sync_detail, w.applied_version, w.credential_expires_at,
                p.version AS latest_version, w.last_seen_at, w.retired_at IS NOT NULL AS retired,
                w.denied_at IS NOT NULL AS denied,
                coalesce(array_position(",
    );
    q.push_bind(attention).push("::smallint[], ").push(crate::shown::STATE).push(
        "), 99) AS rank,
                coalesce((extract(epoch FROM w.last_seen_at) * 1000000)::bigint, -1) AS seen_us
         FROM ",
    );
    q.push(crate::shown::ROWS).push(") AS f WHERE true");
    if !filter.include_retired {
        q.push(" AND NOT retired AND NOT denied");
    }
    if let Some(mode) = filter.mode {
        q.push(" AND mode = ").push_bind(mode.code());
    }
    if let Some(state) = filter.sync_state {
        q.push(" AND sync_state = ").push_bind(state.code());
    }
    if let Some(selector) = &filter.selector {
        if selector.matches().is_empty() {
            q.push(" AND false");
        }
        for (key, values) in selector.matches() {
            let values: Vec<String> = values.iter().map(ToString::to_string).collect();
            q.push(" AND EXISTS (SELECT 1 FROM workload_labels l WHERE l.workload_id = f.id AND l.key = ")
                .push_bind(key.to_string())
                .push(" AND l.value = ANY(")
                .push_bind(values)
                .push("))");
        }
    }
    let cursor_key = page::cursor_key(&mut *conn).await?;
    if let Some(after) = request.after(&cursor_key, WORKLOADS)? {
        let rank = page::field::<i32>(&after, 0, WORKLOADS)?;
        let seen = page::field::<i64>(&after, 1, WORKLOADS)?;
        let id = page::field::<Uuid>(&after, 2, WORKLOADS)?;
        q.push(" AND (rank > ")
            .push_bind(rank)
            .push(" OR (rank = ")
            .push_bind(rank)
            .push(" AND (seen_us < ")
            .push_bind(seen)
            .push(" OR (seen_us = ")
            .push_bind(seen)
            .push(" AND id > ")
            .push_bind(id)
            .push("))))");
    }
    q.push(" ORDER BY rank, seen_us DESC, id LIMIT ").push_bind(limit + 1);
    let rows = q.build().fetch_all(&mut *conn).await?;
    let ids: Vec<Uuid> = rows.iter().map(|r| r.get::<Uuid, _>("id")).collect();
    let mut labels = labels_of(conn, &ids).await?;
    let mut addresses = address_views(conn, Some(&ids)).await?;
    let rows = rows
        .into_iter()
        .map(|row| {
            let id: Uuid = row.get("id");
            let key = (row.get::<i32, _>("rank"), row.get::<i64, _>("seen_us"), id);
            let state = stored::<innerwall_wire::sync::SyncState>(row.get("sync_state"))?;
            let view = WorkloadRow {
                id: id.to_string(),
                hostname: row.get("hostname"),
                mode: stored::<Mode>(row.get("mode"))?.to_string(),
                labels: labels.remove(&id).unwrap_or_default(),
                label_version: row.get("label_version"),
                sync_state: state.name().to_owned(),
                sync_detail: row.get("sync_detail"),
                applied_version: row.get("applied_version"),
                latest_version: row.get("latest_version"),
                last_seen_at: row.get("last_seen_at"),
                credential_expires_at: row.get("credential_expires_at"),
                retired: row.get("retired"),
                denied: row.get("denied"),
                addresses: addresses.remove(&id).unwrap_or_default(),
            };
            Ok((key, view))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let page =
        page::page(&cursor_key, rows, limit, WORKLOADS, |(key, _)| serde_json::json!([key.0, key.1, key.2]));
    Ok(page::Page {
        rows: page.rows.into_iter().map(|(_, view)| view).collect(),
        truncated: page.truncated,
        next_cursor: page.next_cursor,
    })
}

/// What the registry knows of a workload beyond its labels and convergence: its lifecycle and
/// credential.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct WorkloadFacts {
    pub enrolled_at: DateTime<Utc>,
    /// The provisioning token that enrolled it (absent once the token is deleted).
    pub enrolled_by_token: Option<Uuid>,
    pub agent_version: String,
    pub os: String,
    pub credential_serial: String,
    pub credential_expires_at: Option<DateTime<Utc>>,
    pub last_renewed_at: Option<DateTime<Utc>>,
    pub retired_at: Option<DateTime<Utc>>,
    pub denied_at: Option<DateTime<Utc>>,
    /// SHA-256 of the root that issued the current certificate (absent: before issue 25).
    pub credential_issuer: Option<String>,
    /// The last refused renewal, whether or not one succeeded since (compare `last_renewed_at`).
    pub last_renewal_failed_at: Option<DateTime<Utc>>,
    pub last_renewal_error: Option<String>,
    /// The clone episode in progress, if any (IDN-7).
    #[sqlx(skip)]
    pub clone: Option<lifecycle::CloneReport>,
}

pub async fn workload_facts(conn: &mut PgConnection, id: WorkloadId) -> Result<Option<WorkloadFacts>, Error> {
    let facts: Option<WorkloadFacts> = sqlx::query_as(
        "SELECT created_at AS enrolled_at, enrolled_by_token, agent_version, os, credential_serial,
                credential_expires_at, last_renewed_at, retired_at, denied_at, credential_issuer,
                last_renewal_failed_at, last_renewal_error
         FROM workloads WHERE id = $1",
    )
    .bind(id.uuid())
    .fetch_optional(&mut *conn)
    .await?;
    let Some(mut facts) = facts else { return Ok(None) };
    facts.clone = lifecycle::clone_report(conn, id).await?;
    Ok(Some(facts))
}

/// A rendered policy as operators read it (`workload policy --json`, the API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PolicyView {
    pub workload: String,
    pub version: u64,
    pub mode: String,
    pub rendered_at: DateTime<Utc>,
    pub rules: Vec<RuleView>,
}

/// One resolved rule of a rendered policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RuleView {
    /// `<authored rule id>/<protocol>`.
    pub rule_id: String,
    pub protocol: String,
    pub ports: Vec<String>,
    pub peers: Vec<String>,
}

impl PolicyView {
    pub fn of(id: WorkloadId, policy: &WorkloadPolicy, rendered_at: DateTime<Utc>) -> Self {
        PolicyView {
            workload: id.to_string(),
            version: policy.version(),
            mode: policy.mode().name().to_owned(),
            rendered_at,
            rules: policy
                .rules()
                .map(|r| RuleView {
                    rule_id: r.id().to_string(),
                    protocol: r.protocol().name().to_owned(),
                    ports: r.ports().iter().map(ToString::to_string).collect(),
                    peers: r.peers().iter().map(ToString::to_string).collect(),
                })
                .collect(),
        }
    }
}

/// A workload's latest rendered policy (`workload policy`).
pub async fn policy_view(conn: &mut PgConnection, id: WorkloadId) -> Result<PolicyView, Error> {
    let (policy, rendered_at) = persisted_policy(conn, id)
        .await?
        .ok_or_else(|| Error::NotFound { what: "rendered policy of workload", name: id.to_string() })?;
    Ok(PolicyView::of(id, &policy, rendered_at))
}

/// One persisted version of a workload's policy without its rules: what a history page lists
/// (a page of full policies could weigh tens of megabytes). `href` reads the version in full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PolicyVersionView {
    pub workload: String,
    pub version: u64,
    /// SHA-256 of the policy's content (without its version), lower-case hex: versions with the
    /// same digest enforce the same rules.
    pub digest: String,
    pub rendered_at: DateTime<Utc>,
    /// The size of the stored policy in bytes (uncompressed), as the database measures it.
    pub bytes: i64,
    /// The API path of this version in full.
    pub href: String,
}

/// The list a workload's history cursors belong to: one workload's, no other's.
fn history_kind(id: WorkloadId) -> String {
    format!("policy history of workload {id}")
}

/// A workload's persisted policy versions, newest first, a page at a time: summaries measured
/// in SQL (no policy is read or decoded), [`policy_version_view`] reads one in full.
pub async fn policy_history_page(
    conn: &mut PgConnection,
    id: WorkloadId,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<PolicyVersionView>, Error> {
    use crate::page;
    let kind = history_kind(id);
    let limit = request.checked_limit()?;
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let before = match request.after(&cursor_key, &kind)? {
        Some(after) => page::field::<i64>(&after, 0, &kind)?,
        None => i64::MAX,
    };
    let rows = sqlx::query(
        "SELECT h.version, encode(h.digest, 'hex') AS digest, h.rendered_at,
                octet_length(c.policy)::bigint AS bytes
         FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE h.workload_id = $1 AND h.version < $2 ORDER BY h.version DESC LIMIT $3",
    )
    .bind(id.uuid())
    .bind(before)
    .bind(limit + 1)
    .fetch_all(&mut *conn)
    .await?;
    let views = rows
        .iter()
        .map(|row| {
            let version = u64::try_from(row.get::<i64, _>("version")).map_err(|_| Error::Corrupt {
                what: "policy version",
                detail: format!("workload {id}: negative"),
            })?;
            Ok(PolicyVersionView {
                workload: id.to_string(),
                version,
                digest: row.get("digest"),
                rendered_at: row.get("rendered_at"),
                bytes: row.get("bytes"),
                href: format!("/api/v1/workloads/{id}/policy/history/{version}"),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(page::page(&cursor_key, views, limit, &kind, |v| serde_json::json!([v.version])))
}

/// One persisted version of a workload's policy in full (its size is the render's bound).
pub async fn policy_version_view(
    conn: &mut PgConnection,
    id: WorkloadId,
    version: u64,
) -> Result<PolicyView, Error> {
    let missing =
        || Error::NotFound { what: "policy version of workload", name: format!("{id} version {version}") };
    let Ok(version) = i64::try_from(version) else { return Err(missing()) };
    let row = sqlx::query(
        "SELECT h.version, c.policy, h.rendered_at
         FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE h.workload_id = $1 AND h.version = $2",
    )
    .bind(id.uuid())
    .bind(version)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(missing)?;
    let (policy, rendered_at) = decode_row(&row)?;
    Ok(PolicyView::of(id, &policy, rendered_at))
}

/// The hostnames of `ids` (retired ones too), by id; an unknown id is left out.
pub async fn hostnames(conn: &mut PgConnection, ids: &[Uuid]) -> Result<BTreeMap<Uuid, String>, Error> {
    let rows: Vec<(Uuid, String)> = sqlx::query_as("SELECT id, hostname FROM workloads WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().collect())
}

/// The labels now of `ids`, by id; a workload without labels is left out.
pub async fn labels_of(
    conn: &mut PgConnection,
    ids: &[Uuid],
) -> Result<BTreeMap<Uuid, BTreeMap<String, String>>, Error> {
    let mut labels: BTreeMap<Uuid, BTreeMap<String, String>> = BTreeMap::new();
    for row in sqlx::query("SELECT workload_id, key, value FROM workload_labels WHERE workload_id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?
    {
        labels.entry(row.get(0)).or_default().insert(row.get(1), row.get(2));
    }
    Ok(labels)
}

/// `ruleset/rule` of each authored rule id in `ids` (the prefix of a rendered rule id); an id
/// no rule has now (deleted since) is left out.
pub async fn rule_names(conn: &mut PgConnection, ids: &[Uuid]) -> Result<BTreeMap<Uuid, String>, Error> {
    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT r.id, s.name || '/' || r.name FROM rules r JOIN rulesets s ON s.id = r.ruleset_id WHERE r.id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// What each of the newest `count` versions of `id`'s policy changed from the one before it, newest
/// first: the version, when it was rendered, and the changes of the delta between them (a first
/// version is all upserts).
pub async fn version_changes(
    conn: &mut PgConnection,
    id: WorkloadId,
    count: usize,
) -> Result<Vec<(u64, DateTime<Utc>, Vec<innerwall_wire::policy::Change>)>, Error> {
    let rows = sqlx::query(
        "SELECT h.version, c.policy, h.rendered_at
         FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE h.workload_id = $1 ORDER BY h.version DESC LIMIT $2",
    )
    .bind(id.uuid())
    .bind(count as i64 + 1)
    .fetch_all(&mut *conn)
    .await?;
    let versions = rows.iter().map(decode_row).collect::<Result<Vec<_>, Error>>()?;
    let mut out = Vec::new();
    for (i, (policy, at)) in versions.iter().enumerate().take(count) {
        let changes = match versions.get(i + 1) {
            Some((before, _)) => innerwall_wire::policy::diff(before, policy).changes,
            None => {
                let nothing = WorkloadPolicy::new(0, policy.mode(), []).expect("an empty policy is valid");
                innerwall_wire::policy::diff(&nothing, policy).changes
            }
        };
        out.push((policy.version(), *at, changes));
    }
    Ok(out)
}
