//! A deterministic simulator of the policy stream (issue 30): from a seed, replicas' worth of
//! streams and a few agents run for a number of steps with simulated time, network, database
//! and firewall, driving the real protocol logic — the control plane's `StreamCore` through its
//! `Driver` on the `MemoryStore`, the real renderer on a random estate, the wire's diff and
//! apply, and the agent's real `Enforcer::apply` (next policy, persist, install) on a simulated
//! firewall. Faults: message delays (order kept within a stream), stream drops and half-open
//! streams, lost and late announcements, listener reconnects, agent crashes between persist and
//! install, failed applies, the kill switch, clock jumps, duplicate streams of one identity,
//! replicas that die (mid-stream, between a send and the state write after it) and restart with
//! their workloads left to the liveness sweep, and a database restored from a backup with the
//! lost changes authored again (versions reused with other content).
//! After every step the invariants are checked; after the steps the faults stop and every live
//! agent must converge within a bounded number of steps.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use innerwall_agent::enforce::{EnforceError, Installed, PolicyStore};
use innerwall_agent::sync::core::{Effect as AgentEffect, Event as AgentEvent, StreamCore as AgentCore};
use innerwall_agent::sync::{Enforcer, Standing};
use innerwall_control_plane::policy::model::{
    AuthoredModel, Peer, RegisteredWorkload, Rule, Ruleset, Selector, Service, ServiceEntry,
};
use innerwall_control_plane::policy::render::render;
use innerwall_control_plane::sync::core::{Control, CoreConfig, Ended, Event, RECOVERY_RETRY, StreamCore};
use innerwall_control_plane::sync::driver::{Driver, Gone, Outbox};
use innerwall_control_plane::sync::store::{MemoryBackup, MemoryStore};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, WorkloadPolicy};
use innerwall_wire::proto;
use innerwall_wire::sync::{
    Ack, AgentMessage, ControlMessage, Heartbeat, Hello, HelloAck, SyncState, Update,
};

/// splitmix64: small, fast and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What one run is made of.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    pub seed: u64,
    pub steps: u32,
    pub agents: usize,
    pub replicas: usize,
}

impl Params {
    pub fn quick(seed: u64) -> Self {
        Params { seed, steps: 300, agents: 3, replicas: 2 }
    }
}

/// A broken invariant, with the step it broke at and the trace up to it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub step: u32,
    pub what: String,
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seed {} step {}: {}", self.seed, self.step, self.what)
    }
}

const LIVENESS: Duration = Duration::from_secs(90);
const HEARTBEAT: Duration = Duration::from_secs(30);
/// How often every running replica sweeps (the heartbeat interval, as `service` does).
const SWEEP_EVERY: Duration = HEARTBEAT;

/// The host's firewall and disk: a persisted policy and an installed one, with faults.
#[derive(Debug, Default)]
pub struct Firewall {
    persisted: Option<WorkloadPolicy>,
    installed: Option<WorkloadPolicy>,
    suspended: bool,
    /// The next apply fails (the kernel refused it).
    fail_next: bool,
    /// Every apply fails (a refusal that lasts, until the simulation lifts it).
    refusing: bool,
    /// The process dies right after the next persist, before installing.
    crash_after_persist: bool,
    crashed: bool,
}

impl PolicyStore for Firewall {
    fn apply(&mut self, next: &WorkloadPolicy) -> Result<Installed, EnforceError> {
        if std::mem::take(&mut self.fail_next) || self.refusing {
            let source = std::io::Error::other("injected refusal");
            return Err(EnforceError::Install(innerwall_agent::enforce::NetlinkError::Io {
                what: "sim",
                source,
            }));
        }
        self.persisted = Some(next.clone());
        if std::mem::take(&mut self.crash_after_persist) {
            self.crashed = true;
            let source = std::io::Error::other("crashed after persisting");
            return Err(EnforceError::Install(innerwall_agent::enforce::NetlinkError::Io {
                what: "sim",
                source,
            }));
        }
        if self.suspended {
            return Ok(Installed::Held);
        }
        self.installed = Some(next.clone());
        Ok(Installed::Full)
    }

    fn current(&self) -> Option<&WorkloadPolicy> {
        self.persisted.as_ref()
    }

    fn suspended(&self) -> bool {
        self.suspended
    }
}

/// A stream's two directions: messages with the time they arrive, in order.
#[derive(Debug)]
struct Stream {
    agent: usize,
    replica: usize,
    core: StreamCore,
    epoch: i64,
    /// The control plane's side is gone (ended, or its replica forgot it).
    cp_closed: bool,
    /// The agent's side is gone.
    agent_closed: bool,
    to_agent: VecDeque<(Duration, ControlMessage)>,
    to_cp: VecDeque<(Duration, AgentMessage)>,
    opened_at: Duration,
    /// Snapshots sent (the opening one included) and the versions of the updates sent.
    snapshots: u64,
    versions: BTreeSet<u64>,
    /// When its replica died under it (its end was never recorded).
    died_at: Option<Duration>,
    /// The agent's side of it.
    agent_core: AgentCore,
}

/// Messages a driver sends, collected for the network; with `dies_after`, the replica dies
/// once that many more have been sent (the send after them fails, and nothing after it runs).
#[derive(Debug, Default)]
struct Collect {
    sent: Vec<ControlMessage>,
    dies_after: Option<usize>,
}

impl Outbox for &mut Collect {
    async fn send(&mut self, message: proto::SyncResponse) -> Result<(), Gone> {
        if self.dies_after.is_some_and(|n| self.sent.len() >= n) {
            return Err(Gone);
        }
        self.sent.push(ControlMessage::try_from(message).expect("the control plane sends what agents read"));
        Ok(())
    }
}

/// One replica: whether it runs, and announcements on their way to its listener.
#[derive(Debug, Default)]
struct Replica {
    /// Down until this time (it died and restarts then).
    down_until: Option<Duration>,
    /// Announcements on their way to its listener: (arrives at, workload).
    notices: VecDeque<(Duration, WorkloadId)>,
    /// The next stream this replica drives dies after this many sends.
    dies_after: Option<usize>,
    next_sweep: Duration,
}

/// A backup of the database: the store and the authored estate, and how many renders in.
struct Backup {
    at: Duration,
    store: MemoryBackup,
    estate: Estate,
    renders: u64,
}

struct Agent {
    id: WorkloadId,
    enforcer: Enforcer<Firewall>,
    /// Its stream, while it thinks it has one.
    stream: Option<usize>,
    /// Down until this time (crashed or between dials).
    down_until: Option<Duration>,
}

/// The estate the renderer sees.
#[derive(Clone)]
struct Estate {
    model: AuthoredModel,
    workloads: Vec<RegisteredWorkload>,
}

fn label(key: &str, value: &str) -> (LabelKey, LabelValue) {
    (LabelKey::new(key).expect("a key"), LabelValue::new(value).expect("a value"))
}

fn selector(value: &str) -> Selector {
    Selector::from_strings([("app".to_owned(), vec![value.to_owned()])]).expect("a selector")
}

const APPS: [&str; 3] = ["web", "api", "db"];

impl Estate {
    fn new(ids: &[WorkloadId]) -> Self {
        let workloads = ids
            .iter()
            .enumerate()
            .map(|(i, id)| RegisteredWorkload {
                id: *id,
                mode: Mode::Simulation,
                revert_at: None,
                labels: BTreeMap::from([label("app", APPS[i % APPS.len()])]),
                addresses: BTreeSet::from([IpAddr::V4(Ipv4Addr::new(10, 0, 0, i as u8 + 1))]),
            })
            .collect();
        let service = Service {
            id: uuid::Uuid::from_u128(1),
            name: "svc".into(),
            entries: vec![ServiceEntry::parse("tcp:443").expect("an entry")],
        };
        let model = AuthoredModel {
            services: BTreeMap::from([(service.id, service)]),
            address_groups: BTreeMap::new(),
            rulesets: Vec::new(),
            ..Default::default()
        };
        Estate { model, workloads }
    }

    /// One random authored change.
    fn change(&mut self, rng: &mut Rng, n: u128) -> String {
        match rng.below(5) {
            0 | 1 => {
                let (to, from) = (APPS[rng.below(3) as usize], APPS[rng.below(3) as usize]);
                let port = 1000 + rng.below(50) as u16;
                let service = Service {
                    id: uuid::Uuid::from_u128(1000 + n),
                    name: format!("s{n}"),
                    entries: vec![ServiceEntry::parse(&format!("tcp:{port}")).expect("an entry")],
                };
                let rule = Rule {
                    id: uuid::Uuid::from_u128(2000 + n),
                    name: format!("r{n}"),
                    enabled: true,
                    peers: vec![
                        Peer::Workloads(selector(from)),
                        Peer::Cidr(Cidr::parse(&format!("192.168.{}.0/24", rng.below(200))).expect("a cidr")),
                    ],
                    services: vec![service.id],
                };
                self.model.services.insert(service.id, service);
                self.model.rulesets.push(Ruleset {
                    id: uuid::Uuid::from_u128(3000 + n),
                    name: format!("rs{n}"),
                    enabled: true,
                    scope: selector(to),
                    rules: vec![rule],
                });
                format!("ruleset rs{n}: {from} → {to}:{port}")
            }
            2 if !self.model.rulesets.is_empty() => {
                let i = rng.below(self.model.rulesets.len() as u64) as usize;
                let gone = self.model.rulesets.remove(i);
                format!("ruleset {} deleted", gone.name)
            }
            3 => {
                let i = rng.below(self.workloads.len() as u64) as usize;
                let app = APPS[rng.below(3) as usize];
                self.workloads[i].labels = BTreeMap::from([label("app", app)]);
                format!("workload {i} relabelled app={app}")
            }
            _ => {
                let i = rng.below(self.workloads.len() as u64) as usize;
                let mode = if self.workloads[i].mode == Mode::Simulation {
                    Mode::Enforcement
                } else {
                    Mode::Simulation
                };
                self.workloads[i].mode = mode;
                format!("workload {i} to {mode}")
            }
        }
    }
}

/// One simulated world.
struct World {
    rng: Rng,
    now: Duration,
    store: MemoryStore,
    estate: Estate,
    agents: Vec<Agent>,
    streams: Vec<Stream>,
    replicas: Vec<Replica>,
    /// Every policy ever persisted per workload, those a restore lost included.
    ever: BTreeMap<WorkloadId, Vec<WorkloadPolicy>>,
    backups: VecDeque<Backup>,
    /// Renders that moved a version, and when the last sweep ran.
    renders: u64,
    last_sweep: Option<Duration>,
    metrics: Arc<innerwall_control_plane::metrics::Metrics>,
    runtime: tokio::runtime::Runtime,
    trace: Vec<String>,
    changes: u128,
    /// Faults are on; off for convergence.
    faults: bool,
    /// Agents whose firewall refuses every apply, until when.
    refusing: BTreeMap<usize, Duration>,
    /// A broken invariant seen while a step ran (reported by `check`).
    violation: Option<String>,
}

fn epoch_time() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).expect("a time")
}

impl World {
    pub fn new(params: &Params) -> Self {
        let ids: Vec<WorkloadId> = (0..params.agents)
            .map(|i| WorkloadId::from_uuid(uuid::Uuid::from_u128(0x1000 + i as u128)).expect("an id"))
            .collect();
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let mut world = World {
            rng: Rng::new(params.seed),
            now: Duration::ZERO,
            store: MemoryStore::default(),
            estate: Estate::new(&ids),
            agents: ids
                .iter()
                .map(|id| Agent {
                    id: *id,
                    enforcer: Enforcer::new(Firewall::default(), Arc::default()),
                    stream: None,
                    down_until: None,
                })
                .collect(),
            streams: Vec::new(),
            replicas: (0..params.replicas.max(1)).map(|_| Replica::default()).collect(),
            ever: BTreeMap::new(),
            backups: VecDeque::new(),
            renders: 0,
            last_sweep: None,
            metrics: Arc::new(innerwall_control_plane::metrics::Metrics::new()),
            runtime,
            trace: Vec::new(),
            changes: 0,
            faults: true,
            refusing: BTreeMap::new(),
            violation: None,
        };
        world.render("the estate");
        world
    }

    /// The wall clock of the simulated world.
    fn wall(&self) -> DateTime<Utc> {
        epoch_time() + chrono::Duration::from_std(self.now).expect("a duration")
    }

    fn log(&mut self, line: String) {
        self.trace.push(format!("{:>8.1}s {line}", self.now.as_secs_f64()));
    }

    /// Renders the estate with the real renderer and persists a new version for each workload
    /// whose content changed, announcing it to every replica (lost or late while faults are on).
    fn render(&mut self, why: &str) {
        let rendered = match render(&self.estate.model, &self.estate.workloads) {
            Ok(r) => r,
            Err(e) => {
                self.log(format!("render refused ({why}): {e}"));
                return;
            }
        };
        let mut moved = Vec::new();
        for agent in &self.agents {
            let Some(policy) = rendered.get(&agent.id) else { continue };
            let latest =
                self.store.workload(agent.id).and_then(|w| w.policies.last().map(|(p, _)| p.clone()));
            let next = latest.as_ref().map_or(1, |p| p.version() + 1);
            if latest.as_ref().is_some_and(|p| policy.clone().with_version(p.version()) == *p) {
                continue;
            }
            let persisted = policy.clone().with_version(next);
            self.ever.entry(agent.id).or_default().push(persisted.clone());
            self.store.persist(agent.id, persisted, self.wall());
            moved.push(agent.id);
        }
        self.renders += u64::from(!moved.is_empty());
        for id in &moved {
            for r in 0..self.replicas.len() {
                if self.replicas[r].down_until.is_some() || (self.faults && self.rng.chance(10)) {
                    continue; // lost
                }
                let delay = Duration::from_millis(self.rng.below(if self.faults { 5_000 } else { 10 }));
                self.replicas[r].notices.push_back((self.now + delay, *id));
            }
        }
        self.log(format!("render ({why}): {} moved", moved.len()));
    }

    /// Runs one core event through the driver for stream `s`, queueing what it sends.
    fn drive(&mut self, s: usize, event: Event) {
        if self.streams[s].cp_closed {
            return;
        }
        let now = self.now;
        self.store.set_clock(self.wall());
        let replica = self.streams[s].replica;
        let mut sent = Collect { sent: Vec::new(), dies_after: self.replicas[replica].dies_after.take() };
        let dies = sent.dies_after.is_some();
        let stream = &mut self.streams[s];
        let id = self.agents[stream.agent].id;
        let mut driver = Driver {
            id,
            key_sha256: "sim",
            store: &self.store,
            out: &mut sent,
            epoch: stream.epoch,
            liveness: LIVENESS,
            metrics: self.metrics.clone(),
        };
        let ended: Option<Ended> = self.runtime.block_on(driver.run(&mut stream.core, event, now));
        stream.epoch = driver.epoch;
        // A stream whose state write found a newer stream of the identity ends there: it must
        // not go on speaking for the workload.
        let refused = self.store.workload(id).is_some_and(|w| w.superseded_writes.contains(&stream.epoch));
        if refused && !stream.core.ended() {
            self.violation.get_or_insert(format!("stream {s} goes on after a write found it superseded"));
        }
        let sent_count = sent.sent.len();
        let died = ended.as_ref().is_some_and(|e| e.reason == "agent went away")
            && sent.dies_after.is_some_and(|n| sent_count >= n);
        for message in sent.sent {
            if let ControlMessage::Update(update) = &message {
                let stream = &mut self.streams[s];
                stream.versions.insert(update.version());
                if matches!(update, Update::Snapshot(_)) {
                    stream.snapshots += 1;
                }
            }
            let delay = Duration::from_millis(self.rng.below(if self.faults { 2_000 } else { 5 }));
            let stream = &mut self.streams[s];
            let at = stream.to_agent.back().map_or(now, |(t, _)| *t).max(now) + delay;
            stream.to_agent.push_back((at, message));
        }
        if died {
            self.log(format!("replica {replica} dies while stream {s} sends"));
            self.replica_dies(replica);
            return;
        }
        if let (true, Some(n)) = (dies, sent.dies_after) {
            // Fewer were sent this time: the replica dies on a later send.
            self.replicas[replica].dies_after = Some(n - sent_count);
        }
        if let Some(ended) = ended {
            let stream = &mut self.streams[s];
            stream.cp_closed = true;
            let (epoch, offline) = (stream.epoch, ended.offline);
            if offline && epoch > 0 {
                let store = &self.store;
                self.runtime.block_on(innerwall_control_plane::sync::store::SyncStore::mark_offline(
                    store,
                    id,
                    epoch,
                    &ended.reason,
                ));
            }
            self.log(format!("stream {s} ended by the control plane: {}", ended.reason));
        }
    }

    fn hello_ack() -> HelloAck {
        HelloAck {
            heartbeat: HEARTBEAT,
            inventory: Duration::from_secs(300),
            flow_window: Duration::from_secs(60),
            flow_window_max_keys: 1_000,
        }
    }

    /// Agent `a` dials: a new stream on a random replica, Hello first.
    fn dial(&mut self, a: usize) {
        let up: Vec<usize> =
            (0..self.replicas.len()).filter(|r| self.replicas[*r].down_until.is_none()).collect();
        if up.is_empty() {
            self.agents[a].down_until = Some(self.now + Duration::from_secs(1));
            return;
        }
        let replica = up[self.rng.below(up.len() as u64) as usize];
        let config = CoreConfig {
            liveness: LIVENESS,
            hello_ack: Self::hello_ack(),
            expires: Duration::from_secs(1 << 40),
        };
        let enforcer = &self.agents[a].enforcer;
        let suspended = enforcer.suspended();
        let hello = Hello { applied_version: enforcer.applied_version(), suspended, ..Default::default() };
        // An agent holds one stream: a new dial leaves the old one to the control plane's end.
        if let Some(old) = self.agents[a].stream.take() {
            self.streams[old].agent_closed = true;
            self.streams[old].to_agent.clear();
        }
        let s = self.streams.len();
        self.streams.push(Stream {
            agent: a,
            replica,
            core: StreamCore::new(config, self.now),
            epoch: 0,
            cp_closed: false,
            agent_closed: false,
            to_agent: VecDeque::new(),
            to_cp: VecDeque::from([(self.now, AgentMessage::Hello(Box::new(hello)))]),
            opened_at: self.now,
            snapshots: 0,
            versions: BTreeSet::new(),
            died_at: None,
            agent_core: AgentCore::new(Standing { suspended, reverted_version: 0 }),
        });
        self.agents[a].stream = Some(s);
        self.log(format!("agent {a} dials: stream {s} on replica {replica}"));
    }

    /// Delivers the next message of one direction of stream `s`, if it is due.
    fn deliver(&mut self, s: usize, to_agent: bool) {
        let now = self.now;
        if to_agent {
            let Some((at, _)) = self.streams[s].to_agent.front() else { return };
            if *at > now {
                return;
            }
            let (_, message) = self.streams[s].to_agent.pop_front().expect("a message");
            if self.streams[s].agent_closed {
                return;
            }
            self.agent_receives(s, message);
        } else {
            let Some((at, _)) = self.streams[s].to_cp.front() else { return };
            if *at > now {
                return;
            }
            let (_, message) = self.streams[s].to_cp.pop_front().expect("a message");
            self.drive(s, Event::Message(message));
        }
    }

    fn agent_send(&mut self, s: usize, message: AgentMessage) {
        let delay = Duration::from_millis(self.rng.below(if self.faults { 2_000 } else { 5 }));
        let stream = &mut self.streams[s];
        let at = stream.to_cp.back().map_or(self.now, |(t, _)| *t).max(self.now) + delay;
        stream.to_cp.push_back((at, message));
    }

    /// The agent's side of stream `s`: the agent's real stream core, its applies carried out
    /// through the real `Enforcer::apply` on the simulated firewall.
    fn agent_receives(&mut self, s: usize, message: ControlMessage) {
        let event = match message {
            ControlMessage::HelloAck(ack) => AgentEvent::Opened(ack),
            ControlMessage::Directive(directive) => AgentEvent::Directive(directive),
            ControlMessage::Update(update) => AgentEvent::Update(update),
        };
        self.agent_event(s, event);
    }

    /// Hands `event` to stream `s`'s agent core and carries out its effects in order.
    fn agent_event(&mut self, s: usize, event: AgentEvent) {
        let a = self.streams[s].agent;
        let now = self.now - self.streams[s].opened_at;
        let mut queue: VecDeque<AgentEffect> = self.streams[s].agent_core.handle(event, now).into();
        while let Some(effect) = queue.pop_front() {
            match effect {
                AgentEffect::Send(message) => {
                    if let AgentMessage::Ack(ack) = &message {
                        self.log(format!("agent {a} acks {ack:?}"));
                        // An agent's ack of a version says it holds that version.
                        let holds = self.agents[a].enforcer.applied_version();
                        if matches!(ack, Ack::Applied(_) | Ack::Held(_)) && ack.version() != holds {
                            self.violation.get_or_insert(format!(
                                "agent {a} acks {ack:?} while it holds version {holds}"
                            ));
                        }
                    }
                    self.agent_send(s, message);
                }
                AgentEffect::Apply(update) => {
                    let version = update.version();
                    let result = self.agents[a].enforcer.apply(&update).map_err(|e| e.to_string());
                    if self.agents[a].enforcer.store.lock().expect("the firewall").crashed {
                        self.crash(a, "between persist and install");
                        return;
                    }
                    let next =
                        self.streams[s].agent_core.handle(AgentEvent::Applied { version, result }, now);
                    for effect in next.into_iter().rev() {
                        queue.push_front(effect);
                    }
                }
                AgentEffect::Heartbeat => {
                    let suspended = self.agents[a].enforcer.suspended();
                    self.agent_send(
                        s,
                        AgentMessage::Heartbeat(Heartbeat { suspended, ..Default::default() }),
                    );
                }
                // The simulated hosts report no facts (the control plane ignores such a report).
                AgentEffect::Inventory => {}
                AgentEffect::End(end) => {
                    self.agent_drops(a, &format!("{end:?}"));
                    return;
                }
            }
        }
    }

    /// The agent loses its stream (it closes its side) and redials a little later.
    fn agent_drops(&mut self, a: usize, why: &str) {
        if let Some(s) = self.agents[a].stream.take() {
            self.streams[s].agent_closed = true;
            self.streams[s].to_agent.clear();
        }
        let wait = Duration::from_millis(100 + self.rng.below(3_000));
        self.agents[a].down_until = Some(self.now + wait);
        self.log(format!("agent {a} drops its stream ({why})"));
    }

    /// The agent process dies; on restart it installs what it persisted (fail-static) and dials.
    fn crash(&mut self, a: usize, when: &str) {
        self.agent_drops(a, &format!("crashed {when}"));
        let mut firewall = self.agents[a].enforcer.store.lock().expect("the firewall");
        firewall.crashed = false;
        firewall.installed = if firewall.suspended { None } else { firewall.persisted.clone() };
    }

    /// Closes stream `s` on both sides at once (a connection reset).
    fn reset(&mut self, s: usize) {
        let a = self.streams[s].agent;
        if self.agents[a].stream == Some(s) {
            self.agent_drops(a, "connection reset");
        }
        self.drive(s, Event::Control(Control::End { reason: "connection reset".into(), superseded: false }));
    }

    fn live_streams(&self) -> Vec<usize> {
        (0..self.streams.len())
            .filter(|s| !self.streams[*s].cp_closed || !self.streams[*s].agent_closed)
            .collect()
    }

    /// One random step.
    fn step(&mut self) {
        let live = self.live_streams();
        let pick = self.rng.below(100);
        match pick {
            0..=49 if !live.is_empty() => {
                // A message that is due, if any: the network is busy, faults are the exception.
                let now = self.now;
                let due: Vec<(usize, bool)> = live
                    .iter()
                    .flat_map(|s| {
                        let stream = &self.streams[*s];
                        let to_agent = stream.to_agent.front().is_some_and(|(at, _)| *at <= now);
                        let to_cp = stream.to_cp.front().is_some_and(|(at, _)| *at <= now);
                        [(*s, true, to_agent), (*s, false, to_cp)]
                    })
                    .filter(|(_, _, due)| *due)
                    .map(|(s, dir, _)| (s, dir))
                    .collect();
                if let Some((s, to_agent)) =
                    (!due.is_empty()).then(|| due[self.rng.below(due.len() as u64) as usize])
                {
                    self.deliver(s, to_agent);
                } else {
                    self.now += Duration::from_millis(self.rng.below(2_000));
                }
            }
            50..=57 => {
                self.now += Duration::from_millis(self.rng.below(if self.faults { 10_000 } else { 2_000 }))
            }
            58..=65 => {
                self.changes += 1;
                let n = self.changes;
                let what = self.estate.change(&mut self.rng, n);
                self.render(&what);
            }
            66..=72 => self.listeners(),
            81..=83 if self.faults && !live.is_empty() => {
                let s = live[self.rng.below(live.len() as u64) as usize];
                self.log(format!("stream {s} resets"));
                self.reset(s);
            }
            84..=85 if self.faults && !live.is_empty() => {
                // Half-open: the agent's side is gone; only liveness ends the control plane's.
                let s = live[self.rng.below(live.len() as u64) as usize];
                let a = self.streams[s].agent;
                if self.agents[a].stream == Some(s) {
                    self.log(format!("stream {s} goes half-open"));
                    self.agents[a].stream = None;
                    self.streams[s].agent_closed = true;
                    self.streams[s].to_cp.clear();
                    self.agents[a].down_until = Some(self.now + Duration::from_millis(self.rng.below(5_000)));
                }
            }
            86..=88 if self.faults => {
                let a = self.rng.below(self.agents.len() as u64) as usize;
                let kind = self.rng.below(3);
                let until = self.now + Duration::from_secs(30 + self.rng.below(300));
                let mut firewall = self.agents[a].enforcer.store.lock().expect("the firewall");
                match kind {
                    0 => firewall.fail_next = true,
                    1 => firewall.crash_after_persist = true,
                    _ => {
                        firewall.refusing = true;
                        drop(firewall);
                        self.refusing.insert(a, until);
                        self.log(format!(
                            "agent {a}'s firewall refuses every apply until {:.1}s",
                            until.as_secs_f64()
                        ));
                    }
                }
            }
            89 if self.faults => {
                let a = self.rng.below(self.agents.len() as u64) as usize;
                self.log(format!("agent {a} crashes"));
                self.crash(a, "at rest");
            }
            90..=91 if self.faults => {
                let a = self.rng.below(self.agents.len() as u64) as usize;
                let suspended = {
                    let mut firewall = self.agents[a].enforcer.store.lock().expect("the firewall");
                    firewall.suspended = !firewall.suspended;
                    firewall.installed = if firewall.suspended { None } else { firewall.persisted.clone() };
                    firewall.suspended
                };
                self.log(format!("agent {a} kill switch {}", if suspended { "down" } else { "up" }));
                if let Some(s) = self.agents[a].stream {
                    self.agent_event(s, AgentEvent::Standing(Standing { suspended, reverted_version: 0 }));
                }
            }
            92 if self.faults => {
                // A second stream of one identity (a reconnect racing the old one).
                let a = self.rng.below(self.agents.len() as u64) as usize;
                if self.agents[a].stream.is_some() {
                    self.log(format!("agent {a} opens a duplicate stream"));
                    self.dial(a);
                }
            }
            93 if self.faults => {
                // A listener reconnects: every stream of that replica re-reads (SYNC-7); what
                // was on its way to the old listener is lost.
                let r = self.rng.below(self.replicas.len() as u64) as usize;
                self.log(format!("replica {r}'s listener reconnects"));
                self.replicas[r].notices.clear();
                for s in self.live_streams() {
                    if self.streams[s].replica == r {
                        self.drive(s, Event::Announced);
                    }
                }
            }
            94 if self.faults => {
                // A replica dies: at once, or on one of its next sends (between a send and the
                // state write after it). One replica always stays up.
                let up: Vec<usize> =
                    (0..self.replicas.len()).filter(|r| self.replicas[*r].down_until.is_none()).collect();
                if up.len() > 1 {
                    let r = up[self.rng.below(up.len() as u64) as usize];
                    if self.rng.chance(50) {
                        self.log(format!("replica {r} dies"));
                        self.replica_dies(r);
                    } else {
                        self.replicas[r].dies_after = Some(self.rng.below(3) as usize);
                    }
                }
            }
            95 if self.faults => self.take_backup(),
            96 if self.faults && self.rng.chance(25) => self.restore(),
            _ => self.timers(),
        }
    }

    /// Replica `r` dies: its streams end unrecorded (their agents see a reset), announcements
    /// on their way to it are lost, and it restarts a while later.
    fn replica_dies(&mut self, r: usize) {
        for s in self.live_streams() {
            if self.streams[s].replica != r || self.streams[s].cp_closed {
                continue;
            }
            self.streams[s].cp_closed = true;
            self.streams[s].died_at = Some(self.now);
            let a = self.streams[s].agent;
            if self.agents[a].stream == Some(s) {
                self.agent_drops(a, "its replica died");
            }
        }
        let replica = &mut self.replicas[r];
        replica.notices.clear();
        replica.dies_after = None;
        replica.down_until = Some(self.now + Duration::from_secs(5 + self.rng.below(120)));
    }

    /// A replica (re)starts: it sweeps at once, as `service` does, and every interval after.
    fn replica_starts(&mut self, r: usize) {
        self.replicas[r].down_until = None;
        self.log(format!("replica {r} starts"));
        self.sweep(r);
    }

    fn sweep(&mut self, r: usize) {
        self.store.set_clock(self.wall());
        let swept = self
            .runtime
            .block_on(innerwall_control_plane::sync::store::SyncStore::sweep(&self.store))
            .expect("the memory store sweeps");
        self.replicas[r].next_sweep = self.now + SWEEP_EVERY;
        self.last_sweep = Some(self.now);
        if !swept.is_empty() {
            self.log(format!("replica {r} sweeps {} workload(s) OFFLINE", swept.len()));
        }
    }

    /// A backup of the database (store and authored estate); the last few are kept.
    fn take_backup(&mut self) {
        let backup = Backup {
            at: self.now,
            store: self.store.backup(),
            estate: self.estate.clone(),
            renders: self.renders,
        };
        self.backups.push_back(backup);
        if self.backups.len() > 4 {
            self.backups.pop_front();
        }
    }

    /// The database is restored from the newest backup older than the liveness bound (as a
    /// scheduled backup is): every replica stops, the restore loses what was written since,
    /// the operator authors the lost changes again (other content under the versions a host
    /// may hold), and the replicas start, sweeping.
    fn restore(&mut self) {
        let Some(i) = self.backups.iter().rposition(|b| b.at + LIVENESS < self.now) else { return };
        let backup = self.backups.remove(i).expect("a backup");
        self.log(format!("the database is restored from the backup of {:.1}s", backup.at.as_secs_f64()));
        for r in 0..self.replicas.len() {
            self.replica_dies(r);
        }
        self.store.restore(&backup.store);
        self.estate = backup.estate;
        self.backups.clear();
        let lost = (self.renders - backup.renders).min(5);
        self.renders = backup.renders;
        for _ in 0..lost {
            self.changes += 1;
            let n = self.changes;
            let what = self.estate.change(&mut self.rng, n);
            self.render(&format!("authored again after the restore: {what}"));
        }
        for r in 0..self.replicas.len() {
            self.replica_starts(r);
        }
    }

    /// Announcements that reached their replica's listener go to that replica's streams.
    fn listeners(&mut self) {
        for r in 0..self.replicas.len() {
            while let Some((at, id)) = self.replicas[r].notices.front().copied() {
                if at > self.now {
                    break;
                }
                self.replicas[r].notices.pop_front();
                for s in self.live_streams() {
                    let stream = &self.streams[s];
                    if stream.replica == r && self.agents[stream.agent].id == id {
                        self.drive(s, Event::Announced);
                    }
                }
            }
        }
    }

    /// Deadlines: the control plane's ticks, the agents' heartbeats and redials, refusals lifted.
    fn timers(&mut self) {
        for r in 0..self.replicas.len() {
            match self.replicas[r].down_until {
                Some(until) if until <= self.now => self.replica_starts(r),
                None if self.replicas[r].next_sweep <= self.now => self.sweep(r),
                _ => {}
            }
        }
        let lifted: Vec<usize> =
            self.refusing.iter().filter(|(_, until)| **until <= self.now).map(|(a, _)| *a).collect();
        for a in lifted {
            self.refusing.remove(&a);
            self.agents[a].enforcer.store.lock().expect("the firewall").refusing = false;
            self.log(format!("agent {a}'s firewall takes applies again"));
        }
        for s in self.live_streams() {
            if self.streams[s].core.next_deadline() <= self.now {
                self.drive(s, Event::Tick);
            }
        }
        for a in 0..self.agents.len() {
            match (self.agents[a].stream, self.agents[a].down_until) {
                (None, Some(until)) if until <= self.now => {
                    self.agents[a].down_until = None;
                    self.dial(a);
                }
                (None, None) => self.dial(a),
                (Some(s), _) => {
                    if self.streams[s].cp_closed && self.streams[s].to_agent.is_empty() {
                        // The control plane ended it: the agent sees the end and redials.
                        self.agent_drops(a, "the control plane ended the stream");
                    } else if self.streams[s]
                        .opened_at
                        .saturating_add(self.streams[s].agent_core.next_deadline())
                        <= self.now
                    {
                        self.agent_event(s, AgentEvent::Tick);
                    }
                }
                _ => {}
            }
        }
    }

    /// The invariants that hold after every step.
    fn check(&self) -> Result<(), String> {
        if let Some(violation) = &self.violation {
            return Err(violation.clone());
        }
        // Recovery snapshots are bounded (no storm): beside the opening one, at most one per
        // version the stream carried and one per retry interval it lived.
        for (s, stream) in self.streams.iter().enumerate() {
            let lived = (self.now - stream.opened_at).as_secs() / RECOVERY_RETRY.as_secs();
            let bound = 1 + 2 * stream.versions.len() as u64 + lived + 1;
            if stream.snapshots > bound {
                return Err(format!(
                    "stream {s} sent {} snapshots for {} versions in {:.0} s: a recovery storm",
                    stream.snapshots,
                    stream.versions.len(),
                    (self.now - stream.opened_at).as_secs_f64()
                ));
            }
        }
        for (a, agent) in self.agents.iter().enumerate() {
            let stored = self.store.workload(agent.id).unwrap_or_default();
            let firewall = agent.enforcer.store.lock().expect("the firewall");
            // A host runs its last good policy or the latest, never one no render produced
            // (byte for byte, a version its workload really had, before a restore too).
            let ever = self.ever.get(&agent.id).map_or(&[][..], Vec::as_slice);
            for held in [&firewall.installed, &firewall.persisted].into_iter().flatten() {
                if !ever.contains(held) {
                    return Err(format!(
                        "agent {a} holds version {} whose content no render persisted",
                        held.version()
                    ));
                }
            }
            // The state shown never says SYNCED for a version the agent does not hold, by
            // content: after a restore, a version number may stand for other content.
            if stored.shown_state() == Some(SyncState::Synced) {
                let recorded =
                    stored.policies.iter().map(|(p, _)| p).find(|p| Some(p.version()) == stored.applied);
                if recorded.is_none() || recorded != firewall.persisted.as_ref() {
                    let holds = firewall.persisted.as_ref().map(WorkloadPolicy::version);
                    return Err(format!(
                        "agent {a} is recorded SYNCED at {:?} but holds {holds:?}{}",
                        stored.applied,
                        if recorded.is_some() && stored.applied == holds {
                            " with other content"
                        } else {
                            ""
                        }
                    ));
                }
            }
            // Nor any state but OFFLINE (or none ever recorded) after its stream died with its
            // replica, once a sweep ran beyond the liveness bound: the newest stream of the
            // row's epoch decides whose the row is.
            let owner = self.streams.iter().rev().find(|st| st.agent == a && st.epoch == stored.epoch);
            if let (Some(died), Some(swept)) = (owner.and_then(|st| st.died_at), self.last_sweep)
                && swept > died + LIVENESS
                && stored.state.is_some_and(|state| state != SyncState::Offline)
            {
                return Err(format!(
                    "agent {a} is recorded {:?} though its stream died with its replica at {:.1}s",
                    stored.state,
                    died.as_secs_f64()
                ));
            }
        }
        Ok(())
    }

    /// Whether every agent runs its latest version, shown SYNCED (or SUSPENDED).
    fn converged(&self) -> bool {
        self.agents.iter().all(|agent| {
            let stored = self.store.workload(agent.id).unwrap_or_default();
            let latest = stored.policies.last().map(|(p, _)| p.clone());
            let firewall = agent.enforcer.store.lock().expect("the firewall");
            let want = if firewall.suspended { SyncState::Suspended } else { SyncState::Synced };
            firewall.persisted == latest
                && stored.shown_state() == Some(want)
                && (firewall.suspended || firewall.installed == latest)
        })
    }
}

/// Once faults stop, a stream drains its messages within this many exchanges (one message
/// each way, 10 ms apart), or it never will.
const DRAIN_EXCHANGES: u32 = 1_000;

/// Runs one seed; the failure, if an invariant broke or the agents did not converge.
pub fn run(params: &Params) -> Result<Vec<String>, Failure> {
    let mut world = World::new(params);
    let fail = |world: &World, step: u32, what: String| Failure {
        seed: params.seed,
        step,
        what,
        trace: world.trace.clone(),
    };
    for step in 0..params.steps {
        world.step();
        world.check().map_err(|what| fail(&world, step, what))?;
    }
    // Faults stop (armed ones are disarmed): every live agent converges within a bounded
    // number of steps.
    world.faults = false;
    for agent in &world.agents {
        let mut firewall = agent.enforcer.store.lock().expect("the firewall");
        firewall.fail_next = false;
        firewall.crash_after_persist = false;
        firewall.refusing = false;
    }
    world.refusing.clear();
    for step in params.steps..params.steps + 4_000 {
        world.now += Duration::from_secs(1);
        world.listeners();
        for s in world.live_streams() {
            // Bounded: a protocol that answers every message with another never drains, and
            // that is the failure (found at once, not after thousands of steps of it).
            let mut exchanges = 0;
            while !(world.streams[s].to_agent.is_empty() && world.streams[s].to_cp.is_empty()) {
                if exchanges == DRAIN_EXCHANGES {
                    let what = format!(
                        "stream {s} still carried messages after {DRAIN_EXCHANGES} exchanges once faults stopped: \
                         each message is answered with another"
                    );
                    return Err(fail(&world, step, what));
                }
                exchanges += 1;
                world.now += Duration::from_millis(10);
                world.deliver(s, true);
                world.deliver(s, false);
            }
        }
        world.timers();
        // A reconcile after the faults, as a listener's reconnect does.
        if step % 50 == 0 {
            for s in world.live_streams() {
                world.drive(s, Event::Announced);
            }
        }
        world.check().map_err(|what| fail(&world, step, what))?;
        if world.converged() {
            return Ok(world.trace);
        }
    }
    let states: Vec<String> = world
        .agents
        .iter()
        .map(|a| {
            let w = world.store.workload(a.id).unwrap_or_default();
            let fw = a.enforcer.store.lock().expect("the firewall");
            format!(
                "{:?}/{:?} latest {:?} holds {:?}",
                w.state,
                w.applied,
                w.policies.last().map(|(p, _)| p.version()),
                fw.persisted.as_ref().map(WorkloadPolicy::version)
            )
        })
        .collect();
    Err(fail(
        &world,
        params.steps + 4_000,
        format!("did not converge once faults stopped: {}", states.join("; ")),
    ))
}
