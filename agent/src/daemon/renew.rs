//! Credential renewal (IDN-5): in the last third of each credential's life (jittered), a fresh
//! key and CSR over the agent's own mutually authenticated connection, the certificate replaced
//! atomically on disk, with the CA bundle the reply carries (a CA rotation reaches agents this
//! way). Failures are retried with backoff and reported in heartbeats; the policy
//! stream is never dropped for it, since the next connection picks the new credential up.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_wire::backoff;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;

use crate::enforce::PolicyStore;
use crate::error;
use crate::identity::connect::{ConnectError, RunConfig, connect};
use crate::identity::credential::{self, Credential, CredentialError};
use crate::sync::Agent;

/// Why one renewal failed.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Credential(#[from] CredentialError),
    #[error("renewal refused: {}", .0.message())]
    Refused(tonic::Status),
    #[error("the renewed certificate is not PEM text")]
    NotPem(#[source] std::string::FromUtf8Error),
    #[error("the renewed certificate names {renewed} instead of {held}")]
    OtherWorkload { renewed: WorkloadId, held: WorkloadId },
}

async fn renew_once(config: &RunConfig, credential: &Credential) -> Result<Credential, RenewError> {
    let channel = connect(config).await?;
    let (key_pem, csr_pem) = credential::new_key_and_csr()?;
    let response = proto::agent_service_client::AgentServiceClient::new(channel)
        .renew_credential(proto::RenewCredentialRequest { csr_pem })
        .await
        .map_err(RenewError::Refused)?
        .into_inner();
    let cert_pem = String::from_utf8(response.certificate_pem).map_err(RenewError::NotPem)?;
    // The bundle comes with the certificate (a CA rotation adds the new root, a retirement
    // removes the old one); an older control plane sends none and the stored one stands.
    let ca_pem = match String::from_utf8(response.ca_bundle_pem).map_err(RenewError::NotPem)? {
        bundle if bundle.trim().is_empty() => credential.ca_pem.clone(),
        bundle => {
            credential::check_bundle(&cert_pem, &bundle)?;
            bundle
        }
    };
    let renewed = Credential::new(key_pem, cert_pem, ca_pem)?;
    if renewed.id != credential.id {
        return Err(RenewError::OtherWorkload { renewed: renewed.id, held: credential.id });
    }
    renewed.save(&config.state_dir)?;
    Ok(renewed)
}

/// Renews in the last third of each credential's life (jittered); on failure retries with
/// backoff and reports the failure in heartbeats; an expired credential is reported as
/// needing re-enrollment.
pub async fn renew_forever<S: PolicyStore + Send + 'static>(config: RunConfig, agent: Arc<Agent<S>>) {
    loop {
        let credential = match Credential::load(&config.state_dir) {
            Ok(c) => c,
            Err(_) => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                continue;
            }
        };
        agent.metrics.certificate(credential.not_after);
        sleep_until_wall(credential.renew_at(backoff::random_unit())).await;
        let mut attempt = 0;
        loop {
            match renew_once(&config, &credential).await {
                Ok(renewed) => {
                    agent.metrics.certificate(renewed.not_after);
                    agent.reports.set_renewal_error(String::new());
                    agent.renewals.send_modify(|n| *n += 1);
                    tracing::info!(workload = %renewed.id, "renewed the credential; valid until {:?}", renewed.not_after);
                    break;
                }
                Err(e) => {
                    let expired = credential.check_not_expired(SystemTime::now()).is_err();
                    let message = if expired {
                        format!(
                            "credential expired; enroll this host again (innerwall-agent enroll --force): {}",
                            error::chain(&e)
                        )
                    } else {
                        error::chain(&e)
                    };
                    tracing::error!("credential renewal failed: {message}");
                    agent.reports.set_renewal_error(message);
                    let wait = backoff::wait(
                        attempt,
                        Duration::from_secs(1),
                        Duration::from_secs(300),
                        backoff::random_unit(),
                    );
                    attempt = attempt.saturating_add(1);
                    tokio::time::sleep(wait).await;
                    if Credential::load(&config.state_dir).is_ok_and(|c| c.not_after != credential.not_after)
                    {
                        break;
                    }
                }
            }
        }
    }
}

/// The longest nap before the wall clock is looked at again.
const NAP: Duration = Duration::from_secs(60);

/// Sleeps until the wall clock reaches `at`, in naps of at most a minute: a host that was
/// suspended (when the monotonic clock tokio sleeps on stands still) renews within a minute of
/// waking, not a whole suspension late.
async fn sleep_until_wall(at: SystemTime) {
    while let Some(nap) = next_nap(SystemTime::now(), at) {
        tokio::time::sleep(nap).await;
    }
}

/// How long to nap at `now` before looking at the clock again; `None` once `at` has come.
fn next_nap(now: SystemTime, at: SystemTime) -> Option<Duration> {
    at.duration_since(now).ok().filter(|d| !d.is_zero()).map(|d| d.min(NAP))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naps_are_short_so_a_suspended_host_renews_on_waking() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let at = t0 + Duration::from_secs(3 * 3600);
        assert_eq!(next_nap(t0, at), Some(NAP));
        assert_eq!(next_nap(at - Duration::from_secs(5), at), Some(Duration::from_secs(5)));
        // The host slept through the deadline: renew now.
        assert_eq!(next_nap(at + Duration::from_secs(7200), at), None);
        assert_eq!(next_nap(at, at), None);
    }
}
