//! The workload CA (IDN-3, IDN-8): the `Signer` seam, the file-backed root that `innerwall ca init`
//! creates and `innerwall ca rotate` / `ca retire` replace, certificate issuance from a CSR that
//! contributes only its public key, and reading a workload's identity back out of a presented
//! certificate.
//!
//! The signing key lives in an operator-provided directory (identical on every replica) and
//! never in Postgres. Everything a CSR asks for — subject, names, extensions — is ignored: the
//! control plane alone decides what a workload certificate says.
//!
//! Rotation (issue 25): `ca.key`/`ca.crt` are always the root every agent trusts and the one
//! server certificates are issued by. `ca rotate` adds `next.key`/`next.crt`: from then on the
//! bundle holds both roots and workload certificates are issued by `next`, so an agent that
//! renews gets a certificate and a bundle of the new root while the server stays verifiable
//! with the old one. `ca retire` moves `next` over `ca` (the old key is gone): servers then
//! present certificates of the new root, which every agent that renewed trusts. A running
//! replica notices the change by [`Signer::reload`].

use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::{IdentityError, WorkloadId};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber, SignatureAlgorithm,
};
use ring::rand::{SecureRandom, SystemRandom};
use time::OffsetDateTime;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::GeneralName;
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_DSA, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
    OID_SIG_ED448, OID_SIG_ED25519,
};
use x509_parser::prelude::FromDer;
use x509_parser::x509::SubjectPublicKeyInfo;

/// The CA's private key, PKCS#8 PEM, mode 0600.
pub const CA_KEY_FILE: &str = "ca.key";
/// The self-signed root certificate agents and servers trust.
pub const CA_CERT_FILE: &str = "ca.crt";
/// During a rotation: the new root's key, which issues workload certificates.
pub const NEXT_KEY_FILE: &str = "next.key";
/// During a rotation: the new root's certificate, in the bundle beside `ca.crt`.
pub const NEXT_CERT_FILE: &str = "next.crt";
/// The root's common name.
pub const CA_COMMON_NAME: &str = "Innerwall root CA";
/// How long a root created by [`FileCa::init`] is valid.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The default workload certificate lifetime (IDN-3); callers pass it explicitly.
pub const DEFAULT_WORKLOAD_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// Every certificate starts this long before `now`, so a peer whose clock runs a little behind
/// still accepts it.
pub const NOT_BEFORE_BACKDATE: Duration = Duration::from_secs(5 * 60);
/// The largest CSR (PEM) accepted; a P-384 CSR with hostile padding is still well under 4 KiB.
pub const MAX_CSR_BYTES: usize = 16 * 1024;

/// A workload certificate as issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedCertificate {
    pub pem: String,
    /// Lower-case hex of the serial's DER integer content (32 digits).
    pub serial_hex: String,
    /// Exactly as encoded in the certificate (whole seconds).
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// SHA-256 of the issuing root's certificate (DER), lower-case hex.
    pub issuer_sha256: String,
}

/// A CSR that parsed, names an accepted key algorithm and whose signature verifies with its
/// own key: checked where it arrives (the enrollment's own task), so the enrollment writer,
/// which works one batch at a time, only signs.
#[derive(Debug)]
pub struct CheckedCsr {
    pem: Vec<u8>,
    public_key: rcgen::SubjectPublicKeyInfo,
}

impl CheckedCsr {
    pub fn new(csr_pem: &[u8]) -> Result<CheckedCsr, CaError> {
        Ok(CheckedCsr { public_key: csr_public_key(csr_pem)?, pem: csr_pem.to_vec() })
    }
}

/// The seam an external signer (HSM, cloud KMS, Vault) replaces (IDN-8).
pub trait Signer: Send + Sync + fmt::Debug {
    /// The CA certificate(s), PEM, that agents and servers trust.
    fn ca_bundle_pem(&self) -> String;

    /// A client-auth certificate for `id` over the CSR's public key and nothing else (IDN-3),
    /// valid from `now` − [`NOT_BEFORE_BACKDATE`] to `now + lifetime`.
    fn issue_workload(
        &self,
        id: WorkloadId,
        csr_pem: &[u8],
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCertificate, CaError>;

    /// As [`Signer::issue_workload`], over a CSR checked already where it arrived; a signer
    /// that takes the CSR itself (an external one) gets its PEM.
    fn issue_checked(
        &self,
        id: WorkloadId,
        csr: &CheckedCsr,
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCertificate, CaError> {
        self.issue_workload(id, &csr.pem, lifetime, now)
    }

    /// A server-auth certificate and a fresh private key (both PEM) for the control plane's TLS
    /// listener: DNS SANs for `names`, IP SANs for those that parse as addresses.
    fn issue_server(
        &self,
        names: &[String],
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<(String, String), CaError>;

    /// Re-reads the CA's configuration; true if it changed (a rotation or retirement). A signer
    /// that never changes keeps the default.
    fn reload(&self) -> Result<bool, CaError> {
        Ok(false)
    }

    /// Ticks after every change [`Signer::reload`] found, for the server certificates to be
    /// reissued by the root that issues them now.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("csr is {len} bytes; at most {MAX_CSR_BYTES} are accepted")]
    CsrTooLarge { len: usize },
    #[error("csr is not a PEM \"CERTIFICATE REQUEST\": {detail}")]
    CsrPem { detail: String },
    #[error("csr could not be parsed: {detail}")]
    CsrParse { detail: String },
    #[error("csr signature does not verify with its own public key ({detail}); generate a new key and csr")]
    CsrSignature { detail: String },
    #[error(
        "csr public key algorithm {algorithm} is not accepted; use ECDSA P-256 (recommended), \
         ECDSA P-384 or Ed25519"
    )]
    UnsupportedKeyAlgorithm { algorithm: String },
    #[error("certificate lifetime {lifetime:?} is invalid: {detail}")]
    InvalidLifetime { lifetime: Duration, detail: &'static str },
    #[error("server certificate name {name:?} is invalid: {detail}")]
    InvalidServerName { name: String, detail: &'static str },
    #[error("a CA already exists at {}; refusing to overwrite it (move it away first to replace it)", path.display())]
    AlreadyExists { path: PathBuf },
    #[error("{} is accessible by group or others (mode {mode:04o}); run: chmod 600 {}", path.display(), path.display())]
    KeyPermissions { path: PathBuf, mode: u32 },
    #[error("{} does not belong to the certificate in {}: {detail}", key.display(), cert.display())]
    KeyMismatch { key: PathBuf, cert: PathBuf, detail: String },
    #[error("ca certificate {} is unusable: {detail}", path.display())]
    BadCaCertificate { path: PathBuf, detail: String },
    #[error("ca key {} is unusable: {source}", path.display())]
    BadCaKey {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("{} {}: {source}", action, path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a rotation is in progress ({} exists): retire the old CA first (innerwall ca retire)", path.display())]
    RotationInProgress { path: PathBuf },
    #[error("no rotation is in progress ({} is missing): rotate first (innerwall ca rotate)", path.display())]
    NoRotation { path: PathBuf },
    #[error("{}: {detail}", dir.display())]
    Incomplete { dir: PathBuf, detail: &'static str },
    #[error("signing failed: {0}")]
    Signing(#[source] rcgen::Error),
    #[error("the system random number generator failed")]
    Random,
}

impl From<CaError> for crate::error::Error {
    fn from(e: CaError) -> Self {
        crate::error::Error::InvalidInput(Box::new(e))
    }
}

/// Why a presented certificate carries no usable workload identity (IDN-4).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertIdentityError {
    #[error("client certificate could not be parsed: {detail}")]
    Unparseable { detail: String },
    #[error("client certificate has an unreadable subject alternative name extension: {detail}")]
    BadSanExtension { detail: String },
    #[error("client certificate carries no URI SAN; a workload certificate carries exactly one")]
    NoUriSan,
    #[error("client certificate carries {count} URI SANs; a workload certificate carries exactly one")]
    MultipleUriSans { count: usize },
    #[error("client certificate URI SAN is not a workload identity: {0}")]
    BadUri(#[source] IdentityError),
}

/// When a presented leaf certificate expires. A connection, and the streams on it, must not
/// outlive it (issue 16): the TLS layer checks validity only at the handshake.
pub fn certificate_not_after(der: &[u8]) -> Result<SystemTime, CertIdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| CertIdentityError::Unparseable { detail: e.to_string() })?;
    let seconds = cert.validity().not_after.timestamp();
    let seconds = u64::try_from(seconds).map_err(|_| CertIdentityError::Unparseable {
        detail: format!("not after {seconds} is before 1970"),
    })?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds))
}

/// SHA-256 of a presented leaf certificate's public key (its DER SubjectPublicKeyInfo),
/// lower-case hex: which key holds the identity, for clone detection (IDN-7).
pub fn certificate_key_sha256(der: &[u8]) -> Result<String, CertIdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| CertIdentityError::Unparseable { detail: e.to_string() })?;
    Ok(sha256_hex(cert.public_key().raw))
}

/// The workload identity of a presented leaf certificate: its one URI SAN, canonical form only.
/// Chain validation against the CA is the TLS layer's job, not this function's.
pub fn workload_id_from_certificate(der: &[u8]) -> Result<WorkloadId, CertIdentityError> {
    let (rest, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| CertIdentityError::Unparseable { detail: e.to_string() })?;
    if !rest.is_empty() {
        return Err(CertIdentityError::Unparseable {
            detail: format!("{} bytes after the certificate", rest.len()),
        });
    }
    // Fails on a duplicated SAN extension too, so a second extension cannot smuggle a name in.
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CertIdentityError::BadSanExtension { detail: e.to_string() })?;
    let uris: Vec<&str> = san
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        })
        .collect();
    match uris.as_slice() {
        [] => Err(CertIdentityError::NoUriSan),
        [uri] => WorkloadId::parse_uri(uri).map_err(CertIdentityError::BadUri),
        many => Err(CertIdentityError::MultipleUriSans { count: many.len() }),
    }
}

/// One root: its certificate and what signs with its key.
struct Root {
    cert_pem: String,
    sha256: String,
    issuer: Issuer<'static, KeyPair>,
}

/// What the CA directory held when it was last read.
struct Loaded {
    /// `ca.*`: trusted by every agent, issues server certificates.
    current: Root,
    /// `next.*` during a rotation: issues workload certificates.
    next: Option<Root>,
    /// The certificate files' contents, to tell a change without re-reading keys.
    stamp: Vec<u8>,
}

impl Loaded {
    fn workload_issuer(&self) -> &Root {
        self.next.as_ref().unwrap_or(&self.current)
    }
}

/// The file-backed CA: `ca.key` + `ca.crt` (and during a rotation `next.key` + `next.crt`) in an
/// operator-provided directory.
pub struct FileCa {
    dir: PathBuf,
    loaded: std::sync::RwLock<std::sync::Arc<Loaded>>,
    changes: tokio::sync::watch::Sender<u64>,
}

impl fmt::Debug for FileCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("FileCa").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// What `innerwall ca rotate` or `ca retire` did: the fingerprints of the roots involved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RootChange {
    /// The root agents trusted before (rotate) / the root retired (retire).
    pub old_sha256: String,
    /// The root added (rotate) / the root that replaces it (retire).
    pub new_sha256: String,
}

impl FileCa {
    /// Creates a new root in `dir` (created 0700 if missing). Refuses when either file exists.
    pub fn init(dir: &Path) -> Result<FileCa, CaError> {
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        if !dir.exists() {
            DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|source| CaError::Io {
                action: "creating directory",
                path: dir.into(),
                source,
            })?;
        }
        for path in [&key_path, &cert_path] {
            if fs::symlink_metadata(path).is_ok() {
                return Err(CaError::AlreadyExists { path: path.clone() });
            }
        }
        new_root(&key_path, &cert_path, CA_COMMON_NAME)?;
        FileCa::load(dir)
    }

    /// Loads `dir/ca.key` and `dir/ca.crt` (and `next.*` when a rotation is in progress),
    /// refusing a key accessible by group or others, a key that does not match its certificate,
    /// and a certificate that is not a currently valid CA.
    pub fn load(dir: &Path) -> Result<FileCa, CaError> {
        let loaded = load_dir(dir)?;
        Ok(FileCa {
            dir: dir.to_owned(),
            loaded: std::sync::RwLock::new(std::sync::Arc::new(loaded)),
            changes: tokio::sync::watch::Sender::new(0),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn loaded(&self) -> std::sync::Arc<Loaded> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// SHA-256 of the root agents are given and servers present (`ca.crt`).
    pub fn current_sha256(&self) -> String {
        self.loaded().current.sha256.clone()
    }

    /// SHA-256 of the root a rotation added (`next.crt`), if one is in progress.
    pub fn next_sha256(&self) -> Option<String> {
        self.loaded().next.as_ref().map(|r| r.sha256.clone())
    }

    /// `innerwall ca rotate`: creates a new root as `next.*` in `dir`; from the next load or
    /// reload on, workload certificates are issued by it and the bundle holds both roots.
    /// Refused while a rotation is in progress.
    pub fn rotate(dir: &Path) -> Result<RootChange, CaError> {
        let old = FileCa::load(dir)?;
        let (key_path, cert_path) = (dir.join(NEXT_KEY_FILE), dir.join(NEXT_CERT_FILE));
        for path in [&key_path, &cert_path] {
            if fs::symlink_metadata(path).is_ok() {
                return Err(CaError::RotationInProgress { path: path.clone() });
            }
        }
        let serial = random_serial()?;
        let name = format!("{CA_COMMON_NAME} {}", &hex(&serial.to_bytes())[..8]);
        new_root(&key_path, &cert_path, &name)?;
        let new = FileCa::load(dir)?;
        Ok(RootChange { old_sha256: old.current_sha256(), new_sha256: new.next_sha256().unwrap_or_default() })
    }

    /// `innerwall ca retire`: the new root replaces the old one (`next.*` moved over `ca.*`;
    /// the old key is gone). Whether every agent has renewed is the caller's check
    /// ([`crate::identity::rotation::retire`]). An interrupted retirement is completed.
    pub fn retire(dir: &Path) -> Result<RootChange, CaError> {
        let (next_key, next_cert) = (dir.join(NEXT_KEY_FILE), dir.join(NEXT_CERT_FILE));
        let io = |action, path: &Path| {
            let path = path.to_owned();
            move |source| CaError::Io { action, path, source }
        };
        if !next_cert.exists() {
            return Err(CaError::NoRotation { path: next_cert });
        }
        let old_sha256 = certificate_file_sha256(&dir.join(CA_CERT_FILE))?;
        if next_key.exists() {
            // Validates the pair before anything moves.
            FileCa::load(dir)?;
            fs::rename(&next_key, dir.join(CA_KEY_FILE)).map_err(io("renaming", &next_key))?;
        }
        // Between the two renames `ca.key` is the new key beside the old certificate: a load
        // then fails (a reload keeps what it had) until this completes, or `ca retire` is run
        // again after a crash.
        fs::rename(&next_cert, dir.join(CA_CERT_FILE)).map_err(io("renaming", &next_cert))?;
        sync_dir(dir)?;
        let new = FileCa::load(dir)?;
        Ok(RootChange { old_sha256, new_sha256: new.current_sha256() })
    }
}

/// Creates a self-signed root named `name`: the key with `create_new` and mode 0600 first (it
/// never exists with wider permissions), then the certificate.
fn new_root(key_path: &Path, cert_path: &Path, name: &str) -> Result<(), CaError> {
    let key = KeyPair::generate().map_err(CaError::Signing)?;
    let now = SystemTime::now();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    // Path length 0: whatever this root signs can never act as a CA itself.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.serial_number = Some(random_serial()?);
    (params.not_before, params.not_after) = validity(now, CA_LIFETIME)?;
    let cert = params.self_signed(&key).map_err(CaError::Signing)?;

    // create_new + mode: the key file never exists with wider permissions, not even briefly,
    // and an existing file (a race with another `ca init`) is never overwritten.
    write_new(key_path, 0o600, key.serialize_pem().as_bytes())?;
    if let Err(e) = write_new(cert_path, 0o644, cert.pem().as_bytes()) {
        let _ = fs::remove_file(key_path);
        return Err(e);
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), CaError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|source| CaError::Io {
        action: "syncing",
        path: dir.to_owned(),
        source,
    })
}

/// The certificate files' contents (which say whether anything changed) and which exist.
fn stamp(dir: &Path) -> Vec<u8> {
    let mut stamp = Vec::new();
    for name in [CA_CERT_FILE, NEXT_CERT_FILE, CA_KEY_FILE, NEXT_KEY_FILE] {
        let path = dir.join(name);
        match name.ends_with(".crt") {
            true => stamp.extend(fs::read(&path).unwrap_or_default()),
            false => stamp.push(u8::from(path.exists())),
        }
        stamp.push(0);
    }
    stamp
}

fn load_dir(dir: &Path) -> Result<Loaded, CaError> {
    let stamp = stamp(dir);
    let (next_key, next_cert) = (dir.join(NEXT_KEY_FILE), dir.join(NEXT_CERT_FILE));
    // A half-done rotation or retirement first: its message says how to finish it, where the
    // key mismatch it also leaves would not.
    let next = match (next_key.exists(), next_cert.exists()) {
        (true, true) => Some(()),
        (false, false) => None,
        (true, false) => {
            return Err(CaError::Incomplete {
                dir: dir.to_owned(),
                detail: "next.key without next.crt: a rotation was interrupted; remove next.key and rotate again",
            });
        }
        (false, true) => {
            return Err(CaError::Incomplete {
                dir: dir.to_owned(),
                detail: "next.crt without next.key: a retirement was interrupted; run `innerwall ca retire` again",
            });
        }
    };
    let current = load_root(&dir.join(CA_KEY_FILE), &dir.join(CA_CERT_FILE))?;
    let next = match next {
        Some(()) => Some(load_root(&next_key, &next_cert)?),
        None => None,
    };
    Ok(Loaded { current, next, stamp })
}

fn load_root(key_path: &Path, cert_path: &Path) -> Result<Root, CaError> {
    let (key_path, cert_path) = (key_path.to_owned(), cert_path.to_owned());
    let mut key_file = File::open(&key_path).map_err(|source| CaError::Io {
        action: "opening ca key",
        path: key_path.clone(),
        source,
    })?;
    let mode = key_file
        .metadata()
        .map_err(|source| CaError::Io { action: "reading metadata of", path: key_path.clone(), source })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(CaError::KeyPermissions { path: key_path, mode: mode & 0o7777 });
    }
    let mut key_pem = String::new();
    key_file.read_to_string(&mut key_pem).map_err(|source| CaError::Io {
        action: "reading ca key",
        path: key_path.clone(),
        source,
    })?;
    let key =
        KeyPair::from_pem(&key_pem).map_err(|source| CaError::BadCaKey { path: key_path.clone(), source })?;

    let cert_pem = fs::read_to_string(&cert_path).map_err(|source| CaError::Io {
        action: "reading ca certificate",
        path: cert_path.clone(),
        source,
    })?;
    let bad = |detail: String| CaError::BadCaCertificate { path: cert_path.clone(), detail };
    let der = pem_contents(cert_pem.as_bytes(), &["CERTIFICATE"]).map_err(bad)?;
    let (rest, cert) = x509_parser::parse_x509_certificate(&der).map_err(|e| bad(e.to_string()))?;
    if !rest.is_empty() {
        return Err(bad("trailing bytes after the certificate".into()));
    }
    if !cert.is_ca() {
        return Err(bad("it is not a CA certificate (basic constraints CA:true missing)".into()));
    }
    if cert.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err(CaError::KeyMismatch {
            key: key_path,
            cert: cert_path,
            detail: "the public keys differ".into(),
        });
    }
    cert.verify_signature(None).map_err(|e| bad(format!("its self-signature does not verify: {e}")))?;
    if !cert.validity().is_valid() {
        return Err(bad(format!(
            "it is valid only from {} to {}; create a new CA",
            cert.validity().not_before,
            cert.validity().not_after
        )));
    }
    let sha256 = sha256_hex(&der);
    let issuer = Issuer::from_ca_cert_der(&der.as_slice().into(), key).map_err(|e| bad(e.to_string()))?;
    Ok(Root { cert_pem, sha256, issuer })
}

/// SHA-256 of the one certificate in the PEM file at `path`, lower-case hex.
pub fn certificate_file_sha256(path: &Path) -> Result<String, CaError> {
    let pem = fs::read_to_string(path).map_err(|source| CaError::Io {
        action: "reading",
        path: path.to_owned(),
        source,
    })?;
    let der = pem_contents(pem.as_bytes(), &["CERTIFICATE"])
        .map_err(|detail| CaError::BadCaCertificate { path: path.to_owned(), detail })?;
    Ok(sha256_hex(&der))
}

/// SHA-256 of `der`, lower-case hex: how a root is named in the registry and the audit log.
pub fn sha256_hex(der: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, der).as_ref())
}

impl Signer for FileCa {
    fn ca_bundle_pem(&self) -> String {
        let loaded = self.loaded();
        match &loaded.next {
            None => loaded.current.cert_pem.clone(),
            Some(next) => format!("{}\n{}", loaded.current.cert_pem.trim_end(), next.cert_pem),
        }
    }

    fn issue_workload(
        &self,
        id: WorkloadId,
        csr_pem: &[u8],
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCertificate, CaError> {
        self.issue_over(id, &csr_public_key(csr_pem)?, lifetime, now)
    }

    fn issue_checked(
        &self,
        id: WorkloadId,
        csr: &CheckedCsr,
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCertificate, CaError> {
        self.issue_over(id, &csr.public_key, lifetime, now)
    }

    fn issue_server(
        &self,
        names: &[String],
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<(String, String), CaError> {
        let Some(first) = names.first() else {
            return Err(CaError::InvalidServerName {
                name: String::new(),
                detail: "at least one name is required",
            });
        };
        let sans = names.iter().map(|name| server_san(name)).collect::<Result<Vec<_>, _>>()?;
        let key = KeyPair::generate().map_err(CaError::Signing)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, first.as_str());
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(random_serial()?);
        (params.not_before, params.not_after) = validity(now, lifetime)?;
        // By the root every agent trusts, rotation or not: one that has not renewed since the
        // rotation knows only that one.
        let cert = params.signed_by(&key, &self.loaded().current.issuer).map_err(CaError::Signing)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    fn reload(&self) -> Result<bool, CaError> {
        if stamp(&self.dir) == self.loaded().stamp {
            return Ok(false);
        }
        let loaded = load_dir(&self.dir)?;
        *self.loaded.write().unwrap_or_else(|e| e.into_inner()) = std::sync::Arc::new(loaded);
        self.changes.send_modify(|n| *n += 1);
        Ok(true)
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.changes.subscribe())
    }
}

impl FileCa {
    /// A workload certificate for `id` over `public_key` (checked: [`csr_public_key`]).
    fn issue_over(
        &self,
        id: WorkloadId,
        public_key: &rcgen::SubjectPublicKeyInfo,
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCertificate, CaError> {
        let serial = random_serial()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        // A label for humans reading the certificate; identity is the URI SAN alone.
        params.distinguished_name.push(DnType::CommonName, id.uuid().hyphenated().to_string());
        let uri = id.to_uri().try_into().map_err(CaError::Signing)?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(serial.clone());
        let (not_before, not_after) = validity(now, lifetime)?;
        (params.not_before, params.not_after) = (not_before, not_after);
        let loaded = self.loaded();
        let root = loaded.workload_issuer();
        let cert = params.signed_by(public_key, &root.issuer).map_err(CaError::Signing)?;
        Ok(IssuedCertificate {
            pem: cert.pem(),
            serial_hex: hex(&serial.to_bytes()),
            not_before: not_before.into(),
            not_after: not_after.into(),
            issuer_sha256: root.sha256.clone(),
        })
    }
}

/// The CSR's public key, after checking size, encoding, algorithm and self-signature. Nothing
/// else of the CSR is looked at.
fn csr_public_key(csr_pem: &[u8]) -> Result<rcgen::SubjectPublicKeyInfo, CaError> {
    if csr_pem.len() > MAX_CSR_BYTES {
        return Err(CaError::CsrTooLarge { len: csr_pem.len() });
    }
    let der = pem_contents(csr_pem, &["CERTIFICATE REQUEST", "NEW CERTIFICATE REQUEST"])
        .map_err(|detail| CaError::CsrPem { detail })?;
    let (rest, csr) =
        X509CertificationRequest::from_der(&der).map_err(|e| CaError::CsrParse { detail: e.to_string() })?;
    if !rest.is_empty() {
        return Err(CaError::CsrParse { detail: format!("{} bytes after the request", rest.len()) });
    }
    let spki = &csr.certification_request_info.subject_pki;
    let accepted: [&SignatureAlgorithm; 3] =
        [&rcgen::PKCS_ECDSA_P256_SHA256, &rcgen::PKCS_ECDSA_P384_SHA384, &rcgen::PKCS_ED25519];
    let public_key = rcgen::SubjectPublicKeyInfo::from_der(spki.raw)
        .ok()
        .filter(|key| accepted.contains(&key.algorithm()))
        .ok_or_else(|| CaError::UnsupportedKeyAlgorithm { algorithm: key_algorithm_name(spki) })?;
    // The certificate must carry the very key that signed the CSR, byte for byte.
    if public_key.subject_public_key_info() != spki.raw {
        return Err(CaError::CsrParse { detail: "the public key is not in canonical DER form".into() });
    }
    csr.verify_signature().map_err(|e| CaError::CsrSignature { detail: e.to_string() })?;
    Ok(public_key)
}

fn key_algorithm_name(spki: &SubjectPublicKeyInfo<'_>) -> String {
    let alg = &spki.algorithm.algorithm;
    if *alg == OID_PKCS1_RSAENCRYPTION {
        "RSA".into()
    } else if *alg == OID_KEY_TYPE_DSA {
        "DSA".into()
    } else if *alg == OID_SIG_ED448 {
        "Ed448".into()
    } else if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = spki.algorithm.parameters.as_ref().and_then(|p| p.as_oid().ok());
        match curve {
            Some(c) if c == OID_EC_P256 => "ECDSA P-256".into(),
            Some(c) if c == OID_NIST_EC_P384 => "ECDSA P-384".into(),
            Some(c) => format!("ECDSA on curve {c}"),
            None => "ECDSA without a named curve".into(),
        }
    } else if *alg == OID_SIG_ED25519 {
        "Ed25519".into()
    } else {
        format!("with OID {alg}")
    }
}

/// The DER inside one PEM block whose label is one of `labels`; only whitespace may follow.
fn pem_contents(input: &[u8], labels: &[&str]) -> Result<Vec<u8>, String> {
    let (rest, pem) = x509_parser::pem::parse_x509_pem(input).map_err(|e| e.to_string())?;
    if !labels.contains(&pem.label.as_str()) {
        return Err(format!("found a {:?} block, expected {:?}", pem.label, labels[0]));
    }
    if !rest.iter().all(u8::is_ascii_whitespace) {
        return Err("more than one PEM block".into());
    }
    Ok(pem.contents)
}

fn server_san(name: &str) -> Result<SanType, CaError> {
    let invalid = |detail| CaError::InvalidServerName { name: name.to_owned(), detail };
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    if name.is_empty() || name.len() > 253 {
        return Err(invalid("a DNS name is 1 to 253 characters"));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'*') {
        return Err(invalid("a DNS name has only ASCII letters, digits, '-', '.' (and a leading '*.')"));
    }
    Ok(SanType::DnsName(name.try_into().map_err(CaError::Signing)?))
}

/// `(now − backdate, now + lifetime)` in whole seconds, as the certificate encodes them.
fn validity(now: SystemTime, lifetime: Duration) -> Result<(OffsetDateTime, OffsetDateTime), CaError> {
    if lifetime < Duration::from_secs(1) {
        return Err(CaError::InvalidLifetime { lifetime, detail: "it must be at least one second" });
    }
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| CaError::InvalidLifetime { lifetime, detail: "the clock is before 1970" })?
        .as_secs();
    let too_long = || CaError::InvalidLifetime { lifetime, detail: "it ends beyond the year 9999" };
    let not_after = now.checked_add(lifetime.as_secs()).ok_or_else(too_long)?;
    let not_before = now.saturating_sub(NOT_BEFORE_BACKDATE.as_secs());
    let at = |secs: u64| {
        i64::try_from(secs)
            .ok()
            .and_then(|secs| OffsetDateTime::from_unix_timestamp(secs).ok())
            .filter(|t| t.year() <= 9999)
            .ok_or_else(too_long)
    };
    Ok((at(not_before)?, at(not_after)?))
}

/// 16 random bytes, positive and without a leading zero byte, so the DER integer is always 16
/// bytes and `serial_hex` matches what parsers print: 126 random bits.
fn random_serial() -> Result<SerialNumber, CaError> {
    let mut bytes = [0u8; 16];
    SystemRandom::new().fill(&mut bytes).map_err(|_| CaError::Random)?;
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    Ok(SerialNumber::from_slice(&bytes))
}

/// Lower-case hex of `bytes` (fingerprints, digests).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_new(path: &Path, mode: u32, contents: &[u8]) -> Result<(), CaError> {
    let io = |action| move |source| CaError::Io { action, path: path.to_owned(), source };
    let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            CaError::AlreadyExists { path: path.to_owned() }
        } else {
            io("creating")(e)
        }
    })?;
    // The umask may have narrowed the mode; make it exact.
    file.set_permissions(fs::Permissions::from_mode(mode)).map_err(io("setting permissions of"))?;
    file.write_all(contents).map_err(io("writing"))?;
    file.sync_all().map_err(io("syncing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with_sans(sans: Vec<SanType>) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        params.self_signed(&key).unwrap().der().to_vec()
    }

    fn uri(s: &str) -> SanType {
        SanType::URI(s.try_into().unwrap())
    }

    #[test]
    fn identity_from_certificate_needs_exactly_one_canonical_uri_san() {
        let id = WorkloadId::new_random();
        let other = WorkloadId::new_random();
        let dns = SanType::DnsName("agent.example".try_into().unwrap());

        assert_eq!(workload_id_from_certificate(&cert_with_sans(vec![uri(&id.to_uri())])), Ok(id));
        // Other kinds of names do not count as identities (our certificates carry none).
        assert_eq!(
            workload_id_from_certificate(&cert_with_sans(vec![dns.clone(), uri(&id.to_uri())])),
            Ok(id)
        );

        let check = |sans: Vec<SanType>, want: &str| {
            let got = workload_id_from_certificate(&cert_with_sans(sans)).unwrap_err();
            assert!(got.to_string().contains(want), "{got} lacks {want:?}");
        };
        check(vec![], "carries no URI SAN");
        check(vec![dns], "carries no URI SAN");
        check(vec![uri(&id.to_uri()), uri(&other.to_uri())], "carries 2 URI SANs");
        check(vec![uri(&id.to_uri()), uri(&id.to_uri())], "carries 2 URI SANs");
        check(vec![uri(&format!("spiffe://workload/{}", id.uuid()))], "must start with");
        check(vec![uri(&id.to_uri().to_uppercase())], "must start with");
        check(vec![uri(&format!("innerwall://workload/{}", id.uuid().simple()))], "lower-case hyphenated");
        check(vec![uri("innerwall://workload/00000000-0000-0000-0000-000000000000")], "nil uuid");
    }

    #[test]
    fn identity_errors_are_distinct() {
        let id = WorkloadId::new_random();
        assert_eq!(workload_id_from_certificate(&cert_with_sans(vec![])), Err(CertIdentityError::NoUriSan));
        assert_eq!(
            workload_id_from_certificate(&cert_with_sans(vec![uri(&id.to_uri()), uri(&id.to_uri())])),
            Err(CertIdentityError::MultipleUriSans { count: 2 })
        );
        assert!(matches!(
            workload_id_from_certificate(&cert_with_sans(vec![uri("https://x")])),
            Err(CertIdentityError::BadUri(IdentityError::Prefix { .. }))
        ));
        assert!(matches!(workload_id_from_certificate(b"junk"), Err(CertIdentityError::Unparseable { .. })));
        let mut trailing = cert_with_sans(vec![uri(&id.to_uri())]);
        trailing.push(0);
        assert!(matches!(
            workload_id_from_certificate(&trailing),
            Err(CertIdentityError::Unparseable { .. })
        ));
    }

    #[test]
    fn serials_are_positive_sixteen_bytes_and_differ() {
        let a = random_serial().unwrap().to_bytes();
        let b = random_serial().unwrap().to_bytes();
        assert_eq!(a.len(), 16);
        assert!(a[0] & 0x80 == 0 && a[0] != 0, "{a:?}");
        assert_ne!(a, b);
    }

    #[test]
    fn validity_backdates_and_truncates_to_seconds() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_750);
        let (nb, na) = validity(now, DEFAULT_WORKLOAD_LIFETIME).unwrap();
        assert_eq!(nb.unix_timestamp(), 1_700_000_000 - 300);
        assert_eq!(na.unix_timestamp(), 1_700_000_000 + 86_400);
        assert_eq!(na.nanosecond(), 0);
        assert!(matches!(validity(now, Duration::ZERO), Err(CaError::InvalidLifetime { .. })));
        assert!(validity(now, Duration::from_secs(u64::MAX / 4)).is_err());
    }

    #[test]
    fn csr_size_and_encoding_errors_are_clear() {
        let big = vec![b'a'; MAX_CSR_BYTES + 1];
        let e = csr_public_key(&big).unwrap_err();
        assert!(e.to_string().contains("at most 16384 are accepted"), "{e}");
        let e = csr_public_key(b"not pem").unwrap_err();
        assert!(matches!(e, CaError::CsrPem { .. }), "{e}");
        let key = KeyPair::generate().unwrap();
        let cert_pem = CertificateParams::default().self_signed(&key).unwrap().pem();
        let e = csr_public_key(cert_pem.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("found a \"CERTIFICATE\" block"), "{e}");
    }

    #[test]
    fn server_names_are_checked() {
        assert!(matches!(server_san("10.0.0.1"), Ok(SanType::IpAddress(_))));
        assert!(matches!(server_san("::1"), Ok(SanType::IpAddress(_))));
        assert!(matches!(server_san("cp.example.com"), Ok(SanType::DnsName(_))));
        assert!(server_san("").is_err());
        assert!(server_san("bad name").is_err());
        assert!(server_san("caf\u{e9}.example").is_err());
    }
}
