//! Full-jitter reconnect backoff (SYNC-10), shared by every client of the contract: the wait
//! before attempt `n` is uniform in `[0, min(cap, base · 2ⁿ)]`. Pure: the caller supplies the
//! uniform sample, so the bound is testable without a clock or a random source. A control plane
//! that refuses a call for rate (REL-1: RESOURCE_EXHAUSTED) names in the status's `retry-after`
//! metadata how many seconds to wait; the client waits at least that long ([`after_refusal`]).

use std::time::Duration;

/// The policy stream's and the telemetry connection's parameters.
pub const BASE: Duration = Duration::from_secs(1);
pub const CAP: Duration = Duration::from_secs(300);

/// The upper bound of the window for attempt `attempt` (0-based).
pub fn window(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(cap)
}

/// The wait before attempt `attempt`, given `unit` uniform in `[0, 1)`.
pub fn wait(attempt: u32, base: Duration, cap: Duration, unit: f64) -> Duration {
    window(attempt, base, cap).mul_f64(unit.clamp(0.0, 1.0))
}

/// The metadata key of a refusal's wait, in whole seconds (like HTTP's `Retry-After`).
pub const RETRY_AFTER: &str = "retry-after";

/// The longest wait a refusal may ask for: a control plane (or anything in between) cannot
/// park an agent for longer than its own backoff cap.
pub const MAX_RETRY_AFTER: Duration = CAP;

/// The wait a RESOURCE_EXHAUSTED status asks for (its `retry-after`, capped at
/// [`MAX_RETRY_AFTER`]); `None` for any other status or one without a readable value.
pub fn retry_after(status: &tonic::Status) -> Option<Duration> {
    if status.code() != tonic::Code::ResourceExhausted {
        return None;
    }
    let secs: u64 = status.metadata().get(RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// A RESOURCE_EXHAUSTED status that tells the client to retry after `wait` (rounded up to whole
/// seconds, at least one), in its metadata and its message.
pub fn refuse(message: impl std::fmt::Display, wait: Duration) -> tonic::Status {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let secs = secs.max(1);
    let mut status = tonic::Status::resource_exhausted(format!("{message}; retry after {secs} s"));
    status.metadata_mut().insert(RETRY_AFTER, secs.to_string().parse().expect("digits are ascii"));
    status
}

/// The wait before the next attempt after a failure: the jittered backoff for `attempt`, but
/// never less than what a rate refusal asked for.
pub fn after_refusal(
    attempt: u32,
    base: Duration,
    cap: Duration,
    unit: f64,
    retry_after: Option<Duration>,
) -> Duration {
    wait(attempt, base, cap, unit).max(retry_after.unwrap_or_default())
}

/// A uniform sample in `[0, 1)` from the operating system's random source.
pub fn random_unit() -> f64 {
    let bits = uuid::Uuid::new_v4().as_u64_pair().0 >> 11;
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_with_full_jitter() {
        for attempt in 0..40 {
            let bound = window(attempt, BASE, CAP);
            assert_eq!(bound, BASE.saturating_mul(2u32.saturating_pow(attempt)).min(CAP));
            let waits: Vec<Duration> = (0..50).map(|_| wait(attempt, BASE, CAP, random_unit())).collect();
            assert!(waits.iter().all(|w| *w <= bound), "attempt {attempt}: a wait left [0, {bound:?}]");
            let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
            assert!(distinct.len() > 1, "attempt {attempt}: waits for the same attempt must differ");
        }
        assert_eq!(window(0, BASE, CAP), BASE);
        assert_eq!(window(3, BASE, CAP), Duration::from_secs(8));
        assert_eq!(window(9, BASE, CAP), CAP);
        assert_eq!(wait(5, BASE, CAP, 0.0), Duration::ZERO);
    }

    #[test]
    fn a_rate_refusal_sets_the_least_wait() {
        let refused = refuse("uploads over the bound", Duration::from_millis(2_500));
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(refused.message(), "uploads over the bound; retry after 3 s");
        assert_eq!(retry_after(&refused), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(&refuse("x", Duration::ZERO)), Some(Duration::from_secs(1)), "at least 1 s");
        let mut huge = tonic::Status::resource_exhausted("x");
        huge.metadata_mut().insert(RETRY_AFTER, "999999".parse().unwrap());
        assert_eq!(retry_after(&huge), Some(MAX_RETRY_AFTER), "capped");
        let mut other = tonic::Status::unavailable("down");
        other.metadata_mut().insert(RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&other), None, "only a rate refusal asks for a wait");
        let mut garbage = tonic::Status::resource_exhausted("x");
        garbage.metadata_mut().insert(RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&garbage), None);
        let at_least = Some(Duration::from_secs(20));
        for attempt in 0..12 {
            let w = after_refusal(attempt, BASE, CAP, random_unit(), at_least);
            assert!(w >= Duration::from_secs(20) && w <= CAP.max(Duration::from_secs(20)), "{w:?}");
        }
        assert_eq!(after_refusal(0, BASE, CAP, 0.5, None), Duration::from_millis(500));
    }
}
