//! A control plane and agents for end-to-end tests: a replica on a fresh database with its own
//! CA on a loopback port, and agents enrolled through the real enrollment path.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use innerwall_agent::enforce::{EnforceError, Installed, MemoryPolicyStore, PolicyStore};
use innerwall_agent::identity::connect::RunConfig;
use innerwall_agent::identity::credential::Credential;
use innerwall_agent::sync::Agent as Shared;
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_control_plane::postgres::Pools;
use innerwall_control_plane::service::{self, Running, ServiceConfig};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Mode, WorkloadPolicy};
use sqlx::PgPool;

pub struct Plane {
    pub db: TestDatabase,
    pub dir: PathBuf,
    pub signer: Arc<FileCa>,
    pub port: u16,
    pub cert_lifetime: Duration,
    pub gateway: GatewayConfig,
    /// The address the listener binds (loopback unless a test needs agents in other
    /// namespaces to reach it) and the names it presents.
    pub listen_ip: IpAddr,
    pub server_names: Vec<String>,
    /// Where the replica serves `/metrics`, if anywhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The times ingest accepts, with the clock skew allowed.
    pub flow_bounds: innerwall_control_plane::flows::TimeBounds,
    pub running: Option<Running>,
}

/// Heartbeats and flow windows every second: tests of real agents see their state soon.
pub fn fast_gateway() -> GatewayConfig {
    GatewayConfig {
        heartbeat: Duration::from_secs(1),
        flow_window: Duration::from_secs(1),
        ..GatewayConfig::default()
    }
}

impl Plane {
    pub async fn start() -> Plane {
        Plane::start_with(Duration::from_secs(3600)).await
    }

    pub async fn start_with(cert_lifetime: Duration) -> Plane {
        let mut plane = Plane::create(cert_lifetime, GatewayConfig::default()).await;
        plane.up().await;
        plane
    }

    /// A database and CA, with the replica not yet started (`up` starts it).
    pub async fn create(cert_lifetime: Duration, gateway: GatewayConfig) -> Plane {
        let db = fresh_database().await.unwrap();
        let dir = std::env::temp_dir().join(format!("iw-e2e-{}", uuid::Uuid::new_v4()));
        let signer = Arc::new(FileCa::init(&dir.join("ca")).unwrap());
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Plane {
            db,
            dir,
            signer,
            port,
            cert_lifetime,
            gateway,
            listen_ip: IpAddr::from([127, 0, 0, 1]),
            server_names: vec!["localhost".into()],
            metrics_listen: None,
            flow_bounds: Default::default(),
            running: None,
        }
    }

    /// Starts the replica on its port (again, after `down`), in the calling thread's network
    /// namespace.
    pub async fn up(&mut self) {
        let config = ServiceConfig {
            listen: std::net::SocketAddr::new(self.listen_ip, self.port),
            server_names: self.server_names.clone(),
            cert_lifetime: self.cert_lifetime,
            server_cert_lifetime: innerwall_control_plane::identity::server_cert::SERVER_CERT_LIFETIME,
            gateway: self.gateway.clone(),
            flow_bounds: self.flow_bounds,
            limits: Default::default(),
            retention: Default::default(),
            metrics_listen: self.metrics_listen,
        };
        self.running = Some(
            service::start(Pools::shared(self.db.pool.clone()), self.signer.clone(), config).await.unwrap(),
        );
    }

    pub async fn down(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop().await.unwrap();
        }
    }

    /// What agents dial: `localhost` while the replica listens on loopback or every address,
    /// else its listening address.
    pub fn server(&self) -> String {
        if self.listen_ip.is_loopback() || self.listen_ip.is_unspecified() {
            format!("localhost:{}", self.port)
        } else {
            format!("{}:{}", self.listen_ip, self.port)
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    pub async fn mint(&self, labels: &[&str]) -> String {
        let labels: Vec<_> = labels.iter().map(|l| l.parse().unwrap()).collect();
        let mut conn = self.db.pool.acquire().await.unwrap();
        innerwall_control_plane::identity::tokens::mint(
            &mut conn,
            &labels,
            chrono::Duration::days(1),
            None,
            &[],
        )
        .await
        .unwrap()
        .secret
    }

    /// Enrolls a new agent state directory through the agent's own enrollment path.
    pub async fn enroll(&self, name: &str, labels: &[&str]) -> (WorkloadId, RunConfig) {
        let token = self.mint(labels).await;
        let state = self.dir.join(name);
        let credential = innerwall_agent::identity::enroll::enroll(
            &self.server(),
            &token,
            &self.signer.ca_bundle_pem(),
            &state,
            Default::default(),
        )
        .await
        .unwrap()
        .credential;
        let mut config = RunConfig::new(state, self.server());
        config.backoff_base = Duration::from_millis(50);
        config.backoff_cap = Duration::from_millis(400);
        (credential.id, config)
    }

    /// Runs the agent's real sync loop for `config` (a test store for its policy) until `id` is
    /// SYNCED at its latest version, which its acknowledgement recorded as installed: windows
    /// claiming that version are then the host's own. Abort the task to stop the agent.
    pub async fn hold(
        &self,
        id: WorkloadId,
        config: &RunConfig,
    ) -> (Arc<Shared<TestStore>>, tokio::task::JoinHandle<()>) {
        let shared = Arc::new(Shared::new(TestStore::default()));
        let (c, e) = (config.clone(), shared.clone());
        let task = tokio::spawn(async move { innerwall_agent::daemon::hold_stream(&c, e).await.unwrap() });
        let latest = self.status(id).await.2.expect("a rendered policy");
        self.wait_synced(id, latest).await;
        (shared, task)
    }

    /// Registers a workload without an agent (a peer) with its labels and one address.
    pub async fn register(&self, hostname: &str, labels: &[&str], addr: &str) -> WorkloadId {
        let new = NewWorkload {
            id: WorkloadId::new_random(),
            hostname: hostname.into(),
            labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
            addresses: BTreeSet::from([addr.parse::<IpAddr>().unwrap()]),
        };
        innerwall_control_plane::foresight::commit(self.pool(), "test", "register", hostname, async |c| {
            authoring::register_workload(c, &new).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
        new.id
    }

    /// Sets `label` on `id`, whose label version is `expected`, as `workload label` does.
    pub async fn relabel(&self, id: WorkloadId, expected: i64, label: &str) {
        innerwall_control_plane::foresight::commit(
            self.pool(),
            "test",
            "workload.label",
            &id.to_string(),
            async |c| {
                let version = authoring::edit_labels(c, id, expected, &[label.parse().unwrap()], &[]).await?;
                Ok((version, serde_json::json!({})))
            },
        )
        .await
        .unwrap();
    }

    /// Sets one workload's mode directly (the evidence gate's own tests go through `gate`).
    pub async fn set_mode(&self, id: WorkloadId, mode: Mode) {
        innerwall_control_plane::foresight::commit(
            self.pool(),
            "test",
            "workload.mode",
            &id.to_string(),
            async |c| {
                authoring::set_mode(c, id, mode).await?;
                Ok(((), serde_json::json!({})))
            },
        )
        .await
        .unwrap();
    }

    /// One more port for every `app=web` workload: one version each.
    pub async fn bump(&self, n: u16) {
        innerwall_control_plane::testing::add_web_port(self.pool(), n).await.unwrap();
    }

    pub async fn status(&self, id: WorkloadId) -> (String, i64, Option<i64>, String) {
        let s =
            store::sync_status(&mut self.pool().acquire().await.unwrap(), Some(id)).await.unwrap().remove(0);
        (s.state.0.name().to_owned(), s.applied_version, s.latest_version, s.detail)
    }

    /// Polls until the stored state is `state` at `applied`.
    pub async fn wait_synced(&self, id: WorkloadId, applied: i64) {
        self.wait(id, |s| s.0 == "SYNCED" && s.1 == applied, &format!("SYNCED at v{applied}")).await;
    }

    pub async fn wait(
        &self,
        id: WorkloadId,
        done: impl Fn(&(String, i64, Option<i64>, String)) -> bool,
        what: &str,
    ) {
        for _ in 0..300 {
            if done(&self.status(id).await) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("workload never reached {what}: {:?}", self.status(id).await);
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn credential(config: &RunConfig) -> Credential {
    Credential::load(&config.state_dir).unwrap()
}

/// A policy store for sync tests: remembers like `MemoryPolicyStore`, can hold one version's
/// apply until the test opens its gate (so later updates pipeline behind it, and the test sees
/// the moment the agent is applying) and can refuse chosen versions a number of times.
#[derive(Debug, Default)]
pub struct TestStore {
    pub inner: MemoryPolicyStore,
    pub gate: Option<Arc<Gate>>,
    pub refuse: Option<(u64, u32)>,
}

/// Holds the apply of one version until [`Gate::open`]; says when an apply reached it.
#[derive(Debug)]
pub struct Gate {
    version: u64,
    /// (an apply of `version` is waiting or went through, the gate is open)
    state: std::sync::Mutex<(bool, bool)>,
    changed: std::sync::Condvar,
}

impl Gate {
    pub fn new(version: u64) -> Arc<Gate> {
        Arc::new(Gate { version, state: Default::default(), changed: Default::default() })
    }

    /// True once an apply of the gated version has begun.
    pub fn entered(&self) -> bool {
        self.state.lock().unwrap().0
    }

    pub fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }

    /// Called by the store (on the agent's blocking apply thread).
    fn pass(&self, version: u64) {
        if version != self.version {
            return;
        }
        let mut state = self.state.lock().unwrap();
        state.0 = true;
        let (state, timeout) =
            self.changed.wait_timeout_while(state, Duration::from_secs(30), |s| !s.1).unwrap();
        assert!(!timeout.timed_out() || state.1, "the test never opened the gate for v{version}");
    }
}

impl PolicyStore for TestStore {
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError> {
        if let Some(gate) = &self.gate {
            gate.pass(next.version());
        }
        if let Some((version, times)) = self.refuse
            && version == next.version()
            && times > 0
        {
            self.refuse = Some((version, times - 1));
            self.inner.fail_next = Some(format!("test refuses v{version}"));
        }
        self.inner.apply(next)
    }

    fn current(&self) -> Option<&WorkloadPolicy> {
        self.inner.current()
    }
}

pub fn history(shared: &Shared<TestStore>) -> Vec<u64> {
    shared.enforcer.store.lock().unwrap().inner.history().to_vec()
}

/// How many more times the store will refuse the version it was told to refuse.
pub fn refusals_left(shared: &Shared<TestStore>) -> u32 {
    shared.enforcer.store.lock().unwrap().refuse.map_or(0, |(_, times)| times)
}

/// Polls `done` every 50 ms for up to 15 s; panics naming `what` if it never holds.
pub async fn eventually(done: impl Fn() -> bool, what: &str) {
    for _ in 0..300 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never happened: {what}");
}

/// One sample of the replica's metrics (e.g. `innerwall_acks_total{status="APPLIED"}`).
pub fn sample(plane: &Plane, series: &str) -> Option<f64> {
    let text = plane.running.as_ref().expect("the replica runs").metrics.encode();
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
