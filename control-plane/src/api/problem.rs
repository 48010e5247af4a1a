//! Problem documents (RFC 9457): every error the API answers is `application/problem+json` with
//! a `type` from one closed set, [`ProblemType`], documented in the OpenAPI document as an enum
//! of URNs (`urn:innerwall:problem:<name>`). [`ApiError`] is everything a request can fail
//! with — a library [`Error`] or a refusal at the edge (authentication, role, precondition,
//! body) — and [`ApiError::problem`] is the one exhaustive mapping to a document; a library
//! error is classified by its [`Kind`] alone, with the extension members its variant carries.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};

use crate::error::{Error, Kind};
use crate::identity::operators::{Refused, Role};

/// The media type of every error response.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The closed set of problem types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProblemType {
    /// 400: a body, query or path parameter breaks a rule (validation, malformed JSON, a bad cursor).
    Invalid,
    /// 401: no operator token, or one that is malformed, not valid, expired or revoked.
    Unauthorized,
    /// 403: the token's role may not do this (or the request is refused for who makes it).
    Forbidden,
    /// 404: no such object or route.
    NotFound,
    /// 405: the route exists, not with this method (`Allow` names those it has).
    MethodNotAllowed,
    /// 409: the name is taken.
    DuplicateName,
    /// 409: rules still refer to the object (`referrers` names them).
    InUse,
    /// 409: the set a mode change names has another size than expected (`expected`, `matched`).
    MatchCountMismatch,
    /// 409: the verdict does not support a move to enforcement (`outcome`, `reasons`).
    EvidenceInsufficient,
    /// 409: the workload has no stream to act on (`last_seen`).
    AgentOffline,
    /// 409: one more object would pass a count bound (`bound` names its flag, `limit` its value).
    LimitReached,
    /// 429: over a rate or concurrency bound (per token, per source, overall); `Retry-After`
    /// says when to retry (`retry_after`, seconds), `bound` names the flag.
    RateLimited,
    /// 422: the change breaks policy tests (`failures`: every failing test, with why).
    PolicyTestsFailed,
    /// 412: `If-Match` names a version that is no longer current (`current_version`).
    PreconditionFailed,
    /// 413: the body is larger than the listener accepts.
    PayloadTooLarge,
    /// 415: a body that is not `application/json`.
    UnsupportedMediaType,
    /// 428: a conditional write without `If-Match`.
    PreconditionRequired,
    /// 503: the database or the request ran out of time or connections; retry later.
    Busy,
    /// 500: not the caller's fault; the control-plane log has the detail.
    Internal,
}

impl ProblemType {
    pub const ALL: [ProblemType; 19] = [
        ProblemType::Invalid,
        ProblemType::Unauthorized,
        ProblemType::Forbidden,
        ProblemType::NotFound,
        ProblemType::MethodNotAllowed,
        ProblemType::DuplicateName,
        ProblemType::InUse,
        ProblemType::MatchCountMismatch,
        ProblemType::EvidenceInsufficient,
        ProblemType::AgentOffline,
        ProblemType::LimitReached,
        ProblemType::RateLimited,
        ProblemType::PolicyTestsFailed,
        ProblemType::PreconditionFailed,
        ProblemType::PayloadTooLarge,
        ProblemType::UnsupportedMediaType,
        ProblemType::PreconditionRequired,
        ProblemType::Busy,
        ProblemType::Internal,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ProblemType::Invalid => "invalid",
            ProblemType::Unauthorized => "unauthorized",
            ProblemType::Forbidden => "forbidden",
            ProblemType::NotFound => "not-found",
            ProblemType::MethodNotAllowed => "method-not-allowed",
            ProblemType::DuplicateName => "duplicate-name",
            ProblemType::InUse => "in-use",
            ProblemType::MatchCountMismatch => "match-count-mismatch",
            ProblemType::EvidenceInsufficient => "evidence-insufficient",
            ProblemType::AgentOffline => "agent-offline",
            ProblemType::LimitReached => "limit-reached",
            ProblemType::RateLimited => "rate-limited",
            ProblemType::PolicyTestsFailed => "policy-tests-failed",
            ProblemType::PreconditionFailed => "precondition-failed",
            ProblemType::PayloadTooLarge => "payload-too-large",
            ProblemType::UnsupportedMediaType => "unsupported-media-type",
            ProblemType::PreconditionRequired => "precondition-required",
            ProblemType::Busy => "busy",
            ProblemType::Internal => "internal",
        }
    }

    pub fn urn(self) -> String {
        format!("urn:innerwall:problem:{}", self.name())
    }

    pub fn status(self) -> StatusCode {
        match self {
            ProblemType::Invalid => StatusCode::BAD_REQUEST,
            ProblemType::Unauthorized => StatusCode::UNAUTHORIZED,
            ProblemType::Forbidden => StatusCode::FORBIDDEN,
            ProblemType::NotFound => StatusCode::NOT_FOUND,
            ProblemType::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ProblemType::DuplicateName
            | ProblemType::InUse
            | ProblemType::MatchCountMismatch
            | ProblemType::EvidenceInsufficient
            | ProblemType::AgentOffline
            | ProblemType::LimitReached => StatusCode::CONFLICT,
            ProblemType::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ProblemType::PolicyTestsFailed => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemType::PreconditionFailed => StatusCode::PRECONDITION_FAILED,
            ProblemType::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProblemType::PreconditionRequired => StatusCode::PRECONDITION_REQUIRED,
            ProblemType::Busy => StatusCode::SERVICE_UNAVAILABLE,
            ProblemType::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The short, fixed summary of the type (RFC 9457 `title`).
    pub fn title(self) -> &'static str {
        match self {
            ProblemType::Invalid => "The request is not valid",
            ProblemType::Unauthorized => "An operator token is required",
            ProblemType::Forbidden => "The token's role may not do this",
            ProblemType::NotFound => "Not found",
            ProblemType::MethodNotAllowed => "Method not allowed",
            ProblemType::DuplicateName => "The name is taken",
            ProblemType::InUse => "The object is in use",
            ProblemType::MatchCountMismatch => "The set does not have the expected size",
            ProblemType::EvidenceInsufficient => "The evidence does not support enforcement",
            ProblemType::AgentOffline => "The agent is offline",
            ProblemType::LimitReached => "A count bound is reached",
            ProblemType::RateLimited => "Too many requests; retry later",
            ProblemType::PolicyTestsFailed => "The change breaks policy tests",
            ProblemType::PreconditionFailed => "The version read is no longer current",
            ProblemType::PayloadTooLarge => "The body is too large",
            ProblemType::UnsupportedMediaType => "The body is not JSON",
            ProblemType::PreconditionRequired => "If-Match is required",
            ProblemType::Busy => "Busy; retry later",
            ProblemType::Internal => "Internal error",
        }
    }
}

impl Serialize for ProblemType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.urn())
    }
}

/// The document lists the closed set as an enum of URNs (a test holds it to [`ProblemType::ALL`]).
impl utoipa::PartialSchema for ProblemType {
    fn schema() -> RefOr<Schema> {
        let lines: Vec<String> = ProblemType::ALL
            .iter()
            .map(|t| format!("- `{}` ({}): {}", t.urn(), t.status().as_u16(), t.title()))
            .collect();
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(ProblemType::ALL.iter().map(|t| t.urn())))
            .description(Some(format!("The closed set of problem types:\n{}", lines.join("\n"))))
            .into()
    }
}

impl utoipa::ToSchema for ProblemType {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ProblemType")
    }
}

/// An RFC 9457 problem document with Innerwall's extension members.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: ProblemType,
    pub title: &'static str,
    pub status: u16,
    /// What was wrong and what to do, in words.
    pub detail: String,
    /// 412: the version that is current now (re-read, then retry with it in `If-Match`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_version: Option<i64>,
    /// 409 in-use: the rules that refer to the object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referrers: Option<Vec<String>>,
    /// 409 match-count-mismatch: the count the request expected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<usize>,
    /// 409 match-count-mismatch: how many workloads the set names now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<usize>,
    /// 409 match-count-mismatch: the workloads the set names now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub names: Option<Vec<String>>,
    /// 409 evidence-insufficient: the verdict (`UNSAFE`, `INSUFFICIENT`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<&'static str>,
    /// 409 evidence-insufficient: why, per workload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<String>,
    /// 409 agent-offline: when the agent was last seen (RFC 3339, or `never`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
    /// 403: the role the operation needs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub required_role: Option<Role>,
    /// 409 limit-reached: the `serve` flag that sets the bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<&'static str>,
    /// 409 limit-reached: the bound's value (as many exist).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// 429 rate-limited: seconds until a retry can pass (also the `Retry-After` header).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// 422 policy-tests-failed: every failing test, with the pairs and the nearest rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failures: Option<Vec<crate::error::PolicyTestFailure>>,
}

impl Problem {
    pub fn new(kind: ProblemType, detail: impl Into<String>) -> Problem {
        Problem {
            kind,
            title: kind.title(),
            status: kind.status().as_u16(),
            detail: detail.into(),
            current_version: None,
            referrers: None,
            expected: None,
            matched: None,
            names: None,
            outcome: None,
            reasons: None,
            last_seen: None,
            required_role: None,
            bound: None,
            limit: None,
            retry_after: None,
            failures: None,
        }
    }
}

/// Everything an API request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A library error: classified by its kind.
    #[error(transparent)]
    Domain(#[from] Error),
    /// No usable bearer token (missing, too long, not `Bearer`).
    #[error("{0}")]
    NoToken(&'static str),
    /// A presented token was refused.
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error("this needs the {needed} role; the token {token} is {has}")]
    Forbidden { needed: Role, has: Role, token: String },
    /// A conditional write without `If-Match`.
    #[error("{0}")]
    PreconditionRequired(String),
    #[error("the request body is larger than the {limit} bytes this listener accepts")]
    PayloadTooLarge { limit: usize },
    #[error("the request body must be application/json, not {0:?}")]
    UnsupportedMediaType(String),
    /// A body, query or path parameter that does not parse.
    #[error("{0}")]
    Malformed(String),
    #[error("no route {0}; the routes are listed in /api/v1/openapi.json")]
    NoRoute(String),
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request took longer than {0:?}; retry later")]
    Timeout(std::time::Duration),
    /// Over a bound of the listener (`api::edge`): the words, the flag, when to retry.
    #[error("{detail}")]
    RateLimited { detail: String, bound: &'static str, retry_after: std::time::Duration },
}

impl ApiError {
    /// The one mapping of a failure to its problem document. Internal errors are logged here
    /// with their chain and reach the caller without detail.
    pub fn problem(&self) -> Problem {
        let detail = self.to_string();
        match self {
            ApiError::Domain(e) => domain_problem(e),
            ApiError::NoToken(_) | ApiError::Refused(Refused::Malformed | Refused::NotValid) => {
                Problem::new(ProblemType::Unauthorized, detail)
            }
            ApiError::Refused(Refused::Expired { .. } | Refused::Revoked { .. }) => {
                Problem::new(ProblemType::Unauthorized, detail)
            }
            ApiError::Refused(Refused::Unavailable(e)) => domain_problem(e),
            ApiError::Forbidden { needed, .. } => {
                Problem { required_role: Some(*needed), ..Problem::new(ProblemType::Forbidden, detail) }
            }
            ApiError::PreconditionRequired(_) => Problem::new(ProblemType::PreconditionRequired, detail),
            ApiError::PayloadTooLarge { .. } => Problem::new(ProblemType::PayloadTooLarge, detail),
            ApiError::UnsupportedMediaType(_) => Problem::new(ProblemType::UnsupportedMediaType, detail),
            ApiError::Malformed(_) => Problem::new(ProblemType::Invalid, detail),
            ApiError::NoRoute(_) => Problem::new(ProblemType::NotFound, detail),
            ApiError::MethodNotAllowed { .. } => Problem::new(ProblemType::MethodNotAllowed, detail),
            ApiError::Timeout(_) => Problem::new(ProblemType::Busy, detail),
            ApiError::RateLimited { bound, retry_after, .. } => Problem {
                bound: Some(bound),
                retry_after: Some(retry_secs(*retry_after)),
                ..Problem::new(ProblemType::RateLimited, detail)
            },
        }
    }
}

/// A library error's document: its type from [`Error::kind`] alone, its extension members from
/// the variant.
pub(crate) fn domain_problem(e: &Error) -> Problem {
    let detail = e.to_string();
    match e.kind() {
        Kind::NotFound => Problem::new(ProblemType::NotFound, detail),
        Kind::Exists => Problem::new(ProblemType::DuplicateName, detail),
        Kind::Stale => {
            let current = match e {
                Error::Stale { current, .. } => Some(*current),
                _ => None,
            };
            Problem { current_version: current, ..Problem::new(ProblemType::PreconditionFailed, detail) }
        }
        Kind::InUse => {
            let referrers = match e {
                Error::InUse { referrers, .. } => Some(referrers.clone()),
                _ => None,
            };
            Problem { referrers, ..Problem::new(ProblemType::InUse, detail) }
        }
        Kind::Invalid => Problem::new(ProblemType::Invalid, detail),
        Kind::Refused => Problem::new(ProblemType::Forbidden, detail),
        Kind::Unauthenticated => Problem::new(ProblemType::Unauthorized, detail),
        Kind::AgentOffline => {
            let last_seen = match e {
                Error::AgentOffline { last_seen, .. } => Some(last_seen.clone()),
                _ => None,
            };
            Problem { last_seen, ..Problem::new(ProblemType::AgentOffline, detail) }
        }
        Kind::Busy => Problem::new(ProblemType::Busy, detail),
        Kind::CountMismatch => match e {
            Error::CountMismatch { expected, matched, names } => Problem {
                expected: Some(*expected),
                matched: Some(*matched),
                names: Some(names.clone()),
                ..Problem::new(ProblemType::MatchCountMismatch, detail)
            },
            _ => Problem::new(ProblemType::MatchCountMismatch, detail),
        },
        Kind::EvidenceInsufficient => match e {
            Error::EvidenceInsufficient { outcome, reasons } => Problem {
                outcome: Some(outcome),
                reasons: Some(reasons.clone()),
                ..Problem::new(ProblemType::EvidenceInsufficient, detail)
            },
            _ => Problem::new(ProblemType::EvidenceInsufficient, detail),
        },
        Kind::OverBound => match e {
            Error::OverBound { limit, bound, .. } => Problem {
                bound: Some(bound),
                limit: Some(*limit),
                ..Problem::new(ProblemType::LimitReached, detail)
            },
            _ => Problem::new(ProblemType::LimitReached, detail),
        },
        Kind::RateLimited => match e {
            Error::RateLimited { bound, retry_after_secs, .. } => Problem {
                bound: Some(bound),
                retry_after: Some((*retry_after_secs).max(1)),
                ..Problem::new(ProblemType::RateLimited, detail)
            },
            _ => Problem::new(ProblemType::RateLimited, detail),
        },
        Kind::PolicyTestsFailed => match e {
            Error::PolicyTestsFailed(failures) => Problem {
                failures: Some(failures.clone()),
                ..Problem::new(ProblemType::PolicyTestsFailed, detail)
            },
            _ => Problem::new(ProblemType::PolicyTestsFailed, detail),
        },
        Kind::Internal => {
            tracing::error!("api request failed: {:#}", Chain(e));
            Problem::new(ProblemType::Internal, "internal error; see the control-plane log")
        }
    }
}

/// Whole seconds to wait, rounded up, at least 1 (`Retry-After` takes integers).
pub fn retry_secs(wait: std::time::Duration) -> u64 {
    wait.as_secs() + u64::from(wait.subsec_nanos() > 0).max(u64::from(wait.is_zero()))
}

/// Displays an error with its sources, `outer: inner: …`.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.kind.status();
        let unauthorized = self.kind == ProblemType::Unauthorized;
        let busy = self.kind == ProblemType::Busy;
        let retry_after = self.retry_after;
        let body = serde_json::to_vec(&self).expect("a problem serializes");
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if unauthorized {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"innerwall\""));
        }
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        } else if busy {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.problem().into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_has_one_status_and_a_urn() {
        let mut names = std::collections::BTreeSet::new();
        for t in ProblemType::ALL {
            assert!(names.insert(t.name()), "{t:?} twice");
            assert!(t.urn().starts_with("urn:innerwall:problem:"));
            assert!(t.status().is_client_error() || t.status().is_server_error());
        }
        let json = serde_json::to_value(Problem::new(ProblemType::InUse, "x")).unwrap();
        assert_eq!(json["type"], "urn:innerwall:problem:in-use");
        assert_eq!(json["status"], 409);
        assert!(json.get("referrers").is_none(), "absent members are left out: {json}");
    }

    #[test]
    fn a_count_bound_names_its_flag_and_value() {
        let p = ApiError::Domain(crate::counts::over(crate::counts::Counted::Rulesets, 2)).problem();
        assert_eq!((p.kind, p.status), (ProblemType::LimitReached, 409));
        assert_eq!((p.bound, p.limit), (Some("--max-rulesets"), Some(2)));
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["type"], "urn:innerwall:problem:limit-reached");
        assert_eq!((json["bound"].as_str(), json["limit"].as_u64()), (Some("--max-rulesets"), Some(2)));
        assert!(
            p.detail.contains("2 rulesets exist") && p.detail.contains("nothing was changed"),
            "{}",
            p.detail
        );
    }

    #[test]
    fn internal_errors_carry_no_detail() {
        let p = ApiError::Domain(Error::Render("rule x broke".into())).problem();
        assert_eq!(p.kind, ProblemType::Internal);
        assert!(!p.detail.contains("rule x"), "{p:?}");
    }
}
