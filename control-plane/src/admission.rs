//! Who may hold a connection to this replica, and for how long (IDN-7, REL, issue 11):
//! - bounds on connections, overall and per source address, so one client cannot hold the
//!   replica's memory or file descriptors;
//! - connections without a client certificate (enrollment) end after a short lifetime;
//! - the identities that are deny-listed (refused at the handshake too) or retired (refused by
//!   every RPC, so the agent hears why), and every open agent connection by identity, so that a
//!   deny or a retire ends all of that workload's connections, not only its Sync stream.
//!   Loaded from the registry at start and on every bridge reconnect; extended by notices.

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::WorkloadId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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

/// Bounds on what clients may hold. Each has a `serve` flag of the same name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections held at once, all sources together (`--max-connections`). Each costs a file
    /// descriptor and roughly 100 KiB; an operator raises `ulimit -n` above it.
    pub max_connections: usize,
    /// Connections held at once from one source address (`--max-connections-per-source`). Hosts
    /// behind one NAT address share it.
    pub max_connections_per_source: usize,
    /// Connections held at once by one agent identity (`--max-connections-per-identity`): an
    /// agent uses one for policy and renewal and one for uploads, and briefly one more while it
    /// reconnects. With the streams per connection and the upload message cap this bounds what
    /// one certificate can make a replica buffer.
    pub max_connections_per_identity: usize,
    /// TLS handshakes in progress at once (`--max-handshakes`); more are dropped at accept.
    pub max_handshakes: usize,
    /// Concurrent HTTP/2 streams on an agent's connection (`--max-streams-per-connection`); an
    /// agent uses two (Sync, renewal) on its policy connection and one for uploads. A connection
    /// without a client certificate serves one (`service::UNAUTHENTICATED_STREAMS`).
    pub max_streams_per_connection: u32,
    /// Connections without a client certificate held at once (`--max-unauthenticated-
    /// connections`). With one stream each, 64 KiB HTTP/2 windows and the enrollment message
    /// cap, this bounds what clients that proved nothing can make the replica buffer to about
    /// connections × 64 KiB (16 MiB by default).
    pub max_unauthenticated_connections: usize,
    /// How long a connection without a client certificate may stay open
    /// (`--unauthenticated-lifetime`): enrollment is one short call.
    pub unauthenticated_lifetime: Duration,
    /// How long a refused identity's connections stay open after the refusal, so the calls on
    /// them can tell the agent why (an aborted Sync stream, a PERMISSION_DENIED upload).
    pub end_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 20_000,
            max_connections_per_source: 64,
            max_connections_per_identity: 8,
            max_handshakes: 256,
            max_streams_per_connection: 8,
            max_unauthenticated_connections: 256,
            unauthenticated_lifetime: Duration::from_secs(30),
            end_grace: Duration::from_secs(1),
        }
    }
}

/// The refused identities and the open connections of this replica.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    refused: RwLock<BTreeMap<WorkloadId, Refusal>>,
    open: Mutex<BTreeMap<WorkloadId, BTreeMap<u64, Arc<Kill>>>>,
    next: AtomicU64,
    sources: Mutex<BTreeMap<IpAddr, usize>>,
    unauthenticated: Arc<AtomicUsize>,
}

impl Admission {
    pub fn new(refused: impl IntoIterator<Item = (WorkloadId, Refusal)>, limits: Limits) -> Self {
        Admission {
            limits,
            refused: RwLock::new(refused.into_iter().collect()),
            open: Mutex::default(),
            next: AtomicU64::new(0),
            sources: Mutex::default(),
            unauthenticated: Arc::default(),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A place for one more connection from `source`, or `None` when the replica or that source
    /// holds as many as allowed. The place is given back when the slot is dropped.
    pub fn admit(self: &Arc<Self>, source: IpAddr) -> Option<Slot> {
        let mut sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = sources.values().sum();
        let from_source = sources.get(&source).copied().unwrap_or(0);
        if total >= self.limits.max_connections || from_source >= self.limits.max_connections_per_source {
            return None;
        }
        *sources.entry(source).or_default() += 1;
        Some(Slot { admission: self.clone(), source })
    }

    /// Connections held from `source` (all sources when `None`).
    pub fn connections(&self, source: Option<IpAddr>) -> usize {
        let sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        match source {
            Some(s) => sources.get(&s).copied().unwrap_or(0),
            None => sources.values().sum(),
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
        if self.limits.end_grace.is_zero() {
            ids.into_iter().for_each(|id| self.end_connections(id));
            return;
        }
        let (this, grace) = (self.clone(), self.limits.end_grace);
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

    /// Wraps an authenticated agent connection so that refusing `id` ends it, and so does the
    /// expiry of the certificate it was opened with (`not_after`, plus the refusal grace, so the
    /// streams on it can say why first); it leaves the registry, and gives its slot back, when
    /// dropped. `None` when the identity holds as many connections as allowed.
    pub fn guard<S>(
        self: &Arc<Self>,
        id: WorkloadId,
        stream: S,
        slot: Slot,
        not_after: SystemTime,
    ) -> Option<Guarded<S>> {
        let kill = Arc::new(Kill::default());
        let left = not_after.duration_since(SystemTime::now()).unwrap_or_default();
        end_after(&kill, left + self.limits.end_grace);
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            let held = open.entry(id).or_default();
            if held.len() >= self.limits.max_connections_per_identity {
                return None;
            }
            held.insert(key, kill.clone());
        }
        // Already refused (a retired identity reconnecting, or refused since the handshake):
        // ends after the grace, in which its calls hear why (so its agent stops redialing).
        if self.refusal(id).is_some() {
            end_after(&kill, self.limits.end_grace);
        }
        let registration = Registration { admission: self.clone(), id, key };
        Some(Guarded { inner: stream, kill, _held: Held::Agent { _registration: registration }, _slot: slot })
    }

    /// Wraps a connection without an agent identity (enrollment): it ends after the
    /// unauthenticated lifetime. `None` when as many are held as allowed.
    pub fn unauthenticated<S>(&self, stream: S, slot: Slot) -> Option<Guarded<S>> {
        let held = self.unauthenticated.fetch_add(1, Ordering::SeqCst);
        let count = Unauthenticated(self.unauthenticated.clone());
        if held >= self.limits.max_unauthenticated_connections {
            return None;
        }
        let kill = Arc::new(Kill::default());
        end_after(&kill, self.limits.unauthenticated_lifetime);
        Some(Guarded { inner: stream, kill, _held: Held::Unauthenticated { _count: count }, _slot: slot })
    }
}

/// Ends the connection of `kill` after `lifetime`, unless it is gone by then.
fn end_after(kill: &Arc<Kill>, lifetime: Duration) {
    if lifetime.is_zero() {
        kill.fire();
        return;
    }
    let weak = Arc::downgrade(kill);
    tokio::spawn(async move {
        tokio::time::sleep(lifetime).await;
        if let Some(kill) = weak.upgrade() {
            kill.fire();
        }
    });
}

/// One unauthenticated connection in the count.
#[derive(Debug)]
struct Unauthenticated(Arc<AtomicUsize>);

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a connection holds until it is dropped (only for the fields' `Drop`).
#[derive(Debug)]
enum Held {
    Agent { _registration: Registration },
    Unauthenticated { _count: Unauthenticated },
}

/// One admitted connection's place in the per-source count.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    source: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut sources = self.admission.sources.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = sources.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                sources.remove(&self.source);
            }
        }
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

/// An admitted connection: it ends when its agent identity is refused or, without one, when
/// its lifetime is up.
#[derive(Debug)]
pub struct Guarded<S> {
    inner: S,
    kill: Arc<Kill>,
    /// Held for their `Drop`: out of the registry or the unauthenticated count, the slot given
    /// back.
    _held: Held,
    _slot: Slot,
}

impl<S> Guarded<S> {
    fn ended(&self, cx: &Context<'_>) -> bool {
        self.kill.fired(cx)
    }
}

fn ended() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "connection ended by the control plane")
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

    fn in_an_hour() -> SystemTime {
        SystemTime::now() + Duration::from_secs(3600)
    }

    #[tokio::test]
    async fn connections_per_identity_are_bounded() {
        let limits = Limits { max_connections_per_identity: 2, ..Limits::default() };
        let admission = Arc::new(Admission::new([], limits));
        let (a, b) = (WorkloadId::new_random(), WorkloadId::new_random());
        let guard = |id| admission.guard(id, (), admission.admit(LOCAL).unwrap(), in_an_hour());
        let (first, second) = (guard(a).unwrap(), guard(a).unwrap());
        assert!(guard(a).is_none(), "a third connection of one identity is refused");
        assert!(guard(b).is_some(), "another identity is not affected");
        drop(first);
        assert!(guard(a).is_some(), "a closed connection makes room");
        drop(second);
    }

    #[tokio::test]
    async fn a_connection_ends_when_its_certificate_expires() {
        let admission =
            Arc::new(Admission::new([], Limits { end_grace: Duration::ZERO, ..Limits::default() }));
        let id = WorkloadId::new_random();
        let (expired_end, _expired_peer) = tokio::io::duplex(64);
        let (live_end, mut live_peer) = tokio::io::duplex(64);
        let mut expired =
            admission.guard(id, expired_end, admission.admit(LOCAL).unwrap(), SystemTime::now()).unwrap();
        let mut live = admission.guard(id, live_end, admission.admit(LOCAL).unwrap(), in_an_hour()).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(expired.read(&mut buf).await.unwrap_err().kind(), io::ErrorKind::ConnectionAborted);
        // The one whose certificate is still valid carries data after that.
        live_peer.write_all(b"ok").await.unwrap();
        assert_eq!(live.read(&mut buf).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn refusing_an_identity_ends_its_connections_and_only_its() {
        let admission =
            Arc::new(Admission::new([], Limits { end_grace: Duration::ZERO, ..Limits::default() }));
        let (a, b) = (WorkloadId::new_random(), WorkloadId::new_random());
        let (a_end, mut a_peer) = tokio::io::duplex(64);
        let (b_end, mut b_peer) = tokio::io::duplex(64);
        let slot = || admission.admit(LOCAL).unwrap();
        let mut a_conn = admission.guard(a, a_end, slot(), in_an_hour()).unwrap();
        let mut b_conn = admission.guard(b, b_end, slot(), in_an_hour()).unwrap();
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

        // Dropping a connection unregisters it; a refused identity's new connection ends after
        // the grace (none here).
        drop(a_conn);
        assert_eq!(admission.open_connections(a), 0);
        let (again, _peer) = tokio::io::duplex(64);
        let mut again = admission.guard(a, again, slot(), in_an_hour()).unwrap();
        assert_eq!(again.write(b"x").await.map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionAborted));
        assert_eq!(admission.refusal(a), Some(Refusal::Retired));
        admission.refuse(a, Refusal::Denied);
        admission.refuse(a, Refusal::Retired);
        assert_eq!(admission.refusal(a), Some(Refusal::Denied), "a deny outranks a retire");
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn connections_are_bounded_overall_and_per_source() {
        let limits = Limits { max_connections: 3, max_connections_per_source: 2, ..Limits::default() };
        let admission = Arc::new(Admission::new([], limits));
        let other: IpAddr = "192.0.2.7".parse().unwrap();
        let first = admission.admit(LOCAL).unwrap();
        let second = admission.admit(LOCAL).unwrap();
        assert!(admission.admit(LOCAL).is_none(), "a third from one source");
        let third = admission.admit(other).unwrap();
        assert!(admission.admit("192.0.2.8".parse().unwrap()).is_none(), "a fourth overall");
        assert_eq!((admission.connections(Some(LOCAL)), admission.connections(None)), (2, 3));
        drop(first);
        assert_eq!(admission.connections(Some(LOCAL)), 1);
        let again = admission.admit(LOCAL).expect("a place was given back");
        drop((second, third, again));
        assert_eq!(admission.connections(None), 0);
    }

    #[tokio::test]
    async fn unauthenticated_connections_end_after_their_lifetime() {
        let limits = Limits { unauthenticated_lifetime: Duration::from_millis(50), ..Limits::default() };
        let admission = Arc::new(Admission::new([], limits));
        let (end, _peer) = tokio::io::duplex(64);
        let mut conn = admission.unauthenticated(end, admission.admit(LOCAL).unwrap()).unwrap();
        let mut buf = [0u8; 1];
        // Nothing is ever written by the peer: only the lifetime can end this read.
        assert_eq!(conn.read(&mut buf).await.map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionAborted));
        drop(conn);
        assert_eq!(admission.connections(None), 0);

        let limits = Limits { max_unauthenticated_connections: 1, ..Limits::default() };
        let admission = Arc::new(Admission::new([], limits));
        let (a, _pa) = tokio::io::duplex(64);
        let (b, _pb) = tokio::io::duplex(64);
        let first = admission.unauthenticated(a, admission.admit(LOCAL).unwrap()).unwrap();
        assert!(admission.unauthenticated(b, admission.admit(LOCAL).unwrap()).is_none());
        assert_eq!(admission.connections(None), 1, "the refused one gave its slot back");
        drop(first);
        let (c, _pc) = tokio::io::duplex(64);
        assert!(admission.unauthenticated(c, admission.admit(LOCAL).unwrap()).is_some());
    }
}
