//! Who may hold a connection to this replica (IDN-7, issue 11): the identities that are
//! deny-listed (refused at the handshake too) or retired (refused by every RPC, so the agent
//! hears why), and every open agent connection by identity, so that a deny or a retire ends
//! all of that workload's connections, not only its Sync stream. Loaded from the registry at
//! start and on every bridge reconnect; extended by retire and deny notices.

use std::collections::BTreeMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use innerwall_wire::identity::WorkloadId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Why an identity may no longer connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refusal {
    Retired,
    Denied,
}

impl Refusal {
    /// What the agent is told.
    pub fn message(self, id: WorkloadId) -> String {
        match self {
            Refusal::Retired => format!("workload {id} is retired; enroll the host again"),
            Refusal::Denied => format!("workload {id} is deny-listed"),
        }
    }
}

/// How long a refused identity's connections stay open after the refusal, so the calls on them
/// can tell the agent why (an aborted Sync stream, a PERMISSION_DENIED upload) before they end.
pub const END_GRACE: Duration = Duration::from_secs(1);

/// The refused identities and the open agent connections of this replica.
#[derive(Debug)]
pub struct Admission {
    refused: RwLock<BTreeMap<WorkloadId, Refusal>>,
    open: Mutex<BTreeMap<WorkloadId, BTreeMap<u64, Arc<Kill>>>>,
    next: AtomicU64,
    grace: Duration,
}

impl Admission {
    /// `grace`: how long connections outlive their identity's refusal ([`END_GRACE`]).
    pub fn new(refused: impl IntoIterator<Item = (WorkloadId, Refusal)>, grace: Duration) -> Self {
        Admission {
            refused: RwLock::new(refused.into_iter().collect()),
            open: Mutex::default(),
            next: AtomicU64::new(0),
            grace,
        }
    }

    /// Refuses `id` from now on (every call is refused at once) and ends its open connections
    /// after the grace. A deny outranks a retire.
    pub fn refuse(self: &Arc<Self>, id: WorkloadId, refusal: Refusal) {
        let mut refused = self.refused.write().unwrap_or_else(|e| e.into_inner());
        let entry = refused.entry(id).or_insert(refusal);
        *entry = (*entry).max(refusal);
        drop(refused);
        self.end_connections_after_grace(vec![id]);
    }

    /// Replaces the refused identities (after the bridge reconnects: notices sent meanwhile are
    /// lost) and ends the connections of every one of them.
    pub fn replace(self: &Arc<Self>, refused: impl IntoIterator<Item = (WorkloadId, Refusal)>) {
        let refused: BTreeMap<WorkloadId, Refusal> = refused.into_iter().collect();
        let ids: Vec<WorkloadId> = refused.keys().copied().collect();
        *self.refused.write().unwrap_or_else(|e| e.into_inner()) = refused;
        self.end_connections_after_grace(ids);
    }

    fn end_connections_after_grace(self: &Arc<Self>, ids: Vec<WorkloadId>) {
        if self.grace.is_zero() {
            ids.into_iter().for_each(|id| self.end_connections(id));
            return;
        }
        let (this, grace) = (self.clone(), self.grace);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            ids.into_iter().for_each(|id| this.end_connections(id));
        });
    }

    pub fn refusal(&self, id: WorkloadId) -> Option<Refusal> {
        self.refused.read().unwrap_or_else(|e| e.into_inner()).get(&id).copied()
    }

    /// Open agent connections of `id` on this replica.
    pub fn open_connections(&self, id: WorkloadId) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).get(&id).map_or(0, BTreeMap::len)
    }

    fn end_connections(&self, id: WorkloadId) {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let kills: Vec<Arc<Kill>> = open.get(&id).map(|c| c.values().cloned().collect()).unwrap_or_default();
        drop(open);
        if !kills.is_empty() {
            tracing::info!(workload = %id, connections = kills.len(), "ending the connections of a refused identity");
        }
        for kill in kills {
            kill.fire();
        }
    }

    /// Wraps an authenticated agent connection so that refusing `id` ends it; it leaves the
    /// registry when dropped.
    pub fn guard<S>(self: &Arc<Self>, id: WorkloadId, stream: S) -> Guarded<S> {
        let kill = Arc::new(Kill::default());
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        self.open.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default().insert(key, kill.clone());
        // Refused between the handshake and now: end at once.
        if self.refusal(id).is_some() {
            kill.fire();
        }
        let registration = Registration { admission: self.clone(), id, key };
        Guarded { inner: stream, kill: Some(kill), _registration: Some(registration) }
    }

    /// A connection without an agent identity (enrollment): nothing to end it for.
    pub fn unguarded<S>(stream: S) -> Guarded<S> {
        Guarded { inner: stream, kill: None, _registration: None }
    }
}

/// Ends one connection: its next (or pending) read or write fails.
#[derive(Debug, Default)]
struct Kill {
    fired: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Kill {
    fn fire(&self) {
        self.fired.store(true, Ordering::SeqCst);
        if let Some(waker) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            waker.wake();
        }
    }

    /// Remembers the task to wake, then says whether the connection was ended (in this order,
    /// so a `fire` between the two is never missed).
    fn fired(&self, cx: &Context<'_>) -> bool {
        let mut waker = self.waker.lock().unwrap_or_else(|e| e.into_inner());
        if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *waker = Some(cx.waker().clone());
        }
        drop(waker);
        self.fired.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
struct Registration {
    admission: Arc<Admission>,
    id: WorkloadId,
    key: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut open = self.admission.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(connections) = open.get_mut(&self.id) {
            connections.remove(&self.key);
            if connections.is_empty() {
                open.remove(&self.id);
            }
        }
    }
}

/// A connection that ends when its agent identity (if it has one) is refused.
#[derive(Debug)]
pub struct Guarded<S> {
    inner: S,
    kill: Option<Arc<Kill>>,
    /// Held for its `Drop`, which takes the connection out of the registry.
    _registration: Option<Registration>,
}

impl<S> Guarded<S> {
    fn ended(&self, cx: &Context<'_>) -> bool {
        self.kill.as_ref().is_some_and(|k| k.fired(cx))
    }
}

impl<S: Connected> Connected for Guarded<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

fn ended() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the workload was retired or deny-listed")
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.ended(cx) {
            return Poll::Ready(Err(ended()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.ended(cx) {
            return Poll::Ready(Err(ended()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn refusing_an_identity_ends_its_connections_and_only_its() {
        let admission = Arc::new(Admission::new([], Duration::ZERO));
        let (a, b) = (WorkloadId::new_random(), WorkloadId::new_random());
        let (a_end, mut a_peer) = tokio::io::duplex(64);
        let (b_end, mut b_peer) = tokio::io::duplex(64);
        let mut a_conn = admission.guard(a, a_end);
        let mut b_conn = admission.guard(b, b_end);
        assert_eq!((admission.open_connections(a), admission.open_connections(b)), (1, 1));

        // A read pending on a's connection is woken and fails when a is refused.
        let pending = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            let result = a_conn.read(&mut buf).await;
            (result.map_err(|e| e.kind()), a_conn)
        });
        tokio::task::yield_now().await;
        admission.refuse(a, Refusal::Retired);
        let (result, a_conn) = pending.await.unwrap();
        assert_eq!(result, Err(io::ErrorKind::ConnectionAborted));

        // b is untouched.
        b_peer.write_all(b"ok").await.unwrap();
        let mut buf = [0u8; 2];
        b_conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ok");
        a_peer.write_all(b"late").await.unwrap_or_default();

        // Dropping a connection unregisters it; a refused identity's new connection ends at once.
        drop(a_conn);
        assert_eq!(admission.open_connections(a), 0);
        let (again, _peer) = tokio::io::duplex(64);
        let mut again = admission.guard(a, again);
        assert_eq!(again.write(b"x").await.map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionAborted));
        assert_eq!(admission.refusal(a), Some(Refusal::Retired));
        admission.refuse(a, Refusal::Denied);
        admission.refuse(a, Refusal::Retired);
        assert_eq!(admission.refusal(a), Some(Refusal::Denied), "a deny outranks a retire");
    }
}
