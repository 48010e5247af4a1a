//! Clone detection (IDN-7, issue 25): who presents an identity — the kernel boot id the agent
//! reports and the key of the certificate it proved the identity with — recorded at every
//! Hello, and the rule that tells a clone from a reboot or a renewal.
//!
//! A reboot brings a new boot id and a renewal a new key, and neither ever goes back: the boot
//! and the key before are not seen again. A cloned image (which copies `/etc/machine-id` and the
//! credential, so the machine id alone cannot tell) runs under another boot id, and the two
//! copies take turns holding the stream (each new stream supersedes the other), so one of them
//! *returns* after the other was seen: that is the clone. A live clone of a running VM keeps
//! even the boot id; it shows once either copy renews (a new key) and the other returns with
//! the old one. Two copies with the same boot id and the same key are indistinguishable until
//! then (documented limit). A machine id other than the one enrolled counts too.
//!
//! An episode is audited once, when it begins; it lasts while clones keep being seen and ends
//! [`EPISODE`] after the last sighting. `workload status` shows it from the stored times and the
//! clock, never from a flag that could outlive the clone. Both copies present one credential,
//! so the operator's lever is `workload deny` (it ends both; the genuine host enrolls again
//! with a new token): a per-boot deny would be a promise a hostile copy breaks by reporting the
//! genuine boot id.

use sqlx::{PgConnection, PgPool};

use crate::audit;
use crate::error::Error;
use crate::policy::store::SyncStatusView;
use innerwall_wire::identity::WorkloadId;

/// A clone episode ends this long after the last clone sighting; a sighting after that begins
/// (and audits) a new one.
pub const EPISODE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Presenters kept per workload (the most recently seen); a hostile agent inventing boot ids
/// cannot grow the table.
pub const MAX_PRESENTERS: i64 = 8;

/// The longest boot id, machine id or hostname stored.
const MAX_FACT: usize = 256;

/// Who opened a stream: the boot id and machine id the agent reports, and the key of its
/// certificate (proved in the handshake).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presenter {
    pub boot_id: String,
    pub key_sha256: String,
    pub machine_id: String,
    pub hostname: String,
}

impl Presenter {
    pub fn new(facts: Option<&innerwall_wire::proto::HostFacts>, key_sha256: &str) -> Self {
        let cut = |s: &str| s.chars().filter(|c| !c.is_control()).take(MAX_FACT).collect::<String>();
        Presenter {
            boot_id: cut(facts.map_or("", |f| f.boot_id.as_str())),
            key_sha256: key_sha256.to_owned(),
            machine_id: cut(facts.map_or("", |f| f.machine_id.as_str())),
            hostname: cut(facts.map_or("", |f| f.hostname.as_str())),
        }
    }
}

/// A presenter as stored: when it was last seen, as an ordinal (any monotone clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting<T> {
    pub boot_id: String,
    pub key_sha256: String,
    pub last_seen: T,
}

/// Whether the presenter (`boot_id`, `key_sha256`) is a clone, given the sightings before this
/// one: it was seen before, and another presenter was seen after it last was (it returns).
pub fn returns_after_another<T: Ord>(sightings: &[Sighting<T>], boot_id: &str, key_sha256: &str) -> bool {
    let same = |s: &Sighting<T>| s.boot_id == boot_id && s.key_sha256 == key_sha256;
    let Some(mine) = sightings.iter().find(|s| same(s)) else { return false };
    sightings.iter().any(|s| !same(s) && s.last_seen > mine.last_seen)
}

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

/// Records that `presenter` opened a stream of `id`, and whether that makes the identity a
/// clone; the first sighting of an episode writes one `workload.identity-clone` audit record
/// naming the presenters. One transaction, the workload row locked, so two replicas' Hellos
/// of one identity are judged one after the other. Returns true when a clone was seen.
pub async fn observe(pool: &PgPool, id: WorkloadId, presenter: &Presenter) -> Result<bool, Error> {
    let mut tx = pool.begin().await?;
    let registered: Option<String> =
        sqlx::query_scalar("SELECT machine_id FROM workloads WHERE id = $1 FOR UPDATE")
            .bind(id.uuid())
            .fetch_optional(&mut *tx)
            .await?;
    let Some(registered) = registered else {
        return Err(Error::NotFound { what: "workload", name: id.to_string() });
    };
    let rows: Vec<(String, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT boot_id, key_sha256, last_seen_at FROM workload_presenters WHERE workload_id = $1",
    )
    .bind(id.uuid())
    .fetch_all(&mut *tx)
    .await?;
    let sightings: Vec<Sighting<_>> = rows
        .into_iter()
        .map(|(boot_id, key_sha256, last_seen)| Sighting { boot_id, key_sha256, last_seen })
        .collect();
    let returned = returns_after_another(&sightings, &presenter.boot_id, &presenter.key_sha256);
    let other_machine =
        !registered.is_empty() && !presenter.machine_id.is_empty() && presenter.machine_id != registered;
    sqlx::query(
        "INSERT INTO workload_presenters (workload_id, boot_id, key_sha256, machine_id, hostname)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (workload_id, boot_id, key_sha256)
         DO UPDATE SET last_seen_at = now(), machine_id = EXCLUDED.machine_id, hostname = EXCLUDED.hostname",
    )
    .bind(id.uuid())
    .bind(&presenter.boot_id)
    .bind(&presenter.key_sha256)
    .bind(&presenter.machine_id)
    .bind(&presenter.hostname)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM workload_presenters WHERE workload_id = $1 AND (boot_id, key_sha256) NOT IN (
             SELECT boot_id, key_sha256 FROM workload_presenters WHERE workload_id = $1
             ORDER BY last_seen_at DESC, first_seen_at DESC LIMIT $2)",
    )
    .bind(id.uuid())
    .bind(MAX_PRESENTERS)
    .execute(&mut *tx)
    .await?;
    if !(returned || other_machine) {
        tx.commit().await?;
        return Ok(false);
    }
    let begins: bool = sqlx::query_scalar(
        "UPDATE workloads SET
             clone_started_at = CASE WHEN clone_seen_at IS NULL OR clone_seen_at < now() - make_interval(secs => $2)
                                     THEN now() ELSE clone_started_at END,
             clone_seen_at = now()
         WHERE id = $1 RETURNING clone_started_at = now()",
    )
    .bind(id.uuid())
    .bind(EPISODE.as_secs_f64())
    .fetch_one(&mut *tx)
    .await?;
    tracing::warn!(workload = %id, boot_id = %presenter.boot_id, machine_id = %presenter.machine_id,
        new_episode = begins, "identity presented by more than one host (clone)");
    if begins {
        let presenters = presenters(&mut tx, id).await?;
        let detail = serde_json::json!({
            "reason": if returned { "a presenter returned after another was seen" } else { "another machine id than the enrolled one" },
            "registered_machine_id": registered,
            "presenters": presenters,
        });
        let (actor, subject) = (format!("workload:{id}"), id.to_string());
        audit::write(
            &mut tx,
            &audit::Record::new(&actor, "workload.identity-clone", &subject).detail(detail),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// The presenters of `id` seen within an episode's length of its last sighting, newest first.
async fn presenters(conn: &mut PgConnection, id: WorkloadId) -> Result<Vec<PresenterView>, Error> {
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

/// Fills in each status view's clone episode and renewal failure (`workload status`). Most
/// workloads have neither; the two reads are cheap per row and a status page is bounded.
pub async fn annotate(conn: &mut PgConnection, views: &mut [SyncStatusView]) -> Result<(), Error> {
    let ids: Vec<uuid::Uuid> = views.iter().map(|v| v.id).collect();
    let flagged: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT id FROM workloads WHERE id = ANY($1)
           AND (clone_seen_at >= now() - make_interval(secs => $2) OR last_renewal_failed_at IS NOT NULL)",
    )
    .bind(&ids)
    .bind(EPISODE.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?;
    for view in views.iter_mut().filter(|v| flagged.contains(&v.id)) {
        let Some(id) = WorkloadId::from_uuid(view.id) else { continue };
        view.clone = clone_report(conn, id).await?;
        view.renewal_failure = renewal_failure(conn, id).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(boot: &str, key: &str, at: u32) -> Sighting<u32> {
        Sighting { boot_id: boot.into(), key_sha256: key.into(), last_seen: at }
    }

    #[test]
    fn a_returning_presenter_is_a_clone_a_reboot_or_renewal_is_not() {
        // First sighting, reconnects of the same boot and key: no clone.
        assert!(!returns_after_another::<u32>(&[], "b1", "k1"));
        assert!(!returns_after_another(&[seen("b1", "k1", 1)], "b1", "k1"));
        // A reboot (new boot id) and a renewal (new key) are new presenters.
        assert!(!returns_after_another(&[seen("b1", "k1", 1)], "b2", "k1"));
        assert!(!returns_after_another(&[seen("b1", "k1", 1)], "b1", "k2"));
        // A reboot, then a renewal: still only new presenters.
        let history = [seen("b1", "k1", 1), seen("b2", "k1", 2)];
        assert!(!returns_after_another(&history, "b2", "k2"));
        // The newest presenter reconnecting is not a return.
        assert!(!returns_after_another(&history, "b2", "k1"));
        // The old boot coming back after the new one was seen: two hosts.
        assert!(returns_after_another(&history, "b1", "k1"));
        // A live clone with the same boot id: after one copy renewed, the other returns with
        // the old key.
        assert!(returns_after_another(&[seen("b1", "k1", 1), seen("b1", "k2", 2)], "b1", "k1"));
    }
}
