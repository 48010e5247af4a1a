//! PERF-6: eBPF capture overhead on veth traffic (target: < 5 % throughput loss).
//!
//! A TCP bulk transfer (python3 sockets, one stream) from a client namespace to a host
//! namespace across a veth pair, alternating runs without and with the capture attached to the
//! host side (ingress records, egress tracks initiations). Prints Gbit/s per run, the medians,
//! and the loss. Needs root and `cargo xtask build-ebpf`.
//!
//! `cargo bench -p innerwall-agent --bench capture` (env: CAPTURE_BENCH_SECS, default 4;
//! CAPTURE_BENCH_ROUNDS, default 3).

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use innerwall_agent::evidence::capture::{Capture, OBJECT_ENV};

const RECEIVER: &str = r#"
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('10.78.0.1', 5201)); s.listen(8); print('ready', flush=True)
buf = bytearray(1 << 20)
while True:
    c, _ = s.accept()
    while c.recv_into(buf): pass
    c.close()
"#;

const SENDER: &str = r#"
import socket, sys, time
secs = float(sys.argv[1]); data = b'x' * (1 << 20)
s = socket.create_connection(('10.78.0.1', 5201)); sent = 0
end = time.time() + secs; start = time.time()
while time.time() < end: sent += s.send(data)
s.shutdown(socket.SHUT_WR); s.close()
print(sent * 8 / (time.time() - start) / 1e9)
"#;

fn sh(args: &[&str]) {
    let status = Command::new(args[0]).args(&args[1..]).status().expect("spawn");
    assert!(status.success(), "{args:?} failed");
}

struct Namespaces {
    host: String,
    client: String,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.host, &self.client] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

#[allow(unsafe_code)]
fn enter(ns: &str) {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns file");
    // SAFETY: setns(2) on a valid namespace fd; only this thread moves.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

fn run_sender(ns: &Namespaces, secs: f64) -> f64 {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.client, "taskset", "-c", "0", "python3", "-c", SENDER, &secs.to_string()])
        .output()
        .expect("sender");
    assert!(out.status.success(), "sender: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("sender output")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let object = std::env::var_os(OBJECT_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/innerwall-ebpf"));
    assert!(object.is_file(), "{} missing: run `cargo xtask build-ebpf`", object.display());
    let secs: f64 = std::env::var("CAPTURE_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(4.0);
    let rounds: usize = std::env::var("CAPTURE_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let pid = std::process::id();
    let ns = Namespaces { host: format!("iwb-h-{pid}"), client: format!("iwb-c-{pid}") };
    sh(&["ip", "netns", "add", &ns.host]);
    sh(&["ip", "netns", "add", &ns.client]);
    sh(&[
        "ip", "-n", &ns.host, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns",
        &ns.client,
    ]);
    for (name, addr) in [(&ns.host, "10.78.0.1/24"), (&ns.client, "10.78.0.2/24")] {
        sh(&["ip", "-n", name, "addr", "add", addr, "dev", "veth0"]);
        sh(&["ip", "-n", name, "link", "set", "veth0", "up"]);
        sh(&["ip", "-n", name, "link", "set", "lo", "up"]);
    }
    let mut receiver = Command::new("ip")
        .args(["netns", "exec", &ns.host, "taskset", "-c", "1", "python3", "-c", RECEIVER])
        .stdout(Stdio::piped())
        .spawn()
        .expect("receiver");
    let mut line = String::new();
    BufReader::new(receiver.stdout.as_mut().expect("piped")).read_line(&mut line).expect("ready");
    assert_eq!(line.trim(), "ready");

    run_sender(&ns, 1.0); // warm-up
    let (mut without, mut with, mut bpf_share) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let plain = run_sender(&ns, secs);
        let capture = std::thread::scope(|s| {
            s.spawn(|| {
                enter(&ns.host);
                Capture::attach(&["veth0".to_owned()], &object, None, log::logger()).expect("attach")
            })
            .join()
            .expect("attach thread")
        });
        let stats_on = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
        let captured = run_sender(&ns, secs);
        drop(stats_on);
        let mut capture = capture;
        let drained = capture.drain().expect("drain");
        let stats = capture.program_stats().expect("program stats");
        drop(capture);
        let packets: u64 = drained.records.iter().map(|r| r.packets).sum();
        let cost: Vec<String> = stats
            .iter()
            .map(|s| {
                let ns_per_run = s.run_time.as_nanos() as f64 / s.runs.max(1) as f64;
                format!("{} {} runs, {ns_per_run:.0} ns/run", s.program, s.runs)
            })
            .collect();
        let busy: f64 = stats.iter().map(|s| s.run_time.as_secs_f64()).sum();
        println!(
            "round {round}: without {plain:.2} Gbit/s, with capture {captured:.2} Gbit/s \
             ({} records, {packets} packets recorded, {} map-full drops; {}; in BPF {:.2} % of the run)",
            drained.records.len(),
            drained.map_full_drops,
            cost.join(", "),
            busy / secs * 100.0
        );
        bpf_share.push(busy / secs * 100.0);
        without.push(plain);
        with.push(captured);
    }
    let _ = receiver.kill();
    let _ = receiver.wait();
    let (a, b) = (median(without), median(with));
    println!(
        "PERF-6 capture overhead: median {a:.2} Gbit/s without, {b:.2} Gbit/s with: {:.1} % loss (target < 5 %)",
        (a - b) / a * 100.0
    );
    let in_bpf = median(bpf_share);
    println!("PERF-6 time spent in the classifiers: median {in_bpf:.2} % of one CPU during the transfer");
    let loss = (a - b) / a * 100.0;
    println!(
        "FIGURE {{\"id\":\"PERF-6\",\"name\":\"capture throughput loss\",\"value\":{loss:.3},\"unit\":\"%\",\"goal\":{{\"op\":\"<\",\"bound\":5}},\"context\":{{\"rounds\":{rounds},\"seconds\":{secs}}}}}"
    );
    println!(
        "FIGURE {{\"id\":\"PERF-6\",\"name\":\"time in the classifiers\",\"value\":{in_bpf:.3},\"unit\":\"% of a CPU\",\"goal\":null,\"context\":{{\"rounds\":{rounds},\"seconds\":{secs}}}}}"
    );
}
