//! Host facts read over rtnetlink in a network namespace, compared with what iproute2 prints
//! there: `ip -j address show` is the oracle (the agent itself never runs `ip`).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;

use innerwall_agent::identity::facts;
use innerwall_agent::rtnetlink;

use crate::netns::{NetNs, run};

const DEVICE: &str = "iwt0";
const PEER: &str = "iwt1";
const MAC: &str = "02:49:57:00:00:01";

/// Name, MAC and `addr/prefixlen` in order: what host facts report of an interface.
type Interface = (String, String, Vec<String>);

/// What `ip -j address show` prints in `ns`, in index order, as an [`Interface`] each, with
/// its index. A link-layer address that is not six bytes (tunnels print an IP address
/// there) is empty, as the agent reports it.
fn oracle(ns: &NetNs) -> Vec<(u64, Interface)> {
    let out = run(ns.command("ip").args(["-j", "address", "show"]));
    let links: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("ip -j prints JSON");
    let mut interfaces: Vec<_> = links
        .iter()
        .map(|link| {
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            let mac = text(&link["address"]);
            let six_bytes = mac.len() == 17 && mac.split(':').all(|b| b.len() == 2);
            let addresses = link["addr_info"]
                .as_array()
                .expect("addr_info")
                .iter()
                .map(|a| format!("{}/{}", text(&a["local"]), a["prefixlen"]))
                .collect();
            let index = link["ifindex"].as_u64().expect("ifindex");
            (index, (text(&link["ifname"]), if six_bytes { mac } else { String::new() }, addresses))
        })
        .collect();
    interfaces.sort_by_key(|(index, _)| *index);
    interfaces
}

#[test]
fn host_facts_match_iproute2_in_a_namespace() {
    let ns = NetNs::new("facts");
    // Addresses usable at once: no tentative IPv6 addresses that change state between reads.
    run(ns.command("sysctl").args([
        "-qw",
        "net.ipv6.conf.all.accept_dad=0",
        "net.ipv6.conf.default.accept_dad=0",
    ]));
    let ip = |args: &[&str]| run(Command::new("ip").args(["-n", &ns.name]).args(args));
    ip(&["link", "add", DEVICE, "address", MAC, "type", "veth", "peer", "name", PEER]);
    ip(&["addr", "add", "10.78.0.1/24", "dev", DEVICE]);
    // Point-to-point: IFA_LOCAL is this host's address, IFA_ADDRESS the peer's.
    ip(&["addr", "add", "10.79.0.1", "peer", "10.79.0.2/32", "dev", DEVICE]);
    ip(&["-6", "addr", "add", "fd78::1/64", "dev", DEVICE, "nodad"]);
    ip(&["link", "set", DEVICE, "up"]);
    ip(&["link", "set", PEER, "up"]);

    let (host, local, links) =
        ns.enter(|| (facts::host_facts(), facts::local_addresses(), rtnetlink::links()));
    let host = host.expect("host facts in the namespace");
    let got: Vec<Interface> = host
        .interfaces
        .iter()
        .map(|i| (i.name.clone(), i.mac_address.clone(), i.addresses.clone()))
        .collect();
    let oracle = oracle(&ns);
    let want: Vec<Interface> = oracle.iter().map(|(_, interface)| interface.clone()).collect();
    assert_eq!(got, want, "host facts differ from `ip -j address show`");

    // The oracle could be wrong too: what was configured is there.
    let find =
        |name: &str| got.iter().find(|(n, _, _)| n == name).unwrap_or_else(|| panic!("{name}: {got:?}"));
    let (_, lo_mac, lo_addresses) = find("lo");
    assert_eq!(lo_mac, "00:00:00:00:00:00");
    assert_eq!(lo_addresses[..], ["127.0.0.1/8", "::1/128"]);
    let (_, mac, addresses) = find(DEVICE);
    assert_eq!(mac, MAC);
    assert_eq!(addresses[..2], ["10.78.0.1/24", "10.79.0.1/32"], "IPv4 first, IFA_LOCAL over the peer");
    assert!(addresses.contains(&"fd78::1/64".to_owned()), "{addresses:?}");
    assert!(
        addresses.iter().any(|a| a.starts_with("fe80::") && a.ends_with("/64")),
        "link-local: {addresses:?}"
    );

    let local = local.expect("local addresses in the namespace");
    let from_oracle: BTreeSet<IpAddr> = want
        .iter()
        .flat_map(|(_, _, addresses)| addresses)
        .map(|a| a.split('/').next().and_then(|a| a.parse().ok()).expect("an address"))
        .collect();
    assert_eq!(local, from_oracle);
    for own in ["127.0.0.1", "::1", "10.78.0.1", "10.79.0.1", "fd78::1"] {
        assert!(local.contains(&own.parse::<IpAddr>().unwrap()), "{own} missing from {local:?}");
    }
    assert!(!local.contains(&"10.79.0.2".parse::<IpAddr>().unwrap()), "the peer is not a local address");

    // The same reader gives the link watcher index, link type and kind.
    let links = links.expect("links in the namespace");
    let veth = links.iter().find(|l| l.name == DEVICE).expect("the veth link");
    let index = oracle.iter().find(|(_, (name, _, _))| name == DEVICE).map(|(index, _)| *index);
    assert_eq!(Some(u64::from(veth.index)), index);
    assert_eq!((veth.link_type, veth.kind.as_deref()), (libc::ARPHRD_ETHER, Some("veth")));
    assert_eq!(veth.hardware_address, [0x02, 0x49, 0x57, 0x00, 0x00, 0x01]);
}
