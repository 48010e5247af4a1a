//! Rollback (issue 31) end to end: an agent running the real sync loop against a real control
//! plane and Postgres is promoted on a SAFE verdict, gets two versions no verdict judged, and is
//! rolled back to the last clean one's authored source: a new version, equal in content to the
//! clean one, which the agent installs; it stays pinned while the rulesets change, until
//! unpinned; and a rollback to a named version does the same the second time.

use innerwall_control_plane::error::Error;
use innerwall_control_plane::gate::{self, Outcome, Scope};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::safety::rollback::{self, Target};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, WorkloadPolicy};

use crate::gate::{BATCH, Host, SECOND, WEB, allow_db_from, db, now_ms, params, set_mode, synced};
use crate::plane::Plane;

/// Every stored version of `id`, by number.
async fn history(plane: &Plane, id: WorkloadId) -> Vec<WorkloadPolicy> {
    store::policy_history(&mut plane.pool().acquire().await.unwrap(), id).await.unwrap()
}

/// Version `v` of `id` as stored.
async fn at(plane: &Plane, id: WorkloadId, v: i64) -> WorkloadPolicy {
    history(plane, id).await.into_iter().find(|p| p.version() == v as u64).expect("a stored version")
}

/// The same policy, whatever its version number.
fn same(a: &WorkloadPolicy, b: &WorkloadPolicy) -> bool {
    a.clone().with_version(0) == b.clone().with_version(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_renders_the_last_clean_source() {
    let plane = Plane::start().await;
    plane.register("web-1", &["app=web"], WEB).await;
    plane.register("batch-1", &["app=batch"], BATCH).await;
    allow_db_from(&plane, "web").await;
    allow_db_from(&plane, "batch").await;
    let host = Host::start(&plane, "db-1").await;
    let id = host.id;
    set_mode(&plane, db(), 1, Mode::Simulation).await;
    let judged = synced(&plane, &[&host]).await;
    let base = now_ms() - 60 * SECOND;
    host.deliver(base, base + 10 * SECOND, &[WEB, BATCH], &[]).await;
    let range = params(base, base + 10 * SECOND);
    assert_eq!(gate::judge(plane.pool(), &db(), &range).await.unwrap().outcome, Outcome::Safe);
    let request = gate::Request {
        scope: db(),
        expect_count: 1,
        to: Mode::Enforcement,
        params: range,
        reason: "clean".into(),
        override_reason: None,
        guard: None,
        confirm_within: None,
    };
    gate::promote(plane.pool(), "alice", &request).await.unwrap();
    let clean = synced(&plane, &[&host]).await;
    assert!(clean > judged);

    // Two versions no verdict judged.
    allow_db_from(&plane, "cache").await;
    let bad1 = synced(&plane, &[&host]).await;
    allow_db_from(&plane, "ops").await;
    let bad2 = synced(&plane, &[&host]).await;
    assert!(bad2 > bad1 && bad1 > clean);

    // Refused, changing nothing: a later version, an unknown one, the wrong count.
    let only = Scope::Ids(vec![id]);
    for (target, count) in
        [(Target::Version(bad2 as u64), 1), (Target::Version(0), 1), (Target::LastClean, 2)]
    {
        let refused = rollback::rollback(plane.pool(), "bob", &only, count, target).await.unwrap_err();
        assert!(
            matches!(refused, Error::Invalid(_) | Error::NotFound { .. } | Error::CountMismatch { .. }),
            "{refused}"
        );
    }
    assert_eq!(plane.status(id).await.2, Some(bad2));

    // To the last clean source: a new version, the clean one's content, installed by the agent.
    let done = rollback::rollback(plane.pool(), "bob", &db(), 1, Target::LastClean).await.unwrap();
    let rolled = &done.value[0];
    assert_eq!((rolled.from_version, rolled.source_of), (bad2 as u64, judged as u64), "{rolled:?}");
    let new = rolled.version.expect("a new version") as i64;
    assert_eq!(new, bad2 + 1, "numbers are never reused");
    assert!(same(&at(&plane, id, new).await, &at(&plane, id, clean).await), "the clean version's content");
    assert_eq!(synced(&plane, &[&host]).await, new);
    let installed = host.enforcer_current();
    assert!(same(&installed, &at(&plane, id, clean).await) && installed.mode() == Mode::Enforcement);
    let (detail, versions): (serde_json::Value, serde_json::Value) =
        sqlx::query_as("SELECT detail, workload_versions FROM audit_log WHERE action = 'workload.rollback'")
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert_eq!(detail["workloads"][id.to_string()]["from_version"], bad2, "{detail}");
    assert_eq!(detail["workloads"][id.to_string()]["source_of"], judged, "{detail}");
    assert_eq!(versions[id.to_string()], new, "{versions}");

    // Pinned: a ruleset change does not reach it; unpinned, it renders from the rulesets again.
    allow_db_from(&plane, "mail").await;
    assert_eq!(plane.status(id).await.2, Some(new));
    rollback::unpin(plane.pool(), "bob", id).await.unwrap();
    let unpinned = synced(&plane, &[&host]).await;
    assert!(unpinned > new);
    assert_eq!(at(&plane, id, unpinned).await.rules().len(), at(&plane, id, bad2).await.rules().len() + 1);
    assert!(rollback::unpin(plane.pool(), "bob", id).await.is_err(), "not pinned any more");

    // The second time, to a named version.
    let done = rollback::rollback(plane.pool(), "bob", &only, 1, Target::Version(bad1 as u64)).await.unwrap();
    let again = done.value[0].version.expect("a new version") as i64;
    assert!(same(&at(&plane, id, again).await, &at(&plane, id, bad1).await));
    assert_eq!(synced(&plane, &[&host]).await, again);
}
