//! Issue 25 item 6 (OPS-2, OPS-5, POL-8) on a real Postgres, the API over real HTTPS and the
//! `innerwall` binary, locally and with `--api`: every list walks its cursor over more rows than
//! a page, each row once; the audit log reads back what the test's own changes wrote, by actor,
//! action and object; a closed stdout ends a command quietly; an update or delete without
//! `--expect-version` is refused before anything is read or written.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::{ApiConfig, ApiLimits, ApiTls};
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::operators::{self, Role};
use innerwall_control_plane::postgres::Pools;
use innerwall_control_plane::service::{self, Running};
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::Value;
use sqlx::PgPool;

/// A replica with its API on loopback; the CLI reaches it with [`Plane::remote`].
struct Plane {
    db: TestDatabase,
    dir: PathBuf,
    running: Option<Running>,
    addr: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    ca: PathBuf,
}

impl Plane {
    async fn start() -> Plane {
        let db = fresh_database().await.unwrap();
        let dir = std::env::temp_dir().join(format!("iw-lists-{}", uuid::Uuid::new_v4()));
        let signer = Arc::new(FileCa::init(&dir.join("ca")).unwrap());
        let config = innerwall_control_plane::testing::loopback_service();
        let mut running =
            service::start(Pools::shared(db.pool.clone()), signer.clone(), config).await.unwrap();
        let api = ApiConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tls: ApiTls::FromCa { names: vec!["localhost".into()], lifetime: Duration::from_secs(3600) },
            limits: ApiLimits::default(),
        };
        let addr = running.start_api(api).await.unwrap();
        let pem = signer.ca_bundle_pem();
        let ca = dir.join("api-ca.pem");
        std::fs::write(&ca, &pem).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let client =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(client));
        Plane { db, dir, running: Some(running), addr, tls, ca }
    }

    fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.stop().await.unwrap();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// `GET path` with `token` over HTTPS: the status and the JSON answer.
    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let stream = self.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let request = hyper::Request::builder()
            .uri(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {token}"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// Every row of the API list at `path` in pages of `limit`, following `next_cursor`, and
    /// how many pages that took.
    async fn walk(&self, path: &str, token: &str, limit: u32) -> (Vec<Value>, usize) {
        let separator = if path.contains('?') { '&' } else { '?' };
        let (mut rows, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
        loop {
            let mut url = format!("{path}{separator}limit={limit}");
            if let Some(cursor) = &cursor {
                url.push_str(&format!("&cursor={cursor}"));
            }
            let (status, page) = self.get(&url, token).await;
            assert_eq!(status, 200, "GET {url}: {page}");
            let got = page["rows"].as_array().unwrap_or_else(|| panic!("GET {url}: not a page: {page}"));
            assert!(got.len() <= limit as usize, "GET {url}: {} rows in a page of {limit}", got.len());
            assert_eq!(page["truncated"], page["next_cursor"].is_string(), "{page}");
            rows.extend(got.iter().cloned());
            pages += 1;
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return (rows, pages),
            }
        }
    }

    /// The global flags of a CLI run against this plane's API with `token` (in a file).
    fn remote(&self, token: &str) -> Vec<String> {
        let url = format!("https://localhost:{}", self.addr.port());
        let token = crate::foresight_api::token_file(&self.dir, token);
        ["--api", &url, "--token-file", token.to_str().unwrap(), "--api-ca", self.ca.to_str().unwrap()]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }

    fn local(&self) -> Vec<String> {
        vec!["--database-url".to_owned(), self.db.url.clone()]
    }
}

/// `innerwall <global> <args>` as operator `user`: exit code, stdout, stderr.
fn innerwall(global: &[String], user: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    for var in [
        "INNERWALL_API",
        "INNERWALL_TOKEN",
        "INNERWALL_API_TOKEN",
        "INNERWALL_API_CA",
        "INNERWALL_DATABASE_URL",
        "SUDO_USER",
    ] {
        command.env_remove(var);
    }
    let out = command.env("USER", user).args(global).args(args).output().expect("running innerwall");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// [`innerwall`] that must succeed.
#[track_caller]
fn ok(global: &[String], user: &str, args: &[&str]) -> String {
    let (code, stdout, stderr) = innerwall(global, user, args);
    assert_eq!(code, Some(0), "innerwall {args:?}: {stderr}");
    stdout
}

/// The `key` of every row, asserting each appears once.
#[track_caller]
fn keys(rows: &[Value], key: &str, what: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for row in rows {
        let k = row[key].as_str().map_or_else(|| row[key].to_string(), str::to_owned);
        assert!(seen.insert(k.clone()), "{what}: {k} listed twice");
    }
    seen
}

async fn column(pool: &PgPool, sql: &str) -> BTreeSet<String> {
    sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The ids of the audit records `sql` selects (`SELECT id::text FROM audit_log WHERE …`).
async fn audit_ids(pool: &PgPool, sql: &str) -> BTreeSet<String> {
    column(pool, sql).await
}

fn write_ruleset(dir: &std::path::Path, name: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, format!("name: {name}\nscope: {{app: [{name}]}}\nrules: []\n")).unwrap();
    path.to_str().unwrap().to_owned()
}

const PAGE: u32 = 2;

// The CLI runs as a blocking child process while this process serves its API: two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_pages_and_audit_reads_back() {
    let plane = Plane::start().await;
    let pool = plane.pool().clone();
    let admin = operators::mint_audited(&pool, "cli:setup", "ada", Role::Admin, operators::Expiry::Never)
        .await
        .unwrap();
    let editor = operators::mint_audited(&pool, "cli:setup", "ed", Role::Editor, operators::Expiry::Never)
        .await
        .unwrap();
    let promoter =
        operators::mint_audited(&pool, "cli:setup", "pat", Role::Promoter, operators::Expiry::Never)
            .await
            .unwrap();
    for i in 0..3 {
        operators::mint_audited(
            &pool,
            "cli:setup",
            &format!("spare-{i}"),
            Role::Viewer,
            operators::Expiry::Never,
        )
        .await
        .unwrap();
    }
    let (local, as_editor, as_admin, as_promoter) = (
        plane.local(),
        plane.remote(&editor.token),
        plane.remote(&admin.token),
        plane.remote(&promoter.token),
    );
    let editor_actor = format!("operator:ed/{}", editor.id);
    // $USER, which the local actor ignores: it is the real uid's user name (issue 26, item 7).
    let user = "lister";
    let me = nix::unistd::User::from_uid(nix::unistd::getuid()).unwrap().expect("this uid has a user name");
    let local_actor = format!("cli:{}", me.name);

    // More rows than a page of everything, written half here, half through the API.
    for i in 0..5 {
        let (global, name) =
            if i % 2 == 0 { (&local, format!("svc-{i}")) } else { (&as_editor, format!("svc-{i}")) };
        ok(global, user, &["service", "create", &name, "--entry", &format!("tcp:{}", 8000 + i)]);
        let group = format!("grp-{i}");
        ok(global, user, &["address-group", "create", &group, "--cidr", &format!("10.20.{i}.0/24")]);
        let file = write_ruleset(&plane.dir.join("rulesets"), &format!("rs-{i}"));
        ok(global, user, &["ruleset", "create", "--file", &file]);
        ok(global, user, &["token", "mint", "--label", &format!("app=t{i}")]);
        let admin_global = if i % 2 == 0 { &local } else { &as_admin };
        ok(admin_global, user, &["estate-range", "add", &format!("198.51.{i}.0/24")]);
    }
    // An update and a delete, each conditional, each audited.
    ok(&as_editor, user, &["service", "update", "svc-1", "--entry", "tcp:9001", "--expect-version", "1"]);
    ok(&local, user, &["service", "create", "doomed", "--entry", "icmp"]);
    ok(&local, user, &["service", "delete", "doomed", "--expect-version", "1"]);
    // Promotions need a workload: one, moved back and forth.
    let web = innerwall_wire::identity::WorkloadId::new_random();
    let new = innerwall_control_plane::policy::spec::NewWorkload {
        id: web,
        hostname: "web-1".into(),
        labels: ["app=web".parse().unwrap()].into_iter().collect(),
        addresses: BTreeSet::new(),
    };
    innerwall_control_plane::foresight::commit(&pool, "test", "register", "web-1", async |c| {
        innerwall_control_plane::policy::authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    for (i, to) in ["simulation", "visibility", "simulation", "visibility", "simulation"].iter().enumerate() {
        let global = if i % 2 == 0 { &local } else { &as_promoter };
        let args = [
            "workload",
            "promote",
            "--scope",
            "app=web",
            "--expect-count",
            "1",
            "--to",
            to,
            "--reason",
            "test",
        ];
        ok(global, user, &args);
    }

    // Each list: the API a page of 2 at a time, the CLI (locally and remotely) walking pages of
    // 2 — every row the database holds, each once, over more than one page.
    let lists: [(&str, &str, &[&str], &str, &str); 7] = [
        ("/api/v1/services", "name", &["service", "list"], "SELECT name FROM services", "editor"),
        (
            "/api/v1/address-groups",
            "name",
            &["address-group", "list"],
            "SELECT name FROM address_groups",
            "editor",
        ),
        ("/api/v1/rulesets", "name", &["ruleset", "list"], "SELECT name FROM rulesets", "editor"),
        (
            "/api/v1/estate-ranges",
            "cidr",
            &["estate-range", "list"],
            "SELECT cidr::text FROM estate_ranges",
            "editor",
        ),
        (
            "/api/v1/provisioning-tokens",
            "id",
            &["token", "list"],
            "SELECT id::text FROM provisioning_tokens",
            "editor",
        ),
        ("/api/v1/promotions", "id", &["promotions", "list"], "SELECT id::text FROM promotions", "editor"),
        (
            "/api/v1/operator-tokens",
            "id",
            &["operator", "token", "list"],
            "SELECT id FROM operator_tokens",
            "admin",
        ),
    ];
    let page = PAGE.to_string();
    for (path, key, command, truth, role) in lists {
        let stored = column(&pool, truth).await;
        assert!(stored.len() > 2 * PAGE as usize, "{path}: only {} rows", stored.len());
        let token = if role == "admin" { &admin.token } else { &editor.token };
        let (rows, pages) = plane.walk(path, token, PAGE).await;
        assert_eq!(keys(&rows, key, path), stored, "{path}");
        assert_eq!(pages, stored.len().div_ceil(PAGE as usize), "{path}: pages");
        // Without a limit: one page of the default size, which holds them all here.
        let (status, first) = plane.get(path, token).await;
        assert_eq!((status, first["truncated"].as_bool()), (200, Some(false)), "{path}: {first}");

        let mut modes = vec![("local", local.clone())];
        if command[0] != "operator" {
            modes.push(("remote", if role == "admin" { as_admin.clone() } else { as_editor.clone() }));
        }
        for (mode, global) in modes {
            let mut args = vec!["--json", "--page-size", &page];
            args.extend_from_slice(command);
            let printed: Vec<Value> = serde_json::from_str(&ok(&global, user, &args)).unwrap();
            assert_eq!(keys(&printed, key, &format!("{mode} {command:?}")), stored, "{mode} {command:?}");
        }
    }
    // Newest first, across pages too.
    let (rows, _) = plane.walk("/api/v1/promotions", &editor.token, PAGE).await;
    let at: Vec<&str> = rows.iter().map(|r| r["at"].as_str().unwrap()).collect();
    assert!(at.windows(2).all(|w| w[0] >= w[1]), "{at:?}");
    let printed: Vec<Value> =
        serde_json::from_str(&ok(&local, user, &["--json", "promotions", "list", "--limit", "3"])).unwrap();
    assert_eq!(printed, rows[..3], "--limit keeps the newest");
    // A cursor of one list is refused by another.
    let (_, services) = plane.get(&format!("/api/v1/services?limit={PAGE}"), &editor.token).await;
    let cursor = services["next_cursor"].as_str().unwrap();
    let (status, problem) = plane.get(&format!("/api/v1/rulesets?cursor={cursor}"), &editor.token).await;
    assert_eq!(status, 400, "{problem}");

    // Resend-snapshot is audited, once per call, whichever edge calls it.
    sqlx::query("UPDATE workloads SET sync_state = 2, last_seen_at = now() WHERE id = $1")
        .bind(web.uuid())
        .execute(&pool)
        .await
        .unwrap();
    ok(&local, user, &["workload", "resend-snapshot", &web.to_string()]);
    ok(&as_editor, user, &["workload", "resend-snapshot", &web.to_string()]);

    // The audit log reads back what this test wrote: by actor, by action, by object.
    let by_editor =
        audit_ids(&pool, &format!("SELECT id::text FROM audit_log WHERE actor = '{editor_actor}'")).await;
    let by_user =
        audit_ids(&pool, &format!("SELECT id::text FROM audit_log WHERE actor = '{local_actor}'")).await;
    // The editor created 2 services, 2 groups, 2 rulesets, 2 tokens, updated one, resent one.
    assert_eq!(by_editor.len(), 10, "{by_editor:?}");
    assert!(by_user.len() > 10, "{by_user:?}");
    let actor_query = format!("/api/v1/audit?actor={}", editor_actor.replace('/', "%2F").replace(':', "%3A"));
    let (rows, pages) = plane.walk(&actor_query, &editor.token, PAGE).await;
    assert_eq!(keys(&rows, "id", "audit by actor"), by_editor);
    assert_eq!(pages, 5);
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "newest first: {ids:?}");
    for (mode, global) in [("local", &local), ("remote", &as_editor)] {
        let printed: Vec<Value> = serde_json::from_str(&ok(
            global,
            user,
            &["--json", "--page-size", &page, "audit", "list", "--actor", &editor_actor],
        ))
        .unwrap();
        assert_eq!(keys(&printed, "id", mode), by_editor, "{mode}");
        assert!(printed.iter().all(|r| r["actor"] == editor_actor.as_str()), "{mode}");
        let actions: BTreeSet<&str> = printed.iter().map(|r| r["action"].as_str().unwrap()).collect();
        let expected = [
            "address-group.create",
            "ruleset.create",
            "service.create",
            "service.update",
            "token.mint",
            "workload.resend-snapshot",
        ];
        assert_eq!(actions, expected.into_iter().collect(), "{mode}");

        let printed: Vec<Value> = serde_json::from_str(&ok(
            global,
            user,
            &["--json", "--page-size", &page, "audit", "list", "--action", "service.create", "--since", "1h"],
        ))
        .unwrap();
        let created =
            audit_ids(&pool, "SELECT id::text FROM audit_log WHERE action = 'service.create'").await;
        assert_eq!(created.len(), 6);
        assert_eq!(keys(&printed, "id", mode), created, "{mode}");
        let subjects: BTreeSet<&str> = printed.iter().map(|r| r["subject"].as_str().unwrap()).collect();
        assert!(subjects.contains("svc-1") && subjects.contains("doomed"), "{subjects:?}");

        let printed: Vec<Value> = serde_json::from_str(&ok(
            global,
            user,
            &[
                "--json",
                "audit",
                "list",
                "--action",
                "workload.resend-snapshot",
                "--object",
                &web.to_string(),
            ],
        ))
        .unwrap();
        let actors: Vec<&str> = printed.iter().map(|r| r["actor"].as_str().unwrap()).collect();
        assert_eq!(actors, [editor_actor.as_str(), local_actor.as_str()], "{mode}: one record per call");

        let printed: Vec<Value> = serde_json::from_str(&ok(
            global,
            user,
            &["--json", "audit", "list", "--actor", &local_actor, "--action", "service.delete"],
        ))
        .unwrap();
        assert_eq!(printed.len(), 1, "{mode}: {printed:?}");
        assert_eq!(printed[0]["subject"], "doomed");
    }
    // The table reads too, and a viewer may read the log over the API.
    let table = ok(&local, user, &["audit", "list", "--object", "svc-1"]);
    assert!(table.contains("service.update") && table.contains("service.create"), "{table}");
    let viewer = operators::mint_audited(&pool, "cli:setup", "vera", Role::Viewer, operators::Expiry::Never)
        .await
        .unwrap();
    let (status, page) = plane.get("/api/v1/audit?action=service.update", &viewer.token).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["rows"][0]["actor"], editor_actor.as_str());
    plane.stop().await;
}

// The CLI runs as a blocking child process while this process serves its API: two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_without_expect_version_are_refused() {
    let plane = Plane::start().await;
    let pool = plane.pool().clone();
    let editor = operators::mint_audited(&pool, "cli:setup", "ed", Role::Editor, operators::Expiry::Never)
        .await
        .unwrap();
    let (local, remote) = (plane.local(), plane.remote(&editor.token));
    let user = "careful";
    ok(&local, user, &["service", "create", "dns", "--entry", "udp:53"]);
    ok(&local, user, &["address-group", "create", "vpn", "--cidr", "10.8.0.0/16"]);
    let file = write_ruleset(&plane.dir.join("rulesets"), "web-in");
    ok(&local, user, &["ruleset", "create", "--file", &file]);
    let state = async || -> (Vec<(String, i64)>, i64) {
        let versions = sqlx::query_as(
            "SELECT name, version FROM services UNION ALL SELECT name, version FROM address_groups
             UNION ALL SELECT name, version FROM rulesets ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let audit = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(&pool).await.unwrap();
        (versions, audit)
    };
    let before = state().await;
    // Pointing --api at a port nothing listens on proves the refusal comes before any request.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut nowhere = remote.clone();
    nowhere[1] = format!("https://localhost:{closed}");
    let unconditional: [&[&str]; 6] = [
        &["service", "update", "dns", "--entry", "tcp:53"],
        &["service", "delete", "dns"],
        &["address-group", "update", "vpn", "--cidr", "10.9.0.0/16"],
        &["address-group", "delete", "vpn"],
        &["ruleset", "update", "--file", &file],
        &["ruleset", "delete", "web-in"],
    ];
    for args in unconditional {
        for (mode, global) in
            [("local", &local), ("remote", &remote), ("remote, nothing listening", &nowhere)]
        {
            let (code, stdout, stderr) = innerwall(global, user, args);
            assert_eq!(code, Some(1), "{mode} {args:?}: {stdout}{stderr}");
            assert!(stderr.contains("needs --expect-version"), "{mode} {args:?}: {stderr}");
            assert!(stderr.contains("nothing was written"), "{mode} {args:?}: {stderr}");
            assert!(stdout.is_empty(), "{mode} {args:?}: {stdout}");
        }
    }
    assert_eq!(state().await, before, "a refused write changed something");
    // A stale version is refused too, and the right one writes, in either mode.
    for global in [&local, &remote] {
        let (code, _, stderr) = innerwall(
            global,
            user,
            &["service", "update", "dns", "--entry", "tcp:53", "--expect-version", "7"],
        );
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("is at version 1, not 7"), "{stderr}");
    }
    assert_eq!(state().await, before, "a stale write changed something");
    ok(&remote, user, &["service", "update", "dns", "--entry", "tcp:53", "--expect-version", "1"]);
    ok(&local, user, &["service", "delete", "dns", "--expect-version", "2"]);
    let audit: Vec<String> =
        sqlx::query_scalar("SELECT action FROM audit_log WHERE subject = 'dns' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(audit, ["service.create", "service.update", "service.delete"]);
    plane.stop().await;
}

/// Runs `innerwall <args>` with stdout into a pipe whose reader takes one line and closes it, as
/// `| head -1` does: the exit code and stderr.
fn closed_after_one_line(url: &str, args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .env_remove("INNERWALL_API")
        .env("RUST_BACKTRACE", "1")
        .arg("--database-url")
        .arg(url)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "{args:?} printed nothing");
    drop(reader);
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn cli_exits_quietly_when_its_pipe_closes() {
    let db = fresh_database().await.unwrap();
    // Far more output than a pipe buffers (64 KiB), so the command is still writing when its
    // reader goes: 3,000 services and their 3,000 audit records.
    sqlx::query(
        "INSERT INTO services (id, name, description)
         SELECT gen_random_uuid(), 'svc-' || i, repeat('x', 40) FROM generate_series(1, 3000) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO audit_log (actor, action, subject, detail)
         SELECT 'cli:bulk', 'service.create', 'svc-' || i, jsonb_build_object('entries', jsonb_build_array('tcp:' || i))
         FROM generate_series(1, 3000) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO promotions (id, actor, reason, to_mode, scope, expected_count, workloads)
         SELECT gen_random_uuid(), 'cli:bulk', 'why ' || i, 2, 'app=web', 0, '[]'
         FROM generate_series(1, 1000) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for args in [
        &["--json", "promotions", "list"][..],
        &["promotions", "list"],
        &["--json", "audit", "list"],
        &["audit", "list"],
        &["--json", "service", "list"],
        &["service", "list"],
    ] {
        let (code, stderr) = closed_after_one_line(&db.url, args);
        // Quiet, with the status SIGPIPE gives in the shell (issue 26, item 7).
        assert_eq!(code, Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args:?}: {stderr}");
        assert!(stderr.trim().is_empty(), "{args:?} wrote to stderr: {stderr}");
    }
    // The same commands still print everything when the reader reads it all.
    let out = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .arg("--database-url")
        .arg(&db.url)
        .args(["--json", "service", "list"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let all: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(all.len(), 3000);
}
