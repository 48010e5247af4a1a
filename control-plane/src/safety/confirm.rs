//! Commit-confirmed promotion (issue 31, FLOW-11). A promotion to enforcement may carry a
//! confirm deadline (`gate::promote`, `--confirm-within`): its workloads' policies are rendered
//! with the deadline in them and each agent holds it. Then one of three things settles it:
//!
//! - [`confirm`] before the deadline, on a fresh verdict at the promoted version (the evidence
//!   since the promotion, judged in enforcement: nothing the promoted version blocked, no gap,
//!   covered, SYNCED at it) or an override with a reason: the deadline leaves the policies (a new
//!   version) and the workloads stay enforced;
//! - the deadline passing: each agent enforces its policy as its simulation by itself, with or
//!   without a control plane, and says so ([`reported_revert`]); and the control plane, at
//!   its next sweep ([`revert_expired`], every replica, serialized on the render lock), demotes
//!   the workloads to simulation with a promotion record of actor `deadline`;
//! - a later mode change of a workload (`gate::promote` supersedes it).
//!
//! The promotion record shows which, by whom and when; `promotions list` shows the pending ones
//! with their deadlines.

use chrono::{DateTime, Utc};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Version};
use serde_json::json;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::audit;
use crate::error::Error;
use crate::gate::evidence::{self, Scope};
use crate::gate::promote::{self, Promotion, Request};
use crate::gate::verdict::{self, Outcome, Params};
use crate::policy::publish;

/// The actor of a revert by the deadline.
pub const DEADLINE: &str = "deadline";

/// Confirms promotion `id` (all its workloads still pending) before its deadline, on a fresh
/// verdict at the promoted version or with `override_reason`: the deadline leaves their policies.
/// The record as it now reads.
pub async fn confirm(
    pool: &PgPool,
    actor: &str,
    id: Uuid,
    override_reason: Option<&str>,
) -> Result<Promotion, Error> {
    if let Some(text) = override_reason {
        promote::check_text("override reason", text, true)?;
    }
    let mut tx = pool.begin().await?;
    publish::lock_renders(&mut tx).await?;
    let record = promote::show(&mut tx, id).await?;
    let Some(confirmation) = &record.confirmation else {
        return Err(Error::Invalid(format!(
            "promotion {id} has no confirm deadline: there is nothing to confirm"
        )));
    };
    let settled = |how: &str| {
        let by = confirmation.settled_by.as_deref().unwrap_or("?");
        let at = confirmation.settled_at.map_or_else(|| "?".to_owned(), |t| t.to_rfc3339());
        Error::Invalid(format!("promotion {id} was {how} by {by} at {at}: there is nothing to confirm"))
    };
    match confirmation.state.as_str() {
        "pending" => {}
        "reverted" => {
            return Err(Error::Invalid(format!(
                "promotion {id} was reverted to simulation by its deadline ({}); promote again",
                confirmation.deadline.to_rfc3339()
            )));
        }
        other => return Err(settled(other)),
    }
    let now = Utc::now();
    if now >= confirmation.deadline {
        return Err(Error::Invalid(format!(
            "promotion {id}'s deadline passed at {}: its hosts enforce its simulation now, and it is being \
             reverted; promote again",
            confirmation.deadline.to_rfc3339()
        )));
    }
    let pending: Vec<WorkloadId> = confirmation
        .workloads
        .iter()
        .filter(|w| w.state == "pending")
        .filter_map(|w| WorkloadId::from_uuid(w.id))
        .collect();
    let members = evidence::resolve(&mut tx, &Scope::Ids(pending)).await?;
    let params = Params {
        from_ms: record.at.timestamp_millis(),
        to_ms: now.timestamp_millis(),
        min_duration_ms: 0,
        top_peers: 5,
    };
    let facts = evidence::facts(&mut tx, &members, &params).await?;
    let judged = verdict::judge_enforced(&params, &facts);
    if judged.outcome != Outcome::Safe && override_reason.is_none() {
        return Err(Error::EvidenceInsufficient {
            outcome: judged.outcome.name(),
            reasons: judged.summary(),
        });
    }
    let mut verdict = serde_json::to_value(&judged).map_err(|e| Error::Render(Box::new(e)))?;
    verdict["override_reason"] = json!(override_reason);
    sqlx::query("UPDATE promotion_confirmations SET state = 'confirmed' WHERE promotion_id = $1 AND state = 'pending'")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE promotions SET confirm_settled_at = now(), confirm_settled_by = $2, confirm_verdict = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(actor)
    .bind(&verdict)
    .execute(&mut *tx)
    .await?;
    let changed = publish::publish(&mut tx).await?;
    let subject = id.to_string();
    let record = audit::Record {
        detail: json!({
            "promotion": id,
            "workloads": members.iter().map(|m| m.id.to_string()).collect::<Vec<_>>(),
            "verdict": judged.outcome.name(),
            "override": override_reason,
        }),
        workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new(actor, "promotion.confirm", &subject)
    };
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    let mut conn = pool.acquire().await?;
    promote::show(&mut conn, id).await
}

/// Reverts every promotion whose deadline passed unconfirmed: its live workloads go to
/// simulation (a promotion record of actor [`DEADLINE`], audited `promotion.revert`). The
/// reverted promotions' records. Cheap when none is due: one indexed read.
pub async fn revert_expired(pool: &PgPool) -> Result<Vec<Promotion>, Error> {
    let due: Vec<Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT p.id FROM promotion_confirmations c JOIN promotions p ON p.id = c.promotion_id
         WHERE c.state = 'pending' AND p.confirm_deadline <= now()",
    )
    .fetch_all(pool)
    .await?;
    let mut reverted = Vec::new();
    for id in due {
        if let Some(record) = revert_one(pool, id).await? {
            reverted.push(record);
        }
    }
    Ok(reverted)
}

/// Reverts promotion `id` if it is still pending past its deadline (another replica may have).
async fn revert_one(pool: &PgPool, id: Uuid) -> Result<Option<Promotion>, Error> {
    let mut tx = pool.begin().await?;
    publish::lock_renders(&mut tx).await?;
    let rows = sqlx::query(
        "UPDATE promotion_confirmations c SET state = 'reverted'
         FROM promotions p WHERE p.id = c.promotion_id AND c.promotion_id = $1 AND c.state = 'pending'
           AND p.confirm_deadline <= now()
         RETURNING c.workload_id, c.agent_reverted_at",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let reported: Vec<(Uuid, Option<DateTime<Utc>>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    sqlx::query("UPDATE promotions SET confirm_settled_at = now(), confirm_settled_by = $2 WHERE id = $1")
        .bind(id)
        .bind(DEADLINE)
        .execute(&mut *tx)
        .await?;
    let ids: Vec<Uuid> = reported.iter().map(|(w, _)| *w).collect();
    let live: Vec<WorkloadId> = sqlx::query_scalar(
        "SELECT id FROM workloads WHERE id = ANY($1) AND retired_at IS NULL AND denied_at IS NULL ORDER BY id",
    )
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .filter_map(WorkloadId::from_uuid)
    .collect();
    let mut versions = Vec::new();
    let mut demotion = None;
    if !live.is_empty() {
        let request = Request {
            expect_count: live.len(),
            scope: Scope::Ids(live),
            to: Mode::Simulation,
            params: Params { from_ms: 0, to_ms: 0, min_duration_ms: 0, top_peers: 5 },
            reason: format!("promotion {id} was not confirmed by its deadline"),
            override_reason: None,
            guard: None,
            confirm_within: None,
        };
        let record = promote::flip(&mut tx, DEADLINE, &request).await?;
        versions = publish::publish(&mut tx).await?;
        demotion = Some(record.id);
    }
    let agents: Vec<serde_json::Value> =
        reported.iter().map(|(w, at)| json!({"workload": w, "agent_reverted_at": at})).collect();
    let subject = id.to_string();
    let record = audit::Record {
        detail: json!({"promotion": id, "demotion": demotion, "workloads": agents}),
        workload_versions: versions.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new(DEADLINE, "promotion.revert", &subject)
    };
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    tracing::warn!(promotion = %id, workloads = ids.len(), "promotion not confirmed by its deadline: reverted to simulation");
    let mut conn = pool.acquire().await?;
    promote::show(&mut conn, id).await.map(Some)
}

/// An agent's report (Hello, heartbeat) that it enforces `version` as its simulation because its
/// deadline passed unconfirmed: kept, the first time, on the workload's confirmation of that
/// version. 0 (nothing reverted) reads nothing.
pub async fn reported_revert(pool: &PgPool, workload: WorkloadId, version: Version) -> Result<(), Error> {
    if version == 0 {
        return Ok(());
    }
    let noted = sqlx::query(
        "UPDATE promotion_confirmations SET agent_reverted_at = now()
         WHERE workload_id = $1 AND version = $2 AND agent_reverted_at IS NULL",
    )
    .bind(workload.uuid())
    .bind(i64::try_from(version).unwrap_or(i64::MAX))
    .execute(pool)
    .await?;
    if noted.rows_affected() > 0 {
        tracing::warn!(%workload, version, "the agent reports it reverted to simulation at its promotion's deadline");
    }
    Ok(())
}
