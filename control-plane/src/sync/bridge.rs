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

use crate::admission::{Admission, Refusal};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::notice::{CHANNEL, Notice};
use crate::sync::gateway::Gateway;

/// Every deny-listed identity, for the handshake check.
pub async fn load_refused(pool: &PgPool) -> Result<Vec<(WorkloadId, Refusal)>, Error> {
    let rows: Vec<(uuid::Uuid, bool)> = sqlx::query_as(
        "SELECT id, denied_at IS NOT NULL FROM workloads WHERE denied_at IS NOT NULL OR retired_at IS NOT NULL",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, denied)| {
            Some((WorkloadId::from_uuid(id)?, if denied { Refusal::Denied } else { Refusal::Retired }))
        })
        .collect())
}

fn dispatch(gateway: &Gateway, admission: &Arc<Admission>, payload: &str) {
    match Notice::parse(payload) {
        Some(Notice::Policy(id, version)) => gateway.announce(id, version),
        Some(Notice::Reconnect(id)) => {
            if gateway.reconnect(id) {
                tracing::info!(workload = %id, "sent a reconnect directive");
            }
        }
        Some(Notice::Retire(id)) => {
            admission.refuse(id, Refusal::Retired);
            gateway.cut(id, "workload retired");
        }
        Some(Notice::Deny(id)) => {
            admission.refuse(id, Refusal::Denied);
            gateway.cut(id, "workload deny-listed");
        }
        None => tracing::warn!(payload = %payload, "ignored a malformed notification"),
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    // A lost connection is reported at once (`Ok(None)`) and `run` reconnects with its own
    // backoff, metrics and reconcile; sqlx's eager reconnect would first wait inside `try_recv`
    // for a new connection (up to the pool's acquire timeout while the server refuses them),
    // so the loss went unreported or was reported as that timeout, depending on whether the
    // server's goodbye message or the closed socket came first.
    listener.eager_reconnect(false);
    listener.listen(CHANNEL).await?;
    Ok(listener)
}

/// Runs until the process ends. Reconnects with full-jitter backoff (base 0.5 s, cap 30 s).
pub async fn run(pool: PgPool, gateway: Gateway, admission: Arc<Admission>, metrics: Arc<Metrics>) {
    let (base, cap) = (Duration::from_millis(500), Duration::from_secs(30));
    let mut attempt = 0;
    let mut connected_before = false;
    loop {
        match listen(&pool).await {
            Ok(mut listener) => {
                attempt = 0;
                metrics.bridge_connected(connected_before);
                connected_before = true;
                match load_refused(&pool).await {
                    Ok(refused) => admission.replace(refused),
                    Err(e) => tracing::warn!("could not reload the retired and deny-listed workloads: {e}"),
                }
                gateway.reconcile_all();
                tracing::info!(
                    streams = gateway.stream_count(),
                    "listening for policy announcements; reconciled held streams"
                );
                loop {
                    match listener.try_recv().await {
                        Ok(Some(n)) => dispatch(&gateway, &admission, n.payload()),
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
                metrics.bridge_lost();
            }
            Err(e) => tracing::warn!("cannot LISTEN on {CHANNEL}: {e}"),
        }
        tokio::time::sleep(backoff::wait(attempt, base, cap, backoff::random_unit())).await;
        attempt = attempt.saturating_add(1);
    }
}
