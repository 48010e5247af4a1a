//! `cargo xtask test` and `cargo xtask lint`: the full suite, and the checks CI runs after it
//! (import cycles, wire breaking changes, formatting, clippy).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;

use crate::{cmd, cycles, ebpf, fuzz, leftovers, migrations, package, setup, transport, wire};

/// How long each fuzz target runs in the test command: long enough to catch a shallow panic. The
/// targets are built unoptimized for it (with overflow checks), which builds in half the time.
const FUZZ_IN_TESTS: Duration = Duration::from_secs(15);

/// Setup, the verified eBPF build, the packages (this tree's, and the previous release's agent
/// package and binaries), the workspace tests, then a short run of every fuzz target.
pub fn test(root: &Path, cargo_args: &[String]) -> Result<()> {
    // build-ebpf runs the rest of setup (rust-src, bpf-linker) itself.
    setup::apt_packages()?;
    // The packages the tests install (`packages_install_and_enforce`), eBPF object included.
    package::build(root, package::Profile::Dev, &root.join(package::TEST_PACKAGES))?;
    // The previous release's agent, package and control plane
    // (`previous_agent_works_with_this_control_plane`, `agent_upgrade_keeps_enforcing`,
    // `previous_replica_serves_while_this_release_migrates`), from the commit
    // tests/fixtures/previous-release pins; kept by commit, so only the first run after a new pin
    // builds it.
    package::previous::build(root, &root.join(ebpf::OBJECT_PATH))?;
    let before = leftovers::scan();
    cmd::run(cmd::root_cargo(root).args(["test", "--workspace"]).args(cargo_args))?;
    fuzz::run(root, FUZZ_IN_TESTS, fuzz::Build::Dev)?;
    leftovers::check(&before, "the test suite")?;
    println!("test: nothing left behind under the temp directory or /dev/shm");
    Ok(())
}

/// No import cycle between modules, no breaking change of the wire contract, no migration that
/// changes a released one or contracts the schema the previous release uses, then formatting
/// and clippy for both workspaces (`.ci/run` calls it after `test`).
pub fn lint(root: &Path) -> Result<()> {
    cycles::check(root, &cycles::CRATE_SOURCES.iter().map(PathBuf::from).collect::<Vec<_>>())?;
    wire::check(root, &root.join(wire::PROTOS))?;
    transport::check(root, &root.join(wire::PROTOS))?;
    migrations::check(root)?;
    cmd::run(cmd::root_cargo(root).args(["fmt", "--all", "--check"]))?;
    cmd::run(cmd::root_cargo(root).args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    cmd::run(ebpf::crate_cargo(root).args(["fmt", "--all", "--check"]))?;
    cmd::run(setup::standalone_cargo().current_dir(root.join("fuzz")).args(["fmt", "--check"]))?;
    cmd::run(ebpf::bpf_cargo(root, "clippy").args(["--", "-D", "warnings"]))?;
    println!(
        "lint: no import cycles, no breaking wire change, no prost type matched outside convert.rs, migrations expand only; rustfmt and clippy passed for the workspace and agent-ebpf"
    );
    Ok(())
}
