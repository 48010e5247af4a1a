//! The policy stream end to end (SYNC-2..SYNC-11, IDN-5): the real agent sync loop against a
//! real control plane, Postgres and mutual TLS on loopback.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use innerwall_agent::daemon::{self, renew};
use innerwall_agent::evidence::telemetry::{self, Queue};
use innerwall_agent::identity::connect::RunConfig;
use innerwall_agent::sync::{Agent as Shared, DialFailure};
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::policy::diff;

use crate::plane::{Gate, Plane, TestStore, credential, eventually, history, refusals_left, sample};

fn spawn_agent(config: &RunConfig, shared: &Arc<Shared<TestStore>>) -> tokio::task::JoinHandle<()> {
    let (config, shared) = (config.clone(), shared.clone());
    tokio::spawn(async move {
        daemon::hold_stream(&config, shared).await.unwrap();
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_in_order_and_acks_each() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    // The store holds v2's apply until the test opens the gate: no ack for v2 can leave before.
    let gate = Gate::new(2);
    let shared = Arc::new(Shared::new(TestStore { gate: Some(gate.clone()), ..Default::default() }));
    let agent = spawn_agent(&config, &shared);
    plane.wait_synced(id, 1).await;
    let pushed = || sample(&plane, "innerwall_push_sent_latency_seconds_count").unwrap();
    let applied = || sample(&plane, "innerwall_acks_total{status=\"APPLIED\"}").unwrap();
    assert_eq!((pushed(), applied()), (0.0, 1.0), "the opening snapshot, acked");
    plane.bump(0).await;
    eventually(|| gate.entered(), "the agent applying v2").await;
    // v2 is sent and unacked (the agent is inside its apply). The next version is sent as a
    // delta of its own before v2's ack: two deltas in flight (SYNC-4, pipelining). Authored
    // after v2 was sent, it cannot coalesce with it (SYNC-11).
    plane.bump(1).await;
    eventually(|| pushed() == 2.0, "the server sending v3 with v2 unacked").await;
    assert_eq!(applied(), 1.0, "no ack for v2 before its apply ends");
    let (state, acked_version, latest, _) = plane.status(id).await;
    assert_eq!(
        (state.as_str(), acked_version, latest),
        ("PENDING", 1, Some(3)),
        "two in flight, neither acked"
    );
    gate.open();
    plane.wait_synced(id, 3).await;
    assert_eq!(history(&shared), [1, 2, 3], "applied strictly in stream order, each once");
    assert_eq!(shared.enforcer.current().unwrap().version(), 3);
    assert_eq!((pushed(), applied()), (2.0, 3.0), "one ack per update");
    let failed: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_apply_failed_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert!(failed.is_none(), "every ack was APPLIED");
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_apply_keeps_last_good_and_acks_failed() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    // The store refuses v2 twice: the delta and the recovery snapshot.
    let shared = Arc::new(Shared::new(TestStore { refuse: Some((2, 2)), ..Default::default() }));
    let agent = spawn_agent(&config, &shared);
    plane.wait_synced(id, 1).await;
    let v1 = shared.enforcer.current().unwrap();
    plane.bump(0).await;
    plane
        .wait(id, |s| s.0 == "DEGRADED" && s.3.contains("test refuses v2"), "DEGRADED with the refusal")
        .await;
    // Both v2 updates (the delta and its recovery snapshot) reached the store and were refused:
    // the store counts its refusals down.
    eventually(|| refusals_left(&shared) == 0, "the store refused v2 twice").await;
    assert_eq!(shared.enforcer.current().unwrap(), v1, "v1 stays installed, unchanged");
    assert_eq!(history(&shared), [1], "nothing was applied after v1");
    assert_eq!(plane.status(id).await.1, 1, "applied is still v1");

    // The next version arrives as a delta from v2, a base the agent does not hold: refused as a
    // unit, then a recovery snapshot brings it to v3.
    plane.bump(1).await;
    plane.wait_synced(id, 3).await;
    // v3 is the later marker: updates apply in stream order, so any other update sent after
    // v1 (a v2 that slipped through) would show up before it.
    assert_eq!(history(&shared), [1, 3]);

    // The same refusal, directly: a delta on the wrong base leaves the store untouched.
    let v3 = shared.enforcer.current().unwrap();
    let wrong = innerwall_wire::sync::Update::Delta(diff(&v1, &v1.clone().with_version(9)));
    let err = shared.enforcer.apply(&wrong).unwrap_err().to_string();
    assert!(err.contains("based on version 1 but version 3 is held"), "{err}");
    assert_eq!(shared.enforcer.current().unwrap(), v3);
    agent.abort();
}

/// Holds consecutive failed dials (the first after a healthy stream or the start) to full-jitter
/// backoff: attempt `n` waits within `[0, min(cap, base · 2ⁿ)]` (base 50 ms, cap 400 ms, written
/// out here), and the next dial begins no sooner than that wait after the failure.
fn assert_backoff(failures: &[DialFailure]) {
    const WINDOWS_MS: [u64; 8] = [50, 100, 200, 400, 400, 400, 400, 400];
    for (n, f) in failures.iter().enumerate() {
        assert_eq!(f.attempt as usize, n, "attempts count up while dials fail: {failures:?}");
        let window = Duration::from_millis(WINDOWS_MS[n.min(WINDOWS_MS.len() - 1)]);
        assert!(f.wait <= window, "attempt {n} chose {:?}, outside [0, {window:?}]", f.wait);
    }
    for (n, pair) in failures.windows(2).enumerate() {
        let slept = pair[1].dialed_at.duration_since(pair[0].failed_at);
        assert!(
            slept >= pair[0].wait,
            "attempt {n}: redialed {slept:?} after failing, before its {:?}",
            pair[0].wait
        );
    }
    let distinct: std::collections::BTreeSet<Duration> = failures.iter().map(|f| f.wait).collect();
    assert!(distinct.len() > 1, "jitter: the waits differ: {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_is_fresh_hello_with_backoff() {
    let mut plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    plane.down().await;
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = spawn_agent(&config, &shared);
    // The control plane is away: dials fail, each under its backoff window (the agent's own
    // log of its failed dials and the waits it chose).
    eventually(|| shared.dials.logged().len() >= 8, "eight failed dials").await;
    assert_backoff(&shared.dials.logged()[..8]);
    assert_eq!(shared.dials.streams.load(Ordering::Relaxed), 0);
    plane.up().await;
    plane.wait_synced(id, 1).await;
    let healthy = std::time::Instant::now();
    let first_snapshot: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT last_snapshot_sent_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();

    // Drop the stream (the replica goes away) and commit v2 while the agent cannot hear it.
    plane.down().await;
    plane.wait(id, |s| s.0 == "OFFLINE", "OFFLINE").await;
    plane.bump(0).await;
    // The backoff starts over after a healthy stream.
    eventually(
        || shared.dials.logged().iter().filter(|f| f.failed_at > healthy).count() >= 4,
        "four failed dials after the stream ended",
    )
    .await;
    let again: Vec<DialFailure> =
        shared.dials.logged().into_iter().filter(|f| f.failed_at > healthy).take(4).collect();
    assert_backoff(&again);
    // The reconnecting agent holds v1; its v2 apply waits at the gate.
    let gate = Gate::new(2);
    shared.enforcer.store.lock().unwrap().gate = Some(gate.clone());
    plane.up().await;
    eventually(|| gate.entered(), "the new stream's snapshot of v2 being applied").await;
    // The fresh Hello reported v1: the server recorded it when the stream opened, before any
    // ack of this stream, and began the stream with a snapshot again.
    let (state, applied, latest, _) = plane.status(id).await;
    assert_eq!((state.as_str(), applied, latest), ("PENDING", 1, Some(2)), "the version the Hello reported");
    let second_snapshot: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT last_snapshot_sent_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert!(second_snapshot > first_snapshot);
    gate.open();
    plane.wait_synced(id, 2).await;
    assert_eq!(shared.dials.streams.load(Ordering::Relaxed), 2);
    assert_eq!(history(&shared), [1, 2], "each stream's snapshot is applied");
    agent.abort();
}

/// A TCP relay to the replica that can be broken: while broken it closes every connection at
/// once, counting them.
struct Relay {
    port: u16,
    broken: Arc<std::sync::atomic::AtomicBool>,
    closed: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let closed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (b, c) = (broken.clone(), closed.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { continue };
                if b.load(Ordering::SeqCst) {
                    c.fetch_add(1, Ordering::SeqCst);
                    drop(inbound);
                    continue;
                }
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Relay { port, broken, closed, task }
    }
}

/// SYNC-10: flow uploads travel on a connection of their own. While every telemetry connection
/// fails (and the agent retries it under its own backoff), the policy stream stays the same
/// stream (same epoch, no redial) and carries a later commit to APPLIED; telemetry then
/// recovers without touching it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_failure_leaves_the_policy_stream_up() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = spawn_agent(&config, &shared);
    plane.wait_synced(id, 1).await;
    let epoch = async || -> i64 {
        sqlx::query_scalar("SELECT stream_epoch FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap()
    };
    let windows = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM flow_windows WHERE workload_id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap()
    };
    let opened = epoch().await;

    // The agent's telemetry dials the replica through a relay, broken from the start.
    let relay = Relay::start(plane.port).await;
    relay.broken.store(true, Ordering::SeqCst);
    let mut telemetry = config.clone();
    telemetry.server = format!("localhost:{}", relay.port);
    let queue = Queue::new(&config.state_dir, 16).unwrap();
    let start_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let v1 = shared.enforcer.current().unwrap();
    queue
        .push(FlowWindow {
            id: uuid::Uuid::new_v4(),
            start_ms,
            end_ms: start_ms + 1,
            policy_version: v1.version(),
            mode: v1.mode(),
            records: Vec::new(),
            gaps: Vec::new(),
            staged_set: None,
        })
        .unwrap();
    let uploads = tokio::spawn(telemetry::upload_forever(
        telemetry,
        queue.clone(),
        Duration::from_millis(50),
        Default::default(),
    ));
    eventually(|| relay.closed.load(Ordering::SeqCst) >= 3, "three failed telemetry connections").await;
    assert_eq!(queue.len(), 1, "the window waits for a working connection");

    // The policy stream is the one it was and carries the next commit to APPLIED.
    plane.bump(0).await;
    plane.wait_synced(id, 2).await;
    assert_eq!(epoch().await, opened, "the same stream");
    assert_eq!(shared.dials.streams.load(Ordering::Relaxed), 1);
    assert_eq!(shared.dials.failures.load(Ordering::Relaxed), 0, "the stream never redialed");
    assert_eq!(windows().await, 0);

    // Telemetry recovers on its own connection; the stream is still the same.
    relay.broken.store(false, Ordering::SeqCst);
    for _ in 0..300 {
        if windows().await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(windows().await, 1, "the queued window was stored once telemetry recovered");
    eventually(|| queue.is_empty(), "the queue drained").await;
    assert_eq!(epoch().await, opened, "still the same stream");
    uploads.abort();
    relay.task.abort();
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_stream_end_to_end() {
    let mut plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = spawn_agent(&config, &shared);
    plane.wait_synced(id, 1).await;

    // An operator's change in a separate process: exactly one delta, acked.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--database-url", &plane.db.url])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    cli(&["service", "create", "web", "--entry", "tcp:443"]);
    let file = plane.dir.join("web.yaml");
    std::fs::write(&file, "name: web\nscope: {app: [web]}\nrules:\n- name: r\n  peers: [{cidr: 10.0.0.0/8}]\n  services: [web]\n").unwrap();
    cli(&["ruleset", "create", "-f", file.to_str().unwrap()]);
    plane.wait_synced(id, 2).await;
    // A later change is the marker: updates apply in stream order, so a second update for the
    // operator's change would show up between v2 and v3.
    plane.bump(0).await;
    plane.wait_synced(id, 3).await;
    assert_eq!(history(&shared), [1, 2, 3], "exactly one update for each change after the snapshot");

    // Restart the control plane: nothing re-renders, status and versions are kept, and the
    // reconnecting agent gets v3 as a snapshot.
    plane.down().await;
    plane.up().await;
    assert_eq!(
        plane.running.as_ref().unwrap().startup_changes,
        0,
        "the render after a restart changes nothing"
    );
    plane.wait_synced(id, 3).await;
    assert_eq!(plane.status(id).await.2, Some(3));
    assert_eq!(history(&shared), [1, 2, 3, 3]);
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_moves_the_stream_to_the_new_certificate() {
    // Certificates live 12 s: the agent renews 8–10.8 s after receiving one.
    let plane = Plane::start_with(Duration::from_secs(12)).await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let before = credential(&config);
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = spawn_agent(&config, &shared);
    let renewal = tokio::spawn(renew::renew_forever(config.clone(), shared.clone()));
    plane.wait_synced(id, 1).await;
    let epoch = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT stream_epoch FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let opened = epoch(plane.pool().clone()).await;

    let mut renewed = None;
    for _ in 0..150 {
        let now = credential(&config);
        if now.cert_pem != before.cert_pem {
            renewed = Some(now);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed = renewed.expect("no renewal within 15 s");
    assert_eq!(renewed.id, before.id, "the same identity");
    assert_ne!(renewed.key_pem, before.key_pem, "a fresh key");
    assert!(renewed.not_after > before.not_after);
    let serial: String = sqlx::query_scalar("SELECT credential_serial FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert!(!serial.is_empty());

    // The stream moves to the new certificate at once (the control plane ends a stream when
    // the certificate it was opened with expires): one more stream, no failed dial.
    eventually(
        || shared.dials.streams.load(Ordering::Relaxed) == 2,
        "the stream reopened with the new certificate",
    )
    .await;
    // Past the first certificate's expiry, the stream opened with the new one carries updates.
    tokio::time::sleep(before.not_after.duration_since(std::time::SystemTime::now()).unwrap_or_default())
        .await;
    plane.bump(0).await;
    plane.wait_synced(id, 2).await;
    assert_eq!(epoch(plane.pool().clone()).await, opened + 1, "exactly one reconnect, for the renewal");
    assert_eq!(shared.dials.streams.load(Ordering::Relaxed), 2);
    assert_eq!(shared.dials.failures.load(Ordering::Relaxed), 0);
    renewal.abort();
    agent.abort();
}

/// A retired workload's agent is told to enroll again and stops: on its open stream by the
/// `Reenroll` directive, and when it reconnects (a restart) by the refusal of its identity,
/// instead of redialing forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retired_agent_is_told_to_reenroll() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = {
        let (config, shared) = (config.clone(), shared.clone());
        tokio::spawn(async move { daemon::hold_stream(&config, shared).await })
    };
    plane.wait_synced(id, 1).await;
    innerwall_control_plane::foresight::commit(
        plane.pool(),
        "test",
        "workload.retire",
        &id.to_string(),
        async |c| {
            innerwall_control_plane::policy::authoring::retire(c, id).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(15), agent)
        .await
        .expect("the agent kept its stream")
        .unwrap();
    match ended {
        Err(daemon::RunError::Reenroll(reason)) => assert!(reason.contains("retired"), "{reason}"),
        other => panic!("expected Reenroll, got {other:?}"),
    }
    // A restarted agent learns the same from the refusal, at its first attempt.
    let again = tokio::time::timeout(Duration::from_secs(15), daemon::hold_stream(&config, shared.clone()))
        .await
        .expect("the restarted agent kept redialing");
    match again {
        Err(daemon::RunError::Reenroll(reason)) => assert!(reason.contains("retired"), "{reason}"),
        other => panic!("expected Reenroll, got {other:?}"),
    }
    assert_eq!(shared.dials.failures.load(Ordering::Relaxed), 0, "no redial");
}
