//! The persisted policy (ENF-4): the canonical bytes of the last policy the agent was told to
//! apply, written durably (temp file, fsync, rename, fsync directory) under a header with a
//! SHA-256 checksum, so a corrupt or truncated file is detected and never half-applied.
//!
//! Layout of `<state-dir>/policy.bin`:
//! `magic (16 bytes) | format version (u32 BE) | body length (u64 BE) | sha256(body) | body`
//! where body is `WorkloadPolicy::canonical_bytes()`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use innerwall_wire::policy::{PolicyError, WorkloadPolicy};
use sha2::{Digest as _, Sha256};

pub const MAGIC: &[u8; 16] = b"innerwall-policy";
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 16 + 4 + 8 + 32;
pub const FILE_NAME: &str = "policy.bin";

/// Why the persisted policy could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "persisted policy {path} is corrupt ({reason}); it was not applied. Remove it to start \
         without a persisted policy, or let the control plane send a fresh snapshot"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error("persisted policy {path} passed its checksum but does not decode: {source}")]
    Decode {
        path: PathBuf,
        #[source]
        source: PolicyError,
    },
}

/// The persisted policy of one state directory (`<state-dir>/policy.bin`).
#[derive(Debug, Clone)]
pub struct PersistedPolicy {
    dir: PathBuf,
}

impl PersistedPolicy {
    pub fn new(state_dir: impl Into<PathBuf>) -> PersistedPolicy {
        PersistedPolicy { dir: state_dir.into() }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    pub fn state_dir(&self) -> &Path {
        &self.dir
    }

    /// Writes the policy durably: when this returns `Ok`, a crash at any later point leaves
    /// exactly this policy on disk; before it, the previous file is intact.
    pub fn store(&self, policy: &WorkloadPolicy) -> Result<(), PersistError> {
        self.store_bytes(&encode(policy))
    }

    fn store_bytes(&self, bytes: &[u8]) -> Result<(), PersistError> {
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| PersistError::Io { what, path, source }
        };
        crate::private::dir(&self.dir).map_err(io("creating", &self.dir))?;
        let path = self.path();
        crate::private::write(&path, bytes).map_err(io("writing", &path))
    }

    /// Loads the persisted policy: `Ok(None)` when there is none, an error naming the file
    /// when it is unreadable, truncated or corrupt.
    pub fn load(&self) -> Result<Option<WorkloadPolicy>, PersistError> {
        let path = self.path();
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(PersistError::Io { what: "reading", path, source }),
        };
        decode(&bytes, &path).map(Some)
    }

    /// Removes the persisted policy (used to roll back a policy that could not be installed
    /// when none was persisted before).
    pub fn remove(&self) -> Result<(), PersistError> {
        let path = self.path();
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(PersistError::Io { what: "removing", path, source }),
        }
    }
}

/// The file content for a policy.
pub fn encode(policy: &WorkloadPolicy) -> Vec<u8> {
    let body = policy.canonical_bytes();
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&Sha256::digest(&body));
    out.extend_from_slice(&body);
    out
}

/// Parses and verifies file content; `path` only names the file in errors.
pub fn decode(bytes: &[u8], path: &Path) -> Result<WorkloadPolicy, PersistError> {
    let corrupt = |reason: String| PersistError::Corrupt { path: path.to_path_buf(), reason };
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(format!("{} bytes is shorter than the {HEADER_LEN}-byte header", bytes.len())));
    }
    if &bytes[..16] != MAGIC {
        return Err(corrupt("bad magic: not an innerwall persisted policy".into()));
    }
    let version = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(corrupt(format!("format version {version}, this agent reads {FORMAT_VERSION}")));
    }
    let len = u64::from_be_bytes(bytes[20..28].try_into().expect("8 bytes"));
    let body = &bytes[HEADER_LEN..];
    if body.len() as u64 != len {
        return Err(corrupt(format!("body is {} bytes, header says {len} (truncated?)", body.len())));
    }
    if Sha256::digest(body)[..] != bytes[28..60] {
        return Err(corrupt("checksum mismatch".into()));
    }
    WorkloadPolicy::from_canonical_bytes(body)
        .map_err(|source| PersistError::Decode { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use innerwall_wire::policy::{Mode, Protocol};
    use innerwall_wire::testing::rule;

    fn policy() -> WorkloadPolicy {
        let db = rule("db", Protocol::Tcp, &[5432], &["10.1.0.0/16", "fd00::/64"]);
        WorkloadPolicy::new(12, Mode::Enforcement, [db]).unwrap()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("innerwall-persist-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn round_trip_and_durable_replace() {
        let dir = temp_dir("roundtrip");
        let file = PersistedPolicy::new(&dir);
        assert_eq!(file.load().unwrap(), None);
        file.store(&policy()).unwrap();
        assert_eq!(file.load().unwrap(), Some(policy()));
        let next = policy().with_version(13);
        file.store(&next).unwrap();
        assert_eq!(file.load().unwrap(), Some(next));
        assert!(!dir.join("policy.tmp").exists(), "temp file renamed away");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn corruption_and_truncation_are_detected() {
        let good = encode(&policy());
        let path = Path::new("/state/policy.bin");
        assert_eq!(decode(&good, path).unwrap(), policy());
        let check = |bytes: &[u8], expected: &str| {
            let err = decode(bytes, path).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
            assert!(err.contains("/state/policy.bin"), "{err}");
        };
        for cut in [0, 10, HEADER_LEN - 1] {
            check(&good[..cut], "shorter than the");
        }
        check(&good[..good.len() - 1], "truncated");
        check(&good[..HEADER_LEN], "truncated");
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 0x01;
        check(&flipped, "checksum mismatch");
        let mut magic = good.clone();
        magic[0] = b'X';
        check(&magic, "bad magic");
        let mut version = good.clone();
        version[19] = 9;
        check(&version, "format version 9");
        let mut longer = good.clone();
        longer.push(0);
        check(&longer, "header says");
    }

    #[test]
    fn a_corrupt_file_on_disk_is_reported_not_loaded() {
        let dir = temp_dir("corrupt");
        let file = PersistedPolicy::new(&dir);
        file.store(&policy()).unwrap();
        let bytes = fs::read(file.path()).unwrap();
        fs::write(file.path(), &bytes[..bytes.len() / 2]).unwrap();
        let err = file.load().unwrap_err();
        assert!(matches!(err, PersistError::Corrupt { .. }), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }
}
