//! The flow evidence loop (FLOW-1..FLOW-3): a thread that drains the kernel's flow map every
//! second into the open window, closes the window when its time is up or the applied policy
//! version changes, and queues it for upload; restart gaps; and starting and stopping it
//! together with the uploader. The lifecycle itself ([`OpenWindow`]) takes time and the applied
//! version as arguments; what a window is and how a drain is absorbed into it is pure and lives
//! in `flows`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_wire::flows::{FlowWindow, GapKind};
use innerwall_wire::policy::WorkloadPolicy;

use crate::capture::{self, Capture, CaptureError, Drained};
use crate::connect::RunConfig;
use crate::enforce::PolicyStore;
use crate::facts::{self, FactsError};
use crate::sync::Enforcer;
use crate::{error, flows, telemetry};

/// Why flow capture could not start.
#[derive(Debug, thiserror::Error)]
pub enum EvidenceError {
    #[error("listing the interfaces to capture on")]
    Interfaces(#[source] FactsError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// Loads the capture program and attaches it to this host's interfaces of a captured kind,
/// following them as they come and go (`Capture::follow_links`).
fn attach() -> Result<Capture, EvidenceError> {
    let options = capture::CaptureOptions::default();
    let mut capture = Capture::load(&capture::default_object_path(), options, log::logger())?;
    capture.follow_links()?;
    Ok(capture)
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The open flow window and when it closes, with time, the applied version and each drain
/// passed in: the capture loop's state without its thread, clock or kernel, so a test can step
/// it.
#[derive(Debug)]
pub struct OpenWindow {
    window: flows::Window,
    last_drain_ms: i64,
}

impl OpenWindow {
    /// Opens the first window at `now_ms` under the applied `policy`.
    pub fn new(now_ms: i64, policy: Option<WorkloadPolicy>, max_keys: usize) -> OpenWindow {
        OpenWindow { window: flows::Window::open(now_ms, policy, max_keys), last_drain_ms: now_ms }
    }

    /// The agent was not running from `last_window_end_ms` (the end of the last window it
    /// queued) until this window opened: an AGENT_RESTART gap on it.
    pub fn restarted_after(&mut self, last_window_end_ms: i64) {
        let start = self.window.start_ms;
        self.window.gap(GapKind::AgentRestart, last_window_end_ms, start, 0);
    }

    /// Called before each drain. When the applied version is no longer the open window's
    /// (evidence is about exactly one version) or the window is `length_ms` old, closes it at
    /// `now_ms` and returns it, and opens the next under what `next` says is applied now.
    pub fn rotate(
        &mut self,
        now_ms: i64,
        applied_version: u64,
        length_ms: i64,
        next: impl FnOnce() -> (Option<WorkloadPolicy>, usize),
    ) -> Option<FlowWindow> {
        if applied_version == self.window.policy_version() && now_ms - self.window.start_ms < length_ms {
            return None;
        }
        let (policy, max_keys) = next();
        let closed = std::mem::replace(&mut self.window, flows::Window::open(now_ms, policy, max_keys));
        Some(closed.close(now_ms))
    }

    /// Adds one drain at `now_ms` (`None`: the drain failed) to the open window: flows to the
    /// `local` addresses, and the map-full drops as a gap since the previous drain.
    pub fn absorb(&mut self, drained: Option<&Drained>, local: &BTreeSet<IpAddr>, now_ms: i64) {
        if let Some(drained) = drained {
            let (records, drops) = (&drained.records, drained.map_full_drops);
            flows::absorb(&mut self.window, records, drops, local, self.last_drain_ms, now_ms);
        }
        self.last_drain_ms = now_ms;
    }

    /// Closes the open window at `now_ms` (a clean stop).
    pub fn close(self, now_ms: i64) -> FlowWindow {
        self.window.close(now_ms)
    }
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
    mut capture: Capture,
    enforcer: Arc<Enforcer<S>>,
    queue: telemetry::Queue,
    state_dir: &Path,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let marker = state_dir.join("telemetry").join("last_window_end");
    let max_keys = || enforcer.flow_window_max_keys.load(Relaxed) as usize;
    let mut open = OpenWindow::new(now_ms(), enforcer.current(), max_keys());
    if let Some(last) = std::fs::read_to_string(&marker).ok().and_then(|t| t.trim().parse::<i64>().ok()) {
        open.restarted_after(last);
    }
    let queue_window = |window: FlowWindow, now: i64| {
        if let Err(e) = queue.push(window) {
            tracing::error!("could not queue a flow window: {e}");
        }
        if let Err(e) = crate::private::write(&marker, now.to_string().as_bytes()) {
            tracing::error!("could not record the end of the last flow window: {e}");
        }
    };
    // This host's addresses: only flows to them are inbound. When they cannot be listed, the
    // last known set stands.
    let refresh = |local: &mut BTreeSet<IpAddr>| match facts::local_addresses() {
        Ok(now) => *local = now,
        Err(e) => tracing::warn!("keeping the last known local addresses: {}", error::chain(&e)),
    };
    let mut local = BTreeSet::new();
    refresh(&mut local);
    loop {
        let stopping = sleep_unless_stopped(Duration::from_secs(1), stop);
        let now = now_ms();
        // Close first, then drain: traffic seen after a new version was applied is judged
        // under that version, not the one before it.
        let length = enforcer.flow_window_secs.load(Relaxed) as i64 * 1000;
        if !stopping
            && let Some(closed) =
                open.rotate(now, enforcer.applied_version(), length, || (enforcer.current(), max_keys()))
        {
            queue_window(closed, now);
            refresh(&mut local);
        }
        capture.follow_link_changes();
        let drained = capture.drain().map_err(|e| tracing::error!("draining the flow map failed: {e}")).ok();
        open.absorb(drained.as_ref(), &local, now);
        if stopping {
            queue_window(open.close(now), now);
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

/// Flow capture and upload, as started by [`start`].
#[derive(Debug)]
pub struct FlowTasks {
    uploader: tokio::task::JoinHandle<()>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    capture: Option<std::thread::JoinHandle<()>>,
}

impl FlowTasks {
    /// Queues the open window (see [`capture_forever`]) and stops uploading. What is queued
    /// and not yet delivered stays on disk for the next start.
    pub async fn stop(self) {
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
pub fn start<S: PolicyStore + Send + 'static>(
    config: &RunConfig,
    enforcer: Arc<Enforcer<S>>,
) -> Option<FlowTasks> {
    let queue = match telemetry::Queue::new(&config.state_dir, telemetry::DEFAULT_MAX_WINDOWS) {
        Ok(q) => q,
        Err(e) => {
            tracing::error!("flow telemetry disabled: cannot create its queue: {e}");
            return None;
        }
    };
    let uploader =
        tokio::spawn(telemetry::upload_forever(config.clone(), queue.clone(), Duration::from_secs(1)));
    let state_dir = config.state_dir.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_flag = stop.clone();
    let spawned = std::thread::Builder::new().name("flow-capture".into()).spawn(move || {
        let attached = attach();
        match attached {
            Ok(capture) => {
                tracing::info!(interfaces = ?capture.interfaces(), "flow capture attached");
                capture_forever(capture, enforcer, queue, &state_dir, &stop_flag);
            }
            Err(e) => tracing::error!(
                "flow capture unavailable: {}; enforcement continues without flow evidence",
                error::chain(&e)
            ),
        }
    });
    let capture = spawned.map_err(|e| tracing::error!("could not start the flow capture thread: {e}")).ok();
    Some(FlowTasks { uploader, stop, capture })
}
