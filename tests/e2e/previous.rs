//! Version skew (issue 32, item 5): the previous release's agent — the commit
//! tests/fixtures/previous-release pins, built from this clone's history by `cargo xtask test`
//! into target/previous/<commit>/ — against this tree's control plane. It enrolls with its own
//! CLI over real mTLS, enforces in a network namespace (real packets: what is blocked stays
//! blocked, what is allowed arrives), and a policy change made after it enrolled reaches it.
//!
//! Also the packet probes `agent_upgrade_keeps_enforcing` (packages.rs) sends across an upgrade.

use std::io::ErrorKind;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use innerwall_control_plane::identity::ca::Signer as _;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;

use crate::host::{HOST_ADDRESS, Namespace, PEER_ADDRESS, Peer, require_root};
use crate::plane::Plane;

/// The previous release's build: (its commit, its directory under target/previous).
pub(crate) fn previous_release() -> (String, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let fixture = root.join("tests/fixtures/previous-release");
    let text = std::fs::read_to_string(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display()));
    let commit = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or_else(|| panic!("{} names no commit", fixture.display()))
        .to_ascii_lowercase();
    let dir = root.join("target/previous").join(&commit);
    assert!(
        dir.join("built").is_file(),
        "the previous release {commit} is not built in {}: `cargo xtask test` builds it",
        dir.display()
    );
    (commit, dir)
}

/// The previous release's agent binary.
pub(crate) fn previous_agent() -> PathBuf {
    previous_release().1.join("innerwall-agent")
}

/// The previous release's agent package.
pub(crate) fn previous_agent_package() -> PathBuf {
    let (commit, dir) = previous_release();
    std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("innerwall-agent_")))
        .unwrap_or_else(|| panic!("no innerwall-agent_*.deb of {commit} in {}", dir.display()))
}

/// Moves the calling thread into the named network namespace (which stays).
#[allow(unsafe_code)]
fn enter(netns: &str) {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::File::open(format!("/run/netns/{netns}")).expect("netns file");
    // SAFETY: setns(2) on a valid namespace fd; it moves only this thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

/// A UDP socket on the host's address, in the calling thread's network namespace.
pub(crate) struct Receiver(UdpSocket);

impl Receiver {
    pub(crate) fn bind(port: u16) -> Receiver {
        let socket = UdpSocket::bind((HOST_ADDRESS, port)).expect("bind on the host");
        socket.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        Receiver(socket)
    }

    /// What is queued now, without waiting.
    pub(crate) fn queued(&self) -> Vec<Vec<u8>> {
        self.0.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            match self.0.recv(&mut buf) {
                Ok(n) => got.push(buf[..n].to_vec()),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("recv: {e}"),
            }
        }
        self.0.set_nonblocking(false).unwrap();
        got
    }

    /// Waits (10 s at most) for a datagram holding `marker`; returns the ones before it.
    pub(crate) fn wait_for(&self, marker: &[u8]) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut before = Vec::new();
        let mut buf = [0u8; 64];
        while Instant::now() < deadline {
            match self.0.recv(&mut buf) {
                Ok(n) if &buf[..n] == marker => return before,
                Ok(n) => before.push(buf[..n].to_vec()),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => panic!("recv: {e}"),
            }
        }
        panic!("the marker {:?} never arrived", String::from_utf8_lossy(marker));
    }
}

/// Sends `datagrams` (port, payload), in order, from a thread in the peer's namespace.
pub(crate) fn send_from(peer_netns: &str, datagrams: Vec<(u16, Vec<u8>)>) {
    let netns = peer_netns.to_owned();
    std::thread::spawn(move || {
        enter(&netns);
        let socket = UdpSocket::bind((PEER_ADDRESS, 0)).expect("bind in the peer");
        for (port, payload) in datagrams {
            socket.send_to(&payload, (HOST_ADDRESS, port)).expect("send");
        }
    })
    .join()
    .expect("sender thread");
}

/// The packet counter of the table's final drop rule (`comment "innerwall:drop"`), as `nft`
/// in `netns` reads it.
pub(crate) fn drop_counter(netns: &str) -> Option<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "nft", "list", "table", "inet", "innerwall"])
        .output()
        .expect("nft");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().filter(|l| l.contains("comment \"innerwall:drop\"")).find_map(|line| {
        let after = line.split("counter packets ").nth(1)?;
        after.split_whitespace().next()?.parse().ok()
    })
}

/// Two streams from the peer, interleaved on one socket, one datagram pair a millisecond:
/// sequence numbers to an allowed port (counted by a receiver thread) and to a blocked port
/// (whose socket must stay empty). Marks are the count of pairs sent so far.
pub(crate) struct Stream {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    /// The highest sequence number received on the allowed port, plus one (0: none yet).
    seen: Arc<AtomicU64>,
    sender: Option<std::thread::JoinHandle<()>>,
    receiver: Option<std::thread::JoinHandle<(Vec<u64>, bool)>>,
    blocked: Receiver,
}

const END: &[u8] = b"end";

impl Stream {
    /// Binds both ports in the calling thread's namespace and starts sending from the peer's.
    pub(crate) fn start(peer_netns: &str, allowed: u16, blocked: u16) -> Stream {
        let (allowed_socket, blocked) = (Receiver::bind(allowed), Receiver::bind(blocked));
        let blocked_port = blocked.0.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(AtomicU64::new(0));
        let (stop_s, sent_s, netns) = (stop.clone(), sent.clone(), peer_netns.to_owned());
        let sender = std::thread::spawn(move || {
            enter(&netns);
            let socket = UdpSocket::bind((PEER_ADDRESS, 0)).expect("bind in the peer");
            let mut seq = 0u64;
            while !stop_s.load(Ordering::SeqCst) {
                socket.send_to(&seq.to_be_bytes(), (HOST_ADDRESS, blocked_port)).expect("send blocked");
                socket.send_to(&seq.to_be_bytes(), (HOST_ADDRESS, allowed)).expect("send allowed");
                seq += 1;
                sent_s.store(seq, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
            // Behind every datagram sent before it: once it arrives, they all were judged.
            socket.send_to(END, (HOST_ADDRESS, allowed)).expect("send the end marker");
        });
        let (stop_r, seen_r) = (stop.clone(), seen.clone());
        let receiver = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            let mut idle_since: Option<Instant> = None;
            loop {
                match allowed_socket.0.recv(&mut buf) {
                    Ok(n) if &buf[..n] == END => return (got, true),
                    Ok(8) => {
                        let seq = u64::from_be_bytes(buf[..8].try_into().unwrap());
                        got.push(seq);
                        seen_r.fetch_max(seq + 1, Ordering::SeqCst);
                        idle_since = None;
                    }
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        // Stopped and silent for 5 s: the end marker was lost.
                        if stop_r.load(Ordering::SeqCst)
                            && idle_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(5)
                        {
                            return (got, false);
                        }
                    }
                    Err(e) => panic!("recv: {e}"),
                }
            }
        });
        Stream { stop, sent, seen, sender: Some(sender), receiver: Some(receiver), blocked }
    }

    /// The number of pairs sent so far.
    pub(crate) fn mark(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// A mark between two phases: the pairs sent so far, returned once an allowed datagram
    /// sent after them arrived (packets flow now, and every one sent before was judged), and
    /// asserted that no blocked datagram arrived in the phase before it (`what`).
    pub(crate) fn checkpoint(&self, what: &str) -> u64 {
        let mark = self.mark();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.seen.load(Ordering::SeqCst) <= mark {
            assert!(Instant::now() < deadline, "no allowed packet sent after mark {mark} arrived ({what})");
            std::thread::sleep(Duration::from_millis(5));
        }
        let through = self.blocked.queued();
        assert!(
            through.is_empty(),
            "{} blocked datagrams got through {what} (sequence numbers {:?})",
            through.len(),
            through
                .iter()
                .take(10)
                .map(|d| d.first_chunk::<8>().map(|b| u64::from_be_bytes(*b)))
                .collect::<Vec<_>>()
        );
        mark
    }

    /// Waits (30 s at most) until `n` more allowed datagrams sent after `mark` arrived.
    pub(crate) fn wait_arrivals(&self, mark: u64, n: u64, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.seen.load(Ordering::SeqCst) <= mark + n {
            assert!(
                Instant::now() < deadline,
                "{n} allowed packets after mark {mark} never arrived ({what})"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the streams and returns what arrived on the allowed port (every sequence number,
    /// in arrival order) and on the blocked one, once the end marker proved every datagram was
    /// judged.
    pub(crate) fn finish(mut self) -> (u64, Vec<u64>, Vec<Vec<u8>>) {
        self.stop.store(true, Ordering::SeqCst);
        self.sender.take().unwrap().join().expect("sender");
        let (allowed, ended) = self.receiver.take().unwrap().join().expect("receiver");
        assert!(ended, "the end marker never arrived on the allowed port");
        (self.mark(), allowed, self.blocked.queued())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(sender) = self.sender.take() {
            let _ = sender.join();
        }
        if let Some(receiver) = self.receiver.take() {
            let _ = receiver.join();
        }
    }
}

/// `innerwall-agent run` of the previous release, killed by its PID on drop.
struct PreviousAgent(Child);

impl Drop for PreviousAgent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A host namespace with a peer namespace on its veth, the calling thread moved into the host's,
/// and a control plane (1 s heartbeats) whose listener is bound there: the peer `app=peer` at
/// [`PEER_ADDRESS`] is registered, and `app=web` admits it on udp:7000 (ruleset `ruleset`).
pub(crate) struct PeerEstate {
    pub(crate) plane: Plane,
    pub(crate) netns: String,
    pub(crate) ns: Namespace,
    pub(crate) peer: Peer,
    pub(crate) peer_netns: String,
}

impl PeerEstate {
    pub(crate) async fn start(prefix: &str, ruleset: &str) -> PeerEstate {
        let gateway = GatewayConfig { heartbeat: Duration::from_secs(1), ..GatewayConfig::default() };
        // The database first, from the machine's namespace; then the listener in the host's.
        let mut plane = Plane::create(Duration::from_secs(3600), gateway).await;
        let netns = format!("{prefix}-{}", std::process::id());
        let ns = Namespace::create(netns.clone());
        let peer = Peer::create(&ns);
        let peer_netns = format!("{netns}-peer");
        ns.enter();
        plane.up().await;
        plane.register("peer", &["app=peer"], PEER_ADDRESS).await;
        innerwall_control_plane::testing::admit(
            plane.pool(),
            ruleset,
            ("app", "web"),
            ("app", "peer"),
            "udp:7000",
        )
        .await
        .unwrap();
        PeerEstate { plane, netns, ns, peer, peer_netns }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_agent_works_with_this_control_plane() {
    require_root();
    let (commit, _) = previous_release();
    let binary = previous_agent();
    let PeerEstate { plane, netns, ns: _ns, peer, peer_netns } = PeerEstate::start("iw-prev", "early").await;
    let pool = plane.pool().clone();

    // Enrollment with the previous release's own CLI (the token on standard input).
    std::fs::create_dir_all(&plane.dir).unwrap();
    let ca = plane.dir.join("ca-bundle.pem");
    std::fs::write(&ca, plane.signer.ca_bundle_pem()).unwrap();
    let state = plane.dir.join("previous-host");
    let token = plane.mint(&["app=web"]).await;
    let mut enroll = Command::new(&binary)
        .args(["enroll", "--server", &plane.server(), "--token-file", "-", "--ca-bundle"])
        .arg(&ca)
        .arg("--state-dir")
        .arg(&state)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the previous agent's enroll");
    std::io::Write::write_all(enroll.stdin.as_mut().unwrap(), format!("{token}\n").as_bytes()).unwrap();
    drop(enroll.stdin.take());
    let out = tokio::task::spawn_blocking(move || enroll.wait_with_output().unwrap()).await.unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(out.status.success(), "enroll: {}{}", text(&out.stdout), text(&out.stderr));
    let (id, version): (uuid::Uuid, String) =
        sqlx::query_as("SELECT id, agent_version FROM workloads WHERE hostname <> 'peer'")
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}; enroll said: {}", text(&out.stdout)));
    let id = WorkloadId::from_uuid(id).unwrap();
    // The control plane recorded the previous build's own version at enrollment.
    assert!(
        version.ends_with(&format!("-prev-{}", &commit[..12])),
        "the enrolled agent is not the previous build of {commit}: {version}"
    );
    plane.set_mode(id, Mode::Enforcement).await;

    let log = std::fs::File::create(plane.dir.join("previous-agent.log")).unwrap();
    let _agent = PreviousAgent(
        Command::new(&binary)
            .args(["run", "--state-dir"])
            .arg(&state)
            .args(["--server", &plane.server()])
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .expect("the previous agent's run"),
    );
    let v1 = plane.status(id).await.2.expect("a rendered policy");
    plane.wait_synced(id, v1).await;

    // Real packets: 7001 and 7002 are blocked, 7000 is allowed; the marker on 7000 is sent
    // after the rest, so when it arrives the others were judged.
    let receivers = [7000, 7001, 7002].map(Receiver::bind);
    let dropped_before = drop_counter(&netns).expect("the enforced table's drop rule");
    let mut probes: Vec<(u16, Vec<u8>)> =
        (0..20u8).flat_map(|i| [(7001, vec![i]), (7002, vec![i]), (7000, vec![i])]).collect();
    probes.push((7000, b"v1 done".to_vec()));
    send_from(&peer_netns, probes);
    assert_eq!(receivers[0].wait_for(b"v1 done").len(), 20, "every allowed datagram arrived");
    assert!(
        receivers[1].queued().is_empty() && receivers[2].queued().is_empty(),
        "a blocked datagram arrived"
    );
    let dropped = drop_counter(&netns).unwrap() - dropped_before;
    assert!(dropped >= 40, "the table's drop rule counted {dropped} of the 40 blocked datagrams");

    // A change after enrollment: 7002 admitted, a new version, applied by the previous agent.
    innerwall_control_plane::testing::admit(&pool, "later", ("app", "web"), ("app", "peer"), "udp:7002")
        .await
        .unwrap();
    let v2 = plane.status(id).await.2.unwrap();
    assert!(v2 > v1, "the change made a new version (v{v1} -> v{v2})");
    plane.wait_synced(id, v2).await;
    let mut probes: Vec<(u16, Vec<u8>)> =
        (0..20u8).flat_map(|i| [(7001, vec![i]), (7002, vec![i])]).collect();
    probes.push((7000, b"v2 done".to_vec()));
    send_from(&peer_netns, probes);
    assert!(receivers[0].wait_for(b"v2 done").is_empty());
    assert_eq!(receivers[2].queued().len(), 20, "the newly admitted port receives after v{v2}");
    assert!(receivers[1].queued().is_empty(), "7001 stays blocked under v{v2}");
    drop(peer);
}
