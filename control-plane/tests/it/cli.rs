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
