//! Issue 12 part 6, `remote_cli_matches_local`: the same authoring script through the local CLI
//! (database A) and through `--api` against a real `innerwall serve --api-listen` (database B)
//! prints the same tables, messages and `--json`; a bad token is the 401 problem's detail and a
//! non-zero exit; a host-only command refuses `--api`.
//!
//! Two databases rather than one with distinct names, so the outputs can be compared byte for
//! byte with nothing normalized: the script creates no workloads, so no id, timestamp or actor
//! reaches the compared output (the audit log, which names the actor, is not printed).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use innerwall_control_plane::identity::ca::Signer as _;
use innerwall_control_plane::sync::gateway::GatewayConfig;

use crate::plane::Plane;

/// `innerwall serve` with the API on; killed on drop.
pub(crate) struct Serve {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Serve {
    /// `serve` on `plane` with its API on a free loopback port: the server, the API's URL, and
    /// the path of the CA bundle to pass as `--api-ca`.
    pub(crate) fn api(plane: &Plane) -> (Serve, String, String) {
        std::fs::create_dir_all(&plane.dir).unwrap();
        let ca = plane.dir.join("api-ca.pem");
        std::fs::write(&ca, plane.signer.ca_bundle_pem()).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let serve = Serve::start(plane, &format!("127.0.0.1:{port}"));
        (serve, format!("https://localhost:{port}"), ca.to_str().unwrap().to_owned())
    }

    fn start(plane: &Plane, api: &str) -> Serve {
        let mut child = Command::new(innerwall_e2e::workspace_bin("innerwall"))
            .args(["--database-url", &plane.db.url, "--ca-dir"])
            .arg(plane.dir.join("ca"))
            .args(["serve", "--listen", "127.0.0.1:0", "--server-name", "localhost", "--api-listen", api])
            .env("INNERWALL_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning innerwall serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let serve = Serve { child, lines };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        loop {
            match serve.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("operator API on https://") => return serve,
                Ok(line) => seen.push(line),
                Err(_) => panic!("serve never announced its API; it logged:\n{}", seen.join("\n")),
            }
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `innerwall <args>`: exit code, stdout, stderr. `INNERWALL_*` from the test's environment
/// never leaks in.
pub(crate) fn innerwall(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut command = Command::new(innerwall_e2e::workspace_bin("innerwall"));
    for var in [
        "INNERWALL_API",
        "INNERWALL_TOKEN",
        "INNERWALL_API_TOKEN",
        "INNERWALL_API_CA",
        "INNERWALL_DATABASE_URL",
    ] {
        command.env_remove(var);
    }
    let out = command.args(args).envs(env.iter().copied()).output().expect("running innerwall");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const RULESET: &str = "name: web-in
description: the web tier
scope: {app: [web]}
rules:
  - name: from-vpn
    peers: [{address_group: vpn}]
    services: [https]
  - name: from-api
    peers: [{workloads: {app: [api]}}, {cidr: 10.9.0.0/16}]
    services: [https, dns]
";

/// The authoring script: each step's arguments (after the mode's global flags).
fn script(file: &str) -> Vec<Vec<String>> {
    let steps: &[&[&str]] = &[
        &["service", "create", "https", "--entry", "tcp:443", "--entry", "udp:443", "--description", "web"],
        &["service", "create", "dns", "--entry", "udp:53", "--entry", "tcp:53"],
        &[
            "service",
            "update",
            "dns",
            "--entry",
            "udp:53",
            "--description",
            "resolvers",
            "--expect-version",
            "1",
        ],
        &["service", "list"],
        &["service", "show", "dns"],
        &["address-group", "create", "vpn", "--cidr", "10.8.0.0/16", "--cidr", "fd08::/48"],
        &[
            "address-group",
            "update",
            "vpn",
            "--cidr",
            "10.8.0.0/16",
            "--cidr",
            "10.7.0.1/32",
            "--expect-version",
            "1",
        ],
        &["address-group", "list"],
        &["ruleset", "create", "--file", file],
        &["ruleset", "list"],
        &["ruleset", "show", "web-in"],
        &["ruleset", "update", "--file", file, "--expect-version", "1"],
        &["service", "create", "spare", "--entry", "icmp"],
        &["service", "delete", "spare", "--expect-version", "1"],
        &["service", "list"],
    ];
    steps.iter().map(|s| s.iter().map(|a| (*a).to_owned()).collect()).collect()
}

/// Steps that must fail the same way in both modes: the message and the non-zero exit.
fn failing() -> Vec<Vec<String>> {
    let steps: &[&[&str]] = &[
        &["service", "create", "https", "--entry", "tcp:443"],
        &["service", "update", "dns", "--entry", "udp:53", "--expect-version", "1"],
        &["service", "delete", "https"],
        &["service", "show", "nope"],
        &["address-group", "create", "lab", "--cidr", "10.7.0.1/8"],
        &["ruleset", "show", "nope"],
    ];
    steps.iter().map(|s| s.iter().map(|a| (*a).to_owned()).collect()).collect()
}

/// Runs the script in one mode, with and without `--json`: every step's stdout, and every
/// failing step's exit code and last stderr line.
fn run(global: &[String], file: &str) -> Vec<String> {
    let mut outputs = Vec::new();
    for json in [false, true] {
        for step in script(file) {
            let mut args: Vec<&str> = global.iter().map(String::as_str).collect();
            if json {
                args.push("--json");
            }
            args.extend(step.iter().map(String::as_str));
            // Writes run once (without --json); with --json only the reads are repeated.
            let write = ["create", "update", "delete"].contains(&step[1].as_str());
            if json && write {
                continue;
            }
            let (code, stdout, stderr) = innerwall(&args, &[]);
            assert_eq!(code, Some(0), "{args:?}: {stderr}");
            outputs.push(format!("$ {}\n{stdout}", step.join(" ")));
        }
    }
    for step in failing() {
        let mut args: Vec<&str> = global.iter().map(String::as_str).collect();
        args.extend(step.iter().map(String::as_str));
        let (code, stdout, stderr) = innerwall(&args, &[]);
        assert_ne!(code, Some(0), "{args:?} should fail: {stdout}");
        let message = stderr.lines().last().unwrap_or_default();
        let message = message.split_once("error: ").map_or(message, |(_, m)| m);
        outputs.push(format!("$ {} -> {code:?}: {message}", step.join(" ")));
    }
    outputs
}

#[tokio::test]
async fn remote_cli_matches_local() {
    let local = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    let remote = Plane::create(Duration::from_secs(3600), GatewayConfig::default()).await;
    std::fs::create_dir_all(&remote.dir).unwrap();
    let file = remote.dir.join("web-in.yaml");
    std::fs::write(&file, RULESET).unwrap();
    let file = file.to_str().unwrap();
    let (_serve, api, ca) = Serve::api(&remote);
    let ca = ca.as_str();

    let token = mint_token(&remote, "e2e-editor", "editor");

    let local_flags = vec!["--database-url".to_owned(), local.db.url.clone()];
    let token_file = token_file(&remote, &token);
    let remote_flags: Vec<String> = ["--api", &api, "--token-file", &token_file, "--api-ca", ca]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let by_db = run(&local_flags, file);
    let by_api = run(&remote_flags, file);
    assert_eq!(by_db.len(), by_api.len());
    for (db, api) in by_db.iter().zip(&by_api) {
        assert_eq!(db, api, "local and remote differ");
    }
    // The script did what it says (guards against both modes printing the same nothing).
    let joined = by_api.join("\n");
    assert!(joined.contains("ruleset web-in updated (version 2)"), "{joined}");
    assert!(joined.contains("\"name\": \"from-api\""), "{joined}");
    assert!(joined.contains("service \"nope\" not found"), "{joined}");

    // The same token is never on the command line's help or the environment's echo.
    let (_, help, _) = innerwall(&["--help"], &[("INNERWALL_API_TOKEN", &token)]);
    assert!(!help.contains(&token), "{help}");

    // A bad token: the 401 problem's detail as the error, exit 1.
    let (code, stdout, stderr) = innerwall(
        &["--api", &api, "--api-ca", ca, "service", "list"],
        &[("INNERWALL_API_TOKEN", "iwo_not-a-token")],
    );
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("error: ") && stderr.to_lowercase().contains("token"), "{stderr}");

    // Without --api-ca: what to pass.
    let (code, _, stderr) = innerwall(&["--api", &api, "--token-file", &token_file, "service", "list"], &[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("--api-ca"), "{stderr}");

    // Host-only commands refuse --api, also from the environment, before touching anything.
    for host_only in [&["migrate"][..], &["operator", "token", "list"], &["ca", "init"], &["contract"]] {
        let (code, _, stderr) =
            innerwall(host_only, &[("INNERWALL_API", &api), ("INNERWALL_API_TOKEN", &token)]);
        assert_eq!(code, Some(1), "{host_only:?}: {stderr}");
        assert!(stderr.contains("administers this host and does not take --api"), "{host_only:?}: {stderr}");
    }
}

/// `token` in a file of `plane`'s directory only its owner reads (mode 0600), for
/// `--token-file`: the CLI takes no secret as a flag.
pub(crate) fn token_file(plane: &Plane, token: &str) -> String {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(&plane.dir).unwrap();
    let path = plane.dir.join(format!("token-{}", uuid::Uuid::new_v4()));
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
    file.write_all(token.as_bytes()).unwrap();
    path.to_str().unwrap().to_owned()
}

/// An operator token with `role`, minted on `plane`'s host by the CLI.
pub(crate) fn mint_token(plane: &Plane, name: &str, role: &str) -> String {
    let (code, token, stderr) = innerwall(
        &[
            "--json",
            "--database-url",
            &plane.db.url,
            "operator",
            "token",
            "mint",
            "--name",
            name,
            "--role",
            role,
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let token: serde_json::Value = serde_json::from_str(&token).unwrap();
    token["token"].as_str().expect("the token").to_owned()
}
