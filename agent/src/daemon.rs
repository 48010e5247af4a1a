//! `innerwall-agent run`: fail static first (re-apply the persisted policy before dialing
//! anything, ENF-5), then hold the policy stream to the control plane under full-jitter backoff
//! (SYNC-10), check the owned table for drift on a timer (ENF-7), and renew the credential in
//! the last third of its life without dropping the stream (IDN-5).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use innerwall_wire::backoff;
use innerwall_wire::proto;
use tonic::transport::{Channel, Endpoint};

use crate::enforce::{LinuxPolicyStore, PolicyStore, Restored};
use crate::enroll::endpoint;
use crate::identity::{self, Credential};
use crate::sync::{self, Enforcer, SessionEnd, SessionStats};

/// Configuration of `run`.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub state_dir: PathBuf,
    pub server: String,
    pub drift_interval: Duration,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub dial_timeout: Duration,
}

impl RunConfig {
    pub fn new(state_dir: PathBuf, server: String) -> RunConfig {
        RunConfig {
            state_dir,
            server,
            drift_interval: Duration::from_secs(2),
            backoff_base: backoff::BASE,
            backoff_cap: backoff::CAP,
            dial_timeout: Duration::from_secs(10),
        }
    }
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
        Ok(Restored::AlreadyInstalled { version }) => {
            tracing::info!(
                "re-applied persisted policy v{version} before dialing (the kernel still held it)"
            );
            version
        }
        Err(e) => {
            tracing::error!("could not re-apply the persisted policy: {e}; the kernel keeps what it holds");
            0
        }
    }
}

/// A mutually authenticated channel with the credential currently on disk, so a renewed
/// credential is used from the next connection on.
pub async fn connect(config: &RunConfig) -> anyhow::Result<Channel> {
    let credential = Credential::load(&config.state_dir)?;
    credential.check_not_expired(SystemTime::now())?;
    let (url, host) = endpoint(&config.server)?;
    let channel = Endpoint::from_shared(url)?
        .tls_config(credential.tls(&host))?
        .connect_timeout(config.dial_timeout)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .connect()
        .await?;
    Ok(channel)
}

/// Holds the policy stream until a `Reenroll` directive; reconnects with a fresh Hello under
/// full-jitter backoff, reset after a healthy stream, and at once on a `Reconnect` directive.
pub async fn hold_stream<S: PolicyStore + Send + 'static>(
    config: &RunConfig,
    enforcer: Arc<Enforcer<S>>,
) -> anyhow::Result<()> {
    let mut attempt: u32 = 0;
    loop {
        let failure = match connect(config).await {
            Err(e) => format!("{e:#}"),
            Ok(channel) => {
                tracing::info!(server = %config.server, applied_version = enforcer.applied_version(), "connected to the control plane");
                let mut stats = SessionStats::default();
                match sync::session(channel, enforcer.clone(), &mut stats).await {
                    SessionEnd::Reconnect => {
                        tracing::info!("the control plane asked for a reconnect");
                        attempt = 0;
                        continue;
                    }
                    SessionEnd::Reenroll(reason) => {
                        anyhow::bail!("the control plane says this host must be enrolled again: {reason}")
                    }
                    SessionEnd::Closed(reason) => {
                        if stats.established {
                            attempt = 0;
                        }
                        format!("stream ended: {reason}")
                    }
                }
            }
        };
        let wait = backoff::wait(attempt, config.backoff_base, config.backoff_cap, backoff::random_unit());
        attempt = attempt.saturating_add(1);
        enforcer.dial_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            "dial attempt {attempt} to {} failed: {failure}; retrying in {:.3}s",
            config.server,
            wait.as_secs_f64()
        );
        tokio::time::sleep(wait).await;
    }
}

async fn renew_once(config: &RunConfig, credential: &Credential) -> anyhow::Result<Credential> {
    let channel = connect(config).await?;
    let (key_pem, csr_pem) = identity::new_key_and_csr()?;
    let response = proto::agent_service_client::AgentServiceClient::new(channel)
        .renew_credential(proto::RenewCredentialRequest { csr_pem })
        .await
        .map_err(|s| anyhow::anyhow!("renewal refused: {}", s.message()))?
        .into_inner();
    let cert_pem =
        String::from_utf8(response.certificate_pem).context("the renewed certificate is not PEM text")?;
    let renewed = Credential::new(key_pem, cert_pem, credential.ca_pem.clone())?;
    anyhow::ensure!(
        renewed.id == credential.id,
        "the renewed certificate names {} instead of {}",
        renewed.id,
        credential.id
    );
    renewed.save(&config.state_dir)?;
    Ok(renewed)
}

/// Renews in the last third of each credential's life (jittered); on failure retries with
/// backoff and reports the failure in heartbeats; an expired credential is reported as
/// needing re-enrollment.
pub async fn renew_forever<S: PolicyStore + Send + 'static>(config: RunConfig, enforcer: Arc<Enforcer<S>>) {
    loop {
        let credential = match Credential::load(&config.state_dir) {
            Ok(c) => c,
            Err(_) => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                continue;
            }
        };
        let at = credential.renew_at(backoff::random_unit());
        if let Ok(wait) = at.duration_since(SystemTime::now()) {
            tokio::time::sleep(wait).await;
        }
        let mut attempt = 0;
        loop {
            match renew_once(&config, &credential).await {
                Ok(renewed) => {
                    enforcer.set_renewal_error(String::new());
                    tracing::info!(workload = %renewed.id, "renewed the credential; valid until {:?}", renewed.not_after);
                    break;
                }
                Err(e) => {
                    let expired = credential.check_not_expired(SystemTime::now()).is_err();
                    let message = if expired {
                        format!(
                            "credential expired; enroll this host again (innerwall-agent enroll --force): {e:#}"
                        )
                    } else {
                        format!("{e:#}")
                    };
                    tracing::error!("credential renewal failed: {message}");
                    enforcer.set_renewal_error(message);
                    let wait = backoff::wait(
                        attempt,
                        Duration::from_secs(1),
                        Duration::from_secs(300),
                        backoff::random_unit(),
                    );
                    attempt = attempt.saturating_add(1);
                    tokio::time::sleep(wait).await;
                    if Credential::load(&config.state_dir).is_ok_and(|c| c.not_after != credential.not_after)
                    {
                        break;
                    }
                }
            }
        }
    }
}

fn spawn_drift_checks(
    enforcer: Arc<Enforcer<LinuxPolicyStore>>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let e = enforcer.clone();
            let checked = tokio::task::spawn_blocking(move || {
                let result = e
                    .store
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .check_drift(SystemTime::now());
                if let Ok(Some(event)) = &result {
                    e.report_tamper(event.clone());
                }
                result
            })
            .await;
            match checked {
                Ok(Ok(Some(event))) => {
                    tracing::warn!(detail = %event.detail, "repaired drift of table inet innerwall; reported with the next heartbeat")
                }
                Ok(Err(e)) => tracing::error!("drift check failed: {e}"),
                _ => {}
            }
        }
    })
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// This host's own addresses: only flows to them are inbound flows of this workload.
fn local_addresses() -> std::collections::BTreeSet<std::net::IpAddr> {
    crate::enroll::host_facts()
        .interfaces
        .iter()
        .flat_map(|i| i.addresses.iter())
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect()
}

/// The flow evidence loop (FLOW-1..FLOW-3), on its own thread: drain the kernel map every
/// second into the open window; close it when its time is up or the applied policy version
/// changes (evidence is always about exactly one version), and queue it for upload. The time
/// the agent was not running becomes an AGENT_RESTART gap on the first window: from the end of
/// the last window it queued (recorded in `telemetry/last_window_end`) to now. When `stop` is
/// set, the open window is drained and queued one last time, so a clean stop leaves a gap of
/// exactly the downtime; a crash loses the open window, and the gap then starts where the last
/// queued window ended.
fn capture_forever<S: PolicyStore + Send + 'static>(
    mut capture: crate::capture::Capture,
    enforcer: Arc<Enforcer<S>>,
    queue: crate::telemetry::Queue,
    state_dir: &Path,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let marker = state_dir.join("telemetry").join("last_window_end");
    let max_keys = || enforcer.flow_window_max_keys.load(Relaxed) as usize;
    let mut window = crate::flows::Window::open(now_ms(), enforcer.current(), max_keys());
    if let Some(last) = std::fs::read_to_string(&marker).ok().and_then(|t| t.trim().parse::<i64>().ok()) {
        window.gap(innerwall_wire::flows::GapKind::AgentRestart, last, window.start_ms, 0);
    }
    let queue_window = |window: crate::flows::Window, now: i64| {
        if let Err(e) = queue.push(window.close(now)) {
            tracing::error!("could not queue a flow window: {e}");
        }
        if let Err(e) = std::fs::write(&marker, now.to_string()) {
            tracing::error!("could not record the end of the last flow window: {e}");
        }
    };
    let mut local = local_addresses();
    let mut last_drain = now_ms();
    loop {
        let stopping = sleep_unless_stopped(Duration::from_secs(1), stop);
        let now = now_ms();
        // Close first, then drain: traffic seen after a new version was applied is judged
        // under that version, not the one before it.
        let length = enforcer.flow_window_secs.load(Relaxed) as i64 * 1000;
        if !stopping
            && (enforcer.applied_version() != window.policy_version() || now - window.start_ms >= length)
        {
            let next = crate::flows::Window::open(now, enforcer.current(), max_keys());
            queue_window(std::mem::replace(&mut window, next), now);
            local = local_addresses();
        }
        match capture.drain() {
            Ok(drained) => crate::flows::absorb(
                &mut window,
                &drained.records,
                drained.map_full_drops,
                &local,
                last_drain,
                now,
            ),
            Err(e) => tracing::error!("draining the flow map failed: {e}"),
        }
        last_drain = now;
        if stopping {
            queue_window(window, now);
            return;
        }
    }
}

/// Sleeps for `period`, waking early when `stop` is set; returns whether it is.
fn sleep_unless_stopped(period: Duration, stop: &std::sync::atomic::AtomicBool) -> bool {
    let step = Duration::from_millis(50);
    let deadline = std::time::Instant::now() + period;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(step));
    }
    true
}

/// Flow capture and upload, as started by [`start_flows`].
struct FlowTasks {
    uploader: tokio::task::JoinHandle<()>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    capture: Option<std::thread::JoinHandle<()>>,
}

impl FlowTasks {
    /// Queues the open window (see [`capture_forever`]) and stops uploading. What is queued
    /// and not yet delivered stays on disk for the next start.
    async fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(capture) = self.capture {
            let joined = tokio::task::spawn_blocking(move || capture.join());
            if tokio::time::timeout(Duration::from_secs(5), joined).await.is_err() {
                tracing::warn!("flow capture did not stop within 5 s; its open window is lost");
            }
        }
        self.uploader.abort();
    }
}

/// Starts flow capture and upload. Without root or the BPF object, enforcement goes on and the
/// reason is logged; flow evidence is then absent (and the restart gap will say so later).
fn start_flows<S: PolicyStore + Send + 'static>(
    config: &RunConfig,
    enforcer: Arc<Enforcer<S>>,
) -> Option<FlowTasks> {
    let queue = match crate::telemetry::Queue::new(&config.state_dir, crate::telemetry::DEFAULT_MAX_WINDOWS) {
        Ok(q) => q,
        Err(e) => {
            tracing::error!("flow telemetry disabled: cannot create its queue: {e}");
            return None;
        }
    };
    let uploader =
        tokio::spawn(crate::telemetry::upload_forever(config.clone(), queue.clone(), Duration::from_secs(1)));
    let state_dir = config.state_dir.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_flag = stop.clone();
    let spawned = std::thread::Builder::new().name("flow-capture".into()).spawn(move || {
        let attached = crate::capture::Capture::interfaces_of_host().and_then(|ifs| {
            crate::capture::Capture::attach(&ifs, &crate::capture::default_object_path(), None, log::logger())
        });
        match attached {
            Ok(capture) => {
                tracing::info!(interfaces = ?capture.interfaces(), "flow capture attached");
                capture_forever(capture, enforcer, queue, &state_dir, &stop_flag);
            }
            Err(e) => {
                tracing::error!("flow capture unavailable: {e}; enforcement continues without flow evidence")
            }
        }
    });
    let capture = spawned.map_err(|e| tracing::error!("could not start the flow capture thread: {e}")).ok();
    Some(FlowTasks { uploader, stop, capture })
}

/// Runs the agent until SIGINT/SIGTERM. Kernel rules stay in place when it returns.
pub async fn run(config: RunConfig) -> anyhow::Result<()> {
    let mut store = LinuxPolicyStore::new(&config.state_dir);
    restore_before_dialing(&mut store);
    let enforcer = Arc::new(Enforcer::new(store));
    let drift = spawn_drift_checks(enforcer.clone(), config.drift_interval);
    let renewal = tokio::spawn(renew_forever(config.clone(), enforcer.clone()));
    let flows = start_flows(&config, enforcer.clone());

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let result = tokio::select! {
        r = hold_stream(&config, enforcer) => r,
        _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted"); Ok(()) }
        _ = term.recv() => { tracing::info!("terminated"); Ok(()) }
    };
    drift.abort();
    renewal.abort();
    if let Some(flows) = flows {
        flows.stop().await;
    }
    tracing::info!("stopping; table inet innerwall stays in place (fail static)");
    result
}

/// Reads the CA bundle an operator handed this host with its token.
pub fn read_ca_bundle(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading the CA bundle {}", path.display()))
}
