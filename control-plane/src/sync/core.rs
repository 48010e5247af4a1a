//! One stream's logic as a state machine without I/O or a clock (SYNC-2..SYNC-11):
//! `handle(event, now) -> effects`. It holds the [`Session`] (tip, in-flight updates, acks,
//! recovery snapshots, convergence states) and everything around it that used to live among
//! SQL and tokio in the gateway's task: Hello first, liveness and the certificate's expiry as
//! deadlines, supersede by epoch (a state write that finds a newer stream ends this one),
//! directives, inventory coalescing and the push bookkeeping behind the latency metrics.
//!
//! The driver (`driver`) carries out the effects in order against a [`super::store::SyncStore`]
//! and feeds what they return back as events; the gateway adds the network, the simulator
//! simulated time. Time is a [`Duration`] since the driver's origin, so a test can be at any
//! moment.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use innerwall_wire::policy::{Version, WorkloadPolicy};
use innerwall_wire::sync::{
    AckStatus, AgentMessage, ControlMessage, Directive, Heartbeat, Hello, HelloAck, SyncState, Update,
};
use tonic::Status;

use super::session::{Action, Record, Session};

/// A moment of the stream's clock: time since the driver's origin.
pub type Time = Duration;

/// What the core is told at the start.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// A stream silent this long ends (SYNC-9); also the wait for Hello.
    pub liveness: Duration,
    /// The timing handed to the agent in HelloAck.
    pub hello_ack: HelloAck,
    /// When the client certificate the stream was opened with expires.
    pub expires: Time,
}

/// Instructions to one stream from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Tell the agent to reconnect (directed resend-snapshot, SYNC-8), then end the stream.
    Reconnect,
    /// End the stream: superseded by a newer one from the same identity, or the replica is
    /// shutting down.
    End { reason: String, superseded: bool },
    /// Tell the agent to enroll again (the workload was retired or deny-listed), then end.
    Reenroll { reason: String },
}

/// What happened.
#[derive(Debug, Clone)]
pub enum Event {
    /// A message from the agent.
    Message(AgentMessage),
    /// The store admitted the stream's Hello ([`Effect::Admit`]).
    Admitted,
    /// The workload's persisted policy ([`Effect::LoadPersisted`]); `claimed` is the stored
    /// policy of the version Hello claimed, read only under a planted bug (`planted`).
    Opened {
        persisted: WorkloadPolicy,
        claimed: Option<WorkloadPolicy>,
    },
    /// A render announced a newer version, or the listener reconnected: read the latest.
    Announced,
    /// The persisted policy as read ([`Effect::ReadLatest`]), with when it was committed.
    Latest {
        policy: WorkloadPolicy,
        committed: DateTime<Utc>,
    },
    /// The update of `version` encodes to `size` bytes, over the stream's largest message: it
    /// was not sent.
    Unsendable {
        version: Version,
        size: usize,
    },
    /// A state write ([`Effect::Record`]) finished; `current` is false when a newer stream of
    /// the identity (on any replica) owns the workload's row.
    Recorded {
        current: bool,
    },
    /// The store deferred an inventory change ([`Effect::CommitInventory`]) for `wait`.
    InventoryDeferred {
        addresses: BTreeSet<IpAddr>,
        wait: Duration,
    },
    Control(Control),
    /// Time passed: the deadlines are checked.
    Tick,
}

/// What the driver must do, in order. An effect whose result the core needs is answered with
/// the event its documentation names, before the effects after it.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Admit the Hello (a live workload, the next epoch, the version it reports installed, a
    /// clone check); then [`Event::Admitted`], or the stream ends with the store's refusal.
    Admit(Box<Hello>),
    /// Read the persisted policy, rendering first if there is none (POL-6); then
    /// [`Event::Opened`]. `claimed` is the version Hello claimed (never a delta base).
    LoadPersisted { claimed: Version },
    /// Send to the agent; then [`Event::Unsendable`] if it is an update over the largest message.
    Send(ControlMessage),
    /// Send a directive whose stream ends next; a failure to send it changes nothing.
    Direct(Directive),
    /// Read the persisted policy; then [`Event::Latest`] if there is one.
    ReadLatest,
    /// Write the convergence state (installs first); then [`Event::Recorded`].
    Record(Record),
    /// A heartbeat: the stream's beat with the state it last recorded, and what it reports.
    Beat { heartbeat: Heartbeat, state: Option<SyncState> },
    /// Store the reported addresses (renders if they changed), unless they changed less than
    /// the minimum interval ago; then [`Event::InventoryDeferred`] if deferred.
    CommitInventory(BTreeSet<IpAddr>),
    /// Count an ack; `committed`: when its version was committed, if it was pushed as a delta.
    Acked { status: AckStatus, committed: Option<DateTime<Utc>> },
    /// A version committed at `committed` was pushed as a delta.
    Pushed { committed: DateTime<Utc> },
    /// A recovery snapshot was sent (SYNC-5).
    RecoverySnapshot,
    /// The stream ends.
    End(Ended),
}

/// Why a stream ended, whether its end means the workload is offline, and the status the agent
/// is told (`None`: the stream just closes).
#[derive(Debug, Clone)]
pub struct Ended {
    pub reason: String,
    pub offline: bool,
    pub status: Option<Status>,
}

impl Ended {
    pub fn offline(reason: impl Into<String>) -> Self {
        Ended { reason: reason.into(), offline: true, status: None }
    }

    pub fn refused(status: Status) -> Self {
        Ended { reason: status.message().to_owned(), offline: true, status: Some(status) }
    }

    fn invalid(reason: impl Into<String>) -> Self {
        Ended::refused(Status::invalid_argument(reason.into()))
    }
}

#[derive(Debug)]
enum Phase {
    /// Until Hello, for at most the liveness bound from the start.
    AwaitingHello,
    /// Hello is being admitted and the persisted policy read; what Hello claimed.
    Opening {
        claimed: Version,
        suspended: bool,
    },
    Open(Box<Session>),
    Ended,
}

/// The latest inventory report not applied yet, and when it is due.
#[derive(Debug, Default)]
struct Pending {
    addresses: Option<BTreeSet<IpAddr>>,
    due: Option<Time>,
}

/// The commit times of versions sent as deltas and not acked yet (for the push latencies).
/// Bounded: an agent that never acks cannot grow it.
#[derive(Debug, Default)]
struct Pushes(BTreeMap<Version, DateTime<Utc>>);

impl Pushes {
    const MAX: usize = 64;

    fn sent(&mut self, version: Version, committed: DateTime<Utc>) {
        self.0.insert(version, committed);
        while self.0.len() > Self::MAX {
            self.0.pop_first();
        }
    }

    /// The commit time of `version` if it was sent as a delta; it and every older version are
    /// settled (acks come in send order).
    fn acked(&mut self, version: Version) -> Option<DateTime<Utc>> {
        let later = self.0.split_off(&(version.saturating_add(1)));
        let settled = std::mem::replace(&mut self.0, later);
        settled.get(&version).copied()
    }
}

/// The first wait before a stalled recovery is tried again, and the longest.
pub const RECOVERY_RETRY: Duration = Duration::from_secs(30);
pub const MAX_RECOVERY_RETRY: Duration = Duration::from_secs(600);

/// One stream.
#[derive(Debug)]
pub struct StreamCore {
    config: CoreConfig,
    phase: Phase,
    /// When a stalled recovery is tried again, and the wait after that one.
    retry_at: Option<Time>,
    retry_wait: Duration,
    /// When the agent was last heard from (the start, before Hello).
    heard: Time,
    inventory: Pending,
    pushes: Pushes,
    /// The state this stream last recorded.
    recorded: Option<SyncState>,
}

impl StreamCore {
    /// A stream that opened at `now`; it waits for Hello.
    pub fn new(config: CoreConfig, now: Time) -> Self {
        StreamCore {
            config,
            phase: Phase::AwaitingHello,
            retry_at: None,
            retry_wait: RECOVERY_RETRY,
            heard: now,
            inventory: Pending::default(),
            pushes: Pushes::default(),
            recorded: None,
        }
    }

    /// The earliest moment a [`Event::Tick`] can change something.
    pub fn next_deadline(&self) -> Time {
        let mut next = self.config.expires.min(self.heard + self.config.liveness);
        if let (Some(due), Some(_)) = (self.inventory.due, &self.inventory.addresses) {
            next = next.min(due);
        }
        if let Some(retry) = self.retry_at {
            next = next.min(retry);
        }
        next
    }

    /// Whether the stream has ended.
    pub fn ended(&self) -> bool {
        matches!(self.phase, Phase::Ended)
    }

    /// Whether Hello was admitted and the opening snapshot sent.
    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open(_))
    }

    /// The version the stream carries, once open.
    pub fn tip_version(&self) -> Option<Version> {
        match &self.phase {
            Phase::Open(session) => Some(session.tip_version()),
            _ => None,
        }
    }

    fn end(&mut self, ended: Ended) -> Vec<Effect> {
        self.phase = Phase::Ended;
        vec![Effect::End(ended)]
    }

    /// The session's actions as effects: records remember their state, sends become messages.
    fn effects(&mut self, actions: Vec<Action>) -> Vec<Effect> {
        let mut out = Vec::with_capacity(actions.len());
        for action in actions {
            match action {
                Action::Send(update) => out.push(Effect::Send(ControlMessage::Update(update))),
                Action::Record(r) => {
                    self.recorded = Some(r.state);
                    out.push(Effect::Record(r));
                }
                Action::Close(reason) => {
                    out.extend(self.end(Ended::invalid(reason)));
                    break;
                }
                Action::Redial(reason) => {
                    let status = Some(Status::aborted(reason.clone()));
                    out.extend(self.end(Ended { reason, offline: false, status }));
                    break;
                }
            }
        }
        out
    }

    pub fn handle(&mut self, event: Event, now: Time) -> Vec<Effect> {
        if self.ended() {
            return Vec::new();
        }
        match event {
            Event::Tick => self.tick(now),
            Event::Message(message) => {
                self.heard = now;
                self.message(message, now)
            }
            Event::Admitted => match self.phase {
                Phase::Opening { claimed, .. } => vec![
                    Effect::Send(ControlMessage::HelloAck(self.config.hello_ack)),
                    Effect::LoadPersisted { claimed },
                ],
                _ => Vec::new(),
            },
            Event::Opened { persisted, claimed: base } => {
                let Phase::Opening { claimed, suspended } = self.phase else { return Vec::new() };
                let (session, actions) = match base {
                    Some(base) if super::planted::on(super::planted::Bug::DeltaFromClaim) => {
                        Session::planted_open_from(base, persisted, suspended)
                    }
                    _ => Session::open(persisted, claimed, suspended),
                };
                self.phase = Phase::Open(Box::new(session));
                self.effects(actions)
            }
            Event::Announced => match self.phase {
                Phase::Open(_) => vec![Effect::ReadLatest],
                _ => Vec::new(),
            },
            Event::Latest { policy, committed } => {
                let Phase::Open(session) = &mut self.phase else { return Vec::new() };
                let version = policy.version();
                let actions = session.persisted(policy);
                let delta = actions.iter().any(|a| matches!(a, Action::Send(Update::Delta(_))));
                let mut out = self.effects(actions);
                if delta {
                    self.pushes.sent(version, committed);
                    out.push(Effect::Pushed { committed });
                }
                out
            }
            Event::Unsendable { version, size } => {
                let Phase::Open(session) = &mut self.phase else { return Vec::new() };
                let max = innerwall_wire::sync::MAX_POLICY_MESSAGE;
                let actions = session.unsendable(version, size, max);
                self.effects(actions)
            }
            Event::Recorded { current: true } => Vec::new(),
            Event::Recorded { current: false }
                if super::planted::on(super::planted::Bug::KeepSupersededStream) =>
            {
                Vec::new()
            }
            Event::Recorded { current: false } => {
                // Another replica holds a newer stream of this identity (the agent reconnected
                // there): this one is stale and must not speak for it.
                let reason = "superseded by a newer stream on another replica";
                self.end(Ended {
                    reason: reason.into(),
                    offline: false,
                    status: Some(Status::aborted(reason)),
                })
            }
            Event::InventoryDeferred { addresses, wait } => {
                // A newer report that arrived meanwhile wins.
                self.inventory.addresses.get_or_insert(addresses);
                self.inventory.due = Some(now + wait);
                Vec::new()
            }
            Event::Control(control) => self.control(control),
        }
    }

    fn tick(&mut self, now: Time) -> Vec<Effect> {
        if now >= self.config.expires {
            // An agent that cannot renew cannot hold a stream (seed 000): the agent renews well
            // before, and reconnects.
            let reason = "its client certificate expired: renew before expiry, or enroll again";
            let status = Status::unauthenticated(format!("the stream ended because {reason}"));
            return self.end(Ended { reason: reason.into(), offline: true, status: Some(status) });
        }
        if now >= self.heard + self.config.liveness {
            let reason = match self.phase {
                Phase::AwaitingHello => "no Hello within the liveness bound",
                _ => "silent for three heartbeat intervals",
            };
            return self.end(Ended::offline(reason));
        }
        let mut out = Vec::new();
        if let (Some(retry), Phase::Open(session)) = (self.retry_at, &mut self.phase)
            && retry <= now
        {
            self.retry_at = None;
            let actions = session.retry_recovery();
            if !actions.is_empty() {
                // The next wait doubles: a persistent refusal costs one snapshot per wait.
                self.retry_wait = (self.retry_wait * 2).min(MAX_RECOVERY_RETRY);
                out.push(Effect::RecoverySnapshot);
                out.extend(self.effects(actions));
            }
        }
        if let (Some(due), Phase::Open(_)) = (self.inventory.due, &self.phase)
            && due <= now
        {
            self.inventory.due = None;
            out.extend(self.inventory.addresses.take().map(Effect::CommitInventory));
        }
        out
    }

    fn message(&mut self, message: AgentMessage, now: Time) -> Vec<Effect> {
        let session = match &mut self.phase {
            Phase::AwaitingHello => {
                return match message {
                    AgentMessage::Hello(hello) => {
                        self.phase =
                            Phase::Opening { claimed: hello.applied_version, suspended: hello.suspended };
                        vec![Effect::Admit(hello)]
                    }
                    _ => self.end(Ended::invalid("the first message must be Hello")),
                };
            }
            // The driver reads nothing while a stream opens; a message now is out of order.
            Phase::Opening { .. } => return self.end(Ended::invalid("a message before HelloAck")),
            Phase::Open(session) => session,
            Phase::Ended => return Vec::new(),
        };
        match message {
            AgentMessage::Ack(ack) => {
                let status = ack.status();
                let committed = self.pushes.acked(ack.version());
                let actions = session.ack(ack);
                // The only snapshots an ack earns are recovery snapshots (SYNC-5).
                let recoveries =
                    actions.iter().filter(|a| matches!(a, Action::Send(Update::Snapshot(_)))).count();
                let mut out = vec![Effect::Acked { status, committed }];
                out.extend(std::iter::repeat_n(Effect::RecoverySnapshot, recoveries));
                if session.stalled() {
                    self.retry_at.get_or_insert(now + self.retry_wait);
                } else if matches!(status, AckStatus::Applied | AckStatus::Held) {
                    self.retry_wait = RECOVERY_RETRY;
                }
                out.extend(self.effects(actions));
                out
            }
            AgentMessage::Heartbeat(heartbeat) => {
                let actions = session.suspended(heartbeat.suspended);
                let mut out = vec![Effect::Beat { heartbeat, state: self.recorded }];
                out.extend(self.effects(actions));
                out
            }
            AgentMessage::Inventory(inventory) => {
                // A report without facts (the agent could not list its interfaces) says nothing
                // about addresses: the last known set stands, it never becomes "no addresses".
                let Some(facts) = &inventory.facts else { return Vec::new() };
                match crate::policy::spec::routable_addresses(facts) {
                    Ok(addresses) => {
                        // The latest report replaces any earlier pending one; the first is due
                        // at once (the store decides whether it must wait).
                        self.inventory.addresses = Some(addresses);
                        self.inventory.due.get_or_insert(now);
                        Vec::new()
                    }
                    Err(e) => self.end(Ended::refused(Status::from(e))),
                }
            }
            AgentMessage::Hello(_) => self.end(Ended::invalid("Hello may only open a stream")),
        }
    }

    fn control(&mut self, control: Control) -> Vec<Effect> {
        match control {
            Control::Reconnect => {
                let mut out = vec![Effect::Direct(Directive::Reconnect)];
                out.extend(self.end(Ended::offline("directed reconnect")));
                out
            }
            Control::Reenroll { reason } => {
                let directive = Directive::Reenroll { reason: format!("{reason}: enroll this host again") };
                let mut out = vec![Effect::Direct(directive)];
                out.extend(self.end(Ended { reason, offline: true, status: None }));
                out
            }
            Control::End { reason, superseded } => {
                let status = Status::aborted(reason.clone());
                self.end(Ended { reason, offline: !superseded, status: Some(status) })
            }
        }
    }
}

/// What the core's tests and the driver's share: a stream at a moment, Hello, policies.
#[cfg(test)]
pub(crate) mod test_support {
    use innerwall_wire::policy::Mode;

    use super::*;

    pub(crate) const LIVENESS: Duration = Duration::from_secs(90);

    pub(crate) fn policy(version: u64) -> WorkloadPolicy {
        innerwall_wire::testing::policy(version, Mode::Enforcement, &[22, 443 + version as u16])
    }

    pub(crate) fn core(at: Time) -> StreamCore {
        let hello_ack = HelloAck {
            heartbeat: Duration::from_secs(30),
            inventory: Duration::from_secs(300),
            flow_window: Duration::from_secs(60),
            flow_window_max_keys: 10,
        };
        StreamCore::new(CoreConfig { liveness: LIVENESS, hello_ack, expires: Duration::from_secs(3_600) }, at)
    }

    pub(crate) fn hello(applied: u64) -> Event {
        Event::Message(AgentMessage::Hello(Box::new(Hello {
            applied_version: applied,
            ..Default::default()
        })))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use innerwall_wire::identity::{HostFacts, NetworkInterface};
    use innerwall_wire::sync::{Ack, Inventory};

    use super::test_support::{LIVENESS, core, hello, policy};
    use super::*;

    #[test]
    fn hello_comes_first_and_only_first() {
        let mut c = core(Duration::ZERO);
        let effects = c.handle(Event::Message(AgentMessage::Ack(Ack::Applied(1))), Duration::ZERO);
        assert!(matches!(&effects[..], [Effect::End(e)] if e.reason == "the first message must be Hello"));
        assert!(c.ended());
        assert!(c.handle(hello(0), Duration::ZERO).is_empty(), "an ended stream does nothing");

        let mut c = core(Duration::ZERO);
        assert!(matches!(&c.handle(hello(0), Duration::ZERO)[..], [Effect::Admit(_)]));
        assert!(matches!(
            &c.handle(Event::Admitted, Duration::ZERO)[..],
            [Effect::Send(_), Effect::LoadPersisted { .. }]
        ));
        c.handle(Event::Opened { persisted: policy(1), claimed: None }, Duration::ZERO);
        let effects = c.handle(hello(1), Duration::ZERO);
        assert!(matches!(&effects[..], [Effect::End(e)] if e.reason == "Hello may only open a stream"));
    }

    /// Liveness counts from the agent's last message: announcements do not keep a silent
    /// stream alive; Hello must come within the bound too; the certificate's expiry ends it.
    #[test]
    fn deadlines_end_silent_and_expired_streams() {
        let mut c = core(Duration::ZERO);
        assert_eq!(c.next_deadline(), LIVENESS);
        let effects = c.handle(Event::Tick, LIVENESS);
        assert!(
            matches!(&effects[..], [Effect::End(e)] if e.reason == "no Hello within the liveness bound" && e.offline)
        );

        let mut c = core(Duration::ZERO);
        c.handle(hello(0), Duration::from_secs(10));
        c.handle(Event::Admitted, Duration::from_secs(10));
        c.handle(Event::Opened { persisted: policy(1), claimed: None }, Duration::from_secs(10));
        for at in [30, 60, 90] {
            c.handle(Event::Announced, Duration::from_secs(at));
            assert!(c.handle(Event::Tick, Duration::from_secs(at)).is_empty(), "alive at {at} s");
        }
        assert_eq!(c.next_deadline(), Duration::from_secs(100));
        let effects = c.handle(Event::Tick, Duration::from_secs(100));
        assert!(
            matches!(&effects[..], [Effect::End(e)] if e.reason == "silent for three heartbeat intervals")
        );

        let mut c = core(Duration::from_secs(3_550));
        c.handle(hello(0), Duration::from_secs(3_550));
        assert_eq!(c.next_deadline(), Duration::from_secs(3_600), "the certificate expires first");
        let effects = c.handle(Event::Tick, Duration::from_secs(3_600));
        let [Effect::End(ended)] = &effects[..] else { panic!("{effects:?}") };
        assert_eq!(ended.status.as_ref().map(|s| s.code()), Some(tonic::Code::Unauthenticated));
    }

    /// Inventory reports coalesce into the latest; the store's deferral brings it back later.
    #[test]
    fn inventory_reports_coalesce() {
        let report = |address: &str| {
            let facts = HostFacts {
                interfaces: vec![NetworkInterface {
                    addresses: vec![format!("{address}/24")],
                    ..Default::default()
                }],
                ..Default::default()
            };
            Event::Message(AgentMessage::Inventory(Box::new(Inventory {
                facts: Some(facts),
                ..Default::default()
            })))
        };
        let at = Duration::from_secs;
        let mut c = core(at(0));
        c.handle(hello(0), at(0));
        c.handle(Event::Admitted, at(0));
        c.handle(Event::Opened { persisted: policy(1), claimed: None }, at(0));
        assert!(c.handle(report("10.0.0.1"), at(5)).is_empty());
        assert!(c.handle(report("10.0.0.2"), at(5)).is_empty());
        assert_eq!(c.next_deadline(), at(5), "due at once");
        let effects = c.handle(Event::Tick, at(5));
        let [Effect::CommitInventory(addresses)] = &effects[..] else { panic!("{effects:?}") };
        assert_eq!(addresses, &BTreeSet::from(["10.0.0.2".parse().unwrap()]));
        c.handle(Event::InventoryDeferred { addresses: addresses.clone(), wait: at(3) }, at(5));
        assert_eq!(c.next_deadline(), at(8));
        assert!(c.handle(Event::Tick, at(7)).is_empty());
        assert!(matches!(&c.handle(Event::Tick, at(8))[..], [Effect::CommitInventory(_)]));
        // A malformed report ends the stream.
        let bad = HostFacts {
            interfaces: vec![NetworkInterface {
                addresses: vec!["not-an-address".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let bad = Event::Message(AgentMessage::Inventory(Box::new(Inventory {
            facts: Some(bad),
            ..Default::default()
        })));
        assert!(matches!(&c.handle(bad, at(9))[..], [Effect::End(e)] if e.reason.contains("not an address")));
    }

    #[test]
    fn pushes_settle_in_send_order_and_stay_bounded() {
        let at = |s: i64| DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let mut pushes = Pushes::default();
        pushes.sent(2, at(2));
        pushes.sent(3, at(3));
        pushes.sent(5, at(5));
        assert_eq!(pushes.acked(1), None, "the opening snapshot was no push");
        assert_eq!(pushes.acked(3), Some(at(3)));
        assert_eq!(pushes.acked(2), None, "settled with 3");
        assert_eq!(pushes.acked(5), Some(at(5)));
        for v in 10..200 {
            pushes.sent(v, at(v as i64));
        }
        assert_eq!(pushes.0.len(), Pushes::MAX);
        assert_eq!(pushes.acked(199), Some(at(199)));
        assert!(pushes.0.is_empty());
    }

    /// A transient refusal of the recovery snapshot heals without a new version: the core tries
    /// it again after a wait that doubles with each refusal (no storm), and resets once applied.
    #[test]
    fn a_stalled_recovery_is_tried_again_after_a_growing_wait() {
        let at = Duration::from_secs;
        let failed = |v| Event::Message(AgentMessage::Ack(Ack::Failed(v, "refused".into())));
        let sends = |effects: &[Effect]| {
            effects.iter().filter(|e| matches!(e, Effect::Send(ControlMessage::Update(_)))).count()
        };
        let mut c = core(at(0));
        c.handle(hello(0), at(0));
        c.handle(Event::Admitted, at(0));
        c.handle(Event::Opened { persisted: policy(1), claimed: None }, at(0));
        c.handle(Event::Message(AgentMessage::Ack(Ack::Applied(1))), at(1));
        c.handle(Event::Latest { policy: policy(2), committed: Utc::now() }, at(2));
        assert_eq!(sends(&c.handle(failed(2), at(3))), 1, "a failed delta earns a recovery snapshot");
        assert_eq!(
            sends(&c.handle(failed(2), at(4))),
            0,
            "a failed recovery snapshot is not answered at once"
        );
        assert_eq!(c.next_deadline(), at(4) + RECOVERY_RETRY);
        for (n, wait) in [(1, RECOVERY_RETRY), (2, RECOVERY_RETRY * 2)] {
            let now = c.retry_at.expect("a retry is scheduled");
            // The agent stays alive meanwhile.
            c.handle(Event::Message(AgentMessage::Heartbeat(Heartbeat::default())), now);
            let effects = c.handle(Event::Tick, now);
            assert_eq!(sends(&effects), 1, "retry {n}");
            assert!(effects.iter().any(|e| matches!(e, Effect::RecoverySnapshot)));
            c.handle(Event::Message(AgentMessage::Heartbeat(Heartbeat::default())), now);
            assert!(c.handle(failed(2), now).iter().all(|e| !matches!(e, Effect::Send(_))));
            assert_eq!(c.retry_at, Some(now + wait * 2), "the wait doubles after retry {n}");
        }
        let now = c.retry_at.expect("a retry is scheduled");
        c.handle(Event::Message(AgentMessage::Heartbeat(Heartbeat::default())), now);
        assert_eq!(sends(&c.handle(Event::Tick, now)), 1);
        let effects = c.handle(Event::Message(AgentMessage::Ack(Ack::Applied(2))), now);
        assert!(effects.iter().any(|e| matches!(e, Effect::Record(r) if r.state == SyncState::Synced)));
        assert_eq!((c.retry_at, c.retry_wait), (None, RECOVERY_RETRY), "nothing scheduled once applied");
    }
}
