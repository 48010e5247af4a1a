//! The listener's own certificate (issue 16): issued from the CA at start and reissued before
//! it expires, so a replica that runs longer than one certificate lifetime keeps accepting
//! agents. rustls asks [`ServerCertificate`] for the certificate at every handshake, so a
//! reissued one is presented from the next connection on, without a restart; connections
//! already open keep theirs.

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::identity::ca::{CaError, Signer};

/// Why the listener's certificate could not be issued.
#[derive(Debug, thiserror::Error)]
pub enum ServerCertError {
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("server certificate: {0}")]
    Unusable(String),
}

/// The default lifetime of the listener's certificate (`serve --server-cert-lifetime`).
pub const SERVER_CERT_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// After a failed reissue, the next attempt comes this long later at most.
const RETRY: Duration = Duration::from_secs(60);

/// The certificate the listener presents, and what it takes to reissue it.
pub struct ServerCertificate {
    signer: Arc<dyn Signer>,
    provider: Arc<CryptoProvider>,
    names: Vec<String>,
    lifetime: Duration,
    /// The certificate presented now and when it was issued.
    current: RwLock<(Arc<CertifiedKey>, SystemTime)>,
}

impl std::fmt::Debug for ServerCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCertificate")
            .field("names", &self.names)
            .field("lifetime", &self.lifetime)
            .finish()
    }
}

impl ServerCertificate {
    /// Issues the first certificate for `names`, valid for `lifetime`.
    pub fn issue(
        signer: Arc<dyn Signer>,
        provider: Arc<CryptoProvider>,
        names: &[String],
        lifetime: Duration,
    ) -> Result<Arc<Self>, ServerCertError> {
        let now = SystemTime::now();
        let first = certified(signer.as_ref(), &provider, names, lifetime, now)?;
        Ok(Arc::new(ServerCertificate {
            signer,
            provider,
            names: names.to_vec(),
            lifetime,
            current: RwLock::new((first, now)),
        }))
    }

    fn current(&self) -> (Arc<CertifiedKey>, SystemTime) {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The SHA-256 fingerprint of the certificate presented now (`AB:CD:…`), for clients that
    /// pin it.
    pub fn fingerprint(&self) -> String {
        self.current().0.cert.first().map_or_else(String::new, |der| fingerprint(der))
    }

    /// When the presented certificate is due for reissue: half its lifetime after issue.
    pub fn renew_at(&self) -> SystemTime {
        self.current().1 + self.lifetime / 2
    }

    /// Issues a new certificate and presents it from the next handshake on.
    pub fn reissue(&self) -> Result<(), ServerCertError> {
        let now = SystemTime::now();
        let next = certified(self.signer.as_ref(), &self.provider, &self.names, self.lifetime, now)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = (next, now);
        Ok(())
    }

    /// Reissues at half of every lifetime, and at once when the CA changed (a rotation or a
    /// retirement: the certificate must be issued by the root every agent trusts now), until
    /// aborted. The deadline is on the wall clock and checked at least once a minute, so a host
    /// that was suspended renews on waking; a failed reissue is logged and retried.
    pub async fn renew_forever(self: Arc<Self>) {
        let mut changes = self.signer.changes();
        loop {
            let left = self.renew_at().duration_since(SystemTime::now()).unwrap_or_default();
            let changed = async {
                match changes.as_mut() {
                    Some(changes) => changes.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            if !left.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(left.min(RETRY)) => continue,
                    true = changed => {}
                    else => continue,
                }
            }
            match self.reissue() {
                Ok(()) => tracing::info!(names = ?self.names, "reissued the listener's certificate"),
                Err(e) => {
                    tracing::error!("reissuing the listener's certificate failed, retrying: {e}");
                    tokio::time::sleep(RETRY.min(self.lifetime / 10)).await;
                }
            }
        }
    }
}

impl ResolvesServerCert for ServerCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current().0)
    }
}

/// The SHA-256 fingerprint of a DER certificate, as upper-case hex pairs joined by colons.
pub fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let pairs: Vec<String> = digest.as_ref().iter().map(|b| format!("{b:02X}")).collect();
    pairs.join(":")
}

fn certified(
    signer: &dyn Signer,
    provider: &CryptoProvider,
    names: &[String],
    lifetime: Duration,
    now: SystemTime,
) -> Result<Arc<CertifiedKey>, ServerCertError> {
    let (cert_pem, key_pem) = signer.issue_server(names, lifetime, now)?;
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ServerCertError::Unusable(e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| ServerCertError::Unusable(format!("key: {e}")))?;
    let key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| ServerCertError::Unusable(format!("key: {e}")))?;
    Ok(Arc::new(CertifiedKey::new(certs, key)))
}
