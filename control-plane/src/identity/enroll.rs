//! Enrollment and renewal (IDN-2, IDN-3, IDN-5): a provisioning token and a CSR become a new
//! workload with the token's labels and a certificate naming it; a live identity renews over
//! mutual TLS. Nothing the agent says about itself is trusted for authorization: its id comes
//! from us (enroll) or its certificate (renew), its labels from the token, and the workload a
//! re-enrollment replaces from the client certificate of the enrollment connection.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use sqlx::PgPool;

use crate::audit;
use crate::error::Error;
use crate::identity::ca::{IssuedCertificate, Signer};
use crate::policy::authoring;
use crate::policy::spec::NewWorkload;
use crate::policy::spec::routable_addresses;

/// Default lifetime of a workload certificate (IDN-3).
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// Bounds on what an enrollee may send; anything larger is refused before any work is done.
const MAX_TOKEN_LEN: usize = 256;
const MAX_CSR_LEN: usize = 16 * 1024;
const MAX_HOSTNAME_LEN: usize = 253;
const MAX_FACT_LEN: usize = 256;

#[derive(Debug, Clone)]
pub struct Enroller {
    pub pool: PgPool,
    pub signer: Arc<dyn Signer>,
    pub lifetime: Duration,
}

/// What a successful enrollment returns to the agent.
#[derive(Debug, Clone)]
pub struct Enrolled {
    pub id: WorkloadId,
    pub certificate: IssuedCertificate,
    pub labels: Vec<innerwall_wire::labels::Label>,
    /// The workload this enrollment replaced (retired now, or retired already).
    pub replaced: Option<WorkloadId>,
}

fn bounded<'a>(what: &str, text: &'a str, max: usize) -> Result<&'a str, Error> {
    if text.len() > max || text.chars().any(char::is_control) {
        return Err(Error::Invalid(format!("{what} must be at most {max} printable characters")));
    }
    Ok(text)
}

impl Enroller {
    /// Validates everything, then in one transaction consumes a token use, retires the workload
    /// it replaces (`replacing`: the identity the enrollment connection's client certificate
    /// proved, when the request asks to replace it; audited as replaced by the new one),
    /// registers the workload with the token's labels, renders (so version 1 exists from
    /// enrollment on, and the replaced workload has left every render), issues the certificate
    /// and audits. Any failure writes nothing.
    pub async fn enroll(
        &self,
        req: &proto::EnrollRequest,
        replacing: Option<WorkloadId>,
    ) -> Result<Enrolled, Error> {
        if req.provisioning_token.len() > MAX_TOKEN_LEN {
            return Err(Error::Invalid("provisioning token is too long".into()));
        }
        if req.csr_pem.len() > MAX_CSR_LEN {
            return Err(Error::Invalid(format!("csr is larger than {MAX_CSR_LEN} bytes")));
        }
        let facts = req.facts.clone().unwrap_or_default();
        let hostname = bounded("hostname", &facts.hostname, MAX_HOSTNAME_LEN)?.to_owned();
        let machine_id = bounded("machine id", &facts.machine_id, MAX_FACT_LEN)?.to_owned();
        let os = facts.os.as_ref().map(|os| format!("{} {} ({})", os.name, os.version, os.kernel_version));
        let os = bounded("os", os.as_deref().unwrap_or(""), MAX_FACT_LEN)?.to_owned();
        let agent_version =
            bounded("agent version", req.agent.as_ref().map_or("", |a| &a.version), MAX_FACT_LEN)?;
        let addresses = routable_addresses(&facts)?;
        let id = WorkloadId::new_random();
        let token_hint: String = req.provisioning_token.chars().take(9).collect();
        let now = SystemTime::now();
        let actor = format!("enroll:{token_hint}");
        let done = authoring::commit(&self.pool, &actor, "workload.enroll", &id.to_string(), async |c| {
            let token = crate::identity::tokens::consume(c, &req.provisioning_token, chrono::Utc::now()).await?;
            // Before the render: the replaced workload's addresses are the new one's, and a
            // live claim by both would render them for neither.
            if let Some(old) = replacing {
                retire_replaced(c, &actor, old, id).await?;
            }
            let certificate = self.signer.issue_workload(id, &req.csr_pem, self.lifetime, now)?;
            let new = NewWorkload { id, hostname: hostname.clone(), labels: token.labels.clone(), addresses: addresses.clone() };
            authoring::register_workload(c, &new).await?;
            sqlx::query(
                "UPDATE workloads SET enrolled_by_token = $2, credential_serial = $3, credential_expires_at = $4,
                 machine_id = $5, os = $6, agent_version = $7 WHERE id = $1",
            )
            .bind(id.uuid())
            .bind(token.id)
            .bind(&certificate.serial_hex)
            .bind(chrono::DateTime::<chrono::Utc>::from(certificate.not_after))
            .bind(&machine_id)
            .bind(&os)
            .bind(agent_version)
            .execute(&mut *c)
            .await?;
            // The token's narrowing is the workload's own from now on: revoking or deleting the
            // token never widens what the workload may claim.
            sqlx::query("INSERT INTO workload_ranges (workload_id, cidr) SELECT $1, cidr FROM provisioning_token_ranges WHERE token_id = $2")
                .bind(id.uuid())
                .bind(token.id)
                .execute(&mut *c)
                .await?;
            let labels: Vec<String> = token.labels.iter().map(ToString::to_string).collect();
            let replaces = replacing.map(|old| old.to_string());
            let detail = serde_json::json!({"token": token.id, "hostname": hostname, "labels": labels, "replaces": replaces});
            Ok((Enrolled { id, certificate, labels: token.labels, replaced: replacing }, detail))
        })
        .await?;
        match replacing {
            Some(old) => {
                tracing::info!(workload = %id, hostname = %hostname, replaced = %old, "enrolled, replacing a workload")
            }
            None => tracing::info!(workload = %id, hostname = %hostname, "enrolled"),
        }
        Ok(done.value)
    }

    /// Reissues the same identity with a new serial and validity window (IDN-5). Refused for
    /// retired and deny-listed workloads.
    pub async fn renew(&self, id: WorkloadId, csr_pem: &[u8]) -> Result<IssuedCertificate, Error> {
        if csr_pem.len() > MAX_CSR_LEN {
            return Err(Error::Invalid(format!("csr is larger than {MAX_CSR_LEN} bytes")));
        }
        let mut tx = self.pool.begin().await?;
        let row: Option<(bool, bool)> = sqlx::query_as(
            "SELECT retired_at IS NOT NULL, denied_at IS NOT NULL FROM workloads WHERE id = $1 FOR UPDATE",
        )
        .bind(id.uuid())
        .fetch_optional(&mut *tx)
        .await?;
        match row {
            None => return Err(Error::NotFound { what: "workload", name: id.to_string() }),
            Some((true, _)) => {
                return Err(Error::Refused(format!("workload {id} is retired; enroll the host again")));
            }
            Some((_, true)) => return Err(Error::Refused(format!("workload {id} is deny-listed"))),
            Some(_) => {}
        }
        let certificate = self.signer.issue_workload(id, csr_pem, self.lifetime, SystemTime::now())?;
        sqlx::query(
            "UPDATE workloads SET credential_serial = $2, credential_expires_at = $3, last_renewed_at = now() WHERE id = $1",
        )
        .bind(id.uuid())
        .bind(&certificate.serial_hex)
        .bind(chrono::DateTime::<chrono::Utc>::from(certificate.not_after))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(workload = %id, serial = %certificate.serial_hex, "renewed credential");
        Ok(certificate)
    }
}

/// Retires `old`, replaced by the enrollment of `new`, and audits it naming both. A workload
/// retired already stays retired (the host re-enrolls after an operator retired it).
async fn retire_replaced(
    conn: &mut sqlx::PgConnection,
    actor: &str,
    old: WorkloadId,
    new: WorkloadId,
) -> Result<(), Error> {
    let retired: Option<bool> =
        sqlx::query_scalar("SELECT retired_at IS NOT NULL FROM workloads WHERE id = $1 FOR UPDATE")
            .bind(old.uuid())
            .fetch_optional(&mut *conn)
            .await?;
    match retired {
        None => Err(Error::NotFound { what: "workload", name: old.to_string() }),
        Some(true) => Ok(()),
        Some(false) => {
            authoring::retire(conn, old).await?;
            let detail =
                serde_json::json!({"replaced_by": new.to_string(), "reason": "the host enrolled again"});
            audit::write(conn, &audit::Record::new(actor, "workload.retire", &old.to_string()).detail(detail))
                .await
        }
    }
}

/// The workload named by the verified client certificate of the connection `request` came on;
/// the listener accepted the connection only after checking the chain and the deny-list, and
/// the TLS handshake proved the client holds the certificate's key.
#[allow(clippy::result_large_err)]
fn presented_identity<T>(request: &tonic::Request<T>) -> Result<WorkloadId, tonic::Status> {
    let leaf = request.peer_certs().and_then(|certs| certs.first().cloned()).ok_or_else(|| {
        tonic::Status::invalid_argument(
            "replace needs the replaced identity's credential as the TLS client certificate of the \
             enrollment connection",
        )
    })?;
    crate::identity::ca::workload_id_from_certificate(leaf.as_ref())
        .map_err(|e| tonic::Status::unauthenticated(e.to_string()))
}

#[tonic::async_trait]
impl proto::enrollment_service_server::EnrollmentService for Enroller {
    async fn enroll(
        &self,
        request: tonic::Request<proto::EnrollRequest>,
    ) -> Result<tonic::Response<proto::EnrollResponse>, tonic::Status> {
        let replacing = if request.get_ref().replace { Some(presented_identity(&request)?) } else { None };
        let enrolled = self.enroll(request.get_ref(), replacing).await.map_err(tonic::Status::from)?;
        Ok(tonic::Response::new(proto::EnrollResponse {
            workload_id: enrolled.id.to_uri(),
            certificate_pem: enrolled.certificate.pem.into_bytes(),
            ca_bundle_pem: self.signer.ca_bundle_pem().into_bytes(),
            labels: enrolled
                .labels
                .iter()
                .map(|l| proto::Label { key: l.key.to_string(), value: l.value.to_string() })
                .collect(),
            replaced_workload_id: enrolled.replaced.map(|old| old.to_uri()).unwrap_or_default(),
        }))
    }
}
