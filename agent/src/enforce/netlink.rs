//! The netfilter netlink socket: one `sendmsg` per batch (after raising the send buffer with
//! `SO_SNDBUFFORCE`, since nftnl's page-wise sends get the tail refused), waiting for the
//! end-of-batch ack or the first error, dumps with `NLM_F_DUMP_INTR` detection, and the ruleset
//! generation id (`NFT_MSG_GETGEN`). A socket binds to the network namespace of the thread that
//! opens it; every operation opens its own, so stray replies never cross operations.

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

/// Netlink and kernel failures, with the operation that was refused.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("kernel refused {op}: {}{}", io::Error::from_raw_os_error(*.errno), .detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Refused { op: String, errno: i32, detail: Option<String> },
    #[error("netlink dump was interrupted by concurrent ruleset changes {0} times in a row")]
    Interrupted(u32),
    #[error("malformed netlink reply: {0}")]
    Malformed(&'static str),
}

impl NetlinkError {
    /// The kernel's errno, when the kernel refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Refused { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLMSGERR_ATTR_MSG: u16 = 1;
const RECV_BUF: usize = 1 << 20;

/// A parsed netlink message header and its full bytes (header included), 8-byte aligned so
/// libnftnl can read it in place.
#[derive(Debug, Clone)]
pub struct Message {
    words: Vec<u64>,
    len: usize,
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
}

impl Message {
    fn new(bytes: &[u8]) -> Message {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            words[i] = u64::from_ne_bytes(w);
        }
        Message {
            words,
            len: bytes.len(),
            kind: u16::from_ne_bytes([bytes[4], bytes[5]]),
            flags: u16::from_ne_bytes([bytes[6], bytes[7]]),
            seq: u32::from_ne_bytes(bytes[8..12].try_into().expect("4 bytes")),
        }
    }

    /// The message's nftables message type (`NFT_MSG_*`), without the subsystem id.
    pub fn nft_type(&self) -> u16 {
        self.kind & 0xff
    }

    /// The header pointer libnftnl's parsers take.
    pub fn header(&self) -> *const libc::nlmsghdr {
        self.words.as_ptr().cast()
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_ne_bytes()).take(self.len).collect()
    }

    /// Payload after the netlink header and the 4-byte `nfgenmsg`.
    fn nf_attributes(&self) -> Vec<u8> {
        self.bytes().get(NLMSG_HDRLEN + 4..).map(<[u8]>::to_vec).unwrap_or_default()
    }
}

/// Splits a buffer into netlink messages.
pub fn split(buf: &[u8]) -> Result<Vec<Message>, NetlinkError> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(NetlinkError::Malformed("message length out of bounds"));
        }
        out.push(Message::new(&rest[..len]));
        rest = &rest[len.next_multiple_of(4).min(rest.len())..];
    }
    Ok(out)
}

/// An `NLMSG_ERROR` payload: errno (0 = ack), the echoed request's seq, and an extended-ack
/// message if the kernel gave one.
fn parse_error(msg: &Message) -> Result<(i32, u32, Option<String>), NetlinkError> {
    let bytes = msg.bytes();
    let body = bytes.get(NLMSG_HDRLEN..).ok_or(NetlinkError::Malformed("short error message"))?;
    if body.len() < 4 + NLMSG_HDRLEN {
        return Err(NetlinkError::Malformed("short error message"));
    }
    let errno = -i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
    let echoed_len = u32::from_ne_bytes(body[4..8].try_into().expect("4 bytes")) as usize;
    let seq = u32::from_ne_bytes(body[12..16].try_into().expect("4 bytes"));
    // With NETLINK_CAP_ACK only the echoed header is present unless the flag says otherwise.
    let capped = msg.flags & 0x100 != 0; // NLM_F_CAPPED
    let attrs_at = 4 + if capped { NLMSG_HDRLEN } else { echoed_len.next_multiple_of(4) };
    let detail = attributes(body.get(attrs_at..).unwrap_or_default())
        .into_iter()
        .find(|(kind, _)| *kind == NLMSGERR_ATTR_MSG)
        .map(|(_, v)| String::from_utf8_lossy(v).trim_end_matches('\0').to_owned());
    Ok((errno, seq, detail))
}

/// Netlink attributes (type without flag bits, value) of a buffer.
pub fn attributes(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    out
}

/// One netfilter netlink socket in the calling thread's network namespace.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    #[allow(unsafe_code)]
    pub fn open() -> Result<Socket, NetlinkError> {
        let io = |what| move |source| NetlinkError::Io { what, source };
        // SAFETY: plain socket(2) call; the returned descriptor is checked and then owned.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_NETFILTER)
        };
        if fd < 0 {
            return Err(io("socket")(io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let socket = Socket { fd };
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid "kernel assigns the port id".
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: addr is a valid sockaddr_nl and the length matches it.
        let rc = unsafe {
            libc::bind(socket.fd.as_raw_fd(), (&raw const addr).cast(), size_of::<libc::sockaddr_nl>() as u32)
        };
        if rc < 0 {
            return Err(io("bind")(io::Error::last_os_error()));
        }
        // Small acks with the kernel's explanation instead of echoed 64 KiB requests.
        socket.set_int(libc::SOL_NETLINK, libc::NETLINK_CAP_ACK, 1).map_err(io("NETLINK_CAP_ACK"))?;
        socket.set_int(libc::SOL_NETLINK, libc::NETLINK_EXT_ACK, 1).map_err(io("NETLINK_EXT_ACK"))?;
        Ok(socket)
    }

    #[allow(unsafe_code)]
    fn set_int(&self, level: i32, name: i32, value: i32) -> io::Result<()> {
        // SAFETY: value is a live c_int and the length passed is its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&raw const value).cast(),
                size_of::<i32>() as u32,
            )
        };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    #[allow(unsafe_code)]
    fn send(&self, buf: &[u8]) -> Result<(), NetlinkError> {
        // Needs CAP_NET_ADMIN, which the agent has; a batch of several MB needs it.
        let size = i32::try_from(buf.len() + (1 << 16)).unwrap_or(i32::MAX);
        self.set_int(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, size)
            .map_err(|source| NetlinkError::Io { what: "SO_SNDBUFFORCE", source })?;
        // SAFETY: sockaddr_nl is plain data; all-zero addresses the kernel (port id 0).
        let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as u16;
        loop {
            // SAFETY: buf and kernel are valid for the lengths passed.
            let sent = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    0,
                    (&raw const kernel).cast(),
                    size_of::<libc::sockaddr_nl>() as u32,
                )
            };
            if sent < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(NetlinkError::Io { what: "send", source: err });
            }
            if sent as usize != buf.len() {
                return Err(NetlinkError::Malformed("short netlink send"));
            }
            return Ok(());
        }
    }

    #[allow(unsafe_code)]
    fn recv(&self, buf: &mut [u8]) -> Result<Vec<Message>, NetlinkError> {
        loop {
            // SAFETY: buf is valid for writes of its full length.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(NetlinkError::Io { what: "recv", source: err });
            }
            return split(&buf[..n as usize]);
        }
    }
}

/// Sends a finalized batch as one `sendmsg` and waits for the ack of `last_seq` (the
/// end-of-batch marker on kernels that ack it, else the last message) or the first error.
/// `describe(seq)` names the refused message in the error.
pub fn send_batch(
    bytes: &[u8],
    messages: usize,
    last_seq: u32,
    describe: impl Fn(u32) -> String,
) -> Result<(), NetlinkError> {
    let socket = Socket::open()?;
    // Every message is acked; each ack costs a socket buffer (~1 KiB of receive-buffer
    // accounting), and a dropped ack (ENOBUFS) would leave the outcome unknown.
    let rcvbuf = i32::try_from((messages * 2048).max(1 << 20)).unwrap_or(i32::MAX);
    socket
        .set_int(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, rcvbuf)
        .map_err(|source| NetlinkError::Io { what: "SO_RCVBUFFORCE", source })?;
    socket.send(bytes)?;
    let mut buf = vec![0u8; RECV_BUF];
    loop {
        for msg in socket.recv(&mut buf)? {
            if msg.kind != NLMSG_ERROR {
                continue;
            }
            let (errno, seq, detail) = parse_error(&msg)?;
            if errno != 0 {
                return Err(NetlinkError::Refused { op: describe(seq), errno, detail });
            }
            if seq == last_seq {
                return Ok(());
            }
        }
    }
}

/// Sends one request and collects its replies: until `NLMSG_DONE` for a dump, until the ack
/// for a plain request. A kernel error is returned as `Refused { op, .. }`.
pub fn request(req: &[u8], op: &str) -> Result<Vec<Message>, NetlinkError> {
    let socket = Socket::open()?;
    socket.send(req)?;
    let mut buf = vec![0u8; RECV_BUF];
    let mut replies = Vec::new();
    loop {
        for msg in socket.recv(&mut buf)? {
            match msg.kind {
                NLMSG_DONE => {
                    if msg.flags & libc::NLM_F_DUMP_INTR as u16 != 0 {
                        return Err(NetlinkError::Interrupted(1));
                    }
                    return Ok(replies);
                }
                NLMSG_ERROR => {
                    let (errno, _, detail) = parse_error(&msg)?;
                    if errno != 0 {
                        return Err(NetlinkError::Refused { op: op.to_owned(), errno, detail });
                    }
                    return Ok(replies);
                }
                _ => {
                    if msg.flags & libc::NLM_F_DUMP_INTR as u16 != 0 {
                        return Err(NetlinkError::Interrupted(1));
                    }
                    replies.push(msg);
                }
            }
        }
    }
}

/// Runs a dump, retrying a few times when concurrent ruleset changes interrupt it.
pub fn dump(req: &[u8], op: &str) -> Result<Vec<Message>, NetlinkError> {
    const TRIES: u32 = 5;
    for _ in 0..TRIES {
        match request(req, op) {
            Err(NetlinkError::Interrupted(_)) => continue,
            other => return other,
        }
    }
    Err(NetlinkError::Interrupted(TRIES))
}

/// The current ruleset generation id of this network namespace (`NFT_MSG_GETGEN`). It changes
/// on every committed change to any table: a cheap trigger for a full comparison.
pub fn generation() -> Result<u32, NetlinkError> {
    let mut req = Vec::with_capacity(NLMSG_HDRLEN + 4);
    let kind = ((libc::NFNL_SUBSYS_NFTABLES as u16) << 8) | libc::NFT_MSG_GETGEN as u16;
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    req.extend_from_slice(&((NLMSG_HDRLEN + 4) as u32).to_ne_bytes());
    req.extend_from_slice(&kind.to_ne_bytes());
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family unspec, NFNETLINK_V0, res_id 0.
    req.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    for msg in request(&req, "reading the ruleset generation")? {
        if msg.nft_type() == libc::NFT_MSG_NEWGEN as u16 {
            let attrs = msg.nf_attributes();
            for (kind, value) in attributes(&attrs) {
                if kind == 1 && value.len() == 4 {
                    // NFTA_GEN_ID, big endian.
                    return Ok(u32::from_be_bytes(value.try_into().expect("4 bytes")));
                }
            }
        }
    }
    Err(NetlinkError::Malformed("no NFTA_GEN_ID in the NEWGEN reply"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_parses_error_messages() {
        // An NLMSG_ERROR with errno -2 (ENOENT), echoed header seq 7, capped, and an ext-ack
        // message attribute.
        let mut body = Vec::new();
        body.extend_from_slice(&(-2i32).to_ne_bytes());
        let mut echoed = [0u8; 16];
        echoed[..4].copy_from_slice(&16u32.to_ne_bytes());
        echoed[8..12].copy_from_slice(&7u32.to_ne_bytes());
        body.extend_from_slice(&echoed);
        let text = b"no such set\0";
        body.extend_from_slice(&((4 + text.len()) as u16).to_ne_bytes());
        body.extend_from_slice(&NLMSGERR_ATTR_MSG.to_ne_bytes());
        body.extend_from_slice(text);
        while body.len() % 4 != 0 {
            body.push(0);
        }
        let mut msg = Vec::new();
        msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        msg.extend_from_slice(&(0x100u16 | 0x200).to_ne_bytes());
        msg.extend_from_slice(&[0u8; 8]);
        msg.extend_from_slice(&body);
        let two = [msg.clone(), msg].concat();
        let msgs = split(&two).unwrap();
        assert_eq!(msgs.len(), 2);
        let (errno, seq, detail) = parse_error(&msgs[0]).unwrap();
        assert_eq!((errno, seq, detail.as_deref()), (2, 7, Some("no such set")));
        assert!(split(&two[..20]).is_err(), "a cut message is malformed");
    }
}
