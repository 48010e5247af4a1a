//! `innerwall-agent enroll` (IDN-2): a key generated here, the provisioning token presented over
//! server-authenticated TLS (the CA bundle delivered with the token is the only trust anchor),
//! and the issued credential stored in the state directory.

use std::path::{Path, PathBuf};

use innerwall_wire::proto;

use crate::connect::{self, ConnectError};
use crate::facts::{self, FactsError};
use crate::identity::{self, Credential, CredentialError};

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("{dir} already holds an identity (workload {id}); pass --force to replace it")]
    AlreadyEnrolled { dir: String, id: String },
    #[error("reading the CA bundle {path}")]
    CaBundle {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the token file {path}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {path} is {len} bytes; a token is 46 characters")]
    TokenFileTooLarge { path: PathBuf, len: u64 },
    #[error("listing this host's interfaces (enrollment reports its addresses)")]
    Facts(#[from] FactsError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("enrollment refused: {}", .0.message())]
    Refused(tonic::Status),
    #[error(transparent)]
    Credential(#[from] CredentialError),
}

/// Reads the CA bundle an operator handed this host with its token.
pub fn read_ca_bundle(path: &Path) -> Result<String, EnrollError> {
    std::fs::read_to_string(path).map_err(|source| EnrollError::CaBundle { path: path.to_owned(), source })
}

/// Reads a provisioning token from a file (surrounding whitespace ignored; at most 1 KiB).
pub fn read_token_file(path: &Path) -> Result<String, EnrollError> {
    use std::io::Read as _;
    let failed = |source| EnrollError::TokenFile { path: path.to_owned(), source };
    let mut text = String::new();
    std::fs::File::open(path).map_err(failed)?.take(1025).read_to_string(&mut text).map_err(failed)?;
    if text.len() > 1024 {
        return Err(EnrollError::TokenFileTooLarge { path: path.to_owned(), len: text.len() as u64 });
    }
    Ok(text.trim().to_owned())
}

/// Generates a key locally, enrolls with the token over server-authenticated TLS, and stores
/// key, certificate and CA bundle in `state_dir`.
pub async fn enroll(
    server: &str,
    token: &str,
    ca_pem: &str,
    state_dir: &Path,
    force: bool,
) -> Result<Credential, EnrollError> {
    if !force && Credential::exists(state_dir) {
        let id = Credential::load(state_dir).map(|c| c.id.to_string()).unwrap_or_else(|_| "unknown".into());
        return Err(EnrollError::AlreadyEnrolled { dir: state_dir.display().to_string(), id });
    }
    let channel = connect::connect_for_enrollment(server, ca_pem).await?;
    let (key_pem, csr_pem) = identity::new_key_and_csr()?;
    let request = proto::EnrollRequest {
        provisioning_token: token.trim().to_owned(),
        csr_pem,
        facts: Some(facts::host_facts()?),
        agent: Some(facts::agent_info()),
    };
    let response = proto::enrollment_service_client::EnrollmentServiceClient::new(channel)
        .enroll(request)
        .await
        .map_err(EnrollError::Refused)?
        .into_inner();
    let cert_pem = String::from_utf8(response.certificate_pem)
        .map_err(|_| CredentialError::Certificate("the issued certificate is not PEM text".into()))?;
    let credential = Credential::new(key_pem, cert_pem, ca_pem.to_owned())?;
    credential.save(state_dir)?;
    Ok(credential)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_are_trimmed_and_bounded() {
        let path = std::env::temp_dir().join(format!("iw-token-{}", std::process::id()));
        std::fs::write(&path, "  iw_abc\n").unwrap();
        assert_eq!(read_token_file(&path).unwrap(), "iw_abc");
        std::fs::write(&path, "x".repeat(2048)).unwrap();
        assert!(read_token_file(&path).unwrap_err().to_string().contains("a token is 46 characters"));
        std::fs::remove_file(&path).unwrap();
        assert!(read_token_file(&path).unwrap_err().to_string().starts_with("reading the token file"));
    }
}
