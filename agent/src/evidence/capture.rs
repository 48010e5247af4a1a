//! eBPF flow capture (DESIGN.md FLOW-1, FLOW-2): loads the `agent-ebpf` object at run time,
//! attaches its tc classifiers (ingress records, egress tracks what this host initiates) to
//! the given interfaces, and drains the inbound flow records per window.
//!
//! Interfaces are attached one at a time and each keeps its own links, so detaching one drops
//! only its classifiers. [`Capture::follow_links`] makes the capture follow the host's links
//! (`links::LinkWatcher`): existing and hotplugged interfaces of a captured kind are attached
//! (Ethernet or layer-3 programs, see `links::framing`), removed ones detached; one interface
//! failing to attach is logged and reported and never stops capture on the others.
//!
//! Drain consistency: the program writes to one of two per-CPU flow maps, chosen by
//! `ACTIVE_MAP[0]`. [`Capture::drain`] flips the index, waits [`DRAIN_GRACE`] so program runs
//! that read the old index finish (a tc program run takes microseconds), then reads and deletes
//! every key of the now idle map. Per-CPU values mean no increment is lost to concurrent
//! updates either. The counters are monotonic; each drain reports the difference. The two a
//! window's gaps are made of (map full, reply-like UDP) are kept per flow map, so a drain
//! reports exactly those of the records it drains (see `common::counter_is_sided`).
//!
//! The program's diagnostics (aya-log, e.g. "flow map full", logged per doubling of a failure
//! counter) are read from their ring buffer at each drain and handed to a `log` logger: the
//! process's own (`log::logger()`, which the agent bridges into tracing) or one a test passes.
//!
//! A plain `cargo build` needs no BPF toolchain: the object is read from a file,
//! [`default_object_path`] (`$INNERWALL_EBPF_OBJECT`, else `<dir of the executable>/../bpf/
//! innerwall-ebpf`, which is `target/bpf/innerwall-ebpf` for cargo builds; `cargo xtask
//! build-ebpf` puts it there). A packaged agent is built with the `embedded-ebpf` feature
//! (`cargo xtask package`): the object is in the binary, and no path is trusted at run time
//! ([`daemon_object`]). Because it is built separately, the
//! object carries the ABI version of the layouts it was built against
//! (`innerwall_ebpf_common::ABI_VERSION` in its `innerwall_abi` section), and one with another
//! version, or none, is refused before anything is loaded.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use std::collections::BTreeMap;

use aya::maps::{Array, MapData, MapError, PerCpuArray, PerCpuHashMap};
use aya::programs::tc::SchedClassifierLink;
use aya::programs::{ProgramError, SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfError, EbpfLoader};
use innerwall_ebpf_common as common;
use innerwall_ebpf_common::{FlowKey, FlowValue};

use super::links::{Framing, LinkError, LinkEvent, LinkWatcher};

/// How long [`Capture::drain`] waits after switching maps before reading the idle one.
pub const DRAIN_GRACE: Duration = Duration::from_millis(20);

/// The environment variable that overrides where the eBPF object is read from.
pub const OBJECT_ENV: &str = "INNERWALL_EBPF_OBJECT";

/// Where the program comes from.
#[derive(Debug, Clone)]
pub enum Object {
    /// A file, checked before it is read ([`read_trusted`]).
    File(PathBuf),
    /// Bytes built into this binary.
    Embedded(&'static [u8]),
}

/// What errors name an embedded object by.
const EMBEDDED_NAME: &str = "(embedded in this binary)";

#[cfg(feature = "embedded-ebpf")]
static EMBEDDED: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/innerwall-ebpf"));

/// The object the daemon loads: the one embedded in this build.
#[cfg(feature = "embedded-ebpf")]
pub fn daemon_object() -> Object {
    Object::Embedded(EMBEDDED)
}

/// The object the daemon loads: this build has none embedded, so the file at
/// [`default_object_path`].
#[cfg(not(feature = "embedded-ebpf"))]
pub fn daemon_object() -> Object {
    Object::File(default_object_path())
}

/// What can go wrong loading, attaching or draining.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("eBPF flow capture needs root (CAP_BPF + CAP_NET_ADMIN); effective uid is {0}")]
    NotRoot(u32),
    #[error("eBPF object {0} not found: build it with `cargo xtask build-ebpf` (or set {OBJECT_ENV})")]
    ObjectMissing(PathBuf),
    #[error(
        "eBPF object {path} {reason}: it is loaded into the kernel as root, so it must be owned by root \
         and writable by no one else"
    )]
    Untrusted { path: PathBuf, reason: String },
    #[error("reading eBPF object {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "eBPF object {path} has {}, but this agent needs ABI version {expected}: build the object from the \
         agent's own sources (`cargo xtask build-ebpf`)",
        abi_text(.found)
    )]
    Abi { path: PathBuf, found: Option<u32>, expected: u32 },
    #[error("reading the ABI version of eBPF object {path}: {reason}")]
    AbiUnreadable { path: PathBuf, reason: String },
    #[error("loading eBPF object {path}: {source}")]
    Load {
        path: PathBuf,
        #[source]
        source: Box<EbpfError>,
    },
    #[error("eBPF object has no {0}: is it an old build? run `cargo xtask build-ebpf`")]
    Missing(&'static str),
    #[error("eBPF program {program}: {source}")]
    Program {
        program: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("attaching {program} to interface {interface}: {source}")]
    Attach {
        program: &'static str,
        interface: String,
        #[source]
        source: ProgramError,
    },
    #[error("eBPF map {map}: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: MapError,
    },
    #[error("eBPF diagnostics (aya-log): {0}")]
    Log(#[from] aya_log::Error),
    #[error("following the host's interfaces")]
    Links(#[from] LinkError),
}

/// One inbound flow record as drained: key plus counters summed over CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRecord {
    /// The remote peer.
    pub src: IpAddr,
    /// This host's address the packets were sent to.
    pub dst: IpAddr,
    /// Destination port; for ICMP / ICMPv6 `type << 8 | code` (see [`FlowRecord::icmp`]).
    pub dst_port: u16,
    /// IP protocol number (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6, others without ports).
    pub protocol: u8,
    /// Packets.
    pub packets: u64,
    /// Bytes (L2 frame length as tc sees it; IP packet length on WireGuard / tun).
    pub bytes: u64,
    /// New connections: TCP SYNs without ACK; new UDP 5-tuples / ICMP echo ids.
    pub new_connections: u64,
    /// First packet, unix milliseconds.
    pub first_seen_unix_ms: i64,
    /// Last packet, unix milliseconds.
    pub last_seen_unix_ms: i64,
}

impl FlowRecord {
    /// ICMP type and code, for ICMP / ICMPv6 records.
    pub fn icmp(&self) -> Option<(u8, u8)> {
        matches!(self.protocol, common::PROTO_ICMP | common::PROTO_ICMPV6)
            .then(|| ((self.dst_port >> 8) as u8, (self.dst_port & 0xff) as u8))
    }
}

/// What one [`Capture::drain`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drained {
    /// Every record of the drained map (inbound only: replies are never recorded). Not yet
    /// filtered to this host's addresses (broadcast/multicast destinations may appear).
    pub records: Vec<FlowRecord>,
    /// Flow records the program could not insert since the previous drain (map full): each
    /// is a packet whose flow went unrecorded — an evidence gap (FLOW-2), never silence.
    pub map_full_drops: u64,
    /// Inbound packets skipped since the previous drain as replies to connections this host
    /// initiated (diagnostic).
    pub replies_skipped: u64,
    /// ICMP / ICMPv6 errors since the previous drain about a packet of a known connection
    /// (diagnostic: errors are never recorded as flows).
    pub icmp_errors_related: u64,
    /// ICMP / ICMPv6 errors since the previous drain whose quoted packet is in no known
    /// connection (evicted, older than the program, or forged; not recorded either).
    pub icmp_errors_unmatched: u64,
    /// UDP datagrams since the previous drain from a remote port below 1024 to a local
    /// ephemeral port without a connection entry: what a reply whose entry was evicted looks
    /// like. They are recorded as inbound (a genuine one looks the same); this says how many.
    pub udp_reply_like_unmatched: u64,
    /// A lower bound of connection-table evictions since the previous drain: connections
    /// inserted beyond the table's capacity (entries are only ever evicted, never deleted).
    pub conn_evictions_at_least: u64,
    /// When this drain switched the program to the other map, in unix ms, converted from the
    /// monotonic clock read right after the switch the same way as the records' times. The
    /// records of this drain were seen between the previous drain's switch and this one (give
    /// or take one program run, microseconds, at either end).
    pub flipped_at_unix_ms: i64,
}

/// Map sizes to load the object with; `None` keeps the object's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Capacity of each of the two flow maps (default [`common::DEFAULT_FLOW_ENTRIES`]).
    pub flow_capacity: Option<u32>,
    /// Capacity of the connection-direction LRU map (default [`common::CONN_ENTRIES`]; the
    /// agent's `run` passes [`default_conn_entries`] or its `--conn-table-entries`).
    pub conn_capacity: Option<u32>,
}

/// The smallest connection table `run --conn-table-entries` accepts (tests size it small to
/// force evictions; the kernel's LRU needs a few entries per CPU to work at all).
pub const MIN_CONN_ENTRIES: u32 = 64;
/// The largest connection table `run --conn-table-entries` accepts: 16 Mi entries, 1.8 GB of
/// kernel memory (see [`common::CONN_ENTRY_BYTES`]).
pub const MAX_CONN_ENTRIES: u32 = 16 * 1024 * 1024;
/// Bounds of the table size derived from memory: at least Linux's usual `nf_conntrack_max`
/// (65,536, 7 MB), at most 1 Mi entries (117 MB).
const DERIVED_CONN_ENTRIES: (u64, u64) = (65_536, 1024 * 1024);
/// The share of the host's memory the derived connection table takes: 1/256 (0.4 %).
const CONN_MEMORY_SHARE: u64 = 256;

/// The connection-table capacity for a host with `mem_total_bytes` of memory: 1/256 of it at
/// [`common::CONN_ENTRY_BYTES`] an entry, within [65,536, 1,048,576] entries (2 GB: 74,898
/// entries; 8 GB: 299,593; 32 GB and more: 1,048,576). Above Linux's conntrack default on every
/// host, so a connection the kernel still tracks is rarely one evicted here.
pub fn conn_entries_for_memory(mem_total_bytes: u64) -> u32 {
    let entries = mem_total_bytes / CONN_MEMORY_SHARE / common::CONN_ENTRY_BYTES;
    let (floor, ceiling) = DERIVED_CONN_ENTRIES;
    u32::try_from(entries.clamp(floor, ceiling)).expect("the ceiling fits a u32")
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
pub fn mem_total_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let kib = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kib.checked_mul(1024)
}

/// The connection-table capacity for this host: [`conn_entries_for_memory`] of its
/// `/proc/meminfo`, or [`common::CONN_ENTRIES`] when that cannot be read.
pub fn default_conn_entries() -> u32 {
    match std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(mem_total_bytes) {
        Some(bytes) => conn_entries_for_memory(bytes),
        None => common::CONN_ENTRIES,
    }
}

/// What following the host's links did to one interface (see [`Capture::follow_links`]).
#[derive(Debug)]
pub enum LinkChange {
    /// A new interface of a captured kind, now captured with the programs for its framing.
    Attached { interface: String, framing: Framing },
    /// An interface went away (or was renamed); its classifiers were dropped.
    Detached { interface: String },
    /// Attaching failed; the other interfaces are captured as before.
    AttachFailed { interface: String, error: CaptureError },
}

/// Kernel accounting for one classifier (see [`Capture::program_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramStats {
    /// The classifier's name.
    pub program: &'static str,
    /// Runs counted (one per packet on each attached interface).
    pub runs: u64,
    /// Total time spent in the program.
    pub run_time: Duration,
}

/// The classifiers attached to one interface; dropping them detaches them.
struct Attached {
    framing: Framing,
    // Egress first, as attached; only held, so dropping them detaches.
    _links: Vec<SchedClassifierLink>,
}

/// The loaded capture program and the interfaces it is attached to. Dropping it detaches
/// everything.
pub struct Capture {
    // Dropped first: detaching needs nothing else.
    attached: BTreeMap<String, Attached>,
    watcher: Option<LinkWatcher>,
    // Owns the programs.
    ebpf: Ebpf,
    logger: aya_log::EbpfLogger<&'static dyn log::Log>,
    flows: [PerCpuHashMap<MapData, FlowKey, FlowValue>; 2],
    active_map: Array<MapData, u32>,
    counters: PerCpuArray<MapData, u64>,
    active: u32,
    last_counters: Totals,
    conn_capacity: u32,
    legacy_tc: bool,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("interfaces", &self.interfaces())
            .field("following_links", &self.watcher.is_some())
            .field("active", &self.active)
            .field("last_counters", &self.last_counters)
            .finish_non_exhaustive()
    }
}

/// The (egress, ingress) classifiers for a framing.
fn programs(framing: Framing) -> [(&'static str, TcAttachType); 2] {
    match framing {
        Framing::Ethernet => {
            [(common::PROG_EGRESS, TcAttachType::Egress), (common::PROG_INGRESS, TcAttachType::Ingress)]
        }
        Framing::Ip => {
            [(common::PROG_EGRESS_L3, TcAttachType::Egress), (common::PROG_INGRESS_L3, TcAttachType::Ingress)]
        }
    }
}

impl Capture {
    /// Loads the object at `object_path` (flow maps resized to `map_capacity` if given) and
    /// attaches ingress and egress classifiers to each interface (TCX on kernels ≥ 6.6,
    /// clsact filters before), all taken to be Ethernet; any failure is an error. Interface
    /// names resolve in the calling thread's network namespace. The program's diagnostics go
    /// to `log` (usually `log::logger()`). Needs root.
    pub fn attach(
        interfaces: &[String],
        object_path: &Path,
        map_capacity: Option<u32>,
        log: &'static dyn log::Log,
    ) -> Result<Capture, CaptureError> {
        let options = CaptureOptions { flow_capacity: map_capacity, ..CaptureOptions::default() };
        let mut capture = Capture::load(object_path, options, log)?;
        for interface in interfaces {
            capture.attach_interface(interface, Framing::Ethernet)?;
        }
        Ok(capture)
    }

    /// Loads the object at `object_path` with the map sizes of `options` and its programs,
    /// attached nowhere yet ([`Capture::attach_interface`], [`Capture::follow_links`]). The
    /// program's diagnostics go to `log`. Needs root.
    pub fn load(
        object_path: &Path,
        options: CaptureOptions,
        log: &'static dyn log::Log,
    ) -> Result<Capture, CaptureError> {
        Capture::load_object(&Object::File(object_path.to_owned()), options, log)
    }

    /// [`Capture::load`] from a file or from bytes built into this binary.
    pub fn load_object(
        object: &Object,
        options: CaptureOptions,
        log: &'static dyn log::Log,
    ) -> Result<Capture, CaptureError> {
        root_required(effective_uid())?;
        let (object_path, bytes) = match object {
            Object::File(path) if !path.is_file() => return Err(CaptureError::ObjectMissing(path.clone())),
            Object::File(path) => (path.as_path(), std::borrow::Cow::Owned(read_trusted(path)?)),
            Object::Embedded(bytes) => (Path::new(EMBEDDED_NAME), std::borrow::Cow::Borrowed(*bytes)),
        };
        let mut loader = EbpfLoader::new();
        if let Some(capacity) = options.flow_capacity {
            loader.map_max_entries(common::FLOWS_A, capacity);
            loader.map_max_entries(common::FLOWS_B, capacity);
        }
        if let Some(capacity) = options.conn_capacity {
            loader.map_max_entries(common::CONNS, capacity);
        }
        check_abi(object_path, &bytes)?;
        let mut ebpf = loader.load(&bytes).map_err(|source| CaptureError::Load {
            path: object_path.to_owned(),
            source: Box::new(source),
        })?;
        // Before any program runs, so no diagnostic is written where nobody reads.
        let logger = aya_log::EbpfLogger::init_with_logger(&mut ebpf, log)?;
        let legacy_tc = !aya::util::KernelVersion::current()
            .map(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
            .unwrap_or(false);
        for program in
            [common::PROG_EGRESS, common::PROG_INGRESS, common::PROG_EGRESS_L3, common::PROG_INGRESS_L3]
        {
            classifier(&mut ebpf, program)?
                .load()
                .map_err(|source| CaptureError::Program { program, source })?;
        }
        let mut take = |name: &'static str| ebpf.take_map(name).ok_or(CaptureError::Missing(name));
        let map_err = |map: &'static str| move |source| CaptureError::Map { map, source };
        let flows_a = PerCpuHashMap::try_from(take(common::FLOWS_A)?).map_err(map_err(common::FLOWS_A))?;
        let flows_b = PerCpuHashMap::try_from(take(common::FLOWS_B)?).map_err(map_err(common::FLOWS_B))?;
        let active_map = Array::try_from(take(common::ACTIVE_MAP)?).map_err(map_err(common::ACTIVE_MAP))?;
        let counters = PerCpuArray::try_from(take(common::COUNTERS)?).map_err(map_err(common::COUNTERS))?;
        let mut capture = Capture {
            attached: BTreeMap::new(),
            watcher: None,
            ebpf,
            logger,
            flows: [flows_a, flows_b],
            active_map,
            counters,
            active: 0,
            last_counters: [0; common::COUNTER_ARRAY_SLOTS as usize],
            conn_capacity: options.conn_capacity.unwrap_or(common::CONN_ENTRIES),
            legacy_tc,
        };
        capture.active = capture.active_map.get(&0, 0).map_err(map_err(common::ACTIVE_MAP))?;
        capture.last_counters = capture.counter_totals()?;
        Ok(capture)
    }

    /// Attaches the egress and ingress classifiers for `framing` to `interface` (resolved in
    /// the calling thread's network namespace). Already attached: nothing changes. On failure
    /// nothing of it stays attached.
    pub fn attach_interface(&mut self, interface: &str, framing: Framing) -> Result<(), CaptureError> {
        if self.attached.contains_key(interface) {
            return Ok(());
        }
        if self.legacy_tc {
            // Already present is fine; a real failure shows up in attach below.
            let _ = aya::programs::tc::qdisc_add_clsact(interface);
        }
        let mut links = Vec::with_capacity(2);
        // Egress first: initiations are tracked before ingress starts judging replies.
        for (program, attach_type) in programs(framing) {
            let prog = classifier(&mut self.ebpf, program)?;
            let attach_err =
                |source| CaptureError::Attach { program, interface: interface.to_owned(), source };
            let id = prog.attach(interface, attach_type).map_err(attach_err)?;
            // Owned from here on: dropping it (also on a later error) detaches it.
            links.push(prog.take_link(id).map_err(attach_err)?);
        }
        self.attached.insert(interface.to_owned(), Attached { framing, _links: links });
        Ok(())
    }

    /// Detaches the classifiers from `interface`; whether it was attached. The other
    /// interfaces stay captured. An interface already gone from the kernel took its
    /// attachment with it; this then only forgets it.
    pub fn detach_interface(&mut self, interface: &str) -> bool {
        self.attached.remove(interface).is_some()
    }

    /// The framing `interface` is captured with, if it is attached.
    pub fn framing(&self, interface: &str) -> Option<Framing> {
        self.attached.get(interface).map(|a| a.framing)
    }

    /// Starts following the host's links (in the calling thread's network namespace): every
    /// existing interface of a captured kind is attached now, later ones as
    /// [`Capture::follow_link_changes`] sees them. Returns what changed; an interface that
    /// could not be attached is in it (and logged), never an error for the others.
    pub fn follow_links(&mut self) -> Result<Vec<LinkChange>, CaptureError> {
        self.watcher = Some(LinkWatcher::open()?);
        Ok(self.follow_link_changes())
    }

    /// Applies the link notifications that arrived since the last call, without blocking:
    /// attaches added interfaces of a captured kind, detaches removed ones. Call it on the
    /// thread that called [`Capture::follow_links`] (names resolve in its namespace). Each
    /// change is logged and returned; without [`Capture::follow_links`] nothing happens.
    pub fn follow_link_changes(&mut self) -> Vec<LinkChange> {
        let Some(watcher) = self.watcher.as_mut() else {
            return Vec::new();
        };
        let events = match watcher.poll() {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!("reading link notifications failed: {}", crate::error::chain(&e));
                return Vec::new();
            }
        };
        let mut changes = Vec::new();
        for event in events {
            match event {
                LinkEvent::Removed(link) => {
                    if self.detach_interface(&link.name) {
                        tracing::info!(interface = %link.name, "flow capture detached from a removed interface");
                        changes.push(LinkChange::Detached { interface: link.name });
                    }
                }
                LinkEvent::Added(link) => {
                    let Some(framing) = link.framing() else {
                        tracing::debug!(interface = %link.name, kind = ?link.kind, "interface kind not captured");
                        continue;
                    };
                    if self.attached.contains_key(&link.name) {
                        continue;
                    }
                    match self.attach_interface(&link.name, framing) {
                        Ok(()) => {
                            tracing::info!(interface = %link.name, ?framing, "flow capture attached");
                            changes.push(LinkChange::Attached { interface: link.name, framing });
                        }
                        Err(error) => {
                            tracing::error!(
                                interface = %link.name,
                                "flow capture could not attach; the other interfaces are still captured: {}",
                                crate::error::chain(&error)
                            );
                            changes.push(LinkChange::AttachFailed { interface: link.name, error });
                        }
                    }
                }
            }
        }
        changes
    }

    /// The capacity of the connection-direction table as loaded (entries).
    pub fn conn_capacity(&self) -> u32 {
        self.conn_capacity
    }

    /// The interfaces this capture is attached to, sorted.
    pub fn interfaces(&self) -> Vec<&str> {
        self.attached.keys().map(String::as_str).collect()
    }

    /// Run count and total run time of each classifier, as the kernel accounts them. The
    /// kernel only counts while statistics are enabled (`aya::sys::enable_stats`, or the
    /// `kernel.bpf_stats_enabled` sysctl); otherwise both stay zero.
    pub fn program_stats(&self) -> Result<Vec<ProgramStats>, CaptureError> {
        [common::PROG_INGRESS, common::PROG_EGRESS]
            .into_iter()
            .map(|program| {
                let prog: &SchedClassifier = self
                    .ebpf
                    .program(program)
                    .ok_or(CaptureError::Missing(program))?
                    .try_into()
                    .map_err(|source| CaptureError::Program { program, source })?;
                let info = prog.info().map_err(|source| CaptureError::Program { program, source })?;
                Ok(ProgramStats { program, runs: info.run_count(), run_time: info.run_time() })
            })
            .collect()
    }

    /// Switches the program to the other flow map, waits [`DRAIN_GRACE`], then returns and
    /// deletes every record of the previous one, with the counters since the last drain.
    /// Also passes the program's pending diagnostics to the logger.
    pub fn drain(&mut self) -> Result<Drained, CaptureError> {
        let map_err = |map: &'static str| move |source| CaptureError::Map { map, source };
        let idle = self.active as usize;
        let next = 1 - self.active;
        self.active_map.set(0, next, 0).map_err(map_err(common::ACTIVE_MAP))?;
        let flipped_ns = clock_ns(libc::CLOCK_MONOTONIC);
        self.active = next;
        std::thread::sleep(DRAIN_GRACE);

        let name = if idle == 0 { common::FLOWS_A } else { common::FLOWS_B };
        let offset_ns = realtime_minus_monotonic_ns();
        let to_unix_ms = |mono_ns: i128| ((mono_ns + offset_ns) / 1_000_000) as i64;
        let map = &mut self.flows[idle];
        let keys: Vec<FlowKey> = map.keys().collect::<Result<_, _>>().map_err(map_err(name))?;
        let mut records = Vec::with_capacity(keys.len());
        for key in &keys {
            let values = match map.get(key, 0) {
                Ok(values) => values,
                // Deleted meanwhile (cannot happen with one drainer); skip.
                Err(MapError::KeyNotFound) => continue,
                Err(source) => return Err(CaptureError::Map { map: name, source }),
            };
            let mut sum = FlowValue::default();
            let mut first = u64::MAX;
            for value in values.iter().filter(|v| v.packets > 0) {
                sum.packets += value.packets;
                sum.bytes += value.bytes;
                sum.new_connections += value.new_connections;
                first = first.min(value.first_seen_ns);
                sum.last_seen_ns = sum.last_seen_ns.max(value.last_seen_ns);
            }
            match map.remove(key) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(source) => return Err(CaptureError::Map { map: name, source }),
            }
            if sum.packets == 0 {
                continue;
            }
            records.push(FlowRecord {
                src: addr(key.family, key.src),
                dst: addr(key.family, key.dst),
                dst_port: key.dst_port,
                protocol: key.protocol,
                packets: sum.packets,
                bytes: sum.bytes,
                new_connections: sum.new_connections,
                first_seen_unix_ms: to_unix_ms(first.into()),
                last_seen_unix_ms: to_unix_ms(sum.last_seen_ns.into()),
            });
        }
        let totals = self.counter_totals()?;
        let inserted = common::COUNTER_CONN_INSERTED as usize;
        let beyond = |inserted: u64| inserted.saturating_sub(u64::from(self.conn_capacity));
        let evictions = beyond(totals[inserted]) - beyond(self.last_counters[inserted]);
        let counts = since_last(&mut self.last_counters, &totals, idle as u32);
        let delta = |i: u32| counts[i as usize];
        let drained = Drained {
            records,
            map_full_drops: delta(common::COUNTER_FLOW_INSERT_FAILED),
            replies_skipped: delta(common::COUNTER_REPLIES_SKIPPED),
            icmp_errors_related: delta(common::COUNTER_ICMP_ERRORS_RELATED),
            icmp_errors_unmatched: delta(common::COUNTER_ICMP_ERRORS_UNMATCHED),
            udp_reply_like_unmatched: delta(common::COUNTER_UDP_REPLY_LIKE_UNMATCHED),
            conn_evictions_at_least: evictions,
            flipped_at_unix_ms: to_unix_ms(flipped_ns),
        };
        self.logger.flush();
        Ok(drained)
    }

    fn counter_totals(&self) -> Result<Totals, CaptureError> {
        let mut totals = [0; common::COUNTER_ARRAY_SLOTS as usize];
        for (index, total) in (0..common::COUNTER_ARRAY_SLOTS).zip(totals.iter_mut()) {
            let values = self
                .counters
                .get(&index, 0)
                .map_err(|source| CaptureError::Map { map: common::COUNTERS, source })?;
            *total = values.iter().copied().fold(0u64, u64::wrapping_add);
        }
        Ok(totals)
    }
}

/// Every slot of the `COUNTERS` array, summed over the CPUs.
type Totals = [u64; common::COUNTER_ARRAY_SLOTS as usize];

/// Each counter's count since the last drain, given the `totals` read after the drain of the
/// flow map of side `idle`, and moves `last` on: every plain slot, but of the sided ones only
/// the idle side's (the active side's keep counting toward that map's own drain, so a packet
/// counted between the flip and this read is reported with its record, one drain later).
fn since_last(last: &mut Totals, totals: &Totals, idle: u32) -> [u64; common::COUNTER_SLOTS as usize] {
    let mut counts = [0; common::COUNTER_SLOTS as usize];
    for (index, count) in (0..common::COUNTER_SLOTS).zip(counts.iter_mut()) {
        let slot = common::counter_slot(index, idle) as usize;
        *count = totals[slot].wrapping_sub(last[slot]);
        last[slot] = totals[slot];
    }
    counts
}

/// The classifier `program` of the object.
fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, CaptureError> {
    ebpf.program_mut(program)
        .ok_or(CaptureError::Missing(program))?
        .try_into()
        .map_err(|source| CaptureError::Program { program, source })
}

/// Why an object file with this owner and mode must not be loaded, if it must not.
fn untrusted(uid: u32, mode: u32) -> Option<String> {
    if uid != 0 {
        Some(format!("is owned by uid {uid}"))
    } else if mode & 0o022 != 0 {
        Some(format!("is writable by group or others (mode {:o})", mode & 0o777))
    } else {
        None
    }
}

/// Reads the object through one open file, checking the owner and mode of exactly what is read.
fn read_trusted(path: &Path) -> Result<Vec<u8>, CaptureError> {
    use std::io::Read as _;
    use std::os::unix::fs::MetadataExt as _;
    let read = |source| CaptureError::Read { path: path.to_owned(), source };
    let mut file = std::fs::File::open(path).map_err(read)?;
    let meta = file.metadata().map_err(read)?;
    if let Some(reason) = untrusted(meta.uid(), meta.mode()) {
        return Err(CaptureError::Untrusted { path: path.to_owned(), reason });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.read_to_end(&mut bytes).map_err(read)?;
    Ok(bytes)
}

/// The ABI version an object carries: the one `u32` in its [`common::ABI_SECTION`], in the
/// object's byte order; `None` without that section.
fn object_abi(elf: &[u8]) -> Result<Option<u32>, String> {
    use object::{Object as _, ObjectSection as _};
    let file = object::File::parse(elf).map_err(|e| format!("not an ELF object: {e}"))?;
    let Some(section) = file.section_by_name(common::ABI_SECTION) else {
        return Ok(None);
    };
    let data = section.data().map_err(|e| format!("section {}: {e}", common::ABI_SECTION))?;
    let bytes: [u8; 4] = data
        .try_into()
        .map_err(|_| format!("section {} holds {} bytes, not one u32", common::ABI_SECTION, data.len()))?;
    Ok(Some(if file.is_little_endian() { u32::from_le_bytes(bytes) } else { u32::from_be_bytes(bytes) }))
}

/// Refuses an object built against other layouts than this agent's, or against none at all.
fn check_abi(path: &Path, elf: &[u8]) -> Result<(), CaptureError> {
    let found =
        object_abi(elf).map_err(|reason| CaptureError::AbiUnreadable { path: path.to_owned(), reason })?;
    if found == Some(common::ABI_VERSION) {
        return Ok(());
    }
    Err(CaptureError::Abi { path: path.to_owned(), found, expected: common::ABI_VERSION })
}

fn abi_text(found: &Option<u32>) -> String {
    match found {
        Some(version) => format!("ABI version {version}"),
        None => format!(
            "no ABI version (no `{}` section: built before ABI versions existed?)",
            common::ABI_SECTION
        ),
    }
}

/// Where the eBPF object is read from: `$INNERWALL_EBPF_OBJECT`, else
/// `<dir of the current executable>/../bpf/innerwall-ebpf` (`target/bpf/innerwall-ebpf`
/// for `target/<profile>/innerwall-agent`).
pub fn default_object_path() -> PathBuf {
    if let Some(path) = std::env::var_os(OBJECT_ENV) {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new("."));
    dir.join("..").join("bpf").join("innerwall-ebpf")
}

fn addr(family: u8, bytes: [u8; 16]) -> IpAddr {
    if family == common::FAMILY_V4 {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    }
}

/// Loading needs root: refused, naming the uid, otherwise.
fn root_required(uid: u32) -> Result<(), CaptureError> {
    if uid == 0 { Ok(()) } else { Err(CaptureError::NotRoot(uid)) }
}

#[allow(unsafe_code)]
fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A clock's reading in ns.
#[allow(unsafe_code)]
fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid pointer we pass.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// CLOCK_REALTIME − CLOCK_MONOTONIC (what `bpf_ktime_get_ns` counts) in ns, right now.
fn realtime_minus_monotonic_ns() -> i128 {
    let mono_before = clock_ns(libc::CLOCK_MONOTONIC);
    let real = clock_ns(libc::CLOCK_REALTIME);
    let mono_after = clock_ns(libc::CLOCK_MONOTONIC);
    clock_offset_ns(mono_before, real, mono_after)
}

/// The offset of the real-time clock from the monotonic one, from a real-time reading taken
/// between two monotonic ones: it is paired with their midpoint, so the error is at most half
/// the time between them.
fn clock_offset_ns(mono_before: i128, real: i128, mono_after: i128) -> i128 {
    real - (mono_before + mono_after) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_root_owned_objects_nobody_else_can_write_are_loaded() {
        assert_eq!(untrusted(0, 0o100644), None);
        assert_eq!(untrusted(0, 0o100600), None);
        assert_eq!(untrusted(1000, 0o100644).as_deref(), Some("is owned by uid 1000"));
        assert_eq!(untrusted(0, 0o100664).as_deref(), Some("is writable by group or others (mode 664)"));
        assert_eq!(untrusted(0, 0o100646).as_deref(), Some("is writable by group or others (mode 646)"));

        // A real file that others may write is refused before a byte of it is used.
        use std::os::unix::fs::PermissionsExt as _;
        let path = std::env::temp_dir().join(format!("iw-object-{}", std::process::id()));
        std::fs::write(&path, b"not even an ELF").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = read_trusted(&path).unwrap_err().to_string();
        assert!(err.contains("must be owned by root and writable by no one else"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_gap_count_is_reported_by_the_drain_of_its_records_map() {
        use common::{COUNTER_REPLIES_SKIPPED as PLAIN, COUNTER_UDP_REPLY_LIKE_UNMATCHED as SIDED};
        let slot = |index, side| common::counter_slot(index, side) as usize;
        let mut last: Totals = [0; common::COUNTER_ARRAY_SLOTS as usize];
        let mut totals = last;
        // Map 0 active: one reply-like datagram, three replies skipped. Then the flip to map 1,
        // and before the drain reads the counters, two more datagrams on map 1's side.
        totals[slot(SIDED, 0)] += 1;
        totals[slot(PLAIN, 0)] += 3;
        totals[slot(SIDED, 1)] += 2;
        let first = since_last(&mut last, &totals, 0);
        assert_eq!((first[SIDED as usize], first[PLAIN as usize]), (1, 3), "map 0's drain");
        // The next drain (of map 1) reports the two with their records, the plain counter only
        // what came since.
        totals[slot(PLAIN, 1)] += 1;
        let second = since_last(&mut last, &totals, 1);
        assert_eq!((second[SIDED as usize], second[PLAIN as usize]), (2, 1), "map 1's drain");
        let third = since_last(&mut last, &totals, 0);
        assert_eq!((third[SIDED as usize], third[PLAIN as usize]), (0, 0), "nothing twice");
        assert_ne!(slot(SIDED, 0), slot(SIDED, 1));
        assert_eq!(slot(PLAIN, 0), slot(PLAIN, 1));
    }
    /// A BPF ELF object with `sections` (name, contents), as the object crate writes one.
    fn bpf_object(sections: &[(&str, &[u8])]) -> Vec<u8> {
        use object::write::Object;
        use object::{Architecture, BinaryFormat, Endianness, SectionKind};
        let mut obj = Object::new(BinaryFormat::Elf, Architecture::Bpf, Endianness::Little);
        for (name, data) in sections {
            let id = obj.add_section(Vec::new(), name.as_bytes().to_vec(), SectionKind::ReadOnlyData);
            obj.append_section_data(id, data, 4);
        }
        obj.write().unwrap()
    }

    fn check(sections: &[(&str, &[u8])]) -> Result<(), String> {
        check_abi(Path::new("/obj"), &bpf_object(sections)).map_err(|e| e.to_string())
    }

    #[test]
    fn an_object_of_another_abi_version_is_refused_naming_both() {
        let ours = common::ABI_VERSION.to_le_bytes();
        assert_eq!(check(&[("license", b"GPL\0"), (common::ABI_SECTION, &ours)]), Ok(()));

        let theirs = (common::ABI_VERSION + 1).to_le_bytes();
        let err = check(&[(common::ABI_SECTION, &theirs)]).unwrap_err();
        assert_eq!(
            err,
            format!(
                "eBPF object /obj has ABI version {}, but this agent needs ABI version {}: build the object from \
                 the agent's own sources (`cargo xtask build-ebpf`)",
                common::ABI_VERSION + 1,
                common::ABI_VERSION
            )
        );

        let err = check(&[("license", b"GPL\0")]).unwrap_err();
        assert!(err.starts_with("eBPF object /obj has no ABI version (no `innerwall_abi` section"), "{err}");
        assert!(err.contains(&format!("this agent needs ABI version {}", common::ABI_VERSION)), "{err}");

        let err = check(&[(common::ABI_SECTION, &[1, 0])]).unwrap_err();
        assert!(err.contains("section innerwall_abi holds 2 bytes, not one u32"), "{err}");
        let err = check_abi(Path::new("/obj"), b"not an ELF").unwrap_err().to_string();
        assert!(err.starts_with("reading the ABI version of eBPF object /obj: not an ELF object"), "{err}");
    }

    #[test]
    fn addresses_decode_by_family() {
        let mut v4 = [0u8; 16];
        v4[..4].copy_from_slice(&[10, 0, 0, 1]);
        assert_eq!(addr(common::FAMILY_V4, v4), "10.0.0.1".parse::<IpAddr>().unwrap());
        let v6: Ipv6Addr = "fd77::2".parse().unwrap();
        assert_eq!(addr(common::FAMILY_V6, v6.octets()), IpAddr::V6(v6));
    }

    #[test]
    fn icmp_type_and_code_come_from_the_port_field() {
        let record = FlowRecord {
            src: "fd77::2".parse().unwrap(),
            dst: "fd77::1".parse().unwrap(),
            dst_port: 128 << 8,
            protocol: common::PROTO_ICMPV6,
            packets: 1,
            bytes: 1,
            new_connections: 1,
            first_seen_unix_ms: 0,
            last_seen_unix_ms: 0,
        };
        assert_eq!(record.icmp(), Some((128, 0)));
        assert_eq!(FlowRecord { protocol: common::PROTO_TCP, ..record }.icmp(), None);
    }

    #[test]
    fn the_clock_offset_pairs_the_real_time_with_the_monotonic_midpoint() {
        // Fixed readings, no clock: the real-time reading is paired with the midpoint of the
        // monotonic ones around it, so a stamp taken at that midpoint converts to it exactly.
        const S: i128 = 1_000_000_000;
        let (before, real, after) = (5 * S, 1_800_000_000 * S + 7, 5 * S + 2_000);
        let offset = clock_offset_ns(before, real, after);
        assert_eq!(offset, 1_800_000_000 * S + 7 - (5 * S + 1_000));
        assert_eq!(5 * S + 1_000 + offset, real);
        // Readings in the other order (a clock stepped between them) still give one offset.
        assert_eq!(clock_offset_ns(after, real, before), offset);
    }

    #[test]
    fn the_connection_table_is_sized_from_memory_within_bounds() {
        const GIB: u64 = 1024 * 1024 * 1024;
        assert_eq!(conn_entries_for_memory(0), 65_536);
        assert_eq!(conn_entries_for_memory(GIB), 65_536);
        assert_eq!(conn_entries_for_memory(2 * GIB), 74_898);
        assert_eq!(conn_entries_for_memory(8 * GIB), 299_593);
        assert_eq!(conn_entries_for_memory(32 * GIB), 1_048_576);
        assert_eq!(conn_entries_for_memory(u64::MAX), 1_048_576);
        // 1/256 of memory: the table never takes more, above the floor.
        let entries = u64::from(conn_entries_for_memory(8 * GIB));
        assert!(entries * common::CONN_ENTRY_BYTES <= 8 * GIB / 256);
        assert!((MIN_CONN_ENTRIES..=MAX_CONN_ENTRIES).contains(&conn_entries_for_memory(u64::MAX)));

        let meminfo = "MemTotal:       16318412 kB\nMemFree:          987654 kB\n";
        assert_eq!(mem_total_bytes(meminfo), Some(16_318_412 * 1024));
        assert_eq!(mem_total_bytes("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total_bytes("MemTotal: lots kB\n"), None);
        assert_eq!(mem_total_bytes("MemTotal: 12\n"), None);
    }

    #[test]
    fn a_missing_object_is_refused_before_loading_and_names_the_build_command() {
        // Loading needs root; without it this test says so and fails (CI runs as root), never
        // passes on another branch.
        let uid = effective_uid();
        assert_eq!(uid, 0, "this test loads eBPF and needs root (CI runs as root); effective uid is {uid}");
        let missing = Path::new("/nonexistent/innerwall-ebpf");
        let err = Capture::attach(&["lo".to_owned()], missing, None, log::logger()).unwrap_err();
        assert!(matches!(&err, CaptureError::ObjectMissing(p) if p == missing), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("/nonexistent/innerwall-ebpf"), "{text}");
        assert!(text.contains("cargo xtask build-ebpf"), "{text}");
    }

    #[test]
    fn without_root_nothing_is_loaded_and_the_error_names_the_uid() {
        // The refusal itself, pure: its message names what is missing and the uid.
        let text = CaptureError::NotRoot(1000).to_string();
        assert_eq!(text, "eBPF flow capture needs root (CAP_BPF + CAP_NET_ADMIN); effective uid is 1000");
        assert_eq!(root_required(1000).map_err(|e| e.to_string()), Err(text));
        assert!(root_required(0).is_ok());
    }
}
