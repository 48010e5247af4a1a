//! Reads of persisted policies for streams, batched. A render that changes 1,000 workloads pokes
//! 1,000 streams at once, and a restarted replica opens thousands of streams at once; each used
//! to read its own policy with its own query. The reader answers every request waiting when it is
//! free with one query; no request waits for a timer, only for the read in progress. Each stream
//! decodes its own bytes, so decoding stays spread over the runtime's workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::WorkloadPolicy;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use crate::batch;
use crate::error::Error;
use crate::policy::store;

/// Requests in one query at most: the first streams get their answers while later ones are
/// read, and a query's result stays bounded (100 policies of a large estate are ~5 MB).
pub const MAX_BATCH: usize = 100;

/// Requests waiting for the reader at most; a stream asking one more waits for room.
const QUEUE: usize = 4 * MAX_BATCH;

/// A stored policy as read, undecoded, and when it was rendered.
type Stored = (store::Persisted, chrono::DateTime<chrono::Utc>);
type Answer = oneshot::Sender<Result<Option<Stored>, String>>;

/// The asking side, held by the gateway. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reads {
    queue: mpsc::Sender<(WorkloadId, Answer)>,
    queries: Arc<AtomicU64>,
}

impl Reads {
    /// Starts the reader on `pool`; it ends when the last `Reads` is dropped.
    pub fn start(pool: PgPool) -> Reads {
        let (queue, pending) = mpsc::channel(QUEUE);
        let queries = Arc::new(AtomicU64::new(0));
        tokio::spawn(read_forever(pool, pending, queries.clone()));
        Reads { queue, queries }
    }

    /// `id`'s latest persisted policy and when it was rendered, if it has one.
    pub async fn latest(
        &self,
        id: WorkloadId,
    ) -> Result<Option<(WorkloadPolicy, chrono::DateTime<chrono::Utc>)>, Error> {
        let (answer, answered) = oneshot::channel();
        let stopped = || Error::Busy("the policy reader has stopped".into());
        self.queue.send((id, answer)).await.map_err(|_| stopped())?;
        match answered.await.map_err(|_| stopped())? {
            Ok(Some((persisted, rendered_at))) => Ok(Some((persisted.decode()?, rendered_at))),
            Ok(None) => Ok(None),
            Err(why) => Err(Error::Busy(format!("reading persisted policies: {why}"))),
        }
    }

    /// Queries run so far (how many reads were shared is what tests look at).
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }
}

async fn read_forever(
    pool: PgPool,
    mut pending: mpsc::Receiver<(WorkloadId, Answer)>,
    queries: Arc<AtomicU64>,
) {
    while let Some(batch) = batch::next(&mut pending, MAX_BATCH, Duration::ZERO).await {
        let mut ids: Vec<uuid::Uuid> = batch.iter().map(|(id, _)| id.uuid()).collect();
        ids.sort_unstable();
        ids.dedup();
        queries.fetch_add(1, Ordering::Relaxed);
        match store::persisted_bytes_of(&pool, &ids).await {
            Ok(found) => {
                for (id, answer) in batch {
                    let _ = answer.send(Ok(found.get(&id).cloned()));
                }
            }
            Err(e) => {
                let why = e.to_string();
                for (_, answer) in batch {
                    let _ = answer.send(Err(why.clone()));
                }
            }
        }
    }
}
