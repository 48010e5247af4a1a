//! Retention of the control plane's own tables (issue 25) against a real Postgres: old audit
//! records, superseded history, orphan contents, replaced label sets, long-retired workloads and
//! dead tokens go; a version that a promotion record, a retained flow window or the workload
//! itself refers to stays, and so does a retired workload a promotion names. A run deletes in
//! batches until done, and a referenced content cannot be deleted at all.

use innerwall_control_plane::flows::ensure_partitions;
use innerwall_control_plane::gate::{self, Params, Scope};
use innerwall_control_plane::policy::{authoring, store};
use innerwall_control_plane::retention::{self, Removed, Retention};
use innerwall_control_plane::testing::{add_web_port, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::WorkloadPolicy;
use sqlx::PgPool;
use uuid::Uuid;

use crate::publish::register;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
}

async fn history(pool: &PgPool, id: WorkloadId) -> Vec<u64> {
    let mut conn = pool.acquire().await.unwrap();
    store::policy_history(&mut conn, id).await.unwrap().iter().map(WorkloadPolicy::version).collect()
}

async fn retire(pool: &PgPool, id: WorkloadId, days_ago: i32) {
    innerwall_control_plane::foresight::commit(pool, "test", "workload.retire", &id.to_string(), async |c| {
        authoring::retire(c, id).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    sqlx::query("UPDATE workloads SET retired_at = now() - make_interval(days => $2) WHERE id = $1")
        .bind(id.uuid())
        .bind(days_ago)
        .execute(pool)
        .await
        .unwrap();
}

async fn token(pool: &PgPool, table: &str, expired_days_ago: i32) {
    let sql = match table {
        "provisioning_tokens" => {
            "INSERT INTO provisioning_tokens (id, token_hash, prefix_hint, expires_at)
             VALUES ($1, sha256($1::text::bytea), 'iwt_', now() - make_interval(days => $2))"
        }
        _ => {
            "INSERT INTO operator_tokens (id, name, role, token_hash, created_by, expires_at)
             VALUES (substr(replace($1::text, '-', ''), 1, 8), 'op-' || substr(replace($1::text, '-', ''), 1, 8),
                     'viewer', sha256($1::text::bytea), 'test', now() - make_interval(days => $2))"
        }
    };
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(Uuid::new_v4())
        .bind(expired_days_ago)
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn control_plane_retention_keeps_what_evidence_needs() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = register(pool, "web-1", &["app=web"], &["10.0.0.1"]).await;
    for n in 1..=4 {
        add_web_port(pool, n).await.unwrap();
    }
    assert_eq!(history(pool, web).await, [1, 2, 3, 4, 5]);
    // Every version rendered long ago, in order, the latest (v5) too; the agent holds v5.
    sqlx::raw_sql(
        "UPDATE workload_policy_history SET rendered_at = now() - make_interval(days => 300 - version::int);
         UPDATE workload_policies SET rendered_at = now() - interval '295 days';
         UPDATE workloads SET applied_version = 5",
    )
    .execute(pool)
    .await
    .unwrap();
    // v1 explains a retained flow window; v2 a promotion record's verdict (replayed evidence).
    let start = chrono::Utc::now() - chrono::Duration::hours(1);
    let mut conn = pool.acquire().await.unwrap();
    ensure_partitions(&mut conn, start, start).await.unwrap();
    drop(conn);
    sqlx::query(
        "INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode,
                                   record_count, gap_count)
         VALUES ($1, $2, $3, $3 + interval '1 minute', 1, 2, 0, 0)",
    )
    .bind(web.uuid())
    .bind(Uuid::new_v4())
    .bind(start)
    .execute(pool)
    .await
    .unwrap();
    // The verdict as the gate serializes it onto a promotion record, naming v2 as replayed.
    let params = Params::ending_at(
        chrono::Utc::now().timestamp_millis(),
        std::time::Duration::from_secs(3600),
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let verdict = gate::judge(pool, &Scope::ids(vec![web]).unwrap(), &params).await.unwrap();
    let mut verdict = serde_json::to_value(&verdict).unwrap();
    assert_eq!(verdict["workloads"][0]["latest_version"], 5, "{verdict}");
    verdict["workloads"][0]["evidence"]["replayed_from"] = serde_json::json!([2]);

    // Retired workloads: one long ago that nothing names, one a promotion names, one recent.
    let gone = register(pool, "gone", &["app=db"], &["10.0.1.1"]).await;
    let promoted = register(pool, "promoted", &["app=db"], &["10.0.1.2"]).await;
    let recent = register(pool, "recent", &["app=db"], &["10.0.1.3"]).await;
    retire(pool, gone, 200).await;
    retire(pool, promoted, 200).await;
    retire(pool, recent, 10).await;
    sqlx::query(
        "INSERT INTO promotions (id, actor, reason, to_mode, scope, expected_count, workloads, verdict)
         VALUES ($1, 'test', 'tested', 3, 'ids', 2, $2, $3)",
    )
    .bind(Uuid::new_v4())
    .bind(serde_json::json!([
        {"id": web.to_string(), "hostname": "web-1", "mode": "simulation"},
        {"id": promoted.to_string(), "hostname": "promoted", "mode": "simulation"},
    ]))
    .bind(&verdict)
    .execute(pool)
    .await
    .unwrap();

    // Label sets replaced long ago, and one replaced recently; the current set stays.
    for (expected, label) in [(1, "tier=a"), (2, "tier=b"), (3, "tier=c")] {
        innerwall_control_plane::foresight::commit(
            pool,
            "test",
            "workload.label",
            &web.to_string(),
            async |c| {
                authoring::edit_labels(c, web, expected, &[label.parse().unwrap()], &[]).await?;
                Ok(((), serde_json::json!({})))
            },
        )
        .await
        .unwrap();
    }
    sqlx::query(
        "UPDATE workload_label_history SET valid_to = now() - interval '100 days',
             valid_from = least(valid_from, now() - interval '101 days')
         WHERE workload_id = $1 AND label_version < 3",
    )
    .bind(web.uuid())
    .execute(pool)
    .await
    .unwrap();

    // Audit records: three old ones among the recent ones the changes above wrote.
    let recent_audit = count(pool, "SELECT count(*) FROM audit_log").await;
    sqlx::query(
        "INSERT INTO audit_log (at, actor, action, subject)
         SELECT now() - interval '400 days', 'test', 'old.thing', n::text FROM generate_series(1, 3) n",
    )
    .execute(pool)
    .await
    .unwrap();
    // Tokens: dead long ago, dead recently.
    for table in ["provisioning_tokens", "operator_tokens"] {
        token(pool, table, 60).await;
        token(pool, table, 5).await;
    }
    // A content nothing ever referred to.
    sqlx::query(
        "INSERT INTO policy_contents (digest, policy) VALUES (sha256('\\x00'::bytea), '\\x00'::bytea)",
    )
    .execute(pool)
    .await
    .unwrap();
    let contents = count(pool, "SELECT count(*) FROM policy_contents").await;
    // An authored source nothing refers to.
    sqlx::query("INSERT INTO policy_sources (digest, parts) VALUES (sha256('\\x01'::bytea), '\\x'::bytea)")
        .execute(pool)
        .await
        .unwrap();

    let removed = retention::apply(pool, &Retention::default(), chrono::Utc::now()).await.unwrap();
    // `gone` held v1 only (its content may be shared with `recent`'s, which stays).
    assert_eq!(
        removed,
        Removed {
            workloads: 1,
            policy_history: 2,
            label_history: 2,
            audit: 3,
            provisioning_tokens: 1,
            operator_tokens: 1,
            policy_contents: removed.policy_contents,
            policy_sources: removed.policy_sources,
        }
    );
    // The stray source went, and v3's and v4's if no kept version shares them; every kept
    // version's source stays.
    assert!(removed.policy_sources >= 1, "{removed:?}");
    assert_eq!(
        count(pool, "SELECT count(*) FROM policy_sources WHERE digest = sha256('\\x01'::bytea)").await,
        0
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM workload_policy_history h WHERE source_digest IS NULL
             OR NOT EXISTS (SELECT 1 FROM policy_sources s WHERE s.digest = h.source_digest)"
        )
        .await,
        0
    );
    assert_eq!(history(pool, web).await, [1, 2, 5], "v1 (a window), v2 (a promotion) and v5 (latest) stay");
    // v3 and v4 had contents of their own, and the stray one had none: all three went.
    assert!(removed.policy_contents >= 3, "{removed:?}");
    assert_eq!(
        count(pool, "SELECT count(*) FROM policy_contents").await,
        contents - removed.policy_contents as i64
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM (SELECT digest FROM workload_policies UNION SELECT digest FROM workload_policy_history) r
             WHERE NOT EXISTS (SELECT 1 FROM policy_contents c WHERE c.digest = r.digest)"
        )
        .await,
        0,
        "every row still finds its content"
    );
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(store::persisted_policy(&mut conn, web).await.unwrap().unwrap().0.version(), 5);
    drop(conn);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT hostname FROM workloads ORDER BY hostname").fetch_all(pool).await.unwrap();
    assert_eq!(left, ["promoted", "recent", "web-1"]);
    let labels: Vec<i64> = sqlx::query_scalar(
        "SELECT label_version FROM workload_label_history WHERE workload_id = $1 ORDER BY 1",
    )
    .bind(web.uuid())
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(labels, [3, 4], "the recently replaced set and the current one");
    assert_eq!(count(pool, "SELECT count(*) FROM audit_log WHERE action = 'old.thing'").await, 0);
    assert!(count(pool, "SELECT count(*) FROM audit_log").await >= recent_audit, "recent records stay");
    assert_eq!(count(pool, "SELECT count(*) FROM audit_log WHERE action = 'retention.run'").await, 1);
    assert_eq!(
        count(pool, "SELECT count(*) FROM provisioning_tokens WHERE expires_at < now() - interval '30 days'")
            .await,
        0
    );
    assert_eq!(count(pool, "SELECT count(*) FROM provisioning_tokens").await, 1, "the recent dead one");
    assert_eq!(count(pool, "SELECT count(*) FROM operator_tokens").await, 1);

    // The second run finds nothing left to delete, and audits nothing.
    let again = retention::apply(pool, &Retention::default(), chrono::Utc::now()).await.unwrap();
    assert_eq!(again, Removed::default());
    assert_eq!(count(pool, "SELECT count(*) FROM audit_log WHERE action = 'retention.run'").await, 1);
}

#[tokio::test]
async fn retention_deletes_more_than_a_batch_until_done() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    sqlx::raw_sql(
        "INSERT INTO audit_log (at, actor, action, subject)
         SELECT now() - interval '400 days', 'test', 'old.thing', n::text FROM generate_series(1, 250) n;
         INSERT INTO policy_contents (digest, policy)
         SELECT sha256(int4send(n)), int4send(n) FROM generate_series(1, 230) n",
    )
    .execute(pool)
    .await
    .unwrap();
    let retention = Retention { batch: 100, ..Retention::default() };
    let removed = retention::apply(pool, &retention, chrono::Utc::now()).await.unwrap();
    assert_eq!((removed.audit, removed.policy_contents), (250, 230));
    assert_eq!(count(pool, "SELECT count(*) FROM audit_log WHERE action = 'old.thing'").await, 0);
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 0);
    assert_eq!(retention::apply(pool, &retention, chrono::Utc::now()).await.unwrap(), Removed::default());
}

#[tokio::test]
async fn referenced_policy_content_cannot_be_deleted() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = register(pool, "web-1", &["app=web"], &["10.0.0.1"]).await;
    add_web_port(pool, 1).await.unwrap();
    // v1's content is referred to by history only, v2's by the latest row too.
    let digest = |version: i64| {
        sqlx::query_scalar::<_, Vec<u8>>(
            "SELECT digest FROM workload_policy_history WHERE workload_id = $1 AND version = $2",
        )
        .bind(web.uuid())
        .bind(version)
        .fetch_one(pool)
    };
    for version in [1, 2] {
        let d = digest(version).await.unwrap();
        let err = sqlx::query("DELETE FROM policy_contents WHERE digest = $1")
            .bind(&d)
            .execute(pool)
            .await
            .expect_err("a referenced content is kept");
        assert!(err.to_string().contains("is referred to by a rendered policy"), "v{version}: {err}");
    }
    let err = sqlx::query("UPDATE policy_contents SET policy = policy").execute(pool).await.unwrap_err();
    assert!(err.to_string().contains("never changed or deleted"), "{err}");
    let err = sqlx::query("TRUNCATE policy_contents CASCADE").execute(pool).await.unwrap_err();
    assert!(err.to_string().contains("never changed or deleted"), "{err}");
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 2);
    // An orphan may go.
    sqlx::query(
        "INSERT INTO policy_contents (digest, policy) VALUES (sha256('\\x01'::bytea), '\\x01'::bytea)",
    )
    .execute(pool)
    .await
    .unwrap();
    let n = sqlx::query("DELETE FROM policy_contents WHERE digest = sha256('\\x01'::bytea)")
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 1);
}

/// `innerwall retention`, run by hand through the real binary: the flow partitions past the
/// file's --flow-retention and the rows past theirs go, the summary says how many, a setting
/// that would lose history is refused having done nothing, and the run is audited by its actor.
#[tokio::test]
async fn retention_runs_by_hand() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let old = chrono::Utc::now() - chrono::Duration::days(40);
    let mut tx = pool.begin().await.unwrap();
    ensure_partitions(&mut tx, old, old).await.unwrap();
    tx.commit().await.unwrap();
    let partition = format!("flow_records_{}", old.format("%Y%m%d"));
    sqlx::query("INSERT INTO audit_log (at, actor, action, subject, detail) VALUES (now() - interval '400 days', 'x', 'old.thing', 's', '{}')")
        .execute(pool)
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("iw-retention-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("innerwall.toml");
    let innerwall = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .env_remove("INNERWALL_DATABASE_URL")
            .args(["--config", config.to_str().unwrap(), "--database-url", &db.url])
            .args(args)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };

    // History kept shorter than flow evidence would strand windows: refused, nothing done.
    std::fs::write(&config, "flow-retention = \"30d\"\npolicy-history-retention = \"7d\"\n").unwrap();
    let (code, _, err) = innerwall(&["retention"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--policy-history-retention (7 days) must be at least --flow-retention"), "{err}");
    let exists = format!("SELECT count(*) FROM pg_class WHERE relname = '{partition}'");
    assert_eq!(count(pool, &exists).await, 1, "a refused run dropped a partition");

    std::fs::write(&config, "flow-retention = \"30d\"\n").unwrap();
    let day = format!("SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_{}'", old.format("%Y%m%d"));
    let partitions = count(pool, &day).await;
    assert!(partitions >= 7, "{partitions}");
    let (code, out, err) = innerwall(&["retention"]);
    assert_eq!(code, Some(0), "{err}");
    let said = format!("retention applied: {partitions} flow partition(s) dropped");
    assert!(out.contains(&said) && out.contains("1 audit record(s)"), "{out}");
    assert_eq!(count(pool, &exists).await, 0, "the partition outlived the retention");
    // The second time: nothing left, and still audited.
    let (code, out, _) = innerwall(&["--json", "retention"]);
    assert_eq!(code, Some(0));
    let run: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(run["flow_partitions"].as_array().map(Vec::len), Some(0), "{run}");
    let runs = count(
        pool,
        "SELECT count(*) FROM audit_log WHERE action = 'retention.run' AND actor <> 'innerwall-retention'",
    )
    .await;
    assert_eq!(runs, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reported addresses, latest and history rows are checked per statement (migrations 0043 and
/// 0047: a probe per row, or one join for as many rows as a full render writes), with
/// the guarantees the foreign keys gave: each row refers to a workload that exists (and a policy
/// row to a content that is stored), else the statement is refused and changes nothing; neither
/// a workload's id nor a row's workload changes; deleting a workload deletes its rows; and a
/// delete waits for a transaction that wrote rows referring to it, then takes them too, so none
/// is left referring to nothing.
#[tokio::test]
async fn policy_rows_refer_to_existing_workloads_and_contents() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = register(pool, "web-1", &["app=web"], &["10.0.0.1"]).await;
    add_web_port(pool, 1).await.unwrap();
    let rows = "SELECT (SELECT count(*) FROM workload_addresses) * 1000000
                     + (SELECT count(*) FROM workload_policies) * 1000 + (SELECT count(*) FROM workload_policy_history)";
    let before = count(pool, rows).await;
    assert_eq!(before, 1_001_002, "one address, one latest row, two history rows");
    let refused = [
        (
            "INSERT INTO workload_addresses (workload_id, address) VALUES (gen_random_uuid(), '10.0.0.2')",
            "which does not exist",
        ),
        (
            "UPDATE workload_addresses SET workload_id = gen_random_uuid()",
            "workload of a workload_addresses row never changes",
        ),
        (
            "INSERT INTO workload_policies (workload_id, version, digest, rendered_at)
             SELECT gen_random_uuid(), 1, digest, now() FROM workload_policies",
            "which does not exist",
        ),
        (
            "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
             SELECT workload_id, 9, sha256('\\x01'::bytea), now() FROM workload_policies",
            "which is not stored",
        ),
        // As many rows as a full render writes (migration 0047: checked by a join, not probes).
        (
            "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
             SELECT CASE WHEN g = 20000 THEN gen_random_uuid() ELSE workload_id END, 100 + g, digest, now()
             FROM workload_policies, generate_series(1, 20000) g",
            "which does not exist",
        ),
        (
            "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
             SELECT workload_id, 100 + g, CASE WHEN g = 20000 THEN sha256('\\x01'::bytea) ELSE digest END, now()
             FROM workload_policies, generate_series(1, 20000) g",
            "which is not stored",
        ),
        ("UPDATE workload_policies SET digest = sha256('\\x01'::bytea)", "which is not stored"),
        ("UPDATE workload_policy_history SET digest = sha256('\\x01'::bytea)", "which is not stored"),
        (
            "UPDATE workload_policy_history SET workload_id = gen_random_uuid()",
            "workload of a workload_policy_history row never changes",
        ),
        ("UPDATE workloads SET id = gen_random_uuid()", "a workload's id never changes"),
    ];
    for (sql, why) in refused {
        let err = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await.expect_err(sql);
        assert!(err.to_string().contains(why), "{sql}: {err}");
        assert_eq!(count(pool, rows).await, before, "{sql} changed nothing");
    }

    // A transaction writes a history row of web's; a delete of web meanwhile waits for it.
    let mut writer = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
         SELECT workload_id, 9, digest, now() FROM workload_policies WHERE workload_id = $1",
    )
    .bind(web.uuid())
    .execute(&mut *writer)
    .await
    .unwrap();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let deleter = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *conn).await.unwrap();
            pid_tx.send(pid).unwrap();
            sqlx::query("DELETE FROM workloads WHERE id = $1").bind(web.uuid()).execute(&mut *conn).await
        })
    };
    let pid = pid_rx.await.unwrap();
    let mut watcher = pool.acquire().await.unwrap();
    let waiting = async {
        loop {
            let waits: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)")
                    .bind(pid)
                    .fetch_one(&mut *watcher)
                    .await
                    .unwrap();
            if waits {
                return;
            }
            assert!(!deleter.is_finished(), "the delete finished without waiting for the writer");
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), waiting)
        .await
        .expect("the delete never waited on a lock in pg_locks");
    writer.commit().await.unwrap();
    assert_eq!(deleter.await.unwrap().unwrap().rows_affected(), 1);
    assert_eq!(count(pool, rows).await, 0, "the workload's address, latest and history rows went with it");
}
