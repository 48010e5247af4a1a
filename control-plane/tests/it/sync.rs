//! The gateway and the NOTIFY bridge against real Postgres and real mTLS (SYNC-2..SYNC-11),
//! driven by a scripted agent that sends exactly what each test needs.

use std::time::Duration;

use innerwall_control_plane::error::Error;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::store;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto::{self, sync_request, sync_response};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::addresses::inventory;
use crate::enrollment::Plane;
use crate::eventually;

/// A scripted agent on one stream.
pub struct Scripted {
    pub tx: mpsc::Sender<proto::SyncRequest>,
    pub inbound: tonic::Streaming<proto::SyncResponse>,
}

impl Scripted {
    pub async fn open(channel: Channel, applied: u64) -> Scripted {
        let (tx, rx) = mpsc::channel(16);
        let hello = proto::Hello { applied_version: applied, ..Default::default() };
        tx.send(proto::SyncRequest { msg: Some(sync_request::Msg::Hello(hello)) }).await.unwrap();
        let mut client = proto::agent_service_client::AgentServiceClient::new(channel);
        let inbound =
            client.sync(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        let mut s = Scripted { tx, inbound };
        assert!(matches!(s.next().await, Some(sync_response::Msg::HelloAck(_))));
        s
    }

    pub async fn next(&mut self) -> Option<sync_response::Msg> {
        tokio::time::timeout(Duration::from_secs(15), self.inbound.message())
            .await
            .expect("nothing arrived within 15 s")
            .ok()
            .flatten()
            .and_then(|r| r.msg)
    }

    /// The next update as ("snapshot" | "delta", from, to).
    pub async fn update(&mut self) -> (&'static str, u64, u64) {
        match self.next().await {
            Some(sync_response::Msg::Snapshot(s)) => {
                let v = s.policy.unwrap().version;
                ("snapshot", v, v)
            }
            Some(sync_response::Msg::Delta(d)) => ("delta", d.from_version, d.to_version),
            other => panic!("expected an update, got {other:?}"),
        }
    }

    pub async fn ack(&self, version: u64, applied: bool, detail: &str) {
        let status = if applied { proto::AckStatus::Applied } else { proto::AckStatus::Failed };
        let ack = proto::PolicyAck { version, status: status.into(), detail: detail.into() };
        self.tx.send(proto::SyncRequest { msg: Some(sync_request::Msg::Ack(ack)) }).await.unwrap();
    }
}

async fn status(pool: &PgPool, id: WorkloadId) -> (String, i64, Option<i64>, String) {
    let s = store::sync_status(&mut pool.acquire().await.unwrap(), Some(id)).await.unwrap().remove(0);
    (s.state.0.name().to_owned(), s.applied_version, s.latest_version, s.detail)
}

/// Polls until the workload's stored state is `want` (the gateway records asynchronously).
async fn wait_state(pool: &PgPool, id: WorkloadId, want: &str) -> (String, i64, Option<i64>, String) {
    for _ in 0..150 {
        let s = status(pool, id).await;
        if s.0 == want {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("workload never reached {want}: {:?}", status(pool, id).await);
}

/// One more port for every `app=web` workload: one new version each.
async fn bump(pool: &PgPool, n: u16) {
    innerwall_control_plane::testing::add_web_port(pool, n).await.unwrap();
}

/// An enrolled agent whose stream carried its first snapshot (v1) and is SYNCED.
async fn synced(plane: &Plane) -> (WorkloadId, Scripted) {
    let (id, _, _, agent) = synced_with_credential(plane).await;
    (id, agent)
}

/// [`synced`], with the agent's certificate and key (PEM) for a second connection.
async fn synced_with_credential(plane: &Plane) -> (WorkloadId, String, String, Scripted) {
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    let mut agent = Scripted::open(plane.mutual(&cert, &key).await.unwrap(), 0).await;
    assert_eq!(agent.update().await, ("snapshot", 1, 1));
    agent.ack(1, true, "").await;
    wait_state(&plane.db.pool, id, "SYNCED").await;
    (id, cert, key, agent)
}

async fn enrolled(plane: &Plane) -> (WorkloadId, Channel) {
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    (id, plane.mutual(&cert, &key).await.unwrap())
}

#[tokio::test]
async fn recovery_snapshot_does_not_loop() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, mut agent) = synced(&plane).await;

    // Three versions pipelined without acks; the first fails, the two in flight behind it too.
    for n in 0..3 {
        bump(pool, n).await;
        assert_eq!(agent.update().await, ("delta", 1 + u64::from(n), 2 + u64::from(n)));
    }
    agent.ack(2, false, "nft refused the batch").await;
    assert_eq!(agent.update().await, ("snapshot", 4, 4), "one recovery snapshot of the latest");
    let (state, _, _, detail) = wait_state(pool, id, "DEGRADED").await;
    assert_eq!((state.as_str(), detail.as_str()), ("DEGRADED", "nft refused the batch"));
    agent.ack(3, false, "base mismatch").await;
    agent.ack(4, false, "base mismatch").await;
    agent.ack(4, true, "").await;
    assert_eq!(wait_state(pool, id, "SYNCED").await, ("SYNCED".into(), 4, Some(4), String::new()));
    // The marker: one more version. A snapshot earned by a stale failure would come before it.
    bump(pool, 3).await;
    assert_eq!(agent.update().await, ("delta", 4, 5), "stale failures must not earn more snapshots");
    let failed_at: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_apply_failed_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(failed_at.is_some(), "last_apply_failed_at is kept after recovery");
}

#[tokio::test]
async fn half_open_stream_goes_offline() {
    let config = GatewayConfig { heartbeat: Duration::from_secs(1), ..Default::default() };
    let plane = Plane::start(config).await;
    let pool = &plane.db.pool;
    let (id, agent) = synced(&plane).await;
    // The agent now neither reads nor heartbeats: the server must not keep it SYNCED forever.
    // The reason names the liveness bound that ended it (not a sweep, not the agent leaving).
    let (_, _, _, detail) = wait_state(pool, id, "OFFLINE").await;
    assert!(detail.contains("silent for three heartbeat intervals"), "{detail}");
    drop(agent);
}

#[tokio::test]
async fn resend_snapshot() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, channel) = enrolled(&plane).await;
    let mut agent = Scripted::open(channel.clone(), 0).await;
    agent.update().await;
    agent.ack(1, true, "").await;
    wait_state(pool, id, "SYNCED").await;
    let before = authoring::request_snapshot(pool, "test", id).await.unwrap().last_snapshot_sent_at.unwrap();

    // The replica holding the stream tells the agent to reconnect …
    assert!(matches!(
        agent.next().await,
        Some(sync_response::Msg::Directive(proto::Directive {
            directive: Some(proto::directive::Directive::Reconnect(_))
        }))
    ));
    // … and the new stream begins with a snapshot, which advances last_snapshot_sent_at.
    let mut again = Scripted::open(channel, 1).await;
    assert_eq!(again.update().await, ("snapshot", 1, 1));
    let after = authoring::request_snapshot(pool, "test", id).await.unwrap().last_snapshot_sent_at.unwrap();
    assert!(after > before, "{after} !> {before}");

    // An OFFLINE workload is refused with agent-offline and its last-seen time.
    drop(again);
    wait_state(pool, id, "OFFLINE").await;
    let err = authoring::request_snapshot(pool, "test", id).await.unwrap_err();
    assert!(matches!(err, Error::AgentOffline { .. }), "{err}");
    assert!(
        err.to_string().starts_with("agent-offline") && err.to_string().contains("last seen 20"),
        "{err}"
    );
}

/// Issue 26 item 6 through the library call the CLI and the API share: resends are bounded per
/// actor and for everyone (refused naming the flag, nothing written), and each actor's
/// repeat-run is one audit row with its count.
#[tokio::test]
async fn resend_snapshot_is_rate_limited_and_coalesced() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, channel) = enrolled(&plane).await;
    let mut agent = Scripted::open(channel.clone(), 0).await;
    agent.update().await;
    agent.ack(1, true, "").await;
    wait_state(pool, id, "SYNCED").await;
    let bounds =
        authoring::ExpensiveBounds { per_actor_per_minute: 2, overall_per_minute: 3, ..Default::default() };
    // A resend taken tells the agent to reconnect; the agent does, and its new stream begins
    // with a snapshot (so the next resend finds a stream to act on).
    let taken = async |agent: &mut Scripted, actor: &str| {
        authoring::request_snapshot_bounded(pool, actor, id, &bounds).await.unwrap();
        assert!(matches!(
            agent.next().await,
            Some(sync_response::Msg::Directive(proto::Directive {
                directive: Some(proto::directive::Directive::Reconnect(_))
            }))
        ));
        *agent = Scripted::open(channel.clone(), 1).await;
        assert_eq!(agent.update().await.0, "snapshot");
    };
    taken(&mut agent, "ann").await;
    taken(&mut agent, "ann").await;
    let err = authoring::request_snapshot_bounded(pool, "ann", id, &bounds).await.unwrap_err();
    assert!(matches!(err, Error::RateLimited { bound: "--api-expensive-per-minute", .. }), "{err}");
    taken(&mut agent, "bob").await;
    let err = authoring::request_snapshot_bounded(pool, "bob", id, &bounds).await.unwrap_err();
    assert!(matches!(err, Error::RateLimited { bound: "--api-expensive-overall-per-minute", .. }), "{err}");
    assert!(err.to_string().contains("retry after"), "{err}");
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT actor, count FROM audit_log WHERE action = 'workload.resend-snapshot' ORDER BY actor",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [("ann".to_owned(), 2), ("bob".to_owned(), 1)],
        "one row per repeat-run, refusals not counted"
    );
    // A render is bounded apart: its own buckets.
    authoring::render_bounded(pool, "ann", &bounds).await.unwrap();
}

/// A second replica of `a`: same database and CA, its own listener and LISTEN connection.
async fn second_replica(a: &Plane) -> innerwall_control_plane::service::Running {
    innerwall_control_plane::service::start(
        innerwall_control_plane::postgres::Pools::shared(a.db.pool.clone()),
        a.signer.clone(),
        innerwall_control_plane::testing::loopback_service(),
    )
    .await
    .unwrap()
}

/// An mTLS channel to replica `b` with the given credential.
async fn mutual_to(
    a: &Plane,
    b: &innerwall_control_plane::service::Running,
    cert: &str,
    key: &str,
) -> Channel {
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(a.ca_pem()))
        .identity(tonic::transport::Identity::from_pem(cert, key))
        .domain_name("localhost");
    tonic::transport::Endpoint::from_shared(format!("https://localhost:{}", b.local_addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// The agent opened a second stream on the same replica: the first ends at once with ABORTED
/// "superseded" (never as a dropped stream, which could read as the agent going offline), the
/// workload stays SYNCED, and the new stream carries the updates. Twice, so the second
/// supersede is checked too.
#[tokio::test]
async fn a_newer_stream_on_the_same_replica_supersedes_the_old_one() {
    let mut a = Plane::start(GatewayConfig::default()).await;
    let pool = a.db.pool.clone();
    let (id, cert, key, mut old) = synced_with_credential(&a).await;
    for round in 0..2u64 {
        let mut new = Scripted::open(a.mutual(&cert, &key).await.unwrap(), 1 + round).await;
        let ended = match tokio::time::timeout(Duration::from_secs(15), old.inbound.message()).await {
            Ok(Err(status)) => status,
            other => panic!("round {round}: the superseded stream did not end with a status: {other:?}"),
        };
        assert_eq!(ended.code(), tonic::Code::Aborted, "round {round}: {ended:?}");
        assert!(ended.message().contains("superseded by a newer stream"), "round {round}: {ended:?}");
        assert_eq!(
            new.update().await,
            ("snapshot", 1 + round, 1 + round),
            "round {round}: snapshot on connect"
        );
        new.ack(1 + round, true, "").await;
        bump(&pool, round as u16).await;
        assert_eq!(new.update().await, ("delta", 1 + round, 2 + round), "round {round}");
        new.ack(2 + round, true, "").await;
        let (state, applied, ..) = wait_state(&pool, id, "SYNCED").await;
        assert_eq!(applied, 2 + round as i64, "round {round}");
        assert_eq!(state, "SYNCED", "round {round}: a superseded stream must not mark the workload offline");
        old = new;
    }
    assert_eq!(a.running.as_ref().unwrap().gateway.stream_count(), 1);
    a.running.take().unwrap().stop().await.unwrap();
}

/// The agent reconnected to another replica while the first still holds its old stream: the
/// old stream ends (ABORTED, superseded) at its first state write instead of speaking for the
/// identity, and the new one carries the updates. (A delta is sent with nothing written first,
/// so the old stream's first write is the ack of the delta it was sent too.)
#[tokio::test]
async fn stale_stream_on_another_replica_ends() {
    let mut a = Plane::start(GatewayConfig::default()).await;
    let b = second_replica(&a).await;
    let pool = a.db.pool.clone();
    let (id, cert, key, mut old) = synced_with_credential(&a).await;

    let mut new = Scripted::open(mutual_to(&a, &b, &cert, &key).await, 1).await;
    assert_eq!(new.update().await, ("snapshot", 1, 1), "snapshot on connect");
    new.ack(1, true, "").await;
    bump(&pool, 0).await;
    assert_eq!(new.update().await, ("delta", 1, 2));
    new.ack(2, true, "").await;
    assert_eq!(old.update().await, ("delta", 1, 2), "the old stream knows of no newer one yet");
    old.ack(2, true, "").await;
    let ended = match tokio::time::timeout(Duration::from_secs(15), old.inbound.message()).await {
        Ok(Err(status)) => status,
        other => panic!("the stale stream did not end with a status: {other:?}"),
    };
    assert_eq!(ended.code(), tonic::Code::Aborted, "{ended:?}");
    assert!(ended.message().contains("superseded"), "{ended:?}");
    assert_eq!(wait_state(&pool, id, "SYNCED").await.1, 2);
    assert_eq!(a.running.as_ref().unwrap().gateway.stream_count(), 0);
    assert_eq!(b.gateway.stream_count(), 1);
    b.stop().await.unwrap();
    a.running.take().unwrap().stop().await.unwrap();
}

// Several threads: the test blocks in CLI calls while the replica it started runs its tasks
// (on one thread, a task in the middle of a transaction would hold its locks until the call ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas() {
    let mut a = Plane::start(GatewayConfig::default()).await;
    // A second replica: same database and CA, its own listener and LISTEN connection.
    let b = second_replica(&a).await;
    let pool = a.db.pool.clone();
    let (id1, ch1) = enrolled(&a).await;
    let token = a.mint(&["app=web"], None).await;
    let (id2, cert2, key2) = a.enroll(&token).await.unwrap();
    // Point the second agent at replica B.
    let ch2 = mutual_to(&a, &b, &cert2, &key2).await;
    let mut agent1 = Scripted::open(ch1, 0).await;
    let mut agent2 = Scripted::open(ch2, 0).await;
    for agent in [&mut agent1, &mut agent2] {
        agent.update().await;
        agent.ack(1, true, "").await;
    }
    assert_eq!((a.running.as_ref().unwrap().gateway.stream_count(), b.gateway.stream_count()), (1, 1));

    // A change made by a separate process (the CLI) reaches each agent from its own replica.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .args(["--database-url", &a.db.url, "service", "create", "web", "--entry", "tcp:443"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let rs = "name: web\nscope: {app: [web]}\nrules:\n- name: r\n  peers: [{cidr: 10.0.0.0/8}]\n  services: [web]\n";
    let file = std::env::temp_dir().join(format!("iw-two-{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&file, rs).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .args(["--database-url", &a.db.url, "ruleset", "create", "-f"])
        .arg(&file)
        .output()
        .unwrap();
    std::fs::remove_file(&file).ok();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for agent in [&mut agent1, &mut agent2] {
        assert_eq!(agent.update().await, ("delta", 1, 2));
        agent.ack(2, true, "").await;
    }
    // The marker: one more version. A second update for v2 on either stream would come first.
    bump(&pool, 0).await;
    for agent in [&mut agent1, &mut agent2] {
        assert_eq!(agent.update().await, ("delta", 2, 3), "exactly one delta per version");
        agent.ack(3, true, "").await;
    }
    for id in [id1, id2] {
        assert_eq!(wait_state(&pool, id, "SYNCED").await.1, 3);
    }
    b.stop().await.unwrap();
    a.running.take().unwrap().stop().await.unwrap();
}

/// One sample of this replica's metrics, e.g. `innerwall_notify_bridge_reconnects_total`.
fn sample(plane: &Plane, series: &str) -> Option<f64> {
    let text = plane.running.as_ref().unwrap().metrics.encode();
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// A change committed while the LISTEN connection is held down sends a notice nobody hears;
/// the bridge's reconnect (counted) reconciles the held stream, which then carries it.
#[tokio::test]
async fn listener_loss_reconciles() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, mut agent) = synced(&plane).await;
    let reconnects = "innerwall_notify_bridge_reconnects_total";
    assert_eq!(sample(&plane, reconnects), Some(0.0));
    assert_eq!(sample(&plane, "innerwall_notify_bridge_connected"), Some(1.0));

    // A connection of the test's own, opened before the database stops taking new ones: the
    // bridge cannot LISTEN again until the test allows connections back.
    let side = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect(&plane.db.url)
        .await
        .unwrap();
    // A database's connections are switched off from another database.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&innerwall_control_plane::postgres::with_database(&plane.db.url, "postgres"))
        .await
        .unwrap();
    let database = innerwall_control_plane::postgres::quote_ident(&plane.db.name);
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {database} ALLOW_CONNECTIONS false")))
        .execute(&admin)
        .await
        .unwrap();
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND query ILIKE 'LISTEN%' AND pid <> pg_backend_pid()",
    )
    .fetch_all(&side)
    .await
    .unwrap();
    assert_eq!(killed, [true], "exactly one listener connection per replica");
    eventually("the bridge noticed its loss", async || {
        sample(&plane, "innerwall_notify_bridge_connected") == Some(0.0)
    })
    .await;
    // Nobody listens now: this change's notice is lost.
    let listeners: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_one(&side)
    .await
    .unwrap();
    assert_eq!(listeners, 0, "the listener is held down");
    bump(&side, 0).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {database} ALLOW_CONNECTIONS true")))
        .execute(&admin)
        .await
        .unwrap();

    // The bridge reconnects once and reconciles: the stream is brought up to date.
    eventually("the bridge reconnected", async || sample(&plane, reconnects) == Some(1.0)).await;
    assert_eq!(agent.update().await, ("delta", 1, 2));
    agent.ack(2, true, "").await;
    assert_eq!(wait_state(pool, id, "SYNCED").await.1, 2);
    assert_eq!(sample(&plane, reconnects), Some(1.0), "one reconnect");
}

/// A workload with no persisted policy when its stream opens is rendered then (POL-6), and the
/// repair is audited with the version it wrote.
#[tokio::test]
async fn repair_render_on_stream_open_is_audited() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, channel) = enrolled(&plane).await;
    // The workload has no policy at all, as one registered without a render would be.
    for table in ["workload_policies", "workload_policy_history"] {
        let deleted = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table} WHERE workload_id = $1")))
            .bind(id.uuid())
            .execute(pool)
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(deleted, 1, "{table}");
    }
    let repairs = async || -> Vec<(String, serde_json::Value, serde_json::Value)> {
        sqlx::query_as(
            "SELECT actor, detail, workload_versions FROM audit_log WHERE action = 'policy.repair-render' ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    };
    assert!(repairs().await.is_empty());

    let mut agent = Scripted::open(channel.clone(), 0).await;
    let (kind, _, version) = agent.update().await;
    assert_eq!(kind, "snapshot");
    let stored: i64 = sqlx::query_scalar("SELECT version FROM workload_policies WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(stored as u64, version, "the snapshot is the repaired, persisted policy");
    let audited = repairs().await;
    assert_eq!(audited.len(), 1, "{audited:?}");
    let (actor, detail, versions) = &audited[0];
    assert_eq!(actor, &format!("workload:{id}"));
    assert_eq!(detail["reason"], "no persisted policy when its stream opened");
    assert_eq!(versions[id.to_string()], version, "{versions}");

    // The second stream finds the policy persisted: no second repair.
    agent.ack(version, true, "").await;
    wait_state(pool, id, "SYNCED").await;
    drop(agent);
    let mut again = Scripted::open(channel, version).await;
    assert_eq!(again.update().await, ("snapshot", version, version));
    assert_eq!(repairs().await.len(), 1, "a persisted policy needs no repair");
}

/// `count` peer addresses, none adjacent to another, in `10.<block>.0.0/16`.
fn scattered(block: u8, count: usize) -> std::collections::BTreeSet<innerwall_wire::policy::Cidr> {
    (0..count)
        .map(|i| {
            let text = format!("10.{block}.{}.{}/32", i / 120, 2 * (i % 120) + 2);
            innerwall_wire::policy::Cidr::parse(&text).unwrap()
        })
        .collect()
}

/// SYNC-11: an agent that stops reading its stream slows only itself. Every commit reaches the
/// other agent, which applies it, while the stalled stream's queue is full; what the stalled
/// agent then reads is coalesced: fewer updates than versions, one delta spanning several.
#[tokio::test]
async fn slow_agent_does_not_slow_the_others() {
    use innerwall_control_plane::policy::spec::{
        AddressGroupSpec, PeerSpec, RuleSpec, RulesetSpec, ServiceSpec,
    };

    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    // The stalled agent's connection announces a small HTTP/2 window, so its stream backs up
    // after a few updates instead of buffering megabytes in the client.
    let token = plane.mint(&["app=web"], None).await;
    let (slow_id, cert, key) = plane.enroll(&token).await.unwrap();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(plane.ca_pem()))
        .identity(tonic::transport::Identity::from_pem(&cert, &key))
        .domain_name("localhost");
    let narrow = tonic::transport::Endpoint::from_shared(format!("https://{}", plane.addr()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect()
        .await
        .unwrap();
    let mut slow = Scripted::open(narrow, 0).await;
    assert_eq!(slow.update().await, ("snapshot", 1, 1));
    slow.ack(1, true, "").await;
    wait_state(pool, slow_id, "SYNCED").await;
    let (fast_id, mut fast) = synced(&plane).await;

    // Each change swaps a group of 4,000 peers for another: every delta removes and adds 4,000
    // addresses (about 110 KB), so a handful fill the stalled stream's window and queue.
    let group = |n: usize| AddressGroupSpec {
        name: "peers".into(),
        description: String::new(),
        cidrs: scattered(1 + (n % 2) as u8, 4_000),
    };
    innerwall_control_plane::foresight::commit(pool, "test", "ruleset.create", "big", async |c| {
        authoring::create_address_group(c, &group(0)).await?;
        let service = ServiceSpec {
            name: "big".into(),
            description: String::new(),
            entries: vec![innerwall_control_plane::policy::model::ServiceEntry::parse("tcp:443")?],
        };
        authoring::create_service(c, &service).await?;
        let ruleset = RulesetSpec {
            name: "big".into(),
            description: String::new(),
            enabled: true,
            scope: [("app".to_owned(), vec!["web".to_owned()])].into(),
            rules: vec![RuleSpec {
                name: "r".into(),
                description: String::new(),
                enabled: true,
                peers: vec![PeerSpec::address_group("peers")],
                services: vec!["big".into()],
            }],
        };
        authoring::create_ruleset(c, &ruleset).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    const CHANGES: usize = 30;
    for n in 1..=CHANGES {
        innerwall_control_plane::foresight::commit(
            pool,
            "test",
            "address-group.update",
            "peers",
            async |c| {
                authoring::update_address_group(c, &group(n), n as i64).await?;
                Ok(((), serde_json::json!({})))
            },
        )
        .await
        .unwrap();
    }
    let latest = status(pool, fast_id).await.2.unwrap() as u64;
    assert_eq!(latest, 2 + CHANGES as u64);

    // The reading agent applies up to the latest version while the other reads nothing.
    loop {
        let (_, _, to) = fast.update().await;
        fast.ack(to, true, "").await;
        if to == latest {
            break;
        }
    }
    assert_eq!(wait_state(pool, fast_id, "SYNCED").await.1, latest as i64);
    let (state, applied, _, _) = status(pool, slow_id).await;
    assert_eq!((state.as_str(), applied), ("PENDING", 1), "the stalled agent acked nothing");

    // The stalled agent reads at last: what waited in its queue, then one delta from there to
    // the latest version.
    let mut updates = Vec::new();
    loop {
        let update = slow.update().await;
        updates.push(update);
        if update.2 == latest {
            break;
        }
    }
    assert!(
        updates.len() < CHANGES + 1,
        "{} updates for {} versions: {updates:?}",
        updates.len(),
        CHANGES + 1
    );
    assert!(
        updates.iter().any(|&(kind, from, to)| kind == "delta" && to > from + 1),
        "no delta spans several versions: {updates:?}"
    );
    assert!(
        updates.windows(2).all(|w| w[0].2 == w[1].1),
        "each delta starts where the last ended: {updates:?}"
    );
    for &(_, _, to) in &updates {
        slow.ack(to, true, "").await;
    }
    assert_eq!(wait_state(pool, slow_id, "SYNCED").await.1, latest as i64);
}

// Several threads: the test blocks in CLI calls while the replica it started runs its tasks
// (on one thread, a task in the middle of a transaction would hold its locks until the call ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retire_closes_stream_refuses_renewal_and_leaves_renders() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let db_token = plane.mint(&["app=db"], None).await;
    // Its own address: one claimed by two workloads would be rendered for neither.
    let (db, _, _) = plane.enroll_reporting(&db_token, &["10.1.0.4/24"]).await.unwrap();
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    let channel = plane.mutual(&cert, &key).await.unwrap();
    let mut agent = Scripted::open(channel.clone(), 0).await;
    agent.update().await;
    // db admits app=web: the web workload's address is in db's peer set.
    let rs = "name: db\nscope: {app: [db]}\nrules:\n- name: r\n  peers: [{workloads: {app: [web]}}]\n  services: [pg]\n";
    let file = std::env::temp_dir().join(format!("iw-retire-{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&file, rs).unwrap();
    for args in [
        vec!["service", "create", "pg", "--entry", "tcp:5432"],
        vec!["ruleset", "create", "-f", file.to_str().unwrap()],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .args(["--database-url", &plane.db.url])
            .args(&args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::remove_file(&file).ok();
    let peers = async || {
        let (p, _) = store::persisted_policy(&mut pool.acquire().await.unwrap(), db).await.unwrap().unwrap();
        p.rules().flat_map(|r| r.peers().iter().map(ToString::to_string)).collect::<Vec<_>>()
    };
    assert_eq!(peers().await, ["10.1.0.5/32"]);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .args(["--database-url", &plane.db.url, "workload", "retire", &id.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(peers().await, Vec::<String>::new(), "a retired workload leaves every render");
    // The agent is told to enroll again, then the stream ends.
    match agent.next().await {
        Some(sync_response::Msg::Directive(proto::Directive {
            directive: Some(proto::directive::Directive::Reenroll(r)),
        })) => assert!(r.reason.contains("retired"), "{r:?}"),
        other => panic!("expected a Reenroll directive, got {other:?}"),
    }
    let end = tokio::time::timeout(Duration::from_secs(10), agent.inbound.message())
        .await
        .expect("stream not closed");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    let (_, csr) = crate::enrollment::key_and_csr();
    let err = proto::agent_service_client::AgentServiceClient::new(channel)
        .renew_credential(proto::RenewCredentialRequest { csr_pem: csr })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    assert!(err.message().contains("retired"), "{err}");
}

/// An inventory report without facts (the agent could not run `ip`) leaves the addresses as
/// they were: the next report with facts is the only address change recorded.
#[tokio::test]
async fn inventory_without_facts_changes_nothing() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, agent) = synced(&plane).await;
    agent.tx.send(inventory(None)).await.unwrap();
    // The marker: a report with facts, handled after the one without.
    agent.tx.send(inventory(Some(&["10.1.0.6/24"]))).await.unwrap();
    let addresses = || async {
        sqlx::query_scalar::<_, String>("SELECT host(address) FROM workload_addresses WHERE workload_id = $1")
            .bind(id.uuid())
            .fetch_all(pool)
            .await
            .unwrap()
    };
    eventually("the reported address is stored", async || addresses().await == ["10.1.0.6"]).await;
    let changes: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT detail FROM audit_log WHERE action = 'workload.inventory' AND subject = $1 ORDER BY id",
    )
    .bind(id.to_string())
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(changes, [serde_json::json!({"addresses": ["10.1.0.6"]})], "never an empty set in between");
}

/// A replica killed with SIGKILL never marks its streams OFFLINE; the surviving replica's
/// liveness sweep does, within three of the heartbeat intervals the dead one gave its agent.
// Several threads: the test blocks in CLI calls while the replica it started runs its tasks
// (on one thread, a task in the middle of a transaction would hold its locks until the call ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replica_workloads_go_offline() {
    use std::io::BufRead;

    let survivor =
        Plane::start(GatewayConfig { heartbeat: Duration::from_secs(1), ..Default::default() }).await;
    let pool = &survivor.db.pool;
    let mut doomed = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .args(["--database-url", &survivor.db.url, "--ca-dir"])
            .arg(&survivor.ca_dir)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--server-name",
                "localhost",
                "--heartbeat-interval",
                "1s",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(doomed.0.stderr.take().unwrap()).read_line(&mut line).unwrap();
    // "… listening on 127.0.0.1:PORT as localhost"
    let address = line.split("listening on ").nth(1).and_then(|rest| rest.split_whitespace().next());
    let port = address.and_then(|a| a.rsplit(':').next()).and_then(|p| p.parse::<u16>().ok());
    let Some(port) = port else { panic!("no listening line from the replica: {line:?}") };

    let token = survivor.mint(&["app=web"], None).await;
    let (id, cert, key) = survivor.enroll(&token).await.unwrap();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(survivor.ca_pem()))
        .identity(tonic::transport::Identity::from_pem(&cert, &key))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut agent = Scripted::open(channel, 0).await;
    assert_eq!(agent.update().await, ("snapshot", 1, 1));
    agent.ack(1, true, "").await;
    wait_state(pool, id, "SYNCED").await;

    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();
    let (state, _, _, detail) = wait_state(pool, id, "OFFLINE").await;
    assert_eq!(state, "OFFLINE");
    assert!(detail.contains("no heartbeat for three intervals"), "{detail}");
    drop(agent);
}

/// An open Sync stream ends when the certificate it was opened with expires, saying why, and
/// the workload goes OFFLINE with that reason; an agent that renewed reconnects with its new
/// certificate.
#[tokio::test]
async fn stream_ends_at_certificate_expiry() {
    let mut plane = Plane::start(GatewayConfig::default()).await;
    plane.cert_lifetime = Duration::from_secs(3);
    plane.restart(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, mut agent) = synced(&plane).await;
    let end = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            match agent.inbound.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the stream outlived its certificate");
    assert!(
        matches!(&end, Err(s) if s.code() == tonic::Code::Unauthenticated && s.message().contains("client certificate expired")),
        "{end:?}"
    );
    let (_, _, _, detail) = wait_state(pool, id, "OFFLINE").await;
    assert!(detail.contains("client certificate expired"), "{detail}");
}

/// A heartbeat's tamper reports are audited with their counts, at most as many as an agent may
/// send (the distinct details and one entry counting the rest) however many arrive, and
/// repeated reports within the hour make one audit row with a count (REL-1); a report after the
/// hour starts a new row.
#[tokio::test]
async fn repeated_tamper_reports_within_the_hour_make_one_row() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let (id, agent) = synced(&plane).await;
    let flood: Vec<proto::TamperEvent> = (0..40)
        .map(|n| proto::TamperEvent {
            detected_at_unix_ms: 1_000 + n,
            detail: format!("change {n}"),
            count: 3,
        })
        .collect();
    let heartbeat = |tamper_events| proto::SyncRequest {
        msg: Some(sync_request::Msg::Heartbeat(proto::Heartbeat { tamper_events, ..Default::default() })),
    };
    agent.tx.send(heartbeat(flood)).await.unwrap();
    // The marker: a later heartbeat's single report, counted after the flood's.
    let marker =
        |detail: &str| proto::TamperEvent { detected_at_unix_ms: 9, detail: detail.into(), count: 0 };
    agent.tx.send(heartbeat(vec![marker("marker")])).await.unwrap();
    let audited = async || -> Vec<(serde_json::Value, i64)> {
        sqlx::query_as(
            "SELECT detail, count FROM audit_log WHERE action = 'workload.tamper' AND subject = $1 ORDER BY id",
        )
        .bind(id.to_string())
        .fetch_all(pool)
        .await
        .unwrap()
    };
    eventually("the marker is counted", async || {
        audited().await.last().is_some_and(|(d, _)| d["latest"]["detail"] == "marker")
    })
    .await;
    let all = audited().await;
    assert_eq!(all.len(), 1, "one row for every report within the hour: {all:?}");
    let (detail, count) = &all[0];
    assert_eq!(detail["detail"], "change 0", "the row keeps the first report");
    let carried = innerwall_wire::sync::MAX_TAMPER_REPORTS as i64 + 1;
    assert_eq!(*count, carried * 3 + 1, "every change counted (a report without a count once)");

    // Once the row is older than the hour, the next report starts a new one.
    sqlx::query("UPDATE audit_log SET at = at - interval '61 minutes' WHERE action = 'workload.tamper' AND subject = $1")
        .bind(id.to_string())
        .execute(pool)
        .await
        .unwrap();
    agent.tx.send(heartbeat(vec![marker("later")])).await.unwrap();
    eventually("the later report is a row of its own", async || audited().await.len() == 2).await;
    let all = audited().await;
    assert_eq!((all[1].0["detail"].as_str(), all[1].1), (Some("later"), 1));
    assert_eq!(all[0].1, carried * 3 + 1, "the old row is left as it was");
}

/// A child process killed (SIGKILL) when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fresh database with 40 registered workloads, `<prefix>-0` … `<prefix>-39`, each with a policy.
async fn forty_workloads(prefix: &str) -> (innerwall_control_plane::testing::TestDatabase, Vec<WorkloadId>) {
    let db = innerwall_control_plane::testing::fresh_database().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(crate::publish::register(&db.pool, &format!("{prefix}-{i}"), &[], &[]).await);
    }
    (db, ids)
}

/// Heartbeats that arrive together are one statement (one commit: every row gets the same
/// `now()`), and a batch that fails is written beat by beat, so only the stream whose row is
/// stuck hears the failure.
#[tokio::test]
async fn heartbeats_are_written_in_batches_and_a_failed_batch_beat_by_beat() {
    use innerwall_control_plane::postgres::{Timeouts, pool_options_with};
    use innerwall_control_plane::sync::beats::{Beat, Beats};

    let (db, ids) = forty_workloads("beat").await;
    let short_locks = Timeouts {
        lock: Duration::from_millis(300),
        ..innerwall_control_plane::postgres::PoolConfig::STREAMS.timeouts
    };
    let pool = pool_options_with(short_locks).connect(&db.url).await.unwrap();
    let beats = Beats::start(pool);
    // Every beat at once, each from its own task as streams send them; results in `ids` order.
    let write_all = async |ids: &[WorkloadId]| {
        let tasks: Vec<_> = ids
            .iter()
            .map(|id| {
                let (beats, beat) = (beats.clone(), Beat { workload: id.uuid(), epoch: 0, state: 0 });
                tokio::spawn(async move { beats.write(beat).await })
            })
            .collect();
        let mut written = Vec::new();
        for task in tasks {
            written.push(task.await.unwrap());
        }
        written
    };

    let written = write_all(&ids).await;
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    let (rows, stamps): (i64, i64) = sqlx::query_as(
        "SELECT count(last_seen_at), count(DISTINCT last_seen_at) FROM workloads WHERE id = ANY($1)",
    )
    .bind(ids.iter().map(WorkloadId::uuid).collect::<Vec<_>>())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((rows, stamps), (40, 1), "40 heartbeats, one statement");

    // One row locked by another transaction: the batch times out on it, the other beats are
    // written alone, and only the locked one fails.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM workloads WHERE id = $1 FOR UPDATE")
        .bind(ids[0].uuid())
        .execute(&mut *holder)
        .await
        .unwrap();
    let written = write_all(&ids[..5]).await;
    holder.rollback().await.unwrap();
    assert!(written[0].is_err(), "the locked row's heartbeat must fail");
    assert!(written[1..].iter().all(Result::is_ok), "{written:?}");
    let stamps: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT last_seen_at) FROM workloads WHERE id = ANY($1)")
            .bind(ids[1..5].iter().map(WorkloadId::uuid).collect::<Vec<_>>())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stamps, 4, "written one by one after the batch failed");
}

/// A render moves thousands of streams at once, and each records its state at the ack (PERF-2). Records that arrive together are one transaction; every
/// stream hears whether its own was written (not when a newer stream of its identity took over);
/// the acks' installs commit with them; and a batch that fails is written record by record, so
/// only the stream whose write cannot be made hears the failure.
#[tokio::test]
async fn stream_state_records_share_a_transaction_and_each_hears_its_own() {
    use innerwall_control_plane::sync::records::Records;
    use innerwall_control_plane::sync::session::Record;
    use innerwall_wire::convert::WireEnum;
    use innerwall_wire::policy::Mode;
    use innerwall_wire::sync::SyncState;

    let (db, ids) = forty_workloads("record").await;
    let uuids: Vec<uuid::Uuid> = ids.iter().map(WorkloadId::uuid).collect();
    sqlx::query("UPDATE workloads SET stream_epoch = 7 WHERE id = ANY($1)")
        .bind(&uuids)
        .execute(&db.pool)
        .await
        .unwrap();
    let record = |state, applied: Option<u64>| Record {
        state,
        applied,
        detail: Some(String::new()),
        acked: applied.is_some(),
        failed: false,
        snapshot_sent: false,
        installed: applied.map(|_| Mode::Enforcement),
    };
    let records = Records::start(db.pool.clone());
    // Every record at once, each from its own task as streams write them; results in order.
    let write_all = async |rows: Vec<(WorkloadId, i64, Record)>| {
        let tasks: Vec<_> = rows
            .into_iter()
            .map(|(id, epoch, r)| {
                let records = records.clone();
                tokio::spawn(async move { records.write(id, epoch, r).await })
            })
            .collect();
        let mut written = Vec::new();
        for task in tasks {
            written.push(task.await.unwrap());
        }
        written
    };

    // Forty acks, each of its own version, and a superseded stream's record (epoch 6).
    let mut rows: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, 7, record(SyncState::Synced, Some(i as u64 + 1))))
        .collect();
    rows.push((ids[0], 6, record(SyncState::Pending, None)));
    let written = write_all(rows).await;
    let written: Vec<bool> = written.into_iter().map(Result::unwrap).collect();
    assert!(written[..40].iter().all(|w| *w), "{written:?}");
    assert!(!written[40], "a superseded stream's record is not written");
    // The runtime is single-threaded: every record is queued before the writer first runs.
    assert_eq!(records.transactions(), 1, "41 concurrent records, one transaction");
    let stored: Vec<(uuid::Uuid, i16, i64, Option<chrono::DateTime<chrono::Utc>>)> = sqlx::query_as(
        "SELECT id, sync_state, applied_version, last_acked_at FROM workloads WHERE id = ANY($1)",
    )
    .bind(&uuids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored.len(), 40);
    for (id, state, applied, acked_at) in &stored {
        let i = uuids.iter().position(|u| u == id).unwrap();
        assert_eq!((*state, *applied), (SyncState::Synced.code(), i as i64 + 1), "{id}");
        assert_eq!(*acked_at, stored[0].3, "one commit, one now()");
        assert!(acked_at.is_some());
    }
    let installs: Vec<(uuid::Uuid, i64, i16)> = sqlx::query_as(
        "SELECT workload_id, version, mode FROM workload_installs WHERE workload_id = ANY($1)",
    )
    .bind(&uuids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(installs.len(), 40, "each ack's install, with its state");
    for (id, version, mode) in installs {
        let i = uuids.iter().position(|u| *u == id).unwrap();
        assert_eq!((version, mode), (i as i64 + 1, Mode::Enforcement.code()));
    }

    // The second batch: an ack of a workload that does not exist fails its install's foreign
    // key, so the batch fails and is written record by record; only that stream hears it.
    let unknown = WorkloadId::new_random();
    let mut rows: Vec<_> = ids[1..5].iter().map(|id| (*id, 7, record(SyncState::Pending, None))).collect();
    rows.push((unknown, 7, record(SyncState::Synced, Some(1))));
    let written = write_all(rows).await;
    assert!(written[..4].iter().all(|w| matches!(w, Ok(true))), "{written:?}");
    assert!(written[4].is_err(), "{written:?}");
    assert_eq!(records.transactions(), 1 + 1 + 5, "the failed batch, then each record alone");
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workloads WHERE id = ANY($1) AND sync_state = $2")
            .bind(&uuids[1..5])
            .bind(SyncState::Pending.code())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(pending, 4);
}

/// Streams catching up at once share one query: every answer is the stream's own policy (or none
/// for a workload without one), and 41 concurrent reads cost one query. Workloads rendered alike
/// share one decoded content, for as long as some stream holds it (PERF-4); one rendered
/// otherwise gets its own.
#[tokio::test]
async fn concurrent_policy_reads_share_a_query_and_each_gets_its_own_policy() {
    use innerwall_control_plane::sync::reads::Reads;

    let (db, mut ids) = forty_workloads("read").await;
    innerwall_control_plane::testing::admit(&db.pool, "web", ("app", "web"), ("app", "client"), "tcp:443")
        .await
        .unwrap();
    let web = crate::publish::register(&db.pool, "read-web", &["app=web"], &[]).await;
    ids.push(web);
    let unknown = WorkloadId::new_random();
    let reads = Reads::start(db.pool.clone());
    let tasks: Vec<_> = ids
        .iter()
        .chain([&unknown])
        .map(|id| {
            let (reads, id) = (reads.clone(), *id);
            tokio::spawn(async move { reads.latest(id).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().unwrap());
    }
    let mut conn = db.pool.acquire().await.unwrap();
    for (id, answer) in ids.iter().zip(&answers) {
        let expected = store::persisted_policy(&mut conn, *id).await.unwrap();
        assert_eq!(answer, &expected, "{id}");
        assert!(answer.is_some());
    }
    assert_eq!(answers.last(), Some(&None), "a workload without a policy has none");
    // The runtime is single-threaded: every request is queued before the reader first runs.
    assert_eq!(reads.queries(), 1, "42 concurrent reads, one query");

    // The forty unlabelled workloads have one content; the web workload another.
    let digests: Vec<(uuid::Uuid, Vec<u8>)> =
        sqlx::query_as("SELECT workload_id, digest FROM workload_policies WHERE workload_id = ANY($1)")
            .bind(ids.iter().map(|id| id.uuid()).collect::<Vec<_>>())
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let web_digest = &digests.iter().find(|(id, _)| *id == web.uuid()).unwrap().1;
    assert!(digests.iter().filter(|(id, _)| *id != web.uuid()).all(|(_, d)| d != web_digest));
    let policy = |i: usize| answers[i].as_ref().unwrap().0.clone();
    let (first, web_policy) = (policy(0), policy(40));
    assert!((1..40).all(|i| policy(i).shares_content(&first)), "one content for the forty alike");
    assert!(!web_policy.shares_content(&first) && web_policy.rules().len() == 1);

    // The second time: a read after the first batch is its own query, and gets the content the
    // first batch's answers still hold.
    let again = reads.latest(ids[0]).await.unwrap().unwrap().0;
    assert_eq!(reads.queries(), 2);
    assert!(again.shares_content(&first));
    // Once no stream holds a content, a read decodes it afresh, the same.
    drop((answers, first, again));
    let fresh = reads.latest(ids[1]).await.unwrap();
    assert_eq!(fresh, store::persisted_policy(&mut conn, ids[1]).await.unwrap());
    assert_eq!(reads.queries(), 3);
}

/// Issue 33 item 4 at test size: a tenth of the agents stop reading their stream, and the others
/// are not slowed. Every fast agent receives and acknowledges every version in turn; a slow
/// agent's stream holds what its HTTP/2 buffers and the gateway's bounded queue take, and the
/// versions announced meanwhile fold into one (counted) rather than queue without bound: when it
/// reads again, it gets a few deltas, chained, ending at the latest, not one per version.
#[tokio::test]
async fn slow_agents_do_not_slow_the_fleet() {
    use innerwall_control_plane::counts::CountBounds;
    use innerwall_control_plane::operations;
    use innerwall_control_plane::policy::spec::{AddressGroupSpec, PeerSpec};
    use innerwall_wire::policy::Cidr;

    const AGENTS: usize = 10;
    const CHANGES: u32 = 40;
    let plane = Plane::start(GatewayConfig { outbound_queue: 2, ..GatewayConfig::default() }).await;
    let pool = &plane.db.pool;
    // Each change replaces a group of 2,000 host routes every agent admits: deltas of tens of
    // KiB, so a stream nobody reads backs up within a few of them.
    let group = |n: u32| AddressGroupSpec {
        name: "fleet".into(),
        description: String::new(),
        cidrs: (0..2_000u32)
            .map(|i| Cidr::parse(&format!("10.{}.{}.{}/32", 100 + n % 100, i / 250, i % 250)).unwrap())
            .collect(),
    };
    operations::create_address_group(pool, "test", &group(0), &CountBounds::default()).await.unwrap();
    innerwall_control_plane::testing::allow_from(pool, PeerSpec::address_group("fleet")).await.unwrap();
    let mut fast = Vec::new();
    let mut slow = None;
    for i in 0..AGENTS {
        let token = plane.mint(&["app=web"], None).await;
        let (id, cert, key) = plane.enroll(&token).await.unwrap();
        let channel = match i {
            0 => plane.mutual_windowed(&cert, &key, 16 * 1024).await,
            _ => plane.mutual(&cert, &key).await.unwrap(),
        };
        let mut agent = Scripted::open(channel, 0).await;
        let (kind, _, v) = agent.update().await;
        assert_eq!(kind, "snapshot");
        agent.ack(v, true, "").await;
        if i == 0 { slow = Some((id, agent, v)) } else { fast.push((id, agent, v)) }
    }
    let before = sample(&plane, "innerwall_announcements_coalesced_total").unwrap_or(0.0);
    for n in 1..=CHANGES {
        operations::update_address_group(pool, "test", &group(n), i64::from(n)).await.unwrap();
        for (_, agent, at) in &mut fast {
            let (kind, from, to) = agent.update().await;
            assert_eq!((kind, from), ("delta", *at), "change {n}");
            agent.ack(to, true, "").await;
            *at = to;
        }
    }
    let latest = fast[0].2;
    for (id, _, at) in &fast {
        assert_eq!(*at, latest);
        assert_eq!(wait_state(pool, *id, "SYNCED").await.1, latest as i64);
    }

    // The slow agent read nothing since its snapshot. It reads now.
    let (id, mut agent, mut at) = slow.unwrap();
    let mut received = 0;
    while at < latest {
        let (kind, from, to) = agent.update().await;
        assert_eq!((kind, from), ("delta", at), "deltas chain from the stream's tip");
        agent.ack(to, true, "").await;
        received += 1;
        at = to;
    }
    assert_eq!(wait_state(pool, id, "SYNCED").await.1, latest as i64);
    assert!(received < CHANGES / 2, "{received} deltas for {CHANGES} versions: they were queued, not folded");
    let folded = sample(&plane, "innerwall_announcements_coalesced_total").unwrap() - before;
    assert!(folded >= f64::from(CHANGES - received), "{folded} folded, {received} of {CHANGES} sent");
}
