//! Per-identity rate bounds on enrolled agents (REL-1): flow uploads and their bytes, heartbeats
//! and stream opens (Hello) per minute, each a token bucket per workload identity. A call over
//! its bound is refused with RESOURCE_EXHAUSTED and a `retry-after` (seconds) before anything is
//! written, and counted in `innerwall_agent_refusals_total{reason}`.
//!
//! The state is per replica, in memory: a check is on every upload and heartbeat, and sharing
//! it through Postgres would cost a write per check — the very load it bounds. An agent holds
//! its connections to one replica at a time, so per replica is per agent in practice; an agent
//! spreading calls over `n` replicas gets at most `n` times the bound. The table is bounded
//! itself: an identity whose buckets have all refilled is indistinguishable from one never
//! seen and is pruned, and past `max_tracked` identities the least recently seen are dropped.
//! [`Limiter`] is pure (time passed in) and generic over what it is keyed on and which bounds it
//! holds ([`Kind`]): the agent side keys it on [`WorkloadId`] with [`Bound`], the operator API
//! (`api::edge`) on a token or a source address. [`Bounds`] holds it for the gateway and the
//! telemetry service.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use innerwall_wire::identity::WorkloadId;

/// What an agent does that is bounded per minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Bound {
    /// Flow window uploads (`ReportFlows` calls).
    Uploads,
    /// Bytes of flow window uploads (the encoded window).
    UploadBytes,
    /// Heartbeats on the policy stream.
    Heartbeats,
    /// Policy streams opened (each a Hello, a stream epoch and a snapshot).
    Hellos,
}

/// A closed set of bounds a [`Limiter`] holds a bucket of per key.
pub trait Kind: Copy + Ord + std::fmt::Debug + 'static {
    /// Every bound of the set (at most [`MAX_KINDS`]).
    const ALL: &'static [Self];
    /// The bound's place in [`Kind::ALL`].
    fn index(self) -> usize;
}

/// The most bounds one [`Kind`] may have.
pub const MAX_KINDS: usize = 4;

impl Kind for Bound {
    const ALL: &'static [Bound] = Bound::ALL;

    fn index(self) -> usize {
        self as usize
    }
}

impl Bound {
    /// The serve flag that sets it.
    pub fn flag(self) -> &'static str {
        match self {
            Bound::Uploads => "--agent-uploads-per-minute",
            Bound::UploadBytes => "--agent-upload-bytes-per-minute",
            Bound::Heartbeats => "--agent-heartbeats-per-minute",
            Bound::Hellos => "--agent-hellos-per-minute",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Bound::Uploads => "flow uploads",
            Bound::UploadBytes => "flow upload bytes",
            Bound::Heartbeats => "heartbeats",
            Bound::Hellos => "policy stream opens",
        }
    }
}

impl Bound {
    /// Every bound, in the order metrics list them.
    pub const ALL: &'static [Bound] = &[Bound::Uploads, Bound::UploadBytes, Bound::Heartbeats, Bound::Hellos];

    /// The refusal reason a metric and a log line name it by.
    pub fn reason(self) -> &'static str {
        match self {
            Bound::Uploads => "upload_rate",
            Bound::UploadBytes => "upload_bytes",
            Bound::Heartbeats => "heartbeat_rate",
            Bound::Hellos => "hello_rate",
        }
    }
}

/// The bounds, per identity and per minute, each a `serve` flag. A bucket holds a minute's
/// worth (so a burst of a whole minute's allowance passes) and refills evenly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentBounds {
    /// An agent drains its on-disk queue back to back after a partition; at 120 a minute a full
    /// day of one-minute windows (1,440) drains in 12 minutes.
    pub uploads_per_minute: u32,
    /// At least twice the largest upload message (32 MiB), so the largest window always fits.
    pub upload_bytes_per_minute: u64,
    /// An agent heartbeats every interval (30 s by default) and at once when its kill switch
    /// changes; 120 a minute leaves room for a 1 s interval.
    pub heartbeats_per_minute: u32,
    /// Reconnects: renewal, a directed reconnect, a replica's restart, backoff retries.
    pub hellos_per_minute: u32,
    /// Tamper and clone reports of one workload within this long of the row that recorded the
    /// first are counted on that row instead of adding rows (`audit::coalesce`).
    pub report_coalesce: Duration,
    /// Identities whose buckets are held at once; beyond it the least recently seen are forgotten.
    pub max_tracked: usize,
}

impl Default for AgentBounds {
    fn default() -> Self {
        AgentBounds {
            uploads_per_minute: 120,
            upload_bytes_per_minute: 64 * 1024 * 1024,
            heartbeats_per_minute: 120,
            hellos_per_minute: 12,
            report_coalesce: Duration::from_secs(3600),
            max_tracked: 200_000,
        }
    }
}

impl AgentBounds {
    fn per_minute(&self, bound: Bound) -> f64 {
        match bound {
            Bound::Uploads => f64::from(self.uploads_per_minute),
            Bound::UploadBytes => self.upload_bytes_per_minute as f64,
            Bound::Heartbeats => f64::from(self.heartbeats_per_minute),
            Bound::Hellos => f64::from(self.hellos_per_minute),
        }
        .max(1.0)
    }
}

/// A call over its bound: which, and how long until it would pass.
#[derive(Debug, Clone, PartialEq)]
pub struct OverBound<B = Bound> {
    pub bound: B,
    pub per_minute: f64,
    pub retry_after: Duration,
}

impl OverBound {
    /// The RESOURCE_EXHAUSTED status the agent receives, with `retry-after` in its metadata.
    pub fn status(&self, id: WorkloadId) -> tonic::Status {
        innerwall_wire::backoff::refuse(
            format!(
                "{} of workload {id} over the bound of {} per minute ({})",
                self.bound.what(),
                self.per_minute,
                self.bound.flag()
            ),
            self.retry_after,
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug, Clone)]
struct Entry {
    buckets: [Option<Bucket>; MAX_KINDS],
    seen: Instant,
}

/// Token buckets per key (an agent identity, an operator token, a source address). Pure: every
/// call is given the time.
#[derive(Debug)]
pub struct Limiter<K = WorkloadId, B: Kind = Bound> {
    /// A bucket's capacity, and its refill per minute, by [`Kind::index`].
    per_minute: [f64; MAX_KINDS],
    max_tracked: usize,
    entries: BTreeMap<K, Entry>,
    kinds: std::marker::PhantomData<B>,
}

impl Limiter<WorkloadId, Bound> {
    pub fn new(bounds: AgentBounds) -> Limiter {
        Limiter::with_rates(|b| bounds.per_minute(b), bounds.max_tracked)
    }
}

impl<K: Ord + Clone, B: Kind> Limiter<K, B> {
    /// A limiter whose bound `b` allows `per_minute(b)` a minute (at least 1), holding at most
    /// `max_tracked` keys.
    pub fn with_rates(per_minute: impl Fn(B) -> f64, max_tracked: usize) -> Limiter<K, B> {
        assert!(B::ALL.len() <= MAX_KINDS, "a Kind has at most {MAX_KINDS} bounds");
        let mut rates = [1.0; MAX_KINDS];
        for &b in B::ALL {
            rates[b.index()] = per_minute(b).max(1.0);
        }
        Limiter { per_minute: rates, max_tracked, entries: BTreeMap::new(), kinds: std::marker::PhantomData }
    }

    /// Changes every bound's allowance (as [`Limiter::with_rates`]); buckets keep their
    /// tokens, capped at the new capacity when next read.
    pub fn set_rates(&mut self, per_minute: impl Fn(B) -> f64) {
        for &b in B::ALL {
            self.per_minute[b.index()] = per_minute(b).max(1.0);
        }
    }

    pub fn tracked(&self) -> usize {
        self.entries.len()
    }

    fn capacity(&self, bound: B) -> f64 {
        self.per_minute[bound.index()]
    }

    /// A bucket's tokens at `now`, refilled from its last use.
    fn level(&self, bound: B, bucket: Option<Bucket>, now: Instant) -> f64 {
        let capacity = self.capacity(bound);
        match bucket {
            None => capacity,
            Some(b) => {
                let refill = now.saturating_duration_since(b.at).as_secs_f64() * capacity / 60.0;
                (b.tokens + refill).min(capacity)
            }
        }
    }

    /// Whether `take` would pass now, taking nothing.
    pub fn check(&self, key: &K, costs: &[(B, f64)], now: Instant) -> Result<(), OverBound<B>> {
        let entry = self.entries.get(key);
        let mut worst: Option<OverBound<B>> = None;
        for &(bound, cost) in costs {
            let capacity = self.capacity(bound);
            let cost = cost.clamp(0.0, capacity);
            let level = self.level(bound, entry.and_then(|e| e.buckets[bound.index()]), now);
            if level < cost {
                let retry_after = Duration::from_secs_f64((cost - level) * 60.0 / capacity);
                if worst.as_ref().is_none_or(|w| w.retry_after < retry_after) {
                    worst = Some(OverBound { bound, per_minute: capacity, retry_after });
                }
            }
        }
        worst.map_or(Ok(()), Err)
    }

    /// Takes `cost` of each named bound for `key` at `now`, or none of them if any is short (a
    /// refused call costs nothing, so refusals cannot push the wait out). A cost above a whole
    /// minute's allowance counts as a whole minute, so any call passes once the bucket is full.
    pub fn take(&mut self, key: K, costs: &[(B, f64)], now: Instant) -> Result<(), OverBound<B>> {
        self.check(&key, costs, now)?;
        let entry = self.entries.get(&key);
        let mut levels = [0.0; MAX_KINDS];
        for &(bound, cost) in costs {
            let cost = cost.clamp(0.0, self.capacity(bound));
            levels[bound.index()] =
                self.level(bound, entry.and_then(|e| e.buckets[bound.index()]), now) - cost;
        }
        if !self.entries.contains_key(&key) && self.entries.len() >= self.max_tracked.max(1) {
            self.prune(now);
        }
        let entry = self.entries.entry(key).or_insert(Entry { buckets: [None; MAX_KINDS], seen: now });
        entry.seen = now;
        for &(bound, _) in costs {
            entry.buckets[bound.index()] = Some(Bucket { tokens: levels[bound.index()], at: now });
        }
        Ok(())
    }

    /// Forgets keys whose buckets have refilled (nothing is lost); if that frees nothing, the
    /// least recently seen eighth, so the next prune is that far away.
    fn prune(&mut self, now: Instant) {
        let full = |l: &Self, e: &Entry| {
            B::ALL.iter().all(|b| {
                e.buckets[b.index()].is_none_or(|bucket| l.level(*b, Some(bucket), now) >= l.capacity(*b))
            })
        };
        let refilled: Vec<K> =
            self.entries.iter().filter(|(_, e)| full(self, e)).map(|(k, _)| k.clone()).collect();
        for key in &refilled {
            self.entries.remove(key);
        }
        if self.entries.len() < self.max_tracked.max(1) {
            return;
        }
        let mut seen: Vec<(Instant, K)> = self.entries.iter().map(|(k, e)| (e.seen, k.clone())).collect();
        seen.sort_by_key(|a| a.0);
        let drop = (seen.len() / 8).max(1);
        for (_, key) in seen.into_iter().take(drop) {
            self.entries.remove(&key);
        }
    }
}

/// Told of every refusal (the replica counts them in its metrics); a callback, so this module
/// stays below `metrics` in the import graph.
pub type OnRefused = Arc<dyn Fn(Bound) + Send + Sync>;

/// The limiter of one replica with what it tells of refusals: what the gateway and the telemetry
/// service ask.
#[derive(Clone)]
pub struct Bounds {
    limiter: Arc<Mutex<Limiter>>,
    on_refused: OnRefused,
    pub config: AgentBounds,
}

impl std::fmt::Debug for Bounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounds").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Bounds {
    pub fn new(config: AgentBounds, on_refused: OnRefused) -> Bounds {
        Bounds { limiter: Arc::new(Mutex::new(Limiter::new(config.clone()))), on_refused, config }
    }

    /// Takes the costs for `id` now, or answers the refusal (counted) to send the agent.
    #[allow(clippy::result_large_err)]
    pub fn take(&self, id: WorkloadId, costs: &[(Bound, f64)]) -> Result<(), tonic::Status> {
        let taken =
            self.limiter.lock().unwrap_or_else(PoisonError::into_inner).take(id, costs, Instant::now());
        taken.map_err(|over| {
            (self.on_refused)(over.bound);
            tracing::warn!(workload = %id, reason = over.bound.reason(), "agent refused: over its rate bound");
            over.status(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> WorkloadId {
        WorkloadId::from_uuid(uuid::Uuid::from_u128(n + 1)).unwrap()
    }

    fn bounds(per_minute: u32) -> AgentBounds {
        AgentBounds {
            uploads_per_minute: per_minute,
            upload_bytes_per_minute: 1_000,
            heartbeats_per_minute: per_minute,
            hellos_per_minute: per_minute,
            ..AgentBounds::default()
        }
    }

    #[test]
    fn a_minutes_allowance_passes_then_refusals_name_the_wait() {
        let t0 = Instant::now();
        let mut l = Limiter::new(bounds(6));
        for _ in 0..6 {
            l.take(id(1), &[(Bound::Hellos, 1.0)], t0).unwrap();
        }
        let over = l.take(id(1), &[(Bound::Hellos, 1.0)], t0).unwrap_err();
        assert_eq!(
            (over.bound, over.retry_after),
            (Bound::Hellos, Duration::from_secs(10)),
            "6/min: one per 10 s"
        );
        // Refusals cost nothing: the wait does not grow however often the agent asks.
        for _ in 0..100 {
            assert!(l.take(id(1), &[(Bound::Hellos, 1.0)], t0 + Duration::from_secs(5)).is_err());
        }
        assert_eq!(
            l.take(id(1), &[(Bound::Hellos, 1.0)], t0 + Duration::from_secs(5)).unwrap_err().retry_after,
            Duration::from_secs(5)
        );
        l.take(id(1), &[(Bound::Hellos, 1.0)], t0 + Duration::from_secs(10)).unwrap();
        // Another identity and another bound have buckets of their own.
        l.take(id(2), &[(Bound::Hellos, 1.0)], t0).unwrap();
        l.take(id(1), &[(Bound::Heartbeats, 1.0)], t0).unwrap();
    }

    #[test]
    fn a_call_takes_all_its_costs_or_none() {
        let t0 = Instant::now();
        let mut l = Limiter::new(bounds(10));
        let upload = |bytes: f64| [(Bound::Uploads, 1.0), (Bound::UploadBytes, bytes)];
        l.take(id(1), &upload(600.0), t0).unwrap();
        let over = l.take(id(1), &upload(600.0), t0).unwrap_err();
        assert_eq!(over.bound, Bound::UploadBytes);
        assert_eq!(over.retry_after, Duration::from_secs(12), "200 bytes short at 1,000/min");
        // The refused upload took no upload token: nine more of 40 bytes pass, the tenth not.
        for _ in 0..9 {
            l.take(id(1), &upload(40.0), t0).unwrap();
        }
        assert_eq!(l.take(id(1), &upload(1.0), t0).unwrap_err().bound, Bound::Uploads);
        // Larger than a minute's allowance: passes once the bucket is full again.
        l.take(id(3), &upload(5_000.0), t0).unwrap();
        assert_eq!(l.take(id(3), &upload(5_000.0), t0).unwrap_err().retry_after, Duration::from_secs(60));
        l.take(id(3), &upload(5_000.0), t0 + Duration::from_secs(60)).unwrap();
    }

    #[test]
    fn the_table_is_bounded_and_keeps_the_limited() {
        let t0 = Instant::now();
        let mut l = Limiter::new(AgentBounds { max_tracked: 8, ..bounds(2) });
        let hello = [(Bound::Hellos, 1.0)];
        let beat = [(Bound::Heartbeats, 1.0)];
        // One identity at its bound, seven that heartbeat once: the table is full.
        l.take(id(0), &hello, t0).unwrap();
        l.take(id(0), &hello, t0).unwrap();
        for n in 1..8 {
            l.take(id(n), &beat, t0).unwrap();
        }
        assert_eq!(l.tracked(), 8);
        // 31 s later the seven have refilled (forgetting them loses nothing); the limited one
        // has not, and a newcomer's prune keeps it.
        let later = t0 + Duration::from_secs(31);
        l.take(id(100), &beat, later).unwrap();
        assert_eq!(l.tracked(), 2, "the refilled are forgotten");
        l.take(id(0), &hello, later).unwrap();
        assert!(l.take(id(0), &hello, later).is_err(), "still at its bound: not forgotten");
        // However many identities arrive at once, the table stays within its bound.
        for n in 1_000..3_000 {
            l.take(id(n), &beat, later).unwrap();
            assert!(l.tracked() <= 8, "{} tracked", l.tracked());
        }
    }

    #[test]
    fn the_refusal_says_what_and_when() {
        let over =
            OverBound { bound: Bound::Uploads, per_minute: 3.0, retry_after: Duration::from_millis(19_200) };
        let status = over.status(id(7));
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().starts_with("flow uploads of workload "), "{}", status.message());
        assert!(
            status
                .message()
                .ends_with("over the bound of 3 per minute (--agent-uploads-per-minute); retry after 20 s"),
            "{}",
            status.message()
        );
        assert_eq!(innerwall_wire::backoff::retry_after(&status), Some(Duration::from_secs(20)));
    }
}
