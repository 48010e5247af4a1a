//! `/api/v1/render`: render every workload now, as `innerwall render` does — normally automatic
//! on every change, a repair lever otherwise. Not versioned (it names no object), so no
//! `If-Match`; audited as `policy.render` with the caller as the actor and the versions it moved.

use axum::Json;
use axum::extract::State;

use super::auth::Caller;
use super::problem::ApiError;
use super::{ApiState, Changed, Nothing};
use crate::policy::authoring;

/// Renders every workload and publishes what changed.
#[utoipa::path(post, path = "/api/v1/render", tag = "render",
    responses((status = 200, description = "Rendered; `changed` names the workloads whose policy moved (none when the stored policy was current)",
        body = Changed<Nothing>)))]
pub async fn render(
    State(state): State<ApiState>,
    caller: Caller,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    Ok(Json(Changed::from(authoring::render_audited(&state.pool, &caller.actor()).await?)))
}
