//! Version skew of the schema (issue 32, item 5): `previous_replica_serves_while_this_release_migrates`.
//!
//! One real Postgres database, migrated by the previous release's own `innerwall migrate` (the
//! commit tests/fixtures/previous-release pins, built by `cargo xtask test` into
//! target/previous/<commit>/) and nothing newer: this build's migrations are pending on it. The
//! previous release's `innerwall serve` runs on it (agent listener and operator API on loopback,
//! in a network namespace of the test's own; Postgres reached by its unix socket), and a real
//! agent (this tree's `innerwall-agent`) enrolls with a token the previous CLI minted and
//! enforces: SYNCED at its latest version, and real datagrams from a peer namespace prove it (the
//! admitted port receives, three others' datagrams are dropped and counted by the drop rule).
//!
//! Then this tree's `innerwall migrate` migrates the same database while the previous replica
//! serves (the agent's stream open, its pools' connections opened before the DDL), and the test
//! proves the previous replica keeps serving on the migrated schema:
//! - the database is really ahead of the previous build: the previous CLI, which migrates (and
//!   so checks) on every local start, is refused with the unknown migration named;
//! - a policy change made through the previous CLI, over the previous replica's operator API
//!   (that replica renders and commits it on the migrated schema), reaches the agent: SYNCED at
//!   the new version, and the newly admitted port receives while the others stay blocked;
//! - the flow window the agent closed at that change (with the datagrams it dropped before the
//!   migration) is ingested by the previous replica — the only replica the agent talks to — after
//!   the migration: its row's `received_at` is after the migration ended;
//! - this tree's CLI reads the same state from the database: the workload SYNCED at that
//!   version, both rulesets, and the blocked records of that window (both blocked ports);
//! - this tree's `innerwall serve` starts beside it on the migrated database (its startup render
//!   is printed: whether it re-rendered the previous release's policies), and a change made
//!   through its API (with the operator token the previous CLI minted) reaches the agent held by
//!   the previous replica: the commit's NOTIFY crosses from this release's replica to the
//!   previous one's bridge, whose delta the agent applies (SYNCED, and the new port receives).
//!
//! Not tested:
//! - a previous replica *restarting* on the migrated schema. The pinned release predates
//!   `postgres::schema`: its sqlx migrator refuses to start on a database with migrations it does
//!   not know (the refused CLI above is that same check), so during this upgrade a previous
//!   replica that exits after the migration stays down until this release replaces it. From this
//!   release on a replica serves a schema ahead of it (`postgres::schema`, `Plan::Current {
//!   ahead }`), so the next release's skew covers restarts too;
//! - the migration's locks at scale: the database here is small, so a migration's table locks
//!   (an index built on `flow_windows`, a table filled from `flow_rollups`) last milliseconds;
//!   on a large estate ingest waits for them;
//! - the previous replica's periodic jobs (roll-ups, retention, partition upkeep) on the migrated
//!   schema: they run on their own schedule and nothing here waits for one; nor data that only
//!   this release maintains (migration 0034's `flow_key_lasts` is written by this release's
//!   roll-up job, not the previous one's);
//! - the previous *agent* (previous.rs and packages.rs run it against this release).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use innerwall_control_plane::policy::store;
use innerwall_control_plane::postgres::{self, quote_ident, with_database};
use innerwall_control_plane::testing::fresh_database;
use sqlx::{AssertSqlSafe, PgPool};

use crate::host::{Agent, Namespace, PEER_ADDRESS, Peer, require_root, wait_until};
use crate::previous::{Receiver, drop_counter, previous_release, send_from};

/// The previous replica's agent listener and API, and this release's, in the test's namespace.
const PREVIOUS_LISTEN: u16 = 7443;
const PREVIOUS_API: u16 = 7444;
const CURRENT_LISTEN: u16 = 7445;
const CURRENT_API: u16 = 7446;

/// `innerwall serve` (either release's) with its log in a file; killed by its PID on drop.
struct Replica {
    child: Child,
    log: PathBuf,
}

impl Replica {
    /// Starts `binary serve` and returns once it announced its listener.
    fn start(binary: &Path, global: &[String], listen: u16, api: u16, log: PathBuf) -> Replica {
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("INNERWALL_LOG", "info")
            .args(global)
            .args(["serve", "--listen", &format!("127.0.0.1:{listen}"), "--server-name", "localhost"])
            .args(["--api-listen", &format!("127.0.0.1:{api}")])
            // Windows close at a version change only (not by time): the test knows which
            // replica ingests which window.
            .args(["--flow-window", "1h"])
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {} serve: {e}", binary.display()));
        let mut replica = Replica { child, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = replica.text();
            if text.contains("listening on") {
                return replica;
            }
            if let Some(status) = replica.child.try_wait().unwrap() {
                panic!("{} serve exited ({status}) before listening:\n{text}", binary.display());
            }
            assert!(Instant::now() < deadline, "{} serve never listened:\n{text}", binary.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics unless the process still runs.
    fn assert_running(&mut self, what: &str) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{what}: the replica exited ({status}):\n{}", self.text());
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `binary global args`: exit code, stdout, stderr; no `INNERWALL_*` from the test's environment.
fn cli(binary: &Path, global: &[String], args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(binary)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .args(global)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", binary.display()));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// [`cli`] that must succeed: its stdout.
fn ok(binary: &Path, global: &[String], args: &[&str]) -> String {
    let (code, stdout, stderr) = cli(binary, global, args);
    assert_eq!(code, Some(0), "{} {args:?}: {stdout}{stderr}", binary.display());
    stdout
}

/// A database of the test's own on the harness's server, created empty (no migration applied);
/// dropped on drop.
struct EmptyDatabase {
    url: String,
    name: String,
    /// A database on the same server to drop it from.
    via: String,
}

impl EmptyDatabase {
    async fn create(pool: &PgPool, via: &str) -> EmptyDatabase {
        let name = format!("iw_skew_{}", uuid::Uuid::new_v4().simple());
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {}", quote_ident(&name))))
            .execute(pool)
            .await
            .unwrap();
        EmptyDatabase { url: with_database(via, &name), name, via: via.to_owned() }
    }
}

impl Drop for EmptyDatabase {
    fn drop(&mut self) {
        let (via, name) = (self.via.clone(), self.name.clone());
        // A thread with a runtime of its own: Drop runs inside the test's runtime.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                use sqlx::Connection as _;
                if let Ok(mut conn) = sqlx::PgConnection::connect(&via).await {
                    let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(&name));
                    let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut conn).await;
                }
            });
        })
        .join();
    }
}

/// The migrations applied to the database behind `pool`.
async fn applied(pool: &PgPool) -> Vec<postgres::Applied> {
    postgres::applied(&mut pool.acquire().await.unwrap()).await.unwrap()
}

/// (state, applied version, latest version) of `id`.
async fn status(pool: &PgPool, id: uuid::Uuid) -> (String, i64, Option<i64>) {
    let id = innerwall_wire::identity::WorkloadId::from_uuid(id).unwrap();
    let s = store::sync_status(&mut pool.acquire().await.unwrap(), Some(id)).await.unwrap().remove(0);
    (s.state.0.name().to_owned(), s.applied_version, s.latest_version)
}

/// Waits until `id` is SYNCED at its latest version, and that version is above `above`.
async fn synced_above(pool: &PgPool, id: uuid::Uuid, above: i64, state: &Path, what: &str) -> i64 {
    wait_until(what, state, async || {
        let (s, applied, latest) = status(pool, id).await;
        (s == "SYNCED" && Some(applied) == latest && applied > above).then_some(applied)
    })
    .await
}

/// A ruleset admitting udp `port` from the peer to every `app=web` workload, in a file.
fn ruleset(dir: &Path, port: u16) -> String {
    let path = dir.join(format!("udp{port}.yaml"));
    std::fs::write(
        &path,
        format!(
            "name: udp{port}\nscope: {{app: [web]}}\nrules:\n  - name: from-peer\n    peers:\n      - cidr: {PEER_ADDRESS}/32\n    services: [udp{port}]\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_owned()
}

/// Sends 10 datagrams to each port of `blocked` and `admitted` from the peer, then a marker to
/// 7000: once it arrives every datagram before it was judged. Asserts the admitted ports got
/// all of theirs and the blocked none.
fn probe(peer_netns: &str, receivers: &[(u16, Receiver)], admitted: &[u16], marker: &str) {
    let mut datagrams: Vec<(u16, Vec<u8>)> = Vec::new();
    for i in 0..10u8 {
        for (port, _) in receivers.iter().filter(|(p, _)| *p != 7000) {
            datagrams.push((*port, vec![i]));
        }
    }
    datagrams.push((7000, marker.as_bytes().to_vec()));
    send_from(peer_netns, datagrams);
    let marker_port = &receivers.iter().find(|(p, _)| *p == 7000).unwrap().1;
    marker_port.wait_for(marker.as_bytes());
    for (port, receiver) in receivers.iter().filter(|(p, _)| *p != 7000) {
        let got = receiver.queued().len();
        if admitted.contains(port) {
            assert_eq!(got, 10, "{marker}: udp {port} is admitted, {got} of 10 datagrams arrived");
        } else {
            assert_eq!(got, 0, "{marker}: udp {port} is blocked, {got} datagrams got through");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_replica_serves_while_this_release_migrates() {
    require_root();
    let started = Instant::now();
    let (commit, previous_dir) = previous_release();
    let previous = previous_dir.join("innerwall");
    assert!(
        previous.is_file(),
        "{} is missing: `cargo xtask previous` (or `cargo xtask test`) builds the previous release's innerwall",
        previous.display()
    );
    let current = innerwall_e2e::workspace_bin("innerwall");
    let agent_binary = innerwall_e2e::workspace_bin("innerwall-agent");
    assert!(agent_binary.is_file());

    // An empty database beside the harness's migrated ones.
    let harness = fresh_database().await.unwrap();
    assert!(
        harness.url.contains("host=/"),
        "this test runs both replicas in a network namespace and reaches Postgres by its unix socket; \
         the harness's server is at {} (unset {} to use the private server)",
        postgres::redact_url(&harness.url),
        innerwall_control_plane::testing::DATABASE_URL_ENV
    );
    let db = EmptyDatabase::create(&harness.pool, &harness.url).await;
    eprintln!("skew: binaries and database server ready at {:.1} s", started.elapsed().as_secs_f64());
    let dir = std::env::temp_dir().join(format!("iw-skew-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveDir(dir.clone());
    let global = |state: &str| -> Vec<String> {
        vec![
            "--database-url".into(),
            db.url.clone(),
            "--state-dir".into(),
            dir.join(state).to_str().unwrap().into(),
            "--ca-dir".into(),
            dir.join("ca").to_str().unwrap().into(),
        ]
    };

    // The schema as the previous release leaves it.
    ok(&previous, &global("previous-cli"), &["migrate"]);
    let pool = postgres::pool_options().max_connections(3).connect(&db.url).await.unwrap();
    let behind = match postgres::plan_build(&applied(&pool).await) {
        Ok(postgres::Plan::Behind { pending }) => pending,
        other => panic!("the previous release's migrations should leave this build's pending: {other:?}"),
    };
    eprintln!(
        "skew: previous release {commit} migrated the database at {:.1} s; this build's pending: {behind:?}",
        started.elapsed().as_secs_f64()
    );
    ok(&previous, &global("previous-cli"), &["ca", "init"]);
    for port in [7000u16, 7001, 7002] {
        ok(
            &previous,
            &global("previous-cli"),
            &["service", "create", &format!("udp{port}"), "--entry", &format!("udp:{port}")],
        );
    }
    ok(&previous, &global("previous-cli"), &["ruleset", "create", "-f", &ruleset(&dir, 7000)]);
    let minted = ok(&previous, &global("previous-cli"), &["--json", "token", "mint", "--label", "app=web"]);
    let minted: serde_json::Value = serde_json::from_str(&minted).unwrap();
    let token_file = dir.join("enroll-token");
    std::fs::write(&token_file, minted["token"].as_str().expect("a provisioning token")).unwrap();
    let operator = ok(
        &previous,
        &global("previous-cli"),
        &["--json", "operator", "token", "mint", "--name", "skew", "--role", "editor"],
    );
    let operator: serde_json::Value = serde_json::from_str(&operator).unwrap();
    let operator_file = dir.join("operator-token");
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&operator_file)
            .unwrap();
        std::io::Write::write_all(
            &mut file,
            operator["token"].as_str().expect("an operator token").as_bytes(),
        )
        .unwrap();
    }
    let ca_bundle = dir.join("ca/ca.crt");
    let api = |port: u16| -> Vec<String> {
        vec![
            "--api".into(),
            format!("https://localhost:{port}"),
            "--api-ca".into(),
            ca_bundle.to_str().unwrap().into(),
            "--token-file".into(),
            operator_file.to_str().unwrap().into(),
        ]
    };

    // The estate: everything from here on runs in the host's namespace (this thread's), the
    // database reached by its socket.
    let netns = format!("iw-skew-{}", std::process::id());
    let ns = Namespace::create(netns.clone());
    let peer = Peer::create(&ns);
    let peer_netns = format!("{netns}-peer");
    ns.enter();
    let mut old = Replica::start(
        &previous,
        &global("previous-serve"),
        PREVIOUS_LISTEN,
        PREVIOUS_API,
        dir.join("previous-serve.log"),
    );
    eprintln!("skew: previous replica listening at {:.1} s", started.elapsed().as_secs_f64());
    let state = dir.join("agent");
    let server = format!("localhost:{PREVIOUS_LISTEN}");
    let out = Command::new(&agent_binary)
        .args(["enroll", "--server", &server, "--token-file"])
        .arg(&token_file)
        .arg("--ca-bundle")
        .arg(&ca_bundle)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert!(out.status.success(), "enroll: {}", String::from_utf8_lossy(&out.stderr));
    let _agent = Agent::start(&state, &server);
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM workloads").fetch_one(&pool).await.unwrap();
    ok(
        &previous,
        &global("previous-cli"),
        &["workload", "mode", &id.to_string(), "enforcement", "--override", "the skew test"],
    );
    let v1 = synced_above(&pool, id, 0, &state, "SYNCED and enforcing on the previous replica").await;
    let receivers: Vec<(u16, Receiver)> = [7000, 7001, 7002, 7003].map(|p| (p, Receiver::bind(p))).into();
    let dropped_before = drop_counter(&netns).expect("the enforced table's drop rule");
    probe(&peer_netns, &receivers, &[], "v1 (before the migration)");
    assert!(
        drop_counter(&netns).unwrap() >= dropped_before + 30,
        "the table's drop rule counted the blocked datagrams"
    );
    let windows_at_v1: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM flow_windows WHERE workload_id = $1 AND policy_version = $2",
    )
    .bind(id)
    .bind(v1)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(windows_at_v1, 0, "the window of v{v1} closes only when the next version is applied");
    eprintln!(
        "skew: agent enforcing v{v1} through the previous replica at {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // This release migrates the database under the serving previous replica.
    let migrating = Instant::now();
    let said = ok(&current, &global("current-cli"), &["migrate"]);
    let migrated_in = migrating.elapsed();
    let migrated_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await.unwrap();
    match postgres::plan_build(&applied(&pool).await) {
        Ok(postgres::Plan::Current { ahead }) if ahead.is_empty() => {}
        other => panic!("this release's migrate left {other:?}; it said: {said}"),
    }
    old.assert_running("after this release migrated");
    let (code, stdout, stderr) = cli(&previous, &global("previous-cli"), &["service", "list"]);
    assert!(
        code != Some(0) && behind.iter().any(|v| stderr.contains(&format!("migration {v} "))),
        "the previous CLI should refuse to start on the migrated database, naming a migration it lacks: {stdout}{stderr}"
    );
    let refusal = stderr.lines().last().unwrap_or_default().to_owned();
    eprintln!(
        "skew: this release migrated {behind:?} in {:.1} s while the previous replica served; the previous CLI now says: {refusal}",
        migrated_in.as_secs_f64()
    );

    // A change through the previous CLI, over the previous replica's API, after the migration.
    ok(&previous, &api(PREVIOUS_API), &["ruleset", "create", "-f", &ruleset(&dir, 7001)]);
    let v2 =
        synced_above(&pool, id, v1, &state, "SYNCED at the change made through the previous replica").await;
    probe(&peer_netns, &receivers, &[7001], "v2 (made through the previous replica after the migration)");
    old.assert_running("after serving the change");

    // The window the agent closed at v2 holds what v1 dropped: ingested by the previous
    // replica, the only one the agent talks to, after the migration.
    let (received, records): (chrono::DateTime<chrono::Utc>, i32) =
        wait_until("the window of v1 ingested by the previous replica", &state, async || {
            sqlx::query_as(
                "SELECT received_at, record_count FROM flow_windows
                 WHERE workload_id = $1 AND policy_version = $2 AND record_count > 0
                 ORDER BY received_at DESC LIMIT 1",
            )
            .bind(id)
            .bind(v1)
            .fetch_optional(&pool)
            .await
            .unwrap()
        })
        .await;
    assert!(
        received > migrated_at,
        "the window of v{v1} was received at {received}, before the migration ended at {migrated_at}"
    );

    // This release's CLI reads the same state.
    let current_cli = global("current-cli");
    let status: serde_json::Value =
        serde_json::from_str(&ok(&current, &current_cli, &["--json", "workload", "status", &id.to_string()]))
            .unwrap();
    let status = &status.as_array().expect("a list")[0];
    assert_eq!(
        (status["state"].as_str(), status["applied_version"].as_i64()),
        (Some("SYNCED"), Some(v2)),
        "{status}"
    );
    let rulesets = ok(&current, &current_cli, &["ruleset", "list"]);
    assert!(rulesets.contains("udp7000") && rulesets.contains("udp7001"), "{rulesets}");
    let blocked = ok(
        &current,
        &current_cli,
        &[
            "--json",
            "flows",
            "list",
            "--workload",
            &id.to_string(),
            "--decision",
            "blocked",
            "--version",
            &v1.to_string(),
        ],
    );
    let blocked: serde_json::Value = serde_json::from_str(&blocked).unwrap();
    let ports: std::collections::BTreeSet<i64> = blocked
        .as_array()
        .unwrap_or_else(|| panic!("flows list --json prints a list: {blocked}"))
        .iter()
        .filter_map(|r| r["dst_port"].as_i64())
        .collect();
    assert!(
        ports.contains(&7001) && ports.contains(&7003),
        "this release reads the blocked records of v{v1} the previous replica ingested ({records} records): {blocked}"
    );

    // This release's replica beside it: a change through it reaches the agent on the previous
    // one (the commit's NOTIFY, from this release's replica to the previous one's bridge).
    let new = Replica::start(
        &current,
        &global("current-serve"),
        CURRENT_LISTEN,
        CURRENT_API,
        dir.join("current-serve.log"),
    );
    // Its startup render may advance the workload (if this release renders the same authored
    // policy differently): the change below is judged against what the agent holds after it.
    let log = new.text();
    let rendered = log.split("startup render advanced").nth(1).and_then(|rest| rest.split(';').next());
    let rendered = format!(
        "startup render advanced{}",
        rendered.expect("this release's replica names its startup render")
    );
    let before = synced_above(&pool, id, v2 - 1, &state, "SYNCED once this release's replica started").await;
    ok(&current, &api(CURRENT_API), &["ruleset", "create", "-f", &ruleset(&dir, 7002)]);
    let v3 =
        synced_above(&pool, id, before, &state, "SYNCED at the change made through this release's replica")
            .await;
    probe(&peer_netns, &receivers, &[7001, 7002], "v3 (made through this release's replica)");
    old.assert_running("at the end");
    assert!(new.text().contains("listening on"));
    eprintln!(
        "skew: v{v1} -> v{v2} (previous replica's API, after the migration) -> v{v3} (this release's API, \
         through NOTIFY to the previous replica); window of v{v1} with {records} records ingested after the \
         migration; this release's replica: {rendered}; {:.1} s in all",
        started.elapsed().as_secs_f64()
    );
    drop(peer);
}

/// Removes the test's directory on drop.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
