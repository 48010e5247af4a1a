//! The restore drill (issue 32, item 4): a control plane with an enforcing agent is backed up
//! with `innerwall backup create`, its database and CA are wiped, `innerwall backup restore`
//! brings them back, and the running agent reconnects with the certificate it holds and
//! converges at the version it had: nothing was re-rendered, no version moved.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use innerwall_control_plane::identity::ca::{FileCa, Signer as _};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::policy::Mode;

use crate::host::{Agent, Namespace, require_root};
use crate::plane::Plane;

/// `innerwall ARGS` against the plane's database and CA: stdout, or a panic with stderr.
fn innerwall(plane: &Plane, args: &[&str]) -> String {
    let out = Command::new(innerwall_e2e::workspace_bin("innerwall"))
        .env_remove("INNERWALL_CONFIG")
        .args(["--database-url", &plane.db.url, "--ca-dir"])
        .arg(plane.dir.join("ca"))
        .args(args)
        .output()
        .expect("running innerwall");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(out.status.success(), "{args:?}: {}{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

async fn versions(plane: &Plane) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM workload_policy_history").fetch_one(plane.pool()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_restore_drill() {
    require_root();
    let mut plane = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let ns = Namespace::create(format!("iw-backup-{}", std::process::id()));
    ns.enter();
    plane.up().await;
    plane.bump(1).await;
    let (id, config) = plane.enroll("drill", &["app=web"]).await;
    plane.set_mode(id, Mode::Enforcement).await;
    let agent = Agent::start(&config.state_dir, &plane.server());
    plane.wait(id, |s| s.0 == "SYNCED" && s.2 == Some(s.1), "SYNCED at the latest version").await;
    let (_, applied, _, _) = plane.status(id).await;
    let versions_before = versions(&plane).await;
    let bundle_before = plane.signer.ca_bundle_pem();

    let file = plane.dir.join("drill.backup");
    let file_arg = file.to_str().unwrap();
    let said = innerwall(&plane, &["backup", "create", file_arg]);
    assert!(said.contains("1 workload(s)"), "{said}");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(innerwall(&plane, &["backup", "verify", file_arg]).starts_with("verified"));

    // The disaster: the replica stops, its database and CA are gone.
    plane.down().await;
    sqlx::query("DROP SCHEMA public CASCADE").execute(plane.pool()).await.unwrap();
    sqlx::query("CREATE SCHEMA public").execute(plane.pool()).await.unwrap();
    std::fs::remove_dir_all(plane.dir.join("ca")).unwrap();

    let said = innerwall(&plane, &["backup", "restore", file_arg]);
    assert!(said.starts_with("restored"), "{said}");
    let restored = Arc::new(FileCa::load(&plane.dir.join("ca")).unwrap());
    assert_eq!(restored.ca_bundle_pem(), bundle_before, "the CA came back as it was");
    plane.signer = restored;
    // A replica after a restore is a new process: new connections, no plans cached from before.
    plane.db.pool.close().await;
    plane.db.pool = innerwall_control_plane::postgres::pool_options().connect(&plane.db.url).await.unwrap();
    plane.up().await;

    // The agent, running throughout, reconnects with its certificate and converges where it was.
    plane.wait(id, |s| s.0 == "SYNCED" && s.1 == applied, "SYNCED again at the version it had").await;
    assert_eq!(plane.status(id).await.2, Some(applied), "no new version after the restore");
    assert_eq!(versions(&plane).await, versions_before, "nothing was re-rendered into a new version");
    let restores: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action IN ('backup.create', 'backup.restore')",
    )
    .fetch_one(plane.pool())
    .await
    .unwrap();
    assert_eq!(restores, 2, "the backup is in the restored log, and the restore after it");
    agent.terminate();
}
