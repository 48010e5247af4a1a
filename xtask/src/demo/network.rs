//! The demo's network: the bridge, the three host namespaces with their veths and addresses,
//! and deleting all of it by exact name.

use std::{path::Path, process::Command};

use anyhow::{Result, bail};

use crate::cmd;

pub const BRIDGE: &str = "iwdemo0";
const BRIDGE_CIDR: &str = "10.77.0.1/24";

/// One simulated host: a network namespace joined to the bridge by a veth pair whose host end
/// carries the namespace's name.
#[derive(Debug)]
pub struct Host {
    pub name: &'static str,
    pub netns: &'static str,
    pub addr: &'static str,
    pub app: &'static str,
}

pub const DB: Host = Host { name: "db", netns: "iwdemo-db", addr: "10.77.0.10", app: "payments-db" };
pub const WEB: Host = Host { name: "web", netns: "iwdemo-web", addr: "10.77.0.20", app: "web" };
pub const BATCH: Host = Host { name: "batch", netns: "iwdemo-batch", addr: "10.77.0.30", app: "batch" };
pub const HOSTS: [&Host; 3] = [&DB, &WEB, &BATCH];

fn ip(args: &[&str]) -> Result<()> {
    cmd::output(Command::new("ip").args(args)).map(drop)
}

pub fn netns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Whether any namespace, veth or the bridge of a run is still there.
pub fn leftovers_exist() -> bool {
    HOSTS.iter().any(|host| netns_exists(host.netns) || link_exists(host.netns)) || link_exists(BRIDGE)
}

pub fn create_network() -> Result<()> {
    ip(&["link", "add", BRIDGE, "type", "bridge"])?;
    ip(&["addr", "add", BRIDGE_CIDR, "dev", BRIDGE])?;
    ip(&["link", "set", BRIDGE, "up"])?;
    println!("  bridge {BRIDGE} {BRIDGE_CIDR} in the root namespace (the control plane listens here)");
    for host in HOSTS {
        let ns = host.netns;
        ip(&["netns", "add", ns])?;
        ip(&["link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
        ip(&["link", "set", ns, "master", BRIDGE, "up"])?;
        ip(&["-n", ns, "addr", "add", &format!("{}/24", host.addr), "dev", "eth0"])?;
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        println!("  host {:<5} netns {ns:<12} eth0 {}/24  (veth {ns} on {BRIDGE})", host.name, host.addr);
    }
    Ok(())
}

/// Deletes our namespaces, veths and bridge by exact name; absent ones are fine.
pub fn delete_network() -> Result<()> {
    let mut errors = Vec::new();
    for host in HOSTS {
        // The host end first: deleting it takes the pair down at once, whereas a pair that
        // dies with its namespace disappears from the root namespace only a little later.
        if link_exists(host.netns)
            && let Err(err) = ip(&["link", "del", host.netns])
        {
            errors.push(format!("{err:#}"));
        }
        if netns_exists(host.netns)
            && let Err(err) = ip(&["netns", "del", host.netns])
        {
            errors.push(format!("{err:#}"));
        }
    }
    if link_exists(BRIDGE)
        && let Err(err) = ip(&["link", "del", BRIDGE])
    {
        errors.push(format!("{err:#}"));
    }
    if errors.is_empty() { Ok(()) } else { bail!("{}", errors.join("; ")) }
}
