//! Shared helpers for the end-to-end tests: building and locating the workspace binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

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
    // What cargo sets for running this test is not the user's environment: some build scripts
    // (ring's) rerun when CARGO_MANIFEST_DIR changes, so passing it on would rebuild half the
    // dependency tree on every alternation between `cargo test` and `cargo build`.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_tests) {
            cmd.env_remove(name);
        }
    }
    let status = cmd.status().map_err(|e| format!("running cargo build: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of the workspace binaries failed: {status}"));
    }
    Ok(profile_dir)
}

fn set_by_cargo_for_tests(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    const PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}
