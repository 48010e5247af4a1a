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
