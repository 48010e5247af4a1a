//! The evidence gate end to end (FLOW-7, FLOW-8): agents running the real sync loop against a
//! real control plane and Postgres, their evidence built by the agent's own window code and
//! delivered through its queue, telemetry connection and the real ingest; then the verdict, and
//! count-pinned promotions with their records.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use innerwall_agent::daemon;
use innerwall_agent::evidence::flows::{Counters, FlowKey, Window};
use innerwall_agent::evidence::telemetry::Queue;
use innerwall_agent::identity::connect::{RunConfig, connect};
use innerwall_agent::sync::Agent as Shared;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::gate::{self, Outcome, Params, Scope};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::testing;
use innerwall_wire::flows::{EvidenceGap, FlowWindow, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol};

use crate::plane::{Plane, TestStore};

pub(crate) const WEB: &str = "10.9.0.7";
pub(crate) const BATCH: &str = "10.9.0.8";
pub(crate) const SECOND: i64 = 1_000;

pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `app=db` accepts tcp/5432 from workloads labelled `app=<from>` (ruleset `db-from-<from>`).
pub(crate) async fn allow_db_from(plane: &Plane, from: &str) {
    let name = format!("db-from-{from}");
    testing::admit(plane.pool(), &name, ("app", "db"), ("app", from), "tcp:5432").await.unwrap();
}

/// An enrolled `app=db` host running the real sync loop with an in-memory store.
pub(crate) struct Host {
    pub(crate) id: WorkloadId,
    config: RunConfig,
    shared: Arc<Shared<TestStore>>,
    task: tokio::task::JoinHandle<()>,
}

impl Host {
    pub(crate) async fn start(plane: &Plane, name: &str) -> Host {
        let (id, config) = plane.enroll(name, &["app=db"]).await;
        let shared = Arc::new(Shared::new(TestStore::default()));
        let (c, e) = (config.clone(), shared.clone());
        let task = tokio::spawn(async move { daemon::hold_stream(&c, e).await.unwrap() });
        Host { id, config, shared, task }
    }

    /// Builds a window over `[start, end)` with the agent's own window code, under the policy
    /// the agent applied, with tcp/5432 flows from `peers`, and delivers it through the agent's
    /// queue and telemetry connection.
    pub(crate) async fn deliver(&self, start: i64, end: i64, peers: &[&str], gaps: &[EvidenceGap]) {
        let flows: Vec<(&str, u16)> = peers.iter().map(|p| (*p, 5432)).collect();
        self.deliver_to(start, end, &flows, gaps).await;
    }

    /// [`Host::deliver`] with tcp flows from each (peer, port).
    pub(crate) async fn deliver_to(&self, start: i64, end: i64, flows: &[(&str, u16)], gaps: &[EvidenceGap]) {
        let mut window = Window::open(start, self.shared.enforcer.current(), 1_000);
        for (peer, port) in flows {
            let key = FlowKey {
                src: peer.parse().unwrap(),
                dst: "10.1.0.5".parse().unwrap(),
                dst_port: *port,
                protocol: Protocol::Tcp,
            };
            let counters = Counters {
                packets: 4,
                bytes: 240,
                new_connections: 2,
                first_seen_ms: start,
                last_seen_ms: end,
            };
            window.add(key, counters, end);
        }
        for gap in gaps {
            window.gap(gap.clone());
        }
        let window: FlowWindow = window.close(end);
        let queue = Queue::new(&self.config.state_dir, 100).unwrap();
        queue.push(window).unwrap();
        assert_eq!(queue.upload(connect(&self.config).await.unwrap()).await.unwrap(), 1);
    }
}

impl Host {
    /// The policy the agent installed.
    pub(crate) fn enforcer_current(&self) -> innerwall_wire::policy::WorkloadPolicy {
        self.shared.enforcer.current().expect("an installed policy")
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn latest(plane: &Plane, id: WorkloadId) -> i64 {
    plane.status(id).await.2.expect("a rendered policy")
}

pub(crate) async fn synced(plane: &Plane, hosts: &[&Host]) -> i64 {
    let mut version = 0;
    for host in hosts {
        version = latest(plane, host.id).await;
        plane.wait_synced(host.id, version).await;
    }
    version
}

pub(crate) async fn set_mode(plane: &Plane, scope: Scope, count: usize, to: Mode) -> gate::Promotion {
    let request = gate::Request {
        scope,
        expect_count: count,
        to,
        params: Params { from_ms: 0, to_ms: 0, min_duration_ms: 0, top_peers: 5 },
        reason: format!("test: to {to}"),
        override_reason: None,
        guard: None,
        confirm_within: None,
    };
    gate::promote(plane.pool(), "test", &request).await.unwrap()
}

pub(crate) fn db() -> Scope {
    Scope::parse_selector("app=db").unwrap()
}

pub(crate) fn params(from_ms: i64, to_ms: i64) -> Params {
    Params { from_ms, to_ms, min_duration_ms: to_ms - from_ms, top_peers: 5 }
}

async fn count(plane: &Plane, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(plane.pool()).await.unwrap()
}

/// web-1 (`app=web`), batch-1 (`app=batch,team=data`) and two `app=db` hosts in simulation under
/// a version (returned) that admits web only, with ten seconds of evidence from `base` (a minute
/// ago, returned): web allowed, batch would-block.
pub(crate) async fn unsafe_db(plane: &Plane) -> (Host, Host, i64, i64) {
    plane.register("web-1", &["app=web"], WEB).await;
    plane.register("batch-1", &["app=batch", "team=data"], BATCH).await;
    allow_db_from(plane, "web").await;
    let (a, b) = (Host::start(plane, "db-1").await, Host::start(plane, "db-2").await);
    set_mode(plane, db(), 2, Mode::Simulation).await;
    let v1 = synced(plane, &[&a, &b]).await;
    let base = now_ms() - 60 * SECOND;
    for host in [&a, &b] {
        host.deliver(base, base + 5 * SECOND, &[WEB], &[]).await;
        host.deliver(base + 5 * SECOND, base + 10 * SECOND, &[WEB, BATCH], &[]).await;
    }
    (a, b, v1, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdict_scenario_unsafe_then_safe() {
    let plane = Plane::start().await;
    let (a, b, v1, base) = unsafe_db(&plane).await;
    let verdict = gate::judge(plane.pool(), &db(), &params(base, base + 10 * SECOND)).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Unsafe, "{}", verdict.summary());
    let summary = verdict.summary();
    assert!(
        summary.contains(&format!(
            "{BATCH} {{\"app\":\"batch\",\"team\":\"data\"}} to tcp/5432 (native, captured under v{v1})"
        )),
        "{summary}"
    );
    assert!(!summary.contains(WEB), "web is allowed: {summary}");
    // Enforcing now is refused with the reasons, and changes nothing.
    let request = gate::Request {
        scope: db(),
        expect_count: 2,
        to: Mode::Enforcement,
        params: params(base, base + 10 * SECOND),
        reason: "go".into(),
        override_reason: None,
        guard: None,
        confirm_within: None,
    };
    let refused = gate::promote(plane.pool(), "test", &request).await.unwrap_err();
    assert!(matches!(refused, Error::EvidenceInsufficient { outcome: "UNSAFE", .. }), "{refused}");
    assert!(refused.to_string().contains(BATCH), "{refused}");

    // The fix: db accepts batch too. A new version for both; evidence under it.
    allow_db_from(&plane, "batch").await;
    let v2 = synced(&plane, &[&a, &b]).await;
    assert!(v2 > v1);
    for host in [&a, &b] {
        host.deliver(base + 10 * SECOND, base + 15 * SECOND, &[WEB, BATCH], &[]).await;
    }
    let range = params(base, base + 15 * SECOND);
    let verdict = gate::judge(plane.pool(), &db(), &range).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Safe, "{}", verdict.summary());
    for w in &verdict.workloads {
        assert_eq!(w.latest_version, Some(v2 as u64));
        let e = &w.evidence;
        assert_eq!((e.native_windows, e.replayed_windows), (1, 2), "{e:?}");
        assert_eq!(e.replayed_from, BTreeSet::from([v1 as u64]));
        assert_eq!(e.covered_ms, 15 * SECOND);
    }

    // Promotion with the right count flips exactly those two, and records the evidence.
    let other = plane.register("cache-1", &["app=cache"], "10.9.0.9").await;
    let request = gate::Request { params: range, ..request };
    let promotion = gate::promote(plane.pool(), "alice", &request).await.unwrap();
    let ids: BTreeSet<WorkloadId> = promotion.workloads.iter().map(|m| m.id).collect();
    assert_eq!(ids, BTreeSet::from([a.id, b.id]));
    assert!(promotion.workloads.iter().all(|m| m.mode == "simulation"), "the modes they left");
    for host in [&a, &b] {
        let mode: i16 = sqlx::query_scalar("SELECT mode FROM workloads WHERE id = $1")
            .bind(host.id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();
        assert_eq!(mode, 3, "enforcement");
    }
    let untouched: i16 = sqlx::query_scalar("SELECT mode FROM workloads WHERE id = $1")
        .bind(other.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert_eq!(untouched, 1, "outside the scope: still visibility");
    let stored = gate::promote::show(&mut plane.pool().acquire().await.unwrap(), promotion.id).await.unwrap();
    assert_eq!((stored.actor.as_str(), stored.to_mode, stored.expected_count), ("alice", "enforcement", 2));
    let verdict = stored.verdict.expect("the verdict it stood on");
    assert_eq!(verdict["outcome"], "SAFE");
    assert_eq!(verdict["workloads"].as_array().map(Vec::len), Some(2));
    assert_eq!(verdict["workloads"][0]["evidence"]["native_windows"], 1);
    assert_eq!(count(&plane, "SELECT count(*) FROM audit_log WHERE action = 'workload.promote'").await, 1);
    // The agents get the enforcing version.
    synced(&plane, &[&a, &b]).await;
    assert_eq!(a.shared.enforcer.current().unwrap().mode(), Mode::Enforcement);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotion_count_mismatch_changes_nothing() {
    let plane = Plane::start().await;
    let (a, b) = (Host::start(&plane, "db-1").await, Host::start(&plane, "db-2").await);
    set_mode(&plane, db(), 2, Mode::Simulation).await;
    synced(&plane, &[&a, &b]).await;
    let snapshot = async || {
        let rows: Vec<(uuid::Uuid, i16, Option<i64>)> = sqlx::query_as(
            "SELECT w.id, w.mode, p.version FROM workloads w LEFT JOIN workload_policies p ON p.workload_id = w.id
             ORDER BY w.id",
        )
        .fetch_all(plane.pool())
        .await
        .unwrap();
        let audits = count(&plane, "SELECT count(*) FROM audit_log").await;
        let promotions = count(&plane, "SELECT count(*) FROM promotions").await;
        (rows, audits, promotions)
    };
    let before = snapshot().await;
    let to_visibility = |expect_count| gate::Request {
        scope: db(),
        expect_count,
        to: Mode::Visibility,
        params: Params { from_ms: 0, to_ms: 0, min_duration_ms: 0, top_peers: 5 },
        reason: "roll back".into(),
        override_reason: None,
        guard: None,
        confirm_within: None,
    };
    let err = gate::promote(plane.pool(), "test", &to_visibility(3)).await.unwrap_err();
    assert!(matches!(err, Error::CountMismatch { expected: 3, matched: 2, .. }), "{err}");
    let text = err.to_string();
    let named = text.contains(&a.id.to_string()) && text.contains(&b.id.to_string());
    assert!(text.contains("2 workload(s) matched, you expected 3") && named, "{text}");
    assert_eq!(snapshot().await, before, "modes, versions, audit and records unchanged");

    // The verdict was read for two; then a third workload joins the scope: the promotion names
    // three now, so the count the operator read refuses it.
    let verdict = gate::judge(plane.pool(), &db(), &params(now_ms() - 10 * SECOND, now_ms())).await.unwrap();
    assert_eq!(verdict.workloads.len(), 2);
    let third = plane.register("db-3", &["app=cache"], "10.9.0.10").await;
    plane.relabel(third, 1, "app=db").await;
    let before = snapshot().await;
    let err = gate::promote(plane.pool(), "test", &to_visibility(2)).await.unwrap_err();
    assert!(matches!(err, Error::CountMismatch { expected: 2, matched: 3, .. }), "{err}");
    assert_eq!(snapshot().await, before, "the wider set changed nothing");
    // By ids, a retired or unknown workload is refused before anything changes.
    let gone = gate::promote(
        plane.pool(),
        "test",
        &gate::Request { scope: Scope::Ids(vec![a.id, WorkloadId::new_random()]), ..to_visibility(2) },
    )
    .await
    .unwrap_err();
    assert!(matches!(gone, Error::NotFound { .. }), "{gone}");
    assert_eq!(snapshot().await, before);
    // The bounds on what a client sends: ids per request and the length of a reason.
    let ids = vec![a.id; gate::evidence::MAX_SCOPE_IDS + 1];
    let many =
        gate::promote(plane.pool(), "test", &gate::Request { scope: Scope::Ids(ids), ..to_visibility(1) })
            .await
            .unwrap_err();
    assert!(many.to_string().contains("at most 1000 workload ids, not 1001"), "{many}");
    let long = "x".repeat(gate::promote::MAX_REASON + 1);
    let wordy = gate::promote(plane.pool(), "test", &gate::Request { reason: long, ..to_visibility(2) })
        .await
        .unwrap_err();
    assert!(wordy.to_string().contains("longer than 1024 characters"), "{wordy}");
    let silent =
        gate::promote(plane.pool(), "test", &gate::Request { reason: " ".into(), ..to_visibility(2) })
            .await
            .unwrap_err();
    assert!(silent.to_string().contains("needs a reason"), "{silent}");
    assert_eq!(snapshot().await, before);
}

/// Labels a host `tier=1`: a ruleset scoped to it gives it, and only it, a new version.
async fn new_version_for(plane: &Plane, host: &Host) {
    plane.relabel(host.id, 1, "tier=1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdict_refuses_stale_evidence() {
    let plane = Plane::start().await;
    plane.register("web-1", &["app=web"], WEB).await;
    allow_db_from(&plane, "web").await;
    // Workloads labelled tier=1 also accept web on tcp/6432.
    testing::admit(plane.pool(), "tier-1", ("tier", "1"), ("app", "web"), "tcp:6432").await.unwrap();
    let names = ["offline", "degraded", "no-window", "hole", "gap", "good"];
    let mut hosts = Vec::new();
    for name in names {
        hosts.push(Host::start(&plane, name).await);
    }
    set_mode(&plane, db(), hosts.len(), Mode::Simulation).await;
    let v1 = synced(&plane, &hosts.iter().collect::<Vec<_>>()).await;
    let base = now_ms() - 60 * SECOND;
    let (mid, end) = (base + 5 * SECOND, base + 10 * SECOND);
    let gap = EvidenceGap::new(GapKind::MapFull, mid + SECOND, mid + 2 * SECOND, 7);
    for (name, host) in names.iter().zip(&hosts) {
        let first_end = if *name == "hole" { mid - 3 * SECOND } else { mid };
        host.deliver(base, first_end, &[WEB], &[]).await;
        let gaps = if *name == "gap" { vec![gap.clone()] } else { vec![] };
        host.deliver(mid, end, &[WEB], &gaps).await;
    }
    let [offline, degraded, no_window, ..] = &hosts[..] else { unreachable!() };
    offline.task.abort();
    plane.wait(offline.id, |s| s.0 == "OFFLINE", "OFFLINE").await;
    // The degraded host refuses its next version (the delta and the recovery snapshot).
    degraded.shared.enforcer.store.lock().unwrap().refuse = Some((v1 as u64 + 1, 2));
    new_version_for(&plane, degraded).await;
    plane.wait(degraded.id, |s| s.0 == "DEGRADED", "DEGRADED").await;
    // This one applies its next version, but has no window under it yet.
    new_version_for(&plane, no_window).await;
    plane.wait_synced(no_window.id, v1 + 1).await;

    let verdict = gate::judge(plane.pool(), &db(), &params(base, end)).await.unwrap();
    let by_id: BTreeMap<WorkloadId, String> = verdict
        .workloads
        .iter()
        .map(|w| (w.id, w.reasons.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")))
        .collect();
    let reasons: BTreeMap<&str, &String> =
        names.iter().zip(&hosts).map(|(n, h)| (*n, &by_id[&h.id])).collect();
    assert_eq!(verdict.outcome, Outcome::Insufficient, "{reasons:#?}");
    let expect = [
        ("offline", "offline"),
        ("degraded", "degraded"),
        ("no-window", &format!("no window captured under v{} yet", v1 + 1) as &str),
        ("hole", "no evidence from"),
        ("gap", "map-full gap"),
    ];
    for (host, reason) in expect {
        assert!(reasons[host].contains(reason), "{host}: {reasons:#?}");
    }
    assert!(reasons["gap"].contains("count 7"), "{reasons:#?}");
    assert_eq!(reasons["good"].as_str(), "", "{reasons:#?}");
    // The good host alone is SAFE.
    let good = Scope::Ids(vec![hosts[5].id]);
    assert_eq!(gate::judge(plane.pool(), &good, &params(base, end)).await.unwrap().outcome, Outcome::Safe);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdict_replays_older_versions() {
    let plane = Plane::start().await;
    plane.register("web-1", &["app=web"], WEB).await;
    allow_db_from(&plane, "web").await;
    let host = Host::start(&plane, "db-1").await;
    set_mode(&plane, db(), 1, Mode::Simulation).await;
    let vn = synced(&plane, &[&host]).await;
    let base = now_ms() - 60 * SECOND;
    host.deliver(base, base + 5 * SECOND, &[WEB], &[]).await;

    // A peer-only change (a second web host): version N+1 with the same rules.
    plane.register("web-2", &["app=web"], "10.9.0.11").await;
    let vn1 = synced(&plane, &[&host]).await;
    assert_eq!(vn1, vn + 1);
    let range = params(base, base + 10 * SECOND);
    let verdict = gate::judge(plane.pool(), &db(), &range).await.unwrap();
    assert!(
        verdict.summary().contains(&format!("no window captured under v{vn1} yet")),
        "{}",
        verdict.summary()
    );
    host.deliver(base + 5 * SECOND, base + 10 * SECOND, &[WEB], &[]).await;
    let verdict = gate::judge(plane.pool(), &db(), &range).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Safe, "{}", verdict.summary());
    let e = &verdict.workloads[0].evidence;
    assert_eq!(
        (e.native_windows, e.replayed_windows, e.replayed_from.clone()),
        (1, 1, BTreeSet::from([vn as u64]))
    );

    // A change to N+2 that no longer accepts web: the flow recorded under N is found by replay.
    innerwall_control_plane::foresight::commit(
        plane.pool(),
        "test",
        "ruleset.delete",
        "db-from-web",
        async |c| {
            authoring::delete_ruleset(c, "db-from-web", 1).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    let vn2 = synced(&plane, &[&host]).await;
    host.deliver(base + 10 * SECOND, base + 15 * SECOND, &[], &[]).await;
    let verdict = gate::judge(plane.pool(), &db(), &params(base, base + 15 * SECOND)).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Unsafe, "{}", verdict.summary());
    let summary = verdict.summary();
    let found = format!("{WEB} {{\"app\":\"web\"}} to tcp/5432 (by replay, captured under v{vn},v{vn1})");
    assert!(summary.contains(&found), "{summary}");
    assert_eq!(verdict.workloads[0].latest_version, Some(vn2 as u64));
}
