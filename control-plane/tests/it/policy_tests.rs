//! Policy tests on every operator commit (issue 27 item 3, POL-10), against a real Postgres: a
//! change that breaks tests (an `observed` one judged by replaying flows recorded through the
//! real ingest path) is refused with every failure and the nearest-rule reason, and
//! writes nothing (no version, no audit row, no notice); it passes once the tests are updated;
//! the JUnit output parses; empty selectors and hostile files are refused; the real CLI too.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::Command;

use chrono::{DurationRound, TimeDelta, Utc};

use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::{self, policy_tests};
use innerwall_control_plane::notice::CHANNEL;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{NewWorkload, PeerSpec, RulesetSpec, ServiceSpec};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::{self, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::PgPool;

use crate::foresight_api::{backend, bad_backend, good_backend};
use sqlx::postgres::PgListener;

use crate::recorded::{HOUR, at, flow_to, ingest, rule_for};

async fn register(pool: &PgPool, host: &str, labels: &[&str], addr: &str) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: host.into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: [addr.parse::<IpAddr>().unwrap()].into(),
    };
    foresight::commit(pool, "test", "workload.register", host, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    new.id
}

async fn service(pool: &PgPool, name: &str, entry: &str) {
    let spec = ServiceSpec {
        name: name.into(),
        description: String::new(),
        entries: vec![ServiceEntry::parse(entry).unwrap()],
    };
    foresight::commit(pool, "test", "service.create", name, async |c| {
        authoring::create_service(c, &spec).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
}

fn app(v: &str) -> BTreeMap<String, Vec<String>> {
    [("app".to_owned(), vec![v.to_owned()])].into()
}

const TESTS: &str = "
name: payments-intent
description: what the back tier admits
tests:
  - name: web-reaches-payments
    allow: {from: {app: [web]}, to: {app: [payments]}, service: https}
  - name: nothing-from-the-internet
    deny: {from_cidr: 203.0.113.0/24, to: {app: [payments]}, service: https}
  - name: only-api-talks-to-db
    only_from:
      to: {app: [db]}
      service: postgres
      sources: [{workloads: {app: [api]}}, {cidr: 10.9.0.0/16}]
  - name: payments-traffic-keeps-flowing
    observed: {to: {app: [payments]}, since: 7d}
";

/// Holds on both sides of the change below.
const TESTS_UPDATED: &str = "
name: payments-intent
tests:
  - name: api-reaches-db
    allow: {from: {app: [api]}, to: {app: [db]}, service: postgres}
  - name: nothing-from-the-internet
    deny: {from_cidr: 198.51.100.0/24, to: {app: [payments]}, service: https}
  - name: only-api-talks-to-db
    only_from:
      to: {app: [db]}
      service: postgres
      sources: [{workloads: {app: [api]}}, {workloads: {app: [web]}}, {cidr: 10.9.0.0/16}]
  - name: db-traffic-keeps-flowing
    observed: {to: {app: [db]}}
";

async fn counts(pool: &PgPool) -> (i64, i64) {
    let versions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workload_policy_history").fetch_one(pool).await.unwrap();
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(pool).await.unwrap();
    (versions, audit)
}

async fn update_backend(pool: &PgPool, spec: &RulesetSpec, expected: i64) -> Result<i64, Error> {
    foresight::commit(pool, "test", "ruleset.update", "backend", async |c| {
        let v = authoring::update_ruleset(c, spec, expected).await?;
        Ok((v, serde_json::json!({})))
    })
    .await
    .map(|d| d.value)
}

fn innerwall(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_innerwall")).arg("--database-url").arg(url).args(args).output().unwrap()
}

#[tokio::test]
async fn policy_tests_refuse_commit() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    // (the fresh database's estate ranges hold 10.0.0.0/8)
    let web = register(pool, "web-1", &["app=web", "tier=front"], "10.0.0.1").await;
    let api = register(pool, "api-1", &["app=api", "tier=front"], "10.0.0.2").await;
    let payments = register(pool, "payments-1", &["app=payments", "tier=back"], "10.0.0.3").await;
    let db_1 = register(pool, "db-1", &["app=db", "tier=back"], "10.0.0.4").await;
    service(pool, "https", "tcp:443").await;
    service(pool, "postgres", "tcp:5432").await;
    let good = good_backend();
    foresight::commit(pool, "test", "ruleset.create", "backend", async |c| {
        authoring::create_ruleset(c, &good).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();

    // Recorded traffic through the real ingest path: the agents of payments-1 and db-1 applied
    // their current versions, and web-1 → payments-1 https (3 connections), api-1 → db-1
    // postgres (4) were ALLOWED two hours ago.
    let h0 =
        (Utc::now().duration_trunc(TimeDelta::hours(1)).unwrap() - TimeDelta::hours(2)).timestamp_millis();
    let mut conn = pool.acquire().await.unwrap();
    let mut applied = BTreeMap::new();
    for (id, dst, src, port, connections) in
        [(payments, "10.0.0.3", "10.0.0.1", 443, 3), (db_1, "10.0.0.4", "10.0.0.2", 5432, 4)]
    {
        let policy = store::persisted_policy(&mut conn, id).await.unwrap().unwrap().0;
        let version = policy.version();
        testing::installed(pool, id, &[(version, Mode::Simulation, at(h0 - HOUR))]).await.unwrap();
        sqlx::query("UPDATE workloads SET applied_version = $2 WHERE id = $1")
            .bind(id.uuid())
            .bind(version as i64)
            .execute(pool)
            .await
            .unwrap();
        let rule = rule_for(&policy, port);
        ingest(
            pool,
            id,
            version,
            h0,
            vec![flow_to(src, dst, port.into(), Some(&rule), connections, h0)],
            vec![],
        )
        .await;
        applied.insert(id, version);
    }
    drop(conn);

    // The set holds on the estate, so it is created (and audited like any change).
    let set = policy_tests::parse_test_set_file("tests.yaml", TESTS).unwrap();
    assert_eq!(foresight::create_test_set(pool, "test", &set).await.unwrap().value, 1);
    let report = foresight::run_policy_tests(pool).await.unwrap();
    assert_eq!(report.results.len(), 4);
    assert!(report.results.iter().all(|r| r.passed), "{report:?}");
    assert_eq!(report.results[3].assertion, "observed");

    // The breaking change: from-web now admits api and the internet range, from-api admits web.
    let bad = bad_backend();
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen(CHANNEL).await.unwrap();
    let before = counts(pool).await;
    let refused = update_backend(pool, &bad, 1).await.unwrap_err();
    let Error::PolicyTestsFailed(failures) = &refused else { panic!("not a test failure: {refused}") };
    let by_test: BTreeMap<&str, &innerwall_control_plane::error::PolicyTestFailure> =
        failures.iter().map(|f| (f.test.as_str(), f)).collect();
    assert_eq!(
        by_test.keys().copied().collect::<Vec<_>>(),
        [
            "nothing-from-the-internet",
            "only-api-talks-to-db",
            "payments-traffic-keeps-flowing",
            "web-reaches-payments"
        ],
        "every failing test: {failures:#?}"
    );
    let allow = by_test["web-reaches-payments"];
    assert_eq!(
        (allow.set.as_str(), allow.assertion.as_str(), allow.pair_count),
        ("payments-intent", "allow", 1)
    );
    assert!(
        allow.reason.contains("rule backend/from-web needs app=api, the source has app=web"),
        "the nearest rule and why: {}",
        allow.reason
    );
    let deny = by_test["nothing-from-the-internet"];
    assert!(deny.reason.contains("admitted by rule backend/from-web"), "{}", deny.reason);
    assert!(deny.pairs[0].starts_with("203.0.113.0/24 (203.0.113.0)"), "{:?}", deny.pairs);
    let only = by_test["only-api-talks-to-db"];
    assert!(
        only.reason.contains("rule backend/from-api admits 10.0.0.1/32")
            && only.reason.contains("not among the listed"),
        "{}",
        only.reason
    );
    // The recorded flow the change would block: peer, labels, port, connections, the rule that
    // admitted it at the applied version and why the new policy drops it.
    let observed = by_test["payments-traffic-keeps-flowing"];
    assert_eq!((observed.assertion.as_str(), observed.pair_count), ("observed", 1));
    for part in [
        format!("workload {web} (10.0.0.1, labelled app=web,tier=front then and now) → {payments} tcp:443"),
        "3 connection(s)".to_owned(),
        format!("admitted at applied version {} by rule backend/from-web", applied[&payments]),
        "is newly blocked: rule backend/from-web needs app=api, the source has app=web".to_owned(),
    ] {
        assert!(observed.reason.contains(&part), "{part:?} in {}", observed.reason);
    }
    assert_eq!(observed.pairs, [format!("workload {web} (10.0.0.1) → {payments} tcp:443 (3 connection(s))")]);
    assert!(refused.to_string().contains("web-reaches-payments"), "{refused}");
    assert!(
        refused.to_string().contains("payments-intent/payments-traffic-keeps-flowing (observed)"),
        "{refused}"
    );
    let problem = innerwall_control_plane::api::problem::ProblemType::PolicyTestsFailed;
    assert_eq!(problem.status().as_u16(), 422);
    assert_eq!(tonic::Status::from(refused).code(), tonic::Code::FailedPrecondition);
    // Nothing was written: no version, no audit row, no notice (a later marker arrives first).
    assert_eq!(counts(pool).await, before, "no policy version and no audit row");
    assert_eq!(store::ruleset_view(&mut pool.acquire().await.unwrap(), "backend").await.unwrap().version, 1);
    sqlx::query("SELECT pg_notify($1, 'marker')").bind(CHANNEL).execute(pool).await.unwrap();
    assert_eq!(listener.recv().await.unwrap().payload(), "marker", "the refused change announced nothing");

    // JUnit output parses: one suite per set, a case per test, a failure per failing test.
    foresight::delete_test_set(pool, "test", "payments-intent", 1).await.unwrap();
    let updated = policy_tests::parse_test_set_file("tests.yaml", TESTS_UPDATED).unwrap();
    // (an on-demand run of the old set over the bad change, through a rolled-back transaction)
    let mut tx = pool.begin().await.unwrap();
    authoring::update_ruleset(&mut tx, &bad, 1).await.unwrap();
    let rendering = innerwall_control_plane::policy::publish::publish_rendering(
        &mut tx,
        innerwall_control_plane::policy::publish::Overflow::Hold,
    )
    .await
    .unwrap();
    let junit =
        foresight::commit::judge_sets(&mut tx, std::slice::from_ref(&set), &rendering).await.unwrap().junit();
    tx.rollback().await.unwrap();
    let doc = roxmltree::Document::parse(&junit).unwrap();
    let suites: Vec<_> = doc.descendants().filter(|n| n.has_tag_name("testsuite")).collect();
    assert_eq!(suites.len(), 1);
    assert_eq!(suites[0].attribute("name"), Some("payments-intent"));
    assert_eq!(suites[0].attribute("failures"), Some("4"));
    let cases: Vec<_> = suites[0].children().filter(|n| n.has_tag_name("testcase")).collect();
    assert_eq!(cases.len(), 4);
    let message =
        cases[0].children().find(|n| n.has_tag_name("failure")).unwrap().attribute("message").unwrap();
    assert!(message.contains("needs app=api, the source has app=web"), "{message}");

    // Once the tests are updated the same change passes, audited with the versions it moved.
    let created = foresight::create_test_set(pool, "test", &updated).await.unwrap();
    assert_eq!(created.value, 1);
    let (versions, audit) = counts(pool).await;
    assert_eq!(update_backend(pool, &bad, 1).await.unwrap(), 2);
    let after = counts(pool).await;
    assert!(after.0 > versions && after.1 == audit + 1, "{versions} {audit} → {after:?}");

    // The observed tests of all sets are bounded (each commit replays their flows): a set that
    // would bring them over the bound is refused, writing nothing.
    let observed_tests: String = (0..policy_tests::MAX_OBSERVED_TESTS)
        .map(|i| format!("  - name: o{i}\n    observed: {{to: {{app: [db]}}, since: 1d}}\n"))
        .collect();
    let over =
        policy_tests::parse_test_set_file("over", &format!("name: over\ntests:\n{observed_tests}")).unwrap();
    let before = counts(pool).await;
    let err = foresight::create_test_set(pool, "test", &over).await.unwrap_err();
    assert!(
        err.to_string().contains("16 observed policy tests across all test sets")
            && err.to_string().contains("MAX_OBSERVED_TESTS"),
        "{err}"
    );
    assert_eq!(counts(pool).await, before, "the refused set wrote nothing");
    let names: Vec<String> =
        foresight::list_test_sets(pool).await.unwrap().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["payments-intent"]);

    // An empty selector fails (so the set is refused) unless the test allows it.
    let empty = "name: empty\ntests:\n  - name: nobody\n    allow: {from: {app: [nobody]}, to: {app: [db]}, service: postgres}\n";
    let err =
        foresight::create_test_set(pool, "test", &policy_tests::parse_test_set_file("e", empty).unwrap())
            .await
            .unwrap_err();
    assert!(err.to_string().contains("no workload matches from app=nobody"), "{err}");
    let allowed = format!("{empty}    allow_empty: true\n");
    foresight::create_test_set(pool, "test", &policy_tests::parse_test_set_file("e", &allowed).unwrap())
        .await
        .unwrap();

    // Hostile files are refused clearly, before anything is read or written.
    let many: String = (0..201)
        .map(|i| format!("  - name: t{i}\n    deny: {{from_cidr: 192.0.2.0/24, to: {{app: [db]}}, service: postgres}}\n"))
        .collect();
    let err = policy_tests::parse_test_set_file("many", &format!("name: many\ntests:\n{many}")).unwrap_err();
    assert!(err.to_string().contains("tests: 201 is more than the 200 allowed"), "{err}");
    let err =
        policy_tests::parse_test_set_file("ctl", "name: ctl\ndescription: \"a\\u001b[2Jb\"\ntests: []\n")
            .unwrap_err();
    assert!(err.to_string().contains("control character"), "{err}");
    let err = policy_tests::parse_test_set_file("unknown", "name: u\ntests:\n  - name: x\n    alow: {}\n")
        .unwrap_err();
    assert!(err.to_string().contains("unknown field `alow`"), "{err}");
    let observed = "name: o\ntests:\n  - name: x\n    observed: {to: {app: [db]}, since: 91d}\n";
    let err = policy_tests::parse_test_set_file("o", observed).unwrap_err();
    assert!(err.to_string().contains("since \"91d\" is longer than the 90 days"), "{err}");
    let observed = "name: o\ntests:\n  - name: x\n    observed: {to: {app: [db]}, since: a week}\n";
    let err = policy_tests::parse_test_set_file("o", observed).unwrap_err();
    assert!(err.to_string().contains("write e.g. 7d"), "{err}");

    // The real CLI: `policy test` passes now, a breaking ruleset update is refused with exit 1
    // and the failures, `--junit` prints XML that parses.
    let out = innerwall(&db.url, &["policy", "test"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("api-reaches-db"));
    let dir = std::env::temp_dir().join(format!("iw-ptests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("backend.yaml");
    let no_api = backend(vec![PeerSpec::workloads(app("web"))], vec![PeerSpec::cidr("10.9.0.0/16")]);
    std::fs::write(&file, serde_json::to_string(&no_api).unwrap()).unwrap();
    let out =
        innerwall(&db.url, &["ruleset", "update", "-f", file.to_str().unwrap(), "--expect-version", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("payments-intent/api-reaches-db") && stderr.contains("rule backend/from-api"),
        "{stderr}"
    );
    // … and the api-1 → db-1 traffic recorded under the applied version would be blocked.
    assert!(
        stderr.contains("payments-intent/db-traffic-keeps-flowing (observed)")
            && stderr.contains(&format!("workload {api} (10.0.0.2")),
        "{stderr}"
    );
    let out = innerwall(&db.url, &["policy", "test", "--junit"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let xml = String::from_utf8(out.stdout).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("testcase")).count(), 5);
    std::fs::remove_dir_all(&dir).unwrap();
}
