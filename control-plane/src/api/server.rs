//! The API's TLS listener: accepts TCP connections while fewer than `max_connections` are held
//! (more are closed at once, before any TLS work), completes each TLS handshake off the accept
//! loop within `handshake_timeout`, and serves the router on it over HTTP/1.1 with hyper (headers
//! within the same timeout, at most 16 KiB of them). Stopping closes the listener, lets each
//! connection finish the request it is serving, and waits for them up to a grace period.

use std::io::BufReader;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use super::{ApiConfig, ApiLimits, ApiState, ApiTls, router};
use crate::identity::ca::Signer;
use crate::identity::server_cert::{self, ServerCertificate};

/// The most header bytes a request may send (hyper's read buffer).
const MAX_HEADER_BYTES: usize = 16 * 1024;

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
}

impl ApiServer {
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
    let (mut tls, fingerprint, renewal) = match &config.tls {
        ApiTls::Files { cert, key } => {
            let (chain, private) = read_pem(cert, key)?;
            let fingerprint = server_cert::fingerprint(&chain[0]);
            let tls = builder.with_single_cert(chain, private).map_err(|e| {
                ApiStartError::Certificate(format!("{} / {}: {e}", cert.display(), key.display()))
            })?;
            (tls, fingerprint, None)
        }
        ApiTls::FromCa { names, lifetime } => {
            let certificate = ServerCertificate::issue(signer, provider, names, *lifetime)
                .map_err(|e| ApiStartError::Certificate(e.to_string()))?;
            let fingerprint = certificate.fingerprint();
            let renewal = tokio::spawn(certificate.clone().renew_forever());
            (builder.with_cert_resolver(certificate), fingerprint, Some(renewal))
        }
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpListener::bind(config.listen)
        .await
        .map_err(|source| ApiStartError::Bind { addr: config.listen, source })?;
    let local_addr =
        tcp.local_addr().map_err(|source| ApiStartError::Bind { addr: config.listen, source })?;
    let (router, _) = router::build(ApiState { pool, limits: config.limits });
    let (stop, stopped) = oneshot::channel();
    let server = tokio::spawn(serve(tcp, TlsAcceptor::from(Arc::new(tls)), router, config.limits, stopped));
    tracing::info!(%local_addr, %fingerprint, "operator API listening");
    Ok(ApiServer { local_addr, fingerprint, stop, server, renewal })
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
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut refused_since_log: Option<SystemTime> = None;
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            if refused_since_log.is_none_or(|at| at.elapsed().unwrap_or_default() > Duration::from_secs(10)) {
                tracing::warn!(%peer, max = limits.max_connections, "API connection refused: too many held");
                refused_since_log = Some(SystemTime::now());
            }
            continue;
        };
        let (tls, router, watcher) = (tls.clone(), router.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _slot = slot;
            let stream = match tokio::time::timeout(limits.handshake_timeout, tls.accept(stream)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::debug!(%peer, "API TLS handshake failed: {e}"),
                Err(_) => return tracing::debug!(%peer, "API TLS handshake timed out"),
            };
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.handshake_timeout)
                .max_buf_size(MAX_HEADER_BYTES)
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(%peer, "API connection ended: {e}");
            }
        });
    }
    drop(tcp);
    graceful.shutdown().await;
}
