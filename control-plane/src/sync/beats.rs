//! Heartbeat writes, batched. Every heartbeat moves its workload's `last_seen_at` (and answers a
//! liveness sweep that marked a live stream offline). One UPDATE per heartbeat is one commit, one
//! WAL flush, per agent per interval: 333 a second for 10,000 agents at 30 s. The writer gathers
//! the heartbeats that arrive within [`LINGER`] (at most [`MAX_BATCH`]) into one statement.
//! Each stream still waits for its own write and hears its own failure: when a batch fails (a
//! deadlock with a sweep, say), its heartbeats are written one by one, as before batching.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use innerwall_wire::convert::WireEnum;

use crate::batch;
use crate::error::Error;
use crate::sync::session::SyncState;

/// How long the writer waits for more heartbeats after the first of a batch: at most this much
/// later in `last_seen_at`, against liveness bounds of three heartbeat intervals.
pub const LINGER: Duration = Duration::from_millis(100);

/// Heartbeats in one statement at most.
pub const MAX_BATCH: usize = 2_000;

/// Heartbeats waiting for the writer at most; a stream sending one more waits for room.
const QUEUE: usize = 4 * MAX_BATCH;

/// One stream's heartbeat: its workload, its epoch, the state it last recorded (its code; 0
/// before any), so a sweep's wrong OFFLINE is replaced by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    pub workload: Uuid,
    pub epoch: i64,
    pub state: i16,
}

/// The batch as statement parameters: one row per workload, the newest stream's heartbeat for a
/// workload that has two (only a row's current epoch can change its state).
fn rows(beats: impl IntoIterator<Item = Beat>) -> (Vec<Uuid>, Vec<i64>, Vec<i16>) {
    let mut newest: BTreeMap<Uuid, Beat> = BTreeMap::new();
    for beat in beats {
        newest.entry(beat.workload).and_modify(|b| *b = (*b).max_by_epoch(beat)).or_insert(beat);
    }
    let mut columns = (Vec::with_capacity(newest.len()), Vec::new(), Vec::new());
    for beat in newest.into_values() {
        columns.0.push(beat.workload);
        columns.1.push(beat.epoch);
        columns.2.push(beat.state);
    }
    columns
}

impl Beat {
    fn max_by_epoch(self, other: Beat) -> Beat {
        if other.epoch >= self.epoch { other } else { self }
    }
}

/// The sending side, held by the gateway. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Beats {
    queue: mpsc::Sender<(Beat, oneshot::Sender<Result<(), Error>>)>,
}

impl Beats {
    /// Starts the writer on `pool`; it ends when the last `Beats` is dropped.
    pub fn start(pool: PgPool) -> Beats {
        let (queue, pending) = mpsc::channel(QUEUE);
        tokio::spawn(write_forever(pool, pending));
        Beats { queue }
    }

    /// Writes `beat` with the next batch and returns once it is committed.
    pub async fn write(&self, beat: Beat) -> Result<(), Error> {
        let (done, written) = oneshot::channel();
        let stopped = || Error::Busy("the heartbeat writer has stopped".into());
        self.queue.send((beat, done)).await.map_err(|_| stopped())?;
        written.await.map_err(|_| stopped())?
    }
}

type Pending = mpsc::Receiver<(Beat, oneshot::Sender<Result<(), Error>>)>;

async fn write_forever(pool: PgPool, mut pending: Pending) {
    while let Some(batch) = batch::next(&mut pending, MAX_BATCH, LINGER).await {
        match write_batch(&pool, batch.iter().map(|(b, _)| *b)).await {
            Ok(()) => {
                for (_, done) in batch {
                    let _ = done.send(Ok(()));
                }
            }
            Err(e) => {
                tracing::warn!(heartbeats = batch.len(), "a heartbeat batch failed, writing each alone: {e}");
                for (beat, done) in batch {
                    let _ = done.send(write_batch(&pool, [beat]).await);
                }
            }
        }
    }
}

async fn write_batch(pool: &PgPool, beats: impl IntoIterator<Item = Beat>) -> Result<(), Error> {
    let (ids, epochs, states) = rows(beats);
    sqlx::query(
        "UPDATE workloads w SET last_seen_at = now(),
             sync_state = CASE WHEN w.sync_state = $4 AND w.stream_epoch = t.epoch AND t.state <> 0
                               THEN t.state ELSE w.sync_state END
         FROM unnest($1::uuid[], $2::bigint[], $3::smallint[]) AS t (id, epoch, state)
         WHERE w.id = t.id",
    )
    .bind(&ids)
    .bind(&epochs)
    .bind(&states)
    .bind(SyncState::Offline.code())
    .execute(pool)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_has_one_row_per_workload_the_newest_streams() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let beat = |workload, epoch, state| Beat { workload, epoch, state };
        let (ids, epochs, states) =
            rows([beat(b, 3, 2), beat(a, 7, 2), beat(b, 5, 1), beat(b, 4, 3), beat(a, 7, 3)]);
        assert_eq!(ids, [a, b]);
        assert_eq!(epochs, [7, 5]);
        // Equal epochs: the later heartbeat of the one stream.
        assert_eq!(states, [3, 1]);
    }
}
