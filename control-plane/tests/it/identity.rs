//! Identity (IDN-1..IDN-3, IDN-5, IDN-8): a hostile CSR contributes only its public key, the
//! CA's files stay private, are never overwritten and rotate as `ca rotate`/`ca retire` say,
//! every token rejection is distinct and writes nothing in a real Postgres, the enrolling token
//! is recorded and shown, and renewal failures are shown.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use chrono::Utc;
use innerwall_control_plane::identity::ca::{
    self, CaError, DEFAULT_WORKLOAD_LIFETIME, FileCa, IssuedCertificate, Signer, workload_id_from_certificate,
};
use innerwall_control_plane::identity::tokens::{self, TokenError, TokenStatus};
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, PublicKeyData, SanType,
};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use sqlx::{Connection, PgConnection};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::oid_registry::{
    OID_X509_EXT_AUTHORITY_KEY_IDENTIFIER, OID_X509_EXT_BASIC_CONSTRAINTS, OID_X509_EXT_EXTENDED_KEY_USAGE,
    OID_X509_EXT_KEY_USAGE, OID_X509_EXT_SUBJECT_ALT_NAME, OID_X509_EXT_SUBJECT_KEY_IDENTIFIER,
};

/// An RSA-2048 CSR made once with `openssl req -new -newkey rsa:2048` (ring cannot generate RSA
/// keys); only its public key is here.
const RSA_CSR: &str = "-----BEGIN CERTIFICATE REQUEST-----
MIICWTCCAUECAQAwFDESMBAGA1UEAwwJcnNhLWFnZW50MIIBIjANBgkqhkiG9w0B
AQEFAAOCAQ8AMIIBCgKCAQEAwhKWWfECbbDktullsYtTxpceCnZj1dzAPESNdrYK
aEAGToWqSyQxH2VsBkozy2oH+mQr4nM67VTgTQSYo2ii02WNsgUIQghSfaAbrqrv
QpVYabAXfb/q1r2rGD3dvDRdoEEja8Wl7fZqE8qodX7CjHZQhWrdWpToF7WOUCDj
LVHj6q+GfxZ7nAcH9XoObI2rj9uKfUVyeqp9wxlDHpKOHzve0nv5A9vlvo1KryX4
bJUan6mvwS7mvQ8BkhRtcZBi9yIxofMQrIqZfNYGPicxA6GnnWA2CYQHlF3usBXY
Cla9pVXXf2X5pcA7psyaArgrQfvN2ioVIXIseJuZWS4b3wIDAQABoAAwDQYJKoZI
hvcNAQELBQADggEBAHm5vyQQJQk6toxoaYpfMznktifboDnRpeaxF6OLfMibk0Lo
tIhCH4ldOO0RKQQrm4rpD0WnevhSBpe2ZQ9ydrMtxgvVg2feIwHgAWtRH9IBVHTR
MZi3yUASPt33pILLs53+YMCMg3YLRhgZupPCouWqLa9uVqCs7sy98raRofE9NRZS
6zzbfNBT4uaj5zLyM0qdf9VNE9gfzkKUJOapKT6d/qBpIp/t8n5Fird8i+3ENveJ
knc0g1cftv5QZYYTyiSRfXTiWLyXwUiM+UTpN8d29wbyo5DGDcb4aNTN9vhneoTO
+DXIe+2C6oobNwmCpJhOnfSiwse5U61GawFyAvY=
-----END CERTIFICATE REQUEST-----
";

/// A fresh directory under the system temp dir, removed on drop (also on panic).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let path = std::env::temp_dir().join(format!("innerwall-ca-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pem_der(pem: &str) -> Vec<u8> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    block.contents
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b64.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).unwrap()).collect();
    format!("-----BEGIN {label}-----\n{}\n-----END {label}-----\n", lines.join("\n"))
}

fn parse_cert(der: &[u8]) -> X509Certificate<'_> {
    let (rest, cert) = x509_parser::parse_x509_certificate(der).unwrap();
    assert!(rest.is_empty());
    cert
}

fn plain_csr(key: &KeyPair) -> String {
    CertificateParams::default().serialize_request(key).unwrap().pem().unwrap()
}

fn new_ca() -> (TempDir, FileCa) {
    let dir = TempDir::new();
    let ca = FileCa::init(&dir.0.join("ca")).unwrap();
    (dir, ca)
}

/// A rustls client-certificate verifier trusting only `ca`, as the mTLS listener will use.
fn accepts_as_client(ca: &FileCa, cert_pem: &str, at: SystemTime) -> Result<(), rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(pem_der(&ca.ca_bundle_pem()))).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .unwrap();
    let leaf = CertificateDer::from(pem_der(cert_pem));
    verifier
        .verify_client_cert(
            &leaf,
            &[],
            UnixTime::since_unix_epoch(at.duration_since(SystemTime::UNIX_EPOCH).unwrap()),
        )
        .map(|_| ())
}

#[test]
fn hostile_csr_contributes_only_public_key() {
    let (_dir, ca) = new_ca();
    let ca_der = pem_der(&ca.ca_bundle_pem());
    let ca_cert = parse_cert(&ca_der);

    let assigned = WorkloadId::new_random();
    let victim = WorkloadId::new_random();
    let key = KeyPair::generate().unwrap();
    let mut hostile = CertificateParams::default();
    hostile.distinguished_name.push(DnType::CommonName, victim.uuid().to_string());
    hostile.distinguished_name.push(DnType::OrganizationName, "Innerwall");
    hostile.subject_alt_names = vec![
        SanType::URI(victim.to_uri().try_into().unwrap()),
        SanType::DnsName("control-plane.example".try_into().unwrap()),
        SanType::IpAddress("10.0.0.1".parse().unwrap()),
        SanType::Rfc822Name("root@example.com".try_into().unwrap()),
    ];
    hostile.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    hostile.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    hostile.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::Any];
    let mut odd = CustomExtension::from_oid_content(&[1, 3, 6, 1, 4, 1, 55555, 1, 2], vec![0x05, 0x00]);
    odd.set_criticality(true);
    hostile.custom_extensions = vec![odd];
    let csr_pem = hostile.serialize_request(&key).unwrap().pem().unwrap();

    // The CSR really asks for all of that (so the test could fail).
    let csr_der = pem_der(&csr_pem);
    let (_, csr) =
        <x509_parser::certification_request::X509CertificationRequest as x509_parser::prelude::FromDer<_>>::from_der(
            &csr_der,
        )
        .unwrap();
    assert!(csr.requested_extensions().unwrap().count() >= 5, "hostile csr lost its extensions");

    let now = SystemTime::now();
    let issued = ca.issue_workload(assigned, csr_pem.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now).unwrap();
    let der = pem_der(&issued.pem);
    let cert = parse_cert(&der);

    // Only the assigned URI, nothing the CSR named.
    let sans = &cert.subject_alternative_name().unwrap().expect("a SAN extension").value.general_names;
    let assigned_uri = assigned.to_uri();
    assert_eq!(sans.as_slice(), &[GeneralName::URI(assigned_uri.as_str())]);
    assert_eq!(workload_id_from_certificate(&der), Ok(assigned));

    // Not a CA, critically so.
    let bc = cert.basic_constraints().unwrap().expect("basic constraints");
    assert!(bc.critical && !bc.value.ca && bc.value.path_len_constraint.is_none());
    assert!(!cert.is_ca());

    // Client auth only; digital signature only.
    let eku = cert.extended_key_usage().unwrap().expect("eku").value;
    assert!(eku.client_auth && !eku.server_auth && !eku.any && eku.other.is_empty(), "{eku:?}");
    assert!(!eku.code_signing && !eku.email_protection && !eku.time_stamping && !eku.ocsp_signing);
    let ku = cert.key_usage().unwrap().expect("key usage").value;
    assert!(ku.digital_signature() && !ku.key_cert_sign() && !ku.crl_sign(), "{ku:?}");
    assert_eq!(ku.flags, 1, "digitalSignature alone");

    // The CSR's public key, byte for byte.
    assert_eq!(cert.public_key().raw, key.subject_public_key_info().as_slice());
    assert_eq!(cert.public_key().raw, csr.certification_request_info.subject_pki.raw);

    // Our subject, the CA as issuer, and none of the CSR's extensions.
    let cns: Vec<&str> = cert.subject().iter_common_name().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(cns, [assigned.uuid().hyphenated().to_string()]);
    assert_eq!(cert.subject().iter_attributes().count(), 1, "subject is CN only: {}", cert.subject());
    assert_eq!(cert.issuer(), ca_cert.subject());
    let mut oids: Vec<String> = cert.extensions().iter().map(|e| e.oid.to_id_string()).collect();
    oids.sort();
    let mut want: Vec<String> = [
        OID_X509_EXT_AUTHORITY_KEY_IDENTIFIER,
        OID_X509_EXT_SUBJECT_ALT_NAME,
        OID_X509_EXT_KEY_USAGE,
        OID_X509_EXT_EXTENDED_KEY_USAGE,
        OID_X509_EXT_SUBJECT_KEY_IDENTIFIER,
        OID_X509_EXT_BASIC_CONSTRAINTS,
    ]
    .iter()
    .map(|o| o.to_id_string())
    .collect();
    want.sort();
    assert_eq!(oids, want);

    // Authority key id names the CA; the signature verifies with the CA's key; rustls accepts it.
    let aki = cert
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::AuthorityKeyIdentifier(aki) => aki.key_identifier.as_ref().map(|k| k.0.to_vec()),
            _ => None,
        })
        .expect("authority key identifier");
    let ca_ski = ca_cert
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(k) => Some(k.0.to_vec()),
            _ => None,
        })
        .expect("ca subject key identifier");
    assert_eq!(aki, ca_ski);
    cert.verify_signature(Some(ca_cert.public_key())).expect("chains to the CA");
    accepts_as_client(&ca, &issued.pem, now).expect("rustls accepts it as a client certificate");

    // Validity: 5 minutes backdated, 24 h ahead, in whole seconds; serial as reported.
    let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert_eq!(cert.validity().not_before.timestamp(), secs(now) - 300);
    assert_eq!(cert.validity().not_after.timestamp(), secs(now) + 86_400);
    assert_eq!(secs(issued.not_before), secs(now) - 300);
    assert_eq!(secs(issued.not_after), secs(now) + 86_400);
    let serial_hex: String = cert.raw_serial().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(issued.serial_hex, serial_hex);
    assert!(cert.raw_serial().len() == 16 && cert.raw_serial()[0] & 0x80 == 0);
    assert!(
        accepts_as_client(&ca, &issued.pem, now + DEFAULT_WORKLOAD_LIFETIME + Duration::from_secs(1))
            .is_err(),
        "expired certificate must be refused"
    );

    // A CSR whose self-signature does not verify is refused.
    let mut broken = csr_der.clone();
    let last = broken.len() - 1;
    broken[last] ^= 0x01;
    let err = ca
        .issue_workload(
            assigned,
            pem_encode("CERTIFICATE REQUEST", &broken).as_bytes(),
            DEFAULT_WORKLOAD_LIFETIME,
            now,
        )
        .unwrap_err();
    assert!(matches!(err, CaError::CsrSignature { .. }), "{err}");
    assert!(err.to_string().contains("signature does not verify"), "{err}");

    // RSA is refused by name.
    let err = ca.issue_workload(assigned, RSA_CSR.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now).unwrap_err();
    assert!(matches!(err, CaError::UnsupportedKeyAlgorithm { .. }), "{err}");
    assert!(err.to_string().contains("algorithm RSA is not accepted"), "{err}");

    // Oversized input is refused before parsing.
    let padded = format!("{csr_pem}{}", " ".repeat(ca::MAX_CSR_BYTES));
    let err = ca.issue_workload(assigned, padded.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now).unwrap_err();
    assert!(matches!(err, CaError::CsrTooLarge { .. }), "{err}");
}

#[test]
fn accepted_key_algorithms_and_renewal_keep_identity_with_new_serials() {
    let (_dir, ca) = new_ca();
    let now = SystemTime::now();
    for alg in [&rcgen::PKCS_ECDSA_P256_SHA256, &rcgen::PKCS_ECDSA_P384_SHA384, &rcgen::PKCS_ED25519] {
        let id = WorkloadId::new_random();
        let key = KeyPair::generate_for(alg).unwrap();
        let csr = plain_csr(&key);
        let first = ca.issue_workload(id, csr.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now).unwrap();
        // Renewal: same identity, same key, later: a new serial and window, the same URI.
        let later = now + Duration::from_secs(16 * 3600);
        let renewed = ca.issue_workload(id, csr.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, later).unwrap();
        let again = ca.issue_workload(id, csr.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, later).unwrap();
        let serials = [&first.serial_hex, &renewed.serial_hex, &again.serial_hex];
        assert!(
            serials[0] != serials[1] && serials[1] != serials[2] && serials[0] != serials[2],
            "{serials:?}"
        );
        for IssuedCertificate { pem, .. } in [&first, &renewed, &again] {
            let der = pem_der(pem);
            assert_eq!(workload_id_from_certificate(&der), Ok(id));
            assert_eq!(parse_cert(&der).public_key().raw, key.subject_public_key_info().as_slice());
        }
        assert!(renewed.not_after > first.not_after);
        accepts_as_client(&ca, &renewed.pem, later).unwrap();
    }

    let err = ca
        .issue_workload(
            WorkloadId::new_random(),
            plain_csr(&KeyPair::generate().unwrap()).as_bytes(),
            Duration::ZERO,
            now,
        )
        .unwrap_err();
    assert!(matches!(err, CaError::InvalidLifetime { .. }), "{err}");
}

#[test]
fn server_certificate_serves_names_and_addresses() {
    let (_dir, ca) = new_ca();
    let now = SystemTime::now();
    let names = ["cp.example.com".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    let (cert_pem, key_pem) = ca.issue_server(&names, Duration::from_secs(90 * 86_400), now).unwrap();
    let der = pem_der(&cert_pem);
    let cert = parse_cert(&der);
    let sans = &cert.subject_alternative_name().unwrap().unwrap().value.general_names;
    assert_eq!(sans.len(), 3);
    assert!(sans.contains(&GeneralName::DNSName("cp.example.com")));
    assert!(sans.contains(&GeneralName::IPAddress(&[127, 0, 0, 1])));
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && !eku.client_auth);
    assert!(!cert.is_ca());
    assert_eq!(
        cert.public_key().raw,
        KeyPair::from_pem(&key_pem).unwrap().subject_public_key_info().as_slice()
    );
    assert!(workload_id_from_certificate(&der).is_err(), "a server certificate is no workload identity");

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(pem_der(&ca.ca_bundle_pem()))).unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .unwrap();
    let at = UnixTime::since_unix_epoch(now.duration_since(SystemTime::UNIX_EPOCH).unwrap());
    let leaf = CertificateDer::from(der.clone());
    for name in ["cp.example.com", "127.0.0.1", "::1"] {
        let server = ServerName::try_from(name).unwrap();
        rustls::client::danger::ServerCertVerifier::verify_server_cert(
            &*verifier,
            &leaf,
            &[],
            &server,
            &[],
            at,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let other = ServerName::try_from("evil.example.com").unwrap();
    assert!(
        rustls::client::danger::ServerCertVerifier::verify_server_cert(
            &*verifier,
            &leaf,
            &[],
            &other,
            &[],
            at
        )
        .is_err()
    );
    assert!(ca.issue_server(&[], Duration::from_secs(60), now).is_err());
    assert!(ca.issue_server(&["bad name".into()], Duration::from_secs(60), now).is_err());
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn ca_files_are_private_and_not_overwritten() {
    let tmp = TempDir::new();
    let dir = tmp.0.join("ca");
    let ca = FileCa::init(&dir).unwrap();
    let key_path = dir.join(ca::CA_KEY_FILE);
    let cert_path = dir.join(ca::CA_CERT_FILE);
    assert_eq!(mode(&key_path), 0o600);
    assert_eq!(mode(&dir), 0o700, "a directory init creates is private too");
    let key_before = std::fs::read(&key_path).unwrap();
    let cert_before = std::fs::read(&cert_path).unwrap();

    // The root: self-signed, CA:true critical, keyCertSign + cRLSign, ~10 years, our CN.
    let ca_der = pem_der(&ca.ca_bundle_pem());
    let root = parse_cert(&ca_der);
    let bc = root.basic_constraints().unwrap().unwrap();
    assert!(bc.critical && bc.value.ca);
    let ku = root.key_usage().unwrap().unwrap().value;
    assert!(ku.key_cert_sign() && ku.crl_sign() && !ku.digital_signature());
    root.verify_signature(None).unwrap();
    let cns: Vec<&str> = root.subject().iter_common_name().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(cns, [ca::CA_COMMON_NAME]);
    let years =
        (root.validity().not_after.timestamp() - root.validity().not_before.timestamp()) / (365 * 86_400);
    assert_eq!(years, 10);

    // A second init refuses and leaves both files alone.
    let err = FileCa::init(&dir).unwrap_err();
    assert!(matches!(err, CaError::AlreadyExists { .. }), "{err}");
    assert!(err.to_string().contains("refusing to overwrite"), "{err}");
    assert_eq!(std::fs::read(&key_path).unwrap(), key_before);
    assert_eq!(std::fs::read(&cert_path).unwrap(), cert_before);

    // Only a certificate left behind also blocks init, and no key is created next to it.
    let half = tmp.0.join("half");
    std::fs::create_dir(&half).unwrap();
    std::fs::write(half.join(ca::CA_CERT_FILE), &cert_before).unwrap();
    assert!(matches!(FileCa::init(&half), Err(CaError::AlreadyExists { .. })));
    assert!(!half.join(ca::CA_KEY_FILE).exists());

    // Load works with 0600 and gives the same CA.
    assert_eq!(FileCa::load(&dir).unwrap().ca_bundle_pem(), ca.ca_bundle_pem());

    // Load refuses a key readable by others, saying how to fix it.
    for loose in [0o644, 0o640, 0o604, 0o660] {
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(loose)).unwrap();
        let err = FileCa::load(&dir).unwrap_err();
        assert!(matches!(err, CaError::KeyPermissions { .. }), "{loose:o}: {err}");
        let msg = err.to_string();
        assert!(msg.contains(&format!("chmod 600 {}", key_path.display())), "{msg}");
        assert!(msg.contains(&format!("{loose:04o}")), "{msg}");
    }
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    FileCa::load(&dir).unwrap();

    // A key that is not the certificate's is refused.
    let stranger = tmp.0.join("stranger");
    FileCa::init(&stranger).unwrap();
    std::fs::copy(stranger.join(ca::CA_KEY_FILE), &key_path).unwrap();
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = FileCa::load(&dir).unwrap_err();
    assert!(matches!(err, CaError::KeyMismatch { .. }), "{err}");

    // A missing directory is a clear I/O error naming the file.
    let err = FileCa::load(&tmp.0.join("absent")).unwrap_err();
    assert!(err.to_string().contains("absent/ca.key"), "{err}");

    // A leaf signed by another CA is refused by the verifier that trusts this one.
    let other = FileCa::init(&tmp.0.join("other")).unwrap();
    let key = KeyPair::generate().unwrap();
    let now = SystemTime::now();
    let foreign = other
        .issue_workload(WorkloadId::new_random(), plain_csr(&key).as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now)
        .unwrap();
    assert!(accepts_as_client(&ca, &foreign.pem, now).is_err());
    assert!(accepts_as_client(&other, &foreign.pem, now).is_ok());
}

// ---- tokens -------------------------------------------------------------------------------

fn labels(pairs: &[&str]) -> Vec<Label> {
    pairs.iter().map(|l| l.parse().unwrap()).collect()
}

/// Everything a consume could write: every token's use count and the workload/label tables.
async fn snapshot(conn: &mut PgConnection) -> (Vec<(uuid::Uuid, i32)>, i64, i64) {
    let uses = sqlx::query_as("SELECT id, use_count FROM provisioning_tokens ORDER BY id")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    let workloads: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(&mut *conn).await.unwrap();
    let token_labels: i64 = sqlx::query_scalar("SELECT count(*) FROM provisioning_token_labels")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    (uses, workloads, token_labels)
}

/// Consumes inside a transaction that is then COMMITTED, so "nothing written" is consume's
/// doing and not a rollback's.
async fn consume_committed(
    conn: &mut PgConnection,
    text: &str,
    now: chrono::DateTime<Utc>,
) -> Result<tokens::ConsumedToken, TokenError> {
    let mut tx = conn.begin().await.unwrap();
    let result = tokens::consume(&mut tx, text, now).await;
    tx.commit().await.unwrap();
    result
}

#[tokio::test]
async fn token_rejections_are_distinct_in_store() -> anyhow::Result<()> {
    let db = fresh_database().await?;
    let mut conn = db.pool.acquire().await?;
    let now = Utc::now();
    let day = chrono::Duration::days(1);

    let minted_labels = labels(&["tier=web", "app=checkout", "k8s.io/env=prod"]);
    let limited = tokens::mint(&mut conn, &minted_labels, day, Some(2), &[]).await?;
    assert!(limited.secret.starts_with("iw_") && limited.secret.len() == 46);
    assert_eq!(limited.prefix_hint, limited.secret[3..9]);
    assert!(!format!("{limited:?}").contains(&limited.secret), "Debug must not show the secret");
    let short =
        tokens::mint(&mut conn, &labels(&["app=batch"]), chrono::Duration::hours(1), None, &[]).await?;
    let revoked = tokens::mint(&mut conn, &labels(&["app=old"]), day, None, &[]).await?;
    tokens::revoke(&mut conn, revoked.id).await?;

    // The secret is stored only as a hash.
    let stored: Vec<u8> = sqlx::query_scalar("SELECT token_hash FROM provisioning_tokens WHERE id = $1")
        .bind(limited.id)
        .fetch_one(&mut *conn)
        .await?;
    assert_eq!(stored, ring::digest::digest(&ring::digest::SHA256, limited.secret.as_bytes()).as_ref());
    let dump: String = sqlx::query_scalar("SELECT string_agg(t::text, ' ') FROM provisioning_tokens t")
        .fetch_one(&mut *conn)
        .await?;
    assert!(!dump.contains(&limited.secret[3..]), "secret found in the table");

    let before = snapshot(&mut conn).await;
    // Same prefix hint as a real token, different secret: a candidate row that must not match.
    let lookalike = format!("iw_{}{}", limited.prefix_hint, "A".repeat(37));
    let random_unknown = format!("iw_{}", "Q".repeat(42) + "A");
    let cases: [(&str, String, chrono::DateTime<Utc>); 7] = [
        ("malformed", "iw_short".into(), now),
        ("malformed", format!("{} trailing", limited.secret), now),
        ("unknown", lookalike, now),
        ("unknown", random_unknown, now),
        ("revoked", revoked.secret.clone(), now),
        // Revoked beats expired: the order of checks is part of the contract.
        ("revoked", revoked.secret.clone(), now + day * 2),
        ("expired", short.secret.clone(), now + chrono::Duration::hours(2)),
    ];
    let mut messages = Vec::new();
    for (kind, text, at) in &cases {
        let err = consume_committed(&mut conn, text, *at).await.unwrap_err();
        assert_eq!(err.kind(), *kind, "{text:?}: {err}");
        let msg = err.to_string();
        if text.trim().len() > 9 {
            assert!(!msg.contains(&text.trim()[9..]), "secret echoed: {msg}");
        }
        assert!(msg.starts_with(|c: char| c.is_ascii_lowercase()), "messages start lower-case: {msg}");
        messages.push(msg);
    }
    assert!(messages[4].contains(&format!("iw_{}", revoked.prefix_hint)), "the hint helps: {}", messages[4]);
    assert_eq!(snapshot(&mut conn).await, before, "rejections write nothing");

    // max_uses 2: two enrollments, then exhausted; labels come back as minted, sorted by key.
    let mut sorted = minted_labels.clone();
    sorted.sort();
    for n in 1..=2 {
        let got = consume_committed(&mut conn, &format!("  {}\n", limited.secret), now).await?;
        assert_eq!(got.id, limited.id);
        assert_eq!(got.labels, sorted, "use {n}");
    }
    let after_two = snapshot(&mut conn).await;
    let err = consume_committed(&mut conn, &limited.secret, now).await.unwrap_err();
    assert_eq!(err.kind(), "exhausted", "{err}");
    assert!(err.to_string().contains("2 of 2 uses"), "{err}");
    assert_eq!(snapshot(&mut conn).await, after_two, "an exhausted token is not counted again");
    let uses: i32 = sqlx::query_scalar("SELECT use_count FROM provisioning_tokens WHERE id = $1")
        .bind(limited.id)
        .fetch_one(&mut *conn)
        .await?;
    assert_eq!(uses, 2);

    // A token without a use limit keeps working until it expires.
    for _ in 0..3 {
        consume_committed(&mut conn, &short.secret, now).await?;
    }

    // Listing: hints, sorted labels, counts and derived status; never the secret.
    let list = tokens::list(&mut conn).await?;
    let view = |id| list.iter().find(|v| v.id == id).unwrap();
    assert_eq!(view(limited.id).status, TokenStatus::Exhausted);
    assert_eq!(view(limited.id).labels, ["app=checkout", "k8s.io/env=prod", "tier=web"]);
    assert_eq!((view(limited.id).max_uses, view(limited.id).use_count), (Some(2), 2));
    assert_eq!(view(limited.id).prefix_hint, limited.prefix_hint);
    assert_eq!(view(revoked.id).status, TokenStatus::Revoked);
    assert!(view(revoked.id).revoked_at.is_some());
    assert_eq!(
        (view(short.id).status, view(short.id).use_count, view(short.id).max_uses),
        (TokenStatus::Active, 3, None)
    );
    let json = serde_json::to_string(&list)?;
    assert!(json.contains("\"status\":\"exhausted\"") && !json.contains(&limited.secret[3..]));

    // Revoke: idempotent, keeps the first time; unknown id is NotFound.
    let first = view(revoked.id).revoked_at;
    tokens::revoke(&mut conn, revoked.id).await?;
    let list = tokens::list(&mut conn).await?;
    assert_eq!(list.iter().find(|v| v.id == revoked.id).unwrap().revoked_at, first);
    let missing = uuid::Uuid::new_v4();
    let err = tokens::revoke(&mut conn, missing).await.unwrap_err();
    assert_eq!(err.kind(), "not_found");
    assert!(err.to_string().contains(&missing.to_string()));

    // Revocation takes effect at once for a token that was working.
    tokens::revoke(&mut conn, short.id).await?;
    assert_eq!(consume_committed(&mut conn, &short.secret, now).await.unwrap_err().kind(), "revoked");

    // Mint refuses what it cannot honour, writing nothing.
    let too_many_ranges: Vec<innerwall_wire::policy::Cidr> = (0
        ..=innerwall_control_plane::policy::spec::MAX_TOKEN_RANGES)
        .map(|n| innerwall_wire::policy::Cidr::parse(&format!("10.{n}.0.0/16")).unwrap())
        .collect();
    let before = snapshot(&mut conn).await;
    let app = labels(&["app=x"]);
    let refusals = [
        (tokens::mint(&mut conn, &app, chrono::Duration::zero(), None, &[]).await, "ttl must be positive"),
        (tokens::mint(&mut conn, &app, chrono::Duration::days(366), None, &[]).await, "at most 365 days"),
        (tokens::mint(&mut conn, &app, day, Some(0), &[]).await, "max uses must be at least 1"),
        (
            tokens::mint(&mut conn, &labels(&["app=x", "app=y"]), day, None, &[]).await,
            "\"app\" is given more than once",
        ),
        (tokens::mint(&mut conn, &[], day, None, &[]).await, "at least one label"),
        (tokens::mint(&mut conn, &app, day, None, &too_many_ranges).await, "at most 64 address ranges"),
    ];
    for (result, want) in refusals {
        let err = result.unwrap_err();
        assert_eq!(err.kind(), "invalid");
        assert!(err.to_string().contains(want), "{err} lacks {want:?}");
    }
    assert_eq!(snapshot(&mut conn).await, before);
    tokens::mint(&mut conn, &app, chrono::Duration::days(365), Some(1), &[]).await?;
    Ok(())
}

#[tokio::test]
async fn token_use_limit_holds_under_concurrent_enrollment() -> anyhow::Result<()> {
    let db = fresh_database().await?;
    let mut conn = db.pool.acquire().await?;
    let once =
        tokens::mint(&mut conn, &labels(&["app=web"]), chrono::Duration::days(1), Some(1), &[]).await?;
    let now = Utc::now();

    // The first enrollment holds the row until it commits; the second waits, then sees it used up.
    let mut first = db.pool.begin().await?;
    tokens::consume(&mut first, &once.secret, now).await?;
    let pool = db.pool.clone();
    let secret = once.secret.clone();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.unwrap();
        pid_tx.send(pid).unwrap();
        let result = tokens::consume(&mut tx, &secret, now).await.map(|_| ());
        tx.commit().await.unwrap();
        result
    });
    // The wait is proven by Postgres itself: the second's backend holds a lock request that is
    // not granted (the first's row lock), not by the second being slow.
    let pid = pid_rx.await?;
    let waiting = async {
        loop {
            let waits: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)")
                    .bind(pid)
                    .fetch_one(&mut *conn)
                    .await?;
            if waits {
                return anyhow::Ok(());
            }
            assert!(!second.is_finished(), "the second consume finished without waiting for the row lock");
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .map_err(|_| anyhow::anyhow!("the second consume never waited on a lock in pg_locks"))??;
    assert!(!second.is_finished(), "the second consume must wait for the row lock");
    first.commit().await?;
    let err = second.await?.unwrap_err();
    assert_eq!(err.kind(), "exhausted", "{err}");
    Ok(())
}

/// Enrollment records which provisioning token enrolled the workload (IDN-2), and `workload
/// show` (the store's view, which the CLI and the API print) shows it; each workload names its
/// own token.
#[tokio::test]
async fn enrolled_by_token() -> anyhow::Result<()> {
    use innerwall_control_plane::policy::store;
    let plane = crate::enrollment::Plane::start(Default::default()).await;
    let mut conn = plane.db.pool.acquire().await?;
    let day = chrono::Duration::days(1);
    let first = tokens::mint(&mut conn, &labels(&["app=web"]), day, None, &[]).await?;
    let second = tokens::mint(&mut conn, &labels(&["app=db"]), day, None, &[]).await?;
    let (a, _, _) = plane.enroll(&first.secret).await.map_err(|s| anyhow::anyhow!("{s}"))?;
    let (b, _, _) = plane.enroll(&second.secret).await.map_err(|s| anyhow::anyhow!("{s}"))?;
    for (id, token) in [(a, first.id), (b, second.id)] {
        let stored: Option<uuid::Uuid> =
            sqlx::query_scalar("SELECT enrolled_by_token FROM workloads WHERE id = $1")
                .bind(id.uuid())
                .fetch_one(&mut *conn)
                .await?;
        assert_eq!(stored, Some(token), "written at enrollment");
        let view = store::workload_view(&mut conn, id).await?;
        let facts = view.facts.clone().expect("a single workload's view carries its facts");
        assert_eq!(facts.enrolled_by_token, Some(token), "shown");
        let json = serde_json::to_value(&view)?;
        assert_eq!(json["facts"]["enrolled_by_token"], serde_json::json!(token.to_string()), "{json}");
        assert!(facts.credential_issuer.is_some() && !facts.credential_serial.is_empty());
    }
    Ok(())
}

/// The CA directory through a rotation (IDN-8): rotate adds a root that issues workload
/// certificates while servers keep the old one; a second rotation and a retirement without one
/// are refused; a directory caught half-retired fails to load naming the fix, and a running
/// CA keeps what it had; completing the retirement leaves the new root alone, and its key.
#[test]
fn ca_rotation_files_are_checked() {
    let (tmp, ca) = new_ca();
    let dir = tmp.0.join("ca");
    let old_root_der = pem_der(&ca.ca_bundle_pem());
    let old_sha = ca.current_sha256();
    let id = WorkloadId::new_random();
    let csr = plain_csr(&KeyPair::generate().unwrap());
    let now = SystemTime::now();
    let signed_by = |pem: &str, root_der: &[u8]| {
        parse_cert(&pem_der(pem)).verify_signature(Some(parse_cert(root_der).public_key())).is_ok()
    };

    let err = FileCa::retire(&dir).unwrap_err();
    assert!(matches!(err, CaError::NoRotation { .. }), "{err}");
    assert!(!ca.reload().unwrap(), "nothing changed");

    let change = FileCa::rotate(&dir).unwrap();
    assert_eq!(change.old_sha256, old_sha);
    assert_eq!(mode(&dir.join(ca::NEXT_KEY_FILE)), 0o600);
    let next_der = pem_der(&std::fs::read_to_string(dir.join(ca::NEXT_CERT_FILE)).unwrap());
    let err = FileCa::rotate(&dir).unwrap_err();
    assert!(matches!(err, CaError::RotationInProgress { .. }), "{err}");
    assert!(err.to_string().contains("retire the old CA first"), "{err}");

    // The loaded CA notices once; the bundle holds both roots; workloads get the new root,
    // servers the old (every agent trusts it).
    assert!(ca.reload().unwrap());
    assert!(!ca.reload().unwrap());
    assert_eq!(ca.next_sha256().as_deref(), Some(change.new_sha256.as_str()));
    assert_eq!(ca.ca_bundle_pem().matches("BEGIN CERTIFICATE").count(), 2);
    let issued = ca.issue_workload(id, csr.as_bytes(), DEFAULT_WORKLOAD_LIFETIME, now).unwrap();
    assert_eq!(issued.issuer_sha256, change.new_sha256);
    assert!(signed_by(&issued.pem, &next_der) && !signed_by(&issued.pem, &old_root_der));
    let (server, _) = ca.issue_server(&["localhost".into()], DEFAULT_WORKLOAD_LIFETIME, now).unwrap();
    assert!(signed_by(&server, &old_root_der));

    // Interrupted between retire's two renames: the key moved, the certificate not yet.
    let new_key = std::fs::read(dir.join(ca::NEXT_KEY_FILE)).unwrap();
    std::fs::rename(dir.join(ca::NEXT_KEY_FILE), dir.join(ca::CA_KEY_FILE)).unwrap();
    let err = FileCa::load(&dir).unwrap_err();
    assert!(err.to_string().contains("run `innerwall ca retire` again"), "{err}");
    assert!(ca.reload().is_err());
    assert_eq!(ca.next_sha256().as_deref(), Some(change.new_sha256.as_str()), "a failed reload keeps the CA");

    // Running retire again completes it: the new root alone, with its key; servers get it too.
    let done = FileCa::retire(&dir).unwrap();
    assert_eq!(
        (done.old_sha256.as_str(), done.new_sha256.as_str()),
        (old_sha.as_str(), change.new_sha256.as_str())
    );
    assert!(!dir.join(ca::NEXT_KEY_FILE).exists() && !dir.join(ca::NEXT_CERT_FILE).exists());
    assert_eq!(std::fs::read(dir.join(ca::CA_KEY_FILE)).unwrap(), new_key, "the old key is gone");
    assert_eq!(mode(&dir.join(ca::CA_KEY_FILE)), 0o600);
    assert!(ca.reload().unwrap());
    assert_eq!((ca.current_sha256(), ca.next_sha256()), (change.new_sha256.clone(), None));
    assert_eq!(ca.ca_bundle_pem().matches("BEGIN CERTIFICATE").count(), 1);
    let (server, _) = ca.issue_server(&["localhost".into()], DEFAULT_WORKLOAD_LIFETIME, now).unwrap();
    assert!(signed_by(&server, &next_der) && !signed_by(&server, &old_root_der));
}

/// A renewal failure the agent reports in its heartbeats (one that may never have reached the
/// control plane) is recorded and shown in `workload status` with its reason and time; the same
/// reason again is not rewritten at every heartbeat; a successful renewal clears it from status
/// while `workload show` keeps the last failure.
#[tokio::test]
async fn reported_renewal_failures_are_shown() -> anyhow::Result<()> {
    use innerwall_control_plane::policy::store;
    use innerwall_wire::proto::{self, sync_request};
    let plane = crate::enrollment::Plane::start(Default::default()).await;
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.map_err(|s| anyhow::anyhow!("{s}"))?;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let send = async |msg: sync_request::Msg| tx.send(proto::SyncRequest { msg: Some(msg) }).await.unwrap();
    send(sync_request::Msg::Hello(proto::Hello::default())).await;
    let mut client = proto::agent_service_client::AgentServiceClient::new(plane.mutual(&cert, &key).await?);
    let mut inbound = client.sync(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    for _ in 0..2 {
        inbound.message().await?.expect("HelloAck, then the snapshot");
    }
    let heartbeat = |error: &str, marker: Option<&str>| {
        sync_request::Msg::Heartbeat(proto::Heartbeat {
            credential_renewal_error: error.into(),
            tamper_events: marker
                .map(|m| proto::TamperEvent { detail: m.into(), count: 1, ..Default::default() })
                .into_iter()
                .collect(),
            ..Default::default()
        })
    };
    let status =
        async || store::sync_status_of(&mut plane.db.pool.acquire().await.unwrap(), id).await.unwrap();
    let marked = async |marker: &str| -> bool {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM audit_log WHERE action = 'workload.tamper'
                 AND $1 IN (detail->>'detail', detail->'latest'->>'detail'))",
        )
        .bind(marker)
        .fetch_one(&plane.db.pool)
        .await
        .unwrap()
    };

    // The heartbeat's handler records the failure before the tamper record: once the marker is
    // audited, the failure is written (or, for a repeat, was not rewritten).
    send(heartbeat("dial failed: connection refused", Some("m1"))).await;
    crate::eventually("the first heartbeat was handled", async || marked("m1").await).await;
    let first = status().await.renewal_failure.expect("the reported failure shows in status");
    assert_eq!(first.reason, "reported by the agent: dial failed: connection refused");
    send(heartbeat("dial failed: connection refused", Some("m2"))).await;
    crate::eventually("the repeat was handled", async || marked("m2").await).await;
    assert_eq!(status().await.renewal_failure, Some(first.clone()), "a repeat is not rewritten");
    send(heartbeat("writing credential.pem: no space left on device", Some("m3"))).await;
    crate::eventually("the new reason was handled", async || marked("m3").await).await;
    let second = status().await.renewal_failure.unwrap();
    assert!(second.reason.ends_with("no space left on device") && second.at >= first.at, "{second:?}");

    // A renewal that succeeds: status no longer shows a failure; show keeps the last one.
    let (_, csr) = crate::enrollment::key_and_csr();
    proto::agent_service_client::AgentServiceClient::new(plane.mutual(&cert, &key).await?)
        .renew_credential(proto::RenewCredentialRequest { csr_pem: csr })
        .await?;
    assert_eq!(status().await.renewal_failure, None, "renewed since");
    let facts = store::workload_view(&mut *plane.db.pool.acquire().await?, id).await?.facts.unwrap();
    assert_eq!(facts.last_renewal_error.as_deref(), Some(second.reason.as_str()));
    assert!(facts.last_renewed_at > facts.last_renewal_failed_at);
    Ok(())
}
