//! A secret read from a file, or from standard input when the path is `-` (RUN-6: a secret never
//! comes from a flag itself). Both binaries read their tokens, and `innerwall` its backup
//! passphrases, through [`read`]; each says in its own words what the file should have held.
//! Not part of the contract, like `config.rs`: the little both processes share.

use std::io::Read as _;
use std::path::Path;

/// The most a secret file may hold, in bytes: a token or a passphrase, never a document.
pub const MAX_SECRET_FILE: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    Read(#[from] std::io::Error),
    #[error("holds more than {MAX_SECRET_FILE} bytes")]
    TooLarge,
    #[error("is empty")]
    Empty,
}

/// The secret in `path` (standard input for `-`): surrounding whitespace ignored, at most
/// [`MAX_SECRET_FILE`] bytes read, never empty.
pub fn read(path: &Path) -> Result<String, SecretError> {
    let limit = MAX_SECRET_FILE + 1;
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin().take(limit).read_to_string(&mut text)?;
    } else {
        std::fs::File::open(path)?.take(limit).read_to_string(&mut text)?;
    }
    if text.len() as u64 > MAX_SECRET_FILE {
        return Err(SecretError::TooLarge);
    }
    match text.trim() {
        "" => Err(SecretError::Empty),
        secret => Ok(secret.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, content: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("iw-secret-{}-{name}", std::process::id()));
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn a_secret_is_trimmed_bounded_and_never_empty() {
        let ok = file("ok", b"  iw_abc\n");
        assert_eq!(read(&ok).unwrap(), "iw_abc");
        let exact = file("exact", &vec![b'a'; MAX_SECRET_FILE as usize]);
        assert_eq!(read(&exact).unwrap().len() as u64, MAX_SECRET_FILE);
        let big = file("big", &vec![b'a'; MAX_SECRET_FILE as usize + 1]);
        assert!(matches!(read(&big), Err(SecretError::TooLarge)));
        let blank = file("blank", b" \n\t");
        assert!(matches!(read(&blank), Err(SecretError::Empty)));
        let binary = file("binary", &[0xff, 0xfe]);
        assert!(matches!(read(&binary), Err(SecretError::Read(_))));
        assert!(matches!(read(Path::new("/nonexistent/iw-secret")), Err(SecretError::Read(_))));
        for path in [ok, exact, big, blank, binary] {
            std::fs::remove_file(path).unwrap();
        }
    }
}
