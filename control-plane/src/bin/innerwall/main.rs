//! `innerwall`: the control-plane binary — service and operator CLI (OPS-1). A thin layer over
//! the library: parse, connect, call, print (human tables by default, `--json` for scripts).
//! This file owns the top-level flags and dispatch (logging is set up by `logs`); each command
//! group has a module with its clap types next to its handlers.

// Every `print!`/`println!` below goes through `output::stdout` (these shadow std's macros in
// every module declared after them), so no command panics on a closed pipe; `main` catches the
// unwind and exits quietly.
macro_rules! println {
    () => {
        $crate::output::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}
macro_rules! print {
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!($($arg)*))
    };
}

mod api;
mod audit;
mod backend;
mod backup;
mod ca;
mod config;
mod ctx;
mod drafts;
mod duration;
mod estate;
mod file;
mod flows;
mod logs;
mod management;
mod operators;
mod output;
mod pages;
mod policy;
mod promotions;
mod replay;
mod requests;
mod retention;
mod serve;
mod suggest;
mod tokens;
mod workloads;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use innerwall_control_plane::postgres::{self, Create};
use innerwall_wire::secret::{self, MAX_SECRET_FILE, SecretError};

use crate::ctx::{Ctx, Database};

#[derive(Debug, Parser)]
#[command(name = "innerwall", version, about = "Innerwall control plane and operator CLI")]
struct Cli {
    /// The configuration file (TOML): its keys are the long names of `serve`'s flags and of
    /// --database-url, --state-dir, --ca-dir, --max-rendered-entries, --max-rendered-bytes,
    /// --log-format and --log-level; a flag or variable given wins over it. Default:
    /// /etc/innerwall/innerwall.toml, if it exists. `innerwall config check` checks it.
    #[arg(long, env = "INNERWALL_CONFIG", global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Postgres to use. Without it, the private cluster under --state-dir is used: started for
    /// the command if it is not running (and stopped again after it), refused if there is none
    /// (`serve`, `migrate` and --init create it).
    #[arg(long, env = "INNERWALL_DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Where the embedded Postgres cluster lives (and the CA, unless --ca-dir says otherwise).
    #[arg(long, env = "INNERWALL_STATE_DIR", global = true, default_value = "/var/lib/innerwall")]
    state_dir: PathBuf,
    /// The CA directory (ca.key, ca.crt), identical on every replica. Default: <state-dir>/ca.
    #[arg(long, env = "INNERWALL_CA_DIR", global = true)]
    ca_dir: Option<PathBuf>,
    /// A remote control plane's operator API (`https://cp:8443`): operator commands go through
    /// it instead of the database. Host administration (serve, migrate, ca, operator,
    /// contract) stays local and is refused with it.
    #[arg(long, env = "INNERWALL_API", global = true)]
    api: Option<String>,
    /// A file holding the operator token (iwo_…) for --api, minted on the host with `innerwall
    /// operator token mint`; `-` reads it from standard input (surrounding whitespace ignored;
    /// at most 4 KiB). Without it, INNERWALL_API_TOKEN is read (INNERWALL_TOKEN, its former
    /// name, still is, with a warning). A secret is never taken as a flag: other users can
    /// read a process's arguments, and a shell keeps its command lines.
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// The former --token: refused, saying what to use instead.
    #[arg(long, global = true, hide = true, value_name = "TOKEN")]
    token: Option<String>,
    /// The PEM bundle that issued the API's certificate (the host's <ca-dir>/ca.crt).
    #[arg(long, env = "INNERWALL_API_CA", global = true)]
    api_ca: Option<PathBuf>,
    /// Create the embedded cluster under --state-dir if there is none (without it, a state
    /// directory with no cluster is refused, so a mistyped path creates nothing).
    #[arg(long, global = true)]
    init: bool,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Rows per page list commands read while they walk every page (1 to 1,000).
    #[arg(long, env = "INNERWALL_PAGE_SIZE", global = true, default_value_t = pages::DEFAULT_PAGE_SIZE,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(pages::MAX_PAGE_SIZE)))]
    page_size: u32,
    /// The most entries (peers and port ranges of every rule) one workload's rendered policy
    /// may hold. Every render of this process checks it (`serve`, and local authoring
    /// commands): a change over it is refused naming the workload, the rule and this flag; a
    /// start-up or repair render holds that workload at its last good version (DEGRADED).
    #[arg(long, env = "INNERWALL_MAX_RENDERED_ENTRIES", global = true,
        default_value_t = innerwall_wire::sync::DEFAULT_MAX_RENDERED_ENTRIES as u64,
        value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    max_rendered_entries: u64,
    /// The most canonical bytes one workload's rendered policy may hold (as
    /// --max-rendered-entries); at most the policy stream's largest message (4 MiB) / 2, the
    /// default a quarter of it.
    #[arg(long, env = "INNERWALL_MAX_RENDERED_BYTES", global = true,
        default_value_t = innerwall_wire::sync::DEFAULT_MAX_RENDERED_BYTES as u64,
        value_parser = clap::value_parser!(u64).range(1..=(innerwall_wire::sync::MAX_POLICY_MESSAGE as u64 / 2)))]
    max_rendered_bytes: u64,
    /// How stderr logs read: text, or one JSON object per line (filter: --log-level).
    #[arg(long, global = true, value_enum, default_value_t)]
    log_format: logs::LogFormat,
    /// Which log lines are written: a level (error, warn, info, debug, trace) or per-module
    /// directives (`warn,innerwall_control_plane::sync=debug`). `serve` reloads it on SIGHUP.
    #[arg(long, env = "INNERWALL_LOG", global = true, default_value = "warn")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the agent contract package this build speaks.
    Contract,
    /// Apply database migrations and exit (creating the embedded cluster if there is none). Run
    /// it as the schema's owner; `--runtime-role` then grants the replicas' own role what they
    /// need (rows, sequences, the partition upkeep functions) and no DDL.
    Migrate {
        /// The role `serve` connects as (not a superuser), granted a replica's privileges.
        #[arg(long, value_name = "ROLE")]
        runtime_role: Option<String>,
    },
    /// Run the control-plane service: agent listener, NOTIFY bridge; renders once at start.
    /// SIGHUP reloads the configuration: the log level, the API's request bounds and its
    /// certificate files take effect; other changes are named as needing a restart.
    Serve(Box<serve::ServeArgs>),
    /// The configuration file: `check` it, `show` what is in force.
    #[command(subcommand)]
    Config(config::ConfigCmd),
    /// Backups of the database, the CA and the configuration file: create, verify, restore.
    #[command(subcommand)]
    Backup(backup::BackupCmd),
    /// Apply the retention `serve` applies hourly, now: flow partitions older than
    /// --flow-retention, then the control plane's own rows past theirs (the same flags and
    /// file keys as `serve`). Audited as `retention.run`.
    Retention(retention::RetentionCmd),
    /// The certificate authority that issues workload identities.
    #[command(subcommand)]
    Ca(ca::CaCmd),
    /// Provisioning tokens that enroll hosts with a label set.
    #[command(subcommand)]
    Token(tokens::TokenCmd),
    /// Render every workload now (normally automatic on every change).
    Render,
    /// Named sets of (protocol, ports) that rules permit.
    #[command(
        subcommand,
        mut_subcommand("create", |c| c.about("e.g. `service create web --entry tcp:80,443 --entry udp:443`")),
        mut_subcommand("update", |c| c.about("Replace a service's entries and description")),
    )]
    Service(policy::ObjectCmd<policy::ServiceArgs>),
    /// Named sets of CIDRs for peers without an agent.
    #[command(
        subcommand,
        name = "address-group",
        mut_subcommand("create", |c| c.about("e.g. `address-group create vpn --cidr 10.8.0.0/16 --cidr fd08::/48`")),
    )]
    AddressGroup(policy::ObjectCmd<policy::GroupArgs>),
    /// Label-scoped sets of inbound rules, authored as YAML or JSON files.
    #[command(
        subcommand,
        mut_subcommand("create", |c| c.about("Create from a YAML or JSON file (`-` for stdin)")),
        mut_subcommand("update", |c| c.about("Replace the ruleset named in the file; rules keep their identity by name")),
        mut_subcommand("show", |c| c.about("Print in the file format (YAML; `--json` for JSON)")),
    )]
    Ruleset(policy::RulesetCmd),
    /// Policy tests: named assertions every operator change must pass (`test-set`, `test`).
    #[command(
        subcommand,
        mut_subcommand("test-set", |c| c
            .mut_subcommand("create", |c| c.about("Create from a YAML or JSON file (`-` for stdin); refused if a test fails now"))
            .mut_subcommand("update", |c| c.about("Replace the set named in the file"))
            .mut_subcommand("show", |c| c.about("Print in the file format (YAML; `--json` for JSON)"))),
    )]
    Policy(policy::PolicyCmd),
    /// Drafts: named sets of changes, rendered and replayed against recorded flows before one
    /// checked commit.
    #[command(subcommand)]
    Draft(drafts::DraftCmd),
    /// Suggested rules from recorded flows no rule admits, with their evidence (`accept` into a
    /// draft, `ignore`).
    Suggest(suggest::SuggestCmd),
    /// The estate's workload address ranges: only addresses in them are rendered as peers.
    #[command(subcommand, name = "estate-range")]
    EstateRange(estate::EstateRangeCmd),
    /// Management access every workload keeps whatever its policy says (the failsafe rule).
    #[command(subcommand)]
    Management(management::ManagementCmd),
    /// Enrolled hosts: labels, mode, rendered policy.
    #[command(subcommand)]
    Workload(workloads::WorkloadCmd),
    /// Flow evidence the agents reported.
    #[command(subcommand)]
    Flows(flows::FlowsCmd),
    /// The records of mode changes and the evidence they stood on.
    #[command(subcommand)]
    Promotions(promotions::PromotionsCmd),
    /// Operator tokens of the HTTP API (`serve --api-listen`), on this host's database.
    #[command(subcommand)]
    Operator(operators::OperatorCmd),
    /// The audit log: who changed what, and when.
    #[command(subcommand)]
    Audit(audit::AuditCmd),
}

/// The exit status when stdout was closed early: 128 + SIGPIPE, as the shell reports a program
/// that SIGPIPE killed.
const CLOSED_PIPE: u8 = 128 + 13;

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let (cli, layer) = match config::parse(&argv) {
        Ok(parsed) => parsed,
        Err(code) => return code,
    };
    if cli.token.is_some() {
        refuse_token_flag();
    }
    innerwall_control_plane::policy::publish::set_bound(innerwall_control_plane::policy::render::Bound {
        entries: cli.max_rendered_entries as usize,
        bytes: cli.max_rendered_bytes as usize,
    });
    logs::init(cli.log_format, &cli.log_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(target: logs::NOTICE, "error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ran =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runtime.block_on(run(cli, &argv, &layer))));
    match ran {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            tracing::error!(target: logs::NOTICE, "error: {e:#}");
            ExitCode::FAILURE
        }
        Err(payload) => match payload.downcast::<output::StdoutFailed>() {
            // Whoever read our output stopped reading (`| head`): quiet, but not success — the
            // status a program killed by SIGPIPE has in the shell, so `set -o pipefail` sees
            // that the output was cut short.
            Ok(failed) if failed.0.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::from(CLOSED_PIPE),
            Ok(failed) => {
                tracing::error!(target: logs::NOTICE, "error: cannot write to stdout: {}", failed.0);
                ExitCode::FAILURE
            }
            Err(payload) => std::panic::resume_unwind(payload),
        },
    }
}

async fn run(
    cli: Cli,
    argv: &[std::ffi::OsString],
    layer: &innerwall_wire::config::Layer,
) -> anyhow::Result<()> {
    if let Command::Config(cmd) = &cli.command {
        return config::run(cmd, argv, layer, cli.json);
    }
    if let Some(api) = &cli.api {
        let done = remote(api, &cli).await;
        output::flush();
        return done;
    }
    let ca_dir = cli.ca_dir.unwrap_or_else(|| cli.state_dir.join("ca"));
    let create = match cli.command {
        _ if cli.init => Create::Yes,
        Command::Migrate { .. } | Command::Serve(_) | Command::Backup(backup::BackupCmd::Restore { .. }) => {
            Create::Yes
        }
        _ => Create::No,
    };
    let database = Database::new(cli.database_url, cli.state_dir, create);
    let connect = || Ctx::connect(&database, cli.json, cli.page_size);
    match &cli.command {
        Command::Contract => println!("{}", innerwall_wire::CONTRACT_PACKAGE),
        Command::Migrate { runtime_role } => {
            let (pool, migrated) = database.migrate().await?;
            match (migrated.applied.first(), migrated.applied.last()) {
                (Some(first), Some(last)) => println!("migrations {first}..={last} applied"),
                _ => println!("schema current: no migrations to apply"),
            }
            if !migrated.ahead.is_empty() {
                println!("the database also has newer migrations than this build: {:?}", migrated.ahead);
            }
            if let Some(role) = runtime_role {
                postgres::grant_runtime(&pool, role).await?;
                println!("role {role} granted a replica's privileges (rows, sequences, partition upkeep)");
            }
        }
        Command::Serve(args) => serve::run(args, &database, &ca_dir, &|| config::view(argv)).await?,
        Command::Backup(cmd) => {
            backup::run(cmd, &database, &ca_dir, layer.path.as_deref(), &ctx::actor(), cli.json).await?
        }
        Command::Ca(cmd) => ca::run(cmd, &ca_dir, &database, cli.json, cli.page_size).await?,
        Command::Operator(cmd) => operators::run(&connect().await?, cmd).await?,
        Command::Retention(cmd) => retention::run(&connect().await?, cmd).await?,
        command => operate(&connect().await?, command, cli.json, &ca_dir).await?,
    }
    output::flush();
    database.end()
}

/// `--token TOKEN`, the flag the operator token was once given as: a usage error (exit 2) that
/// says what to do instead, without repeating the token.
fn refuse_token_flag() -> ! {
    use clap::CommandFactory as _;
    Cli::command()
        .error(
            clap::error::ErrorKind::UnknownArgument,
            "--token is no longer accepted: other users can read a process's arguments, and a shell \
             keeps its command lines. Put the operator token in a file only you can read and pass \
             --token-file FILE (`--token-file -` reads it from standard input), or set \
             INNERWALL_API_TOKEN",
        )
        .exit()
}

/// The variable that holds the operator token when --token-file is not given.
const TOKEN_VAR: &str = "INNERWALL_API_TOKEN";

/// The former name of `INNERWALL_API_TOKEN`, which the agent's provisioning token also used.
const DEPRECATED_TOKEN_VAR: &str = "INNERWALL_TOKEN";

/// The operator token: from `--token-file` (`-`: standard input), else `INNERWALL_API_TOKEN`,
/// else the deprecated `INNERWALL_TOKEN` with a warning (never when it holds a provisioning
/// token).
fn operator_token(file: Option<&Path>) -> anyhow::Result<Option<String>> {
    if let Some(path) = file {
        return read_token_file(path).map(Some);
    }
    if let Some(token) = std::env::var(TOKEN_VAR).ok().filter(|t| !t.is_empty()) {
        return Ok(Some(token));
    }
    let Some(old) = std::env::var(DEPRECATED_TOKEN_VAR).ok().filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    if !old.starts_with(innerwall_control_plane::identity::operators::OPERATOR_TOKEN_PREFIX) {
        anyhow::bail!(
            "{DEPRECATED_TOKEN_VAR} does not hold an operator token (iwo_…), and the CLI no longer reads it \
             for one: set {TOKEN_VAR} to an operator token or pass --token-file FILE (mint one on \
             the host with `innerwall operator token mint`); an agent's provisioning token goes in \
             a file for `innerwall-agent enroll --token-file`"
        );
    }
    tracing::warn!(
        target: logs::NOTICE,
        "warning: {DEPRECATED_TOKEN_VAR} is deprecated for the operator token; set {TOKEN_VAR} or pass --token-file FILE instead"
    );
    Ok(Some(old))
}

/// `--token-file PATH`: the operator token in it, or on standard input when `PATH` is `-`.
fn read_token_file(path: &Path) -> anyhow::Result<String> {
    read_secret(path, "--token-file", "the operator token (iwo_…)")
}

/// A secret from `flag PATH` (RUN-6: never from a flag itself): the file's text, or standard
/// input's when `PATH` is `-`; surrounding whitespace ignored, at most [`MAX_SECRET_FILE`] bytes,
/// never empty. `what` says what it should hold.
pub fn read_secret(path: &Path, flag: &str, what: &str) -> anyhow::Result<String> {
    let name = if path == Path::new("-") {
        format!("standard input ({flag} -)")
    } else {
        format!("{flag} {}", path.display())
    };
    secret::read(path).map_err(|e| match e {
        SecretError::Read(source) => {
            anyhow::Error::new(source).context(format!("cannot read {what} from {name}"))
        }
        SecretError::TooLarge => {
            anyhow::anyhow!("{name} holds more than {MAX_SECRET_FILE} bytes; it should hold only {what}")
        }
        SecretError::Empty => anyhow::anyhow!("{name} is empty; it should hold {what}"),
    })
}

/// A command with `--api`: through the remote control plane's API, never this host's database.
async fn remote(api: &str, cli: &Cli) -> anyhow::Result<()> {
    let host_only = match &cli.command {
        Command::Contract => Some("contract"),
        Command::Migrate { .. } => Some("migrate"),
        Command::Backup(_) => Some("backup"),
        Command::Retention(_) => Some("retention"),
        Command::Serve(_) => Some("serve"),
        Command::Ca(_) => Some("ca"),
        Command::Operator(_) => Some("operator"),
        Command::Management(management::ManagementCmd::Reset { .. }) => Some("management reset"),
        _ => None,
    };
    if let Some(name) = host_only {
        anyhow::bail!(
            "`innerwall {name}` administers this host and does not take --api; run it on the control-plane host without --api (and without INNERWALL_API)"
        );
    }
    let token = operator_token(cli.token_file.as_deref())?;
    let client = api::ApiClient::new(api, token.as_deref(), cli.api_ca.as_deref(), cli.page_size)?;
    let ca_dir = cli.ca_dir.clone().unwrap_or_else(|| cli.state_dir.join("ca"));
    operate(&client, &cli.command, cli.json, &ca_dir).await
}

/// An operator command, on either side ([`backend::Backend`]): written once.
async fn operate(
    b: &impl backend::Backend,
    command: &Command,
    json: bool,
    ca_dir: &Path,
) -> anyhow::Result<()> {
    match command {
        Command::Token(cmd) => tokens::run(b, json, ca_dir, cmd).await,
        Command::Render => policy::render(b, json).await,
        Command::Service(cmd) => policy::catalog(b, json, cmd).await,
        Command::AddressGroup(cmd) => policy::catalog(b, json, cmd).await,
        Command::Ruleset(cmd) => policy::ruleset(b, json, cmd).await,
        Command::Policy(cmd) => policy::policy(b, json, cmd).await,
        Command::Draft(cmd) => drafts::run(b, json, cmd).await,
        Command::Suggest(cmd) => suggest::run(b, json, cmd).await,
        Command::EstateRange(cmd) => estate::run(b, json, cmd).await,
        Command::Management(cmd) => management::run(b, json, cmd).await,
        Command::Workload(cmd) => workloads::run(b, json, cmd).await,
        Command::Flows(cmd) => flows::run(b, json, cmd).await,
        Command::Promotions(cmd) => promotions::run(b, json, cmd).await,
        Command::Audit(cmd) => audit::run(b, json, cmd).await,
        Command::Contract
        | Command::Config(_)
        | Command::Backup(_)
        | Command::Retention(_)
        | Command::Migrate { .. }
        | Command::Serve(_)
        | Command::Ca(_)
        | Command::Operator(_) => {
            unreachable!("host-only commands are run on the host, never as operations")
        }
    }
}
