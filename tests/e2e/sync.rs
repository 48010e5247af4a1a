//! The policy stream end to end (SYNC-2..SYNC-10, IDN-5): the real agent sync loop against a
//! real control plane, Postgres and mutual TLS on loopback.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use innerwall_agent::connect::RunConfig;
use innerwall_agent::sync::{Enforcer, WireUpdate};
use innerwall_agent::{daemon, renew};
use innerwall_wire::policy::diff;
use innerwall_wire::proto;

use crate::plane::{Plane, TestStore, credential, eventually, history, refusals_left};

fn spawn_agent(config: &RunConfig, enforcer: &Arc<Enforcer<TestStore>>) -> tokio::task::JoinHandle<()> {
    let (config, enforcer) = (config.clone(), enforcer.clone());
    tokio::spawn(async move {
        daemon::hold_stream(&config, enforcer).await.unwrap();
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_in_order_and_acks_each() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    // A slow store: while it applies, later updates queue on the stream (pipelined).
    let enforcer =
        Arc::new(Enforcer::new(TestStore { delay: Duration::from_millis(400), ..Default::default() }));
    let agent = spawn_agent(&config, &enforcer);
    plane.wait_synced(id, 1).await;
    plane.bump(0).await;
    // Once v2 is on its way (PENDING), v3 follows while the agent is still applying v2: two
    // deltas in flight. (Authored back to back, they could coalesce into one delta, SYNC-11.)
    plane.wait(id, |s| s.0 == "PENDING" && s.2 == Some(2), "PENDING towards v2").await;
    plane.bump(1).await;
    plane.wait_synced(id, 3).await;
    assert_eq!(history(&enforcer), [1, 2, 3], "applied strictly in stream order, each once");
    assert_eq!(enforcer.current().unwrap().version(), 3);
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
    let enforcer = Arc::new(Enforcer::new(TestStore { refuse: Some((2, 2)), ..Default::default() }));
    let agent = spawn_agent(&config, &enforcer);
    plane.wait_synced(id, 1).await;
    let v1 = enforcer.current().unwrap();
    plane.bump(0).await;
    plane
        .wait(id, |s| s.0 == "DEGRADED" && s.3.contains("test refuses v2"), "DEGRADED with the refusal")
        .await;
    // Both v2 updates (the delta and its recovery snapshot) reached the store and were refused:
    // the store counts its refusals down.
    eventually(|| refusals_left(&enforcer) == 0, "the store refused v2 twice").await;
    assert_eq!(enforcer.current().unwrap(), v1, "v1 stays installed, unchanged");
    assert_eq!(history(&enforcer), [1], "nothing was applied after v1");
    assert_eq!(plane.status(id).await.1, 1, "applied is still v1");

    // The next version arrives as a delta from v2, a base the agent does not hold: refused as a
    // unit, then a recovery snapshot brings it to v3.
    plane.bump(1).await;
    plane.wait_synced(id, 3).await;
    // v3 is the later marker: updates apply in stream order, so any other update sent after
    // v1 (a v2 that slipped through) would show up before it.
    assert_eq!(history(&enforcer), [1, 3]);

    // The same refusal, directly: a delta on the wrong base leaves the store untouched.
    let v3 = enforcer.current().unwrap();
    let wrong = WireUpdate::Delta(proto::PolicyDelta::from(&diff(&v1, &v1.clone().with_version(9))));
    let err = enforcer.apply(&wrong).unwrap_err().to_string();
    assert!(err.contains("based on version 1 but version 3 is held"), "{err}");
    assert_eq!(enforcer.current().unwrap(), v3);
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_is_fresh_hello_with_backoff() {
    let mut plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    plane.down().await;
    let enforcer = Arc::new(Enforcer::new(TestStore::default()));
    let agent = spawn_agent(&config, &enforcer);
    // The control plane is away: dials fail, under backoff.
    for _ in 0..200 {
        if enforcer.dial_failures.load(Ordering::Relaxed) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(enforcer.dial_failures.load(Ordering::Relaxed) >= 3);
    // The waits between dials: from the fourth attempt on, each is uniform in [0, 400 ms)
    // (base 50 ms, cap 400 ms, full jitter), about ten dials in 2 s. A loop that does not wait
    // makes hundreds (a refused loopback dial takes well under a millisecond); 40 dials would
    // need the 40 waits to average under 50 ms, eight standard deviations below their mean.
    let (before, since) = (enforcer.dial_failures.load(Ordering::Relaxed), std::time::Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dials = enforcer.dial_failures.load(Ordering::Relaxed) - before;
    let elapsed = since.elapsed();
    assert!(dials >= 2, "the agent keeps dialing under the 400 ms cap: {dials} dials in {elapsed:?}");
    assert!(dials <= 40, "the agent waits between dials: {dials} dials in {elapsed:?}");
    assert_eq!(enforcer.streams.load(Ordering::Relaxed), 0);
    plane.up().await;
    plane.wait_synced(id, 1).await;
    let first_snapshot: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT last_snapshot_sent_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();

    // Drop the stream (the replica goes away and comes back): a fresh Hello reports v1 …
    plane.down().await;
    plane.wait(id, |s| s.0 == "OFFLINE", "OFFLINE").await;
    plane.up().await;
    plane.wait_synced(id, 1).await;
    // … and the new stream begins with a snapshot again.
    let second_snapshot: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT last_snapshot_sent_at FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap();
    assert!(second_snapshot > first_snapshot);
    assert_eq!(enforcer.streams.load(Ordering::Relaxed), 2);
    assert_eq!(history(&enforcer), [1, 1], "each stream's snapshot is applied (the second changes nothing)");
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_stream_end_to_end() {
    let mut plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let enforcer = Arc::new(Enforcer::new(TestStore::default()));
    let agent = spawn_agent(&config, &enforcer);
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
    assert_eq!(history(&enforcer), [1, 2, 3], "exactly one update for each change after the snapshot");

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
    assert_eq!(history(&enforcer), [1, 2, 3, 3]);
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_moves_the_stream_to_the_new_certificate() {
    // Certificates live 12 s: the agent renews 8–10.8 s after receiving one.
    let plane = Plane::start_with(Duration::from_secs(12)).await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let before = credential(&config);
    let enforcer = Arc::new(Enforcer::new(TestStore::default()));
    let agent = spawn_agent(&config, &enforcer);
    let renewal = tokio::spawn(renew::renew_forever(config.clone(), enforcer.clone()));
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
        || enforcer.streams.load(Ordering::Relaxed) == 2,
        "the stream reopened with the new certificate",
    )
    .await;
    // Past the first certificate's expiry, the stream opened with the new one carries updates.
    tokio::time::sleep(before.not_after.duration_since(std::time::SystemTime::now()).unwrap_or_default())
        .await;
    plane.bump(0).await;
    plane.wait_synced(id, 2).await;
    assert_eq!(epoch(plane.pool().clone()).await, opened + 1, "exactly one reconnect, for the renewal");
    assert_eq!(enforcer.streams.load(Ordering::Relaxed), 2);
    assert_eq!(enforcer.dial_failures.load(Ordering::Relaxed), 0);
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
    let enforcer = Arc::new(Enforcer::new(TestStore::default()));
    let agent = {
        let (config, enforcer) = (config.clone(), enforcer.clone());
        tokio::spawn(async move { daemon::hold_stream(&config, enforcer).await })
    };
    plane.wait_synced(id, 1).await;
    innerwall_control_plane::policy::authoring::commit(
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
    let again = tokio::time::timeout(Duration::from_secs(15), daemon::hold_stream(&config, enforcer.clone()))
        .await
        .expect("the restarted agent kept redialing");
    match again {
        Err(daemon::RunError::Reenroll(reason)) => assert!(reason.contains("retired"), "{reason}"),
        other => panic!("expected Reenroll, got {other:?}"),
    }
    assert_eq!(enforcer.dial_failures.load(Ordering::Relaxed), 0, "no redial");
}
