//! `innerwall-agent`: the privileged host agent's command line, a thin layer over the
//! `innerwall_agent` library (run, down, status, and the hidden apply-file / render-file).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use std::ffi::OsString;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use innerwall_agent::daemon;
use innerwall_agent::enforce::desired::DesiredTable;
use innerwall_agent::enforce::{self, DEFAULT_STATE_DIR, LinuxPolicyStore, PolicyStore as _, status};
use innerwall_agent::evidence::capture;
use innerwall_agent::identity::connect::RunConfig;
use innerwall_agent::policy_json;
use innerwall_wire::config;

#[derive(Debug, Parser)]
#[command(name = "innerwall-agent", version, about = "Innerwall host agent")]
struct Cli {
    /// The configuration file (TOML): its keys are the long names of `run`'s flags, and
    /// log-format and log-level; a flag or variable given wins over it (`state-dir` and
    /// `server` hold for `enroll`, `status`, `down` and `up` too). Default:
    /// /etc/innerwall/agent.toml, if it exists. `innerwall-agent config check` checks it.
    #[arg(long, env = "INNERWALL_AGENT_CONFIG", global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// How stderr logs read: text, or one JSON object per line (filter: --log-level).
    #[arg(long, global = true, value_enum, default_value_t)]
    log_format: LogFormat,
    /// Which log lines are written: a level or per-module directives
    /// (`info,innerwall_agent::sync=debug`). Given neither this nor its variable nor a file
    /// value, RUST_LOG is read, as before.
    #[arg(long, env = "INNERWALL_AGENT_LOG", global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

/// The agent's file: `run`'s flags and the logging ones.
const CONFIG: config::Spec = config::Spec {
    default_path: "/etc/innerwall/agent.toml",
    env: "INNERWALL_AGENT_CONFIG",
    service: "run",
    globals: &["log_format", "log_level"],
    shared_with: &["enroll", "down", "up", "status"],
};

/// `run`'s settings.
#[derive(Debug, Clone, PartialEq, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    state: StateDir,
    /// Control-plane address, HOST:PORT.
    #[arg(long, env = "INNERWALL_AGENT_SERVER")]
    server: String,
    /// How often the owned table is checked for outside changes, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    drift_interval_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics. Plain HTTP without authentication:
    /// bind it to loopback or a private address. Off by default.
    #[arg(long, env = "INNERWALL_AGENT_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// The local address the agent's connections to the control plane leave from, on a host with
    /// several (a firewall on the way may allow one). Default: the one the kernel picks.
    #[arg(long, env = "INNERWALL_AGENT_SOURCE_ADDRESS", value_name = "IP")]
    source_address: Option<std::net::IpAddr>,
    /// Capacity of the flow capture's connection table (who started each connection, so
    /// replies are not recorded as inbound), in entries of 112 bytes of kernel memory each.
    /// Default: 1/256 of the host's memory, within 65,536..=1,048,576 entries (8 GB: 299,593,
    /// 33 MB). When more connections than this come and go while a conversation is idle, its
    /// entry is evicted and its late replies are recorded as inbound: counted
    /// (innerwall_agent_capture_udp_reply_like_unmatched_total) and reported as a
    /// suspect-direction gap on the window.
    #[arg(
        long,
        env = "INNERWALL_AGENT_CONN_TABLE_ENTRIES",
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(
            i64::from(capture::MIN_CONN_ENTRIES)..=i64::from(capture::MAX_CONN_ENTRIES)
        )
    )]
    conn_table_entries: Option<u32>,
    /// Testing: decode policy-stream messages only up to this many bytes (never more than
    /// the contract's largest message), to see an update this agent cannot read reported.
    #[arg(long, env = "INNERWALL_AGENT_MAX_POLICY_MESSAGE", hide = true, value_name = "BYTES",
          default_value_t = innerwall_wire::sync::MAX_POLICY_MESSAGE)]
    max_policy_message: usize,
}

#[derive(Debug, Subcommand)]
enum ConfigCmd {
    /// Check the file, with the environment, as `run` would read it: every problem is listed,
    /// and the exit status is 1 if there is one.
    Check,
    /// Print the file's settings; with --effective, every value `run` would use and where it
    /// came from (flag, env, file, default).
    Show {
        #[arg(long)]
        effective: bool,
    },
}

/// The command line with the file under it, and whether the log level was given. With a
/// problem in the file only `config check` and the kill switch (`down`, on the file's valid
/// keys) run: anything else prints the problems and exits 2.
fn parse(argv: &[OsString]) -> Result<(Cli, config::Layer, bool), ExitCode> {
    let (matches, layer) = config::parse(&CONFIG, Cli::command, argv);
    let level_given =
        matches.value_source("log_level").is_some_and(|s| s != clap::parser::ValueSource::DefaultValue)
            || layer.values.contains_key("log_level");
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Command::Enroll { token: Some(_), .. } = &cli.command {
        refuse_token_flag();
    }
    // The kill switch works whatever the file says: its problems are warnings there.
    if !layer.problems.is_empty() && matches!(cli.command, Command::Down { .. }) {
        config::print_problems(&layer, "warning", " (ignored by the kill switch)");
        return Ok((cli, layer, level_given));
    }
    if !layer.problems.is_empty() && !matches!(cli.command, Command::Config(ConfigCmd::Check)) {
        return Err(config::refuse(&layer, "innerwall-agent"));
    }
    Ok((cli, layer, level_given))
}

/// `config check` and `config show`, on the `run` command line the file and environment make.
fn config_command(cmd: &ConfigCmd, argv: &[OsString], layer: &config::Layer) -> anyhow::Result<()> {
    let argv = config::service_argv(&CONFIG, argv);
    let command = config::apply(&CONFIG, Cli::command(), layer);
    let mut problems: Vec<String> = layer.problems.iter().map(ToString::to_string).collect();
    let mut settings = Vec::new();
    match command.clone().try_get_matches_from(&argv) {
        Err(e) => problems.push(config::clap_problem(&e)),
        Ok(matches) => {
            let run = matches.subcommand_matches(CONFIG.service).unwrap_or(&matches);
            settings = config::effective(&CONFIG, &command, layer, run);
        }
    }
    let file = layer
        .path
        .as_ref()
        .map_or_else(|| format!("{} (absent)", CONFIG.default_path), |p| p.display().to_string());
    match cmd {
        ConfigCmd::Check if problems.is_empty() => println!("ok: {file}; `run` would start with it"),
        ConfigCmd::Check | ConfigCmd::Show { .. } if !problems.is_empty() => {
            for problem in &problems {
                println!("error: {problem}");
            }
            anyhow::bail!("{} problem(s); `run` would not start with this configuration", problems.len());
        }
        ConfigCmd::Check => unreachable!("handled above"),
        ConfigCmd::Show { effective } => {
            for s in settings.iter().filter(|s| *effective || matches!(s.source, config::Source::File(_))) {
                let value = s.values.as_ref().map_or("(hidden)".to_owned(), |v| v.join(","));
                println!("{:<22} {:<40} {}", s.key, value, s.source);
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, clap::Args)]
struct StateDir {
    /// Where the agent keeps its identity and persisted policy.
    #[arg(long, env = "INNERWALL_AGENT_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the agent contract package this build speaks.
    Contract,
    /// The configuration file: `check` it, `show` what is in force.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Run the agent: re-apply the persisted policy, then connect to the control plane.
    /// SIGHUP reads the command line and file again: the log level takes effect; other changed
    /// settings are named as needing a restart.
    Run(RunArgs),
    /// Enroll this host: generate a key here, present the token, store the issued identity.
    Enroll {
        #[command(flatten)]
        state: StateDir,
        /// Control-plane address, HOST:PORT (HOST must be a name in its certificate).
        #[arg(long, env = "INNERWALL_AGENT_SERVER")]
        server: String,
        /// A file holding the provisioning token (iw_…), as the command `innerwall token mint`
        /// prints has it, or `-` to read it from standard input (surrounding whitespace
        /// ignored; at most 4 KiB). Without it, INNERWALL_PROVISIONING_TOKEN is read
        /// (INNERWALL_TOKEN, its former name, still is, with a warning). The token is never
        /// taken as a flag: other users can read a process's arguments, and a shell keeps its
        /// command lines.
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// The former --token: refused, saying what to use instead.
        #[arg(long, hide = true, value_name = "TOKEN")]
        token: Option<String>,
        /// The CA certificate delivered with the token; the only trust anchor for the server.
        #[arg(long)]
        ca_bundle: PathBuf,
        /// Replace an existing identity. Its workload is retired by the control plane (it leaves
        /// every render), proven by presenting the old credential; if that credential cannot be
        /// used (expired, unreadable), a warning names the workload to retire by hand.
        #[arg(long)]
        force: bool,
        /// With --force: leave the replaced workload live instead of retiring it.
        #[arg(long, requires = "force")]
        keep_replaced: bool,
    },
    /// Kill switch: remove table inet innerwall (and nothing else); keep the persisted policy.
    /// Holds across restarts, reconnects and new versions (they are persisted, not installed)
    /// until `up`.
    Down {
        #[command(flatten)]
        state: StateDir,
    },
    /// Release the kill switch: install the persisted policy (the latest the agent held) and
    /// let a running agent enforce again.
    Up {
        #[command(flatten)]
        state: StateDir,
    },
    /// Show the applied policy and, from the kernel, set sizes and per-rule hit counters.
    Status {
        #[command(flatten)]
        state: StateDir,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Development: persist and install a policy read from a file (a JSON policy or canonical
    /// bytes), bypassing the control plane.
    #[command(hide = true)]
    ApplyFile {
        file: PathBuf,
        #[command(flatten)]
        state: StateDir,
    },
    /// Development: print the nft rendering of the table a JSON policy (or canonical bytes)
    /// installs.
    #[command(hide = true)]
    RenderFile { file: PathBuf },
}

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let (cli, layer, level_given) = match parse(&argv) {
        Ok(parsed) => parsed,
        Err(code) => return code,
    };
    let filter = log_filter(&cli, level_given);
    let logs = init_logs(cli.log_format, &filter);
    match run(cli.command, cli.log_format, &argv, &layer, Logs { handle: logs, filter }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let chain = innerwall_agent::error::chain(err.as_ref());
            // With JSON logs every line on stderr is JSON, the last word included.
            match cli.log_format {
                LogFormat::Text => eprintln!("error: {chain}"),
                LogFormat::Json => tracing::error!("{chain}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// The log filter in force: the level given (flag, variable or file), else RUST_LOG, as before.
fn log_filter(cli: &Cli, level_given: bool) -> String {
    match std::env::var("RUST_LOG") {
        Ok(former) if !level_given && !former.is_empty() => former,
        _ => cli.log_level.clone(),
    }
}

type LogHandle =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

/// Logs to stderr through a filter SIGHUP can replace; a malformed filter means `info`.
fn init_logs(format: LogFormat, filter: &str) -> LogHandle {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let logs = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            logs.with(fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))).init()
        }
        LogFormat::Json => logs.with(fmt.json()).init(),
    }
    handle
}

/// The logs' filter and the spelling in force.
struct Logs {
    handle: LogHandle,
    filter: String,
}

/// What SIGHUP does to a running agent: reads the command line and the file again (as at
/// start), puts a changed log level in force and names the other changed settings, which need
/// a restart. A file with problems changes nothing and is reported.
struct Hangup {
    argv: Vec<OsString>,
    started: RunArgs,
    logs: std::sync::Mutex<Logs>,
}

impl Hangup {
    fn reread(&self) {
        let (matches, layer) = config::parse(&CONFIG, Cli::command, &self.argv);
        if !layer.problems.is_empty() {
            let problems: Vec<String> = layer.problems.iter().map(ToString::to_string).collect();
            tracing::warn!(
                "SIGHUP: nothing reloaded; the configuration has problems: {}",
                problems.join("; ")
            );
            return;
        }
        let level_given =
            matches.value_source("log_level").is_some_and(|s| s != clap::parser::ValueSource::DefaultValue)
                || layer.values.contains_key("log_level");
        let cli = match Cli::from_arg_matches(&matches) {
            Ok(cli) => cli,
            Err(e) => return tracing::warn!("SIGHUP: nothing reloaded: {e}"),
        };
        let Command::Run(now) = &cli.command else { unreachable!("the same command line names `run`") };
        let mut logs = self.logs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let filter = log_filter(&cli, level_given);
        let mut changed = Vec::new();
        if filter != logs.filter {
            match tracing_subscriber::EnvFilter::try_new(&filter) {
                Ok(new) => match logs.handle.reload(new) {
                    Ok(()) => {
                        changed.push(format!("log-level {} → {filter}", logs.filter));
                        logs.filter = filter;
                    }
                    Err(e) => tracing::warn!("SIGHUP: the log level stays {}: {e}", logs.filter),
                },
                Err(e) => tracing::warn!(
                    "SIGHUP: the log level stays {}: {filter:?} is not a filter: {e}",
                    logs.filter
                ),
            }
        }
        let was = &self.started;
        let restart: Vec<&str> = [
            ("state-dir", was.state != now.state),
            ("server", was.server != now.server),
            ("drift-interval-ms", was.drift_interval_ms != now.drift_interval_ms),
            ("metrics-listen", was.metrics_listen != now.metrics_listen),
            ("source-address", was.source_address != now.source_address),
            ("conn-table-entries", was.conn_table_entries != now.conn_table_entries),
            ("max-policy-message", was.max_policy_message != now.max_policy_message),
        ]
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect();
        let changed = if changed.is_empty() { "nothing changed".to_owned() } else { changed.join(", ") };
        if restart.is_empty() {
            tracing::info!("SIGHUP: configuration read again: {changed}");
        } else {
            tracing::warn!(
                "SIGHUP: configuration read again: {changed}; changed but in force only after a restart: {}",
                restart.join(", ")
            );
        }
    }
}

/// `enroll --token TOKEN`, the flag the token was once given as: a usage error (exit 2) that
/// says what to do instead, without repeating the token.
fn refuse_token_flag() -> ! {
    let mut cli = Cli::command();
    cli.build();
    let enroll = cli.find_subcommand_mut("enroll").expect("enroll is a subcommand");
    enroll
        .error(
            clap::error::ErrorKind::UnknownArgument,
            "enroll no longer takes the provisioning token as --token: other users can read a \
             process's arguments, and a shell keeps its command lines. Save the token in a file only \
             root reads and pass --token-file FILE (`--token-file -` reads it from standard input), \
             or set INNERWALL_PROVISIONING_TOKEN",
        )
        .exit()
}

/// The variable that holds the provisioning token when --token-file is not given.
const TOKEN_VAR: &str = "INNERWALL_PROVISIONING_TOKEN";

/// The former name of `INNERWALL_PROVISIONING_TOKEN`, which the CLI's operator token also used.
const DEPRECATED_TOKEN_VAR: &str = "INNERWALL_TOKEN";

/// The provisioning token: from --token-file (`-`: standard input), else
/// `INNERWALL_PROVISIONING_TOKEN`, else the deprecated `INNERWALL_TOKEN`.
fn provisioning_token(token_file: Option<&Path>, log_format: LogFormat) -> anyhow::Result<String> {
    if let Some(path) = token_file {
        return Ok(innerwall_agent::identity::enroll::read_token_file(path)?);
    }
    if let Some(token) = std::env::var(TOKEN_VAR).ok().filter(|t| !t.trim().is_empty()) {
        return Ok(token.trim().to_owned());
    }
    deprecated_token(log_format)
}

/// Without --token-file or INNERWALL_PROVISIONING_TOKEN: the deprecated `INNERWALL_TOKEN`,
/// with a warning, or an error saying what to give.
fn deprecated_token(log_format: LogFormat) -> anyhow::Result<String> {
    let Some(token) = std::env::var(DEPRECATED_TOKEN_VAR).ok().filter(|t| !t.is_empty()) else {
        anyhow::bail!(
            "enroll needs the provisioning token (iw_…): save it in a file only root reads and pass \
             --token-file FILE (as `innerwall token mint` prints), or set INNERWALL_PROVISIONING_TOKEN"
        );
    };
    let warning = format!(
        "{DEPRECATED_TOKEN_VAR} is deprecated for the provisioning token; pass --token-file FILE (or set \
         INNERWALL_PROVISIONING_TOKEN)"
    );
    match log_format {
        LogFormat::Text => eprintln!("warning: {warning}"),
        LogFormat::Json => tracing::warn!("{warning}"),
    }
    Ok(token)
}

fn read_policy(file: &Path) -> anyhow::Result<innerwall_wire::policy::WorkloadPolicy> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    policy_json::parse(&bytes).with_context(|| format!("parsing {}", file.display()))
}

fn run(
    command: Command,
    log_format: LogFormat,
    argv: &[OsString],
    layer: &config::Layer,
    logs: Logs,
) -> anyhow::Result<()> {
    match command {
        Command::Contract => println!("{}", innerwall_wire::CONTRACT_PACKAGE),
        Command::Config(cmd) => config_command(&cmd, argv, layer)?,
        Command::Run(args) => {
            let mut config = RunConfig::new(args.state.state_dir.clone(), args.server.clone());
            config.drift_interval = std::time::Duration::from_millis(args.drift_interval_ms.max(100));
            config.metrics_listen = args.metrics_listen;
            config.source_address = args.source_address;
            config.conn_entries = args.conn_table_entries;
            config.max_policy_message = args.max_policy_message;
            let hangup = Hangup { argv: argv.to_vec(), started: args, logs: std::sync::Mutex::new(logs) };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(daemon::run(config, Box::new(move || hangup.reread())))?;
        }
        Command::Enroll { state, server, token: _, token_file, ca_bundle, force, keep_replaced } => {
            let token = provisioning_token(token_file.as_deref(), log_format)?;
            innerwall_agent::identity::enroll::check_token_kind(&token)?;
            let ca = innerwall_agent::identity::enroll::read_ca_bundle(&ca_bundle)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            let enrollment = runtime.block_on(innerwall_agent::identity::enroll::enroll(
                &server,
                &token,
                &ca,
                &state.state_dir,
                innerwall_agent::identity::enroll::EnrollOptions { force, keep_replaced },
            ))?;
            let credential = &enrollment.credential;
            println!(
                "enrolled as workload {} (certificate valid for {}h); identity stored in {}",
                credential.id,
                credential
                    .not_after
                    .duration_since(std::time::SystemTime::now())
                    .map_or(0, |d| d.as_secs() / 3600),
                state.state_dir.display()
            );
            if let innerwall_agent::identity::enroll::Replaced::Retired(old) = &enrollment.replaced {
                println!("replaced workload {old}: the control plane retired it (it left every render)");
            }
            if let Some(warning) = enrollment.replaced.warning() {
                match log_format {
                    LogFormat::Text => eprintln!("warning: {warning}"),
                    LogFormat::Json => tracing::warn!("{warning}"),
                }
            }
            println!(
                "start the agent with: innerwall-agent run --server {server} --state-dir {}",
                state.state_dir.display()
            );
        }
        Command::Down { state } => {
            let report = enforce::kill_switch(&state.state_dir)?;
            if report.table_removed {
                println!("removed table inet innerwall; no other table was touched");
            } else {
                println!("table inet innerwall was not present; no other table was touched");
            }
            match (report.persisted_version, report.persisted_error) {
                (Some(v), _) => println!(
                    "kept the persisted policy v{v} in {}: the agent holds every policy without installing \
                     it, across restarts, until `innerwall-agent up`",
                    state.state_dir.display()
                ),
                (None, Some(err)) => println!("the persisted policy could not be read: {err}"),
                (None, None) => println!("no persisted policy in {}", state.state_dir.display()),
            }
        }
        Command::Up { state } => {
            let report = enforce::release_kill_switch(&state.state_dir)?;
            match report.installed_version {
                Some(v) => println!("installed the persisted policy v{v} into table inet innerwall"),
                None => println!("no persisted policy in {}: nothing to install", state.state_dir.display()),
            }
            if report.was_engaged {
                println!("kill switch released: a running agent enforces every policy it receives again");
            } else {
                println!("the kill switch was not engaged");
            }
        }
        Command::Status { state, json } => {
            let report = status::status(&state.state_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
        }
        Command::ApplyFile { file, state } => {
            let policy = read_policy(&file)?;
            let mut store = LinuxPolicyStore::new(&state.state_dir);
            // Start from what is persisted, so a peer-only change is an element update.
            if let Err(e) = store.restore_persisted() {
                tracing::warn!("ignoring the persisted policy: {e}");
            }
            let how = store.apply(&policy)?;
            println!("applied policy v{} ({}): {how:?}", policy.version(), policy.mode());
        }
        Command::RenderFile { file } => {
            print!("{}", DesiredTable::from_policy(&read_policy(&file)?).render());
        }
    }
    Ok(())
}
