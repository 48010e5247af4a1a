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

/// Removes the private test servers (`innerwall-pgtest-<pid>-*`) of test processes that have
/// ended, server included: each test process keeps its one server for its whole life and the
/// next one's start removes it (`postgres::TestCluster`), so after the last test process the
/// suite does. Returns how many it removed.
pub fn sweep_test_clusters() -> usize {
    let alive = |pid: &str| Path::new("/proc").join(pid.trim()).exists();
    let mut removed = 0;
    for dir in scan() {
        let Some(name) = dir.file_name().and_then(|n| n.to_str()) else { continue };
        let Some((owner, _)) = name.strip_prefix("innerwall-pgtest-").and_then(|rest| rest.split_once('-'))
        else {
            continue;
        };
        let postmaster = std::fs::read_to_string(dir.join("data/postmaster.pid")).unwrap_or_default();
        if alive(owner) || postmaster.lines().next().is_some_and(|pid| !pid.trim().is_empty() && alive(pid)) {
            continue;
        }
        if std::fs::remove_dir_all(&dir).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Fails naming every entry [`scan`] finds now that it did not find `before`: what `what` left
/// behind.
pub fn check(before: &BTreeSet<PathBuf>, what: &str) -> Result<()> {
    let left: Vec<String> = new_since(before).iter().map(|p| p.display().to_string()).collect();
    if !left.is_empty() {
        bail!(
            "{what} left {} behind: {}; every test and benchmark removes what it created, also when \
             it ends early (a Drop of its own, `testing::release` for test clusters)",
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

    /// One test, as the two parts would see each other's directories if run in parallel; other
    /// tests of this crate may create entries meanwhile, so it asserts on its own entries only.
    #[test]
    fn new_entries_are_named_and_ended_servers_swept() {
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

        // No process has a pid above pid_max (at most 2^22).
        let ended = tmp.join(format!("innerwall-pgtest-999999999-{pid}"));
        let running = tmp.join(format!("innerwall-pgtest-{pid}-sweep"));
        for dir in [&ended, &running] {
            std::fs::create_dir_all(dir.join("data")).unwrap();
        }
        assert!(sweep_test_clusters() >= 1);
        assert!(!ended.exists(), "its owner has ended and it has no server");
        assert!(running.exists(), "its owner is this process");
        for dir in [&own, &new, &running] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
