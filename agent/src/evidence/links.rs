//! This host's network interfaces as they come and go: a non-blocking rtnetlink socket
//! subscribed to link notifications (`RTNLGRP_LINK`: `RTM_NEWLINK` / `RTM_DELLINK`), primed
//! with a dump of the links that exist, and which kinds of interface flow capture attaches to
//! ([`framing`]). The socket belongs to the network namespace of the thread that opens it.
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
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

/// Failures of the link notification socket.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("rtnetlink {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
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

/// One network interface as rtnetlink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `ARPHRD_*` link type (1 Ethernet, 772 loopback, 65534 none: WireGuard, tun).
    pub link_type: u16,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `wireguard`, …); `None` for physical devices.
    pub kind: Option<String>,
}

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

const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
const RTA_HDRLEN: usize = 4;
const NLA_TYPE_MASK: u16 = 0x3fff;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const RECV_BUF: usize = 64 * 1024;
/// Receive buffer asked of the kernel: a burst of hotplug notifications (each about 1-2 KB)
/// fits; an overflow is survived by dumping again.
const SOCKET_RCVBUF: libc::c_int = 1 << 20;

/// Follows the links of one network namespace without blocking (see the module comment).
#[derive(Debug)]
pub struct LinkWatcher {
    fd: OwnedFd,
    known: BTreeMap<u32, Link>,
    /// While a dump is under way: the indices it has reported so far.
    dumping: Option<BTreeSet<u32>>,
    seq: u32,
}

impl LinkWatcher {
    /// Opens the socket in the calling thread's network namespace, subscribed to link
    /// notifications, and asks for a dump: the first [`LinkWatcher::poll`] reports every
    /// existing link as [`LinkEvent::Added`].
    #[allow(unsafe_code)]
    pub fn open() -> Result<LinkWatcher, LinkError> {
        let err = |what| move |source| LinkError::Io { what, source };
        // SAFETY: socket(2) with constant arguments; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(err("socket")(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let rcvbuf = SOCKET_RCVBUF;
        // SAFETY: setsockopt(2) with a pointer to a live c_int and its size.
        unsafe {
            // Best effort: without it the default buffer holds fewer notifications, and an
            // overflow costs a dump.
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&raw const rcvbuf).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = libc::RTMGRP_LINK as u32;
        // SAFETY: bind(2) with a pointer to a live sockaddr_nl and its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(err("bind")(io::Error::last_os_error()));
        }
        let mut watcher = LinkWatcher { fd, known: BTreeMap::new(), dumping: None, seq: 0 };
        watcher.request_dump()?;
        Ok(watcher)
    }

    #[allow(unsafe_code)]
    fn request_dump(&mut self) -> Result<(), LinkError> {
        self.seq = self.seq.wrapping_add(1);
        let mut msg = [0u8; NLMSG_HDRLEN + IFINFOMSG_LEN];
        msg[0..4].copy_from_slice(&((NLMSG_HDRLEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
        msg[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
        msg[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        // ifinfomsg: family AF_UNSPEC and the rest zero — every link.
        // SAFETY: send(2) of a live buffer with its length.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(LinkError::Io {
                what: "requesting the link dump",
                source: io::Error::last_os_error(),
            });
        }
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
    #[allow(unsafe_code)]
    pub fn poll(&mut self) -> Result<Vec<LinkEvent>, LinkError> {
        let mut events = Vec::new();
        let mut buf = vec![0u8; RECV_BUF];
        loop {
            // SAFETY: recv(2) into a live buffer of its length.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => return Ok(events),
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => {
                        // Notifications were lost: ask again for the whole picture.
                        self.request_dump()?;
                        continue;
                    }
                    _ => return Err(LinkError::Io { what: "reading link notifications", source: e }),
                }
            }
            self.handle_datagram(&buf[..n as usize], &mut events);
        }
    }

    fn handle_datagram(&mut self, mut data: &[u8], events: &mut Vec<LinkEvent>) {
        while data.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
            if len < NLMSG_HDRLEN || len > data.len() {
                return;
            }
            let kind = u16::from_ne_bytes([data[4], data[5]]);
            let body = &data[NLMSG_HDRLEN..len];
            match kind {
                libc::RTM_NEWLINK => {
                    if let Some(link) = parse_link(body) {
                        if let Some(seen) = self.dumping.as_mut() {
                            seen.insert(link.index);
                        }
                        self.added(link, events);
                    }
                }
                libc::RTM_DELLINK => {
                    if let Some(link) = parse_link(body)
                        && let Some(old) = self.known.remove(&link.index)
                    {
                        events.push(LinkEvent::Removed(old));
                    }
                }
                k if k == libc::NLMSG_DONE as u16 || k == libc::NLMSG_ERROR as u16 => {
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
                _ => {}
            }
            data = &data[len.next_multiple_of(4).min(data.len())..];
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

/// An `ifinfomsg` and its attributes: index, link type, name and kind. `None` if malformed or
/// nameless.
fn parse_link(body: &[u8]) -> Option<Link> {
    if body.len() < IFINFOMSG_LEN {
        return None;
    }
    let link_type = u16::from_ne_bytes([body[2], body[3]]);
    let index = u32::from_ne_bytes(body[4..8].try_into().ok()?);
    let mut name = None;
    let mut kind = None;
    for (attr, value) in attributes(&body[IFINFOMSG_LEN..]) {
        match attr {
            IFLA_IFNAME => name = Some(c_string(value)),
            IFLA_LINKINFO => {
                kind = attributes(value).find(|(a, _)| *a == IFLA_INFO_KIND).map(|(_, v)| c_string(v));
            }
            _ => {}
        }
    }
    Some(Link { index, name: name?, link_type, kind })
}

/// The (type, value) pairs of a netlink attribute stream; stops at the first malformed one.
fn attributes(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < RTA_HDRLEN {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([data[0], data[1]]));
        let attr = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < RTA_HDRLEN || len > data.len() {
            return None;
        }
        let value = &data[RTA_HDRLEN..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some((attr, value))
    })
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((RTA_HDRLEN + value.len()) as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    fn message(kind: u16, index: u32, link_type: u16, name: &str, link_kind: Option<&str>) -> Vec<u8> {
        let mut body = vec![0u8; IFINFOMSG_LEN];
        body[2..4].copy_from_slice(&link_type.to_ne_bytes());
        body[4..8].copy_from_slice(&index.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, format!("{name}\0").as_bytes()));
        if let Some(k) = link_kind {
            body.extend(attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, k.as_bytes())));
        }
        let mut out = Vec::new();
        out.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&[0; 10]);
        out.extend(body);
        out
    }

    fn done() -> Vec<u8> {
        let mut out = vec![0u8; NLMSG_HDRLEN + 4];
        let len = out.len() as u32;
        out[0..4].copy_from_slice(&len.to_ne_bytes());
        out[4..6].copy_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
        out
    }

    fn watcher() -> LinkWatcher {
        // Only held: these tests feed datagrams in directly.
        let fd = std::fs::File::open("/dev/null").expect("/dev/null").into();
        LinkWatcher { fd, known: BTreeMap::new(), dumping: None, seq: 0 }
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
                kind: Some("wireguard".into())
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
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(parse_link(&[0; 4]), None);
    }
}
