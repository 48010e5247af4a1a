//! Migrations and roles (issue 32, items 5 and 6): a replica runs as a least-privilege role that
//! owns nothing and may not create objects, the schema's owner migrates, and a database a later
//! release migrated (expand/contract) is served while one this build cannot serve is refused.

use chrono::{NaiveDate, TimeZone as _, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::postgres::{
    self, Error, Pools, PoolsConfig, Problem, quote_ident, with_database,
};
use innerwall_control_plane::testing::fresh_database;
use sqlx::{AssertSqlSafe, PgPool};

/// `url` with `user` (and `password`) in place of its own credentials.
fn as_user(url: &str, user: &str, password: &str) -> String {
    let start = url.find("://").unwrap() + 3;
    let rest = &url[start..];
    let at = rest[..rest.find(['/', '?']).unwrap_or(rest.len())].rfind('@').map_or(0, |i| i + 1);
    format!("{}{user}:{password}@{}", &url[..start], &rest[at..])
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned())).execute(pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn insufficient_privilege(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42501")
}

#[tokio::test]
async fn a_least_privilege_role_serves_and_only_the_owner_migrates() -> anyhow::Result<()> {
    let admin = fresh_database().await?;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let (owner, app, name) = (format!("iw_owner_{tag}"), format!("iw_app_{tag}"), format!("iw_roles_{tag}"));
    // As a DBA would: two login roles, neither a superuser, and a database the owner owns.
    exec(&admin.pool, &format!("CREATE ROLE {} LOGIN PASSWORD 'owner-pw'", quote_ident(&owner))).await;
    exec(&admin.pool, &format!("CREATE ROLE {} LOGIN PASSWORD 'app-pw'", quote_ident(&app))).await;
    exec(&admin.pool, &format!("CREATE DATABASE {} OWNER {}", quote_ident(&name), quote_ident(&owner))).await;
    let db_url = with_database(&admin.url, &name);
    let (owner_url, app_url) = (as_user(&db_url, &owner, "owner-pw"), as_user(&db_url, &app, "app-pw"));
    let superuser: String = sqlx::query_scalar("SELECT current_user::text").fetch_one(&admin.pool).await?;
    let result = drill(&owner_url, &app_url, &app, &superuser).await;

    exec(&admin.pool, &format!("DROP DATABASE {} WITH (FORCE)", quote_ident(&name))).await;
    for role in [&app, &owner] {
        exec(&admin.pool, &format!("DROP ROLE {}", quote_ident(role))).await;
    }
    result
}

async fn drill(owner_url: &str, app_url: &str, app: &str, superuser: &str) -> anyhow::Result<()> {
    // The replica's role cannot migrate a new database: refused, naming the fix, nothing made.
    let refused = Pools::connect(app_url, &PoolsConfig::default()).await.unwrap_err();
    let Error::MigrationsPending { role, pending, .. } = &refused else { panic!("{refused:?}") };
    assert_eq!(role, app);
    assert_eq!(pending.len(), postgres::MIGRATOR.iter().count());
    assert!(refused.to_string().contains("innerwall migrate"), "{refused}");
    let owner_pool = postgres::pool_options().connect(owner_url).await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&owner_pool)
        .await?;
    assert!(!exists, "a refused role created the migrations table");

    // The owner migrates and grants; a superuser or a missing role is never granted.
    let migrated = postgres::migrate(&owner_pool, owner_url, &|_| {}).await?;
    assert_eq!(&migrated.applied, pending);
    for (role, why) in [(superuser, "superuser"), ("iw_nobody_here", "no such role")] {
        let e = postgres::grant_runtime(&owner_pool, role).await.unwrap_err();
        assert!(e.to_string().contains(why), "{role}: {e}");
    }
    postgres::grant_runtime(&owner_pool, app).await?;
    postgres::grant_runtime(&owner_pool, app).await?; // idempotent

    // The replica's role serves: reads and writes rows, keeps the flow partitions through the
    // owner's functions, and can do nothing else to the schema.
    let pools = Pools::connect(app_url, &PoolsConfig::default()).await?;
    let pool = &pools.authoring;
    let ddl = sqlx::raw_sql("CREATE TABLE intruder (v int)").execute(pool).await.unwrap_err();
    assert!(insufficient_privilege(&ddl), "{ddl}");
    let drop = sqlx::raw_sql("DROP TABLE workloads").execute(pool).await.unwrap_err();
    assert!(insufficient_privilege(&drop), "{drop}");
    for history in [
        "UPDATE _sqlx_migrations SET checksum = '\\x01'",
        "DELETE FROM _sqlx_migrations",
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99990101000000, 'forged', true, '\\x00', 1)",
    ] {
        let e = sqlx::raw_sql(history).execute(pool).await.unwrap_err();
        assert!(insufficient_privilege(&e), "{history}: {e}");
    }
    let day = NaiveDate::from_ymd_opt(2020, 1, 2).unwrap();
    let at = Utc.from_utc_datetime(&day.and_hms_opt(12, 0, 0).unwrap());
    let mut tx = pool.begin().await?;
    flows::ensure_partitions(&mut tx, at, at).await?;
    tx.commit().await?;
    let made: bool =
        sqlx::query_scalar("SELECT to_regclass('flow_records_20200102') IS NOT NULL").fetch_one(pool).await?;
    assert!(made, "the runtime role's partition upkeep made no partition");
    for hostile in [
        "SELECT innerwall_ensure_partition('workloads', '2020-01-03')",
        "SELECT innerwall_drop_partition('workloads')",
        "SELECT innerwall_drop_partition('flow_records')",
    ] {
        let e = sqlx::raw_sql(hostile).execute(pool).await.unwrap_err();
        assert!(e.to_string().contains("not a"), "{hostile}: {e}");
    }
    let dropped = flows::apply_retention(pool, 30, at + chrono::Duration::days(40)).await?;
    assert!(dropped.contains(&"flow_records_20200102".to_owned()), "{dropped:?}");
    // The roll-up job stages each batch in a temporary table, which the role may create.
    assert_eq!(flows::roll_up(pool, Utc::now()).await?, 0);
    // The map's edge job marks its transaction as the edges' writer (a setting of its own).
    assert_eq!(flows::sum_edges(pool).await?, 0);
    let still: i64 = sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await?;
    assert_eq!(still, 0);
    pools.authoring.close().await;

    // A later release migrated the database (one migration more): this build serves it.
    exec(
        &owner_pool,
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99990101000000, 'a later release', true, '\\x00', 1)",
    )
    .await;
    let served = Pools::connect(app_url, &PoolsConfig::default()).await?;
    served.authoring.close().await;
    let migrated = postgres::migrate(&owner_pool, owner_url, &|_| {}).await?;
    assert_eq!((migrated.applied, migrated.ahead), (vec![], vec![99990101000000]));

    // A migration of this build applied differently, or one that failed: refused.
    let last = postgres::MIGRATOR.iter().map(|m| m.version).max().unwrap();
    exec(&owner_pool, &format!("UPDATE _sqlx_migrations SET checksum = '\\x01' WHERE version = {last}"))
        .await;
    let e = Pools::connect(app_url, &PoolsConfig::default()).await.unwrap_err();
    assert!(matches!(&e, Error::Schema { problem: Problem::Changed(v), .. } if *v == last), "{e:?}");
    owner_pool.close().await;
    Ok(())
}
