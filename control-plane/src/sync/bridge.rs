//! The NOTIFY bridge between replicas (SYNC-7, SYNC-8, IDN-7): one dedicated LISTEN connection
//! per replica, outside the pool. Announcements poke the stream this replica holds for that
//! workload (others drop them); directives reconnect or cut it. Every (re)connect reconciles
//! every held stream, because notifications sent while the listener was down are lost.

use std::sync::Arc;
use std::time::Duration;

use innerwall_wire::backoff;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use crate::identity::listener::DenyList;
use crate::policy::publish::POLICY_CHANNEL;
use crate::policy::store::StoreError;
use crate::sync::gateway::Gateway;

/// What one notification on the policy channel says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// `<workload-id> <version>`: a render persisted this version.
    Policy(WorkloadId, u64),
    /// `reconnect <workload-id>`: directed reconnect (resend-snapshot).
    Reconnect(WorkloadId),
    /// `retire <workload-id>`: end its stream.
    Retire(WorkloadId),
    /// `deny <workload-id>`: refuse it at the handshake and end its stream.
    Deny(WorkloadId),
}

impl Notice {
    pub fn parse(payload: &str) -> Option<Notice> {
        let (head, tail) = payload.split_once(' ')?;
        let id = |s: &str| s.parse::<WorkloadId>().ok();
        match head {
            "reconnect" => id(tail).map(Notice::Reconnect),
            "retire" => id(tail).map(Notice::Retire),
            "deny" => id(tail).map(Notice::Deny),
            _ => Some(Notice::Policy(id(head)?, tail.parse().ok()?)),
        }
    }

    pub fn payload(&self) -> String {
        match self {
            Notice::Policy(id, v) => format!("{id} {v}"),
            Notice::Reconnect(id) => format!("reconnect {id}"),
            Notice::Retire(id) => format!("retire {id}"),
            Notice::Deny(id) => format!("deny {id}"),
        }
    }
}

/// Publishes a directive on the policy channel (delivered on commit when inside a transaction).
pub async fn publish_notice(conn: &mut sqlx::PgConnection, notice: &Notice) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(POLICY_CHANNEL)
        .bind(notice.payload())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Every deny-listed identity, for the handshake check.
pub async fn load_deny_list(pool: &PgPool) -> Result<Vec<WorkloadId>, StoreError> {
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM workloads WHERE denied_at IS NOT NULL").fetch_all(pool).await?;
    Ok(ids.into_iter().filter_map(WorkloadId::from_uuid).collect())
}

fn dispatch(gateway: &Gateway, deny: &DenyList, payload: &str) {
    match Notice::parse(payload) {
        Some(Notice::Policy(id, version)) => gateway.announce(id, version),
        Some(Notice::Reconnect(id)) => {
            if gateway.reconnect(id) {
                tracing::info!(workload = %id, "sent a reconnect directive");
            }
        }
        Some(Notice::Retire(id)) => gateway.cut(id, "workload retired"),
        Some(Notice::Deny(id)) => {
            deny.deny(id);
            gateway.cut(id, "workload deny-listed");
        }
        None => tracing::warn!(payload = %payload, "ignored a malformed notification"),
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(POLICY_CHANNEL).await?;
    Ok(listener)
}

/// Runs until the process ends. Reconnects with full-jitter backoff (base 0.5 s, cap 30 s).
pub async fn run(pool: PgPool, gateway: Gateway, deny: Arc<DenyList>) {
    let (base, cap) = (Duration::from_millis(500), Duration::from_secs(30));
    let mut attempt = 0;
    loop {
        match listen(&pool).await {
            Ok(mut listener) => {
                attempt = 0;
                match load_deny_list(&pool).await {
                    Ok(ids) => deny.replace(ids),
                    Err(e) => tracing::warn!("could not reload the deny list: {e}"),
                }
                gateway.reconcile_all();
                tracing::info!(
                    streams = gateway.stream_count(),
                    "listening for policy announcements; reconciled held streams"
                );
                loop {
                    match listener.try_recv().await {
                        Ok(Some(n)) => dispatch(&gateway, &deny, n.payload()),
                        Ok(None) => {
                            tracing::warn!("lost the LISTEN connection; reconnecting");
                            break;
                        }
                        Err(e) => {
                            tracing::warn!("LISTEN connection failed: {e}; reconnecting");
                            break;
                        }
                    }
                }
            }
            Err(e) => tracing::warn!("cannot LISTEN on {POLICY_CHANNEL}: {e}"),
        }
        tokio::time::sleep(backoff::wait(attempt, base, cap, backoff::random_unit())).await;
        attempt = attempt.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_garbage_is_refused() {
        let id = WorkloadId::new_random();
        for n in [Notice::Policy(id, 7), Notice::Reconnect(id), Notice::Retire(id), Notice::Deny(id)] {
            assert_eq!(Notice::parse(&n.payload()), Some(n));
        }
        for bad in
            ["", "x", "reconnect", "reconnect nope", &format!("{id}"), &format!("{id} seven"), "deny  "]
        {
            assert_eq!(Notice::parse(bad), None, "{bad:?}");
        }
    }
}
