//! The sync state every reader shows (REL-3): the stored row judged against the clock. A
//! workload whose last sign of life is older than its stream's liveness is OFFLINE whatever its
//! row says, so an agent that died with its replica (no replica left to sweep) never reads
//! SYNCED. Silence dominates every stored state, SUSPENDED included: a silent host cannot be
//! known to still hold its kill switch.
//!
//! A row stored SYNCED whose applied version is behind its workload's persisted policy reads
//! PENDING: from the render's commit on, not from whenever a replica noticed the new version.
//! So a stream sending a delta records nothing first; it records the ack (PERF-2: one state
//! write per agent per change, and no write between a render and its update leaving).
//!
//! One rule, in two forms that must agree: [`STATE`] and [`DETAIL`], SQL expressions over
//! [`ROWS`] (the `workloads` row aliased `w` and its persisted policy's aliased `p`), which every
//! reader selects (status, the fleet list with its state filter and attention order, `workload show`, metrics, the verdict, resend-snapshot), so
//! filters, ordering and counts see the state shown; and [`shown`], the same rule as a pure
//! function, the specification the SQL is tested against (`tests/it/states.rs`).

use chrono::{DateTime, Utc};
use innerwall_wire::sync::SyncState;

/// What [`STATE`] and [`DETAIL`] read: a workload and its persisted policy (if it has one).
pub const ROWS: &str = "workloads w LEFT JOIN workload_policies p ON p.workload_id = w.id";

/// The shown state of the `workloads` row `w`, a smallint sync-state code. `now()` is the
/// reading transaction's start. A row with no liveness (no Hello yet) or never seen keeps its
/// stored state.
pub const STATE: &str =
    "(CASE WHEN w.stream_liveness IS NOT NULL AND w.last_seen_at + w.stream_liveness < now()
      THEN 4::smallint
      WHEN w.policy_held IS NOT NULL AND w.sync_state IN (1, 2) THEN 3::smallint
      WHEN w.sync_state = 2 AND p.version > w.applied_version THEN 1::smallint
      ELSE w.sync_state END)";

/// The shown detail of the `workloads` row `w`: for a silent row stored as anything but
/// OFFLINE (no sweep has caught it), when it was last heard of, what its stream tolerates, and
/// when any replica last swept; otherwise the stored detail.
pub const DETAIL: &str = "(CASE WHEN w.sync_state <> 4 AND w.stream_liveness IS NOT NULL
           AND w.last_seen_at + w.stream_liveness < now()
      THEN 'no heartbeat since ' || to_char(w.last_seen_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC, '
           || coalesce((SELECT 'no replica has swept since '
                               || to_char(s.swept_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC'
                        FROM liveness_sweeps s), 'no replica has ever swept')
           || ': no heartbeat for three intervals (' || round(extract(epoch FROM w.stream_liveness))::bigint
           || ' s), so it reads OFFLINE whatever its replica last stored'
      WHEN w.policy_held IS NOT NULL AND w.sync_state IN (1, 2) THEN w.policy_held
      ELSE w.sync_detail END)";

/// The state a reader shows for a row stored as `stored`, last heard of at `last_seen_at`,
/// whose stream tolerates `liveness` of silence, read at `now`. A row whose latest render was
/// `held` (over the rendered-policy bound, kept at its last good version) that reads PENDING or
/// SYNCED reads DEGRADED, with the hold's reason as its detail: the agent will not get the
/// version its rules now describe. A row stored SYNCED whose applied version is `behind` its
/// persisted policy's reads PENDING.
pub fn shown(
    stored: SyncState,
    held: bool,
    behind: bool,
    last_seen_at: Option<DateTime<Utc>>,
    liveness: Option<chrono::Duration>,
    now: DateTime<Utc>,
) -> SyncState {
    match (last_seen_at, liveness) {
        (Some(seen), Some(liveness)) if seen + liveness < now => SyncState::Offline,
        _ if held && matches!(stored, SyncState::Pending | SyncState::Synced) => SyncState::Degraded,
        _ if behind && stored == SyncState::Synced => SyncState::Pending,
        _ => stored,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;
    use innerwall_wire::convert::WireEnum as _;

    fn check(stored: SyncState, seen_ago_s: Option<i64>, liveness_s: Option<i64>, expected: SyncState) {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let seen = seen_ago_s.map(|s| now - Duration::seconds(s));
        let liveness = liveness_s.map(Duration::seconds);
        assert_eq!(
            shown(stored, false, false, seen, liveness, now),
            expected,
            "stored {stored:?}, seen {seen_ago_s:?} s ago, liveness {liveness_s:?} s"
        );
    }

    #[test]
    fn silence_past_the_liveness_reads_offline_whatever_is_stored() {
        use SyncState::*;
        for stored in [Pending, Synced, Degraded, Offline, Suspended] {
            check(stored, Some(91), Some(90), Offline);
        }
    }

    #[test]
    fn within_the_liveness_the_stored_state_stands() {
        use SyncState::*;
        for stored in [Pending, Synced, Degraded, Offline, Suspended] {
            check(stored, Some(89), Some(90), stored);
            // Exactly at the bound is not yet past it (the SQL compares with `<` too).
            check(stored, Some(90), Some(90), stored);
        }
    }

    #[test]
    fn a_held_render_reads_degraded_unless_silent_suspended_or_already_degraded() {
        use SyncState::*;
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let (seen, live) = (Some(now - Duration::seconds(10)), Some(Duration::seconds(90)));
        for (stored, expected) in [
            (Pending, Degraded),
            (Synced, Degraded),
            (Degraded, Degraded),
            (Suspended, Suspended),
            (Offline, Offline),
        ] {
            assert_eq!(shown(stored, true, false, seen, live, now), expected, "{stored:?}");
            assert_eq!(shown(stored, true, true, seen, live, now), expected, "{stored:?} behind");
        }
        assert_eq!(shown(Synced, true, false, Some(now - Duration::seconds(91)), live, now), Offline);
        let held = format!(
            "w.sync_state IN ({}, {}) THEN {}::smallint",
            Pending.code(),
            Synced.code(),
            Degraded.code()
        );
        assert!(STATE.contains(&held), "{STATE}");
        assert!(DETAIL.contains(&format!(
            "w.sync_state IN ({}, {}) THEN w.policy_held",
            Pending.code(),
            Synced.code()
        )));
    }

    #[test]
    fn the_sql_names_offline_by_its_code() {
        let offline = SyncState::Offline.code();
        assert!(STATE.contains(&format!("THEN {offline}::smallint")), "{STATE}");
        assert!(DETAIL.contains(&format!("w.sync_state <> {offline}")), "{DETAIL}");
    }

    #[test]
    fn synced_behind_the_persisted_version_reads_pending_unless_silent() {
        use SyncState::*;
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let live = Some(Duration::seconds(90));
        for (stored, expected) in [
            (Pending, Pending),
            (Synced, Pending),
            (Degraded, Degraded),
            (Suspended, Suspended),
            (Offline, Offline),
        ] {
            let seen = Some(now - Duration::seconds(10));
            assert_eq!(shown(stored, false, true, seen, live, now), expected, "{stored:?}");
        }
        assert_eq!(shown(Synced, false, true, Some(now - Duration::seconds(91)), live, now), Offline);
        let behind = format!(
            "w.sync_state = {} AND p.version > w.applied_version THEN {}::smallint",
            Synced.code(),
            Pending.code()
        );
        assert!(STATE.contains(&behind), "{STATE}");
    }

    #[test]
    fn rows_without_a_liveness_or_a_sighting_keep_their_state() {
        use SyncState::*;
        check(Synced, Some(10_000), None, Synced);
        check(Pending, None, Some(90), Pending);
        check(Offline, None, None, Offline);
    }
}
