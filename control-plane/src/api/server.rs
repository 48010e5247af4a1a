//! The API's TLS listener: accepts TCP connections while fewer than `max_connections` are held,
//! and fewer than `max_connections_per_source` from the connecting address (more are closed at
//! once, before any TLS work, and logged at most every 10 s; the per-source count is
//! `admission`'s, as on the agent listener), completes each TLS handshake off the
//! accept loop within `handshake_timeout`, and serves the router on it over HTTP/1.1 with hyper
//! (headers within the same timeout, at most 16 KiB of them buffered, pipelined requests
//! included). A connection whose writes stall for `write_timeout` — a client that does not read
//! its answers, or pipelines and never reads — is closed ([`WriteDeadline`]), and every
//! connection ends after `connection_lifetime`. A connection the server ends while its client
//! may still be sending (an oversized body answered 413 unread) closes lingering ([`linger`]),
//! so the client reads its answer instead of a reset. Stopping closes the listener, lets each
//! connection finish the request it is serving, and waits for them up to a grace period.

use std::future::Future;
use std::io::BufReader;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use sqlx::PgPool;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use super::edge::Peer;
use super::{ApiConfig, ApiLimits, ApiState, ApiTls, router};
use crate::admission::{Admission, Limits};
use crate::identity::ca::Signer;
use crate::identity::server_cert::{self, ServerCertificate};

/// The most header bytes a request may send (hyper's read buffer).
const MAX_HEADER_BYTES: usize = 16 * 1024;

/// How long, how much, and how many at once closed connections are read and discarded by
/// [`linger`]; beyond these a connection closes at once, as it would without lingering.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1024 * 1024;
const MAX_LINGERING: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ApiStartError {
    #[error("binding the API listener on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the API certificate: {0}")]
    Certificate(String),
}

/// A running API listener.
#[derive(Debug)]
pub struct ApiServer {
    pub local_addr: SocketAddr,
    /// The SHA-256 fingerprint of the certificate presented at start.
    pub fingerprint: String,
    stop: oneshot::Sender<()>,
    server: JoinHandle<()>,
    renewal: Option<JoinHandle<()>>,
    edge: Arc<super::edge::Edge>,
    /// The certificate from files (`ApiTls::Files`), which a reload reads again.
    files: Option<Arc<FileCertificate>>,
}

/// What a reload changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    pub rates: bool,
    /// The new certificate's SHA-256 fingerprint when the files held another, or why they
    /// were not taken (the one presented stays).
    pub certificate: Result<Option<String>, String>,
}

impl ApiServer {
    /// The request bounds in force.
    pub fn rates(&self) -> super::edge::EdgeRates {
        self.edge.rates()
    }

    /// Puts new request bounds in force and, when the certificate comes from files, reads
    /// them again (a renewed certificate is presented to new connections; open ones keep
    /// theirs; files that cannot be read or do not match change nothing).
    pub fn reload(&self, rates: super::edge::EdgeRates) -> Reloaded {
        let changed = self.edge.rates() != rates;
        self.edge.set_rates(rates);
        let certificate = match &self.files {
            Some(files) => files.reload().map_err(|e| e.to_string()),
            None => Ok(None),
        };
        Reloaded { rates: changed, certificate }
    }

    /// Stops accepting, lets open connections finish their request within `grace`, then ends
    /// what is left.
    pub async fn stop(self, grace: Duration) {
        let _ = self.stop.send(());
        if let Some(renewal) = self.renewal {
            renewal.abort();
        }
        let mut server = self.server;
        if tokio::time::timeout(grace, &mut server).await.is_err() {
            tracing::warn!("API connections still open after {grace:?}; closing them");
            server.abort();
            let _ = server.await;
        }
    }
}

/// Binds the listener and starts serving the API on `pool`.
pub async fn start(
    pool: PgPool,
    signer: Arc<dyn Signer>,
    config: ApiConfig,
) -> Result<ApiServer, ApiStartError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ApiStartError::Certificate(format!("protocol versions: {e}")))?
        .with_no_client_auth();
    let (mut tls, fingerprint, renewal, files) = match &config.tls {
        ApiTls::Files { cert, key } => {
            let files = Arc::new(FileCertificate::read(cert, key, provider)?);
            let fingerprint = files.fingerprint();
            (builder.with_cert_resolver(files.clone()), fingerprint, None, Some(files))
        }
        ApiTls::FromCa { names, lifetime } => {
            let certificate = ServerCertificate::issue(signer, provider, names, *lifetime)
                .map_err(|e| ApiStartError::Certificate(e.to_string()))?;
            let fingerprint = certificate.fingerprint();
            let renewal = tokio::spawn(certificate.clone().renew_forever());
            (builder.with_cert_resolver(certificate), fingerprint, Some(renewal), None)
        }
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpListener::bind(config.listen)
        .await
        .map_err(|source| ApiStartError::Bind { addr: config.listen, source })?;
    let local_addr =
        tcp.local_addr().map_err(|source| ApiStartError::Bind { addr: config.listen, source })?;
    let state = ApiState::new(pool, config.limits);
    let edge = state.edge.clone();
    let (router, _) = router::build(state);
    let (stop, stopped) = oneshot::channel();
    let server = tokio::spawn(serve(tcp, TlsAcceptor::from(Arc::new(tls)), router, config.limits, stopped));
    tracing::info!(%local_addr, %fingerprint, "operator API listening");
    Ok(ApiServer { local_addr, fingerprint, stop, server, renewal, edge, files })
}

/// The API's certificate and key from PEM files, presented to each new connection, and read
/// again by [`ApiServer::reload`].
#[derive(Debug)]
struct FileCertificate {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    provider: Arc<rustls::crypto::CryptoProvider>,
    current: std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>,
}

impl FileCertificate {
    fn read(
        cert: &std::path::Path,
        key: &std::path::Path,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<FileCertificate, ApiStartError> {
        let current = Self::load(cert, key, &provider)?;
        Ok(FileCertificate {
            cert: cert.to_owned(),
            key: key.to_owned(),
            provider,
            current: std::sync::RwLock::new(Arc::new(current)),
        })
    }

    fn load(
        cert: &std::path::Path,
        key: &std::path::Path,
        provider: &rustls::crypto::CryptoProvider,
    ) -> Result<rustls::sign::CertifiedKey, ApiStartError> {
        let (chain, private) = read_pem(cert, key)?;
        rustls::sign::CertifiedKey::from_der(chain, private, provider)
            .map_err(|e| ApiStartError::Certificate(format!("{} / {}: {e}", cert.display(), key.display())))
    }

    fn presented(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn fingerprint(&self) -> String {
        server_cert::fingerprint(&self.presented().cert[0])
    }

    /// Reads the files again: the new fingerprint when they hold another certificate.
    fn reload(&self) -> Result<Option<String>, ApiStartError> {
        let before = self.fingerprint();
        let loaded = Arc::new(Self::load(&self.cert, &self.key, &self.provider)?);
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = loaded;
        let after = self.fingerprint();
        Ok((after != before).then_some(after))
    }
}

impl rustls::server::ResolvesServerCert for FileCertificate {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.presented())
    }
}

fn read_pem(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ApiStartError> {
    let open = |path: &std::path::Path| {
        std::fs::File::open(path)
            .map(BufReader::new)
            .map_err(|e| ApiStartError::Certificate(format!("reading {}: {e}", path.display())))
    };
    let chain = CertificateDer::pem_reader_iter(open(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiStartError::Certificate(format!("{}: {e}", cert.display())))?;
    if chain.is_empty() {
        return Err(ApiStartError::Certificate(format!("{} holds no certificate", cert.display())));
    }
    let key = PrivateKeyDer::from_pem_reader(open(key)?)
        .map_err(|e| ApiStartError::Certificate(format!("{}: {e}", key.display())))?;
    Ok((chain, key))
}

async fn serve(
    tcp: TcpListener,
    tls: TlsAcceptor,
    router: axum::Router,
    limits: ApiLimits,
    mut stopped: oneshot::Receiver<()>,
) {
    let graceful = GracefulShutdown::new();
    let admission = Arc::new(Admission::new(
        [],
        Limits {
            max_connections: limits.max_connections,
            max_connections_per_source: limits.max_connections_per_source,
            ..Limits::default()
        },
    ));
    let lingering = Arc::new(Semaphore::new(MAX_LINGERING));
    let mut refused_since_log: Option<SystemTime> = None;
    let mut refused = 0u64;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = tcp.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little instead of spinning.
                    tracing::warn!("API accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stopped => break,
        };
        let Some(slot) = admission.admit(peer.ip()) else {
            drop(stream);
            refused += 1;
            if refused_since_log.is_none_or(|at| at.elapsed().unwrap_or_default() > Duration::from_secs(10)) {
                tracing::warn!(
                    %peer,
                    refused,
                    max = limits.max_connections,
                    max_per_source = limits.max_connections_per_source,
                    "API connections refused: too many held (overall or from this source); count since the last such line"
                );
                refused_since_log = Some(SystemTime::now());
                refused = 0;
            }
            continue;
        };
        let (tls, router, watcher) = (tls.clone(), router.clone(), graceful.watcher());
        let lingering = lingering.clone();
        tokio::spawn(async move {
            // A second handle on the socket keeps it open after hyper is done with the first.
            let (stream, spare) = match split_handle(stream) {
                Ok(handles) => handles,
                Err(e) => return tracing::debug!(%peer, "API connection dropped: {e}"),
            };
            let stream = WriteDeadline::new(stream, limits.write_timeout, Some(slot));
            let stream = match tokio::time::timeout(limits.handshake_timeout, tls.accept(stream)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::debug!(%peer, "API TLS handshake failed: {e}"),
                Err(_) => return tracing::debug!(%peer, "API TLS handshake timed out"),
            };
            let router = TowerToHyperService::new(router);
            let service =
                hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(Peer(peer.ip()));
                    hyper::service::Service::call(&router, request)
                });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.handshake_timeout)
                .max_buf_size(MAX_HEADER_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(limits.connection_lifetime, watcher.watch(connection)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, "API connection ended: {e}"),
                Err(_) => tracing::debug!(%peer, "API connection closed: open longer than its lifetime"),
            }
            linger(spare, &lingering).await;
        });
    }
    drop(tcp);
    graceful.shutdown().await;
}

/// The accepted socket and a duplicate of it (one socket, two descriptors): the second is
/// registered with the runtime only when [`linger`] takes it.
fn split_handle(stream: TcpStream) -> std::io::Result<(TcpStream, std::net::TcpStream)> {
    let stream = stream.into_std()?;
    let spare = stream.try_clone()?;
    Ok((TcpStream::from_std(stream)?, spare))
}

/// A lingering close. Closing a socket whose client is still sending makes the kernel answer
/// with a reset, which discards the answer not yet read and fails the client's write (a
/// 413 for a body the server refused unread arrives as "broken pipe"). So once hyper is done,
/// the socket's sending side is shut (the answer, then FIN) and what the client still sends is
/// read and discarded until it closes, for at most [`LINGER_TIME`] and [`LINGER_BYTES`]; with
/// [`MAX_LINGERING`] connections already lingering, the socket closes at once.
async fn linger(spare: std::net::TcpStream, lingering: &Semaphore) {
    let Ok(_permit) = lingering.try_acquire() else { return };
    let Ok(mut socket) = TcpStream::from_std(spare) else { return };
    if socket.shutdown().await.is_err() {
        return;
    }
    let mut sink = vec![0u8; 16 * 1024];
    let mut left = LINGER_BYTES;
    let _ = tokio::time::timeout(LINGER_TIME, async {
        while left > 0 {
            match socket.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// A connection whose writes fail once they have made no progress for `timeout`: the socket's
/// buffers are full because the peer does not read. Without it a client that never reads its
/// answers holds its slot, and the answer it did not read, for good.
struct WriteDeadline<S> {
    /// The connection's place in the admission count, given back before the socket closes (so
    /// a client that sees the close may connect again at once).
    _slot: Option<crate::admission::Slot>,
    inner: S,
    timeout: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration, slot: Option<crate::admission::Slot>) -> Self {
        WriteDeadline { _slot: slot, inner, timeout, stalled: None }
    }

    /// After a write or flush that returned `poll`: progress clears the deadline, a stall
    /// starts it (or fails once it has passed).
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing of the answer for {timeout:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_write_that_stalls_past_the_deadline_fails_and_one_that_moves_does_not() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut stream = WriteDeadline::new(near, Duration::from_millis(200), None);
        stream.write_all(&[0; 16]).await.unwrap();
        // The peer reads: the next writes make progress and pass.
        let mut buf = [0; 16];
        far.read_exact(&mut buf).await.unwrap();
        stream.write_all(&[1; 16]).await.unwrap();
        // The peer stops reading: the buffer is full and the write fails at the deadline.
        let err = stream.write_all(&[2; 16]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    }
}
