//! The flow-capture tc classifiers (DESIGN.md FLOW-1). Both only observe: the verdict is always
//! `TC_ACT_PIPE`, so a bug here can never cut or alter traffic.
//!
//! - `innerwall_egress` remembers the connections this host initiates (TCP SYN without ACK,
//!   the first UDP datagram of a 5-tuple, ICMP echo requests) in the `CONNS` LRU map.
//! - `innerwall_ingress` parses Ethernet / IPv4 / IPv6 (walking hop-by-hop, routing,
//!   destination-options, fragment and AH headers) / TCP / UDP / ICMP / ICMPv6, skips packets
//!   that belong to a connection this host initiated (the reversed tuple is in `CONNS` as
//!   outbound), and aggregates the rest per `FlowKey` into the active flow map.
//! - `innerwall_ingress_l3` / `innerwall_egress_l3` are the same for layer-3 interfaces
//!   (WireGuard, tun), whose packets start at the IP header: the family comes from
//!   `skb->protocol` instead of an EtherType.
//!
//! ICMP errors (v4: destination unreachable, source quench, redirect, time exceeded, parameter
//! problem; v6: destination unreachable, packet too big, time exceeded, parameter problem) are
//! never inbound flows: an error is by definition about a packet this host sent (or one forged
//! to look so), not a connection a peer starts. The program reads the quoted IP header and the
//! first 8 bytes of its L4 header (ports, or an echo identifier), looks the quoted packet up in
//! `CONNS` from this host's side (quoted source = local), and only counts it: related when the
//! connection is known — whichever side started it, so an error about our reply to an inbound
//! connection is related too — unmatched otherwise (evicted, older than the program, forged).
//! Extension headers in a quoted IPv6 packet are not walked (its ports then read as 0 and the
//! error counts as unmatched); it is still not recorded.
//!
//! Connection table sizing: the kernel's own conntrack cannot be asked from here. The
//! `bpf_skb_ct_lookup` kfunc needs a GPL-compatible program (this object is Apache-2.0) and a
//! loader that resolves kfunc calls against kernel BTF, which aya 0.14 does not. So `CONNS` is
//! an LRU map sized above conntrack's usual table (see `CONN_ENTRIES`), and every packet of a
//! known connection, in either direction, looks its entry up, which marks it referenced. The
//! kernel's LRU evicts entries never referenced since they were inserted (one-off datagrams,
//! scans) before referenced ones, so a conversation that keeps sending outlives a flood of new
//! connections; among entries that are all in use it approximates least-recently-used. New
//! entries are counted (`COUNTER_CONN_INSERTED`), which gives the agent a lower bound of
//! evictions; a UDP datagram that looks like a reply to an evicted entry (no entry, from a
//! remote service port, below 32768, to a local ephemeral port, 32768 and up: the test TCP
//! without a SYN gets too) is still recorded but counted, and the agent turns the count into a
//! suspect-direction gap on the window. The test is per packet on purpose: "no entry, while the
//! table has evicted something" would need the evictions summed over CPUs and the capacity in
//! the program, and would miss the replies to conversations older than the program, which are
//! just as misclassified. What stays: a reply whose entry was evicted (a conversation idle
//! while more than the table's capacity of new connections came and went) is recorded as
//! inbound, as conntrack would call it new once its own entry timed out; it is no longer silent.
//!
//! Diagnostics go through aya-log (a ring buffer the agent reads at each drain), off the hot
//! path: a failure counter logs only when it reaches a power of two, so a full map costs a
//! log line per doubling, not per packet. The ring-buffer helpers are not GPL-only, so the
//! object keeps its Apache-2.0 licence.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST, TC_ACT_PIPE},
    btf_maps::{Array, LruHashMap, PerCpuArray, PerCpuHashMap},
    helpers::bpf_ktime_get_ns,
    macros::{btf_map, classifier},
    programs::TcContext,
};
use aya_log_ebpf::warn;
use innerwall_ebpf_common::{
    ABI_VERSION, CONN_ENTRIES, COUNTER_ARRAY_SLOTS, COUNTER_CONN_INSERT_FAILED, COUNTER_CONN_INSERTED,
    COUNTER_FLOW_INSERT_FAILED, COUNTER_ICMP_ERRORS_RELATED, COUNTER_ICMP_ERRORS_UNMATCHED,
    COUNTER_REPLIES_SKIPPED, COUNTER_UDP_REPLY_LIKE_UNMATCHED, ConnKey, ConnValue, DEFAULT_FLOW_ENTRIES,
    DIR_INBOUND, DIR_OUTBOUND, FAMILY_V4, FAMILY_V6, FlowKey, FlowValue, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP,
    PROTO_UDP, counter_slot,
};

const ETH_HDR_LEN: usize = 14;
const ETH_TYPE_OFFSET: usize = 12;
/// Bytes before the IP header on layer-3 interfaces (WireGuard, tun).
const NO_L2_HDR: usize = 0;
const IPV4_MIN_HDR_LEN: usize = 20;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPV6_HDR_LEN: usize = 40;
/// IPv6 extension headers walked before giving up (the verifier needs a bound).
const MAX_IPV6_EXT_HEADERS: usize = 6;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_SOURCE_QUENCH: u8 = 4;
const ICMP_REDIRECT: u8 = 5;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
/// An ICMP error's header before the quoted packet (type, code, checksum, 4 bytes that vary).
const ICMP_ERROR_HDR_LEN: usize = 8;
/// Start of Linux's default ephemeral port range (`ip_local_port_range`); ports below it are
/// taken as service ports (see `COUNTER_UDP_REPLY_LIKE_UNMATCHED`).
const EPHEMERAL_PORT_MIN: u16 = 32768;
const EEXIST: i32 = 17;

/// Inbound flow records (per CPU: no atomics, no lost increments; the agent sums the CPUs),
/// written while `ACTIVE_MAP[0] == 0`. Resized by the agent before load.
#[btf_map]
static FLOWS_A: PerCpuHashMap<FlowKey, FlowValue, { DEFAULT_FLOW_ENTRIES as usize }> = PerCpuHashMap::new();

/// Inbound flow records, written while `ACTIVE_MAP[0] == 1`.
#[btf_map]
static FLOWS_B: PerCpuHashMap<FlowKey, FlowValue, { DEFAULT_FLOW_ENTRIES as usize }> = PerCpuHashMap::new();

/// Which flow map the programs write to; the agent flips it to drain the other one.
#[btf_map]
static ACTIVE_MAP: Array<u32, 1> = Array::new();

/// Monotonic per-CPU counters (indices in innerwall-ebpf-common: insert failures, …).
#[btf_map]
static COUNTERS: PerCpuArray<u64, { COUNTER_ARRAY_SLOTS as usize }> = PerCpuArray::new();

/// Connections with a known direction (who sent the first packet), keyed from this host's side.
#[btf_map]
static CONNS: LruHashMap<ConnKey, ConnValue, { CONN_ENTRIES as usize }> = LruHashMap::new();

/// Records inbound flows on an Ethernet interface; never drops.
#[classifier]
pub fn innerwall_ingress(ctx: TcContext) -> i32 {
    if let Some(packet) = parse::<ETH_HDR_LEN>(&ctx) {
        ingress(&ctx, &packet);
    }
    TC_ACT_PIPE
}

/// Remembers outbound initiations on an Ethernet interface; never drops.
#[classifier]
pub fn innerwall_egress(ctx: TcContext) -> i32 {
    if let Some(packet) = parse::<ETH_HDR_LEN>(&ctx) {
        egress(&ctx, &packet);
    }
    TC_ACT_PIPE
}

/// Records inbound flows on a layer-3 interface (no Ethernet header); never drops.
#[classifier]
pub fn innerwall_ingress_l3(ctx: TcContext) -> i32 {
    if let Some(packet) = parse::<NO_L2_HDR>(&ctx) {
        ingress(&ctx, &packet);
    }
    TC_ACT_PIPE
}

/// Remembers outbound initiations on a layer-3 interface; never drops.
#[classifier]
pub fn innerwall_egress_l3(ctx: TcContext) -> i32 {
    if let Some(packet) = parse::<NO_L2_HDR>(&ctx) {
        egress(&ctx, &packet);
    }
    TC_ACT_PIPE
}

/// The fields of one packet the programs need. Ports are 0 for non-first fragments and
/// protocols without ports; for ICMP echo both hold the identifier.
struct Packet {
    family: u8,
    protocol: u8,
    src: [u8; 16],
    dst: [u8; 16],
    src_port: u16,
    dst_port: u16,
    tcp_flags: u8,
    icmp_type: u8,
    icmp_code: u8,
    /// Whether the L4 header was read.
    has_l4: bool,
    /// For an ICMP / ICMPv6 error (see the module comment), the offset of the packet it
    /// quotes; 0 otherwise.
    quote_offset: usize,
}

/// Reads a `T` at `offset` into the packet: straight from the linear data when it is there
/// (the common case: a few instructions), else through `bpf_skb_load_bytes` (headers in a
/// paged fragment). Never pulls or otherwise changes the skb.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() <= ctx.data_end() {
        // SAFETY: the bytes [start + offset, start + offset + size_of::<T>()) lie within the
        // linear packet data (checked against data_end just above, which is also what the
        // verifier checks), and T is plain data read unaligned.
        Some(unsafe { core::ptr::read_unaligned((start + offset) as *const T) })
    } else {
        ctx.load::<T>(offset).ok()
    }
}

/// Parses a packet whose IP header starts at `L2` ([`ETH_HDR_LEN`], or [`NO_L2_HDR`] on
/// layer-3 interfaces, where `skb->protocol` gives the EtherType).
#[inline(always)]
fn parse<const L2: usize>(ctx: &TcContext) -> Option<Packet> {
    let ether_type = if L2 == NO_L2_HDR {
        // `skb->protocol` holds the big-endian EtherType in its low 16 bits.
        u16::from_be(ctx.skb.protocol() as u16)
    } else {
        u16::from_be(read::<u16>(ctx, ETH_TYPE_OFFSET)?)
    };
    let mut packet = Packet {
        family: 0,
        protocol: 0,
        src: [0; 16],
        dst: [0; 16],
        src_port: 0,
        dst_port: 0,
        tcp_flags: 0,
        icmp_type: 0,
        icmp_code: 0,
        has_l4: false,
        quote_offset: 0,
    };
    let l4_offset;
    match ether_type {
        ETH_P_IP => {
            // Two bytes, not one: at offset 0 (layer-3 interfaces) the one-byte bounds check
            // compiles to `data < data_end`, from which the verifier grants no range.
            let version_ihl = read::<[u8; 2]>(ctx, L2)?[0];
            let ihl = usize::from(version_ihl & 0x0f) * 4;
            if ihl < IPV4_MIN_HDR_LEN {
                return None;
            }
            packet.family = FAMILY_V4;
            packet.protocol = read::<u8>(ctx, L2 + 9)?;
            let src = read::<[u8; 4]>(ctx, L2 + 12)?;
            let dst = read::<[u8; 4]>(ctx, L2 + 16)?;
            packet.src[..4].copy_from_slice(&src);
            packet.dst[..4].copy_from_slice(&dst);
            let frag = u16::from_be(read::<u16>(ctx, L2 + 6)?);
            if frag & 0x1fff != 0 {
                // A non-first fragment carries no L4 header.
                return Some(packet);
            }
            l4_offset = L2 + ihl;
        }
        ETH_P_IPV6 => {
            packet.family = FAMILY_V6;
            packet.src = read::<[u8; 16]>(ctx, L2 + 8)?;
            packet.dst = read::<[u8; 16]>(ctx, L2 + 24)?;
            let mut next = read::<u8>(ctx, L2 + 6)?;
            let mut offset = L2 + IPV6_HDR_LEN;
            let mut first_fragment = true;
            for _ in 0..MAX_IPV6_EXT_HEADERS {
                let len = match next {
                    NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST => {
                        (usize::from(read::<u8>(ctx, offset + 1)?) + 1) * 8
                    }
                    NEXTHDR_AUTH => (usize::from(read::<u8>(ctx, offset + 1)?) + 2) * 4,
                    NEXTHDR_FRAGMENT => {
                        let frag = u16::from_be(read::<u16>(ctx, offset + 2)?);
                        if frag & 0xfff8 != 0 {
                            first_fragment = false;
                        }
                        8
                    }
                    _ => break,
                };
                next = read::<u8>(ctx, offset)?;
                offset += len;
            }
            packet.protocol = next;
            if !first_fragment {
                return Some(packet);
            }
            l4_offset = offset;
        }
        _ => return None,
    }
    match packet.protocol {
        PROTO_TCP | PROTO_UDP => {
            let ports = read::<[u8; 4]>(ctx, l4_offset)?;
            packet.src_port = u16::from_be_bytes([ports[0], ports[1]]);
            packet.dst_port = u16::from_be_bytes([ports[2], ports[3]]);
            if packet.protocol == PROTO_TCP {
                packet.tcp_flags = read::<u8>(ctx, l4_offset + 13)?;
            }
            packet.has_l4 = true;
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            let head = read::<[u8; 8]>(ctx, l4_offset)?;
            packet.icmp_type = head[0];
            packet.icmp_code = head[1];
            if is_echo(&packet) {
                let id = u16::from_be_bytes([head[4], head[5]]);
                packet.src_port = id;
                packet.dst_port = id;
            }
            packet.has_l4 = true;
            if is_icmp_error(packet.protocol, packet.icmp_type) {
                packet.quote_offset = l4_offset + ICMP_ERROR_HDR_LEN;
            }
        }
        _ => {}
    }
    Some(packet)
}

#[inline(always)]
fn is_icmp_error(protocol: u8, icmp_type: u8) -> bool {
    match protocol {
        PROTO_ICMP => matches!(
            icmp_type,
            ICMP_DEST_UNREACH
                | ICMP_SOURCE_QUENCH
                | ICMP_REDIRECT
                | ICMP_TIME_EXCEEDED
                | ICMP_PARAMETER_PROBLEM
        ),
        PROTO_ICMPV6 => matches!(
            icmp_type,
            ICMPV6_DEST_UNREACH | ICMPV6_PACKET_TOO_BIG | ICMPV6_TIME_EXCEEDED | ICMPV6_PARAMETER_PROBLEM
        ),
        _ => false,
    }
}

/// The connection of the packet an ICMP error quotes at `offset`, from this host's side: the
/// quoted packet went out, so its source is local. Ports are read from the quoted L4 header's
/// first 8 bytes (always quoted); an echo request quotes its identifier as both ports, as
/// `CONNS` keys echoes. `None` if the quote is too short or malformed.
#[inline(always)]
fn parse_quoted(ctx: &TcContext, family: u8, offset: usize) -> Option<ConnKey> {
    // Whole headers in one `bpf_skb_load_bytes` each (errors are rare; no fast path): one
    // buffer per header keeps this frame small enough to sit on top of the ingress path's.
    let mut conn = ConnKey { family, ..ConnKey::default() };
    let l4: [u8; 8] = if family == FAMILY_V4 {
        let ip = ctx.load::<[u8; IPV4_MIN_HDR_LEN]>(offset).ok()?;
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        if ip[0] >> 4 != 4 || ihl < IPV4_MIN_HDR_LEN {
            return None;
        }
        conn.protocol = ip[9];
        conn.local[..4].copy_from_slice(&ip[12..16]);
        conn.remote[..4].copy_from_slice(&ip[16..20]);
        if u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff != 0 {
            return Some(conn);
        }
        ctx.load::<[u8; 8]>(offset + ihl).ok()?
    } else {
        let ip = ctx.load::<[u8; IPV6_HDR_LEN + 8]>(offset).ok()?;
        conn.protocol = ip[6];
        conn.local.copy_from_slice(&ip[8..24]);
        conn.remote.copy_from_slice(&ip[24..40]);
        let mut l4 = [0; 8];
        l4.copy_from_slice(&ip[IPV6_HDR_LEN..]);
        l4
    };
    match conn.protocol {
        PROTO_TCP | PROTO_UDP => {
            conn.local_port = u16::from_be_bytes([l4[0], l4[1]]);
            conn.remote_port = u16::from_be_bytes([l4[2], l4[3]]);
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            let echo_request =
                if conn.protocol == PROTO_ICMP { ICMP_ECHO_REQUEST } else { ICMPV6_ECHO_REQUEST };
            if l4[0] == echo_request {
                let id = u16::from_be_bytes([l4[4], l4[5]]);
                conn.local_port = id;
                conn.remote_port = id;
            }
        }
        _ => {}
    }
    Some(conn)
}

/// Counts an ICMP error as related to a known connection or unmatched. Not inlined: its
/// stack frame then does not add to the ingress path's.
#[inline(never)]
fn icmp_error(ctx: &TcContext, packet: &Packet) {
    let related =
        parse_quoted(ctx, packet.family, packet.quote_offset).is_some_and(|conn| direction(&conn) != 0);
    count(if related { COUNTER_ICMP_ERRORS_RELATED } else { COUNTER_ICMP_ERRORS_UNMATCHED });
}

#[inline(always)]
fn is_echo(packet: &Packet) -> bool {
    is_echo_request(packet) || is_echo_reply(packet)
}

#[inline(always)]
fn is_echo_request(packet: &Packet) -> bool {
    match packet.protocol {
        PROTO_ICMP => packet.icmp_type == ICMP_ECHO_REQUEST,
        PROTO_ICMPV6 => packet.icmp_type == ICMPV6_ECHO_REQUEST,
        _ => false,
    }
}

#[inline(always)]
fn is_echo_reply(packet: &Packet) -> bool {
    match packet.protocol {
        PROTO_ICMP => packet.icmp_type == ICMP_ECHO_REPLY,
        PROTO_ICMPV6 => packet.icmp_type == ICMPV6_ECHO_REPLY,
        _ => false,
    }
}

/// The connection as seen from this host for a packet going out.
#[inline(always)]
fn egress_conn(packet: &Packet) -> ConnKey {
    ConnKey {
        local: packet.src,
        remote: packet.dst,
        local_port: packet.src_port,
        remote_port: packet.dst_port,
        protocol: packet.protocol,
        family: packet.family,
        _pad: [0; 2],
    }
}

/// The connection as seen from this host for a packet coming in.
#[inline(always)]
fn ingress_conn(packet: &Packet) -> ConnKey {
    ConnKey {
        local: packet.dst,
        remote: packet.src,
        local_port: packet.dst_port,
        remote_port: packet.src_port,
        protocol: packet.protocol,
        family: packet.family,
        _pad: [0; 2],
    }
}

/// Records `conn` with `direction` unless it is already known (first writer wins).
#[inline(always)]
fn learn(ctx: &TcContext, conn: &ConnKey, direction: u8) {
    insert_direction(ctx, conn, direction, u64::from(BPF_NOEXIST));
}

/// Records `conn` with `direction`, replacing what was known (a new SYN or echo request
/// restarts the conversation); no write if the direction is already that one.
#[inline(always)]
fn relearn(ctx: &TcContext, conn: &ConnKey, known: u8, direction: u8) {
    if known != direction {
        insert_direction(
            ctx,
            conn,
            direction,
            if known == 0 { u64::from(BPF_NOEXIST) } else { u64::from(BPF_ANY) },
        );
    }
}

#[inline(always)]
fn insert_direction(ctx: &TcContext, conn: &ConnKey, direction: u8, flags: u64) {
    let value = ConnValue { direction, _pad: [0; 7] };
    match CONNS.insert(conn, value, flags) {
        Ok(()) => {
            if flags == u64::from(BPF_NOEXIST) {
                count(COUNTER_CONN_INSERTED);
            }
        }
        Err(err) if err == -EEXIST => {}
        Err(err) => {
            let failed = count(COUNTER_CONN_INSERT_FAILED);
            if failed.is_power_of_two() {
                warn!(ctx, "connection table insert failed (error {}): {} failures on this CPU", err, failed);
            }
        }
    }
}

#[inline(always)]
fn direction(conn: &ConnKey) -> u8 {
    // SAFETY: the value is copied out at once; a concurrent update can at worst give the old
    // or the new direction byte, both valid.
    unsafe { CONNS.get(conn) }.map_or(0, |value| value.direction)
}

#[inline(always)]
fn egress(ctx: &TcContext, packet: &Packet) {
    if !packet.has_l4 {
        return;
    }
    match packet.protocol {
        PROTO_TCP if packet.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN => {
            let conn = egress_conn(packet);
            relearn(ctx, &conn, direction(&conn), DIR_OUTBOUND);
        }
        PROTO_UDP => {
            // The lookup on every datagram also marks a known entry referenced, so the LRU
            // keeps an active conversation.
            let conn = egress_conn(packet);
            if direction(&conn) == 0 {
                learn(ctx, &conn, DIR_OUTBOUND);
            }
        }
        PROTO_ICMP | PROTO_ICMPV6 if is_echo_request(packet) => {
            let conn = egress_conn(packet);
            relearn(ctx, &conn, direction(&conn), DIR_OUTBOUND);
        }
        _ => {}
    }
}

#[inline(always)]
fn ingress(ctx: &TcContext, packet: &Packet) {
    if packet.quote_offset != 0 {
        // Never a flow (see the module comment).
        icmp_error(ctx, packet);
        return;
    }
    // The flow map this packet's record goes to, and the side of its gap counters.
    let side = u32::from(ACTIVE_MAP.get(0).copied().unwrap_or(0) != 0);
    // 0: not a connection start; 1: a new connection; 2: new if the key is new.
    let new_connection: u64 = if !packet.has_l4 {
        2
    } else {
        match packet.protocol {
            PROTO_TCP => {
                let conn = ingress_conn(packet);
                if packet.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN {
                    relearn(ctx, &conn, direction(&conn), DIR_INBOUND);
                    1
                } else {
                    match direction(&conn) {
                        DIR_OUTBOUND => return skip_reply(),
                        DIR_INBOUND => 0,
                        _ => {
                            // Mid-stream without a SYN seen (started before attach, or evicted):
                            // an ephemeral local port talking to a service port is taken as a
                            // connection this host initiated.
                            if packet.dst_port >= EPHEMERAL_PORT_MIN && packet.src_port < EPHEMERAL_PORT_MIN {
                                learn(ctx, &conn, DIR_OUTBOUND);
                                return skip_reply();
                            }
                            learn(ctx, &conn, DIR_INBOUND);
                            0
                        }
                    }
                }
            }
            PROTO_UDP => {
                let conn = ingress_conn(packet);
                match direction(&conn) {
                    DIR_OUTBOUND => return skip_reply(),
                    DIR_INBOUND => 0,
                    _ => {
                        if packet.dst_port >= EPHEMERAL_PORT_MIN && packet.src_port < EPHEMERAL_PORT_MIN {
                            count(counter_slot(COUNTER_UDP_REPLY_LIKE_UNMATCHED, side));
                        }
                        learn(ctx, &conn, DIR_INBOUND);
                        1
                    }
                }
            }
            _ if is_echo_request(packet) => {
                let conn = ingress_conn(packet);
                match direction(&conn) {
                    DIR_INBOUND => 0,
                    known => {
                        relearn(ctx, &conn, known, DIR_INBOUND);
                        1
                    }
                }
            }
            _ if is_echo_reply(packet) => {
                if direction(&ingress_conn(packet)) == DIR_OUTBOUND {
                    return skip_reply();
                }
                2
            }
            _ => 2,
        }
    };
    let dst_port = match packet.protocol {
        PROTO_ICMP | PROTO_ICMPV6 => u16::from(packet.icmp_type) << 8 | u16::from(packet.icmp_code),
        _ => packet.dst_port,
    };
    let key = FlowKey {
        src: packet.src,
        dst: packet.dst,
        dst_port,
        protocol: packet.protocol,
        family: packet.family,
        _pad: [0; 4],
    };
    if side == 0 {
        record(ctx, &FLOWS_A, &key, new_connection, side);
    } else {
        record(ctx, &FLOWS_B, &key, new_connection, side);
    }
}

#[inline(always)]
fn record(
    ctx: &TcContext,
    map: &PerCpuHashMap<FlowKey, FlowValue, { DEFAULT_FLOW_ENTRIES as usize }>,
    key: &FlowKey,
    new_connection: u64,
    side: u32,
) {
    let bytes = u64::from(ctx.len());
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(value) = map.get_ptr_mut(key) {
        add(value, bytes, new_connection & 1, now);
        return;
    }
    let value = FlowValue {
        packets: 1,
        bytes,
        new_connections: u64::from(new_connection != 0),
        first_seen_ns: now,
        last_seen_ns: now,
    };
    match map.insert(key, value, u64::from(BPF_NOEXIST)) {
        Ok(()) => {}
        // Another CPU inserted the key meanwhile: add to its record.
        Err(err) if err == -EEXIST => {
            if let Some(value) = map.get_ptr_mut(key) {
                add(value, bytes, new_connection & 1, now);
            }
        }
        // Map full (E2BIG) or out of memory: counted, never silent.
        Err(err) => {
            let dropped = count(counter_slot(COUNTER_FLOW_INSERT_FAILED, side));
            if dropped.is_power_of_two() {
                warn!(ctx, "flow map full (error {}): {} packets unrecorded on this CPU", err, dropped);
            }
        }
    }
}

#[inline(always)]
fn add(value: *mut FlowValue, bytes: u64, new_connection: u64, now: u64) {
    // SAFETY: `value` is this CPU's slot of a live per-CPU map element, valid for this
    // program run and written by no other CPU. A slot another CPU created the element
    // for starts zeroed, hence the first-seen fill-in.
    unsafe {
        if (*value).packets == 0 {
            (*value).first_seen_ns = now;
        }
        (*value).packets += 1;
        (*value).bytes += bytes;
        (*value).new_connections += new_connection;
        (*value).last_seen_ns = now;
    }
}

#[inline(always)]
fn skip_reply() {
    count(COUNTER_REPLIES_SKIPPED);
}

/// Increments this CPU's counter `index` and returns its new value (0 if the slot is missing,
/// which cannot happen for the fixed indices used here).
#[inline(always)]
fn count(index: u32) -> u64 {
    match COUNTERS.get_ptr_mut(index) {
        // SAFETY: this CPU's slot of a per-CPU array, valid for the whole program run and
        // touched by no other CPU, so a plain increment cannot race.
        Some(counter) => unsafe {
            *counter += 1;
            *counter
        },
        None => 0,
    }
}

/// The contract version this object was built against, read by the agent before it loads
/// anything. `link_section` takes only a literal: it is `innerwall_ebpf_common::ABI_SECTION`.
#[unsafe(link_section = "innerwall_abi")]
#[unsafe(no_mangle)]
static INNERWALL_ABI: u32 = ABI_VERSION;

/// Declared explicitly so the kernel sees the crate's real licence. It is not GPL
/// compatible, so GPL-only helpers are unavailable to these programs (none is used).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Nothing here can panic at run time (the verifier would reject the loop anyway);
    // no_std still demands a handler.
    loop {}
}
