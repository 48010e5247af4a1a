//! `cargo xtask`: the command line that dispatches to setup, the eBPF build and the suites.

mod bench;
mod cargo_env;
mod cmd;
mod cycles;
mod demo;
mod ebpf;
mod elf;
mod fuzz;
mod leftovers;
mod migrations;
mod package;
mod setup;
mod suite;
mod transport;
mod walk;
mod wire;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about = "Innerwall developer and CI tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install what the project needs (apt packages, rust-src, bpf-linker); idempotent.
    Setup,
    /// Build agent-ebpf for the BPF target, copy it to target/bpf/ and verify the object.
    BuildEbpf,
    /// Setup, build-ebpf, then `cargo test --workspace` with any extra arguments.
    Test {
        /// Passed to `cargo test --workspace` as they are (put them after `--`).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// rustfmt and clippy (-D warnings) for both workspaces; `.ci/run` runs it after `test`.
    Lint,
    /// Run the benchmarks of DESIGN.md §11 (all, or those named) and print their figures with
    /// their goals; JSON under target/bench/.
    Bench {
        /// render, publish, propagation, propagation-2, storm, density, nft, capture, ingest, rollup,
        /// impact, suggest, console, notify, heartbeats.
        names: Vec<String>,
        /// Small sizes: proves each benchmark still works (CI), judges no figure.
        #[arg(long)]
        quick: bool,
    },
    /// The main job (RUN-3): control plane and three agents in network namespaces, policy, traffic,
    /// and the web console with screenshots of its pages under target/demo/.
    Demo {
        /// Leave the estate and its console running until Enter is pressed, to click through it.
        #[arg(long)]
        keep: bool,
    },
    /// Build the Debian packages `innerwall` and `innerwall-agent` (the eBPF object embedded)
    /// into target/packages/ (or --out).
    Package {
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Debug binaries, as `cargo xtask test` packages them for its tests.
        #[arg(long)]
        dev: bool,
    },
    /// Build the previous release (the commit tests/fixtures/previous-release pins: its agent,
    /// package and `innerwall`) into target/previous/, as `cargo xtask test` does; kept by
    /// commit. Needs the current eBPF object (`cargo xtask build-ebpf`).
    Previous,
    /// Run the policy stream's deterministic simulator (issue 30) over many seeds; prints seeds
    /// per second and each failing seed with the command that replays it.
    Simulate {
        /// Passed to `innerwall-sim` (`--seeds N --steps K --seed S --agents A --replicas R --trace`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run every cargo-fuzz target for a while (AddressSanitizer; installs cargo-fuzz once).
    Fuzz {
        /// How long each target runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// Report import cycles between the modules of each crate (top level, and within folders).
    CheckCycles {
        /// Crate `src` folders relative to the workspace root; default: control-plane, agent, wire, xtask.
        dirs: Vec<PathBuf>,
    },
    /// Fail on a migration that changes a released one or contracts what the previous release
    /// (tests/fixtures/previous-release) uses; `cargo xtask lint` runs it.
    CheckMigrations,
    /// Fail on a breaking change of the wire contract (`wire/proto`) against the released one
    /// (`wire/contract/innerwall.agent.v1.binpb`); `cargo xtask lint` runs it.
    CheckWire {
        /// Record the current contract as the released one: done at a release, and the file
        /// committed with it.
        #[arg(long)]
        bless: bool,
        /// Check this proto root instead of `wire/proto` (e.g. an edited copy).
        #[arg(long, value_name = "DIR", conflicts_with = "bless")]
        protos: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole context chain on one line; a backtrace would only
            // point into xtask itself.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let root = workspace_root()?;
    match cli.task {
        Task::Setup => setup::all(),
        Task::BuildEbpf => ebpf::build(&root).map(drop),
        Task::Test { cargo_args } => suite::test(&root, &cargo_args),
        Task::Lint => suite::lint(&root),
        Task::Bench { names, quick } => bench::run(&root, &names, quick),
        Task::Demo { keep } => demo::run(&root, keep),
        Task::Package { out, dev } => {
            let profile = if dev { package::Profile::Dev } else { package::Profile::Release };
            package::build(&root, profile, &out.unwrap_or_else(|| root.join(package::TEST_PACKAGES)))
                .map(drop)
        }
        Task::Previous => package::previous::build(&root, &root.join(ebpf::OBJECT_PATH)).map(drop),
        Task::Simulate { args } => cmd::run(
            cmd::root_cargo(&root)
                .args(["run", "--quiet", "--release", "-p", "innerwall-e2e", "--bin", "innerwall-sim", "--"])
                .args(&args),
        ),
        Task::Fuzz { seconds } => {
            fuzz::run(&root, std::time::Duration::from_secs(seconds), fuzz::Build::Optimized)
        }
        Task::CheckCycles { dirs } if dirs.is_empty() => {
            cycles::check(&root, &cycles::CRATE_SOURCES.iter().map(PathBuf::from).collect::<Vec<_>>())
        }
        Task::CheckCycles { dirs } => cycles::check(&root, &dirs),
        Task::CheckMigrations => migrations::check(&root),
        Task::CheckWire { bless: true, .. } => wire::bless(&root, &root.join(wire::PROTOS)),
        Task::CheckWire { bless: false, protos } => {
            wire::check(&root, &protos.unwrap_or_else(|| root.join(wire::PROTOS)))
        }
    }
}

/// The root workspace: xtask lives one level below it.
fn workspace_root() -> Result<PathBuf> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .with_context(|| format!("xtask manifest dir {} has no parent", manifest_dir.display()))
}
