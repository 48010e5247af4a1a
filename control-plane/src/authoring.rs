//! Authored changes (POL-4, POL-8, OPS-1): each mutation validates its input, writes it, and
//! renders in the same transaction (`commit`), so the change is acknowledged only once every
//! affected workload's policy is persisted and announced; an audit record names the result.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::{Cidr, Mode};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::model::{Selector, ServiceEntry, validate_name};
use crate::publish::{Changed, publish};
use crate::store::{StoreError, selector_to_json};
use innerwall_wire::convert::WireEnum;

/// The result of a committed change: its value and the workloads whose version advanced.
#[derive(Debug)]
pub struct Committed<T> {
    pub value: T,
    pub changed: Vec<Changed>,
}

/// Runs `change`, renders, audits and commits, all in one transaction. Nothing is written if
/// any step fails.
pub async fn commit<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), StoreError>,
) -> Result<Committed<T>, StoreError> {
    let mut tx = pool.begin().await?;
    let (value, detail) = change(&mut tx).await?;
    let changed = publish(&mut tx).await?;
    let versions: BTreeMap<String, u64> =
        changed.iter().map(|c| (c.workload.to_string(), c.version)).collect();
    sqlx::query(
        "INSERT INTO audit_log (actor, action, subject, detail, workload_versions) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(actor)
    .bind(action)
    .bind(subject)
    .bind(detail)
    .bind(serde_json::to_value(versions).expect("plain data serializes"))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Committed { value, changed })
}

/// Renders with no authored change (startup render, POL-6; repair).
pub async fn render_now(pool: &PgPool) -> Result<Vec<Changed>, StoreError> {
    let mut tx = pool.begin().await?;
    let changed = publish(&mut tx).await?;
    tx.commit().await?;
    Ok(changed)
}

/// Authored object kinds that carry a name and a version.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Service,
    AddressGroup,
    Ruleset,
}

impl Kind {
    fn table(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::AddressGroup => "address_groups",
            Kind::Ruleset => "rulesets",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::AddressGroup => "address group",
            Kind::Ruleset => "ruleset",
        }
    }
}

/// Locks an object row and checks the version the operator read. Returns (id, new version).
async fn lock_for_write(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    expected: Option<i64>,
) -> Result<(Uuid, i64), StoreError> {
    let sql = format!("SELECT id, version FROM {} WHERE name = $1 FOR UPDATE", kind.table());
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| StoreError::NotFound { what: kind.what(), name: name.to_owned() })?;
    let (id, current): (Uuid, i64) = (row.get(0), row.get(1));
    if let Some(expected) = expected
        && expected != current
    {
        return Err(StoreError::Stale { what: kind.what(), name: name.to_owned(), expected, current });
    }
    let sql = format!("UPDATE {} SET version = version + 1, updated_at = now() WHERE id = $1", kind.table());
    sqlx::query(AssertSqlSafe(sql)).bind(id).execute(&mut *conn).await?;
    Ok((id, current + 1))
}

async fn insert_named(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    description: &str,
) -> Result<Uuid, StoreError> {
    validate_name(kind.what(), name)?;
    let id = Uuid::new_v4();
    let sql = format!(
        "INSERT INTO {} (id, name, description) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
        kind.table()
    );
    let done =
        sqlx::query(AssertSqlSafe(sql)).bind(id).bind(name).bind(description).execute(&mut *conn).await?;
    if done.rows_affected() == 0 {
        return Err(StoreError::Exists { what: kind.what(), name: name.to_owned() });
    }
    Ok(id)
}

/// Deletes an object after naming whoever still refers to it.
async fn delete_named(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    expected: Option<i64>,
    referrers_sql: Option<&'static str>,
) -> Result<(), StoreError> {
    let (id, _) = lock_for_write(conn, kind, name, expected).await?;
    if let Some(sql) = referrers_sql {
        let referrers: Vec<String> = sqlx::query_scalar(sql).bind(id).fetch_all(&mut *conn).await?;
        if !referrers.is_empty() {
            return Err(StoreError::InUse { what: kind.what(), name: name.to_owned(), referrers });
        }
    }
    let sql = format!("DELETE FROM {} WHERE id = $1", kind.table());
    sqlx::query(AssertSqlSafe(sql)).bind(id).execute(&mut *conn).await?;
    Ok(())
}

const SERVICE_REFERRERS: &str = "SELECT DISTINCT format('ruleset %s rule %s', rs.name, r.name)
     FROM rule_services s JOIN rules r ON r.id = s.rule_id JOIN rulesets rs ON rs.id = r.ruleset_id
     WHERE s.service_id = $1 ORDER BY 1";
const GROUP_REFERRERS: &str = "SELECT DISTINCT format('ruleset %s rule %s', rs.name, r.name)
     FROM rule_peers p JOIN rules r ON r.id = p.rule_id JOIN rulesets rs ON rs.id = r.ruleset_id
     WHERE p.address_group_id = $1 ORDER BY 1";

// ---- services -----------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    pub name: String,
    pub description: String,
    pub entries: Vec<ServiceEntry>,
}

async fn write_service_entries(
    conn: &mut PgConnection,
    id: Uuid,
    entries: &[ServiceEntry],
) -> Result<(), StoreError> {
    if entries.is_empty() {
        return Err(StoreError::Invalid("a service needs at least one entry (e.g. --entry tcp:443)".into()));
    }
    sqlx::query("DELETE FROM service_entries WHERE service_id = $1").bind(id).execute(&mut *conn).await?;
    let rows = entries.iter().flat_map(|e| {
        let ranges: Vec<Option<(i32, i32)>> = if e.ports.is_empty() {
            vec![None]
        } else {
            e.ports.iter().map(|r| Some((i32::from(r.start()), i32::from(r.end())))).collect()
        };
        ranges.into_iter().map(move |r| (e.protocol.code(), r))
    });
    for (ordinal, (protocol, range)) in rows.enumerate() {
        sqlx::query(
            "INSERT INTO service_entries (service_id, ordinal, protocol, port_start, port_end) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(id)
        .bind(ordinal as i32)
        .bind(protocol)
        .bind(range.map(|r| r.0))
        .bind(range.map(|r| r.1))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

pub async fn create_service(conn: &mut PgConnection, spec: &ServiceSpec) -> Result<Uuid, StoreError> {
    let id = insert_named(conn, Kind::Service, &spec.name, &spec.description).await?;
    write_service_entries(conn, id, &spec.entries).await?;
    Ok(id)
}

pub async fn update_service(
    conn: &mut PgConnection,
    spec: &ServiceSpec,
    expected: Option<i64>,
) -> Result<i64, StoreError> {
    let (id, version) = lock_for_write(conn, Kind::Service, &spec.name, expected).await?;
    sqlx::query("UPDATE services SET description = $2 WHERE id = $1")
        .bind(id)
        .bind(&spec.description)
        .execute(&mut *conn)
        .await?;
    write_service_entries(conn, id, &spec.entries).await?;
    Ok(version)
}

pub async fn delete_service(
    conn: &mut PgConnection,
    name: &str,
    expected: Option<i64>,
) -> Result<(), StoreError> {
    delete_named(conn, Kind::Service, name, expected, Some(SERVICE_REFERRERS)).await
}

// ---- address groups -----------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressGroupSpec {
    pub name: String,
    pub description: String,
    pub cidrs: BTreeSet<Cidr>,
}

async fn write_group_cidrs(
    conn: &mut PgConnection,
    id: Uuid,
    cidrs: &BTreeSet<Cidr>,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM address_group_cidrs WHERE group_id = $1").bind(id).execute(&mut *conn).await?;
    let texts: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
    sqlx::query("INSERT INTO address_group_cidrs (group_id, cidr) SELECT $1, c::cidr FROM unnest($2::text[]) AS t (c)")
        .bind(id)
        .bind(&texts)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub async fn create_address_group(
    conn: &mut PgConnection,
    spec: &AddressGroupSpec,
) -> Result<Uuid, StoreError> {
    let id = insert_named(conn, Kind::AddressGroup, &spec.name, &spec.description).await?;
    write_group_cidrs(conn, id, &spec.cidrs).await?;
    Ok(id)
}

pub async fn update_address_group(
    conn: &mut PgConnection,
    spec: &AddressGroupSpec,
    expected: Option<i64>,
) -> Result<i64, StoreError> {
    let (id, version) = lock_for_write(conn, Kind::AddressGroup, &spec.name, expected).await?;
    sqlx::query("UPDATE address_groups SET description = $2 WHERE id = $1")
        .bind(id)
        .bind(&spec.description)
        .execute(&mut *conn)
        .await?;
    write_group_cidrs(conn, id, &spec.cidrs).await?;
    Ok(version)
}

pub async fn delete_address_group(
    conn: &mut PgConnection,
    name: &str,
    expected: Option<i64>,
) -> Result<(), StoreError> {
    delete_named(conn, Kind::AddressGroup, name, expected, Some(GROUP_REFERRERS)).await
}

// ---- rulesets -----------------------------------------------------------------------------

/// A ruleset as an operator writes it (YAML or JSON file), and as `ruleset show` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesetSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// `key: [values]`, ANDed across keys; the workloads this ruleset protects.
    pub scope: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Unique within the ruleset; keeps the rule's identity (and rendered ids) across edits.
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "yes")]
    pub enabled: bool,
    pub peers: Vec<PeerSpec>,
    /// Service names.
    pub services: Vec<String>,
}

/// Exactly one of the three, written as a one-key map: `{workloads: {app: [web]}}`,
/// `{address_group: vpn}` or `{cidr: 10.0.0.0/8}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workloads: Option<BTreeMap<String, Vec<String>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
}

/// A peer after checking that exactly one kind is given.
enum PeerRef<'a> {
    Workloads(&'a BTreeMap<String, Vec<String>>),
    AddressGroup(&'a str),
    Cidr(&'a str),
}

impl PeerSpec {
    pub fn workloads(map: BTreeMap<String, Vec<String>>) -> Self {
        PeerSpec { workloads: Some(map), ..Default::default() }
    }

    pub fn address_group(name: &str) -> Self {
        PeerSpec { address_group: Some(name.to_owned()), ..Default::default() }
    }

    pub fn cidr(text: &str) -> Self {
        PeerSpec { cidr: Some(text.to_owned()), ..Default::default() }
    }

    fn kind(&self, context: &str) -> Result<PeerRef<'_>, StoreError> {
        match (&self.workloads, &self.address_group, &self.cidr) {
            (Some(map), None, None) => Ok(PeerRef::Workloads(map)),
            (None, Some(name), None) => Ok(PeerRef::AddressGroup(name)),
            (None, None, Some(text)) => Ok(PeerRef::Cidr(text)),
            _ => Err(StoreError::Invalid(format!(
                "{context}: each peer needs exactly one of workloads, address_group or cidr"
            ))),
        }
    }
}

fn yes() -> bool {
    true
}

fn selector_of(map: &BTreeMap<String, Vec<String>>) -> Result<Selector, StoreError> {
    Ok(Selector::from_strings(map.iter().map(|(k, v)| (k.clone(), v.clone())))?)
}

async fn id_by_name(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    context: &str,
) -> Result<Uuid, StoreError> {
    let sql = format!("SELECT id FROM {} WHERE name = $1", kind.table());
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| StoreError::Invalid(format!("{context} references unknown {} {name:?}", kind.what())))
}

/// Validates everything in the spec before anything is written.
fn validate_ruleset(spec: &RulesetSpec) -> Result<(), StoreError> {
    validate_name("ruleset", &spec.name)?;
    if selector_of(&spec.scope)?.is_empty() {
        return Err(StoreError::Invalid(format!(
            "ruleset {:?}: the scope selector is empty and would match nothing; name at least one label",
            spec.name
        )));
    }
    let mut names = BTreeSet::new();
    for rule in &spec.rules {
        validate_name("rule", &rule.name)?;
        if !names.insert(&rule.name) {
            return Err(StoreError::Invalid(format!(
                "ruleset {:?}: rule {:?} appears twice",
                spec.name, rule.name
            )));
        }
        let context = format!("ruleset {:?} rule {:?}", spec.name, rule.name);
        if rule.peers.is_empty() || rule.services.is_empty() {
            return Err(StoreError::Invalid(format!("{context} needs at least one peer and one service")));
        }
        for peer in &rule.peers {
            match peer.kind(&context)? {
                PeerRef::Workloads(map) if selector_of(map)?.is_empty() => {
                    return Err(StoreError::Invalid(format!(
                        "{context}: an empty workloads selector matches nothing"
                    )));
                }
                PeerRef::Cidr(text) => {
                    Cidr::parse_lenient(text)?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

async fn write_rules(conn: &mut PgConnection, ruleset: Uuid, spec: &RulesetSpec) -> Result<(), StoreError> {
    // Keep each rule's id by name so rendered rule ids survive edits (peer-only deltas stay small).
    let existing: BTreeMap<String, Uuid> = sqlx::query("SELECT name, id FROM rules WHERE ruleset_id = $1")
        .bind(ruleset)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    sqlx::query("DELETE FROM rules WHERE ruleset_id = $1").bind(ruleset).execute(&mut *conn).await?;
    for (ordinal, rule) in spec.rules.iter().enumerate() {
        let context = format!("ruleset {:?} rule {:?}", spec.name, rule.name);
        let id = existing.get(&rule.name).copied().unwrap_or_else(Uuid::new_v4);
        sqlx::query(
            "INSERT INTO rules (id, ruleset_id, ordinal, name, description, enabled) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(ruleset)
        .bind(ordinal as i32)
        .bind(&rule.name)
        .bind(&rule.description)
        .bind(rule.enabled)
        .execute(&mut *conn)
        .await?;
        for (ordinal, peer) in rule.peers.iter().enumerate() {
            let (selector, group, cidr) = match peer.kind(&context)? {
                PeerRef::Workloads(map) => (Some(selector_to_json(&selector_of(map)?)), None, None),
                PeerRef::AddressGroup(name) => {
                    (None, Some(id_by_name(conn, Kind::AddressGroup, name, &context).await?), None)
                }
                PeerRef::Cidr(text) => (None, None, Some(Cidr::parse_lenient(text)?.to_string())),
            };
            sqlx::query(
                "INSERT INTO rule_peers (rule_id, ordinal, selector, address_group_id, cidr) VALUES ($1, $2, $3, $4, $5::cidr)",
            )
            .bind(id)
            .bind(ordinal as i32)
            .bind(selector)
            .bind(group)
            .bind(cidr)
            .execute(&mut *conn)
            .await?;
        }
        let mut services = BTreeSet::new();
        for name in &rule.services {
            services.insert(id_by_name(conn, Kind::Service, name, &context).await?);
        }
        for service in services {
            sqlx::query("INSERT INTO rule_services (rule_id, service_id) VALUES ($1, $2)")
                .bind(id)
                .bind(service)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

pub async fn create_ruleset(conn: &mut PgConnection, spec: &RulesetSpec) -> Result<Uuid, StoreError> {
    validate_ruleset(spec)?;
    let id = Uuid::new_v4();
    let done = sqlx::query(
        "INSERT INTO rulesets (id, name, description, enabled, scope) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(id)
    .bind(&spec.name)
    .bind(&spec.description)
    .bind(spec.enabled)
    .bind(selector_to_json(&selector_of(&spec.scope)?))
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() == 0 {
        return Err(StoreError::Exists { what: "ruleset", name: spec.name.clone() });
    }
    write_rules(conn, id, spec).await?;
    Ok(id)
}

pub async fn update_ruleset(
    conn: &mut PgConnection,
    spec: &RulesetSpec,
    expected: Option<i64>,
) -> Result<i64, StoreError> {
    validate_ruleset(spec)?;
    let (id, version) = lock_for_write(conn, Kind::Ruleset, &spec.name, expected).await?;
    sqlx::query("UPDATE rulesets SET description = $2, enabled = $3, scope = $4 WHERE id = $1")
        .bind(id)
        .bind(&spec.description)
        .bind(spec.enabled)
        .bind(selector_to_json(&selector_of(&spec.scope)?))
        .execute(&mut *conn)
        .await?;
    write_rules(conn, id, spec).await?;
    Ok(version)
}

pub async fn delete_ruleset(
    conn: &mut PgConnection,
    name: &str,
    expected: Option<i64>,
) -> Result<(), StoreError> {
    delete_named(conn, Kind::Ruleset, name, expected, None).await
}

// ---- workloads ----------------------------------------------------------------------------

/// What registration needs; enrollment (issue 4) supplies it from the token and host facts.
#[derive(Debug, Clone)]
pub struct NewWorkload {
    pub id: WorkloadId,
    pub hostname: String,
    pub labels: Vec<Label>,
    pub addresses: BTreeSet<IpAddr>,
}

pub async fn register_workload(conn: &mut PgConnection, new: &NewWorkload) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO workloads (id, hostname) VALUES ($1, $2)")
        .bind(new.id.uuid())
        .bind(&new.hostname)
        .execute(&mut *conn)
        .await?;
    write_labels(conn, new.id, &new.labels).await?;
    record_label_history(conn, new.id).await?;
    set_addresses(conn, new.id, &new.addresses).await?;
    Ok(())
}

/// Closes the workload's open label-history row and opens one for its labels now (same
/// transaction as the change, so history and labels never disagree).
async fn record_label_history(conn: &mut PgConnection, id: WorkloadId) -> Result<(), StoreError> {
    // Two statements: within one, the order of a CTE's update and the insert is unspecified,
    // and the index allowing one open row per workload would see two.
    sqlx::query(
        "UPDATE workload_label_history SET valid_to = now() WHERE workload_id = $1 AND valid_to IS NULL",
    )
    .bind(id.uuid())
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO workload_label_history (workload_id, label_version, labels, valid_from)
         SELECT w.id, w.label_version,
                COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id), '{}'),
                now()
         FROM workloads w WHERE w.id = $1",
    )
    .bind(id.uuid())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn write_labels(conn: &mut PgConnection, id: WorkloadId, labels: &[Label]) -> Result<(), StoreError> {
    let keys: Vec<&str> = labels.iter().map(|l| l.key.as_str()).collect();
    let values: Vec<&str> = labels.iter().map(|l| l.value.as_str()).collect();
    sqlx::query(
        "INSERT INTO workload_labels (workload_id, key, value) SELECT $1, k, v FROM unnest($2::text[], $3::text[]) AS t (k, v)
         ON CONFLICT (workload_id, key) DO UPDATE SET value = excluded.value",
    )
    .bind(id.uuid())
    .bind(&keys)
    .bind(&values)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Replaces a workload's addresses (inventory); the caller's commit renders.
pub async fn set_addresses(
    conn: &mut PgConnection,
    id: WorkloadId,
    addresses: &BTreeSet<IpAddr>,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM workload_addresses WHERE workload_id = $1")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    let texts: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    sqlx::query("INSERT INTO workload_addresses (workload_id, address) SELECT $1, a::inet FROM unnest($2::text[]) AS t (a)")
        .bind(id.uuid())
        .bind(&texts)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn lock_workload(conn: &mut PgConnection, id: WorkloadId) -> Result<(i64, bool), StoreError> {
    let row =
        sqlx::query("SELECT label_version, retired_at IS NOT NULL FROM workloads WHERE id = $1 FOR UPDATE")
            .bind(id.uuid())
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| StoreError::NotFound { what: "workload", name: id.to_string() })?;
    Ok((row.get(0), row.get(1)))
}

/// Sets and removes labels, conditional on the label-set version the operator read (IDN-6).
/// Returns the new label-set version.
pub async fn edit_labels(
    conn: &mut PgConnection,
    id: WorkloadId,
    expected: i64,
    set: &[Label],
    remove: &[LabelKey],
) -> Result<i64, StoreError> {
    if set.is_empty() && remove.is_empty() {
        return Err(StoreError::Invalid("nothing to change: give --set key=value or --remove key".into()));
    }
    if let Some(key) = remove.iter().find(|k| set.iter().any(|l| &l.key == *k)) {
        return Err(StoreError::Invalid(format!("label {key} is both set and removed")));
    }
    let (current, retired) = lock_workload(conn, id).await?;
    if retired {
        return Err(StoreError::Invalid(format!("workload {id} is retired; its labels are frozen")));
    }
    if current != expected {
        return Err(StoreError::Stale {
            what: "workload labels of",
            name: id.to_string(),
            expected,
            current,
        });
    }
    let removed: Vec<&str> = remove.iter().map(LabelKey::as_str).collect();
    sqlx::query("DELETE FROM workload_labels WHERE workload_id = $1 AND key = ANY($2)")
        .bind(id.uuid())
        .bind(&removed)
        .execute(&mut *conn)
        .await?;
    write_labels(conn, id, set).await?;
    sqlx::query("UPDATE workloads SET label_version = label_version + 1 WHERE id = $1")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    record_label_history(conn, id).await?;
    Ok(current + 1)
}

pub async fn set_mode(conn: &mut PgConnection, id: WorkloadId, mode: Mode) -> Result<(), StoreError> {
    let (_, retired) = lock_workload(conn, id).await?;
    if retired {
        return Err(StoreError::Invalid(format!("workload {id} is retired")));
    }
    sqlx::query("UPDATE workloads SET mode = $2 WHERE id = $1")
        .bind(id.uuid())
        .bind(mode.code())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Retires a workload (IDN-7): its identity and addresses leave every render, its stream is
/// ended, renewal is refused. Idempotent refusal: retiring twice is an error naming when.
pub async fn retire(conn: &mut PgConnection, id: WorkloadId) -> Result<(), StoreError> {
    lock_workload(conn, id).await?;
    let done = sqlx::query("UPDATE workloads SET retired_at = now() WHERE id = $1 AND retired_at IS NULL")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(StoreError::Invalid(format!("workload {id} is already retired")));
    }
    crate::bridge::publish_notice(conn, &crate::bridge::Notice::Retire(id)).await
}

/// Deny-lists an identity (IDN-7): refused at the handshake on every replica, its stream is
/// cut, renewal is refused, and it leaves every render like a retired workload.
pub async fn deny(conn: &mut PgConnection, id: WorkloadId) -> Result<(), StoreError> {
    lock_workload(conn, id).await?;
    let done = sqlx::query("UPDATE workloads SET denied_at = now() WHERE id = $1 AND denied_at IS NULL")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(StoreError::Invalid(format!("workload {id} is already deny-listed")));
    }
    crate::bridge::publish_notice(conn, &crate::bridge::Notice::Deny(id)).await
}

/// The answer to a directed reconnect request (SYNC-8).
#[derive(Debug, Clone, Serialize)]
pub struct ResendRequested {
    /// Observe success by this advancing.
    pub last_snapshot_sent_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Asks the replica holding the workload's stream to make the agent reconnect, which begins a
/// new stream with a snapshot. Best effort by design; refused when the stored state is OFFLINE.
pub async fn request_snapshot(pool: &PgPool, id: WorkloadId) -> Result<ResendRequested, StoreError> {
    type Time = Option<chrono::DateTime<chrono::Utc>>;
    let row: Option<(i16, Time, Time)> =
        sqlx::query_as("SELECT sync_state, last_seen_at, last_snapshot_sent_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_optional(pool)
            .await?;
    let Some((state, last_seen, last_snapshot)) = row else {
        return Err(StoreError::NotFound { what: "workload", name: id.to_string() });
    };
    if state == crate::session::SyncState::Offline.code() {
        let seen = last_seen.map_or_else(|| "never".to_owned(), |t| t.to_rfc3339());
        return Err(StoreError::AgentOffline { id: id.to_string(), last_seen: seen });
    }
    let mut conn = pool.acquire().await?;
    crate::bridge::publish_notice(&mut conn, &crate::bridge::Notice::Reconnect(id)).await?;
    Ok(ResendRequested { last_snapshot_sent_at: last_snapshot })
}
