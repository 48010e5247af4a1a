//! Issue 27 item 4 (POL-10): one evaluator, proven against the kernel. Random rendered
//! policies are installed into the agent's real `table inet innerwall` through its own store,
//! real packets are sent from a client namespace, and for every packet the kernel's verdict
//! (which counter of the table moved, and whether the packet reached a socket on the host) is
//! compared with `innerwall_wire::flows::decide`. Every disagreement is collected and reported
//! with the seed, the policy, the packet and both answers.
//!
//! Rerun a failing case with `INNERWALL_EVALUATOR_SEED=<seed>`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::IpAddr;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use innerwall_agent::enforce::desired::{MAX_COMMENT, TERMINAL_DROP, TERMINAL_WOULD_BLOCK, rule_comment};
use innerwall_agent::enforce::{Installed, LinuxPolicyStore, PolicyStore as _};
use innerwall_wire::flows::{Decision, decide};
use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, ResolvedRule, RuleId, WorkloadPolicy};
use ipnet::IpNet;

use crate::netns::*;

/// Policies per run, and packets sent under each.
const POLICIES: usize = 80;
const PACKETS_PER_POLICY: usize = 10;
// Each TCP packet's source port is 40000 + its id (see CLIENT).
const _: () = assert!(40000 + POLICIES * PACKETS_PER_POLICY < 65536);
/// The host listens on TCP and UDP ports `PORT_BASE..PORT_BASE + PORTS` and on the edges of the
/// port space, 1 and 65535; rule ranges are drawn around them (edges inside and outside),
/// packets go to them.
const PORT_BASE: u16 = 20000;
const PORTS: u16 = 24;
const EDGE_PORTS: [u16; 2] = [1, 65535];

fn listened_ports() -> Vec<u16> {
    EDGE_PORTS.into_iter().chain(PORT_BASE..PORT_BASE + PORTS).collect()
}
/// How long a packet may take to be counted or to reach the host's socket. Only a
/// disagreement waits this long: agreeing packets end their wait on the event itself.
const EVENT_TIMEOUT: Duration = Duration::from_secs(3);

/// The client's addresses: the pair's own two per family and more, so peer prefixes of
/// different lengths split them differently.
const CLIENT4: [&str; 8] =
    [ALLOWED4, OTHER4, "10.77.0.5", "10.77.0.9", "10.77.0.17", "10.77.0.64", "10.77.0.130", "10.77.0.201"];
const CLIENT6: [&str; 6] = [ALLOWED6, OTHER6, "fd77::a", "fd77::1:2", "fd77::ff00:1", "fd77::8000:0:0:5"];

/// splitmix64: small, seeded, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

fn random_cidr(rng: &mut Rng) -> Cidr {
    let addr = |s: &str| s.parse::<IpAddr>().expect("test address");
    let net: IpNet = match rng.below(12) {
        0 => "0.0.0.0/0".parse().expect("net"),
        1 => "::/0".parse().expect("net"),
        2 => "10.0.0.0/8".parse().expect("net"),
        3 => "192.0.2.0/24".parse().expect("net"), // owns none of the client's addresses
        4 => "2001:db8::/32".parse().expect("net"),
        5..=8 => {
            IpNet::new(addr(rng.pick::<&str>(&CLIENT4)), 24 + rng.below(9) as u8).expect("prefix").trunc()
        }
        _ => {
            let len = *rng.pick(&[64u8, 96, 112, 116, 120, 124, 126, 127, 128]);
            IpNet::new(addr(rng.pick::<&str>(&CLIENT6)), len).expect("prefix").trunc()
        }
    };
    Cidr::parse(&net.to_string()).expect("a canonical cidr")
}

fn random_peers(rng: &mut Rng) -> Vec<Cidr> {
    let n = if rng.chance(1, 8) { 0 } else { 1 + rng.below(3) };
    (0..n).map(|_| random_cidr(rng)).collect()
}

/// Authored rule names: short ones that sort in several orders, and long ones whose ids exceed
/// nft's comment length (the comment is then a prefix and a hash; the shared 100-character
/// prefix makes only the hash tell them apart).
fn random_name(rng: &mut Rng) -> String {
    if rng.chance(1, 12) {
        format!("{}{}", "x".repeat(124), rng.below(3))
    } else {
        (*rng.pick(&["a", "api", "b", "db", "metrics", "web", "z9", "0-legacy"])).to_owned()
    }
}

fn random_ports(rng: &mut Rng) -> Vec<PortRange> {
    (0..1 + rng.below(3))
        .map(|_| {
            match rng.below(12) {
                0 => return PortRange::ALL,
                1 => return PortRange::new(1, 1 + rng.below(3) as u32).expect("a valid port range"),
                2 => return PortRange::new(65533 + rng.below(3) as u32, 65535).expect("a valid port range"),
                _ => {}
            }
            let start = u32::from(PORT_BASE) - 2 + rng.below(u64::from(PORTS) + 4) as u32;
            let end = start + rng.below(6) as u32;
            PortRange::new(start, end).expect("a valid port range")
        })
        .collect()
}

fn random_rule(rng: &mut Rng) -> ResolvedRule {
    use Protocol::*;
    let protocol = *rng.pick(&[Tcp, Tcp, Tcp, Udp, Udp, Udp, Icmp, Icmpv6]);
    let id = RuleId::new(&random_name(rng), protocol).expect("a valid rule id");
    let ports = if protocol.has_ports() { random_ports(rng) } else { Vec::new() };
    ResolvedRule::new(id, ports, random_peers(rng)).expect("a valid rule")
}

fn random_policy(rng: &mut Rng, version: u64, mode: Mode) -> WorkloadPolicy {
    let mut rules: BTreeMap<RuleId, ResolvedRule> = BTreeMap::new();
    for _ in 0..1 + rng.below(5) {
        let rule = random_rule(rng);
        rules.entry(rule.id().clone()).or_insert(rule);
    }
    // Often a second rule of the same protocol under another name that covers the first one's
    // packets too: which of them a packet is attributed to is then decided by rule order.
    if rng.chance(1, 2) {
        let shadowed = (*rng.pick(&rules.values().collect::<Vec<_>>())).clone();
        let id = RuleId::new(&random_name(rng), shadowed.protocol()).expect("a valid rule id");
        let ports: Vec<PortRange> = match shadowed.ports() {
            [] => Vec::new(),
            _ if rng.chance(1, 2) => vec![PortRange::ALL],
            ports => ports.to_vec(),
        };
        let peers = shadowed.peers().iter().copied().chain(random_peers(rng));
        let rule = ResolvedRule::new(id, ports, peers).expect("a valid rule");
        rules.entry(rule.id().clone()).or_insert(rule);
    }
    WorkloadPolicy::new(version, mode, rules.into_values()).expect("a valid policy")
}

/// The same rules, ports and mode with new peers: the store installs it as a peer-only
/// (element) update of the previous table.
fn with_new_peers(rng: &mut Rng, previous: &WorkloadPolicy, version: u64) -> WorkloadPolicy {
    let rules: Vec<ResolvedRule> = previous
        .rules()
        .map(|r| {
            ResolvedRule::new(r.id().clone(), r.ports().iter().copied(), random_peers(rng)).expect("rule")
        })
        .collect();
    WorkloadPolicy::new(version, previous.mode(), rules).expect("a valid policy")
}

fn random_mode(rng: &mut Rng, index: usize) -> Mode {
    // The first three cover every mode whatever the seed; then mostly the two that evaluate.
    match (index, rng.below(10)) {
        (0, _) | (3.., 5..) => Mode::Enforcement,
        (1, _) | (3.., 1..=4) => Mode::Simulation,
        _ => Mode::Visibility,
    }
}

fn describe(policy: &WorkloadPolicy) -> String {
    let join = |items: Vec<String>| items.join(",");
    let rules: Vec<String> = policy
        .rules()
        .map(|r| {
            format!(
                "{} ports [{}] peers [{}]",
                r.id(),
                join(r.ports().iter().map(ToString::to_string).collect()),
                join(r.peers().iter().map(ToString::to_string).collect())
            )
        })
        .collect();
    format!("v{} {} {{ {} }}", policy.version(), policy.mode(), rules.join("; "))
}

/// One packet from the client to the host.
#[derive(Debug, Clone)]
struct Packet {
    id: u32,
    protocol: Protocol,
    src: &'static str,
    dst: &'static str,
    /// 0 for ICMP and ICMPv6.
    port: u16,
}

impl std::fmt::Display for Packet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{} {} {} -> {} port {}", self.id, self.protocol, self.src, self.dst, self.port)
    }
}

/// Half the packets aim at a random rule (its protocol, a source its peers hold, a port in one
/// of its ranges), so allowed packets are common; the rest are anything.
fn random_packet(rng: &mut Rng, policy: &WorkloadPolicy, id: u32) -> Packet {
    use Protocol::*;
    let rules: Vec<&ResolvedRule> = policy.rules().collect();
    let target = (!rules.is_empty() && rng.chance(1, 2)).then(|| *rng.pick(&rules));
    let protocol = match target {
        Some(rule) => rule.protocol(),
        None => *rng.pick(&[Tcp, Tcp, Udp, Udp, Icmp, Icmpv6]),
    };
    let v6 = match protocol {
        Icmp => false,
        Icmpv6 => true,
        Tcp | Udp => rng.chance(1, 2),
    };
    let family: &[&'static str] = if v6 { &CLIENT6 } else { &CLIENT4 };
    let inside: Vec<&'static str> = match target {
        Some(rule) => family
            .iter()
            .copied()
            .filter(|a| {
                let a: IpAddr = a.parse().expect("address");
                rule.peers().iter().any(|c| c.contains(&a))
            })
            .collect(),
        None => Vec::new(),
    };
    let src = if inside.is_empty() { *rng.pick(family) } else { *rng.pick(&inside) };
    let listened = listened_ports();
    let port = match (protocol.has_ports(), target) {
        (false, _) => 0,
        (true, Some(rule)) => {
            let range = *rng.pick(rule.ports());
            let inside: Vec<u16> = listened.iter().copied().filter(|p| range.contains(*p)).collect();
            if inside.is_empty() { *rng.pick(&listened) } else { *rng.pick(&inside) }
        }
        (true, None) => *rng.pick(&listened),
    };
    Packet { id, protocol, src, dst: if v6 { HOST6 } else { HOST4 }, port }
}

/// What one packet did: the packets each counter of the table counted for it (by comment;
/// uncommented counters under "(no comment)"), and whether it reached a socket on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Verdict {
    counted: BTreeMap<String, u64>,
    arrived: bool,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let counted: Vec<String> = self.counted.iter().map(|(c, n)| format!("{c:?}+{n}")).collect();
        let counted = if counted.is_empty() { "no counter".to_owned() } else { counted.join(" ") };
        write!(f, "{counted}, {}", if self.arrived { "arrived" } else { "did not arrive" })
    }
}

/// The verdict `decide`'s answer means in the table: exactly one counter counts the packet
/// once (the deciding rule's, the drop's or the would-block's; none in visibility), and it
/// arrives unless blocked.
fn expected(decision: Decision, rule: Option<&RuleId>) -> Verdict {
    let one = |c: String| BTreeMap::from([(c, 1)]);
    match (decision, rule) {
        (Decision::Allowed, Some(rule)) => {
            Verdict { counted: one(rule_comment(rule.as_str())), arrived: true }
        }
        (Decision::Blocked, _) => Verdict { counted: one(TERMINAL_DROP.to_owned()), arrived: false },
        (Decision::WouldBlock, _) => Verdict { counted: one(TERMINAL_WOULD_BLOCK.to_owned()), arrived: true },
        (Decision::Observed, _) => Verdict { counted: BTreeMap::new(), arrived: true },
        (Decision::Allowed, None) => panic!("decide allowed without naming a rule"),
    }
}

/// Every counter of the chain, summed by comment, read with nft (not the agent's own readback).
fn counters(host: &NetNs) -> BTreeMap<String, u64> {
    let text = host.nft(&["list", "chain", "inet", "innerwall", "input"]);
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((_, after)) = line.split_once("counter packets ") else { continue };
        let packets: u64 =
            after.split_whitespace().next().and_then(|n| n.parse().ok()).expect("a counter's packets");
        let comment = line
            .split_once("comment \"")
            .and_then(|(_, c)| c.split_once('"'))
            .map_or("(no comment)", |(c, _)| c)
            .to_owned();
        *out.entry(comment).or_insert(0) += packets;
    }
    out
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(c, &n)| {
            let moved = n.saturating_sub(before.get(c).copied().unwrap_or(0));
            (moved > 0).then(|| (c.clone(), moved))
        })
        .collect()
}

/// A python process in a namespace whose stdout lines arrive on a channel; killed on drop.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Proc {
    fn spawn(ns: &NetNs, script: &str, args: &[String]) -> Proc {
        let mut child = ns
            .command("python3")
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting python3");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let proc = Proc { child, stdin, lines };
        let ready = proc.lines.recv_timeout(Duration::from_secs(10)).expect("the python process starts");
        assert_eq!(ready, "ready", "{script}");
        proc
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).expect("writing to the client");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host's listeners: TCP and UDP on every test port (dual stack), and raw ICMP/ICMPv6
/// sockets, which get a copy of every echo request that passed the input chain. One line per
/// arrival: `<kind> <src> <tag> <port>` (tag: the TCP source port; the packet id otherwise).
const SERVER: &str = r#"
import selectors, socket, struct, sys
ports = [int(p) for p in sys.argv[1].split(',')]
sel = selectors.DefaultSelector()
def out(line):
    sys.stdout.write(line + '\n'); sys.stdout.flush()
def host(a): return a[7:] if a.startswith('::ffff:') else a
for port in ports:
    t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    t.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(('::', port)); t.listen(128); t.setblocking(False)
    sel.register(t, selectors.EVENT_READ, ('tcp', port))
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    u.bind(('::', port)); u.setblocking(False)
    sel.register(u, selectors.EVENT_READ, ('udp', port))
i4 = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); i4.setblocking(False)
sel.register(i4, selectors.EVENT_READ, ('icmp', 0))
i6 = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6); i6.setblocking(False)
sel.register(i6, selectors.EVENT_READ, ('icmpv6', 0))
out('ready')
while True:
    for key, _ in sel.select():
        kind, port = key.data; s = key.fileobj
        try:
            if kind == 'tcp':
                c, peer = s.accept(); c.close()
                out('tcp %s %d %d' % (host(peer[0]), peer[1], port))
            elif kind == 'udp':
                data, peer = s.recvfrom(2048)
                if data.startswith(b'iw '): out('udp %s %s %d' % (host(peer[0]), data[3:].decode(), port))
            elif kind == 'icmp':
                data, peer = s.recvfrom(2048); data = data[(data[0] & 0x0f) * 4:]
                if data[0] == 8: out('icmp %s %d 0' % (peer[0], struct.unpack('!H', data[4:6])[0]))
            else:
                data, peer = s.recvfrom(2048)
                if data[0] == 128: out('icmpv6 %s %d 0' % (peer[0], struct.unpack('!H', data[4:6])[0]))
        except (BlockingIOError, InterruptedError):
            pass
"#;

/// The client: one packet per stdin line `<id> <kind> <src> <dst> <port>`, answered with
/// `sent <id> <tag>` once it is on the wire. TCP is a non-blocking connect whose socket closes
/// when it completes or after 0.5 s (before the kernel's first SYN retransmit at 1 s, so a
/// dropped SYN is counted once), from source port 40000 + id: a port the kernel picked could be
/// one an earlier connection from the same address to the same port used (its TIME_WAIT is on
/// the host when the host closed first), and that earlier arrival would be read as this
/// packet's; UDP one datagram carrying the id; ICMP one echo request whose identifier is the id.
const CLIENT: &str = r#"
import os, selectors, socket, struct, sys, time
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
def fam(a): return socket.AF_INET6 if ':' in a else socket.AF_INET
def out(line):
    sys.stdout.write(line + '\n'); sys.stdout.flush()
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ, None)
pending = {}
def send(i, kind, src, dst, port):
    if kind == 'tcp':
        s = socket.socket(fam(dst), socket.SOCK_STREAM); s.bind((src, 40000 + i)); s.setblocking(False)
        s.connect_ex((dst, port)); tag = s.getsockname()[1]
        sel.register(s, selectors.EVENT_WRITE, 'tcp'); pending[s] = time.monotonic() + 0.5
    elif kind == 'udp':
        s = socket.socket(fam(dst), socket.SOCK_DGRAM); s.bind((src, 0))
        s.sendto(b'iw %d' % i, (dst, port)); tag = i; s.close()
    else:
        v6 = kind == 'icmpv6'
        s = socket.socket(fam(dst), socket.SOCK_RAW, socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP)
        s.bind((src, 0))
        pkt = struct.pack('!BBHHH', 128 if v6 else 8, 0, 0, i & 0xffff, 1) + b'innerwall'
        if not v6: pkt = pkt[:2] + struct.pack('!H', csum(pkt)) + pkt[4:]
        s.sendto(pkt, (dst, 0)); tag = i; s.close()
    out('sent %d %d' % (i, tag))
buf = b''
out('ready')
while True:
    now = time.monotonic()
    for s, deadline in list(pending.items()):
        if deadline <= now:
            sel.unregister(s); s.close(); del pending[s]
    timeout = max(0.0, min(pending.values()) - now) if pending else None
    for key, _ in sel.select(timeout):
        if key.data is None:
            data = os.read(0, 65536)
            if not data: sys.exit(0)
            buf += data
            while b'\n' in buf:
                line, buf = buf.split(b'\n', 1)
                f = line.decode().split()
                send(int(f[0]), f[1], f[2], f[3], int(f[4]))
        elif key.fileobj in pending:
            sel.unregister(key.fileobj); key.fileobj.close(); del pending[key.fileobj]
"#;

/// What the server reports for one arrival: kind, source, tag, destination port.
type Arrival = (String, IpAddr, u64, u16);

fn parse_arrival(line: &str) -> Arrival {
    let f: Vec<&str> = line.split_whitespace().collect();
    let parsed = match f[..] {
        [kind, src, tag, port] => {
            (|| Some((kind.to_owned(), src.parse().ok()?, tag.parse().ok()?, port.parse().ok()?)))()
        }
        _ => None,
    };
    parsed.unwrap_or_else(|| panic!("unexpected server line {line:?}"))
}

/// The kernel side of the comparison: the host namespace with its table, server and the
/// client that sends.
struct Kernel<'a> {
    host: &'a NetNs,
    client: Proc,
    server: Proc,
    arrivals: BTreeSet<Arrival>,
    last: BTreeMap<String, u64>,
}

impl Kernel<'_> {
    /// Drains the server's reports, waiting (at most until `deadline`) for `want` if given.
    fn arrived(&mut self, want: Option<&Arrival>, deadline: Instant) -> bool {
        loop {
            while let Ok(line) = self.server.lines.try_recv() {
                self.arrivals.insert(parse_arrival(&line));
            }
            let Some(want) = want else { return false };
            if self.arrivals.contains(want) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.server.lines.recv_timeout(left) {
                Ok(line) => {
                    self.arrivals.insert(parse_arrival(&line));
                }
                Err(RecvTimeoutError::Timeout) => return false,
                Err(RecvTimeoutError::Disconnected) => panic!("the server exited"),
            }
        }
    }

    /// Sends one packet and reads the kernel's verdict back: counters are polled until one
    /// moves (every packet a policy evaluates is counted by exactly one rule); accepted
    /// packets are then awaited at the host's sockets. A dropped packet is proven dropped by
    /// the drop counter, never by waiting. Returns the verdict and the arrival key.
    fn verdict(&mut self, packet: &Packet, mode: Mode) -> (Verdict, Arrival) {
        self.client.send(&format!(
            "{} {} {} {} {}",
            packet.id, packet.protocol, packet.src, packet.dst, packet.port
        ));
        let sent = self.client.lines.recv_timeout(Duration::from_secs(10)).expect("the client sends");
        let tag: u64 = match sent.split_whitespace().collect::<Vec<_>>()[..] {
            ["sent", id, tag] if id == packet.id.to_string() => tag.parse().expect("tag"),
            _ => panic!("client answered {sent:?} for packet {packet}"),
        };
        let key: Arrival =
            (packet.protocol.to_string(), packet.src.parse().expect("address"), tag, packet.port);
        let deadline = Instant::now() + EVENT_TIMEOUT;
        let counted = if mode == Mode::Visibility {
            BTreeMap::new()
        } else {
            loop {
                let now = counters(self.host);
                let moved = delta(&self.last, &now);
                if !moved.is_empty() || Instant::now() >= deadline {
                    self.last = now;
                    break moved;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        let arrived = if counted.contains_key(TERMINAL_DROP) {
            self.arrived(None, deadline);
            self.arrivals.contains(&key)
        } else {
            self.arrived(Some(&key), deadline)
        };
        let counted = if mode == Mode::Visibility {
            // Whatever the table counted meanwhile (it should hold no counter at all).
            let now = counters(self.host);
            let moved = delta(&self.last, &now);
            self.last = now;
            moved
        } else {
            counted
        };
        (Verdict { counted, arrived }, key)
    }
}

struct Disagreement {
    policy: String,
    packet: Packet,
    decided: String,
    kernel: String,
}

#[test]
fn evaluator_agrees_with_nftables() {
    require_root();
    let seed: u64 = match std::env::var("INNERWALL_EVALUATOR_SEED") {
        Ok(s) => s.parse().expect("INNERWALL_EVALUATOR_SEED is a u64"),
        Err(_) => SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos() as u64,
    };
    eprintln!("evaluator_agrees_with_nftables: seed {seed} (rerun with INNERWALL_EVALUATOR_SEED={seed})");
    let started = Instant::now();
    let pair = Pair::new("eval");
    pair.add_client_addresses(&CLIENT4[2..], &CLIENT6[2..]);
    let server = Proc::spawn(
        &pair.host,
        SERVER,
        &[listened_ports().iter().map(u16::to_string).collect::<Vec<_>>().join(",")],
    );
    let client = Proc::spawn(&pair.client, CLIENT, &[]);
    let mut kernel =
        Kernel { host: &pair.host, client, server, arrivals: BTreeSet::new(), last: BTreeMap::new() };
    let state = TempDir::new("eval");
    let mut store = LinuxPolicyStore::new(&state.0);
    let mut rng = Rng(seed);

    let mut disagreements: Vec<Disagreement> = Vec::new();
    let mut judged_dropped: Vec<(String, Packet, Arrival)> = Vec::new();
    let mut decisions: BTreeMap<Decision, usize> = BTreeMap::new();
    let mut installs: BTreeMap<String, usize> = BTreeMap::new();
    let mut previous: Option<WorkloadPolicy> = None;
    let mut next_id = 1u32;
    let (mut overlapping, mut hashed) = (0usize, 0usize);
    for index in 0..POLICIES {
        let version = index as u64 + 1;
        // The first three policies come from random_mode, so every mode is installed whatever the
        // seed (a derived policy at index 2 once left a run without an observed packet).
        let policy = match previous.as_ref().filter(|_| index >= 3) {
            Some(p) if p.mode() != Mode::Visibility && rng.chance(1, 4) => {
                with_new_peers(&mut rng, p, version)
            }
            // A mode change of the same rules, as a promotion or a rollback installs it.
            Some(p) if rng.chance(1, 8) => {
                let mode = if p.mode() == Mode::Enforcement { Mode::Simulation } else { Mode::Enforcement };
                p.clone().with_version(version).with_mode(mode)
            }
            _ => {
                let mode = random_mode(&mut rng, index);
                random_policy(&mut rng, version, mode)
            }
        };
        let how = pair
            .host
            .enter(|| store.apply(&policy))
            .unwrap_or_else(|e| panic!("seed {seed}: installing {}: {e}", describe(&policy)));
        let how = match how {
            Installed::Full | Installed::FullAfterRefusedElements => "full",
            Installed::Elements { .. } => "elements",
            Installed::Unchanged => "unchanged",
            Installed::Held => {
                panic!("seed {seed}: the store held {} instead of installing it", describe(&policy))
            }
        };
        *installs.entry(how.to_owned()).or_insert(0) += 1;
        kernel.last = counters(&pair.host);
        let described = describe(&policy);
        for _ in 0..PACKETS_PER_POLICY {
            let packet = random_packet(&mut rng, &policy, next_id);
            next_id += 1;
            let src: IpAddr = packet.src.parse().expect("address");
            let (decision, rule) = decide(Some(&policy), src, packet.port, packet.protocol);
            *decisions.entry(decision).or_insert(0) += 1;
            if let Some(rule) = &rule {
                // Coverage: the first match in id order decided among several matching rules
                // (decide on the policy without the winner still allows), or the rule's counter
                // is found under a hashed comment.
                let others =
                    WorkloadPolicy::new(0, policy.mode(), policy.rules().filter(|r| r.id() != rule).cloned())
                        .expect("a subset of a valid policy");
                overlapping += usize::from(
                    decide(Some(&others), src, packet.port, packet.protocol).0 == Decision::Allowed,
                );
                hashed += usize::from(rule.as_str().len() > MAX_COMMENT);
            }
            let want = expected(decision, rule.as_ref());
            let (got, key) = kernel.verdict(&packet, policy.mode());
            if !got.arrived {
                judged_dropped.push((described.clone(), packet.clone(), key));
            }
            if got != want {
                let rule = rule.map(|r| format!(" by {r}")).unwrap_or_default();
                disagreements.push(Disagreement {
                    policy: described.clone(),
                    packet,
                    decided: format!("{decision}{rule} (expects {want})"),
                    kernel: got.to_string(),
                });
            }
        }
        previous = Some(policy);
    }
    // A packet the kernel counted as dropped must never turn up later.
    kernel.arrived(None, Instant::now());
    for (policy, packet, key) in judged_dropped {
        if kernel.arrivals.contains(&key) {
            disagreements.push(Disagreement {
                policy,
                packet,
                decided: "(see above)".to_owned(),
                kernel: "arrived after its verdict was read as not arrived".to_owned(),
            });
        }
    }
    let packets = next_id as usize - 1;
    eprintln!(
        "evaluator_agrees_with_nftables: seed {seed}: {POLICIES} policies ({installs:?} installs), {packets} packets \
         ({decisions:?}; {overlapping} allowed by the first of several matching rules, {hashed} by a rule with a \
         hashed comment), {} disagreement(s), {:.1} s",
        disagreements.len(),
        started.elapsed().as_secs_f64()
    );
    let report: Vec<String> = disagreements
        .iter()
        .take(25)
        .map(|d| {
            format!(
                "policy {}\n  packet {}\n  decide: {}\n  kernel: {}",
                d.policy, d.packet, d.decided, d.kernel
            )
        })
        .collect();
    assert!(
        disagreements.is_empty(),
        "seed {seed} (rerun with INNERWALL_EVALUATOR_SEED={seed}): decide and the kernel disagree on {} of \
         {packets} packets{}:\n{}",
        disagreements.len(),
        if disagreements.len() > 25 { " (first 25 listed)" } else { "" },
        report.join("\n")
    );
    // The run exercised every decision, so agreement means something.
    for d in [Decision::Allowed, Decision::Blocked, Decision::WouldBlock, Decision::Observed] {
        assert!(decisions.get(&d).is_some_and(|n| *n > 0), "seed {seed}: no packet was {d}: {decisions:?}");
    }
    assert!(overlapping > 0 && hashed > 0, "seed {seed}: rule order or hashed comments went untested");
}
