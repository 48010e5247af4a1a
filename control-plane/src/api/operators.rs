//! `/api/v1/operator-tokens`: the API's own tokens, for admins — listed, minted (the token is in
//! the answer once, stored only as its hash) and revoked through `identity::operators`, audited
//! with the calling admin as the actor, as `innerwall operator token` does on a host.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query};
use super::problem::ApiError;
use super::{ApiState, PageQuery, page_request};
use crate::error::Error;
use crate::identity::operators::{self, Expiry, MintedOperatorToken, OperatorTokenView, Role, TokenRef};
use crate::page::Page;

#[utoipa::path(get, path = "/api/v1/operator-tokens", tag = "operator-tokens", params(PageQuery),
    responses((status = 200, description = "A page of the operator tokens, newest first (never a secret)",
        body = Page<OperatorTokenView>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<OperatorTokenView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(operators::page(&mut conn, &request).await?))
}

/// An operator token to mint.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewOperatorToken {
    /// Who holds it: 1–63 of `A-Z a-z 0-9 . _ -`, unique among live tokens.
    pub name: String,
    pub role: Role,
    /// Validity in seconds (at most three years); without it (and without `never_expires`) the
    /// token expires after 90 days.
    pub expires_in_seconds: Option<u64>,
    /// `true`: the token never expires (valid until revoked), listed with `expires_at` null.
    /// Not with `expires_in_seconds`.
    #[serde(default)]
    pub never_expires: bool,
}

#[utoipa::path(post, path = "/api/v1/operator-tokens", tag = "operator-tokens", request_body = NewOperatorToken,
    responses((status = 201, description = "Minted; `token` is in this answer only", body = MintedOperatorToken)))]
pub async fn mint(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewOperatorToken>,
) -> Result<Response, ApiError> {
    let expires = match (body.expires_in_seconds, body.never_expires) {
        (Some(_), true) => {
            return Err(ApiError::Malformed("give expires_in_seconds or never_expires, not both".to_owned()));
        }
        (None, true) => Expiry::Never,
        (None, false) => Expiry::default(),
        (Some(s), false) => Expiry::After(
            i64::try_from(s)
                .ok()
                .and_then(chrono::Duration::try_seconds)
                .ok_or_else(|| ApiError::Malformed(format!("expires_in_seconds {s} is too large")))?,
        ),
    };
    let minted = operators::mint_audited_within(
        &state.pool,
        &caller.actor(),
        &body.name,
        body.role,
        expires,
        &state.limits.counts,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(minted)).into_response())
}

/// Revokes a token by its id (never by name, so a name cannot be taken for another token's id);
/// refused from its next request on.
#[utoipa::path(delete, path = "/api/v1/operator-tokens/{id}", tag = "operator-tokens",
    params(("id" = String, Path, description = "The token's id (8 characters, as the list shows)")),
    responses((status = 200, description = "Revoked", body = OperatorTokenView)))]
pub async fn revoke(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<OperatorTokenView>, ApiError> {
    Ok(Json(operators::revoke_audited(&state.pool, &caller.actor(), &TokenRef::Id(id), None).await?))
}
