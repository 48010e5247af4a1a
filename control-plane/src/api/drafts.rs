//! `/api/v1/drafts` (issue 27 items 1 and 2, POL-8): named, stored sets of authored changes
//! (`foresight::drafts`). Viewers read, render, run the tests on and replay a draft; editors
//! create, add to, discard and commit one. A draft's `ETag` is its version; discard and commit
//! need it as `If-Match` (428 without, 412 stale), and a commit whose objects moved since their
//! changes were added is 412 naming them. Render, impact and tests each render the whole estate,
//! so each takes one of the caller's expensive operations first (429 over the bound), as
//! `POST /api/v1/render` does.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use axum::Json;
use axum::extract::{FromRequest, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{BodyLimit, JsonBody, Path, Query, etag, if_match};
use super::impact::range_and_top;
use super::problem::{ApiError, Problem};
use super::workloads::created;
use super::{ApiState, Changed, Nothing};
use crate::foresight::drafts::{self, ChangeFile, DraftCommitted, DraftRender, DraftSummary, DraftView};
use crate::foresight::{Impact, RunReport};
use crate::policy::authoring::{self, Expensive};

/// A new draft.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewDraft {
    pub name: String,
    /// Why the draft exists (at most 1,024 characters).
    #[serde(default)]
    pub note: String,
}

/// The range and rows of a draft's impact.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImpactQuery {
    /// The recorded range: from this long ago until now (default 7d, at most 90 days).
    pub since: Option<String>,
    /// Rows of each kind per workload (default 10, at most 100).
    pub top: Option<usize>,
}

/// A draft's impact: the render it replayed, and the replay of the recorded flows of every
/// workload whose rendered policy differs from the one its agent applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DraftImpact {
    pub render: DraftRender,
    pub impact: Impact,
}

/// Takes one expensive operation (a whole-estate render) for the caller, or refuses (429).
async fn charge(state: &ApiState, caller: &Caller) -> Result<(), ApiError> {
    Ok(authoring::charge_expensive(&state.pool, Expensive::Render, &caller.actor(), &state.limits.expensive)
        .await?)
}

#[utoipa::path(get, path = "/api/v1/drafts", tag = "drafts",
    responses((status = 200, description = "Every draft, by name (at most 100)", body = Vec<DraftSummary>)))]
pub async fn list(State(state): State<ApiState>) -> Result<Json<Vec<DraftSummary>>, ApiError> {
    Ok(Json(drafts::list(&state.pool).await?))
}

#[utoipa::path(post, path = "/api/v1/drafts", tag = "drafts", request_body = NewDraft,
    responses((status = 201, description = "Created, empty, at version 1; `ETag` is its version", body = DraftView),
        (status = 409, description = "duplicate-name, or limit-reached", body = Problem, content_type = "application/problem+json")))]
pub async fn create(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewDraft>,
) -> Result<Response, ApiError> {
    let view = drafts::create(&state.pool, &caller.actor(), &body.name, &body.note).await?;
    Ok(created(format!("/api/v1/drafts/{}", body.name), view.version, view))
}

#[utoipa::path(get, path = "/api/v1/drafts/{name}", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name")),
    responses((status = 200, description = "The draft with its changes; `ETag` is its version", body = DraftView)))]
pub async fn show(State(state): State<ApiState>, Path(name): Path<String>) -> Result<Response, ApiError> {
    let view = drafts::show(&state.pool, &name).await?;
    Ok(([etag(view.version)], Json(view)).into_response())
}

#[utoipa::path(delete, path = "/api/v1/drafts/{name}", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Discarded", body = Changed<Nothing>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn discard(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let expected = if_match(&headers, "a draft")?;
    drafts::discard(&state.pool, &caller.actor(), &name, expected).await?;
    Ok(Json(Changed { result: Nothing, changed: Vec::new() }))
}

/// Adds the changes of a change file (at most 100, the body at most 1 MiB), each against its
/// object's version now; the draft must still apply and render.
#[utoipa::path(post, path = "/api/v1/drafts/{name}/changes", tag = "drafts", request_body = ChangeFile,
    params(("name" = String, Path, description = "The draft's name")),
    responses((status = 200, description = "The draft with its changes; `ETag` is its new version", body = DraftView)))]
pub async fn add(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    mut request: Request,
) -> Result<Response, ApiError> {
    // A change file may be as large as the CLI reads one, whatever the listener's body limit.
    request.extensions_mut().insert(BodyLimit(drafts::MAX_CHANGE_FILE as usize));
    let JsonBody(file) = JsonBody::<ChangeFile>::from_request(request, &state).await?;
    let view = drafts::add(&state.pool, &caller.actor(), &name, &file, &state.limits.counts).await?;
    Ok(([etag(view.version)], Json(view)).into_response())
}

#[utoipa::path(get, path = "/api/v1/drafts/{name}/render", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name")),
    responses((status = 200, description = "Per workload, the delta and next version a commit now would persist, and what would refuse it (nothing is written)",
        body = DraftRender),
        (status = 429, description = "rate-limited: over the renders a token, or everyone, may ask for per minute (`Retry-After`)",
            body = Problem, content_type = "application/problem+json")))]
pub async fn render(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<DraftRender>, ApiError> {
    charge(&state, &caller).await?;
    Ok(Json(drafts::render(&state.pool, &caller.actor(), &name, &state.limits.counts).await?))
}

#[utoipa::path(post, path = "/api/v1/drafts/{name}/impact", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name"), ImpactQuery),
    responses((status = 200, description = "The draft's render and its impact on the flows recorded over the range (nothing is written)",
        body = DraftImpact),
        (status = 429, description = "rate-limited: over the renders a token, or everyone, may ask for per minute (`Retry-After`)",
            body = Problem, content_type = "application/problem+json")))]
pub async fn impact(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    Query(q): Query<ImpactQuery>,
) -> Result<Json<DraftImpact>, ApiError> {
    let (range, top) = range_and_top(q.since.as_deref(), q.top, chrono::Utc::now())?;
    charge(&state, &caller).await?;
    let (render, impact) =
        drafts::impact(&state.pool, &caller.actor(), &name, &state.limits.counts, range, top).await?;
    Ok(Json(DraftImpact { render, impact }))
}

#[utoipa::path(post, path = "/api/v1/drafts/{name}/tests", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name")),
    responses((status = 200, description = "Every policy test's result on the estate as the draft would render it (nothing is written)",
        body = RunReport),
        (status = 429, description = "rate-limited: over the renders a token, or everyone, may ask for per minute (`Retry-After`)",
            body = Problem, content_type = "application/problem+json")))]
pub async fn tests(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<RunReport>, ApiError> {
    charge(&state, &caller).await?;
    Ok(Json(drafts::run_tests(&state.pool, &caller.actor(), &name, &state.limits.counts).await?))
}

/// Commits every change of the draft in one checked transaction; the draft is kept, marked
/// committed.
#[utoipa::path(post, path = "/api/v1/drafts/{name}/commit", tag = "drafts",
    params(("name" = String, Path, description = "The draft's name"),
        ("If-Match" = String, Header, description = "The draft's version read, quoted")),
    responses((status = 200, description = "Committed: the changes and promotion ids, and each workload whose version advanced",
        body = Changed<DraftCommitted>),
        (status = 412, description = "Stale: the draft moved (`current_version`), or an object it changes moved since its change was added (draft-base-moved, naming them)",
            body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "policy-tests-failed", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn commit(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<DraftCommitted>>, ApiError> {
    let expected = if_match(&headers, "a draft")?;
    let done = drafts::commit(&state.pool, &caller.actor(), &name, expected, &state.limits.counts).await?;
    Ok(Json(Changed::from(done)))
}
