//! The control plane's configuration file (issue 32, RUN-6) through the real binary: flag >
//! environment > file > default, every problem listed by `config check` and nothing done by
//! another command while there is one, and a SIGHUP that changes a limit of a running `serve`.

use std::path::Path;
use std::process::Command;

use innerwall_control_plane::api::problem::ProblemType;
use innerwall_control_plane::identity::operators::Role;
use innerwall_control_plane::testing::fresh_database;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::foresight_api::{Serve, mint};

/// `innerwall ARGS` with only `env` of the INNERWALL_ variables set: (status, stdout, stderr).
fn innerwall(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_innerwall"));
    for (name, _) in std::env::vars() {
        if name.starts_with("INNERWALL_") {
            command.env_remove(name);
        }
    }
    let out = command.args(args).envs(env.iter().copied()).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

/// `config show --effective --json` as a map: key → (values joined by ",", source).
fn effective(args: &[&str], env: &[(&str, &str)]) -> std::collections::BTreeMap<String, (String, String)> {
    let mut all = vec!["--json"];
    all.extend(args);
    all.extend(["config", "show", "--effective"]);
    let (code, out, err) = innerwall(&all, env);
    assert_eq!(code, 0, "{out}{err}");
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    rows.iter()
        .map(|r| {
            let values = r["values"].as_array().map_or("(hidden)".to_owned(), |v| {
                v.iter().map(|x| x.as_str().unwrap().to_owned()).collect::<Vec<_>>().join(",")
            });
            (r["key"].as_str().unwrap().to_owned(), (values, r["source"].as_str().unwrap().to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn config_files_are_checked() {
    let dir = std::env::temp_dir().join(format!("iw-config-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("innerwall.toml");
    let path = file.to_str().unwrap();

    // Precedence: flag > environment > file > default, each value's source said.
    write(
        &file,
        "listen = \"127.0.0.1:7001\"\nlog-level = \"info\"\napi-requests-per-minute = 5\n\
         server-name = [\"cp.example\", \"10.0.0.1\"]\ndatabase-url = \"postgres://iw:secret@db/iw\"\n",
    );
    let shown = effective(
        &["--config", path, "--log-level", "debug"],
        &[("INNERWALL_LOG", "trace"), ("INNERWALL_LISTEN", "127.0.0.1:7002")],
    );
    let file_source = format!("file {path}");
    assert_eq!(
        shown["log-level"],
        ("debug".into(), "flag".into()),
        "the flag beats the variable and the file"
    );
    assert_eq!(shown["listen"], ("127.0.0.1:7002".into(), "env INNERWALL_LISTEN".into()));
    assert_eq!(shown["api-requests-per-minute"], ("5".into(), file_source.clone()));
    assert_eq!(shown["server-name"], ("cp.example,10.0.0.1".into(), file_source.clone()));
    assert_eq!(shown["heartbeat-interval"], ("30s".into(), "default".into()));
    assert_eq!(
        shown["database-url"],
        ("(hidden)".into(), file_source.clone()),
        "a URL with a password is not shown"
    );
    // The file named by the variable instead of the flag reads the same.
    let by_variable = effective(&[], &[("INNERWALL_CONFIG", path)]);
    assert_eq!(by_variable["log-level"], ("info".into(), file_source.clone()));
    assert_eq!(by_variable["listen"], ("127.0.0.1:7001".into(), file_source.clone()));
    let (code, out, _) = innerwall(&["--config", path, "config", "check"], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ok:") && out.contains("5 key(s)"), "{out}");

    // Every problem listed, each naming its key and the file; any other command does nothing.
    write(
        &file,
        "bogus = 1\napi_max_body = 3\nheartbeat-interval = \"soon\"\napi-max-connections = [1]\n\
         json = true\nagent-uploads-per-minute = 0\n",
    );
    let (code, out, err) = innerwall(&["--config", path, "config", "check"], &[]);
    assert_eq!(code, 1, "{out}{err}");
    let problems: Vec<&str> = out.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(problems.len(), 6, "{out}");
    for key in [
        "bogus",
        "api_max_body",
        "heartbeat-interval",
        "api-max-connections",
        "json",
        "agent-uploads-per-minute",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(&format!("{path}: {key}: "))),
            "no problem names {key}: {out}"
        );
    }
    assert!(out.contains("did you mean \"api-max-body\""), "{out}");
    assert!(err.contains("6 problem(s)"), "{err}");
    let state = dir.join("state");
    let (code, _, err) =
        innerwall(&["--config", path, "--state-dir", state.to_str().unwrap(), "--init", "migrate"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nothing was done") && err.contains("bogus"), "{err}");
    assert!(!state.exists(), "a refused configuration created nothing");
    // A value the service would refuse as a whole, and a file that is not TOML.
    write(&file, "flow-retention = \"36h\"\n");
    let (code, out, _) = innerwall(&["--config", path, "config", "check"], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("--flow-retention must be a whole number of days"), "{out}");
    write(&file, "listen = \n");
    let (code, out, _) = innerwall(&["--config", path, "--json", "config", "check"], &[]);
    assert_eq!(code, 1, "{out}");
    let doc: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(doc["ok"], false);
    assert!(doc["problems"][0].as_str().unwrap().contains("is not valid TOML"), "{doc}");
    // A file named but missing is a problem; the default one missing is not.
    let (code, _, err) = innerwall(&["--config", "/nonexistent/innerwall.toml", "contract"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot be read"), "{err}");

    // SIGHUP: a limit raised in the file takes effect in a running serve, a key that needs a
    // restart is named, and a broken file changes nothing.
    write(&file, "api-requests-per-minute = 1000\n");
    let db = fresh_database().await.unwrap();
    let viewer = mint(&db.pool, "vera", Role::Viewer).await;
    let serve = Serve::start_with(&db.url, &["--config", path], &[]);
    let services = "/api/v1/services";
    assert_eq!(serve.get(services, &viewer).await.status, 200);
    write(&file, "api-requests-per-minute = 1\nheartbeat-interval = \"20s\"\n");
    kill(Pid::from_raw(serve.pid()), Signal::SIGHUP).unwrap();
    let said = serve.wait_for_line("configuration reloaded");
    assert!(said.contains("applied api-requests-per-minute"), "{said}");
    assert!(said.contains("not applied until a restart: heartbeat-interval"), "{said}");
    // The token's bucket held 999 of 1,000; now it holds at most 1: one more passes, the next
    // is refused naming the new bound (at the old one it would have passed).
    assert_eq!(serve.get(services, &viewer).await.status, 200);
    let refused = serve.get(services, &viewer).await.problem(429, ProblemType::RateLimited);
    assert!(refused["detail"].as_str().unwrap().contains("more than 1 requests"), "{refused}");
    write(&file, "api-requests-per-minute = 0\n");
    kill(Pid::from_raw(serve.pid()), Signal::SIGHUP).unwrap();
    let said = serve.wait_for_line("reload refused");
    assert!(said.contains("nothing changed") && said.contains("api-requests-per-minute"), "{said}");
    write(&file, "api-requests-per-minute = 1\nheartbeat-interval = \"20s\"\n");
    kill(Pid::from_raw(serve.pid()), Signal::SIGHUP).unwrap();
    let said = serve.wait_for_line("configuration reloaded");
    assert!(said.contains("not applied until a restart: heartbeat-interval"), "{said}");
    assert!(!said.contains("applied api-requests-per-minute"), "the refused reload changed nothing: {said}");
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
}
