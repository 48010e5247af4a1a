//! Flow evidence end to end (FLOW-4, FLOW-5): the agent's on-disk queue and telemetry connection
//! against a real control plane and Postgres: peer resolution with label snapshots, idempotent
//! retries, and buffering across a partition with overflow recorded as a gap.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use innerwall_agent::evidence::telemetry::{self, Queue};
use innerwall_agent::identity::connect::connect;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::AddressGroupSpec;
use innerwall_wire::flows::{Decision, FlowRecord, FlowWindow};
use innerwall_wire::policy::{Cidr, Mode, Protocol};
use innerwall_wire::proto;

use crate::plane::{Plane, eventually};

fn record(src: &str, port: u16, packets: u64) -> FlowRecord {
    FlowRecord {
        src: src.parse().unwrap(),
        dst: "10.1.0.5".parse().unwrap(),
        dst_port: port,
        protocol: Protocol::Tcp,
        decision: Decision::WouldBlock,
        matched_rule: None,
        packets,
        bytes: packets * 60,
        new_connections: 1,
        first_seen_ms: now_ms() - 5_000,
        last_seen_ms: now_ms() - 1_000,
        pending: None,
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// A window under version 1 (in its mode, visibility), which `Plane::hold` has the agent
/// install first; each one after the last (a workload's windows do not overlap).
fn window(records: Vec<FlowRecord>) -> FlowWindow {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = now_ms();
    let start = LAST.fetch_max(now, Ordering::Relaxed).max(now);
    LAST.fetch_max(start + 2, Ordering::Relaxed);
    FlowWindow {
        id: uuid::Uuid::new_v4(),
        start_ms: start,
        end_ms: start + 1,
        policy_version: 1,
        mode: Mode::Visibility,
        records,
        gaps: vec![],
        staged_set: None,
    }
}

async fn group(plane: &Plane, name: &str, cidr: &str) {
    let spec = AddressGroupSpec {
        name: name.into(),
        description: String::new(),
        cidrs: BTreeSet::from([Cidr::parse(cidr).unwrap()]),
    };
    innerwall_control_plane::foresight::commit(plane.pool(), "test", "group", name, async |c| {
        authoring::create_address_group(c, &spec).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_end_to_end_with_label_snapshot() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("db-1", &["app=db"]).await;
    let (_shared, _agent) = plane.hold(id, &config).await;
    let peer = plane.register("peer", &["app=web", "env=prod"], "10.9.0.7").await;
    group(&plane, "corp", "10.8.0.0/16").await;
    group(&plane, "office", "10.8.1.0/24").await;

    let queue = Queue::new(&config.state_dir, 10).unwrap();
    queue
        .push(window(vec![
            record("10.9.0.7", 5432, 3),
            record("10.8.1.1", 5432, 2),
            record("192.0.2.1", 22, 1),
        ]))
        .unwrap();
    let delivered = queue.upload(connect(&config).await.unwrap()).await.unwrap();
    assert_eq!(delivered, 1);
    assert!(queue.is_empty());

    let rows: Vec<(String, i16, String, serde_json::Value, i64)> = sqlx::query_as(
        "SELECT host(src_address), peer_kind, peer_key, peer_labels, packets FROM flow_records
         WHERE workload_id = $1 ORDER BY src_address",
    )
    .bind(id.uuid())
    .fetch_all(plane.pool())
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![
            ("10.8.1.1".to_owned(), 2, "office".to_owned(), serde_json::json!({}), 2),
            ("10.9.0.7".to_owned(), 1, peer.to_string(), serde_json::json!({"app": "web", "env": "prod"}), 3),
            ("192.0.2.1".to_owned(), 0, "192.0.2.1".to_owned(), serde_json::json!({}), 1),
        ],
        "workload with its labels, else the most specific group, else the bare address"
    );

    // Relabel the peer: the stored snapshot still says what it was then.
    plane.relabel(peer, 1, "app=checkout").await;
    let out = std::process::Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .args(["--database-url", &plane.db.url, "--json", "flows", "list", "--workload", &id.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let labels: Vec<&serde_json::Value> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["peer_kind"] == 1)
        .map(|r| &r["peer_labels"])
        .collect();
    assert_eq!(labels, [&serde_json::json!({"app": "web", "env": "prod"})]);

    // A malformed window is refused whole, with the reason; nothing of it is stored.
    let mut bad =
        proto::FlowWindow::from(&window(vec![record("10.9.0.7", 5432, 1), record("192.0.2.9", 1, 1)]));
    bad.records[1].src_address = "not-an-ip".into();
    let err = proto::telemetry_service_client::TelemetryServiceClient::new(connect(&config).await.unwrap())
        .report_flows(proto::ReportFlowsRequest { window: Some(bad) })
        .await
        .unwrap_err();
    assert!(err.message().contains("record 1: source \"not-an-ip\" is not an address"), "{err}");
    let windows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_windows").fetch_one(plane.pool()).await.unwrap();
    assert_eq!(windows, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_upload_is_idempotent() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("db-1", &["app=db"]).await;
    let (_shared, _agent) = plane.hold(id, &config).await;
    let queue = Queue::new(&config.state_dir, 10).unwrap();
    let w = window(vec![record("192.0.2.1", 5432, 7)]);
    // A retry after a lost response is the same window again.
    queue.push(w.clone()).unwrap();
    queue.push(w).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 2);
    let (windows, records, packets): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM flow_windows WHERE workload_id = $1),
                (SELECT count(*) FROM flow_records WHERE workload_id = $1),
                (SELECT sum(packets)::bigint FROM flow_windows WHERE workload_id = $1)",
    )
    .bind(id.uuid())
    .fetch_one(plane.pool())
    .await
    .unwrap();
    assert_eq!((windows, records, packets), (1, 1, 7), "stored once, counted once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_buffer_survives_partition() {
    let mut plane = Plane::start().await;
    let (id, config) = plane.enroll("db-1", &["app=db"]).await;
    let (_shared, agent) = plane.hold(id, &config).await;
    agent.abort();
    plane.down().await;
    // In the control plane's place, a listener that counts connections and drops them: every
    // upload attempt fails there.
    // (The stopped replica may still hold its listening socket for a moment.)
    let mut imposter = None;
    for _ in 0..100 {
        match tokio::net::TcpListener::bind(("127.0.0.1", plane.port)).await {
            Ok(listener) => {
                imposter = Some(listener);
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("binding the control plane's port: {e}"),
        }
    }
    let imposter = imposter.expect("the control plane's port stays in use after it stopped");
    let attempts = Arc::new(AtomicU64::new(0));
    let counting = tokio::spawn({
        let attempts = attempts.clone();
        async move {
            loop {
                if let Ok((connection, _)) = imposter.accept().await {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    drop(connection);
                }
            }
        }
    });
    // The control plane is unreachable: five windows close, the queue holds three.
    let queue = Queue::new(&config.state_dir, 3).unwrap();
    for n in 0..5 {
        queue.push(window(vec![record("192.0.2.1", 1000 + n, 1 + u64::from(n))])).unwrap();
    }
    assert_eq!(queue.len(), 3);
    let uploader = tokio::spawn(telemetry::upload_forever(
        config.clone(),
        queue.clone(),
        Duration::from_millis(100),
        Default::default(),
    ));
    // Nothing is lost while uploads fail, checked once the uploader has tried and failed twice.
    eventually(|| attempts.load(Ordering::Relaxed) >= 2, "two failed upload attempts").await;
    assert_eq!(queue.len(), 3, "nothing is lost while the control plane is away");
    counting.abort();
    let _ = counting.await;

    plane.up().await;
    for _ in 0..100 {
        if queue.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(queue.is_empty(), "buffered windows are delivered after the partition");
    let ports: Vec<i32> =
        sqlx::query_scalar("SELECT dst_port FROM flow_records WHERE workload_id = $1 ORDER BY dst_port")
            .bind(id.uuid())
            .fetch_all(plane.pool())
            .await
            .unwrap();
    assert_eq!(ports, [1002, 1003, 1004], "the newest windows survive");
    let gaps: Vec<(i16, i64)> =
        sqlx::query_as("SELECT kind, count FROM flow_gaps WHERE workload_id = $1 ORDER BY gap_from")
            .bind(id.uuid())
            .fetch_all(plane.pool())
            .await
            .unwrap();
    assert_eq!(
        gaps,
        [(3, 1), (3, 1)],
        "each dropped window is an upload-buffer-overflow gap with its record count"
    );
    uploader.abort();
}

/// A window moved in time by `offset_ms`, records included.
fn shifted(records: Vec<FlowRecord>, offset_ms: i64) -> FlowWindow {
    let mut w = window(records);
    w.start_ms += offset_ms;
    w.end_ms += offset_ms;
    for r in &mut w.records {
        r.first_seen_ms += offset_ms;
        r.last_seen_ms += offset_ms;
    }
    w
}

/// Windows far in the past or the future are refused with InvalidArgument before anything is
/// written (no partition for their days); the agent does not retry them and does not drop them
/// silently: the next window it queues carries one UPLOAD_REFUSED gap with their records'
/// count, its interval clamped by the control plane into the range it keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_refuses_times_out_of_range() {
    const DAY: i64 = 86_400_000;
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("db-1", &["app=db"]).await;
    let (_shared, _agent) = plane.hold(id, &config).await;
    let partition_exists = |offset_ms: i64| {
        let day = chrono::DateTime::from_timestamp_millis(now_ms() + offset_ms).unwrap().format("%Y%m%d");
        let pool = plane.pool().clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
                .bind(format!("flow_records_{day}"))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // Directly: the reason names the time and the bound.
    let future = proto::FlowWindow::from(&shifted(vec![record("192.0.2.1", 22, 1)], DAY));
    let err = proto::telemetry_service_client::TelemetryServiceClient::new(connect(&config).await.unwrap())
        .report_flows(proto::ReportFlowsRequest { window: Some(future) })
        .await
        .unwrap_err();
    assert!(err.message().starts_with("window refused: window start"), "{err:?}");
    assert!(err.message().contains("ahead of the control plane's clock"), "{err:?}");

    // Through the agent's queue: one window 40 days old (3 records), one two days ahead (2; the
    // replica makes tomorrow's partitions ahead, so a refusal a day ahead would find one made).
    let queue = Queue::new(&config.state_dir, 10).unwrap();
    let old = vec![record("192.0.2.1", 22, 1), record("192.0.2.2", 22, 1), record("192.0.2.3", 22, 1)];
    queue.push(shifted(old, -40 * DAY)).unwrap();
    queue.push(shifted(vec![record("192.0.2.4", 22, 1), record("192.0.2.5", 22, 1)], 2 * DAY)).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 0, "both refused");
    assert!(queue.is_empty(), "refused windows are not retried");
    assert!(
        !partition_exists(-40 * DAY).await && !partition_exists(2 * DAY).await,
        "no partition for their days"
    );
    let windows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_windows").fetch_one(plane.pool()).await.unwrap();
    assert_eq!(windows, 0);

    // The next window carries them as one gap, and is stored.
    queue.push(window(vec![record("192.0.2.9", 22, 1)])).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 1);
    let gaps: Vec<(i16, i64, chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT kind, count, gap_from, gap_to FROM flow_gaps WHERE workload_id = $1")
            .bind(id.uuid())
            .fetch_all(plane.pool())
            .await
            .unwrap();
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    let (kind, count, from, to) = gaps[0];
    assert_eq!((kind, count), (5, 5), "UPLOAD_REFUSED with the refused records' count");
    let now = chrono::Utc::now();
    assert!(from > now - chrono::Duration::days(31) && from < now - chrono::Duration::days(29), "{from}");
    assert!(to > now && to <= now + chrono::Duration::minutes(5), "{to}");
    let out = std::process::Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .args(["--database-url", &plane.db.url, "flows", "gaps", "--workload", &id.to_string()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("upload-refused"), "{out:?}");

    // Reported once: the window after that carries no gap.
    queue.push(window(vec![record("192.0.2.10", 22, 1)])).unwrap();
    assert_eq!(queue.upload(connect(&config).await.unwrap()).await.unwrap(), 1);
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM flow_gaps WHERE workload_id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert_eq!(total, 1);
}
