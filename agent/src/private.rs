//! Files only root reads (issue 11): the agent's state directories are 0700 and its files
//! 0600, written through a fresh temporary file (`O_CREAT | O_EXCL`, so a symlink planted in
//! its place is never followed), fsynced and renamed into place (a rename replaces a symlink,
//! it never writes through one).

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Creates `dir` (and missing parents) 0700, tightens it to 0700 if it exists, and refuses a
/// symlink in its place.
pub fn dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let meta = fs::symlink_metadata(dir)?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(io::Error::other(format!("{} is not a directory (a symlink is refused)", dir.display())));
    }
    if meta.permissions().mode() & 0o777 != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Replaces `path` with `bytes`, durably and mode 0600.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, path)?;
    fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// Opens (creating it 0600, never through a symlink) and exclusively locks `path` with
/// `flock(2)`, blocking until it is free. The lock lasts as long as the returned file.
#[allow(unsafe_code)]
pub fn lock(path: &Path) -> io::Result<fs::File> {
    use std::os::fd::AsRawFd as _;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    // SAFETY: flock(2) on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_0700_files_0600_and_symlinks_are_not_followed() {
        let root = std::env::temp_dir().join(format!("iw-private-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dir_path = root.join("state");
        fs::create_dir_all(&dir_path).unwrap();
        fs::set_permissions(&dir_path, fs::Permissions::from_mode(0o755)).unwrap();
        dir(&dir_path).unwrap();
        assert_eq!(fs::metadata(&dir_path).unwrap().permissions().mode() & 0o777, 0o700, "tightened");

        // A symlink planted where the file goes, and where its temporary file goes.
        let victim = root.join("victim");
        fs::write(&victim, "untouched").unwrap();
        let file = dir_path.join("marker");
        std::os::unix::fs::symlink(&victim, &file).unwrap();
        std::os::unix::fs::symlink(&victim, file.with_extension("tmp")).unwrap();
        write(&file, b"42").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "untouched");
        assert!(!fs::symlink_metadata(&file).unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(&file).unwrap(), "42");
        assert_eq!(fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);

        let link = root.join("link");
        std::os::unix::fs::symlink(&dir_path, &link).unwrap();
        assert!(dir(&link).unwrap_err().to_string().contains("symlink is refused"));
        fs::remove_dir_all(&root).unwrap();
    }
}
