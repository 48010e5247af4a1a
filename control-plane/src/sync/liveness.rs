//! Liveness independent of the replica holding a stream (SYNC-6, issue 16). A stream's replica
//! marks it OFFLINE when it ends; a replica that dies (SIGKILL, host loss) never does. So every
//! replica sweeps: a workload whose last sign of life (`last_seen_at`, written by every
//! heartbeat and state write) is older than the silence its stream tolerates is OFFLINE,
//! whoever held the stream. The holder itself would have closed a stream that silent, so the
//! sweep never contradicts a live one; if a slow heartbeat write ever lets it, the stream's
//! next heartbeat restores its state (`gateway`), under the epoch rules. No reader depends on a
//! sweep having run: each judges the row against the clock itself (`shown`).

use std::time::Duration;

use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::Error;

/// The sweep's statement (public for the test that checks its plan). It reads only the rows past
/// their deadline, through the index on it (migration 0042), whose condition it repeats word for
/// word: OFFLINE is state 4 (a literal, not a parameter, so the planner can match the index's
/// condition in a generic plan too).
pub const SWEEP: &str = "WITH swept AS (
        INSERT INTO liveness_sweeps (one, swept_at) VALUES (true, now())
        ON CONFLICT (one) DO UPDATE SET swept_at = excluded.swept_at
    )
    UPDATE workloads
    SET sync_state = 4,
        sync_detail = 'silent since ' || to_char(last_seen_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
            || ' UTC: no heartbeat for three intervals (the replica holding its stream is gone, or the host is)'
    WHERE sync_state <> 4 AND stream_liveness IS NOT NULL
      AND innerwall_silent_after(last_seen_at, stream_liveness) < now()
    RETURNING id";

/// Marks every workload whose stream has been silent longer than it tolerates OFFLINE, and
/// records when a sweep last ran (readers say so of a silent row no sweep has caught:
/// `shown`); returns them. Its cost follows the rows past their deadline, not the fleet.
pub async fn sweep(pool: &PgPool) -> Result<Vec<WorkloadId>, Error> {
    let ids: Vec<Uuid> = sqlx::query_scalar(SWEEP).fetch_all(pool).await?;
    Ok(ids.into_iter().filter_map(WorkloadId::from_uuid).collect())
}

/// Sweeps every `every` until aborted; failures are logged and retried at the next tick.
pub async fn sweep_forever(pool: PgPool, every: Duration) {
    let mut ticks = tokio::time::interval(every.max(Duration::from_secs(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match sweep(&pool).await {
            Ok(gone) if !gone.is_empty() => {
                tracing::warn!(workloads = ?gone, "marked OFFLINE: silent longer than their liveness bound")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("liveness sweep failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use innerwall_wire::convert::WireEnum;
    use innerwall_wire::sync::SyncState;

    #[test]
    fn the_sweep_names_offline_by_its_code() {
        assert_eq!(SyncState::Offline.code(), 4);
        assert!(
            super::SWEEP.contains("SET sync_state = 4,") && super::SWEEP.contains("WHERE sync_state <> 4 ")
        );
    }
}
