//! What one caller may ask of the API at once and per minute (REL-1, issue 26): a token's
//! requests in flight and per minute, and the requests a source address makes without a valid
//! token (no token, a bad one, the OpenAPI document) per minute — so callers that proved nothing
//! cannot crowd out the ones that did. Over a bound the answer is 429 `rate-limited` with
//! `Retry-After`, before the database is asked anything more. The buckets are
//! [`crate::rate::Limiter`]s, per replica and in memory, like the agents' bounds.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::ApiLimits;
use super::problem::ApiError;
use crate::rate::{Kind, Limiter};

/// The source address of the connection a request came on (a request extension the listener
/// inserts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub IpAddr);

/// What a key's bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ApiRate {
    /// Requests of one operator token.
    Requests,
    /// Requests of one source address without a valid token.
    Unauthenticated,
}

impl Kind for ApiRate {
    const ALL: &'static [ApiRate] = &[ApiRate::Requests, ApiRate::Unauthenticated];

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Token(String),
    Source(IpAddr),
}

/// The flags, for the refusals to name.
pub const REQUESTS_FLAG: &str = "--api-requests-per-minute";
pub const CONCURRENT_FLAG: &str = "--api-max-concurrent-per-token";
pub const UNAUTHENTICATED_FLAG: &str = "--api-unauthenticated-per-minute";

/// Keys whose buckets are held at once; beyond it the least recently seen are forgotten.
const MAX_TRACKED: usize = 100_000;

/// How long a token that authenticated here passes its source's exhausted share of requests
/// without a valid token, and how many such tokens are remembered (past it, none is added
/// until some expire).
const VOUCHED_FOR: Duration = Duration::from_secs(600);
const MAX_VOUCHED: usize = 4_096;

/// The bounds of one listener, shared by its requests.
#[derive(Debug)]
pub struct Edge {
    /// The request bounds in force ([`Edge::set_rates`] changes them while serving).
    rates: Mutex<EdgeRates>,
    limiter: Mutex<Limiter<Key, ApiRate>>,
    in_flight: Mutex<BTreeMap<String, usize>>,
    /// SHA-256 of the bearer tokens that authenticated lately, and when they last did.
    vouched: Mutex<BTreeMap<[u8; 32], Instant>>,
}

/// The bounds of [`ApiLimits`] an [`Edge`] holds, the ones a reload may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeRates {
    pub requests_per_minute: u32,
    pub max_concurrent_per_token: usize,
    pub unauthenticated_per_minute: u32,
}

impl From<ApiLimits> for EdgeRates {
    fn from(limits: ApiLimits) -> Self {
        EdgeRates {
            requests_per_minute: limits.requests_per_minute,
            max_concurrent_per_token: limits.max_concurrent_per_token,
            unauthenticated_per_minute: limits.unauthenticated_per_minute,
        }
    }
}

impl EdgeRates {
    fn per_minute(self, bound: ApiRate) -> f64 {
        match bound {
            ApiRate::Requests => f64::from(self.requests_per_minute),
            ApiRate::Unauthenticated => f64::from(self.unauthenticated_per_minute),
        }
    }
}

impl Edge {
    pub fn new(limits: ApiLimits) -> Arc<Edge> {
        let rates = EdgeRates::from(limits);
        Arc::new(Edge {
            rates: Mutex::new(rates),
            limiter: Mutex::new(Limiter::with_rates(|b| rates.per_minute(b), MAX_TRACKED)),
            in_flight: Mutex::default(),
            vouched: Mutex::default(),
        })
    }

    /// The request bounds in force.
    pub fn rates(&self) -> EdgeRates {
        *self.rates.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts `rates` in force for the requests that come after (a configuration reload); each
    /// bucket keeps what it holds, up to its new capacity.
    pub fn set_rates(&self, rates: EdgeRates) {
        let mut limiter = self.limiter.lock().unwrap_or_else(PoisonError::into_inner);
        limiter.set_rates(|b| rates.per_minute(b));
        *self.rates.lock().unwrap_or_else(PoisonError::into_inner) = rates;
    }

    fn take(&self, key: Key, bound: ApiRate) -> Result<(), Duration> {
        let mut limiter = self.limiter.lock().unwrap_or_else(PoisonError::into_inner);
        limiter.take(key, &[(bound, 1.0)], Instant::now()).map_err(|over| over.retry_after)
    }

    /// Counts one request of token `token`: refused over its rate or with as many in flight as
    /// allowed; otherwise a place held until the request is answered.
    pub fn admit_token(self: &Arc<Self>, token: &str) -> Result<InFlight, ApiError> {
        // In flight first: a request refused for that costs nothing of the token's rate.
        let rates = self.rates();
        let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if in_flight.get(token).copied().unwrap_or(0) >= rates.max_concurrent_per_token {
            return Err(ApiError::RateLimited {
                detail: format!(
                    "token {token} has {} requests in flight, the most {CONCURRENT_FLAG} allows; wait for \
                     their answers",
                    rates.max_concurrent_per_token
                ),
                bound: CONCURRENT_FLAG,
                retry_after: Duration::from_secs(1),
            });
        }
        self.take(Key::Token(token.to_owned()), ApiRate::Requests).map_err(|wait| ApiError::RateLimited {
            detail: format!(
                "token {token} made more than {} requests in a minute ({REQUESTS_FLAG}); retry after {} s",
                rates.requests_per_minute,
                super::problem::retry_secs(wait)
            ),
            bound: REQUESTS_FLAG,
            retry_after: wait,
        })?;
        *in_flight.entry(token.to_owned()).or_default() += 1;
        Ok(InFlight { edge: self.clone(), token: token.to_owned() })
    }

    /// Remembers that `bearer` authenticated just now.
    pub fn vouch(&self, bearer: &str) {
        let now = Instant::now();
        let mut vouched = self.vouched.lock().unwrap_or_else(PoisonError::into_inner);
        if vouched.len() >= MAX_VOUCHED {
            vouched.retain(|_, at| now.duration_since(*at) < VOUCHED_FOR);
        }
        if vouched.len() < MAX_VOUCHED || vouched.contains_key(&digest(bearer)) {
            vouched.insert(digest(bearer), now);
        }
    }

    /// Whether `bearer` authenticated here within [`VOUCHED_FOR`].
    pub fn vouched(&self, bearer: &str) -> bool {
        let vouched = self.vouched.lock().unwrap_or_else(PoisonError::into_inner);
        vouched.get(&digest(bearer)).is_some_and(|at| at.elapsed() < VOUCHED_FOR)
    }

    /// Refuses a request from `source` at once, before its token is looked up, when the source
    /// has used its share of requests without a valid token.
    pub fn check_source(&self, source: Option<Peer>) -> Result<(), ApiError> {
        let Some(Peer(source)) = source else { return Ok(()) };
        let limiter = self.limiter.lock().unwrap_or_else(PoisonError::into_inner);
        let checked = limiter.check(&Key::Source(source), &[(ApiRate::Unauthenticated, 1.0)], Instant::now());
        drop(limiter);
        checked.map_err(|over| self.over_source(source, over.retry_after))
    }

    fn over_source(&self, source: IpAddr, wait: Duration) -> ApiError {
        ApiError::RateLimited {
            detail: format!(
                "{source} made more than {} requests without a valid operator token in a minute \
                 ({UNAUTHENTICATED_FLAG}); retry after {} s",
                self.rates().unauthenticated_per_minute,
                super::problem::retry_secs(wait)
            ),
            bound: UNAUTHENTICATED_FLAG,
            retry_after: wait,
        }
    }

    /// Counts one request from `source` that carries no valid token (or asks for what needs
    /// none); refused past the source's share.
    pub fn admit_unauthenticated(&self, source: Option<Peer>) -> Result<(), ApiError> {
        let Some(Peer(source)) = source else { return Ok(()) };
        self.take(Key::Source(source), ApiRate::Unauthenticated)
            .map_err(|wait| self.over_source(source, wait))
    }

    /// Requests of `token` in flight now.
    pub fn in_flight(&self, token: &str) -> usize {
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner).get(token).copied().unwrap_or(0)
    }
}

fn digest(bearer: &str) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bearer.as_bytes()).as_ref());
    out
}

/// One request of a token in flight; its place is given back on drop.
#[derive(Debug)]
pub struct InFlight {
    edge: Arc<Edge>,
    token: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut in_flight = self.edge.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = in_flight.get_mut(&self.token) {
            *n -= 1;
            if *n == 0 {
                in_flight.remove(&self.token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(per_minute: u32, concurrent: usize) -> Arc<Edge> {
        Edge::new(ApiLimits {
            requests_per_minute: per_minute,
            max_concurrent_per_token: concurrent,
            unauthenticated_per_minute: per_minute,
            ..ApiLimits::default()
        })
    }

    #[test]
    fn a_token_is_bounded_in_rate_and_in_flight_and_others_are_not() {
        let e = edge(3, 2);
        let (a, b) = (e.admit_token("a").unwrap(), e.admit_token("a").unwrap());
        let ApiError::RateLimited { bound, .. } = e.admit_token("a").unwrap_err() else { panic!() };
        assert_eq!(bound, CONCURRENT_FLAG, "two in flight");
        assert_eq!(e.in_flight("a"), 2);
        drop(a);
        let c = e.admit_token("a").unwrap();
        drop(b);
        let ApiError::RateLimited { bound, retry_after, .. } = e.admit_token("a").unwrap_err() else {
            panic!()
        };
        assert_eq!(bound, REQUESTS_FLAG, "three a minute, and the refused ones counted nothing");
        assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(20), "{retry_after:?}");
        e.admit_token("b").unwrap();
        drop(c);
        assert_eq!(e.in_flight("a"), 0, "places are given back");
    }

    #[test]
    fn sources_without_a_token_have_their_own_share() {
        let e = edge(2, 8);
        let (one, two) = (Peer("10.0.0.1".parse().unwrap()), Peer("10.0.0.2".parse().unwrap()));
        e.admit_unauthenticated(Some(one)).unwrap();
        e.admit_unauthenticated(Some(one)).unwrap();
        e.check_source(Some(two)).unwrap();
        let err = e.check_source(Some(one)).unwrap_err();
        assert!(err.to_string().contains(UNAUTHENTICATED_FLAG), "{err}");
        let err = e.admit_unauthenticated(Some(one)).unwrap_err();
        assert!(err.to_string().contains(UNAUTHENTICATED_FLAG), "{err}");
        e.admit_unauthenticated(Some(two)).unwrap();
        e.admit_token("t").unwrap();
    }

    #[test]
    fn only_tokens_that_authenticated_are_vouched_for() {
        let e = edge(2, 8);
        assert!(!e.vouched("iwo_a"));
        e.vouch("iwo_a");
        assert!(e.vouched("iwo_a"));
        assert!(!e.vouched("iwo_b"), "another token is not vouched for by a's");
        for n in 0..MAX_VOUCHED {
            e.vouch(&format!("iwo_{n}"));
        }
        assert!(e.vouched("iwo_a"), "a vouched token is kept while the table is full");
        assert!(!e.vouched("iwo_past-the-bound"));
        e.vouch("iwo_past-the-bound");
        assert!(!e.vouched("iwo_past-the-bound"), "a full table takes no new token");
    }
}
