//! `/api/v1/suggestions` (issue 28, FLOW-9): suggested rules from recorded flows
//! (`suggest::run`), accepted into a draft or ignored by id. Viewers ask for suggestions (each run
//! reads a scope's flows over the range, so it takes one of the caller's expensive operations
//! first, 429 over the bound); editors accept and ignore.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use std::collections::BTreeSet;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{JsonBody, Query};
use super::problem::ApiError;
use super::{ApiState, Nothing};
use crate::policy::authoring::{self, Expensive};
use crate::suggest::{self, Accepted, Request, Suggestions};

/// The default range of a suggestion run.
pub const DEFAULT_SINCE: &str = "14d";

/// What to suggest rules for.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SuggestQuery {
    /// The destinations, as a selector (`app=payments-db`).
    pub scope: String,
    /// The recorded range: from this long ago until now (default 14d, at most 90 days).
    pub since: Option<String>,
    /// The range's end (RFC 3339; default now).
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Label keys that name a host rather than a role, comma-separated.
    pub exclude_keys: Option<String>,
    /// The most workloads a selector may pick now per observed source workload (default 2).
    pub max_breadth: Option<f64>,
}

/// The request a query makes, checked before any I/O.
pub fn suggest_request(q: &SuggestQuery, now: chrono::DateTime<chrono::Utc>) -> Result<Request, ApiError> {
    let text = q.since.as_deref().unwrap_or(DEFAULT_SINCE);
    let since = humantime::parse_duration(text)
        .map_err(|e| ApiError::Malformed(format!("since {text:?}: {e}; write e.g. 24h, 14d")))?;
    let excluded_keys: BTreeSet<String> = q
        .exclude_keys
        .as_deref()
        .unwrap_or("")
        .split(',')
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    let request = Request {
        scope: q.scope.clone(),
        range: suggest::range_since(q.until.unwrap_or(now), since)?,
        excluded_keys,
        max_breadth: q.max_breadth.unwrap_or(suggest::DEFAULT_MAX_BREADTH),
    };
    request.check()?;
    Ok(request)
}

/// Suggestions to accept into a draft.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcceptBody {
    pub ids: Vec<String>,
    pub draft: String,
}

/// Suggestions to ignore.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IgnoreBody {
    pub ids: Vec<String>,
}

#[utoipa::path(get, path = "/api/v1/suggestions", tag = "suggestions", params(SuggestQuery),
    responses((status = 200, description = "The suggested rules with their evidence, and what was excluded", body = Suggestions),
        (status = 429, description = "rate-limited: over the expensive operations a token, or everyone, may ask for per minute (`Retry-After`)",
            body = super::problem::Problem, content_type = "application/problem+json")))]
pub async fn list(
    State(state): State<ApiState>,
    caller: Caller,
    Query(q): Query<SuggestQuery>,
) -> Result<Json<Suggestions>, ApiError> {
    let request = suggest_request(&q, chrono::Utc::now())?;
    authoring::charge_expensive(&state.pool, Expensive::Render, &caller.actor(), &state.limits.expensive)
        .await?;
    Ok(Json(suggest::run(&state.pool, &request).await?))
}

#[utoipa::path(post, path = "/api/v1/suggestions/accept", tag = "suggestions", request_body = AcceptBody,
    responses((status = 200, description = "Written into the draft (created if missing): the objects it changed", body = Accepted)))]
pub async fn accept(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<AcceptBody>,
) -> Result<Json<Accepted>, ApiError> {
    Ok(Json(
        suggest::accept(&state.pool, &caller.actor(), &body.ids, &body.draft, &state.limits.counts).await?,
    ))
}

#[utoipa::path(post, path = "/api/v1/suggestions/ignore", tag = "suggestions", request_body = IgnoreBody,
    responses((status = 200, description = "Ignored until a new source appears", body = Nothing)))]
pub async fn ignore(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<IgnoreBody>,
) -> Result<Json<Nothing>, ApiError> {
    suggest::ignore(&state.pool, &caller.actor(), &body.ids).await?;
    Ok(Json(Nothing))
}
