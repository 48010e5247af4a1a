//! Shared helpers for the end-to-end tests: locating the workspace binaries under test.

use std::path::PathBuf;

/// Path of a workspace binary (`innerwall`, `innerwall-agent`) built beside this test.
///
/// `cargo test --workspace` builds every member's binaries first; a lone `cargo test -p
/// innerwall-e2e` does not, which this reports instead of testing a stale binary.
pub fn workspace_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).ok_or("test binary has no profile dir")?;
    let bin = profile_dir.join(name);
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "{} not found: run `cargo build --workspace` (or `cargo test --workspace`)",
            bin.display()
        ))
    }
}
