//! How list commands read (OPS-2): every list is a keyset of pages, and a command prints the
//! whole list by walking every page from the first to the last cursor, from the database or
//! through the API, `--page-size` rows at a time — so `--json` holds every row, each once, and
//! no single read is unbounded.

use anyhow::bail;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::page::{Page, PageRequest};
use serde::de::DeserializeOwned;

use crate::api::{ApiClient, segment};

/// Rows a page asks for unless `--page-size` says otherwise.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// The most rows a page asks for: what the API serves in one page.
pub const MAX_PAGE_SIZE: u32 = innerwall_control_plane::api::MAX_API_PAGE;

/// Every row `fetch` pages through on this host's database, following the cursors; `most`
/// stops after that many rows.
pub async fn local<T>(
    size: u32,
    most: Option<usize>,
    mut fetch: impl AsyncFnMut(&PageRequest) -> Result<Page<T>, Error>,
) -> anyhow::Result<Vec<T>> {
    let mut request = PageRequest::first(size);
    let mut rows = Vec::new();
    loop {
        let page = fetch(&request).await?;
        rows.extend(page.rows);
        if most.is_some_and(|most| rows.len() >= most) {
            rows.truncate(most.unwrap_or(usize::MAX));
            return Ok(rows);
        }
        match page.next_cursor {
            Some(cursor) => request.cursor = Some(cursor),
            None => return Ok(rows),
        }
    }
}

/// Every row of the API's paged collection at `path` (which may carry a query of its own),
/// following the cursors; `most` stops after that many rows.
pub async fn remote<T: DeserializeOwned>(
    api: &ApiClient,
    path: &str,
    most: Option<usize>,
) -> anyhow::Result<Vec<T>> {
    remote_pages(api, path, api.page_size, most).await
}

/// Every row of the API's paged collection at `path`, `size` rows a page (the workload lists
/// set theirs: their rows are large).
pub async fn remote_sized<T: DeserializeOwned>(
    api: &ApiClient,
    path: &str,
    size: u32,
) -> anyhow::Result<Vec<T>> {
    remote_pages(api, path, size, None).await
}

async fn remote_pages<T: DeserializeOwned>(
    api: &ApiClient,
    path: &str,
    size: u32,
    most: Option<usize>,
) -> anyhow::Result<Vec<T>> {
    let separator = if path.contains('?') { '&' } else { '?' };
    let mut rows = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{path}{separator}limit={size}");
        if let Some(cursor) = &cursor {
            url.push_str(&format!("&cursor={}", segment(cursor)));
        }
        let page: Page<T> = api.get(&url).await?;
        rows.extend(page.rows);
        if most.is_some_and(|most| rows.len() >= most) {
            rows.truncate(most.unwrap_or(usize::MAX));
            return Ok(rows);
        }
        match page.next_cursor {
            Some(next) if Some(&next) == cursor.as_ref() => {
                bail!("GET {path}: the API answered the same cursor twice; stopped")
            }
            Some(next) => cursor = Some(next),
            None => return Ok(rows),
        }
    }
}
