//! Evidence only for versions that were real (FLOW-5, FLOW-7): an agent running the real sync
//! loop installs versions (its acks record them), and windows uploaded with its own certificate
//! over the real telemetry connection are accepted only under a version it installed, within the
//! time it held it, in that version's mode, and not overlapping one already stored; a refused
//! window is counted by reason, becomes an UPLOAD_REFUSED gap on the agent and never reaches a
//! verdict.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use innerwall_agent::daemon;
use innerwall_agent::evidence::flows::{Counters, FlowKey, Window};
use innerwall_agent::evidence::telemetry::Queue;
use innerwall_agent::identity::connect::{RunConfig, connect};
use innerwall_agent::sync::Agent as Shared;
use innerwall_control_plane::gate::{self, Params, Scope};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_control_plane::testing;
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::{FlowWindow, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol};
use innerwall_wire::proto;

use crate::plane::{Plane, TestStore};

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A window over `[start, end)` built with the agent's own window code under `shared`'s
/// current policy, with one tcp/5432 flow.
fn own_window(shared: &Shared<TestStore>, start: i64, end: i64) -> FlowWindow {
    let mut window = Window::open(start, shared.enforcer.current(), 100);
    let key = FlowKey {
        src: "10.9.0.7".parse().unwrap(),
        dst: "10.1.0.5".parse().unwrap(),
        dst_port: 5432,
        protocol: Protocol::Tcp,
    };
    let counters =
        Counters { packets: 2, bytes: 120, new_connections: 1, first_seen_ms: start, last_seen_ms: end };
    window.add(key, counters, end);
    window.close(end)
}

/// The same window with another id, version, mode or times.
fn claiming(w: &FlowWindow, version: u64, mode: Mode, start_ms: i64, end_ms: i64) -> FlowWindow {
    FlowWindow { id: uuid::Uuid::new_v4(), policy_version: version, mode, start_ms, end_ms, ..w.clone() }
}

async fn upload(
    config: &RunConfig,
    window: &FlowWindow,
) -> Result<proto::ReportFlowsResponse, tonic::Status> {
    proto::telemetry_service_client::TelemetryServiceClient::new(connect(config).await.unwrap())
        .report_flows(proto::ReportFlowsRequest { window: Some(proto::FlowWindow::from(window)) })
        .await
        .map(tonic::Response::into_inner)
}

/// When the host's install of `version` was recorded: (installed_from, installed_by) in ms.
async fn install(plane: &Plane, id: WorkloadId, version: i64) -> (i64, i64) {
    let (from, by): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT installed_from, installed_by FROM workload_installs WHERE workload_id = $1 AND version = $2",
    )
    .bind(id.uuid())
    .bind(version)
    .fetch_one(plane.pool())
    .await
    .unwrap();
    (from.timestamp_millis(), by.timestamp_millis())
}

/// `innerwall_flow_windows_refused_total` for `reason` in the replica's metrics.
fn refused(plane: &Plane, reason: &str) -> u64 {
    let text = plane.running.as_ref().unwrap().metrics.encode();
    let label = format!("reason=\"{reason}\"");
    text.lines()
        .find(|l| l.starts_with("innerwall_flow_windows_refused_total{") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_need_a_version_the_host_installed() {
    const SKEW: i64 = 1_000;
    let mut plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    plane.flow_bounds.max_ahead = chrono::Duration::milliseconds(SKEW);
    plane.up().await;
    let (id, config) = plane.enroll("db-1", &["app=db"]).await;
    let shared = Arc::new(Shared::new(TestStore::default()));
    let (c, e) = (config.clone(), shared.clone());
    let agent = tokio::spawn(async move { daemon::hold_stream(&c, e).await.unwrap() });
    let v1 = plane.status(id).await.2.expect("a rendered policy");
    plane.wait_synced(id, v1).await;
    let (v1_from, _) = install(&plane, id, v1).await;

    // A window the agent captures under v1 and still holds when v2 is installed (a partition).
    let captured = now_ms();
    let buffered = own_window(&shared, captured.max(v1_from), captured.max(v1_from) + 1);
    testing::admit(plane.pool(), "db-in", ("app", "db"), ("app", "web"), "tcp:5432").await.unwrap();
    let v2 = plane.status(id).await.2.unwrap();
    assert!(v2 > v1);
    plane.wait_synced(id, v2).await;
    let (v2_from, v2_by) = install(&plane, id, v2).await;
    assert!(v1_from <= buffered.start_ms + SKEW && buffered.end_ms <= v2_by + SKEW);
    let mode = shared.enforcer.current().unwrap().mode();
    assert_eq!(mode, Mode::Visibility);

    // The agent's own windows are accepted: the buffered one under v1, uploaded after v2 was
    // installed, and one under v2.
    assert!(!upload(&config, &buffered).await.unwrap().duplicate, "buffered through the change to v2");
    let start = now_ms().max(v2_by);
    let current = own_window(&shared, start, start + 1);
    assert_eq!(current.policy_version, v2 as u64);
    assert_eq!(upload(&config, &current).await.unwrap().accepted_records, 1);
    assert!(upload(&config, &current).await.unwrap().duplicate, "a retry stays idempotent");

    // A window claiming v1 after v2 was installed needs the clock past v2's install.
    let after = v2_by + SKEW + 10;
    while now_ms() <= after {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let hostile = [
        ("version-unknown", claiming(&current, v2 as u64 + 5, mode, current.end_ms, current.end_ms + 1)),
        (
            "version-not-installed",
            claiming(&current, v2 as u64, mode, v2_from - 10 * SKEW, v2_from - 9 * SKEW),
        ),
        ("version-not-installed", claiming(&current, v1 as u64, mode, after, after + 1)),
        (
            "mode-mismatch",
            claiming(&current, v2 as u64, Mode::Simulation, current.end_ms, current.end_ms + 1),
        ),
        ("overlap", claiming(&current, v2 as u64, mode, current.start_ms, current.end_ms)),
    ];
    for (reason, window) in &hostile {
        let err = upload(&config, window).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{reason}: {err:?}");
        assert!(
            err.message().contains(&format!("window refused: {reason}: ")),
            "{reason}: {}",
            err.message()
        );
    }
    for (reason, count) in
        [("version_unknown", 1), ("version_not_installed", 2), ("mode_mismatch", 1), ("overlap", 1)]
    {
        assert_eq!(refused(&plane, reason), count, "{reason}");
    }

    // Through the agent's queue a refusal becomes an UPLOAD_REFUSED gap on its next window.
    let queue = Queue::new(&config.state_dir, 10).unwrap();
    queue.push(hostile[0].1.clone()).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 0);
    let next_start = now_ms();
    queue.push(own_window(&shared, next_start, next_start + 1)).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 1);
    let gap: (i64, String) =
        sqlx::query_as("SELECT count, detail FROM flow_gaps WHERE workload_id = $1 AND kind = $2")
            .bind(id.uuid())
            .bind(GapKind::UploadRefused.code())
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert_eq!(gap.0, 1, "the refused window's one record");
    assert!(gap.1.contains("version-unknown"), "the control plane's reason: {gap:?}");

    // Only the agent's own windows are stored, and only they reach a verdict.
    let stored: Vec<i64> = sqlx::query_scalar(
        "SELECT policy_version FROM flow_windows WHERE workload_id = $1 ORDER BY window_start",
    )
    .bind(id.uuid())
    .fetch_all(plane.pool())
    .await
    .unwrap();
    assert_eq!(stored, [v1, v2, v2]);
    let range =
        Params { from_ms: v2_from - 20 * SKEW, to_ms: now_ms() + 2 * SKEW, min_duration_ms: 0, top_peers: 5 };
    let verdict = gate::judge(plane.pool(), &Scope::Ids(vec![id]), &range).await.unwrap();
    let evidence = &verdict.workloads[0].evidence;
    assert_eq!(
        (evidence.native_windows, evidence.replayed_windows, evidence.replayed_from.clone()),
        (2, 1, BTreeSet::from([v1 as u64])),
        "{}",
        verdict.summary()
    );
    agent.abort();
}
