//! The Postgres test harness: every test that needs Postgres gets a fresh, migrated database of
//! its own from [`fresh_database`].
//!
//! The first call in a process starts a private server that dies with the process
//! ([`postgres::TestCluster`]), or uses the server at `INNERWALL_TEST_DATABASE_URL` (a role that
//! may `CREATE DATABASE`), and migrates a template database once. Each call then clones the
//! template (`CREATE DATABASE … TEMPLATE`), which takes milliseconds.
//!
//! Databases on the private server are left to die with it. On an external server each
//! [`TestDatabase`] drops its database when dropped; databases of a test process that crashed
//! stay behind (`iw_test_*`, safe to drop at any time when no tests run).
//!
//! `#[tokio::test]` gives every test a runtime of its own and a pool must not outlive the
//! runtime it was created in, so only the server URL is process-global and every call makes its
//! own pool.
//!
//! [`browser`] drives a real headless Chromium for the console's tests.

pub mod browser;
pub mod usage;

use std::io::Write;

use anyhow::{Context, anyhow};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{AssertSqlSafe, Connection};
use tokio::sync::OnceCell;

use crate::postgres::{self, MIGRATOR, quote_ident, redact_url, with_database};

/// Names an external server that tests use instead of starting their own.
pub const DATABASE_URL_ENV: &str = "INNERWALL_TEST_DATABASE_URL";

/// Serializes template creation across test processes sharing an external server.
const TEMPLATE_LOCK_KEY: i64 = 0x1a2e_7a11_7e57;

/// A database of one test's own, migrated with [`MIGRATOR`].
#[derive(Debug)]
pub struct TestDatabase {
    pub pool: PgPool,
    pub url: String,
    pub name: String,
    /// The admin URL to drop the database through on drop; set on external servers only.
    drop_via: Option<String>,
}

#[derive(Debug)]
struct Server {
    admin_url: String,
    template: String,
    external: bool,
    /// The private server's handle, kept for the life of the process.
    cluster: std::sync::Mutex<Option<postgres::TestCluster>>,
}

/// A failed start is kept as its message so every test fails with the cause, not only the first.
static SERVER: OnceCell<Result<Server, String>> = OnceCell::const_new();

/// A new database cloned from the migrated template. Fails, never skips, when no server can be
/// had (e.g. the PostgreSQL binaries are missing).
pub async fn fresh_database() -> anyhow::Result<TestDatabase> {
    let server = SERVER.get_or_init(|| async { start().await.map_err(|e| format!("{e:#}")) }).await;
    let server = server.as_ref().map_err(|e| anyhow!("the Postgres test harness could not start: {e}"))?;

    let name = format!("iw_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = admin_connection(&server.admin_url).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE DATABASE {} TEMPLATE {}",
        quote_ident(&name),
        quote_ident(&server.template)
    )))
    .execute(&mut admin)
    .await
    .with_context(|| format!("creating test database {name} from template {}", server.template))?;
    let _ = admin.close().await;

    let url = with_database(&server.admin_url, &name);
    let pool = postgres::pool_options()
        .max_connections(5)
        .connect(&url)
        .await
        .with_context(|| format!("connecting to test database {}", redact_url(&url)))?;
    Ok(TestDatabase { pool, url, name, drop_via: server.external.then(|| server.admin_url.clone()) })
}

/// Stops the private server this process started and removes its directory, when the process
/// exits (`exit`, which returning from `main` and the test harness's end both call), so a test or
/// benchmark process leaves nothing behind. A process killed outright cannot; the next test
/// process's start removes what it left ([`postgres::TestCluster::start`]).
extern "C" fn remove_private_server_at_exit() {
    let Some(Ok(server)) = SERVER.get() else { return };
    let cluster = server.cluster.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    if let Some(cluster) = cluster
        && let Err(e) = cluster.remove()
    {
        // No panic may unwind out of an exit handler.
        let _ = writeln!(std::io::stderr(), "the private test server was not removed: {e}");
    }
}

async fn start() -> anyhow::Result<Server> {
    let (admin_url, cluster) = match std::env::var(DATABASE_URL_ENV) {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let cluster = postgres::TestCluster::start().await.with_context(|| {
                format!("starting the private test server (or set {DATABASE_URL_ENV} to use a running one)")
            })?;
            // `start` runs once per process (`SERVER`), so the handler is registered once.
            #[allow(unsafe_code)]
            // SAFETY: `atexit` only records a function pointer; the handler is an `extern "C"`
            // function that takes no arguments and does not unwind.
            let registered = unsafe { libc::atexit(remove_private_server_at_exit) };
            if registered != 0 {
                let _ = cluster.remove();
                anyhow::bail!("registering the private test server's removal at exit failed");
            }
            (cluster.admin_url().to_owned(), Some(cluster))
        }
    };
    let template = template_name(&MIGRATOR);
    create_template(&admin_url, &template).await?;
    Ok(Server { admin_url, template, external: cluster.is_none(), cluster: std::sync::Mutex::new(cluster) })
}

async fn admin_connection(admin_url: &str) -> anyhow::Result<PgConnection> {
    PgConnection::connect(admin_url)
        .await
        .with_context(|| format!("connecting to the test server at {}", redact_url(admin_url)))
}

/// Creates and migrates `template` unless it exists. Other processes on the same server wait on
/// an advisory lock; a template is renamed into place only once fully migrated, so one left
/// half-built by a crashed process is never used.
async fn create_template(admin_url: &str, template: &str) -> anyhow::Result<()> {
    let mut admin = admin_connection(admin_url).await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(TEMPLATE_LOCK_KEY)
        .execute(&mut admin)
        .await
        .context("taking the template advisory lock")?;
    let result = create_template_locked(&mut admin, admin_url, template).await;
    let _ = admin.close().await;
    result
}

async fn create_template_locked(
    admin: &mut PgConnection,
    admin_url: &str,
    template: &str,
) -> anyhow::Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(template)
        .fetch_one(&mut *admin)
        .await
        .context("looking up the template database")?;
    if exists {
        return Ok(());
    }
    let building = format!("{template}_building");
    for sql in [
        format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(&building)),
        format!("CREATE DATABASE {}", quote_ident(&building)),
    ] {
        sqlx::raw_sql(AssertSqlSafe(sql.clone())).execute(&mut *admin).await.with_context(|| sql.clone())?;
    }
    let pool = postgres::pool_options()
        .max_connections(1)
        .connect(&with_database(admin_url, &building))
        .await
        .context("connecting to the template database")?;
    let migrated = MIGRATOR.run(&pool).await;
    pool.close().await;
    migrated.context("migrating the template database")?;
    let rename = format!("ALTER DATABASE {} RENAME TO {}", quote_ident(&building), quote_ident(template));
    sqlx::raw_sql(AssertSqlSafe(rename.clone())).execute(&mut *admin).await.context(rename)?;
    Ok(())
}

/// `iw_tpl_<hash>`, the hash over every migration's version and checksum: a changed migration
/// set gets a template of its own on a shared server.
fn template_name(migrator: &sqlx::migrate::Migrator) -> String {
    let mut hash = Fnv1a::default();
    for migration in migrator.iter() {
        hash.write(&migration.version.to_le_bytes());
        hash.write(&[u8::from(migration.migration_type.is_down_migration())]);
        hash.write(&migration.checksum);
    }
    format!("iw_tpl_{:016x}", hash.0)
}

/// FNV-1a, 64 bit: stable across builds and Rust versions, unlike std's `DefaultHasher`.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Some(admin_url) = self.drop_via.take() else { return };
        let name = self.name.clone();
        // Drop runs inside the test's runtime, which cannot block on a future; a thread with a
        // runtime of its own can, and joining it keeps the process alive until the drop is done.
        let dropped = std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let mut admin = admin_connection(&admin_url).await?;
                let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(&name));
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut admin).await?;
                let _ = admin.close().await;
                Ok(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: could not drop test database {}: {e:#}", self.name),
            Err(_) => eprintln!("warning: dropping test database {} panicked", self.name),
        }
    }
}

/// A replica for a test on loopback: `127.0.0.1:0`, named `localhost`, one-hour workload
/// certificates, every other setting at its default. Tests override fields with `..`.
pub fn loopback_service() -> crate::service::ServiceConfig {
    crate::service::ServiceConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        server_names: vec!["localhost".into()],
        cert_lifetime: std::time::Duration::from_secs(3600),
        server_cert_lifetime: crate::identity::server_cert::SERVER_CERT_LIFETIME,
        gateway: Default::default(),
        flow_bounds: Default::default(),
        limits: Default::default(),
        retention: Default::default(),
        metrics_listen: None,
    }
}

/// Adds service `svc-<n>` (tcp/8000+n) and ruleset `rs-<n>` allowing it from 192.0.2.0/24 to
/// every `app=web` workload: one new policy version for each of them, committed as the CLI does.
/// Every `app=web` workload admits `peer` on one port (a ruleset `rs-fleet` of its own).
pub async fn allow_from(pool: &PgPool, peer: crate::policy::spec::PeerSpec) -> anyhow::Result<()> {
    allow(pool, "svc-fleet", "rs-fleet", ("app", "web"), peer, "tcp:7999").await
}

pub async fn add_web_port(pool: &PgPool, n: u16) -> anyhow::Result<()> {
    use crate::policy::spec::PeerSpec;
    let (service, ruleset) = (format!("svc-{n}"), format!("rs-{n}"));
    let entry = format!("tcp:{}", 8000 + u32::from(n));
    allow(pool, &service, &ruleset, ("app", "web"), PeerSpec::cidr("192.0.2.0/24"), &entry).await
}

/// Creates service `name` with `entry` (e.g. `tcp:5432`) and ruleset `name` with one rule `r`
/// admitting it to the workloads labelled `scope` from the workloads labelled `peers`, committed
/// as the CLI does.
pub async fn admit(
    pool: &PgPool,
    name: &str,
    scope: (&str, &str),
    peers: (&str, &str),
    entry: &str,
) -> anyhow::Result<()> {
    use crate::policy::spec::PeerSpec;
    let peer = PeerSpec::workloads([(peers.0.to_owned(), vec![peers.1.to_owned()])].into());
    allow(pool, name, name, scope, peer, entry).await
}

async fn allow(
    pool: &PgPool,
    service: &str,
    ruleset: &str,
    scope: (&str, &str),
    peer: crate::policy::spec::PeerSpec,
    entry: &str,
) -> anyhow::Result<()> {
    use crate::policy::authoring;
    use crate::policy::spec::{RuleSpec, RulesetSpec, ServiceSpec};
    let service = ServiceSpec {
        name: service.to_owned(),
        description: String::new(),
        entries: vec![crate::policy::model::ServiceEntry::parse(entry)?],
    };
    let ruleset = RulesetSpec {
        name: ruleset.to_owned(),
        description: String::new(),
        enabled: true,
        scope: [(scope.0.to_owned(), vec![scope.1.to_owned()])].into(),
        rules: vec![RuleSpec {
            name: "r".into(),
            description: String::new(),
            enabled: true,
            peers: vec![peer],
            services: vec![service.name.clone()],
        }],
    };
    crate::foresight::commit(pool, "test", "ruleset.create", &ruleset.name, async |c| {
        authoring::create_service(c, &service).await?;
        authoring::create_ruleset(c, &ruleset).await?;
        Ok(((), serde_json::json!({})))
    })
    .await?;
    Ok(())
}

/// Stands in for agents' acknowledgements (and, where a test claims a version no render of its
/// made, for that render) for tests that upload synthetic windows without an agent: each
/// `(version, mode, at)` becomes a version `id` had (a history row with its latest content, if
/// it has none of that version) installed at `at`, written with the gateway's own
/// `flows::installs::record`. Tests of the installs themselves use a real agent's acks.
pub async fn installed(
    pool: &PgPool,
    id: innerwall_wire::identity::WorkloadId,
    versions: &[(u64, innerwall_wire::policy::Mode, chrono::DateTime<chrono::Utc>)],
) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    for (version, mode, at) in versions {
        sqlx::query(
            "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
             SELECT workload_id, $2, digest, $3 FROM workload_policies WHERE workload_id = $1
             ON CONFLICT DO NOTHING",
        )
        .bind(id.uuid())
        .bind(*version as i64)
        .bind(at)
        .execute(&mut *conn)
        .await
        .context("a history row for an installed version")?;
        crate::flows::installs::record(&mut conn, id, *version, *mode, Some(*at), Some(*at)).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_values() {
        fn check(input: &[u8], expected: u64) {
            let mut hash = Fnv1a::default();
            hash.write(input);
            assert_eq!(hash.0, expected, "{input:?}");
        }
        check(b"", 0xcbf2_9ce4_8422_2325);
        check(b"a", 0xaf63_dc4c_8601_ec8c);
        check(b"foobar", 0x8594_4171_f739_67e8);
    }

    #[test]
    fn template_name_changes_with_the_migration_set() {
        use sqlx::SqlSafeStr;
        use sqlx::migrate::{Migration, MigrationType, Migrator};
        let migration = |version, sql: &'static str| {
            Migration::new(
                version,
                "m".into(),
                MigrationType::Simple,
                AssertSqlSafe(sql).into_sql_str(),
                false,
            )
        };
        let a = template_name(&Migrator::with_migrations(vec![migration(1, "CREATE TABLE a ()")]));
        let b = template_name(&Migrator::with_migrations(vec![migration(1, "CREATE TABLE b ()")]));
        let empty = template_name(&Migrator::with_migrations(vec![]));
        assert!(a.starts_with("iw_tpl_") && a.len() == "iw_tpl_".len() + 16, "{a}");
        assert_ne!(a, b);
        assert_ne!(a, empty);
        assert_eq!(a, template_name(&Migrator::with_migrations(vec![migration(1, "CREATE TABLE a ()")])));
    }
}
