//! Issue 6 acceptance: the owned table, enforcement and simulation with real packets, peer
//! deltas without a rebuild, atomic failed batches, fail static across a killed agent, the kill
//! switch and drift repair.

use std::fs;
use std::io::Read as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use innerwall_agent::enforce::desired::DesiredTable;
use innerwall_agent::enforce::status::{StatusReport, status};
use innerwall_agent::enforce::{Installed, LinuxPolicyStore, PersistedPolicy, PolicyStore as _, Restored};
use innerwall_agent::enforce::{nft, state};
use innerwall_agent::policy_json;
use innerwall_wire::policy::{Protocol, WorkloadPolicy};
use innerwall_wire::testing::rule;

use crate::netns::*;

const AGENT: &str = env!("CARGO_BIN_EXE_innerwall-agent");

/// Allowed: tcp/8080 and udp/5353 from .2 and ::2, icmp from .2, icmpv6 from ::2. `web_peers`
/// may be bare addresses (host routes) or CIDRs.
pub fn policy(version: u64, mode: &str, web_peers: &[&str]) -> WorkloadPolicy {
    let host = |peer: &str| match peer {
        p if p.contains('/') => p.to_owned(),
        p if p.contains(':') => format!("{p}/128"),
        p => format!("{p}/32"),
    };
    let web: Vec<String> = web_peers.iter().map(|p| host(p)).collect();
    let web: Vec<&str> = web.iter().map(String::as_str).collect();
    let (v4, v6) = (host(ALLOWED4), host(ALLOWED6));
    let rules = [
        rule("web", Protocol::Tcp, &[8080], &web),
        rule("dns", Protocol::Udp, &[5353], &[&v4, &v6]),
        rule("ping", Protocol::Icmp, &[], &[&v4]),
        rule("ping", Protocol::Icmpv6, &[], &[&v6]),
    ];
    WorkloadPolicy::new(version, mode.parse().expect("test mode"), rules).expect("test policy")
}

/// The probes of the enforcement and simulation tests, with the enforcement outcome.
pub fn matrix() -> Vec<(Probe, bool)> {
    vec![
        (tcp(ALLOWED4, HOST4, 8080), true),
        (tcp(OTHER4, HOST4, 8080), false),   // disallowed source
        (tcp(ALLOWED4, HOST4, 8081), false), // disallowed port (something listens there)
        (udp(ALLOWED4, HOST4, 8080), false), // allowed port, wrong protocol
        (udp(ALLOWED4, HOST4, 5353), true),
        (udp(OTHER4, HOST4, 5353), false),
        (icmp(ALLOWED4, HOST4), true),
        (icmp(OTHER4, HOST4), false),
        (tcp(OTHER6, HOST6, 8080), false),
        (udp(ALLOWED6, HOST6, 5353), true),
        (icmp(ALLOWED6, HOST6), true),
        (icmp(OTHER6, HOST6), false),
    ]
}

fn kernel_status(ns: &NetNs, state: &Path) -> StatusReport {
    ns.enter(|| status(state)).expect("status")
}

#[test]
fn netns_enforcement_allows_and_drops() {
    let pair = Pair::new("enf");
    let _server = Server::start(&pair.host, &[8080, 8081], &[8080, 5353]);
    let state = TempDir::new("enf");
    let applied = pair.host.enter(|| {
        let mut store = LinuxPolicyStore::new(&state.0);
        store.apply(&policy(1, "enforcement", &[ALLOWED4, ALLOWED6]))
    });
    assert_eq!(applied.expect("apply"), Installed::Full);

    // IPv6 first, with empty neighbour caches: neighbour discovery must pass the host's chain.
    pair.flush_neighbours();
    let first = probe_with_timeout(&pair.client, &[tcp(ALLOWED6, HOST6, 8080)], 3.0);
    assert_eq!(first, [true], "IPv6 with neighbour discovery through the enforcing chain");
    expect_reach(&pair.host, &pair.client, &matrix());

    let report = kernel_status(&pair.host, &state.0);
    assert_eq!(report.kernel_matches_persisted, Some(true), "{report:?}");
    let hits = |id: &str| report.rules.iter().find(|r| r.rule == id).map(|r| r.packets).unwrap_or(0);
    assert!(hits("web/tcp") >= 2, "web/tcp counted the v4 and v6 connections: {report:?}");
    assert!(hits("dns/udp") >= 2 && hits("ping/icmp") >= 1 && hits("ping/icmpv6") >= 1, "{report:?}");
    assert!(report.dropped.expect("enforcement counts drops").packets >= 7, "{report:?}");
    assert!(report.would_block.is_none());
}

#[test]
fn netns_simulation_counts_would_block() {
    let pair = Pair::new("sim");
    let _server = Server::start(&pair.host, &[8080, 8081], &[8080, 5353]);
    let state = TempDir::new("sim");
    pair.host
        .enter(|| LinuxPolicyStore::new(&state.0).apply(&policy(1, "simulation", &[ALLOWED4, ALLOWED6])))
        .expect("apply");
    let matrix = matrix();
    let disallowed = matrix.iter().filter(|(_, pass)| !pass).count() as u64;
    let everything_passes: Vec<(Probe, bool)> = matrix.iter().map(|(p, _)| (*p, true)).collect();
    expect_reach(&pair.host, &pair.client, &everything_passes);

    let report = kernel_status(&pair.host, &state.0);
    let would_block = report.would_block.expect("simulation counts would-block");
    assert_eq!(would_block.packets, disallowed, "exactly the disallowed attempts: {report:?}");
    assert!(report.dropped.is_none());
    assert_eq!(report.mode.as_deref(), Some("simulation"));
    // The connections it would have blocked carry the would-block conntrack mark.
    let marked = pair.host.nft(&["list", "chain", "inet", "innerwall", "input"]);
    assert!(marked.contains("ct mark set ct mark | 0x01000000"), "{marked}");
}

/// Staged rules (FLOW-10) in the kernel: each is counted before the enforced rules and acts on
/// nothing — a staged narrowing leaves what the rules admit admitted, a staged new rule admits
/// nothing — and the next version without them takes them out.
#[test]
fn netns_staged_rules_count_without_acting() {
    use innerwall_wire::policy::Staged;
    let pair = Pair::new("stg");
    let _server = Server::start(&pair.host, &[8080, 8081], &[]);
    let state = TempDir::new("stg");
    let narrowed = rule("web", Protocol::Tcp, &[8080], &[&format!("{ALLOWED6}/128")]);
    let new = rule("extra", Protocol::Tcp, &[8081], &[&format!("{OTHER4}/32")]);
    let staged = Staged::new("rs.web:2", [narrowed, new], []).unwrap();
    let enforced = policy(1, "enforcement", &[ALLOWED4, ALLOWED6]).with_staged(Some(staged));
    pair.host.enter(|| LinuxPolicyStore::new(&state.0).apply(&enforced)).expect("apply");
    expect_reach(
        &pair.host,
        &pair.client,
        &[
            (tcp(ALLOWED4, HOST4, 8080), true), // staged away, still enforced-allowed
            (tcp(ALLOWED6, HOST6, 8080), true),
            (tcp(OTHER4, HOST4, 8081), false), // staged in, not admitted yet
        ],
    );
    let report = kernel_status(&pair.host, &state.0);
    assert_eq!(report.kernel_matches_persisted, Some(true), "{report:?}");
    assert_eq!(report.staged_set, Some(("rs.web:2".to_owned(), 2)));
    assert!(report.render().contains("staged set:       rs.web:2: 2 rule(s)"), "{}", report.render());
    let hits = |id: &str| report.rules.iter().find(|r| r.rule == id).map(|r| r.packets).unwrap_or(0);
    assert!(hits("staged:web/tcp") >= 1, "the narrowed rule counted the v6 peer it keeps: {report:?}");
    assert!(hits("staged:extra/tcp") >= 1, "the new rule counted the attempt it would admit: {report:?}");
    assert!(hits("web/tcp") >= 2, "{report:?}");
    assert!(report.dropped.expect("the terminal drop").packets >= 1, "{report:?}");
    let listed = pair.host.nft(&["list", "chain", "inet", "innerwall", "input"]);
    let staged_lines: Vec<&str> = listed.lines().filter(|l| l.contains("staged:")).collect();
    assert!(!staged_lines.is_empty() && staged_lines.iter().all(|l| !l.contains("accept")), "{listed}");

    // The second version drops the staged set: its counters leave the table.
    let next = policy(2, "enforcement", &[ALLOWED4, ALLOWED6]);
    pair.host
        .enter(|| {
            let mut store = LinuxPolicyStore::new(&state.0);
            store.restore_persisted().expect("restore");
            store.apply(&next)
        })
        .expect("apply");
    assert!(!pair.host.nft(&["list", "chain", "inet", "innerwall", "input"]).contains("staged:"));
    assert_eq!(kernel_status(&pair.host, &state.0).kernel_matches_persisted, Some(true));
}

#[test]
fn netns_peer_delta_without_rebuild() {
    let pair = Pair::new("delta");
    let _server = Server::start(&pair.host, &[8080], &[]);
    let state = TempDir::new("delta");
    let v1 = policy(1, "enforcement", &[OTHER4, "192.0.2.0/24"]);
    let v2 = policy(2, "enforcement", &[ALLOWED4, "192.0.2.0/24", "198.51.100.0/24"]);
    let v3 = policy(3, "enforcement", &["192.0.2.0/24"]);
    pair.host.enter(|| {
        let mut store = LinuxPolicyStore::new(&state.0);
        assert_eq!(store.apply(&v1).expect("v1"), Installed::Full);
        expect_reach(
            &pair.host,
            &pair.client,
            &[(tcp(ALLOWED4, HOST4, 8080), false), (tcp(OTHER4, HOST4, 8080), true)],
        );
        let before = state::read_table().expect("read").expect("table");

        // Peer-only: one element batch; the table, its chain and rules (handles) stay.
        let how = store.apply(&v2).expect("v2");
        assert!(matches!(how, Installed::Elements { .. }), "{how:?}");
        let after = state::read_table().expect("read").expect("table");
        let handles = |s: &state::TableState| s.rules.iter().map(|r| r.handle).collect::<Vec<_>>();
        assert_eq!(handles(&before), handles(&after), "no rule was re-created");
        let web_v4 = DesiredTable::from_policy(&v2)
            .sets
            .into_iter()
            .find(|s| s.name.ends_with("_v4") && s.intervals.len() == 3);
        assert!(web_v4.is_some(), "v2's web set holds three merged intervals");
        assert!(after.differences(&nft::expected_state(&DesiredTable::from_policy(&v2))).is_empty());
        expect_reach(
            &pair.host,
            &pair.client,
            &[(tcp(ALLOWED4, HOST4, 8080), true), (tcp(OTHER4, HOST4, 8080), false)],
        );

        // The kernel refuses an element delete that is not installed (someone removed it):
        // the store falls back to a full replace and still ends exactly at v3.
        let set = after.sets.iter().find(|s| s.elements.len() >= 5).expect("web v4 set").name.clone();
        pair.host.nft(&["delete", "element", "inet", "innerwall", &set, &format!("{{ {ALLOWED4} }}")]);
        let how = store.apply(&v3).expect("v3");
        assert_eq!(how, Installed::FullAfterRefusedElements);
        let now = state::read_table().expect("read").expect("table");
        assert!(now.differences(&nft::expected_state(&DesiredTable::from_policy(&v3))).is_empty());
        assert_eq!(store.current(), Some(&v3));
    });
    expect_reach(&pair.host, &pair.client, &[(tcp(ALLOWED4, HOST4, 8080), false)]);
}

#[test]
fn netns_failed_batch_is_atomic() {
    let ns = NetNs::new("atomic");
    let state = TempDir::new("atomic");
    let v1 = policy(1, "enforcement", &[ALLOWED4]);
    let v2 = policy(2, "simulation", &[ALLOWED4, OTHER4]);
    ns.enter(|| {
        let mut store = LinuxPolicyStore::new(&state.0);
        store.apply(&v1).expect("v1");
        let before = ns.nft(&["-a", "list", "table", "inet", "innerwall"]);
        let persisted = fs::read(PersistedPolicy::new(&state.0).path()).expect("persisted v1");

        store.inject_fault_in_next_full_replace();
        let err = store.apply(&v2).expect_err("the kernel refuses the faulty batch").to_string();
        assert!(err.contains("No such file or directory"), "{err}");
        assert!(err.contains("add rule"), "names the refused message: {err}");

        let after = ns.nft(&["-a", "list", "table", "inet", "innerwall"]);
        assert_eq!(before, after, "the previous table is byte-identical");
        assert_eq!(
            fs::read(PersistedPolicy::new(&state.0).path()).expect("persisted"),
            persisted,
            "v1 stays persisted"
        );
        assert_eq!(store.current(), Some(&v1));

        // Without the fault the same policy installs.
        assert_eq!(store.apply(&v2).expect("v2"), Installed::Full);
    });
}

/// An agent process in a namespace with its log captured to a file.
struct Agent {
    child: Child,
    log: std::path::PathBuf,
}

impl Agent {
    fn start(ns: &NetNs, state: &Path, log: &Path) -> Agent {
        let file = fs::File::create(log).expect("log file");
        let child = ns
            .command(AGENT)
            .args(["run", "--state-dir"])
            .arg(state)
            .args(["--server", "127.0.0.1:9", "--drift-interval-ms", "200"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("starting innerwall-agent run");
        Agent { child, log: log.to_path_buf() }
    }

    fn log(&self) -> String {
        let mut text = String::new();
        let _ = fs::File::open(&self.log).and_then(|mut f| f.read_to_string(&mut text));
        text
    }

    fn wait_log(&self, needle: &str) -> String {
        wait_for(Duration::from_secs(10), needle, || {
            let text = self.log();
            text.contains(needle).then_some(text)
        })
    }

    fn kill9(mut self) {
        self.child.kill().expect("SIGKILL by pid");
        self.child.wait().expect("reaped");
    }

    fn stop(mut self) {
        let pid = self.child.id().to_string();
        run(Command::new("kill").args(["-TERM", &pid]));
        self.child.wait().expect("reaped");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn apply_file(ns: &NetNs, state: &Path, policy: &WorkloadPolicy, dir: &Path) -> String {
    let file = dir.join(format!("policy-v{}.json", policy.version()));
    let json = serde_json::to_string(&policy_json::PolicyJson::from_policy(policy)).expect("json");
    fs::write(&file, json).expect("JSON policy file");
    let out = run(ns.command(AGENT).arg("apply-file").arg(&file).arg("--state-dir").arg(state));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn netns_fail_static_on_restart() {
    let pair = Pair::new("static");
    let _server = Server::start(&pair.host, &[8080], &[]);
    let state = TempDir::new("static");
    let enforced = [(tcp(ALLOWED4, HOST4, 8080), true), (tcp(OTHER4, HOST4, 8080), false)];
    let out =
        apply_file(&pair.host, &state.0.join("state"), &policy(5, "enforcement", &[ALLOWED4]), &state.0);
    assert!(out.contains("applied policy v5"), "{out}");

    // The agent dies hard: the rules stay.
    let agent = Agent::start(&pair.host, &state.0.join("state"), &state.0.join("agent1.log"));
    agent.wait_log("dial attempt 1 to 127.0.0.1:9 failed");
    agent.kill9();
    expect_reach(&pair.host, &pair.client, &enforced);

    // The kernel loses the table (as after a reboot); a restarted agent with the control plane
    // unreachable installs the persisted policy before its first dial.
    pair.host.nft(&["delete", "table", "inet", "innerwall"]);
    expect_reach(&pair.host, &pair.client, &[(tcp(OTHER4, HOST4, 8080), true)]);
    let mut agent = Agent::start(&pair.host, &state.0.join("state"), &state.0.join("agent2.log"));
    let log = agent.wait_log("dial attempt 2 to 127.0.0.1:9 failed");
    let restored = log.find("re-applied persisted policy v5 before dialing").expect("restore logged");
    let first_dial = log.find("dial attempt 1").expect("dial logged");
    assert!(restored < first_dial, "restore precedes the first dial:\n{log}");
    assert!(agent.child.try_wait().expect("status").is_none(), "still retrying");
    let table = pair.host.nft(&["list", "table", "inet", "innerwall"]);
    assert!(
        table.contains("comment \"web/tcp\"") && table.contains("drop comment \"innerwall:drop\""),
        "{table}"
    );
    expect_reach(&pair.host, &pair.client, &enforced);

    // A clean stop leaves the rules in place too.
    agent.stop();
    expect_reach(&pair.host, &pair.client, &enforced);
}

#[test]
fn netns_kill_switch_only_our_table() {
    let ns = NetNs::new("kill");
    let state = TempDir::new("kill");
    ns.nft(&["add", "table", "inet", "other"]);
    ns.nft(&["add", "chain", "inet", "other", "c", "{ type filter hook input priority 10; policy accept; }"]);
    ns.nft(&["add", "rule", "inet", "other", "c", "tcp", "dport", "22", "counter", "accept"]);
    ns.nft(&["add", "table", "ip", "innerwall"]); // same name, other family: not ours
    let foreign =
        || (ns.nft(&["-a", "list", "table", "inet", "other"]), ns.nft(&["list", "table", "ip", "innerwall"]));
    let foreign_before = foreign();

    let mut store = ns.enter(|| {
        let mut store = LinuxPolicyStore::new(&state.0);
        store.apply(&policy(4, "enforcement", &[ALLOWED4])).expect("apply");
        store
    });
    let persisted = fs::read(PersistedPolicy::new(&state.0).path()).expect("persisted");

    let out = run(ns.command(AGENT).args(["down", "--state-dir"]).arg(&state.0));
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("removed table inet innerwall"), "{out}");
    assert!(out.contains("kept the persisted policy v4"), "{out}");

    let tables = ns.nft(&["list", "tables"]);
    assert!(!tables.contains("table inet innerwall"), "{tables}");
    assert_eq!(foreign(), foreign_before, "foreign tables untouched");
    assert_eq!(fs::read(PersistedPolicy::new(&state.0).path()).expect("persisted"), persisted, "policy kept");

    // A running agent does not undo the kill switch as if it were drift, and holds what
    // arrives (persisted, not installed)…
    let event = ns.enter(|| store.check_drift(SystemTime::now())).expect("drift check");
    assert_eq!(event, None);
    assert!(store.suspended());
    let v5 = policy(5, "enforcement", &[ALLOWED4, "10.77.9.9"]);
    assert_eq!(ns.enter(|| store.apply(&v5)).expect("apply while down"), Installed::Held);
    assert_eq!(store.applied_version(), 5);
    assert_eq!(PersistedPolicy::new(&state.0).load().expect("load").map(|p| p.version()), Some(5));
    assert!(!ns.nft(&["list", "tables"]).contains("table inet innerwall"));
    // …and so does the next start.
    let restored = ns.enter(|| LinuxPolicyStore::new(&state.0).restore_persisted()).expect("restore");
    assert_eq!(restored, Restored::Suspended { version: 5 });
    assert!(!ns.nft(&["list", "tables"]).contains("table inet innerwall"));

    // `up` installs the held policy; the running store resumes without calling it drift.
    let out = run(ns.command(AGENT).args(["up", "--state-dir"]).arg(&state.0));
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.contains("installed the persisted policy v5") && out.contains("kill switch released"),
        "{out}"
    );
    assert!(ns.nft(&["list", "table", "inet", "innerwall"]).contains("10.77.9.9"), "v5 is installed");
    assert!(!store.suspended());
    assert_eq!(ns.enter(|| store.check_drift(SystemTime::now())).expect("resume"), None, "not drift");
    ns.nft(&["delete", "table", "inet", "innerwall"]);
    let event = ns.enter(|| store.check_drift(SystemTime::now())).expect("drift check");
    assert!(event.is_some_and(|e| e.detail.contains("missing")), "drift repair is back on");
    assert_eq!(foreign(), foreign_before);
    let out = run(ns.command(AGENT).args(["up", "--state-dir"]).arg(&state.0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("was not engaged"));

    // Down twice says there was nothing to remove.
    run(ns.command(AGENT).args(["down", "--state-dir"]).arg(&state.0));
    let out = run(ns.command(AGENT).args(["down", "--state-dir"]).arg(&state.0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("was not present"));
}

#[test]
fn netns_drift_is_repaired() {
    let pair = Pair::new("drift");
    let _server = Server::start(&pair.host, &[8080, 22], &[]);
    let state = TempDir::new("drift");
    let v1 = policy(1, "enforcement", &[ALLOWED4]);
    pair.host.enter(|| {
        let mut store = LinuxPolicyStore::new(&state.0);
        store.apply(&v1).expect("apply");
        let now = SystemTime::now();
        assert_eq!(store.check_drift(now).expect("check"), None, "our own install is not drift");
        let comparisons = store.full_comparisons();
        assert_eq!(store.check_drift(now).expect("check"), None);
        assert_eq!(store.full_comparisons(), comparisons, "unchanged generation: no readback");

        // A change elsewhere moves the generation but is not drift.
        pair.host.nft(&["add", "table", "inet", "bystander"]);
        assert_eq!(store.check_drift(now).expect("check"), None);
        assert_eq!(store.full_comparisons(), comparisons + 1, "generation moved: one comparison");

        // Outside edits to our table are reverted and reported.
        let edits: [(&[&str], &str); 4] = [
            (
                &["insert", "rule", "inet", "innerwall", "input", "tcp", "dport", "22", "accept"],
                "rules differ",
            ),
            (
                &["delete", "element", "inet", "innerwall", "r3_v4", "{ 10.77.0.2 }"],
                "set r3_v4: 2 element(s) missing",
            ),
            (
                &["add", "element", "inet", "innerwall", "r3_v4", "{ 10.77.0.3 }"],
                "set r3_v4: 0 element(s) missing, 2 unexpected",
            ),
            (&["flush", "table", "inet", "innerwall"], "rules differ"),
        ];
        for (edit, expected) in edits {
            let pristine = pair.host.nft(&["list", "table", "inet", "innerwall"]);
            pair.host.nft(edit);
            let event =
                store.check_drift(now).expect("check").unwrap_or_else(|| panic!("{edit:?} not detected"));
            assert!(event.detail.contains(expected), "{edit:?}: {}", event.detail);
            assert_eq!(event.at, now);
            let repaired = state::read_table().expect("read").expect("table restored");
            assert!(repaired.differences(&nft::expected_state(&DesiredTable::from_policy(&v1))).is_empty());
            let strip = |t: &str| t.lines().filter(|l| !l.contains("counter")).collect::<Vec<_>>().join("\n");
            assert_eq!(strip(&pair.host.nft(&["list", "table", "inet", "innerwall"])), strip(&pristine));
            assert_eq!(store.check_drift(now).expect("check"), None, "repaired state is not drift");
        }
        pair.host.nft(&["delete", "table", "inet", "innerwall"]);
        let event = store.check_drift(now).expect("check").expect("a deleted table is drift");
        assert!(event.detail.contains("missing"), "{}", event.detail);
    });
    expect_reach(
        &pair.host,
        &pair.client,
        &[(tcp(ALLOWED4, HOST4, 8080), true), (tcp(ALLOWED4, HOST4, 22), false)],
    );

    // The running agent repairs on its timer and logs it.
    let agent = Agent::start(&pair.host, &state.0, &state.0.join("agent.log"));
    agent.wait_log("re-applied persisted policy v1");
    pair.host.nft(&["insert", "rule", "inet", "innerwall", "input", "tcp", "dport", "22", "accept"]);
    agent.wait_log("repaired drift of table inet innerwall");
    expect_reach(&pair.host, &pair.client, &[(tcp(ALLOWED4, HOST4, 22), false)]);
    agent.stop();
}
