//! The kernel's routing netlink (`NETLINK_ROUTE`), read one way: the socket (bound to the
//! network namespace of the thread that opens it), dump requests for links (`RTM_GETLINK`) and
//! addresses (`RTM_GETADDR`), and the one parser of what comes back — netlink messages, route
//! attributes, `ifinfomsg` / `ifaddrmsg` bodies, and the end or failure of a dump. Host facts
//! (`identity::facts`: one blocking dump of each, [`links`] and [`addresses`]) and flow
//! capture's link watcher (`evidence::links`: non-blocking, subscribed to link notifications)
//! both read the kernel through here.
//!
//! What the kernel sends is bounds-checked before it is read: a message or attribute that does
//! not fit where it claims to is skipped (with the rest of its datagram when its own length
//! cannot be trusted), never read past and never a panic. A dump ends at `NLMSG_DONE`; a kernel
//! error (`NLMSG_ERROR`, or an `NLMSG_DONE` that carries one) ends it as an error, never as an
//! empty answer, and so does an overrun (`ENOBUFS`).

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

/// Failures of the routing netlink socket and of the dumps read through it.
#[derive(Debug, thiserror::Error)]
pub enum RtnlError {
    #[error("rtnetlink {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the kernel refused the {dump} dump: {}", io::Error::from_raw_os_error(*.errno))]
    Refused { dump: Dump, errno: i32 },
    #[error(
        "the rtnetlink socket overran (ENOBUFS): the kernel dropped messages its receive buffer could \
         not hold"
    )]
    Overrun,
    #[error("an rtnetlink datagram of {len} bytes did not fit the {capacity}-byte receive buffer")]
    Truncated { len: usize, capacity: usize },
    #[error("the {dump} dump was interrupted by concurrent changes {attempts} times in a row")]
    Interrupted { dump: Dump, attempts: u32 },
}

const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
const IFADDRMSG_LEN: usize = 8;
const RTA_HDRLEN: usize = 4;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLM_F_DUMP_INTR: u16 = 0x10;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;

/// A receive buffer every datagram fits: the kernel sizes dump datagrams to at most 32 KiB,
/// and a notification is one message of a few KiB.
pub const RECV_BUF: usize = 64 * 1024;

/// What a dump request asks for: every object of its kind, of every address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dump {
    /// `RTM_GETLINK`: the links, answered with `RTM_NEWLINK`.
    Links,
    /// `RTM_GETADDR`: the addresses, IPv4 and IPv6, answered with `RTM_NEWADDR`.
    Addresses,
}

impl fmt::Display for Dump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dump::Links => "link",
            Dump::Addresses => "address",
        })
    }
}

impl Dump {
    /// The request: a netlink header and an all-zero family header (`ifinfomsg` or
    /// `ifaddrmsg`; family `AF_UNSPEC` and no index, so nothing is filtered out).
    fn request(self, seq: u32) -> Vec<u8> {
        let (kind, family_header) = match self {
            Dump::Links => (libc::RTM_GETLINK, IFINFOMSG_LEN),
            Dump::Addresses => (libc::RTM_GETADDR, IFADDRMSG_LEN),
        };
        let len = NLMSG_HDRLEN + family_header;
        let mut msg = vec![0u8; len];
        msg[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
        msg[4..6].copy_from_slice(&kind.to_ne_bytes());
        msg[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&seq.to_ne_bytes());
        msg
    }
}

/// A `NETLINK_ROUTE` socket, bound to the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    /// Opens a socket in the calling thread's network namespace, subscribed to the multicast
    /// `groups` (`RTMGRP_*` bits; 0 for a socket that only dumps). A `nonblocking` socket's
    /// [`Socket::recv`] returns at once when nothing is queued.
    #[allow(unsafe_code)]
    pub fn open(groups: u32, nonblocking: bool) -> Result<Socket, RtnlError> {
        let flags = libc::SOCK_RAW | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
        // SAFETY: socket(2) with constant arguments; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_NETLINK, flags, libc::NETLINK_ROUTE) };
        if raw < 0 {
            return Err(RtnlError::Io { what: "socket", source: io::Error::last_os_error() });
        }
        // SAFETY: `raw` is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = groups;
        // SAFETY: bind(2) with a pointer to a live sockaddr_nl and its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(RtnlError::Io { what: "bind", source: io::Error::last_os_error() });
        }
        Ok(Socket { fd })
    }

    /// Asks the kernel for a receive buffer of `bytes`, best effort: without it the default
    /// buffer holds fewer notifications, and what overflows is reported as
    /// [`RtnlError::Overrun`].
    #[allow(unsafe_code)]
    pub fn set_receive_buffer(&self, bytes: libc::c_int) {
        // SAFETY: setsockopt(2) with a pointer to a live c_int and its size.
        unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&raw const bytes).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }

    /// Sends a dump request; its replies carry `seq`.
    #[allow(unsafe_code)]
    pub fn request(&self, dump: Dump, seq: u32) -> Result<(), RtnlError> {
        let msg = dump.request(seq);
        // SAFETY: send(2) of a live buffer with its length.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(RtnlError::Io { what: "dump request", source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// The next datagram from the kernel, read into `buf` (give it [`RECV_BUF`] bytes);
    /// `Ok(None)` when a non-blocking socket has nothing queued. [`RtnlError::Overrun`] when the
    /// kernel dropped messages because the socket's buffer was full. Datagrams from anyone but
    /// the kernel (another process may address this socket's port) are dropped unread.
    #[allow(unsafe_code)]
    pub fn recv<'b>(&self, buf: &'b mut [u8]) -> Result<Option<&'b [u8]>, RtnlError> {
        loop {
            // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut from_len = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: recvfrom(2) into a live buffer of its length, and a live sockaddr_nl with
            // its size. MSG_TRUNC makes it return the datagram's real length (it never writes
            // past `buf.len()`), so a datagram that did not fit is noticed.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_TRUNC,
                    (&raw mut from).cast(),
                    &raw mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(None),
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => Err(RtnlError::Overrun),
                    _ => Err(RtnlError::Io { what: "recv", source: e }),
                };
            }
            if from.nl_pid != 0 {
                continue;
            }
            let len = n as usize;
            if len > buf.len() {
                return Err(RtnlError::Truncated { len, capacity: buf.len() });
            }
            return Ok(Some(&buf[..len]));
        }
    }

    /// A socket that reads nothing, for tests that feed datagrams in directly.
    #[cfg(test)]
    pub(crate) fn inert() -> Socket {
        Socket { fd: std::fs::File::open("/dev/null").expect("/dev/null").into() }
    }
}

/// One netlink message: header fields and body (the bytes after the header, within its
/// length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// `nlmsg_type`: `RTM_*`, `NLMSG_DONE`, `NLMSG_ERROR`, …
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    pub body: &'a [u8],
}

/// The messages of one datagram, in order. A length shorter than a header or running past the
/// datagram ends the walk: nothing after it can be located.
pub fn messages(mut data: &[u8]) -> impl Iterator<Item = Message<'_>> {
    std::iter::from_fn(move || {
        let header = data.get(..NLMSG_HDRLEN)?;
        let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if len < NLMSG_HDRLEN || len > data.len() {
            data = &[];
            return None;
        }
        let message = Message {
            kind: u16::from_ne_bytes([header[4], header[5]]),
            flags: u16::from_ne_bytes([header[6], header[7]]),
            seq: u32::from_ne_bytes([header[8], header[9], header[10], header[11]]),
            body: &data[NLMSG_HDRLEN..len],
        };
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(message)
    })
}

/// An attribute whose length is shorter than its header or runs past its container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// The (type, value) pairs of a route attribute stream, type without the nested and
/// byte-order flags. A malformed attribute is yielded as `Err` and ends the stream, so a
/// parser can drop the whole message rather than act on half of it; fewer trailing bytes than
/// an attribute header are ignored, as the kernel's own parser does.
pub fn attributes(mut data: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), Malformed>> {
    std::iter::from_fn(move || {
        let header = data.get(..RTA_HDRLEN)?;
        let len = usize::from(u16::from_ne_bytes([header[0], header[1]]));
        let attr = u16::from_ne_bytes([header[2], header[3]]) & NLA_TYPE_MASK;
        if len < RTA_HDRLEN || len > data.len() {
            data = &[];
            return Some(Err(Malformed));
        }
        let value = &data[RTA_HDRLEN..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(Ok((attr, value)))
    })
}

/// One network interface as an `RTM_NEWLINK` / `RTM_DELLINK` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name (`IFLA_IFNAME`).
    pub name: String,
    /// `ARPHRD_*` link type (1 Ethernet, 772 loopback, 65534 none: WireGuard, tun).
    pub link_type: u16,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `wireguard`, …); `None` for physical devices.
    pub kind: Option<String>,
    /// `IFLA_ADDRESS`, the link-layer address as the kernel gives it (6 bytes for Ethernet, and
    /// for loopback); empty when the link has none.
    pub hardware_address: Vec<u8>,
}

/// One interface address as an `RTM_NEWADDR` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// Index of the interface the address is on.
    pub index: u32,
    /// `IFA_LOCAL`, or `IFA_ADDRESS` without it: on a point-to-point link `IFA_ADDRESS` is
    /// the peer's, and `IFA_LOCAL` this host's.
    pub address: IpAddr,
    pub prefix_len: u8,
}

/// What a message says, for the messages the agent reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    NewLink(Link),
    DelLink(Link),
    NewAddress(Address),
    /// The end of a dump.
    Done,
    /// An acknowledgement (`NLMSG_ERROR` carrying 0).
    Ack,
    /// The kernel refused a request or failed a dump, with this (positive) errno.
    Error(i32),
}

impl Message<'_> {
    /// What this message says; `None` for a type the agent does not read, or a message too
    /// short or malformed to be what its type says (skipped).
    pub fn reply(&self) -> Option<Reply> {
        match self.kind {
            libc::RTM_NEWLINK => parse_link(self.body).map(Reply::NewLink),
            libc::RTM_DELLINK => parse_link(self.body).map(Reply::DelLink),
            libc::RTM_NEWADDR => parse_address(self.body).map(Reply::NewAddress),
            // A dump's end carries the dump's status: 0, or a negative errno when it failed.
            NLMSG_DONE => Some(match status(self.body) {
                Some(e) if e < 0 => Reply::Error(e.saturating_neg()),
                _ => Reply::Done,
            }),
            NLMSG_ERROR => Some(match status(self.body)? {
                0 => Reply::Ack,
                e => Reply::Error(e.saturating_abs()),
            }),
            _ => None,
        }
    }

    /// Whether the kernel flagged this dump message as inconsistent: the objects changed while
    /// it was being dumped (`NLM_F_DUMP_INTR`).
    pub fn interrupted(&self) -> bool {
        self.flags & NLM_F_DUMP_INTR != 0
    }
}

/// The `int` that opens an `NLMSG_DONE` or `NLMSG_ERROR` body.
fn status(body: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(body.get(..4)?.try_into().ok()?))
}

/// An `ifinfomsg` and its attributes. `None` if malformed or nameless.
fn parse_link(body: &[u8]) -> Option<Link> {
    let header = body.get(..IFINFOMSG_LEN)?;
    let link_type = u16::from_ne_bytes([header[2], header[3]]);
    let index = u32::from_ne_bytes([header[4], header[5], header[6], header[7]]);
    let mut name = None;
    let mut kind = None;
    let mut hardware_address = Vec::new();
    for attr in attributes(&body[IFINFOMSG_LEN..]) {
        match attr.ok()? {
            (IFLA_IFNAME, value) => name = Some(c_string(value)),
            (IFLA_ADDRESS, value) => hardware_address = value.to_vec(),
            (IFLA_LINKINFO, value) => {
                for nested in attributes(value) {
                    if let (IFLA_INFO_KIND, value) = nested.ok()? {
                        kind = Some(c_string(value));
                    }
                }
            }
            _ => {}
        }
    }
    Some(Link { index, name: name?, link_type, kind, hardware_address })
}

/// An `ifaddrmsg` and its attributes. `None` if malformed, of another family than IPv4 and
/// IPv6, or without an address.
fn parse_address(body: &[u8]) -> Option<Address> {
    let header = body.get(..IFADDRMSG_LEN)?;
    let family = i32::from(header[0]);
    let prefix_len = header[1];
    let index = u32::from_ne_bytes([header[4], header[5], header[6], header[7]]);
    let ip = |value: &[u8]| -> Option<IpAddr> {
        match family {
            libc::AF_INET => Some(Ipv4Addr::from(<[u8; 4]>::try_from(value).ok()?).into()),
            libc::AF_INET6 => Some(Ipv6Addr::from(<[u8; 16]>::try_from(value).ok()?).into()),
            _ => None,
        }
    };
    let mut local = None;
    let mut address = None;
    for attr in attributes(&body[IFADDRMSG_LEN..]) {
        match attr.ok()? {
            // An address of the wrong size is a malformed message, not a reason to fall back
            // to the peer's.
            (IFA_LOCAL, value) => local = Some(ip(value)?),
            (IFA_ADDRESS, value) => address = Some(ip(value)?),
            _ => {}
        }
    }
    Some(Address { index, address: local.or(address)?, prefix_len })
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The sequence number of a blocking dump: each has a fresh socket, so one number serves.
const DUMP_SEQ: u32 = 1;
/// How often a dump the kernel flags as inconsistent is repeated before it is an error.
const DUMP_ATTEMPTS: u32 = 3;

/// The replies to one dump request, gathered datagram by datagram: the part of [`dump`] that
/// does no I/O.
#[derive(Debug)]
struct Gather {
    dump: Dump,
    seq: u32,
    replies: Vec<Reply>,
    interrupted: bool,
}

impl Gather {
    fn new(dump: Dump, seq: u32) -> Gather {
        Gather { dump, seq, replies: Vec::new(), interrupted: false }
    }

    /// Takes one datagram; `Ok(true)` once the dump is complete. Messages of another sequence
    /// number answer something else and are skipped.
    fn feed(&mut self, datagram: &[u8]) -> Result<bool, RtnlError> {
        for message in messages(datagram).filter(|m| m.seq == self.seq) {
            self.interrupted |= message.interrupted();
            match message.reply() {
                Some(Reply::Done) => return Ok(true),
                Some(Reply::Error(errno)) => return Err(RtnlError::Refused { dump: self.dump, errno }),
                Some(Reply::Ack) | None => {}
                Some(reply) => self.replies.push(reply),
            }
        }
        Ok(false)
    }
}

/// Dumps `what` over a fresh blocking socket in the calling thread's network namespace and
/// returns the replies in the order the kernel sent them. A dump the kernel flags as
/// inconsistent is repeated.
fn dump(what: Dump) -> Result<Vec<Reply>, RtnlError> {
    let mut buf = vec![0u8; RECV_BUF];
    for _ in 0..DUMP_ATTEMPTS {
        let socket = Socket::open(0, false)?;
        socket.request(what, DUMP_SEQ)?;
        let mut gather = Gather::new(what, DUMP_SEQ);
        loop {
            if let Some(datagram) = socket.recv(&mut buf)?
                && gather.feed(datagram)?
            {
                break;
            }
        }
        if !gather.interrupted {
            return Ok(gather.replies);
        }
    }
    Err(RtnlError::Interrupted { dump: what, attempts: DUMP_ATTEMPTS })
}

/// Every link of the calling thread's network namespace, in the order the kernel dumps them.
pub fn links() -> Result<Vec<Link>, RtnlError> {
    Ok(dump(Dump::Links)?
        .into_iter()
        .filter_map(|reply| if let Reply::NewLink(l) = reply { Some(l) } else { None })
        .collect())
}

/// Every IPv4 and IPv6 address of the calling thread's network namespace, in the order the
/// kernel dumps them.
pub fn addresses() -> Result<Vec<Address>, RtnlError> {
    Ok(dump(Dump::Addresses)?
        .into_iter()
        .filter_map(|reply| if let Reply::NewAddress(a) = reply { Some(a) } else { None })
        .collect())
}

/// Hand-built messages, as the kernel would send them, for the parser's tests and the link
/// watcher's.
#[cfg(test)]
pub(crate) mod build {
    use super::*;

    pub fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((RTA_HDRLEN + value.len()) as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    pub fn message(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&flags.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(body);
        out
    }

    /// An `ifinfomsg` body with a name, a kind (nested in `IFLA_LINKINFO`, flagged nested as
    /// the kernel does) and a hardware address when given.
    pub fn link_body(index: u32, link_type: u16, name: &str, kind: Option<&str>, mac: &[u8]) -> Vec<u8> {
        let mut body = vec![0u8; IFINFOMSG_LEN];
        body[2..4].copy_from_slice(&link_type.to_ne_bytes());
        body[4..8].copy_from_slice(&index.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, format!("{name}\0").as_bytes()));
        if !mac.is_empty() {
            body.extend(attr(IFLA_ADDRESS, mac));
        }
        if let Some(k) = kind {
            body.extend(attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, k.as_bytes())));
        }
        body
    }

    /// An `ifaddrmsg` body with `IFA_ADDRESS` and, when given, `IFA_LOCAL`.
    pub fn address_body(index: u32, prefix_len: u8, address: IpAddr, local: Option<IpAddr>) -> Vec<u8> {
        let octets = |a: IpAddr| match a {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        let family = if address.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
        let mut body = vec![0u8; IFADDRMSG_LEN];
        body[0] = family as u8;
        body[1] = prefix_len;
        body[4..8].copy_from_slice(&index.to_ne_bytes());
        body.extend(attr(IFA_ADDRESS, &octets(address)));
        if let Some(local) = local {
            body.extend(attr(IFA_LOCAL, &octets(local)));
        }
        body
    }

    /// An `NLMSG_DONE` carrying `status` (0, or a negative errno).
    pub fn done(seq: u32, status: i32) -> Vec<u8> {
        message(NLMSG_DONE, libc::NLM_F_MULTI as u16, seq, &status.to_ne_bytes())
    }

    /// An `NLMSG_ERROR` carrying `error` (0 for an ack, or a negative errno) and the start of
    /// the request it answers.
    pub fn error(seq: u32, error: i32) -> Vec<u8> {
        let mut body = error.to_ne_bytes().to_vec();
        body.extend_from_slice(&Dump::Links.request(seq)[..NLMSG_HDRLEN]);
        message(NLMSG_ERROR, 0, seq, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    const MAC: [u8; 6] = [0x02, 0x49, 0x57, 0x00, 0x00, 0x01];

    fn replies(datagram: &[u8]) -> Vec<Option<Reply>> {
        messages(datagram).map(|m| m.reply()).collect()
    }

    #[test]
    fn a_link_with_its_name_hardware_address_and_kind() {
        let body = link_body(7, libc::ARPHRD_ETHER, "veth0", Some("veth"), &MAC);
        assert_eq!(
            replies(&message(libc::RTM_NEWLINK, 0, 0, &body)),
            [Some(Reply::NewLink(Link {
                index: 7,
                name: "veth0".into(),
                link_type: libc::ARPHRD_ETHER,
                kind: Some("veth".into()),
                hardware_address: MAC.to_vec(),
            }))]
        );
        let wg = link_body(8, libc::ARPHRD_NONE, "wg0", Some("wireguard"), &[]);
        let Some(Reply::DelLink(link)) = replies_one(&message(libc::RTM_DELLINK, 0, 0, &wg)) else {
            panic!("not a removal");
        };
        assert_eq!(
            (link.index, link.kind.as_deref(), link.hardware_address.len()),
            (8, Some("wireguard"), 0)
        );
    }

    fn replies_one(datagram: &[u8]) -> Option<Reply> {
        let mut all = replies(datagram);
        assert_eq!(all.len(), 1, "{all:?}");
        all.remove(0)
    }

    #[test]
    fn ipv4_and_ipv6_addresses_prefer_the_local_address() {
        let v4: IpAddr = "10.79.0.2".parse().unwrap();
        let local4: IpAddr = "10.79.0.1".parse().unwrap();
        let v6: IpAddr = "fd78::1".parse().unwrap();
        let mut datagram = message(libc::RTM_NEWADDR, 0, 0, &address_body(3, 32, v4, Some(local4)));
        datagram.extend(message(libc::RTM_NEWADDR, 0, 0, &address_body(3, 64, v6, None)));
        assert_eq!(
            replies(&datagram),
            [
                Some(Reply::NewAddress(Address { index: 3, address: local4, prefix_len: 32 })),
                Some(Reply::NewAddress(Address { index: 3, address: v6, prefix_len: 64 })),
            ]
        );
    }

    #[test]
    fn an_address_of_the_wrong_size_or_family_is_skipped() {
        // An IPv6 message carrying four bytes: malformed, not an IPv4 address.
        let mut body = address_body(3, 64, "fd78::1".parse().unwrap(), None);
        body.truncate(IFADDRMSG_LEN);
        body.extend(attr(IFA_ADDRESS, &[10, 0, 0, 1]));
        assert_eq!(replies(&message(libc::RTM_NEWADDR, 0, 0, &body)), [None]);
        // A peer address with a malformed local one is not taken for the local one.
        let mut body = address_body(3, 32, "10.79.0.2".parse().unwrap(), None);
        body.extend(attr(IFA_LOCAL, &[10, 79, 0]));
        assert_eq!(replies(&message(libc::RTM_NEWADDR, 0, 0, &body)), [None]);
        let mut body = address_body(3, 32, "10.79.0.2".parse().unwrap(), None);
        body[0] = libc::AF_PACKET as u8;
        assert_eq!(replies(&message(libc::RTM_NEWADDR, 0, 0, &body)), [None]);
        assert_eq!(replies(&message(libc::RTM_NEWADDR, 0, 0, &[2, 24, 0, 0])), [None]);
    }

    #[test]
    fn a_truncated_attribute_drops_its_message() {
        let whole = link_body(7, libc::ARPHRD_ETHER, "veth0", Some("veth"), &MAC);
        assert!(replies_one(&message(libc::RTM_NEWLINK, 0, 0, &whole)).is_some());
        // The last attribute (the nested kind) claims more than the message holds.
        let mut body = whole.clone();
        let last = IFINFOMSG_LEN + 12 + 12;
        assert_eq!(u16::from_ne_bytes([body[last + 2], body[last + 3]]), IFLA_LINKINFO | 0x8000);
        body[last..last + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert_eq!(replies(&message(libc::RTM_NEWLINK, 0, 0, &body)), [None]);
        // The message cut inside an attribute: its header says more than is there.
        let mut body = whole.clone();
        body.truncate(IFINFOMSG_LEN + 6);
        assert_eq!(replies(&message(libc::RTM_NEWLINK, 0, 0, &body)), [None]);
        // The nested kind attribute malformed inside an intact IFLA_LINKINFO.
        let mut body = link_body(7, libc::ARPHRD_ETHER, "br0", None, &MAC);
        body.extend(attr(IFLA_LINKINFO, &[0xff, 0x00, 1, 0, b'b', b'r', 0, 0]));
        assert_eq!(replies(&message(libc::RTM_NEWLINK, 0, 0, &body)), [None]);
        assert_eq!(attributes(&[8, 0, 3, 0, b'l', b'o']).collect::<Vec<_>>(), [Err(Malformed)]);
        assert_eq!(attributes(&[2, 0, 3, 0]).collect::<Vec<_>>(), [Err(Malformed)]);
    }

    #[test]
    fn a_message_longer_than_its_datagram_ends_the_walk() {
        let first = message(libc::RTM_NEWLINK, 0, 0, &link_body(1, 772, "lo", None, &[0; 6]));
        let mut second = message(libc::RTM_NEWLINK, 0, 0, &link_body(2, 1, "eth0", None, &MAC));
        second[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        let mut datagram = first.clone();
        datagram.extend(&second);
        let walked: Vec<Message<'_>> = messages(&datagram).collect();
        assert_eq!(walked.len(), 1, "{walked:?}");
        assert_eq!(walked[0].body.len(), first.len() - NLMSG_HDRLEN);
        // A length shorter than a header, and a datagram shorter than one.
        let mut short = first.clone();
        short[0..4].copy_from_slice(&8u32.to_ne_bytes());
        assert_eq!(messages(&short).count(), 0);
        assert_eq!(messages(&first[..NLMSG_HDRLEN - 1]).count(), 0);
        // A message too short for its family header.
        assert_eq!(replies(&message(libc::RTM_NEWLINK, 0, 0, &[0; 4])), [None]);
    }

    #[test]
    fn a_dump_ends_at_done_and_a_kernel_error_is_an_error() {
        let link = link_body(1, 772, "lo", None, &[0; 6]);
        let mut gather = Gather::new(Dump::Links, 5);
        let mut datagram = message(libc::RTM_NEWLINK, libc::NLM_F_MULTI as u16, 5, &link);
        // Replies to something else: no link, no end.
        datagram.extend(message(libc::RTM_NEWLINK, 0, 9, &link_body(2, 1, "eth0", None, &MAC)));
        datagram.extend(done(9, 0));
        assert!(!gather.feed(&datagram).unwrap());
        assert!(gather.feed(&done(5, 0)).unwrap());
        assert_eq!(gather.replies.len(), 1);
        assert!(!gather.interrupted);

        let refused = Gather::new(Dump::Addresses, 5).feed(&error(5, -libc::EPERM)).unwrap_err();
        assert!(matches!(refused, RtnlError::Refused { dump: Dump::Addresses, errno: libc::EPERM }));
        assert_eq!(
            refused.to_string(),
            format!("the kernel refused the address dump: {}", io::Error::from_raw_os_error(libc::EPERM))
        );
        // A dump that failed half way ends with NLMSG_DONE carrying the error.
        let mut gather = Gather::new(Dump::Links, 5);
        let mut datagram = message(libc::RTM_NEWLINK, libc::NLM_F_MULTI as u16, 5, &link);
        datagram.extend(done(5, -libc::EMSGSIZE));
        assert!(matches!(gather.feed(&datagram), Err(RtnlError::Refused { errno: libc::EMSGSIZE, .. })));
        // An ack is not the end.
        assert!(!Gather::new(Dump::Links, 5).feed(&error(5, 0)).unwrap());
        assert_eq!(replies_one(&error(5, i32::MIN)), Some(Reply::Error(i32::MAX)));
    }

    #[test]
    fn an_inconsistent_dump_is_noticed() {
        let mut gather = Gather::new(Dump::Links, 1);
        let link = link_body(1, 772, "lo", None, &[0; 6]);
        let flags = (libc::NLM_F_MULTI as u16) | NLM_F_DUMP_INTR;
        let mut datagram = message(libc::RTM_NEWLINK, flags, 1, &link);
        datagram.extend(done(1, 0));
        assert!(gather.feed(&datagram).unwrap());
        assert!(gather.interrupted);
    }

    #[test]
    fn dump_requests_ask_for_every_family() {
        let check = |dump: Dump, kind: u16, len: usize| {
            let request = dump.request(42);
            let walked: Vec<Message<'_>> = messages(&request).collect();
            assert_eq!(walked.len(), 1);
            let m = walked[0];
            assert_eq!((m.kind, m.seq, m.body.len()), (kind, 42, len), "{dump}");
            assert_eq!(m.flags, (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16);
            assert!(m.body.iter().all(|b| *b == 0), "AF_UNSPEC, no filter");
        };
        check(Dump::Links, libc::RTM_GETLINK, IFINFOMSG_LEN);
        check(Dump::Addresses, libc::RTM_GETADDR, IFADDRMSG_LEN);
    }
}
