//! Stream state writes, batched. A render that changes 5,000 workloads makes every stream record
//! its state when the agent acknowledges the update (a delta goes with nothing recorded first:
//! the row reads PENDING from the render on, `shown`). Written one by one, these were single-row
//! commits, each waiting for a connection of the streams' pool: at a few thousand agents a
//! replica the last streams waited seconds for their turn (PERF-2). The writer answers every record
//! waiting when it is free with one transaction; no record waits for a timer, only for the write
//! in progress. Each stream still waits for its own record to commit before it goes on, and hears
//! whether it was written (its epoch still the newest) or failed; when a batch fails (a deadlock
//! with a sweep, a workload deleted under it), its records are written one by one.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use innerwall_wire::convert::WireEnum;
use innerwall_wire::identity::WorkloadId;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::session::Record;
use crate::batch;
use crate::error::Error;

/// Records in one transaction at most: the first streams go on while later ones are written.
pub const MAX_BATCH: usize = 1_000;

/// Records waiting for the writer at most; a stream recording one more waits for room.
const QUEUE: usize = 4 * MAX_BATCH;

/// One stream's record: its workload, its epoch and what it records.
type Request = (WorkloadId, i64, Record, oneshot::Sender<Result<bool, Error>>);

/// The recording side, held by the stream store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Records {
    queue: mpsc::Sender<Request>,
    transactions: Arc<AtomicU64>,
}

impl Records {
    /// Starts the writer on `pool`; it ends when the last `Records` is dropped.
    pub fn start(pool: PgPool) -> Records {
        let (queue, pending) = mpsc::channel(QUEUE);
        let transactions = Arc::new(AtomicU64::new(0));
        tokio::spawn(write_forever(pool, pending, transactions.clone()));
        Records { queue, transactions }
    }

    /// Writes `record` of the stream with `epoch` with the next batch; returns once it is
    /// committed, whether it was written (false: a newer stream of the identity said Hello).
    pub async fn write(&self, id: WorkloadId, epoch: i64, record: Record) -> Result<bool, Error> {
        let (done, written) = oneshot::channel();
        let stopped = || Error::Busy("the stream state writer has stopped".into());
        self.queue.send((id, epoch, record, done)).await.map_err(|_| stopped())?;
        written.await.map_err(|_| stopped())?
    }

    /// Transactions committed or tried so far (how many records were shared is what tests see).
    pub fn transactions(&self) -> u64 {
        self.transactions.load(Ordering::Relaxed)
    }
}

async fn write_forever(pool: PgPool, mut pending: mpsc::Receiver<Request>, transactions: Arc<AtomicU64>) {
    while let Some(batch) = batch::next(&mut pending, MAX_BATCH, Duration::ZERO).await {
        // A stream has one record in flight, so it is in a batch once; were one there twice,
        // its later record would be written alone after the batch, keeping their order.
        let mut seen = BTreeSet::new();
        let (now, later): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|(id, epoch, ..)| seen.insert((*id, *epoch)));
        let rows: Vec<_> = now.iter().map(|(id, epoch, record, _)| (*id, *epoch, record)).collect();
        transactions.fetch_add(1, Ordering::Relaxed);
        let alone = match write_batch(&pool, &rows).await {
            Ok(written) => {
                for (id, epoch, _, done) in now {
                    let _ = done.send(Ok(written.contains(&(id.uuid(), epoch))));
                }
                later
            }
            Err(e) => {
                tracing::warn!(records = now.len(), "a stream state batch failed, writing each alone: {e}");
                now.into_iter().chain(later).collect()
            }
        };
        for (id, epoch, record, done) in alone {
            transactions.fetch_add(1, Ordering::Relaxed);
            let written = write_batch(&pool, &[(id, epoch, &record)]).await;
            let _ = done.send(written.map(|w| !w.is_empty()));
        }
    }
}

/// Writes the records (each stream at most once) in one transaction: the installs the acks
/// report (FLOW-5: whoever sees the version SYNCED can upload under it, as both commit together),
/// then the states of the streams still the newest of their identity. Returns the (workload,
/// epoch) of the records written.
async fn write_batch(
    pool: &PgPool,
    rows: &[(WorkloadId, i64, &Record)],
) -> Result<BTreeSet<(Uuid, i64)>, Error> {
    let mut rows = rows.to_vec();
    // In one order, so two batches over the same rows wait for each other, never deadlock.
    rows.sort_by_key(|(id, epoch, _)| (id.uuid(), *epoch));
    // An install once per (workload, version): two streams of one identity may both ack it.
    let mut installs = BTreeSet::new();
    for (id, _, r) in &rows {
        if let (Some(mode), Some(version)) = (r.installed, r.applied)
            && version > 0
        {
            installs.insert((id.uuid(), version as i64, mode.code()));
        }
    }
    let (install_ids, install_versions, install_modes): (Vec<Uuid>, Vec<i64>, Vec<i16>) =
        installs.into_iter().fold(Default::default(), |mut c, (w, v, m)| {
            c.0.push(w);
            c.1.push(v);
            c.2.push(m);
            c
        });
    let mut tx = pool.begin().await?;
    crate::flows::installs::acknowledged(&mut tx, &install_ids, &install_versions, &install_modes).await?;
    let written: Vec<(Uuid, i64)> = sqlx::query_as(
        "UPDATE workloads w SET sync_state = u.state,
            applied_version = COALESCE(u.applied, w.applied_version),
            sync_detail = COALESCE(u.detail, w.sync_detail),
            last_acked_at = CASE WHEN u.acked THEN now() ELSE w.last_acked_at END,
            last_apply_failed_at = CASE WHEN u.failed THEN now() ELSE w.last_apply_failed_at END,
            last_snapshot_sent_at = CASE WHEN u.snapshot_sent THEN now() ELSE w.last_snapshot_sent_at END,
            last_seen_at = now()
         FROM unnest($1::uuid[], $2::bigint[], $3::smallint[], $4::bigint[], $5::text[], $6::bool[], $7::bool[],
                     $8::bool[]) AS u (id, epoch, state, applied, detail, acked, failed, snapshot_sent)
         WHERE w.id = u.id AND w.stream_epoch = u.epoch
         RETURNING w.id, u.epoch",
    )
    .bind(rows.iter().map(|(id, ..)| id.uuid()).collect::<Vec<_>>())
    .bind(rows.iter().map(|(_, epoch, _)| *epoch).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.state.code()).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.applied.map(|v| v as i64)).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.detail.clone()).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.acked).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.failed).collect::<Vec<_>>())
    .bind(rows.iter().map(|(.., r)| r.snapshot_sent).collect::<Vec<_>>())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(written.into_iter().collect())
}
