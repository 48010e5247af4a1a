//! The server side of one sync stream as a pure state machine (SYNC-2..SYNC-6): what the stream
//! has carried (its tip), which updates are in flight, how acks move the convergence state,
//! and when a failure earns a recovery snapshot. No I/O and no clock: the gateway feeds it
//! events and carries out the actions it returns.

use std::collections::VecDeque;

use innerwall_wire::policy::{Mode, Version, WorkloadPolicy, diff};
use innerwall_wire::sync::UNREADABLE_UPDATE;
pub use innerwall_wire::sync::{Ack, SyncState, Update};

/// What the gateway must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Send(Update),
    /// Persist the convergence state (and, for snapshots, `last_snapshot_sent_at`).
    Record(Record),
    /// The agent broke the protocol; end the stream with this reason.
    Close(String),
    /// End the stream without calling the workload offline, so the agent redials: it could not
    /// read an update on this stream and a new version is persisted.
    Redial(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub state: SyncState,
    pub applied: Option<Version>,
    /// `None` leaves the stored detail as it is.
    pub detail: Option<String>,
    pub acked: bool,
    pub failed: bool,
    pub snapshot_sent: bool,
    /// The agent acknowledged `applied` APPLIED or HELD: the host installed it, in this mode
    /// (recorded for the evidence it then reports, FLOW-5).
    pub installed: Option<Mode>,
}

impl Record {
    fn state(state: SyncState) -> Self {
        Record {
            state,
            applied: None,
            detail: Some(String::new()),
            acked: false,
            failed: false,
            snapshot_sent: false,
            installed: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Snapshot { version: Version, mode: Mode, recovery: bool },
    Delta { version: Version, mode: Mode },
}

impl Sent {
    fn version(self) -> Version {
        match self {
            Sent::Snapshot { version, .. } | Sent::Delta { version, .. } => version,
        }
    }

    fn mode(self) -> Mode {
        match self {
            Sent::Snapshot { mode, .. } | Sent::Delta { mode, .. } => mode,
        }
    }
}

/// What a SUSPENDED workload's detail says.
pub const SUSPENDED_DETAIL: &str =
    "kill switch engaged on the host (innerwall-agent down): nothing is enforced until innerwall-agent up";

/// One stream's view. Created when the stream opens with the persisted policy.
#[derive(Debug, Clone)]
pub struct Session {
    tip: WorkloadPolicy,
    in_flight: VecDeque<Sent>,
    degraded: bool,
    /// The agent's kill switch is engaged: whatever it acks, it enforces nothing.
    suspended: bool,
    /// The last version the agent applied or held.
    acked: Option<Version>,
    /// An update of the tip could not be sent (over the stream's largest message): the next
    /// persisted version goes as a (recovery) snapshot, since the agent holds an older base.
    resnapshot: bool,
    /// The agent could not read an update on this stream: nothing more is sent on it.
    deaf: bool,
    /// The last delta sent, kept only while the planted `RetryFailedDelta` is on.
    planted_delta: Option<innerwall_wire::policy::PolicyDelta>,
}

impl Session {
    /// A new stream always begins with a snapshot of the persisted policy, whatever version the
    /// agent claimed (SYNC-2); the claim is recorded as what the agent says it holds.
    pub fn open(persisted: WorkloadPolicy, claimed: Version, suspended: bool) -> (Session, Vec<Action>) {
        let version = persisted.version();
        let session = Session {
            tip: persisted.clone(),
            in_flight: VecDeque::from([Sent::Snapshot { version, mode: persisted.mode(), recovery: false }]),
            degraded: false,
            suspended,
            acked: None,
            resnapshot: false,
            deaf: false,
            planted_delta: None,
        };
        let record = Record { applied: Some(claimed), snapshot_sent: true, ..session.record() };
        // Record first, so whoever sees the snapshot arrive also sees the state that sent it.
        (session, vec![Action::Record(record), Action::Send(Update::Snapshot(persisted))])
    }

    /// The planted bug `DeltaFromClaim`: the stream opens with a delta from `base`, the stored
    /// policy of the version Hello claimed, as if the claim proved what the agent holds.
    pub fn planted_open_from(
        base: WorkloadPolicy,
        persisted: WorkloadPolicy,
        suspended: bool,
    ) -> (Session, Vec<Action>) {
        let (mut session, _) = Session::open(persisted.clone(), base.version(), suspended);
        let (version, mode) = (persisted.version(), persisted.mode());
        session.in_flight = VecDeque::from([Sent::Delta { version, mode }]);
        let record = Record { applied: Some(base.version()), ..session.record() };
        (session, vec![Action::Record(record), Action::Send(Update::Delta(diff(&base, &persisted)))])
    }

    pub fn tip_version(&self) -> Version {
        self.tip.version()
    }

    /// The convergence state (SYNC-6): a suspended agent enforces nothing, whatever it holds;
    /// SYNCED only when the tip is applied and nothing is in flight.
    fn state(&self) -> SyncState {
        if self.suspended {
            SyncState::Suspended
        } else if self.degraded {
            SyncState::Degraded
        } else if self.in_flight.is_empty() && self.acked == Some(self.tip.version()) {
            SyncState::Synced
        } else {
            SyncState::Pending
        }
    }

    /// The record of the current state. A degraded stream keeps the failure's detail until the
    /// recovery snapshot is applied.
    fn record(&self) -> Record {
        let state = self.state();
        let detail = match state {
            SyncState::Suspended if !self.degraded => Some(SUSPENDED_DETAIL.to_owned()),
            SyncState::Suspended | SyncState::Degraded => None,
            _ => Some(String::new()),
        };
        Record { detail, ..Record::state(state) }
    }

    /// The persisted policy moved: send one delta from the tip, whatever happened in between
    /// (SYNC-3, SYNC-11). Nothing if the stream already carried it.
    pub fn persisted(&mut self, latest: WorkloadPolicy) -> Vec<Action> {
        if latest.version() <= self.tip.version() {
            return Vec::new();
        }
        if self.deaf {
            let reason = format!(
                "version {} is persisted and the agent could not read an update on this stream: it redials",
                latest.version()
            );
            self.tip = latest;
            return vec![Action::Redial(reason)];
        }
        if self.resnapshot {
            self.resnapshot = false;
            let (version, mode) = (latest.version(), latest.mode());
            self.in_flight.push_back(Sent::Snapshot { version, mode, recovery: true });
            self.tip = latest;
            return vec![
                Action::Record(Record { snapshot_sent: true, ..self.record() }),
                Action::Send(Update::Snapshot(self.tip.clone())),
            ];
        }
        let delta = diff(&self.tip, &latest);
        if super::planted::on(super::planted::Bug::RetryFailedDelta) {
            self.planted_delta = Some(delta.clone());
        }
        self.in_flight.push_back(Sent::Delta { version: latest.version(), mode: latest.mode() });
        self.tip = latest;
        // Nothing to record first: the stored state is what the last ack left, and a row stored
        // SYNCED behind its persisted version reads PENDING from the render's commit on
        // (`shown`). Only the ack is written (PERF-2: one write per agent per change).
        if super::planted::on(super::planted::Bug::SyncedOnSend) {
            let applied = Some(self.tip.version());
            return vec![
                Action::Record(Record { applied, ..Record::state(SyncState::Synced) }),
                Action::Send(Update::Delta(delta)),
            ];
        }
        vec![Action::Send(Update::Delta(delta))]
    }

    /// A failed recovery snapshot left the agent behind with nothing in flight: no update will
    /// reach it until the next persisted version. (Not when the tip cannot be sent at all, or
    /// the agent cannot read this stream.)
    pub fn stalled(&self) -> bool {
        self.degraded && self.in_flight.is_empty() && !self.resnapshot && !self.deaf
    }

    /// Tries the recovery snapshot of the tip again (the core calls this after a backoff, so a
    /// transient refusal heals without a new version and a persistent one is no storm).
    pub fn retry_recovery(&mut self) -> Vec<Action> {
        if !self.stalled() {
            return Vec::new();
        }
        let (version, mode) = (self.tip.version(), self.tip.mode());
        self.in_flight.push_back(Sent::Snapshot { version, mode, recovery: true });
        vec![
            Action::Record(Record { snapshot_sent: true, ..Record::state(self.state()) }),
            Action::Send(Update::Snapshot(self.tip.clone())),
        ]
    }

    /// The agent says whether its kill switch is engaged (Hello, every heartbeat, and at once
    /// when it changes). Nothing to record if that did not change.
    pub fn suspended(&mut self, suspended: bool) -> Vec<Action> {
        if suspended == self.suspended {
            return Vec::new();
        }
        self.suspended = suspended;
        vec![Action::Record(self.record())]
    }

    /// The update of `version` the last actions sent could not be sent: it is `size` bytes
    /// encoded, over the stream's largest message `max`. A delta is replaced by a snapshot of the
    /// tip (smaller whenever the delta replaces most rules); a snapshot that cannot be sent
    /// leaves the workload DEGRADED with why, and the next persisted version goes as a snapshot.
    pub fn unsendable(&mut self, version: Version, size: usize, max: usize) -> Vec<Action> {
        let Some(at) = self.in_flight.iter().rposition(|s| s.version() == version) else {
            return Vec::new();
        };
        let sent = self.in_flight.remove(at).expect("a position found in it");
        if let Sent::Delta { version, mode } = sent {
            self.in_flight.push_back(Sent::Snapshot { version, mode, recovery: self.degraded });
            return vec![
                Action::Record(Record { snapshot_sent: true, ..self.record() }),
                Action::Send(Update::Snapshot(self.tip.clone())),
            ];
        }
        self.degraded = true;
        self.resnapshot = true;
        let detail = format!(
            "policy version {version} is {size} bytes encoded, over the policy stream's largest \
             message ({max} bytes): it was not sent; the agent keeps the version it holds"
        );
        vec![Action::Record(Record { detail: Some(detail), failed: true, ..Record::state(self.state()) })]
    }

    /// Acks match updates in the order they were sent (SYNC-4). A failure earns one recovery
    /// snapshot of the tip; failures of updates sent before a recovery snapshot are stale
    /// (SYNC-5).
    pub fn ack(&mut self, ack: Ack) -> Vec<Action> {
        let Some(sent) = self.in_flight.pop_front() else {
            return vec![Action::Close("ack received with no update in flight".into())];
        };
        if let Ack::Failed(UNREADABLE_UPDATE, detail) = ack {
            // The agent could not read the next update (UNREADABLE_UPDATE): it reads nothing
            // more on this stream, so nothing more is sent; a new version ends the stream.
            self.degraded = true;
            self.deaf = true;
            self.in_flight.clear();
            let detail = format!("the agent could not read policy version {}: {detail}", sent.version());
            return vec![Action::Record(Record {
                detail: Some(detail),
                failed: true,
                ..Record::state(self.state())
            })];
        }
        let version = match &ack {
            Ack::Applied(v) | Ack::Held(v) | Ack::Failed(v, _) => *v,
        };
        if version != sent.version() {
            return vec![Action::Close(format!(
                "ack for version {version} but version {} was sent next",
                sent.version()
            ))];
        }
        match ack {
            Ack::Applied(v) | Ack::Held(v) => {
                if matches!(sent, Sent::Snapshot { recovery: true, .. }) {
                    self.degraded = false;
                }
                // A held version is the agent's, persisted; it installs it when the switch is
                // released, and says so with its next heartbeat.
                self.suspended = matches!(ack, Ack::Held(_));
                self.acked = Some(v);
                let installed = Some(sent.mode());
                vec![Action::Record(Record { applied: Some(v), acked: true, installed, ..self.record() })]
            }
            Ack::Failed(_, detail) => {
                let stale = self.in_flight.iter().any(|s| matches!(s, Sent::Snapshot { recovery: true, .. }));
                let recovery_failed = matches!(sent, Sent::Snapshot { recovery: true, .. });
                self.degraded = true;
                let record = Record { detail: Some(detail), failed: true, ..Record::state(self.state()) };
                // A failed recovery snapshot is not answered with another one: the next
                // persisted version will be (a persistent refusal must not become a loop).
                if (stale || recovery_failed)
                    && !super::planted::on(super::planted::Bug::SnapshotEveryFailure)
                {
                    return vec![Action::Record(record)];
                }
                if let (true, Some(delta)) =
                    (super::planted::on(super::planted::Bug::RetryFailedDelta), &self.planted_delta)
                {
                    self.in_flight
                        .push_back(Sent::Delta { version: delta.to_version, mode: self.tip.mode() });
                    return vec![Action::Record(record), Action::Send(Update::Delta(delta.clone()))];
                }
                let (version, mode) = (self.tip.version(), self.tip.mode());
                self.in_flight.push_back(Sent::Snapshot { version, mode, recovery: true });
                vec![
                    Action::Record(record),
                    Action::Record(Record { snapshot_sent: true, ..self.record() }),
                    Action::Send(Update::Snapshot(self.tip.clone())),
                ]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::Mode;

    use super::*;

    fn policy(version: u64, ports: &[u16]) -> WorkloadPolicy {
        innerwall_wire::testing::policy(version, Mode::Enforcement, ports)
    }

    fn sends(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send(Update::Snapshot(p)) => Some(format!("snapshot v{}", p.version())),
                Action::Send(Update::Delta(d)) => {
                    Some(format!("delta v{}→v{}", d.from_version, d.to_version))
                }
                _ => None,
            })
            .collect()
    }

    fn last_state(actions: &[Action]) -> Option<SyncState> {
        actions.iter().rev().find_map(|a| match a {
            Action::Record(r) => Some(r.state),
            _ => None,
        })
    }

    #[test]
    fn open_sends_a_snapshot_whatever_the_claim() {
        let (s, actions) = Session::open(policy(12, &[22]), 14, false);
        assert_eq!(sends(&actions), ["snapshot v12"]);
        assert!(matches!(&actions[0], Action::Record(r) if r.applied == Some(14) && r.snapshot_sent));
        assert_eq!(s.tip_version(), 12);
    }

    #[test]
    fn the_seed_walkthrough() {
        // Session 1 of the design record: snapshot v12, delta 12→13 applied, delta 13→14
        // failed, recovery snapshot v14.
        let (mut s, _) = Session::open(policy(12, &[22]), 12, false);
        assert_eq!(last_state(&s.ack(Ack::Applied(12))), Some(SyncState::Synced));
        assert_eq!(sends(&s.persisted(policy(13, &[22, 80]))), ["delta v12→v13"]);
        assert_eq!(last_state(&s.ack(Ack::Applied(13))), Some(SyncState::Synced));
        assert_eq!(sends(&s.persisted(policy(14, &[22, 80, 443]))), ["delta v13→v14"]);
        let failed = s.ack(Ack::Failed(14, "nft refused".into()));
        assert_eq!(sends(&failed), ["snapshot v14"]);
        assert!(
            matches!(&failed[0], Action::Record(r) if r.state == SyncState::Degraded && r.detail.as_deref() == Some("nft refused"))
        );
        assert_eq!(last_state(&s.ack(Ack::Applied(14))), Some(SyncState::Synced));
    }

    #[test]
    fn recovery_snapshot_does_not_loop_on_in_flight_failures() {
        let (mut s, _) = Session::open(policy(1, &[]), 0, false);
        s.ack(Ack::Applied(1));
        s.persisted(policy(2, &[1]));
        s.persisted(policy(3, &[1, 2]));
        s.persisted(policy(4, &[1, 2, 3]));
        // v2 fails: one recovery snapshot (of v4). v3 and v4 were in flight before it: stale.
        assert_eq!(sends(&s.ack(Ack::Failed(2, "boom".into()))), ["snapshot v4"]);
        for v in [3, 4] {
            let actions = s.ack(Ack::Failed(v, "base mismatch".into()));
            assert_eq!(
                sends(&actions),
                Vec::<String>::new(),
                "stale failure of v{v} must not earn a snapshot"
            );
            assert_eq!(last_state(&actions), Some(SyncState::Degraded));
        }
        assert_eq!(last_state(&s.ack(Ack::Applied(4))), Some(SyncState::Synced));
        // A refused recovery snapshot stays DEGRADED without another snapshot …
        s.persisted(policy(5, &[7]));
        s.ack(Ack::Failed(5, "refused".into()));
        assert_eq!(sends(&s.ack(Ack::Failed(5, "refused again".into()))), Vec::<String>::new());
        // … until the next version, which (failing on the wrong base) earns one.
        s.persisted(policy(6, &[8]));
        assert_eq!(sends(&s.ack(Ack::Failed(6, "base mismatch".into()))), ["snapshot v6"]);
        assert_eq!(last_state(&s.ack(Ack::Applied(6))), Some(SyncState::Synced));
        // A fresh failure after recovery earns a fresh snapshot.
        s.persisted(policy(7, &[9]));
        assert_eq!(sends(&s.ack(Ack::Failed(7, "again".into()))), ["snapshot v7"]);
    }

    #[test]
    fn pending_until_the_latest_is_acked_and_coalesced_deltas_start_at_the_tip() {
        let (mut s, _) = Session::open(policy(1, &[]), 0, false);
        // A delta records nothing first: the row reads PENDING from the render on (`shown`).
        let sent = s.persisted(policy(3, &[1]));
        assert_eq!((sends(&sent), last_state(&sent)), (vec!["delta v1→v3".to_owned()], None));
        assert_eq!(last_state(&s.ack(Ack::Applied(1))), Some(SyncState::Pending));
        assert_eq!(last_state(&s.ack(Ack::Applied(3))), Some(SyncState::Synced));
        assert_eq!(s.persisted(policy(3, &[1])), vec![], "already carried");
    }

    #[test]
    fn a_suspended_agent_is_never_synced_whatever_it_acks() {
        let (mut s, actions) = Session::open(policy(1, &[]), 1, true);
        assert_eq!(last_state(&actions), Some(SyncState::Suspended));
        assert_eq!(last_state(&s.ack(Ack::Held(1))), Some(SyncState::Suspended));
        assert_eq!(last_state(&s.persisted(policy(2, &[1]))), None, "still SUSPENDED as stored");
        let held = s.ack(Ack::Held(2));
        assert!(matches!(&held[..], [Action::Record(r)] if r.state == SyncState::Suspended
            && r.applied == Some(2) && r.detail.as_deref() == Some(SUSPENDED_DETAIL)));
        // Released (`innerwall-agent up`): the held version is the tip, so SYNCED at once.
        assert_eq!(last_state(&s.suspended(false)), Some(SyncState::Synced));
        assert_eq!(s.suspended(false), vec![], "no change, nothing to record");
        assert_eq!(last_state(&s.suspended(true)), Some(SyncState::Suspended));
        // A failure while suspended keeps its detail and earns its recovery snapshot.
        s.persisted(policy(3, &[1, 2]));
        let failed = s.ack(Ack::Failed(3, "disk full".into()));
        assert_eq!(sends(&failed), ["snapshot v3"]);
        assert!(failed.iter().all(|a| !matches!(a, Action::Record(r) if r.state != SyncState::Suspended)));
        assert!(matches!(&failed[0], Action::Record(r) if r.detail.as_deref() == Some("disk full")));
        assert!(matches!(&failed[1], Action::Record(r) if r.detail.is_none()), "keeps the failure's detail");
        assert_eq!(last_state(&s.ack(Ack::Held(3))), Some(SyncState::Suspended));
        assert_eq!(last_state(&s.suspended(false)), Some(SyncState::Synced));
        // Released before the tip arrived: PENDING until it is applied.
        s.persisted(policy(4, &[3]));
        s.suspended(true);
        assert_eq!(last_state(&s.suspended(false)), Some(SyncState::Pending));
        assert_eq!(last_state(&s.ack(Ack::Applied(4))), Some(SyncState::Synced));
    }

    #[test]
    fn an_unsendable_snapshot_degrades_with_why_and_the_next_version_goes_whole() {
        let (mut s, _) = Session::open(policy(3, &[22]), 2, false);
        let actions = s.unsendable(3, 5000, 4096);
        assert_eq!(sends(&actions), Vec::<String>::new());
        assert!(matches!(&actions[..], [Action::Record(r)] if r.state == SyncState::Degraded && r.failed
            && r.detail.as_deref().is_some_and(|d| d.contains("version 3 is 5000 bytes") && d.contains("(4096 bytes)"))));
        // Nothing is in flight: an ack now is unsolicited.
        assert!(matches!(&s.clone().ack(Ack::Applied(3))[..], [Action::Close(_)]));
        // The next version is a recovery snapshot (the agent holds no base), which clears it.
        let next = s.persisted(policy(4, &[22, 80]));
        assert_eq!(sends(&next), ["snapshot v4"]);
        assert_eq!(last_state(&s.ack(Ack::Applied(4))), Some(SyncState::Synced));
        // Then deltas again.
        assert_eq!(sends(&s.persisted(policy(5, &[22]))), ["delta v4→v5"]);
    }

    #[test]
    fn an_unsendable_delta_becomes_a_snapshot_of_the_tip() {
        let (mut s, _) = Session::open(policy(1, &[22]), 0, false);
        s.ack(Ack::Applied(1));
        assert_eq!(sends(&s.persisted(policy(2, &[22, 80]))), ["delta v1→v2"]);
        assert_eq!(sends(&s.unsendable(2, 9000, 4096)), ["snapshot v2"]);
        assert_eq!(last_state(&s.ack(Ack::Applied(2))), Some(SyncState::Synced));
        // Unknown versions change nothing.
        assert_eq!(s.unsendable(9, 1, 0), vec![]);
    }

    #[test]
    fn an_unreadable_update_degrades_sends_nothing_more_and_a_new_version_redials() {
        let (mut s, _) = Session::open(policy(1, &[22]), 0, false);
        let failed = s.ack(Ack::Failed(UNREADABLE_UPDATE, "message over 1024 bytes".into()));
        assert_eq!(sends(&failed), Vec::<String>::new(), "no recovery snapshot on a stream it cannot read");
        assert!(matches!(&failed[..], [Action::Record(r)] if r.state == SyncState::Degraded
            && r.detail.as_deref() == Some("the agent could not read policy version 1: message over 1024 bytes")));
        // Heartbeats keep it DEGRADED (not offline); a new version ends the stream for a redial.
        assert_eq!(s.suspended(false), vec![]);
        assert!(matches!(&s.persisted(policy(2, &[80]))[..], [Action::Redial(r)] if r.contains("version 2")));
        assert_eq!(s.persisted(policy(2, &[80])), vec![], "already carried");
    }

    #[test]
    fn out_of_order_or_unsolicited_acks_close_the_stream() {
        let (mut s, _) = Session::open(policy(1, &[]), 0, false);
        assert!(matches!(&s.ack(Ack::Applied(7))[..], [Action::Close(_)]));
        let (mut s, _) = Session::open(policy(1, &[]), 0, false);
        s.ack(Ack::Applied(1));
        assert!(matches!(&s.ack(Ack::Applied(1))[..], [Action::Close(_)]));
    }
}
