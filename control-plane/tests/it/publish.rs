//! Render-on-change and version-by-diff against a real Postgres (POL-4, POL-5, SYNC-7):
//! versions move only when what a workload can see moves, announcements arrive only after
//! commit, concurrent renders serialize, and every persisted history obeys the delta contract.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;
use std::time::Duration;

use innerwall_control_plane::error::Error;
use innerwall_control_plane::notice::CHANNEL as POLICY_CHANNEL;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::publish::{self, Changed};
use innerwall_control_plane::policy::spec::{
    AddressGroupSpec, NewWorkload, PeerSpec, RuleSpec, RulesetSpec, ServiceSpec,
};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::{Change, Mode, diff};
use sqlx::PgPool;
use sqlx::postgres::PgListener;

pub async fn register(pool: &PgPool, host: &str, labels: &[&str], addrs: &[&str]) -> WorkloadId {
    let new = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: host.into(),
        labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
        addresses: addrs.iter().map(|a| a.parse::<IpAddr>().unwrap()).collect(),
    };
    let done =
        innerwall_control_plane::foresight::commit(pool, "test", "workload.register", host, async |c| {
            authoring::register_workload(c, &new).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    assert!(done.changed.contains(&Changed { workload: new.id, version: 1 }), "first render persists v1");
    new.id
}

async fn service(pool: &PgPool, name: &str, entries: &[&str]) -> Vec<Changed> {
    let spec = ServiceSpec {
        name: name.into(),
        description: String::new(),
        entries: entries.iter().map(|e| ServiceEntry::parse(e).unwrap()).collect(),
    };
    innerwall_control_plane::foresight::commit(pool, "test", "service.create", name, async |c| {
        authoring::create_service(c, &spec).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap()
    .changed
}

fn sel(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, Vec<String>> {
    pairs.iter().map(|(k, v)| (k.to_string(), vec![v.to_string()])).collect()
}

fn ruleset(name: &str, scope: &str, peers: Vec<PeerSpec>, services: &[&str]) -> RulesetSpec {
    RulesetSpec {
        name: name.into(),
        description: String::new(),
        enabled: true,
        scope: sel(&[("app", scope)]),
        rules: vec![RuleSpec {
            name: "inbound".into(),
            description: String::new(),
            enabled: true,
            peers,
            services: services.iter().map(|s| s.to_string()).collect(),
        }],
    }
}

async fn create_ruleset(pool: &PgPool, spec: &RulesetSpec) -> Vec<Changed> {
    innerwall_control_plane::foresight::commit(pool, "test", "ruleset.create", &spec.name, async |c| {
        authoring::create_ruleset(c, spec).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap()
    .changed
}

async fn version(pool: &PgPool, id: WorkloadId) -> u64 {
    store::persisted_policy(&mut pool.acquire().await.unwrap(), id).await.unwrap().unwrap().0.version()
}

fn changed(list: &[(WorkloadId, u64)]) -> Vec<Changed> {
    let mut v: Vec<Changed> = list.iter().map(|&(workload, version)| Changed { workload, version }).collect();
    v.sort();
    v
}

/// Every consecutive pair of persisted versions obeys the contract, versions run 1, 2, 3 …
async fn assert_history_obeys_contract(pool: &PgPool, id: WorkloadId) -> usize {
    let history = store::policy_history(&mut pool.acquire().await.unwrap(), id).await.unwrap();
    assert!(!history.is_empty());
    for (i, p) in history.iter().enumerate() {
        assert_eq!(p.version(), i as u64 + 1, "versions are gap-free from 1");
    }
    for pair in history.windows(2) {
        let delta = diff(&pair[0], &pair[1]);
        assert!(!delta.changes.is_empty(), "a version never repeats content");
        assert_eq!(pair[0].apply(&delta).unwrap().canonical_bytes(), pair[1].canonical_bytes());
    }
    let latest = version(pool, id).await;
    assert_eq!(history.last().unwrap().version(), latest, "history ends at the persisted version");
    history.len()
}

#[tokio::test]
async fn version_advances_only_on_visible_change() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    let checkout = register(pool, "checkout-1", &["app=checkout"], &["10.0.0.20", "fd00::20"]).await;
    let batch = register(pool, "batch-1", &["app=batch"], &["10.0.0.30"]).await;

    // Registering checkout and batch changed nothing anyone could see: still v1 everywhere.
    assert_eq!(
        service(pool, "postgres", &["tcp:5432"]).await,
        vec![],
        "an unreferenced service is invisible"
    );
    let rs = ruleset(
        "payments",
        "payments-db",
        vec![PeerSpec::workloads(sel(&[("app", "checkout")]))],
        &["postgres"],
    );
    assert_eq!(create_ruleset(pool, &rs).await, changed(&[(payments, 2)]));

    let group = AddressGroupSpec { name: "vpn".into(), description: String::new(), cidrs: BTreeSet::new() };
    let done =
        innerwall_control_plane::foresight::commit(pool, "test", "address-group.create", "vpn", async |c| {
            authoring::create_address_group(c, &group).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    assert_eq!(done.changed, vec![], "an unreferenced address group is invisible");

    // Several edits in one transaction coalesce into one version.
    let spec = ServiceSpec {
        name: "postgres".into(),
        description: "now with a replica port".into(),
        entries: vec![ServiceEntry::parse("tcp:5432,5433").unwrap()],
    };
    let mut rs2 = rs.clone();
    rs2.rules[0].peers.push(PeerSpec::cidr("192.0.2.0/24"));
    let done = innerwall_control_plane::foresight::commit(pool, "test", "batch", "several", async |c| {
        authoring::update_service(c, &spec, 1).await?;
        authoring::update_ruleset(c, &rs2, 1).await?;
        authoring::set_mode(c, payments, Mode::Simulation).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    assert_eq!(done.changed, changed(&[(payments, 3)]));

    // Setting the mode a workload already has changes nothing; a new mode changes only it.
    let done =
        innerwall_control_plane::foresight::commit(pool, "test", "workload.mode", "batch", async |c| {
            authoring::set_mode(c, batch, Mode::Visibility).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    assert_eq!(done.changed, vec![]);
    let done =
        innerwall_control_plane::foresight::commit(pool, "test", "workload.mode", "batch", async |c| {
            authoring::set_mode(c, batch, Mode::Enforcement).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    assert_eq!(done.changed, changed(&[(batch, 2)]));

    assert_eq!(
        (version(pool, payments).await, version(pool, checkout).await, version(pool, batch).await),
        (3, 1, 2)
    );
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(pool).await.unwrap();
    assert_eq!(audit, 9, "every committed change is audited");
    let last: serde_json::Value =
        sqlx::query_scalar("SELECT workload_versions FROM audit_log ORDER BY id DESC LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(last, serde_json::json!({ batch.to_string(): 2 }));
}

#[tokio::test]
async fn notify_only_after_commit() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen(POLICY_CHANNEL).await.unwrap();
    // Absence is proven by a marker: a notice committed after the point in question must be the
    // next one delivered (Postgres delivers notifications in commit order).
    let mut markers = 0;
    let mut nothing_before_marker = async |l: &mut PgListener| {
        markers += 1;
        let marker = format!("marker {markers}");
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(POLICY_CHANNEL)
            .bind(&marker)
            .execute(pool)
            .await
            .unwrap();
        l.recv().await.unwrap().payload() == marker
    };

    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    let n = listener.recv().await.unwrap();
    assert_eq!(n.payload(), format!("{payments} 1"));
    assert!(nothing_before_marker(&mut listener).await);

    // A render inside an open transaction announces nothing until commit …
    let checkout_id = WorkloadId::new_random();
    let mut tx = pool.begin().await.unwrap();
    let new =
        NewWorkload { id: checkout_id, hostname: "c".into(), labels: vec![], addresses: BTreeSet::new() };
    authoring::register_workload(&mut tx, &new).await.unwrap();
    let announced = publish::publish(&mut tx).await.unwrap();
    assert_eq!(announced, changed(&[(checkout_id, 1)]));
    assert!(nothing_before_marker(&mut listener).await, "nothing before commit");
    tx.commit().await.unwrap();
    assert_eq!(listener.recv().await.unwrap().payload(), format!("{checkout_id} 1"));

    // … and nothing at all after a rollback.
    let mut tx = pool.begin().await.unwrap();
    let gone = NewWorkload {
        id: WorkloadId::new_random(),
        hostname: "g".into(),
        labels: vec![],
        addresses: BTreeSet::new(),
    };
    authoring::register_workload(&mut tx, &gone).await.unwrap();
    assert_eq!(publish::publish(&mut tx).await.unwrap().len(), 1);
    tx.rollback().await.unwrap();
    assert!(nothing_before_marker(&mut listener).await, "a rolled-back render announces nothing");
    assert!(store::persisted_policy(&mut pool.acquire().await.unwrap(), gone.id).await.unwrap().is_none());

    // Exactly the changed workloads: a ruleset on payments announces payments only.
    service(pool, "postgres", &["tcp:5432"]).await;
    let rs = ruleset("payments", "payments-db", vec![PeerSpec::cidr("10.9.0.0/16")], &["postgres"]);
    create_ruleset(pool, &rs).await;
    assert_eq!(listener.recv().await.unwrap().payload(), format!("{payments} 2"));
    assert!(nothing_before_marker(&mut listener).await, "only payments changed");
}

fn innerwall(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_innerwall")).arg("--database-url").arg(url).args(args).output().unwrap()
}

#[tokio::test]
async fn concurrent_renders_serialize() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    let dir = std::env::temp_dir().join(format!("iw-concurrent-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    const N: u16 = 6;
    for i in 0..N {
        service(pool, &format!("svc-{i}"), &[&format!("tcp:{}", 8000 + i)]).await;
        let rs = ruleset(
            &format!("rs-{i}"),
            "payments-db",
            vec![PeerSpec::cidr(&format!("10.{i}.0.0/16"))],
            &[&format!("svc-{i}")],
        );
        std::fs::write(dir.join(format!("rs-{i}.yaml")), serde_norway::to_string(&rs).unwrap()).unwrap();
    }
    // N separate processes, each with its own connection, commit at the same time; each adds a
    // ruleset payments-db can see, so each must claim exactly one new version.
    let handles: Vec<_> = (0..N)
        .map(|i| {
            let (url, file) = (db.url.clone(), dir.join(format!("rs-{i}.yaml")));
            std::thread::spawn(move || {
                Command::new(env!("CARGO_BIN_EXE_innerwall"))
                    .args(["--database-url", &url, "--json", "ruleset", "create", "-f"])
                    .arg(file)
                    .output()
                    .unwrap()
            })
        })
        .collect();
    let mut reported = BTreeSet::new();
    for h in handles {
        let out = h.join().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let changed = v["changed"].as_array().unwrap();
        assert_eq!(changed.len(), 1, "{v}");
        assert_eq!(changed[0]["workload"], payments.to_string());
        assert!(reported.insert(changed[0]["version"].as_u64().unwrap()), "two renders claimed one version");
    }
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(reported, (2..=1 + u64::from(N)).collect::<BTreeSet<_>>(), "gap-free, one version per render");
    assert_eq!(version(pool, payments).await, 1 + u64::from(N));
    assert_eq!(assert_history_obeys_contract(pool, payments).await, 1 + usize::from(N));
}

#[tokio::test]
async fn restart_render_changes_nothing() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    register(pool, "checkout-1", &["app=checkout"], &["10.0.0.20"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    let rs = ruleset(
        "payments",
        "payments-db",
        vec![PeerSpec::workloads(sel(&[("app", "checkout")]))],
        &["postgres"],
    );
    create_ruleset(pool, &rs).await;
    assert_eq!(authoring::render_now(pool).await.unwrap(), vec![]);

    // A restarted process: new connections, the binary's own startup path.
    let out = innerwall(&db.url, &["--json", "render"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["changed"], serde_json::json!([]));

    // `serve` renders once at start (POL-6); after a restart that render changes nothing.
    let ca_dir = std::env::temp_dir().join(format!("iw-ca-{}", uuid::Uuid::new_v4()));
    let out = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .arg("--ca-dir")
        .arg(&ca_dir)
        .args(["ca", "init"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut serve = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .args(["--database-url", &db.url, "--ca-dir"])
        .arg(&ca_dir)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(serve.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
    Command::new("kill").args(["-INT", &serve.id().to_string()]).status().unwrap();
    assert!(serve.wait().unwrap().success());
    std::fs::remove_dir_all(&ca_dir).ok();
    assert!(line.contains("startup render advanced 0 workload(s); listening on 127.0.0.1:"), "{line}");
    assert_eq!(version(pool, payments).await, 2);
}

#[tokio::test]
async fn relabel_updates_peer_sets() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    let checkout = register(pool, "checkout-1", &["app=checkout"], &["10.0.0.20"]).await;
    let batch = register(pool, "batch-1", &["app=batch"], &["10.0.0.30", "fd00::30"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    let rs = ruleset(
        "payments",
        "payments-db",
        vec![PeerSpec::workloads(sel(&[("app", "checkout")]))],
        &["postgres"],
    );
    create_ruleset(pool, &rs).await;
    let before =
        store::persisted_policy(&mut pool.acquire().await.unwrap(), payments).await.unwrap().unwrap().0;

    // batch-1 becomes a checkout: payments-db gains its addresses; batch-1's own policy is untouched.
    let label: Label = "app=checkout".parse().unwrap();
    let done =
        innerwall_control_plane::foresight::commit(pool, "test", "workload.label", "batch-1", async |c| {
            Ok((
                authoring::edit_labels(c, batch, 1, std::slice::from_ref(&label), &[]).await?,
                serde_json::json!({}),
            ))
        })
        .await
        .unwrap();
    assert_eq!(done.value, 2, "label version advances");
    assert_eq!(done.changed, changed(&[(payments, 3)]));
    let after =
        store::persisted_policy(&mut pool.acquire().await.unwrap(), payments).await.unwrap().unwrap().0;
    let delta = diff(&before, &after);
    assert!(
        matches!(&delta.changes[..], [Change::AddPeers { peers, .. }] if peers.len() == 2),
        "a relabel is a peer-only delta: {delta:?}"
    );
    assert_eq!((version(pool, checkout).await, version(pool, batch).await), (1, 1));

    // A stale edit is refused with the current version, and changes nothing.
    let err =
        innerwall_control_plane::foresight::commit(pool, "test", "workload.label", "batch-1", async |c| {
            Ok((
                authoring::edit_labels(c, batch, 1, &[], &["app".parse().unwrap()]).await?,
                serde_json::json!({}),
            ))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Stale { expected: 1, current: 2, .. }), "{err}");
    assert_eq!(version(pool, payments).await, 3);
}

#[tokio::test]
async fn consecutive_versions_satisfy_delta_contract() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let payments = register(pool, "payments-db-1", &["app=payments-db"], &["10.0.0.10"]).await;
    let checkout = register(pool, "checkout-1", &["app=checkout"], &["10.0.0.20"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    service(pool, "web", &["tcp:80,443", "udp:443", "icmp"]).await;
    let mut rs = ruleset(
        "payments",
        "payments-db",
        vec![PeerSpec::workloads(sel(&[("app", "checkout")]))],
        &["postgres"],
    );
    create_ruleset(pool, &rs).await;
    // A run of edits of every kind a workload can see.
    type Step = Box<dyn Fn(&mut RulesetSpec)>;
    let steps: Vec<Step> = vec![
        Box::new(|r| r.rules[0].services.push("web".into())),
        Box::new(|r| r.rules[0].peers.push(PeerSpec::cidr("192.0.2.0/24"))),
        Box::new(|r| {
            r.rules[0].peers.remove(0);
        }),
        Box::new(|r| r.rules[0].services.retain(|s| s != "postgres")),
        Box::new(|r| r.rules[0].enabled = false),
        Box::new(|r| {
            r.rules[0].enabled = true;
            r.scope = sel(&[("app", "checkout")]);
        }),
    ];
    for (i, step) in steps.iter().enumerate() {
        step(&mut rs);
        innerwall_control_plane::foresight::commit(pool, "test", "ruleset.update", "payments", async |c| {
            authoring::update_ruleset(c, &rs, i as i64 + 1).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    }
    for mode in [Mode::Simulation, Mode::Enforcement] {
        innerwall_control_plane::foresight::commit(pool, "test", "workload.mode", "p", async |c| {
            authoring::set_mode(c, payments, mode).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
    }
    let payments_versions = assert_history_obeys_contract(pool, payments).await;
    let checkout_versions = assert_history_obeys_contract(pool, checkout).await;
    assert!(payments_versions >= 7 && checkout_versions == 2, "{payments_versions} {checkout_versions}");
}

#[tokio::test]
async fn deleting_a_referenced_service_or_group_names_the_referrers() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    service(pool, "postgres", &["tcp:5432"]).await;
    let group = AddressGroupSpec { name: "vpn".into(), description: String::new(), cidrs: BTreeSet::new() };
    innerwall_control_plane::foresight::commit(pool, "t", "g", "vpn", async |c| {
        authoring::create_address_group(c, &group).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let rs = ruleset("payments", "payments-db", vec![PeerSpec::address_group("vpn")], &["postgres"]);
    create_ruleset(pool, &rs).await;
    for kind in ["service", "address-group"] {
        let name = if kind == "service" { "postgres" } else { "vpn" };
        let out = innerwall(&db.url, &[kind, "delete", name, "--expect-version", "1"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("is in use by ruleset payments rule inbound"), "{err}");
    }
    let services: i64 = sqlx::query_scalar("SELECT count(*) FROM services").fetch_one(pool).await.unwrap();
    assert_eq!(services, 1);
}

#[tokio::test]
async fn cli_refuses_invalid_input_and_writes_nothing() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let dir = std::env::temp_dir().join(format!("iw-invalid-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let empty_scope = file("a.yaml", "name: x\nscope: {}\nrules: []\n");
    let unknown_field = file("b.yaml", "name: x\nscope: {app: [db]}\ncolour: red\n");
    let unknown_service = file(
        "c.yaml",
        "name: x\nscope: {app: [db]}\nrules:\n- name: r\n  peers: [{cidr: 10.0.0.0/8}]\n  services: [nope]\n",
    );
    let bad_cidr = file(
        "d.yaml",
        "name: x\nscope: {app: [db]}\nrules:\n- name: r\n  peers: [{cidr: 10.0.0.0/33}]\n  services: [nope]\n",
    );
    let bad_label = file("e.yaml", "name: x\nscope: {-app: [db]}\n");
    // A valid ruleset with a 5 MiB description: the file is refused by its size …
    let huge =
        file("f.yaml", &format!("name: x\ndescription: {}\nscope: {{app: [db]}}\n", "d".repeat(5 << 20)));
    // … and under the file bound, the description by its own.
    let long_description =
        file("g.yaml", &format!("name: x\ndescription: {}\nscope: {{app: [db]}}\n", "d".repeat(2_000)));
    let long_text = "d".repeat(2_000);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["service", "create", "web", "--entry", "tcp:0"], "port 0 is not a port"),
        (vec!["service", "create", "web", "--entry", "tcp:70000"], "ports go up to 65535"),
        (vec!["service", "create", "web", "--entry", "tcp:90-80"], "start is after end"),
        (vec!["service", "create", "web", "--entry", "sctp:80"], "protocol must be tcp, udp, icmp or icmpv6"),
        (vec!["service", "create", "Web", "--entry", "tcp:80"], "service name \"Web\""),
        (vec!["address-group", "create", "vpn", "--cidr", "10.0.0.0/33"], "cidr \"10.0.0.0/33\""),
        (vec!["address-group", "create", "vpn", "--cidr", "banana"], "not an address"),
        (vec!["ruleset", "create", "-f", &empty_scope], "scope selector is empty"),
        (vec!["ruleset", "create", "-f", &unknown_field], "unknown field `colour`"),
        (vec!["ruleset", "create", "-f", &unknown_service], "references unknown service \"nope\""),
        (vec!["ruleset", "create", "-f", &bad_cidr], "cidr \"10.0.0.0/33\""),
        (vec!["ruleset", "create", "-f", &bad_label], "label key \"-app\""),
        (vec!["ruleset", "create", "-f", &huge], "larger than the 1048576 bytes a ruleset file may have"),
        (
            vec!["ruleset", "create", "-f", &long_description],
            "description bytes: 2000 is more than the 1024 allowed",
        ),
        (
            vec!["service", "create", "web", "--entry", "tcp:80", "--description", &long_text],
            "description bytes: 2000 is more than the 1024 allowed",
        ),
        (vec!["workload", "mode", "not-a-uuid", "simulation"], "invalid value 'not-a-uuid'"),
        (
            vec![
                "workload",
                "label",
                "0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5b",
                "--set",
                "a=b c",
                "--expect-label-version",
                "1",
            ],
            "contains ' '",
        ),
        (
            vec!["workload", "mode", "0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5b", "simulation"],
            "workload \"0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5b\" not found",
        ),
    ];
    for (args, want) in cases {
        let out = innerwall(&db.url, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
    for table in ["services", "address_groups", "rulesets", "audit_log", "workload_policies"] {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(n, 0, "{table} was written");
    }
}

/// A workload's label set is bounded: an edit that would pass the bound is refused whole and
/// leaves labels, label version and audit log as they were.
#[tokio::test]
async fn label_sets_are_bounded() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let labels: Vec<String> =
        (0..innerwall_control_plane::policy::spec::MAX_LABELS).map(|n| format!("k{n}=v")).collect();
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    let id = register(pool, "full", &labels, &[]).await;
    let audit = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log").fetch_one(pool).await.unwrap()
    };
    let before = audit().await;
    let err = innerwall_control_plane::foresight::commit(pool, "test", "workload.label", "full", async |c| {
        Ok((
            authoring::edit_labels(c, id, 1, &["one=more".parse().unwrap()], &[]).await?,
            serde_json::json!({}),
        ))
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("labels: 65 is more than the 64 allowed"), "{err}");
    let (count, version): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM workload_labels WHERE workload_id = $1), label_version FROM workloads WHERE id = $1",
    )
    .bind(id.uuid())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((count, version, audit().await), (64, 1, before), "nothing changed");
    // Replacing a value keeps the count: allowed.
    innerwall_control_plane::foresight::commit(pool, "test", "workload.label", "full", async |c| {
        Ok((authoring::edit_labels(c, id, 1, &["k0=w".parse().unwrap()], &[]).await?, serde_json::json!({})))
    })
    .await
    .unwrap();
}

/// The database never holds the control plane up without bound: a render that cannot get the
/// render lock fails within the lock timeout, names the lock and writes nothing; and a client
/// stalled in the middle of a change (a suspended CLI holding the lock) loses its transaction
/// after the idle-in-transaction timeout, so the next render goes through; a statement past the
/// statement timeout is cancelled and classified as passing trouble.
#[tokio::test]
async fn database_stalls_are_bounded() {
    use innerwall_control_plane::policy::publish::RENDER_LOCK_KEY;
    use innerwall_control_plane::postgres::{Timeouts, pool_options_with};

    let db = fresh_database().await.unwrap();
    let url = db.url.clone();
    let short = async |t: Timeouts| pool_options_with(t).connect(&url).await.unwrap();
    let impatient = short(Timeouts { lock: Duration::from_secs(1), ..Timeouts::default() }).await;
    let stalls = short(Timeouts { idle_in_transaction: Duration::from_secs(1), ..Timeouts::default() }).await;

    // Someone holds the render lock in an open transaction.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(RENDER_LOCK_KEY)
        .execute(&mut *holder)
        .await
        .unwrap();
    let err = innerwall_control_plane::testing::add_web_port(&impatient, 0).await.unwrap_err();
    assert!(format!("{err:#}").contains("the render lock stayed held past the lock timeout"), "{err:#}");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM services").fetch_one(&db.pool).await.unwrap();
    assert_eq!(written, 0, "a refused change writes nothing");
    holder.rollback().await.unwrap();

    // A client takes the lock and stalls (a suspended CLI mid-commit): the server ends its
    // transaction, and a render with the default lock timeout goes through.
    let mut stalled = stalls.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(RENDER_LOCK_KEY)
        .execute(&mut *stalled)
        .await
        .unwrap();
    innerwall_control_plane::testing::add_web_port(&db.pool, 1).await.unwrap();
    // Its connection is gone (the server closed it with the timeout's FATAL).
    assert!(sqlx::query("SELECT 1").execute(&mut *stalled).await.is_err());

    // A statement past its bound is cancelled by the server and reported as passing trouble
    // (UNAVAILABLE to an agent), not as an internal error.
    let slow = short(Timeouts { statement: Duration::from_millis(200), ..Timeouts::default() }).await;
    let err = Error::from(sqlx::query("SELECT pg_sleep(60)").execute(&slow).await.unwrap_err());
    assert_eq!(err.kind(), innerwall_control_plane::error::Kind::Busy, "{err}");
    assert!(err.to_string().contains("statement timeout"), "{err}");
}

/// A rule's services are a set, shown by name whatever order their ids (random per database)
/// or the authored file put them in: `ruleset show` is the same on every database.
#[tokio::test]
async fn ruleset_view_lists_services_by_name() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let names = ["svc-e", "svc-b", "svc-d", "svc-a", "svc-c"];
    for (i, name) in names.iter().enumerate() {
        service(pool, name, &[&format!("tcp:{}", 1000 + i)]).await;
    }
    create_ruleset(pool, &ruleset("web-in", "web", vec![PeerSpec::cidr("10.9.0.0/16")], &names)).await;
    let views = store::list_rulesets(&mut pool.acquire().await.unwrap()).await.unwrap();
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].spec.rules[0].services, ["svc-a", "svc-b", "svc-c", "svc-d", "svc-e"]);
}

/// Migrations 0016 and 0017: a rendered policy large enough to be compressed is stored with lz4,
/// once, in the contents both the latest and the history row refer to, and read back whole.
#[tokio::test]
async fn large_policies_are_stored_lz4_compressed_and_read_back_whole() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    service(pool, "postgres", &["tcp:5432"]).await;
    // 400 host routes: a policy of ~6 KB, past the 2 KB at which Postgres compresses a value.
    let cidrs = (0..400u32)
        .map(|i| innerwall_wire::policy::Cidr::parse(&format!("10.9.{}.{}/32", i / 256, i % 256)))
        .collect::<Result<BTreeSet<_>, _>>()
        .unwrap();
    let group = AddressGroupSpec { name: "clients".into(), description: String::new(), cidrs };
    innerwall_control_plane::foresight::commit(pool, "t", "g", "clients", async |c| {
        authoring::create_address_group(c, &group).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    let db_host = register(pool, "db", &["app=db"], &["10.0.0.1"]).await;
    create_ruleset(pool, &ruleset("db", "db", vec![PeerSpec::address_group("clients")], &["postgres"])).await;

    let (method, size, in_history): (Option<String>, i32, bool) = sqlx::query_as(
        "SELECT pg_column_compression(c.policy), octet_length(c.policy),
                EXISTS (SELECT FROM workload_policy_history h
                        WHERE h.workload_id = p.workload_id AND h.version = p.version AND h.digest = p.digest)
         FROM workload_policies p JOIN policy_contents c ON c.digest = p.digest WHERE p.workload_id = $1",
    )
    .bind(db_host.uuid())
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(size > 4_000, "the policy is {size} bytes, too small to be compressed");
    assert_eq!(method.as_deref(), Some("lz4"));
    assert!(in_history, "the history row refers to the same content");
    let (policy, _) =
        store::persisted_policy(&mut pool.acquire().await.unwrap(), db_host).await.unwrap().unwrap();
    assert_eq!(policy.version(), 2);
    assert_eq!(policy.rules().map(|r| r.peers().len()).sum::<usize>(), 400);

    // A render tells contents stored with their version inside by their first byte alone, read
    // from the compressed value: a compressed copy with the version is one, the shared one not.
    let mut conn = pool.acquire().await.unwrap();
    let versioned: Vec<u8> = sqlx::query_scalar(
        "INSERT INTO policy_contents (digest, policy) VALUES (sha256($1), $1) RETURNING digest",
    )
    .bind(policy.canonical_bytes())
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let compressed: Option<String> =
        sqlx::query_scalar("SELECT pg_column_compression(policy) FROM policy_contents WHERE digest = $1")
            .bind(&versioned)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(compressed.as_deref(), Some("lz4"));
    let shared = store::Content::of(&policy).digest;
    let found = store::load_versioned_contents(&mut conn, &[versioned.clone(), shared]).await.unwrap();
    assert_eq!(found.keys().collect::<Vec<_>>(), [&versioned]);
    assert_eq!(found[&versioned], policy.canonical_bytes(), "read back whole");
}

/// app=db hosts take postgres from app=client workloads.
fn clients_to_db() -> RulesetSpec {
    ruleset("db", "db", vec![PeerSpec::workloads(sel(&[("app", "client")]))], &["postgres"])
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Migration 0017: workloads with the same policy share one stored content, whatever their
/// versions; each still reads back its own version and history, and a render that changes nothing
/// stores nothing.
#[tokio::test]
async fn workloads_with_the_same_policy_share_one_stored_content() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    service(pool, "postgres", &["tcp:5432"]).await;
    let client = register(pool, "client-1", &["app=client"], &["10.0.0.9"]).await;
    let dbs = [
        register(pool, "db-1", &["app=db"], &["10.0.0.1"]).await,
        register(pool, "db-2", &["app=db"], &["10.0.0.2"]).await,
        register(pool, "db-3", &["app=db"], &["10.0.0.3"]).await,
    ];
    // Until now every policy was empty: one content.
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 1);
    let rs = clients_to_db();
    let done = create_ruleset(pool, &rs).await;
    assert_eq!(done, changed(&[(dbs[0], 2), (dbs[1], 2), (dbs[2], 2)]));
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 2);
    assert_eq!(count(pool, "SELECT count(DISTINCT digest) FROM workload_policies").await, 2);

    // db-1 leaves and comes back: versions 3 and 4, still one content for the three db hosts.
    for (n, app) in [(1, "app=other"), (2, "app=db")] {
        let label: Label = app.parse().unwrap();
        innerwall_control_plane::foresight::commit(pool, "test", "workload.label", "db-1", async |c| {
            Ok((
                authoring::edit_labels(c, dbs[0], n, std::slice::from_ref(&label), &[]).await?,
                serde_json::json!({}),
            ))
        })
        .await
        .unwrap();
    }
    assert_eq!(versions(pool, &dbs).await, [4, 2, 2]);
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 2);
    let mut conn = pool.acquire().await.unwrap();
    let mut shared = Vec::new();
    for id in dbs {
        shared.push(store::persisted_policy(&mut conn, id).await.unwrap().unwrap().0);
    }
    assert!(shared.iter().all(|p| p.rules().eq(shared[0].rules())), "the same rules for every db host");
    assert_eq!(shared[0].rules().next().unwrap().peers().len(), 1);
    let history = store::policy_history(&mut conn, dbs[0]).await.unwrap();
    assert_eq!(
        history.iter().map(|p| (p.version(), p.rules().len())).collect::<Vec<_>>(),
        [(1, 0), (2, 1), (3, 0), (4, 1)]
    );
    assert_eq!(assert_history_obeys_contract(pool, dbs[0]).await, 4);
    assert_eq!(version(pool, client).await, 1);

    assert_eq!(authoring::render_now(pool).await.unwrap(), []);
    assert_eq!(count(pool, "SELECT count(*) FROM policy_contents").await, 2);
    assert_eq!(count(pool, "SELECT count(*) FROM workload_policy_history").await, 4 + 2 + 2 + 1);
}

async fn versions(pool: &PgPool, ids: &[WorkloadId]) -> Vec<u64> {
    let mut out = Vec::new();
    for &id in ids {
        out.push(version(pool, id).await);
    }
    out
}

/// A row stored before contents were shared holds the policy's bytes with the version inside
/// (migration 0017 keeps them as they were): it reads back at its row's version, a render that
/// changes nothing leaves it alone, a real change advances it; and the schema refuses a content
/// whose digest is not its bytes' SHA-256, and any change to a stored one.
#[tokio::test]
async fn contents_stored_with_their_version_inside_still_compare_and_read_back() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    service(pool, "postgres", &["tcp:5432"]).await;
    let host = register(pool, "db-1", &["app=db"], &["10.0.0.1"]).await;
    register(pool, "client-1", &["app=client"], &["10.0.0.9"]).await;
    let rs = clients_to_db();
    create_ruleset(pool, &rs).await;
    let mut conn = pool.acquire().await.unwrap();
    let (held, _) = store::persisted_policy(&mut conn, host).await.unwrap().unwrap();
    assert_eq!(held.version(), 2);
    let legacy = held.canonical_bytes();
    assert_ne!(legacy, store::Content::of(&held).bytes, "the version is inside");
    sqlx::query("INSERT INTO policy_contents (digest, policy) VALUES (sha256($1), $1)")
        .bind(&legacy)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("UPDATE workload_policies SET digest = sha256($1) WHERE workload_id = $2")
        .bind(&legacy)
        .bind(host.uuid())
        .execute(&mut *conn)
        .await
        .unwrap();
    assert_eq!(store::persisted_policy(&mut conn, host).await.unwrap().unwrap().0, held);
    assert_eq!(authoring::render_now(pool).await.unwrap(), [], "the same policy is no change");
    let shared = store::Content::of(&held).digest;
    let found = store::load_versioned_contents(&mut conn, &[shared]).await.unwrap();
    assert!(found.is_empty(), "a content without its version is not read to compare");

    register(pool, "client-2", &["app=client"], &["10.0.0.8"]).await;
    let (now, _) = store::persisted_policy(&mut conn, host).await.unwrap().unwrap();
    assert_eq!(now.version(), 3);
    assert_eq!(now.rules().next().unwrap().peers().len(), 2);
    assert_eq!(assert_history_obeys_contract(pool, host).await, 3);

    let forged = sqlx::query("INSERT INTO policy_contents (digest, policy) VALUES (sha256('x'), $1)")
        .bind(&legacy)
        .execute(&mut *conn)
        .await
        .unwrap_err();
    assert_eq!(forged.as_database_error().and_then(|e| e.code()).as_deref(), Some("23514"), "{forged}");
    // History refers to contents without a foreign key: none may go or change.
    for statement in [
        "DELETE FROM policy_contents",
        "UPDATE policy_contents SET policy = policy",
        "TRUNCATE policy_contents CASCADE",
    ] {
        let err = sqlx::query(statement).execute(&mut *conn).await.unwrap_err();
        assert!(err.to_string().contains("never changed or deleted"), "{statement}: {err}");
    }
    assert_eq!(assert_history_obeys_contract(pool, host).await, 3);
}

/// The oracle of the narrowed-render tests: a full render, rolled back, finds what the narrowed
/// ones persisted and changes nothing.
async fn oracle(pool: &PgPool) -> publish::Rendering {
    let mut tx = pool.begin().await.unwrap();
    let rendering = publish::publish_rendering(&mut tx, publish::Overflow::Refuse).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(rendering.changed, Vec::new(), "the full render finds what the narrowed one persisted");
    rendering
}

/// The estate's services of the narrowed-render tests (postgres, redis) and the ruleset `db`:
/// app=db admits app=web to postgres.
async fn db_admits_web(pool: &PgPool) {
    service(pool, "postgres", &["tcp:5432"]).await;
    service(pool, "redis", &["tcp:6379"]).await;
    create_ruleset(
        pool,
        &ruleset("db", "db", vec![PeerSpec::workloads(sel(&[("app", "web")]))], &["postgres"]),
    )
    .await;
}

/// POL-7 on a real database: a label edit renders only the workloads it can touch, and what it
/// persists is exactly what the full render persists. After each narrowed edit a full render
/// (the oracle) changes nothing; the edit moved the versions of the peers that gained or lost
/// the workload and of the workload itself, and no other; with a policy test set stored, the
/// same edit renders everything (tests judge the whole estate).
#[tokio::test]
async fn a_label_edit_renders_only_what_it_touches() {
    use innerwall_control_plane::operations;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let db1 = register(pool, "db-1", &["app=db"], &["10.0.0.10"]).await;
    let web = register(pool, "web-1", &["app=web"], &["10.0.0.20"]).await;
    let batch = register(pool, "batch-1", &["app=batch"], &["10.0.0.30"]).await;
    let cache = register(pool, "cache-1", &["app=cache"], &["10.0.0.40"]).await;
    db_admits_web(pool).await;
    create_ruleset(
        pool,
        &ruleset("cache", "cache", vec![PeerSpec::workloads(sel(&[("app", "batch")]))], &["redis"]),
    )
    .await;
    let full_render_changes_nothing = async || assert!(!oracle(pool).await.narrowed);
    let versions = async || {
        let mut out = Vec::new();
        for id in [db1, web, batch, cache] {
            out.push(version(pool, id).await);
        }
        out
    };
    let before = versions().await;
    // batch-1 becomes a web server: db-1 gains its address, cache-1 loses it.
    let label: Label = "app=web".parse().unwrap();
    let done =
        operations::change_labels(pool, "test", batch, 1, std::slice::from_ref(&label), &[]).await.unwrap();
    assert_eq!(done.changed, changed(&[(db1, before[0] + 1), (cache, before[3] + 1)]));
    full_render_changes_nothing().await;
    // A label no selector names: nothing moves at all.
    let label: Label = "team=blue".parse().unwrap();
    let done =
        operations::change_labels(pool, "test", web, 1, std::slice::from_ref(&label), &[]).await.unwrap();
    assert_eq!(done.changed, Vec::new());
    full_render_changes_nothing().await;
    // The workload's own scope: db-1 stops being a database; its own policy empties.
    let done =
        operations::replace_labels(pool, "test", db1, 1, &["app=retired".parse().unwrap()]).await.unwrap();
    assert_eq!(done.changed, changed(&[(db1, before[0] + 2)]));
    full_render_changes_nothing().await;

    // With a policy test set stored, an edit renders the whole estate for the tests to judge.
    let set: innerwall_control_plane::foresight::TestSetSpec = serde_json::from_value(serde_json::json!({
        "name": "t", "tests": [{"name": "cache-from-batch", "allow": {"from": {"app": ["batch"]}, "to": {"app": ["cache"]}, "service": "redis"}, "allow_empty": true}]
    }))
    .unwrap();
    innerwall_control_plane::foresight::create_test_set(pool, "test", &set).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let rendering =
        publish::publish_touched(&mut tx, publish::Overflow::Refuse, &[publish::Touched::Labels(web)])
            .await
            .unwrap();
    tx.rollback().await.unwrap();
    assert!(!rendering.narrowed && rendering.rendered.len() == 4);
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("DELETE FROM policy_test_sets").execute(&mut *tx).await.unwrap();
    let rendering =
        publish::publish_touched(&mut tx, publish::Overflow::Refuse, &[publish::Touched::Labels(web)])
            .await
            .unwrap();
    tx.rollback().await.unwrap();
    assert!(rendering.narrowed, "without tests, narrowed");
    assert_eq!(rendering.rendered.len(), 1, "an unchanged label set touches the workload alone");
}

/// POL-7 on a real database, for the catalog: an address group's or a service's edit renders
/// only the workloads whose rules name it (a new one, nothing), and a full render after each
/// changes nothing.
#[tokio::test]
async fn a_group_or_service_edit_renders_only_what_names_it() {
    use innerwall_control_plane::counts::CountBounds;
    use innerwall_control_plane::operations;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let db1 = register(pool, "db-1", &["app=db"], &["10.0.0.10"]).await;
    let cache = register(pool, "cache-1", &["app=cache"], &["10.0.0.40"]).await;
    register(pool, "web-1", &["app=web"], &["10.0.0.20"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    service(pool, "redis", &["tcp:6379"]).await;
    let group = |name: &str, cidr: &str| AddressGroupSpec {
        name: name.into(),
        description: String::new(),
        cidrs: [innerwall_wire::policy::Cidr::parse(cidr).unwrap()].into(),
    };
    operations::create_address_group(pool, "test", &group("vpn", "10.8.0.0/16"), &CountBounds::default())
        .await
        .unwrap();
    create_ruleset(pool, &ruleset("db", "db", vec![PeerSpec::address_group("vpn")], &["postgres"])).await;
    create_ruleset(pool, &ruleset("cache", "cache", vec![PeerSpec::cidr("192.0.2.0/24")], &["redis"])).await;
    let (vdb, vcache) = (version(pool, db1).await, version(pool, cache).await);
    // A new group: no rule names it, nothing renders.
    let done = operations::create_address_group(
        pool,
        "test",
        &group("spare", "10.9.0.0/16"),
        &CountBounds::default(),
    )
    .await
    .unwrap();
    assert_eq!(done.changed, Vec::new());
    oracle(pool).await;
    // The group db's rule names: db-1 alone moves.
    let done =
        operations::update_address_group(pool, "test", &group("vpn", "10.10.0.0/16"), 1).await.unwrap();
    assert_eq!(done.changed, changed(&[(db1, vdb + 1)]));
    oracle(pool).await;
    // The service cache's rule names: cache-1 alone moves.
    let spec = ServiceSpec {
        name: "redis".into(),
        description: String::new(),
        entries: vec![ServiceEntry::parse("tcp:6380").unwrap()],
    };
    let done = operations::update_service(pool, "test", &spec, 1).await.unwrap();
    assert_eq!(done.changed, changed(&[(cache, vcache + 1)]));
    oracle(pool).await;
    // Deleting the unnamed group: nothing moves.
    let done = operations::delete_address_group(pool, "test", "spare", 1).await.unwrap();
    assert_eq!(done.changed, Vec::new());
    oracle(pool).await;
}

/// Issue 33 (POL-7, PERF-1): a publish reuses the inputs its replica kept from the last one only
/// when no other transaction wrote one since, and reads again only what its own change names;
/// anything else loads them whole. (Debug builds also compare each reuse with a whole load and
/// fail the publish if they differ, so every test here checks the contents too.)
#[tokio::test]
async fn kept_render_inputs_are_reused_only_while_true() {
    use innerwall_control_plane::policy::inputs::Outcome;
    use publish::Touched;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let db1 = register(pool, "db-1", &["app=db"], &["10.0.0.10"]).await;
    let batch = register(pool, "batch-1", &["app=batch"], &["10.0.0.30"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    create_ruleset(
        pool,
        &ruleset("db", "db", vec![PeerSpec::workloads(sel(&[("app", "web")]))], &["postgres"]),
    )
    .await;
    // One transaction: `write` (its change touching `touched`), a publish, then commit or not.
    let publish = async |touched: &[Touched], commit: bool, write: Write| {
        let mut tx = pool.begin().await.unwrap();
        match write {
            Write::Nothing => {}
            Write::Sql(sql) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await.unwrap();
            }
            Write::App(id, app) => set_app(&mut tx, id, app).await,
        }
        let rendering = publish::publish_touched(&mut tx, publish::Overflow::Refuse, touched).await.unwrap();
        match commit {
            true => tx.commit().await.unwrap(),
            false => tx.rollback().await.unwrap(),
        }
        (rendering.inputs, rendering.changed)
    };

    // After a commit, a publish that wrote nothing reuses what it kept.
    assert_eq!(publish(&[], true, Write::Nothing).await.0, Outcome::Kept);
    assert_eq!(publish(&[], true, Write::Nothing).await.0, Outcome::Kept);

    // A label edit reads that workload's labels again: batch-1 becomes a web server.
    let before = version(pool, db1).await;
    let (inputs, changed) = publish(&[Touched::Labels(batch)], true, Write::App(batch, "web")).await;
    assert_eq!(inputs, Outcome::Refreshed);
    assert_eq!(changed, vec![Changed { workload: db1, version: before + 1 }], "db-1 admits batch-1 now");

    // A change rolled back leaves a generation no one commits: the next publish loads.
    let (inputs, _) = publish(&[Touched::Labels(batch)], false, Write::App(batch, "batch")).await;
    assert_eq!(inputs, Outcome::Refreshed);
    let (inputs, changed) = publish(&[], true, Write::Nothing).await;
    assert_eq!((inputs, changed), (Outcome::Loaded, Vec::new()), "the rolled-back edit left nothing");

    // Another transaction's write, without a publish of this replica's: the next publish loads.
    set_app(&mut pool.acquire().await.unwrap(), batch, "batch").await;
    let (inputs, changed) = publish(&[], true, Write::Nothing).await;
    assert_eq!(inputs, Outcome::Loaded);
    assert_eq!(changed, vec![Changed { workload: db1, version: before + 2 }], "the write is seen");
    assert_eq!(publish(&[], true, Write::Nothing).await.0, Outcome::Kept);

    // A write the change does not name (a table the touched edit does not write): load.
    let (inputs, _) = publish(
        &[Touched::Labels(batch)],
        true,
        Write::Sql(format!("UPDATE workloads SET mode = mode WHERE id = '{batch}'")),
    )
    .await;
    assert_eq!(inputs, Outcome::Loaded);
    let (inputs, _) = publish(&[Touched::Service("postgres".into())], true, Write::App(batch, "web")).await;
    assert_eq!(inputs, Outcome::Loaded, "labels written, a service named");
    assert_eq!(version(pool, db1).await, before + 3, "batch-1 is a web server again");
    // A state write (heartbeat, sync state) is not an input.
    sqlx::query("UPDATE workloads SET last_seen_at = now(), sync_state = sync_state WHERE id = $1")
        .bind(batch.uuid())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(publish(&[], true, Write::Nothing).await.0, Outcome::Kept);

    // A write after the publish in the same transaction names a newer generation.
    let mut tx = pool.begin().await.unwrap();
    publish::publish(&mut tx).await.unwrap();
    set_app(&mut tx, batch, "batch").await;
    tx.commit().await.unwrap();
    let (inputs, changed) = publish(&[], true, Write::Nothing).await;
    assert_eq!(inputs, Outcome::Loaded);
    assert_eq!(changed, vec![Changed { workload: db1, version: before + 4 }]);

    // A service edit reads that service again.
    let (inputs, changed) = publish(
        &[Touched::Service("postgres".into())],
        true,
        Write::Sql("UPDATE service_entries SET port_start = 5433, port_end = 5433".into()),
    )
    .await;
    assert_eq!(inputs, Outcome::Refreshed);
    assert_eq!(changed, vec![Changed { workload: db1, version: before + 5 }]);
    let policy = store::persisted_policy(&mut pool.acquire().await.unwrap(), db1).await.unwrap().unwrap().0;
    assert!(format!("{policy:?}").contains("5433"), "the edited port is rendered: {policy:?}");
}

/// Sets a workload's `app` label as `workload label` does, at its current label-set version.
async fn set_app(conn: &mut sqlx::PgConnection, id: WorkloadId, app: &str) {
    let version: i64 = sqlx::query_scalar("SELECT label_version FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let label: Label = format!("app={app}").parse().unwrap();
    authoring::change_labels(conn, id, version, &[label], &[]).await.unwrap();
}

/// What a transaction of `kept_render_inputs_are_reused_only_while_true` writes.
enum Write {
    Nothing,
    Sql(String),
    /// The workload's `app` label set to this, as `workload label` does.
    App(WorkloadId, &'static str),
}

/// The trigger of migration 0041 takes the very render lock `publish` takes.
#[tokio::test]
async fn an_input_write_takes_the_render_lock() {
    let db = fresh_database().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO estate_ranges (cidr, description) VALUES ('10.9.0.0/16', 'x')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
             AND ((classid::bigint << 32) | objid::bigint) = $1)",
    )
    .bind(publish::RENDER_LOCK_KEY)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(held, "the render lock is held after a write to an input");
    tx.rollback().await.unwrap();
}

/// POL-7: a ruleset's create, update and delete render only the workloads its scope selects
/// before or after (the rules before come from the inputs the replica kept); a full render
/// afterwards changes nothing; a publish with the inputs loaded whole renders everything.
#[tokio::test]
async fn a_ruleset_edit_renders_only_what_it_selects() {
    use innerwall_control_plane::counts::CountBounds;
    use innerwall_control_plane::operations;
    use innerwall_control_plane::policy::inputs::Outcome;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let db1 = register(pool, "db-1", &["app=db"], &["10.0.0.10"]).await;
    let web = register(pool, "web-1", &["app=web"], &["10.0.0.20"]).await;
    let cache = register(pool, "cache-1", &["app=cache"], &["10.0.0.40"]).await;
    service(pool, "postgres", &["tcp:5432"]).await;
    service(pool, "redis", &["tcp:6379"]).await;
    create_ruleset(pool, &ruleset("cache", "cache", vec![PeerSpec::cidr("192.0.2.0/24")], &["redis"])).await;
    // One edit in a transaction of its own, published as `operations` publishes it.
    let edit = async |spec: Option<&RulesetSpec>, name: &str| {
        let mut tx = pool.begin().await.unwrap();
        match spec {
            Some(spec) => match authoring::update_ruleset(&mut tx, spec, 1).await {
                Ok(_) => {}
                Err(Error::NotFound { .. }) => {
                    authoring::create_ruleset_within(&mut tx, spec, &CountBounds::default()).await.unwrap();
                }
                Err(e) => panic!("{e}"),
            },
            None => authoring::delete_ruleset(&mut tx, name, 2).await.unwrap(),
        }
        let touched = [publish::Touched::Ruleset(name.into())];
        let rendering = publish::publish_touched(&mut tx, publish::Overflow::Refuse, &touched).await.unwrap();
        tx.commit().await.unwrap();
        (
            rendering.inputs,
            rendering.narrowed,
            rendering.rendered.shares().map(|(w, _)| w).collect::<Vec<_>>(),
        )
    };
    let (vdb, vweb, vcache) =
        (version(pool, db1).await, version(pool, web).await, version(pool, cache).await);
    // A new ruleset for db-1: only db-1 renders.
    let db_rules = ruleset("db", "db", vec![PeerSpec::workloads(sel(&[("app", "web")]))], &["postgres"]);
    assert_eq!(edit(Some(&db_rules), "db").await, (Outcome::Refreshed, true, vec![db1]));
    oracle(pool).await;
    // Its scope moves to web-1: both render; db-1 loses the rules, web-1 gains them.
    let moved = ruleset("db", "web", vec![PeerSpec::workloads(sel(&[("app", "web")]))], &["postgres"]);
    let (inputs, narrowed, mut rendered) = edit(Some(&moved), "db").await;
    rendered.sort();
    let mut both = vec![db1, web];
    both.sort();
    assert_eq!((inputs, narrowed, rendered), (Outcome::Refreshed, true, both));
    oracle(pool).await;
    assert_eq!(
        (version(pool, db1).await, version(pool, web).await, version(pool, cache).await),
        (vdb + 2, vweb + 1, vcache),
        "cache-1 never rendered again"
    );
    // Deleted: web-1 alone renders, and loses the rules.
    assert_eq!(edit(None, "db").await, (Outcome::Refreshed, true, vec![web]));
    oracle(pool).await;
    assert_eq!(version(pool, web).await, vweb + 2);

    // Through the operation (as the CLI and API edit), after another transaction's write: the
    // inputs are loaded whole, the rules before are unknown, and everything renders.
    sqlx::query("UPDATE estate_ranges SET description = 'x' WHERE cidr = '10.0.0.0/8'")
        .execute(pool)
        .await
        .unwrap();
    operations::create_ruleset(pool, "test", &db_rules, &CountBounds::default()).await.unwrap();
    oracle(pool).await;
    assert_eq!(version(pool, db1).await, vdb + 3, "db-1 has its rules again");
}

/// POL-7 for enrollment (issue 33, item 2): a batch of new workloads renders the new workloads
/// and the workloads whose rules select them, nothing else, and persists what the full render
/// persists. A new workload whose address another live workload claims moves that one's
/// standing: then everything renders.
#[tokio::test]
async fn an_enrollment_batch_renders_only_what_it_touches() {
    use innerwall_control_plane::policy::inputs::Outcome;
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let db1 = register(pool, "db-1", &["app=db"], &["10.0.0.10"]).await;
    let cache = register(pool, "cache-1", &["app=cache"], &["10.0.0.40"]).await;
    db_admits_web(pool).await;
    create_ruleset(pool, &ruleset("cache", "cache", vec![PeerSpec::cidr("192.0.2.0/24")], &["redis"])).await;
    // The batch as the enrollment writer writes it: each workload registered, one publish.
    let enroll = async |hosts: &[(&str, &str, &str)]| {
        let mut tx = pool.begin().await.unwrap();
        let mut touched = Vec::new();
        let mut ids = Vec::new();
        for &(host, label, address) in hosts {
            let new = NewWorkload {
                id: WorkloadId::new_random(),
                hostname: host.into(),
                labels: vec![label.parse().unwrap()],
                addresses: [address.parse::<IpAddr>().unwrap()].into(),
            };
            authoring::register_workload(&mut tx, &new).await.unwrap();
            touched.push(publish::Touched::Enrolled(new.id));
            ids.push(new.id);
        }
        let rendering = publish::publish_touched(&mut tx, publish::Overflow::Refuse, &touched).await.unwrap();
        tx.commit().await.unwrap();
        let mut rendered: Vec<WorkloadId> = rendering.rendered.shares().map(|(w, _)| w).collect();
        rendered.sort();
        (ids, rendering.inputs, rendering.narrowed, rendered)
    };
    let vcache = version(pool, cache).await;
    let vdb = version(pool, db1).await;

    // Two web servers: they and db-1 (its peers gain them) render; cache-1 does not.
    let (ids, inputs, narrowed, rendered) =
        enroll(&[("web-1", "app=web", "10.0.0.20"), ("web-2", "app=web", "10.0.0.21")]).await;
    let mut want = vec![db1, ids[0], ids[1]];
    want.sort();
    assert_eq!((inputs, narrowed, rendered), (Outcome::Refreshed, true, want));
    oracle(pool).await;
    assert_eq!((version(pool, db1).await, version(pool, cache).await), (vdb + 1, vcache));
    assert_eq!((version(pool, ids[0]).await, version(pool, ids[1]).await), (1, 1));

    // A workload nothing selects: it alone renders.
    let (ids, inputs, narrowed, rendered) = enroll(&[("batch-1", "app=batch", "10.0.0.30")]).await;
    assert_eq!((inputs, narrowed, rendered), (Outcome::Refreshed, true, ids.clone()));
    oracle(pool).await;
    assert_eq!((version(pool, db1).await, version(pool, cache).await), (vdb + 1, vcache));

    // One that claims cache-1's address: cache-1's standing moves, so everything renders, and
    // what it stores is what the full render stores.
    let (_, inputs, narrowed, _) = enroll(&[("impostor", "app=web", "10.0.0.40")]).await;
    assert_eq!((inputs, narrowed), (Outcome::Refreshed, false));
    oracle(pool).await;
    let standing: Option<i16> =
        sqlx::query_scalar("SELECT standing FROM workload_addresses WHERE workload_id = $1")
            .bind(cache.uuid())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(standing, Some(4), "cache-1's address is in conflict");
}
