//! The capacity model's NOTIFY fan-out (issue 33, item 7; SYNC-7): what one estate-wide change
//! costs the Postgres NOTIFY channel and the replicas that hear it, at sizes the agent benchmarks
//! cannot reach on one machine.
//!
//! A render that moves `N` workloads' policies publishes `N` notices in its transaction, one
//! `<workload> <version>` each (`notice::publish`, what a publish calls); Postgres delivers them
//! on commit to every replica's LISTEN connection, and each replica's bridge parses every one
//! and keeps those of the agents it holds. Here `R` simulated replicas each listen on the real
//! bridge's bus (`sync::bridge::PgBus`, a LISTEN connection of their own), parse each notice
//! with `Notice::parse` and look it up among the `N / R` workloads they hold, as the gateway's
//! map lookup does. No agent streams: what this measures is the channel and the parse, which
//! every replica pays for every workload whatever it holds.
//!
//! Printed per size: the publishing statement and the commit (Postgres writes the notices into
//! its queue at commit, holding the lock every notifying commit of the cluster takes), the time
//! from the commit's start to the last replica's last notice, the notices delivered per second
//! over all replicas, the CPU of the listening server processes and of this process (the
//! replicas' side: receive and parse), and the queue's use sampled right after the commit.
//!
//! Then the same change as the design step the capacity model names, **not what the product
//! does**: the notices packed, as many `<workload> <version>` pairs to a notice as fit in
//! Postgres's 8,000-byte payload bound, to show what packing buys.
//!
//! Run with `cargo xtask bench notify`: 10,000 workloads to 2 replicas, 100,000 to 3 and
//! 1,000,000 to 21 (the replicas `docs/capacity.md` gives each size); `INNERWALL_BENCH_QUICK=1`:
//! 1,000 to 2 and 10,000 to 3.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use innerwall_control_plane::notice::{self, CHANNEL, Notice};
use innerwall_control_plane::sync::bridge::{Bus, PgBus};
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;
use tokio::task::JoinSet;

/// Postgres refuses a payload of 8,000 bytes or more.
const PAYLOAD_BOUND: usize = 7_999;
/// How long the last notice may take to reach every replica before the run fails.
const DELIVERY_BOUND: Duration = Duration::from_secs(600);

/// How the change is announced.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// One notice per workload: what `notice::publish` sends.
    PerWorkload,
    /// Pairs packed into notices up to the payload bound, comma-separated (a design option).
    Packed,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::PerWorkload => "one notice per workload",
            Shape::Packed => "packed notices (design option)",
        }
    }
}

/// What one replica heard: the notices and workloads it parsed, those it holds, and when the
/// last one arrived.
struct Heard {
    notices: u64,
    workloads: u64,
    held: u64,
    last: Instant,
}

/// Listens as replica `replica` of `replicas`, holding every workload whose index is `replica`
/// modulo `replicas`, until it has heard of `expected` workloads.
async fn replica(
    mut bus: PgBus,
    ids: Arc<Vec<WorkloadId>>,
    replica: usize,
    replicas: usize,
    expected: u64,
) -> anyhow::Result<(Heard, PgBus)> {
    let held: BTreeSet<WorkloadId> = ids.iter().skip(replica).step_by(replicas).copied().collect();
    let mut heard = Heard { notices: 0, workloads: 0, held: 0, last: Instant::now() };
    while heard.workloads < expected {
        let payload = bus.next().await.map_err(|e| anyhow::anyhow!("replica {replica}: {e}"))?;
        heard.notices += 1;
        for one in payload.split(',') {
            let Some(Notice::Policy(id, _)) = Notice::parse(one) else {
                bail!("replica {replica} heard a notice that is not a policy announcement: {one:?}");
            };
            heard.workloads += 1;
            heard.held += u64::from(held.contains(&id));
        }
    }
    heard.last = Instant::now();
    // The bus goes back to the caller: its server process must live until its CPU is read.
    Ok((heard, bus))
}

/// CPU nanoseconds a task has run (`/proc/…/schedstat`'s first field).
fn cpu_ns(schedstat: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(schedstat).with_context(|| format!("reading {schedstat}"))?;
    text.split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .with_context(|| format!("malformed {schedstat}"))
}

/// CPU nanoseconds of this process's live threads.
fn own_cpu_ns() -> anyhow::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        total += cpu_ns(&format!("{}/schedstat", task?.path().display()))?;
    }
    Ok(total)
}

/// CPU nanoseconds of these server processes (on this machine: the bench's own cluster).
fn backends_cpu_ns(pids: &[i32]) -> anyhow::Result<u64> {
    pids.iter().map(|pid| cpu_ns(&format!("/proc/{pid}/schedstat"))).sum()
}

/// The packed payloads of a change that moves `ids` to `version`: each notice's pairs, up to the
/// payload bound.
fn packed(ids: &[WorkloadId], version: u64) -> Vec<String> {
    let mut packed: Vec<String> = Vec::new();
    for pair in ids.iter().map(|&id| Notice::Policy(id, version).payload()) {
        match packed.last_mut() {
            Some(last) if last.len() + 1 + pair.len() <= PAYLOAD_BOUND => {
                last.push(',');
                last.push_str(&pair);
            }
            _ => packed.push(pair),
        }
    }
    packed
}

struct Run {
    notices: usize,
    statement: Duration,
    commit: Duration,
    delivered: Duration,
    queue_usage: f64,
    server_cpu: Duration,
    own_cpu: Duration,
}

/// One change of `workloads` heard by `replicas` replicas, on a database of its own.
async fn run(workloads: usize, replicas: usize, shape: Shape) -> anyhow::Result<Run> {
    let db = fresh_database().await?;
    let ids: Arc<Vec<WorkloadId>> = Arc::new((0..workloads).map(|_| WorkloadId::new_random()).collect());
    let mut listeners = JoinSet::new();
    for r in 0..replicas {
        let mut bus = PgBus::new(db.pool.clone());
        bus.listen().await.map_err(|e| anyhow::anyhow!("replica {r} could not listen: {e}"))?;
        listeners.spawn(replica(bus, ids.clone(), r, replicas, workloads as u64));
    }
    let mut backends = listening_backends(&db.pool, replicas).await?;
    // Packed payloads are built before the clock starts; `notice::publish` builds its own.
    let packed = (shape == Shape::Packed).then(|| packed(&ids, 2));
    let notices = packed.as_ref().map_or(workloads, Vec::len);

    let mut tx = db.pool.begin().await?;
    let publisher: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await?;
    backends.push(publisher);
    let (server_before, own_before) = (backends_cpu_ns(&backends)?, own_cpu_ns()?);
    let start = Instant::now();
    match &packed {
        None => {
            let notices: Vec<Notice> = ids.iter().map(|&id| Notice::Policy(id, 2)).collect();
            notice::publish(&mut tx, &notices).await?;
        }
        Some(payloads) => {
            sqlx::query("SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS t (payload)")
                .bind(CHANNEL)
                .bind(payloads)
                .execute(&mut *tx)
                .await?;
        }
    }
    let committing = Instant::now();
    tx.commit().await?;
    let committed = Instant::now();
    let queue_usage: f64 =
        sqlx::query_scalar("SELECT pg_notification_queue_usage()").fetch_one(&db.pool).await?;

    let mut last = committed;
    let heard = tokio::time::timeout(DELIVERY_BOUND, async {
        let mut all = Vec::new();
        while let Some(one) = listeners.join_next().await {
            all.push(one??);
        }
        Ok::<_, anyhow::Error>(all)
    })
    .await
    .with_context(|| format!("not every replica heard {workloads} workloads within {DELIVERY_BOUND:?}"))??;
    let (server_after, own_after) = (backends_cpu_ns(&backends)?, own_cpu_ns()?);
    let heard: Vec<Heard> = heard.into_iter().map(|(heard, _bus)| heard).collect();
    let held: u64 = heard.iter().map(|h| h.held).sum();
    ensure!(held == workloads as u64, "the replicas hold {held} of the {workloads} workloads they heard of");
    for h in &heard {
        ensure!(h.notices == notices as u64, "a replica heard {} of {} notices", h.notices, notices);
        last = last.max(h.last);
    }
    Ok(Run {
        notices,
        statement: committing - start,
        commit: committed - committing,
        delivered: last - committing,
        queue_usage,
        server_cpu: Duration::from_nanos(server_after - server_before),
        own_cpu: Duration::from_nanos(own_after - own_before),
    })
}

/// The server processes of the `replicas` LISTEN connections of the current database.
async fn listening_backends(pool: &PgPool, replicas: usize) -> anyhow::Result<Vec<i32>> {
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'",
    )
    .fetch_all(pool)
    .await?;
    ensure!(pids.len() == replicas, "{} LISTEN connections for {replicas} replicas", pids.len());
    Ok(pids)
}

fn figure(name: &str, value: f64, unit: &str, context: &str) {
    println!(
        "FIGURE {{\"id\":\"SYNC-7\",\"name\":\"{name}\",\"value\":{value:.3},\"unit\":\"{unit}\",\"goal\":null,\"context\":{context}}}"
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let sizes: &[(usize, usize)] = if std::env::var_os("INNERWALL_BENCH_QUICK").is_some() {
        &[(1_000, 2), (10_000, 3)]
    } else {
        &[(10_000, 2), (100_000, 3), (1_000_000, 21)]
    };
    println!("SYNC-7 NOTIFY fan-out of one estate-wide change (the capacity model's input; no goal)");
    for &(workloads, replicas) in sizes {
        for shape in [Shape::PerWorkload, Shape::Packed] {
            let r = run(workloads, replicas, shape).await?;
            let deliveries = (workloads * replicas) as f64;
            println!(
                "{workloads} workloads to {replicas} replicas, {}: {} notices; statement {:.1} ms, commit {:.1} ms, \
                 every replica heard every workload {:.1} ms after the commit began ({:.0} workloads/s over all \
                 replicas); queue {:.3} % used after the commit; CPU: the listening and publishing server processes \
                 {:.0} ms, this process (the replicas' receiving and parsing, the publisher's client) {:.0} ms",
                shape.name(),
                r.notices,
                r.statement.as_secs_f64() * 1e3,
                r.commit.as_secs_f64() * 1e3,
                r.delivered.as_secs_f64() * 1e3,
                deliveries / r.delivered.as_secs_f64(),
                r.queue_usage * 100.0,
                r.server_cpu.as_secs_f64() * 1e3,
                r.own_cpu.as_secs_f64() * 1e3,
            );
            let context = format!(
                "{{\"workloads\":{workloads},\"replicas\":{replicas},\"packed\":{}}}",
                shape == Shape::Packed
            );
            figure("notify statement", r.statement.as_secs_f64() * 1e3, "ms", &context);
            figure("notify commit", r.commit.as_secs_f64() * 1e3, "ms", &context);
            figure(
                "every replica heard it, from the commit",
                r.delivered.as_secs_f64() * 1e3,
                "ms",
                &context,
            );
            figure(
                "server CPU per workload heard",
                r.server_cpu.as_secs_f64() * 1e6 / deliveries,
                "µs",
                &context,
            );
            figure(
                "replica CPU per workload heard",
                r.own_cpu.as_secs_f64() * 1e6 / deliveries,
                "µs",
                &context,
            );
        }
    }
    Ok(())
}
