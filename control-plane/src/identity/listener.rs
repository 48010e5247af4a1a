//! The one agent listener (IDN-4): TLS 1.3 on a single port serving enrollment (no client
//! certificate, or on a re-enrollment the credential it replaces) and the agent and telemetry
//! services (client certificate chained to the CA).
//! Identity comes from the connection only: the handshake verifies the chain and refuses
//! deny-listed identities (IDN-7), the listener reads the certificate's identity once per
//! connection ([`Presented`]), and the [`Authenticate`] interceptor hands it to handlers as
//! [`AgentIdentity`] on every call whose workload is still admitted.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use innerwall_wire::identity::WorkloadId;
use rustls::pki_types::{CertificateDer, UnixTime, pem::PemObject};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tonic::{Request, Status};

use crate::admission::{Admission, Refusal};
use crate::identity::ca::{
    CertIdentityError, Signer, certificate_key_sha256, certificate_not_after, workload_id_from_certificate,
};
use crate::identity::server_cert::ServerCertificate;

/// How long a client may take to finish the TLS handshake before its connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("tls configuration: {0}")]
    Tls(String),
    #[error(transparent)]
    Ca(#[from] crate::identity::ca::CaError),
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Certificate(#[from] crate::identity::server_cert::ServerCertError),
}

/// The CA's chain check, then the identity rules: exactly one canonical workload URI, not
/// deny-listed. A client without a certificate may still connect (enrollment); the
/// interceptor refuses it on every other service.
///
/// The chain is checked against every root of the signer's bundle *now*: after a rotation the
/// new root is trusted from the next handshake on, and after a retirement the old one no longer
/// is (IDN-8, issue 25).
#[derive(Debug)]
struct AgentCertVerifier {
    signer: Arc<dyn Signer>,
    /// The bundle the verifier below was built from.
    chain: std::sync::RwLock<(String, Arc<dyn ClientCertVerifier>)>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    admission: Arc<Admission>,
}

fn chain_verifier(
    bundle: &str,
    provider: &Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, ServerError> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        let cert = cert.map_err(|e| ServerError::Tls(format!("ca bundle: {e}")))?;
        roots.add(cert).map_err(tls_err("ca bundle"))?;
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| ServerError::Tls(format!("client verifier: {e}")))
}

impl AgentCertVerifier {
    /// The verifier for the signer's bundle now, rebuilt when the bundle changed. A bundle that
    /// cannot be used (it never should: the signer loaded it) keeps the previous verifier.
    fn chain(&self) -> Arc<dyn ClientCertVerifier> {
        let bundle = self.signer.ca_bundle_pem();
        {
            let chain = self.chain.read().unwrap_or_else(|e| e.into_inner());
            if chain.0 == bundle {
                return chain.1.clone();
            }
        }
        let mut chain = self.chain.write().unwrap_or_else(|e| e.into_inner());
        match chain_verifier(&bundle, &self.provider) {
            Ok(verifier) => {
                tracing::info!("the listener trusts a new CA bundle for client certificates");
                *chain = (bundle, verifier);
            }
            Err(e) => tracing::error!("the new CA bundle is unusable, keeping the previous one: {e}"),
        }
        chain.1.clone()
    }
}

impl ClientCertVerifier for AgentCertVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints are optional in TLS 1.3, and an agent presents its one certificate whatever
        // they say; the roots change at a rotation, a borrowed slice could not.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.chain().verify_client_cert(end_entity, intermediates, now)?;
        let id = workload_id_from_certificate(end_entity.as_ref())
            .map_err(|e| rustls::Error::General(format!("client certificate identity: {e}")))?;
        if self.admission.refusal(id) == Some(Refusal::Denied) {
            tracing::warn!(workload = %id, "refused a deny-listed identity at the handshake");
            return Err(rustls::Error::General(format!("workload {id} is deny-listed")));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain().supported_verify_schemes()
    }
}

fn tls_err(context: &str) -> impl FnOnce(rustls::Error) -> ServerError + '_ {
    move |e| ServerError::Tls(format!("{context}: {e}"))
}

/// The listener's TLS configuration: the server certificate `certificate` presents (reissued
/// from the CA before it expires), TLS 1.3 only, HTTP/2 only, optional client certificates
/// verified by [`AgentCertVerifier`].
pub fn tls_config(
    signer: Arc<dyn Signer>,
    certificate: Arc<ServerCertificate>,
    admission: Arc<Admission>,
) -> Result<Arc<ServerConfig>, ServerError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let bundle = signer.ca_bundle_pem();
    let chain = std::sync::RwLock::new((bundle.clone(), chain_verifier(&bundle, &provider)?));
    let verifier = AgentCertVerifier { signer, chain, provider: provider.clone(), admission };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err("protocol versions"))?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_cert_resolver(certificate);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// HTTP/2 settings of one kind of connection.
#[derive(Debug, Clone, Copy)]
pub struct Http2 {
    /// The most streams a client may open at once on one connection.
    pub max_concurrent_streams: u32,
    /// The initial stream and connection flow-control windows (`None`: hyper's, 1 MiB).
    pub window: Option<u32>,
    /// How long the connection may go without a frame from the client before the replica pings
    /// it (HTTP/2 PING, answered within [`KEEPALIVE_TIMEOUT`] or the connection is closed).
    pub keepalive: Duration,
}

/// The keepalive of an agent's connection: half an interval more than the heartbeat every agent
/// sends once an interval, so the replica pings only a connection whose agent missed one. At
/// 30 s, as often as the heartbeats, a ping could fall due just before each heartbeat arrived:
/// an idle fleet of 10,000 cost the replica, Postgres and the rest of the machine 0.083–0.097
/// cores, and 0.068–0.077 at 45 s (PERF-4 in BENCHMARKS.md).
pub fn agent_keepalive(heartbeat: Duration) -> Duration {
    heartbeat + heartbeat / 2
}

/// The keepalive of a connection without a client certificate (enrollment).
pub const UNAUTHENTICATED_KEEPALIVE: Duration = Duration::from_secs(30);

/// The services, and the HTTP/2 settings for who is calling: `agents` on connections with a
/// client certificate, `unauthenticated` on connections without one (enrollment), whose
/// settings bound what a client that proved nothing can make the replica buffer. Every service
/// is served on both: a client without a certificate calling an agent service hears from
/// [`Authenticate`] that it must enroll first.
#[derive(Debug, Clone)]
pub struct Services {
    pub routes: tonic::service::Routes,
    pub agents: Http2,
    pub unauthenticated: Http2,
}

/// How long the answer to a keepalive PING may take before the connection is closed.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

fn http2(settings: Http2) -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(settings.keepalive)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(settings.max_concurrent_streams);
    if let Some(window) = settings.window {
        builder.initial_stream_window_size(window).initial_connection_window_size(window);
    }
    builder
}

/// The identity of the verified client certificate a connection presented, read once when
/// its handshake completed and put into each of its requests. [`Authenticate`] reads it (and
/// checks it is still admitted) for the agent services; enrollment reads it for a replace.
#[derive(Debug, Clone)]
pub struct Presented(pub Arc<AgentIdentity>);

/// Accepts TCP connections, completes TLS handshakes off the accept loop (bounded by a
/// timeout), and serves `services` over HTTP/2 on them until `shutdown` resolves; then it
/// closes the listener, asks every connection to finish (HTTP/2 GOAWAY) and waits for them.
/// Each connection with a client certificate is registered in `admission` under its workload,
/// so a retire or deny ends it.
///
/// HTTP/2 is served by hyper directly, on the handshake's own task, rather than through
/// tonic's server: that kept a second task, an HTTP/1-or-2 connection and a copy of the peer's
/// certificate chain per connection (PERF-4 in BENCHMARKS.md).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    admission: Arc<Admission>,
    services: Services,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let acceptor = TlsAcceptor::from(tls);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(admission.limits().max_handshakes));
    let builders = Arc::new((http2(services.agents), http2(services.unauthenticated)));
    let routes = services.routes.prepare();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refusals = 0u64;
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Over a bound the connection is closed at once, before any TLS work.
        let (Some(slot), Ok(handshake)) =
            (admission.admit(peer.ip()), handshakes.clone().try_acquire_owned())
        else {
            refusals += 1;
            if refusals.is_power_of_two() {
                tracing::warn!(%peer, refusals, "refused a connection over the connection or handshake limits");
            }
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, admission, builders, routes) =
            (acceptor.clone(), admission.clone(), builders.clone(), routes.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let handshake_result = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            drop(handshake);
            let stream = match handshake_result {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::info!(%peer, "tls handshake refused: {e}"),
                Err(_) => return tracing::info!(%peer, "tls handshake timed out"),
            };
            // The verifier accepted the chain and the identity; here it is read for the requests.
            let leaf = stream.get_ref().1.peer_certificates().and_then(|certs| certs.first());
            let (stream, presented, builder) = match leaf.map(|leaf| presented(leaf.as_ref())) {
                Some(Ok(identity)) => match admission.guard(identity.id, stream, slot, identity.not_after) {
                    Some(stream) => (stream, Some(Presented(Arc::new(identity))), &builders.0),
                    None => {
                        return tracing::info!(%peer, workload = %identity.id, "refused: too many connections of one identity");
                    }
                },
                Some(Err(e)) => return tracing::info!(%peer, "refused: {e}"),
                None => match admission.unauthenticated(stream, slot) {
                    Some(stream) => (stream, None, &builders.1),
                    None => return tracing::info!(%peer, "refused: too many unauthenticated connections"),
                },
            };
            let service =
                hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                    if let Some(presented) = &presented {
                        request.extensions_mut().insert(presented.clone());
                    }
                    tonic::codegen::Service::call(&mut routes.clone(), request)
                });
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The identity a verified client certificate presents.
fn presented(leaf: &[u8]) -> Result<AgentIdentity, CertIdentityError> {
    Ok(AgentIdentity {
        id: workload_id_from_certificate(leaf)?,
        not_after: certificate_not_after(leaf)?,
        key_sha256: certificate_key_sha256(leaf)?.into(),
    })
}

/// The workload an agent RPC comes from and when the certificate it proved that with expires,
/// put into the request by [`Authenticate`] and by nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentIdentity {
    pub id: WorkloadId,
    pub not_after: SystemTime,
    /// SHA-256 of the certificate's public key, hex: which key holds the identity (IDN-7).
    pub key_sha256: Arc<str>,
}

/// Interceptor for every agent service but enrollment: requires the verified client
/// certificate, extracts its workload id, and refuses a retired or deny-listed workload on
/// every call, whatever connection it arrives on.
#[derive(Debug, Clone)]
pub struct Authenticate(pub Arc<Admission>);

impl tonic::service::Interceptor for Authenticate {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let Presented(identity) = req.extensions().get::<Presented>().cloned().ok_or_else(|| {
            Status::unauthenticated(
                "a client certificate issued by the innerwall CA is required: enroll this host first",
            )
        })?;
        if let Some(refusal) = self.0.refusal(identity.id) {
            return Err(Status::permission_denied(refusal.message(identity.id)));
        }
        req.extensions_mut().insert(AgentIdentity::clone(&identity));
        Ok(req)
    }
}

/// The authenticated workload of a request that passed [`Authenticate`].
#[allow(clippy::result_large_err)]
pub fn identity<T>(req: &Request<T>) -> Result<WorkloadId, Status> {
    req.extensions()
        .get::<AgentIdentity>()
        .map(|i| i.id)
        .ok_or_else(|| Status::internal("no authenticated identity: service mounted without its interceptor"))
}

/// The authenticated workload of a request that passed [`Authenticate`], with its
/// certificate's expiry.
#[allow(clippy::result_large_err)]
pub fn agent_identity<T>(req: &Request<T>) -> Result<AgentIdentity, Status> {
    req.extensions()
        .get::<AgentIdentity>()
        .cloned()
        .ok_or_else(|| Status::internal("no authenticated identity: service mounted without its interceptor"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_that_heartbeats_is_never_pinged() {
        for heartbeat in [Duration::from_millis(500), Duration::from_secs(30), Duration::from_secs(300)] {
            let keepalive = agent_keepalive(heartbeat);
            // A heartbeat sent up to half an interval late still arrives before the ping is due.
            assert!(keepalive >= heartbeat + heartbeat / 2, "{heartbeat:?} → {keepalive:?}");
            // A silent connection is still pinged within two intervals.
            assert!(keepalive < 2 * heartbeat, "{heartbeat:?} → {keepalive:?}");
        }
        assert_eq!(agent_keepalive(Duration::from_secs(30)), Duration::from_secs(45));
    }
}
