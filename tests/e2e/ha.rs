//! A highly available database on standard tools (issue 32, item 6):
//! `patroni_failover_keeps_the_fleet`.
//!
//! Two PostgreSQL servers managed by Patroni (Debian's `patroni`, with a one-member `etcd` as its
//! store), synchronous replication on (`synchronous_mode: true`: a commit is acknowledged once
//! the synchronous standby has it), TLS required for every TCP connection. Clients reach the
//! primary through HAProxy, which asks each Patroni's REST API which one is primary
//! (`/primary`) and cuts the sessions of a server marked down. Innerwall on top as an operator
//! would run it: the schema migrated by an owner role, two `innerwall serve` replicas and the CLI
//! as a least-privilege role (no superuser, no DDL), over TLS verified against the database's
//! CA, and two real agents, each in a network namespace of its own, enforcing.
//!
//! Then the primary dies twice: first its postmaster is killed (SIGKILL; Patroni fails over at
//! once, `primary_start_timeout: 0`), then — once the old primary is back as the synchronous
//! standby — the new primary's Patroni is killed (its PostgreSQL keeps running, HAProxy stops
//! sending to it, and the standby takes over when the leader key expires). A writer commits
//! throughout; after each failover: every acknowledged commit is there, both replicas' NOTIFY
//! bridges reconnected (their logs say so), a policy change reaches both agents, and the agents'
//! tables were in place at every sample taken through it. The figures are printed.
//!
//! Everything but the agents runs in a network namespace of the test's own, so its fixed ports
//! collide with nothing; each agent's namespace has a veth link to it.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::{authoring, spec::ServiceSpec, store};
use innerwall_wire::identity::WorkloadId;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sqlx::PgPool;

use crate::host::{Namespace, require_root};

const ETCD: &str = "127.0.0.1:2379";
const HAPROXY_PORT: u16 = 5000;
/// Each node's PostgreSQL port and Patroni REST port.
const NODES: [(u16, u16); 2] = [(5432, 8008), (5433, 8009)];
const SUPERUSER_PASSWORD: &str = "su-secret";
/// Replicas and agents: agent `i` (label `app=web`) reaches replica `i` at 10.90.`i`.1.
const PAIRS: usize = 2;

/// A process of the estate, killed by its PID on drop.
struct Proc(Child);

impl Proc {
    fn spawn(command: &mut Command, log: &Path) -> Proc {
        let log = std::fs::File::create(log).unwrap();
        Proc(
            command
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("{command:?}: {e}")),
        )
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.0.id()).unwrap())
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The status code of `GET path` on 127.0.0.1:`port`, if anything answered within a second.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut stream =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes()).ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Polls `check` every 100 ms until it gives something; panics after `secs` with the logs.
async fn until<T>(what: &str, secs: u64, dir: &Path, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(found) = check().await {
            return found;
        }
        if Instant::now() > deadline {
            let mut logs = String::new();
            for entry in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
                let path = entry.path();
                if path.extension().is_some_and(|e| e == "log") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(25).collect();
                    logs += &format!(
                        "\n--- {}:\n{}",
                        path.display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
            }
            panic!("{what}: not within {secs} s{logs}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn run(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(out.status.success(), "{command:?}: {}{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

/// The database's CA and the servers' certificate (for 127.0.0.1), made with openssl.
fn certificates(dir: &Path) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    run(Command::new("openssl")
        .args(["req", "-x509"])
        .args(ec)
        .args(["-days", "2", "-subj", "/CN=iw-db-ca"])
        .args(["-keyout", "db-ca.key", "-out", "db-ca.crt"])
        .current_dir(dir));
    run(Command::new("openssl")
        .args(["req"])
        .args(ec)
        .args(["-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"])
        .current_dir(dir));
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(Command::new("openssl")
        .args([
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "db-ca.crt",
            "-CAkey",
            "db-ca.key",
            "-CAcreateserial",
        ])
        .args(["-days", "2", "-extfile", "san.ext", "-out", "server.crt"])
        .current_dir(dir));
    // A second CA the servers' certificate is not from.
    run(Command::new("openssl")
        .args(["req", "-x509"])
        .args(ec)
        .args(["-days", "2", "-subj", "/CN=other-ca"])
        .args(["-keyout", "other-ca.key", "-out", "other-ca.crt"])
        .current_dir(dir));
}

fn patroni_config(dir: &Path, node: usize, bin_dir: &Path) -> String {
    let (pg, rest) = NODES[node];
    let d = dir.display();
    format!(
        "scope: iw-ha
name: pg{node}
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  hosts: {ETCD}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 3
    primary_start_timeout: 0
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_log_hints: 'on'
        max_connections: 200
  initdb:
  - encoding: UTF8
  - locale: C
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {d}/pg{node}
  bin_dir: {bin}
  pgpass: {d}/pgpass{node}
  use_unix_socket: true
  authentication:
    superuser: {{username: postgres, password: {SUPERUSER_PASSWORD}}}
    replication: {{username: replicator, password: rep-secret}}
  parameters:
    unix_socket_directories: {d}/sock{node}
    ssl: 'on'
    ssl_cert_file: {d}/server.crt
    ssl_key_file: {d}/server.key
  pg_hba:
  - local all all trust
  - hostssl replication replicator 127.0.0.1/32 scram-sha-256
  - hostssl all all 127.0.0.1/32 scram-sha-256
  - host all all 0.0.0.0/0 reject
",
        bin = bin_dir.display()
    )
}

const HAPROXY: &str = "global
  maxconn 400
defaults
  mode tcp
  timeout connect 1s
  timeout client 1h
  timeout server 1h
  timeout check 1s
listen primary
  bind 127.0.0.1:5000
  option httpchk GET /primary
  http-check expect status 200
  default-server inter 300ms fall 2 rise 1 on-marked-down shutdown-sessions
  server pg0 127.0.0.1:5432 check port 8008
  server pg1 127.0.0.1:5433 check port 8009
";

/// The node (index into [`NODES`]) whose Patroni says it is the primary.
fn primary() -> Option<usize> {
    (0..NODES.len()).find(|&n| http_status(NODES[n].1, "/primary") == Some(200))
}

/// The PID in `data_dir`'s postmaster.pid.
fn postmaster(data_dir: &Path) -> Option<Pid> {
    let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    Some(Pid::from_raw(text.lines().next()?.trim().parse().ok()?))
}

fn alive(pid: Pid) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The estate's processes; dropping it stops them all by PID, PostgreSQL servers included
/// (a killed Patroni leaves its server running).
struct Estate {
    dir: PathBuf,
    agents: Vec<Proc>,
    serves: Vec<Proc>,
    haproxy: Option<Proc>,
    patroni: Vec<Proc>,
    etcd: Option<Proc>,
}

impl Drop for Estate {
    fn drop(&mut self) {
        self.agents.clear();
        self.serves.clear();
        self.haproxy = None;
        self.patroni.iter_mut().for_each(Proc::kill);
        for node in 0..NODES.len() {
            if let Some(pid) = postmaster(&self.dir.join(format!("pg{node}"))) {
                let _ = kill(pid, Signal::SIGQUIT);
                let deadline = Instant::now() + Duration::from_secs(10);
                while alive(pid) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        self.etcd = None;
    }
}

/// `innerwall ARGS` with `url` as its database: stdout, or a panic with stderr.
fn innerwall(url: &str, state: &Path, args: &[&str]) -> String {
    run(Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .env_remove("INNERWALL_CONFIG")
        .env_remove("INNERWALL_DATABASE_URL")
        .args(["--database-url", url, "--state-dir"])
        .arg(state)
        .arg("--ca-dir")
        .arg(state.join("ca"))
        .args(args))
}

/// Every acknowledged commit of the writer: its number and the port of the server that
/// acknowledged it, in order.
type Acknowledged = Arc<Mutex<Vec<(u32, u16, Instant)>>>;

/// Commits a new service every 50 ms until `stop`, recording what was acknowledged.
async fn writer(pool: PgPool, acked: Acknowledged, stop: Arc<AtomicBool>) -> u32 {
    let mut failures = 0;
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let name = format!("w{n}");
        let committed = innerwall_control_plane::foresight::commit(
            &pool,
            "ha-test",
            "service.create",
            &name,
            async |c| {
                let port: i32 = sqlx::query_scalar("SELECT inet_server_port()").fetch_one(&mut *c).await?;
                let spec = ServiceSpec {
                    name: name.clone(),
                    description: String::new(),
                    entries: vec![ServiceEntry::parse(&format!("tcp:{}", 10_000 + n % 50_000)).unwrap()],
                };
                authoring::create_service(c, &spec).await?;
                Ok((port, serde_json::json!({})))
            },
        )
        .await;
        match committed {
            Ok(c) => acked.lock().unwrap().push((n, u16::try_from(c.value).unwrap(), Instant::now())),
            Err(_) => failures += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    failures
}

/// Samples each agent's table every 200 ms until `stop`: how many samples were taken, and the
/// first one that found the table missing or not enforcing.
fn watch_tables(
    namespaces: Vec<String>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u32, Option<String>)> {
    std::thread::spawn(move || {
        let mut samples = 0;
        while !stop.load(Ordering::Relaxed) {
            for ns in &namespaces {
                let out = Command::new("nsenter")
                    .arg(format!("--net=/run/netns/{ns}"))
                    .args(["nft", "list", "table", "inet", "innerwall"])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout);
                if !out.status.success() || !text.contains("innerwall:drop") || !text.contains("192.0.2.0/24")
                {
                    return (samples, Some(format!("{ns}: {text}{}", String::from_utf8_lossy(&out.stderr))));
                }
            }
            samples += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        (samples, None)
    })
}

/// How many times `serve`'s log says its NOTIFY bridge (re)connected and reconciled.
fn bridge_connects(log: &Path) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().matches("listening for policy announcements").count()
}

/// The stored sync state of every agent: (state, applied version, latest version).
async fn states(pool: &PgPool, ids: &[WorkloadId]) -> Option<Vec<(String, i64, Option<i64>)>> {
    let mut conn = pool.acquire().await.ok()?;
    let mut all = Vec::new();
    for id in ids {
        let s = store::sync_status(&mut conn, Some(*id)).await.ok()?.pop()?;
        all.push((s.state.0.name().to_owned(), s.applied_version, s.latest_version));
    }
    Some(all)
}

#[test]
fn patroni_failover_keeps_the_fleet() {
    require_root();
    for tool in ["patroni", "etcd", "haproxy", "openssl"] {
        assert!(
            Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().unwrap().status.success(),
            "{tool} is not installed: `cargo xtask setup` installs it"
        );
    }
    let hub = Namespace::create(format!("iw-ha-{}", std::process::id()));
    // This thread, and so the runtime's threads and every process started from them, in `hub`.
    hub.enter();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(failover());
    drop(hub);
}

async fn failover() {
    let dir = std::env::temp_dir().join(format!("iw-ha-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut estate = Estate {
        dir: dir.clone(),
        agents: vec![],
        serves: vec![],
        haproxy: None,
        patroni: vec![],
        etcd: None,
    };
    assert!(
        nix::unistd::User::from_name("postgres").unwrap().is_some(),
        "no postgres system user (PostgreSQL's package makes it)"
    );
    let bin_dir = innerwall_control_plane::postgres::Binaries::find().unwrap().dir().to_owned();

    certificates(&dir);
    for node in 0..NODES.len() {
        std::fs::create_dir_all(dir.join(format!("sock{node}"))).unwrap();
    }
    for (name, text) in [
        ("patroni0.yml", patroni_config(&dir, 0, &bin_dir)),
        ("patroni1.yml", patroni_config(&dir, 1, &bin_dir)),
        ("haproxy.cfg", HAPROXY.to_owned()),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    run(Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir));
    std::fs::set_permissions(dir.join("server.key"), std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .unwrap();
    let started = Instant::now();

    // etcd, the two Patroni nodes (the first bootstraps the primary, the second clones it and
    // becomes the synchronous standby), and HAProxy in front.
    estate.etcd = Some(Proc::spawn(
        Command::new("etcd")
            .args(["--name", "e0", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &format!("http://{ETCD}"),
                "--advertise-client-urls",
                &format!("http://{ETCD}"),
            ])
            .args([
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
            ])
            .args(["--initial-cluster", "e0=http://127.0.0.1:2380"]),
        &dir.join("etcd.log"),
    ));
    until("etcd healthy", 30, &dir, async || (http_status(2379, "/health") == Some(200)).then_some(())).await;
    let patroni = |node: usize| {
        Proc::spawn(
            Command::new("setpriv")
                .args(["--reuid=postgres", "--regid=postgres", "--init-groups", "patroni"])
                .arg(dir.join(format!("patroni{node}.yml")))
                .env("HOME", &dir),
            &dir.join(format!("patroni{node}.log")),
        )
    };
    estate.patroni.push(patroni(0));
    until("pg0 primary", 60, &dir, async || (primary() == Some(0)).then_some(())).await;
    eprintln!("phase: pg0 primary at {:.1} s", started.elapsed().as_secs_f64());
    estate.patroni.push(patroni(1));
    until("pg1 the synchronous standby", 90, &dir, async || {
        (http_status(NODES[1].1, "/sync") == Some(200)).then_some(())
    })
    .await;
    eprintln!("phase: pg1 sync at {:.1} s", started.elapsed().as_secs_f64());
    estate.haproxy = Some(Proc::spawn(
        Command::new("haproxy").args(["-db", "-f"]).arg(dir.join("haproxy.cfg")),
        &dir.join("haproxy.log"),
    ));
    let db_ca = dir.join("db-ca.crt");
    let url = |user: &str, password: &str, database: &str, ca: &Path| {
        format!(
            "postgres://{user}:{password}@127.0.0.1:{HAPROXY_PORT}/{database}?sslmode=verify-full&sslrootcert={}",
            ca.display()
        )
    };

    // The DBA's part: two roles, neither a superuser, and the database the owner owns.
    let su = url("postgres", SUPERUSER_PASSWORD, "postgres", &db_ca);
    let admin = until("HAProxy reaching the primary", 30, &dir, async || {
        innerwall_control_plane::postgres::pool_options().max_connections(1).connect(&su).await.ok()
    })
    .await;
    for sql in [
        "CREATE ROLE innerwall_owner LOGIN PASSWORD 'owner-secret'",
        "CREATE ROLE innerwall LOGIN PASSWORD 'app-secret'",
        "CREATE DATABASE innerwall OWNER innerwall_owner",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&admin).await.unwrap();
    }
    admin.close().await;
    let owner_url = url("innerwall_owner", "owner-secret", "innerwall", &db_ca);
    let app_url = url("innerwall", "app-secret", "innerwall", &db_ca);

    // TLS is required and verified: plain TCP is refused by the server, a certificate not of the
    // database's CA by the client.
    let plain = format!("postgres://innerwall:app-secret@127.0.0.1:{HAPROXY_PORT}/innerwall?sslmode=disable");
    let refused = PgPool::connect(&plain).await.unwrap_err().to_string();
    assert!(refused.contains("pg_hba.conf rejects"), "{refused}");
    let wrong_ca = url("innerwall", "app-secret", "innerwall", &dir.join("other-ca.crt"));
    let refused = PgPool::connect(&wrong_ca).await.unwrap_err().to_string();
    assert!(refused.to_lowercase().contains("certificate"), "{refused}");

    eprintln!("phase: dba done at {:.1} s", started.elapsed().as_secs_f64());
    // The owner migrates and grants the replicas' role; everything else runs as that role.
    let cli = dir.join("cli");
    std::fs::create_dir_all(&cli).unwrap();
    let said = innerwall(&owner_url, &cli, &["migrate", "--runtime-role", "innerwall"]);
    assert!(said.contains("role innerwall granted"), "{said}");
    innerwall(&app_url, &cli, &["ca", "init"]);
    innerwall(&app_url, &cli, &["service", "create", "ssh", "--entry", "tcp:22"]);
    std::fs::write(dir.join("web.yaml"), "name: web\nscope: {app: [web]}\nrules:\n  - name: ssh\n    peers:\n      - cidr: 192.0.2.0/24\n    services: [ssh]\n").unwrap();
    innerwall(&app_url, &cli, &["ruleset", "create", "-f", dir.join("web.yaml").to_str().unwrap()]);

    eprintln!("phase: policy made at {:.1} s", started.elapsed().as_secs_f64());
    // Two replicas, each reached by one agent over its own link.
    let mut agent_namespaces = Vec::new();
    let mut links = Vec::new();
    for i in 0..PAIRS {
        let ns_name = format!("iw-ha{i}-{}", std::process::id());
        let ns = Namespace::create(ns_name.clone());
        let (hub_end, agent_end) = (format!("10.90.{i}.1/24"), format!("10.90.{i}.2/24"));
        let link = format!("ha{i}");
        for args in [
            vec!["link", "add", &link, "type", "veth", "peer", "name", "up0", "netns", &ns_name],
            vec!["address", "add", &hub_end, "dev", &link],
            vec!["link", "set", &link, "up"],
            vec!["-n", &ns_name, "address", "add", &agent_end, "dev", "up0"],
            vec!["-n", &ns_name, "link", "set", "up0", "up"],
        ] {
            run(Command::new("ip").args(&args));
        }
        links.push(ns_name);
        agent_namespaces.push(ns);
    }
    let serve_logs: Vec<PathBuf> = (0..PAIRS).map(|i| dir.join(format!("serve{i}.log"))).collect();
    for (i, log) in serve_logs.iter().enumerate() {
        let state = dir.join(format!("serve{i}"));
        std::fs::create_dir_all(&state).unwrap();
        estate.serves.push(Proc::spawn(
            Command::new(innerwall_e2e::workspace_bin("innerwall"))
                .env_remove("INNERWALL_CONFIG")
                .args(["--database-url", &app_url, "--state-dir"])
                .arg(&state)
                .arg("--ca-dir")
                .arg(cli.join("ca"))
                .args([
                    "serve",
                    "--listen",
                    &format!("10.90.{i}.1:7443"),
                    "--server-name",
                    &format!("10.90.{i}.1"),
                ])
                .args(["--heartbeat-interval", "2s"])
                .env("INNERWALL_LOG", "info"),
            log,
        ));
    }
    for log in &serve_logs {
        until("serve listening", 60, &dir, async || {
            (bridge_connects(log) >= 1
                && std::fs::read_to_string(log).unwrap_or_default().contains("listening on"))
            .then_some(())
        })
        .await;
    }
    eprintln!("phase: serves up at {:.1} s", started.elapsed().as_secs_f64());
    let mut ids = Vec::new();
    for (i, ns_name) in links.iter().enumerate() {
        let minted = innerwall(&app_url, &cli, &["--json", "token", "mint", "--label", "app=web"]);
        let minted: serde_json::Value = serde_json::from_str(&minted).unwrap();
        let token_file = dir.join(format!("token{i}"));
        std::fs::write(&token_file, minted["token"].as_str().unwrap()).unwrap();
        let state = dir.join(format!("agent{i}"));
        let server = format!("10.90.{i}.1:7443");
        run(Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns_name}"))
            .arg(innerwall_e2e::workspace_bin("innerwall-agent"))
            .args(["enroll", "--server", &server, "--token-file"])
            .arg(&token_file)
            .arg("--ca-bundle")
            .arg(cli.join("ca/ca.crt"))
            .arg("--state-dir")
            .arg(&state));
        estate.agents.push(Proc::spawn(
            Command::new("nsenter")
                .arg(format!("--net=/run/netns/{ns_name}"))
                .arg(innerwall_e2e::workspace_bin("innerwall-agent"))
                .args(["run", "--server", &server, "--state-dir"])
                .arg(&state)
                .env("INNERWALL_AGENT_LOG", "info"),
            &dir.join(format!("agent{i}.log")),
        ));
        let workloads: serde_json::Value =
            serde_json::from_str(&innerwall(&app_url, &cli, &["--json", "workload", "list"])).unwrap();
        let id = workloads
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["id"].as_str().unwrap().to_owned())
            .find(|w| !ids.iter().any(|i: &WorkloadId| i.to_string() == *w))
            .unwrap();
        innerwall(&app_url, &cli, &["workload", "mode", &id, "enforcement", "--override", "the HA test"]);
        ids.push(id.parse::<WorkloadId>().unwrap());
    }
    eprintln!("phase: agents enrolled at {:.1} s", started.elapsed().as_secs_f64());
    let pool =
        innerwall_control_plane::postgres::pool_options().max_connections(4).connect(&app_url).await.unwrap();
    let synced = async |pool: &PgPool| {
        let all = states(pool, &ids).await?;
        all.iter()
            .all(|(state, applied, latest)| state == "SYNCED" && Some(*applied) == *latest)
            .then_some(all)
    };
    until("both agents SYNCED and enforcing", 60, &dir, async || synced(&pool).await).await;
    eprintln!("figures: estate up in {:.1} s", started.elapsed().as_secs_f64());

    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_tables(links.clone(), stop.clone());
    let acked: Acknowledged = Arc::default();
    let writer_pool =
        innerwall_control_plane::postgres::pool_options().max_connections(2).connect(&app_url).await.unwrap();
    let writing = tokio::spawn(writer(writer_pool, acked.clone(), stop.clone()));

    for (round, how) in ["the primary's postmaster killed", "the primary's Patroni killed"].iter().enumerate()
    {
        let old = primary().expect("a primary before the kill");
        let (old_port, _) = NODES[old];
        // Commits are being acknowledged by the old primary before it dies.
        let before = acked.lock().unwrap().len();
        until("commits acknowledged before the kill", 30, &dir, async || {
            (acked.lock().unwrap().len() > before + 3).then_some(())
        })
        .await;
        let connects: Vec<usize> = serve_logs.iter().map(|l| bridge_connects(l)).collect();
        let killed_at = Instant::now();
        if round == 0 {
            let pid = postmaster(&dir.join(format!("pg{old}"))).expect("the primary's postmaster.pid");
            kill(pid, Signal::SIGKILL).unwrap();
        } else {
            kill(estate.patroni[old].pid(), Signal::SIGKILL).unwrap();
        }
        let new = 1 - old;
        let (new_port, _) = NODES[new];
        let first_commit = until("a commit acknowledged by the new primary", 90, &dir, async || {
            acked
                .lock()
                .unwrap()
                .iter()
                .find(|(_, port, at)| *port == new_port && *at > killed_at)
                .map(|(_, _, at)| *at - killed_at)
        })
        .await;
        // A policy change after the failover reaches every agent, through both replicas.
        std::fs::write(dir.join("more.yaml"), format!("name: more{round}\nscope: {{app: [web]}}\nrules:\n  - name: ssh\n    peers:\n      - cidr: 198.51.100.{round}/32\n    services: [ssh]\n")).unwrap();
        innerwall(&app_url, &cli, &["ruleset", "create", "-f", dir.join("more.yaml").to_str().unwrap()]);
        let cidr = format!("198.51.100.{round}/32");
        let changed = until("every agent SYNCED at the changed policy", 90, &dir, async || {
            let all = synced(&pool).await?;
            let mut conn = pool.acquire().await.ok()?;
            for id in &ids {
                let (policy, _) = store::persisted_policy(&mut conn, *id).await.ok()??;
                policy.rules().any(|r| r.peers().iter().any(|c| c.to_string() == cidr)).then_some(())?;
            }
            Some(all)
        })
        .await;
        let all_synced = killed_at.elapsed();
        // Each replica's NOTIFY bridge lost the old primary and listens on the new one. Agents
        // may be SYNCED before that (a stream's reconnect carries the policy too), so wait.
        for (log, before) in serve_logs.iter().zip(&connects) {
            until(&format!("{}: the NOTIFY bridge reconnected", log.display()), 60, &dir, async || {
                (bridge_connects(log) > *before).then_some(())
            })
            .await;
        }
        let bridges = killed_at.elapsed();
        let acked_old =
            acked.lock().unwrap().iter().filter(|(_, port, at)| *port == old_port && *at < killed_at).count();
        eprintln!(
            "figures: failover {} ({how}): first commit on the new primary {:.1} s after the kill, every agent SYNCED at the next policy {:.1} s after it, both bridges listening {:.1} s after it; {acked_old} commits acknowledged by the old primary before it; states {changed:?}",
            round + 1,
            first_commit.as_secs_f64(),
            all_synced.as_secs_f64(),
            bridges.as_secs_f64()
        );
        assert_eq!(primary(), Some(new), "Patroni's primary after the failover");
        if round == 0 {
            // The old primary rejoins (rewound) as the synchronous standby before the next kill.
            until("the old primary back as the synchronous standby", 120, &dir, async || {
                (http_status(NODES[old].1, "/sync") == Some(200)).then_some(())
            })
            .await;
        }
    }

    stop.store(true, Ordering::Relaxed);
    let failures = writing.await.unwrap();
    let (samples, missing) = watcher.join().unwrap();
    assert!(missing.is_none(), "an agent's table was not enforcing at a sample: {}", missing.unwrap());
    // No acknowledged commit is lost.
    let stored: BTreeSet<String> =
        sqlx::query_scalar("SELECT name FROM services").fetch_all(&pool).await.unwrap().into_iter().collect();
    let acked = acked.lock().unwrap().clone();
    let lost: Vec<u32> =
        acked.iter().map(|(n, _, _)| *n).filter(|n| !stored.contains(&format!("w{n}"))).collect();
    assert!(lost.is_empty(), "acknowledged commits lost: {lost:?}");
    eprintln!(
        "figures: {} commits acknowledged, {failures} failed (during the failovers), 0 lost; {samples} samples of both agents' tables, all enforcing",
        acked.len()
    );
    drop(estate);
    drop(agent_namespaces);
    let _ = std::fs::remove_dir_all(&dir);
}
