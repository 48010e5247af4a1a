//! Gathering requests into batches: what the heartbeat writer (`beats`), the policy reader
//! (`reads`) and the enrollment writer (`identity::enroll`) share.

use std::time::Duration;

use tokio::sync::mpsc;

/// The next batch: waits for a first request, then takes what arrives within `linger` of it
/// (only what is already waiting when `linger` is zero), at most `max`. `None` once every sender
/// is gone and nothing is left.
pub async fn next<T>(pending: &mut mpsc::Receiver<T>, max: usize, linger: Duration) -> Option<Vec<T>> {
    let first = pending.recv().await?;
    let mut batch = vec![first];
    let until = tokio::time::Instant::now() + linger;
    while batch.len() < max {
        // A request already waiting is taken even when `until` has passed: the receive is polled
        // before the deadline is looked at.
        match tokio::time::timeout_at(until, pending.recv()).await {
            Ok(Some(next)) => batch.push(next),
            Ok(None) | Err(_) => break,
        }
    }
    Some(batch)
}
