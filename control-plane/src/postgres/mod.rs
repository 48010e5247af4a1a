//! PostgreSQL for the control plane: a private cluster run from the system's server binaries
//! (the `innerwall` CLI's embedded default and the test harness's server) and the migrated pool.
//!
//! A cluster directory holds:
//!
//! ```text
//! <root>/lock        flock'ed while a process inits, starts or stops the cluster
//! <root>/port        the TCP port on 127.0.0.1, chosen once and reused by later invocations
//! <root>/password    the superuser's password (0600, owned by the invoking user)
//! <root>/server.log  the server's log
//! <root>/data/       PGDATA, owned by the server user
//! <root>/run/        the server's unix socket directory
//! ```
//!
//! The server never runs as root (`initdb` and `postgres` refuse to): a root caller runs it as the
//! dedicated system user [`SERVER_USER`], created on first use.
//!
//! Authentication: TCP on 127.0.0.1 takes the superuser's SCRAM password, because any local
//! account can open a TCP connection there and `trust` would make it superuser. The unix socket
//! uses `trust`: its directory is 0700, so only the server user and root reach it. The CLI hands
//! out the TCP URL (with password); the test harness uses the socket, which spares every test
//! connection a SCRAM exchange (tens of milliseconds in debug builds).
//!
//! Where things live: `cluster` (one cluster directory: binaries, init, start, stop, wait),
//! `child` (a server that dies with this process), `system_user` (the account the server runs
//! as), `embedded` (the CLI's default database), `supervise` (restarting it under `serve`),
//! `test_server` (the test harness's private server) and `url` (URLs, ports, identifiers). This
//! file keeps the shared constants, the module's [`Error`] and the migrated pools (one per job); the submodules are private and everything public is
//! re-exported here.

mod child;
mod cluster;
mod embedded;
mod schema;
mod supervise;
mod system_user;
mod test_server;
mod url;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

pub use self::child::ChildServer;
pub use self::cluster::{Binaries, Cluster};
pub use self::embedded::{Create, Session, embedded, embedded_cluster};
pub use self::schema::{Applied, Migrated, Plan, Problem, applied, grant_runtime, migrate, plan, plan_build};
pub use self::supervise::{Health, Supervisor};
pub use self::system_user::ServerUser;
pub use self::test_server::TestCluster;
pub use self::url::{
    database_url, parse_port, pick_free_port, quote_ident, redact_url, socket_url, with_database,
};

/// The control plane's schema, embedded at compile time.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// The unprivileged system account a root caller runs the server as.
pub const SERVER_USER: &str = "innerwall";
/// The cluster's superuser role.
pub const SUPERUSER: &str = "innerwall";
/// The database the embedded cluster serves to the control plane.
pub const DATABASE: &str = "innerwall";

const START_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "`{binary}` not found on PATH or in /usr/lib/postgresql/*/bin: install the PostgreSQL server \
         (apt install postgresql-15) or pass --database-url"
    )]
    BinaryNotFound { binary: &'static str },
    #[error(
        "postgres cannot run as root and the system user {user:?} is missing and could not be created \
         ({detail}): create it with `useradd --system --no-create-home --shell /usr/sbin/nologin {user}` \
         or run as an unprivileged user"
    )]
    ServerUser { user: String, detail: String },
    #[error(
        "{path} is not reachable by the server user {user:?} (a directory on the way lacks search \
         permission): put the state directory under /var/lib or /tmp, or `chmod o+x` its parents"
    )]
    NotReachable { path: PathBuf, user: String },
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}):\n{output}")]
    Command { command: String, status: String, output: String },
    #[error("invalid port file {path}: {content:?}; delete it to pick a new port")]
    PortFile { path: PathBuf, content: String },
    #[error(
        "cluster directory {path} is damaged ({what}): stop any server using it and delete the \
         directory to start over"
    )]
    Damaged { path: PathBuf, what: String },
    #[error(
        "no Innerwall database under {path} (no {path}/postgres/initialized): check --state-dir \
         (or INNERWALL_STATE_DIR); to create one there, run `innerwall migrate` or `innerwall serve` \
         with it, or pass --init"
    )]
    NoCluster { path: PathBuf },
    #[error("the embedded postgres in {path} is not running: {detail}; its log is server.log there")]
    NotRunning { path: PathBuf, detail: String },
    #[error("port {port} on 127.0.0.1 is in use; server log {log} ends with:\n{log_tail}")]
    PortInUse { port: u16, log: PathBuf, log_tail: String },
    #[error(
        "postgres in {data_dir} did not accept connections on 127.0.0.1:{port} within {waited:?}; \
         server log {log} ends with:\n{log_tail}"
    )]
    StartTimeout { data_dir: PathBuf, port: u16, waited: Duration, log: PathBuf, log_tail: String },
    #[error(
        "postgres in {data_dir} exited while starting ({status}); server log {log} ends with:\n{log_tail}"
    )]
    Exited { data_dir: PathBuf, status: String, log: PathBuf, log_tail: String },
    #[error(
        "cannot connect to {url}: check that the server runs and that the URL's host, port, user, \
         password and database are right"
    )]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("migrating the database at {url} failed: fix the migration or the database, then retry")]
    Migrate {
        url: String,
        #[source]
        source: MigrateError,
    },
    #[error("the database at {url} cannot be served by this build: {problem}")]
    Schema { url: String, problem: Problem },
    #[error(
        "the database at {url} lacks migrations {pending:?} of this build, and role {role} may not create \
         objects in its schema: run `innerwall migrate` with the schema owner's URL (and \
         `--runtime-role {role}`), then start this again"
    )]
    MigrationsPending { url: String, role: String, pending: Vec<i64> },
    #[error("cannot grant role {role} a replica's privileges: {reason}")]
    RuntimeRole { role: String, reason: &'static str },
    #[error("{action} failed")]
    Sql {
        action: String,
        #[source]
        source: sqlx::Error,
    },
}

fn io_error(action: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { action, path: path.into(), source }
}

/// Connects to `url` and brings its schema up to date with [`MIGRATOR`]: one pool with the
/// authoring settings ([`PoolConfig::AUTHORING`], ten connections), as the CLI uses.
pub async fn connect(url: &str) -> Result<PgPool, Error> {
    let pool = pool_options()
        .connect(url)
        .await
        .map_err(|source| Error::Connect { url: redact_url(url), source })?;
    report(&migrate(&pool, url, &|_| {}).await?);
    Ok(pool)
}

/// Logs a schema newer than this build's, which it serves (expand/contract).
fn report(migrated: &Migrated) {
    if !migrated.ahead.is_empty() {
        tracing::warn!(
            ahead = ?migrated.ahead,
            "the database has migrations newer than this build; serving it as the previous release \
             (upgrade this replica)"
        );
    }
}

/// Bounds on what one database connection may wait for (issue 16): no statement, lock wait or
/// idle transaction holds the control plane up without limit. A CLI suspended in the middle of
/// a commit loses its transaction (and the render lock) after `idle_in_transaction`; a render
/// that cannot get the lock within `lock` fails and says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub statement: Duration,
    pub lock: Duration,
    pub idle_in_transaction: Duration,
}

impl Default for Timeouts {
    /// The authoring settings: long enough for a render of 10,000 workloads.
    fn default() -> Self {
        PoolConfig::AUTHORING.timeouts
    }
}

/// One pool's settings: its size, the [`Timeouts`] of every connection it opens, and how long a
/// caller waits for a connection (a stopped server or a full pool fails the call after this).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    pub size: u32,
    pub timeouts: Timeouts,
    pub acquire: Duration,
}

impl PoolConfig {
    /// Agent streams (Hello, state records, heartbeats, the liveness sweep, the NOTIFY bridge):
    /// single-row statements that take milliseconds. Short bounds give a stuck connection back
    /// soon, and a stream whose write fails ends and is redialed. The lock wait still outlasts
    /// the row lock an authoring change holds on a workload while it renders (PERF-1: < 1 s).
    pub const STREAMS: PoolConfig = PoolConfig {
        size: 8,
        timeouts: Timeouts {
            statement: Duration::from_secs(15),
            lock: Duration::from_secs(10),
            idle_in_transaction: Duration::from_secs(15),
        },
        acquire: Duration::from_secs(10),
    };
    /// Flow ingest and retention: a window of up to 100,000 records in one `COPY` (PERF-7:
    /// 100,000 records/s), so moderate bounds; few connections, so a flood of uploads waits for
    /// its own pool and never for the streams' or authoring's.
    pub const INGEST: PoolConfig = PoolConfig {
        size: 4,
        timeouts: Timeouts {
            statement: Duration::from_secs(30),
            lock: Duration::from_secs(10),
            idle_in_transaction: Duration::from_secs(30),
        },
        acquire: Duration::from_secs(10),
    };
    /// Authoring and renders (enrollment, inventory changes, renewal, the startup render, the
    /// CLI): a publish of 10,000 workloads fits the statement bound many times over; renders
    /// serialize on the render lock, so more connections would only queue there.
    pub const AUTHORING: PoolConfig = PoolConfig {
        size: 4,
        timeouts: Timeouts {
            statement: Duration::from_secs(60),
            lock: Duration::from_secs(15),
            idle_in_transaction: Duration::from_secs(60),
        },
        acquire: Duration::from_secs(10),
    };

    /// The pool options of this configuration.
    pub fn options(&self) -> PgPoolOptions {
        pool_options_with(self.timeouts).max_connections(self.size).acquire_timeout(self.acquire)
    }
}

/// The settings of the three pools of one replica ([`Pools`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolsConfig {
    pub streams: PoolConfig,
    pub ingest: PoolConfig,
    pub authoring: PoolConfig,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        PoolsConfig {
            streams: PoolConfig::STREAMS,
            ingest: PoolConfig::INGEST,
            authoring: PoolConfig::AUTHORING,
        }
    }
}

/// A replica's connections, one pool per job (REL-5), so that one job cannot take every
/// connection from the others: a flood of flow uploads waits in `ingest` while stream state
/// writes and enrollment go on. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Pools {
    /// Agent streams: Hello, state records, heartbeats, liveness, the NOTIFY bridge.
    pub streams: PgPool,
    /// Flow ingest and retention.
    pub ingest: PgPool,
    /// Authoring and renders: enrollment, renewal, inventory renders, the startup render.
    pub authoring: PgPool,
}

impl Pools {
    /// Opens the three pools on `url` and migrates (through `authoring`).
    pub async fn connect(url: &str, config: &PoolsConfig) -> Result<Pools, Error> {
        let open = async |c: &PoolConfig| {
            c.options().connect(url).await.map_err(|source| Error::Connect { url: redact_url(url), source })
        };
        let authoring = open(&config.authoring).await?;
        report(&migrate(&authoring, url, &|_| {}).await?);
        Ok(Pools { streams: open(&config.streams).await?, ingest: open(&config.ingest).await?, authoring })
    }

    /// One pool serving every job (tests, tools): no isolation between jobs.
    pub fn shared(pool: PgPool) -> Pools {
        Pools { streams: pool.clone(), ingest: pool.clone(), authoring: pool }
    }

    /// Points every pool at `url` from the next connection on (the embedded cluster moved to
    /// another port); connections already open stay until they fail.
    pub fn set_url(&self, url: &str) -> Result<(), Error> {
        let options: PgConnectOptions =
            url.parse().map_err(|source| Error::Connect { url: redact_url(url), source })?;
        for pool in [&self.streams, &self.ingest, &self.authoring] {
            pool.set_connect_options(options.clone());
        }
        Ok(())
    }
}

/// The pool settings [`connect`] uses; callers that manage migrations themselves start from here.
pub fn pool_options() -> PgPoolOptions {
    pool_options_with(Timeouts::default())
}

/// [`pool_options`] with other timeouts, set on every connection the pool opens. JIT
/// compilation is off: the planner estimates a query over the daily flow partitions as
/// expensive enough to compile, and compiling costs more than it saves (a 1 h rollup over 10 M
/// records: 363 ms with it, 79 ms without).
pub fn pool_options_with(timeouts: Timeouts) -> PgPoolOptions {
    let settings = format!(
        "SET jit = off; SET statement_timeout = {}; SET lock_timeout = {}; \
         SET idle_in_transaction_session_timeout = {}",
        timeouts.statement.as_millis(),
        timeouts.lock.as_millis(),
        timeouts.idle_in_transaction.as_millis(),
    );
    PgPoolOptions::new()
        .max_connections(10)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _meta| {
            let settings = settings.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(settings)).execute(conn).await?;
                Ok(())
            })
        })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
