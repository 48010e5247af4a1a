//! The `innerwall` CLI's embedded default: one daemonized cluster under the state directory,
//! shared by every invocation. A command that finds it stopped starts it and stops it again when
//! it ends, unless another command or `serve` uses it by then ([`Session`]); a missing cluster
//! is created only when the caller says so ([`Create`]).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::Path;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};

use super::cluster::{Cluster, wait_until_accepting};
use super::url::{database_url, pick_free_port, quote_ident, redact_url};
use super::{DATABASE, Error, START_TIMEOUT, SUPERUSER, blocking, io_error};

/// How long a dead postmaster may stay a zombie before starting a new one is given up.
const REAP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Every [`Session`] holds this file (under `<state_dir>/postgres`) locked shared; the one that
/// ends holding the cluster lock and can lock it exclusively is the last user.
const USERS_FILE: &str = "users";
/// Present while the running server was started by a command that means to stop it again
/// (written by [`Session::open`] when it starts the server, removed by [`Session::adopt`]).
const STARTED_FOR_A_COMMAND: &str = "started-for-a-command";

/// Whether [`Session::open`] may initialize a cluster where there is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// Initialize one if missing (`serve`, `migrate`, `--init`, the library's [`embedded`]).
    Yes,
    /// Refuse a state directory without a cluster, naming it, and create nothing there: a
    /// mistyped `--state-dir` must not silently become an empty estate.
    No,
}

/// The embedded default of the `innerwall` CLI: initializes the cluster under
/// `<state_dir>/postgres` if missing, starts it as a daemon that outlives this process if it is not
/// running, creates the `innerwall` database if missing and returns its URL. The server keeps
/// running after the caller (as under `serve`): see [`Session`] for a command's use.
///
/// Concurrent callers serialize on the cluster's lock file; the second finds the server running.
pub async fn embedded(state_dir: &Path) -> Result<String, Error> {
    let mut session = Session::open(state_dir, Create::Yes).await?;
    session.adopt()?;
    session.users = None;
    Ok(session.url.clone())
}

/// One command's use of the embedded cluster: opened by [`Session::open`]; when it ends (dropped
/// or [`Session::end`]), the server is stopped if a command started it (not `serve`, not
/// [`embedded`]) and no other session uses it any more.
#[derive(Debug)]
pub struct Session {
    cluster: Cluster,
    url: String,
    /// This session's shared lock on [`USERS_FILE`]; `None` once ended.
    users: Option<File>,
}

impl Session {
    /// Opens the cluster under `<state_dir>/postgres` as [`embedded`] does, except that without
    /// [`Create::Yes`] a state directory with no cluster is refused before anything is created.
    pub async fn open(state_dir: &Path, create: Create) -> Result<Session, Error> {
        let root = state_dir.join("postgres");
        if create == Create::No
            && !root.join("initialized").exists()
            && !root.join("data").join("PG_VERSION").is_file()
        {
            return Err(Error::NoCluster { path: state_dir.to_owned() });
        }
        let (cluster, port, password, users) = blocking(move || {
            let cluster = Cluster::new(root)?;
            let lock = cluster.lock()?;
            // Taken under the cluster lock, so a session ending now either sees this one or
            // stopped the server before this one looks at it.
            let users = open_users(&cluster)?;
            users.lock_shared().map_err(io_error("lock", cluster.root().join(USERS_FILE)))?;
            if !cluster.is_initialized() {
                // A cluster that held data is never silently replaced by an empty one.
                if cluster.was_initialized() {
                    return Err(Error::Damaged {
                        path: cluster.root().to_owned(),
                        what: format!(
                            "{} is missing or incomplete, but this cluster was initialized before; restore it \
                             from a backup, or delete {} to start over with an empty database",
                            cluster.data_dir().display(),
                            cluster.root().display()
                        ),
                    });
                }
                if create == Create::No {
                    return Err(Error::NoCluster { path: state_dir_of(&cluster) });
                }
                cluster.init(true)?;
            }
            cluster.mark_initialized()?;
            let password = cluster.password()?;
            let mut port = cluster.port()?;
            let mut running = cluster.is_running()?;
            if running && cluster.postmaster_alive().is_none() {
                // Died moments ago and not reaped yet (a supervisor notices that fast).
                cluster.wait_until_reaped(REAP_TIMEOUT)?;
                running = false;
            }
            if running {
                // A running server says which port it has; a stale or lost port file is repaired
                // instead of sending every caller to the wrong port.
                if let Some(actual) = cluster.postmaster_port().filter(|p| *p != port) {
                    cluster.write_port(actual)?;
                    port = actual;
                }
            } else {
                let mut attempts = 0;
                loop {
                    match cluster.start_daemon(port) {
                        Ok(()) => break,
                        // After a reboot another program may hold the recorded port: move once.
                        Err(Error::PortInUse { .. }) if attempts < 3 => {
                            attempts += 1;
                            port = pick_free_port()?;
                            cluster.write_port(port)?;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let marker = cluster.root().join(STARTED_FOR_A_COMMAND);
                std::fs::write(&marker, "stopped by the last innerwall command using it\n")
                    .map_err(io_error("write", &marker))?;
            }
            drop(lock);
            Ok((cluster, port, password, users))
        })
        .await?;
        // From here on an error ends the session, which stops a server this call started.
        let session =
            Session { cluster, url: database_url(SUPERUSER, &password, port, DATABASE), users: Some(users) };
        // The wait needs no lock: a concurrent caller finds the server running and waits too.
        let admin_url = database_url(SUPERUSER, &password, port, "postgres");
        wait_until_accepting(&admin_url, &session.cluster, port, START_TIMEOUT, || None).await?;
        ensure_database(&admin_url, DATABASE).await?;
        Ok(session)
    }

    /// The `innerwall` database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Keeps the server running after this session, whoever started it (`serve`).
    pub fn adopt(&self) -> Result<(), Error> {
        let marker = self.cluster.root().join(STARTED_FOR_A_COMMAND);
        match std::fs::remove_file(&marker) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error("remove", marker)(e)),
        }
    }

    /// Ends the session: stops the server if a command started it and no other session uses it;
    /// whether it stopped it. Blocks (`pg_ctl stop`), as a command's last step.
    pub fn end(mut self) -> Result<bool, Error> {
        self.finish()
    }

    fn finish(&mut self) -> Result<bool, Error> {
        let Some(users) = self.users.take() else { return Ok(false) };
        let lock = self.cluster.lock()?;
        drop(users);
        let others = open_users(&self.cluster)?;
        match others.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Error(e)) => {
                return Err(io_error("lock", self.cluster.root().join(USERS_FILE))(e));
            }
        }
        let marker = self.cluster.root().join(STARTED_FOR_A_COMMAND);
        if !marker.exists() {
            return Ok(false);
        }
        self.cluster.stop()?;
        std::fs::remove_file(&marker).map_err(io_error("remove", &marker))?;
        drop(lock);
        Ok(true)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!("could not stop the embedded database this command started: {e}");
        }
    }
}

fn open_users(cluster: &Cluster) -> Result<File, Error> {
    let path = cluster.root().join(USERS_FILE);
    OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(io_error("open", &path))
}

/// The state directory `cluster` is the `postgres` directory of.
fn state_dir_of(cluster: &Cluster) -> std::path::PathBuf {
    cluster.root().parent().unwrap_or(cluster.root()).to_owned()
}

/// The cluster [`embedded`] manages for `state_dir`, e.g. to stop it.
pub fn embedded_cluster(state_dir: &Path) -> Result<Cluster, Error> {
    Cluster::new(state_dir.join("postgres"))
}

async fn ensure_database(admin_url: &str, database: &str) -> Result<(), Error> {
    let mut conn = PgConnection::connect(admin_url)
        .await
        .map_err(|source| Error::Connect { url: redact_url(admin_url), source })?;
    let exists = async |conn: &mut PgConnection| -> Result<bool, Error> {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(database)
            .fetch_one(conn)
            .await
            .map_err(|source| Error::Sql { action: format!("looking up database {database:?}"), source })
    };
    if !exists(&mut conn).await? {
        let created = sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {}", quote_ident(database))))
            .execute(&mut conn)
            .await;
        // A concurrent caller may have created it first (callers wait for the server without
        // the cluster lock): then it exists, whatever error this attempt got.
        if let Err(source) = created
            && !exists(&mut conn).await?
        {
            return Err(Error::Sql { action: format!("creating database {database:?}"), source });
        }
    }
    let _ = conn.close().await;
    Ok(())
}
