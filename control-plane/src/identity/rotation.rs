//! CA rotation as operator operations (IDN-8, issue 25): `innerwall ca rotate` adds a new root
//! and `innerwall ca retire` removes the old one once no live workload holds a certificate of
//! it. Each is one call that validates, changes the CA directory and writes its audit record;
//! the record commits only if the files changed. The keys stay on disk, never in Postgres:
//! the registry knows only which root issued each workload's current certificate.

use std::path::Path;

use sqlx::PgPool;

use crate::audit;
use crate::error::Error;
use crate::identity::ca::{self, FileCa, RootChange};

/// How many holders a refused retirement names.
const NAMED: usize = 20;

/// A live workload still holding a certificate that the new root did not issue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Holder {
    pub id: uuid::Uuid,
    pub hostname: String,
    /// The issuing root's SHA-256; absent when issued before issuers were recorded.
    pub issuer: Option<String>,
    pub credential_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// What a retirement did, and whom it left behind when forced.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Retired {
    #[serde(flatten)]
    pub change: RootChange,
    /// Live workloads whose certificates the retired root issued (non-empty only when forced):
    /// they can no longer connect and must enroll again.
    pub stranded: Vec<Holder>,
}

/// Adds a new root to the CA in `dir` (see [`FileCa::rotate`]), audited as `ca.rotate`.
pub async fn rotate(pool: &PgPool, dir: &Path, actor: &str) -> Result<RootChange, Error> {
    let mut tx = pool.begin().await?;
    let change = FileCa::rotate(dir)?;
    let detail =
        serde_json::json!({"old_root_sha256": change.old_sha256, "new_root_sha256": change.new_sha256});
    audit::write(&mut tx, &audit::Record::new(actor, "ca.rotate", &change.new_sha256).detail(detail)).await?;
    tx.commit().await?;
    Ok(change)
}

/// The live workloads (not retired, not deny-listed, certificate not expired) whose current
/// certificate was not issued by the root `new_sha256`, by hostname.
pub async fn holders(pool: &PgPool, new_sha256: &str) -> Result<Vec<Holder>, Error> {
    Ok(sqlx::query_as(
        "SELECT id, hostname, credential_issuer AS issuer, credential_expires_at FROM workloads
         WHERE retired_at IS NULL AND denied_at IS NULL AND credential_expires_at > now()
           AND credential_issuer IS DISTINCT FROM $1
         ORDER BY hostname, id",
    )
    .bind(new_sha256)
    .fetch_all(pool)
    .await?)
}

/// Retires the old root of the CA in `dir` (see [`FileCa::retire`]), audited as `ca.retire`.
/// Refused, naming them, while any live workload's current certificate was issued by another
/// root than the new one (it would be refused at its next handshake and could never renew),
/// unless `force`.
pub async fn retire(pool: &PgPool, dir: &Path, actor: &str, force: bool) -> Result<Retired, Error> {
    let next = dir.join(ca::NEXT_CERT_FILE);
    if !next.exists() {
        return Err(ca::CaError::NoRotation { path: next }.into());
    }
    let new_sha256 = ca::certificate_file_sha256(&next)?;
    let holders = holders(pool, &new_sha256).await?;
    if !holders.is_empty() && !force {
        let named: Vec<String> =
            holders.iter().take(NAMED).map(|h| format!("{} ({})", h.hostname, h.id)).collect();
        let more = holders.len().saturating_sub(NAMED);
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        return Err(Error::Refused(format!(
            "{} live workload(s) still hold a certificate the old root issued: {}{more}; \
             they take the new root at their next renewal (or retire them), or pass --force to strand them",
            holders.len(),
            named.join(", ")
        )));
    }
    let mut tx = pool.begin().await?;
    let change = FileCa::retire(dir)?;
    let stranded: Vec<String> = holders.iter().map(|h| h.id.to_string()).collect();
    let detail = serde_json::json!({
        "retired_root_sha256": change.old_sha256, "root_sha256": change.new_sha256,
        "forced": force, "stranded": stranded,
    });
    audit::write(&mut tx, &audit::Record::new(actor, "ca.retire", &change.old_sha256).detail(detail)).await?;
    tx.commit().await?;
    Ok(Retired { change, stranded: holders })
}
