//! Dialing the control plane: the run configuration ([`RunConfig`]: state directory, server,
//! backoff, timeouts) and the one way a channel is made — `HOST:PORT` becomes
//! `https://HOST:PORT` with `HOST` verified against the CA bundle, mutually authenticated with
//! the credential on disk ([`connect`]), or server-authenticated, for enrollment
//! ([`connect_for_enrollment`], presenting the replaced credential on a re-enrollment).

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use innerwall_wire::backoff;
use tonic::transport::{Channel, Endpoint};

use super::credential::{self, Credential, CredentialError};

/// Configuration of `run` and of everything it dials.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub state_dir: PathBuf,
    pub server: String,
    pub drift_interval: Duration,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub dial_timeout: Duration,
    /// Where `run` serves `/metrics` (plain HTTP, unauthenticated); nowhere if `None`.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The local address connections to the control plane leave from (`--source-address`);
    /// the kernel's choice if `None`.
    pub source_address: Option<std::net::IpAddr>,
    /// Capacity of the flow capture's connection table (`--conn-table-entries`); `None`
    /// derives it from the host's memory (`evidence::capture::default_conn_entries`).
    pub conn_entries: Option<u32>,
    /// The largest policy-stream message decoded; `wire::sync::MAX_POLICY_MESSAGE` unless
    /// lowered (a hidden flag, to test an update the agent cannot read).
    pub max_policy_message: usize,
    /// The HTTP/2 receive window of each stream, in bytes: how much the control plane may send
    /// ahead of what the agent reads. `None`: the HTTP/2 stack's default (2 MiB). Only the load
    /// generator sets it, so a stream it stops reading backs up within a few updates.
    pub stream_window: Option<u32>,
}

impl RunConfig {
    pub fn new(state_dir: PathBuf, server: String) -> RunConfig {
        RunConfig {
            state_dir,
            server,
            drift_interval: Duration::from_secs(2),
            backoff_base: backoff::BASE,
            backoff_cap: backoff::CAP,
            dial_timeout: Duration::from_secs(10),
            metrics_listen: None,
            source_address: None,
            conn_entries: None,
            max_policy_message: innerwall_wire::sync::MAX_POLICY_MESSAGE,
            stream_window: None,
        }
    }

    /// The full-jitter wait before dial `attempt` again (REL-1), never shorter than a rate
    /// refusal's `retry_after`: the one rule every connection of the agent backs off by.
    pub fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        backoff::after_refusal(
            attempt,
            self.backoff_base,
            self.backoff_cap,
            backoff::random_unit(),
            retry_after,
        )
    }
}

/// Why no channel to the control plane could be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("--server must be HOST:PORT, got {0:?}")]
    Server(String),
    #[error(transparent)]
    Credential(#[from] CredentialError),
    #[error("cannot reach the control plane at {server}")]
    Transport {
        server: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// `HOST:PORT` → (`https://HOST:PORT`, `HOST` for certificate verification).
pub fn endpoint(server: &str) -> Result<(String, String), ConnectError> {
    let bad = || ConnectError::Server(server.to_owned());
    let (host, port) = server.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok((format!("https://{server}"), host.to_owned()))
}

/// A mutually authenticated channel with the credential currently on disk, so a renewed
/// credential is used from the next connection on.
pub async fn connect(config: &RunConfig) -> Result<Channel, ConnectError> {
    let credential = Credential::load(&config.state_dir)?;
    credential.check_not_expired(SystemTime::now())?;
    let (url, host) = endpoint(&config.server)?;
    let transport = |source| ConnectError::Transport { server: config.server.clone(), source };
    Endpoint::from_shared(url)
        .map_err(transport)?
        .tls_config(credential.tls(&host))
        .map_err(transport)?
        .connect_timeout(config.dial_timeout)
        .local_address(config.source_address)
        .initial_stream_window_size(config.stream_window)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(transport)
}

/// A channel that authenticates the server against `ca_pem`: the enrollment connection. It
/// presents no certificate, or `previous` — the credential of the identity this enrollment
/// replaces, as proof that this host held it.
pub async fn connect_for_enrollment(
    server: &str,
    ca_pem: &str,
    previous: Option<&Credential>,
) -> Result<Channel, ConnectError> {
    let (url, host) = endpoint(server)?;
    let transport = |source| ConnectError::Transport { server: server.to_owned(), source };
    Endpoint::from_shared(url)
        .map_err(transport)?
        .tls_config(credential::enroll_tls(ca_pem, &host, previous))
        .map_err(transport)?
        .connect()
        .await
        .map_err(transport)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses_parse() {
        assert_eq!(
            endpoint("cp.example:7443").unwrap(),
            ("https://cp.example:7443".into(), "cp.example".into())
        );
        assert_eq!(endpoint("127.0.0.1:1").unwrap().1, "127.0.0.1");
        assert_eq!(endpoint("[::1]:7443").unwrap().1, "::1");
        for bad in ["cp.example", ":7443", "cp:x", "cp:70000"] {
            assert!(endpoint(bad).is_err(), "{bad}");
        }
    }
}
