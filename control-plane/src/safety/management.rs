//! Management access (issue 31, no lock-out): the sources and services every workload admits
//! whatever its policy says, rendered as the failsafe rule (`model::FAILSAFE_RULE`).
//!
//! The estate's set is seeded by `serve --management-cidr` when none is stored. After that it
//! only narrows ([`narrow`]: an admin, through the CLI or the API, for the estate or for one
//! workload, each narrowing inside what it replaces); nothing removes it. Widening it is
//! [`reset`], which only the local CLI offers: whoever holds the database holds the estate, and
//! a stolen admin token must not be able to open every host's management ports. Every change is
//! one `foresight::commit` (written, rendered, judged by the policy tests, audited).

use chrono::{DateTime, Utc};
use innerwall_wire::identity::WorkloadId;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::Error;
use crate::foresight::commit;
use crate::policy::authoring::Committed;
use crate::policy::model::Management;
use crate::policy::store;

/// Where management access applies: the estate, or one workload (a narrowing of the estate's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Estate,
    Workload(WorkloadId),
}

impl Scope {
    /// Its workload's row key; the estate's row has none.
    fn workload(self) -> Option<Uuid> {
        match self {
            Scope::Estate => None,
            Scope::Workload(id) => Some(id.uuid()),
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Estate => f.write_str("estate"),
            Scope::Workload(id) => write!(f, "workload {id}"),
        }
    }
}

/// One stored set, as the CLI and the API show it.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct ManagementView {
    /// Absent: the estate's set.
    #[schema(value_type = Option<String>)]
    pub workload_id: Option<Uuid>,
    pub cidrs: Vec<String>,
    /// Service entries, e.g. `tcp:22`.
    pub services: Vec<String>,
    pub updated_at: DateTime<Utc>,
    pub updated_by: String,
}

/// The estate's set (if any) and every workload narrowing, workloads in id order.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ManagementListing {
    pub estate: Option<ManagementView>,
    pub workloads: Vec<ManagementView>,
}

fn texts(management: &Management) -> (Vec<String>, Vec<String>) {
    let cidrs = management.cidrs().iter().map(ToString::to_string).collect();
    let services = management.services().iter().map(ToString::to_string).collect();
    (cidrs, services)
}

/// The stored set of `scope`, locked for the change (in a transaction).
async fn current(conn: &mut PgConnection, scope: Scope) -> Result<Option<Management>, Error> {
    let row: Option<(Vec<String>, Vec<String>)> = sqlx::query_as(
        "SELECT cidrs::text[], services FROM management_access WHERE workload_id IS NOT DISTINCT FROM $1 FOR UPDATE",
    )
    .bind(scope.workload())
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|(c, s)| store::management_set(&c, &s)).transpose()
}

async fn store(conn: &mut PgConnection, scope: Scope, set: &Management, actor: &str) -> Result<(), Error> {
    let (cidrs, services) = texts(set);
    let workload = scope.workload();
    let updated = sqlx::query(
        "UPDATE management_access SET cidrs = $2::text[]::cidr[], services = $3, updated_at = now(), updated_by = $4
         WHERE workload_id IS NOT DISTINCT FROM $1",
    )
    .bind(workload)
    .bind(&cidrs)
    .bind(&services)
    .bind(actor)
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() == 0 {
        sqlx::query(
            "INSERT INTO management_access (workload_id, cidrs, services, updated_by)
             VALUES ($1, $2::text[]::cidr[], $3, $4)",
        )
        .bind(workload)
        .bind(&cidrs)
        .bind(&services)
        .bind(actor)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

fn detail(scope: Scope, set: &Management) -> serde_json::Value {
    let (cidrs, services) = texts(set);
    json!({"scope": scope.to_string(), "cidrs": cidrs, "services": services})
}

/// What [`seed`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seeded {
    /// None was stored; `set` is now the estate's.
    Stored,
    /// The stored set is `set`: nothing to do.
    Same,
    /// Another set is stored (narrowed or reset since); it stays, and this is it.
    Differs(Management),
}

/// `management.seed`: the estate's set from `serve --management-cidr`, stored if none is. A
/// different stored set stays (it may only have narrowed since); the caller says so.
pub async fn seed(pool: &PgPool, actor: &str, set: &Management) -> Result<Seeded, Error> {
    let mut conn = pool.acquire().await?;
    if let Some(stored) = current(&mut conn, Scope::Estate).await? {
        return Ok(if &stored == set { Seeded::Same } else { Seeded::Differs(stored) });
    }
    drop(conn);
    let seeded = commit(pool, actor, "management.seed", "estate", async |c| {
        // Two replicas starting together: the render lock orders them, and the second finds
        // the first's set and leaves it.
        crate::policy::publish::lock_renders(c).await?;
        if current(c, Scope::Estate).await?.is_some() {
            return Ok((false, json!({})));
        }
        store(c, Scope::Estate, set, actor).await?;
        Ok((true, detail(Scope::Estate, set)))
    })
    .await?;
    Ok(if seeded.value { Seeded::Stored } else { Seeded::Same })
}

/// `management.narrow`: `set` replaces the management access of `scope`, inside what it
/// replaces (a workload's first narrowing: inside the estate's set). Narrowing the estate's set
/// is refused while a workload's narrowing would fall outside it (narrow that one first), so a
/// narrowing is always inside the estate's set.
pub async fn narrow(
    pool: &PgPool,
    actor: &str,
    scope: Scope,
    set: &Management,
) -> Result<Committed<()>, Error> {
    commit(pool, actor, "management.narrow", &scope.to_string(), async |c| {
        let estate = current(c, Scope::Estate).await?.ok_or_else(|| {
            Error::Invalid(
                "no management access is set: start serve with --management-cidr, or set it with \
                 `innerwall management reset` on the database"
                    .into(),
            )
        })?;
        let replaced = match scope {
            Scope::Estate => estate,
            Scope::Workload(id) => {
                crate::policy::authoring::lock_live(c, id).await?;
                current(c, scope).await?.unwrap_or(estate)
            }
        };
        set.within(&replaced).map_err(|why| {
            Error::Invalid(format!(
                "management access of the {scope} can only be narrowed: {why} ({replaced}); nothing was changed"
            ))
        })?;
        if scope == Scope::Estate {
            let rows: Vec<(Uuid, Vec<String>, Vec<String>)> = sqlx::query_as(
                "SELECT workload_id, cidrs::text[], services FROM management_access
                 WHERE workload_id IS NOT NULL ORDER BY workload_id",
            )
            .fetch_all(&mut *c)
            .await?;
            for (workload, cidrs, services) in rows {
                if let Err(why) = store::management_set(&cidrs, &services)?.within(set) {
                    return Err(Error::Invalid(format!(
                        "workload {workload}'s management access would be outside the estate's: {why}; \
                         narrow that workload's first; nothing was changed"
                    )));
                }
            }
        }
        store(c, scope, set, actor).await?;
        Ok(((), detail(scope, set)))
    })
    .await
}

/// `management.reset`: the estate's set becomes `set`, whatever it was, and every workload's
/// narrowing is dropped (each then has the estate's). Offered only by the local CLI.
pub async fn reset(pool: &PgPool, actor: &str, set: &Management) -> Result<Committed<()>, Error> {
    commit(pool, actor, "management.reset", "estate", async |c| {
        let before = current(c, Scope::Estate).await?;
        let dropped: Vec<Uuid> = sqlx::query_scalar(
            "DELETE FROM management_access WHERE workload_id IS NOT NULL RETURNING workload_id",
        )
        .fetch_all(&mut *c)
        .await?;
        store(c, Scope::Estate, set, actor).await?;
        let mut detail = detail(Scope::Estate, set);
        detail["before"] = json!(before.map(|b| b.to_string()));
        detail["narrowings_dropped"] = json!(dropped);
        Ok(((), detail))
    })
    .await
}

/// Every stored set: the estate's and each live workload's narrowing.
pub async fn list(conn: &mut PgConnection) -> Result<ManagementListing, Error> {
    let mut views: Vec<ManagementView> = sqlx::query_as(
        "SELECT m.workload_id, m.cidrs::text[] AS cidrs, m.services, m.updated_at, m.updated_by
         FROM management_access m LEFT JOIN workloads w ON w.id = m.workload_id
         WHERE m.workload_id IS NULL OR w.retired_at IS NULL ORDER BY m.workload_id NULLS FIRST",
    )
    .fetch_all(&mut *conn)
    .await?;
    let estate =
        if views.first().is_some_and(|v| v.workload_id.is_none()) { Some(views.remove(0)) } else { None };
    Ok(ManagementListing { estate, workloads: views })
}
