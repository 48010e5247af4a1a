//! Carries out a [`StreamCore`]'s effects, in order, against a [`SyncStore`] and an [`Outbox`]
//! (the stream towards the agent), feeding what they return back to the core before the effects
//! after them. The gateway drives it with the network and tokio's clock; the simulator with
//! its own. Nothing here decides: what to send, record or end is the core's.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use innerwall_wire::sync::{ControlMessage, MAX_POLICY_MESSAGE};
use tonic::Status;

use super::core::{Effect, Ended, Event, StreamCore, Time};
use super::store::SyncStore;
use crate::metrics::Metrics;

/// The agent went away: the stream towards it is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

/// Where a stream's messages to its agent go.
pub trait Outbox: Send {
    /// Queues one encoded message (waiting while the queue is full).
    fn send(&mut self, message: proto::SyncResponse) -> impl Future<Output = Result<(), Gone>> + Send;
}

/// One stream's side of the world: its identity, its epoch once admitted, its store, its
/// outbox and where it counts.
#[derive(Debug)]
pub struct Driver<'a, S, O> {
    pub id: WorkloadId,
    /// The key of the certificate the stream's connection proved the identity with.
    pub key_sha256: &'a str,
    pub store: &'a S,
    pub out: O,
    /// This stream's epoch once Hello was admitted (0 before): its writes apply only while it
    /// is the newest.
    pub epoch: i64,
    pub liveness: std::time::Duration,
    pub metrics: Arc<Metrics>,
}

impl<S: SyncStore, O: Outbox> Driver<'_, S, O> {
    /// Hands `event` to `core` and carries out what follows; `Some` when the stream ended.
    pub async fn run(&mut self, core: &mut StreamCore, event: Event, now: Time) -> Option<Ended> {
        let mut queue: VecDeque<Effect> = core.handle(event, now).into();
        while let Some(effect) = queue.pop_front() {
            let next = match self.execute(effect).await {
                Ok(None) => continue,
                Ok(Some(event)) => core.handle(event, now),
                Err(ended) => return Some(ended),
            };
            for effect in next.into_iter().rev() {
                queue.push_front(effect);
            }
        }
        None
    }

    /// One effect; the event it answers with, if any.
    async fn execute(&mut self, effect: Effect) -> Result<Option<Event>, Ended> {
        let id = self.id;
        let refused = |e: crate::error::Error| Ended::refused(Status::from(e));
        match effect {
            Effect::Admit(hello) => {
                self.epoch =
                    self.store.hello(id, self.key_sha256, &hello, self.liveness).await.map_err(refused)?;
                Ok(Some(Event::Admitted))
            }
            Effect::LoadPersisted { claimed } => {
                let persisted = self.store.persisted(id).await.map_err(refused)?;
                let claimed = match super::planted::on(super::planted::Bug::DeltaFromClaim) {
                    true => self.store.policy_at(id, claimed).await,
                    false => None,
                };
                Ok(Some(Event::Opened { persisted, claimed }))
            }
            Effect::Send(message) => {
                let update = match &message {
                    ControlMessage::Update(u) => Some(u.version()),
                    _ => None,
                };
                let encoded = proto::SyncResponse::from(&message);
                let size = prost::Message::encoded_len(&encoded);
                if let Some(version) = update.filter(|_| size > MAX_POLICY_MESSAGE) {
                    // Never sent: the agent could not read it, and would redial for ever.
                    tracing::warn!(workload = %id, version, size, max = MAX_POLICY_MESSAGE,
                        "not sending an update over the policy stream's largest message");
                    return Ok(Some(Event::Unsendable { version, size }));
                }
                self.out.send(encoded).await.map_err(|Gone| Ended::offline("agent went away"))?;
                Ok(None)
            }
            Effect::Direct(directive) => {
                let _ = self.out.send(proto::SyncResponse::from(&ControlMessage::Directive(directive))).await;
                Ok(None)
            }
            Effect::ReadLatest => {
                let latest = self.store.latest(id).await;
                let latest =
                    latest.map_err(|e| Ended::offline(format!("reading the persisted policy: {e}")))?;
                Ok(latest.map(|(policy, committed)| Event::Latest { policy, committed }))
            }
            Effect::Record(record) => {
                let current = self.store.record(id, self.epoch, &record).await;
                let current = current.map_err(|e| Ended::offline(format!("recording state: {e}")))?;
                Ok(Some(Event::Recorded { current }))
            }
            Effect::Beat { heartbeat, state } => {
                self.store.beat(id, self.epoch, state, &heartbeat).await.map_err(refused)?;
                Ok(None)
            }
            Effect::CommitInventory(addresses) => {
                match self.store.commit_inventory(id, &addresses).await.map_err(refused)? {
                    Some(wait) => Ok(Some(Event::InventoryDeferred { addresses, wait })),
                    None => Ok(None),
                }
            }
            Effect::Acked { status, committed } => {
                self.metrics.ack(status);
                if let (innerwall_wire::sync::AckStatus::Applied, Some(committed)) = (status, committed) {
                    self.metrics.applied(committed, chrono::Utc::now());
                }
                Ok(None)
            }
            Effect::Pushed { committed } => {
                self.metrics.pushed(committed, chrono::Utc::now());
                Ok(None)
            }
            Effect::RecoverySnapshot => {
                self.metrics.recovery_snapshot();
                Ok(None)
            }
            Effect::End(ended) => Err(ended),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use chrono::Utc;
    use innerwall_wire::identity::WorkloadId;
    use innerwall_wire::policy::Mode;
    use innerwall_wire::sync::{Ack, AgentMessage, SyncState, Update};

    use super::*;
    use crate::sync::core::test_support::{LIVENESS, core, hello, policy};
    use crate::sync::store::{MemoryStore, SyncStore};

    #[derive(Debug, Default)]
    struct Sent(Vec<ControlMessage>);

    impl Outbox for &mut Sent {
        async fn send(&mut self, message: proto::SyncResponse) -> Result<(), Gone> {
            self.0.push(ControlMessage::try_from(message).expect("the core sends what agents read"));
            Ok(())
        }
    }

    fn versions(sent: &Sent) -> Vec<String> {
        sent.0
            .iter()
            .map(|m| match m {
                ControlMessage::HelloAck(_) => "hello-ack".to_owned(),
                ControlMessage::Update(Update::Snapshot(p)) => format!("snapshot v{}", p.version()),
                ControlMessage::Update(Update::Delta(d)) => {
                    format!("delta v{}→v{}", d.from_version, d.to_version)
                }
                ControlMessage::Directive(d) => format!("{d:?}"),
            })
            .collect()
    }

    fn driver<'a>(
        id: WorkloadId,
        store: &'a MemoryStore,
        out: &'a mut Sent,
    ) -> Driver<'a, MemoryStore, &'a mut Sent> {
        let metrics = Arc::new(Metrics::new());
        Driver { id, key_sha256: "k", store, out, epoch: 0, liveness: LIVENESS, metrics }
    }

    /// A stream on the in-memory store: Hello first, the snapshot, an ack, an announcement's
    /// delta, its ack; the store follows.
    #[tokio::test]
    async fn a_stream_opens_syncs_and_follows_announcements() {
        let (store, id) = (MemoryStore::default(), WorkloadId::new_random());
        store.persist(id, policy(1), Utc::now());
        let mut sent = Sent::default();
        let mut driver = driver(id, &store, &mut sent);
        let mut core = core(Duration::ZERO);
        let second = Duration::from_secs(1);
        assert!(driver.run(&mut core, hello(0), second).await.is_none());
        assert!(core.is_open());
        assert_eq!(driver.epoch, 1);
        assert!(
            driver.run(&mut core, Event::Message(AgentMessage::Ack(Ack::Applied(1))), second).await.is_none()
        );
        assert_eq!(store.workload(id).unwrap().state, Some(SyncState::Synced));
        store.persist(id, policy(2), Utc::now());
        assert!(driver.run(&mut core, Event::Announced, second).await.is_none());
        // Nothing written before the delta: stored SYNCED at 1, shown PENDING behind 2.
        let row = store.workload(id).unwrap();
        assert_eq!((row.state, row.applied), (Some(SyncState::Synced), Some(1)));
        assert_eq!(row.shown_state(), Some(SyncState::Pending));
        assert!(
            driver.run(&mut core, Event::Message(AgentMessage::Ack(Ack::Applied(2))), second).await.is_none()
        );
        let row = store.workload(id).unwrap();
        assert_eq!((row.state, row.applied), (Some(SyncState::Synced), Some(2)));
        assert!(row.installed.contains(&(2, Mode::Enforcement)));
        // An announcement of nothing new sends nothing.
        assert!(driver.run(&mut core, Event::Announced, second).await.is_none());
        drop(driver);
        assert_eq!(versions(&sent), ["hello-ack", "snapshot v1", "delta v1→v2"]);
    }

    /// Two streams of one identity: the newer's Hello takes the next epoch, and the older ends
    /// at its next state write, not calling the workload offline.
    #[tokio::test]
    async fn a_newer_stream_supersedes_by_epoch() {
        let (store, id) = (MemoryStore::default(), WorkloadId::new_random());
        store.persist(id, policy(1), Utc::now());
        let (mut old_sent, mut new_sent) = (Sent::default(), Sent::default());
        let mut old = driver(id, &store, &mut old_sent);
        let mut old_core = core(Duration::ZERO);
        assert!(old.run(&mut old_core, hello(0), Duration::ZERO).await.is_none());
        let mut new = driver(id, &store, &mut new_sent);
        let mut new_core = core(Duration::ZERO);
        assert!(new.run(&mut new_core, hello(0), Duration::ZERO).await.is_none());
        assert_eq!((old.epoch, new.epoch), (1, 2));
        let ended =
            old.run(&mut old_core, Event::Message(AgentMessage::Ack(Ack::Applied(1))), Duration::ZERO).await;
        let ended = ended.expect("the stale stream ends");
        assert_eq!(ended.reason, "superseded by a newer stream on another replica");
        assert!(!ended.offline);
        assert_eq!(
            store.workload(id).unwrap().state,
            Some(SyncState::Pending),
            "the newer stream's state stands"
        );
        // Its end marks nothing offline: its epoch is not the row's.
        SyncStore::mark_offline(&store, id, 1, "ended").await;
        assert_eq!(store.workload(id).unwrap().state, Some(SyncState::Pending));
    }

    #[tokio::test]
    async fn a_retired_workload_is_refused_at_hello() {
        let (store, id) = (MemoryStore::default(), WorkloadId::new_random());
        store.persist(id, policy(1), Utc::now());
        store.retire(id);
        let mut sent = Sent::default();
        let mut driver = driver(id, &store, &mut sent);
        let ended = driver.run(&mut core(Duration::ZERO), hello(0), Duration::ZERO).await.unwrap();
        assert!(ended.reason.contains("retired or deny-listed"), "{}", ended.reason);
        assert!(sent.0.is_empty());
    }
}
