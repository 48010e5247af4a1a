//! `/api/v1/policy-test-sets` and `/api/v1/policy-tests/run` (POL-10): the stored policy test
//! sets and an on-demand run. Each write is `foresight`'s checked commit, so a set whose tests
//! fail now is refused (422 policy-tests-failed) like any change that breaks one.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::auth::Caller;
use super::extract::{JsonBody, Path, etag, if_match};
use super::problem::{ApiError, Problem};
use super::workloads::created;
use super::{ApiState, Changed, Nothing};
use crate::foresight::{self, RunReport, TestSetRow, TestSetSpec};

#[utoipa::path(get, path = "/api/v1/policy-test-sets", tag = "policy-tests",
    responses((status = 200, description = "Every policy test set, by name (at most 64)", body = Vec<TestSetRow>)))]
pub async fn list(State(state): State<ApiState>) -> Result<Json<Vec<TestSetRow>>, ApiError> {
    Ok(Json(foresight::list_test_sets(&state.pool).await?))
}

#[utoipa::path(post, path = "/api/v1/policy-test-sets", tag = "policy-tests", request_body = TestSetSpec,
    responses((status = 201, description = "Created at version 1", body = Changed<i64>),
        (status = 409, description = "duplicate-name, or limit-reached", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "policy-tests-failed: a test of the set fails now", body = Problem, content_type = "application/problem+json")))]
pub async fn create(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(spec): JsonBody<TestSetSpec>,
) -> Result<Response, ApiError> {
    let done = foresight::create_test_set(&state.pool, &caller.actor(), &spec).await?;
    Ok(created(format!("/api/v1/policy-test-sets/{}", spec.name), 1, Changed::from(done)))
}

#[utoipa::path(get, path = "/api/v1/policy-test-sets/{name}", tag = "policy-tests",
    params(("name" = String, Path, description = "The set's name")),
    responses((status = 200, description = "The set; `ETag` is its version", body = TestSetRow)))]
pub async fn show(State(state): State<ApiState>, Path(name): Path<String>) -> Result<Response, ApiError> {
    let row = foresight::show_test_set(&state.pool, &name).await?;
    Ok(([etag(row.version)], Json(row)).into_response())
}

/// Replaces the set; the body names the same set as the path.
#[utoipa::path(put, path = "/api/v1/policy-test-sets/{name}", tag = "policy-tests", request_body = TestSetSpec,
    params(("name" = String, Path, description = "The set's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Updated; the result is the new version", body = Changed<i64>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "policy-tests-failed", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn update(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<TestSetSpec>,
) -> Result<Response, ApiError> {
    let expected = if_match(&headers, "a policy test set")?;
    if spec.name != name {
        return Err(ApiError::Malformed(format!(
            "the body names policy test set {:?} and the path {name:?}; a set is not renamed",
            spec.name
        )));
    }
    let done = foresight::update_test_set(&state.pool, &caller.actor(), &spec, expected).await?;
    Ok(([etag(done.value)], Json(Changed::from(done))).into_response())
}

#[utoipa::path(delete, path = "/api/v1/policy-test-sets/{name}", tag = "policy-tests",
    params(("name" = String, Path, description = "The set's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Deleted", body = Changed<Nothing>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn delete(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let expected = if_match(&headers, "a policy test set")?;
    let done = foresight::delete_test_set(&state.pool, &caller.actor(), &name, expected).await?;
    Ok(Json(Changed::from(done)))
}

#[utoipa::path(post, path = "/api/v1/policy-tests/run", tag = "policy-tests",
    responses((status = 200, description = "Every test's result on the estate as rendered now (nothing is written)",
        body = RunReport)))]
pub async fn run(State(state): State<ApiState>) -> Result<Json<RunReport>, ApiError> {
    Ok(Json(foresight::run_policy_tests(&state.pool).await?))
}
