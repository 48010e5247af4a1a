//! The expand-only rule of `cargo xtask lint` for the SQL migrations (issue 32, item 5).
//!
//! While this release's `innerwall migrate` runs, and until every replica is upgraded, the
//! previous release's replicas keep serving the same database: a migration may add (tables,
//! nullable columns or columns with a default, indexes, functions) but must not take away or
//! change what the previous release uses. The previous release is the commit
//! `tests/fixtures/previous-release` pins (the version-skew tests run it); its migrations are
//! read from this clone's history, so a shallow clone fails with the fix named.
//!
//! Two rules:
//! - released migrations are append-only: every `migrations/*.sql` of the pinned commit is in
//!   the tree with the same bytes (sqlx checksums applied migrations, and a replica refuses a
//!   database whose applied migration differs from its own);
//! - a migration the pinned commit does not have contracts nothing: no `DROP TABLE`, `DROP VIEW`
//!   (or materialized view), `DROP FUNCTION` (or procedure), `DROP TYPE`, `DROP SEQUENCE`,
//!   `DROP SCHEMA`, `DROP DOMAIN`, `DROP COLUMN` (also `ALTER TABLE … DROP name`, whose
//!   `COLUMN` is optional), `DROP CONSTRAINT`, `RENAME` of anything, `ALTER COLUMN … TYPE` (or
//!   `SET DATA TYPE`), `SET NOT NULL`, or `ADD COLUMN … NOT NULL` without a `DEFAULT`.
//!
//! A statement that contracts on purpose — a release after the one that stopped using what it
//! removes — says why in a comment directly above it (above the statement, or above the line the
//! finding is on; other comment lines may stand between, a blank line may not):
//! `-- contract: <why the previous release no longer needs it>`.
//!
//! The scan reads tokens, so comments, string literals and quoted identifiers never count. The
//! body of a `DO` block runs at migration time and is scanned like the statements around it; the
//! body of a `CREATE FUNCTION` or `CREATE PROCEDURE` runs later, when called, and is not (nor is
//! dynamic SQL, `EXECUTE` of a string, anywhere). `DROP INDEX`, `DROP TRIGGER`, a new `CHECK` or
//! foreign key, and `ALTER COLUMN … DROP DEFAULT` are not refused: they break the previous
//! release only in ways the text does not show (an `ON CONFLICT` that needs a unique index, a
//! row it writes that a new constraint refuses, an insert relying on a default); the version-skew
//! test (`previous_replica_serves_while_this_release_migrates`) runs the previous release on
//! the migrated database.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::package::previous;

/// The migrations' directory, relative to the workspace root.
pub const DIR: &str = "migrations";
/// The comment that allows a contracting statement.
const ALLOW: &str = "contract:";

/// Checks the tree's migrations against the pinned previous release's.
pub fn check(root: &Path) -> Result<()> {
    let commit = previous::pinned(root)?;
    previous::ensure_in_clone(root, &commit, "the migration check compares migrations/ with it")?;
    let released = released(root, &commit)?;
    let current = current(root)?;
    let mut problems = compare(&released, &current);
    let new: Vec<&String> = current.keys().filter(|name| !released.contains_key(*name)).collect();
    for name in &new {
        let text =
            std::str::from_utf8(&current[*name]).with_context(|| format!("{DIR}/{name} is not UTF-8"))?;
        for finding in findings(text) {
            problems.push(format!(
                "{DIR}/{name}:{}: {} contracts the schema the previous release ({}) may still use: its \
                 replicas keep serving while this release migrates. Expand now and contract in a later \
                 release, saying why on the line above: `-- {ALLOW} <why the previous release no longer needs it>`",
                finding.line,
                finding.what,
                &commit[..12]
            ));
        }
    }
    if !problems.is_empty() {
        bail!(
            "{} migration problem(s) against the previous release {commit} ({}):\n{}",
            problems.len(),
            previous::FIXTURE,
            problems.join("\n")
        );
    }
    println!(
        "migrations: the {} released with {} unchanged; the {} since only expand",
        released.len(),
        &commit[..12],
        new.len()
    );
    Ok(())
}

/// The `.sql` files of `migrations/` at `commit`, by name.
fn released(root: &Path, commit: &str) -> Result<BTreeMap<String, Vec<u8>>> {
    let git = |args: &[&str]| -> Result<Vec<u8>> {
        let out = Command::new("git").arg("-C").arg(root).args(args).output().context("running git")?;
        ensure!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
        Ok(out.stdout)
    };
    let listing = git(&["ls-tree", "-z", "--name-only", commit, &format!("{DIR}/")])?;
    let mut files = BTreeMap::new();
    for path in listing.split(|b| *b == 0).filter(|p| !p.is_empty()) {
        let path = std::str::from_utf8(path).context("a migration's path at the previous release")?;
        let Some(name) = path.strip_prefix(&format!("{DIR}/")).filter(|n| n.ends_with(".sql")) else {
            continue;
        };
        files.insert(name.to_owned(), git(&["cat-file", "blob", &format!("{commit}:{path}")])?);
    }
    ensure!(!files.is_empty(), "the previous release {commit} has no {DIR}/*.sql");
    Ok(files)
}

/// The `.sql` files of the tree's `migrations/`, by name.
fn current(root: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let dir = root.join(DIR);
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if name.ends_with(".sql") && path.is_file() {
            files.insert(
                name.to_owned(),
                fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
            );
        }
    }
    Ok(files)
}

/// Released migrations removed from the tree or changed in it. Pure.
fn compare(released: &BTreeMap<String, Vec<u8>>, current: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    released
        .iter()
        .filter_map(|(name, bytes)| match current.get(name) {
            None => Some(format!(
                "{DIR}/{name}: released with the previous release and removed; released migrations stay"
            )),
            Some(now) if now != bytes => Some(format!(
                "{DIR}/{name}:{}: released with the previous release and changed (first difference on \
                 this line); released migrations are append-only: put the change in a new migration",
                first_difference_line(bytes, now)
            )),
            Some(_) => None,
        })
        .collect()
}

/// The 1-based line of `b` where it first differs from `a`.
fn first_difference_line(a: &[u8], b: &[u8]) -> usize {
    let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    1 + b[..at.min(b.len())].iter().filter(|c| **c == b'\n').count()
}

/// A contracting statement: where, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub line: usize,
    pub what: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    /// A keyword or unquoted identifier, upper-cased.
    Word(String),
    /// A quoted identifier, a string literal or a number: never a keyword.
    Other,
    /// A dollar-quoted string's contents (a function's or a `DO` block's body).
    Body(String),
    Punct(char),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

/// What the lexer saw besides tokens: the lines holding only a comment, and the reason of each
/// `-- contract:` comment.
#[derive(Debug, Default)]
struct Comments {
    comment_only: BTreeSet<usize>,
    allowed: BTreeSet<usize>,
}

/// Tokens of `text` (whose first line is `first_line`).
fn lex(text: &str, first_line: usize) -> (Vec<Token>, Comments) {
    let chars: Vec<char> = text.chars().collect();
    let (mut tokens, mut comments) = (Vec::new(), Comments::default());
    let mut code_lines = BTreeSet::new();
    let mut comment_lines = BTreeSet::new();
    let (mut i, mut line) = (0, first_line);
    let mut push = |tokens: &mut Vec<Token>, tok: Tok, line: usize| {
        code_lines.insert(line);
        tokens.push(Token { tok, line });
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '-' && next == Some('-') {
            let end = chars[i..].iter().position(|c| *c == '\n').map_or(chars.len(), |p| i + p);
            let comment: String = chars[i + 2..end].iter().collect();
            comment_lines.insert(line);
            if let Some(reason) = comment.trim().strip_prefix(ALLOW)
                && !reason.trim().is_empty()
            {
                comments.allowed.insert(line);
            }
            i = end;
        } else if c == '/' && next == Some('*') {
            // Block comments nest in PostgreSQL.
            let (mut depth, mut j) = (1, i + 2);
            while j < chars.len() && depth > 0 {
                match (chars[j], chars.get(j + 1)) {
                    ('/', Some('*')) => (depth, j) = (depth + 1, j + 2),
                    ('*', Some('/')) => (depth, j) = (depth - 1, j + 2),
                    ('\n', _) => (line, j) = (line + 1, j + 1),
                    _ => j += 1,
                }
            }
            i = j;
        } else if c == '\'' || ((c == 'E' || c == 'e') && next == Some('\'')) {
            let backslash = c != '\'';
            let start = line;
            let mut j = if backslash { i + 2 } else { i + 1 };
            while j < chars.len() {
                match chars[j] {
                    '\\' if backslash => j += 2,
                    '\'' if chars.get(j + 1) == Some(&'\'') => j += 2,
                    '\'' => break,
                    '\n' => (line, j) = (line + 1, j + 1),
                    _ => j += 1,
                }
            }
            push(&mut tokens, Tok::Other, start);
            i = j + 1;
        } else if c == '"' {
            let start = line;
            let mut j = i + 1;
            while j < chars.len() && !(chars[j] == '"' && chars.get(j + 1) != Some(&'"')) {
                if chars[j] == '"' {
                    j += 1;
                }
                if chars[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            push(&mut tokens, Tok::Other, start);
            i = j + 1;
        } else if c == '$'
            && let Some(tag_end) = dollar_tag(&chars, i)
        {
            let tag: String = chars[i..=tag_end].iter().collect();
            let body_start = tag_end + 1;
            let rest: String = chars[body_start..].iter().collect();
            let (body, after) = match rest.find(&tag) {
                Some(at) => {
                    (rest[..at].to_owned(), body_start + rest[..at].chars().count() + tag.chars().count())
                }
                None => (rest.clone(), chars.len()),
            };
            push(&mut tokens, Tok::Body(body.clone()), line);
            line += body.matches('\n').count();
            i = after;
        } else if c.is_alphabetic() || c == '_' {
            let end = chars[i..]
                .iter()
                .position(|c| !(c.is_alphanumeric() || *c == '_' || *c == '$'))
                .map_or(chars.len(), |p| i + p);
            let word: String = chars[i..end].iter().collect();
            push(&mut tokens, Tok::Word(word.to_ascii_uppercase()), line);
            i = end;
        } else if c.is_ascii_digit() {
            let end = chars[i..]
                .iter()
                .position(|c| !(c.is_ascii_alphanumeric() || *c == '.' || *c == '_'))
                .map_or(chars.len(), |p| i + p);
            push(&mut tokens, Tok::Other, line);
            i = end;
        } else {
            push(&mut tokens, Tok::Punct(c), line);
            i += 1;
        }
    }
    comments.comment_only = comment_lines.difference(&code_lines).copied().collect();
    (tokens, comments)
}

/// The index of the closing `$` of a dollar quote's opening tag at `i` (`$$`, `$body$`), or
/// `None` (a parameter such as `$1`).
fn dollar_tag(chars: &[char], i: usize) -> Option<usize> {
    let mut j = i + 1;
    if chars.get(j).is_some_and(char::is_ascii_digit) {
        return None;
    }
    while let Some(c) = chars.get(j) {
        match c {
            '$' => return Some(j),
            c if c.is_alphanumeric() || *c == '_' => j += 1,
            _ => return None,
        }
    }
    None
}

/// The contracting statements of a migration's text that no `-- contract:` comment allows.
pub fn findings(text: &str) -> Vec<Finding> {
    let mut found = Vec::new();
    scan(text, 1, &mut found, false);
    found.sort_by_key(|f| f.line);
    found
}

/// Scans `text` (from `first_line`); `allowed`: an enclosing statement is allowed.
fn scan(text: &str, first_line: usize, found: &mut Vec<Finding>, allowed: bool) {
    let (tokens, comments) = lex(text, first_line);
    let is_allowed = |line: usize| {
        let mut above = line.saturating_sub(1);
        while above >= 1 && comments.comment_only.contains(&above) {
            if comments.allowed.contains(&above) {
                return true;
            }
            above -= 1;
        }
        false
    };
    for statement in tokens.split(|t| t.tok == Tok::Punct(';')).filter(|s| !s.is_empty()) {
        let statement_allowed = allowed || is_allowed(statement[0].line);
        for finding in contractions(statement) {
            if !(statement_allowed || is_allowed(finding.line)) {
                found.push(finding);
            }
        }
        // A DO block's body runs now; a function's body runs when called.
        if statement[0].tok == Tok::Word("DO".into()) {
            for token in statement {
                if let Tok::Body(body) = &token.tok {
                    scan(body, token.line, found, statement_allowed);
                }
            }
        }
    }
}

/// The contracting forms in one statement's tokens.
fn contractions(tokens: &[Token]) -> Vec<Finding> {
    let word = |i: usize| match tokens.get(i).map(|t| &t.tok) {
        Some(Tok::Word(w)) => Some(w.as_str()),
        _ => None,
    };
    let mut found = Vec::new();
    let mut finding = |i: usize, what| found.push(Finding { line: tokens[i].line, what });
    // Where an `ALTER TABLE` starts, if the statement has one (a DO block's statement may begin
    // with BEGIN or a label).
    let alter_table = (0..tokens.len()).find(|&i| word(i) == Some("ALTER") && word(i + 1) == Some("TABLE"));
    for i in 0..tokens.len() {
        match word(i) {
            Some("DROP") => match word(i + 1) {
                Some("TABLE") => finding(i, "DROP TABLE"),
                Some("VIEW") => finding(i, "DROP VIEW"),
                Some("MATERIALIZED") => finding(i, "DROP MATERIALIZED VIEW"),
                Some("FUNCTION") => finding(i, "DROP FUNCTION"),
                Some("PROCEDURE") => finding(i, "DROP PROCEDURE"),
                Some("TYPE") => finding(i, "DROP TYPE"),
                Some("SEQUENCE") => finding(i, "DROP SEQUENCE"),
                Some("SCHEMA") => finding(i, "DROP SCHEMA"),
                Some("DOMAIN") => finding(i, "DROP DOMAIN"),
                Some("COLUMN") => finding(i, "DROP COLUMN"),
                Some("CONSTRAINT") => finding(i, "DROP CONSTRAINT"),
                // A column's own DROP DEFAULT / NOT NULL / EXPRESSION / IDENTITY expands.
                Some("DEFAULT" | "NOT" | "EXPRESSION" | "IDENTITY") => {}
                // ALTER TABLE t DROP [IF EXISTS] c: COLUMN is optional.
                _ if alter_table.is_some_and(|a| a < i) && tokens.get(i + 1).is_some() => {
                    finding(i, "DROP COLUMN")
                }
                _ => {}
            },
            Some("RENAME") => finding(i, "RENAME"),
            Some("TYPE") if alter_table.is_some_and(|a| a < i) => {
                let altered_column = (i >= 2 && word(i - 2) == Some("ALTER"))
                    || (i >= 3 && word(i - 3) == Some("ALTER") && word(i - 2) == Some("COLUMN"));
                if word(i - 1) == Some("DATA") || altered_column {
                    finding(i, "ALTER COLUMN … TYPE");
                }
            }
            Some("SET") if word(i + 1) == Some("NOT") && word(i + 2) == Some("NULL") => {
                finding(i, "SET NOT NULL")
            }
            _ => {}
        }
    }
    if let Some(start) = alter_table {
        for action in actions(&tokens[start + 2..]) {
            let first = |k: usize| match action.get(k).map(|t| &t.tok) {
                Some(Tok::Word(w)) => Some(w.as_str()),
                _ => None,
            };
            if first(0) != Some("ADD")
                || matches!(
                    first(1),
                    Some("CONSTRAINT" | "PRIMARY" | "UNIQUE" | "CHECK" | "FOREIGN" | "EXCLUDE")
                )
            {
                continue;
            }
            // The column's own clauses: depth 0 (a CHECK's `IS NOT NULL` is in parentheses).
            let mut depth = 0i32;
            let mut top = Vec::new();
            for t in action {
                match t.tok {
                    Tok::Punct('(') => depth += 1,
                    Tok::Punct(')') => depth -= 1,
                    Tok::Word(ref w) if depth == 0 => top.push(w.as_str()),
                    _ => {}
                }
            }
            let not_null = top.windows(2).any(|w| w == ["NOT", "NULL"]);
            if not_null && !top.contains(&"DEFAULT") && !top.contains(&"GENERATED") {
                found.push(Finding {
                    line: action[0].line, what: "ADD COLUMN … NOT NULL without a DEFAULT"
                });
            }
        }
    }
    found
}

/// An `ALTER TABLE`'s actions: its tokens split at the commas outside parentheses.
fn actions(tokens: &[Token]) -> Vec<&[Token]> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, t) in tokens.iter().enumerate() {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => depth -= 1,
            Tok::Punct(',') if depth == 0 => {
                out.push(&tokens[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&tokens[start..]);
    // The first action follows the table's name (ALTER TABLE [IF EXISTS] [ONLY] name [*]).
    if let Some(first) = out.first_mut() {
        let skip =
            first.iter().position(|t| matches!(&t.tok, Tok::Word(w) if is_action(w))).unwrap_or(first.len());
        *first = &first[skip..];
    }
    out.into_iter().filter(|a| !a.is_empty()).collect()
}

fn is_action(word: &str) -> bool {
    matches!(
        word,
        "ADD"
            | "DROP"
            | "ALTER"
            | "RENAME"
            | "SET"
            | "RESET"
            | "VALIDATE"
            | "ENABLE"
            | "DISABLE"
            | "ATTACH"
            | "DETACH"
            | "CLUSTER"
            | "INHERIT"
            | "NO"
            | "OF"
            | "NOT"
            | "OWNER"
            | "REPLICA"
            | "FORCE"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whats(text: &str) -> Vec<(usize, &'static str)> {
        findings(text).into_iter().map(|f| (f.line, f.what)).collect()
    }

    #[test]
    fn each_contraction_is_refused_with_its_line() {
        let text = "-- a migration\n\
            DROP TABLE old;\n\
            ALTER TABLE t DROP COLUMN a;\n\
            ALTER TABLE t\n    DROP IF EXISTS b;\n\
            ALTER TABLE t RENAME COLUMN c TO d;\n\
            ALTER TABLE t RENAME TO u;\n\
            ALTER TABLE t ALTER COLUMN e TYPE bigint;\n\
            ALTER TABLE t ALTER f SET DATA TYPE text;\n\
            ALTER TABLE t ALTER g TYPE int USING g::int;\n\
            ALTER TABLE t ALTER COLUMN h SET NOT NULL;\n\
            ALTER TABLE t ADD COLUMN i int NOT NULL;\n\
            ALTER TABLE t ADD j int NOT NULL, ADD COLUMN k int;\n\
            ALTER TABLE t DROP CONSTRAINT t_check;\n\
            DROP FUNCTION f(int);\n\
            DROP VIEW v;\n\
            DROP MATERIALIZED VIEW IF EXISTS m;\n\
            ALTER INDEX i RENAME TO j;\n\
            drop table lower_case;\n";
        assert_eq!(
            whats(text),
            vec![
                (2, "DROP TABLE"),
                (3, "DROP COLUMN"),
                (5, "DROP COLUMN"),
                (6, "RENAME"),
                (7, "RENAME"),
                (8, "ALTER COLUMN … TYPE"),
                (9, "ALTER COLUMN … TYPE"),
                (10, "ALTER COLUMN … TYPE"),
                (11, "SET NOT NULL"),
                (12, "ADD COLUMN … NOT NULL without a DEFAULT"),
                (13, "ADD COLUMN … NOT NULL without a DEFAULT"),
                (14, "DROP CONSTRAINT"),
                (15, "DROP FUNCTION"),
                (16, "DROP VIEW"),
                (17, "DROP MATERIALIZED VIEW"),
                (18, "RENAME"),
                (19, "DROP TABLE"),
            ]
        );
    }

    #[test]
    fn expansions_pass() {
        let text = "CREATE TABLE n (id uuid NOT NULL PRIMARY KEY, at timestamptz NOT NULL DEFAULT now());\n\
            ALTER TABLE t ADD COLUMN a int;\n\
            ALTER TABLE t ADD COLUMN b int NOT NULL DEFAULT 0, ADD COLUMN c text DEFAULT '' NOT NULL;\n\
            ALTER TABLE t ADD COLUMN d int CHECK (d IS NOT NULL OR true);\n\
            ALTER TABLE t ADD COLUMN e bigint GENERATED ALWAYS AS (1) STORED NOT NULL;\n\
            ALTER TABLE t ADD CONSTRAINT k CHECK (x IS NOT NULL) NOT VALID;\n\
            ALTER TABLE t ALTER COLUMN f DROP NOT NULL, ALTER COLUMN g DROP DEFAULT, ALTER h SET DEFAULT 1;\n\
            CREATE INDEX i ON t (a) INCLUDE (b);\n\
            DROP INDEX old_index;\n\
            CREATE TYPE kind AS ENUM ('a');\n\
            ALTER TYPE kind ADD VALUE 'b';\n\
            SELECT 'DROP TABLE t; ALTER TABLE t RENAME TO u' AS text, E'it\\'s DROP TABLE' AS e;\n\
            /* DROP TABLE t; /* nested */ RENAME */\n\
            -- DROP TABLE t;\n\
            INSERT INTO \"drop\" (\"rename\") VALUES ($1);\n\
            CREATE FUNCTION f(p text) RETURNS void LANGUAGE plpgsql AS $$\n\
            BEGIN\n  DROP TABLE x;\n  EXECUTE format('DROP TABLE %I', p);\nEND\n$$;\n\
            CREATE FUNCTION g() RETURNS int LANGUAGE sql AS $body$ SELECT 1; ALTER TABLE t RENAME TO z $body$;\n";
        assert_eq!(whats(text), vec![]);
    }

    #[test]
    fn a_do_block_runs_now_and_is_scanned() {
        let text = "DO $$\nBEGIN\n  IF true THEN\n    ALTER TABLE t DROP COLUMN a;\n  END IF;\n  \
                    EXECUTE format('ALTER TABLE %I RENAME TO x', 't');\nEND\n$$;\n";
        assert_eq!(whats(text), vec![(4, "DROP COLUMN")]);
        let tagged = "SELECT 1;\nDO LANGUAGE plpgsql $x$ BEGIN ALTER TABLE t RENAME c TO d; END $x$;\n";
        assert_eq!(whats(tagged), vec![(2, "RENAME")]);
    }

    #[test]
    fn a_contract_comment_allows_the_statement_below_it() {
        let text = "-- contract: 0.3 stopped reading it (since 0034)\nDROP TABLE old;\n\
            -- contract: 0.3 writes b itself\n-- (the default moved to the code)\nALTER TABLE t\n  ALTER b SET NOT NULL,\n  DROP c;\n\
            ALTER TABLE t\n  -- contract: nobody reads d\n  DROP d,\n  DROP e;\n\
            -- contract: far above\n\nDROP TABLE t2;\n\
            -- contract:\nDROP TABLE t3;\n\
            DROP TABLE t4; -- contract: after it is not above it\n\
            -- contract: the whole block\nDO $$ BEGIN DROP TABLE t5; END $$;\n";
        assert_eq!(
            whats(text),
            vec![(11, "DROP COLUMN"), (14, "DROP TABLE"), (16, "DROP TABLE"), (17, "DROP TABLE")]
        );
    }

    #[test]
    fn released_migrations_are_append_only() {
        let files = |list: &[(&str, &str)]| -> BTreeMap<String, Vec<u8>> {
            list.iter().map(|(n, t)| ((*n).to_owned(), t.as_bytes().to_vec())).collect()
        };
        let released = files(&[("0001_a.sql", "CREATE TABLE a ();\n"), ("0002_b.sql", "one\ntwo\nthree\n")]);
        assert!(
            compare(
                &released,
                &files(&[
                    ("0001_a.sql", "CREATE TABLE a ();\n"),
                    ("0002_b.sql", "one\ntwo\nthree\n"),
                    ("0003_c.sql", "")
                ])
            )
            .is_empty()
        );
        let problems = compare(&released, &files(&[("0002_b.sql", "one\ntwo\nthree \n")]));
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("migrations/0001_a.sql: released") && problems[0].contains("removed"),
            "{problems:?}"
        );
        assert!(
            problems[1].starts_with("migrations/0002_b.sql:3: released") && problems[1].contains("changed"),
            "{problems:?}"
        );
    }

    #[test]
    fn this_trees_partition_upkeep_passes() {
        // Its functions DROP TABLE when called (a daily partition), and its DO block only sets
        // their search_path.
        let text = include_str!("../../migrations/0035_partition_upkeep.sql");
        assert_eq!(whats(text), vec![]);
    }

    /// `check` over a throwaway repository of its own (never this one): the pinned commit's
    /// migrations read from its history, a changed and a contracting one refused by name.
    #[test]
    fn the_check_reads_the_released_migrations_from_history() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let git = |args: &[&str]| {
            let out = Command::new("git")
                .arg("-C")
                .arg(root)
                .args(["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"])
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        git(&["init", "-q"]);
        fs::create_dir_all(root.join(DIR)).unwrap();
        fs::write(root.join(DIR).join("0001_a.sql"), "CREATE TABLE a (x int);\n").unwrap();
        git(&["add", "."]);
        git(&["commit", "-q", "-m", "release"]);
        let commit = git(&["rev-parse", "HEAD"]).trim().to_owned();
        fs::create_dir_all(root.join("tests/fixtures")).unwrap();
        fs::write(root.join(previous::FIXTURE), format!("{commit}\n")).unwrap();

        fs::write(root.join(DIR).join("0002_b.sql"), "ALTER TABLE a ADD COLUMN y int;\n").unwrap();
        check(root).unwrap();
        fs::write(root.join(DIR).join("0003_c.sql"), "SELECT 1;\nALTER TABLE a DROP x;\n").unwrap();
        fs::write(root.join(DIR).join("0001_a.sql"), "CREATE TABLE a (x bigint);\n").unwrap();
        let err = format!("{:#}", check(root).unwrap_err());
        assert!(err.contains("2 migration problem(s)"), "{err}");
        assert!(
            err.contains("migrations/0001_a.sql:1: released with the previous release and changed"),
            "{err}"
        );
        assert!(err.contains("migrations/0003_c.sql:2: DROP COLUMN contracts"), "{err}");
        fs::write(
            root.join(DIR).join("0003_c.sql"),
            "SELECT 1;\n-- contract: x unused since 0001\nALTER TABLE a DROP x;\n",
        )
        .unwrap();
        fs::write(root.join(DIR).join("0001_a.sql"), "CREATE TABLE a (x int);\n").unwrap();
        check(root).unwrap();
    }

    #[test]
    fn a_missing_pinned_commit_names_the_fix() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let err = previous::ensure_in_clone(
            root,
            &"0".repeat(40),
            "the migration check compares migrations/ with it",
        )
        .unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("migration check") && err.contains("git fetch"), "{err}");
    }
}
