//! This host's network interfaces as they come and go: a non-blocking rtnetlink socket
//! subscribed to link notifications (`RTNLGRP_LINK`: `RTM_NEWLINK` / `RTM_DELLINK`), primed
//! with a dump of the links that exist, and which kinds of interface flow capture attaches to
//! ([`framing`]). The socket, the dump and the parsing are the shared rtnetlink reader's
//! (`crate::rtnetlink`); the socket belongs to the network namespace of the thread that opens it.
//!
//! Captured (see [`framing`]):
//! - Ethernet framing: physical NICs (no link kind), `veth`, tap (`tun` kind with an Ethernet
//!   link type).
//! - IP framing (no link-layer header; the program reads the family from `skb->protocol`):
//!   `wireguard`, tun.
//!
//! Not captured:
//! - loopback, ever: nothing on it comes from another host.
//! - `bridge`, `bond`, `team`: every packet they carry passes a captured port or slave first
//!   (tc ingress runs before the bridge/bond receive handler, tc egress after), so capturing
//!   the master too would count each packet twice — and a TCP SYN as two connections.
//! - `vlan`, `macvlan`, `ipvlan`, tunnels (`vxlan`, `geneve`, `gre`, …) and any other kind:
//!   stacked on a lower device that is captured. The lower device sees vlan traffic when the
//!   NIC strips the tag (the usual offload); tagged frames it does not strip are not parsed,
//!   and traffic inside overlay tunnels is seen only as the tunnel's own outer packets.

use std::collections::{BTreeMap, BTreeSet};

use crate::rtnetlink::{self, Dump, Reply, RtnlError};

/// Failures of the link notification socket.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{what}")]
    Netlink {
        what: &'static str,
        #[source]
        source: RtnlError,
    },
}

/// How packets on an interface start, which decides the classifiers attached to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Framing {
    /// An Ethernet header, then IP.
    Ethernet,
    /// IP at once (WireGuard, tun).
    Ip,
}

/// One network interface as rtnetlink reports it (its hardware address is not looked at here).
pub use crate::rtnetlink::Link;

impl Link {
    /// How flow capture attaches to this link, or `None` if it does not (see [`framing`]).
    pub fn framing(&self) -> Option<Framing> {
        framing(self.link_type, self.kind.as_deref())
    }
}

/// Which links flow capture attaches to, and with which framing (the module comment says why).
pub fn framing(link_type: u16, kind: Option<&str>) -> Option<Framing> {
    match (link_type, kind) {
        (libc::ARPHRD_ETHER, None | Some("veth" | "tun")) => Some(Framing::Ethernet),
        (libc::ARPHRD_NONE, Some("wireguard" | "tun")) => Some(Framing::Ip),
        _ => None,
    }
}

/// A change to the set of links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// A link appeared (or existed when the watcher opened, or got this name).
    Added(Link),
    /// A link went away (or lost this name).
    Removed(Link),
}

/// Receive buffer asked of the kernel: a burst of hotplug notifications (each about 1-2 KB)
/// fits; an overflow is survived by dumping again.
const SOCKET_RCVBUF: libc::c_int = 1 << 20;

/// Follows the links of one network namespace without blocking (see the module comment).
#[derive(Debug)]
pub struct LinkWatcher {
    socket: rtnetlink::Socket,
    known: BTreeMap<u32, Link>,
    /// While a dump is under way: the indices it has reported so far.
    dumping: Option<BTreeSet<u32>>,
    seq: u32,
}

impl LinkWatcher {
    /// Opens the socket in the calling thread's network namespace, subscribed to link
    /// notifications, and asks for a dump: the first [`LinkWatcher::poll`] reports every
    /// existing link as [`LinkEvent::Added`].
    pub fn open() -> Result<LinkWatcher, LinkError> {
        let socket = rtnetlink::Socket::open(libc::RTMGRP_LINK as u32, true)
            .map_err(|source| LinkError::Netlink { what: "opening the link notification socket", source })?;
        // Without it the default buffer holds fewer notifications, and an overflow costs a dump.
        socket.set_receive_buffer(SOCKET_RCVBUF);
        let mut watcher = LinkWatcher { socket, known: BTreeMap::new(), dumping: None, seq: 0 };
        watcher.request_dump()?;
        Ok(watcher)
    }

    fn request_dump(&mut self) -> Result<(), LinkError> {
        self.seq = self.seq.wrapping_add(1);
        self.socket
            .request(Dump::Links, self.seq)
            .map_err(|source| LinkError::Netlink { what: "requesting the link dump", source })?;
        self.dumping = Some(BTreeSet::new());
        Ok(())
    }

    /// The links known now (as of the notifications read so far), by index.
    pub fn links(&self) -> impl Iterator<Item = &Link> {
        self.known.values()
    }

    /// Reads every notification queued on the socket, without blocking, and returns the
    /// changes they make to the set of links, in order. A name change is a removal of the old
    /// name and an addition of the new. If the kernel dropped notifications (the socket's
    /// buffer overflowed), the links are dumped again and the differences reported once the
    /// dump is complete.
    pub fn poll(&mut self) -> Result<Vec<LinkEvent>, LinkError> {
        let mut events = Vec::new();
        let mut buf = vec![0u8; rtnetlink::RECV_BUF];
        loop {
            match self.socket.recv(&mut buf) {
                Ok(Some(datagram)) => self.handle_datagram(datagram, &mut events),
                Ok(None) => return Ok(events),
                // Notifications were lost: ask again for the whole picture.
                Err(RtnlError::Overrun) => self.request_dump()?,
                Err(source) => return Err(LinkError::Netlink { what: "reading link notifications", source }),
            }
        }
    }

    fn handle_datagram(&mut self, data: &[u8], events: &mut Vec<LinkEvent>) {
        for message in rtnetlink::messages(data) {
            match message.reply() {
                Some(Reply::NewLink(link)) => {
                    if let Some(seen) = self.dumping.as_mut() {
                        seen.insert(link.index);
                    }
                    self.added(link, events);
                }
                Some(Reply::DelLink(link)) => {
                    if let Some(old) = self.known.remove(&link.index) {
                        events.push(LinkEvent::Removed(old));
                    }
                }
                Some(Reply::Done | Reply::Ack | Reply::Error(_)) => {
                    // The end of a dump (an error reply ends it too): what it did not report
                    // is gone.
                    if let Some(seen) = self.dumping.take() {
                        let gone: Vec<u32> =
                            self.known.keys().filter(|i| !seen.contains(i)).copied().collect();
                        for index in gone {
                            if let Some(old) = self.known.remove(&index) {
                                events.push(LinkEvent::Removed(old));
                            }
                        }
                    }
                }
                Some(Reply::NewAddress(_)) | None => {}
            }
        }
    }

    fn added(&mut self, link: Link, events: &mut Vec<LinkEvent>) {
        match self.known.get(&link.index) {
            // Up/down, MTU, address changes: not ours to report.
            Some(old) if old.name == link.name => {}
            Some(old) => {
                events.push(LinkEvent::Removed(old.clone()));
                events.push(LinkEvent::Added(link.clone()));
                self.known.insert(link.index, link);
            }
            None => {
                events.push(LinkEvent::Added(link.clone()));
                self.known.insert(link.index, link);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtnetlink::build;

    #[test]
    fn captured_kinds() {
        let check = |link_type, kind| framing(link_type, kind);
        assert_eq!(check(libc::ARPHRD_ETHER, None), Some(Framing::Ethernet), "a physical NIC");
        assert_eq!(check(libc::ARPHRD_ETHER, Some("veth")), Some(Framing::Ethernet));
        assert_eq!(check(libc::ARPHRD_ETHER, Some("tun")), Some(Framing::Ethernet), "tap");
        assert_eq!(check(libc::ARPHRD_NONE, Some("tun")), Some(Framing::Ip));
        assert_eq!(check(libc::ARPHRD_NONE, Some("wireguard")), Some(Framing::Ip));
        for kind in ["bridge", "bond", "team", "vlan", "macvlan", "ipvlan", "vxlan", "dummy"] {
            assert_eq!(check(libc::ARPHRD_ETHER, Some(kind)), None, "{kind}");
        }
        assert_eq!(check(libc::ARPHRD_LOOPBACK, None), None, "loopback, never");
        assert_eq!(check(libc::ARPHRD_NONE, None), None);
    }

    fn message(kind: u16, index: u32, link_type: u16, name: &str, link_kind: Option<&str>) -> Vec<u8> {
        build::message(kind, 0, 0, &build::link_body(index, link_type, name, link_kind, &[]))
    }

    fn done() -> Vec<u8> {
        build::done(0, 0)
    }

    fn watcher() -> LinkWatcher {
        // Only held: these tests feed datagrams in directly.
        LinkWatcher { socket: rtnetlink::Socket::inert(), known: BTreeMap::new(), dumping: None, seq: 0 }
    }

    #[test]
    fn notifications_become_additions_removals_and_renames() {
        let mut w = watcher();
        let mut events = Vec::new();
        let mut datagram = message(libc::RTM_NEWLINK, 2, libc::ARPHRD_ETHER, "veth0", Some("veth"));
        datagram.extend(message(libc::RTM_NEWLINK, 3, libc::ARPHRD_NONE, "wg0", Some("wireguard")));
        w.handle_datagram(&datagram, &mut events);
        let names = |events: &[LinkEvent]| {
            events
                .iter()
                .map(|e| match e {
                    LinkEvent::Added(l) => format!("+{}", l.name),
                    LinkEvent::Removed(l) => format!("-{}", l.name),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&events), ["+veth0", "+wg0"]);
        assert_eq!(
            w.known[&3],
            Link {
                index: 3,
                name: "wg0".into(),
                link_type: libc::ARPHRD_NONE,
                kind: Some("wireguard".into()),
                hardware_address: Vec::new(),
            }
        );
        // The same link again (up/down): nothing; renamed: out and in; deleted: out.
        events.clear();
        w.handle_datagram(
            &message(libc::RTM_NEWLINK, 2, libc::ARPHRD_ETHER, "veth0", Some("veth")),
            &mut events,
        );
        w.handle_datagram(
            &message(libc::RTM_NEWLINK, 2, libc::ARPHRD_ETHER, "eth1", Some("veth")),
            &mut events,
        );
        w.handle_datagram(&message(libc::RTM_DELLINK, 3, libc::ARPHRD_NONE, "wg0", None), &mut events);
        assert_eq!(names(&events), ["-veth0", "+eth1", "-wg0"]);

        // A dump that no longer reports a link removes it when it ends.
        events.clear();
        w.handle_datagram(&message(libc::RTM_NEWLINK, 5, libc::ARPHRD_ETHER, "eth5", None), &mut events);
        w.dumping = Some(BTreeSet::new());
        w.handle_datagram(&message(libc::RTM_NEWLINK, 5, libc::ARPHRD_ETHER, "eth5", None), &mut events);
        assert_eq!(names(&events), ["+eth5"]);
        w.handle_datagram(&done(), &mut events);
        assert_eq!(names(&events), ["+eth5", "-eth1"]);
        assert!(w.dumping.is_none());
    }

    #[test]
    fn malformed_messages_are_skipped() {
        let mut w = watcher();
        let mut events = Vec::new();
        let mut truncated = message(libc::RTM_NEWLINK, 2, libc::ARPHRD_ETHER, "veth0", None);
        truncated.truncate(20);
        w.handle_datagram(&truncated, &mut events);
        let mut bad_len = message(libc::RTM_NEWLINK, 2, libc::ARPHRD_ETHER, "veth0", None);
        bad_len[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        w.handle_datagram(&bad_len, &mut events);
        w.handle_datagram(&build::message(libc::RTM_NEWLINK, 0, 0, &[0; 4]), &mut events);
        assert!(events.is_empty(), "{events:?}");
    }
}
