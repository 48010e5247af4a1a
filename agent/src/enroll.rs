//! Enrollment (IDN-2) and the host facts the agent reports (hostname, OS, machine id,
//! interface addresses). Facts are informational: the control plane authorizes nothing on them.

use std::path::Path;

use innerwall_wire::proto;
use tonic::transport::Endpoint;

use crate::identity::{self, Credential, CredentialError};

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("{dir} already holds an identity (workload {id}); pass --force to replace it")]
    AlreadyEnrolled { dir: String, id: String },
    #[error("--server must be HOST:PORT, got {0:?}")]
    Server(String),
    #[error("cannot reach the control plane at {server}: {source}")]
    Connect {
        server: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("enrollment refused: {}", .0.message())]
    Refused(tonic::Status),
    #[error(transparent)]
    Credential(#[from] CredentialError),
}

/// `HOST:PORT` → (`https://HOST:PORT`, `HOST` for certificate verification).
pub fn endpoint(server: &str) -> Result<(String, String), EnrollError> {
    let bad = || EnrollError::Server(server.to_owned());
    let (host, port) = server.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok((format!("https://{server}"), host.to_owned()))
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn os_info() -> proto::OsInfo {
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let field = |key: &str| {
        release
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .map(|v| v.trim_matches('"').to_owned())
            .unwrap_or_default()
    };
    proto::OsInfo {
        family: "linux".into(),
        name: field("NAME"),
        version: field("VERSION_ID"),
        kernel_version: read_trimmed("/proc/sys/kernel/osrelease"),
        architecture: std::env::consts::ARCH.into(),
    }
}

/// Interface addresses from `ip -j address show` (iproute2 is on every host we run on).
fn interfaces() -> Vec<proto::NetworkInterface> {
    let Ok(out) = std::process::Command::new("ip").args(["-j", "address", "show"]).output() else {
        return Vec::new();
    };
    let Ok(list) = serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout) else {
        return Vec::new();
    };
    list.iter()
        .map(|link| proto::NetworkInterface {
            name: link["ifname"].as_str().unwrap_or_default().to_owned(),
            mac_address: link["address"].as_str().unwrap_or_default().to_owned(),
            addresses: link["addr_info"]
                .as_array()
                .map(|addrs| {
                    addrs
                        .iter()
                        .filter_map(|a| {
                            Some(format!("{}/{}", a["local"].as_str()?, a["prefixlen"].as_u64()?))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

pub fn host_facts() -> proto::HostFacts {
    proto::HostFacts {
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        os: Some(os_info()),
        interfaces: interfaces(),
        machine_id: read_trimmed("/etc/machine-id"),
        boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
    }
}

pub fn agent_info() -> proto::AgentInfo {
    proto::AgentInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        capabilities: vec!["nftables".into(), "policy-deltas".into()],
    }
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
    let (url, host) = endpoint(server)?;
    let channel = Endpoint::from_shared(url)
        .map_err(|source| EnrollError::Connect { server: server.into(), source })?
        .tls_config(identity::enroll_tls(ca_pem, &host))
        .map_err(|source| EnrollError::Connect { server: server.into(), source })?
        .connect()
        .await
        .map_err(|source| EnrollError::Connect { server: server.into(), source })?;
    let (key_pem, csr_pem) = identity::new_key_and_csr()?;
    let request = proto::EnrollRequest {
        provisioning_token: token.trim().to_owned(),
        csr_pem,
        facts: Some(host_facts()),
        agent: Some(agent_info()),
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
