//! The audit log: the one way to record who did what, and to read it back. Written in the
//! transaction of the change it describes, so a change and its record commit or roll back
//! together; read a page at a time, newest first, by actor, action, object and time. Reports an
//! agent can repeat at will (tamper, identity clone) go through [`coalesce`]: one row per
//! workload and kind within a window, counting them, so no agent can grow the log faster than
//! that (REL-1).

use std::collections::BTreeMap;

use sqlx::{Acquire, PgConnection};

use crate::error::Error;

/// One audit record.
#[derive(Debug, Clone, PartialEq)]
pub struct Record<'a> {
    /// Who: an operator (`$USER` today, a token's name later) or `workload:<id>`.
    pub actor: &'a str,
    /// What, as `noun.verb` (`token.mint`, `workload.label`, …).
    pub action: &'a str,
    pub subject: &'a str,
    pub detail: serde_json::Value,
    /// The workloads whose policy version this change advanced, with their new versions.
    pub workload_versions: BTreeMap<String, u64>,
}

impl<'a> Record<'a> {
    pub fn new(actor: &'a str, action: &'a str, subject: &'a str) -> Self {
        Record { actor, action, subject, detail: serde_json::json!({}), workload_versions: BTreeMap::new() }
    }

    pub fn detail(self, detail: serde_json::Value) -> Self {
        Record { detail, ..self }
    }
}

/// Appends `record` to the audit log on `conn`.
pub async fn write(conn: &mut PgConnection, record: &Record<'_>) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO audit_log (actor, action, subject, detail, workload_versions) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(record.actor)
    .bind(record.action)
    .bind(record.subject)
    .bind(&record.detail)
    .bind(sqlx::types::Json(&record.workload_versions))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Appends `records` to the audit log on `conn`, in their order, with one statement.
pub async fn write_all(conn: &mut PgConnection, records: &[Record<'_>]) -> Result<(), Error> {
    let column = |f: for<'r> fn(&'r Record<'_>) -> &'r str| -> Vec<&str> { records.iter().map(f).collect() };
    let details: Vec<&serde_json::Value> = records.iter().map(|r| &r.detail).collect();
    let versions: Vec<sqlx::types::Json<&BTreeMap<String, u64>>> =
        records.iter().map(|r| sqlx::types::Json(&r.workload_versions)).collect();
    sqlx::query(
        "INSERT INTO audit_log (actor, action, subject, detail, workload_versions)
         SELECT actor, action, subject, detail, versions
         FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::jsonb[]) WITH ORDINALITY
              AS t (actor, action, subject, detail, versions, n)
         ORDER BY n",
    )
    .bind(column(|r| r.actor))
    .bind(column(|r| r.action))
    .bind(column(|r| r.subject))
    .bind(&details)
    .bind(&versions)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// What [`coalesce`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coalesced {
    /// No row of this actor, action and subject within the window: a new one (its id).
    Written(i64),
    /// That row (its id) now counts this report too.
    Counted(i64),
}

/// Records a report that may repeat: if a row of the same actor, action and subject was written
/// less than `within` ago, that row's `count` grows by `count` (its `last_at` and its detail's
/// `latest` member say when and what the latest was); otherwise a new row with that count. So
/// reports of one kind from one workload add at most one row per `within`, whatever their rate.
/// Concurrent reports of one key (two replicas) are serialized on an advisory lock for it, held
/// until the caller's transaction ends (or this call's, outside one).
pub async fn coalesce(
    conn: &mut PgConnection,
    record: &Record<'_>,
    within: std::time::Duration,
    count: u64,
) -> Result<Coalesced, Error> {
    let count = i64::try_from(count.max(1)).unwrap_or(i64::MAX);
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(10) || $2 || chr(10) || $3, 0))")
        .bind(record.actor)
        .bind(record.action)
        .bind(record.subject)
        .execute(&mut *tx)
        .await?;
    let counted: Option<i64> = sqlx::query_scalar(
        "UPDATE audit_log SET count = LEAST(count::numeric + $5, 9223372036854775807)::bigint, last_at = now(),
                detail = detail || jsonb_build_object('latest', $4::jsonb)
         WHERE id = (SELECT id FROM audit_log
                     WHERE subject = $3 AND action = $2 AND actor = $1 AND at > now() - make_interval(secs => $6)
                     ORDER BY at DESC LIMIT 1)
         RETURNING id",
    )
    .bind(record.actor)
    .bind(record.action)
    .bind(record.subject)
    .bind(&record.detail)
    .bind(count)
    .bind(within.as_secs_f64())
    .fetch_optional(&mut *tx)
    .await?;
    let done = match counted {
        Some(id) => Coalesced::Counted(id),
        None => Coalesced::Written(
            sqlx::query_scalar(
                "INSERT INTO audit_log (actor, action, subject, detail, workload_versions, count)
                 VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
            )
            .bind(record.actor)
            .bind(record.action)
            .bind(record.subject)
            .bind(&record.detail)
            .bind(serde_json::to_value(&record.workload_versions).expect("plain data serializes"))
            .bind(count)
            .fetch_one(&mut *tx)
            .await?,
        ),
    };
    tx.commit().await?;
    Ok(done)
}

/// One stored audit record, as `innerwall audit list --json` prints it and the API answers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct AuditRow {
    /// Increases with every record: the order records were written in.
    pub id: i64,
    pub at: chrono::DateTime<chrono::Utc>,
    pub actor: String,
    pub action: String,
    /// The object the change was made to (a name, a workload id, a token id, …).
    pub subject: String,
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
    /// Workload id to the policy version the change advanced it to.
    #[schema(value_type = Object)]
    pub workload_versions: serde_json::Value,
    /// How many reports this row stands for (more than 1 only for a coalesced report).
    pub count: i64,
    /// When the latest report a coalesced row counts arrived (absent: only the first).
    pub last_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Which records a read wants; each given field must match exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    pub actor: Option<String>,
    pub action: Option<String>,
    /// The record's subject.
    pub object: Option<String>,
    /// Written at or after this.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
}

const AUDIT: &str = "audit list";

/// The longest value an audit filter (actor, action, object) may have, in bytes.
pub const MAX_FILTER: usize = 512;

/// A page of the audit log, newest first (POL-8, OPS-2): keyed by the record id, so walking the
/// cursors reads every matching record once, even while new ones are written.
pub async fn page(
    conn: &mut PgConnection,
    filter: &AuditFilter,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<AuditRow>, Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    for (field, value) in [("actor", &filter.actor), ("action", &filter.action), ("object", &filter.object)] {
        value.as_deref().map(|v| crate::input::text(field, v, MAX_FILTER)).transpose()?;
    }
    if let Some(since) = filter.since {
        crate::input::instant("since", since)?;
    }
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let before = request.after(&cursor_key, AUDIT)?.map(|a| page::field::<i64>(&a, 0, AUDIT)).transpose()?;
    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT id, at, actor, action, subject, detail, workload_versions, count, last_at FROM audit_log
         WHERE ($1::bigint IS NULL OR id < $1)
           AND ($2::text IS NULL OR actor = $2)
           AND ($3::text IS NULL OR action = $3)
           AND ($4::text IS NULL OR subject = $4)
           AND ($5::timestamptz IS NULL OR at >= $5)
         ORDER BY id DESC LIMIT $6",
    )
    .bind(before)
    .bind(filter.actor.as_deref())
    .bind(filter.action.as_deref())
    .bind(filter.object.as_deref())
    .bind(filter.since)
    .bind(limit + 1)
    .fetch_all(&mut *conn)
    .await?;
    Ok(page::page(&cursor_key, rows, limit, AUDIT, |r| serde_json::json!([r.id])))
}
