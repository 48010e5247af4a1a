//! `innerwall-agent run`, the process's tasks and their lifetime: fail static first (re-apply
//! the persisted policy before dialing anything, ENF-5), then hold the policy stream to the
//! control plane under full-jitter backoff (SYNC-10), check the owned table for drift on a
//! timer (ENF-7), and start renewal ([`renew`]) and the flow evidence loop ([`windows`]) beside
//! it, until SIGINT/SIGTERM. Every task runs under one shutdown token (`innerwall_wire::tasks::Tasks`); they live in
//! this room because each holds the agent's shared state (`crate::sync::Agent`).

pub mod notify;
pub mod renew;
pub mod windows;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_wire::tasks::Tasks;

use crate::enforce::{LinuxPolicyStore, PolicyStore, Restored};
use crate::error;
use crate::identity::connect::{RunConfig, connect};
use crate::sync::{self, Agent, SessionEnd, SessionStats};

/// Why `run` (or the stream it holds) ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("the control plane says this host must be enrolled again: {0}")]
    Reenroll(String),
    #[error("installing the SIGTERM, SIGINT and SIGHUP handlers")]
    Signal(#[source] std::io::Error),
    #[error("binding the metrics listener on {addr} (--metrics-listen)")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Fail static (ENF-5): re-applies the persisted policy and logs what it did. Returns the
/// applied version (0 when none) for Hello.
pub fn restore_before_dialing(store: &mut LinuxPolicyStore) -> u64 {
    match store.restore_persisted() {
        Ok(Restored::Nothing) => {
            tracing::info!(
                "no persisted policy to re-apply; nothing is enforced until the first policy arrives"
            );
            0
        }
        Ok(Restored::Installed { version }) => {
            tracing::info!("re-applied persisted policy v{version} before dialing");
            version
        }
        Ok(Restored::Suspended { version }) => {
            tracing::warn!(
                "kill switch engaged: holding persisted policy v{version} without installing it until \
                 `innerwall-agent up`"
            );
            version
        }
        Ok(Restored::AlreadyInstalled { version }) => {
            tracing::info!(
                "re-applied persisted policy v{version} before dialing (the kernel still held it)"
            );
            version
        }
        Err(e) => {
            tracing::error!(
                "could not re-apply the persisted policy: {}; the kernel keeps what it holds",
                error::chain(&e)
            );
            0
        }
    }
}

/// Holds the policy stream until a `Reenroll` directive; reconnects with a fresh Hello under
/// full-jitter backoff, reset after a healthy stream, and at once on a `Reconnect` directive.
pub async fn hold_stream<S: PolicyStore + Send + 'static>(
    config: &RunConfig,
    agent: Arc<Agent<S>>,
) -> Result<(), RunError> {
    agent.stream.limit_messages(config.max_policy_message);
    let mut attempt: u32 = 0;
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            agent.metrics.reconnecting();
        }
        let dialed_at = std::time::Instant::now();
        let mut retry_after = None;
        let failure = match connect(config).await {
            Err(e) => error::chain(&e),
            Ok(channel) => {
                tracing::info!(server = %config.server, applied_version = agent.enforcer.applied_version(), "connected to the control plane");
                agent.reachable.notify_one();
                let mut stats = SessionStats::default();
                let end = sync::session(channel, agent.clone(), &mut stats).await;
                agent.metrics.stream_connected(false);
                match end {
                    SessionEnd::Reconnect => {
                        tracing::info!("the control plane asked for a reconnect");
                        attempt = 0;
                        continue;
                    }
                    SessionEnd::Renewed => {
                        tracing::info!("credential renewed: reconnecting with the new certificate");
                        attempt = 0;
                        continue;
                    }
                    SessionEnd::Reenroll(reason) => return Err(RunError::Reenroll(reason)),
                    SessionEnd::Closed(reason) => {
                        if stats.established {
                            attempt = 0;
                        }
                        format!("stream ended: {reason}")
                    }
                    // Refused for rate: a healthy stream before it resets the backoff, but the
                    // wait is never shorter than the control plane asked for (REL-1).
                    SessionEnd::Throttled(reason, wait) => {
                        if stats.established {
                            attempt = 0;
                        }
                        retry_after = Some(wait);
                        format!("stream ended: {reason}")
                    }
                }
            }
        };
        let wait = config.backoff(attempt, retry_after);
        agent.dials.note(sync::DialFailure {
            attempt,
            dialed_at,
            failed_at: std::time::Instant::now(),
            wait,
        });
        attempt = attempt.saturating_add(1);
        tracing::warn!(
            "dial attempt {attempt} to {} failed: {failure}; retrying in {:.3}s",
            config.server,
            wait.as_secs_f64()
        );
        tokio::time::sleep(wait).await;
    }
}

/// Checks the owned table for drift every `every` (ENF-7), repairing it and reporting what was
/// found with the next heartbeat; notices the kill switch (`down` and `up` run in another
/// process: the check is where this one notices).
async fn check_drift_forever(agent: Arc<Agent<LinuxPolicyStore>>, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let a = agent.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let result = a
                .enforcer
                .store
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .check_drift(SystemTime::now());
            if let Ok(Some(event)) = &result {
                a.reports.tamper(event.clone());
            }
            a.enforcer.refresh_standing();
            result
        })
        .await;
        match checked {
            Ok(Ok(Some(event))) => {
                agent.metrics.drift_repaired();
                tracing::warn!(detail = %event.detail, "repaired drift of table inet innerwall; reported with the next heartbeat")
            }
            Ok(Err(e)) => tracing::error!("drift check failed: {}", error::chain(&e)),
            _ => {}
        }
    }
}

/// How often the agent looks at the applied policy's revert deadline (FLOW-11): a promotion not
/// confirmed in time is enforced as its simulation at most this long after its deadline.
const DEADLINE_CHECK: Duration = Duration::from_secs(1);

/// Holds the applied policy's revert deadline (FLOW-11), with or without a control plane: once
/// it passes unconfirmed, the table becomes the policy's simulation and the stream says so.
async fn hold_deadline_forever(agent: Arc<Agent<LinuxPolicyStore>>) {
    let mut ticker = tokio::time::interval(DEADLINE_CHECK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let a = agent.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let now = crate::enforce::store::now_ms();
            let result = a
                .enforcer
                .store
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .check_deadline(now);
            if matches!(result, Ok(Some(_))) {
                a.metrics.reverted_at_deadline();
                a.enforcer.refresh_standing();
            }
            result
        })
        .await;
        if let Ok(Err(e)) = checked {
            tracing::error!("reverting at the deadline failed (retrying): {}", error::chain(&e));
        }
    }
}

/// Runs the agent until SIGINT/SIGTERM. Kernel rules stay in place when it returns.
pub async fn run(config: RunConfig, hangup: Box<dyn Fn() + Send + Sync>) -> Result<(), RunError> {
    // Bound first: a taken address fails the start before anything is touched.
    let metrics = match config.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr).await.map_err(|source| RunError::Metrics { addr, source })?,
        ),
        None => None,
    };
    // Handled from here on: a SIGTERM or SIGINT while the capture attaches stops the agent
    // cleanly once it has.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RunError::Signal)?;
    let mut hup =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).map_err(RunError::Signal)?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(RunError::Signal)?;
    let mut store = LinuxPolicyStore::new(&config.state_dir);
    let restored = restore_before_dialing(&mut store);
    // Ready means enforcing what it last enforced: said only after the restore (ENF-5).
    let notifier = notify::Notifier::from_env().map(Arc::new);
    if let Some(notifier) = &notifier {
        notifier.send(&format!(
            "READY=1\nSTATUS=enforcing persisted policy v{restored}; dialing the control plane"
        ));
    }
    let agent = Arc::new(Agent::new(store));
    let mut tasks = Tasks::default();
    if let (Some(notifier), Some(every)) = (&notifier, notify::watchdog_interval()) {
        tasks.spawn("watchdog", notify::watchdog_forever(notifier.clone(), every));
    }
    if let Some(tcp) = metrics {
        if let Ok(addr) = tcp.local_addr() {
            tracing::info!(%addr, "serving metrics at /metrics (plain HTTP, unauthenticated)");
        }
        tasks.spawn("metrics", crate::metrics::serve(tcp, agent.metrics.clone()));
    }
    tasks.spawn("drift check", check_drift_forever(agent.clone(), config.drift_interval));
    tasks.spawn("revert deadline", hold_deadline_forever(agent.clone()));
    // Before any dial: the capture remembers the connections the agent opens (FLOW-1).
    let flows = windows::start(&config, agent.clone(), &mut tasks).await;
    tasks.spawn("renewal", renew::renew_forever(config.clone(), agent.clone()));

    let hold = hold_stream(&config, agent);
    tokio::pin!(hold);
    let result = loop {
        tokio::select! {
            r = &mut hold => break r,
            _ = int.recv() => { tracing::info!("interrupted"); break Ok(()) }
            _ = term.recv() => { tracing::info!("terminated"); break Ok(()) }
            _ = hup.recv() => hangup(),
        }
    };
    if let Some(notifier) = &notifier {
        notifier.send("STOPPING=1");
    }
    // The open flow window is queued first, then every task stops under the one token.
    if let Some(flows) = flows {
        flows.stop().await;
    }
    tasks.stop().await;
    tracing::info!("stopping; table inet innerwall stays in place (fail static)");
    result
}
