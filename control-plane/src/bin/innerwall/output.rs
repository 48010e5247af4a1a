//! How results are printed: plain tables for people (comfy-table, no borders, so they read well
//! in logs too) and JSON for scripts (`--json`; the demo and the end-to-end tests parse it); and
//! the one writer of stdout, [`stdout`], which every `print!`/`println!` of the binary goes
//! through (`main` shadows std's macros), so that a closed pipe ends any command quietly and a
//! failed write (a full disk) ends it with the error; and [`escape`], which every table cell and
//! every line written there goes through, so no text from the database or an agent (a hostname,
//! a description, a reason) can put a terminal escape sequence on an operator's screen.

use std::borrow::Cow;
use std::fmt::Write as _;

use comfy_table::{Table, presets};
use innerwall_control_plane::policy::authoring::Committed;
use serde::Serialize;

/// What a failed write to stdout unwinds with, up to `main`: a closed pipe (`innerwall … --json
/// | head`) ends the command quietly with exit 0, any other failure with its error. std's macros
/// would panic with a backtrace instead.
#[derive(Debug)]
pub struct StdoutFailed(pub std::io::Error);

/// Writes `args` to stdout, each line [`escape`]d (line breaks stay); on failure unwinds with
/// [`StdoutFailed`] (without the panic hook, so nothing is printed), which `main` catches.
pub fn stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let text = match args.as_str() {
        Some(text) => Cow::Borrowed(text),
        None => Cow::Owned(args.to_string()),
    };
    let mut lines = text.split('\n');
    let mut out = String::with_capacity(text.len());
    if let Some(first) = lines.next() {
        out.push_str(&escape(first));
    }
    for line in lines {
        out.push('\n');
        out.push_str(&escape(line));
    }
    if let Err(e) = std::io::stdout().lock().write_all(out.as_bytes()) {
        std::panic::resume_unwind(Box::new(StdoutFailed(e)));
    }
}

/// Flushes stdout (the last line of a command may wait in its buffer): a failure unwinds as a
/// failed write does, instead of being dropped at exit.
pub fn flush() {
    use std::io::Write as _;
    if let Err(e) = std::io::stdout().lock().flush() {
        std::panic::resume_unwind(Box::new(StdoutFailed(e)));
    }
}

/// Writes one line of `args` to stderr, [`escape`]d: a note beside the output. A failure to write
/// it is ignored (`eprintln!` would panic), as the output itself decides the command's fate.
pub fn note(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let line = format!("{}\n", escape(&args.to_string()));
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// A long operation's step (backup, restore, migrations, retention), on stderr when it is a
/// terminal: pipelines and logs get only the summary the command prints at the end.
pub fn progress(step: &str) {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        note(format_args!("… {step}"));
    }
}

/// `text` with every control character (C0, DEL, C1) and every bidirectional-override
/// character written as a visible escape (`\n`, `\t`, `\r`, else `\u001b`, `\u202e`, …), so that
/// what a terminal shows is what the text holds. The one escaping of the CLI's output. The
/// escapes are JSON's, so JSON output passes through unchanged in meaning (serde_json leaves DEL,
/// C1 and bidi characters raw; here they become `\u` escapes of the same value).
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            // Every character escaped here is in the Basic Multilingual Plane: four digits.
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
fn needs_escape_except_newline(c: char) -> bool {
    c != '\n' && needs_escape(c)
}

fn needs_escape(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// Stdout as a file of its own (a duplicate of descriptor 1), unbuffered, whose every error is
/// reported: std's `stdout()` quietly discards what is written to a closed descriptor 1.
fn raw_stdout() -> std::io::Result<std::fs::File> {
    use std::os::fd::AsFd as _;
    let fd = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| std::io::Error::new(e.kind(), format!("stdout is closed ({e})")))?;
    Ok(std::fs::File::from(fd))
}

/// Fails unless stdout can show what is written: checked before making something only its
/// output can hand over. A closed descriptor 1 fails, and so does `/dev/null`, which is what a
/// Rust program finds in place of a closed one (the runtime reopens 0, 1 and 2 on it).
pub fn stdout_can_show() -> std::io::Result<()> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let out = raw_stdout()?.metadata()?;
    let null = std::fs::metadata("/dev/null")?;
    if out.file_type().is_char_device() && out.rdev() == null.rdev() {
        return Err(std::io::Error::other("stdout is closed or /dev/null"));
    }
    Ok(())
}

/// Writes `text` to stdout in one piece, returning the error instead of unwinding: for output
/// whose loss must be acted on (a minted secret no one saw is revoked).
pub fn write_all(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    std::io::stdout().lock().flush()?;
    let mut out = raw_stdout()?;
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// A left-aligned table: upper-case headers, columns two spaces apart, no borders or rules.
pub fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    table.set_header(headers.iter().map(|h| h.to_uppercase()).collect::<Vec<_>>());
    // Escaped per cell, line breaks too: a hostname with a newline stays one cell of one row.
    table.add_rows(rows.into_iter().map(|row| row.into_iter().map(|cell| escape(&cell).into_owned())));
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    println!("{}", table.trim_fmt());
}

pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// The one printer of a change's outcome, local or remote: `what` (unless `--json`), then each
/// workload whose version moved; with `--json` the value and those workloads.
fn print_outcome<T: Serialize>(json: bool, what: Option<&str>, done: &Outcome<T>) {
    if json {
        println!("{}", serde_json::json!({"result": done.result, "changed": done.changed}));
        return;
    }
    if let Some(what) = what {
        println!("{what}");
    }
    if done.changed.is_empty() {
        println!("no workload's policy changed");
    } else {
        println!("policy version changed for {} workload(s):", done.changed.len());
        for c in &done.changed {
            println!("  {}  v{}", c.workload, c.version);
        }
    }
}

/// A change's outcome as the API answers it (`{"result": …, "changed": [{workload, version}]}`)
/// and as a local [`Committed`] becomes, so both print alike.
#[derive(Debug, serde::Deserialize)]
pub struct Outcome<T> {
    pub result: T,
    pub changed: Vec<ChangedRow>,
}

#[derive(Debug, Serialize, serde::Deserialize)]
pub struct ChangedRow {
    pub workload: String,
    pub version: u64,
}

impl<T> From<Committed<T>> for Outcome<T> {
    fn from(done: Committed<T>) -> Outcome<T> {
        let changed =
            done.changed.iter().map(|c| ChangedRow { workload: c.workload.to_string(), version: c.version });
        Outcome { result: done.value, changed: changed.collect() }
    }
}

/// Prints `what` (unless `--json`), then the outcome of the change.
pub fn report<T: Serialize>(json: bool, what: &str, done: &Outcome<T>) {
    print_outcome(json, Some(what), done);
}

/// Prints the outcome of a change that needs no sentence (a render): the value, then each
/// workload whose version moved.
pub fn print_changed<T: Serialize>(json: bool, done: &Outcome<T>) {
    print_outcome(json, None, done);
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn escape_makes_control_characters_visible() {
        assert_eq!(escape("web-1.example"), "web-1.example");
        assert_eq!(escape("caf\u{e9} \u{1f600} a\\b"), "caf\u{e9} \u{1f600} a\\b");
        assert_eq!(escape("\x1b[2J\x07host"), "\\u001b[2J\\u0007host");
        assert_eq!(escape("a\nb\tc\rd"), "a\\nb\\tc\\rd");
        assert_eq!(escape("\u{9b}31m \u{7f}"), "\\u009b31m \\u007f");
        assert_eq!(escape("abc\u{202e}gpj.exe"), "abc\\u202egpj.exe");
        assert_eq!(escape("\0"), "\\u0000");
    }

    /// JSON keeps its meaning: what serde_json leaves raw becomes a `\u` escape of itself.
    #[test]
    fn escaped_json_is_the_same_json() {
        let value = serde_json::json!({"d": "\x1b[31m\u{7f}\u{9b}\u{202e}\n\t\\x"});
        let text = serde_json::to_string_pretty(&value).unwrap();
        let escaped: String = text.split('\n').map(|l| escape(l).into_owned()).collect::<Vec<_>>().join("\n");
        assert!(!escaped.chars().any(super::needs_escape_except_newline), "{escaped}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&escaped).unwrap(), value);
    }
}
