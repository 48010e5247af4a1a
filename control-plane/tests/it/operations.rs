//! One operation, one audit record (issue 29 item 0): every operator change is one library call
//! that writes its own record, so the same sequence of changes made by the CLI on this host's
//! database and by the remote CLI through the API (the API's handlers) leaves the same audit log
//! — action, subject, detail and the versions each change moved — in two estates made alike.

use std::collections::BTreeMap;

use innerwall_control_plane::identity::operators::Role;
use innerwall_control_plane::testing::fresh_database;
use serde_json::Value;
use sqlx::PgPool;

use crate::cli::foresight_cli;
use crate::foresight_api::{Serve, TESTS, estate, file, mint};

fn innerwall(args: &[String]) -> String {
    let (code, out, err) = foresight_cli(args, &[]);
    assert_eq!(code, Some(0), "innerwall {args:?}: {err}");
    out
}

/// Hostname by workload id.
async fn hostnames(pool: &PgPool) -> BTreeMap<String, String> {
    let rows: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, hostname FROM workloads").fetch_all(pool).await.unwrap();
    rows.into_iter().map(|(id, host)| (id.to_string(), host)).collect()
}

/// `text` with what differs between two estates made alike by design: a workload id reads as its
/// hostname, another id (a token's, a promotion's) as `<id>`, a time as `<time>` (and lists of
/// such texts compare in order of what they read as).
fn alike(text: &str, hosts: &BTreeMap<String, String>) -> String {
    if let Some(host) = hosts.get(text) {
        return format!("<{host}>");
    }
    if uuid::Uuid::parse_str(text).is_ok() {
        return "<id>".into();
    }
    if chrono::DateTime::parse_from_rfc3339(text).is_ok() {
        return "<time>".into();
    }
    text.to_owned()
}

fn alike_json(value: &Value, hosts: &BTreeMap<String, String>) -> Value {
    match value {
        Value::String(text) => Value::String(alike(text, hosts)),
        // A list of workloads is in id order, which differs between the two estates: compare
        // lists of names as sets.
        Value::Array(items) => {
            let mut items: Vec<Value> = items.iter().map(|v| alike_json(v, hosts)).collect();
            if items.iter().all(Value::is_string) {
                items.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
            }
            Value::Array(items)
        }
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (alike(k, hosts), alike_json(v, hosts))).collect())
        }
        other => other.clone(),
    }
}

/// The audit log after `after` (an id), each record as (action, subject, detail, versions moved).
async fn records(pool: &PgPool, after: i64) -> Vec<(String, String, Value, Value)> {
    let hosts = hostnames(pool).await;
    let rows: Vec<(String, String, Value, Value)> = sqlx::query_as(
        "SELECT action, subject, detail, workload_versions FROM audit_log WHERE id > $1 ORDER BY id",
    )
    .bind(after)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(action, subject, detail, versions)| {
            (action, alike(&subject, &hosts), alike_json(&detail, &hosts), alike_json(&versions, &hosts))
        })
        .collect()
}

async fn last_audit(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM audit_log").fetch_one(pool).await.unwrap()
}

async fn id_of(pool: &PgPool, host: &str) -> String {
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM workloads WHERE hostname = $1")
        .bind(host)
        .fetch_one(pool)
        .await
        .unwrap();
    id.to_string()
}

const RULESET: &str = "name: lab\nscope: {app: [db]}\nrules:\n- {name: from-lab, services: [lab], peers: [{address_group: lab-net}]}\n";
const RULESET_2: &str = "name: lab\nscope: {app: [db]}\nrules:\n- {name: from-lab, services: [lab], peers: [{address_group: lab-net}, {workloads: {app: [web]}}]}\n";
const CHANGES: &str = "changes:\n  - service:\n      name: https\n      members: [tcp:443, tcp:8443]\n";

/// Every operator change the CLI makes, in an order each can succeed in, against `side`'s flags
/// (`--database-url …` or `--api … --token-file …`) on the estate of `pool`.
async fn operate(pool: &PgPool, side: &[String], dir: &std::path::Path) {
    let files =
        [("lab.yaml", RULESET), ("lab-2.yaml", RULESET_2), ("changes.yaml", CHANGES), ("tests.yaml", TESTS)];
    let paths: BTreeMap<&str, String> =
        files.iter().map(|(name, text)| (*name, file(dir, name, text))).collect();
    let (web, api, payments, db) = (
        id_of(pool, "web-1").await,
        id_of(pool, "api-1").await,
        id_of(pool, "payments-1").await,
        id_of(pool, "db-1").await,
    );
    let test_set = TESTS.lines().find_map(|l| l.strip_prefix("name: ")).unwrap();
    let run = |args: &[&str]| {
        let all: Vec<String> = side.iter().cloned().chain(args.iter().map(|a| (*a).to_owned())).collect();
        innerwall(&all)
    };
    run(&["service", "create", "lab", "--entry", "tcp:all", "--description", "the lab's ports"]);
    run(&[
        "service",
        "update",
        "lab",
        "--entry",
        "tcp:8000-8080",
        "--entry",
        "udp:53",
        "--expect-version",
        "1",
    ]);
    run(&["address-group", "create", "lab-net", "--cidr", "10.9.0.0/16", "--cidr", "10.8.0.1/32"]);
    run(&["address-group", "update", "lab-net", "--cidr", "10.9.0.0/24", "--expect-version", "1"]);
    run(&["ruleset", "create", "-f", &paths["lab.yaml"]]);
    run(&["ruleset", "update", "-f", &paths["lab-2.yaml"], "--expect-version", "1"]);
    run(&["ruleset", "delete", "lab", "--expect-version", "2"]);
    run(&["address-group", "delete", "lab-net", "--expect-version", "2"]);
    run(&["service", "delete", "lab", "--expect-version", "2"]);
    run(&["render"]);
    run(&["policy", "test-set", "create", "-f", &paths["tests.yaml"]]);
    run(&["policy", "test-set", "update", "-f", &paths["tests.yaml"], "--expect-version", "1"]);
    run(&["policy", "test-set", "delete", test_set, "--expect-version", "2"]);
    run(&["estate-range", "add", "198.51.100.0/24", "--description", "the lab"]);
    run(&["estate-range", "remove", "198.51.100.0/24"]);
    run(&["workload", "label", &web, "--set", "env=prod", "--remove", "tier", "--expect-label-version", "1"]);
    run(&["workload", "label", &web, "--set", "env=prod", "--expect-label-version", "2"]);
    run(&["workload", "release-address", &web, "10.0.0.1"]);
    run(&["workload", "mode", &db, "simulation", "--reason", "watch it first"]);
    run(&[
        "workload",
        "promote",
        "--scope",
        "tier=back",
        "--expect-count",
        "2",
        "--to",
        "visibility",
        "--reason",
        "back out",
    ]);
    run(&["draft", "create", "widen", "--note", "https on 8443 too"]);
    run(&["draft", "add", "widen", "-f", &paths["changes.yaml"]]);
    run(&["draft", "commit", "widen", "--expect-version", "2"]);
    run(&["draft", "create", "dropped"]);
    run(&["draft", "discard", "dropped", "--expect-version", "1"]);
    let minted: Value = serde_json::from_str(&run(&[
        "--json",
        "token",
        "mint",
        "--label",
        "app=lab",
        "--ttl",
        "1d",
        "--max-uses",
        "2",
    ]))
    .unwrap();
    run(&["token", "revoke", minted["id"].as_str().unwrap()]);
    run(&["workload", "retire", &api]);
    run(&["workload", "deny", &payments]);
}

#[tokio::test]
async fn one_operation_one_audit() {
    let (here, there) = (fresh_database().await.unwrap(), fresh_database().await.unwrap());
    estate(&here.pool).await;
    estate(&there.pool).await;
    let dir = std::env::temp_dir().join(format!("iw-operations-{}", uuid::Uuid::new_v4()));
    let token = mint(&there.pool, "ada", Role::Admin).await;
    let serve = Serve::start(&there.url);
    let (from_here, from_there) = (last_audit(&here.pool).await, last_audit(&there.pool).await);

    operate(&here.pool, &["--database-url".to_owned(), here.url.clone()], &dir).await;
    operate(&there.pool, &serve.remote(&token), &dir).await;

    let local = records(&here.pool, from_here).await;
    let remote = records(&there.pool, from_there).await;
    let actions: Vec<&str> = local.iter().map(|(action, ..)| action.as_str()).collect();
    // Every operation left its one record (a render, a draft's commit and a promotion included).
    for action in [
        "service.create",
        "service.update",
        "service.delete",
        "address-group.create",
        "address-group.update",
        "address-group.delete",
        "ruleset.create",
        "ruleset.update",
        "ruleset.delete",
        "policy.render",
        "estate-range.add",
        "estate-range.remove",
        "workload.label",
        "workload.release-address",
        "workload.demote",
        "policy-test-set.create",
        "policy-test-set.update",
        "policy-test-set.delete",
        "draft.create",
        "draft.add",
        "draft.commit",
        "draft.discard",
        "token.mint",
        "token.revoke",
        "workload.retire",
        "workload.deny",
    ] {
        assert!(actions.contains(&action), "no {action} record in {actions:?}");
    }
    for (i, (l, r)) in local.iter().zip(&remote).enumerate() {
        assert_eq!(l, r, "record {i} differs between the local CLI and the API");
    }
    assert_eq!(local.len(), remote.len(), "{actions:?}");
    // The drift this guards against: `tcp:all` is audited in one canonical text both ways.
    let created = local.iter().find(|(action, ..)| action == "service.create").unwrap();
    assert_eq!(created.2["entries"], serde_json::json!(["tcp:1-65535"]), "{created:?}");
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}
