//! Mode changes on evidence (FLOW-8): a set named by selector or ids with the count the operator
//! expects, resolved, counted, judged and flipped in one transaction under the render lock, and
//! a promotion record of who, when, why, which ids and what evidence — so an auditor sees what a
//! change of mode stood on. A move to enforcement needs a SAFE verdict or an override with a
//! reason; a move away from it (or between visibility and simulation) needs no evidence.

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::audit;
use crate::error::Error;
use crate::gate::evidence::{self, Member, Scope};
use crate::gate::verdict::{self, Outcome, Params, Verdict};
use crate::policy::{authoring, publish};

/// The longest reason (characters) a mode change carries.
pub const MAX_REASON: usize = 1_024;

/// A mode change as the operator asks for it.
#[derive(Debug, Clone)]
pub struct Request {
    pub scope: Scope,
    /// How many workloads the operator expects the scope to name; anything else changes nothing.
    pub expect_count: usize,
    pub to: Mode,
    /// The evidence a move to enforcement is judged on.
    pub params: Params,
    pub reason: String,
    /// Enforce without a SAFE verdict, for this reason (audited on the record).
    pub override_reason: Option<String>,
    /// A move to enforcement's auto-demotion guard; absent: the default (`Guard::default`).
    pub guard: Option<Guard>,
    /// A move to enforcement that reverts unless confirmed within this long (FLOW-11): the
    /// agents hold the deadline ([`MIN_CONFIRM`] to [`MAX_CONFIRM`]).
    pub confirm_within: Option<std::time::Duration>,
}

/// The shortest confirm deadline a promotion may carry.
pub const MIN_CONFIRM: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest confirm deadline a promotion may carry: a day.
pub const MAX_CONFIRM: std::time::Duration = std::time::Duration::from_secs(86_400);

/// A stored promotion record.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Promotion {
    pub id: Uuid,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub reason: String,
    pub override_reason: Option<String>,
    #[serde(deserialize_with = "crate::gate::mode_name")]
    pub to_mode: crate::gate::Name,
    pub scope: String,
    pub expected_count: i32,
    /// Each workload with the mode it left.
    pub workloads: Vec<Member>,
    /// The verdict the change stood on, with its inputs (a move to enforcement only).
    pub verdict: Option<serde_json::Value>,
    /// A promotion that reverts unless confirmed (FLOW-11): its deadline and how it was settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<Confirmation>,
}

/// The confirm deadline of a promotion and what became of it.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Confirmation {
    pub deadline: DateTime<Utc>,
    /// `pending` (awaiting `promotions confirm`), `confirmed`, `reverted` (by the deadline), or
    /// `superseded` (a later mode change of its workloads came first).
    pub state: String,
    pub settled_at: Option<DateTime<Utc>>,
    /// Who confirmed it, or `deadline`.
    pub settled_by: Option<String>,
    /// The verdict a confirmation stood on (evidence since the promotion, judged at the promoted
    /// version).
    pub verdict: Option<serde_json::Value>,
    pub workloads: Vec<ConfirmedWorkload>,
}

/// One workload of a promotion awaiting confirmation.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ConfirmedWorkload {
    pub id: Uuid,
    /// The version the promotion rendered (with the deadline in it).
    pub version: Option<i64>,
    pub state: String,
    /// When its agent reported having reverted by itself at the deadline.
    pub agent_reverted_at: Option<DateTime<Utc>>,
}

impl Confirmation {
    /// The whole promotion's state: pending while any workload is, else reverted if any was,
    /// else confirmed if any was, else superseded.
    fn settle_state(workloads: &[ConfirmedWorkload]) -> String {
        ["pending", "reverted", "confirmed"]
            .into_iter()
            .find(|s| workloads.iter().any(|w| w.state == *s))
            .unwrap_or("superseded")
            .to_owned()
    }
}

pub(crate) fn check_text(what: &str, text: &str, required: bool) -> Result<(), Error> {
    if required && text.trim().is_empty() {
        return Err(Error::Invalid(format!("a mode change needs a {what}: say why")));
    }
    if text.chars().count() > MAX_REASON {
        return Err(Error::Invalid(format!("the {what} is longer than {MAX_REASON} characters")));
    }
    crate::input::text(&format!("the {what}"), text, 4 * MAX_REASON)
}

/// The verdict on `scope` now (FLOW-7), read in one transaction.
pub async fn judge(pool: &PgPool, scope: &Scope, params: &Params) -> Result<Verdict, Error> {
    let mut tx = pool.begin().await?;
    let members = evidence::resolve(&mut tx, scope).await?;
    let facts = evidence::facts(&mut tx, &members, params).await?;
    tx.commit().await?;
    Ok(verdict::judge(params, &facts))
}

/// Changes the mode of exactly the set the request names, or nothing (FLOW-8).
pub async fn promote(pool: &PgPool, actor: &str, request: &Request) -> Result<Promotion, Error> {
    let mut tx = pool.begin().await?;
    // Nothing that renders commits between resolving the set and flipping it.
    publish::lock_renders(&mut tx).await?;
    let promotion = flip(&mut tx, actor, request).await?;
    let changed = publish::publish(&mut tx).await?;
    if promotion.confirmation.is_some() {
        // The version each workload now holds carries the deadline: the one its agent reports.
        let (ids, versions): (Vec<Uuid>, Vec<i64>) =
            changed.iter().map(|c| (c.workload.uuid(), c.version as i64)).unzip();
        sqlx::query(
            "UPDATE promotion_confirmations c SET version = v.version
             FROM unnest($2::uuid[], $3::bigint[]) AS v (workload_id, version)
             WHERE c.promotion_id = $1 AND c.workload_id = v.workload_id",
        )
        .bind(promotion.id)
        .bind(&ids)
        .bind(&versions)
        .execute(&mut *tx)
        .await?;
    }
    let action = if request.to == Mode::Enforcement { "workload.promote" } else { "workload.demote" };
    let record = audit::Record {
        detail: audit_detail(&promotion),
        workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
        ..audit::Record::new(actor, action, &promotion.scope)
    };
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    Ok(promotion)
}

/// What an audit record says of a promotion.
pub(crate) fn audit_detail(p: &Promotion) -> serde_json::Value {
    serde_json::json!({
        "promotion": p.id,
        "to": p.to_mode,
        "scope": p.scope,
        "workloads": p.workloads.iter().map(|m| m.id.to_string()).collect::<Vec<_>>(),
        "reason": p.reason,
        "override": p.override_reason,
        "verdict": p.verdict.as_ref().and_then(|v| v.get("outcome")).cloned(),
        "confirm_deadline": p.confirmation.as_ref().map(|c| c.deadline),
    })
}

/// The gate itself, inside the caller's transaction, which holds the render lock (so nothing
/// renders between resolving the set and flipping it) and renders after: resolves the set,
/// refuses a count other than the expected one, refuses a move to enforcement without a SAFE
/// verdict (or an override), sets the modes and writes the promotion record. Used by
/// [`promote`] and by a draft's commit (`foresight::drafts`), which passes no override.
pub(crate) async fn flip(tx: &mut PgConnection, actor: &str, request: &Request) -> Result<Promotion, Error> {
    check_text("reason", &request.reason, true)?;
    if let Some(text) = &request.override_reason {
        check_text("override reason", text, true)?;
    }
    if let Some(guard) = &request.guard {
        guard.check()?;
    }
    if let Some(within) = request.confirm_within {
        if request.to != Mode::Enforcement {
            return Err(Error::Invalid(
                "a confirm deadline belongs to a move to enforcement: leave --confirm-within out".into(),
            ));
        }
        if !(MIN_CONFIRM..=MAX_CONFIRM).contains(&within) {
            return Err(Error::Invalid(format!(
                "a confirm deadline is {} to {} after the promotion, not {}",
                humantime::format_duration(MIN_CONFIRM),
                humantime::format_duration(MAX_CONFIRM),
                humantime::format_duration(within)
            )));
        }
    }
    let members = evidence::resolve(&mut *tx, &request.scope).await?;
    if members.len() != request.expect_count {
        return Err(Error::CountMismatch {
            expected: request.expect_count,
            matched: members.len(),
            names: members.iter().map(Member::name).collect(),
        });
    }
    if members.is_empty() {
        return Err(Error::Invalid("the scope names no workload: nothing to change".into()));
    }
    let verdict = if request.to == Mode::Enforcement {
        let facts = evidence::facts(&mut *tx, &members, &request.params).await?;
        let verdict = verdict::judge(&request.params, &facts);
        if verdict.outcome != Outcome::Safe && request.override_reason.is_none() {
            return Err(Error::EvidenceInsufficient {
                outcome: verdict.outcome.name(),
                reasons: verdict.summary(),
            });
        }
        Some(serde_json::to_value(&verdict).map_err(|e| Error::Render(Box::new(e)))?)
    } else {
        None
    };
    for member in &members {
        authoring::set_mode(&mut *tx, member.id, request.to).await?;
    }
    let promotion_id = Uuid::new_v4();
    let at: DateTime<Utc> = sqlx::query_scalar(
        "INSERT INTO promotions (id, actor, reason, override_reason, to_mode, scope, expected_count, workloads, verdict)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING at",
    )
    .bind(promotion_id)
    .bind(actor)
    .bind(&request.reason)
    .bind(&request.override_reason)
    .bind(request.to.code())
    .bind(request.scope.to_string())
    .bind(request.expect_count as i32)
    .bind(serde_json::to_value(&members).map_err(|e| Error::Render(Box::new(e)))?)
    .bind(&verdict)
    .fetch_one(&mut *tx)
    .await?;
    arm(&mut *tx, promotion_id, at, &members, request).await?;
    let confirmation = hold(&mut *tx, actor, promotion_id, at, &members, request.confirm_within).await?;
    Ok(Promotion {
        id: promotion_id,
        at,
        actor: actor.to_owned(),
        reason: request.reason.clone(),
        override_reason: request.override_reason.clone(),
        to_mode: request.to.name(),
        scope: request.scope.to_string(),
        expected_count: request.expect_count as i32,
        workloads: members,
        verdict,
        confirmation,
    })
}

/// A mode change settles every confirmation still pending for its workloads (superseded); a
/// promotion with a confirm deadline then gives each of them one, pending, which the render
/// reads (`policy::store`). Refused, changing nothing, when an agent of the set has not said it
/// holds deadlines: it would enforce without ever reverting.
async fn hold(
    tx: &mut PgConnection,
    actor: &str,
    promotion: Uuid,
    at: DateTime<Utc>,
    members: &[Member],
    within: Option<std::time::Duration>,
) -> Result<Option<Confirmation>, Error> {
    let ids: Vec<Uuid> = members.iter().map(|m| m.id.uuid()).collect();
    let Some(within) = within else {
        supersede(&mut *tx, actor, &ids).await?;
        return Ok(None);
    };
    let unable: Vec<String> = sqlx::query_scalar(
        "SELECT hostname || ' (' || id || ')' FROM workloads
         WHERE id = ANY($1) AND NOT ($2 = ANY(agent_capabilities)) ORDER BY hostname, id",
    )
    .bind(&ids)
    .bind(innerwall_wire::sync::CONFIRM_DEADLINE)
    .fetch_all(&mut *tx)
    .await?;
    if !unable.is_empty() {
        return Err(Error::Invalid(format!(
            "the agent of {} has not said it holds a confirm deadline (an older agent, or one that never \
             connected): it would never revert. Upgrade it, or promote without a confirm deadline; nothing \
             was changed",
            unable.join(", ")
        )));
    }
    supersede(&mut *tx, actor, &ids).await?;
    let deadline = at + chrono::Duration::from_std(within).map_err(|e| Error::Invalid(e.to_string()))?;
    sqlx::query("UPDATE promotions SET confirm_deadline = $2 WHERE id = $1")
        .bind(promotion)
        .bind(deadline)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO promotion_confirmations (promotion_id, workload_id) SELECT $1, w FROM unnest($2::uuid[]) AS w",
    )
    .bind(promotion)
    .bind(&ids)
    .execute(&mut *tx)
    .await?;
    let workloads = ids
        .iter()
        .map(|&id| ConfirmedWorkload { id, version: None, state: "pending".into(), agent_reverted_at: None })
        .collect();
    Ok(Some(Confirmation {
        deadline,
        state: "pending".into(),
        settled_at: None,
        settled_by: None,
        verdict: None,
        workloads,
    }))
}

/// Settles the pending confirmations of `ids` as superseded by `actor`'s mode change.
async fn supersede(tx: &mut PgConnection, actor: &str, ids: &[Uuid]) -> Result<(), Error> {
    let settled: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE promotion_confirmations SET state = 'superseded'
         WHERE workload_id = ANY($1) AND state = 'pending' RETURNING promotion_id",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE promotions p SET confirm_settled_at = now(), confirm_settled_by = $2
         WHERE p.id = ANY($1) AND p.confirm_settled_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM promotion_confirmations c WHERE c.promotion_id = p.id AND c.state = 'pending')",
    )
    .bind(&settled)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A promotion's guard; a field left out takes its default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Guard {
    /// Minutes after the promotion it watches; 0: no guard.
    pub minutes: u32,
    /// New connections blocked from one (source, protocol, port) that trip it.
    pub threshold: u32,
    /// Also sources the evidence range never showed allowed.
    pub unseen: bool,
}

impl Default for Guard {
    fn default() -> Self {
        Guard { minutes: 30, threshold: 5, unseen: false }
    }
}

/// The most a guard watches: a day.
pub const MAX_GUARD_MINUTES: u32 = 24 * 60;

impl Guard {
    pub fn check(&self) -> Result<(), Error> {
        if self.minutes > MAX_GUARD_MINUTES || self.threshold == 0 {
            return Err(Error::Invalid(format!(
                "a guard watches 0 to {MAX_GUARD_MINUTES} minutes and trips at 1 or more blocked connections"
            )));
        }
        Ok(())
    }
}

/// Arms the request's auto-demotion guard (`safety::guard` judges it) for the workloads a promotion to enforcement just enforced (replacing an earlier
/// guard), or drops their guards when it moved them elsewhere.
async fn arm(
    tx: &mut PgConnection,
    promotion: Uuid,
    at: DateTime<Utc>,
    members: &[Member],
    request: &Request,
) -> Result<(), Error> {
    let ids: Vec<Uuid> = members.iter().map(|m| m.id.uuid()).collect();
    let guard = request.guard.unwrap_or_default();
    if request.to != Mode::Enforcement {
        // A tripped guard keeps its flows: the demotion it made is one of these.
        sqlx::query("DELETE FROM enforcement_guards WHERE workload_id = ANY($1) AND tripped_at IS NULL")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        return Ok(());
    }
    sqlx::query("DELETE FROM enforcement_guards WHERE workload_id = ANY($1)")
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    if guard.minutes == 0 {
        return Ok(());
    }
    let time = |ms: i64| DateTime::<Utc>::from_timestamp_millis(ms).unwrap_or(at);
    sqlx::query(
        "INSERT INTO enforcement_guards (workload_id, promotion_id, since, until, evidence_from, evidence_to,
             threshold, unseen)
         SELECT w, $2, $3, $3 + make_interval(mins => $4), $5, $6, $7, $8 FROM unnest($1::uuid[]) AS w",
    )
    .bind(&ids)
    .bind(promotion)
    .bind(at)
    .bind(guard.minutes as i32)
    .bind(time(request.params.from_ms))
    .bind(time(request.params.to_ms))
    .bind(guard.threshold as i32)
    .bind(guard.unseen)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

const PROMOTIONS: &str = "promotion list";

/// A promotion record's columns, its confirmation's per-workload rows last (as JSON).
const COLUMNS: &str = "p.id, p.at, p.actor, p.reason, p.override_reason, p.to_mode, p.scope, p.expected_count,
     p.workloads, p.verdict, p.confirm_deadline, p.confirm_settled_at, p.confirm_settled_by, p.confirm_verdict,
     (SELECT jsonb_agg(jsonb_build_object('id', c.workload_id, 'version', c.version, 'state', c.state,
                                          'agent_reverted_at', c.agent_reverted_at) ORDER BY c.workload_id)
      FROM promotion_confirmations c WHERE c.promotion_id = p.id)";

/// A page of the promotion records, newest first (OPS-2).
pub async fn page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<Promotion>, Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let after = request.after_pair::<DateTime<Utc>, Uuid>(&cursor_key, PROMOTIONS)?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM promotions p
         WHERE $1::timestamptz IS NULL OR at < $1 OR (at = $1 AND id > $2)
         ORDER BY at DESC, id LIMIT $3"
    )))
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit + 1)
    .fetch_all(&mut *conn)
    .await?;
    let rows = rows.into_iter().map(promotion).collect::<Result<Vec<_>, Error>>()?;
    Ok(page::page(&cursor_key, rows, limit, PROMOTIONS, |p| serde_json::json!([p.at, p.id])))
}

/// The newest `limit` promotion records that changed `workload`'s mode, newest first.
pub async fn of_workload(
    conn: &mut PgConnection,
    workload: WorkloadId,
    limit: i64,
) -> Result<Vec<Promotion>, Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM promotions p
         WHERE workloads @> jsonb_build_array(jsonb_build_object('id', $1::text))
         ORDER BY at DESC, id LIMIT $2"
    )))
    .bind(workload.uuid().to_string())
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(promotion)
    .collect()
}

/// One promotion record.
pub async fn show(conn: &mut PgConnection, id: Uuid) -> Result<Promotion, Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM promotions p WHERE id = $1")))
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| Error::NotFound { what: "promotion", name: id.to_string() })?;
    promotion(row)
}

fn promotion(row: sqlx::postgres::PgRow) -> Result<Promotion, Error> {
    let corrupt = |what: &'static str, detail: String| Error::Corrupt { what, detail };
    let mode = Mode::from_code(row.get(5))
        .map_err(|_| corrupt("promotion mode", row.get::<i16, _>(5).to_string()))?;
    let workloads: Vec<StoredMember> =
        serde_json::from_value(row.get(8)).map_err(|e| corrupt("promotion workloads", e.to_string()))?;
    Ok(Promotion {
        id: row.get(0),
        at: row.get(1),
        actor: row.get(2),
        reason: row.get(3),
        override_reason: row.get(4),
        to_mode: mode.name(),
        scope: row.get(6),
        expected_count: row.get(7),
        workloads: workloads
            .into_iter()
            .map(|m| {
                let id = WorkloadId::from_uuid(m.id)
                    .ok_or_else(|| corrupt("promotion workload", m.id.to_string()))?;
                let mode = m.mode.parse::<Mode>().map_or("unknown", Mode::name);
                Ok(Member { id, hostname: m.hostname, mode })
            })
            .collect::<Result<_, Error>>()?,
        verdict: row.get(9),
        confirmation: match row.get::<Option<DateTime<Utc>>, _>(10) {
            None => None,
            Some(deadline) => {
                let workloads: Vec<ConfirmedWorkload> =
                    serde_json::from_value(row.get::<Option<serde_json::Value>, _>(14).unwrap_or_default())
                        .map_err(|e| corrupt("promotion confirmations", e.to_string()))?;
                Some(Confirmation {
                    deadline,
                    state: Confirmation::settle_state(&workloads),
                    settled_at: row.get(11),
                    settled_by: row.get(12),
                    verdict: row.get(13),
                    workloads,
                })
            }
        },
    })
}

/// A member as the record stores it.
#[derive(serde::Deserialize)]
struct StoredMember {
    id: Uuid,
    hostname: String,
    mode: String,
}
