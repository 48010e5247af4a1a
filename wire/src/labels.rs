//! Label grammar (IDN-6). Labels live in the registry and select workloads; they never reach an
//! agent and never appear in a certificate.
//!
//! Key: 1–63 characters of `[A-Za-z0-9._/-]`; value: 1–63 characters of `[A-Za-z0-9._-]`; both
//! start and end with an ASCII letter or digit.

use std::fmt;
use std::str::FromStr;

pub const MAX_LABEL_LEN: usize = 63;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelPart {
    Key,
    Value,
}

impl fmt::Display for LabelPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LabelPart::Key => "label key",
            LabelPart::Value => "label value",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("{part} must not be empty")]
    Empty { part: LabelPart },
    #[error("{part} {text:?} is {len} characters; at most {MAX_LABEL_LEN} are allowed")]
    TooLong { part: LabelPart, text: String, len: usize },
    #[error("{part} {text:?} contains {ch:?} at position {pos}; allowed are {allowed}")]
    Char { part: LabelPart, text: String, ch: char, pos: usize, allowed: &'static str },
    #[error("{part} {text:?} must start and end with a letter or digit")]
    Edge { part: LabelPart, text: String },
    #[error("label {text:?} must be written key=value")]
    Syntax { text: String },
}

fn validate(part: LabelPart, text: &str) -> Result<(), LabelError> {
    let (extra, allowed): (&[char], _) = match part {
        LabelPart::Key => (&['.', '_', '/', '-'], "A-Z a-z 0-9 . _ / -"),
        LabelPart::Value => (&['.', '_', '-'], "A-Z a-z 0-9 . _ -"),
    };
    if text.is_empty() {
        return Err(LabelError::Empty { part });
    }
    let len = text.chars().count();
    if len > MAX_LABEL_LEN {
        return Err(LabelError::TooLong { part, text: text.to_owned(), len });
    }
    if let Some((pos, ch)) =
        text.chars().enumerate().find(|(_, c)| !(c.is_ascii_alphanumeric() || extra.contains(c)))
    {
        return Err(LabelError::Char { part, text: text.to_owned(), ch, pos, allowed });
    }
    let bytes = text.as_bytes();
    if !bytes[0].is_ascii_alphanumeric() || !bytes[bytes.len() - 1].is_ascii_alphanumeric() {
        return Err(LabelError::Edge { part, text: text.to_owned() });
    }
    Ok(())
}

macro_rules! label_part {
    ($name:ident, $part:expr) => {
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub fn new(text: &str) -> Result<Self, LabelError> {
                validate($part, text)?;
                Ok(Self(text.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = LabelError;
            fn from_str(s: &str) -> Result<Self, LabelError> {
                Self::new(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

label_part!(LabelKey, LabelPart::Key);
label_part!(LabelValue, LabelPart::Value);

/// One `key=value` pair.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Label {
    pub key: LabelKey,
    pub value: LabelValue,
}

impl FromStr for Label {
    type Err = LabelError;

    fn from_str(s: &str) -> Result<Self, LabelError> {
        let (key, value) = s.split_once('=').ok_or_else(|| LabelError::Syntax { text: s.to_owned() })?;
        Ok(Label { key: key.parse()?, value: value.parse()? })
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expected: Result<(), &str>) {
        let got = input.parse::<Label>().map(|_| ()).map_err(|e| e.to_string());
        match (&got, expected) {
            (Ok(()), Ok(())) => {}
            (Err(msg), Err(want)) => assert!(msg.contains(want), "{input:?}: {msg:?} lacks {want:?}"),
            _ => panic!("{input:?}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn label_grammar_table() {
        let max = "a".repeat(63);
        let over = "a".repeat(64);
        let cases: Vec<(String, Result<(), &str>)> = vec![
            ("app=checkout".into(), Ok(())),
            ("k8s.io/app=web-1".into(), Ok(())),
            ("team_a=b.c_d-e".into(), Ok(())),
            ("A=Z".into(), Ok(())),
            ("0=9".into(), Ok(())),
            (format!("{max}={max}"), Ok(())),
            (format!("{over}=x"), Err("label key \"aaaa")),
            (format!("x={over}"), Err("is 64 characters; at most 63")),
            ("=x".into(), Err("label key must not be empty")),
            ("x=".into(), Err("label value must not be empty")),
            ("".into(), Err("must be written key=value")),
            ("app".into(), Err("must be written key=value")),
            ("a=b=c".into(), Err("contains '='")),
            ("app=a/b".into(), Err("label value \"a/b\" contains '/'")),
            ("-app=x".into(), Err("must start and end with a letter or digit")),
            ("app.=x".into(), Err("must start and end")),
            ("/app=x".into(), Err("must start and end")),
            ("app=x_".into(), Err("must start and end")),
            ("app=.x".into(), Err("must start and end")),
            ("ap p=x".into(), Err("contains ' ' at position 2")),
            ("app=x\n".into(), Err("contains '\\n'")),
            ("app=caf\u{e9}".into(), Err("contains 'é' at position 3")),
            ("\u{430}pp=x".into(), Err("contains 'а' at position 0")),
            ("app=\u{1F600}".into(), Err("contains")),
            ("app=x\u{0}".into(), Err("contains '\\0'")),
            (format!("{}=x", "é".repeat(64)), Err("is 64 characters")),
        ];
        for (input, expected) in cases {
            check(&input, expected);
        }
    }

    #[test]
    fn label_grammar_display_round_trips() {
        let l: Label = "k8s.io/app=web-1".parse().unwrap();
        assert_eq!(l.to_string(), "k8s.io/app=web-1");
        assert_eq!(l.key.as_str(), "k8s.io/app");
        assert_eq!(LabelValue::new("web-1").unwrap(), l.value);
    }
}
