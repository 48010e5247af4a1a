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

use crate::audit;
use crate::counts::{CountBounds, Counted};
use crate::error::Error;
use crate::notice::{self, Notice};
use crate::policy::model::{ServiceEntry, new_rule_id, validate_name};
use crate::policy::publish::{Changed, Overflow, Rendering, Touched, publish_touched, publish_with};
use crate::policy::spec::{
    AddressGroupSpec, NewWorkload, PeerRef, RulesetSpec, ServiceSpec, check_estate_range, check_label_count,
    selector_of, validate_ruleset,
};
use crate::policy::store::selector_to_json;
use innerwall_wire::convert::WireEnum;

/// The result of a committed change: its value and the workloads whose version advanced.
#[derive(Debug)]
pub struct Committed<T> {
    pub value: T,
    pub changed: Vec<Changed>,
}

/// Runs `change`, renders, runs `check` on the rendering, audits and commits, all in one
/// transaction. Nothing is written if any step fails, a policy over the rendered-policy bound
/// included (`publish::Overflow`), and a refusal of `check` included: it runs after the render
/// and before the audit record and the COMMIT, so a refused change leaves no version, no audit
/// row and no notice. Operators' changes go through `foresight::commit`, whose check is the
/// policy tests.
pub async fn commit_checked<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
    check: impl AsyncFnOnce(&mut PgConnection, &Rendering) -> Result<(), Error>,
) -> Result<Committed<T>, Error> {
    commit_checked_touching(pool, actor, action, subject, &[], change, check).await
}

/// [`commit_checked`] of a change that touched only `touched` (POL-7): the render is narrowed
/// to the workloads it can touch when that is sound (`publish::publish_touched`).
pub async fn commit_checked_touching<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    touched: &[Touched],
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
    check: impl AsyncFnOnce(&mut PgConnection, &Rendering) -> Result<(), Error>,
) -> Result<Committed<T>, Error> {
    commit_with(pool, Overflow::Refuse, actor, action, subject, touched, change, check).await
}

/// A change nobody can take back (an agent's inventory, a repair render), unchecked: a
/// workload whose policy would pass the rendered-policy bound is held at its last good version
/// (DEGRADED, with why) instead of refusing the change.
pub async fn commit_holding<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
) -> Result<Committed<T>, Error> {
    commit_with(pool, Overflow::Hold, actor, action, subject, &[], change, async |_, _| Ok(())).await
}

#[allow(clippy::too_many_arguments)]
async fn commit_with<T>(
    pool: &PgPool,
    overflow: Overflow,
    actor: &str,
    action: &str,
    subject: &str,
    touched: &[Touched],
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
    check: impl AsyncFnOnce(&mut PgConnection, &Rendering) -> Result<(), Error>,
) -> Result<Committed<T>, Error> {
    let mut tx = pool.begin().await?;
    let (value, detail) = change(&mut tx).await?;
    let rendering = publish_touched(&mut tx, overflow, touched).await?;
    check(&mut tx, &rendering).await?;
    let changed = rendering.changed;
    let record = audit::Record {
        detail,
        workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new(actor, action, subject)
    };
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    Ok(Committed { value, changed })
}

/// Renders with no authored change (startup render, POL-6; repair). It never fails on a policy
/// over the rendered-policy bound (an estate accepted before the bound was lowered): that
/// workload is held at its last good version, DEGRADED with why, and the rest renders.
pub async fn render_now(pool: &PgPool) -> Result<Vec<Changed>, Error> {
    let mut tx = pool.begin().await?;
    let changed = publish_with(&mut tx, Overflow::Hold).await?;
    tx.commit().await?;
    Ok(changed)
}

/// An operator operation that costs far more than its request: a render of the whole estate,
/// or a workload's reconnect and full snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expensive {
    Render,
    ResendSnapshot,
}

impl Expensive {
    /// The audit action, also the bucket's name.
    pub fn action(self) -> &'static str {
        match self {
            Expensive::Render => "policy.render",
            Expensive::ResendSnapshot => "workload.resend-snapshot",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Expensive::Render => "renders",
            Expensive::ResendSnapshot => "snapshot resends",
        }
    }
}

/// Rate bounds on [`Expensive`] operations, per actor (an API token is its own actor) and for
/// everyone together, each per minute (a minute's worth may come at once). Kept in Postgres
/// (`operation_buckets`), so the CLI, every replica and every token count against the same
/// buckets. Repeats within `coalesce` of the first are counted on one audit row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpensiveBounds {
    /// `serve --api-expensive-per-minute`.
    pub per_actor_per_minute: u32,
    /// `serve --api-expensive-overall-per-minute`.
    pub overall_per_minute: u32,
    pub coalesce: std::time::Duration,
}

impl Default for ExpensiveBounds {
    fn default() -> Self {
        ExpensiveBounds {
            per_actor_per_minute: 6,
            overall_per_minute: 30,
            coalesce: std::time::Duration::from_secs(600),
        }
    }
}

/// Takes one of `operation` for `actor` and for everyone in `tx`, or refuses naming the bound
/// and the wait (nothing is taken then: the caller's transaction rolls back). The rows are
/// locked in one order (everyone's first), so concurrent takes serialize without deadlock.
pub async fn take_expensive(
    tx: &mut PgConnection,
    operation: Expensive,
    actor: &str,
    bounds: &ExpensiveBounds,
) -> Result<(), Error> {
    let buckets = [
        ("", bounds.overall_per_minute, "--api-expensive-overall-per-minute", "everyone"),
        (actor, bounds.per_actor_per_minute, "--api-expensive-per-minute", actor),
    ];
    let mut levels = Vec::with_capacity(2);
    for (who, per_minute, flag, whom) in buckets {
        let capacity = f64::from(per_minute.max(1));
        let (tokens, elapsed): (f64, f64) = sqlx::query_as(
            "INSERT INTO operation_buckets (operation, who, tokens, at) VALUES ($1, $2, $3, now())
             ON CONFLICT (operation, who) DO UPDATE SET operation = EXCLUDED.operation
             RETURNING tokens, GREATEST(extract(epoch FROM now() - at)::float8, 0)",
        )
        .bind(operation.action())
        .bind(who)
        .bind(capacity)
        .fetch_one(&mut *tx)
        .await?;
        let level = (tokens + elapsed * capacity / 60.0).min(capacity);
        if level < 1.0 {
            let wait = ((1.0 - level) * 60.0 / capacity).ceil().max(1.0);
            return Err(Error::RateLimited {
                what: operation.what(),
                who: whom.to_owned(),
                per_minute: per_minute.max(1),
                bound: flag,
                retry_after_secs: wait as u64,
            });
        }
        levels.push((who, level - 1.0));
    }
    for (who, level) in levels {
        sqlx::query("UPDATE operation_buckets SET tokens = $3, at = now() WHERE operation = $1 AND who = $2")
            .bind(operation.action())
            .bind(who)
            .bind(level)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// [`take_expensive`] in its own transaction, for an operation that reads (a draft's render,
/// impact or test run renders the whole estate in a transaction it rolls back): the charge stands
/// whether the operation then succeeds or not, as a request does.
pub async fn charge_expensive(
    pool: &PgPool,
    operation: Expensive,
    actor: &str,
    bounds: &ExpensiveBounds,
) -> Result<(), Error> {
    let mut tx = pool.begin().await?;
    take_expensive(&mut tx, operation, actor, bounds).await?;
    tx.commit().await?;
    Ok(())
}

/// The audit record of an expensive operation: its own row when it moved policy versions,
/// otherwise counted on the row of its repeats within `bounds.coalesce` (so a script that
/// renders in a loop adds one row, with a count).
async fn audit_expensive(
    tx: &mut PgConnection,
    record: &audit::Record<'_>,
    bounds: &ExpensiveBounds,
) -> Result<(), Error> {
    if record.workload_versions.is_empty() {
        audit::coalesce(tx, record, bounds.coalesce, 1).await?;
    } else {
        audit::write(tx, record).await?;
    }
    Ok(())
}

/// [`render_now`] on an operator's request (`innerwall render`, `POST /api/v1/render`), within
/// the default [`ExpensiveBounds`] (the local CLI's).
pub async fn render_audited(pool: &PgPool, actor: &str) -> Result<Committed<()>, Error> {
    render_bounded(pool, actor, &ExpensiveBounds::default()).await
}

/// A render on an operator's request: refused over `bounds` (nothing written), otherwise the
/// render and its audit record (`policy.render`, with the versions it moved; repeats that moved
/// nothing coalesced) in one transaction.
pub async fn render_bounded(
    pool: &PgPool,
    actor: &str,
    bounds: &ExpensiveBounds,
) -> Result<Committed<()>, Error> {
    let mut tx = pool.begin().await?;
    take_expensive(&mut tx, Expensive::Render, actor, bounds).await?;
    let changed = publish_with(&mut tx, Overflow::Hold).await?;
    let record = audit::Record {
        workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new(actor, Expensive::Render.action(), "all")
    };
    audit_expensive(&mut tx, &record, bounds).await?;
    tx.commit().await?;
    Ok(Committed { value: (), changed })
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

/// Locks an object row and checks the version the operator read (POL-8: every update and
/// delete is conditional; there is no unconditional form). Returns (id, new version).
async fn lock_for_write(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    expected: i64,
) -> Result<(Uuid, i64), Error> {
    let sql = format!("SELECT id, version FROM {} WHERE name = $1 FOR UPDATE", kind.table());
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| Error::NotFound { what: kind.what(), name: name.to_owned() })?;
    let (id, current): (Uuid, i64) = (row.get(0), row.get(1));
    if expected != current {
        return Err(Error::Stale { what: kind.what(), name: name.to_owned(), expected, current });
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
) -> Result<Uuid, Error> {
    validate_name(kind.what(), name)?;
    let id = Uuid::new_v4();
    let sql = format!(
        "INSERT INTO {} (id, name, description) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
        kind.table()
    );
    let done =
        sqlx::query(AssertSqlSafe(sql)).bind(id).bind(name).bind(description).execute(&mut *conn).await?;
    if done.rows_affected() == 0 {
        return Err(Error::Exists { what: kind.what(), name: name.to_owned() });
    }
    Ok(id)
}

/// Deletes an object after naming whoever still refers to it.
async fn delete_named(
    conn: &mut PgConnection,
    kind: Kind,
    name: &str,
    expected: i64,
    referrers_sql: Option<&'static str>,
) -> Result<(), Error> {
    let (id, _) = lock_for_write(conn, kind, name, expected).await?;
    if let Some(sql) = referrers_sql {
        let referrers: Vec<String> = sqlx::query_scalar(sql).bind(id).fetch_all(&mut *conn).await?;
        if !referrers.is_empty() {
            return Err(Error::InUse { what: kind.what(), name: name.to_owned(), referrers });
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

async fn write_service_entries(
    conn: &mut PgConnection,
    id: Uuid,
    entries: &[ServiceEntry],
) -> Result<(), Error> {
    if entries.is_empty() {
        return Err(Error::Invalid("a service needs at least one entry (e.g. --entry tcp:443)".into()));
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

/// Creates a service within the default count bound ([`create_service_within`] takes another).
pub async fn create_service(conn: &mut PgConnection, spec: &ServiceSpec) -> Result<Uuid, Error> {
    create_service_within(conn, spec, &CountBounds::default()).await
}

pub async fn create_service_within(
    conn: &mut PgConnection,
    spec: &ServiceSpec,
    counts: &CountBounds,
) -> Result<Uuid, Error> {
    spec.check()?;
    counts.check(conn, Counted::Services).await?;
    let id = insert_named(conn, Kind::Service, &spec.name, &spec.description).await?;
    write_service_entries(conn, id, &spec.entries).await?;
    Ok(id)
}

pub async fn update_service(
    conn: &mut PgConnection,
    spec: &ServiceSpec,
    expected: i64,
) -> Result<i64, Error> {
    spec.check()?;
    let (id, version) = lock_for_write(conn, Kind::Service, &spec.name, expected).await?;
    sqlx::query("UPDATE services SET description = $2 WHERE id = $1")
        .bind(id)
        .bind(&spec.description)
        .execute(&mut *conn)
        .await?;
    write_service_entries(conn, id, &spec.entries).await?;
    Ok(version)
}

pub async fn delete_service(conn: &mut PgConnection, name: &str, expected: i64) -> Result<(), Error> {
    delete_named(conn, Kind::Service, name, expected, Some(SERVICE_REFERRERS)).await
}

// ---- address groups -----------------------------------------------------------------------

async fn write_group_cidrs(conn: &mut PgConnection, id: Uuid, cidrs: &BTreeSet<Cidr>) -> Result<(), Error> {
    sqlx::query("DELETE FROM address_group_cidrs WHERE group_id = $1").bind(id).execute(&mut *conn).await?;
    let texts: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
    sqlx::query("INSERT INTO address_group_cidrs (group_id, cidr) SELECT $1, c::cidr FROM unnest($2::text[]) AS t (c)")
        .bind(id)
        .bind(&texts)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Creates an address group within the default count bound.
pub async fn create_address_group(conn: &mut PgConnection, spec: &AddressGroupSpec) -> Result<Uuid, Error> {
    create_address_group_within(conn, spec, &CountBounds::default()).await
}

pub async fn create_address_group_within(
    conn: &mut PgConnection,
    spec: &AddressGroupSpec,
    counts: &CountBounds,
) -> Result<Uuid, Error> {
    spec.check()?;
    counts.check(conn, Counted::AddressGroups).await?;
    let id = insert_named(conn, Kind::AddressGroup, &spec.name, &spec.description).await?;
    write_group_cidrs(conn, id, &spec.cidrs).await?;
    Ok(id)
}

pub async fn update_address_group(
    conn: &mut PgConnection,
    spec: &AddressGroupSpec,
    expected: i64,
) -> Result<i64, Error> {
    spec.check()?;
    let (id, version) = lock_for_write(conn, Kind::AddressGroup, &spec.name, expected).await?;
    sqlx::query("UPDATE address_groups SET description = $2 WHERE id = $1")
        .bind(id)
        .bind(&spec.description)
        .execute(&mut *conn)
        .await?;
    write_group_cidrs(conn, id, &spec.cidrs).await?;
    Ok(version)
}

pub async fn delete_address_group(conn: &mut PgConnection, name: &str, expected: i64) -> Result<(), Error> {
    delete_named(conn, Kind::AddressGroup, name, expected, Some(GROUP_REFERRERS)).await
}

// ---- rulesets -----------------------------------------------------------------------------

async fn id_by_name(conn: &mut PgConnection, kind: Kind, name: &str, context: &str) -> Result<Uuid, Error> {
    let sql = format!("SELECT id FROM {} WHERE name = $1", kind.table());
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| Error::Invalid(format!("{context} references unknown {} {name:?}", kind.what())))
}

async fn write_rules(conn: &mut PgConnection, ruleset: Uuid, spec: &RulesetSpec) -> Result<(), Error> {
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
        let id = existing.get(&rule.name).copied().unwrap_or_else(|| new_rule_id(&spec.name, &rule.name));
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
                PeerRef::Cidr(text) => (None, None, Some(Cidr::parse(text)?.to_string())),
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

/// Creates a ruleset within the default count bound.
pub async fn create_ruleset(conn: &mut PgConnection, spec: &RulesetSpec) -> Result<Uuid, Error> {
    create_ruleset_within(conn, spec, &CountBounds::default()).await
}

pub async fn create_ruleset_within(
    conn: &mut PgConnection,
    spec: &RulesetSpec,
    counts: &CountBounds,
) -> Result<Uuid, Error> {
    validate_ruleset(spec)?;
    counts.check(conn, Counted::Rulesets).await?;
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
        return Err(Error::Exists { what: "ruleset", name: spec.name.clone() });
    }
    write_rules(conn, id, spec).await?;
    Ok(id)
}

pub async fn update_ruleset(
    conn: &mut PgConnection,
    spec: &RulesetSpec,
    expected: i64,
) -> Result<i64, Error> {
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

pub async fn delete_ruleset(conn: &mut PgConnection, name: &str, expected: i64) -> Result<(), Error> {
    delete_named(conn, Kind::Ruleset, name, expected, None).await
}

// ---- workloads ----------------------------------------------------------------------------

pub async fn register_workload(conn: &mut PgConnection, new: &NewWorkload) -> Result<(), Error> {
    register_workloads(conn, std::slice::from_ref(new)).await
}

/// Registers new workloads with their labels, label history and addresses: a few statements
/// whatever their number (an enrollment batch registers up to a hundred at once).
pub async fn register_workloads(conn: &mut PgConnection, new: &[NewWorkload]) -> Result<(), Error> {
    for one in new {
        check_label_count(&format!("workload {}", one.id), one.labels.len())?;
    }
    let ids: Vec<Uuid> = new.iter().map(|n| n.id.uuid()).collect();
    let hostnames: Vec<&str> = new.iter().map(|n| n.hostname.as_str()).collect();
    sqlx::query(
        "INSERT INTO workloads (id, hostname, addresses_changed_at)
         SELECT id, hostname, now() FROM unnest($1::uuid[], $2::text[]) AS t (id, hostname)",
    )
    .bind(&ids)
    .bind(&hostnames)
    .execute(&mut *conn)
    .await?;
    let labels: Vec<(WorkloadId, &Label)> =
        new.iter().flat_map(|n| n.labels.iter().map(|l| (n.id, l))).collect();
    write_labels(conn, &labels).await?;
    record_label_history(conn, &ids).await?;
    let (owners, addresses): (Vec<Uuid>, Vec<String>) =
        new.iter().flat_map(|n| n.addresses.iter().map(|a| (n.id.uuid(), a.to_string()))).unzip();
    sqlx::query(
        "INSERT INTO workload_addresses (workload_id, address)
         SELECT w, a::inet FROM unnest($1::uuid[], $2::text[]) AS t (w, a)",
    )
    .bind(&owners)
    .bind(&addresses)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Closes the workloads' open label-history rows and opens one for each's labels now (same
/// transaction as the change, so history and labels never disagree).
async fn record_label_history(conn: &mut PgConnection, ids: &[Uuid]) -> Result<(), Error> {
    // Two statements: within one, the order of a CTE's update and the insert is unspecified,
    // and the index allowing one open row per workload would see two.
    sqlx::query(
        "UPDATE workload_label_history SET valid_to = now() WHERE workload_id = ANY($1) AND valid_to IS NULL",
    )
    .bind(ids)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO workload_label_history (workload_id, label_version, labels, valid_from)
         SELECT w.id, w.label_version,
                COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id), '{}'),
                now()
         FROM workloads w WHERE w.id = ANY($1)",
    )
    .bind(ids)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Sets each (workload, label): a workload's label of the same key is replaced.
async fn write_labels(conn: &mut PgConnection, labels: &[(WorkloadId, &Label)]) -> Result<(), Error> {
    let ids: Vec<Uuid> = labels.iter().map(|(id, _)| id.uuid()).collect();
    let keys: Vec<&str> = labels.iter().map(|(_, l)| l.key.as_str()).collect();
    let values: Vec<&str> = labels.iter().map(|(_, l)| l.value.as_str()).collect();
    sqlx::query(
        "INSERT INTO workload_labels (workload_id, key, value)
         SELECT w, k, v FROM unnest($1::uuid[], $2::text[], $3::text[]) AS t (w, k, v)
         ON CONFLICT (workload_id, key) DO UPDATE SET value = excluded.value",
    )
    .bind(&ids)
    .bind(&keys)
    .bind(&values)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Replaces a workload's reported addresses (inventory); the caller's commit renders, which
/// judges the new ones. Addresses kept keep their standing, so only real changes are audited.
pub async fn set_addresses(
    conn: &mut PgConnection,
    id: WorkloadId,
    addresses: &BTreeSet<IpAddr>,
) -> Result<(), Error> {
    let texts: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    sqlx::query(
        "DELETE FROM workload_addresses WHERE workload_id = $1 AND NOT (address = ANY($2::text[]::inet[]))",
    )
    .bind(id.uuid())
    .bind(&texts)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO workload_addresses (workload_id, address) SELECT $1, a::inet FROM unnest($2::text[]) AS t (a)
         ON CONFLICT (workload_id, address) DO NOTHING",
    )
    .bind(id.uuid())
    .bind(&texts)
    .execute(&mut *conn)
    .await?;
    sqlx::query("UPDATE workloads SET addresses_changed_at = now() WHERE id = $1")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Drops one workload's claim to an address (an operator resolving a conflict, or forgetting
/// an address a host no longer has); the host's next inventory report claims it again if it
/// still has it.
pub async fn release_address(conn: &mut PgConnection, id: WorkloadId, address: IpAddr) -> Result<(), Error> {
    let done = sqlx::query("DELETE FROM workload_addresses WHERE workload_id = $1 AND address = $2::inet")
        .bind(id.uuid())
        .bind(address.to_string())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::NotFound { what: "address claim", name: format!("{address} of workload {id}") });
    }
    Ok(())
}

// ---- estate ranges ------------------------------------------------------------------------

/// Adds an estate range (addresses in it may be rendered as workload peers).
pub async fn add_estate_range(conn: &mut PgConnection, range: Cidr, description: &str) -> Result<(), Error> {
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM estate_ranges").fetch_one(&mut *conn).await?;
    check_estate_range(count as usize, description)?;
    let done = sqlx::query(
        "INSERT INTO estate_ranges (cidr, description) VALUES ($1::cidr, $2) ON CONFLICT (cidr) DO NOTHING",
    )
    .bind(range.to_string())
    .bind(description)
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() == 0 {
        return Err(Error::Exists { what: "estate range", name: range.to_string() });
    }
    Ok(())
}

/// Removes an estate range; addresses only it admitted stop being rendered.
pub async fn remove_estate_range(conn: &mut PgConnection, range: Cidr) -> Result<(), Error> {
    let done = sqlx::query("DELETE FROM estate_ranges WHERE cidr = $1::cidr")
        .bind(range.to_string())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::NotFound { what: "estate range", name: range.to_string() });
    }
    Ok(())
}

/// Locks a live workload for a change of its own: an unknown one is not found, a retired one
/// refused.
pub async fn lock_live(conn: &mut PgConnection, id: WorkloadId) -> Result<(), Error> {
    let (_, retired) = lock_workload(conn, id).await?;
    if retired {
        return Err(Error::Invalid(format!("workload {id} is retired")));
    }
    Ok(())
}

async fn lock_workload(conn: &mut PgConnection, id: WorkloadId) -> Result<(i64, bool), Error> {
    let row =
        sqlx::query("SELECT label_version, retired_at IS NOT NULL FROM workloads WHERE id = $1 FOR UPDATE")
            .bind(id.uuid())
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| Error::NotFound { what: "workload", name: id.to_string() })?;
    Ok((row.get(0), row.get(1)))
}

/// The checks of a label edit that need no database: something to change, no key set twice,
/// none both set and removed. The remote CLI makes them before it asks the API for anything.
pub fn check_label_edit(set: &[Label], remove: &[LabelKey]) -> Result<(), Error> {
    if set.is_empty() && remove.is_empty() {
        return Err(Error::Invalid("nothing to change: give --set key=value or --remove key".into()));
    }
    distinct_keys(set)?;
    if let Some(key) = remove.iter().find(|k| set.iter().any(|l| &l.key == *k)) {
        return Err(Error::Invalid(format!("label {key} is both set and removed")));
    }
    Ok(())
}

fn distinct_keys(labels: &[Label]) -> Result<BTreeMap<&str, &Label>, Error> {
    let mut by_key = BTreeMap::new();
    for label in labels {
        if by_key.insert(label.key.as_str(), label).is_some() {
            return Err(Error::Invalid(format!("label key {} is given more than once", label.key)));
        }
    }
    Ok(by_key)
}

/// The refusal of a label change conditioned on a version that is not the current one.
pub fn stale_labels(id: WorkloadId, expected: i64, current: i64) -> Error {
    Error::Stale { what: "workload labels of", name: id.to_string(), expected, current }
}

/// Locks the workload for a label change conditioned on `expected`: refused if unknown, retired
/// (its labels are frozen) or at another version. Returns the version and the labels now.
async fn labels_at(
    conn: &mut PgConnection,
    id: WorkloadId,
    expected: i64,
) -> Result<(i64, BTreeMap<String, String>), Error> {
    let (current, retired) = lock_workload(conn, id).await?;
    if retired {
        return Err(Error::Invalid(format!("workload {id} is retired; its labels are frozen")));
    }
    if current != expected {
        return Err(stale_labels(id, expected, current));
    }
    let now = sqlx::query_as("SELECT key, value FROM workload_labels WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
    Ok((current, now))
}

/// Sets and removes labels, conditional on the label-set version the operator read (IDN-6).
/// Returns the label-set version now (unchanged when the edit changes nothing).
pub async fn edit_labels(
    conn: &mut PgConnection,
    id: WorkloadId,
    expected: i64,
    set: &[Label],
    remove: &[LabelKey],
) -> Result<i64, Error> {
    Ok(change_labels(conn, id, expected, set, remove).await?.version)
}

/// What a label change did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LabelsReplaced {
    /// The label-set version now (unchanged when the change changed nothing).
    pub version: i64,
    /// `key=value` of each label set to a new value, by key.
    pub set: Vec<String>,
    /// Each key removed, in order.
    pub removed: Vec<String>,
}

/// Sets and removes labels, conditional on the label-set version the operator read (IDN-6):
/// `innerwall workload label`. An edit that leaves the set as it is keeps the version.
pub async fn change_labels(
    conn: &mut PgConnection,
    id: WorkloadId,
    expected: i64,
    set: &[Label],
    remove: &[LabelKey],
) -> Result<LabelsReplaced, Error> {
    check_label_edit(set, remove)?;
    let (current, now) = labels_at(conn, id, expected).await?;
    apply_labels(conn, id, current, &now, set, remove).await
}

/// Replaces a workload's whole label set, conditional on the label-set version the operator
/// read (IDN-6): the HTTP API's `PUT …/labels`. A set equal to the current one changes nothing
/// and keeps the version.
pub async fn replace_labels(
    conn: &mut PgConnection,
    id: WorkloadId,
    expected: i64,
    labels: &[Label],
) -> Result<LabelsReplaced, Error> {
    let wanted = distinct_keys(labels)?;
    let (current, now) = labels_at(conn, id, expected).await?;
    let remove: Vec<LabelKey> = now
        .keys()
        .filter(|k| !wanted.contains_key(k.as_str()))
        .map(|k| k.parse::<LabelKey>())
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Corrupt { what: "stored label key", detail: e.to_string() })?;
    apply_labels(conn, id, current, &now, labels, &remove).await
}

/// Applies an edit to the labels `now` (at version `current`, locked and checked): what it
/// really changes is written, with a new version and a label-history row; nothing if nothing.
async fn apply_labels(
    conn: &mut PgConnection,
    id: WorkloadId,
    current: i64,
    now: &BTreeMap<String, String>,
    set: &[Label],
    remove: &[LabelKey],
) -> Result<LabelsReplaced, Error> {
    let mut after = now.clone();
    for key in remove {
        after.remove(key.as_str());
    }
    for label in set {
        after.insert(label.key.to_string(), label.value.to_string());
    }
    check_label_count(&format!("workload {id}"), after.len())?;
    let mut set: Vec<&Label> = set
        .iter()
        .filter(|l| now.get(l.key.as_str()).map(String::as_str) != Some(l.value.as_str()))
        .collect();
    set.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
    let mut remove: Vec<&LabelKey> = remove.iter().filter(|k| now.contains_key(k.as_str())).collect();
    remove.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    remove.dedup();
    let shown = LabelsReplaced {
        version: current,
        set: set.iter().map(ToString::to_string).collect(),
        removed: remove.iter().map(ToString::to_string).collect(),
    };
    if set.is_empty() && remove.is_empty() {
        return Ok(shown);
    }
    let removed: Vec<&str> = remove.iter().map(|k| k.as_str()).collect();
    sqlx::query("DELETE FROM workload_labels WHERE workload_id = $1 AND key = ANY($2)")
        .bind(id.uuid())
        .bind(&removed)
        .execute(&mut *conn)
        .await?;
    let set: Vec<(WorkloadId, &Label)> = set.into_iter().map(|l| (id, l)).collect();
    write_labels(conn, &set).await?;
    sqlx::query("UPDATE workloads SET label_version = label_version + 1 WHERE id = $1")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    record_label_history(conn, &[id.uuid()]).await?;
    Ok(LabelsReplaced { version: current + 1, ..shown })
}

pub async fn set_mode(conn: &mut PgConnection, id: WorkloadId, mode: Mode) -> Result<(), Error> {
    lock_live(conn, id).await?;
    sqlx::query("UPDATE workloads SET mode = $2 WHERE id = $1")
        .bind(id.uuid())
        .bind(mode.code())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Retires a workload (IDN-7): its identity and addresses leave every render, its stream is
/// ended, renewal is refused. Idempotent refusal: retiring twice is an error naming when.
pub async fn retire(conn: &mut PgConnection, id: WorkloadId) -> Result<(), Error> {
    lock_workload(conn, id).await?;
    let done = sqlx::query("UPDATE workloads SET retired_at = now() WHERE id = $1 AND retired_at IS NULL")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::Invalid(format!("workload {id} is already retired")));
    }
    unjudge_addresses(conn, id).await?;
    notice::publish(conn, &[Notice::Retire(id)]).await
}

/// Deny-lists an identity (IDN-7): refused at the handshake on every replica, its stream is
/// cut, renewal is refused, and it leaves every render like a retired workload.
pub async fn deny(conn: &mut PgConnection, id: WorkloadId) -> Result<(), Error> {
    lock_workload(conn, id).await?;
    let done = sqlx::query("UPDATE workloads SET denied_at = now() WHERE id = $1 AND denied_at IS NULL")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::Invalid(format!("workload {id} is already deny-listed")));
    }
    unjudge_addresses(conn, id).await?;
    notice::publish(conn, &[Notice::Deny(id)]).await
}

/// A workload leaving the renders leaves address trust too: none of its addresses stays accepted,
/// so ingest never attributes a flow to it and the address can be accepted for the live host
/// that holds it now (at most one accepted claim per address: `workload_addresses_accepted_once`).
async fn unjudge_addresses(conn: &mut PgConnection, id: WorkloadId) -> Result<(), Error> {
    sqlx::query("UPDATE workload_addresses SET standing = NULL WHERE workload_id = $1")
        .bind(id.uuid())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The answer to a directed reconnect request (SYNC-8).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResendRequested {
    /// Observe success by this advancing.
    pub last_snapshot_sent_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Asks the replica holding the workload's stream to make the agent reconnect, which begins a
/// new stream with a snapshot. Best effort by design; refused when the shown state is OFFLINE.
/// Audited as `workload.resend-snapshot` by `actor`, in the transaction that sends the notice.
pub async fn request_snapshot(pool: &PgPool, actor: &str, id: WorkloadId) -> Result<ResendRequested, Error> {
    request_snapshot_bounded(pool, actor, id, &ExpensiveBounds::default()).await
}

/// [`request_snapshot`] within `bounds` (refused over them, nothing written); repeats for one
/// workload coalesce on one audit row.
pub async fn request_snapshot_bounded(
    pool: &PgPool,
    actor: &str,
    id: WorkloadId,
    bounds: &ExpensiveBounds,
) -> Result<ResendRequested, Error> {
    type Time = Option<chrono::DateTime<chrono::Utc>>;
    let row: Option<(i16, Time, Time)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {}, w.last_seen_at, w.last_snapshot_sent_at FROM {} WHERE w.id = $1",
        crate::shown::STATE,
        crate::shown::ROWS
    )))
    .bind(id.uuid())
    .fetch_optional(pool)
    .await?;
    let Some((state, last_seen, last_snapshot)) = row else {
        return Err(Error::NotFound { what: "workload", name: id.to_string() });
    };
    if state == innerwall_wire::sync::SyncState::Offline.code() {
        let seen = last_seen.map_or_else(|| "never".to_owned(), |t| t.to_rfc3339());
        return Err(Error::AgentOffline { id: id.to_string(), last_seen: seen });
    }
    // The notice is delivered at commit, with its record.
    let mut tx = pool.begin().await?;
    take_expensive(&mut tx, Expensive::ResendSnapshot, actor, bounds).await?;
    notice::publish(&mut tx, &[Notice::Reconnect(id)]).await?;
    let detail = serde_json::json!({"last_snapshot_sent_at": last_snapshot});
    let subject = id.to_string();
    let record = audit::Record::new(actor, Expensive::ResendSnapshot.action(), &subject).detail(detail);
    audit_expensive(&mut tx, &record, bounds).await?;
    tx.commit().await?;
    Ok(ResendRequested { last_snapshot_sent_at: last_snapshot })
}
