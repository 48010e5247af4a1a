//! The auto-demotion guard (issue 31): for a workload's first minutes of enforcement (30 by
//! default, per promotion), blocked flows from a (source address, protocol, port) that the
//! promotion's evidence range showed ALLOWED — traffic that worked before and is refused now —
//! at least `threshold` new connections of them, demote it to simulation. The demotion is a
//! promotion record of its own (actor `guard`, the flows in its reason), audited like any, and
//! the guard keeps the flows; `workload show` says so and `innerwall_auto_demotions_total`
//! counts it. A source the range never showed allowed does not trip it (blocking it is what
//! enforcement is for) unless the promotion asked for `unseen`.
//!
//! Judged after each stored window of a guarded workload (`flows::Telemetry`), in one
//! transaction under the render lock, so two windows at once demote it once.

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::audit;
use crate::error::Error;
use crate::gate::evidence::Scope;
use crate::gate::promote::{self, Promotion, Request, audit_detail};
use crate::gate::verdict::Params;
use crate::policy::publish;

/// One (source, protocol, port) that tripped a guard: the blocked new connections since the
/// promotion, and whether the evidence range showed it allowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Tripped {
    pub src_address: String,
    pub protocol: i16,
    pub dst_port: i32,
    pub blocked_connections: i64,
    pub allowed_before: bool,
}

/// An armed guard as stored: the promotion, when it enforced, the evidence range, the
/// threshold, and whether unseen sources count.
type Armed = (Uuid, DateTime<Utc>, DateTime<Utc>, DateTime<Utc>, i32, bool);

/// Judges `workload`'s guard, if it has one armed and watching now: demotes it when it trips.
/// The demotion's promotion record, if it did.
pub async fn judge(pool: &PgPool, workload: WorkloadId) -> Result<Option<Promotion>, Error> {
    let watching: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM enforcement_guards
                        WHERE workload_id = $1 AND tripped_at IS NULL AND until > now())",
    )
    .bind(workload.uuid())
    .fetch_one(pool)
    .await?;
    if !watching {
        return Ok(None);
    }
    let mut tx = pool.begin().await?;
    publish::lock_renders(&mut tx).await?;
    let guard: Option<Armed> = sqlx::query_as(
        "SELECT promotion_id, since, evidence_from, evidence_to, threshold, unseen FROM enforcement_guards
         WHERE workload_id = $1 AND tripped_at IS NULL AND until > now() FOR UPDATE",
    )
    .bind(workload.uuid())
    .fetch_optional(&mut *tx)
    .await?;
    let Some((guarded, since, from, to, threshold, unseen)) = guard else { return Ok(None) };
    let tripped: Vec<Tripped> = sqlx::query_as(
        "WITH blocked AS (
             SELECT host(src_address) AS src_address, protocol, dst_port, sum(new_connections)::bigint AS n
             FROM flow_records WHERE workload_id = $1 AND window_start >= $2 - interval '1 day' AND last_seen >= $2
               AND decision = $3
             GROUP BY 1, 2, 3)
         SELECT b.src_address, b.protocol, b.dst_port, b.n AS blocked_connections,
                EXISTS (SELECT 1 FROM flow_records r
                        WHERE r.workload_id = $1 AND r.window_start >= $4 - interval '1 day' AND r.window_start < $5
                          AND r.last_seen >= $4 AND r.decision = $6 AND host(r.src_address) = b.src_address
                          AND r.protocol = b.protocol AND r.dst_port = b.dst_port) AS allowed_before
         FROM blocked b WHERE b.n >= $7 ORDER BY b.n DESC, 1, 2, 3",
    )
    .bind(workload.uuid())
    .bind(since)
    .bind(Decision::Blocked.code())
    .bind(from)
    .bind(to)
    .bind(Decision::Allowed.code())
    .bind(i64::from(threshold))
    .fetch_all(&mut *tx)
    .await?;
    let tripped: Vec<Tripped> = tripped.into_iter().filter(|t| unseen || t.allowed_before).collect();
    if tripped.is_empty() {
        return Ok(None);
    }
    let first = &tripped[0];
    let request = Request {
        scope: Scope::Ids(vec![workload]),
        expect_count: 1,
        to: Mode::Simulation,
        params: Params { from_ms: 0, to_ms: 0, min_duration_ms: 0, top_peers: 5 },
        reason: format!(
            "auto-demotion: {} blocked connection(s) from {} to port {} (protocol {}) within the guard of \
             promotion {guarded}{}",
            first.blocked_connections,
            first.src_address,
            first.dst_port,
            first.protocol,
            if first.allowed_before {
                ", allowed in its evidence range"
            } else {
                ", never seen in its evidence range"
            },
        ),
        override_reason: None,
        guard: None,
        confirm_within: None,
    };
    sqlx::query("UPDATE enforcement_guards SET tripped_at = now(), evidence = $2 WHERE workload_id = $1")
        .bind(workload.uuid())
        .bind(json!(tripped))
        .execute(&mut *tx)
        .await?;
    let demotion = promote::flip(&mut tx, "guard", &request).await?;
    let changed = publish::publish(&mut tx).await?;
    sqlx::query("UPDATE enforcement_guards SET demotion_id = $2 WHERE workload_id = $1")
        .bind(workload.uuid())
        .bind(demotion.id)
        .execute(&mut *tx)
        .await?;
    let mut detail = audit_detail(&demotion);
    detail["guarded_promotion"] = json!(guarded);
    detail["flows"] = json!(tripped);
    let subject = workload.to_string();
    let record = audit::Record {
        detail,
        workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new("guard", "workload.auto-demote", &subject)
    };
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    tracing::warn!(%workload, "auto-demoted to simulation: {}", demotion.reason);
    Ok(Some(demotion))
}
