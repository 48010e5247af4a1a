//! Retention of the control plane's own tables (issue 25): the audit log, policy history, policy
//! contents no row refers to, label history, long-retired workloads and long-dead tokens. Flow
//! evidence has its own retention (`flows::retention`, whole daily partitions); this one deletes
//! rows, at most [`Retention::batch`] per transaction, looping until nothing is left to delete.
//!
//! What evidence needs is never deleted: a policy version that a promotion record's verdict, a
//! retained flow window, or the workload itself (its latest and applied versions) refers to
//! stays, and so does a retired workload that a promotion record names or a retained window
//! belongs to (deleting it would cascade to its history). History and label history are kept at
//! least as long as flow windows (`serve` refuses shorter), so every retained window can still be
//! resolved to the policy and labels it was captured under.

use chrono::{DateTime, Duration, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::Error;

/// How long each kind of row is kept, and how many rows one transaction deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    /// Audit records older than this are deleted.
    pub audit: Duration,
    /// A policy version superseded (its successor rendered) longer ago than this is deleted,
    /// unless evidence refers to it.
    pub policy_history: Duration,
    /// A label set that stopped holding longer ago than this is deleted; the current set stays.
    pub label_history: Duration,
    /// A workload retired longer ago than this (whose credential has expired) is deleted with
    /// its dependent rows, unless evidence refers to it.
    pub retired_workloads: Duration,
    /// Provisioning and operator tokens expired or revoked longer ago than this are deleted.
    pub tokens: Duration,
    /// At most this many rows of one table are deleted per transaction.
    pub batch: i64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            audit: Duration::days(365),
            policy_history: Duration::days(90),
            label_history: Duration::days(90),
            retired_workloads: Duration::days(90),
            tokens: Duration::days(30),
            batch: 1_000,
        }
    }
}

/// How many rows one run deleted, per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Removed {
    pub workloads: u64,
    pub policy_history: u64,
    pub policy_contents: u64,
    pub policy_sources: u64,
    pub label_history: u64,
    pub audit: u64,
    pub provisioning_tokens: u64,
    pub operator_tokens: u64,
}

impl Removed {
    pub fn total(&self) -> u64 {
        self.workloads
            + self.policy_history
            + self.policy_contents
            + self.policy_sources
            + self.label_history
            + self.audit
            + self.provisioning_tokens
            + self.operator_tokens
    }
}

/// Every (workload, version) a promotion record's verdict refers to: each judged workload's
/// latest and applied versions and the versions its evidence was replayed from.
const PROMOTED_VERSIONS: &str = "SELECT (v->>'id')::uuid AS workload_id, x.version::bigint AS version
     FROM promotions p
     CROSS JOIN LATERAL jsonb_array_elements(coalesce(p.verdict->'workloads', '[]')) AS v
     CROSS JOIN LATERAL (
         SELECT v->>'latest_version' UNION ALL SELECT v->>'applied_version'
         UNION ALL SELECT jsonb_array_elements_text(coalesce(v->'evidence'->'replayed_from', '[]'))
     ) AS x (version)
     WHERE x.version IS NOT NULL";

/// Long-retired workloads nothing refers to. `ON DELETE CASCADE` takes their labels, label
/// history and totals with them, and migration 0043's trigger their addresses, policies and
/// history.
fn workloads_sql() -> String {
    "WITH doomed AS (
         SELECT w.id FROM workloads w
         WHERE w.retired_at < $1
           AND (w.credential_expires_at IS NULL OR w.credential_expires_at < now())
           AND NOT EXISTS (SELECT 1 FROM flow_windows f WHERE f.workload_id = w.id)
           AND NOT EXISTS (SELECT 1 FROM promotions p
                           WHERE p.workloads @> jsonb_build_array(jsonb_build_object('id', w.id::text)))
         ORDER BY w.retired_at, w.id LIMIT $2
     )
     DELETE FROM workloads w USING doomed d WHERE w.id = d.id"
        .to_owned()
}

/// Superseded versions no evidence refers to: the successor was rendered before the cutoff, it
/// is neither the latest nor the applied version, and no retained window or promotion names it.
fn policy_history_sql() -> String {
    format!(
        "WITH promoted AS ({PROMOTED_VERSIONS}),
         doomed AS (
             SELECT h.workload_id, h.version FROM workload_policy_history h
             WHERE EXISTS (SELECT 1 FROM workload_policy_history n
                           WHERE n.workload_id = h.workload_id AND n.version > h.version AND n.rendered_at < $1)
               AND NOT EXISTS (SELECT 1 FROM workload_policies p
                               WHERE p.workload_id = h.workload_id AND p.version = h.version)
               AND NOT EXISTS (SELECT 1 FROM workloads w
                               WHERE w.id = h.workload_id AND w.applied_version = h.version)
               AND NOT EXISTS (SELECT 1 FROM flow_windows f
                               WHERE f.workload_id = h.workload_id AND f.policy_version = h.version)
               AND NOT EXISTS (SELECT 1 FROM promoted r
                               WHERE r.workload_id = h.workload_id AND r.version = h.version)
             LIMIT $2
         )
         DELETE FROM workload_policy_history h USING doomed d
         WHERE h.workload_id = d.workload_id AND h.version = d.version"
    )
}

/// Contents no latest or history row refers to (the row trigger of migration 0018 checks each
/// again; it refuses deleting a referenced one).
const POLICY_CONTENTS: &str = "WITH doomed AS (
         SELECT c.digest FROM policy_contents c
         WHERE NOT EXISTS (SELECT 1 FROM workload_policies p WHERE p.digest = c.digest)
           AND NOT EXISTS (SELECT 1 FROM workload_policy_history h WHERE h.digest = c.digest)
         LIMIT $1
     )
     DELETE FROM policy_contents c USING doomed d WHERE c.digest = d.digest";

/// Authored sources no history row or rollback pin refers to (under the render lock, as a
/// publish names stored sources; the pin's foreign key refuses deleting a pinned one).
const POLICY_SOURCES: &str = "WITH doomed AS (
         SELECT s.digest FROM policy_sources s
         WHERE NOT EXISTS (SELECT 1 FROM workload_policy_history h WHERE h.source_digest = s.digest)
           AND NOT EXISTS (SELECT 1 FROM workloads w WHERE w.pinned_source = s.digest)
         LIMIT $1
     )
     DELETE FROM policy_sources s USING doomed d WHERE s.digest = d.digest";

/// Parts no source names (under the render lock, as a publish names stored parts).
const POLICY_SOURCE_PARTS: &str = "WITH doomed AS (
         SELECT p.digest FROM policy_source_parts p
         WHERE NOT EXISTS (SELECT 1 FROM policy_sources s WHERE position(p.digest IN s.parts) > 0)
         LIMIT $1
     )
     DELETE FROM policy_source_parts p USING doomed d WHERE p.digest = d.digest";

const LABEL_HISTORY: &str = "WITH doomed AS (
         SELECT workload_id, label_version FROM workload_label_history
         WHERE valid_to IS NOT NULL AND valid_to < $1 LIMIT $2
     )
     DELETE FROM workload_label_history h USING doomed d
     WHERE h.workload_id = d.workload_id AND h.label_version = d.label_version";

const AUDIT: &str = "DELETE FROM audit_log WHERE id IN (
         SELECT id FROM audit_log WHERE at < $1 ORDER BY at, id LIMIT $2)";

const PROVISIONING_TOKENS: &str = "DELETE FROM provisioning_tokens WHERE id IN (
         SELECT id FROM provisioning_tokens WHERE expires_at < $1 OR revoked_at < $1 LIMIT $2)";

const OPERATOR_TOKENS: &str = "DELETE FROM operator_tokens WHERE id IN (
         SELECT id FROM operator_tokens WHERE expires_at < $1 OR revoked_at < $1 LIMIT $2)";

/// Runs `sql` (binding the cutoff, if any, then the batch size) in transactions of one batch
/// each until a batch deletes fewer rows than the batch size; returns how many it deleted.
async fn drain(
    pool: &PgPool,
    sql: &str,
    cutoff: Option<DateTime<Utc>>,
    batch: i64,
    render_lock: bool,
) -> Result<u64, Error> {
    let mut removed = 0;
    loop {
        let mut tx = pool.begin().await?;
        if render_lock {
            // A publish reads which contents are stored and then refers to them: none may go
            // in between.
            crate::policy::publish::lock_renders(&mut tx).await?;
        }
        let query = sqlx::query(sqlx::AssertSqlSafe(sql));
        let query = match cutoff {
            Some(cutoff) => query.bind(cutoff),
            None => query,
        };
        let n = query.bind(batch).execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        removed += n;
        if n < batch as u64 {
            return Ok(removed);
        }
    }
}

/// Deletes what has outlived `retention` as of `now`, one batch per transaction, and audits the
/// run if it deleted anything. Workloads go first (their history goes with them), contents last
/// (the history deleted before leaves them orphans).
pub async fn apply(pool: &PgPool, retention: &Retention, now: DateTime<Utc>) -> Result<Removed, Error> {
    let removed = delete_expired(pool, retention, now).await?;
    if removed.total() > 0 {
        let detail = serde_json::to_value(removed).expect("plain data serializes");
        audit_run(pool, "innerwall-retention", detail).await?;
    }
    Ok(removed)
}

/// What a retention run started by hand removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Run {
    /// The daily flow partitions dropped (FLOW-5).
    pub flow_partitions: Vec<String>,
    pub removed: Removed,
}

/// The retention `serve` applies hourly, now, by `actor` (`innerwall retention`): flow partitions
/// older than `flow_days`, then the control plane's own rows; each step reported to `progress`
/// as it starts, and the run audited as `retention.run` by `actor`, whatever it removed.
pub async fn run_now(
    pool: &PgPool,
    actor: &str,
    flow_days: i64,
    retention: &Retention,
    now: DateTime<Utc>,
    progress: &dyn Fn(&str),
) -> Result<Run, Error> {
    progress(&format!("dropping the flow evidence's daily partitions older than {flow_days} days"));
    let flow_partitions = crate::flows::apply_retention(pool, flow_days, now).await?;
    progress("deleting the control plane's rows past their retention");
    let removed = delete_expired(pool, retention, now).await?;
    let run = Run { flow_partitions, removed };
    audit_run(pool, actor, serde_json::to_value(&run).expect("plain data serializes")).await?;
    Ok(run)
}

async fn audit_run(pool: &PgPool, actor: &str, detail: serde_json::Value) -> Result<(), Error> {
    let mut conn = pool.acquire().await?;
    crate::audit::write(
        &mut conn,
        &crate::audit::Record::new(actor, "retention.run", "control-plane").detail(detail),
    )
    .await
}

async fn delete_expired(pool: &PgPool, retention: &Retention, now: DateTime<Utc>) -> Result<Removed, Error> {
    let batch = retention.batch.max(1);
    let at = |age: Duration| Some(now - age);
    let removed = Removed {
        workloads: drain(pool, &workloads_sql(), at(retention.retired_workloads), batch, false).await?,
        policy_history: drain(pool, &policy_history_sql(), at(retention.policy_history), batch, false)
            .await?,
        label_history: drain(pool, LABEL_HISTORY, at(retention.label_history), batch, false).await?,
        audit: drain(pool, AUDIT, at(retention.audit), batch, false).await?,
        provisioning_tokens: drain(pool, PROVISIONING_TOKENS, at(retention.tokens), batch, false).await?,
        operator_tokens: drain(pool, OPERATOR_TOKENS, at(retention.tokens), batch, false).await?,
        policy_contents: drain(pool, POLICY_CONTENTS, None, batch, true).await?,
        policy_sources: drain(pool, POLICY_SOURCES, None, batch, true).await?
            + drain(pool, POLICY_SOURCE_PARTS, None, batch, true).await?,
    };
    Ok(removed)
}
