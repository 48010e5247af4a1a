//! Every file an operator hands the control plane (ruleset files today; YAML or JSON) is read
//! by [`parse`]: bounded in bytes by its caller, and bounded in nodes here, before a value is
//! built. YAML anchors and aliases are refused outright: an alias re-reads its anchor's whole
//! subtree, so a few KB of nested aliases expand to gigabytes (REL-1). The refusal comes from
//! the same libyaml event stream `serde_norway` deserializes, so the check and the parse can
//! never disagree about where an alias is.

use std::ffi::CStr;
use std::mem::MaybeUninit;

use serde::de::DeserializeOwned;
use unsafe_libyaml_norway as unsafe_yaml;

use crate::error::Error;

/// Most YAML nodes (scalars, sequences, mappings) one file may hold. Without aliases nodes are
/// written out, so this also bounds what the parse builds; the largest valid ruleset (500 rules
/// of 100 peers and 50 services) needs well under it.
pub const MAX_FILE_NODES: usize = 200_000;

/// Parses `text`, read from `origin` (a path, `-` for stdin), into `T`. Refused, before any
/// value is built, with the line and column: an anchor or alias, more than
/// [`MAX_FILE_NODES`] nodes. YAML is a superset of JSON, so this takes both.
pub fn parse<T: DeserializeOwned>(origin: &str, text: &str) -> Result<T, Error> {
    match scan(text.as_bytes()) {
        Scan::Plain => {}
        Scan::Anchor { line, column, name } => {
            return Err(Error::Invalid(format!(
                "{origin}: line {line} column {column}: YAML anchors and aliases are not accepted \
                 (found `&{name}`); write the value out in full"
            )));
        }
        Scan::Alias { line, column, name } => {
            return Err(Error::Invalid(format!(
                "{origin}: line {line} column {column}: YAML anchors and aliases are not accepted \
                 (found `*{name}`); write the value out in full"
            )));
        }
        Scan::TooMany { line, column } => {
            return Err(Error::Invalid(format!(
                "{origin}: line {line} column {column}: more than the {MAX_FILE_NODES} YAML nodes \
                 a file may hold"
            )));
        }
    }
    // A syntax error stops the scan as it stops the parse; the parse words it (with its place).
    serde_norway::from_str(text).map_err(|e| Error::Invalid(format!("{origin}: {e}")))
}

#[derive(Debug, PartialEq, Eq)]
enum Scan {
    /// No anchor, alias or excess node before the end or the first syntax error.
    Plain,
    Anchor {
        line: u64,
        column: u64,
        name: String,
    },
    Alias {
        line: u64,
        column: u64,
        name: String,
    },
    TooMany {
        line: u64,
        column: u64,
    },
}

/// One event's kind and anchor, copied out of libyaml's event before it is freed.
enum Seen {
    End,
    Node(Option<String>),
    Alias(String),
    Other,
}

/// Walks libyaml's event stream over `input`: the events only, no value is built, and each
/// event is freed before the next (memory bounded by the input, not by what it would expand to).
fn scan(input: &[u8]) -> Scan {
    let Some(mut parser) = Parser::new(input) else { return Scan::Plain };
    let mut nodes = 0usize;
    loop {
        let Some((seen, mark)) = parser.next() else { return Scan::Plain };
        let (line, column) = (mark.line + 1, mark.column + 1);
        match seen {
            Seen::End => return Scan::Plain,
            Seen::Other => {}
            Seen::Alias(name) => return Scan::Alias { line, column, name },
            Seen::Node(Some(name)) => return Scan::Anchor { line, column, name },
            Seen::Node(None) => {
                nodes += 1;
                if nodes > MAX_FILE_NODES {
                    return Scan::TooMany { line, column };
                }
            }
        }
    }
}

/// libyaml's parser over a borrowed input, deleted on drop.
struct Parser<'a> {
    sys: Box<MaybeUninit<unsafe_yaml::yaml_parser_t>>,
    _input: &'a [u8],
}

impl<'a> Parser<'a> {
    #[allow(unsafe_code)]
    fn new(input: &'a [u8]) -> Option<Self> {
        let mut sys = Box::new(MaybeUninit::<unsafe_yaml::yaml_parser_t>::uninit());
        let p = sys.as_mut_ptr();
        // SAFETY: `p` points at writable memory for a parser, which initialize fills; on
        // failure nothing was allocated. The input outlives the parser (the lifetime `'a`),
        // and `Drop` deletes the parser before the borrow ends.
        unsafe {
            if !unsafe_yaml::yaml_parser_initialize(p).ok {
                return None;
            }
            unsafe_yaml::yaml_parser_set_encoding(p, unsafe_yaml::YAML_UTF8_ENCODING);
            unsafe_yaml::yaml_parser_set_input_string(p, input.as_ptr(), input.len() as u64);
        }
        Some(Parser { sys, _input: input })
    }

    /// The next event, `None` at a syntax error (or after the end).
    #[allow(unsafe_code)]
    fn next(&mut self) -> Option<(Seen, unsafe_yaml::yaml_mark_t)> {
        let p = self.sys.as_mut_ptr();
        let mut event = MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
        // SAFETY: the parser was initialized in `new`; it is not driven after an error or the
        // end (`scan` stops at both; libyaml would give empty events, read as the end).
        // On success `event` is initialized, its anchor pointers are NUL-terminated strings or
        // null, read only for the variant its type names, copied, and the event is deleted once.
        unsafe {
            if !unsafe_yaml::yaml_parser_parse(p, event.as_mut_ptr()).ok {
                return None;
            }
            let e = event.as_mut_ptr();
            let anchor = |ptr: *const u8| {
                (!ptr.is_null()).then(|| CStr::from_ptr(ptr.cast()).to_string_lossy().into_owned())
            };
            let seen = match (*e).type_ {
                unsafe_yaml::YAML_STREAM_END_EVENT | unsafe_yaml::YAML_NO_EVENT => Seen::End,
                unsafe_yaml::YAML_ALIAS_EVENT => {
                    Seen::Alias(anchor((*e).data.alias.anchor).unwrap_or_default())
                }
                unsafe_yaml::YAML_SCALAR_EVENT => Seen::Node(anchor((*e).data.scalar.anchor)),
                unsafe_yaml::YAML_SEQUENCE_START_EVENT => Seen::Node(anchor((*e).data.sequence_start.anchor)),
                unsafe_yaml::YAML_MAPPING_START_EVENT => Seen::Node(anchor((*e).data.mapping_start.anchor)),
                _ => Seen::Other,
            };
            let mark = (*e).start_mark;
            unsafe_yaml::yaml_event_delete(e);
            Some((seen, mark))
        }
    }
}

impl Drop for Parser<'_> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: initialized in `new` (a parser is only built after initialize succeeded).
        unsafe { unsafe_yaml::yaml_parser_delete(self.sys.as_mut_ptr()) }
    }
}

impl std::fmt::Debug for Parser<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Parser")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bomb(levels: usize, width: usize) -> String {
        let mut text = String::from("a0: &a0 [x]\n");
        for i in 1..levels {
            let refs = vec![format!("*a{}", i - 1); width].join(", ");
            text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        text
    }

    #[test]
    fn anchors_and_aliases_are_refused_with_their_place() {
        let err = parse::<serde_norway::Value>("rs.yaml", "name: x\nscope: &s {app: [web]}\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "rs.yaml: line 2 column 8: YAML anchors and aliases are not accepted (found `&s`); \
             write the value out in full"
        );
        // An alias to an anchor is refused at the anchor, the first of the two in the file.
        let err = parse::<serde_norway::Value>("f", &bomb(9, 9)).unwrap_err().to_string();
        assert!(err.contains("line 1 column 5") && err.contains("`&a0`"), "{err}");
        // An alias without an anchor is refused as an alias.
        let err = parse::<serde_norway::Value>("f", "a: *nothing\n").unwrap_err().to_string();
        assert!(err.contains("line 1 column 4") && err.contains("`*nothing`"), "{err}");
    }

    #[test]
    fn quoted_ampersands_and_stars_are_text() {
        let v: serde_norway::Value = parse("f", "a: '&x'\nb: \"*y\"\nc: p&q*r\nd: |\n  &z *w\n").unwrap();
        assert_eq!(v["a"].as_str(), Some("&x"));
        assert_eq!(v["b"].as_str(), Some("*y"));
        assert_eq!(v["c"].as_str(), Some("p&q*r"));
        assert_eq!(v["d"].as_str(), Some("&z *w\n"));
    }

    #[test]
    fn nodes_are_bounded() {
        let ok = format!("[{}]", vec!["1"; MAX_FILE_NODES - 1].join(","));
        assert_eq!(parse::<Vec<u8>>("f", &ok).unwrap().len(), MAX_FILE_NODES - 1);
        let over = format!("[{}]", vec!["1"; MAX_FILE_NODES].join(","));
        let err = parse::<Vec<u8>>("f", &over).unwrap_err().to_string();
        assert!(err.contains("more than the 200000 YAML nodes"), "{err}");
    }

    #[test]
    fn syntax_errors_and_json_read_as_before() {
        let err = parse::<serde_norway::Value>("f", "a: [1, 2\n").unwrap_err().to_string();
        assert!(err.starts_with("f: ") && err.contains("line"), "{err}");
        let v: serde_norway::Value = parse("f", r#"{"a": [1, "&x"]}"#).unwrap();
        assert_eq!(v["a"][1].as_str(), Some("&x"));
        assert_eq!(parse::<serde_norway::Value>("f", "").unwrap(), serde_norway::Value::Null);
    }
}
