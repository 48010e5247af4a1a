//! Durations on the command line (`--ttl 30d`, `--since 1h`, `--cert-lifetime 24h`), read by
//! humantime, and a `--since` as the instant it names or the API's parameter: `30d`, `12h`, `90m` and `3600s` as before, and also `1h30m`, `2 days`, `500ms`.

/// The forms a user is pointed at when a duration does not parse.
const EXAMPLES: &str = "write e.g. 30d, 12h, 90m or 3600s";

/// `text` as a duration; `what` names the flag in the error (`ttl`, `duration`).
pub fn parse(what: &str, text: &str) -> anyhow::Result<std::time::Duration> {
    humantime::parse_duration(text).map_err(|e| anyhow::anyhow!("{what} {text:?}: {e}; {EXAMPLES}"))
}

/// A clap value parser for duration flags.
pub fn arg(text: &str) -> Result<std::time::Duration, String> {
    parse("duration", text).map_err(|e| e.to_string())
}

/// The instant `back` before now; a span reaching past 1970 (no evidence is older) means all.
pub fn since(back: &std::time::Duration) -> chrono::DateTime<chrono::Utc> {
    innerwall_control_plane::input::since(chrono::Utc::now(), *back)
}

/// `back` as the API's `since` parameter, exactly (the API measures it back from its now, as
/// [`since`] does here).
pub fn since_param(back: &std::time::Duration) -> String {
    match back.subsec_nanos() {
        0 => format!("{}s", back.as_secs()),
        nanos => format!("{}s {nanos}ns", back.as_secs()),
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_every_form_documented_before_humantime() {
        let check = |text: &str, seconds: u64| {
            assert_eq!(parse("ttl", text).unwrap().as_secs(), seconds, "{text}");
        };
        check("30d", 30 * 86_400);
        check("12h", 12 * 3_600);
        check("1h", 3_600);
        check("90m", 90 * 60);
        check("15m", 15 * 60);
        check("3600s", 3_600);
        check("60s", 60);
        check("24h", 86_400);
        check("7d", 7 * 86_400);
        check(" 2h ", 7_200);
        check("0s", 0);
        check("1h30m", 5_400);
    }

    #[test]
    fn says_what_was_wrong_and_what_to_write() {
        let check = |text: &str, expected: &str| {
            assert_eq!(parse("ttl", text).unwrap_err().to_string(), expected, "{text}");
        };
        check(
            "10",
            "ttl \"10\": time unit needed, for example 10sec or 10ms; write e.g. 30d, 12h, 90m or 3600s",
        );
        check("h", "ttl \"h\": expected number at 0; write e.g. 30d, 12h, 90m or 3600s");
        check("", "ttl \"\": value was empty; write e.g. 30d, 12h, 90m or 3600s");
    }
}
