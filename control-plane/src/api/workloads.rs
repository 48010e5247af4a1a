//! `/api/v1/workloads` and `/api/v1/sync-status`: the fleet a page at a time in attention order,
//! one workload's detail, its labels (conditional on the label version), its rendered policy and
//! history, convergence (all, by hostname, a page at a time, or one), and the operator's levers
//! on it (resend snapshot, release an address, retire, deny) — through the library calls the
//! CLI's `innerwall workload` makes.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Mode;
use innerwall_wire::sync::SyncState;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{JsonBody, Path, Query, etag, if_match};
use super::problem::{ApiError, Problem};
use super::{ApiState, Changed, Nothing, page_request};
use crate::error::Error;
use crate::page::Page;
use crate::policy::authoring::{self, LabelsReplaced, ResendRequested};
use crate::policy::store::{
    self, PolicyVersionView, PolicyView, SyncStatusView, WorkloadFacts, WorkloadFilter, WorkloadRow,
    WorkloadView,
};

/// A workload id in a path.
pub(super) fn workload(text: &str) -> Result<WorkloadId, ApiError> {
    text.parse::<WorkloadId>().map_err(|_| {
        ApiError::Malformed(format!(
            "{:?} is not a workload id (a UUID)",
            text.chars().take(64).collect::<String>()
        ))
    })
}

fn not_found(id: WorkloadId) -> ApiError {
    Error::NotFound { what: "workload", name: id.to_string() }.into()
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Workloads whose labels match now: `key=value`, several values `key=v1|v2`, keys ANDed
    /// with commas (`app=web,env=prod|staging`).
    selector: Option<String>,
    /// `visibility`, `simulation` or `enforcement`.
    mode: Option<String>,
    /// `PENDING`, `SYNCED`, `DEGRADED`, `OFFLINE` or `SUSPENDED`.
    sync_state: Option<String>,
    /// Also list retired and deny-listed workloads.
    #[serde(default)]
    include_retired: bool,
    /// Rows per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// The fleet in attention order: degraded, offline, suspended, pending, synced; then the most
/// recently seen first.
#[utoipa::path(get, path = "/api/v1/workloads", tag = "workloads", params(ListQuery),
    responses((status = 200, description = "A page of workloads", body = Page<WorkloadRow>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page<WorkloadRow>>, ApiError> {
    let filter = WorkloadFilter {
        selector: q.selector.as_deref().map(crate::flows::parse_selector).transpose()?,
        mode: q
            .mode
            .as_deref()
            .map(|m| {
                m.parse::<Mode>().map_err(|_| {
                    ApiError::Malformed(format!(
                        "unknown mode {m:?}: use visibility, simulation or enforcement"
                    ))
                })
            })
            .transpose()?,
        sync_state: q
            .sync_state
            .as_deref()
            .map(|s| {
                s.to_ascii_uppercase().parse::<SyncState>().map_err(|_| {
                    ApiError::Malformed(format!(
                        "unknown sync state {s:?}: use PENDING, SYNCED, DEGRADED, OFFLINE or SUSPENDED"
                    ))
                })
            })
            .transpose()?,
        include_retired: q.include_retired,
    };
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(store::workload_page(&mut conn, &filter, &request).await?))
}

/// One workload: registry, labels and addresses (as `workload show --json` prints them),
/// convergence, lifecycle and credential.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkloadDetail {
    pub workload: WorkloadView,
    /// Absent for a retired workload.
    pub sync: Option<SyncStatusView>,
    pub facts: WorkloadFacts,
}

#[utoipa::path(get, path = "/api/v1/workloads/{id}", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "The workload", body = WorkloadDetail)))]
pub async fn show(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<WorkloadDetail>, ApiError> {
    let id = workload(&id)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let view = store::workload_view(&mut conn, id).await?;
    let sync = store::sync_status(&mut conn, Some(id)).await?.into_iter().next();
    let facts = store::workload_facts(&mut conn, id).await?.ok_or_else(|| not_found(id))?;
    Ok(Json(WorkloadDetail { workload: view, sync, facts }))
}

/// A workload's labels and their version (also the `ETag`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Labels {
    pub labels: BTreeMap<String, String>,
    /// The label-set version: send it back in `If-Match` to change the labels.
    #[serde(default)]
    pub version: i64,
}

#[utoipa::path(get, path = "/api/v1/workloads/{id}/labels", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "The labels; `ETag` is their version", body = Labels,
        headers(("ETag" = String, description = "The label-set version, quoted")))))]
pub async fn labels(State(state): State<ApiState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let id = workload(&id)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let view = store::workload_view(&mut conn, id).await?;
    Ok(([etag(view.label_version)], Json(Labels { labels: view.labels, version: view.label_version }))
        .into_response())
}

/// The whole new label set.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutLabels {
    /// Key to value; keys not given are removed.
    pub labels: BTreeMap<String, String>,
}

/// Replaces the label set, if its version is still the one in `If-Match`; renders before it
/// answers.
#[utoipa::path(put, path = "/api/v1/workloads/{id}/labels", tag = "workloads",
    params(("id" = String, Path, description = "The workload id"),
        ("If-Match" = String, Header, description = "The label-set version read, quoted")),
    request_body = PutLabels,
    responses(
        (status = 200, description = "Changed (or already so); `ETag` is the new version", body = Changed<LabelsReplaced>),
        (status = 412, description = "The labels changed since: `current_version` says to what", body = Problem,
            content_type = "application/problem+json"),
        (status = 428, description = "No If-Match", body = Problem, content_type = "application/problem+json")))]
pub async fn put_labels(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<PutLabels>,
) -> Result<Response, ApiError> {
    let id = workload(&id)?;
    let expected = if_match(&headers, "a workload's labels")?;
    let labels = body
        .labels
        .iter()
        .map(|(k, v)| {
            format!("{k}={v}").parse::<Label>().map_err(|e| ApiError::Malformed(format!("label {k:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let done = crate::operations::replace_labels(&state.pool, &caller.actor(), id, expected, &labels).await?;
    let version = done.value.version;
    Ok(([etag(version)], Json(Changed::from(done))).into_response())
}

#[utoipa::path(get, path = "/api/v1/workloads/{id}/policy", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "The latest rendered policy", body = PolicyView)))]
pub async fn policy(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<PolicyView>, ApiError> {
    let id = workload(&id)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(store::policy_view(&mut conn, id).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Rows per page, 1 to 1,000 (default 20).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// Every persisted version of the workload's policy, newest first: summaries (version, digest,
/// rendered_at, size) with the path of each version in full, pages bounded in rows and bytes.
#[utoipa::path(get, path = "/api/v1/workloads/{id}/policy/history", tag = "workloads",
    params(("id" = String, Path, description = "The workload id"), PageQuery),
    responses((status = 200, description = "A page of versions", body = Page<PolicyVersionView>)))]
pub async fn history(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Page<PolicyVersionView>>, ApiError> {
    let id = workload(&id)?;
    let request = page_request(q.limit, q.cursor, 20)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    store::workload_facts(&mut conn, id).await?.ok_or_else(|| not_found(id))?;
    Ok(Json(store::policy_history_page(&mut conn, id, &request).await?))
}

/// One persisted version of the workload's policy in full (a history row's `href`).
#[utoipa::path(get, path = "/api/v1/workloads/{id}/policy/history/{version}", tag = "workloads",
    params(("id" = String, Path, description = "The workload id"),
        ("version" = u64, Path, description = "The policy version")),
    responses((status = 200, description = "The policy at that version", body = PolicyView)))]
pub async fn history_version(
    State(state): State<ApiState>,
    Path((id, version)): Path<(String, String)>,
) -> Result<Json<PolicyView>, ApiError> {
    let id = workload(&id)?;
    let version =
        version.parse::<u64>().ok().filter(|v| *v >= 1 && i64::try_from(*v).is_ok()).ok_or_else(|| {
            ApiError::Malformed(format!(
                "policy version {version:?} is not a version: versions are whole numbers from 1 to {}",
                i64::MAX
            ))
        })?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    store::workload_facts(&mut conn, id).await?.ok_or_else(|| not_found(id))?;
    Ok(Json(store::policy_version_view(&mut conn, id, version).await?))
}

/// The convergence of every workload that is not retired, by hostname (as `workload status
/// --json` prints it, a page at a time).
#[utoipa::path(get, path = "/api/v1/sync-status", tag = "workloads", params(StatusQuery),
    responses((status = 200, description = "A page of sync states", body = Page<SyncStatusView>)))]
pub async fn sync_statuses(
    State(state): State<ApiState>,
    Query(q): Query<StatusQuery>,
) -> Result<Json<Page<SyncStatusView>>, ApiError> {
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(store::sync_status_page(&mut conn, &request).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StatusQuery {
    /// Rows per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// One workload's convergence: applied against latest, sync state, last seen, acked and
/// snapshot, addresses not rendered. A retired workload has none (404).
#[utoipa::path(get, path = "/api/v1/sync-status/{id}", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "Its sync state", body = SyncStatusView)))]
pub async fn sync_status(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<SyncStatusView>, ApiError> {
    let id = workload(&id)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(store::sync_status_of(&mut conn, id).await?))
}

/// The address whose claim is dropped.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseAddress {
    /// An IPv4 or IPv6 address the workload reported.
    pub address: String,
}

/// Drops the workload's claim to an address (resolves a conflict, or forgets an address the host
/// no longer has); if the host still reports it, its next inventory claims it again. Renders
/// before it answers.
#[utoipa::path(post, path = "/api/v1/workloads/{id}/release-address", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    request_body = ReleaseAddress,
    responses((status = 200, description = "Released", body = Changed<Nothing>)))]
pub async fn release_address(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ReleaseAddress>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let id = workload(&id)?;
    let address: std::net::IpAddr = body.address.trim().parse().map_err(|_| {
        ApiError::Malformed(format!(
            "{:?} is not an IP address",
            body.address.chars().take(64).collect::<String>()
        ))
    })?;
    let done = crate::operations::release_address(&state.pool, &caller.actor(), id, address).await?;
    Ok(Json(Changed::from(done)))
}

/// Asks the replica holding the agent's stream to reconnect it (a fresh snapshot follows).
/// Best effort: success shows as `last_snapshot_sent_at` advancing past the one answered.
#[utoipa::path(post, path = "/api/v1/workloads/{id}/resend-snapshot", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses(
        (status = 200, description = "Asked", body = ResendRequested),
        (status = 409, description = "agent-offline: no stream to act on", body = Problem,
            content_type = "application/problem+json"),
        (status = 429, description = "rate-limited: over the resends a token, or everyone, may ask for per minute (`Retry-After`)",
            body = Problem, content_type = "application/problem+json")))]
pub async fn resend_snapshot(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ResendRequested>, ApiError> {
    let id = workload(&id)?;
    Ok(Json(
        authoring::request_snapshot_bounded(&state.pool, &caller.actor(), id, &state.limits.expensive)
            .await?,
    ))
}

/// Retires the workload: its identity and addresses leave every render, its stream is closed.
#[utoipa::path(post, path = "/api/v1/workloads/{id}/retire", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "Retired", body = Changed<Nothing>)))]
pub async fn retire(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    lifecycle(&state, &caller, &id, true).await
}

/// Deny-lists the workload: refused at the handshake, its stream cut, renewal refused.
#[utoipa::path(post, path = "/api/v1/workloads/{id}/deny", tag = "workloads",
    params(("id" = String, Path, description = "The workload id")),
    responses((status = 200, description = "Deny-listed", body = Changed<Nothing>)))]
pub async fn deny(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    lifecycle(&state, &caller, &id, false).await
}

async fn lifecycle(
    state: &ApiState,
    caller: &Caller,
    id: &str,
    retire: bool,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let id = workload(id)?;
    let done = match retire {
        true => crate::operations::retire(&state.pool, &caller.actor(), id).await?,
        false => crate::operations::deny(&state.pool, &caller.actor(), id).await?,
    };
    Ok(Json(Changed::from(done)))
}

/// `201 Created` with a location and a version, for the catalog's creates.
pub(super) fn created<T: Serialize>(location: String, version: i64, body: T) -> Response {
    let location = axum::http::HeaderValue::from_str(&location)
        .unwrap_or_else(|_| axum::http::HeaderValue::from_static("/api/v1"));
    (StatusCode::CREATED, [etag(version)], [(axum::http::header::LOCATION, location)], Json(body))
        .into_response()
}
