//! `/api/v1/audit`: the audit log read back (POL-8, OPS-2) — who changed what and when, newest
//! first, a page at a time, filtered by actor, action, object and age, through `audit::page`,
//! the read `innerwall audit list` makes.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use axum::Json;
use axum::extract::State;
use chrono::Utc;
use serde::Deserialize;
use utoipa::IntoParams;

use super::extract::Query;
use super::problem::ApiError;
use super::{ApiState, page_request};
use crate::audit::{self, AuditFilter, AuditRow};
use crate::error::Error;
use crate::page::Page;

/// The longest filter value read (actors, actions and subjects are far shorter).
const MAX_FILTER: usize = crate::audit::MAX_FILTER;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Records by this actor exactly (`cli:alice`, `operator:ed/AbCd1234`, `workload:<id>`).
    actor: Option<String>,
    /// Records of this action exactly (`service.update`, `workload.resend-snapshot`, …).
    action: Option<String>,
    /// Records about this object exactly: the record's subject (a name, a workload id, …).
    object: Option<String>,
    /// Records written within this long before now (`1h`, `7d`); without it, all.
    since: Option<String>,
    /// Rows per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

fn filter_value(name: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    match value {
        Some(v) if v.len() > MAX_FILTER => {
            Err(ApiError::Malformed(format!("{name}: at most {MAX_FILTER} bytes, not {}", v.len())))
        }
        v => Ok(v),
    }
}

/// The audit log, newest first.
#[utoipa::path(get, path = "/api/v1/audit", operation_id = "list_audit", tag = "audit", params(AuditQuery),
    responses((status = 200, description = "A page of audit records, newest first", body = Page<AuditRow>)))]
pub async fn list(
    State(state): State<ApiState>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<Page<AuditRow>>, ApiError> {
    let since = q
        .since
        .as_deref()
        .map(|text| {
            let back = humantime::parse_duration(text)
                .map_err(|e| ApiError::Malformed(format!("since {text:?}: {e}; write e.g. 1h, 24h, 7d")))?;
            Ok::<_, ApiError>(crate::input::since(Utc::now(), back))
        })
        .transpose()?;
    let filter = AuditFilter {
        actor: filter_value("actor", q.actor)?,
        action: filter_value("action", q.action)?,
        object: filter_value("object", q.object)?,
        since,
    };
    let request = page_request(q.limit, q.cursor, 100)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    Ok(Json(audit::page(&mut conn, &filter, &request).await?))
}
