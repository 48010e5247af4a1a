//! The flow evidence loop (FLOW-1..FLOW-3): a thread that drains the kernel's flow map every
//! second into the open window, closes the window when its time is up or the applied policy
//! version changes, and queues it for upload; restart gaps; and starting and stopping it
//! together with the uploader. The lifecycle itself ([`OpenWindow`]) takes time and the applied
//! version as arguments; what a window is and how a drain is absorbed into it is pure and lives
//! in `crate::evidence::flows`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use innerwall_wire::flows::{EvidenceGap, FlowWindow, GapKind};
use innerwall_wire::policy::WorkloadPolicy;
use innerwall_wire::proto;

use crate::enforce::PolicyStore;
use crate::error;
use crate::evidence::capture::{self, Capture, CaptureError, Drained};
use crate::evidence::{flows, telemetry};
use crate::identity::connect::RunConfig;
use crate::identity::facts;
use crate::sync::{Agent, WindowClose};

/// Loads the capture program with a connection table of `conn_entries` (`run
/// --conn-table-entries`, else derived from the host's memory) and attaches it to this host's
/// interfaces of a captured kind, following them as they come and go (`Capture::follow_links`).
fn attach(conn_entries: Option<u32>, metrics: &crate::metrics::Metrics) -> Result<Capture, CaptureError> {
    let conn_capacity = Some(conn_entries.unwrap_or_else(capture::default_conn_entries));
    let options = capture::CaptureOptions { conn_capacity, ..capture::CaptureOptions::default() };
    let mut capture = Capture::load_object(&capture::daemon_object(), options, log::logger())?;
    metrics.capture_loaded(capture.conn_capacity());
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
        self.window.gap(EvidenceGap::new(GapKind::AgentRestart, last_window_end_ms, start, 0));
    }

    /// Called after each drain at `now_ms`. When flows are no longer judged as in the open
    /// window (`judged_as`, a version and a mode: evidence is about exactly one version, and the
    /// kill switch changes what an enforcing one does) or the window is `length_ms` old,
    /// closes it at `now_ms` and returns it, and opens the next at the same moment under what
    /// `next` says flows are judged under now: windows abut, and each drain's records fall in
    /// the window that was open until that drain.
    pub fn rotate(
        &mut self,
        now_ms: i64,
        judged_as: flows::JudgedAs,
        length_ms: i64,
        next: impl FnOnce() -> (Option<WorkloadPolicy>, usize),
    ) -> Option<FlowWindow> {
        if judged_as == self.window.judged_as() && now_ms - self.window.start_ms < length_ms {
            return None;
        }
        let (policy, max_keys) = next();
        let closed = std::mem::replace(&mut self.window, flows::Window::open(now_ms, policy, max_keys));
        Some(closed.close(now_ms))
    }

    /// Adds one drain at `now_ms` to the open window: flows to the `local` addresses, and the
    /// map-full drops and the reply-like unmatched UDP datagrams as gaps since the previous
    /// drain (`flows::absorb`). An error (no capture attached, or the
    /// drain failed: why) is a CAPTURE_UNAVAILABLE gap since the previous drain: nothing was
    /// seen, and the window says so and why.
    pub fn absorb(&mut self, drained: Result<&Drained, &str>, local: &BTreeSet<IpAddr>, now_ms: i64) {
        match drained {
            Ok(drained) => flows::absorb(&mut self.window, drained, local, self.last_drain_ms, now_ms),
            Err(why) => {
                let gap = EvidenceGap::new(GapKind::CaptureUnavailable, self.last_drain_ms, now_ms, 1);
                self.window.gap(gap.because(why));
            }
        }
        self.last_drain_ms = now_ms;
    }

    /// Closes the open window at `now_ms` (a clean stop).
    pub fn close(self, now_ms: i64) -> FlowWindow {
        self.window.close(now_ms)
    }
}

/// How often the capture loop drains the kernel's flow map.
const DRAIN_EVERY: Duration = Duration::from_secs(1);

/// What the capture loop's thread is asked to do between drains.
#[derive(Debug)]
enum Wake {
    /// The applied version changed: close the window now, then answer.
    CloseWindow(WindowClose),
    /// Queue the open window and return.
    Stop,
}

/// Closed windows on their way to the queue, and the windows the queue could not take: those
/// become one QUEUE_FAILED gap on the next window it does take (FLOW-2), so a full disk costs
/// evidence but never silently.
struct Outbox {
    queue: telemetry::Queue,
    marker: PathBuf,
    unqueued: Option<EvidenceGap>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Outbox {
    fn push(&mut self, mut window: FlowWindow, now: i64) {
        window.gaps.extend(self.unqueued.take());
        self.metrics.window_closed(window.records.len(), window.gaps.len());
        let lost = telemetry::lost(GapKind::QueueFailed, &proto::FlowWindow::from(&window));
        match self.queue.push(window) {
            Ok(()) => {
                if let Err(e) = crate::private::write(&self.marker, now.to_string().as_bytes()) {
                    tracing::error!("could not record the end of the last flow window: {e}");
                }
            }
            Err(e) => {
                tracing::error!("could not queue a flow window (kept as a gap for the next one): {e}");
                self.unqueued = Some(lost.because(&format!("writing to the agent's queue: {e}")));
            }
        }
    }
}

/// The flow evidence loop (FLOW-1..FLOW-3), on its own thread: drain the kernel map every
/// second into the open window; close it when its time is up, and at once when the applied
/// version changes (the apply waits for that before it acks: evidence is always about exactly
/// one version, and what the host sees after an ack counts for the new one), and queue it for
/// upload. The time the agent was not running becomes an AGENT_RESTART gap on the first window:
/// from the end of the last window it queued (recorded in `telemetry/last_window_end`) to now.
/// On [`Wake::Stop`] the open window is drained and queued one last time, so a clean stop
/// leaves a gap of exactly the downtime; a crash loses the open window, and the gap then starts
/// where the last queued window ended. Without a capture (it could not attach) windows go on,
/// each carrying a CAPTURE_UNAVAILABLE gap, and attaching is tried again at each new window.
fn capture_forever<S: PolicyStore + Send + 'static>(
    mut capture: Result<Capture, String>,
    conn_entries: Option<u32>,
    agent: Arc<Agent<S>>,
    queue: telemetry::Queue,
    state_dir: &Path,
    wakes: &std::sync::mpsc::Receiver<Wake>,
    closes: &std::sync::mpsc::Receiver<WindowClose>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let marker = state_dir.join("telemetry").join("last_window_end");
    let max_keys = || agent.stream.flow_window_max_keys.load(Relaxed) as usize;
    let mut open = OpenWindow::new(now_ms(), agent.enforcer.judged(), max_keys());
    if let Some(last) = std::fs::read_to_string(&marker).ok().and_then(|t| t.trim().parse::<i64>().ok()) {
        open.restarted_after(last);
    }
    let mut outbox = Outbox { queue, marker, unqueued: None, metrics: agent.metrics.clone() };
    // This host's addresses: only flows to them are inbound. When they cannot be listed, the
    // last known set stands.
    let refresh = |local: &mut BTreeSet<IpAddr>| match facts::local_addresses() {
        Ok(now) => *local = now,
        Err(e) => tracing::warn!("keeping the last known local addresses: {}", error::chain(&e)),
    };
    let mut local = BTreeSet::new();
    refresh(&mut local);
    let mut next_drain = Instant::now() + DRAIN_EVERY;
    loop {
        let wake = next_wake(wakes, closes, next_drain);
        let now = now_ms();
        // Drain first, then close: everything drained was seen before `now`, under the version
        // the open window is about.
        let drained = match capture.as_mut() {
            Ok(c) => {
                // Interfaces added or removed since the last drain are attached or detached
                // first, so a new interface's traffic is in this window's next drain.
                c.follow_link_changes();
                c.drain().map_err(|e| {
                    let why = format!("draining the flow map failed: {}", error::chain(&e));
                    tracing::error!("{why}");
                    why
                })
            }
            Err(why) => Err(why.clone()),
        };
        if let Ok(drained) = &drained {
            agent.metrics.capture_drained(drained);
        }
        open.absorb(drained.as_ref().map_err(String::as_str), &local, now);
        if matches!(wake, Some(Wake::Stop)) {
            outbox.push(open.close(now), now);
            return;
        }
        let length = agent.stream.flow_window_secs.load(Relaxed) as i64 * 1000;
        if let Some(closed) =
            open.rotate(now, agent.enforcer.judged_as(), length, || (agent.enforcer.judged(), max_keys()))
        {
            outbox.push(closed, now);
            refresh(&mut local);
            if capture.is_err() {
                capture = attach(conn_entries, &agent.metrics)
                    .map_err(|e| format!("flow capture unavailable: {}", error::chain(&e)));
                if let Ok(c) = &capture {
                    tracing::info!(interfaces = ?c.interfaces(), "flow capture attached");
                }
            }
        }
        if let Some(Wake::CloseWindow(done)) = wake {
            let _ = done.send(());
        } else {
            next_drain = Instant::now() + DRAIN_EVERY;
        }
    }
}

/// Waits until `deadline` or a wake: a stop, or a window close asked for by an apply.
fn next_wake(
    wakes: &std::sync::mpsc::Receiver<Wake>,
    closes: &std::sync::mpsc::Receiver<WindowClose>,
    deadline: Instant,
) -> Option<Wake> {
    use std::sync::mpsc::TryRecvError;
    // Two channels without a select: the stop channel is checked every few milliseconds, the
    // window closes are waited on (they must be answered fast, a stop may wait a little).
    loop {
        match wakes.try_recv() {
            Ok(wake) => return Some(wake),
            Err(TryRecvError::Disconnected) => return Some(Wake::Stop),
            Err(TryRecvError::Empty) => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match closes.recv_timeout(left.min(Duration::from_millis(50))) {
            Ok(done) => return Some(Wake::CloseWindow(done)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Some(Wake::Stop),
        }
    }
}

/// Flow capture and upload, as started by [`start`].
#[derive(Debug)]
pub struct FlowTasks {
    wake: std::sync::mpsc::Sender<Wake>,
    capture: Option<std::thread::JoinHandle<()>>,
}

impl FlowTasks {
    /// Queues the open window (see [`capture_forever`]) and stops uploading. What is queued
    /// and not yet delivered stays on disk for the next start.
    pub async fn stop(self) {
        let _ = self.wake.send(Wake::Stop);
        if let Some(capture) = self.capture {
            let joined = tokio::task::spawn_blocking(move || capture.join());
            if tokio::time::timeout(Duration::from_secs(5), joined).await.is_err() {
                tracing::warn!("flow capture did not stop within 5 s; its open window is lost");
            }
        }
    }
}

/// How long the agent waits for the capture to attach before it dials anything anyway.
const ATTACH_WAIT: Duration = Duration::from_secs(10);

/// Starts flow capture and upload. Without root or the BPF object, enforcement goes on and the
/// reason is logged; the windows then carry CAPTURE_UNAVAILABLE gaps until capture attaches.
///
/// Returns once the capture attached (or failed to, or [`ATTACH_WAIT`] passed), and only then
/// dials the telemetry connection: the agent's own connections are opened after the egress
/// program that remembers them, so their replies are never taken for inbound flows (FLOW-1).
/// The caller dials the policy stream after it too.
pub async fn start<S: PolicyStore + Send + 'static>(
    config: &RunConfig,
    agent: Arc<Agent<S>>,
    tasks: &mut innerwall_wire::tasks::Tasks,
) -> Option<FlowTasks> {
    let queue = match telemetry::Queue::new(&config.state_dir, telemetry::DEFAULT_MAX_WINDOWS) {
        Ok(q) => q,
        Err(e) => {
            tracing::error!("flow telemetry disabled: cannot create its queue: {e}");
            return None;
        }
    };
    agent.metrics.watch_queue(queue.clone());
    let state_dir = config.state_dir.clone();
    let (wake, wakes) = std::sync::mpsc::channel();
    let closes = agent.enforcer.window_closes();
    let conn_entries = config.conn_entries;
    let (attached, tried) = tokio::sync::oneshot::channel();
    let upload_queue = queue.clone();
    let reachable = agent.reachable.clone();
    let spawned = std::thread::Builder::new().name("flow-capture".into()).spawn(move || {
        let capture = attach(conn_entries, &agent.metrics)
            .map_err(|e| format!("flow capture unavailable: {}", error::chain(&e)));
        match &capture {
            Ok(c) => tracing::info!(
                interfaces = ?c.interfaces(),
                conn_table_entries = c.conn_capacity(),
                "flow capture attached"
            ),
            Err(why) => tracing::error!(
                "{why}; enforcement continues, and flow windows carry capture-unavailable gaps until it attaches"
            ),
        }
        let _ = attached.send(());
        capture_forever(capture, conn_entries, agent, queue, &state_dir, &wakes, &closes);
    });
    let capture = spawned.map_err(|e| tracing::error!("could not start the flow capture thread: {e}")).ok();
    if capture.is_some() && tokio::time::timeout(ATTACH_WAIT, tried).await.is_err() {
        tracing::warn!("the flow capture did not attach within {ATTACH_WAIT:?}; dialing anyway");
    }
    tasks.spawn(
        "flow upload",
        telemetry::upload_forever(config.clone(), upload_queue, Duration::from_secs(1), reachable),
    );
    Some(FlowTasks { wake, capture })
}

#[cfg(test)]
mod tests {
    use innerwall_wire::flows::EvidenceGap;

    use super::*;

    #[test]
    fn every_loss_is_a_gap_including_failed_drains() {
        let local = BTreeSet::new();
        let mut open = OpenWindow::new(1_000, None, 10);
        open.absorb(Ok(&Drained::default()), &local, 2_000);
        // Two failed drains in a row are one gap, with the later reason; a good drain ends it;
        // the next failure is another.
        open.absorb(Err("map gone"), &local, 3_000);
        open.absorb(Err("map still gone"), &local, 4_000);
        open.absorb(Ok(&Drained { map_full_drops: 5, ..Drained::default() }), &local, 5_000);
        open.absorb(Err("map gone"), &local, 6_000);
        let closed = open.rotate(6_000, flows::judged_as(None), 5_000, || (None, 10)).expect("5 s old");
        let gap = |kind, from_ms, to_ms, count| EvidenceGap::new(kind, from_ms, to_ms, count);
        assert_eq!(
            closed.gaps,
            [
                gap(GapKind::CaptureUnavailable, 2_000, 4_000, 2).because("map still gone"),
                gap(GapKind::MapFull, 4_000, 5_000, 5),
                gap(GapKind::CaptureUnavailable, 5_000, 6_000, 1).because("map gone"),
            ]
        );
        assert_eq!((closed.start_ms, closed.end_ms), (1_000, 6_000));
        // The next window starts where this one ended; with no capture at all it is one gap
        // over all of it.
        open.absorb(Err("no object"), &local, 7_000);
        open.absorb(Err("no object"), &local, 8_000);
        let next = open.close(8_000);
        let all = gap(GapKind::CaptureUnavailable, 6_000, 8_000, 2).because("no object");
        assert_eq!((next.start_ms, next.gaps), (6_000, vec![all]));
    }
}
