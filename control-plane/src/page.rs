//! Bounded results (FLOW-6, OPS-2): a page of rows, whether more follow, and an opaque cursor to
//! the next page. Pagination is by keyset: every query orders by a unique key and the cursor is
//! the last row's key, so walking the cursors yields every row exactly once, and no query stops
//! at a limit without saying so. Flow queries, the workload list and the HTTP API share it.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The most rows one page may ask for.
pub const MAX_PAGE: u32 = 10_000;

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

    /// The key after which the page starts, from a cursor made by a query of the same `kind`.
    pub(crate) fn after(&self, kind: &str) -> Result<Option<serde_json::Value>, Error> {
        let Some(cursor) = &self.cursor else { return Ok(None) };
        let wrong = || {
            Error::Invalid(format!(
                "cursor {cursor:?} is not a cursor of a {kind} query; run the query again without a cursor"
            ))
        };
        let bytes = URL_SAFE_NO_PAD.decode(cursor).map_err(|_| wrong())?;
        let decoded: Cursor = serde_json::from_slice(&bytes).map_err(|_| wrong())?;
        if decoded.of != kind {
            return Err(wrong());
        }
        Ok(Some(decoded.after))
    }

    /// [`after`](Self::after) for the common key of two fields (e.g. a time and an id).
    pub(crate) fn after_pair<A: serde::de::DeserializeOwned, B: serde::de::DeserializeOwned>(
        &self,
        kind: &str,
    ) -> Result<Option<(A, B)>, Error> {
        self.after(kind)?.map(|key| Ok((field(&key, 0, kind)?, field(&key, 1, kind)?))).transpose()
    }
}

#[derive(Serialize, Deserialize)]
struct Cursor {
    of: String,
    after: serde_json::Value,
}

/// Makes a page from up to `limit + 1` rows fetched in key order: the extra row only says that
/// more follow, and the cursor is the key of the last row kept.
pub(crate) fn page<T>(
    mut rows: Vec<T>,
    limit: i64,
    kind: &str,
    key: impl Fn(&T) -> serde_json::Value,
) -> Page<T> {
    let truncated = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next_cursor = truncated.then(|| {
        let last = rows.last().expect("a truncated page has rows");
        let cursor = Cursor { of: kind.to_owned(), after: key(last) };
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(&cursor).expect("a cursor serializes"))
    });
    Page { rows, truncated, next_cursor }
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

    #[test]
    fn a_page_says_it_is_truncated_and_its_cursor_leads_on() {
        let rows = vec![1, 2, 3];
        let p = page(rows.clone(), 2, "test", |r| serde_json::json!([r]));
        assert_eq!((p.rows.as_slice(), p.truncated), ([1, 2].as_slice(), true));
        let next = PageRequest { limit: 2, cursor: p.next_cursor };
        assert_eq!(next.after("test").unwrap(), Some(serde_json::json!([2])));
        let err = next.after("other").unwrap_err().to_string();
        assert!(err.contains("not a cursor of a other query"), "{err}");

        let whole = page(rows, 3, "test", |r| serde_json::json!([r]));
        assert_eq!((whole.truncated, whole.next_cursor), (false, None));
        assert!(PageRequest { limit: 1, cursor: Some("%%".into()) }.after("test").is_err());
        assert!(PageRequest::first(0).checked_limit().is_err());
        assert!(PageRequest::first(MAX_PAGE + 1).checked_limit().is_err());
        assert_eq!(PageRequest::first(MAX_PAGE).checked_limit().unwrap(), i64::from(MAX_PAGE));
    }
}
