//! Reads of persisted policies for streams, batched and shared. A render that changes 1,000
//! workloads pokes 1,000 streams at once, and a restarted replica opens thousands of streams at
//! once; each used to read its own policy with its own query. A reader answers every request
//! waiting when it is free (up to [`MAX_BATCH`]) with one read (a statement, or two when it must
//! read contents), and [`READERS`] read at once; no request waits for a timer, only for a free
//! reader. One reader at a time was the pace of a change's whole fan-out: 25 batches in a row per
//! replica at 5,000 agents over two, each waiting its turn for the cores (PERF-2).
//!
//! Workloads rendered alike hold one content (the store keeps it once, by digest), and so do
//! their streams here: a decoded content is kept by digest for as long as some stream's policy
//! holds it ([`WeakContent`]), and a stream whose policy has that digest gets it without reading
//! or decoding its bytes (PERF-4: what an idle stream holds; PERF-2: what a change costs). The
//! reader reads only the contents nobody holds; it decodes a content itself when several
//! requests of its batch want it, and otherwise leaves the decoding to the stream, so decoding
//! distinct contents stays spread over the runtime's workers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{WeakContent, WorkloadPolicy};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::batch;
use crate::error::Error;
use crate::policy::store;

/// Requests in one query at most: the first streams get their answers while later ones are
/// read, and a query's result stays bounded (100 policies of a large estate are ~5 MB).
pub const MAX_BATCH: usize = 100;

/// Requests waiting for a reader at most; a stream asking one more waits for room.
const QUEUE: usize = 4 * MAX_BATCH;

/// Batches read at once, each on a connection of the streams' pool (8 connections, shared with
/// the batched state writes and heartbeats).
const READERS: usize = 3;

type Rendered = chrono::DateTime<chrono::Utc>;

/// What the reader answers a request with: the policy, or its content's bytes to decode.
#[derive(Debug, Clone)]
enum Found {
    Shared(WorkloadPolicy),
    Bytes { persisted: store::Persisted, digest: Vec<u8> },
}

type Answer = oneshot::Sender<Result<Option<(Found, Rendered)>, String>>;

/// The decoded contents some stream's policy still holds, by digest.
#[derive(Debug, Default)]
struct Contents {
    by_digest: BTreeMap<Vec<u8>, WeakContent>,
    /// How many entries there were after the last sweep of the ones nobody holds.
    swept: usize,
}

impl Contents {
    fn get(&self, digest: &[u8], version: u64) -> Option<WorkloadPolicy> {
        self.by_digest.get(digest)?.upgrade(version)
    }

    /// Keeps `policy`'s content under `digest`. Entries nobody holds are swept whenever the map
    /// has doubled since the last sweep, so it stays within twice the contents held (plus 64).
    fn put(&mut self, digest: Vec<u8>, policy: &WorkloadPolicy) {
        self.by_digest.insert(digest, policy.weak_content());
        if self.by_digest.len() > 2 * self.swept + 64 {
            self.by_digest.retain(|_, content| content.is_held());
            self.swept = self.by_digest.len();
        }
    }
}

type Shared = Arc<Mutex<Contents>>;

fn lock(contents: &Shared) -> std::sync::MutexGuard<'_, Contents> {
    contents.lock().unwrap_or_else(|e| e.into_inner())
}

/// The asking side, held by the gateway. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reads {
    queue: mpsc::Sender<(WorkloadId, Answer)>,
    contents: Shared,
    queries: Arc<AtomicU64>,
}

impl Reads {
    /// Starts the reader on `pool`; it ends when the last `Reads` is dropped.
    pub fn start(pool: PgPool) -> Reads {
        let (queue, pending) = mpsc::channel(QUEUE);
        let queries = Arc::new(AtomicU64::new(0));
        let contents = Shared::default();
        tokio::spawn(read_forever(pool, pending, contents.clone(), queries.clone()));
        Reads { queue, contents, queries }
    }

    /// `id`'s latest persisted policy and when it was rendered, if it has one.
    pub async fn latest(&self, id: WorkloadId) -> Result<Option<(WorkloadPolicy, Rendered)>, Error> {
        let (answer, answered) = oneshot::channel();
        let stopped = || Error::Busy("the policy reader has stopped".into());
        self.queue.send((id, answer)).await.map_err(|_| stopped())?;
        match answered.await.map_err(|_| stopped())? {
            Ok(Some((Found::Shared(policy), rendered_at))) => Ok(Some((policy, rendered_at))),
            Ok(Some((Found::Bytes { persisted, digest }, rendered_at))) => {
                let policy = persisted.decode()?;
                lock(&self.contents).put(digest, &policy);
                Ok(Some((policy, rendered_at)))
            }
            Ok(None) => Ok(None),
            Err(why) => Err(Error::Busy(format!("reading persisted policies: {why}"))),
        }
    }

    /// Batches read so far (how many reads were shared is what tests look at).
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }
}

async fn read_forever(
    pool: PgPool,
    mut pending: mpsc::Receiver<(WorkloadId, Answer)>,
    contents: Shared,
    queries: Arc<AtomicU64>,
) {
    let readers = Arc::new(Semaphore::new(READERS));
    loop {
        // A reader first, then the batch: requests gather while every reader is busy.
        let reader = readers.clone().acquire_owned().await.expect("the semaphore is never closed");
        let Some(batch) = batch::next(&mut pending, MAX_BATCH, Duration::ZERO).await else { return };
        queries.fetch_add(1, Ordering::Relaxed);
        let (pool, contents) = (pool.clone(), contents.clone());
        tokio::spawn(async move {
            let found = read(&pool, &contents, batch.iter().map(|(id, _)| *id)).await;
            drop(reader);
            answer(batch, found);
        });
    }
}

/// Answers each request of `batch` from what its read found.
fn answer(batch: Vec<(WorkloadId, Answer)>, found: Result<BTreeMap<WorkloadId, (Found, Rendered)>, Error>) {
    match found {
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

/// What a batch of requests for `ids` is answered with: the policies whose content is held, and
/// decoded once here when several want it; the bytes of the rest.
///
/// The rows, then the contents no stream holds, each a statement of its own: one round trip
/// when every content is held, as for most batches of a change after its first. A content the
/// rows name is missing by the second statement only if its row moved on and retention deleted
/// it meanwhile; the batch is then read again, rows and contents in one snapshot.
async fn read(
    pool: &PgPool,
    contents: &Shared,
    ids: impl Iterator<Item = WorkloadId>,
) -> Result<BTreeMap<WorkloadId, (Found, Rendered)>, Error> {
    let mut ids: Vec<uuid::Uuid> = ids.map(|id| id.uuid()).collect();
    ids.sort_unstable();
    ids.dedup();
    if let Some(found) = read_in(&mut *pool.acquire().await?, contents, &ids).await? {
        return Ok(found);
    }
    let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?;
    let found = read_in(&mut tx, contents, &ids).await?;
    tx.commit().await?;
    found.ok_or_else(|| Error::Invalid("a persisted policy's content is not stored".into()))
}

/// [`read`] on `conn`; `None` when a content some row names is not stored.
async fn read_in(
    conn: &mut PgConnection,
    contents: &Shared,
    ids: &[uuid::Uuid],
) -> Result<Option<BTreeMap<WorkloadId, (Found, Rendered)>>, Error> {
    let persisting = store::persisting_of(conn, ids).await?;
    // The contents held now, kept alive through the batch (a stream may drop its policy
    // meanwhile), and how many requests want each of the others.
    let mut shared: BTreeMap<&[u8], WorkloadPolicy> = BTreeMap::new();
    let mut missing: BTreeMap<&[u8], usize> = BTreeMap::new();
    {
        let held = lock(contents);
        for p in persisting.values() {
            match held.get(&p.digest, p.version) {
                Some(policy) => {
                    shared.insert(&p.digest, policy);
                }
                None => *missing.entry(&p.digest).or_default() += 1,
            }
        }
    }
    let bytes = if missing.is_empty() {
        BTreeMap::new()
    } else {
        let digests: Vec<Vec<u8>> = missing.keys().map(|d| d.to_vec()).collect();
        store::load_contents(conn, &digests).await?
    };
    if missing.keys().any(|digest| !bytes.contains_key(*digest)) {
        return Ok(None);
    }
    for (digest, _) in missing.iter().filter(|(_, wanted)| **wanted > 1) {
        if let Some(bytes) = bytes.get(*digest) {
            let policy = store::Persisted { version: 0, bytes: bytes.clone() }.decode()?;
            lock(contents).put(digest.to_vec(), &policy);
            shared.insert(digest, policy);
        }
    }
    let mut found = BTreeMap::new();
    for (id, p) in &persisting {
        let answer = match shared.get(p.digest.as_slice()) {
            Some(policy) => Found::Shared(policy.clone().with_version(p.version)),
            None => Found::Bytes {
                persisted: store::Persisted { version: p.version, bytes: bytes[&p.digest].clone() },
                digest: p.digest.clone(),
            },
        };
        found.insert(*id, (answer, p.rendered_at));
    }
    Ok(Some(found))
}
