//! Rollback (issue 31): a workload goes back to the authored source of an earlier version — the
//! newest one a promotion's verdict judged clean (SAFE), or one named — rendered again as a
//! *new* version (numbers are never reused) against the registry as it is now, in the
//! workload's current mode, and with the current management access. The workload stays pinned
//! to that source (later authored changes do not reach it, and every list shows the pin) until
//! [`unpin`]. Each is one `foresight::commit`: rendered, judged by the policy tests, audited —
//! `workload.rollback` names the version it left and the version whose source it took, and its
//! record's versions the new one.

use std::collections::BTreeMap;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Version;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgConnection, PgPool};

use crate::error::Error;
use crate::foresight::commit;
use crate::gate::evidence::{self, Scope};
use crate::policy::authoring::{self, Committed};
use crate::policy::publish;

/// Which earlier version's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The newest earlier version a promotion record's verdict judged SAFE for the workload.
    LastClean,
    /// This version.
    Version(Version),
}

/// One workload rolled back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RolledBack {
    pub workload: String,
    /// Its latest version before the rollback.
    pub from_version: Version,
    /// The version whose authored source it now renders.
    pub source_of: Version,
    /// The new version (absent if the source renders what it has: nothing moved).
    pub version: Option<Version>,
}

/// The newest version before `before` whose verdict in a promotion record was SAFE for `id`.
async fn last_clean(conn: &mut PgConnection, id: WorkloadId, before: i64) -> Result<Option<i64>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT max((w->>'latest_version')::bigint) FROM promotions p, jsonb_array_elements(p.verdict->'workloads') w
         WHERE p.verdict IS NOT NULL AND w->>'id' = $1 AND jsonb_array_length(w->'reasons') = 0
           AND (w->>'latest_version')::bigint < $2",
    )
    .bind(id.to_string())
    .bind(before)
    .fetch_one(&mut *conn)
    .await?)
}

/// Pins `id` to the source of `target`; (latest version, the version whose source it took).
async fn pin(conn: &mut PgConnection, id: WorkloadId, target: Target) -> Result<(i64, i64), Error> {
    authoring::lock_live(conn, id).await?;
    let latest: i64 = sqlx::query_scalar("SELECT version FROM workload_policies WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| Error::Invalid(format!("workload {id} has no rendered policy to roll back")))?;
    let to = match target {
        Target::Version(v) => {
            let v = i64::try_from(v).unwrap_or(i64::MAX);
            if v >= latest {
                return Err(Error::Invalid(format!(
                    "workload {id} is at v{latest}: a rollback goes to an earlier version, not v{v}"
                )));
            }
            v
        }
        Target::LastClean => last_clean(conn, id, latest).await?.ok_or_else(|| {
            Error::Invalid(format!(
                "no version of workload {id} before v{latest} was judged SAFE by a promotion's verdict; \
                 name one with --to-version"
            ))
        })?,
    };
    let source: Option<Option<Vec<u8>>> = sqlx::query_scalar(
        "SELECT source_digest FROM workload_policy_history WHERE workload_id = $1 AND version = $2",
    )
    .bind(id.uuid())
    .bind(to)
    .fetch_optional(&mut *conn)
    .await?;
    let digest = match source {
        None => {
            return Err(Error::NotFound { what: "policy version", name: format!("v{to} of workload {id}") });
        }
        Some(None) => {
            return Err(Error::Invalid(format!(
                "v{to} of workload {id} was rendered before authored sources were kept: it cannot be rendered again"
            )));
        }
        Some(Some(digest)) => digest,
    };
    sqlx::query("UPDATE workloads SET pinned_source = $2, pinned_version = $3 WHERE id = $1")
        .bind(id.uuid())
        .bind(digest)
        .bind(to)
        .execute(&mut *conn)
        .await?;
    Ok((latest, to))
}

/// `workload.rollback`: every workload of `scope` (which must be `expect_count` of them) to the
/// source of its `target`, in one commit.
pub async fn rollback(
    pool: &PgPool,
    actor: &str,
    scope: &Scope,
    expect_count: usize,
    target: Target,
) -> Result<Committed<Vec<RolledBack>>, Error> {
    let mut done = commit(pool, actor, "workload.rollback", &scope.to_string(), async |c| {
        publish::lock_renders(c).await?;
        let members = evidence::resolve(c, scope).await?;
        if members.len() != expect_count {
            return Err(Error::CountMismatch {
                expected: expect_count,
                matched: members.len(),
                names: members.iter().map(evidence::Member::name).collect(),
            });
        }
        if members.is_empty() {
            return Err(Error::Invalid("the scope names no workload: nothing to roll back".into()));
        }
        let mut rolled = Vec::new();
        let mut detail = BTreeMap::new();
        for member in &members {
            let (from, to) = pin(c, member.id, target).await?;
            detail.insert(member.id.to_string(), json!({"from_version": from, "source_of": to}));
            rolled.push(RolledBack {
                workload: member.id.to_string(),
                from_version: from as Version,
                source_of: to as Version,
                version: None,
            });
        }
        Ok((rolled, json!({"workloads": detail})))
    })
    .await?;
    for r in &mut done.value {
        r.version = done.changed.iter().find(|c| c.workload.to_string() == r.workload).map(|c| c.version);
    }
    Ok(done)
}

/// `workload.unpin`: `id` renders from the rulesets again.
pub async fn unpin(pool: &PgPool, actor: &str, id: WorkloadId) -> Result<Committed<()>, Error> {
    commit(pool, actor, "workload.unpin", &id.to_string(), async |c| {
        authoring::lock_live(c, id).await?;
        let pinned: Option<i64> = sqlx::query_scalar("SELECT pinned_version FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(&mut *c)
            .await?;
        let Some(pinned) = pinned else {
            return Err(Error::Invalid(format!("workload {id} is not pinned by a rollback")));
        };
        sqlx::query("UPDATE workloads SET pinned_source = NULL, pinned_version = NULL WHERE id = $1")
            .bind(id.uuid())
            .execute(&mut *c)
            .await?;
        Ok(((), json!({"was_pinned_to_source_of": pinned})))
    })
    .await
}
