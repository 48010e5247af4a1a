//! What every value from a client must be before it is used (REL-1): free text without NUL or
//! control characters and within its field's length, and instants within the range the
//! control plane accepts. Pure; the library calls run these checks themselves, so the API and
//! the CLI refuse the same input with the same words.

use chrono::{DateTime, NaiveDate, Utc};

use crate::error::Error;

/// Free text (a description, a reason, a name): at most `max` bytes, and no control character
/// (NUL, escape, newline, DEL, C1 …): Postgres refuses NUL in text, and the rest would reach
/// an operator's terminal. `field` names the field in the refusal.
pub fn text(field: &str, value: &str, max: usize) -> Result<(), Error> {
    if value.len() > max {
        return Err(Error::Invalid(format!("{field}: at most {max} bytes, not {}", value.len())));
    }
    if let Some((at, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(Error::Invalid(format!(
            "{field}: a control character ({}) at byte {at}; write plain text without NUL, escapes or line breaks",
            c.escape_unicode()
        )));
    }
    Ok(())
}

/// Text from an agent kept for an operator (a reported failure): at most `max` characters,
/// each control character (NUL, which Postgres refuses, included) replaced by U+FFFD.
pub fn printable(value: &str, max: usize) -> String {
    value.chars().take(max).map(|c| if c.is_control() { '\u{fffd}' } else { c }).collect()
}

/// The earliest instant a client may name: no evidence, audit or token is older.
pub const EARLIEST: DateTime<Utc> = DateTime::UNIX_EPOCH;

/// The latest instant a client may name (exclusive), well inside every clock type the control
/// plane converts to (chrono's nanosecond arithmetic ends in 2262).
pub fn latest() -> DateTime<Utc> {
    NaiveDate::from_ymd_opt(2200, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|t| t.and_utc())
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `at` if it lies in the accepted range `[EARLIEST, latest())`; otherwise a refusal naming
/// `field` and the range.
pub fn instant(field: &str, at: DateTime<Utc>) -> Result<DateTime<Utc>, Error> {
    let latest = latest();
    if at < EARLIEST || at >= latest {
        return Err(Error::Invalid(format!(
            "{field} {}: out of range; times from {} to before {} are accepted",
            at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
            EARLIEST.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            latest.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        )));
    }
    Ok(at)
}

/// The instant `back` before `now`; a span reaching past [`EARLIEST`] (or past what any clock
/// holds) means everything since [`EARLIEST`].
pub fn since(now: DateTime<Utc>, back: std::time::Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(back)
        .ok()
        .and_then(|back| now.checked_sub_signed(back))
        .map_or(EARLIEST, |at| at.max(EARLIEST))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_refuses_control_characters_and_length() {
        assert!(text("description", "a web tier — ünïcode", 64).is_ok());
        assert!(text("description", "", 64).is_ok());
        for bad in ["a\0b", "\u{1b}[31mred", "two\nlines", "tab\there", "\u{7f}", "\u{85}"] {
            let e = text("description", bad, 64).unwrap_err().to_string();
            assert!(e.starts_with("description: a control character"), "{bad:?}: {e}");
        }
        let e = text("reason", &"x".repeat(65), 64).unwrap_err().to_string();
        assert_eq!(e, "reason: at most 64 bytes, not 65");
        assert_eq!(printable("a\0b\u{1b}[1mc", 4), "a\u{fffd}b\u{fffd}");
    }

    #[test]
    fn instants_outside_the_range_are_refused_naming_it() {
        let year = |y| NaiveDate::from_ymd_opt(y, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap().and_utc();
        assert!(instant("from", year(2026)).is_ok());
        assert!(instant("from", EARLIEST).is_ok());
        for bad in [year(1600), year(1969), year(2200), year(9999), DateTime::<Utc>::MIN_UTC] {
            let e = instant("from", bad).unwrap_err().to_string();
            assert!(e.contains("1970-01-01T00:00:00Z") && e.contains("2200-01-01T00:00:00Z"), "{e}");
        }
        assert_eq!(since(year(2026), std::time::Duration::MAX), EARLIEST);
        assert_eq!(since(year(2026), std::time::Duration::from_secs(86_400 * 365 * 100)), EARLIEST);
    }
}
