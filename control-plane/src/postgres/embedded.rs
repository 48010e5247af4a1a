//! The `innerwall` CLI's embedded default: one daemonized cluster under the state directory,
//! started on demand and shared by every invocation.

use std::path::Path;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};

use super::cluster::{Cluster, wait_until_accepting};
use super::url::{database_url, pick_free_port, quote_ident, redact_url};
use super::{DATABASE, Error, START_TIMEOUT, SUPERUSER, blocking};

/// How long a dead postmaster may stay a zombie before starting a new one is given up.
const REAP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The embedded default of the `innerwall` CLI: initializes the cluster under
/// `<state_dir>/postgres` if missing, starts it as a daemon that outlives this process if it is not
/// running, creates the `innerwall` database if missing and returns its URL.
///
/// Concurrent callers serialize on the cluster's lock file; the second finds the server running.
pub async fn embedded(state_dir: &Path) -> Result<String, Error> {
    let root = state_dir.join("postgres");
    let (cluster, port, password, lock) = blocking(move || {
        let cluster = Cluster::new(root)?;
        let lock = cluster.lock()?;
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
        }
        Ok((cluster, port, password, lock))
    })
    .await?;
    // The wait needs no lock: a concurrent caller finds the server running and waits too.
    drop(lock);
    let admin_url = database_url(SUPERUSER, &password, port, "postgres");
    wait_until_accepting(&admin_url, &cluster, port, START_TIMEOUT, || None).await?;
    ensure_database(&admin_url, DATABASE).await?;
    Ok(database_url(SUPERUSER, &password, port, DATABASE))
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
