//! `innerwall-agent enroll --force` through the agent's own enrollment path against a replica
//! over real mTLS (issue 16 item 3): what becomes of the workload a re-enrollment replaces. And
//! the `innerwall-agent enroll` command itself takes the provisioning token from a file or
//! standard input, never from a flag (issue 32 item 3).

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use innerwall_agent::identity::credential::{Credential, new_key_and_csr};
use innerwall_agent::identity::enroll::{EnrollError, EnrollOptions, Enrollment, Replaced};
use innerwall_control_plane::identity::ca::Signer;
use innerwall_wire::identity::WorkloadId;

use crate::plane::Plane;

/// One host enrolls, then re-enrolls: with `--force` its old workload is retired (proven by
/// the old credential); with `--keep-replaced` it stays live and the warning names it; with an
/// old credential that proves nothing (expired) enrollment goes on, the old workload stays live
/// and the warning tells the operator how to retire it.
#[tokio::test]
async fn enroll_force_retires_the_replaced_workload_unless_kept() {
    let plane = Plane::start().await;
    let state = plane.dir.join("host");
    let ca = plane.signer.ca_bundle_pem();
    let enroll = async |options: EnrollOptions| -> Result<Enrollment, EnrollError> {
        let token = plane.mint(&["app=web"]).await;
        innerwall_agent::identity::enroll::enroll(&plane.server(), &token, &ca, &state, options).await
    };
    let live = async |id: WorkloadId| -> bool {
        sqlx::query_scalar("SELECT retired_at IS NULL FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap()
    };
    let force = EnrollOptions { force: true, keep_replaced: false };

    let first = enroll(EnrollOptions::default()).await.unwrap();
    assert_eq!(first.replaced, Replaced::Nothing);
    let first = first.credential.id;
    let refused = enroll(EnrollOptions::default()).await.unwrap_err();
    assert!(matches!(refused, EnrollError::AlreadyEnrolled { .. }), "{refused}");

    let second = enroll(force).await.unwrap();
    let second_id = second.credential.id;
    assert_eq!(second.replaced, Replaced::Retired(first));
    assert_eq!(second.replaced.warning(), None);
    assert_eq!((live(first).await, live(second_id).await), (false, true));
    assert_eq!(Credential::load(&state).unwrap().id, second_id, "the new identity is stored");

    let third = enroll(EnrollOptions { force: true, keep_replaced: true }).await.unwrap();
    let third_id = third.credential.id;
    assert_eq!(third.replaced, Replaced::Kept(Some(second_id)));
    let warning = third.replaced.warning().unwrap();
    assert!(warning.contains(&format!("`innerwall workload retire {second_id}`")), "{warning}");
    assert_eq!((live(second_id).await, live(third_id).await), (true, true));

    // The stored credential has expired: it cannot prove anything, so nothing is retired.
    let (key_pem, csr_pem) = new_key_and_csr().unwrap();
    let long_ago = SystemTime::now() - Duration::from_secs(7200);
    let expired =
        plane.signer.issue_workload(third_id, &csr_pem, Duration::from_secs(3600), long_ago).unwrap();
    Credential::new(key_pem, expired.pem, ca.clone()).unwrap().save(&state).unwrap();
    let fourth = enroll(force).await.unwrap();
    let Replaced::Unproven { id, why } = &fourth.replaced else { panic!("{:?}", fourth.replaced) };
    assert_eq!((*id, why.as_str()), (Some(third_id), "its certificate has expired"));
    let warning = fourth.replaced.warning().unwrap();
    assert!(warning.contains(&format!("`innerwall workload retire {third_id}`")), "{warning}");
    assert_eq!((live(third_id).await, live(fourth.credential.id).await), (true, true));
}

/// `innerwall-agent enroll` never takes the token as a flag: `--token` is a usage error (exit 2)
/// that names what to use instead, does not repeat the token, stores nothing and spends nothing
/// (the same one-time token enrolls afterwards); `--token-file -` reads it from standard input;
/// a missing file or empty input is an error naming it. (Worker threads serve the replica while
/// the test waits on the command.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enroll_takes_the_token_from_stdin_never_a_flag() {
    let plane = Plane::start().await;
    std::fs::create_dir_all(&plane.dir).unwrap();
    let ca = plane.dir.join("enroll-ca.pem");
    std::fs::write(&ca, plane.signer.ca_bundle_pem()).unwrap();
    let state = plane.dir.join("stdin-host");
    let token = plane.mint(&["app=web"]).await;
    let enroll = |extra: &[&str], input: &str| -> (Option<i32>, String, String) {
        let mut child = Command::new(innerwall_e2e::workspace_bin("innerwall-agent"))
            .env_remove("INNERWALL_PROVISIONING_TOKEN")
            .env_remove("INNERWALL_TOKEN")
            .args(["enroll", "--server", &plane.server(), "--ca-bundle"])
            .arg(&ca)
            .arg("--state-dir")
            .arg(&state)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running innerwall-agent enroll");
        // One that exits without reading closes the pipe; its status and stderr say why.
        let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
        let out = child.wait_with_output().unwrap();
        let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
        (out.status.code(), text(out.stdout), text(out.stderr))
    };
    let workloads = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(plane.pool()).await.unwrap()
    };

    let (code, stdout, stderr) = enroll(&["--token", &token], "");
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("--token-file FILE") && stderr.contains("INNERWALL_PROVISIONING_TOKEN"),
        "{stderr}"
    );
    assert!(!stderr.contains(&token), "the token is not repeated: {stderr}");
    assert!(!state.exists(), "a refused enroll stored something");
    assert_eq!(workloads().await, 0);

    let missing = plane.dir.join("no-such-token");
    let (code, _, stderr) = enroll(&["--token-file", missing.to_str().unwrap()], &token);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("reading the token file {}", missing.display())), "{stderr}");
    let (code, _, stderr) = enroll(&["--token-file", "-"], " \n");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("the token from standard input (--token-file -) is empty"), "{stderr}");
    assert_eq!(workloads().await, 0);

    let (code, stdout, stderr) = enroll(&["--token-file", "-"], &format!("{token}\n"));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let id = Credential::load(&state).unwrap().id;
    assert!(stdout.contains(&format!("enrolled as workload {id}")), "{stdout}");
    assert_eq!(workloads().await, 1);
}
