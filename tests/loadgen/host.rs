//! One real agent beside the simulated ones (issue 33 item 4): the `innerwall-agent` binary in a
//! network namespace of its own, enrolled through its own CLI, enforcing with real nftables and
//! persisting every version it installs (fsync), so the propagation figure includes a host's own
//! apply. It dials the replica as `localhost:PORT` through a relay: a listener inside the
//! namespace on the replica's port whose connections the load generator copies to the replica
//! on the machine's loopback (the namespace's loopback is its own). Everything is removed when
//! it is dropped: the agent killed by PID, the namespace (its table and tc programs with it).

use std::net::IpAddr;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use chrono::{DateTime, Utc};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use sqlx::PgPool;

use crate::fleet::Fleet;

/// The real agent's address, in the agents' range above every simulated agent's.
const ADDRESS: &str = "10.200.254.1/16";

pub struct RealAgent {
    pub id: WorkloadId,
    namespace: String,
    child: Child,
    relay: tokio::task::JoinHandle<()>,
    state: PathBuf,
}

impl RealAgent {
    /// Creates the namespace and the relay to replica `replica`, enrolls the agent with a
    /// token of its own, starts it, puts its workload in enforcement (so its table holds the
    /// rules) and waits until it is SYNCED.
    pub async fn start(fleet: &Fleet, replica: usize) -> anyhow::Result<RealAgent> {
        ensure!(
            nix::unistd::geteuid().is_root(),
            "--real-agent runs innerwall-agent in a network namespace and needs root"
        );
        let bin = std::env::current_exe()?.with_file_name("innerwall-agent");
        if !bin.is_file() {
            bail!("{} is missing: build it with the load generator (cargo xtask bench does)", bin.display());
        }
        let namespace = format!("iw-load-{}", std::process::id());
        create_namespace(&namespace)?;
        let port = fleet.replicas[replica].port;
        let relay = match relay(&namespace, port).await {
            Ok(relay) => relay,
            Err(e) => {
                delete_namespace(&namespace);
                return Err(e);
            }
        };
        let state = fleet.dir.join("real-agent");
        // From here on, dropping `agent` removes the namespace and stops the relay.
        let mut agent =
            RealAgent { id: WorkloadId::new_random(), namespace, child: placeholder()?, relay, state };
        std::fs::create_dir_all(&agent.state)?;
        let token = agent.state.join("token");
        std::fs::write(&token, fleet.mint(1).await?)?;
        let ca = agent.state.join("ca.pem");
        std::fs::write(&ca, fleet.ca_pem())?;
        let server = format!("localhost:{port}");
        let mut enroll = agent.in_namespace(&bin);
        enroll.args(["enroll", "--state-dir"]).arg(&agent.state).args(["--server", &server, "--token-file"]);
        enroll.arg(&token).arg("--ca-bundle").arg(&ca);
        let enroll = tokio::task::spawn_blocking(move || enroll.output())
            .await?
            .context("running innerwall-agent enroll")?;
        ensure!(
            enroll.status.success(),
            "innerwall-agent enroll failed: {}",
            String::from_utf8_lossy(&enroll.stderr)
        );
        agent.id = innerwall_agent::identity::credential::Credential::load(&agent.state)?.id;
        let log = std::fs::File::create(agent.state.join("agent.log"))?;
        agent.child = agent
            .in_namespace(&bin)
            .args(["run", "--state-dir"])
            .arg(&agent.state)
            .args(["--server", &server])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning innerwall-agent run")?;
        set_mode(fleet.pool(), agent.id, Mode::Enforcement).await?;
        agent.wait_synced(fleet.pool(), Duration::from_secs(60)).await?;
        Ok(agent)
    }

    /// `ip netns exec NAMESPACE bin`: `ip` enters the namespace and execs the binary, so the
    /// child's PID is the agent's.
    fn in_namespace(&self, bin: &Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.namespace]).arg(bin);
        command
    }

    /// Waits until the database has the agent SYNCED at its latest version.
    pub async fn wait_synced(&self, pool: &PgPool, limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let synced: bool = sqlx::query_scalar(
                "SELECT w.sync_state = 2 AND w.applied_version = p.version
                 FROM workloads w JOIN workload_policies p ON p.workload_id = w.id WHERE w.id = $1",
            )
            .bind(self.id.uuid())
            .fetch_optional(pool)
            .await?
            .unwrap_or(false);
            if synced {
                return Ok(());
            }
            if started.elapsed() > limit {
                bail!("the real agent was not SYNCED within {limit:?}; its log: {}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How long after `committed` (the database's clock) the agent's acknowledgement of
    /// `version` or a later one was recorded: the replica's push, the agent's nftables apply and
    /// fsync, its ack, and the ack's write. Waits up to `limit`.
    pub async fn acked_after(
        &self,
        pool: &PgPool,
        version: u64,
        committed: DateTime<Utc>,
        limit: Duration,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            let acked: Option<DateTime<Utc>> = sqlx::query_scalar(
                "SELECT last_acked_at FROM workloads WHERE id = $1 AND applied_version >= $2",
            )
            .bind(self.id.uuid())
            .bind(i64::try_from(version)?)
            .fetch_optional(pool)
            .await?
            .flatten();
            if let Some(at) = acked {
                return Ok((at - committed).to_std().unwrap_or_default());
            }
            if started.elapsed() > limit {
                bail!(
                    "the real agent did not acknowledge v{version} within {limit:?}; its log: {}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Its table in its namespace, as `nft` lists it.
    pub fn table(&self) -> anyhow::Result<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.namespace, "nft", "list", "table", "inet", "innerwall"])
            .output()?;
        ensure!(out.status.success(), "nft list table: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn log(&self) -> String {
        crate::replica::tail(&self.state.join("agent.log"))
    }
}

impl Drop for RealAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.relay.abort();
        delete_namespace(&self.namespace);
    }
}

/// A child that has exited, standing in until the agent is spawned (so a failed enrollment
/// drops a `RealAgent` that cleans up after itself).
fn placeholder() -> anyhow::Result<Child> {
    let mut child = Command::new("true").spawn().context("spawning true")?;
    child.wait()?;
    Ok(child)
}

/// `ip netns add`, its loopback up, and a veth pair (both ends inside) carrying the agent's
/// address, for the capture to attach to and the inventory to report.
fn create_namespace(name: &str) -> anyhow::Result<()> {
    let steps: [&[&str]; 6] = [
        &["netns", "add", name],
        &["-n", name, "link", "set", "lo", "up"],
        &["-n", name, "link", "add", "iw0", "type", "veth", "peer", "name", "iw1"],
        &["-n", name, "address", "add", ADDRESS, "dev", "iw0"],
        &["-n", name, "link", "set", "iw0", "up"],
        &["-n", name, "link", "set", "iw1", "up"],
    ];
    for (n, args) in steps.iter().enumerate() {
        let status = Command::new("ip").args(*args).status().context("running ip")?;
        if !status.success() {
            if n > 0 {
                delete_namespace(name);
            }
            bail!("ip {} failed", args.join(" "));
        }
    }
    Ok(())
}

fn delete_namespace(name: &str) {
    let _ = Command::new("ip").args(["netns", "del", name]).status();
}

/// A listener on `127.0.0.1:port` inside the namespace whose connections are copied to the
/// same port on this machine's loopback, until the returned task is aborted.
async fn relay(namespace: &str, port: u16) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let path = format!("/run/netns/{namespace}");
    // A thread of its own enters the namespace, so the socket is made there; the runtime's
    // threads stay in the machine's namespace, where the replica is.
    let listener = std::thread::spawn(move || -> anyhow::Result<std::net::TcpListener> {
        let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
        nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the relay's thread panicked"))??;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let replica = std::net::SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port);
    Ok(tokio::spawn(async move {
        while let Ok((mut inside, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outside) = tokio::net::TcpStream::connect(replica).await {
                    let _ = inside.set_nodelay(true);
                    let _ = outside.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
                }
            });
        }
    }))
}

async fn set_mode(pool: &PgPool, id: WorkloadId, mode: Mode) -> anyhow::Result<()> {
    innerwall_control_plane::foresight::commit(
        pool,
        "loadgen",
        "workload.mode",
        &id.to_string(),
        async |c| {
            innerwall_control_plane::policy::authoring::set_mode(c, id, mode).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await?;
    Ok(())
}
