//! The publish transaction (POL-4, POL-5, SYNC-7): under the render lock, render every live
//! workload, diff each against its persisted policy with the shared `wire` diff, advance the
//! version only on a non-empty diff, persist, and announce on the notice channel — delivered by
//! Postgres only when the caller's transaction commits.

use std::collections::BTreeMap;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Version, WorkloadPolicy, diff};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::audit;
use crate::error::Error;
use crate::notice::{self, Notice};
use crate::policy::addresses::{self, Standing};
use crate::policy::model::RegisteredWorkload;
use crate::policy::render::render;
use crate::policy::store;

/// Key of the transaction-scoped advisory lock every render takes (ASCII "iw-rendr").
pub const RENDER_LOCK_KEY: i64 = 0x6977_2d72_656e_6472;

/// A workload whose persisted policy advanced in this render.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Changed {
    pub workload: WorkloadId,
    pub version: Version,
}

/// The next persisted policy of one workload, or `None` when nothing it can see changed.
/// The first render always persists version 1, even when empty.
pub fn next_version(persisted: Option<&WorkloadPolicy>, rendered: WorkloadPolicy) -> Option<WorkloadPolicy> {
    match persisted {
        None => Some(rendered.with_version(1)),
        Some(old) => {
            let same_base = rendered.with_version(old.version());
            let delta = diff(old, &same_base);
            (!delta.changes.is_empty()).then(|| same_base.with_version(old.version() + 1))
        }
    }
}

/// [`next_version`] against a persisted policy as stored. Canonical bytes are one-to-one with
/// policies, so equal bytes at the persisted version mean nothing changed, without decoding; only
/// a workload whose bytes differ has its persisted policy decoded and diffed. (Decoding every
/// persisted policy on every render dominated a render of a large estate.)
fn advance(
    persisted: Option<&store::Persisted>,
    rendered: WorkloadPolicy,
) -> Result<Option<WorkloadPolicy>, Error> {
    let Some(persisted) = persisted else { return Ok(next_version(None, rendered)) };
    let same = rendered.with_version(persisted.version);
    if same.canonical_bytes() == persisted.bytes {
        return Ok(None);
    }
    Ok(next_version(Some(&persisted.decode()?), same))
}

/// Takes the render lock for the rest of the caller's transaction (again is fine: it stacks),
/// waiting at most the connection's lock timeout. Whatever the transaction reads after it, no
/// render or authored change commits in between.
pub async fn lock_renders(conn: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(RENDER_LOCK_KEY).execute(&mut *conn).await.map_err(
        |e| match e.as_database_error().and_then(|d| d.code()).as_deref() {
            // lock_not_available: the connection's lock_timeout passed (postgres::Timeouts).
            Some("55P03") => Error::Busy(
                "the render lock stayed held past the lock timeout: another render, or a client \
                 stalled in the middle of a change, holds it; nothing was written, retry"
                    .into(),
            ),
            _ => Error::Database(e),
        },
    )?;
    Ok(())
}

/// Renders and persists inside the caller's transaction. Returns the workloads whose version
/// advanced, in id order. The caller commits (which delivers the notifications) or rolls back
/// (which delivers none).
pub async fn publish(conn: &mut PgConnection) -> Result<Vec<Changed>, Error> {
    lock_renders(conn).await?;
    let started = std::time::Instant::now();
    let changed = render_and_persist(conn).await?;
    crate::metrics::observe_render(started.elapsed(), changed.len());
    Ok(changed)
}

/// `publish` under the render lock.
async fn render_and_persist(conn: &mut PgConnection) -> Result<Vec<Changed>, Error> {
    let model = store::load_model(conn).await?;
    let registry = store::load_registry(conn).await?;
    let registry = judge_addresses(conn, registry).await?;
    let rendered = render(&model, &registry)?;
    let persisted = store::load_persisted_bytes(conn).await?;
    let mut next: BTreeMap<WorkloadId, WorkloadPolicy> = BTreeMap::new();
    for (id, policy) in rendered {
        if let Some(p) = advance(persisted.get(&id), policy)? {
            next.insert(id, p);
        }
    }
    if next.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = next.keys().map(WorkloadId::uuid).collect();
    let versions: Vec<i64> = next.values().map(|p| p.version() as i64).collect();
    let bytes: Vec<Vec<u8>> = next.values().map(WorkloadPolicy::canonical_bytes).collect();
    sqlx::query(
        "INSERT INTO workload_policies (workload_id, version, policy, rendered_at)
         SELECT w, v, p, now() FROM unnest($1::uuid[], $2::bigint[], $3::bytea[]) AS t (w, v, p)
         ON CONFLICT (workload_id) DO UPDATE
         SET version = excluded.version, policy = excluded.policy, rendered_at = excluded.rendered_at",
    )
    .bind(&ids)
    .bind(&versions)
    .bind(&bytes)
    .execute(&mut *conn)
    .await?;
    // Copied on the server from the rows just written: the bytes cross the socket once, and
    // Postgres keeps them as already compressed.
    sqlx::query(
        "INSERT INTO workload_policy_history (workload_id, version, policy, rendered_at)
         SELECT workload_id, version, policy, rendered_at FROM workload_policies
         WHERE workload_id = ANY($1)",
    )
    .bind(&ids)
    .execute(&mut *conn)
    .await?;
    let notices: Vec<Notice> = next.iter().map(|(id, p)| Notice::Policy(*id, p.version())).collect();
    notice::publish(conn, &notices).await?;
    Ok(next.iter().map(|(id, p)| Changed { workload: *id, version: p.version() }).collect())
}

/// Address trust: judges every live workload's reported addresses, stores the standings that
/// changed (auditing each workload whose addresses were refused, came into conflict, or were
/// accepted again), and returns the workloads with only their accepted addresses, to render.
async fn judge_addresses(
    conn: &mut PgConnection,
    registry: store::Registry,
) -> Result<Vec<RegisteredWorkload>, Error> {
    let claims = registry.workloads.iter().map(|w| addresses::Claim {
        workload: w.id,
        addresses: &w.addresses,
        narrowed_to: registry.narrowed.get(&w.id).map_or(&[], Vec::as_slice),
    });
    let standings = addresses::judge(&registry.estate, claims);
    let changes = addresses::changes(&registry.stored, &standings);
    store::save_standings(conn, &changes).await?;
    let conflicts = addresses::conflicts(&standings);
    let mut noteworthy: BTreeMap<WorkloadId, Vec<serde_json::Value>> = BTreeMap::new();
    for &(w, address, standing) in &changes {
        let before = registry.stored.get(&(w, address)).copied().flatten();
        // A new address that is accepted is recorded by the change that reported it.
        if standing == Standing::Accepted && before.is_none() {
            continue;
        }
        let mut entry = serde_json::json!({"address": address.to_string(), "standing": standing.name()});
        if let Some(others) = conflicts.get(&address) {
            let others: Vec<String> = others.iter().filter(|o| **o != w).map(ToString::to_string).collect();
            entry["also_claimed_by"] = serde_json::json!(others);
        }
        noteworthy.entry(w).or_default().push(entry);
    }
    for (w, entries) in noteworthy {
        let subject = w.to_string();
        let record = audit::Record::new("control-plane", "workload.address-standing", &subject)
            .detail(serde_json::json!({"addresses": entries}));
        audit::write(conn, &record).await?;
    }
    Ok(registry
        .workloads
        .into_iter()
        .map(|w| RegisteredWorkload { addresses: addresses::accepted(&standings, w.id), ..w })
        .collect())
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::Mode;
    use innerwall_wire::testing::policy;

    use super::*;

    #[test]
    fn first_render_is_version_one_even_when_empty() {
        assert_eq!(
            next_version(None, policy(0, Mode::Visibility, &[])),
            Some(policy(1, Mode::Visibility, &[]))
        );
    }

    #[test]
    fn version_advances_by_one_only_on_a_real_change() {
        let held = policy(7, Mode::Enforcement, &[22]);
        assert_eq!(next_version(Some(&held), policy(0, Mode::Enforcement, &[22])), None);
        assert_eq!(
            next_version(Some(&held), policy(0, Mode::Enforcement, &[22, 443])),
            Some(policy(8, Mode::Enforcement, &[22, 443]))
        );
        assert_eq!(
            next_version(Some(&held), policy(0, Mode::Simulation, &[22])),
            Some(policy(8, Mode::Simulation, &[22]))
        );
    }

    /// Against the stored bytes: the same answers as [`next_version`] on the decoded policy;
    /// bytes that are not a policy are an error, not a silent new version.
    #[test]
    fn stored_bytes_advance_as_the_decoded_policy_does() {
        let held = policy(7, Mode::Enforcement, &[22]);
        let stored = store::Persisted { version: 7, bytes: held.canonical_bytes() };
        assert_eq!(advance(Some(&stored), policy(0, Mode::Enforcement, &[22])).unwrap(), None);
        for next in [policy(0, Mode::Enforcement, &[22, 443]), policy(0, Mode::Simulation, &[22])] {
            assert_eq!(advance(Some(&stored), next.clone()).unwrap(), next_version(Some(&held), next));
        }
        assert_eq!(
            advance(None, policy(0, Mode::Visibility, &[])).unwrap(),
            Some(policy(1, Mode::Visibility, &[]))
        );
        let corrupt = store::Persisted { version: 7, bytes: vec![0xff, 0x01] };
        assert!(advance(Some(&corrupt), policy(0, Mode::Enforcement, &[22])).is_err());
    }
}
