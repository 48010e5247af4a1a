//! The schema's version as this build sees it, and bringing it up to date (RUN-8, RUN-9, issue 32).
//!
//! Migrations are expand/contract: a release's migrations only add (tables, columns with
//! defaults, indexes, functions), so the previous release's replicas keep serving a database
//! the next release migrated. Hence a database *ahead* of this build (every migration of this
//! build applied, and newer ones besides) is served as it is, with a notice, instead of refused
//! as sqlx's migrator would. A database *behind* it is migrated — only when the role may create
//! objects in the schema; a least-privilege role (no DDL) is refused with the command that
//! migrates named, and changes nothing. `migrate --runtime-role ROLE` grants that role what a
//! replica needs, and only that.

use std::collections::BTreeMap;

use sqlx::{PgConnection, PgPool};

use super::{Error, MIGRATOR, quote_ident, redact_url};

/// How the database's applied migrations stand against this build's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Every migration of this build is applied; `ahead` are newer ones this build does not know
    /// (a later release migrated the database), served under the expand/contract promise.
    Current { ahead: Vec<i64> },
    /// This build's migrations the database lacks, oldest first.
    Behind { pending: Vec<i64> },
}

/// Why a database's migration history cannot be served by this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error(
        "migration {0} failed part-way when it was last applied: restore the database from the dump \
         taken before migrating (`innerwall backup restore`), or repair it by hand, then retry"
    )]
    Dirty(i64),
    #[error(
        "migration {0} as applied to the database differs from this build's: the database was migrated \
         by another build; run the build that migrated it"
    )]
    Changed(i64),
    #[error(
        "the database has migrations this build does not know ({ahead:?}) but lacks ones it has \
         ({pending:?}): the two histories diverged; run the newest release"
    )]
    Diverged { ahead: Vec<i64>, pending: Vec<i64> },
}

/// One applied migration as `_sqlx_migrations` records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub version: i64,
    pub checksum: Vec<u8>,
    pub success: bool,
}

/// Compares `applied` with `known` (this build's `(version, checksum)`s). Pure.
pub fn plan(applied: &[Applied], known: &[(i64, &[u8])]) -> Result<Plan, Problem> {
    let known: BTreeMap<i64, &[u8]> = known.iter().copied().collect();
    let mut ahead = Vec::new();
    for a in applied {
        if !a.success {
            return Err(Problem::Dirty(a.version));
        }
        match known.get(&a.version) {
            Some(checksum) if *checksum != a.checksum.as_slice() => return Err(Problem::Changed(a.version)),
            Some(_) => {}
            None => ahead.push(a.version),
        }
    }
    let applied: std::collections::BTreeSet<i64> = applied.iter().map(|a| a.version).collect();
    let pending: Vec<i64> = known.keys().copied().filter(|v| !applied.contains(v)).collect();
    ahead.sort_unstable();
    match (ahead.is_empty(), pending.is_empty()) {
        (_, true) => Ok(Plan::Current { ahead }),
        (true, false) => Ok(Plan::Behind { pending }),
        (false, false) => Err(Problem::Diverged { ahead, pending }),
    }
}

/// The migrations applied to the database behind `conn` (none for a new database).
pub async fn applied(conn: &mut PgConnection) -> Result<Vec<Applied>, sqlx::Error> {
    // A new database has no migrations table: checked first, as a query naming it would fail.
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, Vec<u8>, bool)> =
        sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
    Ok(rows.into_iter().map(|(version, checksum, success)| Applied { version, checksum, success }).collect())
}

/// [`plan`] of `applied` against this build's migrations ([`MIGRATOR`]).
pub fn plan_build(applied: &[Applied]) -> Result<Plan, Problem> {
    let known: Vec<(i64, &[u8])> = MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| (m.version, &*m.checksum))
        .collect();
    plan(applied, &known)
}

/// What [`migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    /// The migrations it applied, oldest first.
    pub applied: Vec<i64>,
    /// Newer migrations than this build's, found applied and left alone.
    pub ahead: Vec<i64>,
}

/// Brings the database behind `pool` (reached by `url`, for messages) up to this build's
/// schema: nothing when it is current or ahead; the pending migrations when it is behind and
/// the role may create objects in its schema; else an error naming what is pending and how to
/// migrate, having changed nothing. Each migration is reported to `progress` as it starts.
pub async fn migrate(pool: &PgPool, url: &str, progress: &dyn Fn(&str)) -> Result<Migrated, Error> {
    let sql = |action: &str| {
        let action = action.to_owned();
        move |source| Error::Sql { action, source }
    };
    let mut conn = pool.acquire().await.map_err(sql("reading the applied migrations"))?;
    let applied = applied(&mut conn).await.map_err(sql("reading the applied migrations"))?;
    let plan = plan_build(&applied).map_err(|problem| Error::Schema { url: redact_url(url), problem })?;
    let pending = match plan {
        Plan::Current { ahead } => return Ok(Migrated { applied: Vec::new(), ahead }),
        Plan::Behind { pending } => pending,
    };
    let (role, may_create): (String, bool) = sqlx::query_as(
        "SELECT current_user::text, coalesce(has_schema_privilege(current_schema(), 'CREATE'), false)",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(sql("reading the role's privileges"))?;
    if !may_create {
        return Err(Error::MigrationsPending { url: redact_url(url), role, pending });
    }
    drop(conn);
    for version in &pending {
        let description = MIGRATOR.iter().find(|m| m.version == *version).map_or("", |m| &*m.description);
        progress(&format!("applying migration {version} ({description})"));
        MIGRATOR
            .run_to(*version, pool)
            .await
            .map_err(|source| Error::Migrate { url: redact_url(url), source })?;
    }
    Ok(Migrated { applied: pending, ahead: Vec::new() })
}

/// Grants `role` what a replica needs and nothing more: reading and writing the rows of every
/// table, the sequences, and the functions the schema offers (the flow partitions' upkeep runs
/// through them, as their owner). Idempotent; run after each migration (`innerwall migrate
/// --runtime-role`), so tables a migration adds are covered too.
pub async fn grant_runtime(pool: &PgPool, role: &str) -> Result<(), Error> {
    let sql = |action: String| move |source| Error::Sql { action, source };
    let (exists, superuser): (bool, bool) = sqlx::query_as(
        "SELECT count(*) > 0, coalesce(bool_or(rolsuper), false) FROM pg_roles WHERE rolname = $1",
    )
    .bind(role)
    .fetch_one(pool)
    .await
    .map_err(sql(format!("looking up role {role}")))?;
    if !exists {
        return Err(Error::RuntimeRole { role: role.to_owned(), reason: "no such role: create it first" });
    }
    if superuser {
        return Err(Error::RuntimeRole {
            role: role.to_owned(),
            reason: "it is a superuser: a replica's role must not be one (it would gain every privilege)",
        });
    }
    let role = quote_ident(role);
    let mut tx = pool.begin().await.map_err(sql("granting the runtime role".into()))?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut *tx)
        .await
        .map_err(sql("reading the current schema".into()))?;
    let schema = quote_ident(&schema);
    for grant in [
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"),
        format!("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
        format!("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role}"),
        // A replica reads the migration history to check the schema; only `migrate` (the
        // owner) writes it. A replica that could rewrite it could make the next start refuse
        // the database or hide a migration that failed.
        format!("REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {schema}._sqlx_migrations FROM {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(grant.clone())).execute(&mut *tx).await.map_err(sql(grant))?;
    }
    tx.commit().await.map_err(sql("granting the runtime role".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(version: i64, checksum: &[u8]) -> Applied {
        Applied { version, checksum: checksum.to_vec(), success: true }
    }

    const KNOWN: &[(i64, &[u8])] = &[(1, b"a"), (2, b"b"), (3, b"c")];

    #[test]
    fn a_database_behind_lists_what_is_pending() {
        assert_eq!(plan(&[], KNOWN), Ok(Plan::Behind { pending: vec![1, 2, 3] }));
        assert_eq!(plan(&[applied(1, b"a")], KNOWN), Ok(Plan::Behind { pending: vec![2, 3] }));
    }

    #[test]
    fn a_database_ahead_is_served_with_what_it_has_beyond() {
        let all = [applied(1, b"a"), applied(2, b"b"), applied(3, b"c")];
        assert_eq!(plan(&all, KNOWN), Ok(Plan::Current { ahead: vec![] }));
        let ahead =
            [applied(1, b"a"), applied(2, b"b"), applied(3, b"c"), applied(5, b"e"), applied(4, b"d")];
        assert_eq!(plan(&ahead, KNOWN), Ok(Plan::Current { ahead: vec![4, 5] }));
    }

    #[test]
    fn a_history_this_build_cannot_serve_is_refused() {
        let failed = [applied(1, b"a"), Applied { version: 2, checksum: b"b".to_vec(), success: false }];
        assert_eq!(plan(&failed, KNOWN), Err(Problem::Dirty(2)));
        assert_eq!(plan(&[applied(1, b"x")], KNOWN), Err(Problem::Changed(1)));
        let diverged = [applied(1, b"a"), applied(4, b"d")];
        assert_eq!(plan(&diverged, KNOWN), Err(Problem::Diverged { ahead: vec![4], pending: vec![2, 3] }));
    }
}
