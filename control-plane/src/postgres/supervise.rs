//! Supervision of the embedded cluster while `innerwall serve` runs on it (REL-5): a postmaster
//! that dies is noticed, logged and started again with backoff, and its return is logged.
//! While it is down, every database call fails after its pool's acquire timeout
//! ([`PoolConfig`](super::PoolConfig)), never hangs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use innerwall_wire::backoff;
use tokio::sync::watch;

use super::embedded::{embedded, embedded_cluster};
use super::{Error, Pools, blocking, redact_url};

/// How often the supervisor looks for the postmaster.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Restart attempts back off from this …
pub const RESTART_BASE: Duration = Duration::from_secs(1);
/// … to at most this, with full jitter.
pub const RESTART_CAP: Duration = Duration::from_secs(30);

/// What the supervisor last saw of the embedded server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Running as postmaster `pid`; `restarts` counts the restarts this supervisor made.
    Up { pid: u32, restarts: u64 },
    /// Found gone; `attempts` restarts have failed since, the last with `last_error`.
    Down { attempts: u32, last_error: Option<String> },
}

/// Watches the embedded cluster under a state directory and restarts it when it dies.
#[derive(Debug)]
pub struct Supervisor {
    state_dir: PathBuf,
    url: String,
    check_every: Duration,
    health: watch::Sender<Health>,
}

impl Supervisor {
    /// A supervisor for the cluster [`embedded`] started under `state_dir` and handed out as
    /// `url`. Fails when that cluster is not running.
    pub async fn new(state_dir: &Path, url: String) -> Result<Supervisor, Error> {
        let dir = state_dir.to_owned();
        let pid = blocking(move || {
            let cluster = embedded_cluster(&dir)?;
            cluster.postmaster_alive().ok_or_else(|| Error::NotRunning {
                path: cluster.root().to_owned(),
                detail: "it stopped before its supervisor started".into(),
            })
        })
        .await?;
        let (health, _) = watch::channel(Health::Up { pid, restarts: 0 });
        Ok(Supervisor { state_dir: state_dir.to_owned(), url, check_every: CHECK_EVERY, health })
    }

    /// Looks every `every` instead of every [`CHECK_EVERY`].
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    /// The supervisor's view, updated on every change (a test waits on it instead of sleeping).
    pub fn health(&self) -> watch::Receiver<Health> {
        self.health.subscribe()
    }

    /// Runs until dropped (abort its task): looks for the postmaster every interval; when it is
    /// gone, restarts it with backoff and points `pools` at it again if its port changed.
    pub async fn run(mut self, pools: Pools) {
        let mut restarts = 0u64;
        let mut known = match *self.health.borrow() {
            Health::Up { pid, .. } => pid,
            Health::Down { .. } => 0,
        };
        loop {
            tokio::time::sleep(self.check_every).await;
            match self.alive().await {
                Ok(Some(pid)) if pid == known => continue,
                Ok(Some(pid)) => {
                    // Another process (an `innerwall` command finding it stopped) started it.
                    tracing::warn!(
                        old = known,
                        new = pid,
                        "the embedded postgres was restarted by another process"
                    );
                    known = pid;
                    self.health.send_replace(Health::Up { pid, restarts });
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("cannot look for the embedded postgres: {e:#}");
                    continue;
                }
            }
            tracing::error!(
                pid = known,
                state_dir = %self.state_dir.display(),
                "the embedded postgres is not running: database calls fail until it is back; restarting it"
            );
            let down_since = Instant::now();
            self.health.send_replace(Health::Down { attempts: 0, last_error: None });
            let mut attempt = 0u32;
            let pid = loop {
                match self.restart(&pools).await {
                    Ok(pid) => break pid,
                    Err(e) => {
                        attempt += 1;
                        let wait = backoff::wait(attempt, RESTART_BASE, RESTART_CAP, backoff::random_unit());
                        tracing::error!(
                            attempt,
                            "restarting the embedded postgres failed (next attempt in {wait:?}): {e:#}"
                        );
                        self.health.send_replace(Health::Down {
                            attempts: attempt,
                            last_error: Some(format!("{e:#}")),
                        });
                        tokio::time::sleep(wait).await;
                    }
                }
            };
            restarts += 1;
            known = pid;
            tracing::warn!(pid, attempts = attempt + 1, down_for = ?down_since.elapsed(), "the embedded postgres is back");
            self.health.send_replace(Health::Up { pid, restarts });
        }
    }

    /// The running postmaster's pid, if one runs.
    async fn alive(&self) -> Result<Option<u32>, Error> {
        let dir = self.state_dir.clone();
        blocking(move || Ok(embedded_cluster(&dir)?.postmaster_alive())).await
    }

    /// Starts the cluster the way every `innerwall` command does (under its lock, so a command
    /// started meanwhile and this restart do not both start it), then follows a port change.
    async fn restart(&mut self, pools: &Pools) -> Result<u32, Error> {
        let url = embedded(&self.state_dir).await?;
        if url != self.url {
            tracing::warn!(url = %redact_url(&url), "the embedded postgres moved to another port");
            pools.set_url(&url)?;
            self.url = url;
        }
        self.alive().await?.ok_or_else(|| Error::NotRunning {
            path: self.state_dir.join("postgres"),
            detail: "it stopped again right after it started".into(),
        })
    }
}
