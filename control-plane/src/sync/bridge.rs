//! The NOTIFY bridge between replicas (SYNC-7, SYNC-8, IDN-7): one dedicated LISTEN connection
//! per replica, outside the pool. Announcements poke the stream this replica holds for that
//! workload (others drop them); directives reconnect or cut it. Every (re)connect reconciles
//! every held stream, because notifications sent while the listener was down are lost. The
//! relay is generic over the [`Bus`] (Postgres or in memory) and what hears it.

use std::future::Future;
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

/// Where announcements come from: Postgres LISTEN/NOTIFY in production ([`PgBus`]), a channel
/// in tests ([`MemoryBus`]).
pub trait Bus: Send {
    /// (Re)connects and listens on the channel.
    fn listen(&mut self) -> impl Future<Output = Result<(), String>> + Send;
    /// The next notice's payload; `Err` once the connection is lost (listen again).
    fn next(&mut self) -> impl Future<Output = Result<String, String>> + Send;
}

/// What a replica does with what it hears on the bus.
pub trait Hearer: Sync {
    /// The bus (re)connected: whatever was announced while it was down is lost, so everything
    /// held is brought up to date (SYNC-7).
    fn connected(&self, again: bool) -> impl Future<Output = ()> + Send;
    fn heard(&self, payload: &str);
    fn lost(&self);
}

/// Postgres LISTEN on [`CHANNEL`], on one dedicated connection outside the pool.
#[derive(Debug)]
pub struct PgBus {
    pool: PgPool,
    listener: Option<PgListener>,
}

impl PgBus {
    pub fn new(pool: PgPool) -> Self {
        PgBus { pool, listener: None }
    }
}

impl Bus for PgBus {
    async fn listen(&mut self) -> Result<(), String> {
        self.listener = None;
        // A connection of its own, never one of the pool's: a pooled connection would be taken
        // from the streams' jobs for as long as the replica runs, and a reconnect could pick up
        // an idle one opened before the server stopped taking connections.
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with((*self.pool.connect_options()).clone());
        let mut listener = PgListener::connect_with(&own).await.map_err(|e| e.to_string())?;
        // A lost connection is reported at once (`Ok(None)`) and `relay` reconnects with its
        // own backoff, metrics and reconcile; sqlx's eager reconnect would first wait inside
        // `try_recv` for a new connection (up to the pool's acquire timeout while the server
        // refuses them), so the loss went unreported or was reported as that timeout, depending
        // on whether the server's goodbye message or the closed socket came first.
        listener.eager_reconnect(false);
        listener.listen(CHANNEL).await.map_err(|e| e.to_string())?;
        self.listener = Some(listener);
        Ok(())
    }

    async fn next(&mut self) -> Result<String, String> {
        let Some(listener) = &mut self.listener else { return Err("not listening".into()) };
        match listener.try_recv().await {
            Ok(Some(n)) => Ok(n.payload().to_owned()),
            Ok(None) => Err("lost the LISTEN connection".into()),
            Err(e) => Err(format!("LISTEN connection failed: {e}")),
        }
    }
}

/// Notices in memory: each item is a payload, or `None` for a lost connection; a closed
/// channel refuses every `listen`.
#[derive(Debug)]
pub struct MemoryBus(pub tokio::sync::mpsc::Receiver<Option<String>>);

impl Bus for MemoryBus {
    async fn listen(&mut self) -> Result<(), String> {
        if self.0.is_closed() && self.0.is_empty() { Err("the bus is gone".into()) } else { Ok(()) }
    }

    async fn next(&mut self) -> Result<String, String> {
        match self.0.recv().await {
            Some(Some(payload)) => Ok(payload),
            Some(None) => Err("connection lost".into()),
            None => Err("the bus is gone".into()),
        }
    }
}

/// This replica as the bus's hearer: notices poke or cut its streams and update admission.
struct Replica {
    pool: PgPool,
    gateway: Gateway,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
}

impl Hearer for Replica {
    async fn connected(&self, again: bool) {
        self.metrics.bridge_connected(again);
        match load_refused(&self.pool).await {
            Ok(refused) => self.admission.replace(refused),
            Err(e) => tracing::warn!("could not reload the retired and deny-listed workloads: {e}"),
        }
        self.gateway.reconcile_all();
        tracing::info!(
            streams = self.gateway.stream_count(),
            "listening for policy announcements; reconciled held streams"
        );
    }

    fn heard(&self, payload: &str) {
        dispatch(&self.gateway, &self.admission, payload);
    }

    fn lost(&self) {
        self.metrics.bridge_lost();
    }
}

/// Runs until the process ends (or its task is stopped).
pub async fn run(pool: PgPool, gateway: Gateway, admission: Arc<Admission>, metrics: Arc<Metrics>) {
    relay(PgBus::new(pool.clone()), &Replica { pool, gateway, admission, metrics }).await;
}

/// Relays what `bus` carries to `hearer`, reconnecting with full-jitter backoff (base 0.5 s, cap
/// 5 s) and telling the hearer of every (re)connect before the first notice after it. The cap is
/// short because every second without the bridge is a second this replica's agents may miss a
/// policy, and the cost of one connection attempt per replica every few seconds is nothing to
/// a database that has just come back (a failover takes about 10 s).
pub async fn relay(mut bus: impl Bus, hearer: &impl Hearer) {
    let (base, cap) = (Duration::from_millis(500), Duration::from_secs(5));
    let mut attempt = 0;
    let mut connected_before = false;
    loop {
        match bus.listen().await {
            Ok(()) => {
                attempt = 0;
                hearer.connected(connected_before).await;
                connected_before = true;
                let lost = loop {
                    match bus.next().await {
                        Ok(payload) => hearer.heard(&payload),
                        Err(why) => break why,
                    }
                };
                tracing::warn!("{lost}; reconnecting");
                hearer.lost();
            }
            Err(e) => tracing::warn!("cannot LISTEN on {CHANNEL}: {e}"),
        }
        tokio::time::sleep(backoff::wait(attempt, base, cap, backoff::random_unit())).await;
        attempt = attempt.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Heard(Mutex<Vec<String>>);

    impl Hearer for Heard {
        async fn connected(&self, again: bool) {
            self.0.lock().unwrap().push(format!("connected again={again}"));
        }
        fn heard(&self, payload: &str) {
            self.0.lock().unwrap().push(payload.to_owned());
        }
        fn lost(&self) {
            self.0.lock().unwrap().push("lost".into());
        }
    }

    /// Notices arrive in order; a lost connection is listened again, and the reconnect (which
    /// reconciles) comes before any notice after it.
    #[tokio::test]
    async fn every_reconnect_is_heard_before_the_notices_after_it() {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        for item in [Some("policy:a:1"), Some("policy:a:2"), None, Some("policy:a:3")] {
            tx.send(item.map(str::to_owned)).await.unwrap();
        }
        let heard = Heard::default();
        let relayed = relay(MemoryBus(rx), &heard);
        tokio::pin!(relayed);
        // The relay runs until its bus is gone and then keeps retrying: stop once it has heard
        // the last notice and the bus's end.
        drop(tx);
        for _ in 0..600 {
            tokio::select! {
                () = &mut relayed => unreachable!("the relay runs for ever"),
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            if heard.0.lock().unwrap().iter().filter(|h| *h == "lost").count() == 2 {
                break;
            }
        }
        assert_eq!(
            heard.0.lock().unwrap().clone(),
            [
                "connected again=false",
                "policy:a:1",
                "policy:a:2",
                "lost",
                "connected again=true",
                "policy:a:3",
                "lost"
            ]
        );
    }
}
