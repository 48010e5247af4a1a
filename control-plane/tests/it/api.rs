//! The operator HTTP API (issue 12, OPS-2) over real HTTPS against an in-process replica on a
//! real Postgres: authentication and roles, bounded and validated bodies that write nothing when
//! refused, conditional label writes under a race, the OpenAPI document against the mounted
//! routes, and the closed set of problem types.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::problem::{ApiError, ProblemType};
use innerwall_control_plane::api::{self, ApiConfig, ApiLimits, ApiState, ApiTls, openapi, router};
use innerwall_control_plane::error::Error;
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::operators::{self, Refused, Role};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::{Management, ServiceEntry};
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::postgres::Pools;
use innerwall_control_plane::safety::management::{self, Seeded};
use innerwall_control_plane::service::{self, Running};
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Body = BoxBody<Bytes, Infallible>;

/// A replica with its API on loopback, and a client that trusts the replica's CA.
struct Plane {
    db: TestDatabase,
    dir: PathBuf,
    running: Option<Running>,
    addr: SocketAddr,
    tls: tokio_rustls::TlsConnector,
}

/// The CA's directory goes with the plane, also when a test ends without [`Plane::stop`] or
/// panics.
impl Drop for Plane {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One answer: status, headers, body.
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

    /// Asserts a problem document of `kind` with `status`, and returns it.
    #[track_caller]
    fn problem(&self, status: u16, kind: ProblemType) -> Value {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), "application/problem+json", "{self:?}");
        let doc = self.json();
        assert_eq!(doc["type"], kind.urn(), "{doc}");
        assert_eq!(doc["status"], status, "{doc}");
        assert!(doc["detail"].as_str().is_some_and(|d| !d.is_empty()), "{doc}");
        doc
    }
}

/// A TLS client that trusts only the certificates in `pem`.
fn connector(pem: &str) -> tokio_rustls::TlsConnector {
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
    tokio_rustls::TlsConnector::from(Arc::new(client))
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

impl Plane {
    async fn start(limits: ApiLimits) -> Plane {
        let db = fresh_database().await.unwrap();
        let dir = std::env::temp_dir().join(format!("iw-api-{}", uuid::Uuid::new_v4()));
        let signer = Arc::new(FileCa::init(&dir.join("ca")).unwrap());
        let config = innerwall_control_plane::testing::loopback_service();
        let mut running =
            service::start(Pools::shared(db.pool.clone()), signer.clone(), config).await.unwrap();
        let api = ApiConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tls: ApiTls::FromCa { names: vec!["localhost".into()], lifetime: Duration::from_secs(3600) },
            limits,
        };
        let addr = running.start_api(api).await.unwrap();
        assert_eq!(running.api().unwrap().fingerprint.len(), 32 * 3 - 1, "SHA-256 as hex pairs");
        let tls = connector(&signer.ca_bundle_pem());
        Plane { db, dir, running: Some(running), addr, tls }
    }

    fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.stop().await.unwrap();
        }
    }

    /// Sends one request on a connection of its own.
    async fn send(&self, request: hyper::Request<Body>) -> Reply {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let stream = self.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let response = sender.send_request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes().to_vec();
        Reply { status: parts.status.as_u16(), headers: parts.headers, body }
    }

    /// A request with an optional bearer token and extra headers.
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Body,
    ) -> Reply {
        let mut request = hyper::Request::builder().method(method).uri(path).header("host", "localhost");
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.send(request.body(body).unwrap()).await
    }

    async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.call("GET", path, token, &[], full(Bytes::new())).await
    }

    /// A JSON request body with `If-Match` when given.
    async fn write(
        &self,
        method: &str,
        path: &str,
        token: &str,
        if_match: Option<&str>,
        body: &Value,
    ) -> Reply {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(tag) = if_match {
            headers.push(("if-match", tag));
        }
        self.call(method, path, Some(token), &headers, full(serde_json::to_vec(body).unwrap())).await
    }
}

async fn mint(pool: &PgPool, name: &str, role: Role) -> operators::MintedOperatorToken {
    operators::mint_audited(pool, "cli:test", name, role, operators::Expiry::Never).await.unwrap()
}

async fn register(pool: &PgPool, hostname: &str, labels: &[&str]) -> WorkloadId {
    let id = WorkloadId::new_random();
    let new = NewWorkload {
        id,
        hostname: hostname.into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: BTreeSet::new(),
    };
    innerwall_control_plane::foresight::commit(pool, "test", "register", hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), json!({})))
    })
    .await
    .unwrap();
    id
}

/// What a refused request must leave as it was: the audit log, the authored model, labels.
async fn written(pool: &PgPool) -> (i64, i64, BTreeMap<String, i64>) {
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(pool).await.unwrap();
    let services: i64 = sqlx::query_scalar("SELECT count(*) FROM services").fetch_one(pool).await.unwrap();
    let labels: Vec<(String, i64)> =
        sqlx::query_as("SELECT id::text, label_version FROM workloads").fetch_all(pool).await.unwrap();
    (audit, services, labels.into_iter().collect())
}

/// A write refused before its handler reads the body (a viewer's, 403) is answered after the
/// body was read, so the connection stays usable: a second request on it is answered too.
/// Before, the refusal closed the connection with the body unread, and a client still writing
/// it saw a broken pipe instead of the 403.
#[tokio::test]
async fn a_write_refused_before_its_body_keeps_the_connection() {
    let plane = Plane::start(ApiLimits::default()).await;
    let viewer = mint(plane.pool(), "vera", Role::Viewer).await;
    let tcp = tokio::net::TcpStream::connect(plane.addr).await.unwrap();
    let stream = plane.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(connection);
    let body = serde_json::to_vec(
        &serde_json::json!({"name": "svc", "description": "d".repeat(32 * 1024), "members": ["tcp:1"]}),
    )
    .unwrap();
    for round in 0..3 {
        let request = hyper::Request::builder()
            .method("POST")
            .uri("/api/v1/services")
            .header("host", "localhost")
            .header("authorization", format!("Bearer {}", viewer.token))
            .header("content-type", "application/json")
            .body(full(body.clone()))
            .unwrap();
        sender.ready().await.unwrap_or_else(|e| panic!("round {round}: the connection was closed: {e}"));
        let response = sender.send_request(request).await.unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(response.status(), 403, "round {round}");
        response.into_body().collect().await.unwrap();
    }
    plane.stop().await;
}

/// A body over the limit is answered 413 unread and the connection closes; the client, still
/// sending its body, is not met by a reset (the lingering close), so it can read that answer.
/// The body goes as raw bytes after the answer and its close: it arrives after the server is
/// done with the connection.
#[tokio::test]
async fn a_refused_oversized_body_meets_a_clean_close_not_a_reset() {
    let plane = Plane::start(ApiLimits::default()).await;
    let editor = mint(plane.pool(), "ed", Role::Editor).await;
    let length = 4 * api::DEFAULT_MAX_BODY;
    for round in 0..2 {
        let tcp = tokio::net::TcpStream::connect(plane.addr).await.unwrap();
        let mut tls = plane.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let head = format!(
            "POST /api/v1/services HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {}\r\n\
             content-type: application/json\r\ncontent-length: {length}\r\n\r\n",
            editor.token
        );
        tls.write_all(head.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        // The answer, then the server's close: everything it will say has been said.
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer)
            .await
            .unwrap_or_else(|e| panic!("round {round}: reading the answer: {e}"));
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "round {round}: {answer}");
        let (mut raw, _) = tls.into_inner();
        // In small writes, so a reset the first one meets fails the ones after it.
        for chunk in vec![b'x'; length].chunks(4096) {
            raw.write_all(chunk)
                .await
                .unwrap_or_else(|e| panic!("round {round}: the body met a closed socket: {e}"));
        }
        raw.shutdown().await.unwrap();
    }
    plane.stop().await;
}

#[tokio::test]
async fn api_rejects_bad_auth_and_bodies() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let viewer = mint(&pool, "vera", Role::Viewer).await;
    let editor = mint(&pool, "ed", Role::Editor).await;
    let expired = operators::mint_audited(
        &pool,
        "cli:test",
        "old",
        Role::Admin,
        operators::Expiry::After(chrono::Duration::hours(1)),
    )
    .await
    .unwrap();
    sqlx::query("UPDATE operator_tokens SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(&expired.id)
        .execute(&pool)
        .await
        .unwrap();
    let revoked = mint(&pool, "gone", Role::Admin).await;
    operators::revoke_audited(&pool, "cli:test", &operators::TokenRef::Name("gone".into()), None)
        .await
        .unwrap();
    let workload = register(&pool, "web-1", &["app=web"]).await;
    let before = written(&pool).await;

    // 401: no token, a bad one, a forged secret for a real id, expired, revoked, an oversized
    // header — each a problem document with WWW-Authenticate, none saying whether an id exists.
    let services = "/api/v1/services";
    let forged_secret = format!("{}{}", &viewer.token[..12], "A".repeat(43));
    let unknown_id = format!("iwo_{}{}", "Zz9-_Zz9", &viewer.token[12..]);
    let mut not_valid = Vec::new();
    for (what, token) in [
        ("none", None),
        ("malformed", Some("iwo_short".to_owned())),
        ("provisioning-style", Some(format!("iw_{}", &viewer.token[4..]))),
        ("forged secret", Some(forged_secret)),
        ("unknown id", Some(unknown_id)),
        ("expired", Some(expired.token.clone())),
        ("revoked", Some(revoked.token.clone())),
        ("oversized", Some(format!("iwo_{}", "a".repeat(400)))),
    ] {
        let reply = plane.get(services, token.as_deref()).await;
        let doc = reply.problem(401, ProblemType::Unauthorized);
        assert!(reply.header("www-authenticate").starts_with("Bearer"), "{what}: {reply:?}");
        let detail = doc["detail"].as_str().unwrap().to_owned();
        if let Some(secret) = token.as_deref().and_then(|t| t.get(12..)).filter(|s| s.len() >= 8) {
            assert!(!detail.contains(secret), "{what}: the secret is echoed: {detail}");
        }
        match what {
            "expired" => assert!(detail.contains("expired"), "{detail}"),
            "revoked" => assert!(detail.contains("revoked"), "{detail}"),
            "forged secret" | "unknown id" => not_valid.push(detail),
            _ => {}
        }
    }
    assert_eq!(not_valid[0], not_valid[1], "a forged secret and an unknown id get the same answer");

    // A viewer reads, and may not write: 403 naming the role needed; the body is never read.
    assert_eq!(plane.get(services, Some(&viewer.token)).await.status, 200);
    let service = json!({"name": "web", "entries": ["tcp:443"]});
    let reply = plane.write("POST", services, &viewer.token, None, &service).await;
    assert_eq!(reply.problem(403, ProblemType::Forbidden)["required_role"], "editor");
    let labels = format!("/api/v1/workloads/{workload}/labels");
    let reply =
        plane.write("PUT", &labels, &viewer.token, Some("\"1\""), &json!({"labels": {"app": "x"}})).await;
    reply.problem(403, ProblemType::Forbidden);
    let retire = format!("/api/v1/workloads/{workload}/retire");
    let reply = plane.write("POST", &retire, &editor.token, None, &json!({})).await;
    assert_eq!(reply.problem(403, ProblemType::Forbidden)["required_role"], "admin");

    // Bodies: too large (declared, and chunked without a length), not JSON, not the shape, not
    // valid — each refused before anything is written.
    let huge = json!({"name": "web", "entries": ["tcp:443"], "description": "x".repeat(70 * 1024)});
    plane
        .write("POST", services, &editor.token, None, &huge)
        .await
        .problem(413, ProblemType::PayloadTooLarge);
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> =
        (0..70).map(|_| Ok(Frame::data(Bytes::from(vec![b' '; 1024])))).collect();
    let chunked = StreamBody::new(tokio_stream::iter(chunks)).boxed();
    let reply = plane
        .call("POST", services, Some(&editor.token), &[("content-type", "application/json")], chunked)
        .await;
    reply.problem(413, ProblemType::PayloadTooLarge);
    let reply = plane
        .call(
            "POST",
            services,
            Some(&editor.token),
            &[("content-type", "application/json")],
            full("{\"name\": \"web\", \"entries\": ["),
        )
        .await;
    reply.problem(400, ProblemType::Invalid);
    let reply = plane
        .call(
            "POST",
            services,
            Some(&editor.token),
            &[("content-type", "text/plain")],
            full(service.to_string()),
        )
        .await;
    reply.problem(415, ProblemType::UnsupportedMediaType);
    let unknown_field = json!({"name": "web", "entries": ["tcp:443"], "owner": "me"});
    plane
        .write("POST", services, &editor.token, None, &unknown_field)
        .await
        .problem(400, ProblemType::Invalid);
    let bad_port = json!({"name": "web", "entries": ["tcp:99999"]});
    plane.write("POST", services, &editor.token, None, &bad_port).await.problem(400, ProblemType::Invalid);
    let bad_name = json!({"name": "Web Server", "entries": ["tcp:443"]});
    plane.write("POST", services, &editor.token, None, &bad_name).await.problem(400, ProblemType::Invalid);
    let reply =
        plane.write("PUT", &labels, &editor.token, Some("\"1\""), &json!({"labels": {"app": "-bad-"}})).await;
    reply.problem(400, ProblemType::Invalid);
    plane
        .write("PUT", &labels, &editor.token, Some("W/\"1\""), &json!({"labels": {}}))
        .await
        .problem(400, ProblemType::Invalid);
    plane.get("/api/v1/workloads/not-a-uuid", Some(&viewer.token)).await.problem(400, ProblemType::Invalid);
    plane.get("/api/v1/workloads?limit=100000", Some(&viewer.token)).await.problem(400, ProblemType::Invalid);
    plane.get("/api/v1/nothing-here", Some(&viewer.token)).await.problem(404, ProblemType::NotFound);
    let reply = plane.call("PATCH", services, Some(&editor.token), &[], full(Bytes::new())).await;
    reply.problem(405, ProblemType::MethodNotAllowed);
    assert_eq!(reply.header("allow"), "GET,HEAD,POST", "{reply:?}");

    assert_eq!(written(&pool).await, before, "a refused request writes nothing");

    // The same body, well formed, from an editor: created, and audited under the token's name.
    let reply = plane.write("POST", services, &editor.token, None, &service).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(reply.header("etag"), "\"1\"");
    assert_eq!(reply.header("location"), "/api/v1/services/web");
    let actor: String = sqlx::query_scalar("SELECT actor FROM audit_log WHERE action = 'service.create'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(actor, format!("operator:ed/{}", editor.id));
    plane
        .write("POST", services, &editor.token, None, &service)
        .await
        .problem(409, ProblemType::DuplicateName);
    plane.stop().await;
}

#[tokio::test]
async fn labels_conditional_write_race() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let alice = mint(&pool, "alice", Role::Editor).await;
    let bob = mint(&pool, "bob", Role::Editor).await;
    let workload = register(&pool, "web-1", &["app=web", "env=prod"]).await;
    let path = format!("/api/v1/workloads/{workload}/labels");

    // Both read the same version.
    let (a, b) = tokio::join!(plane.get(&path, Some(&alice.token)), plane.get(&path, Some(&bob.token)));
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(a.header("etag"), "\"1\"");
    assert_eq!(a.json(), json!({"labels": {"app": "web", "env": "prod"}, "version": 1}));
    let tag = a.header("etag").to_owned();

    // A PUT without If-Match changes nothing.
    let before = written(&pool).await;
    let reply = plane.write("PUT", &path, &alice.token, None, &json!({"labels": {"app": "api"}})).await;
    reply.problem(428, ProblemType::PreconditionRequired);
    assert_eq!(written(&pool).await, before);

    // Both PUT at once against the version they read: exactly one wins.
    let (alices, bobs) =
        (json!({"labels": {"app": "api", "env": "prod"}}), json!({"labels": {"app": "batch"}}));
    let (a, b) = tokio::join!(
        plane.write("PUT", &path, &alice.token, Some(&tag), &alices),
        plane.write("PUT", &path, &bob.token, Some(&tag), &bobs),
    );
    let (won, lost, winner) = match (a.status, b.status) {
        (200, 412) => (a, b, &alice),
        (412, 200) => (b, a, &bob),
        other => panic!("expected one 200 and one 412, got {other:?}: {a:?} {b:?}"),
    };
    assert_eq!(won.header("etag"), "\"2\"");
    assert_eq!(won.json()["result"]["version"], 2);
    let problem = lost.problem(412, ProblemType::PreconditionFailed);
    assert_eq!(problem["current_version"], 2, "{problem}");

    // The winner's labels stand, once, under its token's name.
    let now = plane.get(&path, Some(&alice.token)).await;
    let expected =
        if winner.name == "alice" { json!({"app": "api", "env": "prod"}) } else { json!({"app": "batch"}) };
    assert_eq!(now.json(), json!({"labels": expected, "version": 2}));
    let actors: Vec<String> =
        sqlx::query_scalar("SELECT actor FROM audit_log WHERE action = 'workload.label' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(actors, vec![format!("operator:{}/{}", winner.name, winner.id)]);

    // The loser re-reads and retries with the current version.
    let reply =
        plane.write("PUT", &path, &alice.token, Some("\"2\""), &json!({"labels": {"app": "web"}})).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("etag"), "\"3\"");
    plane.stop().await;
}

#[tokio::test]
async fn operator_tokens_are_revoked_at_once() {
    let plane = Plane::start(ApiLimits::default()).await;
    let admin = mint(plane.pool(), "root", Role::Admin).await;
    let editor = mint(plane.pool(), "ed", Role::Editor).await;
    let tokens = "/api/v1/operator-tokens";
    plane.get(tokens, Some(&editor.token)).await.problem(403, ProblemType::Forbidden);

    // An admin mints a viewer over the API; it works at once, and stops working at once.
    let reply =
        plane.write("POST", tokens, &admin.token, None, &json!({"name": "vera", "role": "viewer"})).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let minted = reply.json();
    let token = minted["token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("iwo_") && token.len() == operators::TOKEN_LEN, "{minted}");
    assert_eq!(plane.get("/api/v1/workloads", Some(&token)).await.status, 200);
    let listed = plane.get(tokens, Some(&admin.token)).await.json();
    assert!(!listed.to_string().contains(&token[12..]), "a list never shows a secret: {listed}");
    let reply =
        plane.write("POST", tokens, &admin.token, None, &json!({"name": "vera", "role": "admin"})).await;
    reply.problem(409, ProblemType::DuplicateName);
    let id = minted["id"].as_str().unwrap();
    let reply =
        plane.call("DELETE", &format!("{tokens}/{id}"), Some(&admin.token), &[], full(Bytes::new())).await;
    assert_eq!(reply.json()["status"], "revoked", "{reply:?}");
    let doc = plane.get("/api/v1/workloads", Some(&token)).await.problem(401, ProblemType::Unauthorized);
    assert!(doc["detail"].as_str().unwrap().contains("revoked"), "{doc}");
    let actors: Vec<(String, String)> = sqlx::query_as(
        "SELECT action, actor FROM audit_log WHERE action LIKE 'operator-token.%' AND subject LIKE 'vera/%' ORDER BY id",
    )
    .fetch_all(plane.pool())
    .await
    .unwrap();
    let by = format!("operator:root/{}", admin.id);
    assert_eq!(
        actors,
        vec![("operator-token.mint".into(), by.clone()), ("operator-token.revoke".into(), by)]
    );
    plane.stop().await;
}

#[tokio::test]
async fn api_listener_is_bounded_and_drains() {
    let limits =
        ApiLimits { max_connections: 2, handshake_timeout: Duration::from_secs(1), ..ApiLimits::default() };
    let mut plane = Plane::start(limits).await;
    let editor = mint(plane.pool(), "ed", Role::Editor).await;
    let connect = async || {
        let tcp = tokio::net::TcpStream::connect(plane.addr).await.unwrap();
        plane.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await
    };

    // Two connections that send nothing hold both slots; a third is closed before any TLS.
    let (first, second) = (connect().await.unwrap(), connect().await.unwrap());
    assert!(connect().await.is_err(), "a connection over the bound is refused");
    // Connections that send no request within the header timeout are closed by the server (the
    // client reads the end of each), freeing their slots.
    for mut held in [first, second] {
        let mut byte = [0u8; 1];
        let read = held.read(&mut byte).await;
        assert!(matches!(read, Ok(0) | Err(_)), "an idle connection was kept: {read:?}");
    }
    crate::eventually("a slot is free again", async || connect().await.is_ok()).await;
    assert_eq!(plane.get("/api/v1/services", Some(&editor.token)).await.status, 200);

    // A request in flight when the replica stops is answered before its connection closes.
    // The client asks for `100 Continue`, which the server sends when its handler starts reading
    // the body: from then on the request is inside the handler, held open by the body the
    // client has not finished sending.
    let body = br#"{"name": "web", "entries": ["tcp:443"]}"#;
    let (head, tail) = body.split_at(16);
    let tcp = tokio::net::TcpStream::connect(plane.addr).await.unwrap();
    let mut stream = plane.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    let request = format!(
        "POST /api/v1/services HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        editor.token,
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream.flush().await.unwrap();
    let mut answered = Vec::new();
    while !answered.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "closed before 100 Continue: {answered:?}");
        answered.push(byte[0]);
    }
    assert!(answered.starts_with(b"HTTP/1.1 100 Continue"), "{}", String::from_utf8_lossy(&answered));
    stream.write_all(head).await.unwrap();
    stream.flush().await.unwrap();

    // Stop begins: the listener closes (no new connection is taken) …
    let running = plane.running.take().unwrap();
    let mut stopping = tokio::spawn(running.stop());
    crate::eventually("the API listener closed", async || {
        tokio::net::TcpStream::connect(plane.addr).await.is_err()
    })
    .await;
    // … while the request is still open (stop has not returned, and no answer came) …
    assert!(!stopping.is_finished(), "stop returned with a request in flight");
    // … and once the client sends the rest, it is answered, told the connection closes, and
    // only then does stop return.
    stream.write_all(tail).await.unwrap();
    stream.flush().await.unwrap();
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 201"), "{reply}");
    assert!(reply.to_ascii_lowercase().contains("connection: close"), "drained, not kept alive: {reply}");
    (&mut stopping).await.unwrap().unwrap();
    let services: i64 =
        sqlx::query_scalar("SELECT count(*) FROM services").fetch_one(plane.pool()).await.unwrap();
    assert_eq!(services, 1);
    let stopped = tokio::net::TcpStream::connect(plane.addr).await;
    assert!(stopped.is_err(), "the listener is closed after stop");
    plane.stop().await;
}

#[tokio::test]
async fn api_serves_the_fleet_and_the_catalog() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let token = Some(editor.token.as_str());
    let web = register(&pool, "web-1", &["app=web"]).await;
    let db = register(&pool, "db-1", &["app=db"]).await;
    let batch = register(&pool, "batch-1", &["app=batch"]).await;
    let set_state = async |id: WorkloadId, state: innerwall_wire::sync::SyncState, seen: &str| {
        use innerwall_wire::convert::WireEnum;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE workloads w SET sync_state = $2, last_seen_at = now() - interval '{seen}',
                 applied_version = coalesce((SELECT version FROM workload_policies p WHERE p.workload_id = w.id), 0)
             WHERE id = $1"
        )))
        .bind(id.uuid())
        .bind(state.code())
        .execute(&pool)
        .await
        .unwrap();
    };
    set_state(web, innerwall_wire::sync::SyncState::Synced, "1 second").await;
    set_state(db, innerwall_wire::sync::SyncState::Degraded, "1 hour").await;
    set_state(batch, innerwall_wire::sync::SyncState::Synced, "1 minute").await;

    // Attention order across pages: degraded first, then synced by most recently seen.
    let mut seen = Vec::new();
    let mut path = "/api/v1/workloads?limit=1".to_owned();
    loop {
        let page = plane.get(&path, token).await.json();
        seen.extend(
            page["rows"].as_array().unwrap().iter().map(|r| r["hostname"].as_str().unwrap().to_owned()),
        );
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/api/v1/workloads?limit=1&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(seen, ["db-1", "web-1", "batch-1"]);
    let page =
        plane.get("/api/v1/workloads?sync_state=synced&selector=app%3Dweb%7Cbatch", token).await.json();
    let rows: Vec<&str> =
        page["rows"].as_array().unwrap().iter().map(|r| r["hostname"].as_str().unwrap()).collect();
    assert_eq!(rows, ["web-1", "batch-1"], "{page}");
    assert_eq!(page["truncated"], false);
    let page = plane.get("/api/v1/workloads?mode=enforcement", token).await.json();
    assert_eq!(page["rows"], json!([]));

    // Detail and policy read what the CLI prints.
    let detail = plane.get(&format!("/api/v1/workloads/{web}"), token).await.json();
    assert_eq!(detail["workload"]["labels"], json!({"app": "web"}));
    assert_eq!(detail["sync"]["state"], "SYNCED");
    let policy = plane.get(&format!("/api/v1/workloads/{web}/policy"), token).await.json();
    assert_eq!(
        (policy["workload"].as_str(), policy["version"].as_u64()),
        (Some(web.to_string().as_str()), Some(1))
    );
    let history = plane.get(&format!("/api/v1/workloads/{web}/policy/history"), token).await.json();
    assert_eq!(history["rows"].as_array().unwrap().len(), 1);
    // History lists summaries; each row's href reads that version in full.
    let row = &history["rows"][0];
    assert_eq!((row["version"].as_u64(), row["rules"].is_null()), (Some(1), true));
    assert!(
        row["bytes"].as_i64().is_some_and(|b| b > 0) && row["digest"].as_str().is_some_and(|d| d.len() == 64)
    );
    let whole = plane.get(row["href"].as_str().unwrap(), token).await.json();
    assert_eq!((whole["version"].as_u64(), whole["rules"].is_array()), (Some(1), true));
    plane
        .get(&format!("/api/v1/workloads/{web}/policy/history/2"), token)
        .await
        .problem(404, ProblemType::NotFound);
    plane
        .get(&format!("/api/v1/workloads/{web}/policy/history/0"), token)
        .await
        .problem(400, ProblemType::Invalid);
    let unknown = WorkloadId::new_random();
    plane.get(&format!("/api/v1/workloads/{unknown}"), token).await.problem(404, ProblemType::NotFound);
    let reply = plane
        .write("POST", &format!("/api/v1/workloads/{batch}/resend-snapshot"), &editor.token, None, &json!({}))
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    set_state(batch, innerwall_wire::sync::SyncState::Offline, "1 day").await;
    let reply = plane
        .write("POST", &format!("/api/v1/workloads/{batch}/resend-snapshot"), &editor.token, None, &json!({}))
        .await;
    assert!(reply.problem(409, ProblemType::AgentOffline)["last_seen"].is_string());

    // The catalog: a ruleset that uses a service renders; the service is then in use; stale
    // versions are refused with the current one.
    let service = json!({"name": "https", "entries": ["tcp:443"]});
    assert_eq!(plane.write("POST", "/api/v1/services", &editor.token, None, &service).await.status, 201);
    let ruleset = json!({"name": "web-in", "scope": {"app": ["web"]},
        "rules": [{"name": "from-db", "peers": [{"workloads": {"app": ["db"]}}], "services": ["https"]}]});
    let reply = plane.write("POST", "/api/v1/rulesets", &editor.token, None, &ruleset).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(reply.json()["changed"][0]["workload"], web.to_string(), "the commit rendered web-1");
    let reply =
        plane.write("DELETE", "/api/v1/services/https", &editor.token, Some("\"1\""), &json!({})).await;
    assert_eq!(reply.problem(409, ProblemType::InUse)["referrers"], json!(["ruleset web-in rule from-db"]));
    let shown = plane.get("/api/v1/rulesets/web-in", token).await;
    assert_eq!(shown.header("etag"), "\"1\"");
    assert_eq!(shown.json()["rules"][0]["services"], json!(["https"]));
    let renamed = json!({"name": "other", "scope": {"app": ["web"]}});
    let reply = plane.write("PUT", "/api/v1/rulesets/web-in", &editor.token, Some("\"1\""), &renamed).await;
    reply.problem(400, ProblemType::Invalid);
    let emptied = json!({"name": "web-in", "scope": {"app": ["web"]}});
    let reply = plane.write("PUT", "/api/v1/rulesets/web-in", &editor.token, Some("\"1\""), &emptied).await;
    assert_eq!((reply.status, reply.header("etag")), (200, "\"2\""), "{reply:?}");
    let reply = plane.write("PUT", "/api/v1/rulesets/web-in", &editor.token, Some("\"1\""), &emptied).await;
    assert_eq!(reply.problem(412, ProblemType::PreconditionFailed)["current_version"], 2);
    let reply =
        plane.write("DELETE", "/api/v1/services/https", &editor.token, Some("\"1\""), &json!({})).await;
    assert_eq!(reply.status, 200, "no longer in use: {reply:?}");
    plane.get("/api/v1/services/https", token).await.problem(404, ProblemType::NotFound);

    // Provisioning tokens: minted once with the secret, listed without it, revoked.
    let reply = plane
        .write("POST", "/api/v1/provisioning-tokens", &editor.token, None, &json!({"labels": ["app=web"]}))
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let minted = reply.json();
    let secret = minted["token"].as_str().unwrap();
    assert!(secret.starts_with("iw_"));
    let listed = plane.get("/api/v1/provisioning-tokens", token).await.json();
    assert!(!listed.to_string().contains(&secret[3..]));
    let id = minted["id"].as_str().unwrap();
    let reply = plane
        .call("DELETE", &format!("/api/v1/provisioning-tokens/{id}"), token, &[], full(Bytes::new()))
        .await;
    assert_eq!(reply.json()["status"], "revoked");
    let reply =
        plane.write("POST", "/api/v1/provisioning-tokens", &editor.token, None, &json!({"labels": []})).await;
    reply.problem(400, ProblemType::Invalid);
    plane.stop().await;
}

#[tokio::test]
async fn promotions_over_the_api() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let promoter = mint(&pool, "pat", Role::Promoter).await;
    let web = register(&pool, "web-1", &["app=web"]).await;
    register(&pool, "web-2", &["app=web"]).await;
    let promotions = "/api/v1/promotions";
    let to_simulation =
        json!({"scope": "app=web", "expect_count": 2, "to": "simulation", "reason": "try it"});
    plane
        .write("POST", promotions, &editor.token, None, &to_simulation)
        .await
        .problem(403, ProblemType::Forbidden);

    // The count is pinned: a set of another size changes nothing.
    let wrong = json!({"scope": "app=web", "expect_count": 3, "to": "simulation", "reason": "try it"});
    let doc = plane
        .write("POST", promotions, &promoter.token, None, &wrong)
        .await
        .problem(409, ProblemType::MatchCountMismatch);
    assert_eq!((doc["expected"].as_u64(), doc["matched"].as_u64()), (Some(3), Some(2)), "{doc}");
    assert_eq!(doc["names"].as_array().unwrap().len(), 2);

    let reply = plane.write("POST", promotions, &promoter.token, None, &to_simulation).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let record = reply.json();
    assert_eq!(record["actor"], format!("operator:pat/{}", promoter.id));
    assert_eq!(record["to_mode"], "simulation");

    // Enforcement without evidence is refused with the verdict's reasons; the verdict says why.
    let enforce = json!({"ids": [web.to_string()], "expect_count": 1, "to": "enforcement", "reason": "go"});
    let doc = plane
        .write("POST", promotions, &promoter.token, None, &enforce)
        .await
        .problem(409, ProblemType::EvidenceInsufficient);
    assert_eq!(doc["outcome"], "INSUFFICIENT", "{doc}");
    assert!(doc["reasons"].as_str().is_some_and(|r| r.contains("web-1")), "{doc}");
    let verdict = plane.get(&format!("/api/v1/verdict?ids={web}"), Some(&editor.token)).await.json();
    assert_eq!(verdict["outcome"], "INSUFFICIENT");
    let listed = plane.get(promotions, Some(&editor.token)).await.json();
    assert_eq!(
        listed["rows"].as_array().unwrap().len(),
        1,
        "only the change that happened is recorded: {listed}"
    );
    let id = record["id"].as_str().unwrap();
    assert_eq!(plane.get(&format!("{promotions}/{id}"), Some(&editor.token)).await.json(), record);
    plane.stop().await;
}

/// The audit records of `action`: (actor, subject).
async fn audited(pool: &PgPool, action: &str) -> Vec<(String, String)> {
    sqlx::query_as("SELECT actor, subject FROM audit_log WHERE action = $1 ORDER BY id")
        .bind(action)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn estate_ranges(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT cidr::text FROM estate_ranges ORDER BY cidr").fetch_all(pool).await.unwrap()
}

#[tokio::test]
async fn estate_ranges_and_render_over_the_api() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let viewer = mint(&pool, "vera", Role::Viewer).await;
    let editor = mint(&pool, "ed", Role::Editor).await;
    let admin = mint(&pool, "ada", Role::Admin).await;
    let ranges = "/api/v1/estate-ranges";
    let seeded = estate_ranges(&pool).await;
    let listed = plane.get(ranges, Some(&viewer.token)).await.json();
    let cidrs: Vec<&str> =
        listed["rows"].as_array().unwrap().iter().map(|r| r["cidr"].as_str().unwrap()).collect();
    assert_eq!(cidrs, seeded, "{listed}");

    // Writing ranges is for admins; refused or invalid requests write nothing.
    let public = json!({"cidr": "198.51.100.0/24", "description": "dmz"});
    let before = written(&pool).await;
    let doc =
        plane.write("POST", ranges, &editor.token, None, &public).await.problem(403, ProblemType::Forbidden);
    assert_eq!(doc["required_role"], "admin", "{doc}");
    for bad in
        [json!({"cidr": "198.51.100.1/24"}), json!({"cidr": "nope"}), json!({"cidr": "10.1.0.0/16", "x": 1})]
    {
        plane.write("POST", ranges, &admin.token, None, &bad).await.problem(400, ProblemType::Invalid);
    }
    let long = json!({"cidr": "10.1.0.0/16", "description": "d".repeat(2000)});
    plane.write("POST", ranges, &admin.token, None, &long).await.problem(400, ProblemType::Invalid);
    plane
        .call("DELETE", &format!("{ranges}/10.0.0.0/8"), Some(&editor.token), &[], full(Bytes::new()))
        .await
        .problem(403, ProblemType::Forbidden);
    plane
        .call("DELETE", &format!("{ranges}/10.0.0.0/99"), Some(&admin.token), &[], full(Bytes::new()))
        .await
        .problem(400, ProblemType::Invalid);
    assert_eq!(written(&pool).await, before);
    assert_eq!(estate_ranges(&pool).await, seeded);

    // Added (audited with the operator token), then a second add is a duplicate.
    let reply = plane.write("POST", ranges, &admin.token, None, &public).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(reply.header("location"), "/api/v1/estate-ranges/198.51.100.0/24");
    assert_eq!(reply.header("etag"), "", "a range has no version");
    assert_eq!(reply.json(), json!({"result": null, "changed": []}));
    let actor = format!("operator:ada/{}", admin.id);
    assert_eq!(audited(&pool, "estate-range.add").await, [(actor.clone(), "198.51.100.0/24".to_owned())]);
    let doc = plane
        .write("POST", ranges, &admin.token, None, &public)
        .await
        .problem(409, ProblemType::DuplicateName);
    assert_eq!(doc["detail"], "estate range \"198.51.100.0/24\" already exists");
    let v6 = json!({"cidr": "fd08::/48"});
    assert_eq!(plane.write("POST", ranges, &admin.token, None, &v6).await.status, 201);

    // Removed by address and prefix (an IPv6 address percent-encoded or not); then not found.
    for path in ["198.51.100.0/24", "fd08%3A%3A/48"] {
        let reply = plane
            .call("DELETE", &format!("{ranges}/{path}"), Some(&admin.token), &[], full(Bytes::new()))
            .await;
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
    }
    let doc = plane
        .call("DELETE", &format!("{ranges}/198.51.100.0/24"), Some(&admin.token), &[], full(Bytes::new()))
        .await
        .problem(404, ProblemType::NotFound);
    assert_eq!(doc["detail"], "estate range \"198.51.100.0/24\" not found");
    assert_eq!(estate_ranges(&pool).await, seeded);
    assert_eq!(
        audited(&pool, "estate-range.remove").await,
        [(actor.clone(), "198.51.100.0/24".to_owned()), (actor, "fd08::/48".to_owned())]
    );

    // A render on request: editors may, viewers may not; audited with the token.
    plane
        .call("POST", "/api/v1/render", Some(&viewer.token), &[], full(Bytes::new()))
        .await
        .problem(403, ProblemType::Forbidden);
    assert_eq!(audited(&pool, "policy.render").await, []);
    register(&pool, "web-1", &["app=web"]).await;
    let reply = plane.call("POST", "/api/v1/render", Some(&editor.token), &[], full(Bytes::new())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json(), json!({"result": null, "changed": []}), "the policy was current");
    assert_eq!(
        audited(&pool, "policy.render").await,
        [(format!("operator:ed/{}", editor.id), "all".to_owned())]
    );
    plane.stop().await;
}

/// The failsafe rules of `id`'s rendered policy over the API: `proto ports <- peers` lines.
async fn failsafe(plane: &Plane, token: &str, id: WorkloadId) -> Vec<String> {
    let policy = plane.get(&format!("/api/v1/workloads/{id}/policy"), Some(token)).await.json();
    policy["rules"]
        .as_array()
        .unwrap_or_else(|| panic!("{policy}"))
        .iter()
        .filter(|r| r["rule_id"].as_str().unwrap().starts_with("failsafe:management/"))
        .map(|r| {
            let list = |k: &str| -> Vec<&str> {
                r[k].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect()
            };
            format!(
                "{} {} <- {}",
                r["protocol"].as_str().unwrap(),
                list("ports").join(","),
                list("peers").join(" ")
            )
        })
        .collect()
}

fn management(cidrs: &[&str], services: &[&str]) -> Management {
    Management::new(
        cidrs.iter().map(|c| Cidr::parse(c).unwrap()),
        services.iter().map(|e| ServiceEntry::parse(e).unwrap()),
    )
    .unwrap()
}

#[tokio::test]
async fn management_access_narrows_and_is_never_removed() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let admin = mint(&pool, "ada", Role::Admin).await;
    let web = register(&pool, "web-1", &["app=web"]).await;
    let db = register(&pool, "db-1", &["app=db"]).await;
    let path = "/api/v1/management";
    let body = |cidrs: &[&str], services: &[&str]| json!({"cidrs": cidrs, "services": services});

    // None set: nothing rendered, and nothing to narrow.
    assert_eq!(failsafe(&plane, &admin.token, web).await, Vec::<String>::new());
    let doc = plane
        .write("PUT", path, &admin.token, None, &body(&["192.0.2.0/24"], &["tcp:22"]))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("--management-cidr"), "{doc}");

    // Seeded (as serve does at start): every workload's render carries it; a second seed of the
    // same set does nothing, of another reports the stored one and keeps it.
    let seeded = management(&["192.0.2.0/24", "2001:db8::/48"], &["tcp:22", "udp:161"]);
    assert_eq!(management::seed(&pool, "serve", &seeded).await.unwrap(), Seeded::Stored);
    assert_eq!(management::seed(&pool, "serve", &seeded).await.unwrap(), Seeded::Same);
    let other = management(&["0.0.0.0/0"], &["tcp:22"]);
    assert_eq!(management::seed(&pool, "serve", &other).await.unwrap(), Seeded::Differs(seeded.clone()));
    let full = ["tcp 22 <- 192.0.2.0/24 2001:db8::/48", "udp 161 <- 192.0.2.0/24 2001:db8::/48"];
    assert_eq!(failsafe(&plane, &admin.token, web).await, full);
    assert_eq!(failsafe(&plane, &admin.token, db).await, full);

    // Refused, writing nothing: an editor; a wider set; an empty one; a malformed or oversized one.
    let before = written(&pool).await;
    plane
        .write("PUT", path, &editor.token, None, &body(&["192.0.2.0/25"], &["tcp:22"]))
        .await
        .problem(403, ProblemType::Forbidden);
    for (wider, says) in [
        (body(&["192.0.0.0/16"], &["tcp:22"]), "192.0.0.0/16"),
        (body(&["192.0.2.0/24"], &["tcp:22-23"]), "22-23"),
        (body(&["192.0.2.0/24"], &["icmp"]), "icmp"),
    ] {
        let doc =
            plane.write("PUT", path, &admin.token, None, &wider).await.problem(400, ProblemType::Invalid);
        let detail = doc["detail"].as_str().unwrap();
        assert!(detail.contains("can only be narrowed") && detail.contains(says), "{doc}");
    }
    let many: Vec<String> = (0..65).map(|i| format!("192.0.2.{i}/32")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    for bad in [
        body(&[], &["tcp:22"]),
        body(&["192.0.2.0/24"], &[]),
        body(&["192.0.2.1/24"], &["tcp:22"]),
        body(&["192.0.2.0/24"], &["tcp:0"]),
        body(&many, &["tcp:22"]),
        json!({"cidrs": ["192.0.2.0/24"], "services": ["tcp:22"], "x": 1}),
    ] {
        plane.write("PUT", path, &admin.token, None, &bad).await.problem(400, ProblemType::Invalid);
    }
    assert_eq!(written(&pool).await, before);
    assert_eq!(failsafe(&plane, &admin.token, web).await, full);

    // An admin narrows the estate's set: audited with the token, every workload's policy moves.
    let reply = plane.write("PUT", path, &admin.token, None, &body(&["192.0.2.0/25"], &["tcp:22"])).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["changed"].as_array().unwrap().len(), 2, "{reply:?}");
    assert_eq!(failsafe(&plane, &admin.token, db).await, ["tcp 22 <- 192.0.2.0/25"]);
    let actor = format!("operator:ada/{}", admin.id);
    assert_eq!(audited(&pool, "management.narrow").await, [(actor.clone(), "estate".to_owned())]);

    // One workload's narrowing: inside the estate's or refused; then the estate's set cannot be
    // narrowed past it.
    let own = format!("/api/v1/workloads/{web}/management");
    plane
        .write("PUT", &own, &admin.token, None, &body(&["192.0.2.128/25"], &["tcp:22"]))
        .await
        .problem(400, ProblemType::Invalid);
    let reply = plane.write("PUT", &own, &admin.token, None, &body(&["192.0.2.8/29"], &["tcp:22"])).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(failsafe(&plane, &admin.token, web).await, ["tcp 22 <- 192.0.2.8/29"]);
    assert_eq!(failsafe(&plane, &admin.token, db).await, ["tcp 22 <- 192.0.2.0/25"]);
    let doc = plane
        .write("PUT", path, &admin.token, None, &body(&["192.0.2.64/26"], &["tcp:22"]))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains(&web.to_string()), "{doc}");
    let missing = format!("/api/v1/workloads/{}/management", WorkloadId::new_random());
    plane
        .write("PUT", &missing, &admin.token, None, &body(&["192.0.2.8/29"], &["tcp:22"]))
        .await
        .problem(404, ProblemType::NotFound);
    let listed = plane.get(path, Some(&editor.token)).await.json();
    assert_eq!(listed["estate"]["cidrs"], json!(["192.0.2.0/25"]), "{listed}");
    assert_eq!(listed["workloads"][0]["workload_id"], json!(web.to_string()), "{listed}");
    assert_eq!(listed["workloads"][0]["updated_by"], json!(actor), "{listed}");

    // Reset (the database's holder only; the API has no route for it) widens and drops the
    // narrowings, audited with what it replaced.
    management::reset(&pool, "cli:root", &seeded).await.unwrap();
    assert_eq!(failsafe(&plane, &admin.token, web).await, full);
    let detail: Value = sqlx::query_scalar("SELECT detail FROM audit_log WHERE action = 'management.reset'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(detail["narrowings_dropped"], json!([web.to_string()]), "{detail}");
    assert_eq!(detail["before"], json!("tcp:22 from 192.0.2.0/25"), "{detail}");
    assert_eq!(audited(&pool, "management.seed").await, [("serve".to_owned(), "estate".to_owned())]);
    plane.stop().await;
}

/// A promotion that reverts unless confirmed (issue 31, FLOW-11) over the API: the deadline's
/// bounds, the agent's capability, who may confirm, what a confirmation needs, the second
/// confirmation, the revert by the deadline (once), and a later mode change superseding it.
/// The real agent holding the deadline is `e2e::confirm`.
#[tokio::test]
async fn promotion_confirm_over_the_api() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let promoter = mint(&pool, "pat", Role::Promoter).await;
    let db = register(&pool, "db-1", &["app=db"]).await;
    let latest = async || -> u64 {
        let policy = plane.get(&format!("/api/v1/workloads/{db}/policy"), Some(&editor.token)).await.json();
        policy["version"].as_u64().unwrap()
    };
    let promote = |to: &str, within: Option<&str>| {
        json!({"ids": [db.to_string()], "expect_count": 1, "to": to, "reason": "try it",
               "override_reason": "no agent in this test", "confirm_within": within})
    };
    let guarded = |guard: Value| {
        let mut body = promote("enforcement", None);
        body["guard"] = guard;
        body
    };
    let post =
        async |body: &Value| plane.write("POST", "/api/v1/promotions", &promoter.token, None, body).await;
    let before = (written(&pool).await, latest().await);
    for (body, says) in [
        (promote("enforcement", Some("5s")), "10s to 1day"),
        (promote("enforcement", Some("soon")), "confirm_within \"soon\""),
        (promote("simulation", Some("1m")), "belongs to a move to enforcement"),
        // No agent ever said it holds a deadline: it would never revert.
        (promote("enforcement", Some("1m")), "db-1"),
        // The guard watches a day at most, and trips at one connection or more.
        (guarded(json!({"minutes": 24 * 60 + 1})), "0 to 1440 minutes"),
        (guarded(json!({"threshold": 0})), "1 or more blocked connections"),
    ] {
        let doc = post(&body).await.problem(400, ProblemType::Invalid);
        assert!(doc["detail"].as_str().unwrap().contains(says), "{says}: {doc}");
    }
    assert_eq!((written(&pool).await, latest().await), before, "nothing was changed");

    // The agent said so in its Hello (stood in for here).
    sqlx::query("UPDATE workloads SET agent_capabilities = '{confirm-deadline}' WHERE id = $1")
        .bind(db.uuid())
        .execute(&pool)
        .await
        .unwrap();
    let reply = post(&promote("enforcement", Some("1m"))).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let first = reply.json();
    assert_eq!(first["confirmation"]["state"], "pending", "{first}");
    let shown = plane.get(&format!("/api/v1/workloads/{db}"), Some(&editor.token)).await.json();
    assert_eq!(shown["workload"]["awaiting_confirmation"][0], first["id"], "{shown}");
    let held = latest().await;
    assert!(held > before.1, "the deadline renders into the policy");
    assert_eq!(first["confirmation"]["workloads"][0]["version"], Value::Null, "set after the render");
    let listed = plane.get("/api/v1/promotions", Some(&editor.token)).await.json();
    assert_eq!(listed["rows"][0]["confirmation"]["state"], "pending", "{listed}");
    assert_eq!(listed["rows"][0]["confirmation"]["workloads"][0]["version"], held, "{listed}");

    let id = first["id"].as_str().unwrap().to_owned();
    let confirm = |id: &str| format!("/api/v1/promotions/{id}/confirm");
    plane
        .write("POST", &confirm(&id), &editor.token, None, &json!({}))
        .await
        .problem(403, ProblemType::Forbidden);
    plane
        .write("POST", &confirm("nope"), &promoter.token, None, &json!({}))
        .await
        .problem(400, ProblemType::Invalid);
    plane
        .write("POST", &confirm(&uuid::Uuid::new_v4().to_string()), &promoter.token, None, &json!({}))
        .await
        .problem(404, ProblemType::NotFound);
    plane
        .write("POST", &confirm(&id), &promoter.token, None, &json!({"x": 1}))
        .await
        .problem(400, ProblemType::Invalid);
    // A fresh verdict at the promoted version: no agent, no evidence.
    let doc = plane
        .write("POST", &confirm(&id), &promoter.token, None, &json!({}))
        .await
        .problem(409, ProblemType::EvidenceInsufficient);
    assert_eq!(doc["outcome"], "INSUFFICIENT", "{doc}");
    assert_eq!(latest().await, held);
    let reply = plane
        .write(
            "POST",
            &confirm(&id),
            &promoter.token,
            None,
            &json!({"override_reason": "watched it by hand"}),
        )
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let confirmed = reply.json();
    assert_eq!(confirmed["confirmation"]["state"], "confirmed", "{confirmed}");
    let pat = confirmed["actor"].as_str().unwrap().to_owned();
    assert!(pat.starts_with("operator:pat"), "{pat}");
    assert_eq!(confirmed["confirmation"]["settled_by"], pat.as_str(), "{confirmed}");
    let after = latest().await;
    assert!(after > held, "the deadline leaves the policy");
    let shown = plane.get(&format!("/api/v1/workloads/{db}"), Some(&editor.token)).await.json();
    assert!(shown["workload"].get("awaiting_confirmation").is_none(), "{shown}");
    let doc = plane
        .write("POST", &confirm(&id), &promoter.token, None, &json!({}))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains(&format!("confirmed by {pat}")), "{doc}");

    // Not confirmed: past its deadline, the sweep reverts it to simulation, once.
    post(&promote("simulation", None)).await;
    let second = post(&promote("enforcement", Some("1m"))).await.json();
    let second_id: uuid::Uuid = second["id"].as_str().unwrap().parse().unwrap();
    sqlx::query("UPDATE promotions SET confirm_deadline = now() - interval '1 second' WHERE id = $1")
        .bind(second_id)
        .execute(&pool)
        .await
        .unwrap();
    let reverted = innerwall_control_plane::safety::confirm::revert_expired(&pool).await.unwrap();
    assert_eq!(reverted.len(), 1);
    let c = reverted[0].confirmation.as_ref().unwrap();
    assert_eq!((c.state.as_str(), c.settled_by.as_deref()), ("reverted", Some("deadline")));
    assert!(innerwall_control_plane::safety::confirm::revert_expired(&pool).await.unwrap().is_empty());
    let shown = plane.get(&format!("/api/v1/workloads/{db}"), Some(&editor.token)).await.json();
    assert_eq!(shown["workload"]["mode"], "simulation", "{shown}");
    let doc = plane
        .write("POST", &confirm(&second_id.to_string()), &promoter.token, None, &json!({}))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("reverted to simulation by its deadline"), "{doc}");

    // A later mode change supersedes a pending one.
    let third = post(&promote("enforcement", Some("1m"))).await.json();
    post(&promote("simulation", None)).await;
    let third = plane
        .get(&format!("/api/v1/promotions/{}", third["id"].as_str().unwrap()), Some(&editor.token))
        .await
        .json();
    assert_eq!(third["confirmation"]["state"], "superseded", "{third}");
    assert_eq!(third["confirmation"]["settled_by"], pat.as_str(), "{third}");
}

/// Staged rulesets over the API (issue 31, FLOW-10): staging renders a staged set into the
/// policy of each workload the ruleset touches and enforces nothing; a window may only name its
/// version's set; promoting is count-pinned and judged on the pending decisions recorded since
/// the set was acknowledged (UNSAFE with a flow allowed now that the staged rules block), and
/// writes the ruleset, recorded and audited; unstaging drops the set.
#[tokio::test]
async fn staged_rulesets_over_the_api() {
    use innerwall_control_plane::flows::{self, installs};
    use innerwall_control_plane::policy::store;
    use innerwall_wire::convert::WireEnum as _;
    use innerwall_wire::flows::{Decision, FlowRecord, FlowWindow, Pending};
    use innerwall_wire::policy::{Mode, Protocol};

    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let viewer = mint(&pool, "vic", Role::Viewer).await;
    let editor = mint(&pool, "ed", Role::Editor).await;
    let promoter = mint(&pool, "pat", Role::Promoter).await;
    let db = register(&pool, "db-1", &["app=db"]).await;
    register(&pool, "web-1", &["app=web"]).await;
    let write = async |method: &str, path: &str, token: &str, body: &Value| {
        plane.write(method, path, token, None, body).await
    };
    let pg = json!({"name": "pg", "description": "", "entries": ["tcp:5432"]});
    assert_eq!(write("POST", "/api/v1/services", &editor.token, &pg).await.status, 201);
    let ruleset = |clients: &str, extra: bool| {
        let mut rules = vec![json!({"name": "clients", "peers": [{"cidr": clients}], "services": ["pg"]})];
        if extra {
            rules.push(json!({"name": "admins", "peers": [{"cidr": "192.0.2.0/24"}], "services": ["pg"]}));
        }
        json!({"name": "db", "scope": {"app": ["db"]}, "rules": rules})
    };
    assert_eq!(
        write("POST", "/api/v1/rulesets", &editor.token, &ruleset("10.0.0.0/24", false)).await.status,
        201
    );
    let promote = json!({"ids": [db.to_string()], "expect_count": 1, "to": "enforcement", "reason": "r",
                         "override_reason": "no agent in this test"});
    assert_eq!(write("POST", "/api/v1/promotions", &promoter.token, &promote).await.status, 201);
    let latest =
        async || store::persisted_policy(&mut pool.acquire().await.unwrap(), db).await.unwrap().unwrap().0;
    let in_force = latest().await;

    // Refused, changing nothing: a viewer; a reference to nothing; the ruleset as it is.
    let staged = ruleset("10.0.0.0/28", true);
    let before = (written(&pool).await, latest().await.version());
    write("POST", "/api/v1/staged-rulesets", &viewer.token, &staged)
        .await
        .problem(403, ProblemType::Forbidden);
    let mut unknown = staged.clone();
    unknown["rules"][0]["services"] = json!(["ssh"]);
    let doc = write("POST", "/api/v1/staged-rulesets", &editor.token, &unknown)
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("unknown service \"ssh\""), "{doc}");
    let doc = write("POST", "/api/v1/staged-rulesets", &editor.token, &ruleset("10.0.0.0/24", false))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("nothing to stage"), "{doc}");
    assert_eq!((written(&pool).await, latest().await.version()), before);

    // Staged: the db workload's policy carries the staged set beside the same rules.
    let reply = write("POST", "/api/v1/staged-rulesets", &editor.token, &staged).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let stage = reply.json()["result"].as_i64().unwrap();
    let policy = latest().await;
    assert!(policy.rules().eq(in_force.rules()), "nothing is enforced by staging");
    let set = policy.staged().expect("a staged set").clone();
    assert_eq!(set.set(), format!("db:{stage}"));
    assert_eq!((set.upserts().len(), set.removals().len()), (2, 0));
    let listed = plane.get("/api/v1/staged-rulesets", Some(&viewer.token)).await.json();
    assert_eq!(listed[0]["workloads"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["workloads"][0]["staged_set"], set.set(), "{listed}");
    assert_eq!(listed[0]["base_version"], 1, "{listed}");

    // The agent applied it (stood in for) and sent a window of both decisions: 10.0.0.77 is
    // allowed now and pending-blocked (the narrowing), 10.0.0.5 allowed by both.
    installs::record(&mut pool.acquire().await.unwrap(), db, policy.version(), Mode::Enforcement, None, None)
        .await
        .unwrap();
    let acked: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await.unwrap();
    let start = acked.timestamp_millis() - 500;
    let clients = policy.rules().next().unwrap().id().clone();
    let record = |src: &str, pending: Decision| FlowRecord {
        src: src.parse().unwrap(),
        dst: "10.0.0.1".parse().unwrap(),
        dst_port: 5432,
        protocol: Protocol::Tcp,
        decision: Decision::Allowed,
        matched_rule: Some(clients.clone()),
        packets: 3,
        bytes: 180,
        new_connections: 1,
        first_seen_ms: start + 10,
        last_seen_ms: start + 20,
        pending: Some(Pending {
            decision: pending,
            rule: (pending == Decision::Allowed).then(|| clients.clone()),
        }),
    };
    let window = |set: &str, start_ms: i64, records: Vec<FlowRecord>| FlowWindow {
        id: uuid::Uuid::new_v4(),
        start_ms,
        end_ms: start_ms + 1_000,
        policy_version: policy.version(),
        mode: Mode::Enforcement,
        records,
        gaps: vec![],
        staged_set: Some(set.to_owned()),
    };
    // A window naming a set its version never carried is refused.
    let err = flows::ingest(&pool, db, &window("db:999", start, vec![])).await.unwrap_err();
    assert!(err.to_string().contains("staged set \"db:999\""), "{err}");
    let records = vec![record("10.0.0.5", Decision::Allowed), record("10.0.0.77", Decision::Blocked)];
    flows::ingest(&pool, db, &window(set.set(), start, records)).await.unwrap();
    let stored: (Option<String>, i64) = sqlx::query_as(
        "SELECT (SELECT staged_set FROM flow_windows WHERE workload_id = $1),
                (SELECT count(*) FROM flow_records WHERE workload_id = $1 AND pending_decision IS NOT NULL)",
    )
    .bind(db.uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored, (Some(set.set().to_owned()), 2));
    // Operators read both decisions, with the set they were made under.
    let listed = plane.get(&format!("/api/v1/flows?workload={db}"), Some(&viewer.token)).await.json();
    let narrowed: Vec<&Value> =
        listed["rows"].as_array().unwrap().iter().filter(|r| r["src_address"] == "10.0.0.77").collect();
    assert_eq!(narrowed.len(), 1, "{listed}");
    assert_eq!(
        (&narrowed[0]["staged_set"], &narrowed[0]["pending_decision"], &narrowed[0]["pending_rule_id"]),
        (&json!(set.set()), &json!(Decision::Blocked.code()), &json!("")),
        "{listed}"
    );

    // Promoting: a promoter's; count-pinned; UNSAFE names the flow the staged rules would block.
    let path = "/api/v1/staged-rulesets/db/promote";
    let before = (written(&pool).await, latest().await.version());
    let ask = |count: usize, reason: Option<&str>| json!({"expect_count": count, "min_evidence": "0s", "override_reason": reason});
    write("POST", path, &editor.token, &ask(1, None)).await.problem(403, ProblemType::Forbidden);
    let doc = write("POST", path, &promoter.token, &ask(2, None))
        .await
        .problem(409, ProblemType::MatchCountMismatch);
    assert_eq!(doc["names"][0].as_str().unwrap(), format!("db-1 ({db})"), "{doc}");
    let doc = write("POST", path, &promoter.token, &ask(1, None))
        .await
        .problem(409, ProblemType::EvidenceInsufficient);
    assert_eq!(doc["outcome"], "UNSAFE", "{doc}");
    assert!(doc["reasons"].as_str().unwrap().contains("10.0.0.77"), "{doc}");
    assert!(!doc["reasons"].as_str().unwrap().contains("10.0.0.5 "), "{doc}");
    assert_eq!((written(&pool).await, latest().await.version()), before, "nothing was changed");

    // With an override it is the ruleset: enforced, no staged set left, recorded and audited.
    let reply = write("POST", path, &promoter.token, &ask(1, Some("the narrowing is intended"))).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let done = reply.json();
    assert_eq!(
        (done["result"]["version"].as_i64(), done["result"]["stage"].as_i64()),
        (Some(2), Some(stage))
    );
    assert_eq!(done["result"]["verdict"]["outcome"], "UNSAFE", "{done}");
    assert_eq!(done["changed"][0]["workload"], db.to_string(), "{done}");
    let promoted = latest().await;
    assert_eq!(promoted.staged(), None);
    assert!(promoted.rules().eq(policy.pending().unwrap().rules()), "the staged rules are the rules");
    assert_eq!(plane.get("/api/v1/staged-rulesets", Some(&viewer.token)).await.json(), json!([]));
    let (records, audited): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM staged_promotions WHERE ruleset = 'db' AND override_reason IS NOT NULL),
                (SELECT count(*) FROM audit_log WHERE action = 'ruleset.promote-staged')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((records, audited), (1, 1));
    write("POST", path, &promoter.token, &ask(1, None)).await.problem(404, ProblemType::NotFound);

    // Staged again, then again (a new stage), then unstaged: the set leaves the policy.
    let widen = ruleset("10.0.0.0/24", true);
    let first =
        write("POST", "/api/v1/staged-rulesets", &editor.token, &widen).await.json()["result"].as_i64();
    let second =
        write("POST", "/api/v1/staged-rulesets", &editor.token, &widen).await.json()["result"].as_i64();
    assert!(second > first, "{first:?} then {second:?}");
    assert_eq!(latest().await.staged().map(|s| s.set().to_owned()), Some(format!("db:{}", second.unwrap())));
    let reply = plane.write("DELETE", "/api/v1/staged-rulesets/db", &editor.token, None, &json!(null)).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(latest().await.staged(), None);
    assert!(latest().await.rules().eq(promoted.rules()));
    plane
        .write("DELETE", "/api/v1/staged-rulesets/db", &editor.token, None, &json!(null))
        .await
        .problem(404, ProblemType::NotFound);

    // At most MAX_STAGED at once: one more is refused naming the bound, and writes nothing.
    let max = innerwall_control_plane::safety::staged::MAX_STAGED;
    let many = |n: usize| {
        json!({"name": format!("extra-{n}"), "scope": {"app": ["none"]},
                                 "rules": [{"name": "r", "peers": [{"cidr": "10.2.0.0/16"}], "services": ["pg"]}]})
    };
    for n in 0..max {
        assert_eq!(
            write("POST", "/api/v1/staged-rulesets", &editor.token, &many(n)).await.status,
            201,
            "{n}"
        );
    }
    let before = written(&pool).await;
    let doc = write("POST", "/api/v1/staged-rulesets", &editor.token, &many(max))
        .await
        .problem(409, ProblemType::LimitReached);
    assert!(doc["detail"].as_str().unwrap().contains("MAX_STAGED"), "{doc}");
    assert_eq!(written(&pool).await, before);
    for n in 0..max {
        let path = format!("/api/v1/staged-rulesets/extra-{n}");
        assert_eq!(plane.write("DELETE", &path, &editor.token, None, &json!(null)).await.status, 200);
    }

    // A new ruleset that selects no workload yet changes no rule in force: promoting it needs no
    // evidence (there is none to judge), only the count.
    let future = json!({"name": "future", "scope": {"app": ["none"]},
                        "rules": [{"name": "clients", "peers": [{"cidr": "10.1.0.0/16"}], "services": ["pg"]}]});
    assert_eq!(write("POST", "/api/v1/staged-rulesets", &editor.token, &future).await.status, 201);
    let listed = plane.get("/api/v1/staged-rulesets/future", Some(&viewer.token)).await.json();
    assert_eq!((&listed["base_version"], &listed["workloads"]), (&Value::Null, &json!([])), "{listed}");
    let reply = write("POST", "/api/v1/staged-rulesets/future/promote", &promoter.token, &ask(0, None)).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["result"]["version"], 1);
    let created = plane.get("/api/v1/rulesets/future", Some(&viewer.token)).await.json();
    assert_eq!(created["rules"][0]["name"], "clients", "{created}");
    plane.stop().await;
}

#[tokio::test]
async fn rollback_and_unpin_over_the_api() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let promoter = mint(&pool, "pat", Role::Promoter).await;
    let db = register(&pool, "db-1", &["app=db"]).await;
    register(&pool, "web-1", &["app=web"]).await;
    let admit = async |name: &str, from: &str| {
        innerwall_control_plane::testing::admit(&pool, name, ("app", "db"), ("app", from), "tcp:5432")
            .await
            .unwrap();
    };
    let latest = async || -> u64 {
        let policy = plane.get(&format!("/api/v1/workloads/{db}/policy"), Some(&editor.token)).await.json();
        policy["version"].as_u64().unwrap()
    };
    let rules = async || -> Vec<String> {
        let policy = plane.get(&format!("/api/v1/workloads/{db}/policy"), Some(&editor.token)).await.json();
        policy["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["rule_id"].as_str().unwrap().to_owned())
            .collect()
    };
    admit("db-from-web", "web").await;
    let one = latest().await;
    let one_rules = rules().await;
    admit("db-from-ops", "ops").await;
    let two = latest().await;
    assert!(two > one);

    let path = "/api/v1/rollbacks";
    let body = |count: usize, to: Option<u64>| json!({"ids": [db.to_string()], "expect_count": count, "to_version": to});
    let before = written(&pool).await;
    plane
        .write("POST", path, &editor.token, None, &body(1, Some(one)))
        .await
        .problem(403, ProblemType::Forbidden);
    plane
        .write("POST", path, &promoter.token, None, &body(2, Some(one)))
        .await
        .problem(409, ProblemType::MatchCountMismatch);
    let doc = plane
        .write("POST", path, &promoter.token, None, &body(1, None))
        .await
        .problem(400, ProblemType::Invalid);
    assert!(doc["detail"].as_str().unwrap().contains("--to-version"), "{doc}");
    plane
        .write("POST", path, &promoter.token, None, &body(1, Some(two)))
        .await
        .problem(400, ProblemType::Invalid);
    plane
        .write(
            "POST",
            path,
            &promoter.token,
            None,
            &json!({"ids": [db.to_string()], "expect_count": 1, "x": 1}),
        )
        .await
        .problem(400, ProblemType::Invalid);
    assert_eq!(written(&pool).await, before);
    assert_eq!(latest().await, two);

    let reply = plane.write("POST", path, &promoter.token, None, &body(1, Some(one))).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let answer = reply.json();
    assert_eq!(answer["result"][0]["source_of"], one, "{answer}");
    assert_eq!(answer["result"][0]["from_version"], two, "{answer}");
    let three = answer["result"][0]["version"].as_u64().unwrap();
    assert_eq!((latest().await, rules().await), (three, one_rules.clone()));
    // Pinned: a ruleset change does not reach it; unpinned, it does.
    admit("db-from-mail", "mail").await;
    assert_eq!(latest().await, three);
    let unpin = format!("/api/v1/workloads/{db}/unpin");
    plane
        .call("POST", &unpin, Some(&editor.token), &[], full(Bytes::new()))
        .await
        .problem(403, ProblemType::Forbidden);
    let reply = plane.call("POST", &unpin, Some(&promoter.token), &[], full(Bytes::new())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(rules().await.len(), one_rules.len() + 2, "db-from-ops and db-from-mail");
    plane
        .call("POST", &unpin, Some(&promoter.token), &[], full(Bytes::new()))
        .await
        .problem(400, ProblemType::Invalid);
    let actor = format!("operator:pat/{}", promoter.id);
    assert_eq!(audited(&pool, "workload.unpin").await, [(actor.clone(), db.to_string())]);
    assert_eq!(audited(&pool, "workload.rollback").await.len(), 1);
    plane.stop().await;
}

/// A path of the document with its parameters filled in.
fn concrete(path: &str) -> String {
    path.replace("{id}", "00000000-0000-4000-8000-000000000001")
        .replace("{name}", "x")
        .replace("{address}", "198.51.100.0")
        .replace("{prefix}", "24")
}

/// Every route the API may serve with the role it needs, written out by hand: a route mounted
/// without an entry here, or with another role, fails `openapi_covers_mounted_routes`.
const EXPECTED_ROUTES: &[(&str, &str, Option<&str>)] = &[
    ("GET", "/api/v1/address-groups", Some("viewer")),
    ("POST", "/api/v1/address-groups", Some("editor")),
    ("DELETE", "/api/v1/address-groups/{name}", Some("editor")),
    ("GET", "/api/v1/address-groups/{name}", Some("viewer")),
    ("PUT", "/api/v1/address-groups/{name}", Some("editor")),
    ("GET", "/api/v1/drafts", Some("viewer")),
    ("POST", "/api/v1/drafts", Some("editor")),
    ("DELETE", "/api/v1/drafts/{name}", Some("editor")),
    ("GET", "/api/v1/drafts/{name}", Some("viewer")),
    ("POST", "/api/v1/drafts/{name}/changes", Some("editor")),
    ("POST", "/api/v1/drafts/{name}/commit", Some("editor")),
    ("POST", "/api/v1/drafts/{name}/impact", Some("viewer")),
    ("GET", "/api/v1/drafts/{name}/render", Some("viewer")),
    ("POST", "/api/v1/drafts/{name}/tests", Some("viewer")),
    ("GET", "/api/v1/estate-ranges", Some("viewer")),
    ("POST", "/api/v1/estate-ranges", Some("admin")),
    ("DELETE", "/api/v1/estate-ranges/{address}/{prefix}", Some("admin")),
    ("POST", "/api/v1/rollbacks", Some("promoter")),
    ("POST", "/api/v1/workloads/{id}/unpin", Some("promoter")),
    ("GET", "/api/v1/management", Some("viewer")),
    ("PUT", "/api/v1/management", Some("admin")),
    ("PUT", "/api/v1/workloads/{id}/management", Some("admin")),
    ("GET", "/api/v1/audit", Some("viewer")),
    ("GET", "/api/v1/flows", Some("viewer")),
    ("GET", "/api/v1/flows/gaps", Some("viewer")),
    ("GET", "/api/v1/flows/rollup", Some("viewer")),
    ("GET", "/api/v1/openapi.json", None),
    ("GET", "/api/v1/operator-tokens", Some("admin")),
    ("POST", "/api/v1/operator-tokens", Some("admin")),
    ("DELETE", "/api/v1/operator-tokens/{id}", Some("admin")),
    ("GET", "/api/v1/promotions", Some("viewer")),
    ("POST", "/api/v1/promotions", Some("promoter")),
    ("GET", "/api/v1/promotions/{id}", Some("viewer")),
    ("POST", "/api/v1/promotions/{id}/confirm", Some("promoter")),
    ("GET", "/api/v1/provisioning-tokens", Some("viewer")),
    ("POST", "/api/v1/provisioning-tokens", Some("editor")),
    ("DELETE", "/api/v1/provisioning-tokens/{id}", Some("editor")),
    ("POST", "/api/v1/render", Some("editor")),
    ("GET", "/api/v1/rulesets", Some("viewer")),
    ("POST", "/api/v1/rulesets", Some("editor")),
    ("DELETE", "/api/v1/rulesets/{name}", Some("editor")),
    ("GET", "/api/v1/rulesets/{name}", Some("viewer")),
    ("PUT", "/api/v1/rulesets/{name}", Some("editor")),
    ("GET", "/api/v1/staged-rulesets", Some("viewer")),
    ("POST", "/api/v1/staged-rulesets", Some("editor")),
    ("DELETE", "/api/v1/staged-rulesets/{name}", Some("editor")),
    ("GET", "/api/v1/staged-rulesets/{name}", Some("viewer")),
    ("POST", "/api/v1/staged-rulesets/{name}/promote", Some("promoter")),
    ("GET", "/api/v1/policy-test-sets", Some("viewer")),
    ("POST", "/api/v1/policy-test-sets", Some("editor")),
    ("DELETE", "/api/v1/policy-test-sets/{name}", Some("editor")),
    ("GET", "/api/v1/policy-test-sets/{name}", Some("viewer")),
    ("PUT", "/api/v1/policy-test-sets/{name}", Some("editor")),
    ("POST", "/api/v1/policy-tests/run", Some("viewer")),
    ("GET", "/api/v1/services", Some("viewer")),
    ("POST", "/api/v1/services", Some("editor")),
    ("DELETE", "/api/v1/services/{name}", Some("editor")),
    ("GET", "/api/v1/services/{name}", Some("viewer")),
    ("PUT", "/api/v1/services/{name}", Some("editor")),
    ("GET", "/api/v1/suggestions", Some("viewer")),
    ("POST", "/api/v1/suggestions/accept", Some("editor")),
    ("POST", "/api/v1/suggestions/ignore", Some("editor")),
    ("GET", "/api/v1/sync-status", Some("viewer")),
    ("GET", "/api/v1/sync-status/{id}", Some("viewer")),
    ("GET", "/api/v1/verdict", Some("viewer")),
    ("GET", "/api/v1/workloads", Some("viewer")),
    ("GET", "/api/v1/workloads/{id}", Some("viewer")),
    ("POST", "/api/v1/workloads/{id}/deny", Some("admin")),
    ("GET", "/api/v1/workloads/{id}/labels", Some("viewer")),
    ("PUT", "/api/v1/workloads/{id}/labels", Some("editor")),
    ("GET", "/api/v1/workloads/{id}/policy", Some("viewer")),
    ("GET", "/api/v1/workloads/{id}/policy/history", Some("viewer")),
    ("GET", "/api/v1/workloads/{id}/policy/history/{version}", Some("viewer")),
    ("POST", "/api/v1/workloads/{id}/release-address", Some("editor")),
    ("GET", "/api/v1/workloads/{id}/replay", Some("viewer")),
    ("POST", "/api/v1/workloads/{id}/resend-snapshot", Some("editor")),
    ("POST", "/api/v1/workloads/{id}/retire", Some("admin")),
];

#[tokio::test]
async fn openapi_covers_mounted_routes() {
    // Every route is called without a token below: more than a minute's worth of the default
    // bound on unauthenticated requests from one address.
    let plane = Plane::start(ApiLimits { unauthenticated_per_minute: 600, ..ApiLimits::default() }).await;
    let (_, routes) = router::build(ApiState::new(plane.pool().clone(), ApiLimits::default()));
    let doc = openapi::document(&routes);

    // The document lists exactly the routes the router mounted, with their methods.
    let mounted: BTreeSet<(String, &str)> = routes.iter().map(|r| (r.path.to_owned(), r.method)).collect();
    let documented: BTreeSet<(String, &str)> = openapi::operations(&doc).into_iter().collect();
    assert_eq!(mounted.len(), routes.len(), "a route is mounted twice");
    let undocumented: Vec<_> = mounted.difference(&documented).collect();
    let unmounted: Vec<_> = documented.difference(&mounted).collect();
    assert!(
        undocumented.is_empty() && unmounted.is_empty(),
        "mounted, not documented: {undocumented:?}; documented, not mounted: {unmounted:?}"
    );

    // The mounted routes and their roles are exactly the hand-written list.
    let expected: BTreeSet<(String, String, Option<String>)> = EXPECTED_ROUTES
        .iter()
        .map(|(m, p, r)| ((*m).to_owned(), (*p).to_owned(), r.map(str::to_owned)))
        .collect();
    assert_eq!(expected.len(), EXPECTED_ROUTES.len(), "a route is listed twice");
    let actual: BTreeSet<(String, String, Option<String>)> = routes
        .iter()
        .map(|r| (r.method.to_owned(), r.path.to_owned(), r.role.map(|role| role.name().to_owned())))
        .collect();
    let unlisted: Vec<_> = actual.difference(&expected).collect();
    let missing: Vec<_> = expected.difference(&actual).collect();
    assert!(
        unlisted.is_empty() && missing.is_empty(),
        "mounted, not listed (or with another role): {unlisted:?}; listed, not mounted: {missing:?}"
    );

    // Each operation's security is the role it is mounted with.
    let value = serde_json::to_value(&doc).unwrap();
    for route in &routes {
        let op = &value["paths"][route.path][route.method.to_lowercase()];
        let expected = match route.role {
            Some(role) => json!([{ openapi::SECURITY_SCHEME: [role.name()] }]),
            None => json!([{}]),
        };
        assert_eq!(op["security"], expected, "{} {}", route.method, route.path);
    }

    // And the running listener serves them: without a token every route but the document
    // answers 401 (so it exists and is guarded), and a method the document does not list
    // answers 405 naming exactly the documented ones.
    let viewer = mint(plane.pool(), "vera", Role::Viewer).await;
    let mut by_path: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for route in &routes {
        by_path.entry(route.path).or_default().insert(route.method);
        let reply = plane.call(route.method, &concrete(route.path), None, &[], full(Bytes::new())).await;
        match route.role {
            Some(_) => {
                reply.problem(401, ProblemType::Unauthorized);
            }
            None => assert_eq!(reply.status, 200, "{} {}: {reply:?}", route.method, route.path),
        }
    }
    // The role is enforced, not only declared: a token one role short is refused (403, naming
    // the role), and a token of the listed role gets past the check.
    let ladder = [Role::Viewer, Role::Editor, Role::Promoter, Role::Admin];
    let mut tokens = BTreeMap::new();
    for role in ladder {
        tokens.insert(role.name(), mint(plane.pool(), &format!("ladder-{}", role.name()), role).await.token);
    }
    for (method, path, role) in EXPECTED_ROUTES {
        let Some(role) = role else { continue };
        let rank = ladder.iter().position(|r| r.name() == *role).unwrap();
        if let Some(below) = rank.checked_sub(1).map(|i| ladder[i]) {
            let reply = plane
                .call(method, &concrete(path), Some(&tokens[below.name()]), &[], full(Bytes::new()))
                .await;
            let doc = reply.problem(403, ProblemType::Forbidden);
            assert_eq!(doc["required_role"], *role, "{method} {path}: {doc}");
        }
        let reply = plane.call(method, &concrete(path), Some(&tokens[*role]), &[], full(Bytes::new())).await;
        assert!(![401, 403].contains(&reply.status), "{method} {path} as {role}: {reply:?}");
    }

    for (path, methods) in by_path {
        let reply = plane.call("PATCH", &concrete(path), Some(&viewer.token), &[], full(Bytes::new())).await;
        reply.problem(405, ProblemType::MethodNotAllowed);
        let mut allowed: BTreeSet<&str> = reply.header("allow").split(',').collect();
        if methods.contains("GET") {
            assert!(allowed.remove("HEAD"), "GET answers HEAD too: {path}");
        }
        assert_eq!(allowed, methods, "{path}");
    }

    // The served document is the generated one.
    let served = plane.get(openapi::PATH, None).await;
    assert_eq!(served.header("content-type"), "application/json");
    assert_eq!(String::from_utf8(served.body).unwrap(), openapi::json(&routes));
    plane.stop().await;
}

#[tokio::test]
async fn problem_types_are_closed() {
    // One of every library error and every refusal at the edge. The matches below have no
    // wildcard, so a new variant does not compile until it has a sample here.
    fn library_variant(e: &Error) -> &'static str {
        match e {
            Error::NotFound { .. } => "not found",
            Error::Exists { .. } => "exists",
            Error::Stale { .. } => "stale",
            Error::DraftBaseMoved { .. } => "draft base moved",
            Error::InUse { .. } => "in use",
            Error::Invalid(_) => "invalid",
            Error::InvalidInput(_) => "invalid input",
            Error::Refused(_) => "refused",
            Error::Token { .. } => "token",
            Error::Busy(_) => "busy",
            Error::CountMismatch { .. } => "count mismatch",
            Error::EvidenceInsufficient { .. } => "evidence insufficient",
            Error::AgentOffline { .. } => "agent offline",
            Error::OverBound { .. } => "over bound",
            Error::RateLimited { .. } => "rate limited",
            Error::PolicyTestsFailed(_) => "policy tests failed",
            Error::Render(_) => "render",
            Error::Corrupt { .. } => "corrupt",
            Error::Database(_) => "database",
        }
    }
    fn edge_variant(e: &ApiError) -> &'static str {
        match e {
            ApiError::Domain(_) => "domain",
            ApiError::NoToken(_) => "no token",
            ApiError::Refused(_) => "refused",
            ApiError::Forbidden { .. } => "forbidden",
            ApiError::PreconditionRequired(_) => "precondition required",
            ApiError::PayloadTooLarge { .. } => "payload too large",
            ApiError::UnsupportedMediaType(_) => "unsupported media type",
            ApiError::Malformed(_) => "malformed",
            ApiError::NoRoute(_) => "no route",
            ApiError::MethodNotAllowed { .. } => "method not allowed",
            ApiError::Timeout(_) => "timeout",
            ApiError::RateLimited { .. } => "rate limited",
        }
    }
    let library = vec![
        (Error::NotFound { what: "service", name: "web".into() }, ProblemType::NotFound),
        (Error::Exists { what: "service", name: "web".into() }, ProblemType::DuplicateName),
        (
            Error::Stale { what: "service", name: "web".into(), expected: 1, current: 2 },
            ProblemType::PreconditionFailed,
        ),
        (
            Error::DraftBaseMoved {
                draft: "d".into(),
                moved: vec!["ruleset/r: version 1 when added, version 2 now".into()],
            },
            ProblemType::PreconditionFailed,
        ),
        (
            Error::InUse { what: "service", name: "web".into(), referrers: vec!["ruleset a rule r".into()] },
            ProblemType::InUse,
        ),
        (Error::Invalid("bad".into()), ProblemType::Invalid),
        (Error::InvalidInput("bad".into()), ProblemType::Invalid),
        (Error::Refused("no".into()), ProblemType::Forbidden),
        (Error::Token { kind: "revoked", error: "revoked".into() }, ProblemType::Unauthorized),
        (Error::Busy("the render lock".into()), ProblemType::Busy),
        (
            Error::CountMismatch { expected: 2, matched: 1, names: vec!["a".into()] },
            ProblemType::MatchCountMismatch,
        ),
        (
            Error::EvidenceInsufficient { outcome: "UNSAFE", reasons: "x".into() },
            ProblemType::EvidenceInsufficient,
        ),
        (Error::AgentOffline { id: "w".into(), last_seen: "never".into() }, ProblemType::AgentOffline),
        (
            innerwall_control_plane::counts::over(innerwall_control_plane::counts::Counted::Services, 3),
            ProblemType::LimitReached,
        ),
        (
            Error::RateLimited {
                what: "renders",
                who: "everyone".into(),
                per_minute: 30,
                bound: "--api-expensive-overall-per-minute",
                retry_after_secs: 2,
            },
            ProblemType::RateLimited,
        ),
        (
            Error::PolicyTestsFailed(vec![innerwall_control_plane::error::PolicyTestFailure {
                set: "s".into(),
                test: "t".into(),
                assertion: "allow".into(),
                reason: "rule a/b needs app=web, the source has app=api".into(),
                pairs: vec![],
                pair_count: 1,
            }]),
            ProblemType::PolicyTestsFailed,
        ),
        (Error::Render("broke".into()), ProblemType::Internal),
        (Error::Corrupt { what: "mode", detail: "9".into() }, ProblemType::Internal),
        (Error::Database(sqlx::Error::PoolTimedOut), ProblemType::Busy),
        (Error::Database(sqlx::Error::RowNotFound), ProblemType::Internal),
    ];
    let edge = vec![
        (ApiError::NoToken("none"), ProblemType::Unauthorized),
        (ApiError::Refused(Refused::Malformed), ProblemType::Unauthorized),
        (ApiError::Refused(Refused::NotValid), ProblemType::Unauthorized),
        (
            ApiError::Refused(Refused::Expired { id: "x".into(), at: chrono::Utc::now() }),
            ProblemType::Unauthorized,
        ),
        (
            ApiError::Refused(Refused::Revoked { id: "x".into(), at: chrono::Utc::now() }),
            ProblemType::Unauthorized,
        ),
        (
            ApiError::Refused(Refused::Unavailable(Error::Database(sqlx::Error::PoolTimedOut))),
            ProblemType::Busy,
        ),
        (
            ApiError::Forbidden { needed: Role::Admin, has: Role::Viewer, token: "x".into() },
            ProblemType::Forbidden,
        ),
        (ApiError::PreconditionRequired("x".into()), ProblemType::PreconditionRequired),
        (ApiError::PayloadTooLarge { limit: 1 }, ProblemType::PayloadTooLarge),
        (ApiError::UnsupportedMediaType("text/plain".into()), ProblemType::UnsupportedMediaType),
        (ApiError::Malformed("x".into()), ProblemType::Invalid),
        (ApiError::NoRoute("/x".into()), ProblemType::NotFound),
        (
            ApiError::MethodNotAllowed { method: "PATCH".into(), path: "/x".into() },
            ProblemType::MethodNotAllowed,
        ),
        (ApiError::Timeout(Duration::from_secs(1)), ProblemType::Busy),
        (
            ApiError::RateLimited {
                detail: "x".into(),
                bound: "--api-requests-per-minute",
                retry_after: Duration::from_millis(1_500),
            },
            ProblemType::RateLimited,
        ),
    ];
    let library_variants: BTreeSet<&str> = library.iter().map(|(e, _)| library_variant(e)).collect();
    assert_eq!(library_variants.len(), 19, "a sample of every library error");
    let edge_variants: BTreeSet<&str> = edge.iter().map(|(e, _)| edge_variant(e)).collect();
    assert_eq!(
        edge_variants.len() + 1,
        12,
        "a sample of every refusal at the edge (Domain is the library's)"
    );

    let mut produced = BTreeSet::new();
    let errors = library.into_iter().map(|(e, t)| (ApiError::Domain(e), t)).chain(edge);
    for (error, expected) in errors {
        let problem = error.problem();
        assert_eq!(problem.kind, expected, "{error:?}");
        assert_eq!(problem.status, expected.status().as_u16(), "{error:?}");
        let json = serde_json::to_value(&problem).unwrap();
        assert_eq!(json["type"], expected.urn());
        produced.insert(expected);
    }
    // Members the CLI's errors carry reach the document.
    let stale =
        ApiError::Domain(Error::Stale { what: "s", name: "w".into(), expected: 1, current: 7 }).problem();
    assert_eq!(stale.current_version, Some(7));
    let mismatch =
        ApiError::Domain(Error::CountMismatch { expected: 2, matched: 1, names: vec!["a".into()] }).problem();
    assert_eq!(
        (mismatch.expected, mismatch.matched, mismatch.names),
        (Some(2), Some(1), Some(vec!["a".to_owned()]))
    );
    let in_use =
        ApiError::Domain(Error::InUse { what: "s", name: "w".into(), referrers: vec!["r".into()] }).problem();
    assert_eq!(in_use.referrers, Some(vec!["r".to_owned()]));

    // Every type is produced by something, and the document lists exactly the closed set.
    let all: BTreeSet<ProblemType> = ProblemType::ALL.into_iter().collect();
    assert_eq!(produced, all, "a documented type nothing produces, or one produced and not documented");
    let pool =
        sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://unused@localhost/unused").unwrap();
    let (_, routes) = router::build(ApiState::new(pool, ApiLimits::default()));
    let doc = serde_json::to_value(openapi::document(&routes)).unwrap();
    let listed: BTreeSet<String> = doc["components"]["schemas"]["ProblemType"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let urns: BTreeSet<String> = ProblemType::ALL.iter().map(|t| t.urn()).collect();
    assert_eq!(listed, urns);
    assert_eq!(
        doc["components"]["schemas"]["Problem"]["properties"]["type"]["$ref"],
        "#/components/schemas/ProblemType"
    );
    let _ = api::DEFAULT_MAX_BODY;
}

/// `serve --api-cert/--api-key`: the operator's own certificate, from a CA of their own, is what
/// clients see (its fingerprint logged) and trust; a client trusting only the control plane's CA
/// refuses it; a key that is not the certificate's, or a file that is missing, refuses the start
/// naming the file.
#[tokio::test]
async fn api_serves_an_operator_certificate() {
    let db = fresh_database().await.unwrap();
    let dir = std::env::temp_dir().join(format!("iw-api-{}", uuid::Uuid::new_v4()));
    let signer = Arc::new(FileCa::init(&dir.join("ca")).unwrap());
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    let (cert, key, other) = (dir.join("api.crt"), dir.join("api.key"), dir.join("other.key"));
    std::fs::write(&cert, leaf.pem()).unwrap();
    std::fs::write(&key, leaf_key.serialize_pem()).unwrap();
    std::fs::write(&other, rcgen::KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let config = |cert: &std::path::Path, key: &std::path::Path| ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: ApiTls::Files { cert: cert.to_owned(), key: key.to_owned() },
        limits: ApiLimits::default(),
    };

    let server = api::start(db.pool.clone(), signer.clone(), config(&cert, &key)).await.unwrap();
    assert_eq!(server.fingerprint, innerwall_control_plane::identity::server_cert::fingerprint(leaf.der()));
    let addr = server.local_addr;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let refused =
        connector(&signer.ca_bundle_pem()).connect(ServerName::try_from("localhost").unwrap(), tcp).await;
    assert!(refused.is_err(), "the control plane's CA did not issue the operator's certificate");
    let plane = Plane { db, dir: dir.clone(), running: None, addr, tls: connector(&ca_cert.pem()) };
    let viewer = mint(plane.pool(), "viewer", Role::Viewer).await;
    let reply = plane.get("/api/v1/services", Some(&viewer.token)).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["rows"], json!([]));

    // A reload (SIGHUP) reads the files again: a renewed certificate is presented to the next
    // connection; files that do not match keep the one presented.
    let presented = || async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tls =
            connector(&ca_cert.pem()).connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let der = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
        innerwall_control_plane::identity::server_cert::fingerprint(&der)
    };
    let renewed_key = rcgen::KeyPair::generate().unwrap();
    let renewed = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&renewed_key, &issuer)
        .unwrap();
    let renewed_fingerprint = innerwall_control_plane::identity::server_cert::fingerprint(renewed.der());
    std::fs::write(&cert, renewed.pem()).unwrap();
    std::fs::write(&key, renewed_key.serialize_pem()).unwrap();
    let reloaded = server.reload(server.rates());
    assert_eq!(reloaded.certificate, Ok(Some(renewed_fingerprint.clone())));
    assert!(!reloaded.rates, "the same bounds are no change");
    assert_eq!(presented().await, renewed_fingerprint);
    std::fs::write(&key, std::fs::read(&other).unwrap()).unwrap();
    let refused = server.reload(server.rates()).certificate.unwrap_err();
    assert!(refused.contains(&key.display().to_string()), "{refused}");
    assert_eq!(presented().await, renewed_fingerprint, "a key that does not match changes nothing");
    server.stop(Duration::from_secs(1)).await;
    std::fs::write(&key, renewed_key.serialize_pem()).unwrap();

    for (cert, key, named) in [(&cert, &other, &other), (&dir.join("nope.crt"), &key, &dir.join("nope.crt"))]
    {
        let error = api::start(plane.pool().clone(), signer.clone(), config(cert, key)).await.unwrap_err();
        let shown = error.to_string();
        assert!(shown.contains(&named.display().to_string()), "{shown}");
    }
    plane.stop().await;
}

/// `serve --max-services` reaches the API: one service more than the bound is a 409
/// limit-reached problem naming the flag and its value, and writes nothing; after a delete the
/// same request passes.
#[tokio::test]
async fn count_bounds_are_refused_at_the_api() {
    let counts = innerwall_control_plane::counts::CountBounds {
        services: 1,
        ..innerwall_control_plane::counts::CountBounds::default()
    };
    let plane = Plane::start(ApiLimits { counts, ..ApiLimits::default() }).await;
    let pool = plane.pool().clone();
    let editor = mint(&pool, "ed", Role::Editor).await;
    let service = |name: &str| json!({"name": name, "entries": ["tcp:443"]});
    let reply = plane.write("POST", "/api/v1/services", &editor.token, None, &service("https")).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let before = written(&pool).await;
    let reply = plane.write("POST", "/api/v1/services", &editor.token, None, &service("ssh")).await;
    let doc = reply.problem(409, ProblemType::LimitReached);
    assert_eq!((doc["bound"].as_str(), doc["limit"].as_u64()), (Some("--max-services"), Some(1)), "{doc}");
    assert_eq!(written(&pool).await, before, "a refused create writes nothing");
    let reply =
        plane.write("DELETE", "/api/v1/services/https", &editor.token, Some("\"1\""), &json!({})).await;
    assert!(reply.status < 300, "{reply:?}");
    let reply = plane.write("POST", "/api/v1/services", &editor.token, None, &service("ssh")).await;
    assert_eq!(reply.status, 201, "the second attempt, after a delete: {reply:?}");
    plane.stop().await;
}

/// Counts of every table a refused CIDR could have written to, and the audit log.
async fn cidr_rows(pool: &PgPool) -> [i64; 5] {
    let mut counts = [0; 5];
    for (i, table) in ["address_groups", "address_group_cidrs", "rulesets", "estate_ranges", "audit_log"]
        .into_iter()
        .enumerate()
    {
        counts[i] = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(pool)
            .await
            .unwrap();
    }
    counts
}

/// CIDRs mean what they say (issue 26 item 9): one rule at every site. A CIDR with host bits
/// set or in a non-canonical spelling is refused naming the canonical form, by the CLI (address
/// group, ruleset file, estate range) and the API (the same three), writing nothing; the
/// canonical forms are taken, and values stored before the rule still load and render.
// Several threads: the test blocks in CLI calls while the replica it started runs its tasks
// (on one thread, a task in the middle of a transaction would hold its locks until the call ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cidrs_mean_what_they_say() {
    let plane = Plane::start(ApiLimits::default()).await;
    let pool = plane.pool().clone();
    let admin = mint(&pool, "ada", Role::Admin).await;
    let url = plane.db.url.clone();
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .args(["--database-url", &url])
            .args(args)
            .output()
            .unwrap()
    };
    let created = cli(&["service", "create", "web", "--entry", "tcp:80"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let dir = plane.dir.join("cidr-files");
    std::fs::create_dir_all(&dir).unwrap();
    let ruleset = |cidr: &str| {
        json!({"name": "db", "scope": {"app": ["db"]},
               "rules": [{"name": "r", "peers": [{"cidr": cidr}], "services": ["web"]}]})
    };
    // (what was written, the canonical form the refusal must name)
    let cases = [
        ("10.0.0.1/8", "write 10.0.0.0/8 (the network), or 10.0.0.1/32 for the one address"),
        ("010.0.0.0/8", "write 10.0.0.0/8"),
        ("10.0.0.0/08", "write 10.0.0.0/8"),
        ("10.0.0.7", "write 10.0.0.7/32"),
        ("2001:DB8::/32", "write 2001:db8::/32"),
        ("2001:0db8:0:0::/32", "write 2001:db8::/32"),
        ("2001:db8::1/32", "write 2001:db8::/32 (the network), or 2001:db8::1/128 for the one address"),
    ];
    let before = cidr_rows(&pool).await;
    for round in 0..2 {
        for (text, canonical) in cases {
            let file = dir.join(format!("rs-{round}.yaml"));
            std::fs::write(&file, serde_norway::to_string(&ruleset(text)).unwrap()).unwrap();
            let file = file.to_string_lossy().into_owned();
            for args in [
                vec!["address-group", "create", "vpn", "--cidr", "10.9.0.0/16", "--cidr", text],
                vec!["ruleset", "create", "-f", &file],
                vec!["estate-range", "add", text],
            ] {
                let out = cli(&args);
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(!out.status.success(), "{args:?} was taken");
                assert!(err.contains(&format!("{text:?}")) && err.contains(canonical), "{args:?}: {err}");
            }
            let group = json!({"name": "vpn", "cidrs": ["10.9.0.0/16", text]});
            for (path, body) in [
                ("/api/v1/address-groups", group),
                ("/api/v1/rulesets", ruleset(text)),
                ("/api/v1/estate-ranges", json!({"cidr": text})),
            ] {
                let doc = plane
                    .write("POST", path, &admin.token, None, &body)
                    .await
                    .problem(400, ProblemType::Invalid);
                let detail = doc["detail"].as_str().unwrap();
                assert!(detail.contains(canonical), "{path} {text}: {doc}");
            }
        }
        assert_eq!(cidr_rows(&pool).await, before, "a refused cidr wrote something (round {round})");
    }

    // The canonical forms are taken, as written, at every site.
    let ok = cli(&["address-group", "create", "vpn", "--cidr", "10.0.0.0/8", "--cidr", "2001:db8::/32"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let file = dir.join("ok.yaml");
    std::fs::write(&file, serde_norway::to_string(&ruleset("10.0.0.7/32")).unwrap()).unwrap();
    let ok = cli(&["ruleset", "create", "-f", &file.to_string_lossy()]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let ok = cli(&["estate-range", "add", "203.0.113.0/24"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let group = json!({"name": "lab", "cidrs": ["192.0.2.0/24"]});
    assert_eq!(plane.write("POST", "/api/v1/address-groups", &admin.token, None, &group).await.status, 201);
    let ranges = json!({"cidr": "2001:db8:1::/48"});
    assert_eq!(plane.write("POST", "/api/v1/estate-ranges", &admin.token, None, &ranges).await.status, 201);
    let members: Vec<String> = sqlx::query_scalar("SELECT cidr::text FROM address_group_cidrs ORDER BY cidr")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(members, ["10.0.0.0/8", "192.0.2.0/24", "2001:db8::/32"]);
    let peers: Vec<String> =
        sqlx::query_scalar("SELECT cidr::text FROM rule_peers").fetch_all(&pool).await.unwrap();
    assert_eq!(peers, ["10.0.0.7/32"]);

    // Values stored before the rule (written straight to the tables, in spellings the parse
    // now refuses) still load: the estate lists, the group shows, and a render succeeds.
    sqlx::query(
        "INSERT INTO estate_ranges (cidr, description) VALUES ('2001:0DB8:0002:0000::/64'::cidr, 'old')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO address_group_cidrs (group_id, cidr)
         SELECT id, '10.1.2.3'::cidr FROM address_groups WHERE name = 'vpn'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listed = cli(&["--json", "estate-range", "list"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    assert!(String::from_utf8_lossy(&listed.stdout).contains("2001:db8:2::/64"), "{listed:?}");
    let shown = cli(&["--json", "address-group", "show", "vpn"]);
    assert!(shown.status.success(), "{}", String::from_utf8_lossy(&shown.stderr));
    assert!(String::from_utf8_lossy(&shown.stdout).contains("10.1.2.3/32"), "{shown:?}");
    let render = plane.call("POST", "/api/v1/render", Some(&admin.token), &[], full(Bytes::new())).await;
    assert_eq!(render.status, 200, "{render:?}");
    plane.stop().await;
}

/// Counts the ERROR events emitted on this thread (the test's current-thread runtime runs the
/// replica's tasks too), keeping their messages.
#[derive(Clone, Default)]
struct Errors(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                    self.0.push_str(&format!("{}={value:?} ", field.name()));
                }
            }
            let mut m = Message(format!("{}: ", event.metadata().target()));
            event.record(&mut m);
            self.0.lock().unwrap().push(m.0);
        }
    }
}

/// A value as a query or path would carry it, percent-encoded.
fn encoded(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test]
async fn parameters_never_panic() {
    let errors = Errors::default();
    let _capture = tracing::subscriber::set_default(tracing_subscriber::layer::SubscriberExt::with(
        tracing_subscriber::registry(),
        errors.clone(),
    ));
    // The capture sees what the replica's tasks log (a positive control for the end).
    tokio::spawn(async { tracing::error!(target: "probe", "probe") }).await.unwrap();
    assert_eq!(errors.0.lock().unwrap().drain(..).count(), 1, "the capture sees spawned tasks");
    // Every route with every hostile parameter is more than a minute's worth of requests at the
    // default bound; this test is about parameters, not the request bound.
    let plane = Plane::start(ApiLimits { requests_per_minute: 100_000, ..ApiLimits::default() }).await;
    let admin = mint(plane.pool(), "parameters", Role::Admin).await.token;
    let workload = register(plane.pool(), "web-1", &["app=web"]).await.to_string();
    let json_header = [("content-type", "application/json"), ("if-match", "\"1\"")];
    // Objects the PUT routes change, so a refusal is the parameter's and not a missing object's.
    for (path, body) in [
        ("/api/v1/services", json!({"name": "svc", "description": "", "entries": ["tcp:80"]})),
        ("/api/v1/address-groups", json!({"name": "grp", "description": "", "cidrs": ["198.51.100.0/24"]})),
        ("/api/v1/rulesets", json!({"name": "rs", "scope": {"app": ["web"]}, "rules": []})),
    ] {
        let reply = plane.write("POST", path, &admin, None, &body).await;
        assert_eq!(reply.status, 201, "{path}: {reply:?}");
    }
    let (_, routes) = router::build(ApiState::new(plane.pool().clone(), ApiLimits::default()));
    let doc = serde_json::to_value(openapi::document(&routes)).unwrap();
    let huge = "a".repeat(10 * 1024);
    // Bad in every parameter: NUL, an escape sequence, a line break, DEL, 10 KB.
    let bad: Vec<&str> = vec!["a\0b", "\u{1b}[31mred", "a\nb", "\u{7f}", &huge];
    let good_path = |name: &str| match name {
        "id" => workload.clone(),
        "name" => "svc".to_owned(),
        "address" => "198.51.100.0".to_owned(),
        "prefix" => "24".to_owned(),
        other => panic!("a path parameter {other} this test does not know: give it a valid value"),
    };
    let fill = |path: &str, name: &str, value: &str| {
        let mut out = path.to_owned();
        for p in ["id", "name", "address", "prefix"] {
            let good = match p {
                "name" if path.contains("/rulesets/") => "rs".to_owned(),
                "name" if path.contains("/address-groups/") => "grp".to_owned(),
                "name" if path.contains("/policy-test-sets/") => "ts".to_owned(),
                p => good_path(p),
            };
            let v = if p == name { encoded(value) } else { encoded(&good) };
            out = out.replace(&format!("{{{p}}}"), &v);
        }
        out
    };
    // A query that is valid on its own, so a refusal is the bad parameter's.
    let base_query = |path: &str| -> Vec<(String, String)> {
        let pairs: &[(&str, &str)] = match path {
            "/api/v1/flows" => &[("workload", "")],
            "/api/v1/flows/rollup" => &[("by", "rule")],
            "/api/v1/verdict" => &[("ids", "")],
            "/api/v1/workloads/{id}/replay" => &[("from", "1"), ("to", "1")],
            "/api/v1/suggestions" => &[("scope", "app=web")],
            _ => &[],
        };
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), if v.is_empty() { workload.clone() } else { (*v).to_owned() }))
            .collect()
    };
    let query = |pairs: &[(String, String)]| {
        pairs.iter().map(|(k, v)| format!("{}={}", encoded(k), encoded(v))).collect::<Vec<_>>().join("&")
    };
    let mut checked = 0;
    for route in &routes {
        let op = &doc["paths"][route.path][route.method.to_lowercase()];
        let params = op["parameters"].as_array().cloned().unwrap_or_default();
        for param in &params {
            let name = param["name"].as_str().unwrap();
            let mut cases: Vec<(String, String)> =
                bad.iter().map(|v| ((*v).to_owned(), String::new())).collect();
            // Times are refused naming their range; other `from`/`to` (a replay's versions) are numbers.
            let time = param["schema"]["format"] == "date-time";
            match (param["in"].as_str().unwrap(), name) {
                // Workload ids are UUIDs (an operator token's `{id}` may also be its name).
                ("path", "id")
                    if route.path.contains("/workloads/") || route.path.contains("/sync-status/") =>
                {
                    cases.push(("not-a-uuid".into(), String::new()))
                }
                ("query", "cursor") => {
                    cases.push(("garbage".into(), String::new()));
                    cases.push(("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA".into(), String::new()));
                }
                ("query", "from") if time => {
                    for t in ["1600-01-01T00:00:00Z", "1969-12-31T23:59:59Z", "9999-12-31T23:59:59Z"] {
                        cases.push((t.into(), "1970-01-01T00:00:00Z".into()));
                    }
                }
                ("query", "to") if time => {
                    for t in ["1600-01-01T00:00:00Z", "9999-12-31T23:59:59Z"] {
                        cases.push((t.into(), "1970-01-01T00:00:00Z".into()));
                    }
                }
                _ => {}
            }
            for (value, must_name) in cases {
                let (path, target) = match param["in"].as_str().unwrap() {
                    "path" => (fill(route.path, name, &value), format!("path {name}")),
                    "query" => {
                        let mut pairs = base_query(route.path);
                        pairs.retain(|(k, _)| k != name);
                        if name == "to" && time {
                            pairs.push(("from".into(), "2026-01-01T00:00:00Z".into()));
                        }
                        if (name == "from" || name == "to") && time {
                            pairs.retain(|(k, _)| k != "since");
                        }
                        pairs.push((name.to_owned(), value.clone()));
                        (format!("{}?{}", fill(route.path, "", ""), query(&pairs)), format!("query {name}"))
                    }
                    _ => continue, // headers (If-Match) are read by their own checks
                };
                let reply = plane.call(route.method, &path, Some(&admin), &json_header, full("{}")).await;
                let shown: String = value.escape_debug().take(40).collect();
                assert_eq!(
                    reply.status,
                    400,
                    "{} {} {target}={shown}: {}",
                    route.method,
                    route.path,
                    String::from_utf8_lossy(&reply.body)
                );
                let doc = reply.problem(400, ProblemType::Invalid);
                if !must_name.is_empty() {
                    let detail = doc["detail"].as_str().unwrap();
                    assert!(
                        detail.contains(&must_name),
                        "{} {target}={shown}: the range is named: {detail}",
                        route.path
                    );
                }
                checked += 1;
            }
        }
        // Each query route answers its valid base query: the refusals above were the bad values'.
        if route.method == "GET" && params.iter().any(|p| p["in"] == "query") {
            let path = format!("{}?{}", fill(route.path, "", ""), query(&base_query(route.path)));
            let reply = plane.get(&path, Some(&admin)).await;
            assert_eq!(reply.status, 200, "{path}: {reply:?}");
        }
    }
    assert!(checked > 200, "only {checked} parameter cases were sent");

    // Free text in bodies: every string field named like free text, on every route whose body
    // has one, refused with 400 naming the field, nothing written. A new route with such a field
    // fails here until it has a valid body below.
    let valid_body = |method: &str, path: &str| -> Option<Value> {
        Some(match (method, path) {
            ("POST", "/api/v1/services") => json!({"name": "svc2", "description": "", "entries": ["tcp:80"]}),
            ("PUT", "/api/v1/services/{name}") => json!({"description": "", "entries": ["tcp:80"]}),
            ("POST", "/api/v1/address-groups") => {
                json!({"name": "grp2", "description": "", "cidrs": ["198.51.100.0/24"]})
            }
            ("PUT", "/api/v1/address-groups/{name}") => {
                json!({"description": "", "cidrs": ["198.51.100.0/24"]})
            }
            ("POST", "/api/v1/rulesets") => {
                json!({"name": "rs2", "description": "", "scope": {"app": ["web"]}, "rules": []})
            }
            ("PUT", "/api/v1/rulesets/{name}") => {
                json!({"name": "rs", "description": "", "scope": {"app": ["web"]}, "rules": []})
            }
            ("POST", "/api/v1/staged-rulesets") => {
                json!({"name": "rs", "description": "", "scope": {"app": ["db"]}, "rules": []})
            }
            ("POST", "/api/v1/staged-rulesets/{name}/promote") => {
                json!({"expect_count": 1, "override_reason": "r"})
            }
            ("POST", "/api/v1/policy-test-sets") => json!({"name": "ts2", "description": "", "tests": []}),
            ("POST", "/api/v1/drafts") => json!({"name": "d2", "note": ""}),
            ("PUT", "/api/v1/policy-test-sets/{name}") => {
                json!({"name": "ts", "description": "", "tests": []})
            }
            ("POST", "/api/v1/estate-ranges") => json!({"cidr": "203.0.113.0/24", "description": ""}),
            ("POST", "/api/v1/operator-tokens") => json!({"name": "t2", "role": "viewer"}),
            ("POST", "/api/v1/promotions") => {
                json!({"ids": [workload], "expect_count": 1, "to": "simulation", "reason": "r"})
            }
            ("POST", "/api/v1/promotions/{id}/confirm") => json!({"override_reason": "r"}),
            _ => return None,
        })
    };
    let before = written(plane.pool()).await;
    let free_text = ["description", "reason", "override_reason", "name", "note"];
    let mut bodies = 0;
    for route in &routes {
        let op = &doc["paths"][route.path][route.method.to_lowercase()];
        let Some(schema) = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str() else {
            continue;
        };
        let schema = &doc["components"]["schemas"][schema.rsplit('/').next().unwrap()];
        let fields: Vec<&str> = schema["properties"]
            .as_object()
            .map(|p| p.keys().map(String::as_str).filter(|k| free_text.contains(k)).collect())
            .unwrap_or_default();
        if fields.is_empty() {
            continue;
        }
        let body = valid_body(route.method, route.path).unwrap_or_else(|| {
            panic!("{} {} takes free text: give it a valid body here", route.method, route.path)
        });
        // A rule's description is free text too.
        let mut variants: Vec<(String, Value)> = Vec::new();
        for field in &fields {
            for value in &bad {
                let mut b = body.clone();
                b[*field] = json!(value);
                variants.push(((*field).to_owned(), b));
            }
        }
        if route.path.starts_with("/api/v1/rulesets") {
            let mut b = body.clone();
            b["rules"] = json!([{"name": "r", "description": "a\0b", "peers": [{"workloads": {"app": ["web"]}}], "services": []}]);
            variants.push(("description".into(), b));
        }
        for (field, b) in variants {
            let path = fill(route.path, "", "");
            let reply = plane.write(route.method, &path, &admin, Some("\"1\""), &b).await;
            let doc = reply.problem(400, ProblemType::Invalid);
            let detail = doc["detail"].as_str().unwrap();
            let named = field.replace('_', " ");
            assert!(detail.contains(&named), "{} {path} {field}: the field is named: {detail}", route.method);
            bodies += 1;
        }
    }
    assert!(bodies >= 9 * 5, "only {bodies} free-text bodies were sent");
    assert_eq!(written(plane.pool()).await, before, "a refused body wrote something");

    // The request that panicked before (a rollup over 1600–2026) is refused again, and the
    // replica still answers.
    for _ in 0..2 {
        let reply = plane
            .get(
                "/api/v1/flows/rollup?by=rule&from=1600-01-01T00:00:00Z&to=2026-01-01T00:00:00Z",
                Some(&admin),
            )
            .await;
        let doc = reply.problem(400, ProblemType::Invalid);
        assert!(doc["detail"].as_str().unwrap().contains("2200-01-01T00:00:00Z"), "{doc}");
    }
    assert_eq!(plane.get("/api/v1/workloads", Some(&admin)).await.status, 200);
    plane.stop().await;
    let logged = errors.0.lock().unwrap().clone();
    assert!(logged.is_empty(), "ERROR lines were logged: {logged:#?}");
}

/// `GET /api/v1/workloads/{id}/replay` answers what `foresight::replay` replays (the remote CLI
/// prints that answer with the local printer), refuses an unknown version naming it and a `top`
/// out of bounds, and needs a token.
#[tokio::test]
async fn replay_route_answers_what_the_library_replays() {
    use innerwall_control_plane::foresight;
    let plane = Plane::start(ApiLimits::default()).await;
    let id = register(plane.pool(), "web-1", &["app=web"]).await;
    innerwall_control_plane::testing::add_web_port(plane.pool(), 1).await.unwrap();
    innerwall_control_plane::testing::add_web_port(plane.pool(), 2).await.unwrap();
    let viewer = mint(plane.pool(), "replay-viewer", Role::Viewer).await;
    let path = format!("/api/v1/workloads/{id}/replay?from=3&to=2&since=2h&top=5");
    let reply = plane.get(&path, Some(&viewer.token)).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let mut answered: Value = reply.json();
    let range = foresight::Range::ending_at(chrono::Utc::now(), Duration::from_secs(7200)).unwrap();
    let mut conn = plane.pool().acquire().await.unwrap();
    let replayed = foresight::replay(&mut conn, id, 3, 2, range, 5).await.unwrap();
    drop(conn);
    let mut expected = serde_json::to_value(&replayed).unwrap();
    // The two ranges end at their own now; the rest is the same struct.
    for doc in [&mut answered, &mut expected] {
        doc.as_object_mut().unwrap().remove("range");
    }
    assert_eq!(answered, expected);
    assert_eq!(answered["workloads"][0]["from_version"], 3);
    assert_eq!(answered["workloads"][0]["unseen_admission_count"], 0, "v2 admits nothing v3 did not");
    let back: foresight::Impact = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(back.workloads[0].id, id, "the answer deserializes for the remote CLI");

    let missing = plane.get(&format!("/api/v1/workloads/{id}/replay?from=3&to=9"), Some(&viewer.token)).await;
    let doc = missing.problem(404, ProblemType::NotFound);
    assert!(doc["detail"].as_str().unwrap().contains("version 9"), "{doc}");
    let top =
        plane.get(&format!("/api/v1/workloads/{id}/replay?from=3&to=2&top=101"), Some(&viewer.token)).await;
    top.problem(400, ProblemType::Invalid);
    plane.get(&path, None).await.problem(401, ProblemType::Unauthorized);
    plane.stop().await;
}
