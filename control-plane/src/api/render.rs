//! `/api/v1/render`: render every workload now, as `innerwall render` does — normally automatic
//! on every change, a repair lever otherwise. Not versioned (it names no object), so no
//! `If-Match`; audited as `policy.render` with the caller as the actor and the versions it moved
//! (repeats that moved nothing counted on one row); rate-bounded per token and overall (429).

use axum::Json;
use axum::extract::State;

use super::auth::Caller;
use super::problem::{ApiError, Problem};
use super::{ApiState, Changed, Nothing};
use crate::policy::authoring;

/// Renders every workload and publishes what changed.
#[utoipa::path(post, path = "/api/v1/render", tag = "render",
    responses((status = 200, description = "Rendered; `changed` names the workloads whose policy moved (none when the stored policy was current)",
        body = Changed<Nothing>),
        (status = 429, description = "rate-limited: over the renders a token, or everyone, may ask for per minute (`Retry-After`)",
            body = Problem, content_type = "application/problem+json")))]
pub async fn render(
    State(state): State<ApiState>,
    caller: Caller,
) -> Result<Json<Changed<Nothing>>, ApiError> {
    Ok(Json(Changed::from(
        authoring::render_bounded(&state.pool, &caller.actor(), &state.limits.expensive).await?,
    )))
}
