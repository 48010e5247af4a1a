//! Issue 26 items 8, 10 and 7's mint, against a real Postgres and a real `innerwall serve`:
//! operator tokens are revoked by --id or --name and a name never has an id's shape; a token
//! expires after 90 days unless minted with `--expires never`, which the list shows; a mint
//! whose secret cannot be written leaves no live token; and `--api` pointed at the agent port,
//! at plain HTTP or with the wrong CA names the mistake and the fix; and the CLI takes the
//! operator token from `--token-file` (a file, or `-` for stdin) or the environment, never from
//! a flag (issue 32).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::operators::{self, Expiry, Role};
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use sqlx::PgPool;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A real `innerwall serve` on a fresh database: agent listener, operator API and metrics on
/// loopback ports of their own. Killed on drop.
struct Serve {
    db: TestDatabase,
    dir: PathBuf,
    child: Child,
    agent_port: u16,
    api_port: u16,
    metrics_port: u16,
    ca: PathBuf,
}

impl Serve {
    async fn start() -> Serve {
        Serve::start_with(&[]).await
    }

    /// [`Serve::start`] with `extra` flags for `serve`.
    async fn start_with(extra: &[&str]) -> Serve {
        let db = fresh_database().await.unwrap();
        let dir = std::env::temp_dir().join(format!("iw-operators-{}", uuid::Uuid::new_v4()));
        let signer = FileCa::init(&dir.join("ca")).unwrap();
        let ca = dir.join("api-ca.pem");
        std::fs::write(&ca, signer.ca_bundle_pem()).unwrap();
        let (agent_port, api_port, metrics_port) = (free_port(), free_port(), free_port());
        let mut child = Command::new(env!("CARGO_BIN_EXE_innerwall"))
            .args(["--database-url", &db.url, "--ca-dir"])
            .arg(dir.join("ca"))
            .args(["serve", "--server-name", "localhost"])
            .args(["--listen", &format!("127.0.0.1:{agent_port}")])
            .args(["--api-listen", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .args(extra)
            .env("INNERWALL_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning innerwall serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        // The metrics notice is the last of serve's start-up notices.
        while !seen.iter().any(|l: &String| l.contains("metrics at http://")) {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never announced its listeners; it logged:\n{}", seen.join("\n")),
            }
        }
        assert!(seen.iter().any(|l| l.contains("operator API on https://")), "{}", seen.join("\n"));
        Serve { db, dir, child, agent_port, api_port, metrics_port, ca }
    }

    fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// `method path` with `token` over HTTPS to the API: the status and the JSON answer.
    async fn call(&self, method: &str, path: &str, token: &str, body: Option<Value>) -> (u16, Value) {
        let pem = std::fs::read(&self.ca).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.api_port)).await.unwrap();
        let stream = tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {token}"));
        let bytes = match body {
            Some(body) => {
                request = request.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(&body).unwrap())
            }
            None => Bytes::new(),
        };
        let response = sender.send_request(request.body(Full::new(bytes)).unwrap()).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `innerwall`, with no `INNERWALL_*` of the test's environment.
fn command() -> Command {
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
    command
}

/// `innerwall <args>` with stdout as given: exit code, stdout, stderr. No `INNERWALL_*` of the
/// test's environment leaks in.
fn innerwall_with(args: &[&str], stdout: Stdio, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = command()
        .args(args)
        .envs(env.iter().copied())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .expect("running innerwall");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn innerwall(args: &[&str]) -> (Option<i32>, String, String) {
    innerwall_with(args, Stdio::piped(), &[])
}

/// [`innerwall_with`] with `input` on its standard input and its stdout piped.
fn innerwall_input(args: &[&str], input: &str, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    use std::io::Write as _;
    let mut child = command()
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running innerwall");
    // One that exits without reading it closes the pipe; its status and stderr say why.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[track_caller]
fn ok(args: &[&str]) -> String {
    let (code, stdout, stderr) = innerwall(args);
    assert_eq!(code, Some(0), "innerwall {args:?}: {stderr}");
    stdout
}

/// Every operator token as the CLI lists it with `--json`, by id.
fn listed(url: &str) -> std::collections::BTreeMap<String, Value> {
    let out = ok(&["--json", "--database-url", url, "operator", "token", "list"]);
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    rows.into_iter().map(|r| (r["id"].as_str().unwrap().to_owned(), r)).collect()
}

async fn status(pool: &PgPool, id: &str) -> (bool, Option<f64>) {
    sqlx::query_as(
        "SELECT revoked_at IS NOT NULL, extract(epoch FROM expires_at - created_at)::float8
         FROM operator_tokens WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

const NINETY_DAYS: f64 = 90.0 * 86_400.0;

// The CLI runs as a blocking child process while serve runs beside: two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_unambiguous() {
    let serve = Serve::start().await;
    let url = serve.db.url.clone();
    let pool = serve.pool().clone();
    let local = ["--database-url", url.as_str()];
    let mint = |name: &str, extra: &[&str]| -> Value {
        let mut args = vec!["--json", "--database-url", &url, "operator", "token", "mint", "--name", name];
        args.extend(["--role", "admin"]);
        args.extend(extra);
        serde_json::from_str(&ok(&args)).unwrap()
    };

    // Minted without --expires: it expires, 90 days after it was made; the list says when.
    let ada = mint("ada-admin", &[]);
    let ada_id = ada["id"].as_str().unwrap().to_owned();
    let (_, ttl) = status(&pool, &ada_id).await;
    assert_eq!(ttl, Some(NINETY_DAYS), "{ada}");
    assert!(ada["expires_at"].is_string(), "{ada}");
    // `--expires never` is explicit, and listed as never.
    let forever = mint("forever.bot", &["--expires", "never"]);
    let forever_id = forever["id"].as_str().unwrap().to_owned();
    assert_eq!(status(&pool, &forever_id).await.1, None);
    let rows = listed(&url);
    assert!(rows[&forever_id]["expires_at"].is_null() && rows[&ada_id]["expires_at"].is_string(), "{rows:?}");
    let table = ok(&["--database-url", &url, "operator", "token", "list"]);
    let line = |id: &str| table.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{table}"));
    assert!(line(&forever_id).contains("never"), "{table}");
    assert!(!line(&ada_id).contains("never"), "{table}");
    // A bad --expires is refused, naming `never`, and mints nothing.
    let (code, _, stderr) = innerwall(&[
        "--database-url",
        &url,
        "operator",
        "token",
        "mint",
        "--name",
        "x.y",
        "--role",
        "viewer",
        "--expires",
        "forever",
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("never"), "{stderr}");
    assert_eq!(listed(&url).len(), 2);

    // A name of an id's shape (8 characters of base64url) is refused, here another token's id.
    let (code, _, stderr) = innerwall(&[
        "--database-url",
        &url,
        "operator",
        "token",
        "mint",
        "--name",
        &ada_id,
        "--role",
        "viewer",
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("shape of a token id"), "{stderr}");
    // One id in 64 begins with "-" (the CI once drew one): such a name gets the same reason,
    // never a usage error about an unexpected flag.
    let dashed_name = format!("-{}", &ada_id[1..]);
    let (code, _, stderr) = innerwall(&[
        "--database-url",
        &url,
        "operator",
        "token",
        "mint",
        "--name",
        &dashed_name,
        "--role",
        "viewer",
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("shape of a token id"), "{stderr}");
    assert!(
        operators::mint_audited(&pool, "test", &forever_id, Role::Viewer, Expiry::default()).await.is_err(),
        "the library refuses it too"
    );
    assert_eq!(listed(&url).len(), 2);

    // A token named like another's id from before that rule: revoking by that name revokes the
    // named token, never the one with that id; and by id, the other. About one id in 16 begins
    // or ends with '-' or '_', which no name may, so no name could ever spell it: the target is
    // a token whose id a name could spell.
    let spellable = |id: &str| {
        id.starts_with(|c: char| c.is_ascii_alphanumeric())
            && id.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    let target_id = (0..40)
        .map(|i| mint(&format!("target.{i}"), &[])["id"].as_str().unwrap().to_owned())
        .find(|id| spellable(id))
        .expect("one of 40 ids a name could spell");
    let named = mint("impostor.1", &[]);
    let named_id = named["id"].as_str().unwrap().to_owned();
    sqlx::query("UPDATE operator_tokens SET name = $1 WHERE id = $2")
        .bind(&target_id)
        .bind(&named_id)
        .execute(&pool)
        .await
        .unwrap();
    let out = ok(&["--json", "--database-url", &url, "operator", "token", "revoke", "--name", &target_id]);
    let revoked: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(revoked["id"], named_id.as_str(), "{revoked}");
    assert!(status(&pool, &named_id).await.0);
    assert!(!status(&pool, &target_id).await.0, "the token whose id that name spells is untouched");
    // The old one-argument form is a usage error that revokes nothing.
    let (code, _, stderr) = innerwall(&["--database-url", &url, "operator", "token", "revoke", &forever_id]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--id") && stderr.contains("--name"), "{stderr}");
    assert!(!status(&pool, &forever_id).await.0);
    // --id with a name is refused as not an id; --name with an id matches no name.
    let (code, _, stderr) =
        innerwall(&["--database-url", &url, "operator", "token", "revoke", "--id", "forever.bot"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("is not an operator token id") && stderr.contains("--name"), "{stderr}");
    let (code, _, stderr) =
        innerwall(&["--database-url", &url, "operator", "token", "revoke", "--name", &forever_id]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("not found"), "{stderr}");
    assert!(!status(&pool, &forever_id).await.0);
    // By name, then again by the same name (nothing live is left under it), then by id twice.
    ok(&[local[0], local[1], "operator", "token", "revoke", "--name", "forever.bot"]);
    assert!(status(&pool, &forever_id).await.0);
    let (code, _, stderr) =
        innerwall(&[local[0], local[1], "operator", "token", "revoke", "--name", "forever.bot"]);
    assert_eq!(code, Some(1), "{stderr}");
    let revokes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'operator-token.revoke'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(revokes, 2);
    // One id in 64 begins with "-": the CLI reads it as the value it is, never as a flag.
    let dashed = mint("dashed.bot", &[]);
    let minted_id = dashed["id"].as_str().unwrap();
    let dashed_id = format!("-{}", &minted_id[1..]);
    sqlx::query("UPDATE operator_tokens SET id = $1 WHERE id = $2")
        .bind(&dashed_id)
        .bind(minted_id)
        .execute(&pool)
        .await
        .unwrap();
    ok(&[local[0], local[1], "operator", "token", "revoke", "--id", &dashed_id]);
    assert!(status(&pool, &dashed_id).await.0);

    // Over the API: DELETE takes an id only; a name there is a 400 and revokes nothing.
    let token = ada["token"].as_str().unwrap();
    let tokens = "/api/v1/operator-tokens";
    let (code, body) =
        serve.call("POST", tokens, token, Some(json!({"name": "vera.api", "role": "viewer"}))).await;
    assert_eq!(code, 201, "{body}");
    let vera_id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(status(&pool, &vera_id).await.1, Some(NINETY_DAYS), "an API mint expires by default too");
    let (code, body) = serve.call("DELETE", &format!("{tokens}/vera.api"), token, None).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("is not an operator token id"), "{body}");
    assert!(!status(&pool, &vera_id).await.0);
    let (code, body) = serve.call("DELETE", &format!("{tokens}/{vera_id}"), token, None).await;
    assert_eq!((code, body["status"].as_str()), (200, Some("revoked")), "{body}");
    let (code, body) = serve
        .call(
            "POST",
            tokens,
            token,
            Some(json!({"name": "forever.api", "role": "viewer", "never_expires": true})),
        )
        .await;
    assert_eq!(code, 201, "{body}");
    assert!(body["expires_at"].is_null(), "{body}");
    let both = json!({"name": "both.api", "role": "viewer", "never_expires": true, "expires_in_seconds": 60});
    let (code, body) = serve.call("POST", tokens, token, Some(both)).await;
    assert_eq!(code, 400, "{body}");
    let (code, body) =
        serve.call("POST", tokens, token, Some(json!({"name": "deployer", "role": "viewer"}))).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("shape of a token id"), "{body}");
}

/// Stdout as the write end of a pipe whose read end is already closed.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Stdio::from(writer)
}

/// `innerwall <args>` with descriptor 1 closed (`>&-`), through the shell.
fn innerwall_stdout_closed(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new("sh")
        .arg("-c")
        .arg("exec \"$0\" \"$@\" >&-")
        .arg(env!("CARGO_BIN_EXE_innerwall"))
        .args(args)
        .env_remove("INNERWALL_DATABASE_URL")
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

async fn live(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operator_tokens WHERE revoked_at IS NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_token_mint_never_leaves_an_unshown_token() {
    let db = fresh_database().await.unwrap();
    let pool = db.pool.clone();
    let mint = |name: &str, json: bool| -> Vec<String> {
        let mut args = vec!["--database-url", &db.url, "operator", "token", "mint", "--name", name];
        args.extend(["--role", "admin"]);
        if json {
            args.push("--json");
        }
        args.into_iter().map(str::to_owned).collect()
    };

    // A full device and a closed pipe, as tables and as JSON, twice: each mint is refused
    // with what happened and what to do, and its token is revoked at once, audited why.
    let full = || Stdio::from(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap());
    let mut n = 0;
    for round in 0..2 {
        for (what, json) in [("full", false), ("full", true), ("pipe", false), ("pipe", true)] {
            n += 1;
            let name = format!("unseen-{round}-{what}-{json}");
            let stdout = if what == "full" { full() } else { closed_pipe() };
            let (code, _, stderr) = innerwall_with(&args(&mint(&name, json)), stdout, &[]);
            assert_eq!(code, Some(1), "{what} {json}: {stderr}");
            assert!(stderr.contains("cannot write the new operator token to stdout"), "{stderr}");
            assert!(stderr.contains("was revoked at once") && stderr.contains("mint again"), "{stderr}");
            assert!(!stderr.contains("iwo_"), "no secret on stderr either: {stderr}");
            assert_eq!(live(&pool).await, 0, "{what} {json}: a token no one saw stayed live");
            let minted: i64 =
                sqlx::query_scalar("SELECT count(*) FROM operator_tokens").fetch_one(&pool).await.unwrap();
            assert_eq!(minted, n);
        }
    }
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT detail->>'reason' FROM audit_log WHERE action = 'operator-token.revoke' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(reasons.len(), 8);
    assert!(reasons.iter().all(|r| r.contains("could not be written to stdout")), "{reasons:?}");

    // A closed descriptor 1, and /dev/null: refused before anything is minted.
    let (code, stderr) = innerwall_stdout_closed(&args(&mint("never-made", false)));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("stdout is closed") && stderr.contains("nothing was minted"), "{stderr}");
    let (code, _, stderr) = innerwall_with(&args(&mint("never-made", true)), Stdio::null(), &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("/dev/null") && stderr.contains("nothing was minted"), "{stderr}");
    let made: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operator_tokens").fetch_one(&pool).await.unwrap();
    assert_eq!(made, n);

    // And with stdout open, the same mint works and its token is live.
    let (code, stdout, stderr) = innerwall_with(&args(&mint("seen", true)), Stdio::piped(), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let minted: Value = serde_json::from_str(&stdout).unwrap();
    assert!(minted["token"].as_str().unwrap().starts_with("iwo_"), "{minted}");
    assert_eq!(live(&pool).await, 1);
}

/// Runs `service list` through `--api url` with `ca` and `token` (in INNERWALL_API_TOKEN): exit
/// code and stderr.
fn remote(url: &str, token: &str, ca: &Path) -> (Option<i32>, String) {
    let (code, _, stderr) = innerwall_with(
        &["--api", url, "--api-ca", ca.to_str().unwrap(), "service", "list"],
        Stdio::piped(),
        &[("INNERWALL_API_TOKEN", token)],
    );
    (code, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_say_what_to_do() {
    let serve = Serve::start().await;
    let minted =
        operators::mint_audited(serve.pool(), "test", "errors.test", Role::Viewer, Expiry::default())
            .await
            .unwrap();
    let token = minted.token.as_str();
    let api = format!("https://localhost:{}", serve.api_port);
    let other = FileCa::init(&serve.dir.join("other-ca")).unwrap();
    let wrong_ca = serve.dir.join("other-ca.pem");
    std::fs::write(&wrong_ca, other.ca_bundle_pem()).unwrap();

    // Twice each, and the right address answers in between: nothing is left broken.
    for _ in 0..2 {
        let (code, stderr) = remote(&api, token, &serve.ca);
        assert_eq!(code, Some(0), "the right address, token and CA work: {stderr}");

        // The agent port: named as the agent listener, and where the API is instead.
        let (code, stderr) = remote(&format!("https://localhost:{}", serve.agent_port), token, &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("it is the agent listener") && stderr.contains("--api-listen"), "{stderr}");

        // Plain HTTP (the metrics listener): named, and where the API is instead.
        let (code, stderr) = remote(&format!("https://localhost:{}", serve.metrics_port), token, &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains("answered in plain HTTP, not TLS") && stderr.contains("--api-listen"),
            "{stderr}"
        );
        // And http:// for the API itself: it is HTTPS only.
        let (code, stderr) = remote(&format!("http://localhost:{}", serve.api_port), token, &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("speaks only HTTPS; write https://"), "{stderr}");

        // The wrong CA: named, with the file given and the one to pass.
        let (code, stderr) = remote(&api, token, &wrong_ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("is not issued by the CA in --api-ca"), "{stderr}");
        assert!(stderr.contains(wrong_ca.to_str().unwrap()) && stderr.contains("ca.crt"), "{stderr}");

        // A name the certificate does not hold: named, with what to use.
        let (code, stderr) = remote(&format!("https://127.0.0.1:{}", serve.api_port), token, &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("is not for the name") && stderr.contains("--server-name"), "{stderr}");

        // Nothing listening: said so.
        let closed = free_port();
        let (code, stderr) = remote(&format!("https://localhost:{closed}"), token, &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("cannot connect") && stderr.contains("--api-listen"), "{stderr}");

        // A provisioning token given for --api: named, with the kind to mint.
        let (code, stderr) = remote(&api, "iw_0123456789abcdef0123456789abcdef0123456789ab", &serve.ca);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains("is a provisioning token") && stderr.contains("operator token mint"),
            "{stderr}"
        );
    }

    // The former variable still works for an operator token, with a warning; it is refused
    // when it holds anything else.
    let ca = serve.ca.to_str().unwrap();
    let list = ["--api", api.as_str(), "--api-ca", ca, "service", "list"];
    let (code, _, stderr) = innerwall_with(&list, Stdio::piped(), &[("INNERWALL_TOKEN", token)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("INNERWALL_TOKEN is deprecated") && stderr.contains("INNERWALL_API_TOKEN"),
        "{stderr}"
    );
    let (code, _, stderr) = innerwall_with(&list, Stdio::piped(), &[("INNERWALL_API_TOKEN", token)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("deprecated"), "{stderr}");
    let (code, _, stderr) = innerwall_with(&list, Stdio::piped(), &[("INNERWALL_TOKEN", "iw_abc")]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("set INNERWALL_API_TOKEN"), "{stderr}");

    // A secret is never a flag (issue 32): `--token` is a usage error (exit 2) that says what
    // to use instead, does not repeat the token, and calls nothing, though the token could.
    let editor = "stdin.test";
    let minted =
        operators::mint_audited(serve.pool(), "test", editor, Role::Editor, Expiry::default()).await.unwrap();
    let editor_token = minted.token.as_str();
    let called = async || -> (bool, i64) {
        let used: bool =
            sqlx::query_scalar("SELECT last_used_at IS NOT NULL FROM operator_tokens WHERE name = $1")
                .bind(editor)
                .fetch_one(serve.pool())
                .await
                .unwrap();
        let made: i64 = sqlx::query_scalar("SELECT count(*) FROM services WHERE name = 'from-stdin'")
            .fetch_one(serve.pool())
            .await
            .unwrap();
        (used, made)
    };
    let create =
        ["--api", api.as_str(), "--api-ca", ca, "service", "create", "from-stdin", "--entry", "tcp:80"];
    let flagged: Vec<&str> = ["--token", editor_token].iter().chain(&create).copied().collect();
    let (code, stdout, stderr) = innerwall(&flagged);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("--token-file FILE") && stderr.contains("INNERWALL_API_TOKEN"), "{stderr}");
    assert!(!stderr.contains(editor_token), "the token is not repeated: {stderr}");
    assert_eq!(called().await, (false, 0), "a refused --token called the API");

    // `--token-file -`: the token on standard input, whitespace around it ignored, and ahead of
    // INNERWALL_API_TOKEN (here the viewer's, which may not create a service).
    let piped: Vec<&str> = ["--token-file", "-"].iter().chain(&create).copied().collect();
    let (code, stdout, stderr) =
        innerwall_input(&piped, &format!("\n  {editor_token}\n"), &[("INNERWALL_API_TOKEN", token)]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(called().await, (true, 1), "the token from stdin was not the one used");
    let (code, _, stderr) = innerwall_input(&piped, " \n", &[("INNERWALL_API_TOKEN", token)]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("standard input (--token-file -) is empty"), "{stderr}");

    // A token file missing, empty or too large: exit 1 naming the file, never another token.
    let (empty, large) = (serve.dir.join("empty-token"), serve.dir.join("large-token"));
    std::fs::write(&empty, "\n").unwrap();
    std::fs::write(&large, format!("{editor_token}\n{}", " ".repeat(4096))).unwrap();
    for (file, why) in [
        (serve.dir.join("no-such-token"), "cannot read the operator token"),
        (empty, "is empty"),
        (large, "holds more than 4096 bytes"),
    ] {
        let file = file.to_str().unwrap();
        let args: Vec<&str> = ["--token-file", file].iter().chain(&list).copied().collect();
        let (code, stdout, stderr) = innerwall_with(&args, Stdio::piped(), &[("INNERWALL_API_TOKEN", token)]);
        assert_eq!(code, Some(1), "{file}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
        assert!(stderr.contains(&format!("--token-file {file}")) && stderr.contains(why), "{stderr}");
    }
}

/// Management access from the command line: `serve --management-cidr` stores the estate's set,
/// an admin narrows it through the API with the remote CLI and cannot widen it there, and only
/// `management reset` on the database replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn management_access_from_serve_and_the_cli() {
    let serve =
        Serve::start_with(&["--management-cidr", "192.0.2.0/24", "--management-service", "tcp:22"]).await;
    let url = serve.db.url.clone();
    let local = ["--json", "--database-url", url.as_str()];
    let show = |args: &[&str]| -> Value {
        serde_json::from_str(&ok(&[args, &["management", "show"]].concat())).unwrap()
    };
    assert_eq!(show(&local)["estate"]["cidrs"], json!(["192.0.2.0/24"]));
    assert_eq!(show(&local)["estate"]["updated_by"], json!("serve"));

    let admin: Value = serde_json::from_str(&ok(&[
        "--json",
        "--database-url",
        &url,
        "operator",
        "token",
        "mint",
        "--name",
        "ada.admin",
        "--role",
        "admin",
    ]))
    .unwrap();
    let token = admin["token"].as_str().unwrap();
    let api = format!("https://localhost:{}", serve.api_port);
    let ca = serve.ca.to_str().unwrap();
    let remote = |args: &[&str]| {
        innerwall_with(
            &[&["--json", "--api", &api, "--api-ca", ca], args].concat(),
            Stdio::piped(),
            &[("INNERWALL_API_TOKEN", token)],
        )
    };
    let (code, _, stderr) = remote(&["management", "narrow", "--cidr", "192.0.2.0/25"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, out, stderr) = remote(&["management", "show"]);
    assert_eq!(code, Some(0), "{stderr}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["estate"]["cidrs"], json!(["192.0.2.0/25"]), "{listed}");
    assert_eq!(listed["estate"]["services"], json!(["tcp:22"]), "{listed}");

    // Wider through the API: refused, naming what falls outside. Reset: not through the API.
    let (code, _, stderr) = remote(&["management", "narrow", "--cidr", "192.0.2.0/24"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("can only be narrowed") && stderr.contains("192.0.2.0/24"), "{stderr}");
    let (code, _, stderr) = remote(&["management", "reset", "--cidr", "192.0.2.0/24"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("`innerwall management reset` administers this host"), "{stderr}");
    assert_eq!(show(&local)["estate"]["cidrs"], json!(["192.0.2.0/25"]));

    // On the database, reset replaces it, wider or not.
    ok(&[
        "--database-url",
        &url,
        "management",
        "reset",
        "--cidr",
        "198.51.100.0/24",
        "--service",
        "tcp:2222",
    ]);
    let listed = show(&local);
    assert_eq!(listed["estate"]["cidrs"], json!(["198.51.100.0/24"]), "{listed}");
    assert_eq!(listed["estate"]["services"], json!(["tcp:2222"]), "{listed}");
}
