//! Postgres access for the registry, the authored model and rendered policies. Reads build the
//! plain `model` types the renderer takes; writes validate first and leave rendering to
//! `authoring::commit`, so every mutation reaches `publish` before it is acknowledged.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, PolicyError, PortRange, Protocol, WorkloadPolicy};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::model::{
    AddressGroup, AuthoredModel, ModelError, Peer, RegisteredWorkload, Rule, Ruleset, Selector, Service,
    ServiceEntry,
};
use crate::render::RenderError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what} {name:?} not found")]
    NotFound { what: &'static str, name: String },
    #[error("{what} {name:?} already exists")]
    Exists { what: &'static str, name: String },
    #[error("{what} {name:?} is at version {current}, not {expected}: re-read it and retry")]
    Stale { what: &'static str, name: String, expected: i64, current: i64 },
    #[error("{what} {name:?} is in use by {}; change those first", referrers.join(", "))]
    InUse { what: &'static str, name: String, referrers: Vec<String> },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Token(#[from] crate::tokens::TokenError),
    #[error(transparent)]
    Ca(#[from] crate::ca::CaError),
    #[error("agent-offline: workload {id} has no stream (last seen {last_seen})")]
    AgentOffline { id: String, last_seen: String },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("render failed: {0}")]
    Render(#[from] RenderError),
    #[error("stored {what} is corrupt: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

impl From<PolicyError> for StoreError {
    fn from(e: PolicyError) -> Self {
        StoreError::Model(e.into())
    }
}

/// A stored enum number (the schema keeps protobuf numbers), refused as corrupt if unknown.
fn stored<E: WireEnum>(n: i16) -> Result<E, StoreError> {
    E::from_code(n).map_err(|_| StoreError::Corrupt { what: E::WHAT, detail: n.to_string() })
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

fn selector_from_json(value: serde_json::Value) -> Result<Selector, StoreError> {
    let matches: Vec<StoredMatch> = serde_json::from_value(value)
        .map_err(|e| StoreError::Corrupt { what: "selector", detail: e.to_string() })?;
    Ok(Selector::from_strings(matches.into_iter().map(|m| (m.key, m.values)))?)
}

fn service_entry(
    protocol: i16,
    start: Option<i32>,
    end: Option<i32>,
) -> Result<(Protocol, Option<PortRange>), StoreError> {
    let protocol = stored::<Protocol>(protocol)?;
    let range = match (start, end) {
        (Some(s), Some(e)) => Some(PortRange::new(s as u32, e as u32)?),
        _ => None,
    };
    Ok((protocol, range))
}

/// Groups (protocol, range) rows, in ordinal order, into entries: one per protocol run.
fn entries_from_rows(rows: Vec<(Protocol, Option<PortRange>)>) -> Result<Vec<ServiceEntry>, StoreError> {
    let mut by_protocol: BTreeMap<Protocol, Vec<PortRange>> = BTreeMap::new();
    for (protocol, range) in rows {
        by_protocol.entry(protocol).or_default().extend(range);
    }
    by_protocol.into_iter().map(|(p, ports)| Ok(ServiceEntry::new(p, ports)?)).collect()
}

/// The whole authored model, in deterministic order.
pub async fn load_model(conn: &mut PgConnection) -> Result<AuthoredModel, StoreError> {
    let mut model = AuthoredModel::default();

    let mut entry_rows: BTreeMap<Uuid, Vec<(Protocol, Option<PortRange>)>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT service_id, protocol, port_start, port_end FROM service_entries ORDER BY service_id, ordinal",
    )
    .fetch_all(&mut *conn)
    .await?
    {
        entry_rows.entry(row.get(0)).or_default().push(service_entry(row.get(1), row.get(2), row.get(3))?);
    }
    for row in sqlx::query("SELECT id, name FROM services").fetch_all(&mut *conn).await? {
        let id: Uuid = row.get(0);
        let entries = entries_from_rows(entry_rows.remove(&id).unwrap_or_default())?;
        model.services.insert(id, Service { id, name: row.get(1), entries });
    }

    for row in sqlx::query("SELECT id, name FROM address_groups").fetch_all(&mut *conn).await? {
        let id: Uuid = row.get(0);
        model.address_groups.insert(id, AddressGroup { id, name: row.get(1), cidrs: BTreeSet::new() });
    }
    for row in
        sqlx::query("SELECT group_id, cidr::text FROM address_group_cidrs").fetch_all(&mut *conn).await?
    {
        let id: Uuid = row.get(0);
        let text: String = row.get(1);
        if let Some(group) = model.address_groups.get_mut(&id) {
            group.cidrs.insert(Cidr::parse_lenient(&text)?);
        }
    }

    let mut peers: BTreeMap<Uuid, Vec<Peer>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT rule_id, selector, address_group_id, cidr::text FROM rule_peers ORDER BY rule_id, ordinal",
    )
    .fetch_all(&mut *conn)
    .await?
    {
        let selector: Option<serde_json::Value> = row.get(1);
        let group: Option<Uuid> = row.get(2);
        let cidr: Option<String> = row.get(3);
        let peer = match (selector, group, cidr) {
            (Some(s), None, None) => Peer::Workloads(selector_from_json(s)?),
            (None, Some(g), None) => Peer::AddressGroup(g),
            (None, None, Some(c)) => Peer::Cidr(Cidr::parse_lenient(&c)?),
            _ => {
                return Err(StoreError::Corrupt { what: "rule peer", detail: "not exactly one kind".into() });
            }
        };
        peers.entry(row.get(0)).or_default().push(peer);
    }
    let mut services_of: BTreeMap<Uuid, Vec<Uuid>> = BTreeMap::new();
    for row in sqlx::query("SELECT rule_id, service_id FROM rule_services ORDER BY rule_id, service_id")
        .fetch_all(&mut *conn)
        .await?
    {
        services_of.entry(row.get(0)).or_default().push(row.get(1));
    }
    let mut rules_of: BTreeMap<Uuid, Vec<Rule>> = BTreeMap::new();
    for row in sqlx::query("SELECT id, ruleset_id, name, enabled FROM rules ORDER BY ruleset_id, ordinal")
        .fetch_all(&mut *conn)
        .await?
    {
        let id: Uuid = row.get(0);
        rules_of.entry(row.get(1)).or_default().push(Rule {
            id,
            name: row.get(2),
            enabled: row.get(3),
            peers: peers.remove(&id).unwrap_or_default(),
            services: services_of.remove(&id).unwrap_or_default(),
        });
    }
    for row in sqlx::query("SELECT id, name, enabled, scope FROM rulesets ORDER BY name")
        .fetch_all(&mut *conn)
        .await?
    {
        let id: Uuid = row.get(0);
        model.rulesets.push(Ruleset {
            id,
            name: row.get(1),
            enabled: row.get(2),
            scope: selector_from_json(row.get(3))?,
            rules: rules_of.remove(&id).unwrap_or_default(),
        });
    }
    Ok(model)
}

/// Every live (not retired) workload with its labels and addresses, in id order.
pub async fn load_registry(conn: &mut PgConnection) -> Result<Vec<RegisteredWorkload>, StoreError> {
    let mut labels: BTreeMap<Uuid, BTreeMap<LabelKey, LabelValue>> = BTreeMap::new();
    for row in
        sqlx::query("SELECT workload_id, key, value FROM workload_labels").fetch_all(&mut *conn).await?
    {
        let key: String = row.get(1);
        let value: String = row.get(2);
        labels.entry(row.get(0)).or_default().insert(
            LabelKey::new(&key).map_err(ModelError::from)?,
            LabelValue::new(&value).map_err(ModelError::from)?,
        );
    }
    let mut addresses: BTreeMap<Uuid, BTreeSet<IpAddr>> = BTreeMap::new();
    for row in
        sqlx::query("SELECT workload_id, host(address) FROM workload_addresses").fetch_all(&mut *conn).await?
    {
        let text: String = row.get(1);
        let ip = text
            .parse()
            .map_err(|_| StoreError::Corrupt { what: "workload address", detail: text.clone() })?;
        addresses.entry(row.get(0)).or_default().insert(ip);
    }
    let rows = sqlx::query(
        "SELECT id, mode FROM workloads WHERE retired_at IS NULL AND denied_at IS NULL ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|row| {
            let uuid: Uuid = row.get(0);
            Ok(RegisteredWorkload {
                id: workload_id(uuid)?,
                mode: stored::<Mode>(row.get(1))?,
                labels: labels.remove(&uuid).unwrap_or_default(),
                addresses: addresses.remove(&uuid).unwrap_or_default(),
            })
        })
        .collect()
}

fn workload_id(uuid: Uuid) -> Result<WorkloadId, StoreError> {
    WorkloadId::from_uuid(uuid).ok_or(StoreError::Corrupt { what: "workload id", detail: "nil uuid".into() })
}

fn decode_policy(bytes: &[u8]) -> Result<WorkloadPolicy, StoreError> {
    WorkloadPolicy::from_canonical_bytes(bytes)
        .map_err(|e| StoreError::Corrupt { what: "rendered policy", detail: e.to_string() })
}

/// The latest persisted policy of every workload that has one.
pub async fn load_persisted_policies(
    conn: &mut PgConnection,
) -> Result<BTreeMap<WorkloadId, WorkloadPolicy>, StoreError> {
    let rows = sqlx::query("SELECT workload_id, policy FROM workload_policies").fetch_all(&mut *conn).await?;
    rows.into_iter()
        .map(|row| {
            let bytes: Vec<u8> = row.get(1);
            Ok((workload_id(row.get(0))?, decode_policy(&bytes)?))
        })
        .collect()
}

/// A workload's persisted policy with the time it was rendered.
pub async fn persisted_policy(
    conn: &mut PgConnection,
    id: WorkloadId,
) -> Result<Option<(WorkloadPolicy, chrono::DateTime<chrono::Utc>)>, StoreError> {
    let row = sqlx::query("SELECT policy, rendered_at FROM workload_policies WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_optional(&mut *conn)
        .await?;
    row.map(|row| {
        let bytes: Vec<u8> = row.get(0);
        Ok((decode_policy(&bytes)?, row.get(1)))
    })
    .transpose()
}

/// Every persisted version of a workload's policy, oldest first.
pub async fn policy_history(
    conn: &mut PgConnection,
    id: WorkloadId,
) -> Result<Vec<WorkloadPolicy>, StoreError> {
    let rows =
        sqlx::query("SELECT policy FROM workload_policy_history WHERE workload_id = $1 ORDER BY version")
            .bind(id.uuid())
            .fetch_all(&mut *conn)
            .await?;
    rows.into_iter().map(|row| decode_policy(&row.get::<Vec<u8>, _>(0))).collect()
}

// ---- read views for the CLI and API ------------------------------------------------------

#[derive(Debug, Clone, Serialize)]
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
) -> Result<Vec<(String, String, i64, Vec<String>)>, StoreError> {
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

pub async fn list_services(conn: &mut PgConnection) -> Result<Vec<ServiceView>, StoreError> {
    let rows = list_named(conn, "services", |m, id| {
        m.services.get(id).map(|s| s.entries.iter().map(ToString::to_string).collect())
    })
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, description, version, entries)| ServiceView { name, description, version, entries })
        .collect())
}

#[derive(Debug, Clone, Serialize)]
pub struct AddressGroupView {
    pub name: String,
    pub description: String,
    pub version: i64,
    pub cidrs: Vec<String>,
}

pub async fn list_address_groups(conn: &mut PgConnection) -> Result<Vec<AddressGroupView>, StoreError> {
    let rows = list_named(conn, "address_groups", |m, id| {
        m.address_groups.get(id).map(|g| g.cidrs.iter().map(ToString::to_string).collect())
    })
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, description, version, cidrs)| AddressGroupView { name, description, version, cidrs })
        .collect())
}

#[derive(Debug, Clone, Serialize)]
pub struct RulesetView {
    pub version: i64,
    #[serde(flatten)]
    pub spec: crate::authoring::RulesetSpec,
}

/// Every ruleset in the shape an operator writes it, so `show` output can be edited and applied.
pub async fn list_rulesets(conn: &mut PgConnection) -> Result<Vec<RulesetView>, StoreError> {
    use crate::authoring::{PeerSpec, RuleSpec, RulesetSpec};
    let model = load_model(conn).await?;
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
                    services: r
                        .services
                        .iter()
                        .filter_map(|id| model.services.get(id).map(|s| s.name.clone()))
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

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadView {
    pub id: String,
    pub hostname: String,
    pub mode: String,
    pub labels: BTreeMap<String, String>,
    pub label_version: i64,
    pub addresses: Vec<String>,
    pub policy_version: Option<i64>,
    pub retired: bool,
}

pub async fn list_workloads(
    conn: &mut PgConnection,
    only: Option<WorkloadId>,
) -> Result<Vec<WorkloadView>, StoreError> {
    let mut labels: BTreeMap<Uuid, BTreeMap<String, String>> = BTreeMap::new();
    for row in
        sqlx::query("SELECT workload_id, key, value FROM workload_labels").fetch_all(&mut *conn).await?
    {
        labels.entry(row.get(0)).or_default().insert(row.get(1), row.get(2));
    }
    let mut addresses: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for row in sqlx::query("SELECT workload_id, host(address) FROM workload_addresses ORDER BY address")
        .fetch_all(&mut *conn)
        .await?
    {
        addresses.entry(row.get(0)).or_default().push(row.get(1));
    }
    let rows = sqlx::query(
        "SELECT w.id, w.hostname, w.mode, w.label_version, p.version, w.retired_at IS NOT NULL
         FROM workloads w LEFT JOIN workload_policies p ON p.workload_id = w.id
         WHERE $1::uuid IS NULL OR w.id = $1 ORDER BY w.hostname, w.id",
    )
    .bind(only.map(|id| id.uuid()))
    .fetch_all(&mut *conn)
    .await?;
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
                policy_version: row.get(4),
                retired: row.get(5),
            })
        })
        .collect()
}

/// Convergence of one workload (SYNC-6): applied against latest, read in one query.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct SyncStatusView {
    pub id: Uuid,
    pub hostname: String,
    pub applied_version: i64,
    pub latest_version: Option<i64>,
    #[sqlx(try_from = "i16")]
    pub state: StateName,
    pub detail: String,
    pub last_seen_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_acked_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_snapshot_sent_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_apply_failed_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A sync state as its name (`PENDING`, `SYNCED`, `DEGRADED`, `OFFLINE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(into = "&'static str")]
pub struct StateName(pub crate::session::SyncState);

impl From<StateName> for &'static str {
    fn from(s: StateName) -> Self {
        s.0.name()
    }
}

impl TryFrom<i16> for StateName {
    type Error = String;
    fn try_from(n: i16) -> Result<Self, String> {
        crate::session::SyncState::from_code(n).map(StateName).map_err(|_| format!("unknown sync state {n}"))
    }
}

pub async fn sync_status(
    conn: &mut PgConnection,
    only: Option<WorkloadId>,
) -> Result<Vec<SyncStatusView>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT w.id, w.hostname, w.applied_version, p.version AS latest_version, w.sync_state AS state,
                w.sync_detail AS detail, w.last_seen_at, w.last_acked_at, w.last_snapshot_sent_at,
                w.last_apply_failed_at
         FROM workloads w LEFT JOIN workload_policies p ON p.workload_id = w.id
         WHERE ($1::uuid IS NULL OR w.id = $1) AND w.retired_at IS NULL
         ORDER BY w.hostname, w.id",
    )
    .bind(only.map(|id| id.uuid()))
    .fetch_all(&mut *conn)
    .await?)
}
