//! The replay of recorded flows through proposed policies (POL-8) against real Postgres: flows
//! through the real ingest path, policies through the real render, the CLI as the binary.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DurationRound, TimeDelta, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::foresight::{self, Range};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::{self, fresh_database};
use innerwall_wire::flows::FlowWindow;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, Protocol, WorkloadPolicy};
use innerwall_wire::proto;

use crate::recorded::{self, HOUR, at, ingest, rule_for};

async fn register(pool: &sqlx::PgPool, hostname: &str) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: hostname.into(),
        labels: vec!["app=web".parse().unwrap()],
        addresses: BTreeSet::new(),
    };
    foresight::commit(pool, "test", "register", hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    new.id
}

/// A flow of `connections` new connections from `src` to tcp `port` of the workload.
fn flow(src: &str, port: u32, rule: Option<&str>, connections: u64, at: i64) -> proto::FlowRecord {
    recorded::flow_to(src, "10.9.0.1", port, rule, connections, at)
}

#[tokio::test]
async fn impact_replays_recorded_flows() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dst = register(pool, "web-1").await;
    let other = register(pool, "web-2").await;
    // v1: nothing (registered); v2: tcp/8001 from 192.0.2.0/24; v3: and tcp/8002 from it.
    testing::add_web_port(pool, 1).await.unwrap();
    testing::add_web_port(pool, 2).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let history = store::policy_history(&mut conn, dst).await.unwrap();
    assert_eq!(history.iter().map(WorkloadPolicy::version).collect::<Vec<_>>(), [1, 2, 3]);
    let v3 = history[2].clone();
    let (r8001, r8002) = (rule_for(&v3, 8001), rule_for(&v3, 8002));

    // Four closed hours before now: H0 rolled up, H1 without a window, H2 with a gap, H3 a
    // window ingested after the roll-up (not rolled up).
    let now = Utc::now();
    let h0 = (now.duration_trunc(TimeDelta::hours(1)).unwrap() - TimeDelta::hours(4)).timestamp_millis();
    for id in [dst, other] {
        testing::installed(pool, id, &[(3, Mode::Simulation, at(h0 - HOUR))]).await.unwrap();
        // The agent's ack of v3, as the gateway records it.
        sqlx::query("UPDATE workloads SET applied_version = 3 WHERE id = $1")
            .bind(id.uuid())
            .execute(pool)
            .await
            .unwrap();
    }
    let allowed = |src, port, rule: &str, n, at| flow(src, port, Some(rule), n, at);
    ingest(
        pool,
        dst,
        3,
        h0,
        vec![allowed("192.0.2.10", 8001, &r8001, 1, h0), allowed("192.0.2.11", 8002, &r8002, 5, h0)],
        vec![],
    )
    .await;
    let h2 = h0 + 2 * HOUR;
    let gap = proto::EvidenceGap {
        kind: 2,
        from_unix_ms: h2 + 60_000,
        to_unix_ms: h2 + 120_000,
        count: 0,
        detail: String::new(),
    };
    ingest(pool, dst, 3, h2, vec![flow("198.51.100.7", 8001, None, 4, h2)], vec![gap]).await;
    ingest(pool, other, 3, h0, vec![allowed("192.0.2.10", 8001, &r8001, 1, h0)], vec![]).await;
    assert!(flows::roll_up(pool, now).await.unwrap() >= 3);
    let h3 = h0 + 3 * HOUR;
    ingest(pool, dst, 3, h3, vec![allowed("192.0.2.10", 8001, &r8001, 2, h3)], vec![]).await;
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM flow_pending_windows").fetch_one(pool).await.unwrap();
    assert_eq!(pending, 1, "the H3 window is not rolled up");

    // The proposal: tcp/8001 no longer from 192.0.2.0/24 but from 198.51.100.0/24 and
    // 203.0.113.0/24 (from which no flow came); the other workload keeps its content.
    let moved = innerwall_wire::testing::rule(
        "moved",
        Protocol::Tcp,
        &[8001],
        &["198.51.100.0/24", "203.0.113.0/24"],
    );
    let kept = v3.rules().filter(|r| r.id().to_string() != r8001).cloned();
    let proposed_dst = WorkloadPolicy::new(4, Mode::Simulation, kept.chain([moved])).unwrap();
    let other_now = store::persisted_policy(&mut conn, other).await.unwrap().unwrap().0;
    let proposed = BTreeMap::from([(dst, proposed_dst), (other, other_now.with_version(9))]);
    let range = Range { from: at(h0), to: at(h0 + 4 * HOUR) };
    let impact = foresight::impact(&mut conn, &proposed, range, 10).await.unwrap();

    assert_eq!(impact.workloads.len(), 1, "the unaffected workload is not listed: {impact:#?}");
    let w = &impact.workloads[0];
    assert_eq!((w.id, w.from_version, w.to_version), (dst, 3, None));
    // Registered workloads render in visibility; admission is judged as enforcement would anyway.
    assert_eq!(w.from_mode.as_deref(), Some("visibility"));
    let r = &w.replayed;
    assert_eq!((r.newly_blocked, r.newly_allowed, r.unchanged), (1, 1, 1));
    // The rolled-up hour's connection and the pending window's two.
    assert_eq!(r.blocked_connections, 3);
    let blocked = &r.top_blocked[0];
    assert_eq!(blocked.src_address, "192.0.2.10");
    assert_eq!((blocked.connections, blocked.records), (3, 2));
    assert_eq!(blocked.from_rule.as_deref(), Some(r8001.as_str()));
    assert_eq!(blocked.to_rule, None);
    assert_eq!(blocked.first_seen, at(h0 + 1_000));
    assert_eq!(blocked.last_seen, at(h3 + 2_000));
    let newly = &r.top_allowed[0];
    assert_eq!((newly.src_address.as_str(), newly.connections), ("198.51.100.7", 4));
    assert_eq!((newly.from_rule.as_deref(), newly.to_rule.as_deref()), (None, Some("moved/tcp")));
    // H0 and H3 are gap-free; H1 has no window and H2 a gap.
    let c = &w.coverage;
    assert_eq!((c.hours, c.gap_free_hours, c.gap_count), (4, 2, 1));
    assert_eq!(c.gaps[0].kind, "agent-restart");
    assert_eq!(c.gaps[0].from, at(h2 + 60_000));
    assert_eq!(impact.min_coverage(), 0.5);
    let unseen: Vec<&str> = w.unseen_admissions.iter().map(|a| a.cidr.as_str()).collect();
    assert_eq!((unseen, w.unseen_admission_count), (vec!["203.0.113.0/24"], 1));
    assert_eq!(impact.newly_blocked(), 1);

    // Bad input changes nothing and says what is wrong.
    let err = foresight::impact(&mut conn, &proposed, range, 101).await.unwrap_err().to_string();
    assert!(err.contains("top must be between 1 and 100"), "{err}");
    let err = foresight::replay(&mut conn, dst, 3, 7, range, 5).await.unwrap_err().to_string();
    assert!(err.contains("version 7"), "{err}");
    let long = Range { from: at(h0 - 91 * 24 * HOUR), to: at(h0) };
    assert!(foresight::impact(&mut conn, &proposed, long, 5).await.is_err());

    // The CLI between two stored versions: v3 -> v2 drops tcp/8002, so 192.0.2.11 is blocked.
    let cli = |extra: &[&str]| {
        let mut args = vec!["--database-url", db.url.as_str(), "workload", "replay"];
        let id = dst.to_string();
        let mut rest: Vec<String> = [id.as_str(), "--from", "3", "--to", "2", "--since", "5h"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        rest.extend(extra.iter().map(|s| s.to_string()));
        args.extend(rest.iter().map(String::as_str));
        std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .env_remove("INNERWALL_DATABASE_URL")
            .env_remove("INNERWALL_API")
            .args(&args)
            .output()
            .unwrap()
    };
    let out = cli(&["--min-coverage", "0"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("newly blocked") && stderr.contains("--accept-blocks"), "{stderr}");
    assert!(stdout.contains("192.0.2.11") && stdout.contains(&r8002), "{stdout}");
    assert!(stdout.lines().all(|l| l.chars().count() <= 80), "80 columns:\n{stdout}");
    let out = cli(&["--min-coverage", "0", "--accept-blocks", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["workloads"][0]["newly_blocked"], 1);
    assert_eq!(json["workloads"][0]["top_blocked"][0]["from_rule"], r8002.as_str());
    // The default minimum coverage fails a range the evidence covers in part.
    let out = cli(&["--accept-blocks"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--min-coverage"));
}

/// A peer workload registered with `labels` at `address` (accepted, so its flows name it).
async fn peer(pool: &sqlx::PgPool, labels: &[&str], address: &str) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: format!("peer-{address}"),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: BTreeSet::from([address.parse().unwrap()]),
    };
    foresight::commit(pool, "test", "register", &new.hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    new.id
}

async fn relabel(pool: &sqlx::PgPool, id: WorkloadId, label: &str) {
    foresight::commit(pool, "test", "label", "peer", async |c| {
        Ok((authoring::edit_labels(c, id, 1, &[label.parse().unwrap()], &[]).await?, serde_json::json!({})))
    })
    .await
    .unwrap();
}

/// The peer labels an impact reports are the ones each flow was ingested with ("then", read per
/// label set only for the rows shown: from the rollups, or from raw records when only those have
/// it) beside the peer's labels now, whichever part of the range (rolled-up hours, a window not
/// rolled up, the partial hour at the end) the flow came from.
#[tokio::test]
async fn impact_reports_peer_labels_then_and_now() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dst = register(pool, "web-1").await;
    let batch = peer(pool, &["app=batch"], "10.5.0.1").await;
    peer(pool, &["app=api"], "10.5.0.2").await;
    let old = peer(pool, &["app=old"], "10.5.0.3").await;
    let now = Utc::now();
    let h0 = (now.duration_trunc(TimeDelta::hours(1)).unwrap() - TimeDelta::hours(3)).timestamp_millis();
    testing::installed(pool, dst, &[(1, Mode::Simulation, at(h0 - HOUR))]).await.unwrap();
    let blocked = |src, n, at| flow(src, 8001, None, n, at);
    // H0 rolled up: batch (then app=batch) and api; H1 not rolled up: old (then app=old).
    ingest(pool, dst, 1, h0, vec![blocked("10.5.0.1", 5, h0), blocked("10.5.0.2", 2, h0)], vec![]).await;
    assert!(flows::roll_up(pool, now).await.unwrap() >= 1);
    ingest(pool, dst, 1, h0 + HOUR, vec![blocked("10.5.0.3", 4, h0 + HOUR)], vec![]).await;
    relabel(pool, batch, "app=etl").await;
    relabel(pool, old, "app=new").await;
    // Seen after the relabel (a millisecond on: the label history keeps microseconds), in the
    // open hour: batch as app=etl.
    let t = Utc::now().timestamp_millis() + 1;
    let after = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: t - 60_000,
        end_unix_ms: t + 1_000,
        policy_version: 1,
        mode: 2,
        records: vec![blocked("10.5.0.1", 3, t - 1_000)],
        gaps: vec![],
    };
    flows::ingest(pool, dst, &FlowWindow::try_from(&after).unwrap()).await.unwrap();

    // Nothing applied admitted every flow; the proposal admits none of them.
    let none = innerwall_wire::testing::rule("other", Protocol::Tcp, &[9999], &["203.0.113.0/24"]);
    let proposed = BTreeMap::from([(dst, WorkloadPolicy::new(2, Mode::Enforcement, [none]).unwrap())]);
    let range = Range { from: at(h0), to: at(t + 60_000) };
    let mut conn = pool.acquire().await.unwrap();
    let impact = foresight::impact(&mut conn, &proposed, range, 10).await.unwrap();
    let r = &impact.workloads[0].replayed;
    assert_eq!((r.newly_blocked, r.unchanged, impact.keys), (4, 0, 4));
    let app = |v: &str| serde_json::json!({ "app": v });
    let rows: Vec<(&str, u64, serde_json::Value, Option<serde_json::Value>, bool)> = r
        .top_blocked
        .iter()
        .map(|r| {
            (r.src_address.as_str(), r.connections, r.labels_then.clone(), r.labels_now.clone(), r.relabelled)
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("10.5.0.1", 5, app("batch"), Some(app("etl")), true),
            ("10.5.0.3", 4, app("old"), Some(app("new")), true),
            ("10.5.0.1", 3, app("etl"), Some(app("etl")), false),
            ("10.5.0.2", 2, app("api"), Some(app("api")), false),
        ]
    );
    let relabelled: Vec<(&str, &serde_json::Value)> =
        r.top_relabelled.iter().map(|r| (r.src_address.as_str(), &r.labels_then)).collect();
    assert_eq!((r.relabelled, relabelled), (2, vec![("10.5.0.1", &app("batch")), ("10.5.0.3", &app("old"))]));
}

/// Whole UTC days of a range are read from the day sums the roll-up job keeps (`flow_key_days`),
/// the partial days around them from the hourly rollups and the raw records: a key seen on
/// several days, in a late window of a day rolled up before and in a window not rolled up yet
/// sums to exactly what its raw records hold, whichever range is asked.
#[tokio::test]
async fn impact_reads_whole_days_from_day_sums() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dst = register(pool, "web-1").await;
    let now = Utc::now();
    let today = now.duration_trunc(TimeDelta::days(1)).unwrap().timestamp_millis();
    let day = 24 * HOUR;
    testing::installed(pool, dst, &[(1, Mode::Simulation, at(today - 4 * day))]).await.unwrap();
    let blocked = |src, n, at| flow(src, 8001, None, n, at);
    // 192.0.2.10 on the evening before the first whole day, twice on the first whole day, once
    // on the second; 192.0.2.20 on the second whole day only.
    for (start, src, n) in [
        (today - 3 * day + 22 * HOUR, "192.0.2.10", 1),
        (today - 2 * day + HOUR, "192.0.2.10", 2),
        (today - 2 * day + 5 * HOUR, "192.0.2.10", 3),
        (today - day + 2 * HOUR, "192.0.2.10", 5),
        (today - day + 3 * HOUR, "192.0.2.20", 7),
    ] {
        ingest(pool, dst, 1, start, vec![blocked(src, n, start)], vec![]).await;
    }
    assert_eq!(flows::roll_up(pool, now).await.unwrap(), 5);
    // A late window of the first whole day, rolled up by the next run: added to its day sums.
    let late = today - 2 * day + 7 * HOUR;
    ingest(pool, dst, 1, late, vec![blocked("192.0.2.10", 11, late)], vec![]).await;
    assert_eq!(flows::roll_up(pool, now).await.unwrap(), 1);
    let day_rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT new_connections, records FROM flow_key_days WHERE workload_id = $1 AND src_address = '192.0.2.10'
         ORDER BY day",
    )
    .bind(dst.uuid())
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(day_rows, [(1, 1), (16, 3), (5, 1)], "one row per key and day, the late window added");
    // And one not rolled up yet, in the open hour.
    let open = now.duration_trunc(TimeDelta::hours(1)).unwrap().timestamp_millis();
    ingest(pool, dst, 1, open, vec![blocked("192.0.2.10", 13, open)], vec![]).await;

    let none = innerwall_wire::testing::rule("other", Protocol::Tcp, &[9999], &["203.0.113.0/24"]);
    let proposed = BTreeMap::from([(dst, WorkloadPolicy::new(2, Mode::Enforcement, [none]).unwrap())]);
    let mut conn = pool.acquire().await.unwrap();
    // Ranges with whole days and partial days at either end, one within a day, one of days only,
    let ranges = [
        (today - 3 * day + 20 * HOUR, now.timestamp_millis() + HOUR),
        (today - 3 * day + 22 * HOUR + 30 * 60_000, today - day + 3 * HOUR),
        (today - 2 * day + 4 * HOUR, today - 2 * day + 8 * HOUR),
        (today - 2 * day, today),
        // Ending inside the first whole day: before its late window (so its day sums hold more
        // than the range), then after it (so they hold just the range's hours of it).
        (today - 3 * day + 20 * HOUR, today - 2 * day + 6 * HOUR),
        (today - 3 * day + 20 * HOUR, today - 2 * day + 8 * HOUR),
    ];
    for (from, to) in ranges {
        let range = Range { from: at(from), to: at(to) };
        let impact = foresight::impact(&mut conn, &proposed, range, 10).await.unwrap();
        let r = &impact.workloads[0].replayed;
        let mut reported: Vec<(String, i64, i64)> = r
            .top_blocked
            .iter()
            .map(|row| (row.src_address.clone(), row.connections as i64, row.records as i64))
            .collect();
        reported.sort();
        // What the raw records of the range hold, summed per source.
        let raw: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT host(src_address), sum(new_connections)::bigint, count(*) FROM flow_records
             WHERE workload_id = $1 AND window_start >= $2 AND window_start < $3 GROUP BY 1 ORDER BY 1",
        )
        .bind(dst.uuid())
        .bind(range.from)
        .bind(range.to)
        .fetch_all(pool)
        .await
        .unwrap();
        assert!(!raw.is_empty());
        assert_eq!(reported, raw, "range {} .. {}", range.from, range.to);
        assert_eq!(r.newly_blocked, raw.len() as u64);
    }
}

/// A flow of `protocol` (tcp, udp or icmp, then port 0) from `src`, would-block.
fn flow_of(src: &str, protocol: proto::Protocol, port: u32, connections: u64, at: i64) -> proto::FlowRecord {
    let mut record = recorded::flow_to(src, "10.9.0.1", port, None, connections, at);
    record.protocol = protocol.into();
    record
}

/// A ten-minute window of `id` under `version` from `start`, ingested.
async fn ingest_short(
    pool: &sqlx::PgPool,
    id: WorkloadId,
    version: u64,
    start: i64,
    records: Vec<proto::FlowRecord>,
) {
    let window = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: start,
        end_unix_ms: start + 10 * 60_000,
        policy_version: version,
        mode: 2,
        records,
        gaps: vec![],
    };
    flows::ingest(pool, id, &FlowWindow::try_from(&window).unwrap()).await.unwrap();
}

/// The narrowed read (only the keys a change can affect, or of relabelled peers, replayed; the
/// rest counted from `flow_key_lasts`) answers exactly what replaying every key answers: for
/// random proposals over several workloads at once (peers narrowed and widened, ports changed,
/// rules of other protocols added and removed, IPv6 peers, mode changes only, nothing applied),
/// over flows in whole days, partial days, a partial first hour, late and pending windows, with a
/// peer relabelled since.
#[tokio::test]
async fn impact_narrowed_read_equals_full_replay() {
    use innerwall_control_plane::foresight::impact::{Read, impact_read};
    use innerwall_wire::policy::{Cidr, PortRange, ResolvedRule, RuleId};

    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dsts = [
        register(pool, "web-1").await,
        register(pool, "web-2").await,
        register(pool, "web-3").await,
        register(pool, "web-4").await,
    ];
    let fresh = register(pool, "web-5").await;
    // v3 of every web workload: tcp/8001 and tcp/8002 from 192.0.2.0/24.
    testing::add_web_port(pool, 1).await.unwrap();
    testing::add_web_port(pool, 2).await.unwrap();
    let relabelled = peer(pool, &["app=batch"], "10.5.0.1").await;
    peer(pool, &["app=api"], "10.5.0.2").await;
    let now = Utc::now();
    let hour = now.duration_trunc(TimeDelta::hours(1)).unwrap().timestamp_millis();
    let from = hour - 3 * 24 * HOUR + 30 * 60_000;
    // Installed everywhere, applied (acknowledged) everywhere but on web-5.
    testing::installed(pool, fresh, &[(3, Mode::Simulation, at(from - 2 * HOUR))]).await.unwrap();
    for id in dsts {
        testing::installed(pool, id, &[(3, Mode::Simulation, at(from - 2 * HOUR))]).await.unwrap();
        sqlx::query("UPDATE workloads SET applied_version = 3 WHERE id = $1")
            .bind(id.uuid())
            .execute(pool)
            .await
            .unwrap();
    }
    use proto::Protocol::{Icmp, Tcp, Udp};
    let sources = ["192.0.2.5", "192.0.2.77", "198.51.100.7", "10.5.0.1", "10.5.0.2", "203.0.113.9"];
    let services = [(Tcp, 8001), (Tcp, 8002), (Tcp, 8005), (Tcp, 22), (Udp, 53), (Icmp, 0)];
    // Windows from before the range (the hour its start falls in) over the whole days to the last
    // closed hour; each a different mix of keys per workload.
    let starts = [
        from - 20 * 60_000,
        from + 10 * 60_000,
        from + 5 * HOUR,
        from + 30 * HOUR,
        from + 50 * HOUR,
        hour - 2 * HOUR,
        hour - HOUR,
    ];
    let mut n = 0usize;
    let mut records = |salt: usize, start: i64| -> Vec<proto::FlowRecord> {
        let mut out = Vec::new();
        for (i, src) in sources.iter().enumerate() {
            for (j, (protocol, port)) in services.iter().enumerate() {
                n += 1;
                if (i * 7 + j * 3 + salt).is_multiple_of(4) {
                    out.push(flow_of(src, *protocol, *port, 1 + (n % 5) as u64, start));
                }
            }
        }
        out.push(flow_of("2001:db8::5", Tcp, 8001, 2, start));
        out
    };
    for (k, start) in starts.iter().enumerate() {
        for (w, id) in dsts.iter().chain([&fresh]).enumerate() {
            ingest_short(pool, *id, 3, *start, records(k + w, *start)).await;
        }
    }
    assert!(flows::roll_up(pool, now).await.unwrap() >= starts.len() as u64);
    // A late window of an hour rolled up before (not rolled up yet), one in the open hour, and
    // the relabel after them.
    let late = from + 30 * HOUR + 15 * 60_000;
    let open = Utc::now().timestamp_millis() - 30_000;
    for id in dsts.iter().chain([&fresh]) {
        ingest_short(pool, *id, 3, late, records(11, late)).await;
        let window = proto::FlowWindow {
            staged_set: String::new(),
            window_id: uuid::Uuid::new_v4().to_string(),
            start_unix_ms: open,
            end_unix_ms: open + 29_000,
            policy_version: 3,
            mode: 2,
            records: records(13, open),
            gaps: vec![],
        };
        flows::ingest(pool, *id, &FlowWindow::try_from(&window).unwrap()).await.unwrap();
    }
    relabel(pool, relabelled, "app=etl").await;

    // Proposals drawn from rules over the same services and peers (xorshift, fixed seed).
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    let mut conn = pool.acquire().await.unwrap();
    let v3 = store::persisted_policy(&mut conn, dsts[0]).await.unwrap().unwrap().0;
    let peers = [
        "192.0.2.0/24",
        "192.0.2.0/28",
        "198.51.100.0/24",
        "10.5.0.1/32",
        "10.5.0.0/16",
        "0.0.0.0/0",
        "2001:db8::/32",
    ];
    let ports: [&[(u32, u32)]; 4] =
        [&[(8001, 8001)], &[(8001, 8002)], &[(8000, 8010)], &[(22, 22), (8002, 8002)]];
    let range = Range { from: at(from), to: at(now.timestamp_millis() + 60_000) };
    let mut seen = [0u64; 5];
    for case in 0..30 {
        let mut proposed = BTreeMap::new();
        for (w, id) in dsts.iter().chain([&fresh]).enumerate() {
            // Each applied rule kept, dropped, given other peers (some kept) or other ports.
            let mut rules = Vec::new();
            for rule in v3.rules() {
                let mut chosen: Vec<Cidr> =
                    peers.iter().filter(|_| next(3) == 0).map(|c| Cidr::parse(c).unwrap()).collect();
                match next(4) {
                    0 => rules.push(rule.clone()),
                    1 => {}
                    2 => {
                        chosen.extend(rule.peers().iter().filter(|_| next(2) == 0));
                        rules.push(
                            ResolvedRule::new(rule.id().clone(), rule.ports().to_vec(), chosen).unwrap(),
                        );
                    }
                    _ => {
                        let ranges =
                            ports[next(4) as usize].iter().map(|(a, b)| PortRange::new(*a, *b).unwrap());
                        rules.push(
                            ResolvedRule::new(rule.id().clone(), ranges, rule.peers().clone()).unwrap(),
                        );
                    }
                }
            }
            for (r, protocol) in [Protocol::Tcp, Protocol::Udp, Protocol::Icmp].into_iter().enumerate() {
                if next(2) == 0 {
                    continue;
                }
                let chosen: Vec<Cidr> =
                    peers.iter().filter(|_| next(3) == 0).map(|c| Cidr::parse(c).unwrap()).collect();
                let ranges: Vec<PortRange> = match protocol {
                    Protocol::Icmp => vec![],
                    Protocol::Udp => vec![PortRange::new(53, 53).unwrap()],
                    _ => {
                        ports[next(4) as usize].iter().map(|(a, b)| PortRange::new(*a, *b).unwrap()).collect()
                    }
                };
                let id = RuleId::new(&format!("case-{r}"), protocol).unwrap();
                rules.push(ResolvedRule::new(id, ranges, chosen).unwrap());
            }
            // Now and then the applied rules under another mode only.
            let mode = [Mode::Visibility, Mode::Simulation, Mode::Enforcement][next(3) as usize];
            let policy = match (case + w) % 7 {
                0 => v3.clone().with_mode(Mode::Enforcement).with_version(4),
                _ => WorkloadPolicy::new(4, mode, rules).unwrap(),
            };
            proposed.insert(*id, policy);
        }
        let (narrowed, read) = impact_read(&mut conn, &proposed, range, 3, Read::Narrowed).await.unwrap();
        assert_eq!(read, Read::Narrowed, "case {case}: the range ends now, so the read is narrowed");
        let (full, read) = impact_read(&mut conn, &proposed, range, 3, Read::Full).await.unwrap();
        assert_eq!(read, Read::Full);
        assert_eq!(narrowed, full, "case {case}: {proposed:#?}");
        for w in &full.workloads {
            let r = &w.replayed;
            for (i, count) in
                [r.newly_blocked, r.newly_allowed, r.unchanged, r.relabelled, w.unseen_admission_count]
                    .into_iter()
                    .enumerate()
            {
                seen[i] += count;
            }
        }
    }
    assert!(seen.iter().all(|&n| n > 0), "every count was exercised: {seen:?}");
    // A range ending in the past (rollups after it) is read whole.
    let past = Range { from: at(from), to: at(hour - 2 * HOUR) };
    let proposed = BTreeMap::from([(dsts[0], v3.clone().with_mode(Mode::Enforcement).with_version(4))]);
    let (_, read) = impact_read(&mut conn, &proposed, past, 3, Read::Narrowed).await.unwrap();
    assert_eq!(read, Read::Full);
}

/// When a day's partitions expire, the last hours of keys seen only on that day are left behind
/// until the roll-up job deletes them; a narrowed impact reaching back past the oldest rollup
/// does not count them in between, and answers what the full replay answers.
#[tokio::test]
async fn impact_counts_no_key_whose_rollups_expired() {
    use innerwall_control_plane::foresight::impact::{Read, impact_read};

    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dst = register(pool, "web-1").await;
    let now = Utc::now();
    let today = now.duration_trunc(TimeDelta::days(1)).unwrap().timestamp_millis();
    let day = 24 * HOUR;
    testing::installed(pool, dst, &[(1, Mode::Simulation, at(today - 5 * day))]).await.unwrap();
    sqlx::query("UPDATE workloads SET applied_version = 1 WHERE id = $1")
        .bind(dst.uuid())
        .execute(pool)
        .await
        .unwrap();
    let blocked = |src, at| flow(src, 8001, None, 1, at);
    // 192.0.2.30 only on the day that expires; 192.0.2.10 then and later; 192.0.2.20 later only.
    let old = today - 3 * day + HOUR;
    ingest_short(pool, dst, 1, old, vec![blocked("192.0.2.30", old), blocked("192.0.2.10", old)]).await;
    let later = today - day + HOUR;
    ingest_short(pool, dst, 1, later, vec![blocked("192.0.2.10", later), blocked("192.0.2.20", later)]).await;
    assert_eq!(flows::roll_up(pool, now).await.unwrap(), 2);
    let lasts = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM flow_key_lasts").fetch_one(pool).await.unwrap()
    };
    assert_eq!(lasts().await, 3);
    let dropped = flows::apply_retention(pool, 2, now).await.unwrap();
    assert!(dropped.iter().any(|p| p.starts_with("flow_rollups_")), "{dropped:?}");
    assert_eq!(lasts().await, 3, "the expired key's last hour is still there");

    let none = innerwall_wire::testing::rule("other", Protocol::Tcp, &[9999], &["203.0.113.0/24"]);
    let proposed = BTreeMap::from([(dst, WorkloadPolicy::new(2, Mode::Enforcement, [none]).unwrap())]);
    let range = Range { from: at(today - 4 * day), to: at(now.timestamp_millis() + 60_000) };
    let mut conn = pool.acquire().await.unwrap();
    let (narrowed, read) = impact_read(&mut conn, &proposed, range, 5, Read::Narrowed).await.unwrap();
    assert_eq!(read, Read::Narrowed);
    let (full, _) = impact_read(&mut conn, &proposed, range, 5, Read::Full).await.unwrap();
    assert_eq!(narrowed, full);
    assert_eq!((narrowed.keys, narrowed.workloads[0].replayed.unchanged), (2, 2));
    // The job's next run deletes it.
    assert_eq!(flows::roll_up(pool, now).await.unwrap(), 0);
    assert_eq!(lasts().await, 2);
}
