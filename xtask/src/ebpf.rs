//! `cargo xtask build-ebpf`: builds agent-ebpf, puts the object at a known path and verifies it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};

use crate::{
    cmd,
    elf::{self, EM_BPF, Elf},
    setup::{self, TOOLCHAIN},
};

/// Where the verified object lands, relative to the root workspace (also when
/// CARGO_TARGET_DIR points elsewhere). The agent reads it at run time from
/// `<dir of its executable>/../bpf/innerwall-ebpf`, which is this file only for binaries in
/// `<root>/target`; agents built elsewhere need `INNERWALL_EBPF_OBJECT` pointing here.
pub const OBJECT_PATH: &str = "target/bpf/innerwall-ebpf";

const CRATE_DIR: &str = "agent-ebpf";
const BPF_TARGET: &str = "bpfel-unknown-none";
/// The cargo output, relative to `CRATE_DIR` (always a release build).
const BUILT_OBJECT: &str = "target/bpfel-unknown-none/release/innerwall-ebpf";
/// Full debug info is what bpf-linker turns into BTF; the agent needs BTF for BTF maps.
const RUSTFLAGS: &str = "-C debuginfo=2 -C link-arg=--btf";

/// Sections a usable object must have, with what their absence means.
const REQUIRED_SECTIONS: &[(&str, &str)] = &[
    (".BTF", "no BTF: bpf-linker must get `-C link-arg=--btf` and debug info"),
    ("classifier", "no tc program: `#[classifier] fn innerwall_ingress` is missing"),
];

pub fn build(root: &Path) -> Result<PathBuf> {
    setup::bpf_toolchain()?;
    cmd::run(&mut bpf_cargo(root, "build")).context("building agent-ebpf for the BPF target")?;
    let object = copy_object(root)?;
    verify_object(&object)?;
    kernel_load_check(&object)?;
    Ok(object)
}

/// `cargo +stable <subcommand>` for the BPF target inside agent-ebpf, with the nightly
/// switch and flags set only for this child.
pub fn bpf_cargo(root: &Path, subcommand: &str) -> Command {
    let mut cmd = crate_cargo(root);
    cmd.env("RUSTC_BOOTSTRAP", "1")
        .env("RUSTFLAGS", RUSTFLAGS)
        .arg(format!("+{TOOLCHAIN}"))
        .arg(subcommand)
        .args(["-Z", "build-std=core", "--target", BPF_TARGET, "--release"]);
    cmd
}

/// Plain `cargo` inside agent-ebpf (e.g. for rustfmt), isolated from the outer cargo.
pub fn crate_cargo(root: &Path) -> Command {
    let mut cmd = setup::standalone_cargo();
    cmd.current_dir(root.join(CRATE_DIR));
    cmd
}

fn copy_object(root: &Path) -> Result<PathBuf> {
    let built = root.join(CRATE_DIR).join(BUILT_OBJECT);
    let object = root.join(OBJECT_PATH);
    let dir = object.parent().context("object path has no parent")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::copy(&built, &object)
        .with_context(|| format!("copying {} to {}", built.display(), object.display()))?;
    Ok(object)
}

fn verify_object(object: &Path) -> Result<()> {
    let bytes = fs::read(object).with_context(|| format!("reading {}", object.display()))?;
    let elf = elf::parse(&bytes)
        .and_then(|elf| check_bpf_object(&elf).map(|()| elf))
        .with_context(|| format!("{} is not a usable eBPF object", object.display()))?;
    println!(
        "build-ebpf: {} ({} bytes): ELF64 little-endian, e_machine {EM_BPF} (EM_BPF)",
        object.display(),
        bytes.len()
    );
    println!("build-ebpf: sections: {}", elf.sections.join(" "));
    Ok(())
}

fn check_bpf_object(elf: &Elf) -> Result<()> {
    ensure!(
        elf.machine == EM_BPF,
        "e_machine is {}, expected {EM_BPF} (EM_BPF): was it built for {BPF_TARGET}?",
        elf.machine
    );
    let missing: Vec<String> = REQUIRED_SECTIONS
        .iter()
        .filter(|(name, _)| !elf.sections.iter().any(|section| section == name))
        .map(|(name, why)| format!("`{name}` ({why})"))
        .collect();
    if !missing.is_empty() {
        bail!("missing section {}", missing.join(", "));
    }
    Ok(())
}

/// Loads every program of the object into the running kernel (with aya, as the agent does),
/// so the verifier judges it now rather than when an agent first starts; dropping the handle
/// unloads it again. Needs root; skipped without it, except in CI.
fn kernel_load_check(object: &Path) -> Result<()> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    if effective_uid(&status) != Some(0) {
        ensure!(
            std::env::var_os("CI").is_none_or(|ci| ci != "true"),
            "the kernel-load check needs root and CI=true requires it: run CI as root"
        );
        println!("build-ebpf: kernel load check: skipped (needs root)");
        return Ok(());
    }
    let mut ebpf = aya::Ebpf::load_file(object)
        .with_context(|| format!("the kernel refused the maps or BTF of {}", object.display()))?;
    let mut accepted = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let classifier: &mut aya::programs::SchedClassifier =
            program.try_into().with_context(|| format!("program {name} is not a tc classifier"))?;
        classifier.load().with_context(|| format!("the kernel verifier rejected program {name}"))?;
        accepted.push(name.to_owned());
    }
    ensure!(!accepted.is_empty(), "{} holds no programs", object.display());
    accepted.sort();
    println!(
        "build-ebpf: kernel load check: the verifier accepted {} (loaded and unloaded)",
        accepted.join(", ")
    );
    Ok(())
}

/// The effective uid from `/proc/self/status` (`Uid: real effective saved fs`).
fn effective_uid(proc_status: &str) -> Option<u32> {
    proc_status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .and_then(|uid| uid.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elf::tests::tiny_elf;

    fn check(machine: u16, sections: &[&str]) -> Result<(), String> {
        let elf = elf::parse(&tiny_elf(machine, sections)).unwrap();
        check_bpf_object(&elf).map_err(|err| format!("{err:#}"))
    }

    #[test]
    fn accepts_a_bpf_object_with_btf_and_classifier() {
        assert_eq!(check(EM_BPF, &[".text", "classifier", ".maps", ".BTF", ".BTF.ext"]), Ok(()));
    }

    #[test]
    fn names_what_is_wrong() {
        assert_eq!(
            check(62, &["classifier", ".BTF"]),
            Err("e_machine is 62, expected 247 (EM_BPF): was it built for bpfel-unknown-none?".into())
        );
        assert_eq!(
            check(EM_BPF, &["classifier"]),
            Err("missing section `.BTF` (no BTF: bpf-linker must get `-C link-arg=--btf` and debug info)"
                .into())
        );
        assert_eq!(
            check(EM_BPF, &[".text"]),
            Err("missing section `.BTF` (no BTF: bpf-linker must get `-C link-arg=--btf` and debug info), \
                 `classifier` (no tc program: `#[classifier] fn innerwall_ingress` is missing)"
                .into())
        );
    }

    #[test]
    fn effective_uid_is_the_second_uid_field() {
        assert_eq!(effective_uid("Name:\tx\nUid:\t1000\t0\t0\t0\nGid:\t0\n"), Some(0));
        assert_eq!(effective_uid("Uid:\t0\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(effective_uid("Name:\tx\n"), None);
    }
}
