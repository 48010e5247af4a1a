//! No lock-out (issue 31) on a real host: under an enforced policy that admits nothing, the
//! management sources still reach the management services through the failsafe rule, every
//! other source is dropped, and the agent's own connections to its control plane (across the
//! veth, at an address outside the management range) keep working: a narrowing of the
//! management access arrives, is installed and acknowledged, before and after the replica
//! restarts, and the flow windows that name the failsafe rule arrive on the telemetry
//! connection.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::policy::model::{Management, ServiceEntry};
use innerwall_control_plane::safety::management::{self, Scope, Seeded};
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Mode};
use sqlx::PgPool;

use crate::host::{Agent, HOST_ADDRESS, Namespace, PEER_ADDRESS, Peer, require_root, wait_until};
use crate::plane::{Plane, fast_gateway};

/// The control plane's address, in the peer's namespace: outside the management range.
pub(crate) const PLANE_ADDRESS: &str = "10.81.0.3";

fn management(services: &[&str]) -> Management {
    Management::new(
        [Cidr::parse(&format!("{PEER_ADDRESS}/32")).unwrap()],
        services.iter().map(|s| ServiceEntry::parse(s).unwrap()),
    )
    .unwrap()
}

/// Whether a TCP handshake from `src` in the peer's namespace to the host's `port` completes
/// within `wait` (a dropped SYN never does).
pub(crate) fn connects(peer: &Peer, src: &str, port: u16, wait: Duration) -> bool {
    let src: SocketAddr = format!("{src}:0").parse().unwrap();
    let dst: SocketAddr = format!("{HOST_ADDRESS}:{port}").parse().unwrap();
    peer.inside(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(src).unwrap();
            matches!(tokio::time::timeout(wait, socket.connect(dst)).await, Ok(Ok(_)))
        })
    })
}

/// The packets counted by the rule of the owned table whose comment is `comment`, in this
/// thread's namespace (0 without such a rule).
pub(crate) fn counted(comment: &str) -> u64 {
    let out = Command::new("nft").args(["list", "table", "inet", "innerwall"]).output().expect("running nft");
    assert!(out.status.success(), "nft list: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!("comment \"{comment}\"")))
        .filter_map(|l| l.split("packets ").nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The stored flow records of `id` from `src` to `port`: (decision, deciding rule).
pub(crate) async fn records(pool: &PgPool, id: WorkloadId, src: &str, port: i32) -> Vec<(i16, String)> {
    sqlx::query_as(
        "SELECT decision, matched_rule_id FROM flow_records
         WHERE workload_id = $1 AND src_address = $2::inet AND dst_port = $3",
    )
    .bind(id.uuid())
    .bind(src)
    .bind(port)
    .fetch_all(pool)
    .await
    .expect("records")
}

/// Narrows `scope`'s management access to `services` and waits until the agent is SYNCED at
/// the version that carries it: the policy crossed the enforced table on the sync stream.
async fn narrow_and_sync(plane: &Plane, id: WorkloadId, scope: Scope, services: &[&str]) -> i64 {
    let done = management::narrow(plane.pool(), "test", scope, &management(services)).await.unwrap();
    let version = done.changed.iter().find(|c| c.workload == id).expect("a new version").version as i64;
    plane.wait_synced(id, version).await;
    version
}

/// A replica with [`fast_gateway`]'s timing listening across the veth at [`PLANE_ADDRESS`] (in
/// the peer's namespace), and the host's namespace `iw-<name>-<pid>` entered: an agent started
/// from here dials its control plane through its own table.
pub(crate) async fn plane_across_the_veth(name: &str) -> (Plane, Namespace, Peer) {
    let mut plane = Plane::create(Duration::from_secs(3600), fast_gateway()).await;
    let ns = Namespace::create(format!("iw-{name}-{}", std::process::id()));
    let peer = Peer::create(&ns);
    peer.add_address(PLANE_ADDRESS);
    plane.listen_ip = PLANE_ADDRESS.parse().unwrap();
    plane.server_names = vec![PLANE_ADDRESS.into()];
    peer.enter();
    plane.up().await;
    ns.enter();
    (plane, ns, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failsafe_keeps_management_and_control_plane() {
    require_root();
    let (mut plane, ns, peer) = plane_across_the_veth("failsafe").await;
    let pool = plane.pool().clone();
    let seeded = management(&["tcp:22", "tcp:2222", "tcp:2223"]);
    assert_eq!(management::seed(&pool, "serve", &seeded).await.unwrap(), Seeded::Stored);

    // Enforced, and no ruleset selects it: the policy admits nothing but the failsafe.
    let (id, config) = plane.enroll("failsafe", &["app=vault"]).await;
    plane.set_mode(id, Mode::Enforcement).await;
    let state = config.state_dir.clone();
    let _listeners: Vec<std::net::TcpListener> =
        [22, 2222, 2223].map(|p| std::net::TcpListener::bind(("0.0.0.0", p)).expect("listen")).into();
    let _agent = Agent::start(&state, &plane.server());
    let v1 = plane.status(id).await.2.expect("a policy");
    plane.wait_synced(id, v1).await;

    // The management source reaches each management port; another source, the control plane's
    // own address included, is dropped (counted by the table's terminal drop).
    for port in [22, 2222] {
        assert!(connects(&peer, PEER_ADDRESS, port, Duration::from_secs(5)), "management to {port}");
    }
    assert!(counted("failsafe:management/tcp") >= 2);
    let dropped = counted("innerwall:drop");
    assert!(!connects(&peer, PLANE_ADDRESS, 22, Duration::from_secs(2)), "a non-management source");
    assert!(counted("innerwall:drop") > dropped, "the SYN was dropped by the table, not lost");

    // The telemetry connection works: the windows name the failsafe rule, and the drop.
    let allowed = (Decision::Allowed.code(), "failsafe:management/tcp".to_owned());
    wait_until("the failsafe's records and the drop's", &state, async || {
        let admitted = records(&pool, id, PEER_ADDRESS, 22).await;
        let blocked = records(&pool, id, PLANE_ADDRESS, 22).await;
        (admitted.contains(&allowed) && blocked.iter().any(|r| r.0 == Decision::Blocked.code())).then_some(())
    })
    .await;

    // The sync stream works: a narrowing (2223 leaves) arrives and is acknowledged, and the
    // table drops what it no longer admits.
    let v2 = narrow_and_sync(&plane, id, Scope::Estate, &["tcp:22", "tcp:2222"]).await;
    assert!(v2 > v1);
    let dropped = counted("innerwall:drop");
    assert!(!connects(&peer, PEER_ADDRESS, 2223, Duration::from_secs(2)), "2223 is no longer admitted");
    assert!(counted("innerwall:drop") > dropped);

    // The second time: the replica restarts, the agent dials it again through its enforced
    // table, and the next narrowing (this workload's own) arrives on the new stream.
    plane.down().await;
    peer.enter();
    plane.up().await;
    ns.enter();
    let v3 = narrow_and_sync(&plane, id, Scope::Workload(id), &["tcp:22"]).await;
    assert!(v3 > v2);
    assert!(connects(&peer, PEER_ADDRESS, 22, Duration::from_secs(5)), "management after the restart");
    let dropped = counted("innerwall:drop");
    assert!(!connects(&peer, PEER_ADDRESS, 2222, Duration::from_secs(2)), "2222 is no longer admitted");
    assert!(counted("innerwall:drop") > dropped);
    plane.down().await;
}
