//! `/api/v1/flows`: the flow evidence agents reported (FLOW-6) — one workload's records, the
//! evidence gaps, and rollups — each a bounded page with a cursor, through the `flows` queries
//! `innerwall flows` runs.

// utoipa's `params(…)` expansion names the `IntoParams` types by a path it could shorten.
#![allow(unused_qualifications)]

use std::collections::BTreeSet;

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use serde::Deserialize;
use utoipa::IntoParams;

use super::extract::Query;
use super::problem::ApiError;
use super::{ApiState, page_request};
use crate::flows::{self as f, FlowRow, GapRow, Grouping, RollupFilter, RollupRow};
use crate::page::Page;

/// The instant `text` (a duration: `1h`, `7d`, `90m`) before now; `default` when absent.
fn since(text: Option<&str>, default: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
    let text = text.unwrap_or(default);
    let back = humantime::parse_duration(text)
        .map_err(|e| ApiError::Malformed(format!("since {text:?}: {e}; write e.g. 1h, 24h, 7d")))?;
    Ok(crate::input::since(now, back))
}

fn decision(name: &str) -> Result<Decision, ApiError> {
    name.trim().parse::<Decision>().map_err(|_| {
        ApiError::Malformed(format!(
            "unknown decision {name:?}: use observed, allowed, would-block or blocked"
        ))
    })
}

fn workload(text: &str) -> Result<WorkloadId, ApiError> {
    text.trim().parse::<WorkloadId>().map_err(|_| {
        ApiError::Malformed(format!(
            "{:?} is not a workload id (a UUID)",
            text.chars().take(64).collect::<String>()
        ))
    })
}

/// Comma-separated values of a query parameter, empty ones dropped.
fn list(text: Option<&str>) -> Vec<&str> {
    text.map(|t| t.split(',').map(str::trim).filter(|v| !v.is_empty()).collect()).unwrap_or_default()
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// The workload that reported the flows.
    workload: String,
    /// How far back (`1h`, `7d`; default 1h).
    since: Option<String>,
    /// `observed`, `allowed`, `would-block` or `blocked`.
    decision: Option<String>,
    /// Only records decided under this policy version.
    version: Option<u64>,
    /// Rows per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// One workload's inbound flow records, newest window first.
#[utoipa::path(get, path = "/api/v1/flows", tag = "flows", params(ListQuery),
    responses((status = 200, description = "A page of records", body = Page<FlowRow>)))]
pub async fn list_records(
    State(state): State<ApiState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page<FlowRow>>, ApiError> {
    let (filter, request) = records_request(q, Utc::now())?;
    Ok(Json(f::list(&state.pool, &filter, &request).await?))
}

/// What a records query asks, checked before any I/O (pure; the `api_params` fuzz target drives it).
pub fn records_request(
    q: ListQuery,
    now: DateTime<Utc>,
) -> Result<(f::RecordFilter, crate::page::PageRequest), ApiError> {
    let filter = f::RecordFilter {
        workload: workload(&q.workload)?,
        since: since(q.since.as_deref(), "1h", now)?,
        decision: q.decision.as_deref().map(decision).transpose()?,
        version: q.version,
    };
    Ok((filter, page_request(q.limit, q.cursor, 100)?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct GapsQuery {
    /// One workload's gaps (default: every workload's).
    workload: Option<String>,
    /// How far back (`1h`, `7d`; default 24h).
    since: Option<String>,
    /// Rows per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// Evidence gaps: what could not be recorded, latest first.
#[utoipa::path(get, path = "/api/v1/flows/gaps", tag = "flows", params(GapsQuery),
    responses((status = 200, description = "A page of gaps", body = Page<GapRow>)))]
pub async fn gaps(
    State(state): State<ApiState>,
    Query(q): Query<GapsQuery>,
) -> Result<Json<Page<GapRow>>, ApiError> {
    let (who, from, request) = gaps_request(q, Utc::now())?;
    Ok(Json(f::gaps(&state.pool, who, from, &request).await?))
}

/// What a gaps query asks, checked before any I/O (pure).
pub fn gaps_request(
    q: GapsQuery,
    now: DateTime<Utc>,
) -> Result<(Option<WorkloadId>, DateTime<Utc>, crate::page::PageRequest), ApiError> {
    let who = q.workload.as_deref().map(workload).transpose()?;
    Ok((who, since(q.since.as_deref(), "24h", now)?, page_request(q.limit, q.cursor, 100)?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RollupQuery {
    /// `rule`, `rule-peer`, `src-dst`, `dst-service` or `peer-service`.
    by: String,
    /// Flows to these workloads (comma-separated ids).
    workload: Option<String>,
    /// Flows to the workloads the selector matches now (`app=web,env=prod|staging`).
    scope: Option<String>,
    /// The peer had these labels when the flow was recorded (comma-separated `key=value`).
    peer_label: Option<String>,
    /// Any of these decisions (comma-separated).
    decision: Option<String>,
    /// Decided under any of these policy versions (comma-separated).
    version: Option<String>,
    /// How far back (`1h`, `7d`), instead of `from`/`to`; default 1h.
    since: Option<String>,
    /// Start of the range (RFC 3339).
    from: Option<DateTime<Utc>>,
    /// End of the range (RFC 3339); default now.
    to: Option<DateTime<Utc>>,
    /// Groups per page, 1 to 1,000 (default 100).
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// Flows summed by a grouping over a range, with the policy versions that decided them
/// (`innerwall flows rollup --json` prints the same page).
#[utoipa::path(get, path = "/api/v1/flows/rollup", tag = "flows", params(RollupQuery),
    responses((status = 200, description = "A page of groups (`RollupRow`s: the grouping's key fields, then sums)",
        body = Page<serde_json::Value>)))]
pub async fn rollup(
    State(state): State<ApiState>,
    Query(q): Query<RollupQuery>,
) -> Result<Json<Page<RollupRow>>, ApiError> {
    let (by, mut filter, request) = rollup_request(&q, Utc::now())?;
    if let Some(scope) = &q.scope {
        let selector = f::parse_selector(scope)?;
        filter = filter.within(f::workloads_in(&state.pool, &selector).await?);
    }
    Ok(Json(f::rollup(&state.pool, by, &filter, &request).await?))
}

/// What a rollup query asks, checked before any I/O (pure; the scope is resolved by the
/// handler, its selector parsed here): the range within what a client may name.
pub fn rollup_request(
    q: &RollupQuery,
    now: DateTime<Utc>,
) -> Result<(Grouping, RollupFilter, crate::page::PageRequest), ApiError> {
    let by: Grouping = q.by.parse()?;
    let (start, end) = match (&q.since, q.from) {
        (Some(_), Some(_)) => return Err(ApiError::Malformed("give since or from/to, not both".into())),
        (_, Some(from)) => (
            crate::input::instant("from", from)?,
            q.to.map(|to| crate::input::instant("to", to)).transpose()?.unwrap_or(now),
        ),
        (_, None) if q.to.is_some() => return Err(ApiError::Malformed("to needs from".into())),
        (since_text, None) => (since(since_text.as_deref(), "1h", now)?, now),
    };
    let mut filter = RollupFilter {
        decisions: list(q.decision.as_deref()).into_iter().map(decision).collect::<Result<_, _>>()?,
        peer_labels: list(q.peer_label.as_deref())
            .into_iter()
            .map(|l| l.parse::<Label>().map_err(|e| ApiError::Malformed(format!("peer_label {l:?}: {e}"))))
            .collect::<Result<_, _>>()?,
        versions: list(q.version.as_deref())
            .into_iter()
            .map(|v| {
                v.parse::<u64>().map_err(|_| ApiError::Malformed(format!("version {v:?} is not a number")))
            })
            .collect::<Result<_, _>>()?,
        ..RollupFilter::range(start, end)
    };
    let ids = list(q.workload.as_deref());
    if ids.len() > crate::gate::evidence::MAX_SCOPE_IDS {
        return Err(ApiError::Malformed(format!(
            "at most {} workload ids",
            crate::gate::evidence::MAX_SCOPE_IDS
        )));
    }
    if !ids.is_empty() {
        filter = filter.within(ids.into_iter().map(workload).collect::<Result<BTreeSet<_>, _>>()?);
    }
    if let Some(scope) = &q.scope {
        f::parse_selector(scope)?;
    }
    Ok((by, filter, page_request(q.limit, q.cursor.clone(), 100)?))
}
