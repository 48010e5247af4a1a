//! The previous release (issue 32, item 5): the commit pinned in
//! `tests/fixtures/previous-release`, built from this clone's own history into
//! `target/previous/<commit>/`: `innerwall-agent` (its eBPF object embedded) and its Debian
//! package, versioned `<version>~prev.<commit>` so the current package upgrades it, and its
//! control plane's `innerwall`. The version-skew tests run that agent against the working tree's
//! control plane, upgrade it with dpkg, and run that `innerwall serve` against a database the
//! working tree's `innerwall migrate` migrates (tests/e2e/skew.rs).
//!
//! Cheap on purpose (CI builds from a clean clone on 2 cores):
//! - the sources come out of `git archive` (nothing in the repository changes);
//! - they build in the workspace's own target directory, so every registry dependency the
//!   current agent already built is reused; the previous tree's `[workspace.package] version`
//!   becomes `<version>-prev-<commit>`, so its own crates hash apart from the current ones (and
//!   from another pin's) and never share or overwrite their artifacts (the two files cargo
//!   would overwrite, `target/debug/innerwall-agent` and `target/debug/innerwall`, are put back
//!   afterwards);
//! - both binaries come out of one cargo invocation, so `innerwall-wire` and every dependency
//!   the two share are built once;
//! - when its `agent-ebpf/` and `agent-ebpf-common/` are byte for byte the working tree's, the
//!   eBPF object just built for the current agent is embedded instead of building another;
//! - the result is kept by commit (`built` in its directory): a second run builds nothing.
//!
//! The package is staged by this xtask from the previous tree's own unit, configuration file
//! and maintainer scripts: an upgrade runs that release's prerm and postrm, as it would in the
//! field.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use super::{AGENT, Profile, stage_and_build, workspace_version};
use crate::{cmd, ebpf};

/// The file naming the previous release's commit.
pub const FIXTURE: &str = "tests/fixtures/previous-release";
/// Where each pinned commit's build goes (`<commit>/`).
pub const DIR: &str = "target/previous";
/// Written last into a commit's directory: its presence means the build there is whole.
const STAMP: &str = "built";
/// How this module builds: part of the stamp, so a change here (bump it) builds again.
const RECIPE: &str = "recipe 3";
/// The crate directories the eBPF object is built from.
const EBPF_SOURCES: &[&str] = &["agent-ebpf", "agent-ebpf-common"];

/// Builds (or finds already built) the previous release's agent, package and `innerwall`;
/// returns the package's path.
pub fn build(root: &Path, current_object: &Path) -> Result<PathBuf> {
    let started = Instant::now();
    let commit = pinned(root)?;
    let out = root.join(DIR).join(&commit);
    if let Some(deb) = cached(&out, &commit)? {
        println!("previous: {commit} already built: {}", deb.display());
        return Ok(deb);
    }
    ensure_in_clone(root, &commit, "the version-skew tests build it from history")?;
    forget_other_commits(root, &commit)?;
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    let src = out.join("src");
    extract(root, &commit, &src)?;

    let current = workspace_version(root)?;
    let version = workspace_version(&src)?;
    // The commit in both versions: each pinned commit's crates hash apart in the shared
    // target directory (git archive dates files at the commit, so without it a new pin's
    // older-dated sources could pass for fresh against an earlier pin's artifacts).
    let short = &commit[..12];
    let deb_version = format!("{version}~prev.{short}");
    let older = Command::new("dpkg")
        .args(["--compare-versions", &deb_version, "lt", &current])
        .status()
        .context("running dpkg --compare-versions")?;
    ensure!(
        older.success(),
        "the previous release {commit} would be package version {deb_version}, not below the current {current}"
    );
    set_workspace_version(&src, &format!("{version}-prev-{short}"))?;

    let (object, how) = if same_tree(root, &src, EBPF_SOURCES)? {
        (current_object.to_owned(), "the current eBPF object (its sources are the same)")
    } else {
        (ebpf::build(&src)?, "its own eBPF object")
    };
    let binary = build_binaries(root, &src, &object, &out)?;
    let deb = stage_and_build(&src, &AGENT, &binary, &deb_version, &out)?;
    fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    fs::write(out.join(STAMP), format!("{commit} {RECIPE}\n{}\n", deb.display()))
        .with_context(|| format!("writing {}", out.join(STAMP).display()))?;
    println!(
        "previous: built {commit}'s agent with {how}, its innerwall and {} in {:.0} s",
        deb.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(deb)
}

/// The commit `tests/fixtures/previous-release` names: one full hash, `#` lines ignored.
pub fn pinned(root: &Path) -> Result<String> {
    let path = root.join(FIXTURE);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
    let (Some(commit), None) = (lines.next(), lines.next()) else {
        bail!("{} must hold exactly one commit hash (besides # comments)", path.display());
    };
    ensure!(
        commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}: {commit:?} is not a full (40 hex digit) commit hash",
        path.display()
    );
    Ok(commit.to_ascii_lowercase())
}

/// The package in `out` if a whole build of `commit` is there.
fn cached(out: &Path, commit: &str) -> Result<Option<PathBuf>> {
    let Ok(stamp) = fs::read_to_string(out.join(STAMP)) else { return Ok(None) };
    let mut lines = stamp.lines();
    if lines.next() != Some(&format!("{commit} {RECIPE}")) {
        return Ok(None);
    }
    let deb = lines.next().map(PathBuf::from);
    Ok(deb.filter(|deb| deb.is_file() && BINARIES.iter().all(|(_, bin)| out.join(bin).is_file())))
}

/// Fails unless `commit` is in this clone's history, naming `why` it is needed and the fix.
pub(crate) fn ensure_in_clone(root: &Path, commit: &str, why: &str) -> Result<()> {
    let found = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["cat-file", "-e", &format!("{commit}^{{commit}}")])
        .stderr(Stdio::null())
        .status()
        .context("running git (the previous release is built from this clone's history)")?;
    ensure!(
        found.success(),
        "the previous release {commit} ({FIXTURE}) is not in this clone: {why}. Fetch it (`git \
         fetch origin {commit}`, or `git fetch --unshallow` in a shallow clone) and run again"
    );
    Ok(())
}

/// Builds of other commits (an earlier pin) are removed: one previous release at a time.
fn forget_other_commits(root: &Path, commit: &str) -> Result<()> {
    let dir = root.join(DIR);
    let Ok(entries) = fs::read_dir(&dir) else { return Ok(()) };
    for entry in entries {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n != commit) && path.is_dir() {
            fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// `git archive <commit> | tar -x -C <src>`.
fn extract(root: &Path, commit: &str, src: &Path) -> Result<()> {
    fs::create_dir_all(src).with_context(|| format!("creating {}", src.display()))?;
    let mut git = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(src)
        .stdin(git.stdout.take().context("git archive's stdout")?)
        .status()
        .context("running tar")?;
    let archived = git.wait().context("waiting for git archive")?;
    ensure!(archived.success() && tar.success(), "git archive {commit} | tar -x failed ({archived}, {tar})");
    Ok(())
}

/// Sets `[workspace.package] version` in `<src>/Cargo.toml`.
fn set_workspace_version(src: &Path, version: &str) -> Result<()> {
    let path = src.join("Cargo.toml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (mut section, mut replaced) = (String::new(), 0);
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            let trimmed = line.trim();
            if trimmed.starts_with('[') {
                section = trimmed.to_owned();
            } else if section == "[workspace.package]"
                && trimmed.split('=').next().is_some_and(|key| key.trim() == "version")
            {
                replaced += 1;
                return format!("version = \"{version}\"");
            }
            line.to_owned()
        })
        .collect();
    ensure!(replaced == 1, "{} has no single [workspace.package] version line", path.display());
    fs::write(&path, lines.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))
}

/// Whether every directory in `dirs` holds the same files with the same bytes under `a` and
/// `b` (build output, `target/`, left out).
fn same_tree(a: &Path, b: &Path, dirs: &[&str]) -> Result<bool> {
    for dir in dirs {
        let (left, right) = (files(&a.join(dir))?, files(&b.join(dir))?);
        if left.keys().ne(right.keys()) {
            return Ok(false);
        }
        for (relative, path) in &left {
            if fs::read(path)? != fs::read(&right[relative])? {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// The files under `dir` (not under a `target` directory) by their path relative to it.
fn files(dir: &Path) -> Result<std::collections::BTreeMap<PathBuf, PathBuf>> {
    let mut found = std::collections::BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        let Ok(entries) = fs::read_dir(&next) else { continue };
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                if path.file_name().is_none_or(|n| n != "target") {
                    pending.push(path);
                }
            } else {
                found.insert(path.strip_prefix(dir)?.to_path_buf(), path);
            }
        }
    }
    Ok(found)
}

/// The previous release's binaries: (package, binary).
const BINARIES: &[(&str, &str)] =
    &[("innerwall-agent", "innerwall-agent"), ("innerwall-control-plane", "innerwall")];

/// Builds the previous agent and `innerwall` in the workspace's target directory, in one cargo
/// invocation, and copies them to `<out>/`; the current `target/debug/innerwall-agent` and
/// `target/debug/innerwall` are put back (as the same files: hard links, so their times are
/// kept and cargo sees them fresh). Returns the agent's path.
fn build_binaries(root: &Path, src: &Path, object: &Path, out: &Path) -> Result<PathBuf> {
    let dir = root.join("target").join(Profile::Dev.dir());
    let mut kept = Vec::new();
    for (_, bin) in BINARIES {
        let (uplifted, keep) = (dir.join(bin), dir.join(format!(".{bin}.current")));
        let _ = fs::remove_file(&keep);
        if fs::hard_link(&uplifted, &keep).is_ok() {
            kept.push((keep, uplifted));
        }
    }
    let mut cargo = cmd::root_cargo(src);
    cargo.arg("build");
    for (package, bin) in BINARIES {
        cargo.args(["-p", package, "--bin", bin]);
    }
    let built = cmd::run(
        cargo
            .args(["--features", "innerwall-agent/embedded-ebpf"])
            .env("CARGO_TARGET_DIR", root.join("target"))
            // Built once per pinned commit and never edited: incremental state would only take
            // disk (and time to write it).
            .env("CARGO_INCREMENTAL", "0")
            .env("INNERWALL_EBPF_EMBED", object),
    );
    let copied = built.and_then(|()| {
        BINARIES.iter().try_for_each(|(_, bin)| {
            let (from, to) = (dir.join(bin), out.join(bin));
            fs::copy(&from, &to)
                .map(drop)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))
        })
    });
    for (keep, uplifted) in kept {
        fs::rename(&keep, &uplifted).with_context(|| format!("putting back {}", uplifted.display()))?;
    }
    copied?;
    Ok(out.join("innerwall-agent"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_version_alone_changes() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = "[workspace]\nmembers = []\n\n[workspace.package]\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace.dependencies]\nfoo = { version = \"1\" }\n";
        fs::write(dir.path().join("Cargo.toml"), manifest).unwrap();
        set_workspace_version(dir.path(), "0.1.0-prev").unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join("Cargo.toml")).unwrap(),
            manifest.replace("version = \"0.1.0\"", "version = \"0.1.0-prev\"")
        );
    }

    #[test]
    fn the_pin_is_one_full_hash() {
        let dir = tempfile::tempdir().unwrap();
        let write = |text: &str| {
            fs::create_dir_all(dir.path().join("tests/fixtures")).unwrap();
            fs::write(dir.path().join(FIXTURE), text).unwrap();
        };
        let hash = "F4F5EAA1568FA8AF5D587891879C3351C4FA7145";
        write(&format!("# the previous release\n\n{hash}\n"));
        assert_eq!(pinned(dir.path()).unwrap(), hash.to_ascii_lowercase());
        write("f4f5eaa\n");
        assert!(format!("{:#}", pinned(dir.path()).unwrap_err()).contains("not a full"));
        write(&format!("{hash}\n{hash}\n"));
        assert!(format!("{:#}", pinned(dir.path()).unwrap_err()).contains("exactly one"));
    }

    #[test]
    fn a_missing_commit_is_named_with_the_fix() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let err = ensure_in_clone(root, &"0".repeat(40), "the version-skew tests build it").unwrap_err();
        assert!(format!("{err:#}").contains("is not in this clone"), "{err:#}");
        assert!(format!("{err:#}").contains("git fetch"), "{err:#}");
    }
}
