//! Host facts (hostname, OS, machine and boot id, interfaces with their addresses) that every
//! enrollment, Hello and inventory report carries, and the interface listings the agent acts on:
//! this host's own addresses and the Ethernet interfaces flow capture attaches to. Facts are
//! informational: the control plane authorizes nothing on them. Read with iproute2's JSON
//! output (`ip -j`), which asks the kernel over netlink for the calling thread's network
//! namespace.

use std::collections::BTreeSet;
use std::net::IpAddr;

use innerwall_wire::identity::{AgentInfo, HostFacts, NetworkInterface, OsInfo};
use innerwall_wire::policy::PortRange;

/// Why the interfaces could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum FactsError {
    #[error("running `ip -j {object} show`")]
    Spawn {
        object: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("`ip -j {object} show` failed: {stderr}")]
    Failed { object: &'static str, stderr: String },
    #[error("parsing `ip -j {object} show`")]
    Parse {
        object: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn os_info() -> OsInfo {
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let field = |key: &str| {
        release
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .map(|v| v.trim_matches('"').to_owned())
            .unwrap_or_default()
    };
    OsInfo {
        family: "linux".into(),
        name: field("NAME"),
        version: field("VERSION_ID"),
        kernel_version: read_trimmed("/proc/sys/kernel/osrelease"),
        architecture: std::env::consts::ARCH.into(),
    }
}

/// Where iproute2's `ip` may live. The agent runs as root, so it never searches `PATH`: only a
/// root-owned binary nobody else can write, at one of these paths, is run.
const IP_PATHS: [&str; 4] = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"];

/// `ip` by absolute path (the first trustworthy one; the first path when none is, so the
/// failure names it).
fn ip() -> std::process::Command {
    use std::os::unix::fs::MetadataExt as _;
    let trusted = |path: &&&str| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.uid() == 0 && m.mode() & 0o022 == 0)
    };
    std::process::Command::new(IP_PATHS.iter().find(trusted).unwrap_or(&IP_PATHS[0]))
}

/// `ip -j <object> show`, parsed.
fn ip_json(object: &'static str) -> Result<Vec<serde_json::Value>, FactsError> {
    let out =
        ip().args(["-j", object, "show"]).output().map_err(|source| FactsError::Spawn { object, source })?;
    parse_ip_json(object, &out)
}

/// A failed or unparseable run is an error, never an empty list: a host that could not list
/// its interfaces must not report that it has none.
fn parse_ip_json(
    object: &'static str,
    out: &std::process::Output,
) -> Result<Vec<serde_json::Value>, FactsError> {
    if !out.status.success() {
        return Err(FactsError::Failed {
            object,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|source| FactsError::Parse { object, source })
}

/// Interface addresses from `ip -j address show` (iproute2 is on every host we run on).
fn interfaces() -> Result<Vec<NetworkInterface>, FactsError> {
    Ok(ip_json("address")?
        .iter()
        .map(|link| NetworkInterface {
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
        .collect())
}

/// What this host reports about itself; an error when its interfaces cannot be listed.
pub fn host_facts() -> Result<HostFacts, FactsError> {
    Ok(HostFacts {
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        os: Some(os_info()),
        interfaces: interfaces()?,
        machine_id: read_trimmed("/etc/machine-id"),
        boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
        ephemeral_ports: port_range(&read_trimmed("/proc/sys/net/ipv4/ip_local_port_range")),
    })
}

/// `ip_local_port_range` (two numbers, whitespace between); `None` when it is not that.
fn port_range(text: &str) -> Option<PortRange> {
    let mut numbers = text.split_whitespace().map(str::parse::<u32>);
    match (numbers.next(), numbers.next(), numbers.next()) {
        (Some(Ok(start)), Some(Ok(end)), None) => PortRange::new(start, end).ok(),
        _ => None,
    }
}

pub fn agent_info() -> AgentInfo {
    AgentInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        capabilities: vec!["nftables".into(), "policy-deltas".into()],
    }
}

/// This host's own addresses: only flows to them are inbound flows of this workload.
pub fn local_addresses() -> Result<BTreeSet<IpAddr>, FactsError> {
    Ok(interfaces()?
        .iter()
        .flat_map(|i| i.addresses.iter())
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ephemeral_range_is_two_ports_in_order() {
        assert_eq!(port_range("32768\t60999"), Some(PortRange::new(32_768, 60_999).unwrap()));
        for bad in ["", "32768", "60999 32768", "0 100", "1 65536", "1 2 3", "a b"] {
            assert_eq!(port_range(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ip_is_run_by_absolute_path() {
        let program = ip().get_program().to_owned();
        assert!(std::path::Path::new(&program).is_absolute(), "{program:?}");
        assert!(IP_PATHS.iter().any(|p| std::ffi::OsStr::new(p) == program));
    }

    /// `ip` failing or printing garbage is an error, never "no interfaces".
    #[test]
    fn a_failed_ip_run_is_an_error_not_an_empty_list() {
        use std::os::unix::process::ExitStatusExt as _;
        let run = |code: i32, stdout: &[u8]| std::process::Output {
            status: std::process::ExitStatus::from_raw(code << 8),
            stdout: stdout.to_vec(),
            stderr: b"Cannot open netlink socket".to_vec(),
        };
        assert_eq!(parse_ip_json("address", &run(0, b"[]")).unwrap(), Vec::<serde_json::Value>::new());
        let failed = parse_ip_json("address", &run(1, b"")).unwrap_err();
        assert_eq!(failed.to_string(), "`ip -j address show` failed: Cannot open netlink socket");
        assert!(matches!(
            parse_ip_json("link", &run(0, b"not json")),
            Err(FactsError::Parse { object: "link", .. })
        ));
    }
}
