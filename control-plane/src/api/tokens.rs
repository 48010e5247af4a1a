//! `/api/v1/provisioning-tokens`: the tokens hosts enroll with (IDN-1) — listed, minted (the
//! secret is in the answer once, stored nowhere) and revoked, through `identity::tokens`, audited
//! with the caller as the actor.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Cidr;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query};
use super::problem::ApiError;
use super::{ApiState, PageQuery, page_request};
use crate::error::Error;
use crate::identity::tokens::{self, DEFAULT_TTL_DAYS, TokenView};
use crate::page::Page;

#[utoipa::path(get, path = "/api/v1/provisioning-tokens", tag = "provisioning-tokens", params(PageQuery),
    responses((status = 200, description = "A page of the tokens, newest first (never a secret)", body = Page<TokenView>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<TokenView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(tokens::page(&mut conn, &request).await?))
}

/// A token to mint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    /// `key=value`: the labels every workload it enrolls gets (at least one).
    pub labels: Vec<String>,
    /// Validity in seconds; default 30 days, at most 365 days.
    pub ttl_seconds: Option<u64>,
    /// At most this many enrollments (default: unlimited until expiry).
    pub max_uses: Option<u32>,
    /// Narrow the addresses its workloads may claim to these ranges (default: the estate ranges).
    #[serde(default)]
    pub address_ranges: Vec<String>,
}

/// A minted token: `token` is shown here once and stored nowhere.
#[derive(Debug, Serialize, ToSchema)]
pub struct Minted {
    pub id: uuid::Uuid,
    pub token: String,
    pub expires_at: DateTime<Utc>,
}

#[utoipa::path(post, path = "/api/v1/provisioning-tokens", tag = "provisioning-tokens", request_body = NewToken,
    responses((status = 201, description = "Minted; the token is in this answer only", body = Minted)))]
pub async fn mint(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewToken>,
) -> Result<Response, ApiError> {
    let labels = body
        .labels
        .iter()
        .map(|l| l.parse::<Label>().map_err(|e| ApiError::Malformed(format!("label {l:?}: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let ranges = body
        .address_ranges
        .iter()
        .map(|r| Cidr::parse(r).map_err(|e| ApiError::Malformed(format!("address range: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let ttl = match body.ttl_seconds {
        None => chrono::Duration::days(DEFAULT_TTL_DAYS),
        Some(s) => i64::try_from(s)
            .ok()
            .and_then(chrono::Duration::try_seconds)
            .ok_or_else(|| ApiError::Malformed(format!("ttl_seconds {s} is too large")))?,
    };
    let minted = tokens::mint_audited_within(
        &state.pool,
        &caller.actor(),
        &labels,
        ttl,
        body.max_uses,
        &ranges,
        &state.limits.counts,
    )
    .await?;
    let location = format!("/api/v1/provisioning-tokens/{}", minted.id);
    let body = Minted { id: minted.id, token: minted.secret, expires_at: minted.expires_at };
    Ok((StatusCode::CREATED, [(axum::http::header::LOCATION, location)], Json(body)).into_response())
}

/// Revokes a token: it enrolls nothing from now on. Revoking a revoked token keeps the first time.
#[utoipa::path(delete, path = "/api/v1/provisioning-tokens/{id}", tag = "provisioning-tokens",
    params(("id" = String, Path, description = "The token's id")),
    responses((status = 200, description = "Revoked", body = TokenView)))]
pub async fn revoke(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<TokenView>, ApiError> {
    let id: uuid::Uuid = id.parse().map_err(|_| {
        ApiError::Malformed(format!(
            "{:?} is not a token id (a UUID)",
            id.chars().take(64).collect::<String>()
        ))
    })?;
    tokens::revoke_audited(&state.pool, &caller.actor(), id).await?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let all = tokens::list(&mut conn).await.map_err(Error::from)?;
    let view = all
        .into_iter()
        .find(|t| t.id == id)
        .ok_or(Error::NotFound { what: "provisioning token", name: id.to_string() })?;
    Ok(Json(view))
}
