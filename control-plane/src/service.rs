//! One control-plane replica as a running service: startup render (POL-6), the NOTIFY bridge,
//! the agent listener, and the metrics listener if asked for; and, when asked
//! (`Running::start_api`), the operator HTTP API on a listener of its own. `innerwall serve` runs
//! it; tests start several against one database.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use innerwall_wire::proto::agent_service_server::AgentServiceServer;
use innerwall_wire::proto::enrollment_service_server::EnrollmentServiceServer;
use innerwall_wire::proto::telemetry_service_server::TelemetryServiceServer;
use innerwall_wire::tasks::Tasks;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;

use crate::admission::{Admission, Limits};
use crate::error::Error;
use crate::identity::ca::Signer;
use crate::identity::enroll::Enroller;
use crate::identity::listener::{self, Authenticate, ServerError};
use crate::identity::server_cert::ServerCertificate;
use crate::metrics::Metrics;
use crate::policy::authoring;
use crate::postgres::Pools;
use crate::sync::bridge;
use crate::sync::gateway::{Gateway, GatewayConfig};

/// How long a stopping replica waits for open connections to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub listen: SocketAddr,
    /// Names and addresses agents dial this replica by (server certificate SANs).
    pub server_names: Vec<String>,
    pub cert_lifetime: Duration,
    /// Lifetime of the listener's own certificate; it is reissued at half of it.
    pub server_cert_lifetime: Duration,
    pub gateway: GatewayConfig,
    /// How old and how far ahead flow window times may be; the age is also the retention.
    pub flow_bounds: crate::flows::TimeBounds,
    /// Bounds on connections, handshakes and streams.
    pub limits: Limits,
    /// How long the control plane's own rows are kept (audit, history, retired, tokens).
    pub retention: crate::retention::Retention,
    /// Where `/metrics` is served (plain HTTP, unauthenticated: a private address); none if
    /// `None`.
    pub metrics_listen: Option<SocketAddr>,
}

/// The largest message each service accepts: enrollment is small (a CSR, a token, host facts
/// with at most 1,024 addresses); the agent service carries Hello, acks, heartbeats and
/// inventory; only authenticated uploads carry large flow windows (at most 100,000 records).
/// What the agent service sends (policy updates) is bounded by `wire::sync::MAX_POLICY_MESSAGE`,
/// the agent's decoding limit too; the gateway never sends an update over it.
pub const ENROLL_MAX_MESSAGE: usize = 64 * 1024;
pub const AGENT_MAX_MESSAGE: usize = 1024 * 1024;
pub const TELEMETRY_MAX_MESSAGE: usize = 32 * 1024 * 1024;

/// Concurrent HTTP/2 streams on a connection without a client certificate: enrollment is one
/// call. The decoder reserves a message's declared length as soon as its five-byte prefix
/// arrives, so every stream may cost up to `ENROLL_MAX_MESSAGE` whatever the client sends;
/// with agents' stream limit (8) instead, 256 unauthenticated connections held 128 MiB.
pub const UNAUTHENTICATED_STREAMS: u32 = 1;

/// HTTP/2 flow-control windows (per stream and per connection) on a connection without a
/// client certificate: one enrollment message. What the transport buffers for such a
/// connection before the decoder reads it stays within this, not within hyper's default 1 MiB.
pub const UNAUTHENTICATED_WINDOW: u32 = ENROLL_MAX_MESSAGE as u32;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Store(#[from] Error),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error(transparent)]
    Api(#[from] crate::api::ApiStartError),
    #[error("binding the agent listener on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("binding the metrics listener on {addr} (--metrics-listen)")]
    BindMetrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A started replica. Dropping it without `stop` leaves its tasks running until the runtime ends.
#[derive(Debug)]
pub struct Running {
    pub local_addr: SocketAddr,
    pub server_names: Vec<String>,
    pub startup_changes: usize,
    pub gateway: Gateway,
    /// Retired and deny-listed identities, and the agent connections open on this replica.
    pub admission: Arc<Admission>,
    server: JoinHandle<Result<(), ServerError>>,
    /// The bridge, upkeep, liveness sweep, certificate renewal and metrics, under one token
    /// that also stops the listener accepting.
    tasks: Tasks,
    /// The listener's certificate, reissued before it expires.
    pub certificate: Arc<ServerCertificate>,
    /// This replica's metrics, and where they are served (if they are).
    pub metrics: Arc<Metrics>,
    pub metrics_addr: Option<SocketAddr>,
    /// What the operator API needs to start: the authoring pool and the CA.
    authoring: PgPool,
    signer: Arc<dyn Signer>,
    /// The operator API, once started.
    api: Option<crate::api::ApiServer>,
}

/// How often a replica re-reads its CA directory for a rotation or retirement.
pub const CA_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Re-reads the CA every [`CA_RELOAD_INTERVAL`]; a directory caught half-changed (or broken)
/// keeps the CA loaded before, and is logged once until it loads again.
async fn reload_ca_forever(signer: Arc<dyn Signer>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(CA_RELOAD_INTERVAL).await;
        match signer.reload() {
            Ok(true) => {
                failing = false;
                tracing::info!(
                    "the CA changed: the bundle, the issuing root and the listener's certificate follow"
                );
            }
            Ok(false) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::error!("re-reading the CA failed, keeping the one loaded: {e}");
            }
            Err(_) => {}
        }
    }
}

/// Makes today's and tomorrow's flow partitions, sums the map's edges of the windows that arrived
/// and rolls up the records of closed hours every minute (FLOW-6, PERF-11), drops expired flow partitions hourly (FLOW-5) and then deletes the control
/// plane's expired rows (`retention`); replicas serialize on their locks.
async fn flow_upkeep_forever(pool: PgPool, days: i64, retention: crate::retention::Retention) {
    let mut minutely = tokio::time::interval(Duration::from_secs(60));
    for minute in 0u64.. {
        minutely.tick().await;
        if let Err(e) = crate::flows::create_partitions_ahead(&pool).await {
            tracing::warn!("creating the next flow partitions failed: {e:#}");
        }
        if let Err(e) = crate::flows::sum_edges(&pool).await {
            tracing::warn!("summing the map's flow edges failed: {e:#}");
        }
        if let Err(e) = crate::flows::roll_up(&pool, chrono::Utc::now()).await {
            tracing::warn!("flow roll-up failed: {e:#}");
        }
        if minute % 60 != 0 {
            continue;
        }
        match crate::flows::apply_retention(&pool, days, chrono::Utc::now()).await {
            Ok(dropped) if !dropped.is_empty() => tracing::info!(?dropped, "dropped expired flow partitions"),
            Ok(_) => {}
            Err(e) => tracing::warn!("flow retention failed: {e}"),
        }
        match crate::retention::apply(&pool, &retention, chrono::Utc::now()).await {
            Ok(removed) if removed.total() > 0 => {
                tracing::info!(?removed, "deleted expired control-plane rows")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("control-plane retention failed: {e}"),
        }
    }
}

impl Running {
    /// Starts the operator HTTP API (OPS-2) on its own TLS listener, on the authoring pool; `stop`
    /// drains it first. Returns the address it listens on.
    pub async fn start_api(&mut self, config: crate::api::ApiConfig) -> Result<SocketAddr, ServiceError> {
        let server = crate::api::start(self.authoring.clone(), self.signer.clone(), config).await?;
        let addr = server.local_addr;
        self.api = Some(server);
        Ok(addr)
    }

    /// The operator API, if started.
    pub fn api(&self) -> Option<&crate::api::ApiServer> {
        self.api.as_ref()
    }

    /// Stops accepting, drains the operator API, ends the bridge and waits for the server to
    /// finish.
    pub async fn stop(mut self) -> Result<(), ServiceError> {
        if let Some(api) = self.api.take() {
            api.stop(SHUTDOWN_GRACE).await;
        }
        self.gateway.end_all("control plane shutting down");
        self.tasks.stop().await;
        let mut server = self.server;
        let joined = match tokio::time::timeout(SHUTDOWN_GRACE, &mut server).await {
            Ok(joined) => joined,
            Err(_) => {
                tracing::warn!("connections still open after {SHUTDOWN_GRACE:?}; closing them");
                server.abort();
                server.await
            }
        };
        match joined {
            Ok(result) => Ok(result?),
            Err(e) if e.is_cancelled() => Ok(()),
            Err(e) => Err(ServerError::Tls(format!("server task failed: {e}")).into()),
        }
    }
}

/// Starts a replica on `pools`: each job uses its own pool (stream state, the bridge and the
/// liveness sweep `streams`; uploads and retention `ingest`; enrollment, renewal and every render
/// `authoring`), so no job can take the connections another needs.
pub async fn start(
    pools: Pools,
    signer: Arc<dyn Signer>,
    config: ServiceConfig,
) -> Result<Running, ServiceError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Bound first: a taken metrics address fails the start before anything runs.
    let metrics_tcp = match config.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServiceError::BindMetrics { addr, source })?,
        ),
        None => None,
    };
    let metrics = Arc::new(Metrics::new());
    let changed = authoring::render_now(&pools.authoring).await?;
    tracing::info!(changed = changed.len(), "startup render done");
    // Before any task runs: creating a partition locks the tables it references, so it is done
    // here, at once, rather than under whatever the tasks are doing.
    if let Err(e) = crate::flows::create_partitions_ahead(&pools.ingest).await {
        tracing::warn!("creating the flow partitions failed (ingest creates them as needed): {e:#}");
    }

    let admission =
        Arc::new(Admission::new(bridge::load_refused(&pools.streams).await?, config.limits.clone()));
    let enroller = Enroller::new(pools.authoring.clone(), signer.clone(), config.cert_lifetime);
    let gateway = Gateway::new(&pools, config.gateway.clone(), enroller.clone(), metrics.clone());
    let mut tasks = Tasks::default();
    tasks.spawn(
        "bridge",
        bridge::run(pools.streams.clone(), gateway.clone(), admission.clone(), metrics.clone()),
    );
    tasks.spawn(
        "flow upkeep",
        flow_upkeep_forever(
            pools.ingest.clone(),
            config.flow_bounds.max_age.num_days(),
            config.retention.clone(),
        ),
    );
    tasks.spawn("confirm deadlines", revert_unconfirmed_forever(pools.authoring.clone(), metrics.clone()));
    tasks.spawn(
        "liveness sweep",
        crate::sync::liveness::sweep_forever(pools.streams.clone(), config.gateway.heartbeat),
    );

    let certificate = ServerCertificate::issue(
        signer.clone(),
        Arc::new(rustls::crypto::ring::default_provider()),
        &config.server_names,
        config.server_cert_lifetime,
    )
    .map_err(ServerError::from)?;
    let tls = listener::tls_config(signer.clone(), certificate.clone(), admission.clone())?;
    // The listener's certificate is reissued before it expires and whenever the CA changed;
    // the CA directory is re-read every few seconds (a rotation or retirement, IDN-8).
    tasks.spawn("certificate renewal", {
        let (certificate, signer) = (certificate.clone(), signer.clone());
        async move {
            tokio::join!(certificate.renew_forever(), reload_ca_forever(signer));
        }
    });
    let tcp = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServiceError::Bind { addr: config.listen, source })?;
    let local_addr = tcp.local_addr().map_err(ServerError::Io)?;
    let telemetry = crate::flows::Telemetry {
        pool: pools.ingest.clone(),
        bounds: config.flow_bounds,
        metrics: metrics.clone(),
        rate: gateway.bounds(),
        on_blocked: guard(pools.authoring.clone(), metrics.clone()),
    };
    let routes = tonic::service::Routes::new(
        EnrollmentServiceServer::new(enroller.clone()).max_decoding_message_size(ENROLL_MAX_MESSAGE),
    )
    .add_service(InterceptedService::new(
        AgentServiceServer::new(gateway.clone())
            .max_decoding_message_size(AGENT_MAX_MESSAGE)
            .max_encoding_message_size(innerwall_wire::sync::MAX_POLICY_MESSAGE),
        Authenticate(admission.clone()),
    ))
    .add_service(InterceptedService::new(
        TelemetryServiceServer::new(telemetry.clone()).max_decoding_message_size(TELEMETRY_MAX_MESSAGE),
        Authenticate(admission.clone()),
    ));
    let services = listener::Services {
        routes,
        agents: listener::Http2 {
            max_concurrent_streams: config.limits.max_streams_per_connection,
            window: None,
            keepalive: listener::agent_keepalive(config.gateway.heartbeat),
        },
        unauthenticated: listener::Http2 {
            max_concurrent_streams: UNAUTHENTICATED_STREAMS,
            window: Some(UNAUTHENTICATED_WINDOW),
            keepalive: listener::UNAUTHENTICATED_KEEPALIVE,
        },
    };
    let stopped = tasks.token();
    let server = tokio::spawn(listener::serve(tcp, tls, admission.clone(), services, async move {
        stopped.cancelled().await;
    }));
    let metrics_addr = metrics_tcp.as_ref().map(|t| t.local_addr()).transpose().map_err(ServerError::Io)?;
    // The fleet's counts are read with the streams' pool: one short query per scrape.
    if let Some(tcp) = metrics_tcp {
        tasks.spawn("metrics", crate::metrics::serve(tcp, metrics.clone(), pools.streams.clone()));
    }
    if let Some(addr) = metrics_addr {
        tracing::info!(%addr, "serving metrics at /metrics (plain HTTP, unauthenticated)");
    }
    Ok(Running {
        local_addr,
        server_names: config.server_names,
        startup_changes: changed.len(),
        gateway,
        admission,
        server,
        tasks,
        certificate,
        metrics,
        metrics_addr,
        authoring: pools.authoring.clone(),
        signer,
        api: None,
    })
}

/// How often each replica looks for promotions past their confirm deadline.
const CONFIRM_SWEEP: Duration = Duration::from_secs(1);

/// Reverts promotions whose confirm deadline passed unconfirmed (`safety::confirm`), every
/// [`CONFIRM_SWEEP`], counting each; replicas serialize on the render lock.
async fn revert_unconfirmed_forever(pool: PgPool, metrics: Arc<Metrics>) {
    let mut ticker = tokio::time::interval(CONFIRM_SWEEP);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match crate::safety::confirm::revert_expired(&pool).await {
            Ok(reverted) => reverted.iter().for_each(|_| metrics.deadline_reverted()),
            Err(e) => tracing::warn!("reverting promotions past their confirm deadline failed: {e}"),
        }
    }
}

/// The auto-demotion guard (`safety::guard`) as the telemetry service's [`crate::flows::OnBlocked`]:
/// judged with an authoring connection (a demotion renders), counted when it demotes.
fn guard(pool: PgPool, metrics: Arc<Metrics>) -> crate::flows::OnBlocked {
    crate::flows::OnBlocked(Arc::new(move |workload| {
        let (pool, metrics) = (pool.clone(), metrics.clone());
        Box::pin(async move {
            match crate::safety::guard::judge(&pool, workload).await {
                Ok(Some(_)) => metrics.auto_demoted(),
                Ok(None) => {}
                Err(e) => tracing::warn!(%workload, "the auto-demotion guard could not judge a window: {e}"),
            }
        })
    }))
}
