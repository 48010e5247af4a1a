//! The audit log: the one way to record who did what, and to read it back. Written in the
//! transaction of the change it describes, so a change and its record commit or roll back
//! together; read a page at a time, newest first, by actor, action, object and time.

use std::collections::BTreeMap;

use sqlx::PgConnection;

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
    .bind(serde_json::to_value(&record.workload_versions).expect("plain data serializes"))
    .execute(&mut *conn)
    .await?;
    Ok(())
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

/// A page of the audit log, newest first (POL-8, OPS-2): keyed by the record id, so walking the
/// cursors reads every matching record once, even while new ones are written.
pub async fn page(
    conn: &mut PgConnection,
    filter: &AuditFilter,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<AuditRow>, Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    let before = request.after(AUDIT)?.map(|a| page::field::<i64>(&a, 0, AUDIT)).transpose()?;
    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT id, at, actor, action, subject, detail, workload_versions FROM audit_log
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
    Ok(page::page(rows, limit, AUDIT, |r| serde_json::json!([r.id])))
}
