//! What cargo sets for the process it runs, removed from every nested cargo we start.
//!
//! Shared by xtask and the end-to-end tests (`tests/src/lib.rs` includes this file with
//! `#[path]`), so it must stay free of dependencies and of anything either side does not use.

use std::process::Command;

/// Removes from `cmd` every variable cargo set for the running process (a `cargo run` binary,
/// a test or bench). They describe the outer package, not the user's build settings, and some
/// build scripts (ring's) rerun when CARGO_MANIFEST_DIR changes: passed on, they rebuild half
/// the dependency tree each time a nested build alternates with a plain `cargo build`.
/// Build settings (CARGO_TARGET_DIR, RUSTFLAGS, the toolchain) are left alone.
pub fn isolate_cargo_env(cmd: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_the_running_process) {
            cmd.env_remove(name);
        }
    }
}

/// The names cargo documents under "environment variables Cargo sets for crates" that reach a
/// binary, test or bench at run time.
pub fn set_by_cargo_for_the_running_process(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "CARGO",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    const PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"];
    EXACT.contains(&name) || PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    use super::set_by_cargo_for_the_running_process as stripped;

    #[test]
    fn strips_what_cargo_sets_for_the_running_process() {
        for name in [
            "CARGO",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_BIN_NAME",
            "CARGO_BIN_EXE_innerwall",
            "CARGO_CRATE_NAME",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_RUSTC_CURRENT_DIR",
            "OUT_DIR",
        ] {
            assert!(stripped(name), "{name}");
        }
    }

    #[test]
    fn keeps_build_settings_and_the_users_environment() {
        for name in [
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "RUSTFLAGS",
            "RUSTUP_TOOLCHAIN",
            "PATH",
            "HOME",
        ] {
            assert!(!stripped(name), "{name}");
        }
    }
}
