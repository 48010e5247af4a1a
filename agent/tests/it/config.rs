//! The agent's configuration file (issue 32, RUN-6) through the real binary: flag >
//! environment > file > default, the file's `state-dir` used by every command that takes one,
//! and every problem listed by `config check` while any other command but the kill switch
//! does nothing.

use std::process::Command;

const AGENT: &str = env!("CARGO_BIN_EXE_innerwall-agent");

/// `innerwall-agent ARGS` with only `env` of the INNERWALL_ variables (and no RUST_LOG) set.
fn agent(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(AGENT);
    for (name, _) in std::env::vars() {
        if name.starts_with("INNERWALL_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    let out = command.args(args).envs(env.iter().copied()).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// The line `config show --effective` prints for `key`, as (value, source).
fn shown(out: &str, key: &str) -> (String, String) {
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("{key}: {out}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[1].to_owned(), words[2..].join(" "))
}

#[test]
fn agent_config_files_are_checked() {
    let dir = std::env::temp_dir().join(format!("iw-agent-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("agent.toml");
    let path = file.to_str().unwrap();
    let state = dir.join("state");
    std::fs::write(
        &file,
        format!(
            "server = \"cp.example:7443\"\nstate-dir = \"{}\"\nlog-level = \"warn\"\nsource-address = \"127.0.0.2\"\n",
            state.display()
        ),
    )
    .unwrap();

    let (code, out, err) = agent(
        &["--config", path, "--log-level", "debug", "config", "show", "--effective"],
        &[("INNERWALL_AGENT_LOG", "trace"), ("INNERWALL_AGENT_METRICS_LISTEN", "127.0.0.1:9001")],
    );
    assert_eq!(code, 0, "{out}{err}");
    let file_source = format!("file {path}");
    assert_eq!(shown(&out, "server"), ("cp.example:7443".into(), file_source.clone()));
    assert_eq!(shown(&out, "log-level"), ("debug".into(), "flag".into()));
    assert_eq!(
        shown(&out, "metrics-listen"),
        ("127.0.0.1:9001".into(), "env INNERWALL_AGENT_METRICS_LISTEN".into())
    );
    assert_eq!(shown(&out, "drift-interval-ms"), ("2000".into(), "default".into()));
    assert_eq!(shown(&out, "source-address"), ("127.0.0.2".into(), file_source.clone()));
    // The variable beats the file; the file's state-dir is the one `status` reads.
    let (code, out, _) = agent(
        &["--config", path, "config", "show", "--effective"],
        &[("INNERWALL_AGENT_SERVER", "other.example:7443")],
    );
    assert_eq!(code, 0);
    assert_eq!(shown(&out, "server"), ("other.example:7443".into(), "env INNERWALL_AGENT_SERVER".into()));
    let (code, out, err) = agent(&["--config", path, "status"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&state.display().to_string()), "{out}");
    let (code, out, _) = agent(&["config", "check"], &[("INNERWALL_AGENT_CONFIG", path)]);
    assert_eq!(code, 0, "{out}");

    // Every problem listed with its key; any other command refuses and does nothing.
    std::fs::write(
        &file,
        "drift-interval-ms = \"often\"\nserver = [\"a:1\"]\nbogus = 1\nstate_dir = \"/x\"\n",
    )
    .unwrap();
    let (code, out, err) = agent(&["--config", path, "config", "check"], &[]);
    assert_eq!(code, 1, "{out}{err}");
    for key in ["drift-interval-ms", "server", "bogus", "state_dir"] {
        assert!(out.contains(&format!("{path}: {key}: ")), "no problem names {key}: {out}");
    }
    assert!(out.contains("did you mean \"state-dir\""), "{out}");
    let (code, _, err) = agent(&["--config", path, "status"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nothing was done"), "{err}");
    // The kill switch works anyway (in a network namespace of its own), warning of each.
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(&file, format!("bogus = 1\nstate-dir = \"{}\"\n", state.display())).unwrap();
    let out = Command::new("unshare").args(["--net", AGENT, "--config", path, "down"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("bogus") && err.contains("ignored by the kill switch"), "{err}");
    assert!(state.join("down").exists(), "down recorded itself under the file's state-dir");
    // Without a file and without --server, `run` could not start: check says so.
    let (code, out, _) = agent(&["--config", "/nonexistent/agent.toml", "config", "check"], &[]);
    assert_eq!(code, 1);
    assert!(out.contains("cannot be read"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SIGHUP to a running agent (in a network namespace of its own, not enrolled, so it keeps
/// redialing): the file read again, a new log level in force, the settings that need a restart
/// named, a file with problems reported and nothing changed, and the agent running throughout.
#[test]
fn agent_reloads_its_configuration_on_sighup() {
    use std::io::{BufRead as _, BufReader};
    let dir = std::env::temp_dir().join(format!("iw-agent-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("agent.toml");
    let state = dir.join("state");
    let write = |extra: &str| {
        std::fs::write(
            &file,
            format!("server = \"127.0.0.1:9\"\nstate-dir = \"{}\"\n{extra}", state.display()),
        )
        .unwrap()
    };
    write("log-level = \"warn\"\n");
    /// The agent, killed by its PID if the test fails first.
    struct Running(std::process::Child);
    impl Drop for Running {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut agent = Running(
        Command::new("unshare")
            .args(["--net", AGENT, "--config", file.to_str().unwrap(), "run"])
            .env_remove("RUST_LOG")
            .env_remove("INNERWALL_AGENT_LOG")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // `unshare` execs the agent: the child's PID is the agent's.
    let pid = libc::pid_t::try_from(agent.0.id()).unwrap();
    #[allow(unsafe_code)]
    let signal = move |signal| {
        // SAFETY: kill(2) on our own child, not reaped yet.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    };
    let mut lines = BufReader::new(agent.0.stderr.take().unwrap()).lines().map_while(Result::ok);
    let mut until = |what: &str| -> String {
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            if line.contains(what) {
                return line;
            }
            seen.push(line);
        }
        panic!("the agent's log ended without {what:?}:\n{}", seen.join("\n"));
    };
    // At warn, the dial failures are logged and the agent's info lines are not.
    until("dial attempt 1");
    let hup = || signal(libc::SIGHUP);

    write("log-level = \"info\"\ndrift-interval-ms = 500\n");
    hup();
    let said = until("SIGHUP");
    assert!(said.contains("log-level warn → info"), "{said}");
    assert!(said.contains("in force only after a restart: drift-interval-ms"), "{said}");
    // Info lines now come through: the next reload's own line is one (drift-interval-ms is
    // back to what is in force, so nothing needs a restart).
    write("log-level = \"info\"\n");
    hup();
    let said = until("SIGHUP");
    assert!(said.contains("INFO") && said.contains("nothing changed") && !said.contains("restart"), "{said}");

    write("bogus = 1\n");
    hup();
    let said = until("SIGHUP");
    assert!(said.contains("nothing reloaded") && said.contains("bogus"), "{said}");
    // Still running, and still at info: a later reload answers.
    write("log-level = \"info\"\n");
    hup();
    let said = until("SIGHUP");
    assert!(said.contains("nothing changed") && !said.contains("restart"), "{said}");
    assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited");
    signal(libc::SIGTERM);
    assert!(agent.0.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).unwrap();
}
