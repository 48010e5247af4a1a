//! `innerwall-agent enroll` (IDN-2): a key generated here, the provisioning token presented over
//! server-authenticated TLS (the CA bundle delivered with the token is the only trust anchor),
//! and the issued credential stored in the state directory.
//!
//! Re-enrolling (`--force`) replaces the identity in the state directory: the old credential,
//! if still usable, is presented as the TLS client certificate, which proves this host held
//! it, and the control plane retires that workload in the enrollment's transaction (issue 16).
//! `--keep-replaced` leaves it live; an old credential that cannot prove anything (unreadable,
//! expired, from another CA) leaves it live too, and the operator is told to retire it.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use innerwall_wire::secret::{self, SecretError};

use super::connect::{self, ConnectError};
use super::credential::{self, Credential, CredentialError};
use super::facts::{self, FactsError};

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
    #[error("reading {}", token_source(path))]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} holds more than {MAX_TOKEN_FILE} bytes; a token is 46 characters", token_source(path))]
    TokenFileTooLarge { path: PathBuf },
    #[error(
        "{} is empty; it should hold the provisioning token (iw_…) `innerwall token mint` printed",
        token_source(path)
    )]
    TokenFileEmpty { path: PathBuf },
    #[error(
        "the token given is an operator token (iwo_…), which calls the control plane's API; enroll \
         takes a provisioning token (iw_…), minted with `innerwall token mint`"
    )]
    OperatorToken,
    #[error("listing this host's interfaces (enrollment reports its addresses)")]
    Facts(#[from] FactsError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("enrollment refused: {}", .0.message())]
    Refused(tonic::Status),
    #[error(
        "enrollment presenting this host's previous credential (workload {old}) as proof failed: {}; \
         if the control plane refuses that credential (deny-listed, issued by another CA), enroll \
         with --keep-replaced and retire the old workload with `innerwall workload retire {old}`",
        .status.message()
    )]
    ReplacingRefused { old: WorkloadId, status: tonic::Status },
    #[error(transparent)]
    Credential(#[from] CredentialError),
}

/// Reads the CA bundle an operator handed this host with its token.
pub fn read_ca_bundle(path: &Path) -> Result<String, EnrollError> {
    std::fs::read_to_string(path).map_err(|source| EnrollError::CaBundle { path: path.to_owned(), source })
}

/// The most bytes a token file may hold (a token is 46 characters).
pub const MAX_TOKEN_FILE: u64 = secret::MAX_SECRET_FILE;

/// `--token-file PATH` as messages name it: `-` is standard input.
fn token_source(path: &Path) -> String {
    if path == Path::new("-") {
        "the token from standard input (--token-file -)".to_owned()
    } else {
        format!("the token file {}", path.display())
    }
}

/// Reads a provisioning token from a file, or from standard input when `path` is `-`
/// (surrounding whitespace ignored; at most [`MAX_TOKEN_FILE`] bytes; never empty).
pub fn read_token_file(path: &Path) -> Result<String, EnrollError> {
    let path_buf = path.to_owned();
    secret::read(path).map_err(|e| match e {
        SecretError::Read(source) => EnrollError::TokenFile { path: path_buf, source },
        SecretError::TooLarge => EnrollError::TokenFileTooLarge { path: path_buf },
        SecretError::Empty => EnrollError::TokenFileEmpty { path: path_buf },
    })
}

/// Refuses a token that is plainly not a provisioning token: an operator token (`iwo_`), the
/// one mistake its look invites. Everything else is the control plane's to judge.
pub fn check_token_kind(token: &str) -> Result<(), EnrollError> {
    if token.starts_with("iwo_") {
        return Err(EnrollError::OperatorToken);
    }
    Ok(())
}

/// What to do about an identity the state directory already holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnrollOptions {
    /// Replace it (`--force`); without this, enrolling a host that holds one is refused.
    pub force: bool,
    /// Leave the replaced workload live (`--keep-replaced`) instead of having it retired.
    pub keep_replaced: bool,
}

/// What became of the identity an enrollment replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replaced {
    /// The state directory held none.
    Nothing,
    /// The control plane retired it in the enrollment's transaction (or it was retired already).
    Retired(WorkloadId),
    /// Left live, as asked (`--keep-replaced`); `None` when the old credential was unreadable.
    Kept(Option<WorkloadId>),
    /// Left live because this host could not prove it held it (`why`).
    Unproven { id: Option<WorkloadId>, why: String },
}

impl Replaced {
    /// What the operator should hear about a replaced workload left live.
    pub fn warning(&self) -> Option<String> {
        let retire = |id: &Option<WorkloadId>| match id {
            Some(id) => format!("`innerwall workload retire {id}`"),
            None => "`innerwall workload retire <id>` (find it with `innerwall workload list`)".to_owned(),
        };
        let named = |id: &Option<WorkloadId>| id.map(|id| format!(" (workload {id})")).unwrap_or_default();
        match self {
            Replaced::Nothing | Replaced::Retired(_) => None,
            Replaced::Kept(id) => Some(format!(
                "this host's previous identity{} stays live, as --keep-replaced asked; retire it with {} \
                 once nothing needs it",
                named(id),
                retire(id)
            )),
            Replaced::Unproven { id, why } => Some(format!(
                "this host's previous identity{} was not retired ({why}) and stays in every render; \
                 retire it with {}",
                named(id),
                retire(id)
            )),
        }
    }
}

/// What an enrollment stored and what became of the identity it replaced.
#[derive(Debug, Clone)]
pub struct Enrollment {
    pub credential: Credential,
    pub replaced: Replaced,
}

/// Why `old` cannot prove this host held it, if it cannot: the server would refuse it in the
/// handshake, which would fail the enrollment.
fn unusable(old: &Credential, ca_pem: &str, now: SystemTime) -> Option<String> {
    if old.check_not_expired(now).is_err() {
        return Some("its certificate has expired".to_owned());
    }
    if old.ca_pem.trim() != ca_pem.trim() {
        return Some("it was issued under another CA bundle than --ca-bundle".to_owned());
    }
    None
}

/// Generates a key locally, enrolls with the token over server-authenticated TLS, and stores
/// key, certificate and CA bundle in `state_dir`. With `options.force` an identity already
/// there is replaced (see the module docs for what becomes of it).
pub async fn enroll(
    server: &str,
    token: &str,
    ca_pem: &str,
    state_dir: &Path,
    options: EnrollOptions,
) -> Result<Enrollment, EnrollError> {
    let previous = Credential::exists(state_dir).then(|| Credential::load(state_dir));
    if !options.force
        && let Some(previous) = &previous
    {
        let id = previous.as_ref().map(|c| c.id.to_string()).unwrap_or_else(|_| "unknown".into());
        return Err(EnrollError::AlreadyEnrolled { dir: state_dir.display().to_string(), id });
    }
    let (proof, replaced) = match previous {
        None => (None, Replaced::Nothing),
        Some(Ok(old)) if options.keep_replaced => (None, Replaced::Kept(Some(old.id))),
        Some(Err(_)) if options.keep_replaced => (None, Replaced::Kept(None)),
        Some(Ok(old)) => match unusable(&old, ca_pem, SystemTime::now()) {
            None => (Some(old), Replaced::Nothing),
            Some(why) => (None, Replaced::Unproven { id: Some(old.id), why }),
        },
        Some(Err(e)) => {
            let why = format!("its credential is unusable: {}", crate::error::chain(&e));
            (None, Replaced::Unproven { id: None, why })
        }
    };
    let channel = connect::connect_for_enrollment(server, ca_pem, proof.as_ref()).await?;
    let (key_pem, csr_pem) = credential::new_key_and_csr()?;
    let request = proto::EnrollRequest {
        provisioning_token: token.trim().to_owned(),
        csr_pem,
        facts: Some((&facts::host_facts()?).into()),
        agent: Some((&facts::agent_info()).into()),
        replace: proof.is_some(),
    };
    let response = proto::enrollment_service_client::EnrollmentServiceClient::new(channel)
        .enroll(request)
        .await
        .map_err(|status| match &proof {
            Some(old) => EnrollError::ReplacingRefused { old: old.id, status },
            None => EnrollError::Refused(status),
        })?
        .into_inner();
    let replaced = match proof {
        Some(old) if response.replaced_workload_id == old.id.to_uri() => Replaced::Retired(old.id),
        Some(old) => Replaced::Unproven {
            id: Some(old.id),
            why: "the control plane did not confirm retiring it (a version without replacement?)".into(),
        },
        None => replaced,
    };
    let cert_pem = String::from_utf8(response.certificate_pem)
        .map_err(|_| CredentialError::Certificate("the issued certificate is not PEM text".into()))?;
    // The server proved itself with `ca_pem`; the bundle it sends may add the root of a CA
    // rotation in progress (the certificate may be of that root), which renewal would bring
    // anyway. Kept only if it issued this certificate; an older control plane sends `ca_pem`.
    let bundle = String::from_utf8(response.ca_bundle_pem).unwrap_or_default();
    let ca_pem = match credential::check_bundle(&cert_pem, &bundle) {
        Ok(()) => bundle,
        Err(_) => ca_pem.to_owned(),
    };
    let credential = Credential::new(key_pem, cert_pem, ca_pem)?;
    // Two fsyncs: off the runtime's workers, which the caller's other tasks share.
    let dir = state_dir.to_owned();
    let credential = tokio::task::spawn_blocking(move || credential.save(&dir).map(|()| credential))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))?;
    Ok(Enrollment { credential, replaced })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operator_tokens_are_refused_before_enrolling() {
        let operator = format!("iwo_{}", "A".repeat(51));
        assert!(check_token_kind(&operator).unwrap_err().to_string().contains("innerwall token mint"));
        check_token_kind("iw_abc").unwrap();
    }

    #[test]
    fn token_files_are_trimmed_and_bounded() {
        let path = std::env::temp_dir().join(format!("iw-token-{}", std::process::id()));
        std::fs::write(&path, "  iw_abc\n").unwrap();
        assert_eq!(read_token_file(&path).unwrap(), "iw_abc");
        std::fs::write(&path, "x".repeat(4096)).unwrap();
        assert_eq!(read_token_file(&path).unwrap().len(), 4096, "4 KiB is read");
        std::fs::write(&path, "x".repeat(4097)).unwrap();
        let error = read_token_file(&path).unwrap_err().to_string();
        assert!(
            error.contains("a token is 46 characters") && error.contains(path.to_str().unwrap()),
            "{error}"
        );
        std::fs::write(&path, " \n\t\n").unwrap();
        let error = read_token_file(&path).unwrap_err().to_string();
        assert!(error.contains("is empty") && error.contains(path.to_str().unwrap()), "{error}");
        std::fs::remove_file(&path).unwrap();
        let error = read_token_file(&path).unwrap_err().to_string();
        assert!(error.starts_with(&format!("reading the token file {}", path.display())), "{error}");
    }
}
