//! `GET /api/v1/workloads/{id}/replay`: a workload's recorded flows replayed between two of its
//! stored policy versions (`foresight::replay`), as `innerwall workload replay --json` prints it.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use utoipa::IntoParams;

use super::ApiState;
use super::extract::{Path, Query};
use super::problem::ApiError;
use crate::error::Error;
use crate::foresight::{self, Impact, Range};

/// The range replayed when a request names none.
pub const DEFAULT_SINCE: &str = "7d";
/// The rows of each kind when a request names no `top`.
pub const DEFAULT_TOP: usize = 10;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReplayQuery {
    /// The version replayed from (0: nothing applied).
    from: u64,
    /// The version replayed to.
    to: u64,
    /// The recorded range: from this long ago until now (default 7d, at most 90 days).
    since: Option<String>,
    /// Rows of each kind per workload (default 10, at most 100).
    top: Option<usize>,
}

/// The range (ending at `now`) and the rows per kind a replay query asks for, checked before
/// any I/O (pure; the `api_params` fuzz target drives it).
pub fn replay_request(
    q: &ReplayQuery,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(Range, usize), ApiError> {
    range_and_top(q.since.as_deref(), q.top, now)
}

/// A recorded range (`since` before `now`, default [`DEFAULT_SINCE`]) and rows per kind
/// (default [`DEFAULT_TOP`]), checked before any I/O: a replay's and a draft impact's query.
pub fn range_and_top(
    since: Option<&str>,
    top: Option<usize>,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(Range, usize), ApiError> {
    let text = since.unwrap_or(DEFAULT_SINCE);
    let since = humantime::parse_duration(text)
        .map_err(|e| ApiError::Malformed(format!("since {text:?}: {e}; write e.g. 24h, 7d")))?;
    let range = Range::ending_at(now, since)?;
    let top = top.unwrap_or(DEFAULT_TOP);
    if top == 0 || top > foresight::MAX_TOP {
        return Err(ApiError::Malformed(format!(
            "top must be between 1 and {}, not {top}",
            foresight::MAX_TOP
        )));
    }
    Ok((range, top))
}

/// The replay of a workload's recorded flows between two of its stored versions: per transition
/// counts and top rows, coverage and gaps, unseen admissions, relabelled peers.
#[utoipa::path(get, path = "/api/v1/workloads/{id}/replay", tag = "workloads",
    params(("id" = String, Path, description = "The workload id"), ReplayQuery),
    responses((status = 200, description = "The replay", body = serde_json::Value)))]
pub async fn replay(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<ReplayQuery>,
) -> Result<Json<Impact>, ApiError> {
    let id = super::workloads::workload(&id)?;
    let (range, top) = replay_request(&q, chrono::Utc::now())?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(foresight::replay(&mut conn, id, q.from, q.to, range, top).await?))
}
