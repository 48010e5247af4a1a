//! The control plane's one error type. Every library function that can fail for a reason a
//! caller acts on returns [`Error`]; each domain error converts into it beside its own
//! definition (so this module imports nothing of the crate), and [`Error::kind`] is the single
//! classification the transports map: `tonic::Status` here, the HTTP API's problem documents
//! later.

use std::fmt;

/// A domain error kept as the source of a classified [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {name:?} not found")]
    NotFound { what: &'static str, name: String },
    #[error("{what} {name:?} already exists")]
    Exists { what: &'static str, name: String },
    #[error("{what} {name:?} is at version {current}, not {expected}: re-read it and retry")]
    Stale { what: &'static str, name: String, expected: i64, current: i64 },
    #[error("{what} {name:?} is in use by {}; change those first", referrers.join(", "))]
    InUse { what: &'static str, name: String, referrers: Vec<String> },
    /// Input that breaks a rule, described in words.
    #[error("{0}")]
    Invalid(String),
    /// Input that breaks a rule of the model or the CA (a name, a selector, a CSR, …).
    #[error(transparent)]
    InvalidInput(BoxError),
    /// A request the caller may not make (a retired or deny-listed identity, …).
    #[error("{0}")]
    Refused(String),
    /// A provisioning token was refused; `kind` says why (malformed, unknown, revoked, …). The
    /// token error's text is this error's text, so it is kept as a field and not as a source
    /// (a chain would print it twice).
    #[error("{error}")]
    Token { kind: &'static str, error: BoxError },
    /// The database could not do it in bounded time (a lock held too long; also a database that
    /// is down or gives no connection in time, see [`Kind::Busy`]): retry later.
    #[error("{0}")]
    Busy(String),
    /// A mode change named its set with a count that is not what the set resolves to now.
    #[error(
        "match-count-mismatch: {matched} workload(s) matched, you expected {expected}: {}; nothing was changed",
        if names.is_empty() { "none".to_owned() } else { names.join(", ") }
    )]
    CountMismatch { expected: usize, matched: usize, names: Vec<String> },
    /// A move to enforcement without a SAFE verdict (and without an override).
    #[error(
        "evidence-insufficient: the verdict is {outcome}, not SAFE: {reasons}; nothing was changed. \
         Gather more evidence, fix the policy, or pass --override with a reason"
    )]
    EvidenceInsufficient { outcome: &'static str, reasons: String },
    /// One more authored object would pass its count bound (`counts`).
    #[error(
        "count bound reached: {limit} {what} exist, the most {bound} allows; {remedy}, or raise {bound}; \
         nothing was changed"
    )]
    OverBound { what: &'static str, limit: u64, bound: &'static str, remedy: &'static str },
    /// An expensive operation (a render, a resend) over its rate bound (`policy::expensive`).
    #[error(
        "rate-limited: {what} by {who} over the bound of {per_minute} per minute ({bound}); retry after \
         {retry_after_secs} s; nothing was changed"
    )]
    RateLimited {
        what: &'static str,
        who: String,
        per_minute: u32,
        bound: &'static str,
        retry_after_secs: u64,
    },
    /// An operator change that breaks policy tests (`foresight`): every failing test, with why
    /// (one failure a line, so a terminal reads them).
    #[error(
        "policy-tests-failed: {} policy test(s) fail on the change; nothing was changed. Fix the change, \
         or update the test set (itself a commit):{}",
        .0.len(),
        .0.iter().map(|f| format!("\n  - {}/{} ({}): {}", f.set, f.test, f.assertion, f.reason)).collect::<String>()
    )]
    PolicyTestsFailed(Vec<PolicyTestFailure>),
    /// A draft's commit (or render) whose changes' objects moved since each change was added.
    #[error(
        "draft-base-moved: draft {draft:?} was based on versions that moved; nothing was changed. Re-add \
         the changes of these objects to the draft (`innerwall draft add`), or discard it:{}",
        moved.iter().map(|m| format!("\n  - {m}")).collect::<String>()
    )]
    DraftBaseMoved { draft: String, moved: Vec<String> },
    #[error("agent-offline: workload {id} has no stream (last seen {last_seen})")]
    AgentOffline { id: String, last_seen: String },
    #[error("render failed: {0}")]
    Render(#[source] BoxError),
    #[error("stored {what} is corrupt: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("database: {}", describe_database(.0))]
    Database(#[from] sqlx::Error),
}

/// Whether the database could not be reached, gave no connection in time or could not finish
/// in its bounds (a stopped or restarting server, a full pool, a statement timeout): passing
/// trouble, worth a retry, not the caller's fault nor a bug.
fn database_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => true,
        // query_canceled (statement timeout), admin_shutdown (also a postmaster that died under
        // the connection), crash_shutdown, cannot_connect_now, too_many_connections,
        // lock_not_available (the lock timeout).
        sqlx::Error::Database(d) => {
            matches!(d.code().as_deref(), Some("57014" | "57P01" | "57P02" | "57P03" | "53300" | "55P03"))
        }
        _ => false,
    }
}

/// What a change that could not take the render lock in time is told.
pub const RENDER_LOCK_HELD: &str = "the render lock stayed held past the lock timeout: another render, or a \
                                    client stalled in the middle of a change, holds it; nothing was written, retry";

/// A lock timeout (`lock_not_available`): a lock stayed held past this transaction's `lock_timeout`.
pub(crate) fn lock_not_available(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03"))
}

/// A lock timeout in the trigger every write to a render's input runs (migration 0041), which
/// takes the render lock first.
fn waited_for_render_lock(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(d) = e else { return false };
    lock_not_available(e)
        && d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|pg| pg.r#where())
            .is_some_and(|w| w.contains("innerwall_render_inputs_written"))
}

fn describe_database(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::PoolTimedOut => "unavailable: no connection within the pool's acquire timeout (the \
                                      server is down or every connection is busy); retry later"
            .into(),
        e if waited_for_render_lock(e) => RENDER_LOCK_HELD.into(),
        e if database_unavailable(e) => format!("unavailable: {e}; retry later"),
        e => e.to_string(),
    }
}

/// One failing policy test (`foresight::policy_tests`), as every transport reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct PolicyTestFailure {
    /// The test set's name.
    pub set: String,
    /// The test's name within its set.
    pub test: String,
    /// `allow`, `deny`, `only_from` or `observed`.
    pub assertion: String,
    /// Why it fails: the first failing pair and the nearest rule with why it did not match.
    pub reason: String,
    /// The failing (source → destination, entry) pairs, at most `MAX_PAIRS` of them.
    pub pairs: Vec<String>,
    /// How many pairs fail in all (`pairs` may show fewer).
    pub pair_count: u64,
}

/// What kind of failure an [`Error`] is, for a transport to choose its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    NotFound,
    Exists,
    Stale,
    InUse,
    Invalid,
    Refused,
    Unauthenticated,
    AgentOffline,
    Busy,
    /// A mode change's expected count differs from the set it names (409 match-count-mismatch).
    CountMismatch,
    /// A move to enforcement the evidence does not support (409 evidence-insufficient).
    EvidenceInsufficient,
    /// One more object would pass a count bound (409 limit-reached).
    OverBound,
    /// Over a rate bound (429 rate-limited, with `Retry-After`).
    RateLimited,
    /// An operator change that breaks policy tests (422 policy-tests-failed, with every failure).
    PolicyTestsFailed,
    /// Not the caller's fault: logged in full, reported without detail.
    Internal,
}

impl Error {
    pub fn kind(&self) -> Kind {
        match self {
            Error::NotFound { .. } => Kind::NotFound,
            Error::Exists { .. } => Kind::Exists,
            Error::Stale { .. } | Error::DraftBaseMoved { .. } => Kind::Stale,
            Error::InUse { .. } => Kind::InUse,
            Error::Invalid(_) | Error::InvalidInput(_) => Kind::Invalid,
            Error::Refused(_) => Kind::Refused,
            Error::Token { .. } => Kind::Unauthenticated,
            Error::AgentOffline { .. } => Kind::AgentOffline,
            Error::Busy(_) => Kind::Busy,
            Error::Database(e) if database_unavailable(e) => Kind::Busy,
            Error::CountMismatch { .. } => Kind::CountMismatch,
            Error::EvidenceInsufficient { .. } => Kind::EvidenceInsufficient,
            Error::OverBound { .. } => Kind::OverBound,
            Error::RateLimited { .. } => Kind::RateLimited,
            Error::PolicyTestsFailed(_) => Kind::PolicyTestsFailed,
            Error::Render(_) | Error::Corrupt { .. } | Error::Database(_) => Kind::Internal,
        }
    }
}

impl From<innerwall_wire::policy::PolicyError> for Error {
    fn from(e: innerwall_wire::policy::PolicyError) -> Self {
        Error::InvalidInput(Box::new(e))
    }
}

/// The one mapping to gRPC status codes. Internal errors are logged here with their chain and
/// reach the agent without detail.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        let message = e.to_string();
        match e.kind() {
            Kind::NotFound => Status::not_found(message),
            Kind::Exists => Status::already_exists(message),
            Kind::Stale
            | Kind::InUse
            | Kind::CountMismatch
            | Kind::EvidenceInsufficient
            | Kind::PolicyTestsFailed => Status::failed_precondition(message),
            Kind::Invalid => Status::invalid_argument(message),
            Kind::Refused => Status::permission_denied(message),
            Kind::Unauthenticated => match &e {
                Error::Token { kind, .. } => {
                    Status::unauthenticated(format!("provisioning token {kind}: {message}"))
                }
                _ => Status::unauthenticated(message),
            },
            Kind::AgentOffline | Kind::Busy => Status::unavailable(message),
            Kind::OverBound => Status::resource_exhausted(message),
            Kind::RateLimited => match &e {
                Error::RateLimited { retry_after_secs, .. } => innerwall_wire::backoff::refuse(
                    message.clone(),
                    std::time::Duration::from_secs(*retry_after_secs),
                ),
                _ => Status::resource_exhausted(message),
            },
            Kind::Internal => {
                tracing::error!("agent request failed: {:#}", Chain(&e));
                Status::internal("internal error; see the control-plane log")
            }
        }
    }
}

/// Displays an error with its sources, `outer: inner: …`.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_status() {
        let token = Error::Token { kind: "revoked", error: "it was revoked".into() };
        let cases = [
            (Error::NotFound { what: "service", name: "web".into() }, tonic::Code::NotFound),
            (Error::Invalid("bad".into()), tonic::Code::InvalidArgument),
            (Error::Refused("no".into()), tonic::Code::PermissionDenied),
            (Error::Busy("the render lock".into()), tonic::Code::Unavailable),
            (Error::Database(sqlx::Error::PoolTimedOut), tonic::Code::Unavailable),
            (Error::Database(sqlx::Error::RowNotFound), tonic::Code::Internal),
            (token, tonic::Code::Unauthenticated),
            (Error::Corrupt { what: "mode", detail: "9".into() }, tonic::Code::Internal),
            (Error::PolicyTestsFailed(Vec::new()), tonic::Code::FailedPrecondition),
        ];
        for (error, code) in cases {
            let status = tonic::Status::from(error);
            assert_eq!(status.code(), code, "{status:?}");
        }
        let status = tonic::Status::from(Error::Token { kind: "revoked", error: "it was revoked".into() });
        assert_eq!(status.message(), "provisioning token revoked: it was revoked");
        let status = tonic::Status::from(Error::Database(sqlx::Error::PoolTimedOut));
        assert!(status.message().contains("the server is down or every connection is busy"), "{status:?}");
        let status = tonic::Status::from(Error::Render("rule x broke".into()));
        assert_eq!(status.message(), "internal error; see the control-plane log", "no detail leaks");
    }
}
