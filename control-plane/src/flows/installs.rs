//! Which policy versions each host installed, and when (FLOW-5, FLOW-7): recorded when an agent
//! acknowledges a version APPLIED or HELD, or reports in its Hello a version applied whose
//! acknowledgement was lost with its connection; and `judge`, pure, which says whether a
//! window's claimed version, mode and times agree with those installs.
//!
//! Time base: the server's clock. `installed_from` is never later than the true install (an
//! ack: the time it arrived, since the agent acks right after it installs; a Hello's report:
//! the time the version was rendered, since the install may lie before a partition), and
//! `installed_by` never earlier (the arrival of the ack or of the Hello). A window, in the
//! agent's clock, is accepted under version N when it lies within `[installed_from(N), the
//! earliest installed_by of any later version]`, each end widened by the clock skew ingest
//! allows; so a window captured under N and uploaded after N+1 was installed (buffered through
//! a partition) is accepted as long as its times lie before N+1 was.

use chrono::{DateTime, Utc};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::{PgConnection, PgPool};

use crate::error::Error;
use crate::policy::store;

/// Why a window's claim to a version is refused (each its own reason in the refusal metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The workload never had this version.
    VersionUnknown,
    /// The workload had it, but its host did not hold it during the window.
    VersionNotInstalled,
    /// The window's mode is not the version's.
    ModeMismatch,
    /// The window overlaps one the workload already reported.
    Overlap,
    /// The window names a staged set (FLOW-10) its version did not carry.
    StagedSetMismatch,
    /// The workload has the version but no acknowledgement of it yet, and none of a later one:
    /// the ack may have been lost with its connection, and the agent's next Hello reports it.
    /// Not a refusal for good: the agent sends the window again.
    VersionPending,
}

impl Refusal {
    /// The reason's word, in the refusal's message.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::VersionUnknown => "version-unknown",
            Refusal::VersionNotInstalled => "version-not-installed",
            Refusal::ModeMismatch => "mode-mismatch",
            Refusal::Overlap => "overlap",
            Refusal::StagedSetMismatch => "staged-set-mismatch",
            Refusal::VersionPending => "version-pending",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One recorded install of a version on a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Installed {
    pub mode: Mode,
    pub from: DateTime<Utc>,
    pub by: DateTime<Utc>,
}

/// What the database knows about a window's claimed version on its workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The workload had the version (a history row; version 0, no policy yet, always).
    pub known: bool,
    pub installed: Option<Installed>,
    /// The earliest `installed_by` of a later version (the end of this one's tenure), if any.
    pub next_by: Option<DateTime<Utc>>,
    /// The staged set the version carried (FLOW-10), if any.
    pub staged_set: Option<String>,
}

fn at(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}

/// Whether `window`'s version, mode and times agree with what its host installed, `skew` the
/// clock skew allowed between the agent's clock and the server's. Pure.
pub fn judge(window: &FlowWindow, claim: &Claim, skew: chrono::Duration) -> Result<(), (Refusal, String)> {
    let v = window.policy_version;
    if !claim.known {
        return Err((Refusal::VersionUnknown, format!("the workload never had policy version {v}")));
    }
    let Some(installed) = claim.installed else {
        return Err(match claim.next_by {
            Some(_) => (
                Refusal::VersionNotInstalled,
                format!(
                    "policy version {v} was never acknowledged installed on this host, and a later one was"
                ),
            ),
            None => (
                Refusal::VersionPending,
                format!(
                    "policy version {v} is not acknowledged installed on this host yet; send the window again"
                ),
            ),
        });
    };
    let (start, end) = (at(window.start_ms), at(window.end_ms));
    if start < installed.from - skew {
        return Err((
            Refusal::VersionNotInstalled,
            format!(
                "the window starts at {start}, before policy version {v} was installed on this host ({}, {} s skew allowed)",
                installed.from,
                skew.num_seconds()
            ),
        ));
    }
    if let Some(next) = claim.next_by
        && end > next + skew
    {
        return Err((
            Refusal::VersionNotInstalled,
            format!(
                "the window ends at {end}, after the version that followed policy version {v} was installed on this host \
                 ({next}, {} s skew allowed)",
                skew.num_seconds()
            ),
        ));
    }
    // With the kill switch engaged, or once the confirm deadline of an unconfirmed promotion
    // passed (FLOW-11), an enforcing version is judged as its simulation (the agent drops
    // nothing), so its windows say simulation.
    let kill_switch = installed.mode == Mode::Enforcement && window.mode == Mode::Simulation;
    if window.mode != installed.mode && !kill_switch {
        return Err((
            Refusal::ModeMismatch,
            format!("the window says {}, but policy version {v} is in {}", window.mode, installed.mode),
        ));
    }
    // Pending decisions count as evidence for a staged set only under a version that carried it.
    // (A window without one is the agent's to send: in visibility, or from an agent that does
    // not evaluate staged sets, it is evidence of nothing staged.)
    if let Some(set) = &window.staged_set
        && claim.staged_set.as_ref() != Some(set)
    {
        let carried = claim.staged_set.as_ref().map_or_else(|| "none".to_owned(), |s| format!("{s:?}"));
        return Err((
            Refusal::StagedSetMismatch,
            format!("the window names staged set {set:?}, but policy version {v} carried {carried}"),
        ));
    }
    Ok(())
}

/// What the database knows about `version` on `workload` (`created_at`: the workload's, which
/// begins version 0's tenure).
pub(super) async fn claim(
    conn: &mut PgConnection,
    workload: WorkloadId,
    version: u64,
    created_at: DateTime<Utc>,
) -> Result<Claim, Error> {
    type Row = (
        bool,
        Option<i16>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
        Option<String>,
    );
    let (known, mode, from, by, next_by, staged_set): Row = sqlx::query_as(
        "SELECT h.version IS NOT NULL, i.mode, i.installed_from, i.installed_by,
                (SELECT min(n.installed_by) FROM workload_installs n WHERE n.workload_id = $1 AND n.version > $2),
                h.staged_set
         FROM (SELECT 1) AS one
         LEFT JOIN workload_policy_history h ON h.workload_id = $1 AND h.version = $2
         LEFT JOIN workload_installs i ON i.workload_id = $1 AND i.version = $2",
    )
    .bind(workload.uuid())
    .bind(version as i64)
    .fetch_one(&mut *conn)
    .await?;
    let installed = if version == 0 {
        // No policy yet: visibility, from enrollment until the first version is installed.
        Some(Installed { mode: Mode::Visibility, from: created_at, by: created_at })
    } else {
        match (mode, from, by) {
            (Some(mode), Some(from), Some(by)) => Some(Installed {
                mode: Mode::from_code(mode)
                    .map_err(|_| Error::Corrupt { what: "installed mode", detail: mode.to_string() })?,
                from,
                by,
            }),
            _ => None,
        }
    };
    Ok(Claim { known: known || version == 0, installed, next_by, staged_set })
}

/// Records that `version` (in `mode`) was installed on `workload` within `[from, by]` (each
/// `None`: the database's clock now), keeping the earliest of each if it was recorded before.
/// The write of installs for Hellos and tests; the acks' are written by [`acknowledged`], by the
/// same rule.
pub async fn record(
    conn: &mut PgConnection,
    workload: WorkloadId,
    version: u64,
    mode: Mode,
    from: Option<DateTime<Utc>>,
    by: Option<DateTime<Utc>>,
) -> Result<(), Error> {
    if version == 0 {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO workload_installs (workload_id, version, mode, installed_from, installed_by)
         VALUES ($1, $2, $3, COALESCE($4, now()), GREATEST(COALESCE($4, now()), COALESCE($5, now())))
         ON CONFLICT (workload_id, version) DO UPDATE
         SET installed_from = LEAST(workload_installs.installed_from, excluded.installed_from),
             installed_by = LEAST(workload_installs.installed_by, excluded.installed_by)",
    )
    .bind(workload.uuid())
    .bind(version as i64)
    .bind(mode.code())
    .bind(from)
    .bind(by)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Agents acknowledged these versions (in these modes) APPLIED or HELD: each recorded now, by
/// [`record`]'s rule, in one statement (the streams' batched records, `sync::records`; at most
/// one row per workload and version).
pub(crate) async fn acknowledged(
    conn: &mut PgConnection,
    workloads: &[uuid::Uuid],
    versions: &[i64],
    modes: &[i16],
) -> Result<(), Error> {
    if workloads.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO workload_installs (workload_id, version, mode, installed_from, installed_by)
         SELECT w, v, m, now(), now() FROM unnest($1::uuid[], $2::bigint[], $3::smallint[]) AS i (w, v, m)
         ON CONFLICT (workload_id, version) DO UPDATE
         SET installed_from = LEAST(workload_installs.installed_from, excluded.installed_from),
             installed_by = LEAST(workload_installs.installed_by, excluded.installed_by)",
    )
    .bind(workloads)
    .bind(versions)
    .bind(modes)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// An agent's Hello reports `version` applied: if the workload had that version and its install
/// is not recorded (the ack was lost with its connection), it is recorded from the version's
/// render (no later than the true install) to now. A version the workload never had is ignored
/// (the Hello is the agent's word, and the stream sends it the persisted policy anyway).
/// Returns whether it recorded anything.
pub async fn reported(pool: &PgPool, workload: WorkloadId, version: u64) -> Result<bool, Error> {
    if version == 0 {
        return Ok(false);
    }
    let mut conn = pool.acquire().await?;
    let recorded: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM workload_installs WHERE workload_id = $1 AND version = $2)",
    )
    .bind(workload.uuid())
    .bind(version as i64)
    .fetch_one(&mut *conn)
    .await?;
    if recorded {
        return Ok(false);
    }
    let row: Option<(Vec<u8>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT c.policy, h.rendered_at FROM workload_policy_history h JOIN policy_contents c ON c.digest = h.digest
         WHERE h.workload_id = $1 AND h.version = $2",
    )
    .bind(workload.uuid())
    .bind(version as i64)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((bytes, rendered_at)) = row else {
        return Ok(false);
    };
    let mode = store::Persisted { version, bytes }.decode()?.mode();
    record(&mut conn, workload, version, mode, Some(rendered_at), None).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: i64 = 1_800_000_000_000;
    const S: i64 = 1_000;

    fn window(version: u64, mode: Mode, start_ms: i64, end_ms: i64) -> FlowWindow {
        FlowWindow {
            staged_set: None,
            id: uuid::Uuid::new_v4(),
            start_ms,
            end_ms,
            policy_version: version,
            mode,
            records: vec![],
            gaps: vec![],
        }
    }

    fn installed(mode: Mode, from: i64, by: i64) -> Option<Installed> {
        Some(Installed { mode, from: at(from), by: at(by) })
    }

    #[test]
    fn a_window_lies_within_its_versions_tenure() {
        let skew = chrono::Duration::seconds(5);
        let sim = Mode::Simulation;
        // v2 installed at T (ack at T + 1 s), v3 acked at T + 100 s.
        let claim = Claim {
            known: true,
            installed: installed(sim, T, T + S),
            next_by: Some(at(T + 100 * S)),
            staged_set: None,
        };
        let judge = |w: FlowWindow, c: &Claim| judge(&w, c, skew).map_err(|e| e.0);
        assert_eq!(judge(window(2, sim, T, T + 60 * S), &claim), Ok(()));
        assert_eq!(judge(window(2, sim, T - 5 * S, T + 60 * S), &claim), Ok(()), "within the skew");
        assert_eq!(
            judge(window(2, sim, T + 40 * S, T + 105 * S), &claim),
            Ok(()),
            "buffered through the change to v3, captured before it (within the skew)"
        );
        assert_eq!(judge(window(2, sim, T - 5 * S - 1, T), &claim), Err(Refusal::VersionNotInstalled));
        assert_eq!(
            judge(window(2, sim, T + 90 * S, T + 105 * S + 1), &claim),
            Err(Refusal::VersionNotInstalled)
        );
        assert_eq!(judge(window(2, Mode::Visibility, T, T + S), &claim), Err(Refusal::ModeMismatch));
        let open = Claim { next_by: None, ..claim.clone() };
        assert_eq!(judge(window(2, sim, T, T + 10_000 * S), &open), Ok(()), "the latest has no end");
        let enforcing = Claim { installed: installed(Mode::Enforcement, T, T), ..open.clone() };
        assert_eq!(
            judge(window(2, sim, T, T + S), &enforcing),
            Ok(()),
            "the kill switch judges as simulation"
        );
        assert_eq!(judge(window(2, Mode::Visibility, T, T + S), &enforcing), Err(Refusal::ModeMismatch));
        // A window names a staged set only under a version that carried that very set.
        let staged = |set: &str| FlowWindow { staged_set: Some(set.into()), ..window(2, sim, T, T + S) };
        assert_eq!(judge(staged("db:1"), &open), Err(Refusal::StagedSetMismatch), "the version had none");
        let carried = Claim { staged_set: Some("db:1".into()), ..open.clone() };
        assert_eq!(judge(staged("db:1"), &carried), Ok(()));
        assert_eq!(judge(staged("db:2"), &carried), Err(Refusal::StagedSetMismatch), "another stage");
        assert_eq!(judge(window(2, sim, T, T + S), &carried), Ok(()), "a window may carry none");
        let unknown = Claim { known: false, installed: None, next_by: None, staged_set: None };
        assert_eq!(judge(window(7, sim, T, T + S), &unknown), Err(Refusal::VersionUnknown));
        let pending = Claim { known: true, installed: None, next_by: None, staged_set: None };
        assert_eq!(judge(window(2, sim, T, T + S), &pending), Err(Refusal::VersionPending));
        let skipped = Claim { known: true, installed: None, next_by: Some(at(T)), staged_set: None };
        assert_eq!(judge(window(2, sim, T, T + S), &skipped), Err(Refusal::VersionNotInstalled));
    }
}
