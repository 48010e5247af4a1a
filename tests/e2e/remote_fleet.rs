//! Issue 12 part 6, `remote_cli_matches_local_fleet`: `innerwall token`, `render`,
//! `estate-range` and `flows` through `--api` against a real `innerwall serve --api-listen` print
//! what they print on the host's database — tables, messages, `--json`, the notes on stderr —
//! and fail with the same message and exit code; a token whose role is too low is refused
//! (403) and changes nothing.
//!
//! Two databases with the same estate: the same service, address group and ruleset, the same
//! workloads under the same ids, the same flow windows (same ids and times) ingested through the
//! library. The writes run once per mode — locally on database A, through the API on database B —
//! and their outputs are compared with one normalization: what a mint makes up (the token's id,
//! its secret and its expiry) is replaced by a name (`{token1}`, …) in both transcripts, and a
//! later step names the token it revokes the same way. Everything else a write prints (workload
//! ids, policy versions) is identical without help. The reads then run against database B
//! both ways, locally and through the API, and compare byte for byte with nothing normalized:
//! the token list and the estate ranges carry database B's own ids and timestamps; the flow
//! reads are also compared with a local run on database A, which holds the same evidence.

use std::collections::BTreeMap;

use chrono::{DateTime, SubsecRound, Utc};
use innerwall_control_plane::flows;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{AddressGroupSpec, NewWorkload, RulesetSpec, ServiceSpec};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::flows::{Decision, EvidenceGap, FlowRecord, FlowWindow, GapKind};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Mode, Protocol, RuleId};
use sqlx::PgPool;

use crate::plane::Plane;
use crate::remote::{Serve, innerwall, mint_token, token_file};

/// The workloads, under the same ids in both databases.
const DB: &str = "00000000-0000-4000-8000-0000000000d1";
const WEB: &str = "00000000-0000-4000-8000-0000000000e1";
const API: &str = "00000000-0000-4000-8000-0000000000a1";

async fn commit(pool: &PgPool, what: &str, change: impl AsyncFnOnce(&mut sqlx::PgConnection)) {
    innerwall_control_plane::foresight::commit(pool, "test", what, what, async |c| {
        change(c).await;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
}

/// The same estate in `pool`: `db-1` protected by `db-in` (peers `app=web` and `app=api` on
/// `pg`), `web-1` on a public address no estate range holds yet, `api-1`, the group `corp`,
/// and `db-1`'s flow windows relative to `base`.
async fn estate(pool: &PgPool, base: DateTime<Utc>) {
    use Decision::{Allowed, WouldBlock};
    commit(pool, "pg", async |c| {
        let entries = vec![ServiceEntry::parse("tcp:5432").unwrap()];
        let spec = ServiceSpec { name: "pg".into(), description: String::new(), entries };
        authoring::create_service(c, &spec).await.unwrap();
    })
    .await;
    commit(pool, "corp", async |c| {
        let cidrs = [Cidr::parse("10.8.0.0/16").unwrap()].into();
        let spec = AddressGroupSpec { name: "corp".into(), description: String::new(), cidrs };
        authoring::create_address_group(c, &spec).await.unwrap();
    })
    .await;
    let ruleset: RulesetSpec = serde_json::from_value(serde_json::json!({
        "name": "db-in",
        "scope": {"app": ["db"]},
        "rules": [
            {"name": "from-web", "peers": [{"workloads": {"app": ["web"]}}], "services": ["pg"]},
            {"name": "from-api", "peers": [{"workloads": {"app": ["api"]}}], "services": ["pg"]},
        ],
    }))
    .unwrap();
    commit(pool, "db-in", async |c| {
        authoring::create_ruleset(c, &ruleset).await.unwrap();
    })
    .await;
    for (id, hostname, labels, address) in [
        (DB, "db-1", &["app=db"][..], "10.1.0.5"),
        (WEB, "web-1", &["app=web"], "198.51.100.7"),
        (API, "api-1", &["app=api", "env=prod"], "10.9.0.7"),
    ] {
        let new = NewWorkload {
            id: id.parse().unwrap(),
            hostname: hostname.into(),
            labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
            addresses: [address.parse().unwrap()].into(),
        };
        commit(pool, hostname, async |c| {
            authoring::register_workload(c, &new).await.unwrap();
        })
        .await;
    }

    let ms = |minutes_ago: i64| (base - chrono::Duration::minutes(minutes_ago)).timestamp_millis();
    let record = |src: &str, port: u16, decision: Decision, minutes_ago: i64, packets: u64| FlowRecord {
        src: src.parse().unwrap(),
        dst: "10.1.0.5".parse().unwrap(),
        dst_port: port,
        protocol: Protocol::Tcp,
        decision,
        matched_rule: (decision == Allowed).then(|| RuleId::new("db-in.from-api", Protocol::Tcp).unwrap()),
        packets,
        bytes: packets * 60,
        new_connections: 1,
        first_seen_ms: ms(minutes_ago) + 1_000,
        last_seen_ms: ms(minutes_ago) + 50_000,
        pending: None,
    };
    let window =
        |id: u128, minutes_ago: i64, version: u64, records: Vec<FlowRecord>, gaps: Vec<EvidenceGap>| {
            FlowWindow {
                id: uuid::Uuid::from_u128(id),
                start_ms: ms(minutes_ago),
                end_ms: ms(minutes_ago) + 60_000,
                policy_version: version,
                mode: Mode::Simulation,
                records,
                gaps,
                staged_set: None,
            }
        };
    let windows = [
        window(
            0xf1,
            180,
            1,
            vec![record("10.9.0.7", 5432, Allowed, 180, 4), record("192.0.2.1", 22, WouldBlock, 180, 1)],
            vec![],
        ),
        window(
            0xf2,
            20,
            1,
            vec![
                record("10.9.0.7", 5432, Allowed, 20, 3),
                record("10.8.1.1", 5432, WouldBlock, 20, 2),
                record("192.0.2.1", 22, WouldBlock, 20, 1),
            ],
            vec![EvidenceGap::new(GapKind::MapFull, ms(20) + 5_000, ms(20) + 9_000, 7)],
        ),
        window(
            0xf3,
            10,
            2,
            vec![record("10.9.0.7", 5432, Allowed, 10, 5), record("192.0.2.1", 22, WouldBlock, 10, 2)],
            vec![
                EvidenceGap::new(GapKind::AgentRestart, ms(10), ms(10) + 2_000, 1),
                EvidenceGap::new(GapKind::UploadRefused, ms(10) + 3_000, ms(10) + 4_000, 2)
                    .because("too late"),
            ],
        ),
    ];
    let db: WorkloadId = DB.parse().unwrap();
    // The versions the windows claim, as if the host's agent had acked them.
    let installs = [
        (1, Mode::Simulation, base - chrono::Duration::minutes(200)),
        (2, Mode::Simulation, base - chrono::Duration::minutes(11)),
    ];
    innerwall_control_plane::testing::installed(pool, db, &installs).await.unwrap();
    for w in &windows {
        flows::ingest(pool, db, w).await.unwrap();
    }
}

/// One step of a script: a command (its arguments after the mode's global flags; `{name}` is
/// replaced by what the run learned), whether it must succeed, or SQL run on the mode's
/// database between commands.
enum Step {
    Ok(&'static [&'static str]),
    Fails(&'static [&'static str]),
    Sql(&'static str),
}

/// One way of running the CLI (a mode): its global flags and the database behind it.
struct Cli<'a> {
    global: Vec<String>,
    pool: &'a PgPool,
}

/// What a run learned: the workloads' ids, the last cursor printed, each minted token's
/// made-up parts by name.
struct Learned {
    vars: BTreeMap<String, String>,
    /// Text a mint made up, and the name it is shown as.
    made_up: Vec<(String, String)>,
    mints: usize,
}

impl Learned {
    fn new(known: &[(&str, &str)]) -> Learned {
        let ids = [("db", DB), ("web", WEB), ("api", API)];
        let vars = ids.iter().chain(known).map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Learned { vars, made_up: Vec::new(), mints: 0 }
    }

    fn substitute(&self, arg: &str) -> String {
        self.vars.iter().fold(arg.to_owned(), |a, (k, v)| a.replace(&format!("{{{k}}}"), v))
    }

    fn normalize(&self, text: &str) -> String {
        self.made_up.iter().fold(text.to_owned(), |t, (made, name)| t.replace(made, &format!("{{{name}}}")))
    }

    /// Learns from a step's output: a cursor to the next page, a minted token.
    fn learn(&mut self, args: &[String], stdout: &str, stderr: &str) {
        if let Some(cursor) = stdout.lines().chain(stderr.lines()).find_map(|l| l.split_once("--cursor ")) {
            self.vars.insert("cursor".into(), cursor.1.trim().to_owned());
        }
        if !args.windows(2).any(|w| w == ["token", "mint"]) {
            return;
        }
        self.mints += 1;
        let name = format!("token{}", self.mints);
        let (id, secret, expires) = if args.iter().any(|a| a == "--json") {
            let minted: serde_json::Value = serde_json::from_str(stdout).unwrap();
            let text = |k: &str| minted[k].as_str().unwrap().to_owned();
            (text("id"), text("token"), text("expires_at"))
        } else {
            let first = stdout.lines().next().unwrap();
            let (id, rest) = first.strip_prefix("token ").unwrap().split_once(" (expires ").unwrap();
            let expires = rest.strip_suffix("), shown once:").unwrap();
            let secret = stdout.lines().nth(2).unwrap().trim();
            (id.to_owned(), secret.to_owned(), expires.to_owned())
        };
        assert!(secret.starts_with("iw_"), "{stdout}");
        self.vars.insert(name.clone(), id.clone());
        self.made_up.push((secret, format!("{name}.secret")));
        self.made_up.push((id, name.clone()));
        self.made_up.push((expires, format!("{name}.expires")));
    }
}

/// Runs `steps` in `mode` (`known`: more `{name}`s to replace): a transcript entry per command
/// (stdout, any stderr; for a failure the exit code and the error line), with what mints made
/// up normalized.
async fn run(mode: &Cli<'_>, steps: &[Step], known: &[(&str, &str)]) -> Vec<String> {
    let mut learned = Learned::new(known);
    let mut transcript = Vec::new();
    for step in steps {
        let (written, must_succeed) = match step {
            Step::Ok(args) => (*args, true),
            Step::Fails(args) => (*args, false),
            Step::Sql(statement) => {
                sqlx::query(sqlx::AssertSqlSafe(*statement)).execute(mode.pool).await.unwrap();
                continue;
            }
        };
        let args: Vec<String> = written.iter().map(|a| learned.substitute(a)).collect();
        let mut all: Vec<&str> = mode.global.iter().map(String::as_str).collect();
        all.extend(args.iter().map(String::as_str));
        let (code, stdout, stderr) = innerwall(&all, &[]);
        let shown = written.join(" ");
        if must_succeed {
            assert_eq!(code, Some(0), "{all:?}: {stdout}{stderr}");
            learned.learn(&args, &stdout, &stderr);
            let stdout = learned.normalize(&stdout);
            transcript.push(format!("$ {shown}\n{stdout}stderr: {}", learned.normalize(&stderr)));
        } else {
            assert_ne!(code, Some(0), "{all:?} should fail: {stdout}");
            assert!(stdout.is_empty(), "{all:?} failed after printing {stdout}");
            let message = stderr.lines().rfind(|l| l.contains("error")).unwrap_or_default();
            transcript.push(format!("$ {shown} -> {code:?}: {}", learned.normalize(message)));
        }
    }
    transcript
}

/// Changes, once per mode. `web-1` (198.51.100.7) enters `db-1`'s peers only with a range that
/// holds it; SQL edits a label behind the renderer's back so `render` has something to repair.
const WRITES: &[Step] = &[
    Step::Ok(&["estate-range", "add", "198.51.100.0/24", "--description", "dmz"]),
    Step::Ok(&["--json", "estate-range", "add", "203.0.113.0/24"]),
    Step::Ok(&["estate-range", "remove", "203.0.113.0/24"]),
    Step::Ok(&["--json", "estate-range", "remove", "198.51.100.0/24"]),
    Step::Ok(&["estate-range", "add", "198.51.100.0/24", "--description", "dmz hosts"]),
    Step::Ok(&["estate-range", "add", "fd08::/48"]),
    Step::Ok(&["render"]),
    Step::Sql("UPDATE workload_labels SET value = 'batch' WHERE key = 'app' AND value = 'web'"),
    Step::Ok(&["--json", "render"]),
    Step::Sql("UPDATE workload_labels SET value = 'web' WHERE key = 'app' AND value = 'batch'"),
    Step::Ok(&["render"]),
    Step::Ok(&["--json", "render"]),
    Step::Ok(&[
        "token",
        "mint",
        "--label",
        "app=web",
        "--label",
        "env=prod",
        "--ttl",
        "2h",
        "--max-uses",
        "3",
        "--address-range",
        "198.51.100.0/24",
        "--server",
        "cp.example:7443",
    ]),
    Step::Ok(&["--json", "token", "mint", "--label", "app=db"]),
    Step::Ok(&["token", "mint", "--label", "app=api", "--ttl", "1d"]),
    Step::Ok(&["token", "revoke", "{token1}"]),
    Step::Ok(&["--json", "token", "revoke", "{token2}"]),
    Step::Ok(&["token", "revoke", "{token2}"]),
    // Each must fail the same way in both modes and change nothing.
    Step::Fails(&["token", "revoke", "00000000-0000-4000-8000-000000000001"]),
    Step::Fails(&["token", "revoke", "not-a-uuid"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--ttl", "400d"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--ttl", "0s"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--ttl", "1500ms"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--ttl", "10"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--label", "app=db"]),
    Step::Fails(&["token", "mint", "--label", "app=web", "--max-uses", "0"]),
    Step::Fails(&["token", "mint", "--label", "nolabel"]),
    Step::Fails(&["estate-range", "add", "198.51.100.0/24"]),
    Step::Fails(&["estate-range", "remove", "192.0.2.0/24"]),
    Step::Fails(&["estate-range", "add", "198.51.100.1/24"]),
    Step::Fails(&["estate-range", "add", "not-a-cidr"]),
    Step::Fails(&["estate-range", "remove", "10.0.0.0/99"]),
    Step::Fails(&["estate-range", "add", "192.0.2.0/24", "--description", LONG_DESCRIPTION]),
];

/// Longer than an estate range's description may be (1024 bytes).
const LONG_DESCRIPTION: &str = concat!(
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
);

/// Reads of the token list and estate ranges, on one database.
const READS: &[Step] = &[
    Step::Ok(&["token", "list"]),
    Step::Ok(&["--json", "token", "list"]),
    Step::Ok(&["estate-range", "list"]),
    Step::Ok(&["--json", "estate-range", "list"]),
];

/// Reads of the flow evidence, the same in both databases. Cursors are followed as printed.
const FLOW_READS: &[Step] = &[
    Step::Ok(&["flows", "list", "--workload", "{db}"]),
    Step::Ok(&["--json", "flows", "list", "--workload", "{db}", "--since", "6h"]),
    Step::Ok(&["flows", "list", "--workload", "{db}", "--since", "6h", "--decision", "would-block"]),
    Step::Ok(&["flows", "list", "--workload", "{db}", "--version", "2"]),
    Step::Ok(&["flows", "list", "--workload", "{db}", "--since", "1h 30m 500ms", "--limit", "2"]),
    Step::Ok(&[
        "flows",
        "list",
        "--workload",
        "{db}",
        "--since",
        "1h 30m 500ms",
        "--limit",
        "2",
        "--cursor",
        "{cursor}",
    ]),
    Step::Ok(&["--json", "flows", "list", "--workload", "{db}", "--limit", "1"]),
    Step::Ok(&["--json", "flows", "list", "--workload", "{db}", "--limit", "1", "--cursor", "{cursor}"]),
    Step::Ok(&["flows", "list", "--workload", "{web}"]),
    Step::Ok(&["flows", "gaps"]),
    Step::Ok(&["--json", "flows", "gaps", "--workload", "{db}", "--since", "1h"]),
    Step::Ok(&["flows", "gaps", "--limit", "1"]),
    Step::Ok(&["flows", "gaps", "--limit", "1", "--cursor", "{cursor}"]),
    Step::Ok(&["flows", "rollup", "--by", "rule"]),
    Step::Ok(&["--json", "flows", "rollup", "--by", "rule", "--since", "6h"]),
    Step::Ok(&["flows", "rollup", "--by", "rule-peer", "--since", "6h"]),
    Step::Ok(&["flows", "rollup", "--by", "src-dst", "--since", "6h"]),
    Step::Ok(&["--json", "flows", "rollup", "--by", "src-dst", "--since", "6h"]),
    Step::Ok(&[
        "flows",
        "rollup",
        "--by",
        "dst-service",
        "--decision",
        "would-block",
        "--decision",
        "allowed",
    ]),
    Step::Ok(&["flows", "rollup", "--by", "peer-service", "--since", "6h", "--peer-label", "app=api"]),
    Step::Ok(&["flows", "rollup", "--by", "peer-service", "--scope", "app=db", "--version", "1"]),
    Step::Ok(&["flows", "rollup", "--by", "rule", "--scope", "app=nobody,env=prod|staging"]),
    Step::Ok(&["--json", "flows", "rollup", "--by", "rule", "--scope", "app=nobody"]),
    Step::Ok(&["flows", "rollup", "--by", "rule", "--workload", "{db}", "--workload", "{api}"]),
    Step::Ok(&["flows", "rollup", "--by", "rule", "--workload", "{api}"]),
    Step::Ok(&["flows", "rollup", "--by", "rule", "--from", "{from}", "--to", "{to}"]),
    Step::Ok(&["flows", "rollup", "--by", "peer-service", "--since", "6h", "--limit", "1"]),
    Step::Ok(&[
        "flows",
        "rollup",
        "--by",
        "peer-service",
        "--since",
        "6h",
        "--limit",
        "1",
        "--cursor",
        "{cursor}",
    ]),
    Step::Fails(&["flows", "list", "--workload", "{db}", "--decision", "nope"]),
    Step::Fails(&["flows", "list", "--workload", "{db}", "--cursor", "bm9wZQ"]),
    Step::Fails(&["flows", "list", "--workload", "{db}", "--limit", "0"]),
    Step::Fails(&["flows", "list", "--workload", "not-a-workload"]),
    Step::Fails(&["flows", "gaps", "--cursor", "bogus"]),
    Step::Fails(&["flows", "gaps", "--since", "yesterday"]),
    Step::Fails(&["flows", "rollup", "--by", "nope"]),
    Step::Fails(&["flows", "rollup", "--by", "rule", "--cursor", "bogus"]),
    Step::Fails(&["flows", "rollup", "--by", "rule", "--scope", "nope"]),
    Step::Fails(&["flows", "rollup", "--by", "rule", "--peer-label", "bad!"]),
    Step::Fails(&["flows", "rollup", "--by", "rule", "--decision", "allowed,blocked"]),
    Step::Fails(&["flows", "rollup", "--by", "rule", "--since", "1h", "--from", "{from}"]),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_cli_matches_local_fleet() {
    let local = Plane::create(std::time::Duration::from_secs(3600), GatewayConfig::default()).await;
    let remote = Plane::create(std::time::Duration::from_secs(3600), GatewayConfig::default()).await;
    let base = Utc::now().trunc_subsecs(0);
    estate(local.pool(), base).await;
    estate(remote.pool(), base).await;

    let (_serve, api, ca) = Serve::api(&remote);
    let ca = ca.as_str();
    let admin = mint_token(&remote, "e2e-admin", "admin");
    let editor = mint_token(&remote, "e2e-editor", "editor");
    let viewer = mint_token(&remote, "e2e-viewer", "viewer");

    let on_db = |plane: &Plane| vec!["--database-url".to_owned(), plane.db.url.clone()];
    let through_api = |token: &str| -> Vec<String> {
        let token = token_file(&remote, token);
        ["--api", &api, "--token-file", &token, "--api-ca", ca].iter().map(|s| (*s).to_owned()).collect()
    };
    let local_a = Cli { global: on_db(&local), pool: local.pool() };
    let local_b = Cli { global: on_db(&remote), pool: remote.pool() };
    let remote_b = Cli { global: through_api(&admin), pool: remote.pool() };

    // Writes: database A locally, database B through the API.
    let by_db = run(&local_a, WRITES, &[]).await;
    let by_api = run(&remote_b, WRITES, &[]).await;
    assert_same(&by_db, &by_api);
    let joined = by_api.join("\n");
    for done in [
        "estate range 198.51.100.0/24 added\npolicy version changed for 1 workload(s):\n  00000000-0000-4000-8000-0000000000d1  v",
        "estate range fd08::/48 added\nno workload's policy changed",
        "\"changed\":[{\"",
        "$ render\nno workload's policy changed",
        "$ render\npolicy version changed for 1 workload(s):",
        "token {token1} (expires {token1.expires}), shown once:\n\n  {token1.secret}\n",
        "innerwall-agent enroll --server cp.example:7443 --ca-bundle /var/lib/innerwall/ca/ca.crt --token-file /etc/innerwall-agent/enroll-token",
        "\"token\": \"{token2.secret}\"",
        "token {token2} revoked; it enrolls nothing from now on",
        "provisioning token \"00000000-0000-4000-8000-000000000001\" not found",
        "ttl must be at most 365 days, got 400 days",
        "estate range \"198.51.100.0/24\" already exists",
        "estate range \"192.0.2.0/24\" not found",
        "estate range: description bytes",
    ] {
        assert!(joined.contains(done), "the script did not print {done:?}:\n{joined}");
    }
    // The API's changes are audited with the operator token that made them.
    let actors: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT action, actor FROM audit_log WHERE action IN ('estate-range.add', 'estate-range.remove', \
         'policy.render', 'token.mint', 'token.revoke') ORDER BY action",
    )
    .fetch_all(remote.pool())
    .await
    .unwrap();
    assert_eq!(actors.len(), 5, "{actors:?}");
    assert!(actors.iter().all(|(_, actor)| actor.starts_with("operator:e2e-admin/")), "{actors:?}");

    // Reads: database B locally and through the API; the flows also locally on database A.
    let from = (base - chrono::Duration::minutes(30)).to_rfc3339();
    let to = (base - chrono::Duration::minutes(5)).to_rfc3339();
    let range = [("from", from.as_str()), ("to", to.as_str())];
    let reads_b = run(&local_b, READS, &[]).await;
    assert_same(&reads_b, &run(&remote_b, READS, &[]).await);
    let flows_api = run(&remote_b, FLOW_READS, &range).await;
    assert_same(&run(&local_b, FLOW_READS, &range).await, &flows_api);
    assert_same(&run(&local_a, FLOW_READS, &range).await, &flows_api);
    let joined = format!("{}\n{}", reads_b.join("\n"), flows_api.join("\n"));
    for done in [
        "iw_",
        "app=web,env=prod  198.51.100.0/24",
        "0/3",
        "revoked",
        "198.51.100.0/24  dmz hosts",
        "fd08::/48",
        "\"cidr\": \"10.0.0.0/8\"",
        "workload 00000000-0000-4000-8000-0000000000a1 {\"app\":\"api\",\"env\":\"prod\"}",
        "group corp",
        "would-block",
        "truncated: more rows follow; next page: innerwall flows list … --cursor ",
        "truncated: more rows follow; next page: innerwall flows gaps … --cursor ",
        "truncated: more rows follow; next page: innerwall flows rollup … --cursor ",
        "map-full",
        "too late",
        "note: no live workload matches the scope app in (nobody) and env in (prod, staging) now",
        "db-in.from-api/tcp",
        "unknown decision \"nope\": use observed, allowed, would-block or blocked",
        "is not a cursor of a records query",
        "is not a cursor of a gaps query",
        "unknown grouping \"nope\"",
        "invalid value '0' for '--limit <LIMIT>'",
    ] {
        assert!(joined.contains(done), "the reads did not print {done:?}:\n{joined}");
    }

    // A token whose role is too low is refused with the 403 problem's detail and changes
    // nothing; a viewer still reads.
    let before = run(&local_b, READS, &[]).await;
    for (token, role, step) in [
        (&viewer, "admin", &["estate-range", "add", "192.0.2.0/24"][..]),
        (&editor, "admin", &["estate-range", "remove", "198.51.100.0/24"]),
        (&viewer, "editor", &["render"]),
        (&viewer, "editor", &["token", "mint", "--label", "app=web"]),
        (&viewer, "editor", &["token", "revoke", "00000000-0000-4000-8000-000000000001"]),
    ] {
        let global = through_api(token);
        let mut args: Vec<&str> = global.iter().map(String::as_str).collect();
        args.extend(step);
        let (code, stdout, stderr) = innerwall(&args, &[]);
        assert_eq!(code, Some(1), "{step:?}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{step:?}: {stdout}");
        assert!(
            stderr.contains(&format!("error: this needs the {role} role; the token ")),
            "{step:?}: {stderr}"
        );
    }
    assert_same(&before, &run(&local_b, READS, &[]).await);
    let as_viewer = Cli { global: through_api(&viewer), pool: remote.pool() };
    assert_same(&run(&as_viewer, READS, &[]).await, &before);
}

#[track_caller]
fn assert_same(a: &[String], b: &[String]) {
    assert_eq!(a.len(), b.len(), "the transcripts have different lengths");
    for (a, b) in a.iter().zip(b) {
        assert_eq!(a, b, "the two modes printed differently");
    }
}
