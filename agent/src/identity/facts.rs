//! Host facts (hostname, OS, machine and boot id, interfaces with their addresses) that every
//! enrollment, Hello and inventory report carries, and the interface listings the agent acts on:
//! this host's own addresses. Facts are informational: the control plane authorizes nothing on
//! them. Interfaces and addresses are read from the kernel over rtnetlink (`crate::rtnetlink`,
//! one dump of links and one of addresses), in the calling thread's network namespace.

use std::collections::BTreeSet;
use std::net::IpAddr;

use innerwall_wire::identity::{AgentInfo, HostFacts, NetworkInterface, OsInfo};
use innerwall_wire::policy::PortRange;

use crate::rtnetlink::{self, Address, Link, RtnlError};

/// Why the interfaces could not be listed: the kernel's rtnetlink dump failed.
#[derive(Debug, thiserror::Error)]
pub enum FactsError {
    #[error("reading this host's {what} over rtnetlink")]
    Netlink {
        what: &'static str,
        #[source]
        source: RtnlError,
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

/// Every interface, in index order, with its addresses (`addr/prefixlen`, IPv4 and IPv6) in
/// the order the kernel dumps them. A failed dump is an error, never an empty list: a host that
/// could not list its interfaces must not report that it has none.
fn interfaces() -> Result<Vec<NetworkInterface>, FactsError> {
    let links = rtnetlink::links().map_err(|source| FactsError::Netlink { what: "links", source })?;
    let addresses =
        rtnetlink::addresses().map_err(|source| FactsError::Netlink { what: "addresses", source })?;
    Ok(assemble(links, &addresses))
}

/// Links and addresses (two separate dumps) as interfaces; an address of a link the link dump
/// did not report (one that came and went between the dumps) is left out.
fn assemble(mut links: Vec<Link>, addresses: &[Address]) -> Vec<NetworkInterface> {
    links.sort_by_key(|link| link.index);
    links
        .into_iter()
        .map(|link| NetworkInterface {
            mac_address: mac(&link.hardware_address),
            addresses: addresses
                .iter()
                .filter(|a| a.index == link.index)
                .map(|a| format!("{}/{}", a.address, a.prefix_len))
                .collect(),
            name: link.name,
        })
        .collect()
}

/// A 6-byte link-layer address as `aa:bb:cc:dd:ee:ff` (loopback's is all zero); empty for a
/// link without one or with another kind (tunnels carry IP addresses there).
fn mac(bytes: &[u8]) -> String {
    if bytes.len() != 6 {
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
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
        capabilities: vec![
            "nftables".into(),
            "policy-deltas".into(),
            innerwall_wire::sync::CONFIRM_DEADLINE.into(),
        ],
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
    fn interfaces_in_index_order_with_their_addresses() {
        let link = |index, name: &str, hardware_address: &[u8]| Link {
            index,
            name: name.into(),
            link_type: libc::ARPHRD_ETHER,
            kind: None,
            hardware_address: hardware_address.to_vec(),
        };
        let address = |index, address: &str, prefix_len| Address {
            index,
            address: address.parse().unwrap(),
            prefix_len,
        };
        let links = vec![
            link(3, "wg0", &[]),
            link(1, "lo", &[0; 6]),
            link(2, "eth0", &[0x02, 0x49, 0x57, 0x0a, 0xbc, 0xff]),
        ];
        let addresses = [
            address(1, "127.0.0.1", 8),
            address(2, "10.78.0.1", 24),
            address(2, "10.79.0.1", 32),
            address(9, "10.99.0.1", 24),
            address(1, "::1", 128),
            address(2, "fd78::1", 64),
        ];
        let got: Vec<(String, String, Vec<String>)> =
            assemble(links, &addresses).into_iter().map(|i| (i.name, i.mac_address, i.addresses)).collect();
        let want = |name: &str, mac: &str, addresses: &[&str]| {
            (name.to_owned(), mac.to_owned(), addresses.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>())
        };
        assert_eq!(
            got,
            [
                want("lo", "00:00:00:00:00:00", &["127.0.0.1/8", "::1/128"]),
                want("eth0", "02:49:57:0a:bc:ff", &["10.78.0.1/24", "10.79.0.1/32", "fd78::1/64"]),
                want("wg0", "", &[]),
            ]
        );
        assert_eq!(mac(&[0; 4]), "", "a tunnel's IPv4 endpoint is not a MAC");
        assert_eq!(mac(&[0xff; 20]), "", "nor is an InfiniBand address");
    }
}
