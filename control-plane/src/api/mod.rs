//! The operator HTTP API (issue 12, OPS-2): JSON over TLS on a listener of its own, for
//! operators holding a bearer operator token with a role (`identity::operators`).
//!
//! - [`server`]: the TLS listener — bounded connections, handshake and header timeouts, HTTP/1.1
//!   served by hyper, drained on stop.
//! - [`router`]: every route, mounted in one table with the role it needs; the request timeout
//!   and the body limit around them; 404 and 405 as problem documents.
//! - [`auth`]: `Authorization: Bearer iwo_…` checked, the role compared, the caller handed on.
//! - [`extract`]: bounded JSON bodies, queries, path ids, `If-Match` and `ETag`.
//! - [`problem`]: RFC 9457 problem documents from one closed set of types.
//! - [`openapi`]: the OpenAPI 3.1 document generated from the handlers, served at
//!   `/api/v1/openapi.json` and checked in as `control-plane/openapi.json`.
//! - one module per resource group — [`workloads`], [`catalog`] (services, address groups,
//!   rulesets), [`drafts`] (stored drafts of changes), [`estate`] (estate ranges), [`render`], [`tokens`] (provisioning tokens),
//!   [`flows`], [`gate`] (verdict, promotions), [`operators`] (the API's own tokens, for
//!   admins), [`audit`] (the audit log read back) —
//!   whose handlers call the same library functions the CLI does and answer with the structs its
//!   `--json` prints; changes go through `foresight::commit` (or the library call that audits
//!   itself) with the caller's `operator:<name>/<token id>` as the actor.
//!
//! Architecture invariant: no handler writes without a role check (every route is mounted with
//! its role, and the mount table is what the OpenAPI document's security is made from); every
//! conditional write requires `If-Match`; nothing is written when a request is refused.

pub mod audit;
pub mod auth;
pub mod catalog;
pub mod console;
pub mod drafts;
pub mod edge;
pub mod estate;
pub mod extract;
pub mod flows;
pub mod gate;
pub mod impact;
pub mod management;
pub mod openapi;
pub mod operators;
pub mod policy_tests;
pub mod problem;
pub mod render;
pub mod router;
pub mod server;
pub mod staged;
pub mod suggestions;
pub mod tokens;
pub mod workloads;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

pub use server::{ApiServer, ApiStartError, start};

/// The largest request body the API reads by default (`serve --api-max-body`).
pub const DEFAULT_MAX_BODY: usize = 64 * 1024;

/// The listener's bounds; each is a `serve` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// Bytes of a request body.
    pub max_body: usize,
    /// How long one request may take, body included.
    pub request_timeout: Duration,
    /// Connections held at once; more are closed at accept.
    pub max_connections: usize,
    /// How long a TLS handshake, and a request's headers, may take.
    pub handshake_timeout: Duration,
    /// Connections held at once from one source address; more are closed at accept.
    pub max_connections_per_source: usize,
    /// How long writing to a connection may stall (a client that does not read its answers, or
    /// pipelines requests and never reads) before the connection is closed.
    pub write_timeout: Duration,
    /// How long one connection may stay open, however busy.
    pub connection_lifetime: Duration,
    /// Requests one operator token may make per minute (a minute's worth may come at once).
    pub requests_per_minute: u32,
    /// Requests of one operator token in flight at once.
    pub max_concurrent_per_token: usize,
    /// Requests without a valid token (none, a bad one, or for the OpenAPI document) one source
    /// address may make per minute.
    pub unauthenticated_per_minute: u32,
    /// Renders and snapshot resends, per token and overall (`policy::authoring::Expensive`).
    pub expensive: crate::policy::authoring::ExpensiveBounds,
    /// Count bounds on the authored objects the API creates (`serve --max-…`).
    pub counts: crate::counts::CountBounds,
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            max_body: DEFAULT_MAX_BODY,
            request_timeout: Duration::from_secs(30),
            max_connections: 256,
            handshake_timeout: Duration::from_secs(10),
            max_connections_per_source: 32,
            write_timeout: Duration::from_secs(10),
            connection_lifetime: Duration::from_secs(600),
            requests_per_minute: 600,
            max_concurrent_per_token: 16,
            unauthenticated_per_minute: 60,
            expensive: crate::policy::authoring::ExpensiveBounds::default(),
            counts: crate::counts::CountBounds::default(),
        }
    }
}

/// Where the listener's certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiTls {
    /// Operator-provided PEM files: the certificate chain and its private key.
    Files { cert: PathBuf, key: PathBuf },
    /// Issued from the CA at start for these names, reissued at half of `lifetime`.
    FromCa { names: Vec<String>, lifetime: Duration },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub tls: ApiTls,
    pub limits: ApiLimits,
}

/// One mounted route: what the router serves it for, and who may call it (`None`: anyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub path: &'static str,
    pub method: &'static str,
    pub role: Option<crate::identity::operators::Role>,
}

/// What every handler gets.
#[derive(Debug, Clone)]
pub struct ApiState {
    /// The authoring pool: renders, audits and reads, like the CLI's.
    pub pool: PgPool,
    pub limits: ApiLimits,
    /// The per-token and per-source request bounds, shared by every request of the listener.
    pub edge: std::sync::Arc<edge::Edge>,
}

impl ApiState {
    pub fn new(pool: PgPool, limits: ApiLimits) -> ApiState {
        ApiState { pool, limits, edge: edge::Edge::new(limits) }
    }
}

/// The answer to a change, in the shape `innerwall … --json` prints it: the value, and each
/// workload whose policy version the change advanced.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Changed<T> {
    pub result: T,
    pub changed: Vec<ChangedWorkload>,
}

/// The result of a change that has no value (a create, a delete, a retirement): JSON `null`,
/// as the CLI prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nothing;

impl Serialize for Nothing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

impl utoipa::PartialSchema for Nothing {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::Null).into()
    }
}

impl utoipa::ToSchema for Nothing {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("Nothing")
    }
}

impl From<crate::policy::authoring::Committed<()>> for Changed<Nothing> {
    fn from(done: crate::policy::authoring::Committed<()>) -> Self {
        let crate::policy::authoring::Committed { value: (), changed } = done;
        Changed::from(crate::policy::authoring::Committed { value: Nothing, changed })
    }
}

/// A workload whose policy version a change advanced.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ChangedWorkload {
    pub workload: String,
    pub version: u64,
}

/// The most rows one page of the API holds.
pub const MAX_API_PAGE: u32 = 1_000;
/// The longest cursor read back (the ones the API hands out are far shorter).
const MAX_CURSOR: usize = 4_096;

/// The query of a list that takes nothing but a page: `limit` and `cursor`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Rows per page, 1 to 1,000 (default 100).
    pub limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// A page request from a query's `limit` (default `default`) and `cursor`.
pub(crate) fn page_request(
    limit: Option<u32>,
    cursor: Option<String>,
    default: u32,
) -> Result<crate::page::PageRequest, problem::ApiError> {
    let limit = limit.unwrap_or(default);
    if !(1..=MAX_API_PAGE).contains(&limit) {
        return Err(problem::ApiError::Malformed(format!(
            "limit {limit}: a page holds 1 to {MAX_API_PAGE} rows; follow next_cursor for more"
        )));
    }
    if cursor.as_ref().is_some_and(|c| c.len() > MAX_CURSOR) {
        return Err(problem::ApiError::Malformed("the cursor is not one this API handed out".into()));
    }
    Ok(crate::page::PageRequest { limit, cursor })
}

impl<T> From<crate::policy::authoring::Committed<T>> for Changed<T> {
    fn from(done: crate::policy::authoring::Committed<T>) -> Self {
        Changed {
            result: done.value,
            changed: done
                .changed
                .iter()
                .map(|c| ChangedWorkload { workload: c.workload.to_string(), version: c.version })
                .collect(),
        }
    }
}

/// What the `api_params` fuzz target drives: `query` parsed as each route's query type with
/// the checks its handler makes before any I/O, and `value` as each kind of path parameter.
/// Returns how many of them accepted their input; it never panics.
pub fn parse_parameters(query: &str, value: &str) -> usize {
    let now = chrono::Utc::now();
    let mut accepted = 0;
    let mut count = |ok: bool| accepted += usize::from(ok);
    if let Ok(uri) = format!("/api/v1/x?{query}").parse::<axum::http::Uri>() {
        use extract::query_of;
        count(query_of::<flows::RollupQuery>(&uri).and_then(|q| flows::rollup_request(&q, now)).is_ok());
        count(query_of::<flows::ListQuery>(&uri).and_then(|q| flows::records_request(q, now)).is_ok());
        count(query_of::<flows::GapsQuery>(&uri).and_then(|q| flows::gaps_request(q, now)).is_ok());
        count(query_of::<gate::VerdictQuery>(&uri).and_then(|q| gate::verdict_request(&q)).is_ok());
        count(query_of::<impact::ReplayQuery>(&uri).and_then(|q| impact::replay_request(&q, now)).is_ok());
        count(query_of::<audit::AuditQuery>(&uri).is_ok());
        count(query_of::<workloads::ListQuery>(&uri).is_ok());
        count(query_of::<workloads::StatusQuery>(&uri).is_ok());
        count(query_of::<PageQuery>(&uri).and_then(|q| page_request(q.limit, q.cursor, 100)).is_ok());
        count(
            query_of::<suggestions::SuggestQuery>(&uri)
                .and_then(|q| suggestions::suggest_request(&q, now))
                .is_ok(),
        );
        count(
            query_of::<drafts::ImpactQuery>(&uri)
                .and_then(|q| impact::range_and_top(q.since.as_deref(), q.top, chrono::Utc::now()))
                .is_ok(),
        );
    }
    for name in ["id", "name", "address", "prefix"] {
        count(extract::check_path_param(name, value).is_ok());
    }
    count(value.parse::<innerwall_wire::identity::WorkloadId>().is_ok());
    accepted
}
