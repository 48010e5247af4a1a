//! `cargo xtask package`: the two Debian packages (RUN-4, issue 32), staged by hand and built
//! with `dpkg-deb` (always present where a .deb installs; no cargo-deb to install):
//!
//! - `innerwall`: `/usr/bin/innerwall`, its unit, `/etc/innerwall/innerwall.toml` (a conffile,
//!   group `innerwall`, mode 0640: it may hold the database URL's password), the `innerwall`
//!   system user and `/var/lib/innerwall` (0700) made by postinst. Enabled, not started: the
//!   CA comes first (`innerwall ca init`).
//! - `innerwall-agent`: `/usr/bin/innerwall-agent` with the eBPF object embedded (the
//!   `embedded-ebpf` feature: no object path is trusted at run time), its unit,
//!   `/etc/innerwall/agent.toml` (a conffile). Enabled, not started (it needs enrollment); an
//!   upgrade restarts a running agent, whose persisted policy keeps the table in place; purge
//!   removes its state and `table inet innerwall`, and nothing else removes the table.
//!
//! The maintainer scripts call systemctl only where systemd runs (`/run/systemd/system`); they
//! are read from the tree being packaged. [`previous`] builds the previous release's agent
//! package (the commit tests/fixtures/previous-release pins) for the version-skew tests.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::{cmd, ebpf};

pub mod previous;

/// Where `cargo xtask test` puts the packages its tests install.
pub const TEST_PACKAGES: &str = "target/packages";

/// The cargo profile the binaries are built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Release,
    /// The test build's (`cargo xtask test`): quick, and the same packaging.
    Dev,
}

impl Profile {
    fn dir(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Dev => "debug",
        }
    }
}

/// One package: what goes where and its maintainer scripts.
struct Package {
    name: &'static str,
    description: &'static str,
    depends: &'static str,
    binary: &'static str,
    unit: (&'static str, &'static str),
    config: (&'static str, &'static str, u32),
    /// The maintainer scripts, `<this>.postinst`, `.prerm` and `.postrm`, read from the tree
    /// being packaged (so a previous release's package carries that release's scripts).
    scripts: &'static str,
}

const CONTROL_PLANE: Package = Package {
    name: "innerwall",
    description: "Innerwall control plane and operator CLI\n \
        Renders label-based policy for each workload and pushes it to the agents;\n \
        the operator CLI, HTTP API and web console.",
    depends: "libc6, libgcc-s1, adduser",
    binary: "innerwall",
    unit: ("control-plane/systemd/innerwall.service", "innerwall.service"),
    config: ("control-plane/systemd/innerwall.toml", "innerwall.toml", 0o640),
    scripts: "xtask/src/package/innerwall",
};

const AGENT: Package = Package {
    name: "innerwall-agent",
    description: "Innerwall host agent\n \
        Enforces this host's policy in nftables table inet innerwall and captures\n \
        inbound flows with an eBPF program built into the binary.",
    depends: "libc6, libgcc-s1, libnftnl11 (>= 1.2.4), libmnl0, nftables",
    binary: "innerwall-agent",
    unit: ("agent/systemd/innerwall-agent.service", "innerwall-agent.service"),
    config: ("agent/systemd/agent.toml", "agent.toml", 0o644),
    scripts: "xtask/src/package/innerwall-agent",
};

/// Builds both packages into `out` and returns their paths.
pub fn build(root: &Path, profile: Profile, out: &Path) -> Result<Vec<PathBuf>> {
    let object = ebpf::build(root)?;
    let mut cargo = cmd::root_cargo(root);
    cargo.args(["build", "-p", "innerwall-control-plane", "--bin", "innerwall"]);
    if profile == Profile::Release {
        cargo.arg("--release");
    }
    cmd::run(&mut cargo)?;
    let mut cargo = cmd::root_cargo(root);
    cargo
        .args(["build", "-p", "innerwall-agent", "--bin", "innerwall-agent", "--features", "embedded-ebpf"])
        .env("INNERWALL_EBPF_EMBED", &object);
    if profile == Profile::Release {
        cargo.arg("--release");
    }
    cmd::run(&mut cargo)?;
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let version = workspace_version(root)?;
    let arch = architecture()?;
    let built = root.join("target").join(profile.dir());
    let mut debs = Vec::new();
    // Staged and built one after the other: the agent's binary is copied before anything
    // rebuilds it without the feature.
    for package in [&CONTROL_PLANE, &AGENT] {
        let stage = root.join("target/package-stage").join(package.name);
        if stage.exists() {
            fs::remove_dir_all(&stage).with_context(|| format!("clearing {}", stage.display()))?;
        }
        stage_package(root, package, &built.join(package.binary), &stage, &version, &arch)?;
        let deb = out.join(format!("{}_{version}_{arch}.deb", package.name));
        dpkg_deb(&stage, &deb)?;
        debs.push(deb);
    }
    for deb in &debs {
        println!("package: {}", deb.display());
    }
    Ok(debs)
}

/// `dpkg-deb --build` of a staged tree.
fn dpkg_deb(stage: &Path, deb: &Path) -> Result<()> {
    cmd::run(
        std::process::Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(stage)
            .arg(deb),
    )
}

/// This machine's Debian architecture.
fn architecture() -> Result<String> {
    Ok(cmd::output(std::process::Command::new("dpkg").arg("--print-architecture"))?.trim().to_owned())
}

/// Stages `package` from the tree at `root` (its unit, configuration file and maintainer
/// scripts) with `binary`, and builds `<out>/<name>_<version>_<arch>.deb`.
fn stage_and_build(
    root: &Path,
    package: &Package,
    binary: &Path,
    version: &str,
    out: &Path,
) -> Result<PathBuf> {
    let arch = architecture()?;
    let stage = out.join("stage");
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("clearing {}", stage.display()))?;
    }
    stage_package(root, package, binary, &stage, version, &arch)?;
    let deb = out.join(format!("{}_{version}_{arch}.deb", package.name));
    dpkg_deb(&stage, &deb)?;
    fs::remove_dir_all(&stage).with_context(|| format!("clearing {}", stage.display()))?;
    Ok(deb)
}

fn stage_package(
    root: &Path,
    package: &Package,
    binary: &Path,
    stage: &Path,
    version: &str,
    arch: &str,
) -> Result<()> {
    let put = |path: &str, bytes: &[u8], mode: u32| -> Result<()> {
        let target = stage.join(path);
        fs::create_dir_all(target.parent().context("a staged file has a parent")?)?;
        fs::write(&target, bytes).with_context(|| format!("writing {}", target.display()))?;
        fs::set_permissions(&target, fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting the mode of {}", target.display()))
    };
    let read = |path: &Path| fs::read(path).with_context(|| format!("reading {}", path.display()));
    put(&format!("usr/bin/{}", package.binary), &read(binary)?, 0o755)?;
    put(&format!("lib/systemd/system/{}", package.unit.1), &read(&root.join(package.unit.0))?, 0o644)?;
    let (config_source, config_name, config_mode) = package.config;
    put(&format!("etc/innerwall/{config_name}"), &read(&root.join(config_source))?, config_mode)?;
    put(
        &format!("usr/share/doc/{}/copyright", package.name),
        b"Innerwall. Licensed under the Apache License, Version 2.0;\nsee /usr/share/common-licenses/Apache-2.0.\n",
        0o644,
    )?;
    let size_kib = dir_size(stage)?.div_ceil(1024);
    let control = format!(
        "Package: {}\nVersion: {version}\nArchitecture: {arch}\nMaintainer: Innerwall <innerwall@localhost>\n\
         Installed-Size: {size_kib}\nDepends: {}\nSection: net\nPriority: optional\nDescription: {}\n",
        package.name, package.depends, package.description
    );
    put("DEBIAN/control", control.as_bytes(), 0o644)?;
    put("DEBIAN/conffiles", format!("/etc/innerwall/{config_name}\n").as_bytes(), 0o644)?;
    for script in ["postinst", "prerm", "postrm"] {
        put(&format!("DEBIAN/{script}"), &read(&root.join(format!("{}.{script}", package.scripts)))?, 0o755)?;
    }
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { dir_size(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}

/// `[workspace.package] version` of the root manifest.
fn workspace_version(root: &Path) -> Result<String> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?;
    let table: toml::Table = manifest.parse().context("parsing Cargo.toml")?;
    table
        .get("workspace")
        .and_then(|w| w.get("package"))
        .and_then(|p| p.get("version"))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .context("Cargo.toml has no [workspace.package] version")
}
