//! `cargo xtask demo` (RUN-3): the steps and the expectations they check: a control plane and
//! three agents in network namespaces on this machine, a sample policy, real traffic it allows
//! and blocks, and a relabel that converges. The network, the processes and the CLIs' JSON
//! live in the submodules.
//!
//! Everything the demo creates is named by one scheme (`iwdemo*` links and namespaces,
//! `/tmp/innerwall-demo-*` directories), torn down by a guard on every exit path, and found
//! again by exact name at the next start if a run was killed (Ctrl-C cannot run the guard:
//! xtask has no signal handler, and the children die with the terminal's SIGINT anyway).

// The control plane's test browser, shared as a file (it needs only std and serde_json): the
// demo uses part of it.
#[allow(dead_code, reason = "the demo drives only some of the browser's commands")]
#[path = "../../../control-plane/src/testing/browser.rs"]
mod browser;
mod cli;
mod network;
mod processes;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};

use self::browser::Browser;
use self::{
    cli::{AgentStatus, FlowRecord, MintedToken, RenderedPolicy, SyncStatus, VerdictJson, Workload},
    network::{BATCH, BRIDGE, DB, HOSTS, Host, WEB},
    processes::{POLL, Processes, capture},
};
use crate::cmd::root_cargo;
use crate::{cmd, setup};

const SERVER_NAME: &str = "10.77.0.1";
const SERVER: &str = "10.77.0.1:7443";
/// The operator API and console, on the bridge address the certificate names.
const CONSOLE: &str = "10.77.0.1:8443";
const DB_PORT: &str = "5432";
/// A port db's policy never allows: in enforcement its SYNs are dropped.
const OTHER_PORT: &str = "5433";
/// The evidence a verdict judges: the last 45 s, at least 10 s of it (a real estate would use
/// the default 24 h).
const EVIDENCE_SINCE: &str = "45s";
const MIN_EVIDENCE: &str = "10s";
const VERDICT_TIMEOUT: Duration = Duration::from_secs(90);
const DIR_PREFIX: &str = "innerwall-demo-";

const CLI_TIMEOUT: Duration = Duration::from_secs(30);
const SERVE_READY_TIMEOUT: Duration = Duration::from_secs(90);
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT_SECS: &str = "2";

/// `sh -c` program: set the hostname to `$0`, then run the rest of the arguments.
const SET_HOSTNAME: &str = "hostname \"$0\" && exec \"$@\"";

const RULESET_YAML: &str = "\
name: payments
scope: {app: [payments-db]}
rules:
  - name: from-web
    peers:
      - workloads: {app: [web]}
    services: [postgres]
";

/// The database stand-in: accepts, greets, closes; logs each peer so the demo can show them.
const LISTENER_PY: &str = "\
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print('listening', flush=True)
while True:
    c, peer = s.accept()
    print('accepted', peer[0], flush=True)
    c.sendall(b'hello from payments-db\\n')
    c.close()
";

/// One connection attempt: exit 0 connected, 2 timed out (dropped), 3 any other error.
const CLIENT_PY: &str = "\
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print('connected:', s.recv(64).decode().strip())
except TimeoutError:
    print('timed out'); sys.exit(2)
except OSError as e:
    print('error:', e); sys.exit(3)
";

pub fn run(root: &Path, keep: bool) -> Result<()> {
    let started = Instant::now();
    section("0", "Prepare", "packages, toolchain and the two release binaries");
    ensure_root()?;
    setup::all()?;
    // The agents capture flows with the eBPF object, loaded from target/bpf at run time.
    crate::ebpf::build(root)?;
    cmd::run(root_cargo(root).args([
        "build",
        "--release",
        "-p",
        "innerwall-control-plane",
        "-p",
        "innerwall-agent",
    ]))?;
    let release = target_dir(root).join("release");
    for binary in ["innerwall", "innerwall-agent"] {
        let path = release.join(binary);
        if !path.is_file() {
            bail!("{} is missing after the release build", path.display());
        }
    }

    let demo_started = Instant::now();
    clean_leftovers()?;
    let mut demo = Demo::create(release, target_dir(root).join("demo"))?;
    let result = demo.show();
    if keep && result.is_ok() {
        demo.hold();
    }
    demo.keep_dir = result.is_err();
    drop(demo);
    println!("\ndemo took {:.0?} ({:.0?} after the build)", started.elapsed(), demo_started.elapsed());
    result
}

/// The running demo; dropping it stops every process it started (by PID) and deletes the
/// namespaces, the bridge and, unless something failed, its directory.
#[derive(Debug)]
struct Demo {
    dir: PathBuf,
    release: PathBuf,
    procs: Processes,
    ids: BTreeMap<&'static str, String>,
    failures: Vec<String>,
    keep_dir: bool,
    /// Where the console's screenshots go (`target/demo/`).
    shots: PathBuf,
    /// The console's URL and an admin's operator token, once it is up.
    console: Option<(String, String)>,
}

impl Demo {
    fn create(release: PathBuf, shots: PathBuf) -> Result<Self> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{nanos:08x}", std::process::id()));
        fs::create_dir(&dir).with_context(|| format!("while creating {}", dir.display()))?;
        // The embedded Postgres runs as the unprivileged `innerwall` user, which must reach cp/.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("while making {} world-readable", dir.display()))?;
        let procs = Processes::new(&dir)?;
        println!("demo directory: {}   (shown as $DEMO below)", dir.display());
        Ok(Self {
            dir,
            release,
            procs,
            ids: BTreeMap::new(),
            failures: Vec::new(),
            keep_dir: false,
            shots,
            console: None,
        })
    }

    fn show(&mut self) -> Result<()> {
        section("1", "Simulated hosts", "three network namespaces on one bridge, each its own host");
        network::create_network()?;

        section("2", "Control plane", "a CA, then `innerwall serve` with its embedded Postgres");
        self.iw_print(&["ca", "init"])?;
        let serve = self.iw_command(&[
            "serve",
            "--listen",
            SERVER,
            "--server-name",
            SERVER_NAME,
            "--heartbeat-interval",
            "5s",
            "--flow-window",
            "5s",
            "--api-listen",
            CONSOLE,
        ]);
        self.spawn("serve", serve)?;
        let ready = self.wait_for_log("serve", "listening on", SERVE_READY_TIMEOUT)?;
        println!("  {}", ready.trim());
        let api = self.wait_for_log("serve", "operator API on https://", SERVE_READY_TIMEOUT)?;
        println!("  {}", api.trim());

        section("3", "Enrollment", "each agent enrolls with a one-time token, inside its namespace");
        let ca_bundle = self.dir.join("cp/ca/ca.crt");
        for host in HOSTS {
            let label = format!("app={}", host.app);
            let mut mint =
                self.iw_command(&["token", "mint", "--label", &label, "--server", SERVER, "--json"]);
            println!("  $ {}", self.display(&mint));
            let MintedToken { token } = cli::parse(&self.checked(&mut mint)?, "token mint --json")?;
            println!("    token {token}");
            let state = self.agent_state(host);
            // The token goes in a file only root reads, as on a real host: never on a command line.
            let token_file = self.dir.join(format!("enroll-token-{}", host.name));
            write_secret(&token_file, &token)?;
            // A UTS namespace of its own gives each host its own hostname, which enrollment
            // reports; the network namespace alone would leave all three with this machine's.
            let mut enroll = Command::new("ip");
            enroll.args([
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--uts",
                "sh",
                "-c",
                SET_HOSTNAME,
                host.name,
            ]);
            enroll
                .arg(self.release.join("innerwall-agent"))
                .arg("enroll")
                .args(["--server", SERVER, "--token-file"])
                .arg(&token_file);
            enroll.arg("--ca-bundle").arg(&ca_bundle).arg("--state-dir").arg(&state);
            self.run_print(&mut enroll)?;
        }
        for host in HOSTS {
            let mut agent = self.in_netns(host, "innerwall-agent");
            agent.args(["run", "--server", SERVER]).arg("--state-dir").arg(self.agent_state(host));
            self.spawn(&format!("agent-{}", host.name), agent)?;
        }
        for host in HOSTS {
            self.wait_for_log(
                &format!("agent-{}", host.name),
                "connected to the control plane",
                AGENT_CONNECT_TIMEOUT,
            )?;
        }
        println!("  all three agents hold their mTLS sync stream");
        self.learn_ids()?;
        self.iw_print(&["workload", "list"])?;
        for host in HOSTS {
            println!("  host {:<5} = workload {}  ({})", host.name, self.id(host), host.addr);
        }

        section(
            "4",
            "Policy",
            "label-based authoring renders per-host policy; workloads start in visibility",
        );
        self.iw_print(&["service", "create", "postgres", "--entry", &format!("tcp:{DB_PORT}")])?;
        let ruleset = self.dir.join("payments.yaml");
        fs::write(&ruleset, RULESET_YAML).context("while writing payments.yaml")?;
        println!("  $DEMO/payments.yaml:");
        print_indented(RULESET_YAML, 4);
        let ruleset = ruleset.to_string_lossy().into_owned();
        self.iw_print(&["ruleset", "create", "-f", &ruleset])?;
        self.wait_converged()?;
        let mut listener = self.in_netns(&DB, "/usr/bin/python3");
        listener.args(["-u", "-c", LISTENER_PY, DB.addr, DB_PORT]);
        self.spawn("listener", listener)?;
        self.wait_for_log("listener", "listening", Duration::from_secs(10))?;
        println!("  a TCP server listens on {}:{DB_PORT} inside {}", DB.addr, DB.netns);
        let outcome = self.connect(&BATCH, DB_PORT)?;
        self.expect(
            "visibility: batch -> db:5432 connects (the rule exists, nothing is dropped yet)",
            outcome.connected(),
            &outcome,
        );

        section(
            "5",
            "Simulation",
            "db moves to simulation by a count-pinned promotion; nothing is dropped yet",
        );
        let db = self.id(&DB).to_owned();
        let scope = "app=payments-db";
        self.iw_print(&[
            "workload",
            "promote",
            "--scope",
            scope,
            "--expect-count",
            "1",
            "--to",
            "simulation",
            "--reason",
            "demo: gather evidence before enforcing",
        ])?;
        self.wait_converged()?;
        let outcome = self.connect(&BATCH, DB_PORT)?;
        self.expect("simulation: batch -> db:5432 still connects", outcome.connected(), &outcome);
        let outcome = self.connect(&WEB, DB_PORT)?;
        self.expect("simulation: web -> db:5432 connects", outcome.connected(), &outcome);
        let mut wrong = self.iw_command(&[
            "workload",
            "promote",
            "--scope",
            scope,
            "--expect-count",
            "2",
            "--to",
            "enforcement",
            "--reason",
            "demo",
        ]);
        println!("  $ {}", self.display(&wrong));
        let out = capture(&mut wrong, CLI_TIMEOUT)?;
        println!("    {}", out.stderr.trim());
        self.expect(
            "a promotion naming the wrong count is refused and changes nothing",
            !out.status.success()
                && out.stderr.contains("match-count-mismatch: 1 workload(s) matched, you expected 2"),
            &out.stderr.trim(),
        );

        section("6", "Verdict", "is it safe to enforce? the evidence says batch would be blocked");
        let verdict =
            self.wait_verdict(scope, |v| v.outcome == "UNSAFE" && v.would_block_from(BATCH.addr))?;
        self.iw_print(&verdict_args(scope, &[]))?;
        self.expect(
            "the verdict is UNSAFE and names batch's attempt as would-block",
            verdict.outcome == "UNSAFE" && verdict.would_block_from(BATCH.addr),
            &verdict.outcome,
        );

        section("7", "Fix", "batch becomes app=web: only db's peer set changes, and the verdict follows");
        let before = self.policy(&db)?;
        let hits_before = self.rule_hits(&DB)?;
        let batch = self.id(&BATCH).to_owned();
        self.iw_print(&["workload", "label", &batch, "--set", "app=web", "--expect-label-version", "1"])?;
        self.wait_converged()?;
        self.iw_print(&["workload", "status"])?;
        let after = self.policy(&db)?;
        self.expect(
            "db's policy moved one version with the same rules, batch added as a peer",
            after.version == before.version + 1
                && after.rule_ids() == before.rule_ids()
                && after.has_peer(&format!("{}/32", BATCH.addr)),
            &format!("v{} {:?} -> v{} {:?}", before.version, before.rules, after.version, after.rules),
        );
        let hits_after = self.rule_hits(&DB)?;
        println!("  rule hits on db: {hits_before} -> {hits_after} (a peer-only update keeps the counters)");
        let verdict = self.wait_verdict(scope, |v| v.outcome == "SAFE")?;
        self.iw_print(&verdict_args(scope, &[]))?;
        self.expect(
            "the verdict is SAFE on the new version (older windows replayed through it)",
            verdict.outcome == "SAFE" && verdict.judged_version(&db) == Some(after.version),
            &verdict.outcome,
        );

        section("8", "Enforcement", "a count-pinned promotion on the SAFE verdict, with its record");
        self.iw_print(&[
            "workload",
            "promote",
            "--scope",
            scope,
            "--expect-count",
            "1",
            "--to",
            "enforcement",
            "--evidence-since",
            EVIDENCE_SINCE,
            "--min-evidence",
            MIN_EVIDENCE,
            "--reason",
            "demo: the verdict is SAFE on the fixed policy",
        ])?;
        self.wait_converged()?;
        self.iw_print(&["promotions", "list"])?;
        let outcome = self.connect(&WEB, DB_PORT)?;
        self.expect("web -> db:5432 connects (allowed by payments/from-web)", outcome.connected(), &outcome);
        let outcome = self.connect(&BATCH, DB_PORT)?;
        self.expect("batch, now app=web, -> db:5432 connects", outcome.connected(), &outcome);
        let outcome = self.connect(&WEB, OTHER_PORT)?;
        self.expect(
            "web -> db:5433 is blocked (no rule; SYN dropped, the connection times out)",
            outcome == Outcome::TimedOut,
            &outcome,
        );
        let mut status = self.in_netns(&DB, "innerwall-agent");
        status.arg("status").arg("--state-dir").arg(self.agent_state(&DB));
        self.run_print(&mut status)?;
        self.iw_print(&["workload", "policy", &db])?;
        let log = fs::read_to_string(self.procs.log("listener")).unwrap_or_default();
        let peers: Vec<&str> = log.lines().filter_map(|line| line.strip_prefix("accepted ")).collect();
        println!("  the db server accepted connections from: {}", peers.join(", "));

        section("9", "Flows", "what db's eBPF capture saw, with the decision its policy made");
        // Windows close every 5 s and upload on their own connection; wait for web's blocked
        // attempt on 5433 and its allowed connection on 5432 to arrive.
        let deadline = Instant::now() + Duration::from_secs(40);
        let (mut blocked, mut allowed) = (false, false);
        while Instant::now() < deadline && !(blocked && allowed) {
            thread::sleep(Duration::from_secs(2));
            let out = self.checked(&mut self.iw_command(&[
                "flows",
                "list",
                "--workload",
                &db,
                "--since",
                "10m",
                "--json",
            ]))?;
            let rows: Vec<FlowRecord> = cli::parse(&out, "flows list --json")?;
            for row in rows.iter().filter(|row| row.src_address == WEB.addr) {
                blocked |= row.decision == FlowRecord::BLOCKED && row.dst_port.to_string() == OTHER_PORT;
                allowed |= row.decision == FlowRecord::ALLOWED && row.dst_port.to_string() == DB_PORT;
            }
        }
        self.iw_print(&["flows", "list", "--workload", &db, "--since", "10m"])?;
        self.expect("db's flows show web's attempt on 5433 as BLOCKED", blocked, &"no blocked record");
        self.expect(
            "db's flows show web's connection as ALLOWED with its rule",
            allowed,
            &"no allowed record from web",
        );
        self.iw_print(&["flows", "gaps", "--workload", &db])?;

        self.show_console(scope)?;
        self.summary()
    }

    /// Asks for the verdict on `scope` until `done` holds of it (evidence arrives in 5 s
    /// windows); the last verdict either way.
    fn wait_verdict(&self, scope: &str, done: impl Fn(&VerdictJson) -> bool) -> Result<VerdictJson> {
        let started = Instant::now();
        loop {
            let args = verdict_args(scope, &["--json"]);
            let verdict: VerdictJson = cli::parse(&self.iw(&args)?, "workload verdict --json")?;
            if done(&verdict) || started.elapsed() > VERDICT_TIMEOUT {
                println!("  verdict {} after {:.1?}", verdict.outcome, started.elapsed());
                return Ok(verdict);
            }
            thread::sleep(POLL);
        }
    }

    /// The web console on the same estate: an admin's operator token, and screenshots of the
    /// fleet, map and review pages taken in headless Chromium.
    fn show_console(&mut self, scope: &str) -> Result<()> {
        section("10", "Console", "the same estate in the web console, signed in with an operator token");
        let minted =
            self.iw(&["operator", "token", "mint", "--name", "demo", "--role", "admin", "--json"])?;
        let MintedToken { token } = cli::parse(&minted, "operator token mint --json")?;
        let url = format!("https://{CONSOLE}");
        println!("  console: {url}/   (its certificate is from $DEMO/cp/ca/ca.crt)");
        println!("  sign in with the operator token {token}");
        let browser = Browser::start();
        browser.goto(&format!("{url}/sign-in"));
        browser.type_into(&browser.one("#token"), &token);
        browser.click(&browser.one("form.sign-in button"));
        browser.wait_for("/fleet");
        let pages = [
            ("fleet", "/fleet".to_owned(), "Fleet"),
            ("map", "/map?key=app&since=15m".to_owned(), "Edges"),
            (
                "review",
                format!(
                    "/review?scope={}&since={EVIDENCE_SINCE}&min={MIN_EVIDENCE}",
                    scope.replace('=', "%3D")
                ),
                "Verdict",
            ),
        ];
        for (name, path, marker) in pages {
            browser.goto(&format!("{url}{path}"));
            browser.wait_for(marker);
            let shot = self.shots.join(format!("{name}.png"));
            browser.screenshot(&shot);
            let size = fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
            println!("  {name}: {} ({size} bytes)", shot.display());
            self.expect(&format!("the console's {name} page is drawn"), size > 10_000, &size);
        }
        let text = browser.text();
        self.expect(
            "the review page shows the scope's verdict",
            text.contains("Verdict: SAFE")
                || text.contains("Verdict: UNSAFE")
                || text.contains("Verdict: INSUFFICIENT"),
            &"no verdict",
        );
        self.console = Some((url, token));
        Ok(())
    }

    /// Leaves everything running until Enter is pressed (`--keep`).
    fn hold(&self) {
        if let Some((url, token)) = &self.console {
            println!("\nthe estate keeps running: open {url}/ and sign in with {token}");
        }
        println!("press Enter to stop it and clean up (Ctrl-C leaves namespaces that the next demo clears)");
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    }

    fn summary(&self) -> Result<()> {
        section("11", "Summary", "");
        println!(
            "  shown: token enrollment of three agents over mTLS, each inside its own network\n  \
             namespace; label-based policy rendered per host and streamed to the agents; the\n  \
             visibility -> simulation -> enforcement path on evidence: a count-pinned promotion\n  \
             (a wrong count refused), the verdict UNSAFE naming batch's would-block attempt, a\n  \
             relabel converging as a peer-only update, the verdict SAFE on the new version with\n  \
             the older windows replayed, the promotion to enforcement and its record; nftables on\n  \
             db allowing app=web and dropping what no rule allows; the flows db's eBPF capture\n  \
             recorded, with the decision its installed policy made."
        );
        if self.failures.is_empty() {
            println!("\nRESULT: PASS, every expectation held");
            Ok(())
        } else {
            println!("\nRESULT: FAIL");
            for failure in &self.failures {
                println!("  failed: {failure}");
            }
            bail!(
                "{} demo expectation(s) did not hold; logs are kept in {}",
                self.failures.len(),
                self.dir.display()
            )
        }
    }

    fn expect(&mut self, what: &str, held: bool, observed: &dyn std::fmt::Display) {
        if held {
            println!("  PASS  {what}");
        } else {
            println!("  FAIL  {what}  (observed: {observed})");
            self.failures.push(what.to_owned());
        }
    }

    // --- commands -------------------------------------------------------------------------

    fn iw_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.release.join("innerwall"));
        cmd.arg("--state-dir").arg(self.dir.join("cp")).args(args);
        cmd
    }

    /// `innerwall …` against the demo's control plane; its stdout.
    fn iw(&self, args: &[&str]) -> Result<String> {
        self.checked(&mut self.iw_command(args))
    }

    fn iw_print(&self, args: &[&str]) -> Result<()> {
        self.run_print(&mut self.iw_command(args))
    }

    fn run_print(&self, cmd: &mut Command) -> Result<()> {
        println!("  $ {}", self.display(cmd));
        let out = self.checked(cmd)?;
        print_indented(&out, 4);
        Ok(())
    }

    /// Runs `cmd` with a timeout; on failure the error carries its stderr and the serve log.
    fn checked(&self, cmd: &mut Command) -> Result<String> {
        let line = self.display(cmd);
        let out = capture(cmd, CLI_TIMEOUT).with_context(|| format!("while running `{line}`"))?;
        if !out.status.success() {
            bail!(
                "`{line}` failed ({}):\n{}{}",
                out.status,
                out.stderr.trim_end(),
                self.procs.log_tail("serve")
            );
        }
        Ok(out.stdout)
    }

    /// `ip netns exec NS PROGRAM`, with the release binaries found by their short names.
    fn in_netns(&self, host: &Host, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", host.netns]);
        if program.starts_with('/') {
            cmd.arg(program);
        } else {
            cmd.arg(self.release.join(program));
        }
        cmd
    }

    fn agent_state(&self, host: &Host) -> PathBuf {
        self.dir.join(format!("agent-{}", host.name))
    }

    /// The command line as a reader wants it: binaries by name, the demo dir as $DEMO, inline
    /// programs elided.
    fn display(&self, cmd: &Command) -> String {
        let dir = self.dir.to_string_lossy();
        let release = format!("{}/", self.release.to_string_lossy());
        let word = |word: &std::ffi::OsStr| {
            let word = word.to_string_lossy().replace(&release, "").replace(dir.as_ref(), "$DEMO");
            if word.contains('\n') {
                "'<program>'".to_owned()
            } else if word.contains(' ') {
                format!("'{word}'")
            } else {
                word
            }
        };
        std::iter::once(word(cmd.get_program())).chain(cmd.get_args().map(word)).collect::<Vec<_>>().join(" ")
    }

    // --- background processes -------------------------------------------------------------

    fn spawn(&mut self, name: &str, cmd: Command) -> Result<()> {
        let shown = self.display(&cmd);
        self.procs.spawn(name, cmd, &shown)
    }

    fn wait_for_log(&mut self, name: &str, needle: &str, timeout: Duration) -> Result<String> {
        self.procs.wait_for_log(name, needle, timeout)
    }

    // --- observations ---------------------------------------------------------------------

    fn learn_ids(&mut self) -> Result<()> {
        let list: Vec<Workload> =
            cli::parse(&self.iw(&["workload", "list", "--json"])?, "workload list --json")?;
        for host in HOSTS {
            let found =
                list.iter().find(|workload| workload.addresses.iter().any(|a| a.address == host.addr));
            let Some(workload) = found else {
                bail!("no enrolled workload reports address {} (host {})", host.addr, host.name);
            };
            // The demo's addresses are private: address trust must accept them (issue 11).
            if let Some(a) =
                workload.addresses.iter().find(|a| a.address == host.addr && a.standing != "accepted")
            {
                bail!("address {} of host {} is {}, not accepted", a.address, host.name, a.standing);
            }
            self.ids.insert(host.name, workload.id.clone());
        }
        Ok(())
    }

    fn id(&self, host: &Host) -> &str {
        self.ids.get(host.name).map_or("?", String::as_str)
    }

    /// Polls `workload status` until all three agents have applied their latest version.
    fn wait_converged(&mut self) -> Result<()> {
        let started = Instant::now();
        let mut last = String::new();
        while started.elapsed() < CONVERGE_TIMEOUT {
            last = self.iw(&["workload", "status", "--json"])?;
            let status: Vec<SyncStatus> = cli::parse(&last, "workload status --json")?;
            let converged = HOSTS.iter().all(|host| {
                status.iter().find(|row| row.id == self.id(host)).is_some_and(SyncStatus::converged)
            });
            if converged {
                println!(
                    "  converged: all three agents SYNCED at their latest version after {:.1?}",
                    started.elapsed()
                );
                return Ok(());
            }
            thread::sleep(POLL);
        }
        let mut tails = String::new();
        for host in HOSTS {
            tails.push_str(&self.procs.log_tail(&format!("agent-{}", host.name)));
        }
        bail!(
            "the agents did not converge within {CONVERGE_TIMEOUT:?}; last `workload status --json`:\n{last}{tails}{}",
            self.procs.log_tail("serve")
        )
    }

    fn connect(&self, from: &Host, port: &str) -> Result<Outcome> {
        let mut client = self.in_netns(from, "/usr/bin/python3");
        client.args(["-c", CLIENT_PY, DB.addr, port, CONNECT_TIMEOUT_SECS]);
        println!("  $ {}   # from {}", self.display(&client), from.name);
        let out = capture(&mut client, Duration::from_secs(15))?;
        println!("    {}", out.stdout.trim());
        Ok(match out.status.code() {
            Some(0) => Outcome::Connected,
            Some(2) => Outcome::TimedOut,
            _ => Outcome::Failed(format!("{} {}", out.stdout.trim(), out.stderr.trim())),
        })
    }

    fn policy(&self, id: &str) -> Result<Policy> {
        let text = self.iw(&["workload", "policy", id, "--json"])?;
        let policy: RenderedPolicy = cli::parse(&text, "workload policy --json")?;
        let rules = policy.rules.into_iter().map(|rule| (rule.rule_id, rule.peers)).collect();
        Ok(Policy { version: policy.version, rules })
    }

    /// The sum of db's per-rule packet counters, read from the kernel by `innerwall-agent status`.
    fn rule_hits(&self, host: &Host) -> Result<u64> {
        let mut status = self.in_netns(host, "innerwall-agent");
        status.arg("status").arg("--state-dir").arg(self.agent_state(host)).arg("--json");
        let status: AgentStatus = cli::parse(&self.checked(&mut status)?, "innerwall-agent status --json")?;
        Ok(status.rules.iter().map(|rule| rule.packets).sum())
    }
}

#[derive(Debug)]
struct Policy {
    version: u64,
    rules: BTreeMap<String, Vec<String>>,
}

impl Policy {
    fn rule_ids(&self) -> Vec<&String> {
        self.rules.keys().collect()
    }

    fn has_peer(&self, cidr: &str) -> bool {
        self.rules.values().any(|peers| peers.iter().any(|peer| peer == cidr))
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Connected,
    TimedOut,
    Failed(String),
}

impl Outcome {
    fn connected(&self) -> bool {
        *self == Outcome::Connected
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Connected => f.write_str("connected"),
            Outcome::TimedOut => f.write_str("timed out"),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        section("", "Cleanup", "");
        self.procs.stop_all();
        match processes::stop_postgres(&self.dir) {
            Ok(Some(how)) => println!("  postgres: {how}"),
            Ok(None) => {}
            Err(err) => println!("  postgres: {err:#}"),
        }
        if let Err(err) = network::delete_network() {
            println!("  network: {err:#}");
        } else {
            println!(
                "  network: namespaces {}, {} and {} and bridge {BRIDGE} deleted",
                DB.netns, WEB.netns, BATCH.netns
            );
        }
        if self.keep_dir {
            println!("  kept {} for its logs (the next run removes it)", self.dir.display());
        } else if let Err(err) = fs::remove_dir_all(&self.dir) {
            println!("  could not remove {}: {err}", self.dir.display());
        } else {
            println!("  removed {}", self.dir.display());
        }
    }
}

/// Undoes what a killed run left behind, found by exact name only: processes inside our
/// namespaces, each leftover demo directory's recorded processes and Postgres, then the
/// namespaces and the bridge.
fn clean_leftovers() -> Result<()> {
    let mut found = Vec::new();
    let tmp = std::env::temp_dir();
    let dirs: Vec<PathBuf> = fs::read_dir(&tmp)
        .with_context(|| format!("while listing {}", tmp.display()))?
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(DIR_PREFIX))
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .map(|entry| entry.path())
        .collect();
    for dir in &dirs {
        found.extend(processes::stop_interrupted_run(dir)?);
    }
    for host in HOSTS.iter().filter(|host| network::netns_exists(host.netns)) {
        found.extend(processes::stop_in_netns(host.netns)?);
    }
    for dir in &dirs {
        let dir_text = dir.to_string_lossy().into_owned();
        found.extend(processes::stop_recorded(dir)?);
        if let Some(how) = processes::stop_postgres(dir)? {
            found.push(format!("postgres of {dir_text}: {how}"));
        }
        fs::remove_dir_all(dir).with_context(|| format!("while removing {dir_text}"))?;
        found.push(format!("directory {dir_text}"));
    }
    if network::leftovers_exist() {
        network::delete_network()?;
        found.push("namespaces and bridge of an earlier run".to_owned());
    }
    if found.is_empty() {
        println!("no leftovers of an earlier demo run");
    } else {
        println!("cleaned up after an earlier demo run:");
        for item in found {
            println!("  {item}");
        }
    }
    Ok(())
}

// --- output -------------------------------------------------------------------------------

/// `innerwall workload verdict` on `scope` over the demo's evidence range, then `extra`.
fn verdict_args<'a>(scope: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "workload",
        "verdict",
        "--scope",
        scope,
        "--evidence-since",
        EVIDENCE_SINCE,
        "--min-evidence",
        MIN_EVIDENCE,
    ];
    args.extend_from_slice(extra);
    args
}

fn section(number: &str, title: &str, shows: &str) {
    let mut header =
        if number.is_empty() { format!("\n=== {title} ") } else { format!("\n=== {number}. {title} ") };
    let width = header.chars().count();
    header.push_str(&"=".repeat(92usize.saturating_sub(width)));
    println!("{header}");
    if !shows.is_empty() {
        println!("  ({shows})");
    }
}

fn print_indented(text: &str, indent: usize) {
    let pad = " ".repeat(indent);
    let mut out = String::new();
    for line in text.trim_end().lines() {
        let _ = writeln!(out, "{pad}{line}");
    }
    print!("{out}");
}

/// Writes `secret` to `path`, readable by its owner only (mode 0600).
fn write_secret(path: &Path, secret: &str) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("while writing {}", path.display()))?;
    // An older file keeps its mode when opened: set it again.
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(secret.as_bytes()).with_context(|| format!("while writing {}", path.display()))
}

fn ensure_root() -> Result<()> {
    // /proc/self belongs to the effective user: no libc call needed.
    let uid = fs::metadata("/proc/self").context("while reading /proc/self")?.uid();
    if uid != 0 {
        bail!("the demo creates network namespaces and nftables tables: run it as root (uid is {uid})");
    }
    Ok(())
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |dir| root.join(dir))
}
