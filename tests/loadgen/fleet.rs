//! The fleet under load: a fresh database and CA, replicas of `innerwall serve`, a policy that
//! scopes every agent, and N simulated agents — each enrolled through the real enrollment path
//! (its own key, CSR and certificate), each holding its own mTLS connection and Sync stream with
//! the agent's own loop (`daemon::hold_stream`: session, `next_policy`, acks, heartbeats,
//! full-jitter backoff), installing into memory instead of nftables. Optionally each agent also
//! closes flow windows judged under its applied policy and ships them with the agent's own
//! queue and uploader (`telemetry::Queue`, `upload_forever`: a connection of its own per drain).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use innerwall_agent::enforce::{EnforceError, Installed, MemoryPolicyStore, PolicyStore};
use innerwall_agent::evidence::flows::{Counters, FlowKey, Window};
use innerwall_agent::evidence::telemetry::{DEFAULT_MAX_WINDOWS, Queue, upload_forever};
use innerwall_agent::identity::connect::RunConfig;
use innerwall_agent::sync::Agent as Shared;
use innerwall_control_plane::identity::ca::{FileCa, Signer as _};
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_control_plane::testing::{self, TestDatabase};
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Protocol, WorkloadPolicy};
use sqlx::PgPool;

use crate::replica::{Replica, ReplicaConfig};

/// Agents' addresses: one each, from this range (the estate range and the token's range).
const AGENT_RANGE: &str = "10.200.0.0/16";
/// Agents and agentless peers a fleet can have: their addresses do not overlap.
pub const MAX_AGENTS: usize = 65_000;
pub const MAX_PEERS: usize = 250;
/// Enrollments in flight at once (the replica admits 256 unauthenticated connections).
pub const ENROLL_CONCURRENCY: usize = 192;

/// What the fleet is made of.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub agents: usize,
    pub replicas: usize,
    pub heartbeat: Duration,
    /// Agentless peers that `change` can move into every agent's peer set, one per change.
    pub spare_peers: usize,
    /// Flow windows each agent closes and uploads, if any.
    pub flows: Option<FlowLoad>,
    /// The HTTP/2 stream window (`RunConfig::stream_window`) of the first agents, so many of
    /// them (those a slow run stalls); the others keep the default.
    pub stream_window: Option<(u32, usize)>,
}

/// Flow evidence each agent produces: `windows_per_minute` windows of `records` records each.
#[derive(Debug, Clone, Copy)]
pub struct FlowLoad {
    pub windows_per_minute: u32,
    pub records: usize,
}

pub struct Fleet {
    pub db: TestDatabase,
    pub dir: PathBuf,
    /// The simulated agents' state directories ([`agents_root`]).
    agents_dir: PathBuf,
    pub replicas: Vec<Replica>,
    pub agents: Vec<Agent>,
    spares: Vec<WorkloadId>,
    ca_pem: String,
    /// Enrolled, not started yet: (index, id, state directory).
    enrolled: Vec<(usize, WorkloadId, PathBuf)>,
    flows: Option<FlowLoad>,
    stream_window: Option<(u32, usize)>,
    /// Streams the replicas hold besides the simulated agents' (a real agent's).
    pub other_streams: usize,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fleet({} agents, {} replicas)", self.agents.len(), self.replicas.len())
    }
}

/// One simulated agent.
#[derive(Debug)]
pub struct Agent {
    pub id: WorkloadId,
    pub shared: Arc<Shared<LoadStore>>,
    pub log: Arc<ApplyLog>,
    pub stall: Arc<Stall>,
    task: tokio::task::JoinHandle<String>,
}

impl Agent {
    /// Why its loop ended, if it did (a re-enrollment order: an error in every scenario).
    pub fn ended(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a simulated agent installed and when.
#[derive(Debug, Default)]
pub struct ApplyLog {
    /// Every install, a snapshot or a delta.
    pub installs: AtomicU64,
    times: Mutex<Vec<(u64, Instant)>>,
}

impl ApplyLog {
    /// When `version` or a later one was first installed (the agent acks right after), if yet.
    pub fn installed_at(&self, version: u64) -> Option<Instant> {
        let times = self.times.lock().unwrap_or_else(PoisonError::into_inner);
        times.iter().find(|(v, _)| *v >= version).map(|(_, at)| *at)
    }
}

/// Whether an agent reads its stream. A stalled agent blocks in its next install (on the
/// blocking thread the agent runs installs on) until resumed, so it reads nothing more from its
/// stream meanwhile: a host whose agent hangs, as issue 33's slow agents.
#[derive(Debug, Default)]
pub struct Stall {
    stalled: Mutex<bool>,
    resumed: Condvar,
}

impl Stall {
    pub fn stop(&self) {
        *self.stalled.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }

    pub fn resume(&self) {
        *self.stalled.lock().unwrap_or_else(PoisonError::into_inner) = false;
        self.resumed.notify_all();
    }

    fn wait(&self) {
        let mut stalled = self.stalled.lock().unwrap_or_else(PoisonError::into_inner);
        while *stalled {
            stalled = self.resumed.wait(stalled).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// The agent's in-memory store, noting the time of every install.
#[derive(Debug)]
pub struct LoadStore {
    inner: MemoryPolicyStore,
    log: Arc<ApplyLog>,
    stall: Arc<Stall>,
}

impl PolicyStore for LoadStore {
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError> {
        self.stall.wait();
        let installed = self.inner.apply(next)?;
        self.log.installs.fetch_add(1, Ordering::Relaxed);
        let mut times = self.log.times.lock().unwrap_or_else(PoisonError::into_inner);
        // Bounded: a long run keeps the latest installs only.
        if times.len() >= 64 {
            times.drain(..32);
        }
        times.push((next.version(), Instant::now()));
        Ok(installed)
    }

    fn current(&self) -> Option<&WorkloadPolicy> {
        self.inner.current()
    }
}

impl Fleet {
    /// A database, a CA, the replicas, the policy and the spare peers; no agents yet.
    pub async fn create(config: &FleetConfig) -> anyhow::Result<Fleet> {
        if config.agents > MAX_AGENTS || config.spare_peers >= MAX_PEERS {
            bail!("at most {MAX_AGENTS} agents and {} spare peers", MAX_PEERS - 1);
        }
        let db = testing::fresh_database().await.context("starting Postgres")?;
        let dir = std::env::temp_dir().join(format!("iw-loadgen-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir)?;
        let agents_dir = agents_root(&dir);
        std::fs::create_dir_all(&agents_dir)?;
        let ca_pem = FileCa::init(&dir.join("ca")).context("creating the CA")?.ca_bundle_pem();
        let bin = std::env::current_exe()?.with_file_name("innerwall");
        if !bin.is_file() {
            bail!("{} is missing: build it with the load generator (cargo xtask bench does)", bin.display());
        }
        let mut replicas = Vec::new();
        for i in 0..config.replicas.max(1) {
            let replica_config = ReplicaConfig {
                bin: bin.clone(),
                database_url: db.url.clone(),
                ca_dir: dir.join("ca"),
                heartbeat: config.heartbeat,
                log: dir.join(format!("replica-{i}.log")),
            };
            replicas.push(Replica::start(&replica_config).await?);
        }
        let pool = db.pool.clone();
        // Every agent is app=web; web admits tcp/443 from app=client. One client exists; the
        // spares (app=idle) join the clients one per change, which moves every agent's peers.
        testing::admit(&pool, "fleet", ("app", "web"), ("app", "client"), "tcp:443").await?;
        let range = Cidr::parse(AGENT_RANGE)?;
        innerwall_control_plane::foresight::commit(
            &pool,
            "loadgen",
            "estate-range.add",
            AGENT_RANGE,
            async |c| {
                authoring::add_estate_range(c, range, "load generator agents").await?;
                Ok(((), serde_json::json!({})))
            },
        )
        .await?;
        register(&pool, "client-0", "app=client", peer_address(0)).await?;
        let mut spares = Vec::new();
        for i in 0..config.spare_peers {
            spares.push(register(&pool, &format!("spare-{i}"), "app=idle", peer_address(i + 1)).await?);
        }
        Ok(Fleet {
            db,
            dir,
            agents_dir,
            replicas,
            agents: Vec::new(),
            spares,
            ca_pem,
            enrolled: Vec::new(),
            flows: config.flows,
            stream_window: config.stream_window,
            other_streams: 0,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// A provisioning token for `uses` agents of the fleet (`app=web`, addresses in the agents'
    /// range).
    pub async fn mint(&self, uses: usize) -> anyhow::Result<String> {
        let mut conn = self.pool().acquire().await?;
        let labels = vec!["app=web".parse()?];
        let uses = u32::try_from(uses).context("too many agents")?;
        let range = Cidr::parse(AGENT_RANGE)?;
        let minted = innerwall_control_plane::identity::tokens::mint(
            &mut conn,
            &labels,
            chrono::Duration::days(1),
            Some(uses),
            &[range],
        )
        .await?;
        Ok(minted.secret)
    }

    /// The CA bundle agents trust the replicas by.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Enrolls `n` agents through replica 0: one token for all of them (`max_uses` n), and for
    /// each its own key, CSR and certificate. Returns how long it took.
    pub async fn enroll(&mut self, n: usize) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let token = self.mint(n).await?;
        let enroll_server = self.replicas[0].server();
        let first = self.agents.len() + self.enrolled.len();
        let semaphore = Arc::new(tokio::sync::Semaphore::new(ENROLL_CONCURRENCY));
        let mut enrollments = tokio::task::JoinSet::new();
        for i in first..first + n {
            let (server, token, ca_pem) = (enroll_server.clone(), token.clone(), self.ca_pem.clone());
            let state = self.agents_dir.join(format!("a{i}"));
            let permit = semaphore.clone().acquire_owned().await?;
            enrollments.spawn(async move {
                let _permit = permit;
                let enrolled = innerwall_agent::identity::enroll::enroll(
                    &server,
                    &token,
                    &ca_pem,
                    &state,
                    Default::default(),
                )
                .await;
                (i, state, enrolled.map(|e| e.credential.id))
            });
        }
        while let Some(joined) = enrollments.join_next().await {
            let (i, state, id) = joined?;
            self.enrolled.push((i, id.with_context(|| format!("enrolling agent {i}"))?, state));
        }
        Ok(started.elapsed())
    }

    /// Starts every enrolled agent, agent `i` on its own connection to replica `i % replicas`,
    /// from loopback address `127.0.0.(1 + i % SOURCES)`.
    pub fn connect(&mut self) {
        self.enrolled.sort_by_key(|(i, _, _)| *i);
        for (i, id, state) in std::mem::take(&mut self.enrolled) {
            let server = self.replicas[i % self.replicas.len()].server();
            let mut config = RunConfig::new(state, server);
            config.source_address = Some(source_address(i));
            config.stream_window =
                self.stream_window.filter(|(_, first)| i < *first).map(|(window, _)| window);
            self.agents.push(start_agent(i, id, config, self.flows));
        }
    }

    /// Waits until every agent is SYNCED at its latest version in the database and has a
    /// stream open (`streams` at least `min_streams` each), the replicas together hold one
    /// stream per agent, and no agent's loop ended. Returns how long that took.
    pub async fn wait_converged(
        &self,
        min_streams: &BTreeMap<WorkloadId, u64>,
        limit: Duration,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let poll =
            if self.agents.len() > 2_000 { Duration::from_millis(200) } else { Duration::from_millis(25) };
        loop {
            if let Some(agent) = self.agents.iter().find(|a| a.ended()) {
                bail!("agent {} stopped: the control plane ordered a re-enrollment", agent.id);
            }
            let streams_ok = self.agents.iter().all(|a| {
                a.shared.dials.streams.load(Ordering::Relaxed) >= min_streams.get(&a.id).copied().unwrap_or(1)
            });
            if streams_ok
                && self.synced().await? == self.agents.len()
                && self.streams_open().await? == self.agents.len() + self.other_streams
            {
                return Ok(started.elapsed());
            }
            if started.elapsed() > limit {
                bail!(
                    "not converged within {limit:?}: {} of {} SYNCED, {} streams open; replica log: {}",
                    self.synced().await?,
                    self.agents.len(),
                    self.streams_open().await?,
                    crate::replica::tail(&self.dir.join("replica-0.log"))
                );
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Agents the database says are SYNCED with applied = latest.
    pub async fn synced(&self) -> anyhow::Result<usize> {
        self.synced_among(&self.agents).await
    }

    /// Those of `agents` the database says are SYNCED with applied = latest: the state operators
    /// are shown (`shown::STATE`), in one statement. (`store::sync_status` reads every
    /// workload's address issues too, which the load generator's polling needs not make the
    /// database do while it measures.)
    pub async fn synced_among(&self, agents: &[Agent]) -> anyhow::Result<usize> {
        let ids: Vec<uuid::Uuid> = agents.iter().map(|a| a.id.uuid()).collect();
        let sql = format!(
            "SELECT count(*) FROM unnest($1::uuid[]) AS o (id)
             JOIN workloads w ON w.id = o.id JOIN workload_policies p ON p.workload_id = w.id
             WHERE {} = $2 AND w.applied_version = p.version",
            innerwall_control_plane::shown::STATE
        );
        let synced: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(&ids)
            .bind(innerwall_wire::sync::SyncState::Synced.code())
            .fetch_one(self.pool())
            .await?;
        Ok(usize::try_from(synced)?)
    }

    /// Waits until `agents` (a part of the fleet) are SYNCED at their latest versions in the
    /// database, e.g. while the others are stalled.
    pub async fn wait_synced(&self, agents: &[Agent], limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        while self.synced_among(agents).await? < agents.len() {
            if started.elapsed() > limit {
                bail!(
                    "{} agents not SYNCED within {limit:?}",
                    agents.len() - self.synced_among(agents).await?
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Streams the replicas hold, by their metrics.
    pub async fn streams_open(&self) -> anyhow::Result<usize> {
        let mut open = 0.0;
        for replica in &self.replicas {
            open += replica.metric("innerwall_streams_open").await.unwrap_or(0.0);
        }
        Ok(open as usize)
    }

    /// Moves the next spare peer into `app=client`: every agent's peer set gains its address,
    /// one new version each. Returns the versions by workload and when the commit returned.
    pub async fn change(&mut self) -> anyhow::Result<(BTreeMap<WorkloadId, u64>, Instant)> {
        let Some(spare) = self.spares.pop() else { bail!("no spare peers left to move") };
        let pool = self.pool().clone();
        let mut conn = pool.acquire().await?;
        let expected = store::list_workloads(&mut conn, Some(spare)).await?.remove(0).label_version;
        drop(conn);
        let label = "app=client".parse()?;
        let done = innerwall_control_plane::foresight::commit(
            &pool,
            "loadgen",
            "workload.label",
            &spare.to_string(),
            async |c| {
                let version = authoring::edit_labels(c, spare, expected, &[label], &[]).await?;
                Ok((version, serde_json::json!({})))
            },
        )
        .await?;
        let committed = Instant::now();
        Ok((done.changed.iter().map(|c| (c.workload, c.version)).collect(), committed))
    }

    /// Each of `agents`' latency from `committed` to installing its version of `targets` (waits
    /// up to `limit` for the last one).
    pub async fn propagation(
        agents: &[Agent],
        targets: &BTreeMap<WorkloadId, u64>,
        committed: Instant,
        limit: Duration,
    ) -> anyhow::Result<Vec<Duration>> {
        let mut latencies = Vec::with_capacity(agents.len());
        for agent in agents {
            let Some(version) = targets.get(&agent.id) else {
                bail!("the change did not give agent {} a new version", agent.id);
            };
            loop {
                if let Some(at) = agent.log.installed_at(*version) {
                    latencies.push(at.saturating_duration_since(committed));
                    break;
                }
                if committed.elapsed() > limit {
                    bail!("agent {} did not install v{version} within {limit:?}", agent.id);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Ok(latencies)
    }

    /// How many of the first agents have a narrowed stream window (`FleetConfig::stream_window`).
    pub fn narrowed(&self) -> usize {
        self.stream_window.map_or(0, |(_, first)| first.min(self.agents.len()))
    }

    /// Streams established so far, per agent.
    pub fn streams(&self) -> BTreeMap<WorkloadId, u64> {
        self.agents.iter().map(|a| (a.id, a.shared.dials.streams.load(Ordering::Relaxed))).collect()
    }

    pub fn installs(&self) -> u64 {
        self.agents.iter().map(|a| a.log.installs.load(Ordering::Relaxed)).sum()
    }

    pub fn dial_failures(&self) -> u64 {
        self.agents.iter().map(|a| a.shared.dials.failures.load(Ordering::Relaxed)).sum()
    }

    pub fn replica_pids(&self) -> Vec<u32> {
        self.replicas.iter().map(Replica::pid).collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.agents.clear();
        self.replicas.clear();
        let _ = std::fs::remove_dir_all(&self.agents_dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where the simulated agents keep their state: in memory (`/dev/shm`) when the machine has it,
/// else under `dir`. Each enrollment writes its credential with two fsyncs, which a fleet's hosts
/// pay on disks of their own; on this machine 10,000 of them would queue on the one disk the
/// replica's Postgres writes to and measure that disk, not the replica (on this machine's disk:
/// 630-735 enrollments/s, in memory 828-891/s, same hour). The real agent of `--real-agent`
/// keeps its state on disk, under `dir`: its fsync is part of its apply.
fn agents_root(dir: &Path) -> PathBuf {
    let shm = Path::new("/dev/shm");
    match (shm.is_dir(), dir.file_name()) {
        (true, Some(name)) => shm.join(name),
        _ => dir.join("agents"),
    }
}

/// Starts agent `i` on the real stream loop with its own facts (hostname, one address).
fn start_agent(i: usize, id: WorkloadId, config: RunConfig, flows: Option<FlowLoad>) -> Agent {
    let (log, stall) = (Arc::new(ApplyLog::default()), Arc::new(Stall::default()));
    let store = LoadStore { inner: MemoryPolicyStore::new(None), log: log.clone(), stall: stall.clone() };
    let shared = Arc::new(Shared::new(store));
    shared.stream.report_facts(facts(i));
    if let Some(load) = flows {
        match Queue::new(&config.state_dir, DEFAULT_MAX_WINDOWS) {
            Ok(queue) => {
                tokio::spawn(produce_flows(i, shared.clone(), queue.clone(), load));
                tokio::spawn(upload_forever(
                    config.clone(),
                    queue,
                    Duration::from_secs(1),
                    Default::default(),
                ));
            }
            Err(e) => eprintln!("agent {i}: no flow queue, so no flows: {e}"),
        }
    }
    let task = tokio::spawn({
        let shared = shared.clone();
        async move {
            match innerwall_agent::daemon::hold_stream(&config, shared).await {
                Ok(()) => "stream loop ended".to_owned(),
                Err(e) => e.to_string(),
            }
        }
    });
    Agent { id, shared, log, stall, task }
}

/// Agent `i`'s flow windows: every `60 s / windows_per_minute`, a window of `records` inbound
/// TCP flows to its address, judged under its applied policy, queued durably for the uploader.
/// Agents start at spread offsets, so windows do not all close at once.
async fn produce_flows(i: usize, shared: Arc<Shared<LoadStore>>, queue: Queue, load: FlowLoad) {
    let period = Duration::from_secs(60) / load.windows_per_minute.max(1);
    tokio::time::sleep(period.mul_f64((i % 1_000) as f64 / 1_000.0)).await;
    let dst = agent_address(i);
    loop {
        let start_ms = chrono::Utc::now().timestamp_millis();
        tokio::time::sleep(period).await;
        let now_ms = chrono::Utc::now().timestamp_millis();
        let mut window = Window::open(start_ms, shared.enforcer.judged(), load.records);
        for r in 0..load.records {
            let src = IpAddr::from([172, 16, (r >> 8) as u8, (r & 0xff) as u8]);
            let key = FlowKey { src, dst, dst_port: 443, protocol: Protocol::Tcp };
            let counters = Counters {
                packets: 10,
                bytes: 1_500,
                new_connections: 1,
                first_seen_ms: start_ms,
                last_seen_ms: now_ms,
            };
            window.add(key, counters, now_ms);
        }
        match queue.push(window.close(now_ms)) {
            Ok(()) => {}
            // The fleet's directory is gone: the scenario is over.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => eprintln!("agent {i}: queueing a flow window failed: {e}"),
        }
    }
}

/// What agent `i` reports as its host: its own name and address, and the machine id it
/// enrolled with (this machine's: every agent enrolls through the agent's own path, which reads
/// it). Another machine id than the enrolled one is a clone (IDN-7), and a fleet of clones is
/// not the fleet PERF-2 describes: each Hello would open a clone episode, and each status read
/// would read every agent's episode.
fn facts(i: usize) -> innerwall_wire::identity::HostFacts {
    static MACHINE_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let machine_id = MACHINE_ID.get_or_init(|| {
        innerwall_agent::identity::facts::host_facts().map(|f| f.machine_id).unwrap_or_default()
    });
    let address = agent_address(i);
    innerwall_wire::identity::HostFacts {
        hostname: format!("load-{i}"),
        os: None,
        interfaces: vec![innerwall_wire::identity::NetworkInterface {
            name: "eth0".into(),
            addresses: vec![format!("{address}/16")],
            mac_address: String::new(),
        }],
        machine_id: machine_id.clone(),
        boot_id: String::new(),
        ephemeral_ports: Some(innerwall_wire::policy::PortRange::new(32_768, 60_999).expect("a port range")),
    }
}

/// Loopback addresses the agents' streams leave from: a connection from one address to the one
/// replica's takes a port of the 28,232 of Linux's default ephemeral range, so 50,000 streams
/// need two addresses at least; four leave room for the enrollments' connections in TIME_WAIT.
const SOURCES: usize = 4;

/// The loopback address agent `i`'s connections leave from.
fn source_address(i: usize) -> IpAddr {
    IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1 + (i % SOURCES) as u8))
}

/// Agent `i`'s address, in [`AGENT_RANGE`].
fn agent_address(i: usize) -> IpAddr {
    let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
    IpAddr::from([10, 200, (n >> 8) as u8, (n & 0xff) as u8])
}

/// The address of agentless peer `i` (< [`MAX_PEERS`]): the top of the agents' range.
fn peer_address(i: usize) -> IpAddr {
    IpAddr::from([10, 200, 255, u8::try_from(i + 1).unwrap_or(255)])
}

async fn register(pool: &PgPool, hostname: &str, label: &str, address: IpAddr) -> anyhow::Result<WorkloadId> {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: hostname.into(),
        labels: vec![label.parse()?],
        addresses: [address].into(),
    };
    innerwall_control_plane::foresight::commit(pool, "loadgen", "register", hostname, async |c| {
        authoring::register_workload(c, &new).await?;
        Ok(((), serde_json::json!({})))
    })
    .await?;
    Ok(new.id)
}
