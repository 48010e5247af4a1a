//! A host for end-to-end tests with the real agent binary: a network namespace of its own (with
//! a veth pair for the capture to attach to), so the agent's nftables table and tc programs never
//! touch the machine's own namespace, and the agent process, killed by PID when dropped.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub struct Namespace(String);

impl Namespace {
    pub fn create(name: String) -> Namespace {
        let ns = Namespace(name);
        for args in [
            vec!["netns", "add", &ns.0],
            vec!["-n", &ns.0, "link", "set", "lo", "up"],
            vec!["-n", &ns.0, "link", "add", "iw0", "type", "veth", "peer", "name", "iw1"],
            vec!["-n", &ns.0, "address", "add", "10.81.0.1/24", "dev", "iw0"],
            vec!["-n", &ns.0, "link", "set", "iw0", "up"],
            vec!["-n", &ns.0, "link", "set", "iw1", "up"],
        ] {
            let status = Command::new("ip").args(&args).status().expect("running ip");
            assert!(status.success(), "ip {args:?} failed");
        }
        ns
    }

    /// Moves the calling thread (and so every process and socket it creates) into it.
    #[allow(unsafe_code)]
    pub fn enter(&self) {
        use std::os::fd::AsRawFd as _;
        let file = File::open(format!("/run/netns/{}", self.0)).expect("netns file");
        // SAFETY: setns(2) on a valid namespace fd; it moves only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The address of the host's end of the veth pair (`iw0`).
pub const HOST_ADDRESS: &str = "10.81.0.1";
/// The address of the peer's end (`iw1`), once [`Peer::create`] moved it into the peer's own
/// namespace.
pub const PEER_ADDRESS: &str = "10.81.0.2";

/// A second namespace holding the other end of the host's veth pair: packets sent from it
/// arrive at the host's `iw0` from outside, as genuine inbound traffic.
pub struct Peer(Namespace);

impl Peer {
    pub fn create(host: &Namespace) -> Peer {
        let name = format!("{}-peer", host.0);
        let status = Command::new("ip").args(["netns", "add", &name]).status().expect("running ip");
        assert!(status.success(), "ip netns add {name} failed");
        let peer = Peer(Namespace(name));
        let address = format!("{PEER_ADDRESS}/24");
        for args in [
            vec!["-n", &host.0, "link", "set", "iw1", "netns", &peer.0.0],
            vec!["-n", &peer.0.0, "address", "add", &address, "dev", "iw1"],
            vec!["-n", &peer.0.0, "link", "set", "iw1", "up"],
        ] {
            let status = Command::new("ip").args(&args).status().expect("running ip");
            assert!(status.success(), "ip {args:?} failed");
        }
        peer
    }

    /// Moves the calling thread into the peer's namespace ([`Namespace::enter`]).
    pub fn enter(&self) {
        self.0.enter();
    }

    /// Adds `address` (/24) to the peer's end of the veth pair, beside [`PEER_ADDRESS`].
    pub fn add_address(&self, address: &str) {
        let cidr = format!("{address}/24");
        let args = ["-n", &self.0.0, "address", "add", &cidr, "dev", "iw1"];
        let status = Command::new("ip").args(args).status().expect("running ip");
        assert!(status.success(), "ip {args:?} failed");
    }

    /// Runs `f` on a thread inside the peer's namespace, so processes it starts run there.
    pub fn inside<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let name = self.0.0.clone();
        std::thread::scope(|s| {
            s.spawn(move || {
                Namespace(name).enter_and_forget();
                f()
            })
            .join()
            .expect("thread in the peer's namespace")
        })
    }

    /// Sends `count` UDP datagrams from the peer to the host's `port`, from a thread inside the
    /// peer's namespace.
    pub fn send_udp(&self, port: u16, count: usize) {
        let name = self.0.0.clone();
        std::thread::spawn(move || {
            Namespace(name.clone()).enter_and_forget();
            let socket = std::net::UdpSocket::bind((PEER_ADDRESS, 0)).expect("bind in the peer");
            for _ in 0..count {
                socket.send_to(b"innerwall", (HOST_ADDRESS, port)).expect("send");
            }
        })
        .join()
        .expect("sender thread");
    }
}

impl Namespace {
    /// [`Namespace::enter`] for a thread that only borrows the name: the namespace is not
    /// deleted when this value goes.
    fn enter_and_forget(self) {
        self.enter();
        std::mem::forget(self);
    }
}

/// A running `innerwall-agent run`; killed by PID on drop.
pub struct Agent(Child);

impl Agent {
    pub fn start(state: &Path, server: &str) -> Agent {
        Agent::start_with(state, server, &[])
    }

    /// `innerwall-agent run` with `extra` flags.
    pub fn start_with(state: &Path, server: &str, extra: &[&str]) -> Agent {
        Agent::spawn(state, server, extra, &[])
    }

    /// `innerwall-agent run` with `extra` flags and environment variables.
    pub fn spawn(state: &Path, server: &str, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let log = File::options().create(true).append(true).open(state.join("agent.log")).expect("agent log");
        let child = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
            .args(["run", "--state-dir"])
            .arg(state)
            .args(["--server", server])
            .args(extra)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stderr(log)
            .spawn()
            .expect("spawning innerwall-agent");
        Agent(child)
    }

    /// SIGTERM, then waits for the agent to exit on its own.
    #[allow(unsafe_code)]
    pub fn terminate(mut self) {
        let pid = libc::pid_t::try_from(self.0.id()).expect("pid");
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.0.try_wait().expect("wait") {
                assert!(status.success(), "the agent exited with {status} on SIGTERM");
                return;
            }
            assert!(Instant::now() < deadline, "the agent did not exit within 15 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as i64
}

#[allow(unsafe_code)]
pub fn require_root() {
    // SAFETY: geteuid(2) has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "this test runs the agent in a network namespace and needs root (CI runs as root)");
}

/// Polls `check` until it finds something; panics with the agent's log after 30 s.
pub async fn wait_until<T>(what: &str, state: &Path, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = check().await {
            return found;
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(state.join("agent.log")).unwrap_or_default();
            panic!("timed out waiting for {what}; agent log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
