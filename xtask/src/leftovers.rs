//! What tests and benchmarks create under the temp directory and `/dev/shm`, known by its name's
//! prefix: a run of either must leave none of it behind, and `cargo xtask test` and
//! `cargo xtask bench` check that it did not.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// The prefixes of every directory and file the project's tests, benchmarks and their test
/// clusters (`innerwall-pgtest-*`) create there.
const PREFIXES: &[&str] = &["iw-", "innerwall-", "config-test-"];

/// Every entry of the temp directory and `/dev/shm` whose name has one of [`PREFIXES`].
pub fn scan() -> BTreeSet<PathBuf> {
    [std::env::temp_dir(), PathBuf::from("/dev/shm")]
        .iter()
        .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten().flatten())
        .map(|entry| entry.path())
        .filter(|p| ours(p))
        .collect()
}

fn ours(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| PREFIXES.iter().any(|p| n.starts_with(p)))
}

/// What [`scan`] finds now that it did not find `before`.
fn new_since(before: &BTreeSet<PathBuf>) -> Vec<PathBuf> {
    scan().difference(before).cloned().collect()
}

/// Fails naming every entry [`scan`] finds now that it did not find `before`: what `what` left
/// behind.
pub fn check(before: &BTreeSet<PathBuf>, what: &str) -> Result<()> {
    let left: Vec<String> = new_since(before).iter().map(|p| p.display().to_string()).collect();
    if !left.is_empty() {
        bail!(
            "{what} left {} behind: {}; every test and benchmark removes what it created, also when \
             it ends early (a Drop of its own; the test harness removes its private server at exit)",
            match left.len() {
                1 => "this".to_owned(),
                n => format!("these {n}"),
            },
            left.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Other tests of this crate may create entries meanwhile, so it asserts on its own entries
    /// only.
    #[test]
    fn new_entries_are_named() {
        let tmp = std::env::temp_dir();
        let pid = std::process::id();
        let own = tmp.join(format!("iw-leftover-{pid}"));
        std::fs::create_dir_all(&own).unwrap();
        let before = scan();
        let new = tmp.join(format!("iw-leftover-new-{pid}"));
        std::fs::create_dir_all(&new).unwrap();
        let left = new_since(&before);
        assert!(left.contains(&new) && !left.contains(&own), "{left:?}");
        let error = check(&before, "this test").unwrap_err().to_string();
        assert!(error.contains(&new.display().to_string()), "{error}");
        assert!(!ours(Path::new("/tmp/cargo-install-x")) && ours(Path::new("/dev/shm/iw-loadgen-1")));
        for dir in [&own, &new] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
