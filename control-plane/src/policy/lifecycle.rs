//! What the registry shows of an identity's lifecycle (IDN-5, IDN-7): a clone episode in
//! progress and the last refused renewal, judged from stored times and the clock when read.
//! `identity::clones` records the sightings; this is the reading half, so the registry's views
//! (`store`) need nothing from `identity`.

use sqlx::PgConnection;

use crate::error::Error;
use innerwall_wire::identity::WorkloadId;

/// A clone episode ends this long after the last clone sighting; a sighting after that begins
/// (and audits) a new one.
pub const EPISODE: std::time::Duration = std::time::Duration::from_secs(3600);

/// One presenter of a cloned identity, as `workload status` shows it.
#[derive(
    Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow, utoipa::ToSchema,
)]
pub struct PresenterView {
    pub boot_id: String,
    pub key_sha256: String,
    pub machine_id: String,
    pub hostname: String,
    pub first_seen_at: chrono::DateTime<chrono::Utc>,
    pub last_seen_at: chrono::DateTime<chrono::Utc>,
}

/// A clone episode in progress: since when, the last sighting, and every presenter seen in it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct CloneReport {
    pub since: chrono::DateTime<chrono::Utc>,
    pub last_seen_at: chrono::DateTime<chrono::Utc>,
    pub presenters: Vec<PresenterView>,
}

/// The last refused renewal, shown while no renewal has succeeded since.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct RenewalFailure {
    pub at: chrono::DateTime<chrono::Utc>,
    pub reason: String,
}

/// The presenters of `id` seen within an episode's length of its last sighting, newest first.
pub async fn presenters(conn: &mut PgConnection, id: WorkloadId) -> Result<Vec<PresenterView>, Error> {
    Ok(sqlx::query_as(
        "SELECT boot_id, key_sha256, machine_id, hostname, first_seen_at, last_seen_at
         FROM workload_presenters
         WHERE workload_id = $1
           AND last_seen_at >= (SELECT max(last_seen_at) FROM workload_presenters WHERE workload_id = $1)
                               - make_interval(secs => $2)
         ORDER BY last_seen_at DESC, boot_id, key_sha256",
    )
    .bind(id.uuid())
    .bind(EPISODE.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?)
}

/// The clone episode of `id` in progress now, if any (judged from the clock, not a flag).
pub async fn clone_report(conn: &mut PgConnection, id: WorkloadId) -> Result<Option<CloneReport>, Error> {
    let row: Option<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT clone_started_at, clone_seen_at FROM workloads
         WHERE id = $1 AND clone_seen_at >= now() - make_interval(secs => $2)",
    )
    .bind(id.uuid())
    .bind(EPISODE.as_secs_f64())
    .fetch_optional(&mut *conn)
    .await?;
    let Some((since, last_seen_at)) = row else { return Ok(None) };
    Ok(Some(CloneReport { since, last_seen_at, presenters: presenters(conn, id).await? }))
}

/// The last renewal failure of `id`, unless a renewal succeeded since.
pub async fn renewal_failure(
    conn: &mut PgConnection,
    id: WorkloadId,
) -> Result<Option<RenewalFailure>, Error> {
    let row: Option<(chrono::DateTime<chrono::Utc>, String)> = sqlx::query_as(
        "SELECT last_renewal_failed_at, COALESCE(last_renewal_error, '') FROM workloads
         WHERE id = $1 AND last_renewal_failed_at IS NOT NULL
           AND (last_renewed_at IS NULL OR last_renewed_at < last_renewal_failed_at)",
    )
    .bind(id.uuid())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|(at, reason)| RenewalFailure { at, reason }))
}
