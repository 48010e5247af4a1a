//! The agent side of the policy stream (SYNC-2, SYNC-4, SYNC-9, SYNC-10): Hello with the applied
//! version, then every update applied strictly in stream order through the policy store and
//! acked APPLIED or FAILED; heartbeats carry liveness, renewal trouble and tamper reports.
//! [`next_policy`] is the pure core: what an update turns the held policy into, or why not.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use innerwall_wire::convert::ControlMessageError;
use innerwall_wire::identity::HostFacts;
use innerwall_wire::policy::{ApplyError, Version, WorkloadPolicy};
use innerwall_wire::proto;
use innerwall_wire::sync::{
    self as wire, Ack, AgentMessage, ControlMessage, Heartbeat, Hello, Inventory, MAX_POLICY_MESSAGE,
    MAX_TAMPER_DETAIL, MAX_TAMPER_REPORTS, Update,
};
use tokio::sync::mpsc;
use tonic::transport::Channel;

pub mod core;
pub mod planted;

use crate::enforce::{EnforceError, Installed, PolicyStore, TamperEvent};
use crate::error;
use crate::evidence::flows;
use crate::metrics::{ApplyResult, Metrics};

/// Why an update was refused as a unit; its text is the detail of the FAILED ack.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error("delta from version {from_version} but no policy is held; a snapshot must come first")]
    NoBase { from_version: Version },
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Store(#[from] EnforceError),
}

/// The complete next policy an update describes, given what the agent holds; or why it is
/// refused as a unit (SYNC-4): a delta whose base the agent does not hold. (A malformed update
/// never gets here: the conversion at the edge refuses it, naming its version.)
pub fn next_policy(held: Option<&WorkloadPolicy>, update: &Update) -> Result<WorkloadPolicy, UpdateError> {
    match update {
        Update::Snapshot(p) => Ok(p.clone()),
        Update::Delta(delta) => {
            let held = held.ok_or(UpdateError::NoBase { from_version: delta.from_version })?;
            Ok(held.apply(delta)?)
        }
    }
}

/// The store plus what the heartbeat reports. Shared by the sync stream, the drift timer and
/// the renewal task.
#[derive(Debug)]
pub struct Enforcer<S> {
    pub store: Mutex<S>,
    tamper: Mutex<TamperLog>,
    renewal_error: Mutex<String>,
    started: Instant,
    /// Connection attempts that failed, and streams that reached HelloAck (for status/tests).
    pub dial_failures: std::sync::atomic::AtomicU64,
    pub streams: std::sync::atomic::AtomicU64,
    /// The latest failed dials of the policy stream with the backoff each chose (at most
    /// [`DIAL_LOG`]), so a test can hold every wait to its full-jitter window.
    pub dial_log: Mutex<std::collections::VecDeque<DialFailure>>,
    /// Flow window length and key cap the control plane set in the last HelloAck.
    pub flow_window_secs: std::sync::atomic::AtomicU64,
    pub flow_window_max_keys: std::sync::atomic::AtomicU64,
    /// Counts credential renewals: the policy stream moves to the new certificate at once,
    /// because the control plane ends a stream when the certificate it opened with expires.
    pub renewals: tokio::sync::watch::Sender<u64>,
    /// Whether the kill switch is engaged, as last seen; the stream reports a change at once.
    suspension: tokio::sync::watch::Sender<bool>,
    /// The evidence loop, when one runs: asked to close its flow window at every version
    /// change, before the change is acked (see [`Enforcer::window_closes`]).
    evidence: Mutex<Option<std::sync::mpsc::Sender<WindowClose>>>,
    /// What the agent exposes to Prometheus (`run --metrics-listen`).
    pub metrics: Arc<Metrics>,
    /// Host facts to report instead of this host's own (see [`Enforcer::report_facts`]).
    fixed_facts: Mutex<Option<HostFacts>>,
    /// The largest policy-stream message this agent decodes: `wire::sync::MAX_POLICY_MESSAGE`,
    /// lowered only to test what an agent does with an update it cannot read.
    max_message: std::sync::atomic::AtomicUsize,
}

/// How many failed dials [`Enforcer::dial_log`] keeps.
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

impl<S> Enforcer<S> {
    /// Notes a failed dial; the oldest entry goes once [`DIAL_LOG`] are kept.
    pub fn note_dial_failure(&self, failure: DialFailure) {
        let mut log = self.dial_log.lock().unwrap_or_else(PoisonError::into_inner);
        if log.len() == DIAL_LOG {
            log.pop_front();
        }
        log.push_back(failure);
    }

    /// The failed dials kept, oldest first.
    pub fn dial_failures_logged(&self) -> Vec<DialFailure> {
        self.dial_log.lock().unwrap_or_else(PoisonError::into_inner).iter().copied().collect()
    }
}

/// A request to the evidence loop to close its open flow window now, because the applied
/// version changed; it answers on the enclosed channel once it has.
pub type WindowClose = std::sync::mpsc::SyncSender<()>;

/// How long an apply waits for the evidence loop to close its window before acking anyway.
const WINDOW_CLOSE_WAIT: Duration = Duration::from_secs(2);

impl<S: PolicyStore> Enforcer<S> {
    pub fn new(store: S) -> Self {
        let suspended = store.suspended();
        let metrics = Arc::new(Metrics::new());
        metrics.set_applied_version(store.applied_version());
        Enforcer {
            store: Mutex::new(store),
            tamper: Mutex::new(TamperLog::default()),
            renewal_error: Mutex::new(String::new()),
            started: Instant::now(),
            dial_failures: Default::default(),
            streams: Default::default(),
            dial_log: Default::default(),
            flow_window_secs: std::sync::atomic::AtomicU64::new(60),
            flow_window_max_keys: std::sync::atomic::AtomicU64::new(10_000),
            renewals: tokio::sync::watch::Sender::new(0),
            suspension: tokio::sync::watch::Sender::new(suspended),
            evidence: Mutex::new(None),
            metrics,
            fixed_facts: Mutex::new(None),
            max_message: std::sync::atomic::AtomicUsize::new(MAX_POLICY_MESSAGE),
        }
    }

    /// Lowers the largest policy-stream message this agent decodes (never above
    /// `wire::sync::MAX_POLICY_MESSAGE`), from the next stream on.
    pub fn limit_messages(&self, max: usize) {
        self.max_message.store(max.min(MAX_POLICY_MESSAGE), std::sync::atomic::Ordering::Relaxed);
    }

    /// Reports `facts` in every Hello and inventory instead of listing this host's interfaces:
    /// for agents that stand for other hosts (the load generator runs thousands in one process,
    /// each with its own addresses).
    pub fn report_facts(&self, facts: HostFacts) {
        *self.fixed_facts.lock().unwrap_or_else(PoisonError::into_inner) = Some(facts);
    }

    /// The facts the stream reports: the fixed ones, or this host's (`None`, logged, when its
    /// interfaces cannot be listed).
    async fn facts(&self) -> Option<HostFacts> {
        let fixed = self.fixed_facts.lock().unwrap_or_else(PoisonError::into_inner).clone();
        match fixed {
            Some(facts) => Some(facts),
            None => current_facts().await,
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
        flows::judged(store.current().cloned(), store.suspended())
    }

    /// The version and mode flows are judged under now, without copying the policy.
    pub fn judged_as(&self) -> flows::JudgedAs {
        let store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        let (version, mode) = flows::judged_as(store.current());
        (version, flows::judged_mode(mode, store.suspended()))
    }

    /// Looks at the kill switch again; a change is reported on the stream at once. Returns
    /// whether it changed.
    pub fn note_suspension(&self) -> bool {
        let now = self.suspended();
        self.suspension.send_if_modified(|seen| std::mem::replace(seen, now) != now)
    }

    /// [`note_suspension`](Self::note_suspension), and on a change the evidence loop closes its
    /// window (what an enforcing policy does changed). Blocking.
    pub fn refresh_suspension(&self) {
        if self.note_suspension() {
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
        if self.note_suspension() || changed {
            self.close_evidence_window();
        }
        Ok(installed)
    }

    pub fn report_tamper(&self, event: TamperEvent) {
        self.tamper.lock().unwrap_or_else(PoisonError::into_inner).record(event);
    }

    pub fn set_renewal_error(&self, error: String) {
        *self.renewal_error.lock().unwrap_or_else(PoisonError::into_inner) = error;
    }

    fn heartbeat(&self) -> AgentMessage {
        let tamper = self.tamper.lock().unwrap_or_else(PoisonError::into_inner).take();
        AgentMessage::Heartbeat(Heartbeat {
            uptime: self.started.elapsed(),
            credential_renewal_error: self
                .renewal_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            tamper_events: tamper,
            suspended: *self.suspension.borrow(),
        })
    }
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// The server closed the stream or it failed; reconnect with backoff.
    Closed(String),
    /// The control plane refused the stream for rate (REL-1: RESOURCE_EXHAUSTED, too many
    /// reconnects or heartbeats): reconnect with backoff, but not before the wait it named.
    Throttled(String, Duration),
    /// The server asked for a reconnect (SYNC-8); reconnect at once.
    Reconnect,
    /// The credential was renewed; reconnect at once, with the new certificate.
    Renewed,
    /// The identity cannot be renewed; an operator must enroll the host again.
    Reenroll(String),
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

/// How a stream refused or ended by the control plane ends the session. PERMISSION_DENIED is
/// the control plane refusing this identity (retired or deny-listed): no reconnect can change
/// that, only a new enrollment. RESOURCE_EXHAUSTED with a `retry-after` is a rate refusal:
/// the next attempt waits at least that long.
fn refused(what: &str, status: &tonic::Status) -> SessionEnd {
    let reason = format!("{what}: {}", status.message());
    match (status.code(), innerwall_wire::backoff::retry_after(status)) {
        (tonic::Code::PermissionDenied, _) => SessionEnd::Reenroll(reason),
        (_, Some(wait)) => SessionEnd::Throttled(reason, wait),
        _ => SessionEnd::Closed(reason),
    }
}

/// Whether the stream failed on an update this agent could not read (over its decoding limit,
/// or not a message), rather than for the stream itself: the control plane is told.
fn unreadable(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::OutOfRange => true,
        tonic::Code::Internal => status.message().contains("failed to decode"),
        _ => false,
    }
}

/// Counters the daemon and tests read.
#[derive(Debug, Default)]
pub struct SessionStats {
    /// True once HelloAck arrived: the stream was healthy, so backoff resets.
    pub established: bool,
    pub updates: u64,
}

fn msg(m: &AgentMessage) -> proto::SyncRequest {
    m.into()
}

/// This host's facts, or `None` (logged) when its interfaces cannot be listed.
async fn current_facts() -> Option<HostFacts> {
    match tokio::task::spawn_blocking(crate::identity::facts::host_facts).await {
        Ok(Ok(facts)) => Some(facts),
        Ok(Err(e)) => {
            tracing::warn!("not reporting host facts: {}", error::chain(&e));
            None
        }
        Err(_) => None,
    }
}

/// One sync stream on `channel`, until it ends: the I/O around [`core::StreamCore`], which
/// decides.
pub async fn session<S: PolicyStore + Send + 'static>(
    channel: Channel,
    enforcer: Arc<Enforcer<S>>,
    stats: &mut SessionStats,
) -> SessionEnd {
    use std::sync::atomic::Ordering::Relaxed;
    // Without facts (interfaces could not be listed) the Hello says nothing about the host.
    let facts = enforcer.facts().await;
    enforcer.note_suspension();
    let mut suspension = enforcer.suspension.subscribe();
    let suspended = *suspension.borrow_and_update();
    let hello = Hello {
        applied_version: enforcer.applied_version(),
        agent: crate::identity::facts::agent_info(),
        facts,
        suspended,
    };
    let (tx, rx) = mpsc::channel(64);
    if tx.send(msg(&AgentMessage::Hello(Box::new(hello)))).await.is_err() {
        return SessionEnd::Closed("could not queue Hello".into());
    }
    // A renewal from here on moves the stream to the new certificate (one made between the dial
    // and here is caught by the stream's end at the old certificate's expiry, then a redial).
    let mut renewals = enforcer.renewals.subscribe();
    let max_message = enforcer.max_message.load(Relaxed);
    let mut client =
        proto::agent_service_client::AgentServiceClient::new(channel).max_decoding_message_size(max_message);
    let mut inbound = match client.sync(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(s) => return refused("sync refused", &s),
    };
    let hello_ack = match tokio::time::timeout(Duration::from_secs(30), inbound.message()).await {
        Ok(Ok(Some(res))) => match ControlMessage::try_from(res) {
            Ok(ControlMessage::HelloAck(a)) => a,
            _ => return SessionEnd::Closed("no HelloAck".into()),
        },
        Ok(Err(s)) => return refused("stream refused", &s),
        _ => return SessionEnd::Closed("no HelloAck".into()),
    };
    stats.established = true;
    enforcer.flow_window_secs.store(hello_ack.flow_window.as_secs(), Relaxed);
    enforcer.flow_window_max_keys.store(u64::from(hello_ack.flow_window_max_keys), Relaxed);
    enforcer.streams.fetch_add(1, Relaxed);
    enforcer.metrics.stream_connected(true);
    let origin = tokio::time::Instant::now();
    let mut core = core::StreamCore::new(suspended);
    let mut next = Some(core::Event::Opened(hello_ack));
    loop {
        if let Some(event) = next.take() {
            let now = origin.elapsed();
            if let Some(end) = carry_out(&mut core, event, now, &enforcer, &tx, stats).await {
                return end;
            }
        }
        let deadline = origin + core.next_deadline().min(Duration::from_secs(86_400 * 365));
        next = tokio::select! {
            () = tx.closed(), if core.deaf() => {
                return SessionEnd::Closed("the control plane ended the stream after an update this agent could not read".into());
            }
            message = inbound.message(), if !core.deaf() => match message {
                Ok(Some(res)) => match ControlMessage::try_from(res) {
                    Ok(ControlMessage::Update(update)) => Some(core::Event::Update(update)),
                    Ok(ControlMessage::Directive(d)) => Some(core::Event::Directive(d)),
                    Ok(ControlMessage::HelloAck(_)) | Err(ControlMessageError::Unknown) => None,
                    Err(ControlMessageError::SnapshotWithoutPolicy) => {
                        return SessionEnd::Closed("snapshot without a policy".into());
                    }
                    Err(malformed @ (ControlMessageError::MalformedSnapshot { version, .. }
                    | ControlMessageError::MalformedDelta { version, .. })) => {
                        enforcer.metrics.applied(ApplyResult::Failed, Duration::ZERO, enforcer.applied_version());
                        Some(core::Event::Malformed { version, detail: malformed.to_string() })
                    }
                },
                Ok(None) => return SessionEnd::Closed("server closed the stream".into()),
                Err(s) if unreadable(&s) => {
                    enforcer.metrics.applied(ApplyResult::Failed, Duration::ZERO, enforcer.applied_version());
                    Some(core::Event::Unreadable(format!(
                        "{} (this agent decodes at most {max_message} bytes)",
                        s.message()
                    )))
                }
                Err(s) => return refused("stream ended", &s),
            },
            _ = renewals.changed() => Some(core::Event::Renewed),
            _ = suspension.changed() => Some(core::Event::Suspension(*suspension.borrow_and_update())),
            () = tokio::time::sleep_until(deadline) => Some(core::Event::Tick),
        };
    }
}

/// Hands `event` to the core and carries out its effects in order, feeding an apply's result
/// back before the effects after it; `Some` when the stream ended.
async fn carry_out<S: PolicyStore + Send + 'static>(
    core: &mut core::StreamCore,
    event: core::Event,
    now: core::Time,
    enforcer: &Arc<Enforcer<S>>,
    tx: &mpsc::Sender<proto::SyncRequest>,
    stats: &mut SessionStats,
) -> Option<SessionEnd> {
    let mut queue: std::collections::VecDeque<core::Effect> = core.handle(event, now).into();
    while let Some(effect) = queue.pop_front() {
        let message = match effect {
            core::Effect::Send(message) => {
                if let AgentMessage::Ack(ack) = &message {
                    stats.updates += 1;
                    if let Ack::Failed(version, detail) = ack {
                        tracing::warn!(version, "refused an update: {detail}");
                        // An apply counts itself (`Enforcer::apply`); a refusal without one here.
                        if detail == core::AFTER_FAILURE {
                            enforcer.metrics.applied(
                                ApplyResult::Failed,
                                Duration::ZERO,
                                enforcer.applied_version(),
                            );
                        }
                    }
                }
                message
            }
            core::Effect::Apply(update) => {
                let version = update.version();
                let e = enforcer.clone();
                let result =
                    tokio::task::spawn_blocking(move || e.apply(&update).map_err(|e| error::chain(&e)))
                        .await
                        .unwrap_or_else(|e| Err(format!("apply task failed: {e}")));
                if let Ok(Installed::Held) = result {
                    tracing::warn!(version, "kill switch engaged: holding the policy without installing it");
                }
                let next = core.handle(core::Event::Applied { version, result }, now);
                for effect in next.into_iter().rev() {
                    queue.push_front(effect);
                }
                continue;
            }
            core::Effect::Heartbeat => enforcer.heartbeat(),
            core::Effect::Inventory => {
                // No report when the interfaces cannot be listed: the addresses the control plane
                // knows stand, they never become "none".
                let Some(facts) = enforcer.facts().await else { continue };
                AgentMessage::Inventory(Box::new(Inventory {
                    facts: Some(facts),
                    listening_services: Vec::new(),
                }))
            }
            core::Effect::End(end) => return Some(end),
        };
        if tx.send(msg(&message)).await.is_err() {
            return Some(SessionEnd::Closed("stream closed".into()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::{Mode, diff};
    use innerwall_wire::testing;

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

    #[test]
    fn a_refused_identity_ends_in_reenroll_anything_else_in_a_reconnect() {
        let denied = tonic::Status::permission_denied("workload w is retired");
        assert_eq!(
            refused("sync refused", &denied),
            SessionEnd::Reenroll("sync refused: workload w is retired".into())
        );
        for status in [tonic::Status::unavailable("down"), tonic::Status::unauthenticated("expired")] {
            assert!(matches!(refused("stream ended", &status), SessionEnd::Closed(_)), "{status:?}");
        }
        // A rate refusal names its wait; without a readable one it is any other closed stream.
        let throttled = innerwall_wire::backoff::refuse("heartbeats over the bound", Duration::from_secs(12));
        assert_eq!(
            refused("stream ended", &throttled),
            SessionEnd::Throttled(
                "stream ended: heartbeats over the bound; retry after 12 s".into(),
                Duration::from_secs(12)
            )
        );
        let bare = tonic::Status::resource_exhausted("busy");
        assert!(matches!(refused("sync refused", &bare), SessionEnd::Closed(_)));
    }

    #[test]
    fn only_an_update_the_agent_cannot_decode_is_unreadable() {
        let over = tonic::Status::out_of_range(
            "Error, decoded message length too large: found 5000 bytes, the limit is: 2048 bytes",
        );
        assert!(unreadable(&over));
        assert!(unreadable(&tonic::Status::internal("failed to decode Protobuf message: invalid wire type")));
        for other in [
            tonic::Status::internal("h2 protocol error"),
            tonic::Status::unavailable("down"),
            tonic::Status::aborted("superseded"),
        ] {
            assert!(!unreadable(&other), "{other:?}");
        }
    }

    fn policy(version: u64, ports: &[u16]) -> WorkloadPolicy {
        testing::policy(version, Mode::Enforcement, ports)
    }

    #[test]
    fn snapshots_replace_and_deltas_need_their_base() {
        let v1 = policy(1, &[22]);
        let v2 = policy(2, &[22, 443]);
        let snap = Update::Snapshot(v1.clone());
        assert_eq!(next_policy(None, &snap).unwrap(), v1);
        let delta = Update::Delta(diff(&v1, &v2));
        assert_eq!(next_policy(Some(&v1), &delta).unwrap(), v2);
        let wrong_base = next_policy(Some(&v2), &delta).unwrap_err();
        assert!(matches!(wrong_base, UpdateError::Apply(_)), "{wrong_base}");
        assert!(wrong_base.to_string().contains("based on version 1 but version 2 is held"), "{wrong_base}");
        let no_base = next_policy(None, &delta).unwrap_err();
        assert!(matches!(no_base, UpdateError::NoBase { from_version: 1 }), "{no_base}");
    }
}
