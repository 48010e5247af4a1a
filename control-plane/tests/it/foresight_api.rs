//! The foresight routes (issue 27, POL-10) over real HTTPS against a real `innerwall serve` on a
//! real Postgres: `/api/v1/policy-test-sets` and `POST /api/v1/policy-tests/run` — roles, the
//! version precondition, refusals that write nothing (a failing set, a ruleset update that breaks
//! a stored test, hostile bodies), and a run that answers what the library runs. The `Serve`
//! and the estate here are the remote CLI's too (`cli.rs`).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::problem::ProblemType;
use innerwall_control_plane::foresight::{self, policy_tests};
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::operators::{self, Role};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::publish::{Overflow, publish_rendering};
use innerwall_control_plane::policy::spec::{NewWorkload, PeerSpec, RuleSpec, RulesetSpec, ServiceSpec};
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use sqlx::PgPool;

/// A real `innerwall serve` on loopback (agent listener and operator API), over a test's
/// database, with a CA of its own; killed (by its own pid) when dropped.
pub struct Serve {
    child: Child,
    pub addr: SocketAddr,
    /// The CA bundle a client of the API trusts (`--api-ca`).
    pub ca: PathBuf,
    pub dir: PathBuf,
    tls: tokio_rustls::TlsConnector,
    /// Its stderr, line by line, from after the API's announcement.
    lines: std::sync::Mutex<mpsc::Receiver<String>>,
}

/// One answer: status, headers, body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", |v| v.to_str().unwrap())
    }

    /// Asserts a problem document of `kind` with `status`, and returns it.
    #[track_caller]
    pub fn problem(&self, status: u16, kind: ProblemType) -> Value {
        assert_eq!(self.status, status, "{self:?}: {}", String::from_utf8_lossy(&self.body));
        assert_eq!(self.header("content-type"), "application/problem+json", "{self:?}");
        let doc = self.json();
        assert_eq!(doc["type"], kind.urn(), "{doc}");
        assert!(doc["detail"].as_str().is_some_and(|d| !d.is_empty()), "{doc}");
        doc
    }
}

impl Serve {
    /// Starts `innerwall serve` on `url` and waits for it to say where its API listens.
    pub fn start(url: &str) -> Serve {
        Serve::start_with(url, &[], &[])
    }

    /// [`Serve::start`] with more global flags (before `serve`) and variables.
    pub fn start_with(url: &str, globals: &[&str], env: &[(&str, &str)]) -> Serve {
        let dir = std::env::temp_dir().join(format!("iw-foresight-{}", uuid::Uuid::new_v4()));
        let signer = FileCa::init(&dir.join("ca")).unwrap();
        let pem = signer.ca_bundle_pem();
        let ca = dir.join("api-ca.pem");
        std::fs::write(&ca, &pem).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
        for var in ["INNERWALL_API", "INNERWALL_TOKEN", "INNERWALL_API_TOKEN", "INNERWALL_API_CA"] {
            command.env_remove(var);
        }
        let mut child = command
            .env_remove("INNERWALL_DATABASE_URL")
            .env_remove("INNERWALL_CONFIG")
            .args(["--database-url", url, "--ca-dir"])
            .arg(dir.join("ca"))
            .args(globals)
            .args(["serve", "--listen", "127.0.0.1:0", "--server-name", "localhost"])
            .args(["--api-listen", "127.0.0.1:0"])
            .env("INNERWALL_LOG", "info")
            .envs(env.iter().copied())
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        let addr = loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(rest) = line.split("operator API on https://").nth(1) {
                        let addr = rest.split('/').next().unwrap();
                        break addr.parse::<SocketAddr>().unwrap_or_else(|e| panic!("{e}: {line}"));
                    }
                    seen.push(line);
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("serve never announced its API; it logged:\n{}", seen.join("\n"))
                }
            }
        };
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
        Serve { child, addr, ca, dir, tls, lines: std::sync::Mutex::new(lines) }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// Waits for a line of its log holding `needle`, and returns it.
    pub fn wait_for_line(&self, needle: &str) -> String {
        let lines = self.lines.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains(needle) => return line,
                Ok(line) => seen.push(line),
                Err(e) => panic!("no line with {needle:?} ({e}); it logged:\n{}", seen.join("\n")),
            }
        }
    }

    /// The global flags of a CLI run against this API with `token` (in a file of its own).
    pub fn remote(&self, token: &str) -> Vec<String> {
        let url = format!("https://localhost:{}", self.addr.port());
        let token = token_file(&self.dir, token);
        ["--api", &url, "--token-file", token.to_str().unwrap(), "--api-ca", self.ca.to_str().unwrap()]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }

    /// One request on a connection of its own; `body` is its content type and bytes.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        headers: &[(&str, &str)],
        body: Option<(&str, Vec<u8>)>,
    ) -> Reply {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let stream = self.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {token}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let bytes = match body {
            Some((kind, bytes)) => {
                request = request.header("content-type", kind);
                bytes
            }
            None => Vec::new(),
        };
        let response =
            sender.send_request(request.body(Full::new(Bytes::from(bytes))).unwrap()).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes().to_vec();
        Reply { status: parts.status.as_u16(), headers: parts.headers, body }
    }

    pub async fn get(&self, path: &str, token: &str) -> Reply {
        self.call("GET", path, token, &[], None).await
    }

    /// A JSON body, with `If-Match` when given.
    pub async fn write(
        &self,
        method: &str,
        path: &str,
        token: &str,
        if_match: Option<&str>,
        body: &Value,
    ) -> Reply {
        let headers: Vec<(&str, &str)> = if_match.map(|tag| ("if-match", tag)).into_iter().collect();
        let bytes = serde_json::to_vec(body).unwrap();
        self.call(method, path, token, &headers, Some(("application/json", bytes))).await
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `token` in a file of `dir` only its owner reads (mode 0600), for `--token-file`: the CLI takes
/// no secret as a flag. The same token is always the same file.
pub fn token_file(dir: &Path, token: &str) -> PathBuf {
    use std::hash::{Hash as _, Hasher as _};
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    token.hash(&mut hasher);
    let path = dir.join(format!("token-{:016x}", hasher.finish()));
    // Written whole under another name, then renamed: a reader never sees it half written.
    let partial = dir.join(format!("token-{}.partial", uuid::Uuid::new_v4()));
    let mut file =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial).unwrap();
    file.write_all(token.as_bytes()).unwrap();
    std::fs::rename(&partial, &path).unwrap();
    path
}

pub async fn mint(pool: &PgPool, name: &str, role: Role) -> String {
    operators::mint_audited(pool, "cli:test", name, role, operators::Expiry::Never).await.unwrap().token
}

pub async fn register(pool: &PgPool, host: &str, labels: &[&str], addr: Option<&str>) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: host.into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: addr.iter().map(|a| a.parse::<IpAddr>().unwrap()).collect(),
    };
    foresight::commit(pool, "test", "workload.register", host, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), json!({})))
    })
    .await
    .unwrap();
    new.id
}

fn app(v: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    [("app".to_owned(), vec![v.to_owned()])].into()
}

/// The back tier's ruleset: payments from `from_web` on https, db from `from_api` on postgres.
pub fn backend(from_web: Vec<PeerSpec>, from_api: Vec<PeerSpec>) -> RulesetSpec {
    let rule = |name: &str, peers, service: &str| RuleSpec {
        name: name.into(),
        description: String::new(),
        enabled: true,
        peers,
        services: vec![service.into()],
    };
    RulesetSpec {
        name: "backend".into(),
        description: String::new(),
        enabled: true,
        scope: [("tier".to_owned(), vec!["back".to_owned()])].into(),
        rules: vec![rule("from-web", from_web, "https"), rule("from-api", from_api, "postgres")],
    }
}

/// The intended back tier: payments from web, db from api and 10.9.0.0/16.
pub fn good_backend() -> RulesetSpec {
    backend(
        vec![PeerSpec::workloads(app("web"))],
        vec![PeerSpec::workloads(app("api")), PeerSpec::cidr("10.9.0.0/16")],
    )
}

/// Breaks every test of [`TESTS`]: from-web admits api and the internet, from-api admits web.
pub fn bad_backend() -> RulesetSpec {
    backend(
        vec![PeerSpec::workloads(app("api")), PeerSpec::cidr("203.0.113.0/24")],
        vec![PeerSpec::workloads(app("api")), PeerSpec::workloads(app("web")), PeerSpec::cidr("10.9.0.0/16")],
    )
}

/// Three tests that hold on [`good_backend`] (an allow, a deny, an only_from).
pub const TESTS: &str = "
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
";

/// Four workloads in two tiers (the fresh database's estate ranges hold 10.0.0.0/8), the https
/// and postgres services, and [`good_backend`]; returns web-1.
pub async fn estate(pool: &PgPool) -> WorkloadId {
    let web = register(pool, "web-1", &["app=web", "tier=front"], Some("10.0.0.1")).await;
    register(pool, "api-1", &["app=api", "tier=front"], Some("10.0.0.2")).await;
    register(pool, "payments-1", &["app=payments", "tier=back"], Some("10.0.0.3")).await;
    register(pool, "db-1", &["app=db", "tier=back"], Some("10.0.0.4")).await;
    for (name, entry) in [("https", "tcp:443"), ("postgres", "tcp:5432")] {
        let spec = ServiceSpec {
            name: name.into(),
            description: String::new(),
            entries: vec![ServiceEntry::parse(entry).unwrap()],
        };
        foresight::commit(pool, "test", "service.create", name, async |c| {
            authoring::create_service(c, &spec).await?;
            Ok(((), json!({})))
        })
        .await
        .unwrap();
    }
    let good = good_backend();
    foresight::commit(pool, "test", "ruleset.create", "backend", async |c| {
        authoring::create_ruleset(c, &good).await?;
        Ok(((), json!({})))
    })
    .await
    .unwrap();
    web
}

/// Stores a set as it is, past every check (a set stored before the estate moved under it, as
/// the commits that judge sets cannot make one): how a run with failing tests is set up.
pub async fn plant_set(pool: &PgPool, spec: &Value) {
    sqlx::query("INSERT INTO policy_test_sets (id, name, description, spec) VALUES ($1, $2, '', $3)")
        .bind(uuid::Uuid::new_v4())
        .bind(spec["name"].as_str().unwrap())
        .bind(spec)
        .execute(pool)
        .await
        .unwrap();
}

/// What a refused request must leave as it was: policy versions, the audit log, the test sets
/// (name and version) and the rulesets (name and version).
async fn written(pool: &PgPool) -> (i64, i64, BTreeSet<(String, i64)>, BTreeSet<(String, i64)>) {
    let count =
        |sql: &'static str| async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.unwrap() };
    let rows = |sql: &'static str| async move {
        sqlx::query_as::<_, (String, i64)>(sql)
            .fetch_all(pool)
            .await
            .unwrap()
            .into_iter()
            .collect::<BTreeSet<_>>()
    };
    (
        count("SELECT count(*) FROM workload_policy_history").await,
        count("SELECT count(*) FROM audit_log").await,
        rows("SELECT name, version FROM policy_test_sets").await,
        rows("SELECT name, version FROM rulesets").await,
    )
}

fn yaml_to_json(text: &str) -> Value {
    serde_json::to_value(policy_tests::parse_test_set_file("tests.yaml", text).unwrap()).unwrap()
}

/// `n` deny tests, each well formed.
fn denies(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            json!({"name": format!("t{i}"),
                   "deny": {"from_cidr": "192.0.2.0/24", "to": {"app": ["db"]}, "service": "postgres"}})
        })
        .collect()
}

#[tokio::test]
async fn policy_test_set_routes_over_http() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    let viewer = mint(pool, "vera", Role::Viewer).await;
    let editor = mint(pool, "ed", Role::Editor).await;
    let serve = Serve::start(&db.url);
    const SETS: &str = "/api/v1/policy-test-sets";
    const SET: &str = "/api/v1/policy-test-sets/payments-intent";
    let set = yaml_to_json(TESTS);

    // A viewer reads (nothing yet) and may not write: 403 naming the role, nothing written.
    let reply = serve.get(SETS, &viewer).await;
    assert_eq!((reply.status, reply.json()), (200, json!([])), "{reply:?}");
    let before = written(pool).await;
    let refused = serve.write("POST", SETS, &viewer, None, &set).await;
    assert_eq!(refused.problem(403, ProblemType::Forbidden)["required_role"], "editor");
    serve.write("PUT", SET, &viewer, Some("\"1\""), &set).await.problem(403, ProblemType::Forbidden);
    serve
        .call("DELETE", SET, &viewer, &[("if-match", "\"1\"")], None)
        .await
        .problem(403, ProblemType::Forbidden);
    assert_eq!(written(pool).await, before, "a viewer's writes wrote nothing");

    // An editor creates it: 201 at version 1, audited under the token's name.
    let reply = serve.write("POST", SETS, &editor, None, &set).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!((reply.header("etag"), reply.header("location")), ("\"1\"", SET));
    assert_eq!(reply.json(), json!({"result": 1, "changed": []}));
    let actor: String =
        sqlx::query_scalar("SELECT actor FROM audit_log WHERE action = 'policy-test-set.create'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(actor.starts_with("operator:ed/"), "{actor}");
    serve.write("POST", SETS, &editor, None, &set).await.problem(409, ProblemType::DuplicateName);

    // The viewer reads what the library reads.
    let listed = serve.get(SETS, &viewer).await;
    assert_eq!(listed.status, 200, "{listed:?}");
    assert_eq!(listed.json(), serde_json::to_value(foresight::list_test_sets(pool).await.unwrap()).unwrap());
    let shown = serve.get(SET, &viewer).await;
    assert_eq!((shown.status, shown.header("etag")), (200, "\"1\""), "{shown:?}");
    let library = foresight::show_test_set(pool, "payments-intent").await.unwrap();
    assert_eq!(shown.json(), serde_json::to_value(&library).unwrap());
    assert_eq!((library.tests, &library.spec.description), (3, &"what the back tier admits".to_owned()));
    serve.get("/api/v1/policy-test-sets/nothing-here", &viewer).await.problem(404, ProblemType::NotFound);

    // Update and delete need the version read: none is 428, a stale one 412 with the current
    // version, and neither changes anything.
    let mut renamed = set.clone();
    renamed["description"] = json!("the back tier, reviewed");
    let before = written(pool).await;
    serve.write("PUT", SET, &editor, None, &renamed).await.problem(428, ProblemType::PreconditionRequired);
    let stale = serve.write("PUT", SET, &editor, Some("\"2\""), &renamed).await;
    assert_eq!(stale.problem(412, ProblemType::PreconditionFailed)["current_version"], 1);
    serve.call("DELETE", SET, &editor, &[], None).await.problem(428, ProblemType::PreconditionRequired);
    let stale = serve.call("DELETE", SET, &editor, &[("if-match", "\"7\"")], None).await;
    assert_eq!(stale.problem(412, ProblemType::PreconditionFailed)["current_version"], 1);
    let mut other = renamed.clone();
    other["name"] = json!("another-set");
    let doc =
        serve.write("PUT", SET, &editor, Some("\"1\""), &other).await.problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("is not renamed"), "{doc}");
    assert_eq!(written(pool).await, before, "refused updates and deletes wrote nothing");
    let reply = serve.write("PUT", SET, &editor, Some("\"1\""), &renamed).await;
    assert_eq!((reply.status, reply.header("etag")), (200, "\"2\""), "{reply:?}");
    assert_eq!(reply.json()["result"], 2);
    let now = serve.get(SET, &viewer).await.json();
    assert_eq!(
        (now["version"].as_i64(), now["description"].as_str()),
        (Some(2), Some("the back tier, reviewed"))
    );

    // A set whose tests fail now is refused as 422 policy-tests-failed with its failures, and is
    // not stored.
    let failing = json!({"name": "api-intent", "tests": [
        {"name": "api-reaches-payments",
         "allow": {"from": {"app": ["api"]}, "to": {"app": ["payments"]}, "service": "https"}},
        {"name": "web-reaches-db",
         "allow": {"from": {"app": ["web"]}, "to": {"app": ["db"]}, "service": "postgres"}},
        {"name": "internet-kept-out",
         "deny": {"from_cidr": "203.0.113.0/24", "to": {"app": ["payments"]}, "service": "https"}}]});
    let before = written(pool).await;
    let doc =
        serve.write("POST", SETS, &editor, None, &failing).await.problem(422, ProblemType::PolicyTestsFailed);
    let failures = doc["failures"].as_array().unwrap_or_else(|| panic!("no failures: {doc}"));
    let tests: Vec<&str> = failures.iter().map(|f| f["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["api-reaches-payments", "web-reaches-db"], "every failing test, only those: {doc}");
    assert!(
        failures[0]["reason"]
            .as_str()
            .unwrap()
            .contains("rule backend/from-web needs app=web, the source has app=api"),
        "the nearest rule and why: {doc}"
    );
    assert_eq!(
        (failures[0]["set"].as_str(), failures[0]["assertion"].as_str()),
        (Some("api-intent"), Some("allow"))
    );
    assert_eq!(written(pool).await, before, "a failing set is not stored, nor audited");

    // A ruleset update through the API that breaks the stored tests: 422 with every failure —
    // the ones the library judges over that change — and nothing written: no policy version,
    // no audit row, the ruleset still at version 1.
    let bad = serde_json::to_value(bad_backend()).unwrap();
    let reply = serve.write("PUT", "/api/v1/rulesets/backend", &editor, Some("\"1\""), &bad).await;
    let doc = reply.problem(422, ProblemType::PolicyTestsFailed);
    let expected = {
        let mut tx = pool.begin().await.unwrap();
        authoring::update_ruleset(&mut tx, &bad_backend(), 1).await.unwrap();
        let rendering = publish_rendering(&mut tx, Overflow::Hold).await.unwrap();
        let stored = foresight::show_test_set(pool, "payments-intent").await.unwrap().spec;
        let report = policy_tests::evaluate(&[stored], &rendering, &Default::default());
        tx.rollback().await.unwrap();
        report.failures()
    };
    assert_eq!(expected.len(), 3, "the change breaks all three tests: {expected:#?}");
    assert_eq!(doc["failures"], serde_json::to_value(&expected).unwrap(), "{doc}");
    for test in ["web-reaches-payments", "nothing-from-the-internet", "only-api-talks-to-db"] {
        assert!(doc["detail"].as_str().unwrap().contains(test), "the detail names {test}: {doc}");
    }
    assert_eq!(written(pool).await, before, "the refused ruleset update wrote nothing");
    let ruleset = serve.get("/api/v1/rulesets/backend", &viewer).await;
    assert_eq!(ruleset.header("etag"), "\"1\"", "{ruleset:?}");

    // Hostile bodies: each a 4xx problem, nothing written.
    let huge = json!({"name": "huge", "description": "x".repeat(70 * 1024), "tests": []});
    serve.write("POST", SETS, &editor, None, &huge).await.problem(413, ProblemType::PayloadTooLarge);
    let mut unknown = set.clone();
    unknown["owner"] = json!("me");
    let doc = serve.write("POST", SETS, &editor, None, &unknown).await.problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("owner"), "{doc}");
    let typo = json!({"name": "typo", "tests": [{"name": "x", "alow": {}}]});
    let doc = serve.write("POST", SETS, &editor, None, &typo).await.problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("alow"), "{doc}");
    let many = json!({"name": "many", "tests": denies(201)});
    let doc = serve.write("POST", SETS, &editor, None, &many).await.problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("tests: 201 is more than the 200 allowed"), "{doc}");
    let mut many = renamed.clone();
    many["tests"] = json!(denies(201));
    serve.write("PUT", SET, &editor, Some("\"2\""), &many).await.problem(400, ProblemType::Invalid);
    let sources: Vec<Value> = (0..101).map(|i| json!({"cidr": format!("10.8.{i}.0/24")})).collect();
    let wide = json!({"name": "wide", "tests": [{"name": "x",
        "only_from": {"to": {"app": ["db"]}, "service": "postgres", "sources": sources}}]});
    let doc = serve.write("POST", SETS, &editor, None, &wide).await.problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("sources: 101 is more than the 100 allowed"), "{doc}");
    let both = json!({"name": "both", "tests": [{"name": "x",
        "allow": {"from": {"app": ["web"]}, "to": {"app": ["db"]}, "service": "postgres"},
        "deny": {"from": {"app": ["web"]}, "to": {"app": ["db"]}, "service": "postgres"}}]});
    serve.write("POST", SETS, &editor, None, &both).await.problem(400, ProblemType::Invalid);
    let control = json!({"name": "ctl", "description": "a\u{1b}[2Jb", "tests": []});
    serve.write("POST", SETS, &editor, None, &control).await.problem(400, ProblemType::Invalid);
    let bad_name = json!({"name": "Not A Name", "tests": []});
    serve.write("POST", SETS, &editor, None, &bad_name).await.problem(400, ProblemType::Invalid);
    let truncated = Some(("application/json", b"{\"name\": \"t\", \"tests\": [".to_vec()));
    serve.call("POST", SETS, &editor, &[], truncated).await.problem(400, ProblemType::Invalid);
    let text = Some(("text/plain", serde_json::to_vec(&set).unwrap()));
    serve.call("POST", SETS, &editor, &[], text).await.problem(415, ProblemType::UnsupportedMediaType);
    assert_eq!(written(pool).await, before, "no hostile body wrote anything");
    // One set more than the bound: 409 limit-reached, nothing written.
    for i in 0..policy_tests::MAX_TEST_SETS - 1 {
        plant_set(pool, &json!({"name": format!("filler-{i}"), "tests": []})).await;
    }
    let before = written(pool).await;
    let one_more = json!({"name": "one-more", "tests": []});
    let doc =
        serve.write("POST", SETS, &editor, None, &one_more).await.problem(409, ProblemType::LimitReached);
    assert_eq!(doc["limit"], policy_tests::MAX_TEST_SETS, "{doc}");
    assert_eq!(written(pool).await, before, "a set over the bound is not stored");
    sqlx::query("DELETE FROM policy_test_sets WHERE name LIKE 'filler-%'").execute(pool).await.unwrap();

    // `run` answers the library's report, as JSON, for a viewer, and writes nothing: first all
    // passing, then with a planted set that fails on the estate.
    for round in ["passing", "failing"] {
        if round == "failing" {
            plant_set(pool, &failing).await;
        }
        let before = written(pool).await;
        let reply = serve.call("POST", "/api/v1/policy-tests/run", &viewer, &[], None).await;
        assert_eq!(reply.status, 200, "{round}: {reply:?}");
        assert_eq!(reply.header("content-type"), "application/json", "{round}");
        let library = foresight::run_policy_tests(pool).await.unwrap();
        assert_eq!(reply.json(), serde_json::to_value(&library).unwrap(), "{round}");
        let back: foresight::RunReport = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(back, library, "{round}: the answer deserializes for the remote CLI");
        let failed: Vec<&str> =
            library.results.iter().filter(|r| !r.passed).map(|r| r.test.as_str()).collect();
        match round {
            "passing" => assert_eq!((library.results.len(), failed.len()), (3, 0), "{library:?}"),
            _ => assert_eq!(failed, ["api-reaches-payments", "web-reaches-db"], "{library:?}"),
        }
        assert_eq!(written(pool).await, before, "{round}: a run writes nothing");
    }
    sqlx::query("DELETE FROM policy_test_sets WHERE name = 'api-intent'").execute(pool).await.unwrap();

    // Delete at the current version: gone, audited; the same delete again is 404.
    let reply = serve.call("DELETE", SET, &editor, &[("if-match", "\"2\"")], None).await;
    assert_eq!((reply.status, reply.json()), (200, json!({"result": null, "changed": []})), "{reply:?}");
    serve.get(SET, &viewer).await.problem(404, ProblemType::NotFound);
    serve
        .call("DELETE", SET, &editor, &[("if-match", "\"2\"")], None)
        .await
        .problem(404, ProblemType::NotFound);
    let actions: Vec<String> =
        sqlx::query_scalar("SELECT action FROM audit_log WHERE subject = 'payments-intent' ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(actions, ["policy-test-set.create", "policy-test-set.update", "policy-test-set.delete"]);

    // With the tests gone, the same ruleset update passes.
    let reply = serve.write("PUT", "/api/v1/rulesets/backend", &editor, Some("\"1\""), &bad).await;
    assert_eq!((reply.status, reply.header("etag")), (200, "\"2\""), "{reply:?}");
    drop(serve);
}

/// The path of a test-set file written under `dir`.
pub fn file(dir: &Path, name: &str, text: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}
