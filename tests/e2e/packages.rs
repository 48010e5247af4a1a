//! The Debian packages (issue 32, RUN-4), installed with dpkg and run from their installed
//! paths with their installed configuration files: a control plane with its embedded database
//! as the `innerwall` user, an agent whose eBPF object is built into its binary (no object file
//! exists on this host), a host that enforces and records the flows it blocks; removing the
//! agent's package keeps the table, purging both removes the table and the state.
//!
//! The machine stays untouched: dpkg and everything installed run in a mount namespace whose
//! /etc, /usr and /var are overlays on the machine's own (writes land in the test's directory
//! and vanish with it), and the processes in a network namespace of their own. `cargo xtask
//! test` builds the packages (debug binaries, the same packaging) into target/packages.
//!
//! An upgrade (issue 32, item 5): the previous release's agent package (target/previous, see
//! tests/fixtures/previous-release) installed and enforcing, upgraded with dpkg to this one
//! while real packets stream from outside; not one blocked datagram arrives.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::host::{Namespace, Peer, require_root};

/// A process holding a private mount namespace with /etc, /usr and /var overlaid.
struct Sandbox {
    holder: Child,
    dir: PathBuf,
}

impl Sandbox {
    fn create(dir: &Path) -> Sandbox {
        std::fs::create_dir_all(dir).unwrap();
        let holder = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sleep", "infinity"])
            .spawn()
            .expect("unshare");
        let sandbox = Sandbox { holder, dir: dir.to_owned() };
        // The holder is in its namespace once its mnt link differs from ours.
        let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(format!("/proc/{}/ns/mnt", sandbox.pid())).ok().as_ref() == Some(&ours) {
            assert!(Instant::now() < deadline, "unshare never entered its mount namespace");
            std::thread::yield_now();
        }
        for top in ["etc", "usr", "var"] {
            let (upper, work) = (dir.join("upper").join(top), dir.join("work").join(top));
            std::fs::create_dir_all(&upper).unwrap();
            std::fs::create_dir_all(&work).unwrap();
            let options = format!("lowerdir=/{top},upperdir={},workdir={}", upper.display(), work.display());
            sandbox.ok(&["mount", "-t", "overlay", "overlay", "-o", &options, &format!("/{top}")]);
        }
        sandbox
    }

    fn pid(&self) -> String {
        self.holder.id().to_string()
    }

    /// `args` inside the mount namespace (and, with `netns`, that network namespace too).
    fn command(&self, netns: Option<&str>, args: &[&str]) -> Command {
        let mut command = Command::new("nsenter");
        command.args(["-t", &self.pid(), "-m"]);
        if let Some(netns) = netns {
            // Opened here, before nsenter enters the mount namespace.
            command.arg(format!("--net=/run/netns/{netns}"));
        }
        command.arg("--").args(args);
        command
    }

    fn run_in(&self, netns: Option<&str>, args: &[&str]) -> Output {
        self.command(netns, args).output().expect("nsenter")
    }

    /// Runs `args` and returns its stdout; panics with its stderr unless it succeeded.
    fn ok_in(&self, netns: Option<&str>, args: &[&str]) -> String {
        let out = self.run_in(netns, args);
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(out.status.success(), "{args:?}: {}{}", text(&out.stdout), text(&out.stderr));
        text(&out.stdout)
    }

    fn ok(&self, args: &[&str]) -> String {
        self.ok_in(None, args)
    }

    /// Writes `text` to `path` as the sandbox sees it.
    fn write(&self, path: &str, text: &str) {
        let mut child = self
            .command(None, &["sh", "-c", &format!("cat > {path}")])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "writing {path}");
    }

    /// Whether `path` exists as the sandbox sees it.
    fn exists(&self, path: &str) -> bool {
        self.run_in(None, &["test", "-e", path]).status.success()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // An embedded postmaster a failed run left behind, stopped by its PID.
        let pidfile = self.dir.join("upper/var/lib/innerwall/postgres/data/postmaster.pid");
        if let Some(pid) =
            std::fs::read_to_string(pidfile).ok().and_then(|t| t.lines().next()?.trim().parse().ok())
        {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT);
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A process started in the sandbox, killed by its PID on drop.
struct Running(Child);

impl Running {
    /// SIGTERM, and its exit within 60 s (`serve` stops its embedded database on the way).
    fn terminate(mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.0.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "not stopped within 60 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The packages `cargo xtask test` built.
fn packages() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/packages");
    let find = |prefix: &str| {
        std::fs::read_dir(&dir)
            .ok()
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix)))
            .unwrap_or_else(|| {
                panic!(
                    "no {prefix}*.deb in {}: `cargo xtask test` builds them (or `cargo xtask package --dev`)",
                    dir.display()
                )
            })
    };
    (find("innerwall_"), find("innerwall-agent_"))
}

/// Polls `check` (every 200 ms) until it returns something, for at most `secs` seconds; the
/// logs under `dir` are in the failure.
fn wait_for<T>(what: &str, secs: u64, dir: &Path, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(found) = check() {
            return found;
        }
        if Instant::now() > deadline {
            let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            panic!("{what}: not within {secs} s\nserve:\n{}\nagent:\n{}", log("serve.log"), log("agent.log"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn packages_install_and_enforce() {
    require_root();
    let (control_plane, agent) = packages();
    let dir = std::env::temp_dir().join(format!("iw-packages-{}", std::process::id()));
    let sandbox = Sandbox::create(&dir);
    let netns = format!("iw-pkg-{}", std::process::id());
    let ns = Namespace::create(netns.clone());
    let peer = Peer::create(&ns);
    let netns = Some(netns.as_str());

    // Install: binaries, units, conffiles, the system user and the state directories.
    sandbox.ok(&["dpkg", "-i", control_plane.to_str().unwrap(), agent.to_str().unwrap()]);
    assert!(!Path::new("/usr/bin/innerwall-agent").exists(), "the machine itself is untouched");
    let stat = |path: &str| sandbox.ok(&["stat", "-c", "%a %U %G", path]).trim().to_owned();
    assert_eq!(stat("/var/lib/innerwall"), "700 innerwall innerwall");
    assert_eq!(stat("/var/lib/innerwall-agent"), "700 root root");
    assert_eq!(stat("/etc/innerwall/innerwall.toml"), "640 root innerwall");
    for unit in ["innerwall.service", "innerwall-agent.service"] {
        assert!(sandbox.exists(&format!("/lib/systemd/system/{unit}")), "{unit} installed");
        assert!(
            sandbox.exists(&format!("/etc/systemd/system/multi-user.target.wants/{unit}")),
            "{unit} enabled"
        );
    }
    assert!(
        !sandbox.exists("/usr/bin/bpf") && !sandbox.exists("/usr/bpf"),
        "no eBPF object file is installed"
    );

    // The installed configuration files, edited as an operator would, and checked.
    let write = |path: &str, text: &str| sandbox.write(path, text);
    write(
        "/etc/innerwall/innerwall.toml",
        "listen = \"127.0.0.1:7443\"\nserver-name = [\"localhost\"]\nflow-window = \"2s\"\nheartbeat-interval = \"2s\"\n",
    );
    write("/etc/innerwall/agent.toml", "server = \"localhost:7443\"\n");
    let as_innerwall =
        ["setpriv", "--reuid=innerwall", "--regid=innerwall", "--init-groups", "/usr/bin/innerwall"];
    let innerwall = |args: &[&str]| {
        let mut all = as_innerwall.to_vec();
        all.extend(args);
        sandbox.ok_in(netns, &all)
    };
    assert!(innerwall(&["config", "check"]).contains("ok: /etc/innerwall/innerwall.toml"));
    assert!(
        sandbox
            .ok(&["/usr/bin/innerwall-agent", "config", "check"])
            .contains("ok: /etc/innerwall/agent.toml")
    );

    // The control plane, as its unit runs it: the innerwall user, the embedded database.
    innerwall(&["ca", "init"]);
    let log = dir.join("serve.log");
    let mut serve_args = as_innerwall.to_vec();
    serve_args.extend(["serve", "--state-dir", "/var/lib/innerwall"]);
    let serve = Running(
        sandbox
            .command(netns, &serve_args)
            .env("INNERWALL_LOG", "info")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for("serve listening", 120, &dir, || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("listening on 127.0.0.1:7443")
            .then_some(())
    });
    innerwall(&["service", "create", "ssh", "--entry", "tcp:22"]);
    let ruleset = "name: web\nscope: {app: [web]}\nrules:\n  - name: ssh\n    peers:\n      - cidr: 192.0.2.0/24\n    services: [ssh]\n";
    write("/var/lib/innerwall/web.yaml", ruleset);
    sandbox.ok(&["chown", "innerwall", "/var/lib/innerwall/web.yaml"]);
    innerwall(&["ruleset", "create", "-f", "/var/lib/innerwall/web.yaml"]);
    let minted = innerwall(&["--json", "token", "mint", "--label", "app=web"]);
    let minted: serde_json::Value = serde_json::from_str(&minted).unwrap_or_else(|e| panic!("{e}: {minted}"));
    let token = minted["token"].as_str().unwrap_or_else(|| panic!("{minted}"));
    write("/var/lib/innerwall-agent/enroll-token", token);

    // The agent enrolls and runs from its installed path with its installed file.
    sandbox.ok_in(
        netns,
        &[
            "/usr/bin/innerwall-agent",
            "enroll",
            "--token-file",
            "/var/lib/innerwall-agent/enroll-token",
            "--ca-bundle",
            "/var/lib/innerwall/ca/ca.crt",
        ],
    );
    let agent_log = dir.join("agent.log");
    let agent_run = Running(
        sandbox
            .command(netns, &["/usr/bin/innerwall-agent", "run"])
            .stderr(std::fs::File::create(&agent_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let workloads: serde_json::Value =
        serde_json::from_str(&innerwall(&["--json", "workload", "list"])).unwrap();
    let id = workloads[0]["id"].as_str().unwrap_or_else(|| panic!("{workloads}")).to_owned();
    innerwall(&["workload", "mode", &id, "enforcement", "--override", "the package test"]);
    let table = wait_for("an enforced table", 60, &dir, || {
        let out = sandbox.run_in(netns, &["nft", "list", "table", "inet", "innerwall"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success()
            && text.contains("drop comment \"innerwall:drop\"")
            && text.contains("192.0.2.0/24"))
        .then_some(text)
    });
    assert!(table.contains("dport 22"), "{table}");

    // Real packets from outside: blocked, and recorded by the embedded capture program.
    let blocked = wait_for("blocked flows recorded", 90, &dir, || {
        peer.send_udp(5353, 3);
        let out = innerwall(&["--json", "flows", "list", "--workload", &id, "--since", "1h"]);
        let rows: serde_json::Value = serde_json::from_str(&out).ok()?;
        rows.as_array()?.iter().find(|r| r["dst_port"] == 5353).cloned()
    });
    // FLOW_DECISION_BLOCKED, decided under the enforced version.
    assert_eq!(blocked["decision"], 4, "{blocked}");
    assert_eq!(blocked["src_address"], "10.81.0.2", "{blocked}");
    assert!(
        !std::fs::read_to_string(&agent_log).unwrap().contains("eBPF object"),
        "the capture loaded without any object file"
    );

    // Removing the agent's package stops nothing here (no systemd) and keeps the table;
    // purging both removes it and the state.
    agent_run.terminate();
    serve.terminate();
    // The embedded cluster outlives `serve` by design (its unit's stop ends the whole control
    // group); without systemd, the package's removal stops it before the purge deletes it.
    let postmaster = sandbox.ok(&["head", "-1", "/var/lib/innerwall/postgres/data/postmaster.pid"]);
    let postmaster = nix::unistd::Pid::from_raw(postmaster.trim().parse().unwrap());
    assert!(Path::new(&format!("/proc/{postmaster}")).exists(), "the embedded cluster runs after serve");
    sandbox.ok_in(netns, &["dpkg", "--remove", "innerwall-agent"]);
    assert!(
        sandbox.run_in(netns, &["nft", "list", "table", "inet", "innerwall"]).status.success(),
        "remove keeps the table"
    );
    assert!(sandbox.exists("/var/lib/innerwall-agent"), "remove keeps the state");
    sandbox.ok_in(netns, &["dpkg", "--purge", "innerwall-agent", "innerwall"]);
    assert!(
        !Path::new(&format!("/proc/{postmaster}")).exists(),
        "the purge left the embedded cluster running"
    );
    assert!(
        !sandbox.run_in(netns, &["nft", "list", "table", "inet", "innerwall"]).status.success(),
        "purge removes the table"
    );
    for gone in ["/var/lib/innerwall-agent", "/var/lib/innerwall", "/etc/innerwall", "/usr/bin/innerwall"] {
        assert!(!sandbox.exists(gone), "{gone} is left after purge");
    }
}

/// The previous release's agent package (built by `cargo xtask test` from the commit
/// tests/fixtures/previous-release pins) is installed, enrolled and enforcing; real packets
/// stream from outside throughout — one to a blocked port and one to an allowed port every
/// millisecond — while `dpkg -i` upgrades it to this tree's package (the real maintainer
/// scripts: the old prerm and postrm, the new postinst), and while the running agent is
/// restarted as the unit's service manager would: SIGTERM to the old process, then the
/// installed unit's ExecStart (`/usr/bin/innerwall-agent run`, the new binary). Not one blocked
/// datagram arrives at any point; allowed ones arrive in every phase (dpkg, the old agent
/// stopping, no agent at all, the new agent starting, after); the new agent finds the table in
/// place, and the control plane records it SYNCED at the same version.
///
/// No systemd runs here (not PID 1), so the scripts' systemd branch (`try-restart`) does
/// nothing; the test asserts the old agent kept running through dpkg, then plays the service
/// manager's part itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_upgrade_keeps_enforcing() {
    use crate::previous::{PeerEstate, Stream, drop_counter, previous_agent_package};
    use innerwall_control_plane::identity::ca::Signer as _;
    use innerwall_wire::identity::WorkloadId;
    use innerwall_wire::policy::Mode;

    require_root();
    let previous = previous_agent_package();
    let short = crate::previous::previous_release().0[..12].to_owned();
    let (_, current) = packages();
    let dir = std::env::temp_dir().join(format!("iw-upgrade-{}", std::process::id()));
    let sandbox = Sandbox::create(&dir);
    let PeerEstate { plane, netns, ns: _ns, peer, peer_netns } = PeerEstate::start("iw-upg", "allowed").await;
    let pool = plane.pool().clone();
    let installed_version = || sandbox.ok(&["dpkg-query", "-W", "-f=${Version}", "innerwall-agent"]);

    // The previous release, installed, enrolled and enforcing.
    sandbox.ok(&["dpkg", "-i", previous.to_str().unwrap()]);
    let old_version = installed_version();
    assert!(old_version.ends_with(&format!("~prev.{short}")), "installed {old_version}");
    sandbox.write("/etc/innerwall/agent.toml", &format!("server = \"{}\"\n", plane.server()));
    let (ca, token) = (dir.join("ca.pem"), dir.join("token"));
    std::fs::write(&ca, plane.signer.ca_bundle_pem()).unwrap();
    std::fs::write(&token, plane.mint(&["app=web"]).await).unwrap();
    let netns_opt = Some(netns.as_str());
    sandbox.ok_in(
        netns_opt,
        &[
            "/usr/bin/innerwall-agent",
            "enroll",
            "--token-file",
            token.to_str().unwrap(),
            "--ca-bundle",
            ca.to_str().unwrap(),
        ],
    );
    let (id, enrolled_as): (uuid::Uuid, String) =
        sqlx::query_as("SELECT id, agent_version FROM workloads WHERE hostname <> 'peer'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let id = WorkloadId::from_uuid(id).unwrap();
    assert!(enrolled_as.ends_with(&format!("-prev-{short}")), "enrolled by {enrolled_as}");
    plane.set_mode(id, Mode::Enforcement).await;
    let old_log = dir.join("agent.log");
    let mut old_agent = Running(
        sandbox
            .command(netns_opt, &["/usr/bin/innerwall-agent", "run"])
            .stderr(std::fs::File::create(&old_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let version = plane.status(id).await.2.expect("a rendered policy");
    plane.wait_synced(id, version).await;

    // Packets from outside from here on: 7001 blocked, 7000 allowed.
    let stream = Stream::start(&peer_netns, 7000, 7001);
    let before = stream.checkpoint("before the upgrade");

    // The upgrade, its maintainer scripts run in the host's network namespace (where the
    // table is). Without systemd they leave the running agent alone.
    let upgrade = sandbox
        .command(netns_opt, &["dpkg", "-i", "--force-confold", current.to_str().unwrap()])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(upgrade.status.success(), "dpkg -i: {}{}", text(&upgrade.stdout), text(&upgrade.stderr));
    let new_version = installed_version();
    assert_eq!(new_version, env!("CARGO_PKG_VERSION"), "upgraded from {old_version}");
    assert!(old_agent.0.try_wait().unwrap().is_none(), "the old agent stopped during dpkg (no systemd here)");
    let upgraded = stream.checkpoint("during dpkg -i");

    // The restart systemd's try-restart makes: stop (SIGTERM, the unit's KillSignal) ...
    let stopped_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await.unwrap();
    old_agent.terminate();
    let stopped = stream.checkpoint("while the old agent stopped");
    // A while with no agent at all: 200 more allowed datagrams, and the blocked ones between.
    stream.wait_arrivals(stopped, 200, "with no agent running");
    assert!(
        sandbox.run_in(netns_opt, &["nft", "list", "table", "inet", "innerwall"]).status.success(),
        "the table stays when the agent stops"
    );
    // ... then start: the installed unit's ExecStart, the new binary from its installed path.
    let exec_start =
        sandbox.ok(&["sed", "-n", "s/^ExecStart=//p", "/lib/systemd/system/innerwall-agent.service"]);
    let exec_start: Vec<&str> = exec_start.split_whitespace().collect();
    assert_eq!(exec_start.first(), Some(&"/usr/bin/innerwall-agent"), "{exec_start:?}");
    let started = stream.checkpoint("with no agent running");
    let new_log = dir.join("agent-new.log");
    let new_agent = Running(
        sandbox
            .command(netns_opt, &exec_start)
            .stderr(std::fs::File::create(&new_log).unwrap())
            .spawn()
            .unwrap(),
    );
    // The new agent's own stream acked: SYNCED at the same version, acknowledged after the stop.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let acked: bool =
            sqlx::query_scalar("SELECT coalesce(last_acked_at > $1, false) FROM workloads WHERE id = $2")
                .bind(stopped_at)
                .bind(id.uuid())
                .fetch_one(&pool)
                .await
                .unwrap();
        let (state, applied, latest, _) = plane.status(id).await;
        if acked && state == "SYNCED" {
            assert_eq!(
                (applied, latest),
                (version, Some(version)),
                "the same policy version after the upgrade"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new agent never acked v{version}: {state} v{applied}\n{}",
            std::fs::read_to_string(&new_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let synced = stream.checkpoint("while the new agent started and synced");
    let exe = std::fs::read_link(format!("/proc/{}/exe", new_agent.0.id())).unwrap();
    assert_eq!(exe, Path::new("/usr/bin/innerwall-agent"), "the new agent runs the installed binary");
    let reported = sandbox.ok(&["/usr/bin/innerwall-agent", "--version"]);
    assert!(reported.contains(env!("CARGO_PKG_VERSION")) && !reported.contains("prev"), "{reported}");
    let new_log_text = std::fs::read_to_string(&new_log).unwrap();
    assert!(
        new_log_text.contains(&format!(
            "re-applied persisted policy v{version} before dialing (the kernel still held it)"
        )),
        "the new agent did not start from its persisted policy:\n{new_log_text}"
    );

    let (end, allowed, blocked) = stream.finish();
    assert!(
        blocked.is_empty(),
        "{} blocked datagrams got through during the upgrade (first sequence numbers: {:?})",
        blocked.len(),
        blocked
            .iter()
            .take(10)
            .map(|d| d.first_chunk::<8>().map(|b| u64::from_be_bytes(*b)))
            .collect::<Vec<_>>()
    );
    let phases = [
        ("dpkg -i", before, upgraded),
        ("the old agent stopping", upgraded, stopped),
        ("no agent", stopped, started),
        ("the new agent starting and syncing", started, synced),
        ("after", synced, end),
    ];
    for (phase, from, to) in phases {
        let n = allowed.iter().filter(|&&s| (from..to).contains(&s)).count();
        assert!(n > 0, "no allowed packet arrived during {phase} ({from}..{to})");
        println!("upgrade: {phase}: {} pairs sent, {n} allowed arrived, 0 blocked arrived", to - from);
    }
    // The blocked ones reached the table and its drop rule dropped them (at least those sent
    // after the new agent synced, whatever it did to the counters before).
    let dropped = drop_counter(&netns).expect("the table's drop rule");
    assert!(
        dropped >= end - synced,
        "the drop rule counted {dropped}, {} were sent after sync",
        end - synced
    );
    drop(new_agent);
    drop(peer);
}
