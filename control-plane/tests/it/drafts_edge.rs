//! The drafts' edges (issue 27 items 1, 2 and 5): `/api/v1/drafts` on the real `innerwall serve`
//! binary over real HTTPS on a real Postgres — roles, conditional writes that write nothing when
//! refused, the render equal to the library's and the commit advancing exactly those versions,
//! a moved base refused naming the object, hostile bodies refused — and the real CLI, whose
//! `draft … --json` answers the same from the database and through the API, and whose
//! `draft impact` exits as `workload replay` does.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::problem::ProblemType;
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::foresight::drafts::{self, ChangeFile, ChangeSpec, DraftRender, NamedMembers};
use innerwall_control_plane::identity::ca::{FileCa, Signer as _};
use innerwall_control_plane::identity::operators::{self, Role};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{NewWorkload, ServiceSpec};
use innerwall_control_plane::testing::{TestDatabase, add_web_port, fresh_database};
use innerwall_wire::identity::WorkloadId;
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use sqlx::PgPool;

/// A running `innerwall serve` with its API on loopback; killed by its PID on drop.
struct Serve {
    child: Child,
    port: u16,
}

impl Serve {
    /// `serve` with `extra` flags after the defaults.
    fn start(db: &TestDatabase, dir: &Path, extra: &[&str]) -> Serve {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
        for var in ["INNERWALL_API", "INNERWALL_TOKEN", "INNERWALL_API_TOKEN", "INNERWALL_API_CA"] {
            command.env_remove(var);
        }
        let mut child = command
            .args(["--database-url", &db.url, "--ca-dir"])
            .arg(dir.join("ca"))
            .args(["serve", "--listen", "127.0.0.1:0", "--server-name", "localhost", "--api-listen"])
            .arg(format!("127.0.0.1:{port}"))
            .args(extra)
            .env("INNERWALL_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning innerwall serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let serve = Serve { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("operator API on https://") => break,
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never announced its API; it logged:\n{}", seen.join("\n")),
            }
        }
        std::thread::spawn(move || while lines.recv().is_ok() {});
        serve
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: hyper::HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", |v| v.to_str().unwrap())
    }

    #[track_caller]
    fn ok(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", String::from_utf8_lossy(&self.body));
        self.json()
    }

    #[track_caller]
    fn problem(&self, status: u16, kind: ProblemType) -> Value {
        assert_eq!(self.status, status, "{}", String::from_utf8_lossy(&self.body));
        assert_eq!(self.header("content-type"), "application/problem+json", "{self:?}");
        let doc = self.json();
        assert_eq!(doc["type"], kind.urn(), "{doc}");
        assert!(doc["detail"].as_str().is_some_and(|d| !d.is_empty()), "{doc}");
        doc
    }
}

/// An HTTPS client of the replica's API that trusts only its CA.
struct Client {
    port: u16,
    tls: tokio_rustls::TlsConnector,
}

impl Client {
    fn new(port: u16, ca_pem: &str) -> Client {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        Client { port, tls: tokio_rustls::TlsConnector::from(Arc::new(config)) }
    }

    /// One request on a connection of its own: a JSON body when given, `If-Match` when given.
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        if_match: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Reply {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.unwrap();
        let stream = self.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {token}"));
        if let Some(tag) = if_match {
            request = request.header("if-match", tag);
        }
        if body.is_some() {
            request = request.header("content-type", "application/json");
        }
        let request = request.body(Full::new(Bytes::from(body.unwrap_or_default()))).unwrap();
        let response = sender.send_request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes().to_vec(),
        }
    }

    async fn get(&self, path: &str, token: &str) -> Reply {
        self.call("GET", path, token, None, None).await
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        token: &str,
        if_match: Option<&str>,
        body: &Value,
    ) -> Reply {
        self.call(method, path, token, if_match, Some(serde_json::to_vec(body).unwrap())).await
    }
}

async fn register(pool: &PgPool, hostname: &str, labels: &[&str]) -> WorkloadId {
    let id = WorkloadId::new_random();
    let new = NewWorkload {
        id,
        hostname: hostname.into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: Default::default(),
    };
    innerwall_control_plane::foresight::commit(pool, "test", "register", hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), json!({})))
    })
    .await
    .unwrap();
    id
}

/// Two web workloads and a db workload; `svc-1`/`rs-1` admit tcp/8001 to the web ones.
async fn estate(pool: &PgPool) -> Vec<WorkloadId> {
    let web = vec![register(pool, "web-1", &["app=web"]).await, register(pool, "web-2", &["app=web"]).await];
    register(pool, "db-1", &["app=db"]).await;
    add_web_port(pool, 1).await.unwrap();
    web
}

/// The change file that gives `svc-1` a second port (every web workload's policy changes).
fn widen(port: u16) -> ChangeFile {
    ChangeFile {
        changes: vec![ChangeSpec::service(NamedMembers {
            name: "svc-1".into(),
            description: String::new(),
            members: vec!["tcp:8001".into(), format!("tcp:{port}")],
        })],
    }
}

/// What a refused request must leave as it was: the audit log, the drafts and their changes,
/// every persisted policy version.
async fn written(pool: &PgPool) -> (i64, Vec<(String, i64)>, i64, Vec<(String, i64)>) {
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(pool).await.unwrap();
    let drafts: Vec<(String, i64)> =
        sqlx::query_as("SELECT name, version FROM drafts ORDER BY name").fetch_all(pool).await.unwrap();
    let changes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM draft_changes").fetch_one(pool).await.unwrap();
    let versions = versions(pool).await;
    (audit, drafts, changes, versions)
}

async fn versions(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT workload_id::text, version FROM workload_policies ORDER BY workload_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

fn temp_dir(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("iw-{what}-{}", uuid::Uuid::new_v4()))
}

#[tokio::test]
async fn drafts_edge_api_roles_render_commit() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = estate(pool).await;
    let dir = temp_dir("drafts-api");
    let signer = FileCa::init(&dir.join("ca")).unwrap();
    let serve = Serve::start(&db, &dir, &[]);
    let api = Client::new(serve.port, &signer.ca_bundle_pem());
    let mint = async |name: &str, role| {
        operators::mint_audited(pool, "cli:test", name, role, operators::Expiry::Never).await.unwrap().token
    };
    let (viewer, editor) = (mint("viewer", Role::Viewer).await, mint("editor", Role::Editor).await);

    // A viewer reads, and cannot write: 403, nothing written.
    assert_eq!(api.get("/api/v1/drafts", &viewer).await.ok(200), json!([]));
    let before = written(pool).await;
    let doc = api
        .send("POST", "/api/v1/drafts", &viewer, None, &json!({"name": "widen", "note": "n"}))
        .await
        .problem(403, ProblemType::Forbidden);
    assert_eq!(doc["required_role"], "editor", "{doc}");
    assert_eq!(written(pool).await, before, "a refused create writes nothing");

    // An editor creates (201, ETag "1") and adds a change file.
    let created =
        api.send("POST", "/api/v1/drafts", &editor, None, &json!({"name": "widen", "note": "n"})).await;
    assert_eq!(created.ok(201)["version"], 1);
    assert_eq!(created.header("etag"), "\"1\"");
    let changes = "/api/v1/drafts/widen/changes";
    let file = serde_json::to_value(widen(9001)).unwrap();
    let before = written(pool).await;
    api.send("POST", changes, &viewer, None, &file).await.problem(403, ProblemType::Forbidden);
    for (name, method, path) in
        [("commit", "POST", "/api/v1/drafts/widen/commit"), ("discard", "DELETE", "/api/v1/drafts/widen")]
    {
        let reply = api.call(method, path, &viewer, Some("\"1\""), None).await;
        assert_eq!(reply.problem(403, ProblemType::Forbidden)["required_role"], "editor", "{name}");
    }
    assert_eq!(written(pool).await, before, "a viewer's refused writes write nothing");
    let added = api.send("POST", changes, &editor, None, &file).await;
    let view = added.ok(200);
    let version = view["version"].as_i64().unwrap();
    assert!(version > 1, "{view}");
    assert_eq!(added.header("etag"), format!("\"{version}\""));
    assert_eq!(view["changes"][0]["object"], "service/svc-1", "{view}");
    let shown = api.get("/api/v1/drafts/widen", &viewer).await;
    assert_eq!(shown.ok(200), view, "show answers what add answered");
    assert_eq!(shown.header("etag"), format!("\"{version}\""));

    // The render a viewer gets is the library's, and writes nothing.
    let before = written(pool).await;
    let rendered: DraftRender =
        serde_json::from_value(api.get("/api/v1/drafts/widen/render", &viewer).await.ok(200)).unwrap();
    let library = drafts::render(pool, "test", "widen", &CountBounds::default()).await.unwrap();
    assert_eq!(rendered, library);
    let mut listed: Vec<WorkloadId> = rendered.workloads.iter().map(|w| w.workload).collect();
    listed.sort();
    let mut expected = web.clone();
    expected.sort();
    assert_eq!(listed, expected, "exactly the web workloads' policies change");
    assert!(rendered.would_commit(), "{:?}", rendered.blockers);
    let after = written(pool).await;
    assert_eq!(
        (&after.1, after.2, &after.3),
        (&before.1, before.2, &before.3),
        "a render writes no draft and no version"
    );
    let tests = api.call("POST", "/api/v1/drafts/widen/tests", &viewer, None, None).await.ok(200);
    assert_eq!(tests["results"], json!([]), "no test set exists");

    // Commit: without If-Match 428, stale 412 with the current version, each writing nothing;
    // with the version read, the versions advance exactly as rendered.
    let commit = "/api/v1/drafts/widen/commit";
    let before = written(pool).await;
    api.call("POST", commit, &editor, None, None).await.problem(428, ProblemType::PreconditionRequired);
    let stale = api.call("POST", commit, &editor, Some("\"1\""), None).await;
    assert_eq!(stale.problem(412, ProblemType::PreconditionFailed)["current_version"], version);
    assert_eq!(written(pool).await, before, "a refused commit writes nothing");
    let tag = format!("\"{version}\"");
    let done = api.call("POST", commit, &editor, Some(&tag), None).await.ok(200);
    assert_eq!(done["result"]["draft"], "widen");
    assert_eq!(done["result"]["changes"], 1);
    assert_eq!(done["result"]["promotions"], json!([]));
    let mut changed: Vec<(String, u64)> = done["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["workload"].as_str().unwrap().to_owned(), c["version"].as_u64().unwrap()))
        .collect();
    changed.sort();
    let mut as_rendered: Vec<(String, u64)> =
        rendered.workloads.iter().map(|w| (w.workload.to_string(), w.to_version)).collect();
    as_rendered.sort();
    assert_eq!(changed, as_rendered, "the commit advanced the versions the render showed");
    let persisted = versions(pool).await;
    for (workload, version) in &as_rendered {
        assert!(
            persisted.contains(&(workload.clone(), *version as i64)),
            "{workload} v{version}: {persisted:?}"
        );
    }
    let again = api.call("POST", commit, &editor, Some(&tag), None).await;
    assert!(again.problem(400, ProblemType::Invalid)["detail"].as_str().unwrap().contains("committed"));

    // A draft whose base moved is refused, naming the object, and writes nothing.
    api.send("POST", "/api/v1/drafts", &editor, None, &json!({"name": "later"})).await.ok(201);
    let view = api
        .send(
            "POST",
            "/api/v1/drafts/later/changes",
            &editor,
            None,
            &serde_json::to_value(widen(9002)).unwrap(),
        )
        .await
        .ok(200);
    let spec = ServiceSpec {
        name: "svc-1".into(),
        description: String::new(),
        entries: vec![ServiceEntry::parse("tcp:8001").unwrap()],
    };
    let current: i64 = sqlx::query_scalar("SELECT version FROM services WHERE name = 'svc-1'")
        .fetch_one(pool)
        .await
        .unwrap();
    innerwall_control_plane::foresight::commit(pool, "test", "service.update", "svc-1", async |c| {
        Ok((authoring::update_service(c, &spec, current).await?, json!({})))
    })
    .await
    .unwrap();
    let before = written(pool).await;
    let tag = format!("\"{}\"", view["version"]);
    let moved = api.call("POST", "/api/v1/drafts/later/commit", &editor, Some(&tag), None).await;
    let detail = moved.problem(412, ProblemType::PreconditionFailed)["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("service/svc-1") && detail.contains("draft add"), "{detail}");
    assert_eq!(written(pool).await, before, "a commit whose base moved writes nothing");

    // Hostile bodies: each a 4xx problem, nothing written.
    let changes = "/api/v1/drafts/later/changes";
    let oversize = vec![b' '; drafts::MAX_CHANGE_FILE as usize + 1];
    api.call("POST", changes, &editor, None, Some(oversize)).await.problem(413, ProblemType::PayloadTooLarge);
    // Larger than the listener's 64 KiB body limit, within the change file's: read, then judged.
    let long = json!({"changes": [{"service": {"name": "svc-9", "description": "d".repeat(200 * 1024), "members": ["tcp:1"]}}]});
    api.send("POST", changes, &editor, None, &long).await.problem(400, ProblemType::Invalid);
    let unknown = json!({"changes": [], "also": 1});
    assert!(
        api.send("POST", changes, &editor, None, &unknown).await.problem(400, ProblemType::Invalid)["detail"]
            .as_str()
            .unwrap()
            .contains("also")
    );
    let inner = json!({"changes": [{"service": {"name": "svc-9", "members": ["tcp:1"], "colour": "red"}}]});
    api.send("POST", changes, &editor, None, &inner).await.problem(400, ProblemType::Invalid);
    let many = ChangeFile {
        changes: (0..=drafts::MAX_FILE_CHANGES)
            .map(|i| {
                ChangeSpec::service(NamedMembers {
                    name: format!("s{i}"),
                    description: String::new(),
                    members: vec!["tcp:1".into()],
                })
            })
            .collect(),
    };
    let doc = api
        .send("POST", changes, &editor, None, &serde_json::to_value(many).unwrap())
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("at most 100"), "{doc}");
    assert_eq!(written(pool).await, before, "refused bodies write nothing");

    // A render of a draft whose base moved is refused as its commit would be.
    let doc =
        api.get("/api/v1/drafts/later/render", &viewer).await.problem(412, ProblemType::PreconditionFailed);
    assert!(doc["detail"].as_str().unwrap().contains("service/svc-1"), "{doc}");

    // Renders are expensive operations: a viewer looping them is refused within a minute's worth.
    api.send("POST", "/api/v1/drafts", &editor, None, &json!({"name": "empty"})).await.ok(201);
    let mut refused = None;
    for i in 0..20 {
        let reply = api.get("/api/v1/drafts/empty/render", &viewer).await;
        if reply.status == 429 {
            refused = Some(i);
            reply.problem(429, ProblemType::RateLimited);
            break;
        }
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    }
    assert!(refused.is_some_and(|i| i <= 6), "renders were never refused: {refused:?}");

    // Discard with If-Match.
    let tag = format!("\"{}\"", view["version"]);
    api.call("DELETE", "/api/v1/drafts/later", &editor, Some(&tag), None).await.ok(200);
    api.get("/api/v1/drafts/later", &viewer).await.problem(404, ProblemType::NotFound);
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `innerwall <args>`: exit code, stdout, stderr.
fn innerwall(args: &[&str], stdin: Option<&str>) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    for var in [
        "INNERWALL_API",
        "INNERWALL_TOKEN",
        "INNERWALL_API_TOKEN",
        "INNERWALL_API_CA",
        "INNERWALL_DATABASE_URL",
    ] {
        command.env_remove(var);
    }
    command.args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::piped());
    let mut child = command.spawn().expect("running innerwall");
    {
        use std::io::Write as _;
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `args` run successfully, its stdout parsed as JSON.
#[track_caller]
fn json_of(mode: &[&str], args: &[&str], stdin: Option<&str>) -> Value {
    let all: Vec<&str> = mode.iter().chain(["--json"].iter()).chain(args).copied().collect();
    let (code, out, err) = innerwall(&all, stdin);
    assert_eq!(code, Some(0), "innerwall {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("innerwall {args:?}: {e}: {out}"))
}

/// A view without what differs between two drafts made alike by different actors at different times.
fn alike(mut view: Value) -> Value {
    for field in ["name", "author", "created_at", "updated_at"] {
        view.as_object_mut().unwrap().remove(field);
    }
    view
}

/// A note longer than a list's column (and than a line): tables still read on 80 columns.
const NOTE: &str =
    "widen svc-1 to a second port, so that the web tier answers on tcp/9001 too, as the proxy expects";

const CHANGE_FILE: &str = "changes:\n  - service:\n      name: svc-1\n      members: [tcp:8001, tcp:9001]\n";

#[tokio::test]
async fn drafts_edge_cli_local_and_remote_agree() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    let dir = temp_dir("drafts-cli");
    let signer = FileCa::init(&dir.join("ca")).unwrap();
    let ca = dir.join("api-ca.pem");
    std::fs::write(&ca, signer.ca_bundle_pem()).unwrap();
    let file = dir.join("change.yaml");
    std::fs::write(&file, CHANGE_FILE).unwrap();
    // The remote renders below are more than a minute's worth of the default bound.
    let serve = Serve::start(&db, &dir, &["--api-expensive-per-minute", "60"]);
    let token =
        operators::mint_audited(pool, "cli:test", "cli-editor", Role::Editor, operators::Expiry::Never)
            .await
            .unwrap()
            .token;
    let url = format!("https://localhost:{}", serve.port);
    let (ca, file) = (ca.to_str().unwrap(), file.to_str().unwrap());
    let token = crate::foresight_api::token_file(&dir, &token);
    let token = token.to_str().unwrap();
    let remote = ["--api", url.as_str(), "--token-file", token, "--api-ca", ca];
    let local = ["--database-url", db.url.as_str()];

    // A draft made locally reads the same both ways, and so does one made remotely.
    let made_here = json_of(&local, &["draft", "create", "here", "--note", NOTE], None);
    assert_eq!(made_here["version"], 1);
    assert_eq!(json_of(&remote, &["draft", "show", "here"], None), made_here);
    let made_there = json_of(&remote, &["draft", "create", "there", "--note", NOTE], None);
    assert_eq!(json_of(&local, &["draft", "show", "there"], None), made_there);
    assert_eq!(alike(made_here.clone()), alike(made_there.clone()));
    assert!(made_there["author"].as_str().unwrap().starts_with("operator:cli-editor/"), "{made_there}");

    // The same change file added locally (from stdin) and remotely gives the same draft.
    let here = json_of(&local, &["draft", "add", "here", "-f", "-"], Some(CHANGE_FILE));
    let there = json_of(&remote, &["draft", "add", "there", "-f", file], None);
    assert_eq!(alike(here.clone()), alike(there.clone()));
    assert_eq!(here["changes"][0]["object"], "service/svc-1", "{here}");
    assert_eq!(json_of(&remote, &["draft", "show", "here"], None), here);
    let listed = json_of(&remote, &["draft", "list"], None);
    assert_eq!(listed, json_of(&local, &["draft", "list"], None));
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");

    // The render is the same both ways, and the same for the two drafts but for their names.
    let rendered = json_of(&local, &["draft", "render", "here"], None);
    assert_eq!(json_of(&remote, &["draft", "render", "here"], None), rendered);
    let mut other = json_of(&remote, &["draft", "render", "there"], None);
    other["draft"] = rendered["draft"].clone();
    assert_eq!(other, rendered);
    assert_eq!(rendered["workloads"].as_array().unwrap().len(), 2, "{rendered}");
    // For people: every table and line reads on 80 columns, the same both ways.
    for args in [&["draft", "list"][..], &["draft", "show", "here"], &["draft", "render", "here"]] {
        let (code, text, err) = innerwall(&[&local[..], args].concat(), None);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(innerwall(&[&remote[..], args].concat(), None).1, text, "{args:?}");
        assert!(text.lines().all(|l| l.chars().count() <= 80), "{args:?} is wider than 80 columns:\n{text}");
        println!("innerwall {}\n{text}", args.join(" "));
    }
    let (_, text, _) = innerwall(&[&local[..], &["draft", "render", "here"][..]].concat(), None);
    let first = &rendered["workloads"][0];
    let versions = format!("v{} -> v{}", first["from_version"], first["to_version"]);
    assert!(text.contains(&versions) && text.contains("a commit now would pass"), "{text}");
    let tests = json_of(&local, &["policy", "test", "--draft", "here"], None);
    assert_eq!(json_of(&remote, &["policy", "test", "--draft", "here"], None), tests);

    // `draft impact`: nothing recorded, so no evidence covers the range (exit 1, naming the
    // threshold) — locally and remotely — unless the minimum is lowered; --accept-blocks does
    // not excuse missing evidence.
    for mode in [&local[..], &remote[..]] {
        for extra in [&[][..], &["--accept-blocks"][..]] {
            let mut args: Vec<&str> = mode.to_vec();
            args.extend(["draft", "impact", "here", "--since", "2h"]);
            args.extend(extra);
            let (code, out, err) = innerwall(&args, None);
            assert_eq!(code, Some(1), "{out}\n{err}");
            assert!(err.contains("--min-coverage"), "{err}");
            assert!(out.contains("a commit now would pass"), "{out}");
        }
        let mut args: Vec<&str> = mode.to_vec();
        args.extend(["--json", "draft", "impact", "here", "--since", "2h", "--min-coverage", "0"]);
        let (code, out, err) = innerwall(&args, None);
        assert_eq!(code, Some(0), "{err}");
        let answer: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(answer["render"]["workloads"], rendered["workloads"], "{answer}");
        // No agent applied anything, so every web workload's drafted policy differs from its applied one.
        let replayed: Vec<&str> = answer["impact"]["workloads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["id"].as_str().unwrap())
            .collect();
        for w in rendered["workloads"].as_array().unwrap() {
            assert!(replayed.contains(&w["workload"].as_str().unwrap()), "{answer}");
        }
    }

    // Commit: without --expect-version refused before anything is sent; remotely, with the
    // version, the versions advance as rendered; the other draft's base moved, so its local
    // commit is refused naming the object.
    let (code, _, err) = innerwall(&[&remote[..], &["draft", "commit", "here"][..]].concat(), None);
    assert_eq!(code, Some(1));
    assert!(err.contains("--expect-version"), "{err}");
    let version = here["version"].to_string();
    let done = json_of(&remote, &["draft", "commit", "here", "--expect-version", &version], None);
    assert_eq!(done["result"]["changes"], 1, "{done}");
    let mut changed: Vec<(String, u64)> = done["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["workload"].as_str().unwrap().to_owned(), c["version"].as_u64().unwrap()))
        .collect();
    changed.sort();
    let mut as_rendered: Vec<(String, u64)> = rendered["workloads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["workload"].as_str().unwrap().to_owned(), w["to_version"].as_u64().unwrap()))
        .collect();
    as_rendered.sort();
    assert_eq!(changed, as_rendered);
    let version = there["version"].to_string();
    let (code, _, err) = innerwall(
        &[&local[..], &["draft", "commit", "there", "--expect-version", &version][..]].concat(),
        None,
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("draft-base-moved") && err.contains("service/svc-1"), "{err}");
    let committed = json_of(&local, &["draft", "show", "here"], None);
    assert!(committed["committed_at"].is_string(), "{committed}");
    assert_eq!(json_of(&remote, &["draft", "show", "here"], None), committed);

    // Discard, remotely and locally alike.
    let gone = json_of(&remote, &["draft", "discard", "there", "--expect-version", &version], None);
    assert_eq!(gone, json!({"result": null, "changed": []}));
    let version = committed["version"].to_string();
    let gone = json_of(&local, &["draft", "discard", "here", "--expect-version", &version], None);
    assert_eq!(gone, json!({"result": null, "changed": []}));
    assert_eq!(json_of(&local, &["draft", "list"], None), json!([]));
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `draft impact` exits as `workload replay` does: a recorded ALLOWED flow the draft would block
/// fails the command unless --accept-blocks; the JSON names it with both rule ids.
#[tokio::test]
async fn drafts_edge_impact_exit_status_blocks() {
    use chrono::{DurationRound, TimeDelta, Utc};
    use innerwall_control_plane::flows;
    use innerwall_control_plane::policy::store;
    use innerwall_wire::flows::FlowWindow;
    use innerwall_wire::policy::Mode;
    use innerwall_wire::proto;

    const HOUR: i64 = 3_600_000;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = register(pool, "web-1", &["app=web"]).await;
    add_web_port(pool, 1).await.unwrap();
    let policy = store::persisted_policy(&mut pool.acquire().await.unwrap(), web).await.unwrap().unwrap().0;
    let rule = policy.rules().next().unwrap().id().to_string();
    // The agent applied this version and recorded an allowed flow under it an hour ago.
    let h0 =
        (Utc::now().duration_trunc(TimeDelta::hours(1)).unwrap() - TimeDelta::hours(1)).timestamp_millis();
    let installed_at = chrono::DateTime::from_timestamp_millis(h0 - HOUR).unwrap();
    innerwall_control_plane::testing::installed(
        pool,
        web,
        &[(policy.version(), Mode::Simulation, installed_at)],
    )
    .await
    .unwrap();
    sqlx::query("UPDATE workloads SET applied_version = $2 WHERE id = $1")
        .bind(web.uuid())
        .bind(policy.version() as i64)
        .execute(pool)
        .await
        .unwrap();
    let record = proto::FlowRecord {
        pending_decision: 0,
        pending_rule_id: String::new(),
        src_address: "192.0.2.10".into(),
        dst_address: "10.9.0.1".into(),
        dst_port: 8001,
        protocol: proto::Protocol::Tcp.into(),
        decision: proto::FlowDecision::Allowed.into(),
        matched_rule_id: rule.clone(),
        packets: 3,
        bytes: 180,
        new_connections: 3,
        first_seen_unix_ms: h0 + 1_000,
        last_seen_unix_ms: h0 + 2_000,
    };
    let window = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: h0,
        end_unix_ms: h0 + HOUR,
        policy_version: policy.version(),
        mode: 2,
        records: vec![record],
        gaps: vec![],
    };
    flows::ingest(pool, web, &FlowWindow::try_from(&window).unwrap()).await.unwrap();

    // The draft deletes the ruleset that admits it.
    let local = ["--database-url", db.url.as_str()];
    json_of(&local, &["draft", "create", "tighten"], None);
    let file = "changes:\n  - delete_ruleset: {name: rs-1}\n";
    json_of(&local, &["draft", "add", "tighten", "-f", "-"], Some(file));
    let impact = ["draft", "impact", "tighten", "--since", "3h", "--min-coverage", "0"];
    let (code, out, err) = innerwall(&[&local[..], &impact[..]].concat(), None);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        err.contains("1 recorded flow key(s) would become newly blocked") && err.contains("--accept-blocks"),
        "{err}"
    );
    assert!(out.contains("newly blocked 1 (3 conns)") && out.contains(&rule), "{out}");
    let answer = json_of(&local, &[&impact[..], &["--accept-blocks"][..]].concat(), None);
    let replayed = &answer["impact"]["workloads"][0];
    assert_eq!(replayed["id"], web.to_string(), "{answer}");
    assert_eq!(replayed["newly_blocked"], 1, "{answer}");
    assert_eq!(replayed["top_blocked"][0]["from_rule"], rule, "{answer}");
    assert_eq!(replayed["top_blocked"][0]["to_rule"], Value::Null, "{answer}");
}
