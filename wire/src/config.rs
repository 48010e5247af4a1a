//! Configuration files for both binaries (RUN-6, issue 32): one TOML file whose keys are the
//! long names of the flags it may set — the service command's (`serve`, `run`) and the listed
//! global ones — so that every key is also a flag and, where the flag has one, an `INNERWALL_*`
//! variable. Precedence is flag > environment > file > default: a file's value becomes its
//! flag's default before the command line is parsed, so clap's own order does the rest, and
//! every value is checked by the flag's own parser.
//!
//! The file is `--config PATH` (or its variable), else the default path if it exists. A key
//! that names no such flag, a value of the wrong shape, and a value the flag's parser refuses
//! are each a [`Problem`] naming the key and the file; [`load`] collects all of them, so `config
//! check` lists every one. Secrets have no key: they are read from files or standard input.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

/// The most bytes a configuration file may hold.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// What one binary's file configures.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Read when neither `--config` nor [`Spec::env`] names a file, if it exists.
    pub default_path: &'static str,
    /// The variable naming the file.
    pub env: &'static str,
    /// The service's subcommand, all of whose flags are keys (hidden ones aside).
    pub service: &'static str,
    /// Ids of the top-level flags that are keys too.
    pub globals: &'static [&'static str],
    /// Other subcommands whose flags of the same name take the file's values (the agent's
    /// `enroll` and `status` read the same `state-dir` as `run`).
    pub shared_with: &'static [&'static str],
}

/// One thing wrong with a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// The key, when the problem is one key's.
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) => write!(f, "{}: {key}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

/// A file's values, each checked, by flag id; and what was wrong with the rest.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    pub path: Option<PathBuf>,
    /// Flag id → the values its key gave.
    pub values: BTreeMap<String, Vec<String>>,
    pub problems: Vec<Problem>,
}

/// Where a value in force came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
    File(PathBuf),
    Default,
    Unset,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag => f.write_str("flag"),
            Source::Env(name) => write!(f, "env {name}"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Default => f.write_str("default"),
            Source::Unset => f.write_str("unset"),
        }
    }
}

/// One key's value in force, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    pub key: String,
    /// The values as given (`None` for a flag whose values are hidden, a secret's).
    pub values: Option<Vec<String>>,
    pub source: Source,
}

/// The file `argv` and the environment name: `--config PATH` (or `--config=PATH`) before any
/// `--`, else [`Spec::env`]; `None` with neither (the default path, if it exists, is read).
fn named_path(spec: &Spec, argv: &[OsString]) -> Option<PathBuf> {
    let mut args = argv.iter().skip(1).take_while(|a| *a != "--");
    while let Some(arg) = args.next() {
        if arg == "--config" {
            return args.next().map(PathBuf::from);
        }
        if let Some(path) = arg.to_str().and_then(|a| a.strip_prefix("--config=")) {
            return Some(PathBuf::from(path));
        }
    }
    std::env::var_os(spec.env).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The flags a file may set: the service command's visible ones and the listed globals, by
/// long name.
fn keys<'c>(spec: &Spec, command: &'c Command) -> BTreeMap<&'c str, &'c Arg> {
    let visible = |a: &&Arg| !a.is_hide_set() && a.get_long().is_some_and(|l| l != "config" && l != "help");
    let service = command.get_subcommands().find(|c| c.get_name() == spec.service);
    let globals = command.get_arguments().filter(|a| spec.globals.contains(&a.get_id().as_str()));
    service
        .into_iter()
        .flat_map(Command::get_arguments)
        .filter(visible)
        .chain(globals)
        .filter_map(|a| Some((a.get_long()?, a)))
        .collect()
}

/// Reads and checks the file `argv` names (or the default one): every key known, every value
/// of its flag's shape and accepted by its parser. A file that cannot be read or parsed is one
/// problem; nothing of it is used.
pub fn load(spec: &Spec, command: &Command, argv: &[OsString]) -> Layer {
    let (path, named) = match named_path(spec, argv) {
        Some(path) => (path, true),
        None => (PathBuf::from(spec.default_path), false),
    };
    let mut layer = Layer { path: Some(path.clone()), ..Layer::default() };
    let problem = |key: Option<&str>, message: String| Problem {
        file: path.clone(),
        key: key.map(str::to_owned),
        message,
    };
    let text = match read_bounded(&path) {
        Ok(text) => text,
        Err(e) if !named && e.kind() == std::io::ErrorKind::NotFound => return Layer::default(),
        Err(e) => {
            layer.problems.push(problem(None, format!("cannot be read: {e}")));
            return layer;
        }
    };
    let table: toml::Table = match toml::from_str(&text) {
        Ok(table) => table,
        Err(e) => {
            layer.problems.push(problem(None, format!("is not valid TOML: {}", e.to_string().trim_end())));
            return layer;
        }
    };
    let keys = keys(spec, command);
    for (key, value) in &table {
        let Some(arg) = keys.get(key.as_str()) else {
            let message = if key.contains('_') && keys.contains_key(key.replace('_', "-").as_str()) {
                format!("no such key; did you mean {:?}?", key.replace('_', "-"))
            } else {
                format!("no such key (the keys are the long names of `{}`'s flags)", spec.service)
            };
            layer.problems.push(problem(Some(key), message));
            continue;
        };
        match values(arg, value).and_then(|values| check(arg, &values).map(|()| values)) {
            Ok(values) => {
                layer.values.insert(arg.get_id().to_string(), values);
            }
            Err(message) => layer.problems.push(problem(Some(key), message)),
        }
    }
    layer
}

fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?.take(MAX_FILE_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    Ok(text)
}

fn takes_many(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append)
}

fn is_switch(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse)
}

/// A TOML value as the strings the command line would give.
fn values(arg: &Arg, value: &toml::Value) -> Result<Vec<String>, String> {
    let scalar = |value: &toml::Value| match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!("a {} is not a value here", other.type_str())),
    };
    match value {
        toml::Value::Array(items) if takes_many(arg) => items.iter().map(scalar).collect(),
        toml::Value::Array(_) => Err("takes one value, not a list".to_owned()),
        toml::Value::Boolean(_) if is_switch(arg) => Ok(vec![scalar(value)?]),
        _ if is_switch(arg) => Err("is a switch: true or false".to_owned()),
        value => Ok(vec![scalar(value)?]),
    }
}

/// Whether the flag's own parser takes `values`.
fn check(arg: &Arg, values: &[String]) -> Result<(), String> {
    let long = arg.get_long().unwrap_or_default();
    let probe = Arg::new("value")
        .long(long.to_owned())
        .action(ArgAction::Append)
        .value_parser(arg.get_value_parser().clone());
    let mut argv = vec![OsString::from("check")];
    for value in values {
        argv.push(format!("--{long}").into());
        argv.push(value.into());
    }
    Command::new("check").arg(probe).try_get_matches_from(argv).map(|_| ()).map_err(|e| clap_problem(&e))
}

/// `command` with the file's values as its flags' defaults (and a flag the file sets no longer
/// required: clap counts only flags and variables as given).
pub fn apply(spec: &Spec, command: Command, layer: &Layer) -> Command {
    let set = |arg: Arg, values: &[String]| -> Arg {
        let arg = arg.required(false);
        if takes_many(&arg) {
            arg.default_values(values.iter().map(|v| clap::builder::OsStr::from(v.clone())))
        } else {
            arg.default_value(values.first().cloned().unwrap_or_default())
        }
    };
    let mut command = command;
    let takers: Vec<(String, Vec<String>)> = command
        .get_subcommands()
        .filter(|c| c.get_name() == spec.service || spec.shared_with.contains(&c.get_name()))
        .map(|c| (c.get_name().to_owned(), c.get_arguments().map(|a| a.get_id().to_string()).collect()))
        .collect();
    for (id, values) in &layer.values {
        if spec.globals.contains(&id.as_str()) {
            command = command.mut_arg(id, |a| set(a, values));
            continue;
        }
        for (name, ids) in &takers {
            if ids.contains(id) {
                command = command.mut_subcommand(name, |c| c.mut_arg(id, |a| set(a, values)));
            }
        }
    }
    command
}

/// `argv` parsed with the file under it ([`load`], [`apply`]): the matches and the file. A
/// usage error prints the file's problems, then clap's message, and exits.
pub fn parse(spec: &Spec, command: fn() -> Command, argv: &[OsString]) -> (ArgMatches, Layer) {
    let layer = load(spec, &command(), argv);
    let matches = apply(spec, command(), &layer).try_get_matches_from(argv).unwrap_or_else(|e| {
        print_problems(&layer, "error", "");
        e.exit()
    });
    (matches, layer)
}

/// Each of the file's problems on stderr, as `{level}: {problem}{suffix}`.
pub fn print_problems(layer: &Layer, level: &str, suffix: &str) {
    for problem in &layer.problems {
        eprintln!("{level}: {problem}{suffix}");
    }
}

/// Refuses a command while the file has problems: prints them and what to run, and returns
/// the exit status (2).
pub fn refuse(layer: &Layer, binary: &str) -> std::process::ExitCode {
    print_problems(layer, "error", "");
    eprintln!(
        "{binary}: the configuration has {} problem(s); nothing was done (`{binary} config check` lists them)",
        layer.problems.len()
    );
    std::process::ExitCode::from(2)
}

/// `argv` of a `config …` command as the service's command line it stands for: the flags
/// before `config`, then the service's subcommand.
pub fn service_argv(spec: &Spec, argv: &[OsString]) -> Vec<OsString> {
    let at = argv.iter().position(|a| a == "config").unwrap_or(argv.len());
    argv[..at].iter().cloned().chain([OsString::from(spec.service)]).collect()
}

/// A clap error as one line, for a list of problems: what it says before its usage and tips.
pub fn clap_problem(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let said: Vec<&str> =
        text.lines().map(str::trim).take_while(|l| !l.is_empty() && !l.starts_with("Usage:")).collect();
    said.join(" ").trim_start_matches("error: ").to_owned()
}

/// Each key's value in force after `matches` (of the service command, globals included), and
/// where it came from.
pub fn effective(spec: &Spec, command: &Command, layer: &Layer, matches: &ArgMatches) -> Vec<Setting> {
    keys(spec, command)
        .into_iter()
        .map(|(key, arg)| {
            let id = arg.get_id().as_str();
            let source = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => {
                    Source::Env(arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default())
                }
                Some(ValueSource::DefaultValue) if layer.values.contains_key(id) => {
                    Source::File(layer.path.clone().unwrap_or_default())
                }
                Some(ValueSource::DefaultValue) => Source::Default,
                _ => Source::Unset,
            };
            let raw = matches.try_get_raw(id).ok().flatten();
            let values =
                raw.map(|v| v.map(OsStr::to_string_lossy).map(|v| v.into_owned()).collect::<Vec<_>>());
            let values = if arg.is_hide_env_values_set() { None } else { values.or(Some(Vec::new())) };
            Setting { key: key.to_owned(), values, source }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[arg(long, global = true)]
        config: Option<PathBuf>,
        #[arg(long, global = true, env = "CONFIG_TEST_STATE", default_value = "/var/lib/x")]
        state_dir: PathBuf,
        #[arg(long, global = true)]
        json: bool,
        #[command(subcommand)]
        command: Cmd,
    }

    #[derive(Debug, Subcommand)]
    enum Cmd {
        Serve {
            #[arg(long)]
            server: String,
            #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
            max_body: u32,
            #[arg(long)]
            server_name: Vec<String>,
            #[arg(long)]
            verbose: bool,
            #[arg(long, env = "CONFIG_TEST_LIMIT", default_value_t = 5)]
            limit: u32,
            #[arg(long, hide = true, default_value_t = 1)]
            knob: u32,
        },
        Other,
    }

    const SPEC: Spec = Spec {
        default_path: "/nonexistent/x.toml",
        env: "CONFIG_TEST_FILE",
        service: "serve",
        globals: &["state_dir"],
        shared_with: &[],
    };

    fn file(text: &str) -> (tempfile_path::Guard, Vec<OsString>) {
        let guard = tempfile_path::write(text);
        let argv = vec!["x".into(), "--config".into(), guard.0.clone().into_os_string(), "serve".into()];
        (guard, argv)
    }

    /// A file in the system's temporary directory, removed on drop.
    mod tempfile_path {
        pub struct Guard(pub std::path::PathBuf);
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        pub fn write(text: &str) -> Guard {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("config-test-{}-{n}.toml", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Guard(path)
        }
    }

    fn parse(argv: &[OsString], layer: &Layer) -> (Cli, Vec<Setting>) {
        let command = apply(&SPEC, Cli::command(), layer);
        let matches = command.clone().try_get_matches_from(argv).unwrap();
        let cli = Cli::from_arg_matches(&matches).unwrap();
        let (_, serve) = matches.subcommand().unwrap();
        (cli, effective(&SPEC, &command, layer, serve))
    }

    #[test]
    fn a_file_fills_what_flags_leave_and_says_so() {
        let (_f, mut argv) = file(
            "server = \"cp:7443\"\nmax-body = 20\nserver-name = [\"a\", \"b\"]\nverbose = true\nstate-dir = \"/srv\"\n",
        );
        argv.extend(["--max-body".into(), "30".into()]);
        let layer = load(&SPEC, &Cli::command(), &argv);
        assert!(layer.problems.is_empty(), "{:?}", layer.problems);
        let (cli, settings) = parse(&argv, &layer);
        let Cmd::Serve { server, max_body, server_name, verbose, limit, .. } = cli.command else { panic!() };
        assert_eq!((server.as_str(), max_body, verbose, limit), ("cp:7443", 30, true, 5));
        assert_eq!(server_name, ["a", "b"]);
        assert_eq!(cli.state_dir, PathBuf::from("/srv"));
        let source = |key: &str| settings.iter().find(|s| s.key == key).unwrap().source.clone();
        assert_eq!(source("max-body"), Source::Flag);
        assert!(matches!(source("server"), Source::File(_)));
        assert_eq!(source("limit"), Source::Default);
        assert!(matches!(source("state-dir"), Source::File(_)));
        assert!(
            settings.iter().all(|s| s.key != "knob" && s.key != "json"),
            "hidden and unlisted flags are no keys"
        );
    }

    #[test]
    fn every_problem_is_listed_with_its_key() {
        let (_f, argv) = file(
            "serve = 1\nmax_body = 3\nmax-body = 0\nserver-name = \"one\"\nverbose = \"yes\"\nknob = 2\njson = true\nserver = [\"a\"]\n",
        );
        let layer = load(&SPEC, &Cli::command(), &argv);
        let keys: Vec<_> = layer.problems.iter().map(|p| p.key.clone().unwrap()).collect();
        assert_eq!(
            keys,
            ["json", "knob", "max-body", "max_body", "serve", "server", "verbose"],
            "{:?}",
            layer.problems
        );
        let said =
            |key: &str| layer.problems.iter().find(|p| p.key.as_deref() == Some(key)).unwrap().to_string();
        assert!(said("max_body").contains("did you mean \"max-body\""), "{}", said("max_body"));
        assert!(said("max-body").contains("0 is not in 1.."), "{}", said("max-body"));
        assert!(said("verbose").contains("true or false"), "{}", said("verbose"));
        assert!(said("server").contains("one value"), "{}", said("server"));
        assert!(said("serve").contains(&layer.path.clone().unwrap().display().to_string()));
        // A single string where a list is taken is one item.
        assert!(layer.values.get("server_name").is_some_and(|v| v == &["one"]));
    }

    #[test]
    fn a_named_file_must_exist_and_parse_the_default_may_be_absent() {
        let argv: Vec<OsString> = vec!["x".into(), "--config=/nonexistent/named.toml".into(), "serve".into()];
        let layer = load(&SPEC, &Cli::command(), &argv);
        assert_eq!(layer.problems.len(), 1, "{:?}", layer.problems);
        assert!(layer.problems[0].message.contains("cannot be read"));
        let absent = load(&SPEC, &Cli::command(), &["x".into(), "serve".into()]);
        assert!(absent.problems.is_empty() && absent.values.is_empty());
        let (_f, argv) = file("server = \"unterminated\n");
        let broken = load(&SPEC, &Cli::command(), &argv);
        assert!(broken.problems[0].message.contains("not valid TOML"), "{:?}", broken.problems);
        assert!(broken.values.is_empty());
    }
}
