//! Suggested policy end to end (FLOW-9, issue 28): agents running the real sync loop, their
//! windows built by the agent's own window code and delivered through the real ingest; then
//! `suggest::run` over the stored flows, accepted into a real draft, its impact, its commit, new
//! evidence and the verdict; ignores; and the CLI's output read back by `ruleset create -f`.

use std::collections::BTreeSet;
use std::process::Command;

use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::Range;
use innerwall_control_plane::foresight::drafts;
use innerwall_control_plane::gate::{self, Outcome};
use innerwall_control_plane::suggest::{self, Request, State, SuggestedPeer, Suggestions};
use innerwall_control_plane::testing;
use innerwall_wire::flows::{EvidenceGap, GapKind};
use innerwall_wire::policy::Mode;

use crate::gate::{BATCH, Host, SECOND, WEB, db, now_ms, params, set_mode, synced};
use crate::plane::Plane;

fn at(ms: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms).unwrap()
}

fn request(range: Range) -> Request {
    Request {
        scope: "app=db".into(),
        range,
        excluded_keys: BTreeSet::new(),
        max_breadth: suggest::DEFAULT_MAX_BREADTH,
    }
}

fn labels(pairs: &[(&str, &str)]) -> suggest::Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn peers(out: &Suggestions) -> Vec<SuggestedPeer> {
    out.suggestions.iter().map(|s| s.peer.clone()).collect()
}

async fn count(plane: &Plane, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(plane.pool()).await.unwrap()
}

/// The last 14 UTC days, today's included.
fn fourteen_days() -> Range {
    suggest::range_since(chrono::Utc::now(), std::time::Duration::from_secs(14 * 86_400)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suggestion_makes_the_verdict_safe() {
    let plane = Plane::start().await;
    let pool = plane.pool();
    plane.register("web-1", &["app=web"], WEB).await;
    plane.register("batch-1", &["app=batch", "team=data"], BATCH).await;
    let (a, b) = (Host::start(&plane, "db-1").await, Host::start(&plane, "db-2").await);
    set_mode(&plane, db(), 2, Mode::Simulation).await;
    let v1 = synced(&plane, &[&a, &b]).await;
    // Nothing admits either app group: both would be blocked.
    let base = now_ms() - 60 * SECOND;
    for host in [&a, &b] {
        host.deliver(base, base + 10 * SECOND, &[WEB, BATCH], &[]).await;
    }
    let verdict = gate::judge(pool, &db(), &params(base, base + 10 * SECOND)).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Unsafe, "{}", verdict.summary());

    let range = Range { from: at(base), to: at(base + 10 * SECOND) };
    let out = suggest::run(pool, &request(range)).await.unwrap();
    assert_eq!(
        peers(&out),
        [
            SuggestedPeer::Workloads(labels(&[("app", "batch"), ("team", "data")])),
            SuggestedPeer::Workloads(labels(&[("app", "web")])),
        ],
        "the two groups share no label: one rule each, never the empty selector"
    );
    for s in &out.suggestions {
        assert_eq!((s.group.clone(), s.protocol.as_str(), s.port), (labels(&[("app", "db")]), "tcp", 5432));
        let mut names = [format!("vm ({})", a.id), format!("vm ({})", b.id)];
        names.sort();
        assert_eq!(s.destinations.len(), 2);
        assert!(
            names.iter().all(|n| s.destinations.iter().any(|d| d.ends_with(&n[n.len() - 38..]))),
            "{:?}",
            s.destinations
        );
        assert_eq!((s.evidence.connections, s.evidence.flows), (4, 2), "2 connections to each host");
        assert_eq!((s.evidence.rule_coverage_before, s.evidence.rule_coverage_after), (0.0, 0.5));
        assert_eq!(s.evidence.breadth, Some(1.0));
        assert!(!s.service.exists && s.service.name == "tcp-5432", "{:?}", s.service);
        assert!(
            matches!(&s.state, State::Learning { reason } if reason.contains("gap-free evidence")),
            "{s:?}"
        );
    }
    let ids: Vec<String> = out.suggestions.iter().map(|s| s.id.clone()).collect();
    let counts = CountBounds::default();
    let accepted = suggest::accept(pool, "alice", &ids, "from-flows", &counts).await.unwrap();
    assert_eq!(accepted.objects, ["service/tcp-5432", "ruleset/suggested-db"]);

    // The draft's impact: both flows newly allowed on both hosts, nothing newly blocked.
    let (_, impact) = drafts::impact(pool, "alice", "from-flows", &counts, range, 10).await.unwrap();
    assert_eq!(impact.newly_blocked(), 0, "{impact:#?}");
    for host in [&a, &b] {
        let w = impact.workloads.iter().find(|w| w.id == host.id).expect("each db host is affected");
        assert_eq!((w.replayed.newly_allowed, w.replayed.newly_blocked), (2, 0), "{w:#?}");
    }
    // Shown again, they say where they went.
    let again = suggest::run(pool, &request(range)).await.unwrap();
    assert!(again.suggestions.iter().all(|s| s.state == State::Accepted { draft: "from-flows".into() }));

    // Commit, evidence under the new version, and the verdict is SAFE.
    let draft = drafts::show(pool, "from-flows").await.unwrap();
    drafts::commit(pool, "alice", "from-flows", draft.version, &counts).await.unwrap();
    let v2 = synced(&plane, &[&a, &b]).await;
    assert!(v2 > v1);
    for host in [&a, &b] {
        host.deliver(base + 10 * SECOND, base + 15 * SECOND, &[WEB, BATCH], &[]).await;
    }
    let verdict = gate::judge(pool, &db(), &params(base, base + 15 * SECOND)).await.unwrap();
    assert_eq!(verdict.outcome, Outcome::Safe, "{}", verdict.summary());
    // Under the applied version nothing is left to suggest.
    let after =
        suggest::run(pool, &request(Range { from: at(base), to: at(base + 15 * SECOND) })).await.unwrap();
    assert!(after.suggestions.is_empty(), "{after:#?}");
    assert_eq!(count(&plane, "SELECT count(*) FROM audit_log WHERE action = 'suggestion.accept'").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suggestions_are_narrow_and_honest() {
    let plane = Plane::start().await;
    let pool = plane.pool();
    plane.register("web-prod", &["app=web", "env=prod"], WEB).await;
    plane.register("web-staging", &["app=web", "env=staging"], BATCH).await;
    let hosts = [
        Host::start(&plane, "db-1").await,
        Host::start(&plane, "db-2").await,
        Host::start(&plane, "db-3").await,
    ];
    set_mode(&plane, db(), 3, Mode::Simulation).await;
    synced(&plane, &hosts.iter().collect::<Vec<_>>()).await;
    let base = now_ms() - 60 * SECOND;
    let end = base + 10 * SECOND;
    // db-1: both web hosts and an unmanaged peer on 5432, and web to an ephemeral port.
    let flows = [(WEB, 5432), (BATCH, 5432), ("192.0.2.5", 5432), (WEB, 40_000)];
    hosts[0].deliver_to(base, end, &flows, &[]).await;
    // db-2's window lost records to a full map; db-3's has a suspect direction.
    let gap = |kind| EvidenceGap::new(kind, base + SECOND, base + 2 * SECOND, 3);
    hosts[1].deliver_to(base, end, &[("10.9.0.99", 22)], &[gap(GapKind::MapFull)]).await;
    hosts[2].deliver_to(base, end, &[("10.9.0.98", 53)], &[gap(GapKind::SuspectDirection)]).await;

    // Each host reported its ephemeral range at enrollment (this kernel's, read by the agent).
    let kernel: Vec<i32> = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .unwrap()
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    let stored: (Option<i32>, Option<i32>) =
        sqlx::query_as("SELECT ephemeral_low, ephemeral_high FROM workloads WHERE id = $1")
            .bind(hosts[0].id.uuid())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(stored, (Some(kernel[0]), Some(kernel[1])));
    assert!((kernel[0]..=kernel[1]).contains(&40_000), "the test's ephemeral port is in this kernel's range");
    let out = suggest::run(pool, &request(fourteen_days())).await.unwrap();
    assert_eq!(
        peers(&out),
        [
            SuggestedPeer::Workloads(labels(&[("app", "web")])),
            SuggestedPeer::Cidrs(vec!["192.0.2.5/32".into()])
        ],
        "{out:#?}"
    );
    for s in &out.suggestions {
        assert_eq!((s.protocol.as_str(), s.port, s.service.entry.as_str()), ("tcp", 5432, "tcp:5432"));
        assert_eq!((s.evidence.days_seen, s.evidence.days_in_range), (1, 14), "seen today only");
    }
    assert_eq!(out.suggestions[0].evidence.breadth, Some(1.0), "2 web workloads now, 2 seen");
    let excluded: Vec<(String, &str, u64)> =
        out.excluded.iter().map(|e| (e.destination.clone(), e.reason.as_str(), e.connections)).collect();
    let has = |host: &Host, words: &str| {
        let id = host.id.to_string();
        excluded.iter().any(|(d, r, c)| d.contains(&id) && r.contains(words) && *c == 2)
    };
    assert!(has(&hosts[0], "ephemeral port range"), "{excluded:?}");
    assert!(has(&hosts[1], "map-full gap"), "{excluded:?}");
    assert!(has(&hosts[2], "suspect-direction gap"), "{excluded:?}");
    assert_eq!(excluded.len(), 3, "{excluded:?}");
    let files = suggest::ruleset_files(&out);
    assert!(files[0].1.contains("seen on 1 of 14 days"), "{}", files[0].1);

    // Three more web workloads nobody saw: `app=web` would select 5 for 2 seen (breadth 2.5 >
    // 2), so one rule per observed label set.
    for (n, addr) in ["10.9.0.20", "10.9.0.21", "10.9.0.22"].iter().enumerate() {
        plane.register(&format!("web-dev-{n}"), &["app=web", "env=dev"], addr).await;
    }
    let out = suggest::run(pool, &request(fourteen_days())).await.unwrap();
    assert_eq!(
        peers(&out),
        [
            SuggestedPeer::Workloads(labels(&[("app", "web"), ("env", "prod")])),
            SuggestedPeer::Workloads(labels(&[("app", "web"), ("env", "staging")])),
            SuggestedPeer::Cidrs(vec!["192.0.2.5/32".into()]),
        ]
    );
    // With `env` excluded as a host key, the role is `app=web` again, as broad as it is.
    let loose = Request { excluded_keys: BTreeSet::from(["env".to_owned()]), ..request(fourteen_days()) };
    let out = suggest::run(pool, &loose).await.unwrap();
    assert_eq!(peers(&out)[0], SuggestedPeer::Workloads(labels(&[("app", "web")])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_suggestions_stay_ignored() {
    let plane = Plane::start().await;
    let pool = plane.pool();
    plane.register("web-1", &["app=web"], WEB).await;
    let host = Host::start(&plane, "db-1").await;
    set_mode(&plane, db(), 1, Mode::Simulation).await;
    synced(&plane, &[&host]).await;
    let base = now_ms() - 60 * SECOND;
    host.deliver(base, base + 10 * SECOND, &[WEB], &[]).await;
    let first = suggest::run(pool, &request(fourteen_days())).await.unwrap();
    let [shown] = first.suggestions.as_slice() else { panic!("{first:#?}") };

    // Bad ids are refused and change nothing.
    let audits = count(&plane, "SELECT count(*) FROM audit_log").await;
    let err = suggest::ignore(pool, "bob", &["0123456789ab".into()]).await.unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    let err = suggest::ignore(pool, "bob", &["'; DROP".into()]).await.unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    let too_many = vec![shown.id.clone(); suggest::MAX_IDS + 1];
    let err = suggest::ignore(pool, "bob", &too_many).await.unwrap_err();
    assert!(matches!(err, Error::Invalid(_)) && err.to_string().contains("1 to 100"), "{err}");
    let keys = (0..=64).map(|n| format!("k{n}")).collect();
    let err =
        suggest::run(pool, &Request { excluded_keys: keys, ..request(fourteen_days()) }).await.unwrap_err();
    assert!(matches!(err, Error::Invalid(_)) && err.to_string().contains("at most 64"), "{err}");
    assert_eq!(count(&plane, "SELECT count(*) FROM audit_log").await, audits);

    suggest::ignore(pool, "bob", std::slice::from_ref(&shown.id)).await.unwrap();
    assert_eq!(count(&plane, "SELECT count(*) FROM audit_log WHERE action = 'suggestion.ignore'").await, 1);
    let held = suggest::run(pool, &request(fourteen_days())).await.unwrap();
    assert_eq!((held.suggestions.len(), held.ignored), (0, 1), "{held:#?}");
    // An ignored suggestion cannot be accepted by its id either.
    let counts = CountBounds::default();
    let err = suggest::accept(pool, "bob", std::slice::from_ref(&shown.id), "d", &counts).await.unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");

    // A new source: proposed again, naming it.
    let web2 = plane.register("web-2", &["app=web"], BATCH).await;
    host.deliver(base + 10 * SECOND, base + 20 * SECOND, &[BATCH], &[]).await;
    let back = suggest::run(pool, &request(fourteen_days())).await.unwrap();
    let [s] = back.suggestions.as_slice() else { panic!("{back:#?}") };
    assert_eq!(s.new_since_ignored, [format!("{web2} {{app=web}}")]);
    assert_eq!(s.evidence.sources.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suggestions_are_deterministic() {
    let plane = Plane::start().await;
    let pool = plane.pool();
    plane.register("web-1", &["app=web", "env=prod"], WEB).await;
    plane.register("web-2", &["app=web", "env=prod"], BATCH).await;
    // `postgres` (tcp:5432) exists, admitting only `app=cache`: suggestions name it.
    testing::admit(pool, "postgres", ("app", "db"), ("app", "cache"), "tcp:5432").await.unwrap();
    let host = Host::start(&plane, "db-1").await;
    set_mode(&plane, db(), 1, Mode::Simulation).await;
    synced(&plane, &[&host]).await;
    let base = now_ms() - 60 * SECOND;
    host.deliver_to(base, base + 10 * SECOND, &[(WEB, 5432), (BATCH, 5432), ("192.0.2.7", 5432)], &[]).await;

    let dir = plane.dir.join("suggested");
    let until = chrono::Utc::now().to_rfc3339();
    let cli = |args: &[&str]| {
        let out = Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--database-url", &plane.db.url])
            .args(args)
            .output()
            .expect("running innerwall");
        assert!(out.status.success(), "{args:?}: {out:?}");
        out.stdout
    };
    let run = |n: usize| {
        let out = dir.join(n.to_string());
        let json = cli(&[
            "--json",
            "suggest",
            "--scope",
            "app=db",
            "--until",
            &until,
            "--out-dir",
            out.to_str().unwrap(),
        ]);
        let file = std::fs::read(out.join("suggested-db.yaml")).expect("the ruleset file");
        (json, file)
    };
    let (first, second) = (run(1), run(2));
    assert_eq!(first.0, second.0, "the same flows, the same JSON");
    assert_eq!(first.1, second.1, "the same flows, the same file");
    let parsed: Suggestions = serde_json::from_slice(&first.0).unwrap();
    assert_eq!(parsed.suggestions.len(), 2);
    assert!(parsed.suggestions.iter().all(|s| s.service.name == "postgres" && s.service.exists));
    let text = String::from_utf8(first.1).unwrap();
    assert!(text.contains("# suggested-") && text.contains("evidence sha256:"), "{text}");

    // `ruleset create -f` takes the file unchanged.
    let path = dir.join("1").join("suggested-db.yaml");
    cli(&["ruleset", "create", "-f", path.to_str().unwrap()]);
    let shown: serde_json::Value =
        serde_json::from_slice(&cli(&["--json", "ruleset", "show", "suggested-db"])).unwrap();
    assert_eq!(shown["rules"].as_array().map(Vec::len), Some(2), "{shown}");
    assert_eq!(shown["scope"]["app"][0], "db");
}
