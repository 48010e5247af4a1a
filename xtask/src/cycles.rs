//! `cargo xtask check-cycles`: finds import cycles between the modules of a crate: between its
//! top-level modules, and between the submodules of each folder module.
//!
//! A module "imports" another when its file (inline modules such as `mod tests` included)
//! names it in a `use` or in a path: `crate::x`, `super::x`, `self::x`, or `x::` for a child.
//! Within one scope (the crate root, or a folder module such as `demo/`) that makes an edge
//! between the two children of the scope the modules belong to; a parent using its child or a
//! child using its parent is not an edge. Every strongly connected set of two or more
//! children is reported. The scan reads tokens, not a syntax tree: comments, strings and
//! `$crate` are skipped, and macro bodies count like any other code.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// The `src` folders of the crates that must stay free of cycles.
pub const CRATE_SOURCES: &[&str] =
    &["control-plane/src", "control-plane/src/bin/innerwall", "agent/src", "wire/src", "xtask/src"];

/// Scans each of `dirs` (a crate's `src`, relative to `root`), prints every cycle and fails if
/// there is one.
pub fn check(root: &Path, dirs: &[PathBuf]) -> Result<()> {
    let mut total = 0;
    for dir in dirs {
        let files = read_crate(&root.join(dir))?;
        let cycles = find_cycles(&files);
        if cycles.is_empty() {
            println!("{}: no cycles ({} files)", dir.display(), files.len());
        }
        for cycle in &cycles {
            println!("{}", cycle.describe(&dir.display().to_string()));
        }
        total += cycles.len();
    }
    if total > 0 {
        bail!("{total} import cycle(s) between modules: cut one edge of each (listed above)");
    }
    Ok(())
}

/// Every `.rs` file under `src`, sorted, with its path relative to `src`.
fn read_crate(src: &Path) -> Result<Vec<SourceFile>> {
    let paths = crate::walk::files_with_extension(src, "rs")?;
    paths
        .into_iter()
        .map(|path| {
            let text =
                fs::read_to_string(&path).with_context(|| format!("while reading {}", path.display()))?;
            let relative = path.strip_prefix(src).unwrap_or(&path).to_string_lossy().into_owned();
            Ok(SourceFile { path: relative, text })
        })
        .collect()
}

/// A source file: its path relative to the crate's `src` (`/`-separated) and its text.
#[derive(Debug)]
pub struct SourceFile {
    pub path: String,
    pub text: String,
}

/// Modules of one scope that import each other, directly or around a loop.
#[derive(Debug, PartialEq)]
pub struct Cycle {
    /// The folder module whose children these are; empty for the crate's top level.
    pub scope: Vec<String>,
    pub members: Vec<String>,
    /// The edges between members, each with the first place that makes it (`file:line`).
    pub edges: Vec<(String, String, String)>,
}

impl Cycle {
    fn describe(&self, crate_dir: &str) -> String {
        let scope = if self.scope.is_empty() {
            "top-level modules".to_owned()
        } else {
            format!("submodules of {}", self.scope.join("::"))
        };
        let mut text =
            format!("{crate_dir}: cycle between {} {scope}: {}", self.members.len(), self.members.join(", "));
        for (from, to, place) in &self.edges {
            text.push_str(&format!("\n  {from} -> {to}   ({place})"));
        }
        text
    }
}

/// The cycles among the modules of one crate, by scope then first member.
pub fn find_cycles(files: &[SourceFile]) -> Vec<Cycle> {
    let modules: Vec<(&SourceFile, Vec<String>)> =
        files.iter().filter_map(|file| Some((file, module_path(&file.path)?))).collect();
    let known: BTreeSet<Vec<String>> = modules.iter().map(|(_, module)| module.clone()).collect();
    // scope -> from -> to -> first place
    let mut graph: BTreeMap<Vec<String>, BTreeMap<String, BTreeMap<String, String>>> = BTreeMap::new();
    for (file, module) in &modules {
        for reference in references(&file.text, module) {
            let Some(target) = resolve(&reference, &known) else { continue };
            let from = &reference.module;
            let common = from.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= from.len() || common >= target.len() {
                continue; // itself, an ancestor or a descendant
            }
            graph
                .entry(from[..common].to_vec())
                .or_default()
                .entry(from[common].clone())
                .or_default()
                .entry(target[common].clone())
                .or_insert_with(|| format!("{}:{}", file.path, reference.line));
        }
    }
    let mut cycles = Vec::new();
    for (scope, edges) in &graph {
        for members in strongly_connected(edges).into_iter().filter(|set| set.len() > 1) {
            let inside: Vec<(String, String, String)> = members
                .iter()
                .flat_map(|from| {
                    edges
                        .get(from)
                        .into_iter()
                        .flatten()
                        .filter(|(to, _)| members.contains(*to))
                        .map(move |(to, place)| (from.clone(), to.clone(), place.clone()))
                })
                .collect();
            cycles.push(Cycle {
                scope: scope.clone(),
                members: members.into_iter().collect(),
                edges: inside,
            });
        }
    }
    cycles
}

/// `foo.rs` and `foo/mod.rs` are `foo`, `foo/bar.rs` is `foo::bar`, `main.rs` and `lib.rs` are
/// the root; `bin/` holds other crates.
fn module_path(relative: &str) -> Option<Vec<String>> {
    let mut parts: Vec<&str> = relative.split('/').collect();
    let file = parts.pop()?.strip_suffix(".rs")?;
    if parts.first() == Some(&"bin") {
        return None;
    }
    if !(file == "mod" || (parts.is_empty() && (file == "main" || file == "lib"))) {
        parts.push(file);
    }
    Some(parts.into_iter().map(str::to_owned).collect())
}

/// A path as written (`crate::a::b`, `super::x`, `child::y`), with the module it is written in.
#[derive(Debug, PartialEq)]
struct Reference {
    module: Vec<String>,
    path: Vec<String>,
    line: usize,
}

/// The known module `reference` names: the longest known prefix of its absolute path. A path
/// whose first segment is neither `crate`, `super` nor `self` counts only if it names a child
/// of the module it is written in (otherwise it is another crate or a local name).
fn resolve(reference: &Reference, known: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let mut absolute = reference.module.clone();
    let mut segments = reference.path.iter().peekable();
    match segments.peek().map(|s| s.as_str()) {
        Some("crate") => {
            absolute.clear();
            segments.next();
        }
        Some("self") => {
            segments.next();
        }
        Some("super") => {
            while segments.next_if(|s| *s == "super").is_some() {
                absolute.pop()?;
            }
        }
        Some(first) => {
            let mut child = absolute.clone();
            child.push(first.to_owned());
            if !known.contains(&child) {
                return None;
            }
        }
        None => return None,
    }
    absolute.extend(segments.cloned());
    (0..=absolute.len())
        .rev()
        .map(|len| &absolute[..len])
        .find(|prefix| known.contains(*prefix))
        .map(<[_]>::to_vec)
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

/// Every path in `text` (a file of module `module`) that could name a module: the leaves of
/// `use` trees, and `a::b` paths elsewhere, each with the (inline) module it is written in.
fn references(text: &str, module: &[String]) -> Vec<Reference> {
    let tokens = lex(text);
    let mut found = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    let current = |inline: &[(String, usize)]| -> Vec<String> {
        module.iter().cloned().chain(inline.iter().map(|(name, _)| name.clone())).collect()
    };
    while i < tokens.len() {
        let (token, line) = &tokens[i];
        let prev = i.checked_sub(1).map(|p| &tokens[p].0);
        match token {
            Token::Ident(word) if word == "mod" => {
                if let (Some((Token::Ident(name), _)), Some((Token::Punct('{'), _))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                    i += 2;
                    continue;
                }
            }
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                if inline.last().is_some_and(|(_, at)| *at == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Token::Ident(word) if word == "use" && starts_statement(prev) => {
                let mut at = i + 1;
                let mut leaves = Vec::new();
                use_tree(&tokens, &mut at, &mut Vec::new(), &mut leaves);
                let here = current(&inline);
                found.extend(leaves.into_iter().map(|path| Reference {
                    module: here.clone(),
                    path,
                    line: *line,
                }));
                while at < tokens.len() && tokens[at].0 != Token::Punct(';') {
                    at += 1;
                }
                i = at + 1;
                continue;
            }
            Token::Ident(first)
                if prev != Some(&Token::PathSep)
                    && prev != Some(&Token::Punct('$'))
                    && tokens.get(i + 1).map(|t| &t.0) == Some(&Token::PathSep) =>
            {
                let mut path = vec![first.clone()];
                let mut at = i + 1;
                while let (Some((Token::PathSep, _)), Some((Token::Ident(next), _))) =
                    (tokens.get(at), tokens.get(at + 1))
                {
                    path.push(next.clone());
                    at += 2;
                }
                found.push(Reference { module: current(&inline), path, line: *line });
                i = at;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// `use` begins a statement only after these (not in `impl Trait + use<'a>`).
fn starts_statement(prev: Option<&Token>) -> bool {
    match prev {
        None => true,
        Some(Token::Punct(c)) => matches!(c, ';' | '{' | '}' | ']' | ')'),
        Some(Token::Ident(word)) => word == "pub",
        Some(Token::PathSep) => false,
    }
}

/// Reads one use tree at `at` under `prefix`, adding each leaf path (a trailing `self` names
/// the prefix itself; a glob names the prefix).
fn use_tree(
    tokens: &[(Token, usize)],
    at: &mut usize,
    prefix: &mut Vec<String>,
    leaves: &mut Vec<Vec<String>>,
) {
    let depth = prefix.len();
    if tokens.get(*at).map(|t| &t.0) == Some(&Token::PathSep) {
        *at += 1; // `::std::…`: another crate
        prefix.push("::".to_owned());
    }
    loop {
        match tokens.get(*at).map(|t| &t.0) {
            Some(Token::Ident(word)) => {
                *at += 1;
                let more = tokens.get(*at).map(|t| &t.0) == Some(&Token::PathSep);
                if more {
                    *at += 1;
                    prefix.push(word.clone());
                    continue;
                }
                if word == "self" && depth > 0 {
                    leaves.push(prefix.clone());
                } else {
                    leaves.push([&prefix[..], std::slice::from_ref(word)].concat());
                }
                if matches!(tokens.get(*at), Some((Token::Ident(word), _)) if word == "as") {
                    *at += 2;
                }
                break;
            }
            Some(Token::Punct('*')) => {
                *at += 1;
                leaves.push(prefix.clone());
                break;
            }
            Some(Token::Punct('{')) => {
                *at += 1;
                loop {
                    match tokens.get(*at).map(|t| &t.0) {
                        Some(Token::Punct('}')) => {
                            *at += 1;
                            break;
                        }
                        Some(Token::Punct(',')) => *at += 1,
                        None | Some(Token::Punct(';')) => break,
                        Some(_) => use_tree(tokens, at, prefix, leaves),
                    }
                }
                break;
            }
            _ => break,
        }
    }
    prefix.truncate(depth);
    leaves.retain(|leaf| leaf.first().is_none_or(|first| first != "::"));
}

/// Identifiers, `::` and single punctuation, each with its line; comments, string, char and
/// byte literals, lifetimes and numbers are dropped.
pub(crate) fn lex(text: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let newlines =
        |from: usize, to: usize| chars[from..to.min(chars.len())].iter().filter(|c| **c == '\n').count();
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let start = i;
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut nesting = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    nesting += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    nesting -= 1;
                    i += 2;
                    if nesting == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(&chars, i + 1, 0);
        } else if c == '\'' {
            if next == Some('\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1; // a lifetime or label: its name follows as an identifier
            }
        } else if c.is_alphabetic() || c == '_' {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let hashes = chars[i..].iter().take_while(|c| **c == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && chars.get(i + hashes) == Some(&'"') {
                i = skip_string(&chars, i + hashes + 1, hashes);
            } else if word == "r" && hashes == 1 {
                i += 1; // raw identifier `r#name`: the name follows
            } else {
                tokens.push((Token::Ident(word), line));
            }
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c == ':' && next == Some(':') {
            tokens.push((Token::PathSep, line));
            i += 2;
        } else {
            if !c.is_whitespace() {
                tokens.push((Token::Punct(c), line));
            }
            i += 1;
        }
        line += newlines(start, i);
    }
    tokens
}

/// The index after a string whose body starts at `i`; `hashes` > 0 for a raw string, in which
/// backslashes do not escape.
fn skip_string(chars: &[char], mut i: usize, hashes: usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' if hashes == 0 => i += 2,
            '"' if chars[i + 1..].iter().take(hashes).filter(|c| **c == '#').count() == hashes => {
                return i + 1 + hashes;
            }
            _ => i += 1,
        }
    }
    i
}

/// Tarjan's strongly connected components, each sorted, in a stable order.
fn strongly_connected(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<BTreeSet<String>> {
    #[derive(Default)]
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(node: &'a str, edges: &'a BTreeMap<String, BTreeMap<String, String>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(node, n);
        s.low.insert(node, n);
        s.stack.push(node);
        s.on_stack.insert(node);
        for next in edges.get(node).into_iter().flat_map(BTreeMap::keys) {
            if !s.index.contains_key(next.as_str()) {
                visit(next, edges, s);
                let low = s.low[node].min(s.low[next.as_str()]);
                s.low.insert(node, low);
            } else if s.on_stack.contains(next.as_str()) {
                let low = s.low[node].min(s.index[next.as_str()]);
                s.low.insert(node, low);
            }
        }
        if s.low[node] == s.index[node] {
            let mut component = BTreeSet::new();
            while let Some(member) = s.stack.pop() {
                s.on_stack.remove(member);
                component.insert(member.to_owned());
                if member == node {
                    break;
                }
            }
            s.components.push(component);
        }
    }
    let mut state = State::default();
    let nodes: BTreeSet<&str> = edges
        .iter()
        .flat_map(|(from, to)| std::iter::once(from.as_str()).chain(to.keys().map(String::as_str)))
        .collect();
    for node in nodes {
        if !state.index.contains_key(node) {
            visit(node, edges, &mut state);
        }
    }
    state.components.sort();
    state.components
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_of(files: &[(&str, &str)]) -> Vec<SourceFile> {
        files
            .iter()
            .map(|(path, text)| SourceFile { path: (*path).to_owned(), text: (*text).to_owned() })
            .collect()
    }

    /// The cycles as `scope: member member …` lines.
    fn check(files: &[(&str, &str)], expected: &[&str]) {
        let found: Vec<String> = find_cycles(&crate_of(files))
            .iter()
            .map(|cycle| format!("{}: {}", cycle.scope.join("::"), cycle.members.join(" ")))
            .collect();
        assert_eq!(found, expected);
    }

    #[test]
    fn a_pair_that_imports_each_other_is_a_cycle() {
        check(
            &[
                ("main.rs", "mod ebpf;\nmod setup;\n"),
                ("ebpf.rs", "use crate::{cmd, setup::{self, TOOLCHAIN}};\n"),
                ("setup.rs", "fn f() { crate::ebpf::isolate(); }\n"),
                ("cmd.rs", ""),
            ],
            &[": ebpf setup"],
        );
    }

    #[test]
    fn a_one_way_chain_passes() {
        check(
            &[
                ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
                ("a.rs", "use crate::b::Thing;\n"),
                ("b.rs", "use crate::c;\nfn f() -> c::X { c::X }\n"),
                ("c.rs", "use std::fmt;\n"),
            ],
            &[],
        );
    }

    #[test]
    fn a_longer_loop_is_one_cycle_with_its_edges() {
        let cycles = find_cycles(&crate_of(&[
            ("lib.rs", ""),
            ("a.rs", "use crate::b;"),
            ("b.rs", "\n\nuse crate::c::{self as see};"),
            ("c/mod.rs", "pub fn f() { crate::a::g() }"),
            ("d.rs", "use crate::a;"),
        ]));
        assert_eq!(
            cycles,
            [Cycle {
                scope: vec![],
                members: vec!["a".into(), "b".into(), "c".into()],
                edges: vec![
                    ("a".into(), "b".into(), "a.rs:1".into()),
                    ("b".into(), "c".into(), "b.rs:3".into()),
                    ("c".into(), "a".into(), "c/mod.rs:1".into()),
                ],
            }]
        );
    }

    #[test]
    fn submodules_of_a_folder_are_checked_among_themselves() {
        check(
            &[
                ("main.rs", "mod demo;"),
                ("demo/mod.rs", "mod network;\nmod processes;\nuse self::network::Host;\n"),
                ("demo/network.rs", "use super::processes::stop;\nuse super::POLL;\n"),
                ("demo/processes.rs", "fn f() { super::network::delete(); }"),
            ],
            &["demo: network processes"],
        );
        // A parent using its children and the children using the parent is no cycle.
        check(
            &[
                ("demo/mod.rs", "mod network;\nuse network::Host;\nfn f() { network::create() }"),
                ("demo/network.rs", "use super::POLL;\nuse crate::demo::SERVER;\n"),
            ],
            &[],
        );
    }

    #[test]
    fn a_submodule_importing_another_top_level_module_is_an_edge_of_its_parent() {
        check(
            &[
                ("demo/mod.rs", "mod network;"),
                ("demo/network.rs", "use crate::cmd;"),
                ("cmd.rs", "use crate::demo::network::BRIDGE;"),
            ],
            &[": cmd demo"],
        );
    }

    #[test]
    fn inline_modules_resolve_super_from_where_they_are() {
        // `super` in `mod tests` is `b` itself, not the crate root; `helper` is not module `a`.
        check(
            &[
                ("a.rs", "use crate::b;"),
                (
                    "b.rs",
                    "fn helper() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::helper;\n}\n",
                ),
                ("helper.rs", "use crate::a;"),
            ],
            &[],
        );
        // Test code counts: a test module importing back closes a cycle.
        check(
            &[
                ("a.rs", "use crate::b;"),
                ("b.rs", "#[cfg(test)]\nmod tests {\n    use crate::a::fixture;\n}\n"),
            ],
            &[": a b"],
        );
    }

    #[test]
    fn comments_strings_and_macros_do_not_import() {
        check(
            &[
                ("a.rs", "use crate::b;"),
                (
                    "b.rs",
                    "//! see crate::a::run\n/* crate::a /* nested */ crate::a */\n\
                     const Q: char = '\"'; const S: &str = \"crate::a::x \\\" crate::a\";\n\
                     const R: &str = r#\"crate::a \"# ; fn f<'a>(x: &'a str) {}\n\
                     macro_rules! m { () => { $crate::a::x() } }\n",
                ),
            ],
            &[],
        );
        // …but a real path after all of that still does.
        check(
            &[("a.rs", "use crate::b;"), ("b.rs", "const Q: char = '\"';\nfn f() { crate::a::g() }")],
            &[": a b"],
        );
    }

    #[test]
    fn another_crate_with_the_same_name_is_not_a_module() {
        check(
            &[
                ("a.rs", "use crate::b;"),
                ("b.rs", "use ::a::x;\nfn f() { a::y() }"), // extern crate `a`: b has no child `a`
            ],
            &[],
        );
    }

    #[test]
    fn file_paths_name_modules() {
        let path = |p: &str| module_path(p).map(|m| m.join("::"));
        assert_eq!(path("main.rs").as_deref(), Some(""));
        assert_eq!(path("lib.rs").as_deref(), Some(""));
        assert_eq!(path("demo.rs").as_deref(), Some("demo"));
        assert_eq!(path("demo/mod.rs").as_deref(), Some("demo"));
        assert_eq!(path("demo/network.rs").as_deref(), Some("demo::network"));
        assert_eq!(path("enforce/nft/main.rs").as_deref(), Some("enforce::nft::main"));
        assert_eq!(path("bin/tool.rs"), None);
        assert_eq!(path("notes.txt"), None);
    }

    #[test]
    fn use_trees_expand_to_their_leaves() {
        let paths: Vec<String> = references(
            "pub(crate) use crate::{cmd, ebpf::{self, X as Y}, setup::*};\nuse ::std::fmt;\nuse std::io;",
            &[],
        )
        .into_iter()
        .map(|r| r.path.join("::"))
        .collect();
        assert_eq!(paths, ["crate::cmd", "crate::ebpf", "crate::ebpf::X", "crate::setup", "std::io"]);
    }
}
