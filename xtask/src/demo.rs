//! `cargo xtask demo`: for now builds the release binaries and shows they start; the real demo replaces it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

use crate::{cmd, ebpf, setup, suite::root_cargo};

const BINARIES: &[&str] = &["innerwall", "innerwall-agent"];

pub fn run(root: &Path) -> Result<()> {
    // build-ebpf runs the rest of setup (rust-src, bpf-linker) itself.
    setup::apt_packages()?;
    ebpf::build(root)?;
    cmd::run(root_cargo(root).args([
        "build",
        "--release",
        "-p",
        "innerwall-control-plane",
        "-p",
        "innerwall-agent",
    ]))?;
    let release = target_dir(root).join("release");
    for binary in BINARIES {
        cmd::run(Command::new(release.join(binary)).arg("--version"))?;
    }
    println!(
        "demo: not built yet: the full demo (control plane + agents in network namespaces) \
         comes later; this only shows that the release binaries start"
    );
    Ok(())
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |dir| root.join(dir))
}
