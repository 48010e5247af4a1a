//! The audit log: the one way to record who did what. Written in the transaction of the change
//! it describes, so a change and its record commit or roll back together.

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
