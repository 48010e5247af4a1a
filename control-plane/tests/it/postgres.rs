//! The Postgres test harness (`testing::fresh_database`) and the embedded cluster of the CLI.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use innerwall_control_plane::identity::tokens;
use innerwall_control_plane::postgres::{self, Cluster, MIGRATOR};
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::proto;

async fn probe_table_exists(db: &TestDatabase) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar("SELECT to_regclass('public.probe') IS NOT NULL").fetch_one(&db.pool).await?)
}

#[tokio::test]
async fn fresh_databases_are_migrated_empty_and_independent() -> anyhow::Result<()> {
    let started = Instant::now();
    let a = fresh_database().await?;
    let first = started.elapsed();
    let started = Instant::now();
    let b = fresh_database().await?;
    let second = started.elapsed();
    eprintln!("timing: fresh_database first call {first:?} (may include the server start), next {second:?}");
    // Where the server is (`private_server_goes_when_its_process_exits` reads it).
    println!("first database: {}", postgres::redact_url(&a.url));

    assert_ne!(a.name, b.name);
    assert_ne!(a.url, b.url);
    for db in [&a, &b] {
        let current: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&db.pool).await?;
        assert_eq!(current, db.name);
        let applied: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(&db.pool)
                .await?;
        let expected: Vec<i64> =
            MIGRATOR.iter().filter(|m| !m.migration_type.is_down_migration()).map(|m| m.version).collect();
        assert_eq!(applied, expected, "{} is not fully migrated", db.name);
        assert!(!probe_table_exists(db).await?, "{} is not fresh", db.name);
    }

    sqlx::raw_sql("CREATE TABLE probe (v int); INSERT INTO probe VALUES (42)").execute(&a.pool).await?;
    let v: i32 = sqlx::query_scalar("SELECT v FROM probe").fetch_one(&a.pool).await?;
    assert_eq!(v, 42);
    assert!(!probe_table_exists(&b).await?, "a write to {} is visible in {}", a.name, b.name);

    // The URL works on its own, as for code under test that connects by itself.
    let pool = postgres::connect(&b.url).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
    assert_eq!(one, 1);
    Ok(())
}

/// A test process leaves no private server behind: this test binary runs the test above alone in
/// a process of its own, with a temp directory of its own and no external server, so that process
/// starts a private server there; once it has exited, the directory is empty.
#[test]
fn private_server_goes_when_its_process_exits() -> anyhow::Result<()> {
    /// Removed when dropped, also on panic. Short: the server's socket path must fit 107 bytes.
    struct Tmp(PathBuf);
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let tmp = Tmp(
        std::env::temp_dir().join(format!("iw-exit-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]))
    );
    std::fs::create_dir(&tmp.0)?;
    let output = std::process::Command::new(std::env::current_exe()?)
        .args(["postgres::fresh_databases_are_migrated_empty_and_independent", "--exact", "--nocapture"])
        .env("TMPDIR", &tmp.0)
        .env_remove(innerwall_control_plane::testing::DATABASE_URL_ENV)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        output.status.success(),
        "the child test failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let server = format!("host={}/innerwall-pgtest-", tmp.0.display());
    assert!(stdout.contains(&server), "the child's server was not under its temp directory: {stdout}");
    let left: Vec<_> = std::fs::read_dir(&tmp.0)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    assert!(left.is_empty(), "the child test process left {left:?} behind");
    Ok(())
}

/// Twenty callers at once, each on a runtime of its own as under `#[tokio::test]`.
#[test]
fn concurrent_fresh_databases_from_parallel_tests() -> anyhow::Result<()> {
    let threads: Vec<_> = (0..20)
        .map(|i| {
            std::thread::spawn(move || -> anyhow::Result<(String, Duration)> {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                runtime.block_on(async {
                    let started = Instant::now();
                    let db = fresh_database().await.with_context(|| format!("caller {i}"))?;
                    let took = started.elapsed();
                    sqlx::raw_sql("CREATE TABLE probe (v int)").execute(&db.pool).await?;
                    sqlx::query("INSERT INTO probe VALUES ($1)").bind(i).execute(&db.pool).await?;
                    let rows: Vec<i32> =
                        sqlx::query_scalar("SELECT v FROM probe").fetch_all(&db.pool).await?;
                    assert_eq!(rows, vec![i], "{} sees other callers' rows", db.name);
                    Ok((db.name.clone(), took))
                })
            })
        })
        .collect();
    let mut names = std::collections::BTreeSet::new();
    let mut times = Vec::new();
    for thread in threads {
        let (name, took) = thread.join().map_err(|_| anyhow::anyhow!("a caller panicked"))??;
        names.insert(name);
        times.push(took);
    }
    assert_eq!(names.len(), 20, "database names repeat");
    times.sort();
    eprintln!(
        "timing: 20 concurrent fresh_database calls: min {:?}, median {:?}, max {:?}",
        times[0], times[10], times[19]
    );
    Ok(())
}

/// A state directory that stops the cluster in it and removes it when dropped, also on panic.
pub(crate) struct StateDir(pub(crate) PathBuf);

impl StateDir {
    pub(crate) fn new() -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("innerwall-embedded-it-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&dir)?;
        Ok(StateDir(dir))
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if let Ok(cluster) = postgres::embedded_cluster(&self.0)
            && let Err(e) = cluster.stop()
        {
            eprintln!("warning: could not stop the embedded test cluster: {e:#}");
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn identity(path: &Path) -> anyhow::Result<(u64, SystemTime)> {
    let meta = std::fs::metadata(path).with_context(|| path.display().to_string())?;
    Ok((meta.ino(), meta.modified()?))
}

pub(crate) fn ready_count(cluster: &Cluster) -> anyhow::Result<usize> {
    let log = std::fs::read_to_string(cluster.log_file())?;
    Ok(log.matches("database system is ready to accept connections").count())
}

/// Whether `pid` is gone or a zombie (the daemon's parent is init, which reaps when it likes).
fn exited_within(pid: u32, timeout: Duration) -> bool {
    let started = Instant::now();
    loop {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(stat) if stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')) => return true,
            Ok(_) if started.elapsed() > timeout => return false,
            Ok(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

pub(crate) fn stop_and_check_gone(cluster: &Cluster) -> anyhow::Result<()> {
    let pid = cluster.postmaster_pid().context("no postmaster.pid while running")?;
    cluster.stop()?;
    assert!(exited_within(pid, Duration::from_secs(5)), "postmaster {pid} still runs after stop");
    assert!(!cluster.is_running()?);
    Ok(())
}

#[tokio::test]
async fn embedded_cluster_is_initialized_once_and_reused() -> anyhow::Result<()> {
    let state = StateDir::new()?;

    // Two first invocations at once: one inits and starts, the other waits on the lock and reuses.
    let started = Instant::now();
    let (url1, url2) = tokio::join!(postgres::embedded(&state.0), postgres::embedded(&state.0));
    let (url1, url2) = (url1?, url2?);
    eprintln!("timing: embedded() first start (initdb + pg_ctl start) {:?}", started.elapsed());
    assert_eq!(url1, url2);

    let cluster = postgres::embedded_cluster(&state.0)?;
    let pg_version = cluster.data_dir().join("PG_VERSION");
    let initialized = identity(&pg_version)?;
    let port = cluster.port()?;
    let pid = cluster.postmaster_pid().context("no postmaster.pid")?;
    assert!(url1.contains(&format!("@127.0.0.1:{port}/innerwall")), "{url1}");
    assert_eq!(ready_count(&cluster)?, 1);

    let pool = postgres::connect(&url1).await?;
    let db: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&pool).await?;
    assert_eq!(db, "innerwall");
    sqlx::raw_sql("CREATE TABLE probe (v int); INSERT INTO probe VALUES (7)").execute(&pool).await?;
    pool.close().await;

    // A later invocation finds it running: same server, same port, no second initdb.
    let started = Instant::now();
    let url3 = postgres::embedded(&state.0).await?;
    eprintln!("timing: embedded() with the server running {:?}", started.elapsed());
    assert_eq!(url3, url1);
    assert_eq!(cluster.postmaster_pid(), Some(pid));
    assert_eq!(identity(&pg_version)?, initialized);
    assert_eq!(ready_count(&cluster)?, 1);

    // Stopped, the next invocation restarts the same cluster on the same port with its data.
    stop_and_check_gone(&cluster)?;
    let started = Instant::now();
    let url4 = postgres::embedded(&state.0).await?;
    eprintln!("timing: embedded() restarting a stopped cluster {:?}", started.elapsed());
    assert_eq!(url4, url1);
    assert_ne!(cluster.postmaster_pid(), Some(pid));
    assert_eq!(identity(&pg_version)?, initialized);
    assert_eq!(ready_count(&cluster)?, 2);
    // A stale port file does not send callers to the wrong port: the running server's
    // postmaster.pid says where it listens, and the file is repaired.
    std::fs::write(cluster.port_file(), "1\n")?;
    assert_eq!(postgres::embedded(&state.0).await?, url1);
    assert_eq!(cluster.port()?, port);
    let pool = postgres::connect(&url4).await?;
    let v: i32 = sqlx::query_scalar("SELECT v FROM probe").fetch_one(&pool).await?;
    assert_eq!(v, 7);
    pool.close().await;
    stop_and_check_gone(&cluster)?;

    // A lost data directory is refused, never replaced by an empty cluster; put back, it runs.
    let aside = state.0.join("data-aside");
    std::fs::rename(cluster.data_dir(), &aside)?;
    let err = postgres::embedded(&state.0).await.unwrap_err().to_string();
    assert!(err.contains("was initialized before"), "{err}");
    assert!(!cluster.data_dir().exists(), "no new data directory");
    std::fs::rename(&aside, cluster.data_dir())?;
    let pool = postgres::connect(&postgres::embedded(&state.0).await?).await?;
    let v: i32 = sqlx::query_scalar("SELECT v FROM probe").fetch_one(&pool).await?;
    assert_eq!(v, 7);
    pool.close().await;

    stop_and_check_gone(&cluster)?;
    Ok(())
}

pub(crate) fn innerwall_embedded(state: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .env_remove("INNERWALL_DATABASE_URL")
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .output()
        .unwrap()
}

/// Issue 26, item 7: `--init` creates the cluster; a command that started the server stops it
/// when it ends, and the next command starts the same cluster with the same data; a server that
/// was running (as under `serve`) is used and left running.
#[tokio::test]
async fn cli_without_database_url_runs_and_reuses_the_embedded_cluster() -> anyhow::Result<()> {
    let state = StateDir::new()?;
    let out = innerwall_embedded(&state.0, &["--init", "service", "create", "web", "--entry", "tcp:443"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cluster = postgres::embedded_cluster(&state.0)?;
    assert!(!cluster.is_running()?, "the command stopped the server it started");
    assert_eq!(ready_count(&cluster)?, 1);

    // A second invocation is a new process that starts the same cluster with the same data.
    let out = innerwall_embedded(&state.0, &["--json", "service", "list"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let services: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(services[0]["name"], "web");
    assert_eq!(services[0]["entries"], serde_json::json!(["tcp:443"]));
    assert!(!cluster.is_running()?, "stopped again");
    assert_eq!(ready_count(&cluster)?, 2);

    // Running already (started as `serve` starts it): used, and left running, twice.
    postgres::embedded(&state.0).await?;
    let pid = cluster.postmaster_pid().context("the embedded cluster is not running")?;
    for _ in 0..2 {
        let out = innerwall_embedded(&state.0, &["--json", "service", "list"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(cluster.postmaster_pid(), Some(pid), "reused, not restarted");
        assert!(cluster.is_running()?);
    }
    assert_eq!(ready_count(&cluster)?, 3);
    stop_and_check_gone(&cluster)
}

/// Enrolls one host on the replica at `addr` with `token` (server-authenticated TLS, as agents
/// enroll).
async fn enroll_at(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    token: &str,
) -> Result<proto::EnrollResponse, tonic::Status> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://localhost:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (_, csr_pem) = crate::enrollment::key_and_csr();
    let request = proto::EnrollRequest { provisioning_token: token.into(), csr_pem, ..Default::default() };
    proto::enrollment_service_client::EnrollmentServiceClient::new(channel)
        .enroll(request)
        .await
        .map(tonic::Response::into_inner)
}

/// Issue 16, item 4: under `serve`, the embedded cluster's postmaster dies (SIGKILL, by the pid
/// in `postmaster.pid`). While it is down — held down here by holding the cluster lock, as a
/// concurrent `innerwall` command starting it would — every pool and the service fail with a
/// clear UNAVAILABLE error after the acquire timeout instead of hanging; the supervisor
/// restarts it when it can, and the same replica then enrolls again on the same data.
#[tokio::test]
async fn database_stalls_are_bounded_when_the_postmaster_dies() -> anyhow::Result<()> {
    use innerwall_control_plane::identity::ca::{FileCa, Signer};
    use innerwall_control_plane::postgres::{Health, PoolConfig, Pools, PoolsConfig, Supervisor};
    use innerwall_control_plane::service;

    let state = StateDir::new()?;
    let url = postgres::embedded(&state.0).await?;
    let cluster = postgres::embedded_cluster(&state.0)?;
    // Short acquire waits keep the test quick; the bound they set is what is checked.
    let quick = |c: PoolConfig| PoolConfig { acquire: Duration::from_secs(2), ..c };
    let config = PoolsConfig {
        streams: quick(PoolConfig::STREAMS),
        ingest: quick(PoolConfig::INGEST),
        authoring: quick(PoolConfig::AUTHORING),
    };
    let pools = Pools::connect(&url, &config).await?;
    let supervisor = Supervisor::new(&state.0, url.clone()).await?.check_every(Duration::from_millis(100));
    let mut health = supervisor.health();
    let supervising = tokio::spawn(supervisor.run(pools.clone()));

    let ca_dir = state.0.join("ca");
    let signer = Arc::new(FileCa::init(&ca_dir)?);
    let running =
        service::start(pools.clone(), signer.clone(), innerwall_control_plane::testing::loopback_service())
            .await?;
    let token = {
        let mut conn = pools.authoring.acquire().await?;
        let labels = vec!["app=web".parse()?];
        tokens::mint(&mut conn, &labels, chrono::Duration::days(1), None, &[]).await?.secret
    };
    let first = enroll_at(running.local_addr, &signer.ca_bundle_pem(), &token).await?;

    // Hold the cluster lock so that nothing can start it again, then kill the postmaster.
    let lock = cluster.lock()?;
    let pid = cluster.postmaster_pid().context("no postmaster.pid")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)?;
    tokio::time::timeout(Duration::from_secs(60), health.wait_for(|h| matches!(h, Health::Down { .. })))
        .await
        .context("the supervisor never noticed the dead postmaster")??;

    // Bounded and clear: each call returns (the guard only catches a hang) with an error that
    // says the database is unavailable, and the service maps it to UNAVAILABLE.
    let hang_guard = Duration::from_secs(60);
    for (job, pool) in
        [("streams", &pools.streams), ("ingest", &pools.ingest), ("authoring", &pools.authoring)]
    {
        let result = tokio::time::timeout(hang_guard, sqlx::query("SELECT 1").execute(pool))
            .await
            .with_context(|| format!("a query on the {job} pool hung while the database was down"))?;
        let err = innerwall_control_plane::error::Error::from(result.expect_err("the database is down"));
        assert_eq!(err.kind(), innerwall_control_plane::error::Kind::Busy, "{job}: {err}");
        assert!(err.to_string().starts_with("database: unavailable"), "{job}: {err}");
    }
    let refused =
        tokio::time::timeout(hang_guard, enroll_at(running.local_addr, &signer.ca_bundle_pem(), &token))
            .await
            .context("enrollment hung while the database was down")?
            .expect_err("enrollment cannot succeed without a database");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("the server is down or every connection is busy"), "{refused:?}");

    // Let it be started: the supervisor brings it back, and the same replica works again.
    drop(lock);
    tokio::time::timeout(
        Duration::from_secs(120),
        health.wait_for(|h| matches!(h, Health::Up { restarts: 1, .. })),
    )
    .await
    .context("the supervisor never brought the postmaster back")??;
    let Health::Up { pid: new_pid, .. } = health.borrow().clone() else { unreachable!() };
    assert_ne!(new_pid, pid);
    assert_eq!(cluster.postmaster_alive(), Some(new_pid));
    let second = enroll_at(running.local_addr, &signer.ca_bundle_pem(), &token).await?;
    let enrolled: Vec<String> =
        sqlx::query_scalar("SELECT 'innerwall://workload/' || id FROM workloads ORDER BY created_at")
            .fetch_all(&pools.streams)
            .await?;
    assert_eq!(enrolled, [first.workload_id, second.workload_id], "the same data, not a new cluster");

    running.stop().await?;
    supervising.abort();
    pools.streams.close().await;
    pools.ingest.close().await;
    pools.authoring.close().await;
    stop_and_check_gone(&cluster)
}
