//! `innerwall serve`: one control-plane replica, from start-up to a drained stop on SIGINT or
//! SIGTERM, reloading its configuration on SIGHUP.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use innerwall_control_plane::admission::Limits;
use innerwall_control_plane::api::{self, ApiLimits};
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::identity::ca::{self, FileCa};
use innerwall_control_plane::policy::model::{Management, ServiceEntry};
use innerwall_control_plane::postgres::{PoolConfig, PoolsConfig};
use innerwall_control_plane::rate::AgentBounds;
use innerwall_control_plane::safety::management::{self, Seeded};
use innerwall_control_plane::sync::gateway;
use innerwall_control_plane::{flows, service};
use innerwall_wire::config::Setting;
use innerwall_wire::policy::Cidr;

use crate::ctx::Database;
use crate::duration;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The one agent listener (enrollment, sync, telemetry). Port 0 picks a free port.
    #[arg(long, env = "INNERWALL_LISTEN", default_value = "0.0.0.0:7443")]
    listen: std::net::SocketAddr,
    /// Names and addresses agents dial this replica by (server certificate SANs); repeatable.
    /// Default: this host's name, localhost and 127.0.0.1.
    #[arg(long = "server-name")]
    server_names: Vec<String>,
    /// Lifetime of issued workload certificates, e.g. 24h.
    #[arg(long, default_value = "24h", value_parser = duration::arg)]
    cert_lifetime: std::time::Duration,
    /// Lifetime of this replica's own listener certificate, issued from the CA at start and
    /// reissued at half of it, without a restart.
    #[arg(long, default_value = "90d", value_parser = duration::arg)]
    server_cert_lifetime: std::time::Duration,
    /// Interval agents heartbeat at; a stream silent for three of them is closed.
    #[arg(long, default_value = "30s", value_parser = duration::arg)]
    heartbeat_interval: std::time::Duration,
    /// At most one address change from one workload's inventory reports renders per interval;
    /// reports in between coalesce into the latest.
    #[arg(long, default_value = "5s", value_parser = duration::arg)]
    inventory_min_interval: std::time::Duration,
    /// Flow window length agents use.
    #[arg(long, default_value = "60s", value_parser = duration::arg)]
    flow_window: std::time::Duration,
    /// How long flow evidence is kept (whole days); windows older than this are refused.
    #[arg(long, default_value = "30d", value_parser = duration::arg)]
    flow_retention: std::time::Duration,
    /// How far ahead of this replica's clock a flow window's times may be (agents' clock skew).
    #[arg(long, default_value = "5m", value_parser = duration::arg)]
    flow_max_ahead: std::time::Duration,
    /// Management sources every workload admits whatever its policy says, as the failsafe rule
    /// `failsafe:management` (repeatable, e.g. 192.0.2.0/24). Stored as the estate's set when
    /// none is; after that the set only narrows (`innerwall management narrow`) or is replaced
    /// on the database (`innerwall management reset`), and a different value here is reported.
    #[arg(long = "management-cidr", value_parser = crate::estate::parse_cidr)]
    management_cidr: Vec<Cidr>,
    /// The services management sources reach (repeatable service entries, e.g. tcp:22 udp:161).
    #[arg(long = "management-service", default_value = "tcp:22", value_parser = crate::management::parse_entry)]
    management_service: Vec<ServiceEntry>,
    #[command(flatten)]
    retention: RetentionArgs,
    #[command(flatten)]
    api: ApiArgs,
    /// Connections held at once, all sources together; raise `ulimit -n` above it.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// Connections held at once from one source address (hosts behind one NAT share it).
    #[arg(long, default_value_t = Limits::default().max_connections_per_source)]
    max_connections_per_source: usize,
    /// Connections held at once by one agent identity (policy, uploads, a reconnect).
    #[arg(long, default_value_t = Limits::default().max_connections_per_identity)]
    max_connections_per_identity: usize,
    /// TLS handshakes in progress at once; connections beyond are closed at accept.
    #[arg(long, default_value_t = Limits::default().max_handshakes)]
    max_handshakes: usize,
    /// Concurrent HTTP/2 streams on one connection.
    #[arg(long, default_value_t = Limits::default().max_streams_per_connection)]
    max_streams_per_connection: u32,
    /// Connections without a client certificate (enrollment) held at once.
    #[arg(long, default_value_t = Limits::default().max_unauthenticated_connections)]
    max_unauthenticated_connections: usize,
    /// How long a connection without a client certificate (enrollment) may stay open.
    #[arg(long, default_value = "30s", value_parser = duration::arg)]
    unauthenticated_lifetime: std::time::Duration,
    /// Flow window uploads one agent identity may make per minute (a minute's worth may come
    /// at once); more are refused with RESOURCE_EXHAUSTED and a retry-after, and stay queued on
    /// the agent. Per replica.
    #[arg(long, default_value_t = AgentBounds::default().uploads_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    agent_uploads_per_minute: u32,
    /// Bytes of flow windows one agent identity may upload per minute (encoded); at least the
    /// largest upload (32 MiB) so every window can pass.
    #[arg(long, default_value_t = AgentBounds::default().upload_bytes_per_minute, value_parser = clap::value_parser!(u64).range(1..))]
    agent_upload_bytes_per_minute: u64,
    /// Heartbeats one agent identity may send per minute; over it its stream ends with
    /// RESOURCE_EXHAUSTED and a retry-after.
    #[arg(long, default_value_t = AgentBounds::default().heartbeats_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    agent_heartbeats_per_minute: u32,
    /// Policy streams (Hello, reconnects) one agent identity may open per minute.
    #[arg(long, default_value_t = AgentBounds::default().hellos_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    agent_hellos_per_minute: u32,
    /// Tamper and identity-clone reports of one workload within this long of the audit row
    /// that recorded the first are counted on that row instead of adding rows.
    #[arg(long, default_value = "1h", value_parser = duration::arg)]
    agent_report_coalesce: std::time::Duration,
    /// Agent identities whose rate state this replica holds at once (memory: about 100 bytes
    /// each); beyond it the least recently seen are forgotten.
    #[arg(long, default_value_t = AgentBounds::default().max_tracked as u64, value_parser = clap::value_parser!(u64).range(1..))]
    agent_rate_tracked: u64,
    /// Database connections for agent streams (Hello, state records, heartbeats, liveness, the
    /// NOTIFY bridge); statements there are bounded to 15 s.
    #[arg(long, default_value_t = PoolConfig::STREAMS.size, value_parser = clap::value_parser!(u32).range(1..))]
    db_stream_connections: u32,
    /// Database connections for flow ingest and retention; a flood of uploads waits for these
    /// and never for the others. Statements bounded to 30 s.
    #[arg(long, default_value_t = PoolConfig::INGEST.size, value_parser = clap::value_parser!(u32).range(1..))]
    db_ingest_connections: u32,
    /// Database connections for enrollment, renewal and renders; statements bounded to 60 s.
    #[arg(long, default_value_t = PoolConfig::AUTHORING.size, value_parser = clap::value_parser!(u32).range(1..))]
    db_authoring_connections: u32,
    /// Serve Prometheus metrics at http://ADDR/metrics. Plain HTTP without authentication:
    /// bind it to a private address. Off by default.
    #[arg(long, env = "INNERWALL_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
}

/// The keys a reload puts in force while `serve` runs; a change to any other is named as
/// needing a restart. The API's certificate files are read again on every reload.
const RELOADED: &[&str] = &[
    "log-level",
    "api-requests-per-minute",
    "api-max-concurrent-per-token",
    "api-unauthenticated-per-minute",
];

impl ServeArgs {
    /// Everything about these arguments that can be wrong before anything starts (`config
    /// check` runs it, as `serve` does).
    pub fn check(&self) -> anyhow::Result<()> {
        let flows = days(self.flow_retention, "--flow-retention")?;
        chrono::Duration::from_std(self.flow_max_ahead).context("--flow-max-ahead is too large")?;
        self.retention.retention(flows)?;
        self.api.config(&[], self.server_cert_lifetime)?;
        self.management()?;
        Ok(())
    }

    fn pools(&self) -> PoolsConfig {
        let defaults = PoolsConfig::default();
        PoolsConfig {
            streams: PoolConfig { size: self.db_stream_connections, ..defaults.streams },
            ingest: PoolConfig { size: self.db_ingest_connections, ..defaults.ingest },
            authoring: PoolConfig { size: self.db_authoring_connections, ..defaults.authoring },
        }
    }

    fn agent_bounds(&self) -> AgentBounds {
        AgentBounds {
            uploads_per_minute: self.agent_uploads_per_minute,
            upload_bytes_per_minute: self.agent_upload_bytes_per_minute,
            heartbeats_per_minute: self.agent_heartbeats_per_minute,
            hellos_per_minute: self.agent_hellos_per_minute,
            report_coalesce: self.agent_report_coalesce,
            max_tracked: usize::try_from(self.agent_rate_tracked).unwrap_or(usize::MAX),
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_connections_per_source: self.max_connections_per_source,
            max_connections_per_identity: self.max_connections_per_identity,
            max_handshakes: self.max_handshakes,
            max_streams_per_connection: self.max_streams_per_connection,
            max_unauthenticated_connections: self.max_unauthenticated_connections,
            unauthenticated_lifetime: self.unauthenticated_lifetime,
            ..Limits::default()
        }
    }
}

/// Retention of the control plane's own tables (issue 25), run hourly after flow retention.
#[derive(Debug, Args)]
pub struct RetentionArgs {
    /// How long audit records are kept (whole days).
    #[arg(long, default_value = "365d", value_parser = duration::arg)]
    audit_retention: std::time::Duration,
    /// How long a superseded policy version is kept (whole days, at least --flow-retention);
    /// versions a promotion record, a retained flow window or the workload refers to stay.
    #[arg(long, default_value = "90d", value_parser = duration::arg)]
    policy_history_retention: std::time::Duration,
    /// How long a replaced label set is kept (whole days, at least --flow-retention).
    #[arg(long, default_value = "90d", value_parser = duration::arg)]
    label_history_retention: std::time::Duration,
    /// How long a retired workload is kept (whole days); one a promotion record names or a
    /// retained flow window belongs to stays, as does one whose credential is still valid.
    #[arg(long, default_value = "90d", value_parser = duration::arg)]
    retired_workload_retention: std::time::Duration,
    /// How long provisioning and operator tokens are kept after they expired or were revoked.
    #[arg(long, default_value = "30d", value_parser = duration::arg)]
    token_retention: std::time::Duration,
    /// At most this many rows are deleted per transaction.
    #[arg(long, default_value_t = innerwall_control_plane::retention::Retention::default().batch,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    retention_batch: i64,
}

impl RetentionArgs {
    /// The retention, refused if history would go before the flow windows it explains.
    pub fn retention(
        &self,
        flows: chrono::Duration,
    ) -> anyhow::Result<innerwall_control_plane::retention::Retention> {
        let retention = innerwall_control_plane::retention::Retention {
            audit: days(self.audit_retention, "--audit-retention")?,
            policy_history: days(self.policy_history_retention, "--policy-history-retention")?,
            label_history: days(self.label_history_retention, "--label-history-retention")?,
            retired_workloads: days(self.retired_workload_retention, "--retired-workload-retention")?,
            tokens: days(self.token_retention, "--token-retention")?,
            batch: self.retention_batch,
        };
        for (flag, kept) in [
            ("--policy-history-retention", retention.policy_history),
            ("--label-history-retention", retention.label_history),
        ] {
            if kept < flows {
                anyhow::bail!(
                    "{flag} ({} days) must be at least --flow-retention ({} days): retained flow windows \
                     are resolved against that history",
                    kept.num_days(),
                    flows.num_days()
                );
            }
        }
        Ok(retention)
    }
}

/// The operator HTTP API's listener (issue 12): off unless `--api-listen` is given.
#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Serve the operator HTTP API (HTTPS) on this address, e.g. 0.0.0.0:8443. Off without it.
    #[arg(long, env = "INNERWALL_API_LISTEN")]
    api_listen: Option<std::net::SocketAddr>,
    /// The API's certificate chain (PEM); with --api-key. Without them a certificate is issued
    /// from the CA for the --server-name names at start (its SHA-256 fingerprint is printed).
    #[arg(long, requires = "api_key")]
    api_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --api-cert.
    #[arg(long, requires = "api_cert")]
    api_key: Option<std::path::PathBuf>,
    /// The largest request body the API reads, in bytes.
    #[arg(long, default_value_t = ApiLimits::default().max_body)]
    api_max_body: usize,
    /// How long one API request may take.
    #[arg(long, default_value = "30s", value_parser = duration::arg)]
    api_request_timeout: std::time::Duration,
    /// API connections held at once; more are closed at accept.
    #[arg(long, default_value_t = ApiLimits::default().max_connections)]
    api_max_connections: usize,
    /// API connections held at once from one source address; more are closed at accept.
    #[arg(long, default_value_t = ApiLimits::default().max_connections_per_source as u64, value_parser = clap::value_parser!(u64).range(1..))]
    api_max_connections_per_source: u64,
    /// How long writing an answer may stall (a client that does not read it) before the API
    /// closes the connection.
    #[arg(long, default_value = "10s", value_parser = duration::arg)]
    api_write_timeout: std::time::Duration,
    /// How long one API connection may stay open, however busy.
    #[arg(long, default_value = "10m", value_parser = duration::arg)]
    api_connection_lifetime: std::time::Duration,
    /// Requests one operator token may make per minute (a minute's worth may come at once);
    /// more are answered 429 with Retry-After. Per replica.
    #[arg(long, default_value_t = ApiLimits::default().requests_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    api_requests_per_minute: u32,
    /// Requests of one operator token in flight at once; more are answered 429.
    #[arg(long, default_value_t = ApiLimits::default().max_concurrent_per_token as u64, value_parser = clap::value_parser!(u64).range(1..))]
    api_max_concurrent_per_token: u64,
    /// Requests without a valid operator token (none, a bad one, the OpenAPI document) one
    /// source address may make per minute; more are answered 429 before any token is looked up.
    #[arg(long, default_value_t = ApiLimits::default().unauthenticated_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    api_unauthenticated_per_minute: u32,
    /// Renders and snapshot resends (each counted apart) one API token may ask for per minute.
    /// Shared by every replica; the local CLI applies the default.
    #[arg(long, default_value_t = ApiLimits::default().expensive.per_actor_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    api_expensive_per_minute: u32,
    /// Renders and snapshot resends (each counted apart) everyone together may ask for per
    /// minute, the CLI included.
    #[arg(long, default_value_t = ApiLimits::default().expensive.overall_per_minute, value_parser = clap::value_parser!(u32).range(1..))]
    api_expensive_overall_per_minute: u32,
    /// Services that may exist at once; creating one more through the API is refused naming
    /// this flag (409 limit-reached). The local CLI applies the default.
    #[arg(long, default_value_t = CountBounds::default().services, value_parser = clap::value_parser!(u64).range(1..))]
    max_services: u64,
    /// Address groups that may exist at once (as --max-services).
    #[arg(long, default_value_t = CountBounds::default().address_groups, value_parser = clap::value_parser!(u64).range(1..))]
    max_address_groups: u64,
    /// Rulesets that may exist at once (as --max-services).
    #[arg(long, default_value_t = CountBounds::default().rulesets, value_parser = clap::value_parser!(u64).range(1..))]
    max_rulesets: u64,
    /// Provisioning tokens neither revoked nor expired at once (as --max-services).
    #[arg(long, default_value_t = CountBounds::default().provisioning_tokens, value_parser = clap::value_parser!(u64).range(1..))]
    max_provisioning_tokens: u64,
    /// Operator tokens neither revoked nor expired at once (as --max-services).
    #[arg(long, default_value_t = CountBounds::default().operator_tokens, value_parser = clap::value_parser!(u64).range(1..))]
    max_operator_tokens: u64,
}

impl ApiArgs {
    fn counts(&self) -> CountBounds {
        CountBounds {
            services: self.max_services,
            address_groups: self.max_address_groups,
            rulesets: self.max_rulesets,
            provisioning_tokens: self.max_provisioning_tokens,
            operator_tokens: self.max_operator_tokens,
        }
    }

    /// The API's configuration, if it is to listen; its certificate lives as long as the agent
    /// listener's would, issued for the same names.
    fn config(
        &self,
        names: &[String],
        lifetime: std::time::Duration,
    ) -> anyhow::Result<Option<api::ApiConfig>> {
        if self.api_max_body == 0
            || self.api_max_connections == 0
            || self.api_request_timeout.is_zero()
            || self.api_write_timeout.is_zero()
            || self.api_connection_lifetime.is_zero()
        {
            anyhow::bail!(
                "--api-max-body, --api-max-connections, --api-request-timeout, --api-write-timeout and \
                 --api-connection-lifetime must be more than 0"
            );
        }
        let Some(listen) = self.api_listen else { return Ok(None) };
        let tls = match (&self.api_cert, &self.api_key) {
            (Some(cert), Some(key)) => api::ApiTls::Files { cert: cert.clone(), key: key.clone() },
            (None, None) => api::ApiTls::FromCa { names: names.to_vec(), lifetime },
            // The flags require each other; a file or the environment could give one alone.
            _ => anyhow::bail!("--api-cert and --api-key are given together or not at all"),
        };
        let defaults = ApiLimits::default();
        let limits = ApiLimits {
            max_body: self.api_max_body,
            request_timeout: self.api_request_timeout,
            max_connections: self.api_max_connections,
            max_connections_per_source: usize::try_from(self.api_max_connections_per_source)
                .unwrap_or(usize::MAX),
            write_timeout: self.api_write_timeout,
            connection_lifetime: self.api_connection_lifetime,
            requests_per_minute: self.api_requests_per_minute,
            max_concurrent_per_token: usize::try_from(self.api_max_concurrent_per_token)
                .unwrap_or(usize::MAX),
            unauthenticated_per_minute: self.api_unauthenticated_per_minute,
            expensive: innerwall_control_plane::policy::authoring::ExpensiveBounds {
                per_actor_per_minute: self.api_expensive_per_minute,
                overall_per_minute: self.api_expensive_overall_per_minute,
                ..defaults.expensive
            },
            counts: self.counts(),
            ..defaults
        };
        Ok(Some(api::ApiConfig { listen, tls, limits }))
    }
}

impl ServeArgs {
    /// The management access the flags name, if they name any source.
    fn management(&self) -> anyhow::Result<Option<Management>> {
        if self.management_cidr.is_empty() {
            return Ok(None);
        }
        let set =
            Management::new(self.management_cidr.iter().copied(), self.management_service.iter().cloned())
                .context("--management-cidr and --management-service")?;
        Ok(Some(set))
    }
}

/// Stores the flags' management access as the estate's when none is stored; what to say about
/// the estate's management access once the replica is listening (a warning, or not).
async fn seed_management(args: &ServeArgs, pool: &sqlx::PgPool) -> anyhow::Result<(bool, String)> {
    let Some(set) = args.management()? else {
        let mut conn = pool.acquire().await?;
        return Ok(match management::list(&mut conn).await?.estate {
            None => (
                true,
                "no management access is set: an enforced host admits only what its policy does (and \
                 loopback, its own connections, neighbour discovery); give --management-cidr"
                    .to_owned(),
            ),
            Some(view) => (
                false,
                format!(
                    "management access of the estate: {} from {}",
                    view.services.join(" "),
                    view.cidrs.join(" ")
                ),
            ),
        });
    };
    Ok(match management::seed(pool, "serve", &set).await? {
        Seeded::Stored => (false, format!("management access of the estate set to {set}")),
        Seeded::Same => (false, format!("management access of the estate: {set}")),
        Seeded::Differs(stored) => (
            true,
            format!(
                "--management-cidr and --management-service say {set}, but the estate's stored \
                 management access is {stored}, and it stays: narrow it with `innerwall management \
                 narrow`, replace it with `innerwall management reset` on the database"
            ),
        ),
    })
}

/// A retention in whole days, at least one.
pub fn days(d: std::time::Duration, flag: &str) -> anyhow::Result<chrono::Duration> {
    let days = d.as_secs() / 86_400;
    if days == 0 || !d.as_secs().is_multiple_of(86_400) {
        anyhow::bail!("{flag} must be a whole number of days, at least 1d");
    }
    chrono::Duration::try_days(days as i64).with_context(|| format!("{flag} is too large"))
}

/// What `serve` runs with, read from its command line and configuration file: its arguments,
/// and every key's value and source.
pub struct View {
    pub args: Box<ServeArgs>,
    pub log_level: String,
    pub settings: Vec<Setting>,
}

/// Reads the command line and the configuration file as they are now (at start, and on each
/// SIGHUP): what would be in force, or every problem with it.
pub type Reread<'a> = &'a dyn Fn() -> Result<View, Vec<String>>;

/// Loads the CA before touching the database, so a replica without one fails at once.
pub async fn run(
    args: &ServeArgs,
    database: &Database,
    ca_dir: &Path,
    reread: Reread<'_>,
) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("while installing the SIGHUP handler")?;
    args.check()?;
    let mut in_force = reread().map_err(|p| anyhow::anyhow!("{}", p.join("; ")))?.settings;
    let signer: Arc<dyn ca::Signer> =
        Arc::new(FileCa::load(ca_dir).context("while loading the CA (create it with `innerwall ca init`)")?);
    let (pools, supervisor) = database.connect_pools(&args.pools()).await?;
    let (warn, management) = seed_management(args, &pools.authoring).await?;
    // On the embedded cluster, a postmaster that dies is restarted (and logged) while we run.
    let mut tasks = innerwall_wire::tasks::Tasks::default();
    if let Some(supervisor) = supervisor {
        tasks.spawn("postmaster supervisor", supervisor.run(pools.clone()));
    }
    let config = service::ServiceConfig {
        listen: args.listen,
        server_names: if args.server_names.is_empty() {
            default_server_names()
        } else {
            args.server_names.clone()
        },
        cert_lifetime: args.cert_lifetime,
        server_cert_lifetime: args.server_cert_lifetime,
        gateway: gateway::GatewayConfig {
            heartbeat: args.heartbeat_interval,
            flow_window: args.flow_window,
            inventory_min_interval: args.inventory_min_interval,
            bounds: args.agent_bounds(),
            ..Default::default()
        },
        flow_bounds: flows::TimeBounds {
            max_age: days(args.flow_retention, "--flow-retention")?,
            max_ahead: chrono::Duration::from_std(args.flow_max_ahead)
                .context("--flow-max-ahead is too large")?,
        },
        limits: args.limits(),
        retention: args.retention.retention(days(args.flow_retention, "--flow-retention")?)?,
        metrics_listen: args.metrics_listen,
    };
    let mut running = service::start(pools, signer, config).await?;
    if let Some(api) = args.api.config(&running.server_names, args.server_cert_lifetime)? {
        let addr = running.start_api(api).await?;
        let fingerprint = running.api().map_or("", |a| a.fingerprint.as_str());
        tracing::info!(
            target: crate::logs::NOTICE,
            "innerwall: operator API on https://{addr}/api/v1 (certificate SHA-256 {fingerprint})"
        );
    }
    tracing::info!(
        target: crate::logs::NOTICE,
        "innerwall: startup render advanced {} workload(s); listening on {} as {}",
        running.startup_changes,
        running.local_addr,
        running.server_names.join(", ")
    );
    if warn {
        tracing::warn!(target: crate::logs::NOTICE, "innerwall: {management}");
    } else {
        tracing::info!(target: crate::logs::NOTICE, "innerwall: {management}");
    }
    if let Some(addr) = running.metrics_addr {
        tracing::info!(target: crate::logs::NOTICE, "innerwall: metrics at http://{addr}/metrics (unauthenticated)");
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = hangups.recv() => reload(reread, &mut in_force, &running),
        }
    }
    tasks.stop().await;
    running.stop().await?;
    Ok(())
}

/// A SIGHUP: reads the command line and the file again and puts in force what can change
/// while running ([`RELOADED`], the API certificate's files); says what changed, what did
/// not take effect and why. A configuration with a problem changes nothing.
fn reload(reread: Reread<'_>, in_force: &mut [Setting], running: &service::Running) {
    let notice = |text: String| tracing::warn!(target: crate::logs::NOTICE, "innerwall: {text}");
    let view = match reread() {
        Ok(view) => view,
        Err(problems) => {
            return notice(format!("reload refused, nothing changed: {}", problems.join("; ")));
        }
    };
    let changed: Vec<&str> = view
        .settings
        .iter()
        .filter(|new| {
            in_force.iter().find(|old| old.key == new.key).is_none_or(|old| old.values != new.values)
        })
        .map(|s| s.key.as_str())
        .collect();
    let (applied, restart): (Vec<&str>, Vec<&str>) = changed.iter().partition(|k| RELOADED.contains(k));
    let mut said = Vec::new();
    if applied.contains(&"log-level")
        && let Err(e) = crate::logs::set_filter(&view.log_level)
    {
        return notice(format!("reload refused, nothing changed: --log-level {e}"));
    }
    if let Some(api) = running.api() {
        let limits = view.args.api.config(&[], view.args.server_cert_lifetime).ok().flatten();
        let rates = limits.map_or_else(|| api.rates(), |c| api::edge::EdgeRates::from(c.limits));
        match api.reload(rates).certificate {
            Ok(Some(fingerprint)) => said.push(format!("the API certificate is now SHA-256 {fingerprint}")),
            Ok(None) => {}
            Err(e) => said.push(format!("the API certificate was kept: {e}")),
        }
    }
    if !applied.is_empty() {
        said.insert(0, format!("applied {}", applied.join(", ")));
    }
    if !restart.is_empty() {
        said.push(format!("not applied until a restart: {}", restart.join(", ")));
    }
    if said.is_empty() {
        said.push("nothing changed".to_owned());
    }
    notice(format!("configuration reloaded: {}", said.join("; ")));
    // What needs a restart stays recorded as it runs, so the next reload names it again.
    for setting in &view.settings {
        if applied.contains(&setting.key.as_str())
            && let Some(old) = in_force.iter_mut().find(|old| old.key == setting.key)
        {
            *old = setting.clone();
        }
    }
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

fn default_server_names() -> Vec<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    if !host.trim().is_empty() {
        names.insert(0, host.trim().to_owned());
    }
    names
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn flag_defaults_are_the_library_defaults() {
        let args = Cli::parse_from(["serve"]).serve;
        assert_eq!(args.limits(), Limits::default());
        assert_eq!(args.pools(), PoolsConfig::default());
        assert_eq!(args.agent_bounds(), AgentBounds::default());
        assert_eq!(args.api.counts(), CountBounds::default());
        let args = Cli::parse_from(["serve", "--max-rulesets", "7"]).serve;
        assert_eq!(args.api.counts().rulesets, 7);
        let args = Cli::parse_from(["serve", "--agent-hellos-per-minute", "3"]).serve;
        assert_eq!(args.agent_bounds().hellos_per_minute, 3);
        assert!(Cli::try_parse_from(["serve", "--agent-uploads-per-minute", "0"]).is_err());
        let args = Cli::parse_from(["serve", "--db-ingest-connections", "2"]).serve;
        assert_eq!(args.pools().ingest, PoolConfig { size: 2, ..PoolConfig::INGEST });
        assert!(Cli::try_parse_from(["serve", "--db-stream-connections", "0"]).is_err());
    }

    #[test]
    fn retention_flags_default_to_the_library_and_keep_history_as_long_as_flows() {
        let thirty = chrono::Duration::days(30);
        let args = Cli::parse_from(["serve"]).serve;
        assert_eq!(
            args.retention.retention(thirty).unwrap(),
            innerwall_control_plane::retention::Retention::default()
        );
        let args = Cli::parse_from(["serve", "--policy-history-retention", "7d"]).serve;
        let err = args.retention.retention(thirty).unwrap_err().to_string();
        assert!(
            err.contains("--policy-history-retention (7 days) must be at least --flow-retention (30 days)"),
            "{err}"
        );
        let args = Cli::parse_from(["serve", "--audit-retention", "36h"]).serve;
        let err = args.retention.retention(thirty).unwrap_err().to_string();
        assert!(err.contains("--audit-retention must be a whole number of days"), "{err}");
        assert!(Cli::try_parse_from(["serve", "--retention-batch", "0"]).is_err());
    }
}
