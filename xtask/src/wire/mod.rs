//! `cargo xtask check-wire`: the breaking-change gate of the agent contract (seed 004). The
//! `.proto` files under `wire/proto` are compiled with protoc into a descriptor set and compared
//! with the last released one, checked in at [`BASELINE`]; `--bless`, run at a release, makes
//! the current contract the released one. Agents and control planes of different releases talk
//! to each other, so what one release sent the next must still read.

mod breaking;

use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use prost::Message;
use prost_types::FileDescriptorSet;

use crate::cmd;

pub use breaking::Break;

/// The proto root of the contract, relative to the workspace root.
pub const PROTOS: &str = "wire/proto";

/// The descriptor set of the last released contract, relative to the workspace root.
pub const BASELINE: &str = "wire/contract/innerwall.agent.v1.binpb";

/// Compares the contract under `protos` with the released one; prints every breaking change
/// and fails if there is one.
pub fn check(root: &Path, protos: &Path) -> Result<()> {
    let breaks = breaking_changes(root, protos)?;
    if breaks.is_empty() {
        println!("wire: no breaking change against {BASELINE}");
        return Ok(());
    }
    for change in &breaks {
        println!("wire: {change}");
    }
    bail!(
        "{} breaking change(s) in {} against the released contract {BASELINE} (listed above): keep what \
         was released (reserve the numbers of removed fields and enum values), or put an incompatible \
         contract in a new package beside this one",
        breaks.len(),
        shown(root, protos)
    )
}

/// Every breaking change of the contract under `protos` against the released one.
pub fn breaking_changes(root: &Path, protos: &Path) -> Result<Vec<Break>> {
    let released = read_baseline(&root.join(BASELINE))?;
    let current = decode(&compile(protos)?).context("while reading protoc's descriptor set")?;
    Ok(breaking::breaking_changes(&released, &current))
}

/// Writes the contract under `protos` as the released one (done at a release, and the file
/// committed with it); any breaking change it accepts is printed first.
pub fn bless(root: &Path, protos: &Path) -> Result<()> {
    let bytes = compile(protos)?;
    let current = decode(&bytes).context("while reading protoc's descriptor set")?;
    let path = root.join(BASELINE);
    if path.exists() {
        match read_baseline(&path) {
            Ok(released) => {
                for change in breaking::breaking_changes(&released, &current) {
                    println!("wire: blessing a breaking change: {change}");
                }
            }
            Err(err) => println!("wire: replacing a baseline that could not be read: {err:#}"),
        }
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("while creating {}", dir.display()))?;
    }
    fs::write(&path, &bytes).with_context(|| format!("while writing {}", path.display()))?;
    println!(
        "wire: wrote {BASELINE} ({} files of {}) as the released contract; commit it with the release",
        current.file.len(),
        shown(root, protos)
    );
    Ok(())
}

/// `path` relative to the workspace root when it is inside it.
fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap_or(path).display().to_string()
}

fn read_baseline(path: &Path) -> Result<FileDescriptorSet> {
    if !path.exists() {
        bail!(
            "no released contract at {}: at a release, `cargo xtask check-wire --bless` records it \
             (commit the file)",
            path.display()
        );
    }
    let bytes = fs::read(path).with_context(|| format!("while reading {}", path.display()))?;
    decode(&bytes).with_context(|| {
        format!(
            "{} is not a descriptor set: restore it from git (`git checkout -- {BASELINE}`)",
            path.display()
        )
    })
}

fn decode(bytes: &[u8]) -> Result<FileDescriptorSet> {
    let set = FileDescriptorSet::decode(bytes)?;
    if set.file.is_empty() {
        bail!("the descriptor set holds no file");
    }
    Ok(set)
}

/// The descriptor set of every `.proto` file under `protos`, imports included, as protoc
/// writes it (no source info, so comments and layout do not reach the baseline).
fn compile(protos: &Path) -> Result<Vec<u8>> {
    let files = proto_files(protos)?;
    if files.is_empty() {
        bail!("no .proto file under {}", protos.display());
    }
    let out = tempfile::tempdir().context("while creating a directory for protoc's output")?;
    let set = out.path().join("current.binpb");
    let mut descriptor_set_out = OsString::from("--descriptor_set_out=");
    descriptor_set_out.push(&set);
    cmd::output(
        Command::new(protoc()?)
            .arg("--include_imports")
            .arg(descriptor_set_out)
            .arg("-I")
            .arg(protos)
            .args(&files),
    )?;
    fs::read(&set).with_context(|| format!("while reading protoc's output {}", set.display()))
}

/// `PROTOC` if set, else the vendored protoc `wire/build.rs` compiles the contract with.
fn protoc() -> Result<PathBuf> {
    match std::env::var_os("PROTOC") {
        Some(path) => Ok(PathBuf::from(path)),
        None => protoc_bin_vendored::protoc_bin_path()
            .context("no vendored protoc for this platform: install protoc and set PROTOC to it"),
    }
}

/// The `.proto` files under `root`, relative to it, sorted.
fn proto_files(root: &Path) -> Result<Vec<PathBuf>> {
    Ok(crate::walk::files_with_extension(root, "proto")?
        .into_iter()
        .map(|path| path.strip_prefix(root).unwrap_or(&path).to_path_buf())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy of the contract's protos with `edit` applied to `file`, which must change it.
    fn edited_copy(file: &str, from: &str, to: &str) -> tempfile::TempDir {
        let root = crate::workspace_root().unwrap();
        let copy = tempfile::tempdir().unwrap();
        for relative in proto_files(&root.join(PROTOS)).unwrap() {
            let target = copy.path().join(&relative);
            fs::create_dir_all(target.parent().unwrap()).unwrap();
            fs::copy(root.join(PROTOS).join(&relative), target).unwrap();
        }
        let path = copy.path().join(file);
        let text = fs::read_to_string(&path).unwrap();
        let edited = text.replace(from, to);
        assert_ne!(edited, text, "{file} no longer contains {from:?}: pick another edit for this test");
        fs::write(&path, edited).unwrap();
        copy
    }

    const TELEMETRY: &str = "innerwall/agent/v1/telemetry.proto";

    #[test]
    fn wire_check_fails_on_a_removed_field() {
        let root = crate::workspace_root().unwrap();
        let copy = edited_copy(TELEMETRY, "  string dst_address = 2;\n", "");
        let found: Vec<String> =
            breaking_changes(&root, copy.path()).unwrap().iter().map(ToString::to_string).collect();
        assert_eq!(
            found,
            ["innerwall/agent/v1/telemetry.proto: innerwall.agent.v1.FlowRecord.dst_address: \
              field 2 was removed or renamed without `reserved 2;`"]
        );
        let err = check(&root, copy.path()).unwrap_err();
        assert!(format!("{err:#}").starts_with("1 breaking change(s) in "), "{err:#}");
    }

    #[test]
    fn wire_check_accepts_a_removed_field_whose_number_is_reserved() {
        let root = crate::workspace_root().unwrap();
        let copy = edited_copy(TELEMETRY, "  string dst_address = 2;\n", "  reserved 2;\n");
        check(&root, copy.path()).unwrap();
    }

    #[test]
    fn wire_check_accepts_an_added_field() {
        let root = crate::workspace_root().unwrap();
        let copy =
            edited_copy(TELEMETRY, "  uint64 count = 4;\n", "  uint64 count = 4;\n  string note = 99;\n");
        check(&root, copy.path()).unwrap();
    }

    #[test]
    fn the_baseline_is_protocs_descriptor_set_of_the_contract() {
        let root = crate::workspace_root().unwrap();
        let released = read_baseline(&root.join(BASELINE)).unwrap();
        let names: Vec<&str> = released.file.iter().map(|file| file.name()).collect();
        assert!(names.contains(&TELEMETRY), "{names:?}");
        assert!(released.file.iter().all(|file| file.source_code_info.is_none()));
    }

    #[test]
    fn a_missing_baseline_says_how_to_record_one() {
        let empty = tempfile::tempdir().unwrap();
        let err = breaking_changes(empty.path(), &crate::workspace_root().unwrap().join(PROTOS)).unwrap_err();
        assert!(format!("{err:#}").contains("`cargo xtask check-wire --bless` records it"), "{err:#}");
    }
}
