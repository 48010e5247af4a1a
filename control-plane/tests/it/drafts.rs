//! Drafts (issue 27 item 1, POL-8) against a real Postgres: for random drafts on a generated
//! estate, what a draft renders — per workload the delta and the next version — is, byte for
//! byte, what committing it persists, and rendering writes nothing; a draft whose base moved is
//! refused naming the object; a mode change in a draft passes the promotion gate (a move to
//! enforcement without a SAFE verdict is refused, writing nothing), never around it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::drafts::{
    ChangeFile, ChangeSpec, LabelsChange, ModeChange, NamedMembers,
};
use innerwall_control_plane::foresight::{self, drafts};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{NewWorkload, PeerSpec, RuleSpec, RulesetSpec, ServiceSpec};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::diff;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use sqlx::PgPool;

const APPS: [&str; 4] = ["web", "api", "db", "cache"];
const SERVICES: [&str; 3] = ["https", "postgres", "dns"];

async fn register(pool: &PgPool, n: usize) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: format!("h{n}"),
        labels: vec![
            format!("app={}", APPS[n % APPS.len()]).parse().unwrap(),
            format!("tier={}", if n.is_multiple_of(2) { "front" } else { "back" }).parse().unwrap(),
        ],
        addresses: [format!("10.1.0.{}", n + 1).parse::<IpAddr>().unwrap()].into(),
    };
    foresight::commit(pool, "test", "workload.register", &new.hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    new.id
}

async fn estate(pool: &PgPool) -> Vec<WorkloadId> {
    for (name, entry) in SERVICES.iter().zip(["tcp:443", "tcp:5432", "udp:53"]) {
        let spec = ServiceSpec {
            name: (*name).into(),
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
    let mut ids = Vec::new();
    for n in 0..10 {
        ids.push(register(pool, n).await);
    }
    ids
}

/// One random authored change over the generated estate (workload `n` of the estate by index).
#[derive(Debug, Clone)]
enum Op {
    Ruleset { n: usize, scope: usize, rules: Vec<(usize, Option<u8>, usize)> },
    DeleteRuleset(usize),
    Service { n: usize, port: u16 },
    Relabel { workload: usize, app: usize },
    Mode { app: usize, simulation: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..APPS.len(), prop::collection::vec((0..APPS.len(), prop::option::of(0..4u8), 0..SERVICES.len()), 1..4))
            .prop_map(|(n, scope, rules)| Op::Ruleset { n, scope, rules }),
        1 => (0..3usize).prop_map(Op::DeleteRuleset),
        1 => (0..SERVICES.len(), 1..65535u16).prop_map(|(n, port)| Op::Service { n, port }),
        2 => (0..10usize, 0..APPS.len()).prop_map(|(workload, app)| Op::Relabel { workload, app }),
        1 => (0..APPS.len(), any::<bool>()).prop_map(|(app, simulation)| Op::Mode { app, simulation }),
    ]
}

fn app(v: &str) -> BTreeMap<String, Vec<String>> {
    [("app".to_owned(), vec![v.to_owned()])].into()
}

/// The change file of `ops`, the estate's live labels deciding a mode change's expected count.
/// `None` when a delete names a ruleset that does not exist (the op is dropped).
fn change_of(op: &Op, ids: &[WorkloadId], apps: &[usize], rulesets: &[bool]) -> Option<ChangeSpec> {
    Some(match op {
        Op::Ruleset { n, scope, rules } => ChangeSpec::ruleset(RulesetSpec {
            name: format!("r{n}"),
            description: String::new(),
            enabled: true,
            scope: app(APPS[*scope]),
            rules: rules
                .iter()
                .enumerate()
                .map(|(i, (from, cidr, service))| RuleSpec {
                    name: format!("rule-{i}"),
                    description: String::new(),
                    enabled: true,
                    peers: match cidr {
                        Some(c) => {
                            vec![PeerSpec { cidr: Some(format!("192.0.2.{}/32", c)), ..Default::default() }]
                        }
                        None => vec![PeerSpec::workloads(app(APPS[*from]))],
                    },
                    services: vec![SERVICES[*service].to_owned()],
                })
                .collect(),
        }),
        Op::DeleteRuleset(n) if rulesets[*n] => ChangeSpec::delete_ruleset(&format!("r{n}")),
        Op::DeleteRuleset(_) => return None,
        Op::Service { n, port } => ChangeSpec::service(NamedMembers {
            name: SERVICES[*n].to_owned(),
            description: String::new(),
            members: vec![format!("tcp:{port}")],
        }),
        Op::Relabel { workload, app } => ChangeSpec::labels(LabelsChange {
            workload: ids[*workload].to_string(),
            set: vec![format!("app={}", APPS[*app])],
            remove: Vec::new(),
        }),
        Op::Mode { app, simulation } => {
            let count = apps.iter().filter(|a| **a == *app).count();
            if count == 0 {
                return None;
            }
            ChangeSpec::mode(ModeChange {
                selector: Some(format!("app={}", APPS[*app])),
                ids: Vec::new(),
                expect_count: count,
                to: if *simulation { "simulation" } else { "visibility" }.into(),
                reason: "draft test".into(),
                evidence_since: None,
                min_evidence: None,
            })
        }
    })
}

/// Everything a render must not write and a commit does: persisted versions and their history,
/// the audit log, promotions, the drafts' versions.
async fn written(pool: &PgPool) -> (Vec<(uuid::Uuid, i64)>, i64, i64, i64, Vec<(String, i64)>) {
    let latest = sqlx::query_as("SELECT workload_id, version FROM workload_policies ORDER BY workload_id")
        .fetch_all(pool)
        .await
        .unwrap();
    let count = async |sql: &str| {
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
    };
    let drafts =
        sqlx::query_as("SELECT name::text, version FROM drafts ORDER BY name").fetch_all(pool).await.unwrap();
    (
        latest,
        count("SELECT count(*) FROM workload_policy_history").await,
        count("SELECT count(*) FROM audit_log").await,
        count("SELECT count(*) FROM promotions").await,
        drafts,
    )
}

fn rng() -> TestRng {
    let seed: u64 =
        std::env::var("INNERWALL_DRAFT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand_seed);
    eprintln!("draft_render_matches_commit: INNERWALL_DRAFT_SEED={seed}");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.finish()
}

#[tokio::test]
async fn draft_render_matches_commit() {
    let db = fresh_database().await.unwrap();
    let pool = db.pool.clone();
    let counts = CountBounds::default();
    let ids = estate(&pool).await;
    let mut apps: Vec<usize> = (0..ids.len()).map(|n| n % APPS.len()).collect();
    let mut rulesets = [false; 3];
    let mut runner = TestRunner::new_with_rng(Config { cases: 32, ..Config::default() }, rng());
    let strategy = prop::collection::vec(op(), 1..6);
    let (mut advanced, mut cases) = (0usize, 0usize);
    for case in 0..32 {
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        let changes: Vec<ChangeSpec> =
            ops.iter().filter_map(|o| change_of(o, &ids, &apps, &rulesets)).collect();
        if changes.is_empty() {
            continue;
        }
        let name = format!("d{case}");
        drafts::create(&pool, "alice", &name, "random").await.unwrap();
        let draft = drafts::add(&pool, "alice", &name, &ChangeFile { changes: changes.clone() }, &counts)
            .await
            .unwrap_or_else(|e| panic!("case {case}: {ops:?}: add refused: {e}"));
        let before = written(&pool).await;
        let render = drafts::render(&pool, "alice", &name, &counts).await.unwrap();
        assert_eq!(written(&pool).await, before, "case {case}: rendering wrote something");
        assert!(render.would_commit(), "case {case}: {:?}", render.blockers);
        let done = drafts::commit(&pool, "alice", &name, draft.version, &counts)
            .await
            .unwrap_or_else(|e| panic!("case {case}: {ops:?}: commit refused: {e}"));
        let committed: Vec<(WorkloadId, u64)> =
            done.changed.iter().map(|c| (c.workload, c.version)).collect();
        let rendered: Vec<(WorkloadId, u64)> =
            render.workloads.iter().map(|w| (w.workload, w.to_version)).collect();
        assert_eq!(committed, rendered, "case {case}: {ops:?}");
        let mut conn = pool.acquire().await.unwrap();
        for w in &render.workloads {
            let stored =
                store::policies_at(&mut conn, &[(w.workload, w.from_version), (w.workload, w.to_version)])
                    .await
                    .unwrap();
            let new = &stored[&(w.workload, w.to_version)];
            let delta = diff(&stored[&(w.workload, w.from_version)], new);
            assert_eq!(drafts::delta_bytes(&delta), w.delta, "case {case}: delta of {}", w.workload);
            assert_eq!(delta.changes.len(), w.delta_changes);
            assert_eq!(w.mode, new.mode().to_string());
            let digest: String = ring::digest::digest(&ring::digest::SHA256, &new.canonical_bytes())
                .as_ref()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(digest, w.digest, "case {case}: policy of {}", w.workload);
        }
        advanced += render.workloads.len();
        cases += 1;
        // Track what the estate now is, for the next case's expectations.
        for o in ops.iter().cloned() {
            match o {
                Op::Ruleset { n, .. } => rulesets[n] = true,
                Op::DeleteRuleset(n) => rulesets[n] = false,
                Op::Relabel { workload, app } => apps[workload] = app,
                _ => {}
            }
        }
        // A later op on the same object replaced an earlier one in the draft: recompute rulesets.
        let names: Vec<String> =
            store::list_rulesets(&mut conn).await.unwrap().into_iter().map(|r| r.spec.name).collect();
        rulesets = [0, 1, 2].map(|n| names.contains(&format!("r{n}")));
        // The draft is kept, committed, and changes no more.
        let again = drafts::commit(&pool, "alice", &name, draft.version, &counts).await.unwrap_err();
        assert!(again.to_string().contains("was committed"), "{again}");
    }
    assert!(cases >= 10 && advanced > 0, "too few drafts exercised: {cases} cases, {advanced} versions");
}

#[tokio::test]
async fn draft_base_moved_is_refused_naming_the_object() {
    let db = fresh_database().await.unwrap();
    let pool = db.pool.clone();
    let counts = CountBounds::default();
    let ids = estate(&pool).await;
    let ruleset = |port_service: &str| RulesetSpec {
        name: "backend".into(),
        description: String::new(),
        enabled: true,
        scope: app("db"),
        rules: vec![RuleSpec {
            name: "from-api".into(),
            description: String::new(),
            enabled: true,
            peers: vec![PeerSpec::workloads(app("api"))],
            services: vec![port_service.into()],
        }],
    };
    let first = ruleset("postgres");
    foresight::commit(&pool, "test", "ruleset.create", "backend", async |c| {
        authoring::create_ruleset(c, &first).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    drafts::create(&pool, "alice", "widen", "").await.unwrap();
    let file = ChangeFile {
        changes: vec![
            ChangeSpec::ruleset(ruleset("https")),
            ChangeSpec::labels(LabelsChange {
                workload: ids[0].to_string(),
                set: vec!["app=db".into()],
                remove: vec![],
            }),
        ],
    };
    let draft = drafts::add(&pool, "alice", "widen", &file, &counts).await.unwrap();
    assert_eq!(draft.changes.len(), 2);
    // Someone else moves both objects.
    let moved = ruleset("dns");
    foresight::commit(&pool, "bob", "ruleset.update", "backend", async |c| {
        let v = authoring::update_ruleset(c, &moved, 1).await?;
        let l = authoring::change_labels(c, ids[0], 1, &["env=prod".parse().unwrap()], &[]).await?;
        Ok(((v, l), serde_json::json!({})))
    })
    .await
    .unwrap();
    let before = written(&pool).await;
    for refused in [
        drafts::commit(&pool, "alice", "widen", draft.version, &counts).await.map(|_| ()),
        drafts::render(&pool, "alice", "widen", &counts).await.map(|_| ()),
    ] {
        let err = refused.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::DraftBaseMoved { .. }), "{text}");
        assert!(text.contains("ruleset/backend: version 1 when added, version 2 now"), "{text}");
        assert!(text.contains(&format!("labels/{}: version 1 when added, version 2 now", ids[0])), "{text}");
    }
    assert_eq!(written(&pool).await, before, "a refused commit wrote something");
    // A stale draft version is refused too; re-adding rebases nothing (the first base stays).
    let stale = drafts::commit(&pool, "alice", "widen", draft.version + 1, &counts).await.unwrap_err();
    assert!(matches!(stale, Error::Stale { .. }), "{stale}");
    // Discarded, a fresh draft on the moved versions commits.
    drafts::discard(&pool, "alice", "widen", draft.version).await.unwrap();
    drafts::create(&pool, "alice", "widen", "again").await.unwrap();
    let draft = drafts::add(&pool, "alice", "widen", &file, &counts).await.unwrap();
    let done = drafts::commit(&pool, "alice", "widen", draft.version, &counts).await.unwrap();
    assert!(!done.changed.is_empty());
}

#[tokio::test]
async fn draft_mode_changes_pass_the_gate() {
    let db = fresh_database().await.unwrap();
    let pool = db.pool.clone();
    let counts = CountBounds::default();
    estate(&pool).await;
    let mode = |to: &str, count: usize| ChangeFile {
        changes: vec![ChangeSpec::mode(ModeChange {
            selector: Some("app=web".into()),
            ids: Vec::new(),
            expect_count: count,
            to: to.into(),
            reason: "rollout".into(),
            evidence_since: None,
            min_evidence: None,
        })],
    };
    // A count other than what the selector resolves to is refused at add.
    drafts::create(&pool, "alice", "enforce", "").await.unwrap();
    let err = drafts::add(&pool, "alice", "enforce", &mode("enforcement", 2), &counts).await.unwrap_err();
    assert!(matches!(err, Error::CountMismatch { expected: 2, matched: 3, .. }), "{err}");
    // Enforcement with no evidence: the render names the blocker, the commit is refused.
    let draft = drafts::add(&pool, "alice", "enforce", &mode("enforcement", 3), &counts).await.unwrap();
    let render = drafts::render(&pool, "alice", "enforce", &counts).await.unwrap();
    assert!(!render.would_commit());
    assert!(render.blockers[0].contains("not SAFE"), "{:?}", render.blockers);
    assert_eq!(render.workloads.len(), 3, "the render still shows the deltas");
    let before = written(&pool).await;
    let err = drafts::commit(&pool, "alice", "enforce", draft.version, &counts).await.unwrap_err();
    assert!(matches!(err, Error::EvidenceInsufficient { .. }), "{err}");
    assert_eq!(written(&pool).await, before, "a refused mode change wrote something");
    // A move to simulation needs no evidence and leaves a promotion record, as a promotion does.
    drafts::create(&pool, "alice", "simulate", "").await.unwrap();
    let draft = drafts::add(&pool, "alice", "simulate", &mode("simulation", 3), &counts).await.unwrap();
    let done = drafts::commit(&pool, "alice", "simulate", draft.version, &counts).await.unwrap();
    assert_eq!(done.value.promotions.len(), 1);
    assert_eq!(done.changed.len(), 3);
    let recorded: (String, i32) =
        sqlx::query_as("SELECT actor, expected_count FROM promotions WHERE id = $1")
            .bind(done.value.promotions[0])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, ("alice".to_owned(), 3));
}

#[tokio::test]
async fn draft_input_is_bounded() {
    let db = fresh_database().await.unwrap();
    let pool = db.pool.clone();
    let counts = CountBounds::default();
    let ids = estate(&pool).await;
    drafts::create(&pool, "alice", "d", "").await.unwrap();
    let refused = [
        (ChangeFile { changes: vec![] }, "no change"),
        (
            ChangeFile { changes: vec![ChangeSpec::delete_ruleset("r0"); drafts::MAX_FILE_CHANGES + 1] },
            "at most 100 changes",
        ),
        (ChangeFile { changes: vec![ChangeSpec::delete_ruleset("nope")] }, "not found"),
        (ChangeFile { changes: vec![ChangeSpec::delete_ruleset("Bad Name")] }, "Bad Name"),
        (
            ChangeFile {
                changes: vec![ChangeSpec::labels(LabelsChange {
                    workload: "x".into(),
                    set: vec!["a=b".into()],
                    remove: vec![],
                })],
            },
            "is not a workload id",
        ),
        (
            ChangeFile {
                changes: vec![ChangeSpec::service(NamedMembers {
                    name: "https".into(),
                    description: String::new(),
                    members: vec!["tcp:99999".into()],
                })],
            },
            "99999",
        ),
        // A ruleset that references an unknown service applies nowhere: the trial render refuses it.
        (
            ChangeFile {
                changes: vec![ChangeSpec::ruleset(RulesetSpec {
                    name: "r".into(),
                    description: String::new(),
                    enabled: true,
                    scope: app("db"),
                    rules: vec![RuleSpec {
                        name: "x".into(),
                        description: String::new(),
                        enabled: true,
                        peers: vec![PeerSpec::workloads(app("api"))],
                        services: vec!["nosuch".into()],
                    }],
                })],
            },
            "nosuch",
        ),
    ];
    let before = written(&pool).await;
    for (file, wanted) in refused {
        let err = drafts::add(&pool, "alice", "d", &file, &counts).await.unwrap_err().to_string();
        assert!(err.contains(wanted), "{wanted:?} not in {err}");
    }
    assert_eq!(written(&pool).await, before, "a refused add wrote something");
    // Unknown fields in a change file are refused by its parser.
    let text = format!("changes:\n- labels: {{workload: {}, set: [a=b], extra: 1}}\n", ids[0]);
    let err =
        innerwall_control_plane::policy::file::parse::<ChangeFile>("c.yaml", &text).unwrap_err().to_string();
    assert!(err.contains("extra"), "{err}");
    // The count of drafts is bounded.
    for n in 1..drafts::MAX_DRAFTS {
        drafts::create(&pool, "alice", &format!("d{n}"), "").await.unwrap();
    }
    let err = drafts::create(&pool, "alice", "one-more", "").await.unwrap_err();
    assert!(matches!(err, Error::OverBound { .. }), "{err}");
}
