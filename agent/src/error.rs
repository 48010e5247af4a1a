//! The one way the agent prints an error with its causes, for logs, heartbeats and FAILED acks
//! (the error enums themselves live with the module whose boundary they describe).

use std::error::Error;

/// `err` and each of its sources, joined with `": "`. A source whose text the message already
/// ends with (an error that spells out its cause) is not repeated.
pub fn chain(err: &(dyn Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("inner {0}")]
    struct Inner(u8);

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("reading x")]
        Terse(#[source] Inner),
        #[error("reading y: {0}")]
        Spelled(#[source] Inner),
    }

    #[test]
    fn each_cause_is_printed_once() {
        assert_eq!(chain(&Outer::Terse(Inner(1))), "reading x: inner 1");
        assert_eq!(chain(&Outer::Spelled(Inner(2))), "reading y: inner 2");
    }
}
