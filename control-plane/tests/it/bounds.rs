//! Enrolled agents are bounded (REL-1), against real Postgres and real mTLS: one identity's
//! uploads, upload bytes, heartbeats and stream opens over their per-minute bounds are refused
//! with RESOURCE_EXHAUSTED and a retry-after, before anything is written, while another agent's
//! propagation goes on.

use std::time::Duration;

use innerwall_control_plane::policy::store;
use innerwall_control_plane::rate::AgentBounds;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto::{self, sync_request, sync_response};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::enrollment::Plane;
use crate::eventually;
use crate::sync::Scripted;

async fn state(pool: &PgPool, id: WorkloadId) -> (String, i64) {
    let s = store::sync_status(&mut pool.acquire().await.unwrap(), Some(id)).await.unwrap().remove(0);
    (s.state.0.name().to_owned(), s.applied_version)
}

async fn wait_state(pool: &PgPool, id: WorkloadId, want: &str, version: i64) {
    let what = format!("workload {id} {want} at version {version}");
    eventually(&what, async || state(pool, id).await == (want.to_owned(), version)).await;
}

/// Opens a stream with Hello; the refusal if the control plane refuses the call itself.
async fn open(channel: Channel, applied: u64) -> Result<Scripted, tonic::Status> {
    let (tx, rx) = mpsc::channel(64);
    let hello = proto::Hello { applied_version: applied, ..Default::default() };
    tx.send(proto::SyncRequest { msg: Some(sync_request::Msg::Hello(hello)) }).await.unwrap();
    let mut client = proto::agent_service_client::AgentServiceClient::new(channel);
    let inbound = client.sync(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    let mut s = Scripted { tx, inbound };
    assert!(matches!(s.next().await, Some(sync_response::Msg::HelloAck(_))));
    Ok(s)
}

fn heartbeat(n: i64) -> proto::SyncRequest {
    let tamper =
        proto::TamperEvent { detected_at_unix_ms: 1_000 + n, detail: format!("change {n}"), count: 1 };
    proto::SyncRequest {
        msg: Some(sync_request::Msg::Heartbeat(proto::Heartbeat {
            tamper_events: vec![tamper],
            ..Default::default()
        })),
    }
}

/// A one-second window starting `start_ms`, under version 1 in visibility (the mode a new
/// workload's first version has), with `records` observed flows from distinct sources.
fn window(start_ms: i64, records: u32) -> proto::FlowWindow {
    let record = |n: u32| proto::FlowRecord {
        pending_decision: 0,
        pending_rule_id: String::new(),
        src_address: format!("10.9.{}.{}", n / 250, n % 250 + 1),
        dst_address: "10.1.0.5".into(),
        dst_port: 443,
        protocol: proto::Protocol::Tcp.into(),
        decision: proto::FlowDecision::Observed.into(),
        matched_rule_id: String::new(),
        packets: 1,
        bytes: 60,
        new_connections: 1,
        first_seen_unix_ms: start_ms,
        last_seen_unix_ms: start_ms,
    };
    proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start_ms,
        end_unix_ms: start_ms + 1_000,
        policy_version: 1,
        mode: proto::EnforcementMode::Visibility.into(),
        records: (0..records).map(record).collect(),
        gaps: vec![],
    }
}

fn assert_rate_refusal(status: &tonic::Status, what: &str, flag: &str) {
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{what}: {status:?}");
    let wait = innerwall_wire::backoff::retry_after(status)
        .unwrap_or_else(|| panic!("{what}: no retry-after: {status:?}"));
    assert!(wait >= Duration::from_secs(1), "{what}: {wait:?}");
    let message = status.message();
    assert!(message.contains(flag), "{what}: the refusal names its bound: {message}");
    assert!(message.ends_with(&format!("retry after {} s", wait.as_secs())), "{what}: {message}");
}

async fn count(pool: &PgPool, sql: &'static str, id: WorkloadId) -> i64 {
    sqlx::query_scalar(sql).bind(id.uuid()).fetch_one(pool).await.unwrap()
}

/// The tamper audit rows of `id` and the reports they count.
pub async fn tamper_rows(pool: &PgPool, id: WorkloadId) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), COALESCE(sum(count), 0)::bigint FROM audit_log
         WHERE action = 'workload.tamper' AND subject = $1",
    )
    .bind(id.to_string())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The metric's value for `reason`, as the replica exposes it.
fn refusals(plane: &Plane, reason: &str) -> u64 {
    let text = plane.running.as_ref().unwrap().metrics.encode();
    let series = format!("innerwall_agent_refusals_total{{reason=\"{reason}\"}} ");
    let line =
        text.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
    line[series.len()..].trim().parse().unwrap()
}

#[tokio::test]
async fn enrolled_agents_are_rate_bounded() {
    let bounds = AgentBounds {
        uploads_per_minute: 3,
        upload_bytes_per_minute: 1_000,
        heartbeats_per_minute: 5,
        hellos_per_minute: 4,
        ..AgentBounds::default()
    };
    let plane = Plane::start(GatewayConfig { bounds, ..GatewayConfig::default() }).await;
    let pool = &plane.db.pool;

    // The other agent: enrolled, SYNCED at version 1, its stream open throughout.
    let token = plane.mint(&["app=web"], None).await;
    let (other, cert, key) = plane.enroll(&token).await.unwrap();
    let mut quiet = open(plane.mutual(&cert, &key).await.unwrap(), 0).await.unwrap();
    assert_eq!(quiet.update().await, ("snapshot", 1, 1));
    quiet.ack(1, true, "").await;
    wait_state(pool, other, "SYNCED", 1).await;

    // The hammering agent: one certificate, one connection for all it does.
    let token = plane.mint(&["app=web"], None).await;
    let (loud, cert, key) = plane.enroll(&token).await.unwrap();
    let channel = plane.mutual(&cert, &key).await.unwrap();
    let mut stream = open(channel.clone(), 0).await.unwrap(); // stream open 1 of 4
    assert_eq!(stream.update().await, ("snapshot", 1, 1));
    stream.ack(1, true, "").await;
    wait_state(pool, loud, "SYNCED", 1).await;

    // Heartbeats: twenty, each with a tamper report, at once. The sixth ends the stream with
    // RESOURCE_EXHAUSTED; the five before it were written (their reports counted on one row).
    for n in 0..20 {
        if stream.tx.send(heartbeat(n)).await.is_err() {
            break;
        }
    }
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(15), stream.inbound.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(Err(status)) => break status,
            other => panic!("the heartbeat flood did not end the stream with a status: {other:?}"),
        }
    };
    assert_rate_refusal(&ended, "heartbeats", "--agent-heartbeats-per-minute");
    let (rows, reports) = tamper_rows(pool, loud).await;
    assert_eq!(reports, 5, "only the heartbeats within the bound were written");
    assert_eq!(rows, 1, "coalesced into one row");
    assert_eq!(refusals(&plane, "heartbeat_rate"), 1);

    // Uploads: ten windows one after another; three are stored, the fourth is refused, and
    // every one after it too, with nothing more stored.
    let mut uploads = proto::telemetry_service_client::TelemetryServiceClient::new(channel.clone());
    let start = chrono::Utc::now().timestamp_millis() + 1_000;
    let mut refused = 0;
    for n in 0..10 {
        let request = proto::ReportFlowsRequest { window: Some(window(start + n * 1_000, 1)) };
        match uploads.report_flows(request).await {
            Ok(_) => assert!(n < 3, "upload {n} was accepted over the bound of 3"),
            Err(status) => {
                assert_rate_refusal(&status, "uploads", "--agent-uploads-per-minute");
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 7);
    let windows = "SELECT count(*) FROM flow_windows WHERE workload_id = $1";
    assert_eq!(count(pool, windows, loud).await, 3, "windows stay within the bound");
    assert_eq!(refusals(&plane, "upload_rate"), 7);

    // Stream opens: three more pass (four a minute), each supersedes the last; the fifth is
    // refused at the call, before its Hello is read: no epoch, no supersede.
    let epochs = "SELECT stream_epoch FROM workloads WHERE id = $1";
    let mut held = Vec::new();
    for n in 2..=4 {
        let mut s = open(channel.clone(), 1).await.unwrap_or_else(|e| panic!("stream open {n}: {e:?}"));
        assert_eq!(s.update().await, ("snapshot", 1, 1), "stream open {n}");
        held.push(s);
    }
    for _ in 0..3 {
        let status = open(channel.clone(), 1).await.err().expect("a stream opened over the bound");
        assert_rate_refusal(&status, "stream opens", "--agent-hellos-per-minute");
    }
    assert_eq!(count(pool, epochs, loud).await, 4, "one stream epoch per stream opened within the bound");
    assert_eq!(refusals(&plane, "hello_rate"), 3);
    // The newest stream within the bound still holds: it is the one a new version reaches.
    let newest = held.last_mut().unwrap();
    newest.ack(1, true, "").await;

    // Bytes: another identity's first window, larger than a minute's allowance, passes; the
    // next, however small, waits for the bucket to refill.
    let token = plane.mint(&["app=web"], None).await;
    let (bulky, cert, key) = plane.enroll(&token).await.unwrap();
    let mut bulk = proto::telemetry_service_client::TelemetryServiceClient::new(
        plane.mutual(&cert, &key).await.unwrap(),
    );
    // No agent holds a stream for it: stand in for its ack of version 1, so ingest takes its windows.
    let installed_at = chrono::Utc::now() - chrono::Duration::minutes(1);
    innerwall_control_plane::testing::installed(
        pool,
        bulky,
        &[(1, innerwall_wire::policy::Mode::Visibility, installed_at)],
    )
    .await
    .unwrap();
    bulk.report_flows(proto::ReportFlowsRequest { window: Some(window(start, 40)) }).await.unwrap();
    let status = bulk
        .report_flows(proto::ReportFlowsRequest { window: Some(window(start + 1_000, 1)) })
        .await
        .unwrap_err();
    assert_rate_refusal(&status, "upload bytes", "--agent-upload-bytes-per-minute");
    assert_eq!(count(pool, windows, bulky).await, 1);
    assert_eq!(refusals(&plane, "upload_bytes"), 1);

    // The other agent's propagation is unaffected: a commit reaches it, and it applies it.
    innerwall_control_plane::testing::add_web_port(pool, 1).await.unwrap();
    assert_eq!(quiet.update().await, ("delta", 1, 2));
    quiet.ack(2, true, "").await;
    wait_state(pool, other, "SYNCED", 2).await;
    // And so does the hammering agent's newest stream: refused calls took nothing from it.
    assert_eq!(held.last_mut().unwrap().update().await, ("delta", 1, 2));
}

/// Each authored kind over its count bound is refused naming the bound, and writes nothing (no
/// row, no audit record, no version); after a delete (or revoke) the same create passes. The
/// library calls carry the check, so the CLI (local: the defaults) and the API (serve's flags)
/// both get it.
#[tokio::test]
async fn authored_objects_over_their_count_bound_are_refused() {
    use innerwall_control_plane::counts::CountBounds;
    use innerwall_control_plane::error::Error;
    use innerwall_control_plane::identity::{operators, tokens};
    use innerwall_control_plane::policy::authoring;
    use innerwall_control_plane::policy::model::ServiceEntry;
    use innerwall_control_plane::policy::spec::{AddressGroupSpec, RulesetSpec, ServiceSpec};

    let db = innerwall_control_plane::testing::fresh_database().await.unwrap();
    let pool = &db.pool;
    let counts = CountBounds {
        services: 2,
        address_groups: 1,
        rulesets: 1,
        provisioning_tokens: 2,
        operator_tokens: 1,
    };
    let service = |name: &str| ServiceSpec {
        name: name.into(),
        description: String::new(),
        entries: vec![ServiceEntry::parse("tcp:443").unwrap()],
    };
    let group = |name: &str| AddressGroupSpec {
        name: name.into(),
        description: String::new(),
        cidrs: [innerwall_wire::policy::Cidr::parse_lenient("10.0.0.0/8").unwrap()].into(),
    };
    let ruleset = |name: &str| RulesetSpec {
        name: name.into(),
        description: String::new(),
        enabled: true,
        scope: [("app".to_owned(), vec!["web".to_owned()])].into(),
        rules: vec![],
    };
    let written = async || -> (i64, i64, i64, i64, i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM audit_log), (SELECT count(*) FROM services),
                    (SELECT count(*) FROM address_groups), (SELECT count(*) FROM rulesets),
                    (SELECT count(*) FROM provisioning_tokens), (SELECT count(*) FROM operator_tokens)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    #[track_caller]
    fn refused<T: std::fmt::Debug>(result: Result<T, Error>, flag: &str, limit: u64) {
        match result {
            Err(Error::OverBound { bound, limit: l, .. }) if bound == flag && l == limit => {}
            other => panic!("expected the {flag} bound of {limit}, got {other:?}"),
        }
    }
    let create = async |kind: &str, name: &str| -> Result<(), Error> {
        innerwall_control_plane::foresight::commit(pool, "test", &format!("{kind}.create"), name, async |c| {
            match kind {
                "service" => authoring::create_service_within(c, &service(name), &counts).await?,
                "address-group" => authoring::create_address_group_within(c, &group(name), &counts).await?,
                _ => authoring::create_ruleset_within(c, &ruleset(name), &counts).await?,
            };
            Ok(((), serde_json::json!({})))
        })
        .await
        .map(|_| ())
    };
    let delete = async |kind: &str, name: &str| {
        innerwall_control_plane::foresight::commit(
            pool,
            "test",
            &format!("{kind}.delete"),
            name,
            async |c| {
                match kind {
                    "service" => authoring::delete_service(c, name, 1).await?,
                    "address-group" => authoring::delete_address_group(c, name, 1).await?,
                    _ => authoring::delete_ruleset(c, name, 1).await?,
                };
                Ok(((), serde_json::json!({})))
            },
        )
        .await
        .unwrap();
    };

    for (kind, flag, limit) in [
        ("service", "--max-services", 2),
        ("address-group", "--max-address-groups", 1),
        ("ruleset", "--max-rulesets", 1),
    ] {
        for n in 0..limit {
            create(kind, &format!("{kind}-{n}")).await.unwrap();
        }
        let before = written().await;
        let over = create(kind, "one-too-many").await;
        let message = over.as_ref().err().map(ToString::to_string).unwrap_or_default();
        refused(over, flag, limit);
        assert!(message.contains(flag) && message.contains("nothing was changed"), "{message}");
        assert_eq!(written().await, before, "{kind}: a refused create writes nothing");
        // The second time, after a delete, it passes.
        delete(kind, &format!("{kind}-0")).await;
        create(kind, "one-too-many").await.unwrap();
        refused(create(kind, "and-another").await, flag, limit);
    }

    // Live provisioning tokens: revoked or expired ones do not count.
    let labels: Vec<innerwall_wire::labels::Label> = vec!["app=web".parse().unwrap()];
    let day = chrono::Duration::days(1);
    let mint = async || tokens::mint_audited_within(pool, "test", &labels, day, None, &[], &counts).await;
    let first = mint().await.unwrap();
    mint().await.unwrap();
    let before = written().await;
    refused(mint().await, "--max-provisioning-tokens", 2);
    assert_eq!(written().await, before, "a refused mint writes nothing");
    tokens::revoke_audited(pool, "test", first.id).await.unwrap();
    mint().await.unwrap();
    refused(mint().await, "--max-provisioning-tokens", 2);

    // Live operator tokens.
    let role = operators::Role::Viewer;
    operators::mint_audited_within(pool, "test", "ops-1", role, operators::Expiry::Never, &counts)
        .await
        .unwrap();
    let before = written().await;
    refused(
        operators::mint_audited_within(pool, "test", "ops-2", role, operators::Expiry::Never, &counts).await,
        "--max-operator-tokens",
        1,
    );
    assert_eq!(written().await, before);
    operators::revoke_audited(pool, "test", &operators::TokenRef::Name("ops-1".into()), None).await.unwrap();
    operators::mint_audited_within(pool, "test", "ops-2", role, operators::Expiry::Never, &counts)
        .await
        .unwrap();

    // The plain calls (the local CLI's) apply the defaults.
    let defaults = CountBounds::default();
    sqlx::query(
        "INSERT INTO rulesets (id, name, description, enabled, scope)
         SELECT gen_random_uuid(), 'bulk-' || n, '', false, (SELECT scope FROM rulesets LIMIT 1)
         FROM generate_series(1, $1) AS n",
    )
    .bind(defaults.rulesets as i64 - 1)
    .execute(pool)
    .await
    .unwrap();
    let plain = |name: &'static str| {
        innerwall_control_plane::foresight::commit(pool, "test", "ruleset.create", name, async move |c| {
            authoring::create_ruleset(c, &ruleset(name)).await?;
            Ok(((), serde_json::json!({})))
        })
    };
    refused(plain("over-the-default").await.map(|_| ()), "--max-rulesets", defaults.rulesets);
}
