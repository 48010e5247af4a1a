//! `/api/v1/estate-ranges`: the estate's workload address ranges (address trust: a reported
//! address enters other workloads' peer sets only inside one of them) — listed, added and
//! removed through the library calls `innerwall estate-range` makes, each change an
//! `foresight::commit` (written, rendered, audited) with the caller as the actor.
//!
//! Ranges are not versioned: a range is named by its value, adding one that exists is 409
//! duplicate-name and removing one that does not is 404, so a write cannot overwrite what
//! another operator did and needs no `If-Match`. Writing them needs the admin role (see
//! `router`): a range decides which reported addresses other hosts admit, the same trust
//! decision as retiring or deny-listing a workload.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use innerwall_wire::policy::Cidr;
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query};
use super::problem::ApiError;
use super::{ApiState, Changed, Nothing, PageQuery, page_request};
use crate::error::Error;
use crate::page::Page;
use crate::policy::store::{self, EstateRangeView};

/// A range as the CLI takes it: the network address and prefix (`10.0.0.0/8`, `fd00::/8`).
fn range(text: &str) -> Result<Cidr, ApiError> {
    Cidr::parse(text).map_err(|e| {
        ApiError::Malformed(format!("estate range {:?}: {e}", text.chars().take(64).collect::<String>()))
    })
}

#[utoipa::path(get, path = "/api/v1/estate-ranges", operation_id = "list_estate_ranges", tag = "estate-ranges",
    params(PageQuery),
    responses((status = 200, description = "A page of the estate ranges, smallest address first",
        body = Page<EstateRangeView>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<EstateRangeView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(store::estate_range_page(&mut conn, &request).await?))
}

/// A range to trust as workload addresses.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEstateRange {
    /// The network address and prefix, e.g. `198.51.100.0/24`.
    pub cidr: String,
    #[serde(default)]
    pub description: String,
}

/// Adds a range: addresses in it that workloads report (and nothing else refuses) enter other
/// workloads' peer sets.
#[utoipa::path(post, path = "/api/v1/estate-ranges", operation_id = "add_estate_range", tag = "estate-ranges", request_body = NewEstateRange,
    responses((status = 201, description = "Added; `changed` names the workloads whose policy moved", body = Changed<Nothing>),
        (status = 409, description = "duplicate-name: the range is there already", body = super::problem::Problem,
            content_type = "application/problem+json")))]
pub async fn add(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewEstateRange>,
) -> Result<Response, ApiError> {
    let cidr = range(&body.cidr)?;
    let description = body.description;
    let subject = cidr.to_string();
    let done = crate::operations::add_estate_range(&state.pool, &caller.actor(), cidr, &description).await?;
    // No ETag: a range has no version. Its location is where it is removed.
    let location = format!("/api/v1/estate-ranges/{subject}");
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(Changed::<Nothing>::from(done)))
        .into_response())
}

/// Removes a range, named by its address and prefix as two path segments
/// (`/api/v1/estate-ranges/198.51.100.0/24`): addresses only it admitted leave every peer set.
#[utoipa::path(delete, path = "/api/v1/estate-ranges/{address}/{prefix}", operation_id = "remove_estate_range", tag = "estate-ranges",
    params(("address" = String, Path, description = "The range's network address, e.g. `198.51.100.0`"),
        ("prefix" = u8, Path, description = "The range's prefix length, e.g. `24`")),
    responses((status = 200, description = "Removed; `changed` names the workloads whose policy moved", body = Changed<Nothing>)))]
pub async fn remove(
    State(state): State<ApiState>,
    caller: Caller,
    Path((address, prefix)): Path<(String, String)>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let cidr = range(&format!("{address}/{prefix}"))?;
    let done = crate::operations::remove_estate_range(&state.pool, &caller.actor(), cidr).await?;
    Ok(Json(Changed::from(done)))
}
