//! An operator file (`-f PATH`, `-` for stdin) read as text, at most one byte over its bound, so
//! the library's parser refuses an oversized file by its size without the CLI reading it whole.

use std::io::Read as _;
use std::path::Path;

use anyhow::Context;

/// The file's name as messages give it, and at most `max + 1` bytes of its text.
pub fn read_bounded(path: &Path, max: u64) -> anyhow::Result<(String, String)> {
    let reader: Box<dyn std::io::Read> = if path == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(path).with_context(|| format!("while reading {}", path.display()))?)
    };
    let mut text = String::new();
    reader
        .take(max + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("while reading {}", path.display()))?;
    Ok((path.display().to_string(), text))
}
