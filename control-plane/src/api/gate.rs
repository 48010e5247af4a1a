//! `/api/v1/verdict` and `/api/v1/promotions`: is it safe to enforce a scope (FLOW-7), and
//! count-pinned mode changes with their records (FLOW-8) — `gate::judge` and `gate::promote`,
//! as `innerwall workload verdict|promote` call them, with the caller as the promotion's actor.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query};
use super::problem::{ApiError, Problem};
use super::{ApiState, Changed, Nothing, PageQuery, page_request};
use crate::error::Error;
use crate::gate::promote::Guard;
use crate::gate::{self, Params, Scope, promote as promotions};
use crate::page::Page;
use crate::safety::rollback::{self, RolledBack, Target};

/// The evidence range and minimum when a request names none.
const DEFAULT_EVIDENCE: &str = "24h";

pub(super) fn duration(what: &str, text: Option<&str>) -> Result<std::time::Duration, ApiError> {
    let text = text.unwrap_or(DEFAULT_EVIDENCE);
    humantime::parse_duration(text)
        .map_err(|e| ApiError::Malformed(format!("{what} {text:?}: {e}; write e.g. 24h, 7d")))
}

/// The evidence a verdict judges: from `evidence_since` ago until now, at least `min_evidence`
/// (each at most `gate::MAX_EVIDENCE`).
fn params(evidence_since: Option<&str>, min_evidence: Option<&str>) -> Result<Params, ApiError> {
    let since = duration("evidence_since", evidence_since)?;
    let min = duration("min_evidence", min_evidence)?;
    Ok(Params::ending_at(chrono::Utc::now().timestamp_millis(), since, min)?)
}

/// A scope by selector or by ids, exactly one of them.
fn scope(selector: Option<&str>, ids: &[String]) -> Result<Scope, ApiError> {
    match (selector, ids) {
        (Some(text), []) => Ok(Scope::parse_selector(text)?),
        (None, ids) if !ids.is_empty() => {
            let ids = ids
                .iter()
                .map(|id| {
                    id.trim().parse::<WorkloadId>().map_err(|_| {
                        ApiError::Malformed(format!(
                            "{:?} is not a workload id",
                            id.chars().take(64).collect::<String>()
                        ))
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok(Scope::ids(ids)?)
        }
        _ => Err(ApiError::Malformed(
            "name the workloads by scope (a selector) or by ids, exactly one of them".into(),
        )),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct VerdictQuery {
    /// A selector: `key=value`, several values `key=v1|v2`, keys ANDed with commas.
    scope: Option<String>,
    /// Workload ids, comma-separated (instead of `scope`).
    ids: Option<String>,
    /// The evidence range: from this long ago until now (default 24h).
    evidence_since: Option<String>,
    /// A shorter range is never enough evidence (default 24h).
    min_evidence: Option<String>,
}

/// The verdict on a scope now: SAFE to enforce, UNSAFE (would block flows), or INSUFFICIENT,
/// with every workload's evidence and reasons (as `workload verdict --json` prints it).
#[utoipa::path(get, path = "/api/v1/verdict", tag = "gate", params(VerdictQuery),
    responses((status = 200, description = "The verdict", body = serde_json::Value)))]
pub async fn verdict(
    State(state): State<ApiState>,
    Query(q): Query<VerdictQuery>,
) -> Result<Json<gate::Verdict>, ApiError> {
    let (scope, params) = verdict_request(&q)?;
    Ok(Json(gate::judge(&state.pool, &scope, &params).await?))
}

/// What a verdict query asks, checked before any I/O (pure; the `api_params` fuzz target drives it).
pub fn verdict_request(q: &VerdictQuery) -> Result<(Scope, Params), ApiError> {
    let ids: Vec<String> =
        q.ids.as_deref().map(|t| t.split(',').map(str::to_owned).collect()).unwrap_or_default();
    let scope = scope(q.scope.as_deref(), &ids)?;
    Ok((scope, params(q.evidence_since.as_deref(), q.min_evidence.as_deref())?))
}

/// The promotion records, newest first, a page at a time.
#[utoipa::path(get, path = "/api/v1/promotions", tag = "gate", params(PageQuery),
    responses((status = 200, description = "A page of promotion records (the rows as `promotions list --json` prints them)",
        body = Page<serde_json::Value>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<promotions::Promotion>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 50)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(promotions::page(&mut conn, &request).await?))
}

#[utoipa::path(get, path = "/api/v1/promotions/{id}", tag = "gate",
    params(("id" = String, Path, description = "The promotion record's id")),
    responses((status = 200, description = "One record with the verdict it stood on", body = serde_json::Value)))]
pub async fn show(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<promotions::Promotion>, ApiError> {
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(promotions::show(&mut conn, promotion_id(&id)?).await?))
}

fn promotion_id(text: &str) -> Result<uuid::Uuid, ApiError> {
    text.parse().map_err(|_| {
        ApiError::Malformed(format!(
            "{:?} is not a promotion id (a UUID)",
            text.chars().take(64).collect::<String>()
        ))
    })
}

/// A confirmation of a promotion with a confirm deadline.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfirmRequest {
    /// Confirm without a SAFE verdict at the promoted version, for this reason (kept on the
    /// record).
    pub override_reason: Option<String>,
}

/// Confirms a promotion before its deadline, on a fresh verdict at the promoted version (the
/// evidence since the promotion: nothing blocked, no gap, covered, SYNCED): the deadline leaves
/// the workloads' policies and they stay enforced.
#[utoipa::path(post, path = "/api/v1/promotions/{id}/confirm", tag = "gate", request_body = ConfirmRequest,
    params(("id" = String, Path, description = "The promotion record's id")),
    responses((status = 200, description = "Confirmed; the promotion record", body = serde_json::Value),
        (status = 409, description = "evidence-insufficient (`outcome`, `reasons`), or the promotion is not pending             (reverted by its deadline, confirmed, superseded); nothing was changed",
            body = Problem, content_type = "application/problem+json")))]
pub async fn confirm(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ConfirmRequest>,
) -> Result<Json<promotions::Promotion>, ApiError> {
    let id = promotion_id(&id)?;
    let done =
        crate::safety::confirm::confirm(&state.pool, &caller.actor(), id, body.override_reason.as_deref())
            .await?;
    Ok(Json(done))
}

/// A mode change of exactly the set a scope names, if it names as many as expected.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PromotionRequest {
    /// A selector (`app=web,env=prod|staging`) …
    pub scope: Option<String>,
    /// … or workload ids.
    #[serde(default)]
    pub ids: Vec<String>,
    /// How many workloads the scope must name now; any other number changes nothing (409).
    pub expect_count: usize,
    /// `visibility`, `simulation` or `enforcement`.
    pub to: String,
    /// Why (kept on the record).
    pub reason: String,
    /// Enforce without a SAFE verdict, for this reason (kept on the record).
    pub override_reason: Option<String>,
    /// The evidence range a move to enforcement is judged on (default 24h).
    pub evidence_since: Option<String>,
    /// A shorter range is never enough evidence (default 24h).
    pub min_evidence: Option<String>,
    /// A move to enforcement's auto-demotion guard (default: 30 minutes, 5 connections, seen
    /// sources only; `minutes: 0` for none).
    pub guard: Option<Guard>,
    /// A move to enforcement that reverts to simulation unless confirmed within this long
    /// (`POST /api/v1/promotions/{id}/confirm`), e.g. `10m`; 10s to 24h. The agents hold the
    /// deadline themselves.
    pub confirm_within: Option<String>,
}

#[utoipa::path(post, path = "/api/v1/promotions", tag = "gate", request_body = PromotionRequest,
    responses((status = 201, description = "Changed; the promotion record", body = serde_json::Value),
        (status = 409, description = "match-count-mismatch (`expected`, `matched`, `names`) or evidence-insufficient \
            (`outcome`, `reasons`); nothing was changed", body = Problem, content_type = "application/problem+json")))]
pub async fn promote(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<PromotionRequest>,
) -> Result<Response, ApiError> {
    let request = gate::Request {
        scope: scope(body.scope.as_deref(), &body.ids)?,
        expect_count: body.expect_count,
        to: body.to.parse::<Mode>().map_err(|_| {
            ApiError::Malformed(format!(
                "unknown mode {:?}: use visibility, simulation or enforcement",
                body.to
            ))
        })?,
        params: params(body.evidence_since.as_deref(), body.min_evidence.as_deref())?,
        reason: body.reason,
        override_reason: body.override_reason,
        guard: body.guard,
        confirm_within: match body.confirm_within.as_deref() {
            None => None,
            Some(text) => Some(humantime::parse_duration(text).map_err(|e| {
                let text: String = text.chars().take(64).collect();
                ApiError::Malformed(format!("confirm_within {text:?}: {e}; write e.g. 10m"))
            })?),
        },
    };
    let promotion = gate::promote(&state.pool, &caller.actor(), &request).await?;
    Ok((StatusCode::CREATED, Json(promotion)).into_response())
}

/// A rollback of exactly the set a scope names, if it names as many as expected.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// A selector (`app=web,env=prod|staging`) …
    pub scope: Option<String>,
    /// … or workload ids.
    #[serde(default)]
    pub ids: Vec<String>,
    /// How many workloads the scope must name now; any other number changes nothing (409).
    pub expect_count: usize,
    /// The version whose source to render again; absent: each workload's newest earlier version
    /// a promotion's verdict judged SAFE.
    pub to_version: Option<u64>,
}

/// Rolls workloads back to an earlier version's authored source, rendered again as a new
/// version; they stay pinned to it until unpinned.
#[utoipa::path(post, path = "/api/v1/rollbacks", tag = "gate", request_body = RollbackRequest,
    responses((status = 200, description = "Rolled back; `changed` names the new versions", body = Changed<Vec<RolledBack>>),
        (status = 409, description = "match-count-mismatch (`expected`, `matched`, `names`); nothing was changed",
            body = Problem, content_type = "application/problem+json")))]
pub async fn rollback(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<RollbackRequest>,
) -> Result<Json<Changed<Vec<RolledBack>>>, ApiError> {
    let scope = scope(body.scope.as_deref(), &body.ids)?;
    let target = body.to_version.map_or(Target::LastClean, Target::Version);
    let done = rollback::rollback(&state.pool, &caller.actor(), &scope, body.expect_count, target).await?;
    Ok(Json(done.into()))
}

/// After a rollback: the workload renders from the rulesets again.
#[utoipa::path(post, path = "/api/v1/workloads/{id}/unpin", tag = "gate",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "Unpinned; `changed` names the new version", body = Changed<Nothing>)))]
pub async fn unpin(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let id = super::workloads::workload(&id)?;
    Ok(Json(rollback::unpin(&state.pool, &caller.actor(), id).await?.into()))
}
