//! The agent's credential (IDN-2, IDN-5): a key generated here and never sent, the certificate
//! the control plane issued for it, and the CA bundle delivered out of band. Stored together in
//! one file of the state directory (`credential.pem`, mode 0600: key, certificate, CA bundle),
//! so renewal replaces all three with one rename and a crash at any moment leaves either the old
//! credential or the new one, never a new key beside an old certificate (issue 16). The three
//! files of earlier versions are still read, and replaced at the next save.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::WorkloadId;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

pub const CREDENTIAL_FILE: &str = "credential.pem";
/// The layout before `CREDENTIAL_FILE`: three files, replaced one at a time.
const KEY_FILE: &str = "key.pem";
const CERT_FILE: &str = "cert.pem";
const CA_FILE: &str = "ca.pem";

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
    #[error(
        "the key does not belong to the certificate; this host must be enrolled again (innerwall-agent enroll --force …)"
    )]
    Mismatch,
    #[error("{path}: {detail}")]
    Malformed { path: PathBuf, detail: String },
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

/// `bundle_pem` as the CA bundle for `cert_pem`, if it is one: PEM certificates only (at most
/// [`MAX_BUNDLE_CERTS`]), one of which signed the certificate. A bundle the control plane sends
/// (enrollment, renewal) replaces the stored one only then, so a bad reply cannot lock the agent
/// out of the control plane (IDN-8 rotation).
pub fn check_bundle(cert_pem: &str, bundle_pem: &str) -> Result<(), CredentialError> {
    let bad = |e: String| CredentialError::Certificate(format!("the CA bundle the control plane sent: {e}"));
    let (_, leaf) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()).map_err(|e| bad(e.to_string()))?;
    let leaf = leaf.parse_x509().map_err(|e| bad(e.to_string()))?;
    let mut signed = false;
    let mut count = 0;
    for pem in x509_parser::pem::Pem::iter_from_buffer(bundle_pem.as_bytes()) {
        let pem = pem.map_err(|e| bad(e.to_string()))?;
        if pem.label != "CERTIFICATE" {
            return Err(bad(format!("unexpected PEM block {:?}", pem.label)));
        }
        count += 1;
        if count > MAX_BUNDLE_CERTS {
            return Err(bad(format!("more than {MAX_BUNDLE_CERTS} certificates")));
        }
        let ca = pem.parse_x509().map_err(|e| bad(e.to_string()))?;
        signed |= ca.is_ca() && leaf.verify_signature(Some(ca.public_key())).is_ok();
    }
    match (count, signed) {
        (0, _) => Err(bad("no certificate".into())),
        (_, false) => Err(bad("none of its roots issued this host's certificate".into())),
        _ => Ok(()),
    }
}

/// The most roots a CA bundle holds (a rotation has two).
pub const MAX_BUNDLE_CERTS: usize = 8;

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
        [CREDENTIAL_FILE, KEY_FILE, CERT_FILE].iter().any(|f| dir.join(f).exists())
    }

    /// A credential from its parts; refused unless the key is the certificate's.
    pub fn new(key_pem: String, cert_pem: String, ca_pem: String) -> Result<Self, CredentialError> {
        let (id, not_before, not_after) = inspect(&cert_pem)?;
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(|e| CredentialError::Key(e.to_string()))?;
        let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
            .map_err(|e| CredentialError::Certificate(e.to_string()))?;
        let cert = pem.parse_x509().map_err(|e| CredentialError::Certificate(e.to_string()))?;
        if cert.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(&key).as_slice() {
            return Err(CredentialError::Mismatch);
        }
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
        let one = dir.join(CREDENTIAL_FILE);
        let (mut credential, stored) = if one.exists() {
            let text = read_private(&one)?;
            let (key, cert, ca) = split_bundle(&text)
                .map_err(|detail| CredentialError::Malformed { path: one.clone(), detail })?;
            (Credential::new(key, cert, ca)?, one)
        } else {
            let key = read_private(&dir.join(KEY_FILE))?;
            let read = |name: &str| {
                let path = dir.join(name);
                fs::read_to_string(&path).map_err(|source| CredentialError::Io { path, source })
            };
            (Credential::new(key, read(CERT_FILE)?, read(CA_FILE)?)?, dir.join(CERT_FILE))
        };
        credential.received_at = fs::metadata(&stored).and_then(|m| m.modified()).map_err(io(&stored))?;
        Ok(credential)
    }

    /// Writes key, certificate and CA bundle as one file (a fresh 0600 temporary file, fsync,
    /// one rename, fsync of the directory), then removes the files of the old layout.
    pub fn save(&self, dir: &Path) -> Result<(), CredentialError> {
        crate::private::dir(dir).map_err(io(dir))?;
        let path = dir.join(CREDENTIAL_FILE);
        let bundle =
            format!("{}\n{}\n{}", self.key_pem.trim_end(), self.cert_pem.trim_end(), self.ca_pem.trim_end());
        crate::private::write(&path, format!("{bundle}\n").as_bytes()).map_err(io(&path))?;
        for legacy in [KEY_FILE, CERT_FILE, CA_FILE] {
            let legacy = dir.join(legacy);
            match fs::remove_file(&legacy) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&legacy)(e)),
                _ => {}
            }
        }
        Ok(())
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
/// Server-authenticated TLS against `ca_pem` for enrollment, presenting `previous` (this host's
/// old credential) as the client certificate when it re-enrolls to replace that identity.
pub fn enroll_tls(ca_pem: &str, server_name: &str, previous: Option<&Credential>) -> ClientTlsConfig {
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name(server_name);
    match previous {
        Some(old) => tls.identity(Identity::from_pem(&old.cert_pem, &old.key_pem)),
        None => tls,
    }
}

/// Reads a file that holds a private key, refusing it if group or others can read it.
fn read_private(path: &Path) -> Result<String, CredentialError> {
    let mode = fs::metadata(path).map_err(io(path))?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(CredentialError::KeyMode { path: path.to_owned(), mode });
    }
    fs::read_to_string(path).map_err(io(path))
}

/// Splits a stored credential into (key, leaf certificate, CA bundle): the one private key
/// block, the first certificate, and every certificate after it.
fn split_bundle(text: &str) -> Result<(String, String, String), String> {
    let (mut key, mut leaf, mut ca) = (None, None, Vec::new());
    let mut rest = text;
    while let Some(start) = rest.find("-----BEGIN ") {
        let label_end = rest[start..].find("-----\n").ok_or("a PEM header is not terminated")? + start;
        let label = &rest[start + "-----BEGIN ".len()..label_end];
        let end_marker = format!("-----END {label}-----");
        let end = rest[start..].find(&end_marker).ok_or_else(|| format!("no {end_marker}"))? + start;
        let block = format!("{}\n", &rest[start..end + end_marker.len()]);
        rest = &rest[end + end_marker.len()..];
        match label {
            l if l.ends_with("PRIVATE KEY") && key.is_none() => key = Some(block),
            l if l.ends_with("PRIVATE KEY") => return Err("more than one private key".into()),
            "CERTIFICATE" if leaf.is_none() => leaf = Some(block),
            "CERTIFICATE" => ca.push(block),
            other => return Err(format!("unexpected PEM block {other:?}")),
        }
    }
    match (key, leaf, ca.is_empty()) {
        (Some(key), Some(leaf), false) => Ok((key, leaf, ca.concat())),
        _ => Err("a credential holds a private key, its certificate and the CA bundle".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key and a certificate naming `id`, self-signed (the chain is the TLS layer's business).
    fn issued(id: WorkloadId) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = vec![rcgen::SanType::URI(id.to_uri().try_into().unwrap())];
        let cert = params.self_signed(&key).unwrap();
        (key.serialize_pem(), cert.pem())
    }

    fn ca() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::default().self_signed(&key).unwrap().pem()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("iw-cred-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// Every state a crash during renewal can leave on disk loads as one whole credential, the
    /// old or the new, and the next save succeeds from it.
    #[test]
    fn renewal_is_crash_safe() {
        let dir = temp_dir("crash");
        let id = WorkloadId::new_random();
        let (old_key, old_cert) = issued(id);
        let (new_key, new_cert) = issued(id);
        let old = Credential::new(old_key.clone(), old_cert.clone(), ca()).unwrap();
        let new = Credential::new(new_key.clone(), new_cert.clone(), old.ca_pem.clone()).unwrap();
        old.save(&dir).unwrap();
        let usable = |want: &Credential| {
            let got = Credential::load(&dir).unwrap();
            assert_eq!((&got.key_pem, &got.cert_pem), (&want.key_pem, &want.cert_pem));
        };
        let tmp = dir.join(CREDENTIAL_FILE).with_extension("tmp");
        // Crashed while writing the temporary file (empty, or cut short), or after it was
        // complete but before the rename: the old credential stands.
        for partial in [String::new(), new_key[..40].to_owned(), format!("{new_key}\n{new_cert}")] {
            fs::write(&tmp, &partial).unwrap();
            usable(&old);
        }
        // The save that follows a crash clears the leftover and completes.
        new.save(&dir).unwrap();
        usable(&new);
        assert!(!tmp.exists());

        // The old three-file layout, and a crash between its renames (new key, old certificate):
        // the pair is refused by name rather than handed to TLS, and a whole credential replaces
        // the files at the next save.
        let legacy = temp_dir("legacy");
        crate::private::dir(&legacy).unwrap();
        for (name, text) in [(KEY_FILE, &old_key), (CERT_FILE, &old_cert), (CA_FILE, &old.ca_pem)] {
            crate::private::write(&legacy.join(name), text.as_bytes()).unwrap();
        }
        assert_eq!(Credential::load(&legacy).unwrap().cert_pem, old_cert);
        crate::private::write(&legacy.join(KEY_FILE), new_key.as_bytes()).unwrap();
        assert!(matches!(Credential::load(&legacy), Err(CredentialError::Mismatch)));
        new.save(&legacy).unwrap();
        assert_eq!(Credential::load(&legacy).unwrap().cert_pem, new_cert);
        for name in [KEY_FILE, CERT_FILE, CA_FILE] {
            assert!(!legacy.join(name).exists(), "{name} left behind");
        }
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&legacy);
    }

    /// A CA and a certificate it issued, as PEM.
    fn ca_and_leaf() -> (String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::from_ca_cert_der(ca.der(), ca_key).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::default().signed_by(&leaf_key, &issuer).unwrap();
        (ca.pem(), leaf.pem())
    }

    #[test]
    fn a_sent_bundle_is_kept_only_if_it_issued_the_certificate() {
        let (ca, leaf) = ca_and_leaf();
        let (other_ca, _) = ca_and_leaf();
        assert!(check_bundle(&leaf, &ca).is_ok());
        assert!(check_bundle(&leaf, &format!("{other_ca}{ca}")).is_ok(), "a rotation's two roots");
        let e = check_bundle(&leaf, &other_ca).unwrap_err().to_string();
        assert!(e.contains("none of its roots issued"), "{e}");
        assert!(check_bundle(&leaf, "").is_err());
        assert!(check_bundle(&leaf, &ca.repeat(MAX_BUNDLE_CERTS + 1)).is_err());
        let (key, _) = issued(WorkloadId::new_random());
        assert!(check_bundle(&leaf, &format!("{ca}{key}")).is_err(), "a key in a bundle");
    }

    #[test]
    fn a_stored_credential_must_hold_key_certificate_and_ca() {
        let (key, cert) = issued(WorkloadId::new_random());
        let ca = ca();
        assert!(split_bundle(&format!("{key}{cert}{ca}")).is_ok());
        for bad in
            [format!("{cert}{ca}"), format!("{key}{cert}"), format!("{key}{key}{cert}{ca}"), "junk".into()]
        {
            assert!(split_bundle(&bad).is_err(), "{bad}");
        }
    }

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
