//! Map names, key and value layouts shared by the eBPF programs (`agent-ebpf`) and the agent's
//! loader (`innerwall_agent::evidence::capture`). Everything here is `#[repr(C)]`, padding-free
//! and plain data, so the kernel map bytes and these structs are the same thing on both sides.
//!
//! Addresses are 16 bytes plus a family byte: IPv6 as is, IPv4 in the first 4 bytes with the
//! remaining 12 zero (see [`FAMILY_V4`]).
#![no_std]

/// The version of this crate's contract between program and loader: map names and kinds, key
/// and value layouts, counter slots, program names. Bump it with any change to them. The
/// program carries it in [`ABI_SECTION`]; the loader refuses an object whose version differs
/// (one built from other sources than the agent) before it loads anything.
pub const ABI_VERSION: u32 = 4;
/// The ELF section holding the program's [`ABI_VERSION`] as one little-endian `u32` (the static
/// `INNERWALL_ABI`). Not a data section, so aya never turns it into a map.
pub const ABI_SECTION: &str = "innerwall_abi";

/// Name of the first of the two flow maps (see [`ACTIVE_MAP`]).
pub const FLOWS_A: &str = "FLOWS_A";
/// Name of the second flow map.
pub const FLOWS_B: &str = "FLOWS_B";
/// Name of the one-slot array whose value (0 or 1) selects the flow map the programs write
/// to. The agent flips it, waits a grace period, then drains the idle map: no increment is
/// lost to a read-then-delete race.
pub const ACTIVE_MAP: &str = "ACTIVE_MAP";
/// Name of the per-CPU counter array (see [`COUNTER_FLOW_INSERT_FAILED`]).
pub const COUNTERS: &str = "COUNTERS";
/// Name of the LRU map of connections with a known direction (the conntrack-like state).
pub const CONNS: &str = "CONNS";
/// Name of the ingress classifier for interfaces whose packets start with an Ethernet header.
pub const PROG_INGRESS: &str = "innerwall_ingress";
/// Name of the egress classifier for Ethernet interfaces.
pub const PROG_EGRESS: &str = "innerwall_egress";
/// Name of the ingress classifier for layer-3 interfaces (WireGuard, tun): packets start at
/// the IP header and `skb->protocol` says which IP.
pub const PROG_INGRESS_L3: &str = "innerwall_ingress_l3";
/// Name of the egress classifier for layer-3 interfaces.
pub const PROG_EGRESS_L3: &str = "innerwall_egress_l3";

/// Default capacity of each flow map (the agent may resize it before load).
pub const DEFAULT_FLOW_ENTRIES: u32 = 65_536;
/// Capacity of the connection-direction LRU map as compiled; the agent always sets it at load
/// (`run --conn-table-entries`, by default derived from the host's memory: see
/// `innerwall_agent::evidence::capture::conn_entries_for_memory`). An element costs
/// [`CONN_ENTRY_BYTES`] of preallocated kernel memory, so this is 29 MB: four times Linux's usual
/// `nf_conntrack_max` of 65,536, so this table is not the smaller one: a connection the kernel
/// still tracks is rarely one that was evicted here.
pub const CONN_ENTRIES: u32 = 262_144;
/// Preallocated kernel memory of one `CONNS` element: 40-byte key, 8-byte value, the hash
/// table's and LRU's per-element bookkeeping (the kernel's memlock figure for an LRU hash of
/// this shape).
pub const CONN_ENTRY_BYTES: u64 = 112;

/// `COUNTERS` index: flow records that could not be inserted (map full), monotonic.
pub const COUNTER_FLOW_INSERT_FAILED: u32 = 0;
/// `COUNTERS` index: inbound packets skipped as replies to connections this host initiated.
pub const COUNTER_REPLIES_SKIPPED: u32 = 1;
/// `COUNTERS` index: conntrack inserts that failed (LRU maps evict, so this stays ~0).
pub const COUNTER_CONN_INSERT_FAILED: u32 = 2;
/// `COUNTERS` index: connections newly inserted into `CONNS` (a key that was not there).
/// Entries are never deleted, only evicted, so every insert beyond the map's capacity evicted
/// at least one entry: the agent reports `inserted - capacity` as a lower bound of evictions.
pub const COUNTER_CONN_INSERTED: u32 = 3;
/// `COUNTERS` index: ICMP / ICMPv6 errors (destination unreachable, time exceeded, …) about a
/// packet in a connection `CONNS` knows. Never recorded as inbound flows (diagnostic).
pub const COUNTER_ICMP_ERRORS_RELATED: u32 = 4;
/// `COUNTERS` index: ICMP / ICMPv6 errors whose quoted packet is in no known connection
/// (evicted, started before the program was attached, or forged). Not recorded either.
pub const COUNTER_ICMP_ERRORS_UNMATCHED: u32 = 5;
/// `COUNTERS` index: UDP datagrams with no `CONNS` entry from a remote port outside the
/// ephemeral range (a service port, below 32768) to a local port inside it (32768 and up): what
/// a reply looks like whose entry was evicted, or whose conversation began before the program
/// was attached (the same test the program uses for TCP without a SYN). Still recorded as
/// inbound (a genuine datagram, e.g. a scan from source port 53, looks the same), and counted:
/// the agent reports them as a suspect-direction evidence gap on the window.
pub const COUNTER_UDP_REPLY_LIKE_UNMATCHED: u32 = 6;
/// Number of logical `COUNTERS` slots (the array holds [`COUNTER_ARRAY_SLOTS`]).
pub const COUNTER_SLOTS: u32 = 8;
/// Number of slots of the `COUNTERS` array: each [sided](counter_is_sided) counter has a slot
/// per flow map ([`counter_slot`]).
pub const COUNTER_ARRAY_SLOTS: u32 = 2 * COUNTER_SLOTS;

/// Whether counter `index` is kept per flow map: the counts a window's evidence gaps are made
/// of. The program adds to the side of the flow map it writes the packet's record to (read
/// once per packet), so the agent's drain of a map reports exactly the gaps of the records it
/// drains; one counter read after the flip would put a packet counted between the flip and
/// the read in this window's gap and its record in the next window.
pub const fn counter_is_sided(index: u32) -> bool {
    matches!(index, COUNTER_FLOW_INSERT_FAILED | COUNTER_UDP_REPLY_LIKE_UNMATCHED)
}

/// The `COUNTERS` array slot of counter `index` while `ACTIVE_MAP[0] == side` (0 or 1).
pub const fn counter_slot(index: u32, side: u32) -> u32 {
    if counter_is_sided(index) { index + COUNTER_SLOTS * side } else { index }
}

/// [`FlowKey::family`] for IPv4.
pub const FAMILY_V4: u8 = 4;
/// [`FlowKey::family`] for IPv6.
pub const FAMILY_V6: u8 = 6;

/// IP protocol numbers used in keys.
pub const PROTO_ICMP: u8 = 1;
/// TCP.
pub const PROTO_TCP: u8 = 6;
/// UDP.
pub const PROTO_UDP: u8 = 17;
/// ICMPv6.
pub const PROTO_ICMPV6: u8 = 58;

/// [`ConnValue::direction`]: this host sent the first packet.
pub const DIR_OUTBOUND: u8 = 1;
/// [`ConnValue::direction`]: the remote peer sent the first packet.
pub const DIR_INBOUND: u8 = 2;

/// The key of one inbound flow record: who (src) reached what (dst, dst port) over which
/// protocol. For ICMP/ICMPv6, `dst_port` is `type << 8 | code`. 40 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// Source address (the remote peer).
    pub src: [u8; 16],
    /// Destination address (this host).
    pub dst: [u8; 16],
    /// Destination port, host byte order (ICMP: type << 8 | code).
    pub dst_port: u16,
    /// IP protocol number ([`PROTO_TCP`], …).
    pub protocol: u8,
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// Always zero (keeps the key free of uninitialised padding).
    pub _pad: [u8; 4],
}

/// The counters of one flow record. 40 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowValue {
    /// Packets seen.
    pub packets: u64,
    /// Bytes seen (`skb->len` at tc: the L2 frame without FCS; the IP packet on IP-framed
    /// interfaces such as WireGuard and tun).
    pub bytes: u64,
    /// New connections: TCP SYN without ACK; UDP / ICMP echo: first packet of a conversation
    /// (5-tuple / echo id) the connection table did not know; other ICMP: first packet of the key.
    pub new_connections: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the first packet.
    pub first_seen_ns: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the last packet.
    pub last_seen_ns: u64,
}

/// A connection seen from this host: local and remote endpoint. For ICMP echo both ports
/// hold the echo identifier. 40 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnKey {
    /// This host's address.
    pub local: [u8; 16],
    /// The peer's address.
    pub remote: [u8; 16],
    /// This host's port.
    pub local_port: u16,
    /// The peer's port.
    pub remote_port: u16,
    /// IP protocol number.
    pub protocol: u8,
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// Always zero.
    pub _pad: [u8; 2],
}

/// Who started a connection. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnValue {
    /// [`DIR_OUTBOUND`] or [`DIR_INBOUND`].
    pub direction: u8,
    /// Always zero.
    pub _pad: [u8; 7],
}

const _: () = {
    assert!(size_of::<FlowKey>() == 40);
    assert!(size_of::<FlowValue>() == 40);
    assert!(size_of::<ConnKey>() == 40);
    assert!(size_of::<ConnValue>() == 8);
};

// SAFETY (all four): `#[repr(C)]` structs of integers and byte arrays with no padding (the
// size assertions above prove it) and no invalid bit patterns, so any bytes the kernel hands
// back are a valid value and every byte written is initialised.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
mod pod {
    // SAFETY: see the module comment.
    unsafe impl aya::Pod for super::FlowKey {}
    // SAFETY: see the module comment.
    unsafe impl aya::Pod for super::FlowValue {}
    // SAFETY: see the module comment.
    unsafe impl aya::Pod for super::ConnKey {}
    // SAFETY: see the module comment.
    unsafe impl aya::Pod for super::ConnValue {}
}
