//! Which versions a host installed (FLOW-5), against real Postgres and real mTLS, driven by a
//! scripted agent: an acknowledgement lost with its connection is recorded from the next
//! Hello's reported version, no later than the true install, so the agent's window under it is
//! accepted; until then such a window waits (UNAVAILABLE, not refused); a Hello claiming a
//! version the workload never had records nothing.

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use sqlx::PgPool;

use crate::enrollment::Plane;
use crate::sync::Scripted;

async fn installs(pool: &PgPool, id: WorkloadId) -> Vec<(i64, chrono::DateTime<chrono::Utc>)> {
    sqlx::query_as(
        "SELECT version, installed_from FROM workload_installs WHERE workload_id = $1 ORDER BY version",
    )
    .bind(id.uuid())
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_lost_ack_is_recorded_from_the_next_hello() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    let channel = plane.mutual(&cert, &key).await.unwrap();
    let mut agent = Scripted::open(channel.clone(), 0).await;
    assert_eq!(agent.update().await, ("snapshot", 1, 1));
    agent.ack(1, true, "").await;
    crate::eventually("v1 installed", async || installs(pool, id).await.len() == 1).await;

    // v2 arrives and the agent installs it, but its connection is lost before the ack.
    innerwall_control_plane::testing::add_web_port(pool, 0).await.unwrap();
    assert_eq!(agent.update().await, ("delta", 1, 2));
    let received: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(pool).await.unwrap();
    drop(agent);
    let start = received.timestamp_millis();
    let window = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + 1,
        policy_version: 2,
        mode: proto::EnforcementMode::Visibility.into(),
        records: vec![],
        gaps: vec![],
    };
    let mut telemetry = proto::telemetry_service_client::TelemetryServiceClient::new(channel.clone());
    let upload = async |t: &mut proto::telemetry_service_client::TelemetryServiceClient<_>| {
        t.report_flows(proto::ReportFlowsRequest { window: Some(window.clone()) }).await
    };
    let err = upload(&mut telemetry).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "the window waits for the Hello: {err:?}");
    assert!(err.message().contains("version-pending"), "{}", err.message());

    // The next stream's Hello says v2 is applied: recorded from v2's render, no later than the
    // true install (the moment the delta arrived).
    let mut again = Scripted::open(channel.clone(), 2).await;
    let recorded = installs(pool, id).await;
    assert_eq!(recorded.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2]);
    assert!(recorded[1].1 <= received, "{:?} is after the install at {received}", recorded[1].1);
    let stored = upload(&mut telemetry).await.unwrap().into_inner();
    assert!(!stored.duplicate, "the agent's own window is accepted once the Hello reported v2");
    assert_eq!(again.update().await, ("snapshot", 2, 2));
    drop(again);

    // A Hello claiming a version the workload never had records nothing.
    let _hostile = Scripted::open(channel, 7).await;
    assert_eq!(installs(pool, id).await.len(), 2);
}
