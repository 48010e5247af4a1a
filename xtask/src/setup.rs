//! `cargo xtask setup`: installs the apt packages, rust-src and bpf-linker the project needs, if missing.

use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{cargo_env, cmd};

/// What the builds and tests need from Debian: nftnl/mnl headers for the agent, the
/// tools the namespace tests drive, bpftool for inspecting loaded programs and maps, and the
/// headless browser (and its WebDriver) the console's tests drive.
const APT_PACKAGES: &[&str] = &[
    "libnftnl-dev",
    "libmnl-dev",
    "pkg-config",
    "iproute2",
    "nftables",
    "python3",
    "bpftool",
    "chromium",
    "chromium-driver",
    // The highly available database of `patroni_failover_keeps_the_fleet` (and its certificates).
    "patroni",
    "etcd-server",
    "haproxy",
    "openssl",
];

/// The toolchain the eBPF crate is built with (`cargo +stable`, with RUSTC_BOOTSTRAP=1).
pub const TOOLCHAIN: &str = "stable";

const BPF_LINKER_VERSION: &str = "0.13.0";

/// Every step, in order.
pub fn all() -> Result<()> {
    apt_packages()?;
    bpf_toolchain()
}

/// The part the eBPF build needs: rust-src for `-Z build-std=core` and bpf-linker.
pub fn bpf_toolchain() -> Result<()> {
    rust_src()?;
    bpf_linker()
}

pub fn apt_packages() -> Result<()> {
    // dpkg-query exits non-zero when it has never heard of a package; the ones it knows
    // are still printed, so read stdout whatever the status.
    let query = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${Status}\n"])
        .args(APT_PACKAGES)
        .output()
        .context("could not run dpkg-query: setup supports Debian-like systems only")?;
    let missing = missing_packages(&String::from_utf8_lossy(&query.stdout), APT_PACKAGES);
    if missing.is_empty() {
        println!("setup: apt packages ({}): already present", APT_PACKAGES.join(" "));
        return Ok(());
    }
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive").args(args);
        cmd::run(&mut cmd).context("installing apt packages needs root and Debian's package mirror")
    };
    apt(&["update"])?;
    apt(&[&["install", "-y"][..], &missing].concat())?;
    println!("setup: apt packages ({}): installed", missing.join(" "));
    Ok(())
}

/// The packages of `wanted` that `dpkg-query -W -f='${Package} ${Status}\n'` did not
/// report as installed.
fn missing_packages<'a>(dpkg_output: &str, wanted: &[&'a str]) -> Vec<&'a str> {
    let installed: BTreeSet<&str> = dpkg_output
        .lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(_, status)| status.trim() == "install ok installed")
        .map(|(package, _)| package)
        .collect();
    wanted.iter().copied().filter(|package| !installed.contains(package)).collect()
}

fn rust_src() -> Result<()> {
    let installed = cmd::output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        TOOLCHAIN,
    ]))?;
    if has_component(&installed, "rust-src") {
        println!("setup: rust-src ({TOOLCHAIN}): already present");
        return Ok(());
    }
    cmd::run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", TOOLCHAIN]))?;
    println!("setup: rust-src ({TOOLCHAIN}): installed");
    Ok(())
}

fn has_component(installed: &str, component: &str) -> bool {
    installed.lines().map(str::trim).any(|line| {
        line == component || line.strip_prefix(component).is_some_and(|rest| rest.starts_with('-'))
    })
}

/// bpf-linker must use the same LLVM as rustc (it reads rustc's bitcode), so it is built
/// against a copy of rustc's own libLLVM and the install is keyed on the LLVM major.
fn bpf_linker() -> Result<()> {
    let llvm = RustcLlvm::probe()?;
    let prefix = llvm.prefix()?;
    let marker = prefix.join("bpf-linker.installed");
    let expected = marker_text(llvm.major);
    let marker_ok = fs::read_to_string(&marker).is_ok_and(|text| text == expected);
    if marker_ok && bpf_linker_version().is_ok_and(|v| v.contains(BPF_LINKER_VERSION)) {
        println!("setup: bpf-linker {BPF_LINKER_VERSION} (LLVM {}): already present", llvm.major);
        return Ok(());
    }
    install_bpf_linker(&llvm, &prefix)?;
    fs::write(&marker, expected).with_context(|| format!("writing {}", marker.display()))?;
    let version = bpf_linker_version().context(
        "bpf-linker was installed but does not run: is $CARGO_HOME/bin (usually ~/.cargo/bin) on PATH?",
    )?;
    println!("setup: bpf-linker {BPF_LINKER_VERSION} (LLVM {}): installed ({})", llvm.major, version.trim());
    Ok(())
}

/// The cargo-fuzz the fuzz targets are run with (builds on stable).
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Installs cargo-fuzz once; idempotent.
pub fn cargo_fuzz() -> Result<()> {
    if cmd::output(Command::new("cargo").args(["fuzz", "--version"]))
        .is_ok_and(|v| v.contains(CARGO_FUZZ_VERSION))
    {
        println!("setup: cargo-fuzz {CARGO_FUZZ_VERSION}: already present");
        return Ok(());
    }
    cmd::run(standalone_cargo().args([
        "install",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
        "--locked",
    ]))?;
    println!("setup: cargo-fuzz {CARGO_FUZZ_VERSION}: installed");
    Ok(())
}

fn bpf_linker_version() -> Result<String> {
    cmd::output(Command::new("bpf-linker").arg("--version"))
}

fn install_bpf_linker(llvm: &RustcLlvm, prefix: &Path) -> Result<()> {
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let libllvm = llvm.libllvm()?;
    let name = libllvm.file_name().with_context(|| format!("{} has no file name", libllvm.display()))?;
    fs::copy(&libllvm, lib.join(name))
        .with_context(|| format!("copying {} to {}", libllvm.display(), lib.display()))?;
    let link = lib.join("libLLVM.so");
    if link.symlink_metadata().is_ok() {
        fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
    }
    symlink(name, &link).with_context(|| format!("linking {}", link.display()))?;

    let mut install = standalone_cargo();
    install
        .env("LLVM_PREFIX", prefix)
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--locked", "--force"])
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{}", llvm.major));
    cmd::run(&mut install).context("building bpf-linker against rustc's LLVM")
}

/// `cargo` for a build outside the root workspace (agent-ebpf, `cargo install bpf-linker`):
/// isolated from the outer cargo, and also from the build settings the user or the outer
/// build set (target dir and triple, flags, wrappers, toolchain), which belong to the root
/// workspace and would redirect or break this one.
pub fn standalone_cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cargo_env::isolate_cargo_env(&mut cmd);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(redirects_a_standalone_build) {
            cmd.env_remove(name);
        }
    }
    cmd
}

fn redirects_a_standalone_build(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "CARGO_MAKEFLAGS",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_BOOTSTRAP",
        "RUSTDOC",
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "RUSTUP_TOOLCHAIN",
        "RUSTUP_TOOLCHAIN_SOURCE",
    ];
    const PREFIXES: &[&str] = &[
        "CARGO_BUILD_",
        "CARGO_TARGET_",
        "CARGO_PROFILE_",
        "CARGO_ENCODED_",
        "CARGO_CFG_",
        "CARGO_FEATURE_",
    ];
    EXACT.contains(&name) || PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

fn marker_text(llvm_major: u32) -> String {
    format!("bpf-linker {BPF_LINKER_VERSION} llvm-{llvm_major}\n")
}

/// The LLVM inside the toolchain that builds the eBPF crate.
#[derive(Debug)]
struct RustcLlvm {
    sysroot: PathBuf,
    major: u32,
}

impl RustcLlvm {
    fn probe() -> Result<Self> {
        let rustc = |arg: &str| cmd::output(Command::new("rustc").arg(format!("+{TOOLCHAIN}")).arg(arg));
        let version = rustc("-vV")?;
        let major = parse_llvm_major(&version)
            .with_context(|| format!("no `LLVM version: N` line in `rustc -vV` output:\n{version}"))?;
        let sysroot = PathBuf::from(rustc("--print=sysroot")?.trim());
        Ok(Self { sysroot, major })
    }

    /// Where rustc's libLLVM is copied for bpf-linker to build and run against.
    fn prefix(&self) -> Result<PathBuf> {
        let home = std::env::var_os("HOME").context("HOME is not set")?;
        Ok(PathBuf::from(home).join(".local/share/bpf-llvm").join(self.major.to_string()))
    }

    fn libllvm(&self) -> Result<PathBuf> {
        let lib = self.sysroot.join("lib");
        let mut found: Vec<PathBuf> = fs::read_dir(&lib)
            .with_context(|| format!("reading {}", lib.display()))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| {
                path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("libLLVM.so."))
            })
            .collect();
        found.sort();
        match found.as_slice() {
            [one] => Ok(one.clone()),
            [] => bail!("no libLLVM.so.* in {}: the {TOOLCHAIN} toolchain looks incomplete", lib.display()),
            many => bail!("several libLLVM.so.* in {}: {many:?}", lib.display()),
        }
    }
}

fn parse_llvm_major(rustc_vv: &str) -> Option<u32> {
    rustc_vv
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version: "))
        .and_then(|version| version.split('.').next())
        .and_then(|major| major.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_packages_are_those_not_installed_or_unknown() {
        let dpkg = "pkg-config install ok installed\n\
                    python3 deinstall ok config-files\n\
                    iproute2 install ok installed\n";
        assert_eq!(
            missing_packages(dpkg, &["pkg-config", "python3", "iproute2", "nftables"]),
            ["python3", "nftables"]
        );
        assert!(missing_packages(dpkg, &["pkg-config", "iproute2"]).is_empty());
    }

    #[test]
    fn component_list_matches_whole_names() {
        let list = "cargo-x86_64-unknown-linux-gnu\nrust-src\nrust-std-x86_64-unknown-linux-gnu\n";
        assert!(has_component(list, "rust-src"));
        assert!(has_component(list, "rust-std"));
        assert!(!has_component("rust-src-extra-thing\n", "rust-sr"));
        assert!(!has_component("cargo-x86_64-unknown-linux-gnu\n", "rust-src"));
    }

    #[test]
    fn llvm_major_comes_from_rustc_vv() {
        let vv = "rustc 1.95.0 (59807616e 2026-04-14)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\n\
                  release: 1.95.0\nLLVM version: 22.1.2\n";
        assert_eq!(parse_llvm_major(vv), Some(22));
        assert_eq!(parse_llvm_major("rustc 1.95.0\n"), None);
    }

    #[test]
    fn standalone_builds_drop_the_root_workspaces_build_settings() {
        for name in ["CARGO_TARGET_DIR", "CARGO_BUILD_TARGET", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS"] {
            assert!(redirects_a_standalone_build(name), "{name}");
        }
        for name in ["RUSTC_WRAPPER", "RUSTUP_TOOLCHAIN", "CARGO_PROFILE_RELEASE_LTO", "CARGO_MAKEFLAGS"] {
            assert!(redirects_a_standalone_build(name), "{name}");
        }
        for name in ["CARGO_HOME", "RUSTUP_HOME", "CARGO_NET_OFFLINE", "PATH", "HOME"] {
            assert!(!redirects_a_standalone_build(name), "{name}");
        }
    }

    #[test]
    fn marker_records_version_and_llvm_major() {
        assert_eq!(marker_text(22), "bpf-linker 0.13.0 llvm-22\n");
    }
}
