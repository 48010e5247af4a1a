//! The policy stream's simulator (issue 30): a quick batch of seeds in the test command, and the
//! same seed twice gives the same trace.

use innerwall_e2e::sim::{self, Params};

/// Seeds the test command runs: enough to cover every fault kind many times, quick enough for
/// every run (`cargo xtask simulate` runs long batches).
const QUICK_SEEDS: u64 = 200;

#[test]
fn simulation_quick_batch() {
    let mut failures = Vec::new();
    for seed in 1..=QUICK_SEEDS {
        if let Err(failure) = sim::run(&Params::quick(seed)) {
            failures.push(failure.to_string());
        }
    }
    assert!(failures.is_empty(), "replay each with cargo xtask simulate --seeds 1 --seed S: {failures:#?}");
}

#[test]
fn simulation_is_deterministic() {
    for seed in [7, 4242] {
        let first = sim::run(&Params::quick(seed)).map_err(|f| f.to_string()).unwrap();
        let second = sim::run(&Params::quick(seed)).map_err(|f| f.to_string()).unwrap();
        assert!(first.len() > 50, "a run does something: {} lines", first.len());
        assert_eq!(first, second, "seed {seed} replays identically");
    }
}

/// Each planted bug (`control-plane/src/sync/planted.rs`) is found by the quick batch's seeds,
/// and the seeds it takes are printed (`--nocapture`).
#[test]
fn simulation_finds_planted_bugs() {
    use innerwall_agent::sync::planted as agent;
    use innerwall_control_plane::sync::planted::{self, Bug};
    let control_plane = [
        Bug::SyncedOnSend,
        Bug::SnapshotEveryFailure,
        Bug::KeepSupersededStream,
        Bug::RetryFailedDelta,
        Bug::DeltaFromClaim,
    ];
    let bugs = control_plane.map(|bug| (format!("{bug:?}"), Some(bug), None));
    for (bug, in_control_plane, in_agent) in bugs.into_iter().chain([(
        format!("{:?}", agent::Bug::AckBeforePersist),
        None,
        Some(agent::Bug::AckBeforePersist),
    )]) {
        planted::plant(in_control_plane);
        agent::plant(in_agent);
        let found = (1..=QUICK_SEEDS).find_map(|seed| sim::run(&Params::quick(seed)).err());
        planted::plant(None);
        agent::plant(None);
        let failure = found.unwrap_or_else(|| panic!("{bug} was not found in {QUICK_SEEDS} seeds"));
        println!("{bug}: found by seed {} at step {}: {}", failure.seed, failure.step, failure.what);
        // Unplanted, the seed that found it passes: the failure was the bug's.
        assert!(sim::run(&Params::quick(failure.seed)).is_ok(), "seed {} fails without {bug}", failure.seed);
    }
}
