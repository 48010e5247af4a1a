//! `/api/v1/management`: the management access every workload keeps whatever its policy says
//! (the failsafe rule) — shown, and narrowed for the estate or for one workload through the
//! library calls `innerwall management` makes (`safety::management`). Narrowing needs the admin
//! role (see `router`). Nothing here widens or removes it: replacing it (`management reset`) is
//! offered only on the database, so a stolen token cannot open every host's management ports.

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{JsonBody, Path};
use super::problem::ApiError;
use super::workloads::workload;
use super::{ApiState, Changed, Nothing};
use crate::error::Error;
use crate::policy::model::{MAX_MANAGEMENT_CIDRS, Management, ServiceEntry};
use crate::safety::management::{self, ManagementListing, Scope};
use innerwall_wire::policy::Cidr;

/// Management access as written: source ranges and service entries.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ManagementSpec {
    /// Source ranges, e.g. `192.0.2.0/24` (1 to 64).
    pub cidrs: Vec<String>,
    /// Service entries, e.g. `tcp:22`.
    pub services: Vec<String>,
}

impl ManagementSpec {
    fn parse(&self) -> Result<Management, ApiError> {
        // Bounded before anything is parsed: a body of a million ranges is refused as such.
        if self.cidrs.len() > MAX_MANAGEMENT_CIDRS || self.services.len() > 16 {
            return Err(ApiError::Malformed(format!(
                "management access names at most {MAX_MANAGEMENT_CIDRS} ranges and 16 services"
            )));
        }
        let cidrs = self.cidrs.iter().map(|c| Cidr::parse(c)).collect::<Result<Vec<_>, _>>();
        let services = self.services.iter().map(|s| ServiceEntry::parse(s)).collect::<Result<Vec<_>, _>>();
        let set = Management::new(cidrs.map_err(Error::from)?, services.map_err(Error::from)?)
            .map_err(Error::from)?;
        Ok(set)
    }
}

#[utoipa::path(get, path = "/api/v1/management", operation_id = "show_management", tag = "management",
    responses((status = 200, description = "The estate's management access and every workload's narrowing",
        body = ManagementListing)))]
pub async fn show(State(state): State<ApiState>) -> Result<Json<ManagementListing>, ApiError> {
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(management::list(&mut conn).await?))
}

/// Narrows the estate's management access: every range inside one of the current set's, every
/// service inside its services; refused while a workload's narrowing would fall outside it.
#[utoipa::path(put, path = "/api/v1/management", operation_id = "narrow_management", tag = "management",
    request_body = ManagementSpec,
    responses((status = 200, description = "Narrowed; `changed` names the workloads whose policy moved", body = Changed<Nothing>)))]
pub async fn narrow(
    State(state): State<ApiState>,
    caller: Caller,
    JsonBody(body): JsonBody<ManagementSpec>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let set = body.parse()?;
    Ok(Json(management::narrow(&state.pool, &caller.actor(), Scope::Estate, &set).await?.into()))
}

/// Narrows one workload's management access (at first, from the estate's).
#[utoipa::path(put, path = "/api/v1/workloads/{id}/management", operation_id = "narrow_workload_management", tag = "management",
    params(("id" = String, Path, description = "The workload id")),
    request_body = ManagementSpec,
    responses((status = 200, description = "Narrowed; `changed` names the workloads whose policy moved", body = Changed<Nothing>)))]
pub async fn narrow_workload(
    State(state): State<ApiState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ManagementSpec>,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    let id = workload(&id)?;
    let set = body.parse()?;
    Ok(Json(management::narrow(&state.pool, &caller.actor(), Scope::Workload(id), &set).await?.into()))
}
