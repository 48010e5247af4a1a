//! How a real agent reacts when the control plane refuses it for rate (REL-1): a stream open
//! over the bound ends the session as throttled, with the wait the control plane named (the
//! daemon waits at least that long, `backoff::after_refusal`), and an upload over the bound
//! leaves the window and those behind it queued, never given up as UPLOAD_REFUSED.

use std::sync::Arc;
use std::time::Duration;

use innerwall_agent::evidence::telemetry::Queue;
use innerwall_agent::identity::connect::connect;
use innerwall_agent::sync::{self, Agent as Shared, SessionEnd, SessionStats};
use innerwall_control_plane::rate::AgentBounds;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::flows::FlowWindow;

use crate::plane::{Plane, TestStore};

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_agent_keeps_its_windows_and_waits() {
    let bounds = AgentBounds { uploads_per_minute: 2, hellos_per_minute: 1, ..AgentBounds::default() };
    let mut plane =
        Plane::create(Duration::from_secs(3600), GatewayConfig { bounds, ..Default::default() }).await;
    plane.up().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let shared = Arc::new(Shared::new(TestStore::default()));

    // The one stream open a minute allows: SYNCED.
    let channel = connect(&config).await.unwrap();
    let first = tokio::spawn({
        let shared = shared.clone();
        async move { sync::session(channel, shared, &mut SessionStats::default()).await }
    });
    plane.wait_synced(id, 1).await;

    // A second open is refused for rate: throttled, naming the bound and the wait.
    let mut stats = SessionStats::default();
    let end = sync::session(connect(&config).await.unwrap(), shared.clone(), &mut stats).await;
    let SessionEnd::Throttled(reason, wait) = end else { panic!("not throttled: {end:?}") };
    assert!(reason.contains("--agent-hellos-per-minute"), "{reason}");
    assert!(wait >= Duration::from_secs(1) && wait <= Duration::from_secs(60), "{wait:?}");
    assert!(!stats.established);
    assert!(!first.is_finished(), "the refused open superseded nothing");

    // Five windows queued after the install; two are stored, the third is refused for rate.
    let queue = Queue::new(&config.state_dir, 10).unwrap();
    let (version, mode) = shared.enforcer.judged_as();
    let start = now_ms() + 1_000;
    for n in 0..5 {
        let window = FlowWindow {
            id: uuid::Uuid::new_v4(),
            start_ms: start + n * 1_000,
            end_ms: start + (n + 1) * 1_000,
            policy_version: version,
            mode,
            records: vec![],
            gaps: vec![],
            staged_set: None,
        };
        queue.push(window).unwrap();
    }
    let refused = queue.upload(connect(&config).await.unwrap()).await.unwrap_err();
    // retry_after reads a wait only from a RESOURCE_EXHAUSTED status.
    assert!(innerwall_wire::backoff::retry_after(&refused).is_some(), "{refused:?}");
    assert!(refused.message().contains("--agent-uploads-per-minute"), "{refused:?}");
    assert_eq!(queue.len(), 3, "the refused window and those behind it stay queued");
    assert!(
        !config.state_dir.join("telemetry").join("pending.gaps").exists(),
        "nothing was given up as UPLOAD_REFUSED"
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM flow_windows WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert_eq!(stored, 2);
    first.abort();
}
