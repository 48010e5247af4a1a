//! Identity lifecycle end to end (IDN-7, IDN-8, issue 25): the real agent library (stream,
//! renewal) against a real control plane, Postgres and mutual TLS on loopback, through a CA
//! rotation and a cloned credential.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use innerwall_agent::daemon::{self, renew};
use innerwall_agent::identity::connect::RunConfig;
use innerwall_agent::identity::credential::Credential;
use innerwall_agent::sync::Agent as Shared;
use innerwall_control_plane::identity::ca::{self, Signer};
use innerwall_control_plane::identity::rotation;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::proto;

use crate::plane::{Plane, TestStore, credential};

/// Polls the async `done` every 100 ms for up to `secs`; panics naming `what` if it never holds.
async fn until<F: AsyncFn() -> bool>(secs: u64, what: &str, done: F) {
    for _ in 0..secs * 10 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never happened within {secs} s: {what}");
}

fn certificates(bundle: &str) -> usize {
    bundle.matches("-----BEGIN CERTIFICATE-----").count()
}

async fn issuer(plane: &Plane, id: WorkloadId) -> Option<String> {
    sqlx::query_scalar("SELECT credential_issuer FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap()
}

/// A renewal over mutual TLS with `cert`/`key` (trusting `ca_pem`, through the agent's own
/// dialer) and a CSR that is not one: the status code says how far the call got
/// (`InvalidArgument`: the listener accepted the certificate).
async fn probe(plane: &Plane, ca_pem: &str, cert: &str, key: &str) -> String {
    let state = plane.dir.join(format!("probe-{}", uuid::Uuid::new_v4()));
    Credential::new(key.to_owned(), cert.to_owned(), ca_pem.to_owned()).unwrap().save(&state).unwrap();
    let channel =
        match innerwall_agent::identity::connect::connect(&RunConfig::new(state, plane.server())).await {
            Ok(channel) => channel,
            Err(e) => return format!("dial failed: {e}"),
        };
    let request = proto::RenewCredentialRequest { csr_pem: b"not a csr".to_vec() };
    match proto::agent_service_client::AgentServiceClient::new(channel).renew_credential(request).await {
        Ok(_) => "Ok".into(),
        Err(status) => format!("{:?}", status.code()),
    }
}

/// Rotate, renew, retire: the agent takes the new root from its renewal and keeps its policy
/// stream (one reconnect per renewal, no failed dial); retiring is refused while it still holds
/// an old certificate; afterwards a certificate of the retired root is refused, and the agent
/// reconnects with the new chain alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_rotation_keeps_the_fleet() {
    // Certificates live 12 s: the agent renews 8–10.8 s after receiving one.
    let plane = Plane::start_with(Duration::from_secs(12)).await;
    let ca_dir = plane.dir.join("ca");
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let old_root = plane.signer.ca_bundle_pem();
    let shared = Arc::new(Shared::new(TestStore::default()));
    let agent = {
        let (config, shared) = (config.clone(), shared.clone());
        tokio::spawn(async move { daemon::hold_stream(&config, shared).await.unwrap() })
    };
    let renewal = tokio::spawn(renew::renew_forever(config.clone(), shared.clone()));
    plane.wait_synced(id, 1).await;
    assert_eq!(issuer(&plane, id).await.as_deref(), Some(plane.signer.current_sha256().as_str()));

    // A certificate of the old root that outlives the test, to knock with later.
    let (probe_key, probe_csr) = innerwall_agent::identity::credential::new_key_and_csr().unwrap();
    let old_cert = plane
        .signer
        .issue_workload(id, &probe_csr, Duration::from_secs(3600), std::time::SystemTime::now())
        .unwrap();

    // Rotate: the running replica re-reads its CA directory and issues with the new root.
    let change = rotation::rotate(plane.pool(), &ca_dir, "test").await.unwrap();
    let new_root = std::fs::read_to_string(ca_dir.join(ca::NEXT_CERT_FILE)).unwrap();
    until(15, "the replica loaded the new root", async || {
        plane.signer.next_sha256().as_deref() == Some(change.new_sha256.as_str())
    })
    .await;
    assert_eq!(certificates(&plane.signer.ca_bundle_pem()), 2, "the bundle holds both roots");
    let again = rotation::rotate(plane.pool(), &ca_dir, "test").await.unwrap_err();
    assert!(again.to_string().contains("a rotation is in progress"), "{again}");

    // Retiring before the agent renewed would strand it: refused, naming it.
    let refused = rotation::retire(plane.pool(), &ca_dir, "test", false).await.unwrap_err();
    assert!(refused.to_string().contains(&id.uuid().to_string()), "{refused}");
    assert!(
        ca_dir.join(ca::NEXT_CERT_FILE).exists() && plane.signer.next_sha256().is_some(),
        "nothing moved"
    );

    // The agent's renewal brings a certificate of the new root and the bundle of both.
    until(20, "the agent renewed under the new root", async || {
        issuer(&plane, id).await.as_deref() == Some(change.new_sha256.as_str())
    })
    .await;
    until(5, "the agent stored the bundle of both roots", async || {
        certificates(&credential(&config).ca_pem) == 2
    })
    .await;
    // The old root's certificates are still trusted during the rotation; a refused renewal is
    // recorded with its reason, and shown.
    assert_eq!(probe(&plane, &old_root, &old_cert.pem, &probe_key).await, "InvalidArgument");
    let status = store::sync_status_of(&mut plane.pool().acquire().await.unwrap(), id).await.unwrap();
    let failure = status.renewal_failure.expect("the refused renewal shows in status");
    assert!(failure.reason.contains("csr"), "{failure:?}");
    let shown = store::workload_view(&mut plane.pool().acquire().await.unwrap(), id).await.unwrap();
    let facts = shown.facts.expect("workload show carries the lifecycle facts");
    assert!(facts.last_renewal_error.unwrap_or_default().contains("csr"));
    assert_eq!(facts.credential_issuer.as_deref(), Some(change.new_sha256.as_str()));

    // Retire: the new root replaces the old one; the replica reloads and presents a server
    // certificate of the new root.
    let presented = plane.running.as_ref().unwrap().certificate.fingerprint();
    let retired = rotation::retire(plane.pool(), &ca_dir, "test", false).await.unwrap();
    assert_eq!((retired.change.old_sha256.as_str(), retired.stranded.len()), (change.old_sha256.as_str(), 0));
    until(15, "the replica dropped the old root", async || {
        plane.signer.next_sha256().is_none() && plane.signer.current_sha256() == change.new_sha256
    })
    .await;
    until(15, "the listener presents a certificate of the new root", async || {
        plane.running.as_ref().unwrap().certificate.fingerprint() != presented
    })
    .await;
    assert_eq!(certificates(&plane.signer.ca_bundle_pem()), 1);

    // A certificate of the retired root is refused; the stream opened before goes on.
    assert_ne!(probe(&plane, &new_root, &old_cert.pem, &probe_key).await, "InvalidArgument");
    plane.bump(0).await;
    plane.wait_synced(id, 2).await;

    // The next renewal brings the bundle of the new root alone, and the agent reconnects with
    // it (the server's certificate now chains to the new root only).
    until(20, "the agent stored the new root alone", async || {
        credential(&config).ca_pem.trim() == new_root.trim()
    })
    .await;
    let renewed = *shared.renewals.borrow();
    plane.bump(1).await;
    plane.wait_synced(id, 3).await;
    assert_eq!(shared.enforcer.current().unwrap().version(), 3, "the policy is kept");
    renewal.abort();
    until(15, "one stream per renewal, no more", async || {
        shared.dials.streams.load(Ordering::Relaxed) == 1 + *shared.renewals.borrow()
    })
    .await;
    assert!(renewed >= 2, "renewed under the rotation and after the retirement: {renewed}");
    assert_eq!(shared.dials.failures.load(Ordering::Relaxed), 0, "no dial failed across the rotation");

    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM audit_log WHERE action IN ('ca.rotate', 'ca.retire') ORDER BY id",
    )
    .fetch_all(plane.pool())
    .await
    .unwrap();
    assert_eq!(audited, ["ca.rotate", "ca.retire"], "each operation audited once, refusals not");
    agent.abort();
}

fn facts(boot_id: &str) -> innerwall_wire::identity::HostFacts {
    innerwall_wire::identity::HostFacts {
        hostname: "web-1".into(),
        // A cloned image copies /etc/machine-id: both copies report the same one, this host's
        // (the one enrollment registered).
        machine_id: std::fs::read_to_string("/etc/machine-id").unwrap_or_default().trim().into(),
        boot_id: boot_id.into(),
        interfaces: vec![innerwall_wire::identity::NetworkInterface {
            name: "eth0".into(),
            addresses: vec!["10.1.0.5/24".into()],
            mac_address: String::new(),
        }],
        ..Default::default()
    }
}

fn agent(
    config: &RunConfig,
    boot_id: &str,
) -> (Arc<Shared<TestStore>>, tokio::task::JoinHandle<Result<(), daemon::RunError>>) {
    let shared = Arc::new(Shared::new(TestStore::default()));
    shared.stream.report_facts(facts(boot_id));
    let (config, e) = (config.clone(), shared.clone());
    (shared, tokio::spawn(async move { daemon::hold_stream(&config, e).await }))
}

async fn epoch(plane: &Plane, id: WorkloadId) -> i64 {
    sqlx::query_scalar("SELECT stream_epoch FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(plane.pool())
        .await
        .unwrap()
}

async fn clone_audits(plane: &Plane, id: WorkloadId) -> Vec<serde_json::Value> {
    sqlx::query_scalar(
        "SELECT detail FROM audit_log WHERE action = 'workload.identity-clone' AND subject = $1",
    )
    .bind(id.to_string())
    .fetch_all(plane.pool())
    .await
    .unwrap()
}

/// One credential on two hosts with the same machine id but different boots: a reboot is not a
/// clone, the two copies are; both are seen in `workload status`, the episode is audited once
/// however often they reconnect, and a deny ends both (what "deny one" means when both hold one
/// credential: the identity is denied, and the genuine host enrolls again with a new token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloned_identity_is_reported() {
    let plane = Plane::start().await;
    let (id, config) = plane.enroll("web-1", &["app=web"]).await;
    let status =
        async || store::sync_status_of(&mut plane.pool().acquire().await.unwrap(), id).await.unwrap();

    // The genuine host, then the same host rebooted (a new boot id): no clone.
    let (_, first) = agent(&config, "boot-a");
    plane.wait_synced(id, 1).await;
    first.abort();
    let opened = epoch(&plane, id).await;
    let (genuine_shared, genuine) = agent(&config, "boot-a2");
    until(15, "the rebooted host reconnected", async || epoch(&plane, id).await > opened).await;
    plane.wait_synced(id, 1).await;
    assert!(status().await.clone.is_none(), "a reboot is not a clone");
    assert!(clone_audits(&plane, id).await.is_empty());

    // A copy of its state directory (credential and all) on a cloned image.
    let copy = plane.dir.join("web-1-clone");
    Credential::load(&config.state_dir).unwrap().save(&copy).unwrap();
    let mut clone_config = RunConfig::new(copy, plane.server());
    (clone_config.backoff_base, clone_config.backoff_cap) = (config.backoff_base, config.backoff_cap);
    let (clone_shared, clone) = agent(&clone_config, "boot-b");

    until(20, "both presenters are reported in status", async || {
        status().await.clone.is_some_and(|c| {
            let boots: Vec<&str> = c.presenters.iter().map(|p| p.boot_id.as_str()).collect();
            boots.contains(&"boot-a2") && boots.contains(&"boot-b")
        })
    })
    .await;
    let report = status().await.clone.unwrap();
    let machine_id = facts("").machine_id;
    assert!(report.presenters.iter().all(|p| p.machine_id == machine_id), "{report:?}");
    let shown = store::workload_view(&mut plane.pool().acquire().await.unwrap(), id).await.unwrap();
    assert!(shown.facts.unwrap().clone.is_some(), "workload show reports the clone too");

    // The copies keep taking the stream from each other: many more Hellos, one audit record.
    let detected = epoch(&plane, id).await;
    until(30, "the copies reconnected four more times", async || epoch(&plane, id).await >= detected + 4)
        .await;
    let audits = clone_audits(&plane, id).await;
    assert_eq!(audits.len(), 1, "one audit record per episode, not per reconnect: {audits:?}");
    let detail = audits[0].to_string();
    assert!(detail.contains("boot-a2") && detail.contains("boot-b"), "{detail}");

    // Deny ends both: the copy holding the stream is told to enroll again (the directive); the
    // other is refused at every handshake from now on (a deny-listed identity gets no further
    // than TLS), so no stream of the identity opens again, however often it redials.
    let copies = [("genuine", genuine_shared, genuine), ("clone", clone_shared, clone)];
    let failures: Vec<u64> =
        copies.iter().map(|(_, e, _)| e.dials.failures.load(Ordering::Relaxed)).collect();
    innerwall_control_plane::foresight::commit(
        plane.pool(),
        "test",
        "workload.deny",
        &id.to_string(),
        async |c| {
            authoring::deny(c, id).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();
    for ((name, shared, task), before) in copies.iter().zip(&failures) {
        until(20, &format!("the {name} copy ended or was refused three times"), async || {
            task.is_finished() || shared.dials.failures.load(Ordering::Relaxed) >= before + 3
        })
        .await;
    }
    let (settled, streams): (i64, Vec<u64>) = (
        epoch(&plane, id).await,
        copies.iter().map(|(_, e, _)| e.dials.streams.load(Ordering::Relaxed)).collect(),
    );
    for ((name, shared, task), _) in copies.iter().zip(&failures) {
        if !task.is_finished() {
            let now = shared.dials.failures.load(Ordering::Relaxed);
            until(20, &format!("the {name} copy redialed three more times"), async || {
                shared.dials.failures.load(Ordering::Relaxed) >= now + 3
            })
            .await;
        }
    }
    assert_eq!(epoch(&plane, id).await, settled, "no stream of the deny-listed identity opened again");
    let after: Vec<u64> = copies.iter().map(|(_, e, _)| e.dials.streams.load(Ordering::Relaxed)).collect();
    assert_eq!(after, streams, "neither copy opened a stream after the deny");
    assert_eq!(plane.running.as_ref().unwrap().gateway.stream_count(), 0, "no stream is held");
    for (name, _, task) in copies {
        if task.is_finished() {
            let ended = task.await.unwrap();
            assert!(matches!(ended, Err(daemon::RunError::Reenroll(_))), "{name}: {ended:?}");
        } else {
            task.abort();
        }
    }
    assert_eq!(clone_audits(&plane, id).await.len(), 1);
}
