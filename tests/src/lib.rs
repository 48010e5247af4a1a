//! Shared helpers for the end-to-end tests: building and locating the workspace binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

// One definition of what a nested cargo must not inherit, shared with xtask without a
// dependency on it: the file has no imports beyond std.
#[path = "../../xtask/src/cargo_env.rs"]
mod cargo_env;

/// The binaries under test, with the packages that own them.
const BINARIES: &[(&str, &str)] =
    &[("innerwall", "innerwall-control-plane"), ("innerwall-agent", "innerwall-agent")];

/// Path of a workspace binary (`innerwall`, `innerwall-agent`), built for this test run.
///
/// `cargo test` builds a package's binaries only for that package's own integration tests, so
/// the first call builds every workspace binary once with the cargo running the tests (a no-op
/// when they are fresh); the build lock is free while tests run.
pub fn workspace_bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT.get_or_init(build_binaries).as_ref().unwrap_or_else(|e| panic!("{e}"));
    let bin = dir.join(name);
    assert!(bin.is_file(), "{} is not a workspace binary", bin.display());
    bin
}

fn build_binaries() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    // target/<profile>/deps/<test> → target/<profile>
    let profile_dir =
        exe.parent().and_then(Path::parent).ok_or("test binary has no profile dir")?.to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).args(["build", "--quiet"]);
    if profile_dir.file_name().is_some_and(|p| p == "release") {
        cmd.arg("--release");
    }
    for (bin, package) in BINARIES {
        cmd.args(["--package", package, "--bin", bin]);
    }
    // Passing on what cargo set for this test run would rebuild half the dependency tree on
    // every alternation between `cargo test` and `cargo build`.
    cargo_env::isolate_cargo_env(&mut cmd);
    let status = cmd.status().map_err(|e| format!("running cargo build: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of the workspace binaries failed: {status}"));
    }
    Ok(profile_dir)
}

pub mod sim;
