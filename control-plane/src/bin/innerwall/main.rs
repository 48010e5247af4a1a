//! `innerwall`: the control-plane binary — service and operator CLI (OPS-1). A thin layer over
//! the library: parse, connect, call, print (human tables by default, `--json` for scripts).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use innerwall_control_plane::identity::ca::{self, FileCa};
use innerwall_control_plane::identity::tokens;
use innerwall_control_plane::policy::authoring::{self, Committed};
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::publish::Changed;
use innerwall_control_plane::policy::spec::{AddressGroupSpec, RulesetSpec, ServiceSpec};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::sync::gateway;
use innerwall_control_plane::{audit, postgres, service};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::{Cidr, Mode};
use serde::Serialize;
use sqlx::PgPool;

#[derive(Debug, Parser)]
#[command(name = "innerwall", version, about = "Innerwall control plane and operator CLI")]
struct Cli {
    /// Postgres to use. Without it, a private cluster under --state-dir is started and reused.
    #[arg(long, env = "INNERWALL_DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Where the embedded Postgres cluster lives (and the CA, unless --ca-dir says otherwise).
    #[arg(long, env = "INNERWALL_STATE_DIR", global = true, default_value = "/var/lib/innerwall")]
    state_dir: PathBuf,
    /// The CA directory (ca.key, ca.crt), identical on every replica. Default: <state-dir>/ca.
    #[arg(long, env = "INNERWALL_CA_DIR", global = true)]
    ca_dir: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the agent contract package this build speaks.
    Contract,
    /// Apply database migrations and exit.
    Migrate,
    /// Run the control-plane service: agent listener, NOTIFY bridge; renders once at start.
    Serve(ServeArgs),
    /// The certificate authority that issues workload identities.
    #[command(subcommand)]
    Ca(CaCmd),
    /// Provisioning tokens that enroll hosts with a label set.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Render every workload now (normally automatic on every change).
    Render,
    /// Named sets of (protocol, ports) that rules permit.
    #[command(subcommand)]
    Service(ServiceCmd),
    /// Named sets of CIDRs for peers without an agent.
    #[command(subcommand, name = "address-group")]
    AddressGroup(GroupCmd),
    /// Label-scoped sets of inbound rules, authored as YAML or JSON files.
    #[command(subcommand)]
    Ruleset(RulesetCmd),
    /// Enrolled hosts: labels, mode, rendered policy.
    #[command(subcommand)]
    Workload(WorkloadCmd),
    /// Flow evidence the agents reported.
    #[command(subcommand)]
    Flows(FlowsCmd),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The one agent listener (enrollment, sync, telemetry). Port 0 picks a free port.
    #[arg(long, env = "INNERWALL_LISTEN", default_value = "0.0.0.0:7443")]
    listen: std::net::SocketAddr,
    /// Names and addresses agents dial this replica by (server certificate SANs); repeatable.
    /// Default: this host's name, localhost and 127.0.0.1.
    #[arg(long = "server-name")]
    server_names: Vec<String>,
    /// Lifetime of issued workload certificates, e.g. 24h.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    cert_lifetime: std::time::Duration,
    /// Interval agents heartbeat at; a stream silent for three of them is closed.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    heartbeat_interval: std::time::Duration,
    /// Flow window length agents use.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    flow_window: std::time::Duration,
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let d = tokens::parse_ttl(text).map_err(|e| e.to_string())?;
    d.to_std().map_err(|_| format!("duration {text:?} must be positive"))
}

#[derive(Debug, Subcommand)]
enum CaCmd {
    /// Create the root key (0600) and a 10-year self-signed certificate in --ca-dir.
    Init,
}

#[derive(Debug, Subcommand)]
enum TokenCmd {
    /// Mint a token; it is printed once, with the enroll command line.
    Mint {
        /// Labels every workload enrolled with this token gets; repeatable.
        #[arg(long = "label", required = true)]
        labels: Vec<Label>,
        /// Validity, e.g. 30d, 12h.
        #[arg(long, default_value = "30d")]
        ttl: String,
        #[arg(long)]
        max_uses: Option<u32>,
        /// The HOST:PORT agents dial, for the printed enroll command.
        #[arg(long, default_value = "CONTROL-PLANE:7443")]
        server: String,
    },
    List,
    /// Revoke a token: it enrolls nothing more, effective immediately.
    Revoke {
        id: uuid::Uuid,
    },
}

#[derive(Debug, Args)]
struct Expect {
    /// Refuse the write unless the object is still at this version (as `show` printed it).
    #[arg(long)]
    expect_version: Option<i64>,
}

#[derive(Debug, Subcommand)]
enum ServiceCmd {
    /// e.g. `service create web --entry tcp:80,443 --entry udp:443`
    Create(ServiceArgs),
    /// Replace a service's entries and description.
    Update {
        #[command(flatten)]
        service: ServiceArgs,
        #[command(flatten)]
        expect: Expect,
    },
    Delete {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
    List,
    Show {
        name: String,
    },
}

#[derive(Debug, Args)]
struct ServiceArgs {
    name: String,
    /// `tcp:80,443,8000-8080`, `udp:53`, `tcp:all`, `icmp`, `icmpv6`; repeatable.
    #[arg(long = "entry", required = true)]
    entries: Vec<String>,
    #[arg(long, default_value = "")]
    description: String,
}

#[derive(Debug, Subcommand)]
enum GroupCmd {
    /// e.g. `address-group create vpn --cidr 10.8.0.0/16 --cidr fd08::/48`
    Create(GroupArgs),
    Update {
        #[command(flatten)]
        group: GroupArgs,
        #[command(flatten)]
        expect: Expect,
    },
    Delete {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
    List,
    Show {
        name: String,
    },
}

#[derive(Debug, Args)]
struct GroupArgs {
    name: String,
    /// A CIDR or a bare address (a host route); repeatable.
    #[arg(long = "cidr", required = true)]
    cidrs: Vec<String>,
    #[arg(long, default_value = "")]
    description: String,
}

#[derive(Debug, Subcommand)]
enum RulesetCmd {
    /// Create from a YAML or JSON file (`-` for stdin).
    Create {
        #[arg(short, long)]
        file: PathBuf,
    },
    /// Replace the ruleset named in the file; rules keep their identity by name.
    Update {
        #[arg(short, long)]
        file: PathBuf,
        #[command(flatten)]
        expect: Expect,
    },
    Delete {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
    List,
    /// Print in the file format (YAML; `--json` for JSON).
    Show {
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum FlowsCmd {
    /// Inbound flow records of one workload, newest first.
    List {
        #[arg(long)]
        workload: WorkloadId,
        /// How far back, e.g. 1h, 7d.
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        since: std::time::Duration,
        /// observed, allowed, would-block or blocked.
        #[arg(long)]
        decision: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Evidence gaps: what could not be recorded (never silence).
    Gaps {
        #[arg(long)]
        workload: Option<WorkloadId>,
        #[arg(long, default_value = "24h", value_parser = parse_duration)]
        since: std::time::Duration,
    },
}

#[derive(Debug, Subcommand)]
enum WorkloadCmd {
    List,
    Show {
        id: WorkloadId,
    },
    /// Set or remove labels, conditional on the label version you read.
    Label {
        id: WorkloadId,
        #[arg(long = "set")]
        set: Vec<Label>,
        #[arg(long = "remove")]
        remove: Vec<LabelKey>,
        /// The label version `workload show` printed; a stale edit is refused.
        #[arg(long)]
        expect_label_version: i64,
    },
    /// Set the enforcement mode: visibility, simulation or enforcement.
    Mode {
        id: WorkloadId,
        mode: Mode,
    },
    /// Show the rendered policy and its version.
    Policy {
        id: WorkloadId,
    },
    /// Convergence: applied vs latest version, sync state, last seen/acked/snapshot.
    Status {
        id: Option<WorkloadId>,
    },
    /// Ask the replica holding the agent's stream to make it reconnect (fresh snapshot).
    ResendSnapshot {
        id: WorkloadId,
    },
    /// Retire: identity and addresses leave every render; its stream is closed.
    Retire {
        id: WorkloadId,
    },
    /// Deny-list: refused at the handshake, stream cut, renewal refused.
    Deny {
        id: WorkloadId,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn pool(cli: &Cli) -> anyhow::Result<PgPool> {
    let url = match &cli.database_url {
        Some(url) => url.clone(),
        None => postgres::embedded(&cli.state_dir).await.with_context(|| {
            format!("while starting the embedded database in {}", cli.state_dir.display())
        })?,
    };
    Ok(postgres::connect(&url).await?)
}

fn actor() -> String {
    let user =
        std::env::var("SUDO_USER").or_else(|_| std::env::var("USER")).unwrap_or_else(|_| "unknown".into());
    format!("cli:{user}")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    init_logging();
    let json = cli.json;
    match &cli.command {
        Command::Contract => println!("{}", innerwall_wire::CONTRACT_PACKAGE),
        Command::Migrate => {
            pool(&cli).await?;
            println!("migrations applied");
        }
        Command::Serve(args) => serve(&cli, args).await?,
        Command::Ca(CaCmd::Init) => {
            let dir = ca_dir(&cli);
            std::fs::create_dir_all(&dir).with_context(|| format!("while creating {}", dir.display()))?;
            FileCa::init(&dir)?;
            println!(
                "created {} (mode 0600) and {}",
                dir.join(ca::CA_KEY_FILE).display(),
                dir.join(ca::CA_CERT_FILE).display()
            );
            println!(
                "copy this directory to every replica; give agents {}",
                dir.join(ca::CA_CERT_FILE).display()
            );
        }
        Command::Token(cmd) => token(&cli, cmd, json).await?,
        Command::Render => {
            let changed = authoring::render_now(&pool(&cli).await?).await?;
            print_changed(json, &changed, &());
        }
        Command::Service(cmd) => service(&pool(&cli).await?, cmd, json).await?,
        Command::AddressGroup(cmd) => group(&pool(&cli).await?, cmd, json).await?,
        Command::Ruleset(cmd) => ruleset(&pool(&cli).await?, cmd, json).await?,
        Command::Workload(cmd) => workload(&pool(&cli).await?, cmd, json).await?,
        Command::Flows(cmd) => flows(&pool(&cli).await?, cmd, json).await?,
    }
    Ok(())
}

fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("INNERWALL_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when it
/// is first polled, so a signal that arrives during start-up is not lost.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("while installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("while installing the SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

fn ca_dir(cli: &Cli) -> PathBuf {
    cli.ca_dir.clone().unwrap_or_else(|| cli.state_dir.join("ca"))
}

fn default_server_names() -> Vec<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    if !host.trim().is_empty() {
        names.insert(0, host.trim().to_owned());
    }
    names
}

async fn serve(cli: &Cli, args: &ServeArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let signer: Arc<dyn ca::Signer> = Arc::new(
        FileCa::load(&ca_dir(cli)).context("while loading the CA (create it with `innerwall ca init`)")?,
    );
    let pool = pool(cli).await?;
    let config = service::ServiceConfig {
        listen: args.listen,
        server_names: if args.server_names.is_empty() {
            default_server_names()
        } else {
            args.server_names.clone()
        },
        cert_lifetime: args.cert_lifetime,
        gateway: gateway::GatewayConfig {
            heartbeat: args.heartbeat_interval,
            flow_window: args.flow_window,
            ..Default::default()
        },
    };
    let running = service::start(pool, signer, config).await?;
    eprintln!(
        "innerwall: startup render advanced {} workload(s); listening on {} as {}",
        running.startup_changes,
        running.local_addr,
        running.server_names.join(", ")
    );
    shutdown.await;
    running.stop().await?;
    Ok(())
}

async fn flows(pool: &PgPool, cmd: &FlowsCmd, json: bool) -> anyhow::Result<()> {
    use innerwall_control_plane::flows as f;
    use innerwall_wire::convert::WireEnum;
    use innerwall_wire::flows::{Decision, GapKind};
    use innerwall_wire::policy::Protocol;
    /// A stored enum number by name; "?" for a number this binary does not know.
    fn stored<E: WireEnum + std::fmt::Display>(code: i16) -> String {
        E::from_code(code).map_or_else(|_| "?".to_owned(), |e| e.to_string())
    }
    let since = |d: &std::time::Duration| {
        chrono::Utc::now() - chrono::Duration::from_std(*d).unwrap_or(chrono::Duration::MAX)
    };
    match cmd {
        FlowsCmd::List { workload, since: back, decision, limit } => {
            let decision = match decision.as_deref() {
                None => None,
                Some(name) => Some(name.parse::<Decision>().map_err(|_| {
                    anyhow::anyhow!(
                        "unknown decision {name:?}: use observed, allowed, would-block or blocked"
                    )
                })?),
            };
            if !(1..=10_000).contains(limit) {
                bail!("--limit must be between 1 and 10000");
            }
            let rows = f::list(pool, *workload, since(back), decision, *limit).await?;
            if json {
                return print_json(&rows);
            }
            let rows = rows
                .into_iter()
                .map(|r| {
                    let peer = match r.peer_kind {
                        1 => format!("workload {} {}", r.peer_key, r.peer_labels),
                        2 => format!("group {}", r.peer_key),
                        _ => r.peer_key.clone(),
                    };
                    let proto = stored::<Protocol>(r.protocol);
                    vec![
                        r.window_start.format("%F %T").to_string(),
                        format!("v{}", r.policy_version),
                        r.src_address,
                        peer,
                        format!("{proto}/{}", r.dst_port),
                        stored::<Decision>(r.decision),
                        r.matched_rule_id,
                        r.new_connections.to_string(),
                        r.packets.to_string(),
                        r.bytes.to_string(),
                    ]
                })
                .collect();
            print_table(
                &[
                    "window", "policy", "source", "peer", "service", "decision", "rule", "conns", "packets",
                    "bytes",
                ],
                rows,
            );
        }
        FlowsCmd::Gaps { workload, since: back } => {
            let rows = f::gaps(pool, *workload, since(back)).await?;
            if json {
                return print_json(&rows);
            }
            let rows = rows
                .into_iter()
                .map(|g| {
                    vec![
                        g.workload_id.to_string(),
                        stored::<GapKind>(g.kind),
                        g.gap_from.format("%F %T").to_string(),
                        g.gap_to.format("%F %T").to_string(),
                        g.count.to_string(),
                    ]
                })
                .collect();
            print_table(&["workload", "kind", "from", "to", "count"], rows);
        }
    }
    Ok(())
}

async fn token(cli: &Cli, cmd: &TokenCmd, json: bool) -> anyhow::Result<()> {
    let pool = pool(cli).await?;
    match cmd {
        TokenCmd::Mint { labels, ttl, max_uses, server } => {
            let ttl = tokens::parse_ttl(ttl)?;
            let mut tx = pool.begin().await?;
            let minted = tokens::mint(&mut tx, labels, ttl, *max_uses).await?;
            let shown: Vec<String> = labels.iter().map(ToString::to_string).collect();
            let detail =
                serde_json::json!({"labels": shown, "expires_at": minted.expires_at, "max_uses": max_uses});
            let subject = minted.id.to_string();
            audit::write(&mut tx, &audit::Record::new(&actor(), "token.mint", &subject).detail(detail))
                .await?;
            tx.commit().await?;
            let bundle = ca_dir(cli).join(ca::CA_CERT_FILE);
            let command = format!(
                "innerwall-agent enroll --server {server} --token {} --ca-bundle {}",
                minted.secret,
                bundle.display()
            );
            if json {
                return print_json(&serde_json::json!({
                    "id": minted.id, "token": minted.secret, "expires_at": minted.expires_at, "enroll_command": command,
                }));
            }
            println!(
                "token {} (expires {}), shown once:\n\n  {}\n",
                minted.id, minted.expires_at, minted.secret
            );
            println!("enroll a host with:\n\n  {command}");
        }
        TokenCmd::List => {
            let all = tokens::list(&mut *pool.acquire().await?).await?;
            if json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|t| {
                    vec![
                        t.id.to_string(),
                        format!("iw_{}…", t.prefix_hint),
                        t.labels.join(","),
                        t.expires_at.to_rfc3339(),
                        format!("{}/{}", t.use_count, t.max_uses.map_or("∞".into(), |m| m.to_string())),
                        t.status.to_string(),
                    ]
                })
                .collect();
            print_table(&["id", "token", "labels", "expires", "uses", "status"], rows);
        }
        TokenCmd::Revoke { id } => {
            let mut tx = pool.begin().await?;
            tokens::revoke(&mut tx, *id).await?;
            audit::write(&mut tx, &audit::Record::new(&actor(), "token.revoke", &id.to_string())).await?;
            tx.commit().await?;
            println!("token {id} revoked; it enrolls nothing from now on");
        }
    }
    Ok(())
}

/// Prints the outcome of a committed change: the value, then each workload whose version moved.
fn print_changed<T: Serialize>(json: bool, changed: &[Changed], value: &T) {
    if json {
        let changed: Vec<_> = changed
            .iter()
            .map(|c| serde_json::json!({"workload": c.workload.to_string(), "version": c.version}))
            .collect();
        println!("{}", serde_json::json!({"result": value, "changed": changed}));
        return;
    }
    if changed.is_empty() {
        println!("no workload's policy changed");
    } else {
        println!("policy version changed for {} workload(s):", changed.len());
        for c in changed {
            println!("  {}  v{}", c.workload, c.version);
        }
    }
}

fn report<T: Serialize>(json: bool, what: &str, done: Committed<T>) {
    if !json {
        println!("{what}");
    }
    print_changed(json, &done.changed, &done.value);
}

/// A plain left-aligned table.
fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_uppercase()).collect());
    for row in rows {
        line(row);
    }
}

fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn parse_entries(texts: &[String]) -> anyhow::Result<Vec<ServiceEntry>> {
    texts.iter().map(|t| ServiceEntry::parse(t).map_err(Into::into)).collect()
}

fn parse_cidrs(texts: &[String]) -> anyhow::Result<BTreeSet<Cidr>> {
    texts.iter().map(|t| Cidr::parse_lenient(t).map_err(Into::into)).collect()
}

async fn service(pool: &PgPool, cmd: &ServiceCmd, json: bool) -> anyhow::Result<()> {
    let spec = |a: &ServiceArgs| -> anyhow::Result<ServiceSpec> {
        Ok(ServiceSpec {
            name: a.name.clone(),
            description: a.description.clone(),
            entries: parse_entries(&a.entries)?,
        })
    };
    match cmd {
        ServiceCmd::Create(args) => {
            let spec = spec(args)?;
            let done = authoring::commit(pool, &actor(), "service.create", &spec.name, async |c| {
                authoring::create_service(c, &spec).await?;
                Ok(((), serde_json::json!({"entries": spec.entries.iter().map(ToString::to_string).collect::<Vec<_>>()})))
            })
            .await?;
            report(json, &format!("service {} created (version 1)", spec.name), done);
        }
        ServiceCmd::Update { service, expect } => {
            let spec = spec(service)?;
            let done = authoring::commit(pool, &actor(), "service.update", &spec.name, async |c| {
                let v = authoring::update_service(c, &spec, expect.expect_version).await?;
                Ok((v, serde_json::json!({"entries": spec.entries.iter().map(ToString::to_string).collect::<Vec<_>>()})))
            })
            .await?;
            report(json, &format!("service {} updated (version {})", spec.name, done.value), done);
        }
        ServiceCmd::Delete { name, expect } => {
            let done = authoring::commit(pool, &actor(), "service.delete", name, async |c| {
                authoring::delete_service(c, name, expect.expect_version).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(json, &format!("service {name} deleted"), done);
        }
        ServiceCmd::List | ServiceCmd::Show { .. } => {
            let mut all = store::list_services(&mut *pool.acquire().await?).await?;
            if let ServiceCmd::Show { name } = cmd {
                all.retain(|s| &s.name == name);
                if all.is_empty() {
                    bail!("service {name:?} not found");
                }
            }
            if json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|s| vec![s.name, s.version.to_string(), s.entries.join(" "), s.description])
                .collect();
            print_table(&["name", "version", "entries", "description"], rows);
        }
    }
    Ok(())
}

async fn group(pool: &PgPool, cmd: &GroupCmd, json: bool) -> anyhow::Result<()> {
    let spec = |a: &GroupArgs| -> anyhow::Result<AddressGroupSpec> {
        Ok(AddressGroupSpec {
            name: a.name.clone(),
            description: a.description.clone(),
            cidrs: parse_cidrs(&a.cidrs)?,
        })
    };
    match cmd {
        GroupCmd::Create(args) => {
            let spec = spec(args)?;
            let done = authoring::commit(pool, &actor(), "address-group.create", &spec.name, async |c| {
                authoring::create_address_group(c, &spec).await?;
                Ok(((), serde_json::json!({"cidrs": spec.cidrs.iter().map(ToString::to_string).collect::<Vec<_>>()})))
            })
            .await?;
            report(json, &format!("address group {} created (version 1)", spec.name), done);
        }
        GroupCmd::Update { group, expect } => {
            let spec = spec(group)?;
            let done = authoring::commit(pool, &actor(), "address-group.update", &spec.name, async |c| {
                let v = authoring::update_address_group(c, &spec, expect.expect_version).await?;
                Ok((v, serde_json::json!({"cidrs": spec.cidrs.iter().map(ToString::to_string).collect::<Vec<_>>()})))
            })
            .await?;
            report(json, &format!("address group {} updated (version {})", spec.name, done.value), done);
        }
        GroupCmd::Delete { name, expect } => {
            let done = authoring::commit(pool, &actor(), "address-group.delete", name, async |c| {
                authoring::delete_address_group(c, name, expect.expect_version).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(json, &format!("address group {name} deleted"), done);
        }
        GroupCmd::List | GroupCmd::Show { .. } => {
            let mut all = store::list_address_groups(&mut *pool.acquire().await?).await?;
            if let GroupCmd::Show { name } = cmd {
                all.retain(|g| &g.name == name);
                if all.is_empty() {
                    bail!("address group {name:?} not found");
                }
            }
            if json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|g| vec![g.name, g.version.to_string(), g.cidrs.join(" "), g.description])
                .collect();
            print_table(&["name", "version", "cidrs", "description"], rows);
        }
    }
    Ok(())
}

fn read_ruleset_file(path: &Path) -> anyhow::Result<RulesetSpec> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("while reading the ruleset from stdin")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("while reading {}", path.display()))?
    };
    // YAML is a superset of JSON, so one parser takes both.
    serde_yaml::from_str(&text).with_context(|| format!("{} is not a valid ruleset file", path.display()))
}

async fn ruleset(pool: &PgPool, cmd: &RulesetCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        RulesetCmd::Create { file } => {
            let spec = read_ruleset_file(file)?;
            let done = authoring::commit(pool, &actor(), "ruleset.create", &spec.name.clone(), async |c| {
                authoring::create_ruleset(c, &spec).await?;
                Ok(((), serde_json::to_value(&spec).expect("plain data serializes")))
            })
            .await?;
            report(json, &format!("ruleset {} created (version 1)", spec.name), done);
        }
        RulesetCmd::Update { file, expect } => {
            let spec = read_ruleset_file(file)?;
            let done = authoring::commit(pool, &actor(), "ruleset.update", &spec.name.clone(), async |c| {
                let v = authoring::update_ruleset(c, &spec, expect.expect_version).await?;
                Ok((v, serde_json::to_value(&spec).expect("plain data serializes")))
            })
            .await?;
            report(json, &format!("ruleset {} updated (version {})", spec.name, done.value), done);
        }
        RulesetCmd::Delete { name, expect } => {
            let done = authoring::commit(pool, &actor(), "ruleset.delete", name, async |c| {
                authoring::delete_ruleset(c, name, expect.expect_version).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(json, &format!("ruleset {name} deleted"), done);
        }
        RulesetCmd::List => {
            let all = store::list_rulesets(&mut *pool.acquire().await?).await?;
            if json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|r| {
                    let scope: Vec<String> =
                        r.spec.scope.iter().map(|(k, vs)| format!("{k} in ({})", vs.join(", "))).collect();
                    vec![
                        r.spec.name,
                        r.version.to_string(),
                        if r.spec.enabled { "yes" } else { "no" }.into(),
                        scope.join(" and "),
                        r.spec.rules.len().to_string(),
                    ]
                })
                .collect();
            print_table(&["name", "version", "enabled", "scope", "rules"], rows);
        }
        RulesetCmd::Show { name } => {
            let all = store::list_rulesets(&mut *pool.acquire().await?).await?;
            let Some(view) = all.into_iter().find(|r| &r.spec.name == name) else {
                bail!("ruleset {name:?} not found");
            };
            if json {
                return print_json(&view);
            }
            println!("# version: {}", view.version);
            print!("{}", serde_yaml::to_string(&view.spec)?);
        }
    }
    Ok(())
}

async fn workload(pool: &PgPool, cmd: &WorkloadCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        WorkloadCmd::List | WorkloadCmd::Show { .. } => {
            let only = if let WorkloadCmd::Show { id } = cmd { Some(*id) } else { None };
            let all = store::list_workloads(&mut *pool.acquire().await?, only).await?;
            if let Some(id) = only
                && all.is_empty()
            {
                bail!("workload {id} not found");
            }
            if json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|w| {
                    let labels: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    vec![
                        w.id,
                        w.hostname,
                        if w.retired { format!("{} (retired)", w.mode) } else { w.mode },
                        labels.join(","),
                        w.label_version.to_string(),
                        w.addresses.join(" "),
                        w.policy_version.map_or("-".into(), |v| v.to_string()),
                    ]
                })
                .collect();
            print_table(
                &["id", "hostname", "mode", "labels", "label version", "addresses", "policy version"],
                rows,
            );
        }
        WorkloadCmd::Label { id, set, remove, expect_label_version } => {
            let done = authoring::commit(pool, &actor(), "workload.label", &id.to_string(), async |c| {
                let v = authoring::edit_labels(c, *id, *expect_label_version, set, remove).await?;
                let set: Vec<String> = set.iter().map(ToString::to_string).collect();
                let removed: Vec<String> = remove.iter().map(ToString::to_string).collect();
                Ok((v, serde_json::json!({"set": set, "removed": removed})))
            })
            .await?;
            report(json, &format!("labels of {id} updated (label version {})", done.value), done);
        }
        WorkloadCmd::Mode { id, mode } => {
            let done = authoring::commit(pool, &actor(), "workload.mode", &id.to_string(), async |c| {
                authoring::set_mode(c, *id, *mode).await?;
                Ok(((), serde_json::json!({"mode": mode.name()})))
            })
            .await?;
            report(json, &format!("{id} is now in {mode} mode"), done);
        }
        WorkloadCmd::Status { id } => {
            let all = store::sync_status(&mut *pool.acquire().await?, *id).await?;
            if let Some(id) = id
                && all.is_empty()
            {
                bail!("workload {id} not found (or retired)");
            }
            if json {
                return print_json(&all);
            }
            let when = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or("-".into(), |t| t.format("%F %T").to_string())
            };
            let rows = all
                .into_iter()
                .map(|w| {
                    let latest = w.latest_version.map_or("-".into(), |v| v.to_string());
                    let behind = match w.latest_version {
                        Some(l) if l != w.applied_version => {
                            format!("{}/{latest} (behind)", w.applied_version)
                        }
                        _ => format!("{}/{latest}", w.applied_version),
                    };
                    vec![
                        w.id.to_string(),
                        w.hostname,
                        behind,
                        w.state.0.name().to_owned(),
                        w.detail,
                        when(w.last_seen_at),
                        when(w.last_acked_at),
                        when(w.last_snapshot_sent_at),
                    ]
                })
                .collect();
            print_table(
                &[
                    "id",
                    "hostname",
                    "applied/latest",
                    "state",
                    "detail",
                    "last seen",
                    "last ack",
                    "last snapshot",
                ],
                rows,
            );
        }
        WorkloadCmd::ResendSnapshot { id } => {
            let requested = authoring::request_snapshot(pool, *id).await?;
            if json {
                return print_json(&requested);
            }
            let at = requested.last_snapshot_sent_at.map_or("never".into(), |t| t.to_rfc3339());
            println!(
                "asked the replica holding {id}'s stream to reconnect it; success shows as last snapshot advancing past {at}"
            );
        }
        WorkloadCmd::Retire { id } | WorkloadCmd::Deny { id } => {
            let retire = matches!(cmd, WorkloadCmd::Retire { .. });
            let action = if retire { "workload.retire" } else { "workload.deny" };
            let done = authoring::commit(pool, &actor(), action, &id.to_string(), async |c| {
                if retire {
                    authoring::retire(c, *id).await?
                } else {
                    authoring::deny(c, *id).await?
                }
                Ok(((), serde_json::json!({})))
            })
            .await?;
            let what = if retire {
                "retired: it left every render and its stream is closed"
            } else {
                "deny-listed: refused at the handshake, its stream is cut and it left every render"
            };
            report(json, &format!("{id} {what}"), done);
        }
        WorkloadCmd::Policy { id } => {
            let Some((policy, rendered_at)) =
                store::persisted_policy(&mut *pool.acquire().await?, *id).await?
            else {
                bail!("workload {id} has no rendered policy (unknown workload, or not rendered yet)");
            };
            let rules: Vec<serde_json::Value> = policy
                .rules()
                .map(|r| {
                    serde_json::json!({
                        "rule_id": r.id().to_string(),
                        "protocol": r.protocol().name(),
                        "ports": r.ports().iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "peers": r.peers().iter().map(ToString::to_string).collect::<Vec<_>>(),
                    })
                })
                .collect();
            if json {
                return print_json(&serde_json::json!({
                    "workload": id.to_string(),
                    "version": policy.version(),
                    "mode": policy.mode().name(),
                    "rendered_at": rendered_at,
                    "rules": rules,
                }));
            }
            println!(
                "workload {id}: version {} · mode {} · rendered {rendered_at}",
                policy.version(),
                policy.mode()
            );
            let rows = policy
                .rules()
                .map(|r| {
                    let ports: Vec<String> = r.ports().iter().map(ToString::to_string).collect();
                    let peers: Vec<String> = r.peers().iter().map(ToString::to_string).collect();
                    vec![r.id().to_string(), r.protocol().to_string(), ports.join(","), peers.join(" ")]
                })
                .collect();
            print_table(&["rule", "protocol", "ports", "peers"], rows);
        }
    }
    Ok(())
}
