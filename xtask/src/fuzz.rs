//! `cargo xtask fuzz`: every cargo-fuzz target in `fuzz/` (its own workspace) for a while each,
//! with AddressSanitizer, on stable Rust (`RUSTC_BOOTSTRAP=1` for that nested build only).
//! `cargo xtask test` runs each briefly; a long run is `cargo xtask fuzz --seconds 3600`.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::{cmd, setup};

/// The targets, one per thing that arrives from outside (see `fuzz/fuzz_targets/`).
pub const TARGETS: [&str; 5] = ["policy_delta", "flow_window", "csr", "ruleset", "api_params"];

/// Memory limits of every run, in MiB: a target whose RSS passes `RSS_LIMIT_MB` (an input that
/// expands, such as a YAML alias bomb) or that asks for more than `MALLOC_LIMIT_MB` at once is
/// a finding and fails the run. AddressSanitizer's own overhead fits well under both.
pub const RSS_LIMIT_MB: u32 = 1024;
pub const MALLOC_LIMIT_MB: u32 = 256;

/// How the targets are built.
#[derive(Debug, Clone, Copy)]
pub enum Build {
    /// Optimized: the most executions per second, for long runs (about 9 minutes to build on
    /// the project's 2-core machine).
    Optimized,
    /// Unoptimized, with debug assertions and overflow checks: fewer executions per second but
    /// a build in less than half the time, for the test command's short runs.
    Dev,
}

/// Runs each target for `each`, built as `build` says, with [`RSS_LIMIT_MB`] and [`MALLOC_LIMIT_MB`], starting from its seeds (`fuzz/seeds/<target>`, checked in)
/// and its growing corpus (`fuzz/corpus/<target>`, not checked in). A finding fails the run
/// and leaves its input under `fuzz/artifacts/<target>/`.
pub fn run(root: &Path, each: Duration, build: Build) -> Result<()> {
    setup::cargo_fuzz()?;
    let dir = root.join("fuzz");
    for target in TARGETS {
        let corpus = dir.join("corpus").join(target);
        std::fs::create_dir_all(&corpus)?;
        let mut cargo = setup::standalone_cargo();
        cargo
            .current_dir(&dir)
            .env("RUSTC_BOOTSTRAP", "1")
            .args([
                "fuzz",
                "run",
                match build {
                    Build::Optimized => "-O",
                    Build::Dev => "--dev",
                },
                target,
            ])
            .arg(&corpus);
        let seeds = dir.join("seeds").join(target);
        if seeds.is_dir() {
            cargo.arg(&seeds);
        }
        cargo.args([
            "--",
            &format!("-max_total_time={}", each.as_secs().max(1)),
            &format!("-rss_limit_mb={RSS_LIMIT_MB}"),
            &format!("-malloc_limit_mb={MALLOC_LIMIT_MB}"),
            "-print_final_stats=1",
        ]);
        println!("fuzz: {target} for {} s", each.as_secs());
        cmd::run(&mut cargo)?;
    }
    println!("fuzz: {} targets ran without a finding", TARGETS.len());
    Ok(())
}
