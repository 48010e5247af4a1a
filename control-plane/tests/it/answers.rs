//! Issue 26 items 2 and 5 (REL-1): what a viewer's lists may make a replica hold, and whose
//! cursors it takes — measured on the real `innerwall serve` binary (its own process, its
//! /proc status) on a real Postgres, over real HTTPS, and through the real CLI.
//!
//! The estate holds large policies: every workload has a long history whose every version is
//! a policy of 150,000 peers (about 2.5 MB as JSON; before history pages were summaries, one
//! page of 20 weighed 50 MB), and address groups of 10,000 members each (a page of all of them
//! weighs several megabytes unless it stops at its byte budget).

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::api::problem::ProblemType;
use innerwall_control_plane::identity::ca::{FileCa, Signer as _};
use innerwall_control_plane::page::{PAGE_BYTES, PAGE_ENVELOPE};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::policy::store::Content;
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Mode, PortRange, ResolvedRule, RuleId, WorkloadPolicy};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::Value;

/// How much serve's resident set may grow at its peak over its size before the readers start.
/// Each answer is bounded by `PAGE_BYTES` (1 MiB) of rows; twelve readers at once, each holding
/// a page, its serialization and the database rows behind it, need a few times that at worst.
/// Measured on the project's machine kind (2 cores, debug build): 3.4 MiB in the first round,
/// 4.5 MiB in the second. Before history pages were summaries with a byte budget, each history
/// reader here asked for every version in full, about 100 MB of JSON (issue 26: eight parallel
/// history pages took serve from 251 to 869 MB).
const RSS_GROWTH_BOUND: u64 = 48 << 20;

const WORKLOADS: usize = 4;
const VERSIONS: i64 = 40;
const PEERS: u32 = 150_000;
const GROUPS: i64 = 12;
const MEMBERS: i64 = 10_000;

/// A running `innerwall serve` with its API on loopback; killed by its PID on drop.
struct Serve {
    child: Child,
}

impl Serve {
    fn start(db: &TestDatabase, dir: &std::path::Path) -> (Serve, String) {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
        for var in ["INNERWALL_API", "INNERWALL_TOKEN", "INNERWALL_API_CA", "INNERWALL_DATABASE_URL"] {
            command.env_remove(var);
        }
        let mut child = command
            .args(["--database-url", &db.url, "--ca-dir"])
            .arg(dir.join("ca"))
            .args(["serve", "--listen", "127.0.0.1:0", "--server-name", "localhost", "--api-listen"])
            .arg(format!("127.0.0.1:{port}"))
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
        let serve = Serve { child };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("operator API on https://") => break,
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never announced its API; it logged:\n{}", seen.join("\n")),
            }
        }
        // Keep draining its log so it never blocks on a full pipe.
        std::thread::spawn(move || while lines.recv().is_ok() {});
        (serve, format!("127.0.0.1:{port}"))
    }

    /// (VmRSS, VmHWM) in bytes, from /proc/<pid>/status.
    fn memory(&self) -> (u64, u64) {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("proc status");
        let field = |name: &str| -> u64 {
            let line =
                status.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_else(|| panic!("no {name}"));
            line.trim().trim_end_matches("kB").trim().parse::<u64>().expect("kB") * 1024
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets the peak to the current resident set (proc(5), `clear_refs`).
    fn reset_peak(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").expect("resetting VmHWM");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTPS client of one replica's API.
#[derive(Clone)]
struct Client {
    addr: String,
    tls: tokio_rustls::TlsConnector,
    token: String,
}

impl Client {
    fn new(addr: &str, ca_pem: &str, token: &str) -> Client {
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
        Client {
            addr: addr.to_owned(),
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            token: token.to_owned(),
        }
    }

    /// GET `path`: status, content type and body.
    async fn get(&self, path: &str) -> (u16, String, Vec<u8>) {
        let tcp = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let stream = self.tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let request = hyper::Request::builder()
            .uri(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {}", self.token))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let kind = parts.headers.get("content-type").map_or("", |v| v.to_str().unwrap()).to_owned();
        (parts.status.as_u16(), kind, body.collect().await.unwrap().to_bytes().to_vec())
    }

    /// Walks every page of `path` (which takes `limit` and `cursor`): every row, each page's
    /// weight checked against the byte budget, and the number of pages.
    async fn walk(&self, path: &str, limit: u32) -> (Vec<Value>, usize) {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut rows = Vec::new();
        let mut cursor: Option<String> = None;
        let mut pages = 0;
        loop {
            let mut url = format!("{path}{separator}limit={limit}");
            if let Some(cursor) = &cursor {
                url.push_str(&format!("&cursor={cursor}"));
            }
            let (status, _, body) = self.get(&url).await;
            assert_eq!(status, 200, "GET {url}: {}", String::from_utf8_lossy(&body));
            assert!(
                body.len() <= PAGE_BYTES + PAGE_ENVELOPE,
                "GET {url}: a page of {} bytes is over its budget of {PAGE_BYTES} (+{PAGE_ENVELOPE})",
                body.len()
            );
            let page: Value = serde_json::from_slice(&body).unwrap();
            pages += 1;
            rows.extend(page["rows"].as_array().unwrap().iter().cloned());
            match page["next_cursor"].as_str() {
                Some(next) => {
                    assert_eq!(page["truncated"], true, "{url}");
                    cursor = Some(next.to_owned());
                }
                None => return (rows, pages),
            }
        }
    }

    /// Asserts a 400 problem document of type invalid for GET `path`.
    #[track_caller]
    fn refused(reply: &(u16, String, Vec<u8>), what: &str) {
        let (status, kind, body) = reply;
        let body = String::from_utf8_lossy(body);
        assert_eq!(*status, 400, "{what}: {body}");
        assert_eq!(kind, "application/problem+json", "{what}: {body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(doc["type"], ProblemType::Invalid.urn(), "{what}: {doc}");
        assert!(doc["detail"].as_str().is_some_and(|d| d.contains("cursor")), "{what}: {doc}");
    }
}

/// `innerwall <args>`: exit code, stdout, stderr.
fn innerwall(args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    for var in ["INNERWALL_API", "INNERWALL_TOKEN", "INNERWALL_API_CA", "INNERWALL_DATABASE_URL"] {
        command.env_remove(var);
    }
    let out = command.args(args).output().expect("running innerwall");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The estate: workloads with long histories of large policies, large address groups, a CA
/// for serve, and a viewer token minted by the CLI. Returns the workloads, the state dir and
/// the token.
async fn estate(db: &TestDatabase) -> (Vec<WorkloadId>, PathBuf, String, String) {
    let dir = std::env::temp_dir().join(format!("iw-answers-{}", uuid::Uuid::new_v4()));
    let signer = FileCa::init(&dir.join("ca")).unwrap();
    let ca = dir.join("api-ca.pem");
    std::fs::write(&ca, signer.ca_bundle_pem()).unwrap();

    let mut ids = Vec::new();
    for i in 0..WORKLOADS {
        let new = NewWorkload {
            id: WorkloadId::new_random(),
            hostname: format!("big-{i}"),
            labels: vec!["app=big".parse().unwrap()],
            addresses: [format!("192.168.7.{}", i + 1).parse().unwrap()].into(),
        };
        innerwall_control_plane::foresight::commit(&db.pool, "test", "register", &new.hostname, async |c| {
            authoring::register_workload(c, &new).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
        ids.push(new.id);
    }

    // One large policy content, shared by every version (contents are stored once), as a render
    // would have written it.
    let peers = (0..PEERS)
        .map(|n| Cidr::parse(&format!("{}/32", std::net::Ipv4Addr::from(0x0a00_0000 + n))).unwrap());
    let rule =
        ResolvedRule::new(RuleId::parse("wide/tcp").unwrap(), [PortRange::new(443, 443).unwrap()], peers)
            .unwrap();
    let policy = WorkloadPolicy::new(0, Mode::Enforcement, [rule]).unwrap();
    let content = Content::of(&policy);
    sqlx::query("INSERT INTO policy_contents (digest, policy) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(&content.digest)
        .bind(&content.bytes)
        .execute(&db.pool)
        .await
        .unwrap();
    for id in &ids {
        sqlx::query(
            "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at)
             SELECT $1, coalesce((SELECT max(version) FROM workload_policy_history WHERE workload_id = $1), 0) + v,
                    $2, now()
             FROM generate_series(1, $3::bigint) v",
        )
        .bind(id.uuid())
        .bind(&content.digest)
        .bind(VERSIONS)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "WITH g AS (INSERT INTO address_groups (id, name)
                    SELECT gen_random_uuid(), 'wide-' || k FROM generate_series(1, $1::bigint) k
                    RETURNING id, name)
         INSERT INTO address_group_cidrs (group_id, cidr)
         SELECT g.id, (('10.' || split_part(g.name, '-', 2) || '.0.0')::inet + n)::cidr
         FROM g, generate_series(0, $2::bigint - 1) n",
    )
    .bind(GROUPS)
    .bind(MEMBERS)
    .execute(&db.pool)
    .await
    .unwrap();

    let (code, out, err) = innerwall(&[
        "--json",
        "--database-url",
        db.url.as_str(),
        "operator",
        "token",
        "mint",
        "--name",
        "reader",
        "--role",
        "viewer",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let token: Value = serde_json::from_str(&out).unwrap();
    let token = token["token"].as_str().expect("the token").to_owned();
    (ids, dir, token, ca.to_str().unwrap().to_owned())
}

/// The versions of `id`'s history, newest first, as the database has them.
async fn versions(db: &TestDatabase, id: WorkloadId) -> Vec<u64> {
    let rows: Vec<i64> = sqlx::query_scalar(
        "SELECT version FROM workload_policy_history WHERE workload_id = $1 ORDER BY version DESC",
    )
    .bind(id.uuid())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    rows.into_iter().map(|v| v as u64).collect()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn viewer_answers_are_bounded() {
    let db = fresh_database().await.unwrap();
    let (ids, dir, token, ca) = estate(&db).await;
    let (serve, addr) = Serve::start(&db, &dir);
    let client = Client::new(&addr, &std::fs::read_to_string(&ca).unwrap(), &token);
    let mut expected = Vec::new();
    for id in &ids {
        expected.push(versions(&db, *id).await);
        assert!(expected.last().unwrap().len() as i64 >= VERSIONS);
    }

    // One version in full, through a history row's href (as large as a policy is).
    let (_, _, body) = client.get(&format!("/api/v1/workloads/{}/policy/history?limit=1", ids[0])).await;
    let first = serde_json::from_slice::<Value>(&body).unwrap()["rows"].as_array().unwrap().clone();
    let href = first[0]["href"].as_str().unwrap().to_owned();
    let (status, _, body) = client.get(&href).await;
    assert_eq!(status, 200);
    let full: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(full["rules"][0]["peers"].as_array().unwrap().len(), PEERS as usize);
    assert!(first[0]["bytes"].as_i64().unwrap() as usize >= content_floor(), "{}", first[0]);

    // Twice: the second round over a replica that has answered the first.
    for round in 0..2 {
        let (before, _) = serve.memory();
        serve.reset_peak();
        let mut readers = Vec::new();
        for r in 0..8 {
            let (client, id, expected) =
                (client.clone(), ids[r % WORKLOADS], expected[r % WORKLOADS].clone());
            readers.push(tokio::spawn(async move {
                let (rows, _) = client.walk(&format!("/api/v1/workloads/{id}/policy/history"), 1000).await;
                let got: Vec<u64> = rows.iter().map(|r| r["version"].as_u64().unwrap()).collect();
                assert_eq!(got, expected, "the cursor walks every version of {id} once, newest first");
                assert!(rows.iter().all(|r| r["rules"].is_null() && r["href"].is_string()), "summaries only");
            }));
        }
        for _ in 0..3 {
            let client = client.clone();
            readers.push(tokio::spawn(async move {
                let (rows, pages) = client.walk("/api/v1/address-groups", 1000).await;
                let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
                let mut unique = names.clone();
                unique.dedup();
                assert_eq!((names.len(), unique.len()), (GROUPS as usize, GROUPS as usize), "{names:?}");
                assert!(rows.iter().all(|r| r["cidrs"].as_array().unwrap().len() == MEMBERS as usize));
                assert!(pages > 1, "twelve groups of 10,000 members do not fit one page's budget");
            }));
        }
        let client2 = client.clone();
        readers.push(tokio::spawn(async move {
            let (rows, _) = client2.walk("/api/v1/workloads", 1000).await;
            assert_eq!(rows.len(), WORKLOADS);
            let (rows, _) = client2.walk("/api/v1/sync-status", 1000).await;
            assert_eq!(rows.len(), WORKLOADS);
        }));
        for reader in readers {
            reader.await.unwrap();
        }
        let (after, peak) = serve.memory();
        let growth = peak.saturating_sub(before);
        eprintln!(
            "round {round}: serve RSS before {}, peak (VmHWM) {}, after {}; growth at peak {} (bound {})",
            mib(before),
            mib(peak),
            mib(after),
            mib(growth),
            mib(RSS_GROWTH_BOUND)
        );
        assert!(
            growth < RSS_GROWTH_BOUND,
            "serve grew by {} at its peak (bound {})",
            mib(growth),
            mib(RSS_GROWTH_BOUND)
        );
    }

    // The CLI reads the same bounded pages, through the API and from the database: every group
    // once.
    let api = format!("https://localhost:{}", addr.rsplit(':').next().unwrap());
    let token_file = crate::foresight_api::token_file(&dir, &token);
    for args in [
        vec![
            "--json",
            "--page-size",
            "1000",
            "--api",
            api.as_str(),
            "--token-file",
            token_file.to_str().unwrap(),
            "--api-ca",
            ca.as_str(),
            "address-group",
            "list",
        ],
        vec!["--json", "--page-size", "1000", "--database-url", db.url.as_str(), "address-group", "list"],
    ] {
        let (code, out, err) = innerwall(&args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        let listed: Value = serde_json::from_str(&out).unwrap();
        let rows = listed.as_array().or(listed["rows"].as_array()).unwrap_or_else(|| panic!("{listed}"));
        assert_eq!(rows.len(), GROUPS as usize, "{args:?}");
    }
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The least the stored content weighs: four bytes an IPv4 peer.
fn content_floor() -> usize {
    PEERS as usize * 4
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_are_authenticated() {
    let db = fresh_database().await.unwrap();
    let (ids, dir, token, ca) = estate(&db).await;
    let (serve, addr) = Serve::start(&db, &dir);
    let pem = std::fs::read_to_string(&ca).unwrap();
    let client = Client::new(&addr, &pem, &token);
    let history = |id: WorkloadId| format!("/api/v1/workloads/{id}/policy/history");

    let (_, _, body) = client.get(&format!("{}?limit=2", history(ids[0]))).await;
    let page: Value = serde_json::from_slice(&body).unwrap();
    let cursor = page["next_cursor"].as_str().expect("a long history has a next page").to_owned();
    let after_first: Vec<u64> =
        page["rows"].as_array().unwrap().iter().map(|r| r["version"].as_u64().unwrap()).collect();
    let (_, _, body) = client.get("/api/v1/address-groups?limit=1").await;
    let groups: Value = serde_json::from_slice(&body).unwrap();
    let group_cursor = groups["next_cursor"].as_str().unwrap().to_owned();

    // The cursor as handed out leads on, on this replica and on another behind the same balancer
    // (the key is the database's, shared by every replica).
    let (second, addr2) = Serve::start(&db, &dir);
    for client in [client.clone(), Client::new(&addr2, &pem, &token)] {
        let (status, _, body) = client.get(&format!("{}?limit=2&cursor={cursor}", history(ids[0]))).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let next: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(next["rows"][0]["version"].as_u64(), Some(after_first[1] - 1));
    }

    let (payload, tag) = cursor.split_once('.').expect("a cursor is its key and its MAC");
    let tampered = format!("{}.{tag}", URL_SAFE_NO_PAD.encode(b"[3]"));
    let mut flipped = tag.as_bytes().to_vec();
    flipped[0] = if flipped[0] == b'A' { b'B' } else { b'A' };
    let flipped = format!("{payload}.{}", String::from_utf8(flipped).unwrap());
    let unsigned = URL_SAFE_NO_PAD.encode(br#"{"of":"policy history","after":[3]}"#);
    let forged = format!("{}.{}", URL_SAFE_NO_PAD.encode(b"[3]"), URL_SAFE_NO_PAD.encode([0u8; 32]));
    for (what, path) in [
        ("tampered key", format!("{}?cursor={tampered}", history(ids[0]))),
        ("altered MAC", format!("{}?cursor={flipped}", history(ids[0]))),
        ("unsigned (the old shape)", format!("{}?cursor={unsigned}", history(ids[0]))),
        ("forged", format!("{}?cursor={forged}", history(ids[0]))),
        ("garbage", format!("{}?cursor=not-a-cursor", history(ids[0]))),
        ("another workload's history", format!("{}?cursor={cursor}", history(ids[1]))),
        ("a history cursor on the group list", format!("/api/v1/address-groups?cursor={cursor}")),
        ("a group cursor on the workload list", format!("/api/v1/workloads?cursor={group_cursor}")),
        ("a group cursor on the audit log", format!("/api/v1/audit?cursor={group_cursor}")),
        (
            "a group cursor on the flow records",
            format!("/api/v1/flows?workload={}&cursor={group_cursor}", ids[0]),
        ),
    ] {
        Client::refused(&client.get(&path).await, what);
    }

    // Through the CLI: over the API and from the database, a clear error naming the cursor and
    // a non-zero exit.
    let api = format!("https://localhost:{}", addr.rsplit(':').next().unwrap());
    let workload = ids[0].to_string();
    let token_file = crate::foresight_api::token_file(&dir, &token);
    let token_file = token_file.to_str().unwrap();
    for bad in [forged.as_str(), tampered.as_str(), cursor.as_str()] {
        for mode in [
            vec!["--api", api.as_str(), "--token-file", token_file, "--api-ca", ca.as_str()],
            vec!["--database-url", db.url.as_str()],
        ] {
            let mut args = mode.clone();
            args.extend(["flows", "list", "--workload", workload.as_str(), "--cursor", bad]);
            let (code, out, err) = innerwall(&args);
            assert_ne!(code, Some(0), "{args:?}: {out}");
            assert!(err.contains("cursor") && !err.contains("panicked"), "{args:?}: {err}");
        }
    }
    drop(second);
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}
