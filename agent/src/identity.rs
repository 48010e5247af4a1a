//! The agent's credential (IDN-2, IDN-5): a key generated here and never sent, the certificate
//! the control plane issued for it, and the CA bundle delivered out of band. Stored in the state
//! directory (key mode 0600), loaded into the TLS client for every connection, and replaced
//! atomically on renewal.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::WorkloadId;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

pub const KEY_FILE: &str = "key.pem";
pub const CERT_FILE: &str = "cert.pem";
pub const CA_FILE: &str = "ca.pem";

#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("no credential in {dir}: enroll this host first (innerwall-agent enroll …)")]
    Missing { dir: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is readable by group or others (mode {mode:o}); run: chmod 600 {path}")]
    KeyMode { path: PathBuf, mode: u32 },
    #[error("certificate: {0}")]
    Certificate(String),
    #[error("key generation: {0}")]
    Key(String),
    #[error(
        "the credential expired at {expired:?}; this host must be enrolled again (innerwall-agent enroll --force …)"
    )]
    Expired { expired: SystemTime },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CredentialError + '_ {
    move |source| CredentialError::Io { path: path.to_owned(), source }
}

/// A key pair made here and the CSR that carries its public key. The CSR asks for nothing else:
/// the control plane ignores everything but the key anyway.
pub fn new_key_and_csr() -> Result<(String, Vec<u8>), CredentialError> {
    let key = rcgen::KeyPair::generate().map_err(|e| CredentialError::Key(e.to_string()))?;
    let csr = rcgen::CertificateParams::default()
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(|e| CredentialError::Key(e.to_string()))?;
    Ok((key.serialize_pem(), csr.into_bytes()))
}

/// The workload id and validity window of a PEM certificate.
pub fn inspect(cert_pem: &str) -> Result<(WorkloadId, SystemTime, SystemTime), CredentialError> {
    let bad = |e: String| CredentialError::Certificate(e);
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()).map_err(|e| bad(e.to_string()))?;
    let cert = pem.parse_x509().map_err(|e| bad(e.to_string()))?;
    let uris: Vec<&str> = cert
        .subject_alternative_name()
        .map_err(|e| bad(e.to_string()))?
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::URI(u) => Some(*u),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let [uri] = uris[..] else {
        return Err(bad(format!("expected exactly one URI SAN, found {}", uris.len())));
    };
    let id = WorkloadId::parse_uri(uri).map_err(|e| bad(e.to_string()))?;
    let at = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
    };
    Ok((id, at(cert.validity().not_before), at(cert.validity().not_after)))
}

/// The credential on disk.
#[derive(Clone)]
pub struct Credential {
    pub id: WorkloadId,
    pub key_pem: String,
    pub cert_pem: String,
    pub ca_pem: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// When this host received the certificate (its file's mtime once stored): renewal timing
    /// runs from here, because `not_before` is backdated for clock skew.
    pub received_at: SystemTime,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("id", &self.id)
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Credential {
    pub fn exists(dir: &Path) -> bool {
        dir.join(KEY_FILE).exists() || dir.join(CERT_FILE).exists()
    }

    pub fn new(key_pem: String, cert_pem: String, ca_pem: String) -> Result<Self, CredentialError> {
        let (id, not_before, not_after) = inspect(&cert_pem)?;
        Ok(Credential {
            id,
            key_pem,
            cert_pem,
            ca_pem,
            not_before,
            not_after,
            received_at: SystemTime::now(),
        })
    }

    pub fn load(dir: &Path) -> Result<Self, CredentialError> {
        if !Credential::exists(dir) {
            return Err(CredentialError::Missing { dir: dir.to_owned() });
        }
        let key_path = dir.join(KEY_FILE);
        let mode = fs::metadata(&key_path).map_err(io(&key_path))?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(CredentialError::KeyMode { path: key_path, mode });
        }
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).map_err(|source| CredentialError::Io { path, source })
        };
        let mut credential = Credential::new(read(KEY_FILE)?, read(CERT_FILE)?, read(CA_FILE)?)?;
        let cert_path = dir.join(CERT_FILE);
        credential.received_at =
            fs::metadata(&cert_path).and_then(|m| m.modified()).map_err(io(&cert_path))?;
        Ok(credential)
    }

    /// Writes all three files atomically (temp file, fsync, rename), the key with mode 0600 from
    /// creation on, then fsyncs the directory.
    pub fn save(&self, dir: &Path) -> Result<(), CredentialError> {
        crate::private::dir(dir).map_err(io(dir))?;
        write_atomic(&dir.join(KEY_FILE), self.key_pem.as_bytes(), 0o600)?;
        write_atomic(&dir.join(CERT_FILE), self.cert_pem.as_bytes(), 0o600)?;
        write_atomic(&dir.join(CA_FILE), self.ca_pem.as_bytes(), 0o600)?;
        fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
    }

    /// TLS for agent RPCs: trust only the CA bundle, present this certificate.
    pub fn tls(&self, server_name: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(server_name)
    }

    /// When to renew: uniformly in the last third of the lifetime (counted from receipt),
    /// ending 10 % before expiry (IDN-5), given `unit` uniform in `[0, 1)`.
    pub fn renew_at(&self, unit: f64) -> SystemTime {
        let issued = self.not_before.max(self.received_at);
        let life = self.not_after.duration_since(issued).unwrap_or_default();
        let start = life.mul_f64(2.0 / 3.0);
        let span = life.mul_f64(0.9).saturating_sub(start);
        issued + start + span.mul_f64(unit.clamp(0.0, 1.0))
    }

    pub fn check_not_expired(&self, now: SystemTime) -> Result<(), CredentialError> {
        if now >= self.not_after {
            return Err(CredentialError::Expired { expired: self.not_after });
        }
        Ok(())
    }
}

/// TLS for enrollment: trust only the CA bundle, present no certificate.
pub fn enroll_tls(ca_pem: &str, server_name: &str) -> ClientTlsConfig {
    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name(server_name)
}

fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CredentialError> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut file =
        fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(io(&tmp))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io(&tmp))?;
    fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_falls_in_the_last_third_before_expiry() {
        let c = Credential {
            id: WorkloadId::new_random(),
            key_pem: String::new(),
            cert_pem: String::new(),
            ca_pem: String::new(),
            not_before: SystemTime::UNIX_EPOCH,
            not_after: SystemTime::UNIX_EPOCH + Duration::from_secs(3000),
            received_at: SystemTime::UNIX_EPOCH,
        };
        let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!((secs(c.renew_at(0.0)) - 2000.0).abs() < 1.0);
        assert!((secs(c.renew_at(0.999_999)) - 2700.0).abs() < 1.0);
        assert!(c.check_not_expired(c.not_after).is_err());
    }
}
