//! Evidence that is exact and never silently lost (FLOW-1..FLOW-3), with the real agent binary
//! in a network namespace of its own: its windows close at the moment a new version is applied
//! (before it is acked), every record lies inside its window, and every loss the agent can
//! suffer after capture — a capture that never attached, a queue it cannot write, a queued window
//! it cannot read back, a window the control plane refuses — arrives as a gap, without blocking
//! the windows after it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;
use innerwall_wire::proto;
use prost::Message as _;
use sqlx::PgPool;

use crate::host::{Agent, Namespace, Peer, now_ms, require_root, wait_until};
use crate::plane::Plane;

/// A stored window: id, start and end (unix ms), policy version.
type Window = (uuid::Uuid, i64, i64, i64);

async fn windows(pool: &PgPool, id: WorkloadId) -> Vec<Window> {
    sqlx::query_as(
        "SELECT window_id, (extract(epoch FROM window_start) * 1000)::bigint,
                (extract(epoch FROM window_end) * 1000)::bigint, policy_version
         FROM flow_windows WHERE workload_id = $1 ORDER BY window_start",
    )
    .bind(id.uuid())
    .fetch_all(pool)
    .await
    .expect("windows")
}

/// The stored records of the workload: window id, destination port, first and last seen.
async fn records(pool: &PgPool, id: WorkloadId) -> Vec<(uuid::Uuid, i32, i64, i64)> {
    sqlx::query_as(
        "SELECT window_id, dst_port, (extract(epoch FROM first_seen) * 1000)::bigint,
                (extract(epoch FROM last_seen) * 1000)::bigint
         FROM flow_records WHERE workload_id = $1",
    )
    .bind(id.uuid())
    .fetch_all(pool)
    .await
    .expect("records")
}

/// The stored gaps of `kind`: from, to (unix ms), count and why.
async fn gaps(pool: &PgPool, id: WorkloadId, kind: i16) -> Vec<(i64, i64, i64, String)> {
    sqlx::query_as(
        "SELECT (extract(epoch FROM gap_from) * 1000)::bigint, (extract(epoch FROM gap_to) * 1000)::bigint, count,
                detail
         FROM flow_gaps WHERE workload_id = $1 AND kind = $2 ORDER BY gap_from",
    )
    .bind(id.uuid())
    .bind(kind)
    .fetch_all(pool)
    .await
    .expect("gaps")
}

async fn db_now_ms(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .expect("now")
}

/// The host's namespace with its peer, a replica listening in it, and one enrolled workload.
async fn host(name: &str, flow_window: Duration) -> (Plane, Namespace, WorkloadId, PathBuf) {
    let gateway = GatewayConfig { flow_window, ..GatewayConfig::default() };
    let mut plane = Plane::create(Duration::from_secs(3600), gateway).await;
    let ns = Namespace::create(format!("iw-{name}-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    plane.bump(1).await;
    let (id, config) = plane.enroll(name, &["app=web"]).await;
    plane.set_mode(id, Mode::Simulation).await;
    (plane, ns, id, config.state_dir)
}

#[tokio::test]
async fn window_closes_exactly_at_version_change() {
    require_root();
    // Windows as long as the agent accepts: only version changes close them here.
    let (plane, ns, id, state) = host("version", Duration::from_secs(3600)).await;
    let peer = Peer::create(&ns);
    let pool = plane.pool().clone();
    let _agent = Agent::start(&state, &plane.server());
    let v1 = plane.status(id).await.2.expect("v1");
    plane.wait_synced(id, v1).await;

    // Traffic under v1, then v2 applied and acked, then traffic under v2, then v3.
    peer.send_udp(7001, 3);
    let bumped_at = db_now_ms(&pool).await;
    plane.bump(2).await;
    let v2 = plane.status(id).await.2.expect("v2");
    plane.wait_synced(id, v2).await;
    let acked_at = db_now_ms(&pool).await;
    peer.send_udp(7002, 3);
    plane.bump(3).await;
    let v3 = plane.status(id).await.2.expect("v3");
    plane.wait_synced(id, v3).await;

    let stored = wait_until("the windows of v1 and v2", &state, async || {
        let w = windows(&pool, id).await;
        let of = |v: u64| w.iter().find(|w| w.3 == v as i64).copied();
        Some((of(v1 as u64)?, of(v2 as u64)?))
    })
    .await;
    let (w1, w2) = stored;
    // v1's window ended when v2 was installed: after the change was made, before it was acked,
    // and v2's window began at that very moment.
    assert!(bumped_at <= w1.2 && w1.2 <= acked_at, "v1 window {w1:?}: bumped {bumped_at}, acked {acked_at}");
    assert_eq!(w1.2, w2.1, "windows abut at the version change");
    let records = records(&pool, id).await;
    let ports = |w: &Window| {
        let mut p: Vec<i32> = records.iter().filter(|r| r.0 == w.0).map(|r| r.1).collect();
        p.sort();
        p
    };
    assert_eq!(ports(&w1), [7001], "v1's window holds exactly the traffic sent under v1");
    assert_eq!(ports(&w2), [7002], "v2's window holds exactly the traffic sent after v2's ack");
    let all = windows(&pool, id).await;
    for (window, port, first, last) in &records {
        let w = all.iter().find(|w| w.0 == *window).expect("a stored window");
        assert!(
            w.1 <= *first && first <= last && *last <= w.2,
            "record to port {port} seen [{first}, {last}] outside its window [{}, {}]",
            w.1,
            w.2
        );
    }
}

/// Gap kinds as the database stores them (`GapKind`'s protobuf numbers).
const UPLOAD_REFUSED: i16 = 5;
const CAPTURE_UNAVAILABLE: i16 = 6;
const QUEUE_FAILED: i16 = 7;

/// A small tmpfs mounted over `dir` and filled, so every write into it fails with ENOSPC: a
/// full disk, for real. Unmounted on drop.
struct FullDisk(PathBuf);

impl FullDisk {
    fn mount(dir: &Path) -> FullDisk {
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs"])
            .arg(dir)
            .status()
            .expect("running mount");
        assert!(status.success(), "mounting a tmpfs over {}", dir.display());
        let full = FullDisk(dir.to_owned());
        let filler = vec![0u8; 64 * 1024];
        // Fill it until a write fails: then nothing more fits.
        let _ = std::fs::write(dir.join("filler"), &filler);
        full
    }
}

impl Drop for FullDisk {
    /// Detaches the tmpfs at once (`--lazy`): a plain unmount fails as busy whenever the agent
    /// happens to be listing or writing the queue, and the disk then stays full. A file the
    /// agent still has open there is finished on the detached tmpfs, and its rename into the
    /// queue fails like any other write to the full disk.
    fn drop(&mut self) {
        let status = Command::new("umount").arg("--lazy").arg(&self.0).status().expect("running umount");
        if !std::thread::panicking() {
            assert!(status.success(), "unmounting the tmpfs over {}", self.0.display());
        }
    }
}

/// Writes `bytes` as a queued window file with the given interval, the way the agent names them.
fn queue_file(telemetry: &Path, seq: u64, from_ms: i64, to_ms: i64, bytes: &[u8]) {
    let path = telemetry.join(format!("{seq:020}-{from_ms}-{to_ms}.window"));
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, bytes).expect("writing a queued window");
    std::fs::rename(&tmp, &path).expect("placing a queued window");
}

#[tokio::test]
async fn every_loss_is_a_gap() {
    require_root();
    let (plane, _ns, id, state) = host("loss", Duration::from_secs(1)).await;
    let pool = plane.pool().clone();
    let server = plane.server();
    let telemetry = state.join("telemetry");
    let agent = Agent::start(&state, &server);
    wait_until("a stored window", &state, async || (!windows(&pool, id).await.is_empty()).then_some(()))
        .await;

    // A full disk: the windows closed meanwhile cannot be queued; the first one queued after it
    // carries them as one QUEUE_FAILED gap, with their records counted.
    let full_from = now_ms();
    let full = FullDisk::mount(&telemetry);
    wait_until("a window the queue could not take", &state, async || {
        let log = std::fs::read_to_string(state.join("agent.log")).unwrap_or_default();
        log.contains("could not queue a flow window").then_some(())
    })
    .await;
    drop(full);
    let full_gap = wait_until("a QUEUE_FAILED gap for the full disk", &state, async || {
        gaps(&pool, id, QUEUE_FAILED).await.into_iter().find(|g| g.1 >= full_from)
    })
    .await;
    assert!(full_gap.0 >= full_from - 2_000, "the gap is the windows lost while full: {full_gap:?}");
    assert!(full_gap.3.contains("No space left on device"), "why: {full_gap:?}");

    // A queued window that cannot be read back, and one the control plane refuses (its times
    // are older than the control plane keeps): each becomes a gap, and neither blocks the
    // windows queued after it.
    let hour = 3_600_000;
    let (garbled_from, garbled_to) = (now_ms() - 2 * hour, now_ms() - 2 * hour + 1_000);
    queue_file(&telemetry, 0, garbled_from, garbled_to, b"not a flow window");
    let ancient = 1_000_000_000_000; // 2001
    let refused = proto::FlowWindow {
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: ancient,
        end_unix_ms: ancient + 1_000,
        policy_version: 1,
        mode: proto::EnforcementMode::Simulation.into(),
        records: Vec::new(),
        gaps: Vec::new(),
        staged_set: String::new(),
    };
    queue_file(&telemetry, 1, ancient, ancient + 1_000, &refused.encode_to_vec());
    let refused_from = db_now_ms(&pool).await;
    let garbled = wait_until("a QUEUE_FAILED gap for the unreadable window", &state, async || {
        gaps(&pool, id, QUEUE_FAILED).await.into_iter().find(|g| g.1 <= garbled_to + 1)
    })
    .await;
    assert_eq!((garbled.0, garbled.1), (garbled_from, garbled_to), "the interval its name gave");
    assert!(garbled.3.contains("decod"), "why: {garbled:?}");
    let refused_gap = wait_until("an UPLOAD_REFUSED gap", &state, async || {
        gaps(&pool, id, UPLOAD_REFUSED).await.first().cloned()
    })
    .await;
    assert_eq!(refused_gap.2, 0, "the refused window had no records: {refused_gap:?}");
    assert!(refused_gap.3.contains("older than"), "the control plane's reason: {refused_gap:?}");
    wait_until("windows stored after the refusal", &state, async || {
        let later = windows(&pool, id).await.into_iter().filter(|w| w.1 >= refused_from).count();
        (later >= 2).then_some(())
    })
    .await;

    // A capture that cannot attach (no eBPF object): the agent still closes windows, each
    // carrying a CAPTURE_UNAVAILABLE gap over all of it.
    agent.terminate();
    let missing = state.join("no-such-object");
    let _agent =
        Agent::spawn(&state, &server, &[], &[("INNERWALL_EBPF_OBJECT", missing.to_str().expect("utf-8"))]);
    let (covered, why) = wait_until("a window that is all CAPTURE_UNAVAILABLE gap", &state, async || {
        let unavailable = gaps(&pool, id, CAPTURE_UNAVAILABLE).await;
        windows(&pool, id)
            .await
            .into_iter()
            .find_map(|w| unavailable.iter().find(|g| (g.0, g.1) == (w.1, w.2)).map(|g| (w, g.3.clone())))
    })
    .await;
    assert!(covered.2 > covered.1, "a window of some length: {covered:?}");
    assert!(why.contains("no-such-object") && why.contains("not found"), "why: {why}");
}

/// Gap kind 8 as the database stores it.
const SUSPECT_DIRECTION: i16 = 8;

/// Sends one UDP datagram per `src sport dst dport` argument from a socket bound to that source
/// port (0: a fresh ephemeral one each), and waits for nothing.
const SEND_UDP_FROM: &str = r#"
import socket, sys
for spec in sys.argv[1:]:
    src, sport, dst, dport = spec.split(' ')
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((src, int(sport))); s.sendto(b'innerwall', (dst, int(dport))); s.close()
print('sent')
"#;

/// Runs [`SEND_UDP_FROM`] pinned to CPU 0 in the calling thread's namespace: the kernel's LRU
/// keeps per-CPU lists of fresh entries, and an entry meant to be evicted by a flood is evicted
/// in order when the same CPU inserted both.
fn send_udp_from(specs: &[String]) {
    let out = Command::new("taskset")
        .args(["-c", "0", "python3", "-c", SEND_UDP_FROM])
        .args(specs)
        .output()
        .expect("running python3");
    assert!(out.status.success() && out.stdout == b"sent\n", "sending: {out:?}");
}

/// FLOW-1, FLOW-2 (issue 25), with the real agent binary sized by its flag: replies that arrive
/// after their connection entry was evicted (`--conn-table-entries 64`, then a flood of new
/// conversations from this host) reach the control plane as a suspect-direction gap through the
/// real ingest, the agent's `/metrics` counts them, and the verdict over that window is not
/// SAFE: INSUFFICIENT, naming the gap.
#[tokio::test]
async fn late_udp_replies_are_counted_as_suspect_through_ingest_to_the_verdict() {
    use crate::host::{HOST_ADDRESS, PEER_ADDRESS};
    use crate::metrics::{http, sample};
    use innerwall_control_plane::gate::{self, Outcome, Params, Scope};
    require_root();
    let (plane, ns, id, state) = host("late", Duration::from_secs(1)).await;
    let peer = Peer::create(&ns);
    // The peer never answers with port unreachable: an error about a datagram looks its
    // connection up, which would keep the idle conversations' entries referenced.
    peer.inside(|| {
        for rule in [
            "add table ip iwt_quiet",
            "add chain ip iwt_quiet out { type filter hook output priority 0; }",
            "add rule ip iwt_quiet out icmp type destination-unreachable drop",
        ] {
            let status = Command::new("nft").arg(rule).status().expect("running nft");
            assert!(status.success(), "nft {rule}");
        }
    });
    let pool = plane.pool().clone();
    let metrics: std::net::SocketAddr = "127.0.0.1:9464".parse().unwrap();
    let _agent = Agent::start_with(
        &state,
        &plane.server(),
        &["--conn-table-entries", "64", "--metrics-listen", &metrics.to_string()],
    );
    let v1 = plane.status(id).await.2.expect("v1");
    plane.wait_synced(id, v1).await;
    let scrape = || http(metrics, "GET", "/metrics").map(|a| a.body).unwrap_or_default();
    let loaded = wait_until("the capture loaded with 64 entries", &state, async || {
        let text = scrape();
        (sample(&text, "innerwall_agent_capture_conn_table_entries") == Some(64.0)).then_some(text)
    })
    .await;
    assert_eq!(sample(&loaded, "innerwall_agent_capture_udp_reply_like_unmatched_total"), Some(0.0));

    // Two requests from this host, then a flood of new conversations, then the late replies
    // from the service ports the requests went to.
    wait_until("a stored window", &state, async || (!windows(&pool, id).await.is_empty()).then_some(()))
        .await;
    let from = db_now_ms(&pool).await;
    send_udp_from(&[
        format!("{HOST_ADDRESS} 40011 {PEER_ADDRESS} 53"),
        format!("{HOST_ADDRESS} 40012 {PEER_ADDRESS} 5353"),
    ]);
    let flood: Vec<String> = (0..1024).map(|_| format!("{HOST_ADDRESS} 0 {PEER_ADDRESS} 7778")).collect();
    send_udp_from(&flood);
    peer.inside(|| {
        send_udp_from(&[
            format!("{PEER_ADDRESS} 53 {HOST_ADDRESS} 40011"),
            format!("{PEER_ADDRESS} 5353 {HOST_ADDRESS} 40012"),
        ]);
    });

    let suspect = wait_until("a suspect-direction gap", &state, async || {
        let found: Vec<_> =
            gaps(&pool, id, SUSPECT_DIRECTION).await.into_iter().filter(|g| g.1 >= from).collect();
        (found.iter().map(|g| g.2).sum::<i64>() >= 2).then_some(found)
    })
    .await;
    assert_eq!(suspect.iter().map(|g| g.2).sum::<i64>(), 2, "exactly the two late replies: {suspect:?}");
    assert!(suspect[0].3.contains("matched no connection entry"), "why: {suspect:?}");
    let text = wait_until("the metric", &state, async || {
        let text = scrape();
        (sample(&text, "innerwall_agent_capture_udp_reply_like_unmatched_total") == Some(2.0)).then_some(text)
    })
    .await;
    let evictions = sample(&text, "innerwall_agent_capture_conn_evictions_total").unwrap_or(0.0);
    assert!(evictions >= 256.0, "the flood overflowed the table: {evictions} evictions\n{text}");
    // The late replies were recorded (the limitation the gap speaks for), in a window the gap
    // is on.
    let stored = records(&pool, id).await;
    let late =
        stored.iter().find(|r| r.1 == 40011).unwrap_or_else(|| panic!("no record to 40011: {stored:?}"));
    let window = windows(&pool, id).await.into_iter().find(|w| w.0 == late.0).expect("its window");
    assert!(
        suspect.iter().any(|g| window.1 <= g.0 && g.1 <= window.2),
        "the gap lies in the late replies' window {window:?}: {suspect:?}"
    );

    // The operator's CLI lists it by name, with its count and why.
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .args(["--database-url", &plane.db.url, "flows", "gaps", "--workload", &id.to_string()])
        .output()
        .expect("running innerwall");
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    assert!(
        listed.lines().any(|l| l.contains("suspect-direction") && l.contains("matched no connection entry")),
        "{listed}"
    );

    // The verdict over that window refuses to call it clean and names the gap. Here the late
    // replies themselves are would-block flows (nothing allows udp to 40011 from the peer), so
    // it is UNSAFE, which outranks INSUFFICIENT; the gap beside them says those flows may be
    // replies (a window with the gap alone is INSUFFICIENT: `every_missing_piece_is_a_reason`).
    let scope = Scope::parse_selector("app=web").unwrap();
    let judge = async |w: &Window| {
        let params = Params { from_ms: w.1, to_ms: w.2, min_duration_ms: 0, top_peers: 5 };
        let verdict = gate::judge(&pool, &scope, &params).await.unwrap();
        let reasons: Vec<String> =
            verdict.workloads.iter().flat_map(|w| w.reasons.iter().map(ToString::to_string)).collect();
        (verdict.outcome, reasons)
    };
    let (outcome, reasons) = judge(&window).await;
    assert_ne!(outcome, Outcome::Safe, "{reasons:?}");
    let gap = "suspect-direction gap from";
    assert!(reasons.iter().any(|r| r.starts_with(gap) && r.contains("(count 2)")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("udp/40011")), "the late replies as flows: {reasons:?}");
    // The last window before the requests carries no such gap: the gap is the late replies',
    // not every window's.
    let earlier = windows(&pool, id).await.into_iter().rfind(|w| w.2 <= from).expect("an earlier window");
    let (_, reasons) = judge(&earlier).await;
    assert!(!reasons.iter().any(|r| r.starts_with(gap)), "{reasons:?}");
}
