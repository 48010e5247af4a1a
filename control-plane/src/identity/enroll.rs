//! Enrollment and renewal (IDN-2, IDN-3, IDN-5): a provisioning token and a CSR become a new
//! workload with the token's labels and a certificate naming it; a live identity renews over
//! mutual TLS. Nothing the agent says about itself is trusted for authorization: its id comes
//! from us (enroll) or its certificate (renew), its labels from the token, and the workload a
//! re-enrollment replaces from the client certificate of the enrollment connection.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot};

use crate::audit;
use crate::error::Error;
use crate::identity::ca::{CheckedCsr, IssuedCertificate, Signer};
use crate::identity::tokens::{self, LockedToken, TokenError};
use crate::policy::authoring;
use crate::policy::publish::{Overflow, Touched, publish_touched};
use crate::policy::spec::NewWorkload;
use crate::policy::spec::routable_addresses;

/// Default lifetime of a workload certificate (IDN-3).
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// Bounds on what an enrollee may send; anything larger is refused before any work is done.
const MAX_TOKEN_LEN: usize = 256;
const MAX_CSR_LEN: usize = 16 * 1024;
const MAX_HOSTNAME_LEN: usize = 253;
const MAX_FACT_LEN: usize = 256;

/// Enrollments waiting for the writer; beyond this an enrollment waits to be queued.
const QUEUE: usize = 1024;
/// Enrollments written in one transaction and rendered once, at most.
const MAX_BATCH: usize = 128;

/// Enrolls workloads. Enrollments that arrive while the previous ones are being written are
/// written together (each in a savepoint of its own) and rendered once: every enrollment
/// renders the estate, so one at a time a fleet's enrollment rate falls as the fleet grows.
#[derive(Debug, Clone)]
pub struct Enroller {
    pub pool: PgPool,
    pub signer: Arc<dyn Signer>,
    pub lifetime: Duration,
    queue: mpsc::Sender<Queued>,
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

/// An enrollment request that passed every check that needs no database, with the id the new
/// workload will have. Its `Debug` leaves out the token (a secret) and the CSR.
pub struct Checked {
    id: WorkloadId,
    token: String,
    csr: CheckedCsr,
    hostname: String,
    machine_id: String,
    os: String,
    agent_version: String,
    /// The host's ephemeral port range, when it reported a valid one.
    ephemeral: Option<(i32, i32)>,
    addresses: BTreeSet<std::net::IpAddr>,
    replacing: Option<WorkloadId>,
    actor: String,
}

impl std::fmt::Debug for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked")
            .field("id", &self.id)
            .field("hostname", &self.hostname)
            .field("addresses", &self.addresses)
            .field("replacing", &self.replacing)
            .field("actor", &self.actor)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Queued {
    checked: Checked,
    reply: oneshot::Sender<Result<Enrolled, Error>>,
}

fn bounded<'a>(what: &str, text: &'a str, max: usize) -> Result<&'a str, Error> {
    if text.len() > max || text.chars().any(char::is_control) {
        return Err(Error::Invalid(format!("{what} must be at most {max} printable characters")));
    }
    Ok(text)
}

impl Checked {
    /// Bounds every field an enrollee sends and checks its CSR (parsed, its signature verified)
    /// before any database work; `replacing` is the identity the enrollment connection's client
    /// certificate proved, when the request asks to replace it.
    pub fn new(req: &proto::EnrollRequest, replacing: Option<WorkloadId>) -> Result<Checked, Error> {
        if req.provisioning_token.len() > MAX_TOKEN_LEN {
            return Err(Error::Invalid("provisioning token is too long".into()));
        }
        let facts = req.facts.as_ref().map(innerwall_wire::identity::HostFacts::from).unwrap_or_default();
        let os = facts.os.as_ref().map(|os| format!("{} {} ({})", os.name, os.version, os.kernel_version));
        let token_hint: String = req.provisioning_token.chars().take(9).collect();
        Ok(Checked {
            id: WorkloadId::new_random(),
            token: req.provisioning_token.clone(),
            hostname: bounded("hostname", &facts.hostname, MAX_HOSTNAME_LEN)?.to_owned(),
            machine_id: bounded("machine id", &facts.machine_id, MAX_FACT_LEN)?.to_owned(),
            os: bounded("os", os.as_deref().unwrap_or(""), MAX_FACT_LEN)?.to_owned(),
            agent_version: bounded(
                "agent version",
                req.agent.as_ref().map_or("", |a| &a.version),
                MAX_FACT_LEN,
            )?
            .to_owned(),
            ephemeral: facts.ephemeral_ports.map(|p| (i32::from(p.start()), i32::from(p.end()))),
            addresses: routable_addresses(&facts)?,
            // Last: the only check that costs more than a bound (a signature to verify).
            csr: CheckedCsr::new(&req.csr_pem)?,
            replacing,
            actor: format!("enroll:{token_hint}"),
        })
    }
}

impl Enroller {
    /// An enroller and its writer task, which ends when the last clone is dropped.
    pub fn new(pool: PgPool, signer: Arc<dyn Signer>, lifetime: Duration) -> Enroller {
        let (queue, mut pending) = mpsc::channel::<Queued>(QUEUE);
        let enroller = Enroller { pool, signer, lifetime, queue };
        let writer = enroller.writer();
        tokio::spawn(async move {
            while let Some(batch) = crate::batch::next(&mut pending, MAX_BATCH, Duration::ZERO).await {
                let (checked, replies): (Vec<_>, Vec<_>) =
                    batch.into_iter().map(|q| (q.checked, q.reply)).unzip();
                for (result, reply) in writer.enroll_together(checked).await.into_iter().zip(replies) {
                    let _ = reply.send(result);
                }
            }
        });
        enroller
    }

    /// Validates everything, then (with whatever other enrollments are waiting) in one
    /// transaction: consumes a token use, retires the workload it replaces (`replacing`: the
    /// identity the enrollment connection's client certificate proved, when the request asks to
    /// replace it; audited as replaced by the new one), registers the workload with the token's
    /// labels, issues the certificate and audits, each enrollment in a savepoint of its own;
    /// then renders (so version 1 exists from enrollment on, and the replaced workload has left
    /// every render) and commits. A failed enrollment writes nothing.
    pub async fn enroll(
        &self,
        req: &proto::EnrollRequest,
        replacing: Option<WorkloadId>,
    ) -> Result<Enrolled, Error> {
        let checked = Checked::new(req, replacing)?;
        let (reply, done) = oneshot::channel();
        let gone =
            || Error::Busy("the enrollment writer has stopped (the replica is shutting down); retry".into());
        self.queue.send(Queued { checked, reply }).await.map_err(|_| gone())?;
        done.await.map_err(|_| gone())?
    }

    /// Writes `enrollments` in one transaction with one render, as [`Enroller::enroll`] does
    /// with the enrollments waiting together; the results are in the same order.
    pub async fn enroll_together(&self, enrollments: Vec<Checked>) -> Vec<Result<Enrolled, Error>> {
        self.writer().enroll_together(enrollments).await
    }

    fn writer(&self) -> Writer {
        Writer { pool: self.pool.clone(), signer: self.signer.clone(), lifetime: self.lifetime }
    }

    /// Reissues the same identity with a new serial and validity window (IDN-5), by the root
    /// that issues workload certificates now (after a rotation, the new one). Refused for
    /// retired and deny-listed workloads. A refusal is recorded on the workload with its reason
    /// and time (`workload status`, `workload show`).
    pub async fn renew(&self, id: WorkloadId, csr_pem: &[u8]) -> Result<IssuedCertificate, Error> {
        let result = self.try_renew(id, csr_pem).await;
        if let Err(e) = &result {
            record_renewal_failure(&self.pool, id, &e.to_string()).await;
        }
        result
    }

    async fn try_renew(&self, id: WorkloadId, csr_pem: &[u8]) -> Result<IssuedCertificate, Error> {
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
            "UPDATE workloads SET credential_serial = $2, credential_expires_at = $3, last_renewed_at = now(),
                credential_issuer = $4
             WHERE id = $1",
        )
        .bind(id.uuid())
        .bind(&certificate.serial_hex)
        .bind(chrono::DateTime::<chrono::Utc>::from(certificate.not_after))
        .bind(&certificate.issuer_sha256)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(workload = %id, serial = %certificate.serial_hex, "renewed credential");
        Ok(certificate)
    }
}

/// How often an agent's own report of a failing renewal (in its heartbeats) is written again
/// while its reason stays the same.
const REPORTED_FAILURE_REWRITE: Duration = Duration::from_secs(300);

/// Records a renewal failure the agent reports in a heartbeat (it may never have reached us:
/// a network fault, a full disk): written when the reason changes, else at most every
/// [`REPORTED_FAILURE_REWRITE`], so a heartbeat does not become a write.
pub async fn record_reported_renewal_failure(
    pool: &PgPool,
    id: WorkloadId,
    reason: &str,
) -> Result<(), Error> {
    let reason = crate::input::printable(&format!("reported by the agent: {reason}"), MAX_RENEWAL_ERROR);
    sqlx::query(
        "UPDATE workloads SET last_renewal_failed_at = now(), last_renewal_error = $2
         WHERE id = $1 AND (last_renewal_error IS DISTINCT FROM $2
                            OR last_renewal_failed_at < now() - make_interval(secs => $3))",
    )
    .bind(id.uuid())
    .bind(&reason)
    .bind(REPORTED_FAILURE_REWRITE.as_secs_f64())
    .execute(pool)
    .await?;
    Ok(())
}

/// The longest renewal failure reason stored.
const MAX_RENEWAL_ERROR: usize = 512;

/// Records that renewing `id` failed and why (the newest failure replaces the one before).
/// Best effort: the renewal's own error is what the agent hears.
pub async fn record_renewal_failure(pool: &PgPool, id: WorkloadId, reason: &str) {
    let reason = crate::input::printable(reason, MAX_RENEWAL_ERROR);
    let result = sqlx::query(
        "UPDATE workloads SET last_renewal_failed_at = now(), last_renewal_error = $2 WHERE id = $1",
    )
    .bind(id.uuid())
    .bind(&reason)
    .execute(pool)
    .await;
    match result {
        Ok(_) => tracing::warn!(workload = %id, "credential renewal refused: {reason}"),
        Err(e) => tracing::error!(workload = %id, "could not record a renewal failure ({reason}): {e}"),
    }
}

/// What the enrollment writer needs: the database and the CA.
struct Writer {
    pool: PgPool,
    signer: Arc<dyn Signer>,
    lifetime: Duration,
}

impl Writer {
    /// One transaction for the batch; if it fails as a whole (the render, the commit), each
    /// enrollment is written again alone, so one cannot fail another and each hears its own error.
    async fn enroll_together(&self, batch: Vec<Checked>) -> Vec<Result<Enrolled, Error>> {
        if batch.len() > 1 {
            match self.write(&batch).await {
                Ok(results) => return results,
                Err(e) => tracing::warn!(
                    enrollments = batch.len(),
                    "an enrollment batch failed as a whole ({e}); writing each alone"
                ),
            }
        }
        let mut results = Vec::with_capacity(batch.len());
        for one in batch {
            let result = self.write(std::slice::from_ref(&one)).await;
            results.push(result.and_then(|mut r| r.remove(0)));
        }
        results
    }

    /// Checks each enrollment on its own (its token, its CSR, the workload it replaces, in a
    /// savepoint: a failed one is rolled back alone and reported), then writes all that passed
    /// with a few statements whatever their number, one render for them, audited with every
    /// version it moved, and the commit.
    async fn write(&self, batch: &[Checked]) -> Result<Vec<Result<Enrolled, Error>>, Error> {
        let now = SystemTime::now();
        let mut tx = self.pool.begin().await?;
        // Each token presented is looked up once and its row locked, in one order (its text)
        // so that two replicas' batches never wait on each other's tokens.
        let presented: BTreeSet<&str> = batch.iter().map(|c| c.token.as_str()).collect();
        let mut tokens: BTreeMap<&str, Result<LockedToken, Error>> = BTreeMap::new();
        for text in presented {
            let locked = match tokens::lock(&mut tx, text, chrono::Utc::now()).await {
                Err(TokenError::Database(e)) => return Err(e.into()),
                other => other.map_err(Error::from),
            };
            tokens.insert(text, locked);
        }
        let mut results = Vec::with_capacity(batch.len());
        for checked in batch {
            let locked = tokens.get_mut(checked.token.as_str()).expect("every token presented was looked up");
            results.push(self.check_one(&mut tx, locked, checked, now).await?);
        }
        let passed: Vec<(&Checked, &Passed)> =
            batch.iter().zip(&results).filter_map(|(c, r)| Some((c, r.as_ref().ok()?))).collect();
        if passed.is_empty() {
            return Ok(results.into_iter().map(|r| r.map(|p| p.enrolled)).collect());
        }
        for locked in tokens.values().flatten() {
            locked.record_uses(&mut tx).await?;
        }
        let new: Vec<NewWorkload> = passed
            .iter()
            .map(|(c, p)| NewWorkload {
                id: c.id,
                hostname: c.hostname.clone(),
                labels: p.enrolled.labels.clone(),
                addresses: c.addresses.clone(),
            })
            .collect();
        authoring::register_workloads(&mut tx, &new).await?;
        record_enrollments(&mut tx, &passed).await?;
        let records: Vec<audit::Record> = passed
            .iter()
            .map(|(c, p)| {
                let labels: Vec<String> = p.enrolled.labels.iter().map(ToString::to_string).collect();
                let replaces = c.replacing.map(|old| old.to_string());
                let detail = serde_json::json!({"token": p.token, "hostname": c.hostname, "labels": labels, "replaces": replaces});
                audit::Record::new(&c.actor, "workload.enroll", &p.subject).detail(detail)
            })
            .collect();
        audit::write_all(&mut tx, &records).await?;
        let enrolled: Vec<&str> = passed.iter().map(|(_, p)| p.subject.as_str()).collect();
        // New workloads only: the render reads and renders what they can touch (POL-7). One that
        // replaces another also takes the old one out of every render: everything renders.
        let replaced = passed.iter().any(|(c, _)| c.replacing.is_some());
        let touched: Vec<Touched> = match replaced {
            true => Vec::new(),
            false => passed.iter().map(|(c, _)| Touched::Enrolled(c.id)).collect(),
        };
        let changed = publish_touched(&mut tx, Overflow::Hold, &touched).await?.changed;
        let record = audit::Record {
            detail: serde_json::json!({"enrollments": enrolled}),
            workload_versions: changed.iter().map(|c| (c.workload.to_string(), c.version)).collect(),
            ..audit::Record::new("enroll", "policy.render", "enrollments")
        };
        audit::write(&mut tx, &record).await?;
        tx.commit().await?;
        for (checked, _) in &passed {
            match checked.replacing {
                Some(old) => {
                    tracing::info!(workload = %checked.id, hostname = %checked.hostname, replaced = %old, "enrolled, replacing a workload")
                }
                None => tracing::info!(workload = %checked.id, hostname = %checked.hostname, "enrolled"),
            }
        }
        Ok(results.into_iter().map(|r| r.map(|p| p.enrolled)).collect())
    }

    /// What can refuse one enrollment alone, in order: its token (refused, or used up by the
    /// enrollments before it), its CSR, and the workload it replaces (retired here, in a
    /// savepoint). A use of the token is taken only when all passed. `Err` only for the database.
    async fn check_one(
        &self,
        tx: &mut PgConnection,
        token: &mut Result<LockedToken, Error>,
        e: &Checked,
        now: SystemTime,
    ) -> Result<Result<Passed, Error>, Error> {
        let token = match token {
            Ok(locked) => locked,
            Err(refused) => return Ok(Err(refused_again(refused))),
        };
        if let Err(used_up) = token.left() {
            return Ok(Err(used_up.into()));
        }
        let certificate = match self.signer.issue_checked(e.id, &e.csr, self.lifetime, now) {
            Ok(certificate) => certificate,
            Err(refused) => return Ok(Err(refused.into())),
        };
        // Before the render: the replaced workload's addresses are the new one's, and a live
        // claim by both would render them for neither.
        if let Some(old) = e.replacing {
            let mut savepoint = tx.begin().await?;
            match retire_replaced(&mut savepoint, &e.actor, old, e.id).await {
                Ok(()) => savepoint.commit().await?,
                Err(refused) => {
                    savepoint.rollback().await?;
                    return Ok(Err(refused));
                }
            }
        }
        token.take()?;
        let enrolled =
            Enrolled { id: e.id, certificate, labels: token.token.labels.clone(), replaced: e.replacing };
        Ok(Ok(Passed { enrolled, token: token.token.id, subject: e.id.to_string() }))
    }
}

/// An enrollment that passed its own checks, waiting to be written with the others.
struct Passed {
    enrolled: Enrolled,
    /// The token it took a use of.
    token: uuid::Uuid,
    /// Its workload id as the audit log names it.
    subject: String,
}

/// A token's refusal, for each enrollment that presented it.
fn refused_again(refused: &Error) -> Error {
    match refused {
        Error::Token { kind, error } => Error::Token { kind, error: error.to_string().into() },
        Error::Invalid(text) => Error::Invalid(text.clone()),
        other => Error::Refused(other.to_string()),
    }
}

/// What enrollment adds to each registered workload: the token that enrolled it, its
/// credential and its host's facts; and the token's narrowing, which is the workload's own from
/// now on (revoking or deleting the token never widens what the workload may claim).
async fn record_enrollments(conn: &mut PgConnection, passed: &[(&Checked, &Passed)]) -> Result<(), Error> {
    let column =
        |f: fn(&Checked, &Passed) -> String| -> Vec<String> { passed.iter().map(|(c, p)| f(c, p)).collect() };
    let ids: Vec<uuid::Uuid> = passed.iter().map(|(c, _)| c.id.uuid()).collect();
    let tokens: Vec<uuid::Uuid> = passed.iter().map(|(_, p)| p.token).collect();
    let expires: Vec<chrono::DateTime<chrono::Utc>> =
        passed.iter().map(|(_, p)| chrono::DateTime::from(p.enrolled.certificate.not_after)).collect();
    let (low, high): (Vec<Option<i32>>, Vec<Option<i32>>) =
        passed.iter().map(|(c, _)| (c.ephemeral.map(|r| r.0), c.ephemeral.map(|r| r.1))).unzip();
    sqlx::query(
        "UPDATE workloads w SET enrolled_by_token = t.token, credential_serial = t.serial,
             credential_expires_at = t.expires, machine_id = t.machine, os = t.os, agent_version = t.agent,
             credential_issuer = t.issuer, ephemeral_low = t.low, ephemeral_high = t.high
         FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::timestamptz[], $5::text[], $6::text[], $7::text[],
                     $8::text[], $9::int4[], $10::int4[])
              AS t (id, token, serial, expires, machine, os, agent, issuer, low, high)
         WHERE w.id = t.id",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(column(|_, p| p.enrolled.certificate.serial_hex.clone()))
    .bind(&expires)
    .bind(column(|c, _| c.machine_id.clone()))
    .bind(column(|c, _| c.os.clone()))
    .bind(column(|c, _| c.agent_version.clone()))
    .bind(column(|_, p| p.enrolled.certificate.issuer_sha256.clone()))
    .bind(&low)
    .bind(&high)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO workload_ranges (workload_id, cidr)
         SELECT t.w, r.cidr FROM unnest($1::uuid[], $2::uuid[]) AS t (w, token)
         JOIN provisioning_token_ranges r ON r.token_id = t.token",
    )
    .bind(&ids)
    .bind(&tokens)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Retires `old`, replaced by the enrollment of `new`, and audits it naming both. A workload
/// retired already stays retired (the host re-enrolls after an operator retired it).
async fn retire_replaced(
    conn: &mut PgConnection,
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
    let presented = request.extensions().get::<crate::identity::listener::Presented>().ok_or_else(|| {
        tonic::Status::invalid_argument(
            "replace needs the replaced identity's credential as the TLS client certificate of the \
             enrollment connection",
        )
    })?;
    Ok(presented.0.id)
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
