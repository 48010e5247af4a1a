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

use sqlx::PgPool;

use crate::audit;
use crate::error::Error;
use crate::policy::lifecycle::{EPISODE, presenters};
use innerwall_wire::identity::WorkloadId;

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
    pub fn new(facts: Option<&innerwall_wire::identity::HostFacts>, key_sha256: &str) -> Self {
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
