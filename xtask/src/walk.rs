//! Finding source files: the one directory walk `check-cycles` and `check-wire` share.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Every file under `root` (recursively) whose extension is `extension`, sorted.
pub fn files_with_extension(root: &Path, extension: &str) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("while listing {}", dir.display()))? {
            let path = entry.with_context(|| format!("while listing {}", dir.display()))?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == extension) {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}
