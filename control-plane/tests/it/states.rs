//! States judged when read (REL-3, issue 25) against a real Postgres: the SQL every reader uses
//! agrees with the pure rule (`shown::shown`), and a row stored SYNCED whose last
//! heartbeat is older than its stream's liveness reads OFFLINE through every reader — status,
//! the fleet list with a state filter, show, the metrics query and the verdict — with no sweep
//! ever having run.

use std::time::Duration;

use innerwall_control_plane::gate::verdict::Reason;
use innerwall_control_plane::gate::{self, Outcome, Params, Scope};
use innerwall_control_plane::metrics::Metrics;
use innerwall_control_plane::page::PageRequest;
use innerwall_control_plane::policy::store::{self, WorkloadFilter};
use innerwall_control_plane::shown;
use innerwall_control_plane::sync::liveness;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use innerwall_wire::sync::SyncState;
use sqlx::PgPool;

use crate::publish::register;

/// Stores `state` on `id` as a replica would have, last heard of `seen_ago` ago, on a stream
/// tolerating 90 s of silence, and applied at its latest version.
async fn store_state(pool: &PgPool, id: WorkloadId, state: SyncState, seen_ago: Duration, detail: &str) {
    sqlx::query(
        "UPDATE workloads w SET sync_state = $2, sync_detail = $3,
             last_seen_at = now() - make_interval(secs => $4), stream_liveness = interval '90 seconds',
             applied_version = (SELECT version FROM workload_policies p WHERE p.workload_id = w.id)
         WHERE id = $1",
    )
    .bind(id.uuid())
    .bind(state.code())
    .bind(detail)
    .bind(seen_ago.as_secs_f64())
    .execute(pool)
    .await
    .unwrap();
}

fn page_filter(state: SyncState) -> WorkloadFilter {
    WorkloadFilter { sync_state: Some(state), ..Default::default() }
}

async fn listed(pool: &PgPool, state: SyncState) -> Vec<String> {
    let mut conn = pool.acquire().await.unwrap();
    let page = store::workload_page(&mut conn, &page_filter(state), &PageRequest::first(100)).await.unwrap();
    page.rows.into_iter().map(|r| format!("{} {}", r.hostname, r.sync_state)).collect()
}

/// A case as stored, with the state the SQL shows: host, stored state, last seen, liveness.
type Case =
    (String, i16, Option<chrono::DateTime<chrono::Utc>>, Option<sqlx::postgres::types::PgInterval>, i16);

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn shown_state_sql_agrees_with_the_rule() {
    let db = fresh_database().await.unwrap();
    let cases: Vec<(SyncState, Option<i64>, Option<i64>)> = [
        SyncState::Pending,
        SyncState::Synced,
        SyncState::Degraded,
        SyncState::Offline,
        SyncState::Suspended,
    ]
    .into_iter()
    .flat_map(|s| {
        [(Some(3_600), Some(90)), (Some(10), Some(90)), (None, Some(90)), (Some(3_600), None), (None, None)]
            .map(|(seen, live)| (s, seen, live))
    })
    .collect();
    let mut tx = db.pool.begin().await.unwrap();
    for (i, (state, seen, live)) in cases.iter().enumerate() {
        sqlx::query(
            "INSERT INTO workloads (id, hostname, sync_state, last_seen_at, stream_liveness)
             VALUES ($1, $2, $3, now() - make_interval(secs => $4), make_interval(secs => $5))",
        )
        .bind(uuid::Uuid::new_v4())
        .bind(format!("case-{i:02}"))
        .bind(state.code())
        .bind(seen.map(|s| s as f64))
        .bind(live.map(|s| s as f64))
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    // One transaction: `now()` is the same for every row and for the rule's `now`.
    let now: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await.unwrap();
    let sql = format!(
        "SELECT w.hostname, w.sync_state, w.last_seen_at, w.stream_liveness, {} FROM {} ORDER BY 1",
        shown::STATE,
        shown::ROWS
    );
    let rows: Vec<Case> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&mut *tx).await.unwrap();
    assert_eq!(rows.len(), cases.len());
    let mut offline = 0;
    for (host, stored, seen, live, from_sql) in rows {
        let live =
            live.map(|i| chrono::Duration::microseconds(i.microseconds + i64::from(i.days) * 86_400_000_000));
        let expected = shown::shown(SyncState::from_code(stored).unwrap(), false, false, seen, live, now);
        assert_eq!(SyncState::from_code(from_sql).unwrap(), expected, "{host}: SQL and rule disagree");
        offline += usize::from(expected == SyncState::Offline);
    }
    // Every stored state silent past its liveness, plus the rows stored OFFLINE otherwise.
    assert_eq!(offline, 5 + 4, "the cases cover both outcomes");
}

#[tokio::test]
async fn silent_synced_row_reads_offline_in_every_reader() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let silent = register(pool, "silent", &["app=web"], &["10.0.0.1"]).await;
    let alive = register(pool, "alive", &["app=web"], &["10.0.0.2"]).await;
    for id in [silent, alive] {
        sqlx::query("UPDATE workloads SET mode = $2 WHERE id = $1")
            .bind(id.uuid())
            .bind(Mode::Simulation.code())
            .execute(pool)
            .await
            .unwrap();
    }
    // Both stored SYNCED by a replica that is gone; one was last heard of an hour ago.
    store_state(pool, silent, SyncState::Synced, Duration::from_secs(3_600), "").await;
    store_state(pool, alive, SyncState::Synced, Duration::ZERO, "").await;
    let sweeps: i64 =
        sqlx::query_scalar("SELECT count(*) FROM liveness_sweeps").fetch_one(pool).await.unwrap();
    assert_eq!(sweeps, 0, "no sweep has run");

    // Status, one and all.
    let mut conn = pool.acquire().await.unwrap();
    let status = store::sync_status_of(&mut conn, silent).await.unwrap();
    assert_eq!(status.state.0, SyncState::Offline);
    assert!(
        status.detail.starts_with("no heartbeat since ")
            && status.detail.contains("no heartbeat for three intervals (90 s)")
            && status.detail.contains("no replica has ever swept"),
        "{}",
        status.detail
    );
    assert_eq!(store::sync_status_of(&mut conn, alive).await.unwrap().state.0, SyncState::Synced);
    let page = store::sync_status_page(&mut conn, &PageRequest::first(10)).await.unwrap();
    let states: Vec<(String, SyncState)> =
        page.rows.iter().map(|v| (v.hostname.clone(), v.state.0)).collect();
    assert_eq!(states, [("alive".to_owned(), SyncState::Synced), ("silent".to_owned(), SyncState::Offline)]);

    // The fleet list: the state filter and the attention order see the shown state.
    assert_eq!(listed(pool, SyncState::Offline).await, ["silent OFFLINE"]);
    assert_eq!(listed(pool, SyncState::Synced).await, ["alive SYNCED"]);
    let all =
        store::workload_page(&mut conn, &WorkloadFilter::default(), &PageRequest::first(10)).await.unwrap();
    let order: Vec<&str> = all.rows.iter().map(|r| r.hostname.as_str()).collect();
    assert_eq!(order, ["silent", "alive"], "offline comes before synced");

    // Show.
    let view = store::workload_view(&mut conn, silent).await.unwrap();
    assert_eq!(view.sync_state, "OFFLINE");
    assert!(view.sync_detail.starts_with("no heartbeat since "), "{}", view.sync_detail);
    assert_eq!(store::workload_view(&mut conn, alive).await.unwrap().sync_state, "SYNCED");
    drop(conn);

    // The metrics query, at scrape time.
    let text = Metrics::new().scrape(pool).await;
    assert_eq!(sample(&text, "innerwall_workloads_by_sync_state{state=\"OFFLINE\"}"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "innerwall_workloads_by_sync_state{state=\"SYNCED\"}"), Some(1.0), "{text}");

    // The verdict.
    let now = chrono::Utc::now().timestamp_millis();
    let params = Params::ending_at(now, Duration::from_secs(3_600), Duration::from_secs(60)).unwrap();
    let verdict = gate::judge(pool, &Scope::ids(vec![silent, alive]).unwrap(), &params).await.unwrap();
    assert_ne!(verdict.outcome, Outcome::Safe);
    let reasons = |id: WorkloadId| verdict.workloads.iter().find(|w| w.id == id).unwrap().reasons.clone();
    assert!(reasons(silent).contains(&Reason::Offline), "{:?}", reasons(silent));
    assert!(!reasons(alive).contains(&Reason::Offline), "{:?}", reasons(alive));

    // A sweep stores what readers already showed, and is recorded; a row gone silent after it
    // names when it ran.
    let swept = liveness::sweep(pool).await.unwrap();
    assert_eq!(swept, [silent]);
    let at: String =
        sqlx::query_scalar("SELECT to_char(swept_at AT TIME ZONE 'UTC', 'YYYY-MM-DD') FROM liveness_sweeps")
            .fetch_one(pool)
            .await
            .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let status = store::sync_status_of(&mut conn, silent).await.unwrap();
    assert_eq!(status.state.0, SyncState::Offline);
    assert!(status.detail.starts_with("silent since "), "the sweep's own detail: {}", status.detail);
    store_state(pool, alive, SyncState::Suspended, Duration::from_secs(600), "kill switch engaged").await;
    let status = store::sync_status_of(&mut conn, alive).await.unwrap();
    assert_eq!(status.state.0, SyncState::Offline, "silence dominates SUSPENDED");
    assert!(status.detail.contains(&format!("no replica has swept since {at} ")), "{}", status.detail);
}

/// A row stored SYNCED whose applied version is behind its persisted policy reads PENDING in
/// every reader, from the render's commit on: no replica records PENDING before it sends a
/// delta (PERF-2), so the readers judge it.
#[tokio::test]
async fn synced_behind_its_persisted_version_reads_pending_in_every_reader() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let behind = register(pool, "behind", &["app=web"], &["10.0.0.1"]).await;
    let current = register(pool, "current", &["app=web"], &["10.0.0.2"]).await;
    for id in [behind, current] {
        store_state(pool, id, SyncState::Synced, Duration::ZERO, "").await;
    }
    // The agent's acknowledged version, moved by `by`.
    let acknowledge = async |by: i64| {
        sqlx::query("UPDATE workloads SET applied_version = applied_version + $2 WHERE id = $1")
            .bind(behind.uuid())
            .bind(by)
            .execute(pool)
            .await
            .unwrap();
    };
    // The agent acknowledged the version before the latest (a render persisted one since).
    acknowledge(-1).await;

    let mut conn = pool.acquire().await.unwrap();
    let status = store::sync_status_of(&mut conn, behind).await.unwrap();
    assert_eq!(status.state.0, SyncState::Pending);
    assert_eq!(status.applied_version + 1, status.latest_version.unwrap());
    assert_eq!(store::sync_status_of(&mut conn, current).await.unwrap().state.0, SyncState::Synced);
    assert_eq!(listed(pool, SyncState::Pending).await, ["behind PENDING"]);
    assert_eq!(listed(pool, SyncState::Synced).await, ["current SYNCED"]);
    assert_eq!(store::workload_view(&mut conn, behind).await.unwrap().sync_state, "PENDING");
    drop(conn);
    let text = Metrics::new().scrape(pool).await;
    assert_eq!(sample(&text, "innerwall_workloads_by_sync_state{state=\"PENDING\"}"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "innerwall_workloads_by_sync_state{state=\"SYNCED\"}"), Some(1.0), "{text}");

    // The ack of the latest is recorded: SYNCED again, with nothing else written.
    acknowledge(1).await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(store::sync_status_of(&mut conn, behind).await.unwrap().state.0, SyncState::Synced);
}

/// Every row the scans in `plan` read from `relation`: those they returned and those their
/// filters (or a bitmap's recheck) removed, over all loops.
fn rows_read(plan: &serde_json::Value, relation: &str) -> f64 {
    let own = if plan["Relation Name"] == relation && plan["Node Type"] != "ModifyTable" {
        let n = |key: &str| plan[key].as_f64().unwrap_or(0.0);
        (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Index Recheck"))
            * n("Actual Loops")
    } else {
        0.0
    };
    let children =
        plan["Plans"].as_array().map(|p| p.iter().map(|c| rows_read(c, relation)).sum()).unwrap_or(0.0);
    own + children
}

/// SYNC-6 at fleet scale (issue 33, item 1): the sweep every replica runs once per heartbeat
/// interval reads the rows past their deadline, not every live stream's row.
#[tokio::test]
async fn the_liveness_sweep_reads_only_rows_past_their_deadline() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    // 5,000 live streams, three silent for an hour, two silent and OFFLINE already, one never on
    // a stream.
    sqlx::raw_sql(
        "INSERT INTO workloads (id, hostname, sync_state, last_seen_at, stream_liveness)
         SELECT gen_random_uuid(), 'live-' || g, 2, now(), interval '90 seconds' FROM generate_series(1, 5000) g;
         INSERT INTO workloads (id, hostname, sync_state, last_seen_at, stream_liveness)
         SELECT gen_random_uuid(), 'silent-' || g, CASE WHEN g <= 3 THEN 2 ELSE 4 END, now() - interval '1 hour',
                interval '90 seconds'
         FROM generate_series(1, 5) g;
         INSERT INTO workloads (id, hostname) VALUES (gen_random_uuid(), 'never');
         ANALYZE workloads;",
    )
    .execute(pool)
    .await
    .unwrap();

    let mut tx = pool.begin().await.unwrap();
    let explained: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) {}",
        liveness::SWEEP
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let plan = &explained[0]["Plan"];
    assert_eq!(rows_read(plan, "workloads"), 3.0, "the sweep read more than the silent rows: {plan:#}");

    let mut swept: Vec<String> = Vec::new();
    for id in liveness::sweep(pool).await.unwrap() {
        let host: String =
            sqlx::query_scalar("SELECT hostname FROM workloads WHERE id = $1 AND sync_state = 4")
                .bind(id.uuid())
                .fetch_one(pool)
                .await
                .unwrap();
        swept.push(host);
    }
    swept.sort();
    assert_eq!(swept, ["silent-1", "silent-2", "silent-3"]);
    assert!(liveness::sweep(pool).await.unwrap().is_empty(), "a second sweep finds nothing new");
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM workloads WHERE sync_state = 2")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(live, 5_000);
}
