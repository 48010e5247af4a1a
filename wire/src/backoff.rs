//! Full-jitter reconnect backoff (SYNC-10), shared by every client of the contract: the wait
//! before attempt `n` is uniform in `[0, min(cap, base · 2ⁿ)]`. Pure: the caller supplies the
//! uniform sample, so the bound is testable without a clock or a random source.

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
}
