//! The capacity model's heartbeat load on the Postgres primary (issue 33, item 7; SYNC-6): what
//! one heartbeat interval of a fleet costs when the `workloads` table holds the whole fleet, at
//! sizes the agent benchmarks cannot reach on one machine (a process may hold 20,000 descriptors
//! here, and each simulated agent is a connection).
//!
//! Every agent heartbeats once per interval (30 s), and its replica writes the heartbeats that
//! arrive together in one statement (`sync::beats`, up to 2,000 at a time within 100 ms). Here,
//! on a private server started as the embedded cluster is (durable: `fsync`, `synchronous_commit`
//! and `full_page_writes` on; one per size), the `workloads` table holds `N` live agents' rows (inserted directly, with a stream's state
//! and a 90 s liveness, not enrolled: each row as wide as an enrolled one's), and `R` simulated
//! replicas each run the replica's own heartbeat writer (`Beats`, on a pool of its own) for
//! `N / R` of them, paced to one heartbeat per agent per interval, for one interval. Each
//! heartbeat waits for its commit, as a stream does.
//!
//! Printed per size: the heartbeats written per second against the rate asked for, the write's
//! latency (p50, p99), the CPU of Postgres and the rest of the machine per heartbeat (the machine's
//! busy time less this process's), this process's (the writers'), WAL bytes per heartbeat, and
//! how many of the row updates were HOT (a heartbeat moves `last_seen_at`, which the liveness
//! sweep's index holds, so none can be).
//!
//! Run with `cargo xtask bench heartbeats`: 100,000 agents over 3 replicas and 1,000,000 over 21
//! (the replicas `docs/capacity.md` gives each size); `INNERWALL_BENCH_QUICK=1`: 10,000 over 2
//! for a tenth of an interval. This machine's Postgres shares 2 cores with the writers, so where
//! it cannot keep the pace, the figure is what it did keep and its cost per heartbeat.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use innerwall_control_plane::postgres;
use innerwall_control_plane::sync::beats::{Beat, Beats};
use innerwall_control_plane::testing::usage::{Usage, machine_busy_secs};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::sync::SyncState;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use uuid::Uuid;

#[path = "shared/production_server.rs"]
mod production_server;
use production_server::ProductionServer;

/// The agents' heartbeat interval (the default).
const INTERVAL: Duration = Duration::from_secs(30);
/// Pacing: each writer is handed its share of heartbeats this often.
const TICK: Duration = Duration::from_millis(10);
/// Heartbeats waiting for their commit at most, per replica (twice the writer's own queue): past
/// it, the pace waits, and the heartbeats are late.
const IN_FLIGHT: usize = 16_000;
/// How long the table's statistics may take to count every heartbeat.
const STATISTICS_BOUND: Duration = Duration::from_secs(30);

/// Inserts `n` live agents' rows and returns their ids.
async fn fleet(pool: &PgPool, n: usize) -> anyhow::Result<Vec<Uuid>> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    for chunk in ids.chunks(100_000) {
        sqlx::query(
            "INSERT INTO workloads (id, hostname, sync_state, applied_version, last_seen_at, last_acked_at,
                 stream_liveness, stream_epoch, credential_serial, credential_expires_at, credential_issuer)
             SELECT id, 'host-' || left(id::text, 8), $2, 1, now(), now(), make_interval(secs => 90), 1,
                    md5(id::text) || md5(id::text), now() + interval '30 days', 'innerwall-ca'
             FROM unnest($1::uuid[]) AS t (id)",
        )
        .bind(chunk)
        .bind(SyncState::Synced.code())
        .execute(pool)
        .await?;
    }
    sqlx::query("VACUUM ANALYZE workloads").execute(pool).await?;
    Ok(ids)
}

/// One replica's heartbeats over `span`: each of `ids` once, evenly spaced. Returns each write's
/// latency and how often the pace had to wait for room.
async fn replica(pool: PgPool, ids: Vec<Uuid>, span: Duration) -> anyhow::Result<(Vec<Duration>, u64)> {
    let beats = Beats::start(pool);
    let room = Arc::new(Semaphore::new(IN_FLIGHT));
    let state = SyncState::Synced.code();
    let mut writes = JoinSet::new();
    let mut latencies = Vec::with_capacity(ids.len());
    let mut stalls = 0;
    let start = Instant::now();
    let mut sent = 0;
    let mut tick = tokio::time::interval(TICK);
    while sent < ids.len() {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() / span.as_secs_f64()) * ids.len() as f64).ceil() as usize;
        for &workload in &ids[sent..due.min(ids.len())] {
            let permit = match room.clone().try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => {
                    stalls += 1;
                    room.clone().acquire_owned().await?
                }
            };
            let beats = beats.clone();
            writes.spawn(async move {
                let asked = Instant::now();
                let written = beats.write(Beat { workload, epoch: 1, state }).await;
                drop(permit);
                written.map(|()| asked.elapsed())
            });
            sent += 1;
        }
        while let Some(done) = writes.try_join_next() {
            latencies.push(done??);
        }
    }
    while let Some(done) = writes.join_next().await {
        latencies.push(done??);
    }
    Ok((latencies, stalls))
}

/// CPU seconds the whole machine has spent busy, and this process's.
fn cpu_secs() -> anyhow::Result<(f64, f64)> {
    Ok((machine_busy_secs()?, Usage::of(std::process::id())?.cpu_secs))
}

struct Table {
    updates: i64,
    hot: i64,
    wal: i64,
}

async fn table(pool: &PgPool) -> anyhow::Result<Table> {
    // The statistics are sent at the end of each transaction and read from a snapshot: clear it.
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(pool).await?;
    let (updates, hot, wal): (i64, i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd, (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint
         FROM pg_stat_user_tables WHERE relname = 'workloads'",
    )
    .fetch_one(pool)
    .await?;
    Ok(Table { updates, hot, wal })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn figure(name: &str, value: f64, unit: &str, context: &str) {
    println!(
        "FIGURE {{\"id\":\"SYNC-6\",\"name\":\"{name}\",\"value\":{value:.3},\"unit\":\"{unit}\",\"goal\":null,\"context\":{context}}}"
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (sizes, span): (&[(usize, usize)], Duration) = if std::env::var_os("INNERWALL_BENCH_QUICK").is_some()
    {
        (&[(10_000, 2)], INTERVAL / 10)
    } else {
        (&[(100_000, 3), (1_000_000, 21)], INTERVAL)
    };
    println!("SYNC-6 heartbeat writes over one interval (the capacity model's input; no goal)");
    for &(agents, replicas) in sizes {
        let server = ProductionServer::start().await?;
        let pool = postgres::connect(&server.url).await?;
        let measured = interval(&pool, &server.url, agents, replicas, span).await;
        pool.close().await;
        server.stop()?;
        measured?;
    }
    Ok(())
}

/// One interval of `agents` heartbeats from `replicas` replicas' writers, on a fresh server.
async fn interval(
    pool: &PgPool,
    url: &str,
    agents: usize,
    replicas: usize,
    span: Duration,
) -> anyhow::Result<()> {
    let ids = fleet(pool, agents).await?;
    let mut pools = Vec::new();
    for _ in 0..replicas {
        pools.push(postgres::pool_options().max_connections(2).connect(url).await?);
    }
    let (before, cpu_before) = (table(pool).await?, cpu_secs()?);
    let started = Instant::now();
    let mut running = JoinSet::new();
    for (r, pool) in pools.iter().enumerate() {
        let share: Vec<Uuid> = ids.iter().skip(r).step_by(replicas).copied().collect();
        running.spawn(replica(pool.clone(), share, span));
    }
    let mut latencies = Vec::with_capacity(agents);
    let mut stalls = 0;
    while let Some(done) = running.join_next().await {
        let (more, stalled) = done??;
        latencies.extend(more);
        stalls += stalled;
    }
    let elapsed = started.elapsed();
    let ((busy_after, own_after), wal_after) = (cpu_secs()?, table(pool).await?.wal);
    for pool in pools {
        pool.close().await;
    }
    ensure!(latencies.len() == agents, "{} of {agents} heartbeats written", latencies.len());
    // A server process reports its counts at most once a second, and when its connection
    // ends: wait until the table's counts hold every heartbeat.
    let asked = Instant::now();
    let after = loop {
        let now = table(pool).await?;
        if now.updates - before.updates >= agents as i64 {
            break now;
        }
        ensure!(
            asked.elapsed() < STATISTICS_BOUND,
            "the table counted {} updates for {agents} heartbeats",
            now.updates - before.updates
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let updates = after.updates - before.updates;
    latencies.sort_unstable();
    let beats = agents as f64;
    let rate = beats / elapsed.as_secs_f64();
    let server_cpu = (busy_after - cpu_before.0) - (own_after - cpu_before.1);
    let own_cpu = own_after - cpu_before.1;
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    let wal = (wal_after - before.wal) as f64 / beats;
    let hot = (after.hot - before.hot) as f64 / updates as f64;
    println!(
        "{agents} agents over {replicas} replicas: {agents} heartbeats in {:.1} s ({rate:.0}/s, asked {:.0}/s; the \
         pace waited for room {stalls} times); write p50 {:.1} ms, p99 {:.1} ms; Postgres and the rest {:.1} µs and \
         the writers {:.1} µs of CPU per heartbeat ({:.2} and {:.2} cores); {wal:.0} bytes of WAL per heartbeat; \
         {:.1} % of the row updates HOT",
        elapsed.as_secs_f64(),
        beats / span.as_secs_f64(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        server_cpu * 1e6 / beats,
        own_cpu * 1e6 / beats,
        server_cpu / elapsed.as_secs_f64(),
        own_cpu / elapsed.as_secs_f64(),
        hot * 100.0,
    );
    let context =
        format!("{{\"agents\":{agents},\"replicas\":{replicas},\"interval_s\":{}}}", span.as_secs_f64());
    figure("heartbeats written per second", rate, "heartbeats/s", &context);
    figure("heartbeat write p99", p99.as_secs_f64() * 1e3, "ms", &context);
    figure("Postgres and the rest, CPU per heartbeat", server_cpu * 1e6 / beats, "µs", &context);
    figure("WAL per heartbeat", wal, "bytes", &context);
    Ok(())
}
