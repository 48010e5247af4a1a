//! Bounded results (FLOW-6, OPS-2, REL-1): a page of rows, whether more follow, and an opaque
//! cursor to the next page. Pagination is by keyset: every query orders by a unique key and the
//! cursor is the last row's key, so walking the cursors yields every row exactly once, and no
//! query stops at a limit without saying so. Flow queries, the workload list and the HTTP API
//! share it.
//!
//! A page stops at [`PAGE_BYTES`] of rows (as JSON) as well as at its row count, so no page may
//! weigh more than that whatever its rows hold (only a single row heavier than the budget makes
//! a page of its own, and such rows are bounded where they are written). A cursor is
//! authenticated: its key and an HMAC-SHA256 over the list it belongs to and that key, under
//! the key every replica reads from Postgres (`cursor_key`, created once by migration 0025), so a
//! forged, tampered or other list's cursor is refused as invalid input, on any replica.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The most rows one page may ask for.
pub const MAX_PAGE: u32 = 10_000;

/// The most bytes of rows (their JSON) one page holds: a page stops before the row that would
/// take it past this, and says it is truncated. The page's own fields (flags, cursor) add less
/// than [`PAGE_ENVELOPE`].
pub const PAGE_BYTES: usize = 1 << 20;

/// What a page's JSON adds to its rows at most: the braces, field names and a cursor.
pub const PAGE_ENVELOPE: usize = 8 << 10;

/// One page of a bounded query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Page<T> {
    pub rows: Vec<T>,
    /// More rows follow; `next_cursor` asks for them.
    pub truncated: bool,
    pub next_cursor: Option<String>,
}

/// Which page: at most `limit` rows (1..=[`MAX_PAGE`]) after `cursor` (none: the first page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRequest {
    pub limit: u32,
    pub cursor: Option<String>,
}

/// The key cursors are authenticated with, as read from the database ([`cursor_key`]).
pub struct CursorKey(hmac::Key);

impl std::fmt::Debug for CursorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CursorKey(..)")
    }
}

impl CursorKey {
    /// A key from its 32 bytes.
    pub fn new(bytes: &[u8]) -> Self {
        CursorKey(hmac::Key::new(hmac::HMAC_SHA256, bytes))
    }

    fn tag(&self, kind: &str, payload: &[u8]) -> hmac::Tag {
        let mut context = hmac::Context::with_key(&self.0);
        context.update(&(kind.len() as u64).to_be_bytes());
        context.update(kind.as_bytes());
        context.update(payload);
        context.sign()
    }
}

/// The cursor key every replica shares (migration 0025 created it once).
pub async fn cursor_key<'e, E: sqlx::PgExecutor<'e>>(executor: E) -> Result<CursorKey, Error> {
    let bytes: Vec<u8> = sqlx::query_scalar("SELECT key FROM cursor_key").fetch_one(executor).await?;
    Ok(CursorKey::new(&bytes))
}

impl PageRequest {
    pub fn first(limit: u32) -> Self {
        PageRequest { limit, cursor: None }
    }

    /// The limit as bound in SQL, after checking it.
    pub(crate) fn checked_limit(&self) -> Result<i64, Error> {
        if !(1..=MAX_PAGE).contains(&self.limit) {
            return Err(Error::Invalid(format!(
                "a page holds 1 to {MAX_PAGE} rows, not {}; ask for fewer and follow the cursor",
                self.limit
            )));
        }
        Ok(i64::from(self.limit))
    }

    /// The key after which the page starts, from a cursor that a query of the same `kind` made
    /// and `key` authenticates.
    pub(crate) fn after(&self, key: &CursorKey, kind: &str) -> Result<Option<serde_json::Value>, Error> {
        let Some(cursor) = &self.cursor else { return Ok(None) };
        let wrong = || {
            Error::Invalid(format!(
                "the cursor is not a cursor of a {kind} query (forged, altered or another list's); \
                 run the query again without a cursor"
            ))
        };
        let (payload, tag) = cursor.split_once('.').ok_or_else(wrong)?;
        let payload = URL_SAFE_NO_PAD.decode(payload).map_err(|_| wrong())?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| wrong())?;
        let mut context = Vec::with_capacity(8 + kind.len() + payload.len());
        context.extend_from_slice(&(kind.len() as u64).to_be_bytes());
        context.extend_from_slice(kind.as_bytes());
        context.extend_from_slice(&payload);
        hmac::verify(&key.0, &context, &tag).map_err(|_| wrong())?;
        let after: serde_json::Value = serde_json::from_slice(&payload).map_err(|_| wrong())?;
        if !after.is_array() {
            return Err(wrong());
        }
        Ok(Some(after))
    }

    /// [`after`](Self::after) for the common key of two fields (e.g. a time and an id).
    pub(crate) fn after_pair<A: serde::de::DeserializeOwned, B: serde::de::DeserializeOwned>(
        &self,
        key: &CursorKey,
        kind: &str,
    ) -> Result<Option<(A, B)>, Error> {
        self.after(key, kind)?.map(|after| Ok((field(&after, 0, kind)?, field(&after, 1, kind)?))).transpose()
    }
}

/// Counts what is written to it, keeping nothing.
struct Weigh(usize);

impl std::io::Write for Weigh {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The bytes of `row` as JSON, measured without building it.
pub fn weight<T: Serialize>(row: &T) -> usize {
    let mut weigh = Weigh(0);
    // Writing to a counter cannot fail; a row that cannot serialize weighs nothing here and
    // fails where it is answered.
    let _ = serde_json::to_writer(&mut weigh, row);
    weigh.0
}

/// Makes a page from up to `limit + 1` rows fetched in key order: the extra row only says that
/// more follow, and the cursor is the key of the last row kept. The page also stops before the
/// row that would take its rows past [`PAGE_BYTES`] (it always keeps the first).
pub(crate) fn page<T: Serialize>(
    cursor_key: &CursorKey,
    rows: Vec<T>,
    limit: i64,
    kind: &str,
    key: impl Fn(&T) -> serde_json::Value,
) -> Page<T> {
    page_within(cursor_key, rows, limit, false, PAGE_BYTES, kind, key)
}

/// [`page`] for a query that already stopped reading at the budget: `more` says rows it did
/// not read follow.
pub(crate) fn page_more<T: Serialize>(
    cursor_key: &CursorKey,
    rows: Vec<T>,
    limit: i64,
    more: bool,
    kind: &str,
    key: impl Fn(&T) -> serde_json::Value,
) -> Page<T> {
    page_within(cursor_key, rows, limit, more, PAGE_BYTES, kind, key)
}

fn page_within<T: Serialize>(
    cursor_key: &CursorKey,
    mut rows: Vec<T>,
    limit: i64,
    more: bool,
    budget: usize,
    kind: &str,
    key: impl Fn(&T) -> serde_json::Value,
) -> Page<T> {
    let mut keep = rows.len().min(usize::try_from(limit).unwrap_or(usize::MAX));
    let mut total = 0usize;
    for (i, row) in rows.iter().take(keep).enumerate() {
        // A comma between rows.
        total += weight(row) + 1;
        if total > budget && i > 0 {
            keep = i;
            break;
        }
    }
    let truncated = more || rows.len() > keep;
    rows.truncate(keep);
    let next_cursor = match (truncated, rows.last()) {
        (true, Some(last)) => Some(cursor(cursor_key, kind, &key(last))),
        _ => None,
    };
    Page { rows, truncated, next_cursor }
}

/// The cursor that leads past `after` in the list `kind`.
pub(crate) fn cursor(key: &CursorKey, kind: &str, after: &serde_json::Value) -> String {
    let payload = after.to_string().into_bytes();
    let tag = key.tag(kind, &payload);
    format!("{}.{}", URL_SAFE_NO_PAD.encode(&payload), URL_SAFE_NO_PAD.encode(tag.as_ref()))
}

/// Reads field `i` of a cursor key; a cursor that does not have it was not made here.
pub(crate) fn field<T: serde::de::DeserializeOwned>(
    key: &serde_json::Value,
    i: usize,
    kind: &str,
) -> Result<T, Error> {
    key.get(i).cloned().and_then(|v| serde_json::from_value(v).ok()).ok_or_else(|| {
        Error::Invalid(format!("a {kind} cursor lacks field {i}; run the query again without a cursor"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CursorKey {
        CursorKey::new(&[7; 32])
    }

    #[test]
    fn a_page_says_it_is_truncated_and_its_cursor_leads_on() {
        let rows = vec![1, 2, 3];
        let p = page(&key(), rows.clone(), 2, "test", |r| serde_json::json!([r]));
        assert_eq!((p.rows.as_slice(), p.truncated), ([1, 2].as_slice(), true));
        let next = PageRequest { limit: 2, cursor: p.next_cursor };
        assert_eq!(next.after(&key(), "test").unwrap(), Some(serde_json::json!([2])));
        let err = next.after(&key(), "other").unwrap_err().to_string();
        assert!(err.contains("not a cursor of a other query"), "{err}");

        let whole = page(&key(), rows, 3, "test", |r| serde_json::json!([r]));
        assert_eq!((whole.truncated, whole.next_cursor), (false, None));
        assert!(PageRequest { limit: 1, cursor: Some("%%".into()) }.after(&key(), "test").is_err());
        assert!(PageRequest::first(0).checked_limit().is_err());
        assert!(PageRequest::first(MAX_PAGE + 1).checked_limit().is_err());
        assert_eq!(PageRequest::first(MAX_PAGE).checked_limit().unwrap(), i64::from(MAX_PAGE));
    }

    #[test]
    fn forged_tampered_and_foreign_cursors_are_refused() {
        let p = page(&key(), vec![1, 2, 3], 1, "test", |r| serde_json::json!([r]));
        let good = p.next_cursor.unwrap();
        let request = |c: String| PageRequest { limit: 1, cursor: Some(c) };
        assert_eq!(request(good.clone()).after(&key(), "test").unwrap(), Some(serde_json::json!([1])));
        // Another key (another installation), another list, a changed payload, a bare payload
        // (the old unauthenticated shape), a cursor made up from scratch.
        assert!(request(good.clone()).after(&CursorKey::new(&[8; 32]), "test").is_err());
        assert!(request(good.clone()).after(&key(), "test2").is_err());
        let (_, tag) = good.split_once('.').unwrap();
        let forged = format!("{}.{tag}", URL_SAFE_NO_PAD.encode(b"[999]"));
        assert!(request(forged).after(&key(), "test").is_err());
        assert!(request(URL_SAFE_NO_PAD.encode(b"[1]")).after(&key(), "test").is_err());
        assert!(request("a.b".into()).after(&key(), "test").is_err());
        assert!(request(".".into()).after(&key(), "test").is_err());
        // A validly signed key of the wrong shape still reads as not this list's.
        let odd = cursor(&key(), "test", &serde_json::json!({"x": 1}));
        assert!(request(odd).after(&key(), "test").is_err());
        let short = cursor(&key(), "test", &serde_json::json!(["a"]));
        assert!(request(short).after_pair::<i64, i64>(&key(), "test").is_err());
    }

    #[test]
    fn a_page_stops_at_its_byte_budget() {
        let rows: Vec<String> = (0..10).map(|i| format!("{i}").repeat(100)).collect();
        // Each row weighs 102 bytes and a comma: three fit in 320.
        let p = page_within(&key(), rows.clone(), 10, false, 320, "test", |r| serde_json::json!([r]));
        assert_eq!(p.rows.len(), 3);
        assert!(p.truncated);
        assert!(p.rows.iter().map(|r| weight(r) + 1).sum::<usize>() <= 320);
        // A row heavier than the budget makes a page of its own, so the walk goes on.
        let p = page_within(&key(), rows.clone(), 10, false, 50, "test", |r| serde_json::json!([r]));
        assert_eq!((p.rows.len(), p.truncated), (1, true));
        // Walking the budgeted cursors reads every row once.
        let mut seen = Vec::new();
        let mut at = 0;
        loop {
            let p =
                page_within(&key(), rows[at..].to_vec(), 10, false, 320, "test", |r| serde_json::json!([r]));
            at += p.rows.len();
            seen.extend(p.rows);
            if p.next_cursor.is_none() {
                break;
            }
        }
        assert_eq!(seen, rows);
        // A query that stopped reading early says more follow, with a cursor.
        let p = page_within(&key(), rows[..2].to_vec(), 10, true, 320, "test", |r| serde_json::json!([r]));
        assert_eq!((p.rows.len(), p.truncated, p.next_cursor.is_some()), (2, true, true));
    }
}
