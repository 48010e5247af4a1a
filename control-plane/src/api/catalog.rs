//! `/api/v1/services`, `/api/v1/address-groups`, `/api/v1/rulesets`: the authored model, named
//! and versioned. Creates answer 201 with `ETag: "1"`; updates and deletes require `If-Match`
//! with the version read (428 without, 412 with the current version when stale); a delete of
//! something rules still use is 409 in-use naming them; a taken name is 409 duplicate-name.
//! Every change is one call of `operations`, which the CLI makes too: written, rendered, judged
//! and audited in one transaction, with one audit record whichever edge it came through.

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use innerwall_wire::policy::Cidr;
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query, etag, if_match};
use super::problem::{ApiError, Problem};
use super::workloads::created;
use super::{ApiState, Changed, Nothing, PageQuery, page_request};
use crate::error::Error;
use crate::operations;
use crate::page::Page;
use crate::policy::model::ServiceEntry;
use crate::policy::spec::{AddressGroupSpec, RulesetSpec, ServiceSpec};
use crate::policy::store::{self, AddressGroupView, RulesetView, ServiceView};

fn entries(texts: &[String]) -> Result<Vec<ServiceEntry>, Error> {
    texts.iter().map(|t| ServiceEntry::parse(t).map_err(Error::from)).collect()
}

fn cidrs(texts: &[String]) -> Result<std::collections::BTreeSet<Cidr>, Error> {
    texts.iter().map(|t| Cidr::parse(t).map_err(Error::from)).collect()
}

async fn conn(state: &ApiState) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, ApiError> {
    Ok(state.pool.acquire().await.map_err(Error::from)?)
}

// ---- services -----------------------------------------------------------------------------

/// A new service.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewService {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// `tcp:80,443,8000-8080`, `udp:53`, `tcp:all`, `icmp`, `icmpv6`.
    pub entries: Vec<String>,
}

/// A service's new entries and description.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceBody {
    #[serde(default)]
    pub description: String,
    pub entries: Vec<String>,
}

#[utoipa::path(get, path = "/api/v1/services", tag = "catalog", params(PageQuery),
    responses((status = 200, description = "A page of the services, by name", body = Page<ServiceView>)))]
pub async fn list_services(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<ServiceView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    Ok(Json(store::service_page(&mut *conn(&state).await?, &request).await?))
}

#[utoipa::path(post, path = "/api/v1/services", tag = "catalog", request_body = NewService,
    responses((status = 201, description = "Created at version 1", body = Changed<Nothing>),
        (status = 409, description = "duplicate-name, or limit-reached", body = Problem, content_type = "application/problem+json")))]
pub async fn create_service(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewService>,
) -> Result<Response, ApiError> {
    let spec =
        ServiceSpec { name: body.name, description: body.description, entries: entries(&body.entries)? };
    let done = operations::create_service(&state.pool, &caller.actor(), &spec, &state.limits.counts).await?;
    Ok(created(format!("/api/v1/services/{}", spec.name), 1, Changed::<Nothing>::from(done)))
}

#[utoipa::path(get, path = "/api/v1/services/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The service's name")),
    responses((status = 200, description = "The service; `ETag` is its version", body = ServiceView)))]
pub async fn show_service(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let view = store::service_view(&mut *conn(&state).await?, &name).await?;
    Ok(([etag(view.version)], Json(view)).into_response())
}

#[utoipa::path(put, path = "/api/v1/services/{name}", tag = "catalog", request_body = ServiceBody,
    params(("name" = String, Path, description = "The service's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Updated; the result is the new version", body = Changed<i64>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn update_service(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<ServiceBody>,
) -> Result<Response, ApiError> {
    let expected = if_match(&headers, "a service")?;
    let spec = ServiceSpec { name, description: body.description, entries: entries(&body.entries)? };
    let done = operations::update_service(&state.pool, &caller.actor(), &spec, expected).await?;
    Ok(([etag(done.value)], Json(Changed::from(done))).into_response())
}

#[utoipa::path(delete, path = "/api/v1/services/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The service's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Deleted", body = Changed<Nothing>),
        (status = 409, description = "in-use: `referrers` names the rules", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn delete_service(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let expected = if_match(&headers, "a service")?;
    let done = operations::delete_service(&state.pool, &caller.actor(), &name, expected).await?;
    Ok(Json(Changed::from(done)))
}

// ---- address groups -----------------------------------------------------------------------

/// A new address group.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewGroup {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// CIDRs in canonical spelling (a host route is `/32` or `/128`; a bare address is refused).
    pub cidrs: Vec<String>,
}

/// An address group's new CIDRs and description.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupBody {
    #[serde(default)]
    pub description: String,
    pub cidrs: Vec<String>,
}

#[utoipa::path(get, path = "/api/v1/address-groups", tag = "catalog", params(PageQuery),
    responses((status = 200, description = "A page of the address groups, by name", body = Page<AddressGroupView>)))]
pub async fn list_groups(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<AddressGroupView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    Ok(Json(store::address_group_page(&mut *conn(&state).await?, &request).await?))
}

#[utoipa::path(post, path = "/api/v1/address-groups", tag = "catalog", request_body = NewGroup,
    responses((status = 201, description = "Created at version 1", body = Changed<Nothing>),
        (status = 409, description = "duplicate-name, or limit-reached", body = Problem, content_type = "application/problem+json")))]
pub async fn create_group(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<NewGroup>,
) -> Result<Response, ApiError> {
    let spec =
        AddressGroupSpec { name: body.name, description: body.description, cidrs: cidrs(&body.cidrs)? };
    let done =
        operations::create_address_group(&state.pool, &caller.actor(), &spec, &state.limits.counts).await?;
    Ok(created(format!("/api/v1/address-groups/{}", spec.name), 1, Changed::<Nothing>::from(done)))
}

#[utoipa::path(get, path = "/api/v1/address-groups/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The address group's name")),
    responses((status = 200, description = "The address group; `ETag` is its version", body = AddressGroupView)))]
pub async fn show_group(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let view = store::address_group_view(&mut *conn(&state).await?, &name).await?;
    Ok(([etag(view.version)], Json(view)).into_response())
}

#[utoipa::path(put, path = "/api/v1/address-groups/{name}", tag = "catalog", request_body = GroupBody,
    params(("name" = String, Path, description = "The address group's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Updated; the result is the new version", body = Changed<i64>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn update_group(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<GroupBody>,
) -> Result<Response, ApiError> {
    let expected = if_match(&headers, "an address group")?;
    let spec = AddressGroupSpec { name, description: body.description, cidrs: cidrs(&body.cidrs)? };
    let done = operations::update_address_group(&state.pool, &caller.actor(), &spec, expected).await?;
    Ok(([etag(done.value)], Json(Changed::from(done))).into_response())
}

#[utoipa::path(delete, path = "/api/v1/address-groups/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The address group's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Deleted", body = Changed<Nothing>),
        (status = 409, description = "in-use: `referrers` names the rules", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn delete_group(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let expected = if_match(&headers, "an address group")?;
    let done = operations::delete_address_group(&state.pool, &caller.actor(), &name, expected).await?;
    Ok(Json(Changed::from(done)))
}

// ---- rulesets -----------------------------------------------------------------------------

#[utoipa::path(get, path = "/api/v1/rulesets", tag = "catalog", params(PageQuery),
    responses((status = 200, description = "A page of the rulesets, by name, in the shape they are written",
        body = Page<RulesetView>)))]
pub async fn list_rulesets(
    State(state): State<ApiState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<RulesetView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    Ok(Json(store::ruleset_page(&mut *conn(&state).await?, &request).await?))
}

#[utoipa::path(post, path = "/api/v1/rulesets", tag = "catalog", request_body = RulesetSpec,
    responses((status = 201, description = "Created at version 1", body = Changed<Nothing>),
        (status = 409, description = "duplicate-name, or limit-reached", body = Problem, content_type = "application/problem+json")))]
pub async fn create_ruleset(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(spec): JsonBody<RulesetSpec>,
) -> Result<Response, ApiError> {
    let done = operations::create_ruleset(&state.pool, &caller.actor(), &spec, &state.limits.counts).await?;
    Ok(created(format!("/api/v1/rulesets/{}", spec.name), 1, Changed::<Nothing>::from(done)))
}

#[utoipa::path(get, path = "/api/v1/rulesets/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The ruleset's name")),
    responses((status = 200, description = "The ruleset; `ETag` is its version", body = RulesetView)))]
pub async fn show_ruleset(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let view = store::ruleset_view(&mut *conn(&state).await?, &name).await?;
    Ok(([etag(view.version)], Json(view)).into_response())
}

/// Replaces the ruleset (rules keep their identity by name); the body names the same ruleset
/// as the path (a ruleset is not renamed).
#[utoipa::path(put, path = "/api/v1/rulesets/{name}", tag = "catalog", request_body = RulesetSpec,
    params(("name" = String, Path, description = "The ruleset's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Updated; the result is the new version", body = Changed<i64>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn update_ruleset(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<RulesetSpec>,
) -> Result<Response, ApiError> {
    let expected = if_match(&headers, "a ruleset")?;
    if spec.name != name {
        return Err(ApiError::Malformed(format!(
            "the body names ruleset {:?} and the path {name:?}; a ruleset is not renamed (create the new one, delete the old)",
            spec.name
        )));
    }
    let done = operations::update_ruleset(&state.pool, &caller.actor(), &spec, expected).await?;
    Ok(([etag(done.value)], Json(Changed::from(done))).into_response())
}

#[utoipa::path(delete, path = "/api/v1/rulesets/{name}", tag = "catalog",
    params(("name" = String, Path, description = "The ruleset's name"),
        ("If-Match" = String, Header, description = "The version read, quoted")),
    responses((status = 200, description = "Deleted", body = Changed<Nothing>),
        (status = 412, description = "Stale: `current_version`", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn delete_ruleset(
    State(state): State<ApiState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let expected = if_match(&headers, "a ruleset")?;
    let done = operations::delete_ruleset(&state.pool, &caller.actor(), &name, expected).await?;
    Ok(Json(Changed::from(done)))
}
