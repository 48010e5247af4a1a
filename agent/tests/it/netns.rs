//! Network-namespace fixtures: a guard that creates a uniquely named namespace and deletes it
//! on drop (also on panic), a client/host pair joined by veth, running code or processes inside
//! a namespace, and real TCP/UDP/ICMP probes sent with python3 sockets.

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Fails loudly unless the suite can create network namespaces (root, `ip` available).
pub fn require_root() {
    let uid = Command::new("id").arg("-u").output().expect("running id -u");
    let uid = String::from_utf8_lossy(&uid.stdout).trim().to_owned();
    assert!(
        uid == "0",
        "the agent's enforcement tests need root (network namespaces and nf_tables); uid is {uid}. \
         Run `cargo test` as root (CI does); these tests never pass silently without it."
    );
}

/// Runs a command, panicking with its output when it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn ip(args: &[&str]) {
    run(Command::new("ip").args(args));
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh network namespace, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(tag: &str) -> NetNs {
        require_root();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("iwt-{tag}-{}-{n}", std::process::id());
        ip(&["netns", "add", &name]);
        let ns = NetNs { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// `ip netns exec <ns> <program> <args…>`
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Runs `nft <args>` in the namespace and returns its stdout.
    pub fn nft(&self, args: &[&str]) -> String {
        String::from_utf8(run(self.command("nft").args(args)).stdout).expect("utf-8")
    }

    /// Runs `f` on a thread that entered this namespace, so netlink sockets it opens (and
    /// threads it spawns) live here.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&path);
                f()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

#[allow(unsafe_code)]
fn setns(path: &Path) {
    use std::os::fd::AsRawFd as _;
    let file = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    // SAFETY: setns(2) on a valid namespace fd; it only changes this thread's namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {}: {}", path.display(), std::io::Error::last_os_error());
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

pub const HOST4: &str = "10.77.0.1";
pub const ALLOWED4: &str = "10.77.0.2";
pub const OTHER4: &str = "10.77.0.3";
pub const HOST6: &str = "fd77::1";
pub const ALLOWED6: &str = "fd77::2";
pub const OTHER6: &str = "fd77::3";

/// A client and a host namespace joined by a veth pair: the host has .1 / ::1, the client
/// has two addresses per family (.2 / ::2 are the "allowed" sources in tests, .3 / ::3 not).
#[derive(Debug)]
pub struct Pair {
    pub host: NetNs,
    pub client: NetNs,
}

impl Pair {
    pub fn new(tag: &str) -> Pair {
        let host = NetNs::new(&format!("{tag}-h"));
        let client = NetNs::new(&format!("{tag}-c"));
        // No duplicate address detection: link-local addresses are usable at once, so the first
        // IPv6 packets do not race DAD (only neighbour discovery, which the tests exercise).
        for ns in [&host, &client] {
            run(ns.command("sysctl").args([
                "-qw",
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            ]));
        }
        ip(&[
            "-n",
            &host.name,
            "link",
            "add",
            "veth0",
            "type",
            "veth",
            "peer",
            "name",
            "veth0",
            "netns",
            &client.name,
        ]);
        for (ns, v4, v6) in
            [(&host, &[HOST4][..], &[HOST6][..]), (&client, &[ALLOWED4, OTHER4], &[ALLOWED6, OTHER6])]
        {
            for a in v4 {
                ip(&["-n", &ns.name, "addr", "add", &format!("{a}/24"), "dev", "veth0"]);
            }
            for a in v6 {
                ip(&["-n", &ns.name, "-6", "addr", "add", &format!("{a}/64"), "dev", "veth0", "nodad"]);
            }
            ip(&["-n", &ns.name, "link", "set", "veth0", "up"]);
        }
        let pair = Pair { host, client };
        pair.warm_neighbours();
        pair
    }

    /// Resolves every client address on the host and back (no policy installed yet), so later
    /// parallel probes do not race the kernel's first neighbour solicitations: parallel first
    /// contacts from two source addresses sometimes wait for the 1 s NS retransmit.
    fn warm_neighbours(&self) {
        let all = [ALLOWED4, OTHER4, ALLOWED6, OTHER6];
        let probes: Vec<Probe> =
            all.iter().map(|src| icmp(src, if src.contains(':') { HOST6 } else { HOST4 })).collect();
        let got = probe_with_timeout(&self.client, &probes, 3.0);
        assert!(got.iter().all(|ok| *ok), "warming neighbour caches failed: {got:?}");
    }

    /// Adds more addresses to the client's veth (IPv4 in the host's /24, IPv6 in its /64, so
    /// the host answers them on-link) and resolves them on the host, as [`Pair::new`] does for
    /// its own, so the first policy-checked packet from each does not race neighbour discovery.
    pub fn add_client_addresses(&self, v4: &[&'static str], v6: &[&'static str]) {
        for a in v4 {
            ip(&["-n", &self.client.name, "addr", "add", &format!("{a}/24"), "dev", "veth0"]);
        }
        for a in v6 {
            ip(&["-n", &self.client.name, "-6", "addr", "add", &format!("{a}/64"), "dev", "veth0", "nodad"]);
        }
        let probes: Vec<Probe> =
            v4.iter().map(|src| icmp(src, HOST4)).chain(v6.iter().map(|src| icmp(src, HOST6))).collect();
        let got = probe_with_timeout(&self.client, &probes, 3.0);
        assert!(got.iter().all(|ok| *ok), "warming neighbour caches for {v4:?} {v6:?} failed: {got:?}");
    }

    /// Forgets neighbour entries on both sides, so the next IPv6 packet needs neighbour
    /// discovery through the host's input chain.
    pub fn flush_neighbours(&self) {
        for ns in [&self.host, &self.client] {
            ip(&["-n", &ns.name, "neigh", "flush", "dev", "veth0"]);
        }
    }
}

const SERVER: &str = r#"
import socket, sys, threading
tcp, udp = [int(p) for p in sys.argv[1].split(',') if p], [int(p) for p in sys.argv[2].split(',') if p]
def serve_tcp(s):
    while True:
        c, _ = s.accept()
        c.close()
def serve_udp(s):
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)
for port in tcp:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('::', port)); s.listen(64)
    threading.Thread(target=serve_tcp, args=(s,), daemon=True).start()
for port in udp:
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(('::', port))
    threading.Thread(target=serve_udp, args=(s,), daemon=True).start()
print('ready', flush=True)
threading.Event().wait()
"#;

/// TCP listeners and UDP echo servers in a namespace (dual stack), killed on drop.
#[derive(Debug)]
pub struct Server {
    child: Child,
}

impl Server {
    pub fn start(ns: &NetNs, tcp: &[u16], udp: &[u16]) -> Server {
        let join = |ports: &[u16]| ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        let mut child = ns
            .command("python3")
            .args(["-c", SERVER, &join(tcp), &join(udp)])
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the python server");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut line).expect("server output");
        assert_eq!(line.trim(), "ready", "server did not start");
        Server { child }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const CLIENT: &str = r#"
import json, os, socket, struct, sys, threading, time
T = float(sys.argv[2])
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
def fam(a): return socket.AF_INET6 if ':' in a else socket.AF_INET
def tcp(p):
    s = socket.socket(fam(p['dst']), socket.SOCK_STREAM); s.settimeout(T); s.bind((p['src'], 0))
    try: s.connect((p['dst'], p['port'])); return True
    except ConnectionRefusedError: return True
    except OSError: return False
    finally: s.close()
def udp(p):
    s = socket.socket(fam(p['dst']), socket.SOCK_DGRAM); s.settimeout(T); s.bind((p['src'], 0))
    try:
        s.connect((p['dst'], p['port'])); s.send(b'innerwall'); return s.recv(64) == b'innerwall'
    except ConnectionRefusedError: return True
    except OSError: return False
    finally: s.close()
def icmp(p):
    v6 = ':' in p['dst']
    s = socket.socket(fam(p['dst']), socket.SOCK_RAW, socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP)
    s.bind((p['src'], 0)); ident = (os.getpid() + p['i']) & 0xffff
    pkt = struct.pack('!BBHHH', 128 if v6 else 8, 0, 0, ident, 1) + b'innerwall'
    if not v6: pkt = pkt[:2] + struct.pack('!H', csum(pkt)) + pkt[4:]
    s.sendto(pkt, (p['dst'], 0)); end = time.time() + T
    try:
        while time.time() < end:
            s.settimeout(max(0.01, end - time.time()))
            data = s.recv(2048)
            if not v6: data = data[(data[0] & 0x0f) * 4:]
            if data[0] == (129 if v6 else 0) and struct.unpack('!H', data[4:6])[0] == ident: return True
    except OSError: pass
    finally: s.close()
    return False
probes = json.loads(sys.argv[1]); out = [None] * len(probes)
def go(i, p):
    p['i'] = i; out[i] = {'tcp': tcp, 'udp': udp, 'icmp': icmp}[p['kind']](p)
ts = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(probes)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"#;

/// One connection attempt from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub kind: &'static str,
    pub src: &'static str,
    pub dst: &'static str,
    pub port: u16,
}

pub fn tcp(src: &'static str, dst: &'static str, port: u16) -> Probe {
    Probe { kind: "tcp", src, dst, port }
}
pub fn udp(src: &'static str, dst: &'static str, port: u16) -> Probe {
    Probe { kind: "udp", src, dst, port }
}
pub fn icmp(src: &'static str, dst: &'static str) -> Probe {
    Probe { kind: "icmp", src, dst, port: 0 }
}

/// Sends the probes in parallel from the client namespace; `true` = the host answered
/// (connected, refused, echoed), `false` = silence until the timeout (which [`expect_reach`]
/// only takes for a drop when the host's drop counter agrees).
pub fn probe_with_timeout(client: &NetNs, probes: &[Probe], timeout: f64) -> Vec<bool> {
    let json = serde_json::to_string(
        &probes
            .iter()
            .map(|p| serde_json::json!({"kind": p.kind, "src": p.src, "dst": p.dst, "port": p.port}))
            .collect::<Vec<_>>(),
    )
    .expect("json");
    let out = run(client.command("python3").args(["-c", CLIENT, &json, &timeout.to_string()]));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("probe output: {e}: {:?}", out.stdout))
}

/// Packets the terminal drop rules of table `inet innerwall` in `ns` have counted (`counter
/// drop comment "innerwall:drop"`, summed over the rules that carry it); 0 without the table.
pub fn dropped_packets(ns: &NetNs) -> u64 {
    let out = ns.command("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    if !out.status.success() {
        return 0;
    }
    let text = String::from_utf8(out.stdout).expect("utf-8");
    text.lines()
        .filter(|l| l.contains("drop comment \"innerwall:drop\""))
        .map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "packets");
            // A drop rule without a counter counts nothing.
            words.next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0)
        })
        .sum()
}

/// Sends the probes from `client` (as [`probe_with_timeout`]) and returns their outcomes with
/// the packets the host's drop rule counted meanwhile.
pub fn probe_counting_drops(
    host: &NetNs,
    client: &NetNs,
    probes: &[Probe],
    timeout: f64,
) -> (Vec<bool>, u64) {
    let before = dropped_packets(host);
    let got = probe_with_timeout(client, probes, timeout);
    (got, dropped_packets(host) - before)
}

/// Asserts that `silent` probes that timed out were dropped by the host's table: its drop
/// counter counted at least one packet for each. Silence alone proves nothing (a lost packet,
/// a server that is not there, a broken link are silent too).
pub fn assert_drops_counted(silent: usize, dropped: u64) {
    assert!(
        dropped >= silent as u64,
        "{silent} probe(s) went unanswered, but the drop rule of table inet innerwall counted {dropped} packet(s): \
         silence is not a drop"
    );
}

/// Asserts each probe's outcome, naming the ones that differ; every probe expected to be
/// dropped must also be counted by the host's drop rule ([`assert_drops_counted`]).
pub fn expect_reach(host: &NetNs, client: &NetNs, expected: &[(Probe, bool)]) {
    let probes: Vec<Probe> = expected.iter().map(|(p, _)| *p).collect();
    let (got, dropped) = probe_counting_drops(host, client, &probes, 0.7);
    let wrong: Vec<String> = expected
        .iter()
        .zip(&got)
        .filter(|((_, want), got)| want != *got)
        .map(|((p, want), _)| {
            format!(
                "{} {} -> {}:{} expected {}",
                p.kind,
                p.src,
                p.dst,
                p.port,
                if *want { "to pass" } else { "dropped" }
            )
        })
        .collect();
    assert!(wrong.is_empty(), "probe outcomes differ:\n{}", wrong.join("\n"));
    assert_drops_counted(expected.iter().filter(|(_, pass)| !pass).count(), dropped);
}

/// Polls until `f` returns `Some`, or panics after `timeout` with `what`.
pub fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A temporary directory removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("innerwall-agent-it-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
