//! The agent's side of one policy stream as a state machine without I/O or a clock:
//! `handle(event, now) -> effects`. It decides what the stream does with each update (apply it,
//! or refuse it at once), when it acks and with what, when heartbeats and inventory reports are
//! due, and how the stream ends (a directive, a renewal). The session (`super::session`) carries
//! the effects out with tonic and tokio; the simulator (`innerwall_e2e::sim`) with its own
//! network and clock.
//!
//! Two rules keep a host on policies some render produced:
//! - an update is acked only after its apply returned: the ack of a version says the policy is
//!   persisted (and installed, or held under the kill switch);
//! - after an update on this stream failed, every delta is refused until a snapshot applies.
//!   A delta's base is the control plane's record of what this stream carried, and a failure
//!   broke that record: the host still holds what it held before, which may carry the same
//!   version number with other content (a database restored from a backup reuses numbers).

use std::collections::VecDeque;
use std::time::Duration;

use innerwall_wire::policy::Version;
use innerwall_wire::sync::{Ack, AgentMessage, Directive, HelloAck, UNREADABLE_UPDATE, Update};

use super::SessionEnd;
use super::shared::Standing;
use crate::enforce::Installed;

/// A moment of the stream's clock: time since the stream opened.
pub type Time = Duration;

/// What happened on or around the stream.
#[derive(Debug, Clone)]
pub enum Event {
    /// The control plane answered Hello: the stream is open.
    Opened(HelloAck),
    /// An update arrived, in stream order.
    Update(Update),
    /// An update arrived that does not convert (its version, and why): refused as a unit.
    Malformed {
        version: Version,
        detail: String,
    },
    /// An update arrived that this agent cannot read at all (over its decoding limit).
    Unreadable(String),
    /// An apply asked for by [`Effect::Apply`] returned.
    Applied {
        version: Version,
        result: Result<Installed, String>,
    },
    Directive(Directive),
    /// The kill switch and a passed revert deadline, as seen now.
    Standing(Standing),
    /// The credential was renewed: the stream moves to the new certificate.
    Renewed,
    /// Time passed: the deadlines are checked.
    Tick,
}

/// What the session must do, in order.
#[derive(Debug, Clone)]
pub enum Effect {
    Send(AgentMessage),
    /// Apply the update (persist, then install) and answer with [`Event::Applied`].
    Apply(Update),
    /// Send a heartbeat with what the agent reports now.
    Heartbeat,
    /// Send an inventory report of this host's facts (none when they cannot be listed).
    Inventory,
    /// The stream ends.
    End(SessionEnd),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitingHelloAck,
    Open,
    /// An update could not be read: the control plane was told and sends nothing more on this
    /// stream; heartbeats go on until it ends the stream.
    Deaf,
    Ended,
}

/// One stream, from Hello on.
#[derive(Debug)]
pub struct StreamCore {
    phase: Phase,
    hello_ack: Option<HelloAck>,
    next_heartbeat: Time,
    next_inventory: Time,
    /// The update being applied, and those that arrived meanwhile (applied in order).
    applying: Option<Version>,
    queued: VecDeque<Update>,
    /// An update on this stream failed: deltas are refused until a snapshot applies.
    broken: bool,
    /// The kill switch and a passed revert deadline, as last reported.
    standing: Standing,
}

/// Why a delta is refused after a failure (the detail of its FAILED ack).
pub const AFTER_FAILURE: &str =
    "an earlier update on this stream failed; only a snapshot is applied until one succeeds";

impl StreamCore {
    /// A stream whose Hello said `standing`.
    pub fn new(standing: Standing) -> Self {
        StreamCore {
            phase: Phase::AwaitingHelloAck,
            hello_ack: None,
            next_heartbeat: Time::MAX,
            next_inventory: Time::MAX,
            applying: None,
            queued: VecDeque::new(),
            broken: false,
            standing,
        }
    }

    /// The timing the control plane set, once the stream is open.
    pub fn hello_ack(&self) -> Option<HelloAck> {
        self.hello_ack
    }

    /// Whether the control plane was told of an unreadable update (nothing more is read).
    pub fn deaf(&self) -> bool {
        self.phase == Phase::Deaf
    }

    /// The earliest moment a [`Event::Tick`] can change something.
    pub fn next_deadline(&self) -> Time {
        self.next_heartbeat.min(self.next_inventory)
    }

    fn end(&mut self, end: SessionEnd) -> Vec<Effect> {
        self.phase = Phase::Ended;
        vec![Effect::End(end)]
    }

    pub fn handle(&mut self, event: Event, now: Time) -> Vec<Effect> {
        if self.phase == Phase::Ended {
            return Vec::new();
        }
        match event {
            Event::Opened(ack) if self.phase == Phase::AwaitingHelloAck => {
                self.phase = Phase::Open;
                self.hello_ack = Some(ack);
                self.next_heartbeat = now + ack.heartbeat;
                self.next_inventory = now + ack.inventory;
                Vec::new()
            }
            Event::Opened(_) => Vec::new(),
            Event::Update(update) => {
                if self.applying.is_some() {
                    self.queued.push_back(update);
                    return Vec::new();
                }
                self.start(update)
            }
            Event::Malformed { version, detail } => {
                self.broken = true;
                vec![Effect::Send(AgentMessage::Ack(Ack::Failed(version, detail)))]
            }
            Event::Unreadable(detail) => {
                self.broken = true;
                self.phase = Phase::Deaf;
                vec![Effect::Send(AgentMessage::Ack(Ack::Failed(UNREADABLE_UPDATE, detail)))]
            }
            Event::Applied { version, result } => self.applied(version, result),
            Event::Directive(Directive::Reconnect) => self.end(SessionEnd::Reconnect),
            Event::Directive(Directive::Reenroll { reason }) => self.end(SessionEnd::Reenroll(reason)),
            Event::Standing(standing) => {
                // A change is said at once, not at the next heartbeat.
                let changed = std::mem::replace(&mut self.standing, standing) != standing;
                if changed && self.phase != Phase::AwaitingHelloAck {
                    vec![Effect::Heartbeat]
                } else {
                    Vec::new()
                }
            }
            Event::Renewed => self.end(SessionEnd::Renewed),
            Event::Tick => self.tick(now),
        }
    }

    /// Starts applying `update`, or refuses it at once.
    fn start(&mut self, update: Update) -> Vec<Effect> {
        let version = update.version();
        if self.broken && matches!(update, Update::Delta(_)) {
            return vec![Effect::Send(AgentMessage::Ack(Ack::Failed(version, AFTER_FAILURE.into())))];
        }
        self.applying = Some(version);
        if super::planted::on(super::planted::Bug::AckBeforePersist) {
            return vec![Effect::Send(AgentMessage::Ack(Ack::Applied(version))), Effect::Apply(update)];
        }
        vec![Effect::Apply(update)]
    }

    fn applied(&mut self, version: Version, result: Result<Installed, String>) -> Vec<Effect> {
        if self.applying != Some(version) {
            return Vec::new();
        }
        self.applying = None;
        let ack = match result {
            Ok(installed) => {
                // A snapshot replaced whatever the stream's failures left: deltas apply again
                // (a delta that applied was based on what the host holds, so nothing changes).
                self.broken = false;
                match installed {
                    Installed::Held => Ack::Held(version),
                    _ => Ack::Applied(version),
                }
            }
            Err(detail) => {
                self.broken = true;
                Ack::Failed(version, detail)
            }
        };
        let mut out = Vec::new();
        if !super::planted::on(super::planted::Bug::AckBeforePersist) {
            out.push(Effect::Send(AgentMessage::Ack(ack)));
        }
        while let Some(next) = self.queued.pop_front() {
            let effects = self.start(next);
            let started = effects.iter().any(|e| matches!(e, Effect::Apply(_)));
            out.extend(effects);
            if started {
                break;
            }
        }
        out
    }

    fn tick(&mut self, now: Time) -> Vec<Effect> {
        let Some(ack) = self.hello_ack else { return Vec::new() };
        let mut out = Vec::new();
        if now >= self.next_heartbeat {
            out.push(Effect::Heartbeat);
            self.next_heartbeat = now + ack.heartbeat;
        }
        if now >= self.next_inventory && self.phase == Phase::Open {
            out.push(Effect::Inventory);
            self.next_inventory = now + ack.inventory;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::{Mode, diff};
    use innerwall_wire::testing;

    use super::*;

    fn open() -> StreamCore {
        let mut core = StreamCore::new(Standing::default());
        let ack = HelloAck {
            heartbeat: Duration::from_secs(30),
            inventory: Duration::from_secs(300),
            flow_window: Duration::from_secs(60),
            flow_window_max_keys: 100,
        };
        assert!(core.handle(Event::Opened(ack), Duration::ZERO).is_empty());
        core
    }

    fn snapshot(version: Version) -> Update {
        Update::Snapshot(testing::policy(version, Mode::Enforcement, &[22]))
    }

    fn delta(from: Version, to: Version) -> Update {
        let (a, b) = (
            testing::policy(from, Mode::Enforcement, &[22]),
            testing::policy(to, Mode::Enforcement, &[22, 443]),
        );
        Update::Delta(diff(&a, &b))
    }

    fn acks(effects: &[Effect]) -> Vec<String> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(AgentMessage::Ack(ack)) => Some(format!("{ack:?}")),
                _ => None,
            })
            .collect()
    }

    /// An ack comes only after its apply returned; updates that arrive meanwhile wait in order.
    #[test]
    fn acks_follow_applies_in_stream_order() {
        let mut core = open();
        let t = Duration::ZERO;
        assert!(matches!(&core.handle(Event::Update(snapshot(1)), t)[..], [Effect::Apply(_)]));
        assert!(core.handle(Event::Update(delta(1, 2)), t).is_empty(), "queued behind the apply");
        let after_first = core.handle(Event::Applied { version: 1, result: Ok(Installed::Full) }, t);
        assert_eq!(acks(&after_first), ["Applied(1)"]);
        assert!(matches!(&after_first[1..], [Effect::Apply(Update::Delta(_))]));
        let held = core.handle(Event::Applied { version: 2, result: Ok(Installed::Held) }, t);
        assert_eq!(acks(&held), ["Held(2)"]);
        // An answer for an apply that is not running changes nothing.
        assert!(core.handle(Event::Applied { version: 9, result: Ok(Installed::Full) }, t).is_empty());
    }

    /// After a failure, deltas are refused without an apply until a snapshot succeeds.
    #[test]
    fn after_a_failure_only_a_snapshot_applies() {
        let mut core = open();
        let t = Duration::ZERO;
        core.handle(Event::Update(snapshot(4)), t);
        let failed = core.handle(Event::Applied { version: 4, result: Err("refused".into()) }, t);
        assert_eq!(acks(&failed), [r#"Failed(4, "refused")"#]);
        let refused = core.handle(Event::Update(delta(4, 5)), t);
        assert_eq!(acks(&refused), [format!("Failed(5, {AFTER_FAILURE:?})")]);
        assert!(!refused.iter().any(|e| matches!(e, Effect::Apply(_))), "never applied");
        core.handle(Event::Update(snapshot(5)), t);
        core.handle(Event::Applied { version: 5, result: Ok(Installed::Full) }, t);
        assert!(matches!(&core.handle(Event::Update(delta(5, 6)), t)[..], [Effect::Apply(_)]));
        // A malformed update is a failure too.
        core.handle(Event::Applied { version: 6, result: Ok(Installed::Full) }, t);
        core.handle(Event::Malformed { version: 7, detail: "bad".into() }, t);
        assert_eq!(
            acks(&core.handle(Event::Update(delta(6, 8)), t)),
            [format!("Failed(8, {AFTER_FAILURE:?})")]
        );
    }

    #[test]
    fn heartbeats_and_inventory_fall_due_and_the_switch_is_said_at_once() {
        let mut core = open();
        assert_eq!(core.next_deadline(), Duration::from_secs(30));
        assert!(core.handle(Event::Tick, Duration::from_secs(29)).is_empty());
        assert!(matches!(&core.handle(Event::Tick, Duration::from_secs(30))[..], [Effect::Heartbeat]));
        assert_eq!(core.next_deadline(), Duration::from_secs(60));
        let both = core.handle(Event::Tick, Duration::from_secs(300));
        assert!(matches!(&both[..], [Effect::Heartbeat, Effect::Inventory]), "{both:?}");
        let down = Standing { suspended: true, reverted_version: 0 };
        assert!(matches!(
            &core.handle(Event::Standing(down), Duration::from_secs(301))[..],
            [Effect::Heartbeat]
        ));
        assert!(core.handle(Event::Standing(down), Duration::from_secs(302)).is_empty(), "no change");
        // A revert deadline passing is said at once too.
        let reverted = Standing { suspended: true, reverted_version: 7 };
        assert!(matches!(
            &core.handle(Event::Standing(reverted), Duration::from_secs(303))[..],
            [Effect::Heartbeat]
        ));
    }

    #[test]
    fn directives_renewals_and_unreadable_updates_end_or_deafen_the_stream() {
        let mut core = open();
        let t = Duration::ZERO;
        let deaf = core.handle(Event::Unreadable("too large".into()), t);
        assert_eq!(acks(&deaf), [format!("Failed({UNREADABLE_UPDATE}, \"too large\")")]);
        assert!(core.deaf());
        assert!(matches!(&core.handle(Event::Tick, Duration::from_secs(30))[..], [Effect::Heartbeat]));
        assert!(
            core.handle(Event::Tick, Duration::from_secs(300))
                .iter()
                .all(|e| !matches!(e, Effect::Inventory))
        );
        assert!(matches!(&core.handle(Event::Renewed, t)[..], [Effect::End(SessionEnd::Renewed)]));
        assert!(core.handle(Event::Tick, Duration::from_secs(900)).is_empty(), "an ended stream is silent");
        let mut core = open();
        let reenroll = core.handle(Event::Directive(Directive::Reenroll { reason: "retired".into() }), t);
        assert!(matches!(&reenroll[..], [Effect::End(SessionEnd::Reenroll(r))] if r == "retired"));
        let mut core = open();
        assert!(matches!(
            &core.handle(Event::Directive(Directive::Reconnect), t)[..],
            [Effect::End(SessionEnd::Reconnect)]
        ));
    }
}
