//! The transport rule of `cargo xtask lint` (ARCHITECTURE.md, "Transport types stay at the
//! edge"): outside `wire/src/convert.rs`, no production source matches on a prost `oneof` or
//! names a protobuf enum's variant. Both would let a protobuf number or an unvalidated message
//! into domain code; the edge converts to `wire` types instead.
//!
//! The names come from the contract itself: each `oneof` becomes a prost module named after its
//! message in snake case (`SyncRequest` → `sync_request::`), and each `enum` a Rust enum whose
//! variants are reached as `proto::Name::Variant`. The scan reads tokens (`cycles::lex`), so
//! comments and strings do not count. Tests are not scanned: hostile-client tests craft raw
//! messages on purpose.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::cycles::{Token, lex};
use crate::walk;

/// The production sources the rule covers, relative to the workspace root.
pub const SOURCES: &[&str] = &["control-plane/src", "agent/src", "wire/src"];

/// The one file allowed to touch prost types freely.
pub const BOUNDARY: &str = "wire/src/convert.rs";

/// What the contract generates that only the boundary may match on.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Generated {
    /// Modules prost makes for `oneof`s (`sync_request`).
    pub oneof_modules: BTreeSet<String>,
    /// Protobuf enums (`AckStatus`).
    pub enums: BTreeSet<String>,
}

fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_lowercase());
    }
    out
}

/// The oneof modules and enums of `.proto` texts: a `oneof` belongs to the innermost `message`
/// open around it.
pub fn generated<'a>(protos: impl IntoIterator<Item = &'a str>) -> Generated {
    let mut found = Generated::default();
    for text in protos {
        // Words and braces, comments dropped.
        let mut tokens: Vec<String> = Vec::new();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut word = String::new();
            for c in code.chars().chain([' ']) {
                if c.is_alphanumeric() || c == '_' {
                    word.push(c);
                    continue;
                }
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                if c == '{' || c == '}' {
                    tokens.push(c.to_string());
                }
            }
        }
        // The blocks open: `Some(name)` for a message, `None` for anything else.
        let mut open: Vec<Option<String>> = Vec::new();
        for (i, token) in tokens.iter().enumerate() {
            match token.as_str() {
                "{" => {
                    let (keyword, name) = match i {
                        0 | 1 => ("", ""),
                        _ => (tokens[i - 2].as_str(), tokens[i - 1].as_str()),
                    };
                    match keyword {
                        "message" => open.push(Some(name.to_owned())),
                        "enum" => {
                            found.enums.insert(name.to_owned());
                            open.push(None);
                        }
                        "oneof" => {
                            if let Some(Some(message)) = open.iter().rev().find(|m| m.is_some()) {
                                found.oneof_modules.insert(snake_case(message));
                            }
                            open.push(None);
                        }
                        _ => open.push(None),
                    }
                }
                "}" => {
                    open.pop();
                }
                _ => {}
            }
        }
    }
    found
}

/// Where `text` matches on a oneof or names a protobuf enum's variant: (line, what).
pub fn violations(text: &str, generated: &Generated) -> Vec<(usize, String)> {
    let tokens = lex(text);
    let mut found = Vec::new();
    for (i, (token, line)) in tokens.iter().enumerate() {
        let Token::Ident(name) = token else { continue };
        let next = tokens.get(i + 1).map(|(t, _)| t);
        let after = tokens.get(i + 2).map(|(t, _)| t);
        if generated.oneof_modules.contains(name) && next == Some(&Token::PathSep) {
            found.push((*line, format!("`{name}::` matches on a oneof")));
        } else if name == "proto"
            && next == Some(&Token::PathSep)
            && let Some(Token::Ident(e)) = after
            && generated.enums.contains(e)
            && tokens.get(i + 3).map(|(t, _)| t) == Some(&Token::PathSep)
            && let Some((Token::Ident(variant), _)) = tokens.get(i + 4)
        {
            found.push((*line, format!("`proto::{e}::{variant}` names a protobuf enum")));
        }
    }
    found
}

/// Scans [`SOURCES`] under `root` against the contract in `protos`; fails naming each violation.
pub fn check(root: &Path, protos: &Path) -> Result<()> {
    let texts: Vec<String> = walk::files_with_extension(protos, "proto")?
        .iter()
        .map(|p| fs::read_to_string(p).with_context(|| format!("while reading {}", p.display())))
        .collect::<Result<_>>()?;
    let generated = generated(texts.iter().map(String::as_str));
    let mut total = 0;
    let mut scanned = 0;
    for dir in SOURCES {
        for file in walk::files_with_extension(&root.join(dir), "rs")? {
            let relative: PathBuf = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
            if relative == Path::new(BOUNDARY) {
                continue;
            }
            let text =
                fs::read_to_string(&file).with_context(|| format!("while reading {}", file.display()))?;
            scanned += 1;
            for (line, what) in violations(&text, &generated) {
                println!(
                    "{}:{line}: {what}; convert in {BOUNDARY} and use the wire type",
                    relative.display()
                );
                total += 1;
            }
        }
    }
    if total > 0 {
        bail!("{total} use(s) of prost oneofs or enum variants outside {BOUNDARY} (listed above)");
    }
    println!(
        "transport: no prost oneof or enum variant outside {BOUNDARY} ({scanned} files, {} oneofs, {} enums)",
        generated.oneof_modules.len(),
        generated.enums.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTRACT: &str = "syntax = \"proto3\";
        service AgentService { rpc Sync(stream SyncRequest) returns (stream SyncResponse); }
        enum AckStatus { ACK_STATUS_UNSPECIFIED = 0; ACK_STATUS_APPLIED = 1; }
        message SyncRequest {
          // oneof commented { }
          oneof msg { Hello hello = 1; }
          message Nested { oneof inner { uint32 a = 1; } }
        }
        message Plain { string s = 1; }";

    #[test]
    fn the_contract_names_its_oneofs_and_enums() {
        let g = generated([CONTRACT]);
        assert_eq!(g.oneof_modules, BTreeSet::from(["sync_request".to_owned(), "nested".to_owned()]));
        assert_eq!(g.enums, BTreeSet::from(["AckStatus".to_owned()]));
    }

    #[test]
    fn matches_on_oneofs_and_enum_variants_are_found_and_nothing_else() {
        let g = generated([CONTRACT]);
        let bad = "use innerwall_wire::proto::{self, sync_request};
            fn f(m: sync_request::Msg) { let s = proto::AckStatus::Applied; }";
        let found = violations(bad, &g);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].0, 2);
        assert!(found[1].1.contains("proto::AckStatus::Applied"), "{found:?}");
        let fine = "// sync_request::Msg in a comment
            fn f(m: &proto::SyncRequest) -> AgentMessage { let s = \"proto::AckStatus::Applied\"; AckStatus::Applied; todo!() }
            fn g() { proto::agent_service_client::AgentServiceClient::new(c); proto::WorkloadPolicy::from(p); }";
        assert_eq!(violations(fine, &g), vec![]);
    }

    /// The workspace as it is keeps the rule (what `cargo xtask lint` runs).
    #[test]
    fn the_workspace_keeps_transport_types_at_the_edge() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        check(root, &root.join(crate::wire::PROTOS)).unwrap();
    }
}
