//! The agent under a service manager (issue 32): with `NOTIFY_SOCKET` it says `READY=1` only
//! once the persisted policy is back in the kernel, with the control plane unreachable; with
//! `WATCHDOG_USEC` it keeps saying `WATCHDOG=1`; on SIGTERM it says `STOPPING=1`. The socket is
//! the test's own, standing in for systemd's.

use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::policy::Mode;

use crate::host::{Agent, Namespace, require_root};
use crate::plane::Plane;

/// `table inet innerwall` as nft lists it in this thread's namespace, if it exists.
fn table() -> Option<String> {
    let out = Command::new("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The next notification, within 30 s.
fn next(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 1024];
    let n = socket.recv(&mut buf).expect("a notification within 30 s");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_is_ready_only_once_its_policy_is_back() {
    require_root();
    let mut plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let ns = Namespace::create(format!("iw-notify-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    plane.bump(1).await;
    let (id, config) = plane.enroll("notify", &["app=web"]).await;
    plane.set_mode(id, Mode::Enforcement).await;
    let (state, server) = (config.state_dir.clone(), plane.server());
    let agent = Agent::start(&state, &server);
    let version = plane.status(id).await.2.expect("a persisted policy");
    plane.wait_synced(id, version).await;
    agent.terminate();

    // The control plane is gone and the table too: only the restore can bring it back.
    plane.down().await;
    let deleted = Command::new("nft").args(["delete", "table", "inet", "innerwall"]).status().expect("nft");
    assert!(deleted.success() && table().is_none());
    let path = state.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("the notify socket");
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let notify = path.to_string_lossy().into_owned();
    let agent =
        Agent::spawn(&state, &server, &[], &[("NOTIFY_SOCKET", &notify), ("WATCHDOG_USEC", "400000")]);
    let ready = next(&socket);
    // READY names the version the restore put back, so it was sent after the restore.
    let installed = table();
    assert!(ready.starts_with("READY=1\n"), "{ready:?}");
    assert!(ready.contains(&format!("persisted policy v{version}")), "{ready:?}");
    assert!(installed.is_some_and(|t| t.contains("8001")), "READY before the policy was back in the kernel");
    for _ in 0..3 {
        assert_eq!(next(&socket), "WATCHDOG=1");
    }
    // The agent has exited when `terminate` returns: whatever it said is queued by now.
    agent.terminate();
    socket.set_nonblocking(true).unwrap();
    let mut said = Vec::new();
    let mut buf = [0u8; 1024];
    while let Ok(n) = socket.recv(&mut buf) {
        said.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    assert!(said.iter().any(|s| s == "STOPPING=1"), "{said:?}");
    drop(socket);
    let _ = std::fs::remove_file(&path);
    drop(ns);
}
