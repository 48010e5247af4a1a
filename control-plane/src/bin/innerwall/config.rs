//! The configuration file (RUN-6): `/etc/innerwall/innerwall.toml` unless --config or
//! INNERWALL_CONFIG names another. Parsing it with the command line (flag, then environment,
//! then file, then default) is `innerwall_wire::config`'s; this module says which keys the
//! control plane's file has, refuses to run anything but `config check` while the file has a
//! problem, and runs `config check` and `config show`.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{ArgMatches, CommandFactory, FromArgMatches, Subcommand};
use innerwall_wire::config::{self, Layer, Setting, Spec};

use crate::serve::View;
use crate::{Cli, Command};

/// The control plane's file: `serve`'s flags, and the global flags a service sets.
pub const SPEC: Spec = Spec {
    default_path: "/etc/innerwall/innerwall.toml",
    env: "INNERWALL_CONFIG",
    service: "serve",
    globals: &[
        "database_url",
        "state_dir",
        "ca_dir",
        "max_rendered_entries",
        "max_rendered_bytes",
        "log_format",
        "log_level",
    ],
    shared_with: &["retention"],
};

#[derive(Debug, Subcommand)]
pub enum ConfigCmd {
    /// Check the file, with the environment, as `serve` would read it: every problem is listed,
    /// and the exit status is 1 if there is one.
    Check,
    /// Print the file's settings; with --effective, every value `serve` would run with and
    /// where it came from (flag, env, file, default).
    Show {
        #[arg(long)]
        effective: bool,
    },
}

/// The command line with the file under it. With a problem in the file, only `config check`
/// runs: anything else prints the problems and exits 2, having done nothing.
pub fn parse(argv: &[OsString]) -> Result<(Cli, Layer), ExitCode> {
    let (matches, layer) = config::parse(&SPEC, Cli::command, argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !layer.problems.is_empty() && !matches!(cli.command, Command::Config(ConfigCmd::Check)) {
        return Err(config::refuse(&layer, "innerwall"));
    }
    Ok((cli, layer))
}

/// `argv` (a `serve` command line) read again with the file as it is now: what a reload
/// would put in force, or every problem that refuses it.
pub fn view(argv: &[OsString]) -> Result<View, Vec<String>> {
    let layer = config::load(&SPEC, &Cli::command(), argv);
    let mut problems: Vec<String> = layer.problems.iter().map(ToString::to_string).collect();
    let command = config::apply(&SPEC, Cli::command(), &layer);
    let parsed = command
        .clone()
        .try_get_matches_from(argv)
        .and_then(|matches| Ok((Cli::from_arg_matches(&matches)?, matches)));
    match parsed {
        Err(e) => problems.push(config::clap_problem(&e)),
        Ok((cli, matches)) => {
            let Command::Serve(args) = cli.command else {
                return Err(vec!["not a `serve` command line".to_owned()]);
            };
            if let Err(e) = args.check() {
                problems.push(format!("{e:#}"));
            }
            if problems.is_empty() {
                let serve: &ArgMatches = matches.subcommand_matches("serve").unwrap_or(&matches);
                let settings = config::effective(&SPEC, &command, &layer, serve);
                return Ok(View { args, log_level: cli.log_level, settings });
            }
        }
    }
    Err(problems)
}

pub fn run(cmd: &ConfigCmd, argv: &[OsString], layer: &Layer, json: bool) -> anyhow::Result<()> {
    let file = layer.path.as_ref().map_or("(no file)".to_owned(), |p| p.display().to_string());
    match (cmd, view(&config::service_argv(&SPEC, argv))) {
        (ConfigCmd::Check, Err(problems)) => {
            if json {
                println!("{}", serde_json::json!({ "file": file, "ok": false, "problems": problems }));
            } else {
                for problem in &problems {
                    println!("error: {problem}");
                }
            }
            crate::output::flush();
            anyhow::bail!("{} problem(s); `serve` would not start with this configuration", problems.len())
        }
        (ConfigCmd::Check, Ok(_)) if json => {
            println!("{}", serde_json::json!({ "file": file, "ok": true, "problems": [] }));
        }
        (ConfigCmd::Check, Ok(_)) if layer.path.is_some() => {
            println!("ok: {file} ({} key(s)); `serve` would start with it", layer.values.len());
        }
        (ConfigCmd::Check, Ok(_)) => println!(
            "ok: no configuration file ({} does not exist); `serve` would run on flags, the environment and defaults",
            SPEC.default_path
        ),
        (ConfigCmd::Show { .. }, Err(problems)) => {
            anyhow::bail!("{}", problems.join("\n"))
        }
        (ConfigCmd::Show { effective }, Ok(view)) => {
            let shown: Vec<&Setting> = view
                .settings
                .iter()
                .filter(|s| *effective || matches!(s.source, config::Source::File(_)))
                .collect();
            print_settings(&shown, json);
        }
    }
    crate::output::flush();
    Ok(())
}

fn print_settings(settings: &[&Setting], json: bool) {
    let value = |s: &Setting| match &s.values {
        None => "(hidden)".to_owned(),
        Some(values) => values.join(","),
    };
    if json {
        let rows: Vec<_> = settings
            .iter()
            .map(|s| serde_json::json!({ "key": s.key, "values": s.values, "source": s.source.to_string() }))
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return;
    }
    let rows: Vec<Vec<String>> =
        settings.iter().map(|s| vec![s.key.clone(), value(s), s.source.to_string()]).collect();
    crate::output::print_table(&["KEY", "VALUE", "SOURCE"], rows);
}
