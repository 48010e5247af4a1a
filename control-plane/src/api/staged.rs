//! `/api/v1/staged-rulesets`: rulesets staged beside the rules in force (issue 31, FLOW-10) —
//! `safety::staged` as `innerwall ruleset stage|unstage|staged|promote-staged` calls it, with the
//! caller as the actor. Editors stage and unstage (nothing is enforced by it); promoting, which
//! enforces, is a promoter's.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path};
use super::problem::{ApiError, Problem};
use super::{ApiState, Changed, Nothing};
use crate::policy::spec::RulesetSpec;
use crate::safety::staged::{self, PromoteStaged, StagedPromotion, StagedView};

/// Every staged ruleset, with the workloads promoting each would change (at most
/// `safety::staged::MAX_STAGED`).
#[utoipa::path(get, path = "/api/v1/staged-rulesets", tag = "catalog",
    responses((status = 200, description = "The staged rulesets, in name order", body = Vec<StagedView>)))]
pub async fn list(State(state): State<ApiState>) -> Result<Json<Vec<StagedView>>, ApiError> {
    Ok(Json(staged::list(&state.pool).await?))
}

#[utoipa::path(get, path = "/api/v1/staged-rulesets/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The ruleset's name")),
    responses((status = 200, description = "The staged ruleset", body = StagedView)))]
pub async fn show(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Json<StagedView>, ApiError> {
    Ok(Json(staged::show(&state.pool, &name).await?))
}

/// Stages a ruleset (a new version of one, or a new one): evaluated beside the rules in force,
/// never acted on, until promoted. Staging it again replaces it, under a new stage number.
#[utoipa::path(post, path = "/api/v1/staged-rulesets", tag = "catalog", request_body = RulesetSpec,
    responses((status = 201, description = "Staged; `result` is its stage number", body = Changed<i64>),
        (status = 409, description = "limit-reached", body = Problem, content_type = "application/problem+json")))]
pub async fn stage(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(spec): JsonBody<RulesetSpec>,
) -> Result<Response, ApiError> {
    let done = staged::stage(&state.pool, &caller.actor(), &spec).await?;
    Ok((StatusCode::CREATED, Json(Changed::from(done))).into_response())
}

#[utoipa::path(delete, path = "/api/v1/staged-rulesets/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The ruleset's name")),
    responses((status = 200, description = "Unstaged", body = Changed<Nothing>)))]
pub async fn unstage(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    Ok(Json(Changed::from(staged::unstage(&state.pool, &caller.actor(), &name).await?)))
}

/// Promotes a staged ruleset, if it changes the rules in force of exactly `expect_count`
/// workloads and the evidence since each acknowledged its staged set is SAFE.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PromoteStagedRequest {
    /// How many workloads' rules in force it must change; any other number changes nothing (409).
    pub expect_count: usize,
    /// Less evidence than this since a workload acknowledged its staged set is not enough
    /// (humantime; default 24h).
    pub min_evidence: Option<String>,
    /// Promote without a SAFE verdict, for this reason (kept on the record).
    pub override_reason: Option<String>,
}

#[utoipa::path(post, path = "/api/v1/staged-rulesets/{name}/promote", tag = "gate",
    request_body = PromoteStagedRequest,
    params(("name" = String, Path, description = "The ruleset's name")),
    responses((status = 200, description = "Promoted; the record, and `changed` the new versions", body = Changed<StagedPromotion>),
        (status = 409, description = "match-count-mismatch (`expected`, `matched`, `names`) or evidence-insufficient \
            (`outcome`, `reasons`); nothing was changed", body = Problem, content_type = "application/problem+json")))]
pub async fn promote(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<PromoteStagedRequest>,
) -> Result<Json<Changed<StagedPromotion>>, ApiError> {
    let request = PromoteStaged {
        name,
        expect_count: body.expect_count,
        min_evidence: super::gate::duration("min_evidence", body.min_evidence.as_deref())?,
        override_reason: body.override_reason,
    };
    Ok(Json(Changed::from(staged::promote_staged(&state.pool, &caller.actor(), &request).await?)))
}
