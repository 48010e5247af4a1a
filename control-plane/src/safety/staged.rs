//! Staged rulesets (issue 31, FLOW-10): a new version of a ruleset (or a new ruleset) that the
//! workloads it touches evaluate beside the rules in force without acting on it, until it is
//! promoted on evidence. `stage` and `unstage` are `foresight::commit`s: the render
//! (`policy::render`, `policy::staged`) turns every staged ruleset into each touched workload's
//! staged set, so the agents decide every flow a second time by the pending rules and record
//! both decisions. `promote_staged` is count-pinned like a workload promotion: the workloads
//! whose rules in force it changes must be as many as expected, and the verdict over the flows
//! recorded since each acknowledged its staged set (`verdict::judge_staged`) must be SAFE — no
//! flow allowed now that the staged rules would block, no gap, the windows covering the range —
//! or an override must carry a reason. It writes the ruleset, drops the staged one, and keeps a
//! record (`staged_promotions`) with the verdict, audited as `ruleset.promote-staged`.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::Error;
use crate::foresight::commit;
use crate::gate::evidence::{self, Member};
use crate::gate::promote::check_text;
use crate::gate::verdict::{self, Outcome, Params};
use crate::policy::authoring::{self, Committed};
use crate::policy::model::{AuthoredModel, RegisteredWorkload};
use crate::policy::render::render;
use crate::policy::spec::RulesetSpec;
use crate::policy::{publish, staged, store};

/// The most rulesets staged at once (each is rendered beside the rules in force).
pub const MAX_STAGED: usize = 32;

/// A staged ruleset as `ruleset staged` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StagedView {
    pub name: String,
    /// Its stage number: the staged sets it renders name it (`<name>:<stage>`).
    pub stage: i64,
    /// The ruleset's version when it was staged (absent: a ruleset new to the estate).
    pub base_version: Option<i64>,
    pub staged_by: String,
    pub staged_at: DateTime<Utc>,
    /// The ruleset as staged.
    pub spec: RulesetSpec,
    /// Why it is left out of every render now (a service or address group it names is gone).
    pub problem: Option<String>,
    /// The workloads whose rules in force promoting it changes (what `--expect-count` counts).
    pub workloads: Vec<StagedWorkload>,
}

/// A workload a staged ruleset changes, and where its agent stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StagedWorkload {
    pub id: String,
    pub hostname: String,
    /// The staged set its latest version carries.
    pub staged_set: Option<String>,
    pub latest_version: Option<u64>,
    pub applied_version: u64,
}

/// What `promote-staged` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromoteStaged {
    pub name: String,
    /// How many workloads' rules in force it must change; any other number changes nothing.
    pub expect_count: usize,
    /// Less evidence than this (since a workload acknowledged its staged set) is not enough.
    pub min_evidence: std::time::Duration,
    /// Promote without a SAFE verdict, for this reason (kept on the record).
    pub override_reason: Option<String>,
}

/// A staged ruleset promoted: the record kept in `staged_promotions`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StagedPromotion {
    pub id: Uuid,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub ruleset: String,
    pub stage: i64,
    /// The ruleset's version it wrote.
    pub version: i64,
    pub expect_count: usize,
    /// The workloads whose rules in force it changed.
    #[schema(value_type = Vec<Object>)]
    pub workloads: Vec<Member>,
    /// The verdict it stood on (`gate::verdict::Verdict`).
    pub verdict: serde_json::Value,
    pub override_reason: Option<String>,
}

/// `ruleset.stage`: stages `spec` (replacing what was staged under its name, with a new stage
/// number). Refused when a service or address group it names does not exist, when it is the
/// ruleset in force already, or beyond [`MAX_STAGED`].
pub async fn stage(pool: &PgPool, actor: &str, spec: &RulesetSpec) -> Result<Committed<i64>, Error> {
    let detail = serde_json::to_value(spec).map_err(|e| Error::Render(Box::new(e)))?;
    commit(pool, actor, "ruleset.stage", &spec.name, async |c| {
        publish::lock_renders(c).await?;
        let model = store::load_model(c).await?;
        let resolved = staged::resolve(spec, &model)?;
        if model.rulesets.contains(&resolved) {
            return Err(Error::Invalid(format!(
                "ruleset {:?} as staged is the ruleset in force: there is nothing to stage",
                spec.name
            )));
        }
        let others = model.staged.iter().filter(|s| s.ruleset.name != spec.name).count();
        if others >= MAX_STAGED {
            return Err(Error::OverBound {
                what: "staged rulesets",
                limit: MAX_STAGED as u64,
                bound: "safety::staged::MAX_STAGED",
                remedy: "promote or unstage one first",
            });
        }
        let stage: i64 = sqlx::query_scalar(
            "INSERT INTO staged_rulesets (name, spec, base_version, staged_by)
             VALUES ($1, $2, (SELECT version FROM rulesets WHERE name = $1), $3)
             ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, stage = nextval('staged_ruleset_stage'),
                 base_version = excluded.base_version, staged_by = excluded.staged_by, staged_at = now()
             RETURNING stage",
        )
        .bind(&spec.name)
        .bind(&detail)
        .bind(actor)
        .fetch_one(&mut *c)
        .await?;
        Ok((stage, json!({"stage": stage, "ruleset": detail})))
    })
    .await
}

/// `ruleset.unstage`: drops the staged ruleset `name`; its staged sets leave every policy.
pub async fn unstage(pool: &PgPool, actor: &str, name: &str) -> Result<Committed<()>, Error> {
    commit(pool, actor, "ruleset.unstage", name, async |c| {
        let stage: Option<i64> =
            sqlx::query_scalar("DELETE FROM staged_rulesets WHERE name = $1 RETURNING stage")
                .bind(name)
                .fetch_optional(&mut *c)
                .await?;
        let stage = stage.ok_or_else(|| Error::NotFound { what: "staged ruleset", name: name.to_owned() })?;
        Ok(((), json!({"stage": stage})))
    })
    .await
}

/// Every staged ruleset with the workloads it changes, in name order.
pub async fn list(pool: &PgPool) -> Result<Vec<StagedView>, Error> {
    let mut tx = pool.begin().await?;
    let stored = store::staged_rulesets(&mut tx).await?;
    let model = store::load_model(&mut tx).await?;
    let registry = publish::registry_as_rendered(&mut tx).await?;
    let mut views = Vec::with_capacity(stored.len());
    for s in stored {
        let (problem, workloads) = match staged::resolve(&s.spec, &model) {
            Err(e) => (Some(e.to_string()), Vec::new()),
            Ok(_) => {
                let ids = changed_by(&model, &registry, &s.spec.name)?;
                (None, standing(&mut tx, &ids).await?.into_iter().map(|(_, w)| w).collect())
            }
        };
        views.push(StagedView {
            name: s.spec.name.clone(),
            stage: s.stage,
            base_version: s.base_version,
            staged_by: s.staged_by,
            staged_at: s.staged_at,
            spec: s.spec,
            problem,
            workloads,
        });
    }
    tx.commit().await?;
    Ok(views)
}

/// One staged ruleset, as [`list`] shows it.
pub async fn show(pool: &PgPool, name: &str) -> Result<StagedView, Error> {
    list(pool)
        .await?
        .into_iter()
        .find(|v| v.name == name)
        .ok_or_else(|| Error::NotFound { what: "staged ruleset", name: name.to_owned() })
}

/// The workloads whose rules in force change when the staged ruleset `name` is promoted, in id
/// order. Pure.
pub fn changed_by(
    model: &AuthoredModel,
    registry: &[RegisteredWorkload],
    name: &str,
) -> Result<Vec<WorkloadId>, Error> {
    let now = render(&AuthoredModel { staged: Vec::new(), ..model.clone() }, registry)?;
    let then = render(&model.with_staged(|s| s.ruleset.name == name), registry)?;
    Ok(now
        .iter()
        .filter(|(id, policy)| then.get(id).is_none_or(|p| !p.rules().eq(policy.rules())))
        .map(|(id, _)| id)
        .collect())
}

/// Each of `ids` (live workloads, in id order) as a verdict's member, with its latest version's
/// staged set and its applied version: one query, however many.
async fn standing(
    conn: &mut PgConnection,
    ids: &[WorkloadId],
) -> Result<Vec<(Member, StagedWorkload)>, Error> {
    let uuids: Vec<Uuid> = ids.iter().map(WorkloadId::uuid).collect();
    type Row = (Uuid, String, i16, i64, Option<i64>, Option<String>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT w.id, w.hostname, w.mode, w.applied_version, p.version, h.staged_set
         FROM workloads w
         LEFT JOIN workload_policies p ON p.workload_id = w.id
         LEFT JOIN workload_policy_history h ON h.workload_id = w.id AND h.version = p.version
         WHERE w.id = ANY($1) AND w.retired_at IS NULL AND w.denied_at IS NULL ORDER BY w.id",
    )
    .bind(&uuids)
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|(id, hostname, mode, applied, latest, staged_set)| {
            let corrupt = |what, detail: String| Error::Corrupt { what, detail };
            let id = WorkloadId::from_uuid(id).ok_or_else(|| corrupt("workload id", id.to_string()))?;
            let mode = Mode::from_code(mode).map_err(|_| corrupt("workload mode", mode.to_string()))?;
            let member = Member { id, hostname: hostname.clone(), mode: mode.name() };
            let workload = StagedWorkload {
                id: id.to_string(),
                hostname,
                staged_set,
                latest_version: latest.map(|v| v.max(0) as u64),
                applied_version: applied.max(0) as u64,
            };
            Ok((member, workload))
        })
        .collect()
}

/// When each workload first acknowledged a version carrying its staged set (`sets`, in `ids`'
/// order), unix milliseconds.
async fn acknowledged(
    conn: &mut PgConnection,
    ids: &[Uuid],
    sets: &[String],
) -> Result<BTreeMap<WorkloadId, i64>, Error> {
    let rows: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
        "SELECT h.workload_id, min(i.installed_from)
         FROM workload_policy_history h
         JOIN unnest($1::uuid[], $2::text[]) AS s (id, set) ON s.id = h.workload_id AND s.set = h.staged_set
         JOIN workload_installs i ON i.workload_id = h.workload_id AND i.version = h.version
         GROUP BY 1",
    )
    .bind(ids)
    .bind(sets)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, at)| WorkloadId::from_uuid(id).map(|id| (id, at.timestamp_millis())))
        .collect())
}

/// `ruleset.promote-staged`: the staged ruleset becomes the ruleset, if it changes the rules in
/// force of exactly `expect_count` workloads and the evidence since each acknowledged its
/// staged set is SAFE (or an override says why not; with no workload changed there is nothing
/// to judge), in one commit.
pub async fn promote_staged(
    pool: &PgPool,
    actor: &str,
    request: &PromoteStaged,
) -> Result<Committed<StagedPromotion>, Error> {
    if let Some(reason) = &request.override_reason {
        check_text("override reason", reason, true)?;
    }
    let name = &request.name;
    commit(pool, actor, "ruleset.promote-staged", name, async |c| {
        publish::lock_renders(c).await?;
        let stored = store::staged_rulesets(c).await?.into_iter().find(|s| &s.spec.name == name);
        let stored = stored.ok_or_else(|| Error::NotFound { what: "staged ruleset", name: name.clone() })?;
        let model = store::load_model(c).await?;
        staged::resolve(&stored.spec, &model)?;
        let registry = publish::registry_as_rendered(c).await?;
        let ids = changed_by(&model, &registry, name)?;
        let (members, standing): (Vec<Member>, Vec<StagedWorkload>) =
            standing(c, &ids).await?.into_iter().unzip();
        if members.len() != request.expect_count {
            return Err(Error::CountMismatch {
                expected: request.expect_count,
                matched: members.len(),
                names: members.iter().map(Member::name).collect(),
            });
        }
        // The evidence: each workload's flows since it acknowledged the staged set its latest
        // version carries.
        let sets: Vec<String> = standing.iter().map(|w| w.staged_set.clone().unwrap_or_default()).collect();
        let uuids: Vec<Uuid> = members.iter().map(|m| m.id.uuid()).collect();
        let acked = acknowledged(c, &uuids, &sets).await?;
        let now = Utc::now().timestamp_millis();
        let mut params = Params::ending_at(now, std::time::Duration::ZERO, request.min_evidence)?;
        params.from_ms = acked.values().copied().min().unwrap_or(now).min(now);
        let facts = evidence::staged_facts(c, &members, &sets, &params).await?;
        let judged = verdict::judge_staged(&params, &acked, &facts);
        // Changing no workload's rules in force (it selects none yet), it enforces nothing now:
        // there is nothing to judge, and nothing to refuse.
        if judged.outcome != Outcome::Safe && !members.is_empty() && request.override_reason.is_none() {
            return Err(Error::EvidenceInsufficient { outcome: judged.outcome.name(), reasons: judged.summary() });
        }
        let version = match stored.base_version {
            Some(base) => authoring::update_ruleset(c, &stored.spec, base).await?,
            None => {
                authoring::create_ruleset(c, &stored.spec).await?;
                1
            }
        };
        sqlx::query("DELETE FROM staged_rulesets WHERE name = $1").bind(name).execute(&mut *c).await?;
        let verdict = serde_json::to_value(&judged).map_err(|e| Error::Render(Box::new(e)))?;
        let record = StagedPromotion {
            id: Uuid::new_v4(),
            at: Utc::now(),
            actor: actor.to_owned(),
            ruleset: name.clone(),
            stage: stored.stage,
            version,
            expect_count: request.expect_count,
            workloads: members,
            verdict,
            override_reason: request.override_reason.clone(),
        };
        sqlx::query(
            "INSERT INTO staged_promotions (id, ruleset, stage, actor, at, expect_count, workloads, verdict, override_reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(record.id)
        .bind(&record.ruleset)
        .bind(record.stage)
        .bind(actor)
        .bind(record.at)
        .bind(request.expect_count as i32)
        .bind(serde_json::to_value(&record.workloads).map_err(|e| Error::Render(Box::new(e)))?)
        .bind(&record.verdict)
        .bind(&record.override_reason)
        .execute(&mut *c)
        .await?;
        let detail = json!({
            "promotion": record.id,
            "stage": record.stage,
            "version": version,
            "outcome": judged.outcome.name(),
            "override_reason": record.override_reason,
        });
        Ok((record, detail))
    })
    .await
}
