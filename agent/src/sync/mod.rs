//! The agent side of the policy stream (SYNC-2, SYNC-4, SYNC-9, SYNC-10): Hello with the applied
//! version, then every update applied strictly in stream order through the policy store and
//! acked APPLIED or FAILED; heartbeats carry liveness, renewal trouble and tamper reports.
//! [`core`] decides (sans I/O, time passed in), [`session`] carries it out with tonic and
//! tokio, [`shared`] is what the agent's tasks share by role, and [`next_policy`] is the pure
//! step from an update and the held policy to the next one.

use std::sync::Arc;
use std::time::Duration;

use innerwall_wire::convert::ControlMessageError;
use innerwall_wire::identity::HostFacts;
use innerwall_wire::policy::{ApplyError, Version, WorkloadPolicy};
use innerwall_wire::proto;
use innerwall_wire::sync::{Ack, AgentMessage, ControlMessage, Hello, Inventory, Update};
use tokio::sync::mpsc;
use tonic::transport::Channel;

pub mod core;
pub mod planted;
pub mod shared;

pub use shared::{
    Agent, DIAL_LOG, DialFailure, Dials, Enforcer, Reports, Standing, StreamSettings, TamperLog, WindowClose,
};

use crate::enforce::{EnforceError, Installed, PolicyStore};
use crate::error;
use crate::metrics::ApplyResult;

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
    agent: Arc<Agent<S>>,
    stats: &mut SessionStats,
) -> SessionEnd {
    use std::sync::atomic::Ordering::Relaxed;
    // Without facts (interfaces could not be listed) the Hello says nothing about the host.
    let facts = agent.stream.facts().await;
    agent.enforcer.note_standing();
    let mut standings = agent.enforcer.standing.subscribe();
    let standing = *standings.borrow_and_update();
    let hello = Hello {
        applied_version: agent.enforcer.applied_version(),
        agent: crate::identity::facts::agent_info(),
        facts,
        suspended: standing.suspended,
        reverted_version: standing.reverted_version,
    };
    let (tx, rx) = mpsc::channel(64);
    if tx.send(msg(&AgentMessage::Hello(Box::new(hello)))).await.is_err() {
        return SessionEnd::Closed("could not queue Hello".into());
    }
    // A renewal from here on moves the stream to the new certificate (one made between the dial
    // and here is caught by the stream's end at the old certificate's expiry, then a redial).
    let mut renewals = agent.renewals.subscribe();
    let max_message = agent.stream.max_message();
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
    agent.stream.hello_ack(&hello_ack);
    agent.dials.streams.fetch_add(1, Relaxed);
    agent.metrics.stream_connected(true);
    let origin = tokio::time::Instant::now();
    let mut core = core::StreamCore::new(standing);
    let mut next = Some(core::Event::Opened(hello_ack));
    loop {
        if let Some(event) = next.take() {
            let now = origin.elapsed();
            if let Some(end) = carry_out(&mut core, event, now, &agent, &tx, stats).await {
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
                        agent.metrics.applied(ApplyResult::Failed, Duration::ZERO, agent.enforcer.applied_version());
                        Some(core::Event::Malformed { version, detail: malformed.to_string() })
                    }
                },
                Ok(None) => return SessionEnd::Closed("server closed the stream".into()),
                Err(s) if unreadable(&s) => {
                    agent.metrics.applied(ApplyResult::Failed, Duration::ZERO, agent.enforcer.applied_version());
                    Some(core::Event::Unreadable(format!(
                        "{} (this agent decodes at most {max_message} bytes)",
                        s.message()
                    )))
                }
                Err(s) => return refused("stream ended", &s),
            },
            _ = renewals.changed() => Some(core::Event::Renewed),
            _ = standings.changed() => Some(core::Event::Standing(*standings.borrow_and_update())),
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
    agent: &Arc<Agent<S>>,
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
                            agent.metrics.applied(
                                ApplyResult::Failed,
                                Duration::ZERO,
                                agent.enforcer.applied_version(),
                            );
                        }
                    }
                }
                message
            }
            core::Effect::Apply(update) => {
                let version = update.version();
                let a = agent.clone();
                let result = tokio::task::spawn_blocking(move || {
                    a.enforcer.apply(&update).map_err(|e| error::chain(&e))
                })
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
            core::Effect::Heartbeat => agent.heartbeat(),
            core::Effect::Inventory => {
                // No report when the interfaces cannot be listed: the addresses the control plane
                // knows stand, they never become "none".
                let Some(facts) = agent.stream.facts().await else { continue };
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
