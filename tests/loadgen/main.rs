//! `innerwall-loadgen`: fleet-scale benchmarks (issue 13; DESIGN.md §11 PERF-2, 3, 4). N
//! simulated agents in one process against real `innerwall serve` replicas and a real Postgres:
//! each agent enrolled for real and holding its own mTLS connection and Sync stream with the
//! agent's own loop (see `fleet`). Three scenarios, each printing its figures as text and as
//! `FIGURE {json}` lines that `cargo xtask bench` collects:
//!
//! - `propagation` (PERF-2): a label change that moves every agent's peer set; from the commit
//!   to each agent's install (it acks right after), p50/p99/max, and the replicas' CPU and RSS.
//! - `storm` (PERF-3): every replica killed and restarted; the time until every agent is SYNCED
//!   again over fresh streams, with the agents' real backoff and full handshakes.
//! - `density` (PERF-4): idle streams one replica holds and its RSS per stream.

mod fleet;
mod host;
mod replica;

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;

use crate::fleet::{Agent, Fleet, FleetConfig, FlowLoad};
use crate::host::RealAgent;
use crate::replica::Sampler;

#[derive(Debug, Parser)]
#[command(name = "innerwall-loadgen", about = "Fleet-scale benchmarks against real control-plane replicas")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, clap::Args)]
struct Knobs {
    /// Simulated agents, each with its own identity, connection and stream.
    #[arg(long)]
    agents: usize,
    /// Replicas of `innerwall serve` the agents are spread over.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The heartbeat interval the replicas give agents.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    heartbeat: Duration,
    /// Label changes per minute committed in the background while the scenario runs (policy
    /// churn: each gives every agent a new version); 0 for none.
    #[arg(long, default_value_t = 0)]
    churn_per_minute: u32,
    /// Flow windows each agent closes and uploads per minute (the agent's own queue and
    /// uploader, on a connection of its own); 0 for none.
    #[arg(long, default_value_t = 0)]
    flows_per_minute: u32,
    /// Records in each of those windows.
    #[arg(long, default_value_t = 100)]
    records_per_window: usize,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// PERF-2: commit → every agent APPLIED, for label changes that move every agent's peers.
    Propagation {
        #[command(flatten)]
        knobs: Knobs,
        /// Changes measured one after the other (each waits for the previous to land).
        #[arg(long, default_value_t = 5)]
        changes: usize,
        /// One real `innerwall-agent` beside the simulated ones, in a network namespace of its
        /// own (real nftables and fsync; needs root), measured on its own.
        #[arg(long)]
        real_agent: bool,
        /// After the clean changes, this many agents stop reading their streams and
        /// `--slow-changes` more changes are measured on the others (SYNC-11).
        #[arg(long, default_value_t = 0)]
        slow: usize,
        /// Changes measured while the slow agents stall: enough to fill their streams.
        #[arg(long, default_value_t = 30)]
        slow_changes: usize,
    },
    /// PERF-3: kill and restart every replica; time until all agents are SYNCED again.
    Storm {
        #[command(flatten)]
        knobs: Knobs,
    },
    /// PERF-3: enrollments per second, each agent with its own token use, key, CSR, TLS
    /// handshake and certificate; the fleet is enrolled and nothing more.
    Enroll {
        #[command(flatten)]
        knobs: Knobs,
    },
    /// PERF-4: idle streams held by one replica and its RSS per stream.
    Density {
        #[command(flatten)]
        knobs: Knobs,
        /// Idle time after the last stream opened before RSS is read.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        settle: Duration,
    },
}

impl Scenario {
    fn knobs(&self) -> &Knobs {
        match self {
            Scenario::Propagation { knobs, .. }
            | Scenario::Storm { knobs }
            | Scenario::Enroll { knobs }
            | Scenario::Density { knobs, .. } => knobs,
        }
    }
}

/// How long a fleet may take to converge, by size: generous, it is a bound, not a figure.
fn converge_limit(agents: usize) -> Duration {
    Duration::from_secs(120 + agents as u64 / 20)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    raise_file_limit(cli.scenario.knobs().agents)?;
    // Every stalled agent blocks a thread of the blocking pool in its install (`fleet::Stall`):
    // room for them beside the others' installs.
    let stalled = match &cli.scenario {
        Scenario::Propagation { slow, .. } => *slow,
        _ => 0,
    };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().max_blocking_threads(8 + stalled).enable_all().build()?;
    runtime.block_on(async {
        match cli.scenario {
            Scenario::Propagation { knobs, changes, real_agent, slow, slow_changes } => {
                propagation(&knobs, changes, real_agent, slow, slow_changes).await
            }
            Scenario::Storm { knobs } => storm(&knobs).await,
            Scenario::Enroll { knobs } => enroll(&knobs).await,
            Scenario::Density { knobs, settle } => density(&knobs, settle).await,
        }
    })
}

/// Every agent is a connection on both sides of loopback: raise this process's open-file limit
/// (replicas inherit it) to what the fleet needs. The product's defaults are left alone; the
/// operator's equivalent is `LimitNOFILE=` in the replica's unit (BENCHMARKS.md). A fleet the
/// limit cannot hold is refused before it starts: each stream takes a descriptor here and one in
/// its replica, and a replica at its limit refuses connections, which agents retry without end.
fn raise_file_limit(agents: usize) -> anyhow::Result<()> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    const WANT: u64 = 1 << 20;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < WANT {
        setrlimit(Resource::RLIMIT_NOFILE, WANT, hard.max(WANT))
            .or_else(|_| setrlimit(Resource::RLIMIT_NOFILE, hard, hard))
            .context("raising the open-file limit")?;
    }
    let (limit, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    let needed = agents as u64 + 1_000;
    anyhow::ensure!(
        limit >= needed,
        "{agents} agents need about {needed} open files in this process and as many in a replica, and \
         the limit here is {limit} (the hard limit, which only CAP_SYS_RESOURCE raises; `ulimit -Hn`)"
    );
    Ok(())
}

async fn fleet(
    knobs: &Knobs,
    spare_peers: usize,
    stream_window: Option<(u32, usize)>,
) -> anyhow::Result<(Fleet, f64)> {
    let config = FleetConfig {
        stream_window,
        agents: knobs.agents,
        replicas: knobs.replicas,
        heartbeat: knobs.heartbeat,
        spare_peers,
        flows: (knobs.flows_per_minute > 0).then_some(FlowLoad {
            windows_per_minute: knobs.flows_per_minute,
            records: knobs.records_per_window,
        }),
    };
    let mut fleet = Fleet::create(&config).await?;
    let took = fleet.enroll(knobs.agents).await?;
    let rate = knobs.agents as f64 / took.as_secs_f64().max(1e-3);
    println!(
        "enrolled {} agents in {:.1} s ({rate:.0}/s): token, key, CSR and certificate each",
        knobs.agents,
        took.as_secs_f64(),
    );
    Ok((fleet, rate))
}

/// PERF-3: enrolls the fleet, each agent through the real path, and nothing more.
async fn enroll(knobs: &Knobs) -> anyhow::Result<()> {
    let (_fleet, rate) = fleet(knobs, 0, None).await?;
    let context = json!({"agents": knobs.agents, "concurrency": fleet::ENROLL_CONCURRENCY});
    figure("PERF-3", "enrollments per second", rate, "enrollments/s", Some((">=", 800.0)), &context);
    Ok(())
}

/// Connects the enrolled agents and waits until all are SYNCED.
async fn connect(fleet: &mut Fleet) -> anyhow::Result<()> {
    fleet.connect();
    let took = fleet.wait_converged(&Default::default(), converge_limit(fleet.agents.len())).await?;
    println!(
        "{} agents connected and SYNCED in {:.1} s over {} replica(s)",
        fleet.agents.len(),
        took.as_secs_f64(),
        fleet.replicas.len()
    );
    Ok(())
}

/// Background label changes at `per_minute` while the returned task runs (it stops when
/// dropped by abort). Each change moves a spare peer in and back out.
fn churn(pool: sqlx::PgPool, per_minute: u32) -> Option<tokio::task::JoinHandle<()>> {
    if per_minute == 0 {
        return None;
    }
    let every = Duration::from_secs_f64(60.0 / f64::from(per_minute));
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        let mut n = 0u64;
        loop {
            tick.tick().await;
            n += 1;
            let _ =
                innerwall_control_plane::testing::add_web_port(&pool, u16::try_from(n % 50_000).unwrap_or(0))
                    .await;
        }
    }))
}

/// The stream window of the agents a slow run stalls: a stalled stream backs up within a few
/// updates (a peer moving in is a delta of some 100 bytes, and the default 2 MiB window would
/// take thousands), which is when its replica must fold announcements instead of queuing them.
/// The others keep the default window, as in a fleet without slow agents (1 KiB for every agent
/// added some 50 ms to the clean run's p99 at 5,000 agents: window updates).
const SLOW_RUN_WINDOW: u32 = 1024;

/// What a series of changes measured.
#[derive(Debug, Default)]
struct Measured {
    /// Commit → installed, per agent per change.
    latencies: Vec<Duration>,
    /// The commits themselves (render + persist).
    commits: Vec<Duration>,
    /// Commit → every measured agent's ack in the database, per change.
    recorded: Vec<Duration>,
    /// Commit → the real agent's ack in the database, per change.
    real: Vec<Duration>,
    /// Those of `latencies` of the agents with a narrowed stream window, and of the others.
    narrowed: Vec<Duration>,
    wide: Vec<Duration>,
}

impl Measured {
    /// The `q` quantile of the agents' latencies, in ms.
    fn at(&self, q: f64) -> f64 {
        quantile(&self.latencies, q)
    }
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// `changes` label changes one after the other, each measured on the agents in `measured` (and
/// on the real agent).
async fn measure(
    fleet: &mut Fleet,
    measured: std::ops::RangeFrom<usize>,
    real: Option<&RealAgent>,
    changes: usize,
) -> anyhow::Result<Measured> {
    let limit = converge_limit(fleet.agents.len());
    let mut m = Measured::default();
    for _ in 0..changes {
        let started = Instant::now();
        let (targets, committed) = fleet.change().await?;
        let committed_at: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(fleet.pool()).await?;
        m.commits.push(committed - started);
        let agents: &[Agent] = &fleet.agents[measured.clone()];
        let latencies = Fleet::propagation(agents, &targets, committed, limit).await?;
        // The agents of the slow run's narrow window, while they still read (agent order).
        let narrowed = fleet.narrowed().saturating_sub(measured.start);
        m.narrowed.extend_from_slice(&latencies[..narrowed]);
        m.wide.extend_from_slice(&latencies[narrowed..]);
        m.latencies.extend(latencies);
        if let Some(real) = real {
            let version = *targets.get(&real.id).context("the change gave the real agent no new version")?;
            m.real.push(real.acked_after(fleet.pool(), version, committed_at, limit).await?);
        }
        // The replicas' view: every ack recorded (SYNCED at the new version) in the database.
        if measured.start == 0 {
            fleet.wait_converged(&Default::default(), limit).await?;
        } else {
            fleet.wait_synced(agents, limit).await?;
        }
        m.recorded.push(committed.elapsed());
    }
    m.latencies.sort();
    m.real.sort();
    m.narrowed.sort();
    m.wide.sort();
    Ok(m)
}

async fn propagation(
    knobs: &Knobs,
    changes: usize,
    real_agent: bool,
    slow: usize,
    slow_changes: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(slow < knobs.agents, "--slow {slow} leaves no agent of {} reading", knobs.agents);
    let spares = changes + if slow > 0 { slow_changes } else { 0 };
    let (mut fleet, _) = fleet(knobs, spares, (slow > 0).then_some((SLOW_RUN_WINDOW, slow))).await?;
    connect(&mut fleet).await?;
    let real = match real_agent {
        true => {
            let real = RealAgent::start(&fleet, 0).await?;
            fleet.other_streams = 1;
            Some(real)
        }
        false => None,
    };
    let churn = churn(fleet.pool().clone(), knobs.churn_per_minute);
    let sampler = Sampler::start(fleet.replica_pids());
    let sent_before = pushes_sent(&fleet).await?;
    let clean = measure(&mut fleet, 0.., real.as_ref(), changes).await?;
    let (cores, peak_rss) = sampler.finish().await;
    let sent = pushes_sent(&fleet).await?;
    let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
    let scope = format!("{} agents, {} replica(s), {changes} changes", knobs.agents, knobs.replicas);
    let commit_ms = clean.commits.iter().map(ms).fold(0.0, f64::max);
    let recorded_ms = clean.recorded.iter().map(ms).fold(0.0, f64::max);
    println!("PERF-2 propagation ({scope}): commit → installed and acked, per agent");
    println!(
        "  p50 {:.1} ms · p99 {:.1} ms · max {:.1} ms (goal p99 < 400 ms); commit itself (render + persist) up to {commit_ms:.1} ms",
        clean.at(0.50),
        clean.at(0.99),
        clean.at(1.0)
    );
    println!(
        "  every ack recorded in the database within {recorded_ms:.1} ms of the commit; replicas used {cores:.2} cores on average, peak RSS {peak_rss:.1} MiB"
    );
    println!(
        "  the replicas' side: {:.0} deltas sent, on average {:.1} ms after their render's commit",
        sent.1 - sent_before.1,
        (sent.0 - sent_before.0) / (sent.1 - sent_before.1).max(1.0) * 1000.0
    );
    if !clean.narrowed.is_empty() {
        println!(
            "  of which the {slow} agents the slow run stalls (stream window {SLOW_RUN_WINDOW} bytes): p50 {:.1} ms · p99 {:.1} ms; the other {}: p50 {:.1} ms · p99 {:.1} ms",
            quantile(&clean.narrowed, 0.5),
            quantile(&clean.narrowed, 0.99),
            knobs.agents - slow,
            quantile(&clean.wide, 0.5),
            quantile(&clean.wide, 0.99),
        );
    }
    let base = json!({"agents": knobs.agents, "replicas": knobs.replicas, "changes": changes});
    figure("PERF-2", "propagation p50", clean.at(0.50), "ms", None, &base);
    figure("PERF-2", "propagation p99", clean.at(0.99), "ms", Some(("<", 400.0)), &base);
    figure("PERF-2", "propagation max", clean.at(1.0), "ms", None, &base);
    figure("PERF-2", "commit duration max", commit_ms, "ms", None, &base);
    figure("PERF-2", "all acks recorded max", recorded_ms, "ms", None, &base);
    figure("PERF-2", "replica CPU", cores, "cores", None, &base);
    figure("PERF-2", "replica peak RSS", peak_rss, "MiB", None, &base);
    if let Some(real) = &real {
        let (p50, max) = (quantile(&clean.real, 0.5), quantile(&clean.real, 1.0));
        let table = real.table()?;
        anyhow::ensure!(table.contains("10.200.255."), "the real agent's table admits no peer:\n{table}");
        println!(
            "  the real agent (innerwall-agent in a network namespace, nftables in enforcement, state fsynced): \
             commit → its ack recorded p50 {p50:.1} ms, max {max:.1} ms"
        );
        figure("PERF-2", "real agent commit to ack recorded p50", p50, "ms", None, &base);
        figure("PERF-2", "real agent commit to ack recorded max", max, "ms", Some(("<", 400.0)), &base);
    }
    if slow > 0 {
        slow_agents(&mut fleet, slow, slow_changes, &clean, real.as_ref()).await?;
    }
    if let Some(churn) = churn {
        churn.abort();
    }
    Ok(())
}

/// The replicas' `push_sent_latency` so far, summed over them: (seconds, deltas).
async fn pushes_sent(fleet: &Fleet) -> anyhow::Result<(f64, f64)> {
    let (mut seconds, mut deltas) = (0.0, 0.0);
    for replica in &fleet.replicas {
        seconds += replica.metric("innerwall_push_sent_latency_seconds_sum").await?;
        deltas += replica.metric("innerwall_push_sent_latency_seconds_count").await?;
    }
    Ok((seconds, deltas))
}

/// SYNC-11 at fleet size: the first `slow` agents (spread over the replicas as every agent is)
/// stop reading their streams; `changes` changes are measured on the others, against the clean
/// run; then the slow ones read again, and what reached them is counted.
async fn slow_agents(
    fleet: &mut Fleet,
    slow: usize,
    changes: usize,
    clean: &Measured,
    real: Option<&RealAgent>,
) -> anyhow::Result<()> {
    let coalesced = async |fleet: &Fleet| -> anyhow::Result<f64> {
        let mut sum = 0.0;
        for replica in &fleet.replicas {
            sum += replica.metric("innerwall_announcements_coalesced_total").await?;
        }
        Ok(sum)
    };
    let folded_before = coalesced(fleet).await?;
    let installs_before: Vec<u64> = fleet.agents[..slow]
        .iter()
        .map(|a| a.log.installs.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    for agent in &fleet.agents[..slow] {
        agent.stall.stop();
    }
    let sampler = Sampler::start(fleet.replica_pids());
    let stalled = measure(fleet, slow.., real, changes).await?;
    let (cores, peak_rss) = sampler.finish().await;
    let resumed = Instant::now();
    for agent in &fleet.agents[..slow] {
        agent.stall.resume();
    }
    fleet.wait_converged(&Default::default(), converge_limit(fleet.agents.len())).await?;
    let caught_up = resumed.elapsed();
    // A stream counts what it folded when it takes the next announcement, after it could send.
    let folded = coalesced(fleet).await? - folded_before;
    let received: Vec<u64> = fleet.agents[..slow]
        .iter()
        .zip(installs_before)
        .map(|(a, before)| a.log.installs.load(std::sync::atomic::Ordering::Relaxed) - before)
        .collect();
    let most = received.iter().copied().max().unwrap_or(0);
    let mean = received.iter().sum::<u64>() as f64 / received.len().max(1) as f64;
    let ratio = stalled.at(0.99) / clean.at(0.99);
    println!(
        "SYNC-11 slow agents: {slow} of {} stop reading their streams (stream window {SLOW_RUN_WINDOW} bytes), {changes} changes",
        fleet.agents.len()
    );
    println!(
        "  the others: p50 {:.1} ms · p99 {:.1} ms · max {:.1} ms, {:.2} times the clean run's p99 (goal ≤ 1.10); replicas used {cores:.2} cores, peak RSS {peak_rss:.1} MiB",
        stalled.at(0.5),
        stalled.at(0.99),
        stalled.at(1.0),
        ratio
    );
    println!(
        "  {folded:.0} announcements folded into later ones while they stalled; once reading, each slow agent received {mean:.1} updates on average, {most} at most, for {changes} versions, and all were SYNCED {:.1} s after resuming",
        caught_up.as_secs_f64()
    );
    anyhow::ensure!(folded > 0.0, "no announcement was folded: the slow agents' streams never backed up");
    anyhow::ensure!(
        most < changes as u64,
        "a slow agent received {most} updates for {changes} versions: they were queued, not folded"
    );
    let base = json!({"agents": fleet.agents.len(), "replicas": fleet.replicas.len(), "slow": slow, "changes": changes});
    figure("SYNC-11", "fast agents p99 while a tenth stall", stalled.at(0.99), "ms", None, &base);
    figure("SYNC-11", "fast agents p99 against the clean run", ratio, "times", Some(("<=", 1.10)), &base);
    figure("SYNC-11", "announcements folded", folded, "announcements", None, &base);
    figure(
        "SYNC-11",
        "updates per slow agent, most",
        most as f64,
        "updates",
        Some(("<", changes as f64)),
        &base,
    );
    figure("SYNC-11", "replica peak RSS while stalled", peak_rss, "MiB", None, &base);
    Ok(())
}

async fn storm(knobs: &Knobs) -> anyhow::Result<()> {
    let (mut fleet, _) = fleet(knobs, 0, None).await?;
    connect(&mut fleet).await?;
    let churn = churn(fleet.pool().clone(), knobs.churn_per_minute);
    let streams_before = fleet.streams();
    let installs_before = fleet.installs();
    let dials_before = fleet.dial_failures();
    let killed = Instant::now();
    for replica in &mut fleet.replicas {
        replica.kill()?;
    }
    for replica in &mut fleet.replicas {
        replica.restart().await?;
    }
    let restarted = killed.elapsed();
    let sampler = Sampler::start(fleet.replica_pids());
    // Every agent on a new stream (its count moved past the one before the kill), SYNCED.
    let min_streams = streams_before.iter().map(|(id, n)| (*id, n + 1)).collect();
    let recovered = fleet.wait_converged(&min_streams, converge_limit(fleet.agents.len())).await;
    let (cores, peak_rss) = sampler.finish().await;
    if let Some(churn) = churn {
        churn.abort();
    }
    let total = killed.elapsed();
    let mut failed = 0.0;
    for replica in &fleet.replicas {
        failed += replica.metric_labeled("innerwall_acks_total", "status=\"FAILED\"").await?;
    }
    let ended = fleet.agents.iter().filter(|a| a.ended()).count();
    let errors = failed as usize + ended + usize::from(recovered.is_err());
    let snapshots = (fleet.installs() - installs_before) as f64 / fleet.agents.len() as f64;
    let dials = fleet.dial_failures() - dials_before;
    let scope = format!("{} agents, {} replica(s)", knobs.agents, knobs.replicas);
    println!("PERF-3 reconnect storm ({scope}): replicas killed (SIGKILL) and restarted");
    println!(
        "  every agent SYNCED on a new stream {:.1} s after the kill (replicas back after {:.1} s; goal < 60 s)",
        total.as_secs_f64(),
        restarted.as_secs_f64()
    );
    println!(
        "  errors {errors} (FAILED acks {failed}, agents ordered to re-enroll {ended}; goal 0); installs per agent {snapshots:.2} (goal ≤ 1); failed dials, retried with backoff: {dials}; replicas used {cores:.2} cores, peak RSS {peak_rss:.1} MiB"
    );
    if let Err(e) = &recovered {
        println!("  NOT RECOVERED: {e:#}");
    }
    let base = json!({"agents": knobs.agents, "replicas": knobs.replicas});
    figure("PERF-3", "reconnect storm recovery", total.as_secs_f64(), "s", Some(("<", 60.0)), &base);
    figure("PERF-3", "reconnect storm errors", errors as f64, "errors", Some(("<=", 0.0)), &base);
    figure("PERF-3", "snapshots per agent", snapshots, "per agent", Some(("<=", 1.0)), &base);
    figure("PERF-3", "failed dials", dials as f64, "dials", None, &base);
    figure("PERF-3", "replica CPU during recovery", cores, "cores", None, &base);
    recovered.map(drop)
}

async fn density(knobs: &Knobs, settle: Duration) -> anyhow::Result<()> {
    let (mut fleet, _) = fleet(knobs, 0, None).await?;
    // Baseline after enrollment, before any stream: what the streams add is what is measured.
    let before = fleet.replicas.iter().map(|r| r.usage().map(|u| u.rss_kib)).sum::<anyhow::Result<u64>>()?;
    connect(&mut fleet).await?;
    tokio::time::sleep(settle).await;
    let churn = churn(fleet.pool().clone(), knobs.churn_per_minute);
    let after = fleet.replicas.iter().map(|r| r.usage().map(|u| u.rss_kib)).sum::<anyhow::Result<u64>>()?;
    if let Some(churn) = churn {
        churn.abort();
    }
    let streams = fleet.streams_open().await?;
    let per_stream = after.saturating_sub(before) as f64 / streams.max(1) as f64;
    println!(
        "PERF-4 stream density ({} replica(s)): {streams} idle streams held; RSS {:.1} → {:.1} MiB, {per_stream:.1} KiB per stream (goal ≥ 50,000 streams at ≤ 40 KiB each)",
        knobs.replicas,
        before as f64 / 1024.0,
        after as f64 / 1024.0
    );
    let base = json!({"agents": knobs.agents, "replicas": knobs.replicas});
    figure(
        "PERF-4",
        "idle streams held",
        streams as f64,
        "streams",
        Some((">=", knobs.agents as f64)),
        &base,
    );
    figure("PERF-4", "RSS per stream", per_stream, "KiB", Some(("<=", 40.0)), &base);

    // What holding the idle fleet costs: over one heartbeat interval every stream sends one
    // heartbeat, which the replica writes to Postgres.
    let replicas_cpu =
        || fleet.replicas.iter().map(|r| r.usage().map(|u| u.cpu_secs)).sum::<anyhow::Result<f64>>();
    let own_cpu = || replica::Usage::of(std::process::id()).map(|u| u.cpu_secs);
    let stored = async || -> anyhow::Result<(i64, i64)> {
        Ok(sqlx::query_as("SELECT (SELECT count(*) FROM flow_windows), (SELECT count(*) FROM flow_records)")
            .fetch_one(fleet.pool())
            .await?)
    };
    let stored0 = stored().await?;
    let (machine0, replicas0, own0) = (replica::machine_busy_secs()?, replicas_cpu()?, own_cpu()?);
    let started = Instant::now();
    tokio::time::sleep(knobs.heartbeat).await;
    let secs = started.elapsed().as_secs_f64();
    let stored1 = stored().await?;
    let replicas_cores = (replicas_cpu()? - replicas0) / secs;
    let own_cores = (own_cpu()? - own0) / secs;
    let rest_cores =
        ((replica::machine_busy_secs()? - machine0) / secs - replicas_cores - own_cores).max(0.0);
    println!(
        "PERF-4 idle fleet over one heartbeat interval ({secs:.1} s, {:.0} heartbeats/s): replica(s) {replicas_cores:.3} cores, Postgres and the rest of the machine {rest_cores:.3} cores, the simulated agents {own_cores:.3} cores",
        streams as f64 / knobs.heartbeat.as_secs_f64()
    );
    let context = json!({"agents": knobs.agents, "replicas": knobs.replicas, "heartbeat_s": knobs.heartbeat.as_secs_f64()});
    figure("PERF-4", "replica CPU, idle fleet", replicas_cores, "cores", None, &context);
    figure("PERF-4", "Postgres and the rest of the machine, idle fleet", rest_cores, "cores", None, &context);
    figure(
        "PERF-4",
        "replica, Postgres and the rest, idle fleet",
        replicas_cores + rest_cores,
        "cores",
        Some(("<=", 0.15)),
        &context,
    );

    // The liveness sweep every replica runs once per heartbeat interval, over this fleet, all of
    // it alive: what it costs when nothing went silent.
    let mut sweeps = Vec::new();
    for _ in 0..9 {
        let started = Instant::now();
        let swept = innerwall_control_plane::sync::liveness::sweep(fleet.pool()).await?;
        sweeps.push(started.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(swept.is_empty(), "the sweep marked {} live agents OFFLINE", swept.len());
    }
    sweeps.sort_by(f64::total_cmp);
    println!("PERF-4 liveness sweep over {streams} live streams: median {:.2} ms of 9", sweeps[4]);
    figure("PERF-4", "liveness sweep, nothing silent", sweeps[4], "ms", None, &base);
    if knobs.flows_per_minute > 0 {
        let (windows, records) =
            ((stored1.0 - stored0.0) as f64 / secs, (stored1.1 - stored0.1) as f64 / secs);
        println!(
            "PERF-4 flows during that interval: {windows:.1} windows/s, {records:.0} records/s stored ({} per agent per minute, {} records each)",
            knobs.flows_per_minute, knobs.records_per_window
        );
        anyhow::ensure!(windows > 0.0, "flows were on, yet no flow window was stored in {secs:.1} s");
        figure("PERF-4", "flow windows stored, idle fleet", windows, "windows/s", None, &context);
    }
    Ok(())
}

/// One `FIGURE {json}` line: what `cargo xtask bench` collects.
fn figure(
    id: &str,
    name: &str,
    value: f64,
    unit: &str,
    goal: Option<(&str, f64)>,
    context: &serde_json::Value,
) {
    let goal = goal.map(|(op, bound)| json!({"op": op, "bound": bound}));
    let line =
        json!({"id": id, "name": name, "value": value, "unit": unit, "goal": goal, "context": context});
    println!("FIGURE {line}");
}
