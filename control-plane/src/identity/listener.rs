//! The one agent listener (IDN-4): TLS 1.3 on a single port serving enrollment (no client
//! certificate, or on a re-enrollment the credential it replaces) and the agent and telemetry
//! services (client certificate chained to the CA).
//! Identity comes from the connection only: the handshake verifies the chain and refuses
//! deny-listed identities (IDN-7), and the `authenticate` interceptor hands the certificate's
//! workload id to handlers as [`AgentIdentity`].

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

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
    Signer, certificate_key_sha256, certificate_not_after, workload_id_from_certificate,
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
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
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

/// The services, served twice over with HTTP/2 settings for who is calling: `agents` on
/// connections with a client certificate, `unauthenticated` on connections without one
/// (enrollment), whose settings bound what a client that proved nothing can make the replica
/// buffer.
#[derive(Debug)]
pub struct Routers {
    pub agents: tonic::transport::server::Router,
    pub unauthenticated: tonic::transport::server::Router,
}

/// Accepts TCP connections, completes TLS handshakes off the accept loop (bounded by a
/// timeout), and serves `routers` on them until `shutdown` resolves. Each connection with a
/// client certificate is registered in `admission` under its workload, so a retire or deny
/// ends it.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    admission: Arc<Admission>,
    routers: Routers,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let acceptor = TlsAcceptor::from(tls);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(admission.limits().max_handshakes));
    let (agents_tx, agents_rx) = tokio::sync::mpsc::channel(128);
    let (unauthenticated_tx, unauthenticated_rx) = tokio::sync::mpsc::channel(128);
    let accept = tokio::spawn(async move {
        let mut refusals = 0u64;
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
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
            let (acceptor, admission) = (acceptor.clone(), admission.clone());
            let (agents_tx, unauthenticated_tx) = (agents_tx.clone(), unauthenticated_tx.clone());
            tokio::spawn(async move {
                let handshake_result = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                drop(handshake);
                match handshake_result {
                    Ok(Ok(stream)) => {
                        // The verifier accepted the chain and the identity; only its id is read here.
                        let agent = stream.get_ref().1.peer_certificates().and_then(|certs| certs.first());
                        let identity = agent.map(|leaf| {
                            let id = workload_id_from_certificate(leaf.as_ref());
                            id.and_then(|id| Ok((id, certificate_not_after(leaf.as_ref())?)))
                        });
                        match identity {
                            Some(Ok((id, not_after))) => match admission.guard(id, stream, slot, not_after) {
                                Some(stream) => {
                                    let _ = agents_tx.send(Ok::<_, std::io::Error>(stream)).await;
                                }
                                None => {
                                    tracing::info!(%peer, workload = %id, "refused: too many connections of one identity")
                                }
                            },
                            _ => match admission.unauthenticated(stream, slot) {
                                Some(stream) => {
                                    let _ = unauthenticated_tx.send(Ok::<_, std::io::Error>(stream)).await;
                                }
                                None => {
                                    tracing::info!(%peer, "refused: too many unauthenticated connections")
                                }
                            },
                        }
                    }
                    Ok(Err(e)) => tracing::info!(%peer, "tls handshake refused: {e}"),
                    Err(_) => tracing::info!(%peer, "tls handshake timed out"),
                }
            });
        }
    });
    // Both servers stop on the one shutdown signal.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signal = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let agents = routers.agents.serve_with_incoming_shutdown(
        tokio_stream::wrappers::ReceiverStream::new(agents_rx),
        signal(stopped.clone()),
    );
    let unauthenticated = routers.unauthenticated.serve_with_incoming_shutdown(
        tokio_stream::wrappers::ReceiverStream::new(unauthenticated_rx),
        signal(stopped),
    );
    let shutdown = async move {
        shutdown.await;
        let _ = stop.send(true);
    };
    let ((), agents, unauthenticated) = tokio::join!(shutdown, agents, unauthenticated);
    accept.abort();
    agents?;
    Ok(unauthenticated?)
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
        let certs = req.peer_certs().ok_or_else(|| {
            Status::unauthenticated(
                "a client certificate issued by the innerwall CA is required: enroll this host first",
            )
        })?;
        let leaf = certs.first().ok_or_else(|| Status::unauthenticated("empty client certificate chain"))?;
        let id = workload_id_from_certificate(leaf.as_ref())
            .map_err(|e| Status::unauthenticated(e.to_string()))?;
        let not_after =
            certificate_not_after(leaf.as_ref()).map_err(|e| Status::unauthenticated(e.to_string()))?;
        if let Some(refusal) = self.0.refusal(id) {
            return Err(Status::permission_denied(refusal.message(id)));
        }
        let key_sha256 =
            certificate_key_sha256(leaf.as_ref()).map_err(|e| Status::unauthenticated(e.to_string()))?.into();
        req.extensions_mut().insert(AgentIdentity { id, not_after, key_sha256 });
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
