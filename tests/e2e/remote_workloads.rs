//! Issue 12 part 6, `remote_cli_matches_local_workloads`: every `innerwall workload` and
//! `innerwall promotions` subcommand through `--api` against a real `innerwall serve
//! --api-listen` prints what the local CLI prints, and fails with the same message.
//!
//! The same estate is set up in two databases — the same workloads under the same ids, labels,
//! addresses, sync states and last-seen times, the same estate range, service and ruleset — and
//! the script runs through the local CLI on database A and through the API on database B, each
//! step with a token of the role it needs. Then:
//! - every read is also run by the local CLI on database B and must be byte-identical to the
//!   remote read (a verdict's evidence range ends at the moment it is asked, so its times and
//!   millisecond bounds are replaced by tokens first);
//! - every step's output on A must equal its output on B once what two databases cannot share
//!   is replaced by tokens: times (renders, promotions, evidence ranges), the ids the databases
//!   made (promotion records, authored rules; numbered in order of appearance — the workloads'
//!   ids are the same in both), and the actor (`cli:<user>` locally, `operator:<name>/<token id>`
//!   remotely); in `promotions list`'s table, whose actor column is as wide as the actor, runs
//!   of spaces are collapsed, the same-database comparison having checked its layout byte for
//!   byte.
//!
//! Refusals are remote-only: a viewer's write and an editor's mode change or retirement are 403
//! with the role in the detail; the reads that follow show they changed nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::spec::NewWorkload;
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_wire::convert::WireEnum as _;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;
use innerwall_wire::sync::SyncState;
use sqlx::PgPool;

use crate::plane::Plane;
use crate::remote::{Serve, innerwall, mint_token};

/// One workload of the estate.
struct Host {
    hostname: &'static str,
    /// Its id is made from this, the same in both databases.
    n: u128,
    labels: &'static [&'static str],
    address: &'static str,
    state: SyncState,
    /// Seconds after [`EPOCH`]; distinct, so the list's attention order is the same in both
    /// databases.
    seen: i64,
}

const fn host(
    hostname: &'static str,
    n: u128,
    labels: &'static [&'static str],
    address: &'static str,
    state: SyncState,
    seen: i64,
) -> Host {
    Host { hostname, n, labels, address, state, seen }
}

const WORKLOADS: &[Host] = &[
    host("web-1", 0xa1, &["app=web", "env=prod"], "10.20.0.1", SyncState::Synced, 50),
    host("web-2", 0xa2, &["app=web", "env=prod"], "10.20.0.2", SyncState::Synced, 40),
    host("db-1", 0xa3, &["app=db"], "10.20.0.3", SyncState::Offline, 30),
    host("batch-1", 0xa4, &["app=batch"], "10.20.0.4", SyncState::Offline, 20),
    host("batch-2", 0xa5, &["app=batch"], "10.20.0.5", SyncState::Offline, 10),
    // Claims web-1's address: both are a conflict until it releases it.
    host("dup-1", 0xa6, &["app=dup"], "10.20.0.1", SyncState::Offline, 5),
];

/// 2026-01-01T00:00:00Z.
const EPOCH: i64 = 1_767_225_600;

fn id(hostname: &str) -> String {
    let n = WORKLOADS.iter().find(|w| w.hostname == hostname).expect("a workload of the estate").n;
    let uuid = uuid::Uuid::parse_str(&format!("{n:08x}-0000-4000-8000-{n:012x}")).unwrap();
    WorkloadId::from_uuid(uuid).unwrap().to_string()
}

const RULESET: &str = "name: web-in
scope: {app: [web]}
rules:
  - name: from-db
    peers: [{workloads: {app: [db]}}]
    services: [https]
";

/// The same estate in `plane`'s database.
async fn estate(plane: &Plane) {
    let pool = plane.pool();
    innerwall_control_plane::foresight::commit(pool, "test", "estate-range.add", "10.20.0.0/16", async |c| {
        authoring::add_estate_range(c, Cidr::parse_lenient("10.20.0.0/16").unwrap(), "e2e").await?;
        Ok(((), serde_json::json!({})))
    })
    .await
    .unwrap();
    for Host { hostname, labels, address, state, seen, .. } in WORKLOADS {
        let new = NewWorkload {
            id: id(hostname).parse().unwrap(),
            hostname: (*hostname).into(),
            labels: labels.iter().map(|l| l.parse().unwrap()).collect(),
            addresses: BTreeSet::from([address.parse::<IpAddr>().unwrap()]),
        };
        innerwall_control_plane::foresight::commit(pool, "test", "register", hostname, async |c| {
            authoring::register_workload(c, &new).await?;
            Ok(((), serde_json::json!({})))
        })
        .await
        .unwrap();
        sqlx::query("UPDATE workloads SET sync_state = $2, last_seen_at = $3 WHERE id = $1")
            .bind(new.id.uuid())
            .bind(state.code())
            .bind(chrono::DateTime::from_timestamp(EPOCH + seen, 0).unwrap())
            .execute(pool)
            .await
            .unwrap();
    }
    let file = plane.dir.join("web-in.yaml");
    std::fs::create_dir_all(&plane.dir).unwrap();
    std::fs::write(&file, RULESET).unwrap();
    for step in [
        &["service", "create", "https", "--entry", "tcp:443"][..],
        &["ruleset", "create", "--file", file.to_str().unwrap()],
    ] {
        let mut args = vec!["--database-url", &plane.db.url];
        args.extend(step);
        let (code, _, stderr) = innerwall(&args, &[]);
        assert_eq!(code, Some(0), "{step:?}: {stderr}");
    }
}

/// The role a step needs through the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Viewer,
    Editor,
    Promoter,
    Admin,
}

/// What a step does, which decides how it is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Changes nothing: also run locally on B, byte-identical to the remote run.
    Read,
    /// Reads the evidence up to now: also run locally on B, identical once times are tokens.
    Verdict,
    /// Changes something, or fails: once per database.
    Write,
}

struct Step {
    role: Role,
    kind: Kind,
    /// Must it succeed?
    ok: bool,
    args: Vec<String>,
}

/// A step written as its arguments separated by spaces (none has a space of its own); `{web-1}`
/// and the like become the workload's id, `{latest-promotion}` and `{enforcement-promotion}`
/// are looked up in each database when the step runs.
fn step(role: Role, kind: Kind, ok: bool, line: &str) -> Step {
    let args = line
        .split_whitespace()
        .map(|a| match a.strip_prefix('{').and_then(|a| a.strip_suffix('}')) {
            Some(name) if !name.ends_with("-promotion") => id(name),
            _ => a.to_owned(),
        })
        .collect();
    Step { role, kind, ok, args }
}

/// Reads, each with and without `--json`.
fn reads(out: &mut Vec<Step>, kind: Kind, lines: &[&str]) {
    for line in lines {
        out.push(step(Role::Viewer, kind, true, line));
        out.push(step(Role::Viewer, kind, true, &format!("--json {line}")));
    }
}

fn script() -> Vec<Step> {
    use Kind::{Read, Verdict, Write};
    use Role::{Admin, Editor, Promoter, Viewer};
    let mut s = Vec::new();
    reads(
        &mut s,
        Read,
        &[
            "workload list",
            "workload show {web-1}",
            "workload show {dup-1}",
            "workload status",
            "workload status {web-1}",
            "workload policy {web-1}",
            "promotions list",
        ],
    );
    reads(
        &mut s,
        Verdict,
        &[
            "workload verdict --scope app=web",
            "workload verdict --id {web-1} --id {db-1} --evidence-since 2h --min-evidence 1h",
        ],
    );
    let writes = [
        (Editor, "workload label {web-1} --set tier=gold --remove env --expect-label-version 1"),
        (Editor, "--json workload label {web-2} --set zone=b --set tier=silver --expect-label-version 1"),
        // Sets what is already set and removes what is not there: keeps the version.
        (Editor, "workload label {db-1} --set app=db --remove gone --expect-label-version 1"),
        (Editor, "workload release-address {dup-1} 10.20.0.1"),
        (Editor, "workload resend-snapshot {web-1}"),
        (Editor, "--json workload resend-snapshot {web-2}"),
        (Promoter, "workload mode {web-1} simulation --reason start-simulating"),
        (Promoter, "--json workload mode {db-1} simulation"),
        (Promoter, "workload promote --scope app=web --expect-count 2 --to simulation --reason both"),
        (
            Promoter,
            "--json workload promote --id {web-1} --id {web-2} --expect-count 2 --to enforcement \
             --reason go --override change-window-42",
        ),
        (
            Promoter,
            "workload promote --scope tier=gold --expect-count 1 --to visibility --reason back --evidence-since 1h",
        ),
        (Admin, "workload retire {batch-1}"),
        (Admin, "--json workload deny {batch-2}"),
    ];
    s.extend(writes.iter().map(|(role, line)| step(*role, Write, true, line)));
    let failing = [
        // Stale: the labels are at version 2 now (remotely: older than the version read).
        (Editor, "workload label {web-1} --set tier=silver --expect-label-version 1"),
        // Stale: a version never read (remotely: refused before anything is sent).
        (Editor, "workload label {web-1} --set tier=silver --expect-label-version 7"),
        (Editor, "workload label {web-1} --expect-label-version 2"),
        (Editor, "workload label {web-1} --set a=b --remove a --expect-label-version 2"),
        (Editor, "workload label {batch-1} --set a=b --expect-label-version 1"),
        (Editor, "workload label 00000000-0000-4000-8000-0000000000ff --set a=b --expect-label-version 1"),
        (Promoter, "workload promote --scope app=web --expect-count 3 --to simulation --reason x"),
        (Promoter, "workload promote --scope app=db --expect-count 1 --to enforcement --reason no-evidence"),
        (Promoter, "workload promote --scope app=db --expect-count 1 --to visibility"),
        (Promoter, "workload mode {batch-1} enforcement --override x"),
        (Promoter, "workload verdict --scope app=web --evidence-since 100d"),
        (Viewer, "workload show 00000000-0000-4000-8000-0000000000ff"),
        (Viewer, "workload policy 00000000-0000-4000-8000-0000000000ff"),
        (Viewer, "workload status {batch-1}"),
        (Viewer, "promotions show 00000000-0000-4000-8000-0000000000ff"),
        (Editor, "workload resend-snapshot {db-1}"),
        (Editor, "workload release-address {dup-1} 10.20.0.9"),
        (Admin, "workload retire {batch-1}"),
        (Admin, "workload deny {batch-2}"),
    ];
    s.extend(failing.iter().map(|(role, line)| step(*role, Write, false, line)));
    reads(
        &mut s,
        Read,
        &[
            "workload list",
            "workload show {web-1}",
            "workload show {web-2}",
            "workload show {dup-1}",
            "workload show {batch-1}",
            "workload status",
            "workload status {db-1}",
            "workload policy {web-2}",
            "promotions list",
            "promotions list --limit 1",
            "promotions show {latest-promotion}",
            "promotions show {enforcement-promotion}",
        ],
    );
    reads(&mut s, Verdict, &["workload verdict --scope app=web"]);
    s
}

/// How `innerwall` is run against one database: its flags, the token for each role (remote),
/// and the pool to look ids up in.
struct Target<'a> {
    flags: Vec<String>,
    tokens: Option<&'a BTreeMap<Role, String>>,
    pool: &'a PgPool,
}

/// One step's output: stdout, or for a failure the exit code and the error message.
async fn run(target: &Target<'_>, step: &Step) -> String {
    let mut args: Vec<String> = target.flags.clone();
    let mut env = vec![("USER", "e2e"), ("SUDO_USER", "e2e")];
    if let Some(tokens) = target.tokens {
        env.push(("INNERWALL_API_TOKEN", tokens[&step.role].as_str()));
    }
    for arg in &step.args {
        // The newest record, and the newest that stood on a verdict.
        let sql = match arg.as_str() {
            "{latest-promotion}" => Some("SELECT id FROM promotions ORDER BY at DESC LIMIT 1"),
            "{enforcement-promotion}" => {
                Some("SELECT id FROM promotions WHERE verdict IS NOT NULL ORDER BY at DESC LIMIT 1")
            }
            _ => None,
        };
        if let Some(sql) = sql {
            let id: uuid::Uuid =
                sqlx::query_scalar(sql).fetch_one(target.pool).await.expect("a promotion record");
            args.push(id.to_string());
        } else {
            args.push(arg.clone());
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The local actor is `cli:<the real uid's user name>` (never $USER), read as `<actor>`.
    let (code, stdout, stderr) = innerwall(&args, &env);
    if step.ok {
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        return stdout;
    }
    assert_eq!(code, Some(1), "{args:?} should fail: {stdout}");
    assert!(stdout.is_empty(), "{args:?} failed but printed: {stdout}");
    let message = stderr.lines().last().unwrap_or_default();
    format!("exit 1: {}", message.split_once("error: ").map_or(message, |(_, m)| m))
}

/// Replaces what two databases cannot share by tokens (see the module doc).
#[derive(Default)]
struct Normalize {
    /// Ids other than the workloads', numbered as they first appear.
    ids: BTreeMap<String, String>,
}

impl Normalize {
    /// Times and evidence-range bounds only: what depends on when a verdict is asked.
    fn now(text: &str) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if let Some(len) = time_len(rest.as_bytes()) {
                out.push_str("<time>");
                rest = &rest[len..];
            } else {
                out.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
        for key in ["\"from_ms\":", "\"to_ms\":"] {
            out = replace_after(&out, key, |c| c.is_ascii_digit() || c == ' ', |_| " <ms>".to_owned());
        }
        out
    }

    fn across(&mut self, text: &str, collapse: bool) -> String {
        let text = Normalize::now(text);
        let workloads: BTreeSet<String> = WORKLOADS.iter().map(|w| id(w.hostname)).collect();
        let mut out = String::new();
        let mut rest = text.as_str();
        while let Some(c) = rest.chars().next() {
            match rest.get(..36).filter(|s| is_uuid(s) && !workloads.contains(*s)) {
                Some(uuid) => {
                    let n = self.ids.len() + 1;
                    out.push_str(self.ids.entry(uuid.to_owned()).or_insert_with(|| format!("<uuid-{n}>")));
                    rest = &rest[36..];
                }
                None => {
                    out.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        let out = replace_after(
            &out.replace(&local_actor(), "<actor>"),
            "operator:",
            |c| !c.is_whitespace() && c != '"',
            |_| String::new(),
        );
        let out = out.replace("operator:", "<actor>");
        if !collapse {
            return out;
        }
        out.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect::<Vec<_>>().join("\n")
    }
}

/// `2026-01-01T00:00:00.123456Z`, `2026-01-01 00:00:00`, `… .123`, `… UTC`, `…+00:00`: its length.
fn time_len(b: &[u8]) -> Option<usize> {
    let digits =
        |range: std::ops::Range<usize>| b.get(range).is_some_and(|s| s.iter().all(u8::is_ascii_digit));
    let at = |i: usize, c: &[u8]| b.get(i).is_some_and(|x| c.contains(x));
    let shape = digits(0..4)
        && at(4, b"-")
        && digits(5..7)
        && at(7, b"-")
        && digits(8..10)
        && at(10, b"T ")
        && digits(11..13)
        && at(13, b":")
        && digits(14..16)
        && at(16, b":")
        && digits(17..19);
    if !shape {
        return None;
    }
    let mut len = 19;
    if at(len, b".") {
        len += 1;
        while at(len, b"0123456789") {
            len += 1;
        }
    }
    for zone in [&b"Z"[..], b"+00:00", b" UTC"] {
        if b[len..].starts_with(zone) {
            len += zone.len();
            break;
        }
    }
    Some(len)
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_hexdigit() && !c.is_ascii_uppercase(),
        })
}

/// Replaces the run of characters matching `keep` right after each `key` by `with(run)`.
fn replace_after(
    text: &str,
    key: &str,
    keep: impl Fn(char) -> bool,
    with: impl Fn(&str) -> String,
) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(key) {
        out.push_str(&rest[..at + key.len()]);
        rest = &rest[at + key.len()..];
        let run = rest.find(|c: char| !keep(c)).unwrap_or(rest.len());
        out.push_str(&with(&rest[..run]));
        rest = &rest[run..];
    }
    out.push_str(rest);
    out
}

#[tokio::test]
async fn remote_cli_matches_local_workloads() {
    let local = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let remote = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    estate(&local).await;
    estate(&remote).await;
    let (_serve, api, ca) = Serve::api(&remote);
    let ca = ca.as_str();
    let tokens: BTreeMap<Role, String> = [
        (Role::Viewer, "viewer"),
        (Role::Editor, "editor"),
        (Role::Promoter, "promoter"),
        (Role::Admin, "admin"),
    ]
    .into_iter()
    .map(|(role, name)| (role, mint_token(&remote, &format!("e2e-{name}"), name)))
    .collect();

    let on_a = Target {
        flags: vec!["--database-url".into(), local.db.url.clone()],
        tokens: None,
        pool: local.pool(),
    };
    let on_b = Target {
        flags: vec!["--database-url".into(), remote.db.url.clone()],
        tokens: None,
        pool: remote.pool(),
    };
    let by_api = Target {
        flags: vec!["--api".into(), api.clone(), "--api-ca".into(), ca.into()],
        tokens: Some(&tokens),
        pool: remote.pool(),
    };

    let (mut across_a, mut across_b) = (Normalize::default(), Normalize::default());
    let mut transcript = Vec::new();
    let script = script();
    let refusals_at = script.iter().position(|s| s.kind == Kind::Write && !s.ok).unwrap();
    for (n, step) in script.iter().enumerate() {
        if n == refusals_at {
            refused_by_role(&by_api, &tokens);
        }
        let a = run(&on_a, step).await;
        let b = run(&by_api, step).await;
        if step.kind != Kind::Write {
            let b_local = run(&on_b, step).await;
            let same = |t: &str| if step.kind == Kind::Verdict { Normalize::now(t) } else { t.to_owned() };
            assert_eq!(
                same(&b_local),
                same(&b),
                "$ {}: local and remote differ on the same database",
                step.args.join(" ")
            );
        }
        // The table that names the actor is as wide as it.
        let collapse = step.args.starts_with(&["promotions".to_owned(), "list".to_owned()]);
        let (a, b) = (across_a.across(&a, collapse), across_b.across(&b, collapse));
        assert_eq!(a, b, "$ {}: database A (local) and B (remote) differ", step.args.join(" "));
        transcript.push(format!("$ {}\n{b}", step.args.join(" ")));
    }

    // The script did what it says (guards against both modes printing the same nothing).
    let all = transcript.join("\n");
    for expected in [
        &format!("labels of {} updated (label version 2)", id("web-1"))[..],
        &format!("labels of {} unchanged (label version 1)", id("db-1")),
        "\"set\":[\"tier=silver\",\"zone=b\"]",
        "(conflict with 000000a1)",
        &format!("{} no longer claims 10.20.0.1", id("dup-1")),
        "last snapshot advancing past never",
        "1 workload(s) now in simulation mode: web-1",
        "2 workload(s) now in simulation mode",
        "\"override_reason\": \"change-window-42\"",
        "\"to_mode\": \"enforcement\"",
        "\"actor\": \"<actor>\"",
        "1 workload(s) now in visibility mode: web-1",
        "retired: it left every render",
        "{\"changed\":[],\"result\":null}",
        "is at version 2, not 1: re-read it and retry",
        "is at version 2, not 7: re-read it and retry",
        "nothing to change: give --set key=value or --remove key",
        "is retired; its labels are frozen",
        "match-count-mismatch: 2 workload(s) matched, you expected 3",
        "evidence-insufficient: the verdict is INSUFFICIENT, not SAFE",
        "a mode change needs a reason: say why",
        "an evidence range of 100 days is longer than the 90 days a verdict may look back",
        "agent-offline: workload",
        "already retired",
        "already deny-listed",
        "live workload \"",
        "verdict: INSUFFICIENT",
        "in enforcement mode, not simulation",
        "verdict it stood on:",
        "tier=gold",
        "(deny-listed)",
        "(retired)",
    ] {
        assert!(all.contains(expected), "the transcript lacks {expected:?}:\n{all}");
    }
}

/// Writes a token's role does not allow: the 403 problem's detail, naming the role needed, and
/// exit 1. The reads after them (compared with database A, where none of this ran) show they
/// changed nothing.
fn refused_by_role(by_api: &Target<'_>, tokens: &BTreeMap<Role, String>) {
    let cases: &[(Role, &[&str], &str)] = &[
        (
            Role::Viewer,
            &["workload", "label", &id("web-2"), "--set", "x=y", "--expect-label-version", "2"],
            "editor",
        ),
        (Role::Viewer, &["workload", "release-address", &id("web-1"), "10.20.0.1"], "editor"),
        (Role::Editor, &["workload", "mode", &id("web-2"), "visibility", "--reason", "no"], "promoter"),
        (Role::Promoter, &["workload", "retire", &id("web-2")], "admin"),
        (Role::Editor, &["workload", "deny", &id("web-2")], "admin"),
    ];
    for (role, step, needed) in cases {
        let mut args: Vec<&str> = by_api.flags.iter().map(String::as_str).collect();
        args.extend(*step);
        let (code, stdout, stderr) = innerwall(&args, &[("INNERWALL_API_TOKEN", &tokens[role])]);
        assert_eq!(code, Some(1), "{args:?}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
        let has = format!("{role:?}").to_lowercase();
        assert!(
            stderr.contains(&format!("error: this needs the {needed} role; the token"))
                && stderr.contains(&format!("is {has}")),
            "{args:?}: {stderr}"
        );
    }
}

/// The actor the audit log names for a local command: `cli:` and the real uid's user name.
fn local_actor() -> String {
    let me =
        nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten().expect("this uid has a user name");
    format!("cli:{}", me.name)
}
