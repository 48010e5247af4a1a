//! Running child processes: echoing them, capturing output, and errors that name the full command.

use std::{ffi::OsStr, path::Path, process::Command};

use anyhow::{Context, Result, bail};

use crate::cargo_env;

/// `cargo` in the root workspace, inheriting the toolchain and build settings `cargo xtask`
/// runs with, but not what cargo set for xtask itself (which would force rebuilds).
pub fn root_cargo(root: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cargo_env::isolate_cargo_env(&mut cmd);
    cmd.current_dir(root);
    cmd
}

/// Runs `cmd` with inherited stdio after echoing it; fails unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = describe(cmd);
    match cmd.get_current_dir() {
        Some(dir) => println!("$ {}  (in {})", shell_words(cmd), dir.display()),
        None => println!("$ {}", shell_words(cmd)),
    }
    let status =
        cmd.status().with_context(|| format!("could not start {line} (is it installed and on PATH?)"))?;
    if !status.success() {
        bail!("{line} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout; on failure the error carries its stderr.
pub fn output(cmd: &mut Command) -> Result<String> {
    let line = describe(cmd);
    let out =
        cmd.output().with_context(|| format!("could not start {line} (is it installed and on PATH?)"))?;
    if !out.status.success() {
        bail!("{line} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    String::from_utf8(out.stdout).with_context(|| format!("{line} printed non-UTF-8 output"))
}

/// The command for messages: its shell line in backticks, then the directory it runs in.
pub fn describe(cmd: &Command) -> String {
    format!("`{}`{}", shell_words(cmd), in_dir(cmd))
}

/// Environment overrides, program and arguments, quoted for a POSIX shell.
fn shell_words(cmd: &Command) -> String {
    let mut words: Vec<String> = cmd
        .get_envs()
        .filter_map(|(key, value)| value.map(|value| format!("{}={}", key.display(), quote(value))))
        .collect();
    words.push(quote(cmd.get_program()));
    words.extend(cmd.get_args().map(quote));
    words.join(" ")
}

fn in_dir(cmd: &Command) -> String {
    cmd.get_current_dir().map(|dir| format!(" in {}", dir.display())).unwrap_or_default()
}

fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain =
        !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:+,@%".contains(c));
    if plain { word.into_owned() } else { format!("'{}'", word.replace('\'', r"'\''")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_shows_env_overrides_quoting_and_directory() {
        let mut cmd = Command::new("cargo");
        cmd.args(["build", "--target", "bpfel-unknown-none", "it's"])
            .env("RUSTFLAGS", "-C debuginfo=2")
            .env_remove("CARGO_TARGET_DIR")
            .current_dir("/src/agent-ebpf");
        assert_eq!(
            describe(&cmd),
            "`RUSTFLAGS='-C debuginfo=2' cargo build --target bpfel-unknown-none 'it'\\''s'` \
             in /src/agent-ebpf"
        );
    }

    #[test]
    fn run_error_names_the_command_and_status() {
        let err = run(Command::new("false").arg("--flag")).unwrap_err();
        assert_eq!(format!("{err:#}"), "`false --flag` failed (exit status: 1)");
    }

    #[test]
    fn output_error_carries_stderr() {
        let err = output(Command::new("sh").args(["-c", "echo boom >&2; exit 3"])).unwrap_err();
        assert_eq!(format!("{err:#}"), "`sh -c 'echo boom >&2; exit 3'` failed (exit status: 3): boom");
    }
}
