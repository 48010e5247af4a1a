//! The operator CLI as a careless (or hostile) user meets it: the real `innerwall` binary on the
//! embedded cluster (issue 26, item 7).

use std::process::{Command, Output, Stdio};

use anyhow::Context;
use innerwall_control_plane::postgres;

use crate::postgres::{StateDir, innerwall_embedded, ready_count, stop_and_check_gone};

/// What a terminal would take for a command: ESC (a CSI sequence), BEL, a C1 CSI, DEL, a
/// line break, and a right-to-left override.
const HOSTILE: &str = "evil\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m\u{7f}\nfake-row\u{202e}";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn innerwall(state: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    cmd.env_remove("INNERWALL_DATABASE_URL").arg("--state-dir").arg(state).args(args);
    cmd
}

/// No control character reached stdout but the line breaks the CLI wrote itself.
fn assert_no_control(stdout: &[u8]) {
    let text = String::from_utf8_lossy(stdout);
    let bad: Vec<char> = text
        .chars()
        .filter(|c| *c != '\n' && (c.is_control() || ('\u{202a}'..='\u{202e}').contains(c)))
        .collect();
    assert!(bad.is_empty(), "raw control characters {bad:?} in:\n{text}");
}

#[tokio::test]
async fn cli_is_safe_to_use_carelessly() -> anyhow::Result<()> {
    let state = StateDir::new()?;

    // A mistyped state directory is refused, named, and nothing is created: neither the
    // directory nor anything in an existing empty one.
    let typo = state.0.join("innerwal");
    for dir in [&typo, &state.0] {
        let out = innerwall(dir, &["service", "list"]).output()?;
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(&format!("no Innerwall database under {}", dir.display())), "{err}");
        assert!(err.contains("--init"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!typo.exists(), "the mistyped directory was created");
    assert_eq!(std::fs::read_dir(&state.0)?.count(), 0, "something was created in the state dir");

    // `migrate` creates it, and stops the server it started when it ends.
    let out = innerwall(&state.0, &["migrate"]).output()?;
    assert!(out.status.success(), "{}", stderr(&out));
    let cluster = postgres::embedded_cluster(&state.0)?;
    assert!(!cluster.is_running()?, "migrate left the server it started running");

    // The audit actor is the real uid's user name, whatever $USER and $SUDO_USER say.
    let me = nix::unistd::User::from_uid(nix::unistd::getuid())?.context("this uid has no user name")?.name;
    assert_ne!(me, "mallory");
    let out = innerwall(&state.0, &["service", "create", "web", "--entry", "tcp:443"])
        .env("USER", "mallory")
        .env("SUDO_USER", "mallory")
        .env("LOGNAME", "mallory")
        .output()?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!cluster.is_running()?, "the command left the server it started running");
    let out = innerwall(&state.0, &["--json", "audit", "list"]).env("USER", "mallory").output()?;
    assert!(out.status.success(), "{}", stderr(&out));
    let audit: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let actors: Vec<&str> =
        audit.as_array().context("audit list")?.iter().filter_map(|r| r["actor"].as_str()).collect();
    assert!(actors.contains(&format!("cli:{me}").as_str()), "{actors:?}");
    assert!(!actors.iter().any(|a| a.contains("mallory")), "{actors:?}");

    // Text as an agent reports it (a hostname, a sync detail) and as a description arrives,
    // planted with SQL under a running server (as `serve` runs it), which the CLI leaves running.
    let url = postgres::embedded(&state.0).await?;
    let pid = cluster.postmaster_pid().context("not running")?;
    let pool = postgres::connect(&url).await?;
    let id = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO workloads (id, hostname, sync_detail) VALUES ($1, $2, $2)")
        .bind(id)
        .bind(HOSTILE)
        .execute(&pool)
        .await?;
    sqlx::query("UPDATE services SET description = $1 WHERE name = 'web'")
        .bind(HOSTILE)
        .execute(&pool)
        .await?;
    for args in [
        &["service", "list"][..],
        &["workload", "list"],
        &["workload", "show", &id.to_string()],
        &["--json", "service", "list"],
        &["--json", "workload", "list"],
    ] {
        let out = innerwall(&state.0, args).output()?;
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_no_control(&out.stdout);
        let text = String::from_utf8(out.stdout.clone())?;
        if args[0] == "--json" {
            // JSON keeps the value exactly.
            let value: serde_json::Value = serde_json::from_str(&text)?;
            assert!(text.contains("\\u001b") && text.contains("\\u009b"), "{text}");
            assert!(value.to_string().contains(&serde_json::to_string(HOSTILE)?[1..20]), "{text}");
        } else {
            assert!(
                text.contains("evil\\u001b]0;owned\\u0007\\u001b[2J\\u009b31m\\u007f\\nfake-row\\u202e"),
                "{args:?}:\n{text}"
            );
            assert!(!text.lines().any(|l| l.starts_with("fake-row")), "a line break started a row:\n{text}");
        }
    }
    assert_eq!(cluster.postmaster_pid(), Some(pid), "the CLI stopped a server it did not start");

    // A closed pipe: quiet, status 141 (as SIGPIPE in the shell), no panic; twice.
    for _ in 0..2 {
        let mut child = innerwall(&state.0, &["--json", "workload", "list"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        drop(child.stdout.take());
        let out = child.wait_with_output()?;
        assert_eq!(out.status.code(), Some(141), "{}", stderr(&out));
        assert_eq!(stderr(&out), "", "a closed pipe is no error to report");
    }
    // A full output device: the error, status 1, no panic.
    for args in [&["service", "list"][..], &["--json", "service", "list"], &["contract"]] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full")?;
        let out = innerwall(&state.0, args).stdout(full).output()?;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("cannot write to stdout") && err.contains("No space left on device"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert_eq!(cluster.postmaster_pid(), Some(pid));
    pool.close().await;
    stop_and_check_gone(&cluster)?;

    // Stopped, a command starts it for itself and stops it after, even when its output fails.
    let before = ready_count(&cluster)?;
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full")?;
    let out = innerwall(&state.0, &["service", "list"]).stdout(full).output()?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(ready_count(&cluster)?, before + 1, "the command did not start the server");
    assert!(!cluster.is_running()?, "the server the failed command started is still running");
    let out = innerwall_embedded(&state.0, &["service", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!cluster.is_running()?);
    Ok(())
}

/// `innerwall <global> <args>` without any of the environment's control-plane settings: exit
/// code, stdout, stderr.
pub fn foresight_cli(global: &[String], args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    for var in [
        "INNERWALL_API",
        "INNERWALL_TOKEN",
        "INNERWALL_API_TOKEN",
        "INNERWALL_API_CA",
        "INNERWALL_DATABASE_URL",
    ] {
        command.env_remove(var);
    }
    let out = command.args(global).args(args).output().expect("running innerwall");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), stderr(&out))
}

/// The same command locally (`--database-url`) and through a real `serve`'s API (`--api`):
/// both exit with `code` and print the same stdout and stderr, which are returned.
#[track_caller]
fn same_both_ways(local: &[String], remote: &[String], args: &[&str], code: i32) -> (String, String) {
    let (l_code, l_out, l_err) = foresight_cli(local, args);
    let (r_code, r_out, r_err) = foresight_cli(remote, args);
    assert_eq!(l_code, Some(code), "local {args:?}: {l_err}\n{l_out}");
    assert_eq!(r_code, Some(code), "remote {args:?}: {r_err}\n{r_out}");
    assert_eq!(r_out, l_out, "{args:?}: the remote output is the local one");
    assert_eq!(r_err, l_err, "{args:?}: the remote error is the local one");
    (l_out, l_err)
}

/// The foresight commands through a real `innerwall serve`'s API print what the same commands
/// print from the database, and exit the same: `policy test-set create|list|show|update|delete`,
/// `policy test` (table, `--json`, `--junit`, which parses) passing and failing, and `workload
/// replay --json` (1 on newly blocked flows without `--accept-blocks`, 0 with it).
#[tokio::test]
async fn foresight_remote_cli_matches_local() -> anyhow::Result<()> {
    use chrono::{DurationRound, TimeDelta};
    use innerwall_control_plane::foresight;
    use innerwall_control_plane::identity::operators::Role;
    use innerwall_wire::flows::FlowWindow;
    use innerwall_wire::policy::{Mode, WorkloadPolicy};
    use innerwall_wire::proto;

    use crate::foresight_api::{Serve, TESTS, estate, file, mint, plant_set};

    let db = innerwall_control_plane::testing::fresh_database().await?;
    let pool = &db.pool;
    let web = estate(pool).await;
    // web-1 gains tcp/8001 then tcp/8002 from 192.0.2.0/24: its last two versions differ by 8002.
    innerwall_control_plane::testing::add_web_port(pool, 1).await?;
    innerwall_control_plane::testing::add_web_port(pool, 2).await?;
    let history =
        innerwall_control_plane::policy::store::policy_history(&mut *pool.acquire().await?, web).await?;
    let versions: Vec<u64> = history.iter().map(WorkloadPolicy::version).collect();
    let (to, from) = (versions[versions.len() - 2], versions[versions.len() - 1]);
    let latest = history.last().context("a history")?;
    let rule_of = |port: u16| {
        latest.rules().find(|r| r.ports().iter().any(|p| p.contains(port))).map(|r| r.id().to_string())
    };
    let (r8001, r8002) = (rule_of(8001).context("8001")?, rule_of(8002).context("8002")?);

    // An hour of allowed flows under the latest version, rolled up: one to each port.
    let hour = 3_600_000;
    let now = chrono::Utc::now();
    let h0 = (now.duration_trunc(TimeDelta::hours(1))? - TimeDelta::hours(3)).timestamp_millis();
    let at = |ms| chrono::DateTime::from_timestamp_millis(ms).unwrap();
    innerwall_control_plane::testing::installed(pool, web, &[(from, Mode::Simulation, at(h0 - hour))])
        .await?;
    sqlx::query("UPDATE workloads SET applied_version = $2 WHERE id = $1")
        .bind(web.uuid())
        .bind(from as i64)
        .execute(pool)
        .await?;
    let record = |src: &str, port: u32, rule: &str, n: u64| proto::FlowRecord {
        pending_decision: 0,
        pending_rule_id: String::new(),
        src_address: src.into(),
        dst_address: "10.0.0.1".into(),
        dst_port: port,
        protocol: proto::Protocol::Tcp.into(),
        decision: proto::FlowDecision::Allowed.into(),
        matched_rule_id: rule.into(),
        packets: n,
        bytes: n * 60,
        new_connections: n,
        first_seen_unix_ms: h0 + 1_000,
        last_seen_unix_ms: h0 + 2_000,
    };
    let window = proto::FlowWindow {
        staged_set: String::new(),
        window_id: uuid::Uuid::new_v4().to_string(),
        start_unix_ms: h0,
        end_unix_ms: h0 + hour,
        policy_version: from,
        mode: 2,
        records: vec![record("192.0.2.10", 8001, &r8001, 1), record("192.0.2.11", 8002, &r8002, 5)],
        gaps: vec![],
    };
    innerwall_control_plane::flows::ingest(pool, web, &FlowWindow::try_from(&window)?).await?;
    assert!(innerwall_control_plane::flows::roll_up(pool, now).await? >= 1);

    let editor = mint(pool, "ed", Role::Editor).await;
    let serve = Serve::start(&db.url);
    let remote = serve.remote(&editor);
    let local = vec!["--database-url".to_owned(), db.url.clone()];
    let dir = serve.dir.join("files");
    let with = |global: &[String], first: &[&str]| -> Vec<String> {
        first.iter().map(|s| (*s).to_owned()).chain(global.iter().cloned()).collect()
    };
    let (json_local, json_remote) = (with(&local, &["--json"]), with(&remote, &["--json"]));

    // `test-set create -f`: the set through the API, its twin from the database, the same words.
    let remote_file = file(&dir, "remote.yaml", TESTS);
    let local_file = file(&dir, "local.yaml", &TESTS.replace("payments-intent", "payments-twin"));
    let (code, remote_out, err) =
        foresight_cli(&remote, &["policy", "test-set", "create", "-f", &remote_file]);
    assert_eq!(code, Some(0), "{err}");
    let (code, local_out, err) = foresight_cli(&local, &["policy", "test-set", "create", "-f", &local_file]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(local_out.replace("payments-twin", "payments-intent"), remote_out);
    assert!(remote_out.contains("policy test set payments-intent created (version 1)"), "{remote_out}");
    let actor: String = sqlx::query_scalar("SELECT actor FROM audit_log WHERE subject = 'payments-intent'")
        .fetch_one(pool)
        .await?;
    assert!(actor.starts_with("operator:ed/"), "the remote create went through the API: {actor}");

    // `list` and `show`, as tables and JSON.
    let (listed, _) = same_both_ways(&json_local, &json_remote, &["policy", "test-set", "list"], 0);
    let listed: serde_json::Value = serde_json::from_str(&listed)?;
    assert_eq!(listed, serde_json::to_value(foresight::list_test_sets(pool).await?)?);
    let (table, _) = same_both_ways(&local, &remote, &["policy", "test-set", "list"], 0);
    assert!(table.contains("payments-intent") && table.contains("payments-twin"), "{table}");
    let show = ["policy", "test-set", "show", "payments-intent"];
    let (shown, _) = same_both_ways(&json_local, &json_remote, &show, 0);
    let shown: serde_json::Value = serde_json::from_str(&shown)?;
    assert_eq!(shown, serde_json::to_value(foresight::show_test_set(pool, "payments-intent").await?)?);
    let (yaml, _) = same_both_ways(&local, &remote, &show, 0);
    assert!(yaml.starts_with("# version: 1\n") && yaml.contains("web-reaches-payments"), "{yaml}");
    let (_, err) = same_both_ways(&local, &remote, &["policy", "test-set", "show", "nothing-here"], 1);
    assert!(err.contains("nothing-here"), "{err}");

    // `update` and `delete` need the version read, and a stale one changes nothing either way.
    let update = ["policy", "test-set", "update", "-f", &remote_file, "--expect-version", "3"];
    let (_, err) = same_both_ways(&local, &remote, &update, 1);
    assert!(err.contains("\"payments-intent\" is at version 1, not 3"), "{err}");
    let delete = ["policy", "test-set", "delete", "payments-twin", "--expect-version", "2"];
    let (_, err) = same_both_ways(&local, &remote, &delete, 1);
    assert!(err.contains("\"payments-twin\" is at version 1, not 2"), "{err}");
    let (code, out, err) = foresight_cli(
        &remote,
        &["policy", "test-set", "update", "-f", &remote_file, "--expect-version", "1"],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("policy test set payments-intent updated (version 2)"), "{out}");

    // `policy test`, passing: table, JSON (the library's report) and JUnit, the same both ways.
    let (table, _) = same_both_ways(&local, &remote, &["policy", "test"], 0);
    assert_eq!(table.matches("pass").count(), 6, "two sets of three: {table}");
    let (report, _) = same_both_ways(&json_local, &json_remote, &["policy", "test"], 0);
    let report: foresight::RunReport = serde_json::from_str(&report)?;
    assert_eq!(report, foresight::run_policy_tests(pool).await?);
    let (xml, _) = same_both_ways(&local, &remote, &["policy", "test", "--junit"], 0);
    let doc = roxmltree::Document::parse(&xml)?;
    let root = doc.root_element();
    assert_eq!(
        (root.tag_name().name(), root.attribute("tests"), root.attribute("failures")),
        ("testsuites", Some("6"), Some("0"))
    );
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("testsuite")).count(), 2);
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("failure")).count(), 0);

    // Failing (a set stored as it is, failing on the estate): exit 1 both ways, the same output.
    plant_set(
        pool,
        &serde_json::json!({"name": "api-intent", "tests": [{"name": "api-reaches-payments",
            "allow": {"from": {"app": ["api"]}, "to": {"app": ["payments"]}, "service": "https"}}]}),
    )
    .await;
    let (_, err) = same_both_ways(&local, &remote, &["policy", "test"], 1);
    assert!(err.contains("1 of 7 policy test(s) fail"), "{err}");
    let (report, _) = same_both_ways(&json_local, &json_remote, &["policy", "test"], 1);
    let report: foresight::RunReport = serde_json::from_str(&report)?;
    assert_eq!(report, foresight::run_policy_tests(pool).await?);
    let (xml, _) = same_both_ways(&local, &remote, &["policy", "test", "--junit"], 1);
    let doc = roxmltree::Document::parse(&xml)?;
    let failures: Vec<_> = doc.descendants().filter(|n| n.has_tag_name("failure")).collect();
    assert_eq!(failures.len(), 1, "{xml}");
    let case = failures[0].parent().context("a failure's testcase")?;
    assert_eq!(
        (case.attribute("classname"), case.attribute("name")),
        (Some("api-intent"), Some("api-reaches-payments"))
    );
    assert!(
        failures[0].attribute("message").is_some_and(|m| m.contains("needs app=web, the source has app=api")),
        "{xml}"
    );
    sqlx::query("DELETE FROM policy_test_sets WHERE name = 'api-intent'").execute(pool).await?;
    let delete = ["policy", "test-set", "delete", "payments-twin", "--expect-version", "1"];
    let (code, out, err) = foresight_cli(&remote, &delete);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("policy test set payments-twin deleted"), "{out}");
    let (listed, _) = same_both_ways(&json_local, &json_remote, &["policy", "test-set", "list"], 0);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&listed)?.as_array().map(Vec::len), Some(1));

    // `workload replay` from the latest version to the one before: 192.0.2.11 → tcp/8002 is
    // newly blocked, so exit 1 without --accept-blocks and 0 with it; the same JSON both ways
    // but for the range, which ends at each side's own now.
    let id = web.to_string();
    let (from, to) = (from.to_string(), to.to_string());
    let replay =
        ["workload", "replay", &id, "--from", &from, "--to", &to, "--since", "4h", "--min-coverage", "0"];
    let without_range = |text: &str| -> anyhow::Result<serde_json::Value> {
        let mut value: serde_json::Value = serde_json::from_str(text)?;
        value.as_object_mut().context("an object")?.remove("range").context("a range")?;
        Ok(value)
    };
    // Both sides' coverage counts the hours of their own range: a pair of runs the hour turned
    // under is run again.
    let both = |global: (&[String], &[String]), args: &[&str]| loop {
        let hour = || chrono::Utc::now().duration_trunc(TimeDelta::hours(1)).unwrap();
        let started = hour();
        let pair = (foresight_cli(global.0, args), foresight_cli(global.1, args));
        if hour() == started {
            return pair;
        }
    };
    for accept in [false, true] {
        let mut args = replay.to_vec();
        if accept {
            args.push("--accept-blocks");
        }
        let ((l_code, l_out, l_err), (r_code, r_out, r_err)) = both((&json_local, &json_remote), &args);
        let code = if accept { 0 } else { 1 };
        assert_eq!((l_code, r_code), (Some(code), Some(code)), "{args:?}: {l_err}\n{r_err}");
        assert_eq!(without_range(&r_out)?, without_range(&l_out)?, "{args:?}");
        let w = &without_range(&l_out)?["workloads"][0];
        assert_eq!((w["newly_blocked"].as_u64(), w["unchanged"].as_u64()), (Some(1), Some(1)), "{l_out}");
        assert_eq!(w["top_blocked"][0]["src_address"], "192.0.2.11", "{l_out}");
        assert_eq!(w["top_blocked"][0]["from_rule"], r8002.as_str(), "{l_out}");
        for err in [&l_err, &r_err] {
            assert_eq!(err.contains("--accept-blocks"), !accept, "{args:?}: {err}");
        }
    }
    // The other way round nothing is newly blocked: 0 without --accept-blocks.
    let back =
        ["workload", "replay", &id, "--from", &to, "--to", &from, "--since", "4h", "--min-coverage", "0"];
    let ((l_code, l_out, l_err), (r_code, r_out, r_err)) = both((&json_local, &json_remote), &back);
    assert_eq!((l_code, r_code), (Some(0), Some(0)), "{l_err}\n{r_err}");
    assert_eq!(without_range(&r_out)?, without_range(&l_out)?);
    // A version the workload never had: the same refusal, naming it.
    let missing = ["workload", "replay", &id, "--from", &from, "--to", "99", "--since", "4h"];
    let (l_code, _, l_err) = foresight_cli(&local, &missing);
    let (r_code, _, r_err) = foresight_cli(&remote, &missing);
    assert_eq!((l_code, r_code), (Some(1), Some(1)));
    assert!(l_err.contains("version 99") && r_err.contains("version 99"), "{l_err}\n{r_err}");
    drop(serve);
    Ok(())
}
