//! What the agent's tasks share, split by role ([`Agent`]): the [`Enforcer`] (the policy store
//! and what a version change sets off), the [`Reports`] heartbeats carry, the policy stream's
//! [`Dials`], the [`StreamSettings`] the control plane set and the agent reports as, and the
//! renewal signal. Each role has one writer: the stream (settings, dials), the drift check and
//! renewal (reports), the apply path (enforcer); anyone reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use innerwall_wire::identity::HostFacts;
use innerwall_wire::policy::{Version, WorkloadPolicy};
use innerwall_wire::sync::{
    self as wire, AgentMessage, Heartbeat, MAX_POLICY_MESSAGE, MAX_TAMPER_DETAIL, MAX_TAMPER_REPORTS, Update,
};

use super::{UpdateError, next_policy};
use crate::enforce::{Installed, PolicyStore, TamperEvent};
use crate::evidence::flows;
use crate::metrics::{ApplyResult, Metrics};

/// Everything the agent's tasks share, by role.
#[derive(Debug)]
pub struct Agent<S> {
    pub enforcer: Enforcer<S>,
    pub reports: Reports,
    pub dials: Dials,
    pub stream: StreamSettings,
    /// Counts credential renewals: the policy stream moves to the new certificate at once,
    /// because the control plane ends a stream when the certificate it opened with expires.
    pub renewals: tokio::sync::watch::Sender<u64>,
    /// What the agent exposes to Prometheus (`run --metrics-listen`).
    pub metrics: Arc<Metrics>,
    /// Told each time the policy stream reaches the control plane: the flow uploader, waiting
    /// out its backoff after failures, uploads at once instead.
    pub reachable: Arc<tokio::sync::Notify>,
}

impl<S: PolicyStore> Agent<S> {
    pub fn new(store: S) -> Self {
        let metrics = Arc::new(Metrics::new());
        Agent {
            enforcer: Enforcer::new(store, metrics.clone()),
            reports: Reports::default(),
            dials: Dials::default(),
            stream: StreamSettings::default(),
            renewals: tokio::sync::watch::Sender::new(0),
            metrics,
            reachable: Arc::default(),
        }
    }

    /// The heartbeat to send now.
    pub fn heartbeat(&self) -> AgentMessage {
        self.reports.heartbeat(*self.enforcer.standing.borrow())
    }
}

/// What the host's table does with the applied policy beside enforcing it, as Hello and every
/// heartbeat say (a change is said at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Standing {
    /// The kill switch is engaged: nothing is installed.
    pub suspended: bool,
    /// The applied version whose revert deadline passed unconfirmed (FLOW-11), enforced as its
    /// simulation; 0: none.
    pub reverted_version: Version,
}

impl Standing {
    fn of(store: &impl PolicyStore) -> Standing {
        Standing { suspended: store.suspended(), reverted_version: store.reverted_version() }
    }

    /// Whether an enforcing policy's drops are not happening now (they are would-blocks).
    pub fn holds_back(self) -> bool {
        self.suspended || self.reverted_version != 0
    }
}

/// The policy store and what a version change sets off: the metrics of each apply, the kill
/// switch and a passed revert deadline as last seen ([`Standing`]: a change is said on the
/// stream at once), and the evidence loop's window, closed at every version change before its
/// ack.
#[derive(Debug)]
pub struct Enforcer<S> {
    pub store: Mutex<S>,
    metrics: Arc<Metrics>,
    /// The kill switch and a passed revert deadline, as last seen.
    pub(super) standing: tokio::sync::watch::Sender<Standing>,
    /// The evidence loop, when one runs (see [`Enforcer::window_closes`]).
    evidence: Mutex<Option<std::sync::mpsc::Sender<WindowClose>>>,
}

/// A request to the evidence loop to close its open flow window now, because the applied
/// version changed; it answers on the enclosed channel once it has.
pub type WindowClose = std::sync::mpsc::SyncSender<()>;

/// How long an apply waits for the evidence loop to close its window before acking anyway.
const WINDOW_CLOSE_WAIT: Duration = Duration::from_secs(2);

impl<S: PolicyStore> Enforcer<S> {
    pub fn new(store: S, metrics: Arc<Metrics>) -> Self {
        metrics.set_applied_version(store.applied_version());
        Enforcer {
            standing: tokio::sync::watch::Sender::new(Standing::of(&store)),
            store: Mutex::new(store),
            metrics,
            evidence: Mutex::new(None),
        }
    }

    /// For the evidence loop: a request arrives on the returned receiver each time the applied
    /// version changes, right after the install and before its ack, so a window is about
    /// exactly one version and whatever the agent sees after an ack counts for the new one.
    pub fn window_closes(&self) -> std::sync::mpsc::Receiver<WindowClose> {
        let (tx, rx) = std::sync::mpsc::channel();
        *self.evidence.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        rx
    }

    /// Asks the evidence loop, if one runs, to close its window, and waits until it has
    /// (bounded: the ack is never held up for long by evidence).
    fn close_evidence_window(&self) {
        let Some(loop_) = self.evidence.lock().unwrap_or_else(PoisonError::into_inner).clone() else {
            return;
        };
        let (done, closed) = std::sync::mpsc::sync_channel(1);
        if loop_.send(done).is_ok() && closed.recv_timeout(WINDOW_CLOSE_WAIT).is_err() {
            tracing::warn!(
                "the flow evidence loop did not close its window within {WINDOW_CLOSE_WAIT:?} of a version change"
            );
        }
    }

    /// Whether the kill switch is engaged now.
    pub fn suspended(&self) -> bool {
        self.store.lock().unwrap_or_else(PoisonError::into_inner).suspended()
    }

    /// The policy flows are judged under now ([`flows::judged`]).
    pub fn judged(&self) -> Option<WorkloadPolicy> {
        let store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        flows::judged(store.current().cloned(), Standing::of(&*store).holds_back())
    }

    /// The version and mode flows are judged under now, without copying the policy.
    pub fn judged_as(&self) -> flows::JudgedAs {
        let store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        let (version, mode) = flows::judged_as(store.current());
        (version, flows::judged_mode(mode, Standing::of(&*store).holds_back()))
    }

    /// Looks at the kill switch and the revert deadline again; a change is reported on the
    /// stream at once. Returns whether it changed.
    pub fn note_standing(&self) -> bool {
        let now = Standing::of(&*self.store.lock().unwrap_or_else(PoisonError::into_inner));
        self.standing.send_if_modified(|seen| std::mem::replace(seen, now) != now)
    }

    /// [`note_standing`](Self::note_standing), and on a change the evidence loop closes its
    /// window (what an enforcing policy does changed). Blocking.
    pub fn refresh_standing(&self) {
        if self.note_standing() {
            self.close_evidence_window();
        }
    }

    pub fn applied_version(&self) -> Version {
        self.store.lock().unwrap_or_else(PoisonError::into_inner).applied_version()
    }

    pub fn current(&self) -> Option<WorkloadPolicy> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner).current().cloned()
    }

    /// Applies one update atomically; on error nothing changed. Blocking (netlink). With the
    /// kill switch engaged the result is [`Installed::Held`].
    pub fn apply(&self, update: &Update) -> Result<Installed, UpdateError> {
        let started = Instant::now();
        let (installed, changed) = {
            let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
            let before = store.applied_version();
            let applied = next_policy(store.current(), update)
                .and_then(|next| store.apply(&next).map_err(UpdateError::from));
            let result = match &applied {
                Ok(Installed::Held) => ApplyResult::Held,
                Ok(_) => ApplyResult::Applied,
                Err(_) => ApplyResult::Failed,
            };
            self.metrics.applied(result, started.elapsed(), store.applied_version());
            (applied?, store.applied_version() != before)
        };
        if self.note_standing() || changed {
            self.close_evidence_window();
        }
        Ok(installed)
    }
}

/// What heartbeats report beside liveness: outside changes repaired since the last one, the
/// last renewal failure, and the agent's uptime.
#[derive(Debug)]
pub struct Reports {
    tamper: Mutex<TamperLog>,
    renewal_error: Mutex<String>,
    started: Instant,
}

impl Default for Reports {
    fn default() -> Self {
        Reports { tamper: Mutex::default(), renewal_error: Mutex::default(), started: Instant::now() }
    }
}

impl Reports {
    pub fn tamper(&self, event: TamperEvent) {
        self.tamper.lock().unwrap_or_else(PoisonError::into_inner).record(event);
    }

    pub fn set_renewal_error(&self, error: String) {
        *self.renewal_error.lock().unwrap_or_else(PoisonError::into_inner) = error;
    }

    /// The next heartbeat; the tamper log starts over.
    fn heartbeat(&self, standing: Standing) -> AgentMessage {
        let tamper = self.tamper.lock().unwrap_or_else(PoisonError::into_inner).take();
        AgentMessage::Heartbeat(Heartbeat {
            uptime: self.started.elapsed(),
            credential_renewal_error: self
                .renewal_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            tamper_events: tamper,
            suspended: standing.suspended,
            reverted_version: standing.reverted_version,
        })
    }
}

/// The policy stream's connection history (for status and tests).
#[derive(Debug, Default)]
pub struct Dials {
    /// Connection attempts that failed, and streams that reached HelloAck.
    pub failures: AtomicU64,
    pub streams: AtomicU64,
    /// The latest failed dials with the backoff each chose (at most [`DIAL_LOG`]), so a test
    /// can hold every wait to its full-jitter window.
    log: Mutex<VecDeque<DialFailure>>,
}

/// How many failed dials [`Dials`] keeps.
pub const DIAL_LOG: usize = 64;

/// One failed dial of the policy stream and the backoff chosen after it.
#[derive(Debug, Clone, Copy)]
pub struct DialFailure {
    /// The backoff attempt (0-based; reset after a healthy stream).
    pub attempt: u32,
    /// When the dial began and when it failed.
    pub dialed_at: Instant,
    pub failed_at: Instant,
    /// The wait chosen before the next dial.
    pub wait: Duration,
}

impl Dials {
    /// Notes a failed dial; the oldest entry goes once [`DIAL_LOG`] are kept.
    pub fn note(&self, failure: DialFailure) {
        self.failures.fetch_add(1, Relaxed);
        let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        if log.len() == DIAL_LOG {
            log.pop_front();
        }
        log.push_back(failure);
    }

    /// The failed dials kept, oldest first.
    pub fn logged(&self) -> Vec<DialFailure> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).iter().copied().collect()
    }
}

/// What the control plane set in the last HelloAck (flow window length and key cap), and what
/// this agent reports as: fixed host facts (for agents standing for other hosts) and the
/// largest policy-stream message it decodes.
#[derive(Debug)]
pub struct StreamSettings {
    pub flow_window_secs: AtomicU64,
    pub flow_window_max_keys: AtomicU64,
    fixed_facts: Mutex<Option<HostFacts>>,
    max_message: AtomicUsize,
}

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            flow_window_secs: AtomicU64::new(60),
            flow_window_max_keys: AtomicU64::new(10_000),
            fixed_facts: Mutex::new(None),
            max_message: AtomicUsize::new(MAX_POLICY_MESSAGE),
        }
    }
}

impl StreamSettings {
    /// Lowers the largest policy-stream message this agent decodes (never above
    /// `wire::sync::MAX_POLICY_MESSAGE`), from the next stream on.
    pub fn limit_messages(&self, max: usize) {
        self.max_message.store(max.min(MAX_POLICY_MESSAGE), Relaxed);
    }

    pub fn max_message(&self) -> usize {
        self.max_message.load(Relaxed)
    }

    /// Reports `facts` in every Hello and inventory instead of listing this host's interfaces:
    /// for agents that stand for other hosts (the load generator runs thousands in one process,
    /// each with its own addresses).
    pub fn report_facts(&self, facts: HostFacts) {
        *self.fixed_facts.lock().unwrap_or_else(PoisonError::into_inner) = Some(facts);
    }

    /// The facts the stream reports: the fixed ones, or this host's (`None`, logged, when its
    /// interfaces cannot be listed).
    pub(super) async fn facts(&self) -> Option<HostFacts> {
        let fixed = self.fixed_facts.lock().unwrap_or_else(PoisonError::into_inner).clone();
        match fixed {
            Some(facts) => Some(facts),
            None => super::current_facts().await,
        }
    }

    /// Takes the timing the control plane set.
    pub(super) fn hello_ack(&self, ack: &wire::HelloAck) {
        self.flow_window_secs.store(ack.flow_window.as_secs(), Relaxed);
        self.flow_window_max_keys.store(u64::from(ack.flow_window_max_keys), Relaxed);
    }
}

/// Outside changes to the table since the last heartbeat, bounded however long the agent is
/// disconnected: at most [`MAX_TAMPER_REPORTS`] distinct details, each with when it was first
/// seen and how often, and one more entry counting the rest.
#[derive(Debug, Default)]
pub struct TamperLog {
    entries: Vec<(TamperEvent, u32)>,
    others: Option<(SystemTime, u32)>,
}

impl TamperLog {
    pub fn record(&mut self, mut event: TamperEvent) {
        if event.detail.chars().count() > MAX_TAMPER_DETAIL {
            event.detail = event.detail.chars().take(MAX_TAMPER_DETAIL).collect();
        }
        if let Some((_, n)) = self.entries.iter_mut().find(|(e, _)| e.detail == event.detail) {
            *n = n.saturating_add(1);
        } else if self.entries.len() < MAX_TAMPER_REPORTS {
            self.entries.push((event, 1));
        } else {
            let (_, n) = self.others.get_or_insert((event.at, 0));
            *n = n.saturating_add(1);
        }
    }

    /// What the next heartbeat carries; the log starts over.
    pub fn take(&mut self) -> Vec<wire::TamperEvent> {
        let ms =
            |at: SystemTime| at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let mut out: Vec<wire::TamperEvent> = std::mem::take(&mut self.entries)
            .into_iter()
            .map(|(e, count)| wire::TamperEvent { detected_at_unix_ms: ms(e.at), detail: e.detail, count })
            .collect();
        if let Some((at, count)) = self.others.take() {
            out.push(wire::TamperEvent {
                detected_at_unix_ms: ms(at),
                detail: format!("{count} more outside changes with other details"),
                count,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tamper_reports_are_coalesced_and_bounded() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1);
        let mut log = TamperLog::default();
        for round in 0..1000 {
            log.record(TamperEvent { at, detail: format!("change {}", round % 40) });
        }
        log.record(TamperEvent { at, detail: "x".repeat(5000) });
        let sent = log.take();
        assert_eq!(sent.len(), MAX_TAMPER_REPORTS + 1);
        assert_eq!((sent[0].detail.as_str(), sent[0].count), ("change 0", 25));
        let last = &sent[MAX_TAMPER_REPORTS];
        assert_eq!(last.detail, "601 more outside changes with other details");
        assert_eq!(sent.iter().map(|e| e.count).sum::<u32>(), 1001, "every change is counted");
        assert!(log.take().is_empty(), "the log starts over");
        log.record(TamperEvent { at, detail: "y".repeat(5000) });
        assert_eq!(log.take()[0].detail.chars().count(), MAX_TAMPER_DETAIL);
    }
}
