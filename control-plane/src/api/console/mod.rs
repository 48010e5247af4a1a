//! The web console (issue 29, OPS-4), served on the API listener under `/`: server-rendered
//! HTML (askama templates, checked at compile time, escaped by default) and one embedded style
//! sheet; nothing is fetched from elsewhere and no page runs a script it did not get from this
//! origin ([`CSP`]). It is a third client of the library calls the CLI and the API make, with
//! the same roles: a page offers only what the session's role may do, and every write checks
//! the role, the session's CSRF secret and the request's `Origin` on the server.

pub mod map;
pub mod session;

use askama::Template;
use axum::Router;
use axum::extract::{Form, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use innerwall_wire::convert::WireEnum;
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::{Mode, Protocol};
use serde::Deserialize;

use self::session::{NoSession, Session};
use super::ApiState;
use super::edge::Peer;
use super::extract::Path;
use crate::audit::{self, AuditFilter};
use crate::error::Error;
use crate::flows::{self, Grouping, RollupFilter, RollupRow};
use crate::foresight::drafts::{self, DraftSummary, DraftView};
use crate::foresight::policy_tests::RunReport;
use crate::gate::{self, Params, Promotion, Scope, Verdict};
use crate::identity::operators::{Refused, Role};
use crate::page::PageRequest;
use crate::policy::authoring::{self, Expensive};
use crate::policy::store::{self, WorkloadFilter, WorkloadView};
use crate::suggest;

/// Scripts, styles and images only from this origin, no plugins, no framing, forms only here.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";
/// Rows a console table shows per page.
const PAGE_ROWS: u32 = 100;
/// The longest form body read (a label set is the largest).
const MAX_FORM: usize = 16 * 1024;
const STYLE: &str = include_str!("../../../assets/console.css");
const SCRIPT: &str = include_str!("../../../assets/console.js");

/// The console's routes, for the API's router to mount beside its own.
pub fn router(state: ApiState) -> Router<ApiState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/fleet") }))
        .route("/sign-in", get(sign_in_page).post(sign_in))
        .route("/sign-out", post(sign_out))
        .route("/fleet", get(fleet))
        .route("/fleet/rows", get(fleet_rows))
        .route("/workloads/{id}", get(workload))
        .route("/workloads/{id}/labels", post(set_labels))
        .route("/audit", get(audit_log))
        .route("/review", get(review))
        .route("/review/promote", post(promote))
        .route("/promotions/{id}", get(promotion))
        .route("/flows", get(flows_page))
        .route("/flows/export.csv", get(flows_csv))
        .route("/flows/export.json", get(flows_json))
        .route("/map", get(map_page))
        .route("/policy", get(policy_page))
        // A change file may be as large as the CLI reads one (form encoding triples it at most).
        .route(
            "/drafts",
            post(new_draft)
                .layer(axum::extract::DefaultBodyLimit::max(3 * drafts::MAX_CHANGE_FILE as usize + 4096)),
        )
        .route("/drafts/{name}", get(draft_page))
        .route("/drafts/{name}/commit", post(commit_draft))
        .route("/suggestions", get(suggestions_page))
        .route("/suggestions/accept", post(accept_suggestions))
        .route(
            "/assets/console.css",
            get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE) }),
        )
        .route(
            "/assets/console.js",
            get(|| async { ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT) }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FORM))
        .layer(middleware::from_fn_with_state(state, guarded))
}

/// Around every console answer: the security headers; before every write: the `Origin` check
/// (a browser sends it with every POST; one from elsewhere is refused before anything runs).
async fn guarded(State(_): State<ApiState>, request: Request, next: Next) -> Response {
    if request.method() == axum::http::Method::POST && !same_origin(&request) {
        let origin = request.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).unwrap_or("?");
        let detail = format!(
            "this form was sent from another site ({}), not from this console; nothing was done",
            origin.chars().take(100).collect::<String>()
        );
        return problem(StatusCode::FORBIDDEN, "Refused", detail);
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not `no-referrer`: under it a browser sends `Origin: null` with the console's own forms.
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    response
}

/// Whether a POST's `Origin` (absent: not a browser's cross-site form) names this host, as the
/// request names it (`Host` over HTTP/1.1, the authority over HTTP/2).
fn same_origin(request: &Request) -> bool {
    let headers = request.headers();
    let Some(origin) = headers.get(header::ORIGIN) else { return true };
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    match (origin.to_str().ok().and_then(|o| o.strip_prefix("https://")), host) {
        (Some(origin), Some(host)) => origin.eq_ignore_ascii_case(host),
        _ => false,
    }
}

/// Who the header shows, for a signed-in page.
struct Who {
    name: String,
    role: String,
    csrf: String,
}

impl From<&Session> for Who {
    fn from(s: &Session) -> Who {
        Who { name: s.operator.name.clone(), role: s.operator.role.to_string(), csrf: s.csrf.clone() }
    }
}

fn html(template: &impl Template) -> Response {
    match template.render() {
        Ok(body) => ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response(),
        Err(e) => {
            tracing::error!("console template failed: {e}");
            (StatusCode::INTERNAL_SERVER_ERROR, "the page could not be drawn").into_response()
        }
    }
}

#[derive(Template)]
#[template(path = "problem.html")]
struct ProblemPage {
    who: Option<Who>,
    title: &'static str,
    /// The API's problem type (`match-count-mismatch`), when the library refused.
    kind: &'static str,
    detail: String,
}

fn problem(status: StatusCode, title: &'static str, detail: String) -> Response {
    (status, html(&ProblemPage { who: None, title, kind: "", detail })).into_response()
}

/// A console failure as a page: not signed in goes to the sign-in page; the rest say why.
#[derive(Debug)]
enum Failure {
    SignIn,
    Forbidden(String),
    Invalid(String),
    Domain(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Domain(e)
    }
}

impl From<NoSession> for Failure {
    fn from(e: NoSession) -> Failure {
        match e {
            NoSession::Absent | NoSession::Ended => Failure::SignIn,
            NoSession::Database(e) => Failure::Domain(e),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Failure::SignIn => Redirect::to("/sign-in").into_response(),
            Failure::Forbidden(why) => problem(StatusCode::FORBIDDEN, "Refused", why),
            Failure::Invalid(why) => problem(StatusCode::BAD_REQUEST, "Not done", why),
            Failure::Domain(e) => {
                // The API's problem for the same error: its type names the refusal as the API
                // and the CLI name it (`match-count-mismatch`, `precondition-failed`, …).
                let p = super::problem::domain_problem(&e);
                let status = StatusCode::from_u16(p.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let page = ProblemPage { who: None, title: p.title, kind: p.kind.name(), detail: p.detail };
                (status, html(&page)).into_response()
            }
        }
    }
}

/// The session of a page's request, or the way to the sign-in page.
async fn signed(state: &ApiState, headers: &HeaderMap) -> Result<Session, Failure> {
    Ok(session::session(&state.pool, headers).await?)
}

/// The session of a write: signed in, with the role `needed`, carrying the session's CSRF
/// secret. Checked in that order before anything is read or written.
async fn writer(state: &ApiState, headers: &HeaderMap, needed: Role, csrf: &str) -> Result<Session, Failure> {
    let session = signed(state, headers).await?;
    if !session.check_csrf(csrf) {
        return Err(Failure::Forbidden(
            "the form's CSRF token is not this session's: reload the page".into(),
        ));
    }
    if !session.operator.role.allows(needed) {
        return Err(Failure::Forbidden(format!(
            "this needs the {needed} role; you sign in as {}",
            session.operator.role
        )));
    }
    Ok(session)
}

// ---- sign-in -------------------------------------------------------------------------------

#[derive(Template)]
#[template(path = "sign_in.html")]
struct SignInPage {
    who: Option<Who>,
    error: Option<String>,
}

async fn sign_in_page() -> Response {
    html(&SignInPage { who: None, error: None })
}

#[derive(Deserialize)]
struct SignInForm {
    token: String,
}

/// A token for a session cookie. Refusals count against the source's share of requests
/// without a valid token, as the API's do.
async fn sign_in(State(state): State<ApiState>, request: Request) -> Response {
    let peer = request.extensions().get::<Peer>().copied();
    if let Err(refused) = state.edge.check_source(peer) {
        return refused.into_response();
    }
    let form =
        <Form<SignInForm> as axum::extract::FromRequest<ApiState>>::from_request(request, &state).await;
    let refused = |error: String| {
        (StatusCode::UNAUTHORIZED, html(&SignInPage { who: None, error: Some(error) })).into_response()
    };
    let Ok(Form(form)) = form else { return refused("send the token in the form".into()) };
    match session::sign_in(&state.pool, form.token.trim()).await {
        Ok((secret, _)) => {
            let cookie =
                HeaderValue::from_str(&session::set_cookie(&secret)).expect("base64url is a header value");
            (
                StatusCode::SEE_OTHER,
                [(header::SET_COOKIE, cookie), (header::LOCATION, HeaderValue::from_static("/fleet"))],
            )
                .into_response()
        }
        Err(refused_by @ Refused::Unavailable(_)) => {
            problem(StatusCode::SERVICE_UNAVAILABLE, "Failed", refused_by.to_string())
        }
        Err(why) => {
            if let Err(over) = state.edge.admit_unauthenticated(peer) {
                return over.into_response();
            }
            refused(why.to_string())
        }
    }
}

#[derive(Deserialize)]
struct CsrfForm {
    csrf: String,
}

async fn sign_out(State(state): State<ApiState>, headers: HeaderMap, Form(form): Form<CsrfForm>) -> Response {
    match signed(&state, &headers).await {
        Ok(session) if session.check_csrf(&form.csrf) => {}
        Ok(_) => {
            return Failure::Forbidden("the form's CSRF token is not this session's".into()).into_response();
        }
        Err(e) => return e.into_response(),
    }
    if let Err(e) = session::sign_out(&state.pool, &headers).await {
        return Failure::Domain(e).into_response();
    }
    let cookie = HeaderValue::from_str(&session::clear_cookie()).expect("a fixed header value");
    (
        StatusCode::SEE_OTHER,
        [(header::SET_COOKIE, cookie), (header::LOCATION, HeaderValue::from_static("/sign-in"))],
    )
        .into_response()
}

// ---- fleet -------------------------------------------------------------------------------

/// One workload as the fleet table shows it.
struct FleetLine {
    id: String,
    hostname: String,
    state: String,
    detail: String,
    mode: String,
    labels: Vec<String>,
    versions: String,
    last_seen: String,
    expires: String,
    blocking: i64,
    gaps: i64,
}

#[derive(Template)]
#[template(path = "fleet.html")]
struct FleetPage {
    who: Option<Who>,
    selector: String,
    error: Option<String>,
    rows: Vec<FleetLine>,
    next: Option<String>,
    refresh: String,
}

/// The fleet table's rows alone, for the page's refresh.
#[derive(Template)]
#[template(path = "fleet_rows.html")]
struct FleetRows {
    rows: Vec<FleetLine>,
}

#[derive(Deserialize)]
struct FleetQuery {
    selector: Option<String>,
    cursor: Option<String>,
}

const TIME: &str = "%Y-%m-%d %H:%M:%S";

/// `text` percent-encoded for a path segment or a query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            true => (b as char).to_string(),
            false => format!("%{b:02X}"),
        })
        .collect()
}

/// A page link: `path` and the non-empty `pairs` as its query, each value percent-encoded.
fn link(path: &str, pairs: &[(&str, &str)]) -> String {
    let query: Vec<String> =
        pairs.iter().filter(|(_, v)| !v.is_empty()).map(|(k, v)| format!("{k}={}", encode(v))).collect();
    match query.is_empty() {
        true => path.to_owned(),
        false => format!("{path}?{}", query.join("&")),
    }
}

/// A page of the fleet in attention order with each row's last 24 h of evidence (records that
/// would be or were blocked, gaps), and the link to the next page.
async fn fleet_lines(
    state: &ApiState,
    filter: &WorkloadFilter,
    text: &str,
    cursor: Option<String>,
) -> Result<(Vec<FleetLine>, Option<String>), Error> {
    let request = PageRequest { limit: PAGE_ROWS, cursor };
    let page = store::workload_page(&mut *state.pool.acquire().await?, filter, &request).await?;
    let ids: Vec<uuid::Uuid> = page.rows.iter().filter_map(|w| w.id.parse().ok()).collect();
    let since = chrono::Utc::now() - chrono::TimeDelta::hours(24);
    let totals = flows::window_totals(&state.pool, &ids, since).await?;
    let lines = page
        .rows
        .into_iter()
        .map(|w| {
            let t = w.id.parse().ok().and_then(|id| totals.get(&id).copied()).unwrap_or_default();
            let mut mode = w.mode.clone();
            if w.denied {
                mode.push_str(" (deny-listed)");
            } else if w.retired {
                mode.push_str(" (retired)");
            }
            FleetLine {
                labels: w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                versions: format!(
                    "v{} / {}",
                    w.applied_version,
                    w.latest_version.map_or("-".into(), |v| format!("v{v}"))
                ),
                last_seen: w.last_seen_at.map_or("never".into(), |t| t.format(TIME).to_string()),
                expires: w.credential_expires_at.map_or("-".into(), |t| t.format(TIME).to_string()),
                blocking: t.blocking_records,
                gaps: t.gaps,
                id: w.id,
                hostname: w.hostname,
                state: w.sync_state,
                detail: w.sync_detail,
                mode,
            }
        })
        .collect();
    let next = page.next_cursor.map(|c| link("/fleet", &[("selector", text), ("cursor", &c)]));
    Ok((lines, next))
}

/// The selector of a fleet query, or why it is not one.
fn fleet_filter(text: &str) -> Result<WorkloadFilter, String> {
    let mut filter = WorkloadFilter::default();
    if !text.trim().is_empty() {
        filter.selector = Some(flows::parse_selector(text).map_err(|e| format!("selector {text:?}: {e}"))?);
    }
    Ok(filter)
}

/// The fleet in attention order (degraded, offline, suspended, pending, synced), a page of
/// [`PAGE_ROWS`] at a time, filtered by a selector as the CLI writes it; its table refreshes
/// from [`fleet_rows`].
async fn fleet(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<FleetQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let text = q.selector.unwrap_or_default();
    let refresh = link(
        "/fleet/rows",
        &[("selector", text.as_str()), ("cursor", q.cursor.as_deref().unwrap_or_default())],
    );
    let mut page = FleetPage {
        who: Some(Who::from(&session)),
        selector: text.clone(),
        error: None,
        rows: Vec::new(),
        next: None,
        refresh,
    };
    let filter = match fleet_filter(&text) {
        Ok(filter) => filter,
        Err(why) => {
            page.error = Some(why);
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
    };
    (page.rows, page.next) = fleet_lines(&state, &filter, &text, q.cursor).await?;
    Ok(html(&page))
}

/// The rows of a fleet page, for its refresh.
async fn fleet_rows(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<FleetQuery>,
) -> Result<Response, Failure> {
    signed(&state, &headers).await?;
    let text = q.selector.unwrap_or_default();
    let filter = fleet_filter(&text).map_err(Failure::Invalid)?;
    let (rows, _) = fleet_lines(&state, &filter, &text, q.cursor).await?;
    Ok(html(&FleetRows { rows }))
}

// ---- one workload ------------------------------------------------------------------------

/// How many of a workload's versions, promotions, flow groups and gaps its page shows.
const WORKLOAD_ROWS: usize = 10;

struct RuleLine {
    id: String,
    name: String,
    protocol: String,
    ports: String,
    peers: String,
}

struct VersionLine {
    version: u64,
    at: String,
    changes: Vec<String>,
}

struct GapLine {
    kind: String,
    from: String,
    to: String,
    count: i64,
    detail: String,
}

#[derive(Template)]
#[template(path = "workload.html")]
struct WorkloadPage {
    who: Option<Who>,
    w: WorkloadView,
    may_label: bool,
    csrf: String,
    policy: Option<(u64, String)>,
    rules: Vec<RuleLine>,
    versions: Vec<VersionLine>,
    promotions: Vec<Promotion>,
    verdict: Option<VerdictView>,
    flows: Vec<FlowLine>,
    gaps: Vec<GapLine>,
}

fn workload_id(text: &str) -> Result<WorkloadId, Failure> {
    text.parse().map_err(|_| {
        Failure::Invalid(format!("{:?} is not a workload id", text.chars().take(64).collect::<String>()))
    })
}

/// A change of a delta in words, rules by their authored names.
fn describe(
    change: &innerwall_wire::policy::Change,
    names: &std::collections::BTreeMap<String, String>,
) -> String {
    use innerwall_wire::policy::Change;
    let name = |id: &innerwall_wire::policy::RuleId| {
        let authored = names.get(id.authored()).cloned().unwrap_or_else(|| id.authored().to_owned());
        format!("{authored} ({})", id.protocol())
    };
    match change {
        Change::UpsertRule(rule) => format!("rule {} set: {} peer(s)", name(rule.id()), rule.peers().len()),
        Change::RemoveRule(id) => format!("rule {} removed", name(id)),
        Change::AddPeers { rule, peers } => {
            format!(
                "rule {} admits {}",
                name(rule),
                peers.iter().map(|c| c.text()).collect::<Vec<_>>().join(", ")
            )
        }
        Change::RemovePeers { rule, peers } => {
            format!(
                "rule {} no longer admits {}",
                name(rule),
                peers.iter().map(|c| c.text()).collect::<Vec<_>>().join(", ")
            )
        }
        Change::SetMode(mode) => format!("mode {mode}"),
        Change::SetRevertAt(Some(at)) => match chrono::DateTime::<chrono::Utc>::from_timestamp_millis(*at) {
            Some(t) => format!("reverts to simulation at {} unless confirmed", t.format("%F %T UTC")),
            None => format!("reverts to simulation at {at} ms unless confirmed"),
        },
        Change::SetRevertAt(None) => "confirmed: no revert deadline".to_owned(),
        Change::SetStaged(Some(staged)) => format!(
            "staged set {}: {} rule(s) staged, {} removal(s) staged",
            staged.set(),
            staged.upserts().len(),
            staged.removals().len()
        ),
        Change::SetStaged(None) => "no staged set".to_owned(),
    }
}

/// One workload: its labels and addresses with their standing, the rendered rules by name, what
/// each of its newest versions changed, the promotions that changed its mode, its verdict and
/// its flows and gaps over the last 24 h.
async fn workload(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let id = workload_id(&id)?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let w = store::workload_view(&mut conn, id).await?;
    let policy = match w.policy_version {
        Some(_) => Some(store::policy_view(&mut conn, id).await?),
        None => None,
    };
    let history = store::version_changes(&mut conn, id, WORKLOAD_ROWS).await?;
    let mut authored: Vec<uuid::Uuid> = Vec::new();
    for rule in policy.iter().flat_map(|p| &p.rules) {
        authored.extend(rule.rule_id.rsplit_once('/').and_then(|(a, _)| a.parse::<uuid::Uuid>().ok()));
    }
    for (_, _, changes) in &history {
        for change in changes {
            use innerwall_wire::policy::Change;
            let rule = match change {
                Change::UpsertRule(r) => Some(r.id()),
                Change::RemoveRule(id)
                | Change::AddPeers { rule: id, .. }
                | Change::RemovePeers { rule: id, .. } => Some(id),
                Change::SetMode(_) | Change::SetRevertAt(_) | Change::SetStaged(_) => None,
            };
            authored.extend(rule.and_then(|r| r.authored().parse::<uuid::Uuid>().ok()));
        }
    }
    let names: std::collections::BTreeMap<String, String> =
        store::rule_names(&mut conn, &authored).await?.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let rules = policy
        .iter()
        .flat_map(|p| &p.rules)
        .map(|r| {
            let authored = r.rule_id.rsplit_once('/').map_or(r.rule_id.as_str(), |(a, _)| a);
            RuleLine {
                name: names.get(authored).cloned().unwrap_or_else(|| "(authored rule deleted since)".into()),
                id: r.rule_id.clone(),
                protocol: r.protocol.clone(),
                ports: r.ports.join(", "),
                peers: r.peers.join(" "),
            }
        })
        .collect();
    let versions = history
        .iter()
        .map(|(version, at, changes)| VersionLine {
            version: *version,
            at: at.format(TIME).to_string(),
            changes: changes.iter().map(|c| describe(c, &names)).collect(),
        })
        .collect();
    let promotions = gate::promote::of_workload(&mut conn, id, WORKLOAD_ROWS as i64).await?;
    drop(conn);
    let day = chrono::Utc::now().timestamp_millis();
    let params = Params::ending_at(
        day,
        std::time::Duration::from_secs(86_400),
        std::time::Duration::from_secs(86_400),
    )?;
    let verdict = gate::judge(&state.pool, &Scope::ids(vec![id])?, &params).await?;
    let at = |ms| chrono::DateTime::from_timestamp_millis(ms).unwrap_or(chrono::DateTime::UNIX_EPOCH);
    let filter = RollupFilter::range(at(params.from_ms), at(params.to_ms)).within([id].into());
    let rows = flows::rollup(
        &state.pool,
        Grouping::RulePeer,
        &filter,
        &PageRequest { limit: WORKLOAD_ROWS as u32, cursor: None },
    )
    .await?;
    let hosts = std::collections::BTreeMap::new();
    let flows = rows.rows.iter().map(|r| flow_line(Grouping::RulePeer, r, &hosts)).collect();
    let gaps = flows::gaps(
        &state.pool,
        Some(id),
        at(params.from_ms),
        &PageRequest { limit: WORKLOAD_ROWS as u32, cursor: None },
    )
    .await?
    .rows
    .into_iter()
    .map(|g| GapLine {
        kind: innerwall_wire::flows::GapKind::from_code(g.kind).map_or("?".into(), |k| k.to_string()),
        from: g.gap_from.format(TIME).to_string(),
        to: g.gap_to.format(TIME).to_string(),
        count: g.count,
        detail: g.detail,
    })
    .collect();
    let may_label = session.operator.role.allows(Role::Editor);
    Ok(html(&WorkloadPage {
        who: Some(Who::from(&session)),
        csrf: session.csrf.clone(),
        may_label,
        policy: policy.map(|p| (p.version, p.mode)),
        rules,
        versions,
        promotions,
        verdict: Some(VerdictView::from(&verdict)),
        flows,
        gaps,
        w,
    }))
}

#[derive(Deserialize)]
struct LabelsForm {
    csrf: String,
    expect_label_version: i64,
    labels: String,
}

/// Replaces the workload's label set (editor), conditional on the version the page showed:
/// `operations::replace_labels`, as `PUT /api/v1/workloads/{id}/labels`.
async fn set_labels(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(form): Form<LabelsForm>,
) -> Result<Response, Failure> {
    let session = writer(&state, &headers, Role::Editor, &form.csrf).await?;
    let id = workload_id(&id)?;
    let labels = form
        .labels
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.parse::<Label>().map_err(|e| Failure::Invalid(format!("label {l:?}: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    crate::operations::replace_labels(
        &state.pool,
        &session.operator.actor(),
        id,
        form.expect_label_version,
        &labels,
    )
    .await?;
    Ok(Redirect::to(&format!("/workloads/{id}")).into_response())
}

// ---- audit -------------------------------------------------------------------------------

struct AuditLine {
    at: chrono::DateTime<chrono::Utc>,
    actor: String,
    action: String,
    subject: String,
    moved: usize,
}

#[derive(Template)]
#[template(path = "audit.html")]
struct AuditPage {
    who: Option<Who>,
    q: AuditQuery,
    error: Option<String>,
    rows: Vec<AuditLine>,
    next: Option<String>,
    promotions: Vec<Promotion>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct AuditQuery {
    #[serde(default)]
    actor: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    object: String,
    #[serde(default)]
    since: String,
    cursor: Option<String>,
}

/// The audit log, newest first, a page at a time, filtered as `audit list` filters it (exact
/// actor, action and object; a range back from now); and the newest promotion records.
async fn audit_log(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<AuditQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let some = |text: &str| Some(text.trim().to_owned()).filter(|t| !t.is_empty());
    let mut page = AuditPage {
        who: Some(Who::from(&session)),
        q: q.clone(),
        error: None,
        rows: Vec::new(),
        next: None,
        promotions: Vec::new(),
    };
    let since = match q.since.trim() {
        "" => Ok(None),
        text => duration("since", text).map(|d| {
            Some(chrono::Utc::now() - chrono::TimeDelta::from_std(d).unwrap_or(chrono::TimeDelta::MAX))
        }),
    };
    let filter = match since {
        Ok(since) => {
            AuditFilter { actor: some(&q.actor), action: some(&q.action), object: some(&q.object), since }
        }
        Err(why) => {
            page.error = Some(why);
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
    };
    let request = PageRequest { limit: PAGE_ROWS, cursor: q.cursor.clone() };
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let found = match audit::page(&mut conn, &filter, &request).await {
        Ok(found) => found,
        Err(e) if e.kind() == crate::error::Kind::Invalid => {
            page.error = Some(e.to_string());
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
        Err(e) => return Err(e.into()),
    };
    page.rows = found
        .rows
        .into_iter()
        .map(|r| AuditLine {
            moved: r.workload_versions.as_object().map_or(0, serde_json::Map::len),
            at: r.at,
            actor: r.actor,
            action: r.action,
            subject: r.subject,
        })
        .collect();
    page.next = found.next_cursor.map(|c| {
        let pairs = [
            ("actor", q.actor.as_str()),
            ("action", &q.action),
            ("object", &q.object),
            ("since", &q.since),
            ("cursor", &c),
        ];
        link("/audit", &pairs)
    });
    page.promotions = gate::promote::page(&mut conn, &PageRequest { limit: 20, cursor: None }).await?.rows;
    Ok(html(&page))
}

// ---- review and promote ------------------------------------------------------------------

/// One workload's verdict as the review table shows it.
struct VerdictLine {
    id: String,
    hostname: String,
    outcome: &'static str,
    judged: String,
    mode_state: String,
    covered: String,
    native: String,
    replayed: String,
    would_block: usize,
    reasons: Vec<String>,
}

struct VerdictView {
    outcome: &'static str,
    range: String,
    rows: Vec<VerdictLine>,
}

impl From<&Verdict> for VerdictView {
    fn from(v: &Verdict) -> VerdictView {
        let rows = v
            .workloads
            .iter()
            .map(|w| {
                let e = &w.evidence;
                let replayed: Vec<String> = e.replayed_from.iter().map(|v| format!("v{v}")).collect();
                VerdictLine {
                    id: w.id.to_string(),
                    hostname: w.hostname.clone(),
                    outcome: w.outcome().name(),
                    judged: w.latest_version.map_or("-".into(), |v| format!("v{v}")),
                    mode_state: format!("{} · {}", w.mode, w.state),
                    covered: format!("{}%", if e.range_ms > 0 { e.covered_ms * 100 / e.range_ms } else { 0 }),
                    native: format!("{} win / {} s", e.native_windows, e.native_ms / 1000),
                    replayed: match replayed.is_empty() {
                        true => "-".into(),
                        false => format!(
                            "{} win / {} s from {}",
                            e.replayed_windows,
                            e.replayed_ms / 1000,
                            replayed.join(",")
                        ),
                    },
                    would_block: e.would_block_flows,
                    reasons: w.reasons.iter().map(ToString::to_string).collect(),
                }
            })
            .collect();
        let at = |ms: i64| {
            chrono::DateTime::from_timestamp_millis(ms)
                .map_or("?".into(), |t| t.format("%Y-%m-%d %H:%M").to_string())
        };
        VerdictView {
            outcome: v.outcome.name(),
            range: format!("{} to {} UTC", at(v.params.from_ms), at(v.params.to_ms)),
            rows,
        }
    }
}

#[derive(Template)]
#[template(path = "review.html")]
struct ReviewPage {
    who: Option<Who>,
    scope: String,
    since: String,
    min: String,
    until: String,
    error: Option<String>,
    verdict: Option<VerdictView>,
    may_promote: bool,
    csrf: String,
    /// The scope's suggested rules.
    suggest: String,
}

#[derive(Deserialize)]
struct ReviewQuery {
    scope: Option<String>,
    since: Option<String>,
    min: Option<String>,
    until: Option<String>,
}

/// A duration field as the CLI's flags read it (`24h`, `7d`), or why it is not one.
fn duration(what: &str, text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| format!("{what} {text:?}: {e} (write e.g. 24h, 7d)"))
}

/// The evidence range `since` back from `until` (RFC 3339; empty: now), at least `min` long, as
/// the CLI's flags read them.
fn evidence(since: &str, min: &str, until: &str) -> Result<Params, String> {
    let (since, min) = (duration("evidence since", since)?, duration("minimum evidence", min)?);
    let until = match until.trim() {
        "" => chrono::Utc::now(),
        text => chrono::DateTime::parse_from_rfc3339(text)
            .map_err(|e| {
                format!("until {text:?}: {e} (write e.g. 2026-12-03T10:00:00Z, or leave it empty for now)")
            })?
            .with_timezone(&chrono::Utc),
    };
    Params::ending_at(until.timestamp_millis(), since, min).map_err(|e| e.to_string())
}

/// A scope's verdict with every workload's reasons (`gate::judge`, as `workload verdict` and
/// `GET /api/v1/verdict`), and for promoters the form that changes exactly that set's mode.
async fn review(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<ReviewQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let mut page = ReviewPage {
        who: Some(Who::from(&session)),
        scope: q.scope.unwrap_or_default(),
        since: q.since.unwrap_or_else(|| "24h".into()),
        min: q.min.unwrap_or_else(|| "24h".into()),
        until: q.until.unwrap_or_default(),
        error: None,
        verdict: None,
        may_promote: session.operator.role.allows(Role::Promoter),
        csrf: session.csrf.clone(),
        suggest: String::new(),
    };
    if page.scope.trim().is_empty() {
        return Ok(html(&page));
    }
    page.suggest = link("/suggestions", &[("scope", page.scope.as_str())]);
    let judged = match (Scope::parse_selector(&page.scope), evidence(&page.since, &page.min, &page.until)) {
        (Ok(scope), Ok(params)) => gate::judge(&state.pool, &scope, &params).await,
        (Err(e), _) => Err(e),
        (_, Err(why)) => Err(Error::Invalid(why)),
    };
    match judged {
        Ok(verdict) => page.verdict = Some(VerdictView::from(&verdict)),
        Err(e) if e.kind() == crate::error::Kind::Invalid => {
            page.error = Some(e.to_string());
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
        Err(e) => return Err(e.into()),
    }
    Ok(html(&page))
}

#[derive(Deserialize)]
struct PromoteForm {
    csrf: String,
    scope: String,
    since: String,
    min: String,
    #[serde(default)]
    until: String,
    expect_count: usize,
    to: String,
    reason: String,
    #[serde(default)]
    override_reason: String,
}

/// A count-pinned mode change from the review page (promoter): `gate::promote` with the count
/// the page showed, so a scope that names another set by now changes nothing.
async fn promote(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Form(form): Form<PromoteForm>,
) -> Result<Response, Failure> {
    let session = writer(&state, &headers, Role::Promoter, &form.csrf).await?;
    let to: Mode = form.to.parse().map_err(|_| Failure::Invalid(format!("{:?} is not a mode", form.to)))?;
    let request = gate::Request {
        scope: Scope::parse_selector(&form.scope)?,
        expect_count: form.expect_count,
        to,
        params: evidence(&form.since, &form.min, &form.until).map_err(Failure::Invalid)?,
        reason: form.reason,
        override_reason: Some(form.override_reason).filter(|r| !r.trim().is_empty()),
        guard: None,
        confirm_within: None,
    };
    let promotion = gate::promote(&state.pool, &session.operator.actor(), &request).await?;
    Ok(Redirect::to(&format!("/promotions/{}", promotion.id)).into_response())
}

#[derive(Template)]
#[template(path = "promotion.html")]
struct PromotionPage {
    who: Option<Who>,
    p: Promotion,
    verdict: Option<String>,
}

async fn promotion(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let id: uuid::Uuid = id.parse().map_err(|_| Failure::Invalid("not a promotion id".into()))?;
    let p = gate::promote::show(&mut *state.pool.acquire().await.map_err(Error::from)?, id).await?;
    let verdict = p.verdict.as_ref().map(|v| serde_json::to_string_pretty(v).unwrap_or_default());
    Ok(html(&PromotionPage { who: Some(Who::from(&session)), p, verdict }))
}

// ---- flows -------------------------------------------------------------------------------

/// The most rows an export walks (pages of [`flows::MAX_PAGE`]); it says when it stopped.
const EXPORT_ROWS: usize = 10_000;

/// The flows page's query, as written (each field a form field; empty: the default).
#[derive(Debug, Clone, Default, Deserialize)]
struct FlowsQuery {
    #[serde(default)]
    by: String,
    #[serde(default)]
    scope: String,
    /// Labels the peer had then, `key=value,…` (the map's links set it).
    #[serde(default)]
    peer: String,
    #[serde(default)]
    decision: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    since: String,
    /// The range's end (RFC 3339); empty: now.
    #[serde(default)]
    until: String,
    cursor: Option<String>,
}

impl FlowsQuery {
    fn normalised(mut self) -> FlowsQuery {
        if self.by.is_empty() {
            self.by = Grouping::RulePeer.name().into();
        }
        if self.since.is_empty() {
            self.since = "24h".into();
        }
        self
    }

    /// `since` before `until` (now when empty) until then.
    fn range(&self) -> Result<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>), Error> {
        let params = evidence(&self.since, "0s", &self.until).map_err(Error::Invalid)?;
        let at = |ms| chrono::DateTime::from_timestamp_millis(ms).unwrap_or(chrono::DateTime::UNIX_EPOCH);
        Ok((at(params.from_ms), at(params.to_ms)))
    }

    /// The link to this query (without its cursor) at `path`, with `cursor` when given.
    fn link(&self, path: &str, cursor: Option<&str>) -> String {
        let mut pairs = vec![
            ("by", self.by.as_str()),
            ("scope", self.scope.as_str()),
            ("peer", self.peer.as_str()),
            ("decision", self.decision.as_str()),
            ("version", self.version.as_str()),
            ("since", self.since.as_str()),
            ("until", self.until.as_str()),
        ];
        if let Some(cursor) = cursor {
            pairs.push(("cursor", cursor));
        }
        link(path, &pairs)
    }

    /// The grouping and the library's filter, each field checked as the CLI checks its flags.
    async fn filter(&self, pool: &sqlx::PgPool) -> Result<(Grouping, RollupFilter), Error> {
        let by: Grouping = self.by.parse()?;
        let (from, to) = self.range()?;
        let mut filter = RollupFilter::range(from, to);
        if !self.decision.is_empty() {
            let decision = self.decision.parse::<Decision>().map_err(|_| {
                Error::Invalid(format!(
                    "unknown decision {:?}: use observed, allowed, would-block or blocked",
                    self.decision
                ))
            })?;
            filter.decisions = vec![decision];
        }
        if !self.version.trim().is_empty() {
            let version = self.version.trim().parse::<u64>().map_err(|_| {
                Error::Invalid(format!("version {:?} is not a policy version (a whole number)", self.version))
            })?;
            filter.versions = vec![version];
        }
        if !self.peer.trim().is_empty() {
            filter.peer_labels = self
                .peer
                .split(',')
                .map(|l| {
                    l.trim().parse::<Label>().map_err(|e| Error::Invalid(format!("peer label {l:?}: {e}")))
                })
                .collect::<Result<_, _>>()?;
        }
        if !self.scope.trim().is_empty() {
            let selector = flows::parse_selector(&self.scope)?;
            filter = filter.within(flows::workloads_in(pool, &selector).await?);
        }
        Ok((by, filter))
    }
}

/// A table cell, linked when it names something with a page.
struct Cell {
    text: String,
    href: Option<String>,
}

impl Cell {
    fn text(text: impl Into<String>) -> Cell {
        Cell { text: text.into(), href: None }
    }
}

struct FlowLine {
    class: &'static str,
    cells: Vec<Cell>,
    connections: i64,
    packets: i64,
    bytes: i64,
    first_seen: String,
    last_seen: String,
    versions: String,
    decisions: String,
}

#[derive(Template)]
#[template(path = "flows.html")]
struct FlowsPage {
    who: Option<Who>,
    q: FlowsQuery,
    groupings: Vec<&'static str>,
    decisions: Vec<&'static str>,
    error: Option<String>,
    headers: Vec<&'static str>,
    rows: Vec<FlowLine>,
    next: Option<String>,
    csv: String,
    json: String,
}

/// The key columns of a grouping, as the table heads them.
fn key_headers(by: Grouping) -> Vec<&'static str> {
    match by {
        Grouping::Rule => vec!["Rule"],
        Grouping::RulePeer => vec!["Rule", "Peer"],
        Grouping::SrcDst => vec!["Source", "Peer", "To", "Destination"],
        Grouping::DstService => vec!["To", "Service"],
        Grouping::PeerService => vec!["Peer", "Service"],
    }
}

/// How a peer reads: a workload with its labels then, an address group, or an address.
fn peer_text(row: &RollupRow) -> String {
    let key = row.peer_key.clone().unwrap_or_default();
    match row.peer_kind {
        Some(1) => format!("workload {key} {}", row.peer_labels.clone().unwrap_or_default()),
        Some(2) => format!("group {key}"),
        _ => key,
    }
}

fn service_text(row: &RollupRow) -> String {
    let protocol =
        row.protocol.and_then(|p| Protocol::from_code(p).ok()).map_or("?".into(), |p| p.to_string());
    match row.dst_port {
        Some(port) if port > 0 => format!("{protocol}/{port}"),
        _ => protocol,
    }
}

fn decision_names(codes: &[i16]) -> Vec<String> {
    codes.iter().map(|c| Decision::from_code(*c).map_or("?".into(), |d| d.to_string())).collect()
}

/// One rollup row as the table shows it; the destination by hostname (`hosts`), linked.
fn flow_line(
    by: Grouping,
    row: &RollupRow,
    hosts: &std::collections::BTreeMap<uuid::Uuid, String>,
) -> FlowLine {
    let to = || match row.workload_id {
        Some(id) => Cell {
            text: hosts.get(&id).cloned().unwrap_or_else(|| id.to_string()),
            href: Some(format!("/workloads/{id}")),
        },
        None => Cell::text("-"),
    };
    let rule =
        || Cell::text(row.rule.clone().filter(|r| !r.is_empty()).unwrap_or_else(|| "(no rule)".into()));
    let cells = match by {
        Grouping::Rule => vec![rule()],
        Grouping::RulePeer => vec![rule(), Cell::text(peer_text(row))],
        Grouping::SrcDst => vec![
            Cell::text(row.src_address.clone().unwrap_or_default()),
            Cell::text(peer_text(row)),
            to(),
            Cell::text(row.dst_address.clone().unwrap_or_default()),
        ],
        Grouping::DstService => vec![to(), Cell::text(service_text(row))],
        Grouping::PeerService => vec![Cell::text(peer_text(row)), Cell::text(service_text(row))],
    };
    let decisions = decision_names(&row.decisions);
    let blocked = decisions.iter().any(|d| d == "would-block" || d == "blocked");
    FlowLine {
        class: if blocked { "decision-would-block" } else { "decision-allowed" },
        cells,
        connections: row.connections,
        packets: row.packets,
        bytes: row.bytes,
        first_seen: row.first_seen.format("%Y-%m-%d %H:%M:%S").to_string(),
        last_seen: row.last_seen.format("%Y-%m-%d %H:%M:%S").to_string(),
        versions: row.policy_versions.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", "),
        decisions: decisions.join(", "),
    }
}

async fn hostnames_of(
    state: &ApiState,
    rows: &[RollupRow],
) -> Result<std::collections::BTreeMap<uuid::Uuid, String>, Error> {
    let ids: Vec<uuid::Uuid> = rows.iter().filter_map(|r| r.workload_id).collect();
    store::hostnames(&mut *state.pool.acquire().await?, &ids).await
}

/// The flow rollups (`flows::rollup`, as `flows rollup` and `GET /api/v1/flows/rollup`), by
/// rule, rule and peer, source and destination, destination and service, or peer and service,
/// filtered by decision, version, a destination selector and a range; every row names the
/// versions and decisions behind it (and in the rule groupings, the rule).
async fn flows_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<FlowsQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let q = q.normalised();
    let mut page = FlowsPage {
        who: Some(Who::from(&session)),
        groupings: Grouping::ALL.iter().map(|g| g.name()).collect(),
        decisions: vec!["", "allowed", "would-block", "blocked", "observed"],
        error: None,
        headers: Vec::new(),
        rows: Vec::new(),
        next: None,
        csv: q.link("/flows/export.csv", None),
        json: q.link("/flows/export.json", None),
        q,
    };
    let (by, filter) = match page.q.filter(&state.pool).await {
        Ok(parsed) => parsed,
        Err(e) if e.kind() == crate::error::Kind::Invalid => {
            page.error = Some(e.to_string());
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
        Err(e) => return Err(e.into()),
    };
    let request = PageRequest { limit: PAGE_ROWS, cursor: page.q.cursor.clone() };
    let rows = flows::rollup(&state.pool, by, &filter, &request).await?;
    let hosts = hostnames_of(&state, &rows.rows).await?;
    page.headers = key_headers(by);
    page.rows = rows.rows.iter().map(|r| flow_line(by, r, &hosts)).collect();
    page.next = rows.next_cursor.as_deref().map(|c| page.q.link("/flows", Some(c)));
    Ok(html(&page))
}

/// Every row of the query, up to [`EXPORT_ROWS`]; whether it stopped there.
async fn export_rows(state: &ApiState, q: &FlowsQuery) -> Result<(Grouping, Vec<RollupRow>, bool), Failure> {
    let (by, filter) = q.filter(&state.pool).await.map_err(|e| match e.kind() {
        crate::error::Kind::Invalid => Failure::Invalid(e.to_string()),
        _ => Failure::Domain(e),
    })?;
    let mut request = PageRequest { limit: flows::MAX_PAGE, cursor: None };
    let mut rows = Vec::new();
    loop {
        let page = flows::rollup(&state.pool, by, &filter, &request).await?;
        rows.extend(page.rows);
        match page.next_cursor {
            Some(cursor) if rows.len() < EXPORT_ROWS => request.cursor = Some(cursor),
            Some(_) => return Ok((by, rows, true)),
            None => return Ok((by, rows, false)),
        }
    }
}

/// A CSV field: quoted when it must be, and never read as a formula by a spreadsheet.
fn csv_field(text: &str) -> String {
    let text = match text.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        true => format!("'{text}"),
        false => text.to_owned(),
    };
    match text.contains([',', '"', '\n', '\r']) {
        true => format!("\"{}\"", text.replace('"', "\"\"")),
        false => text,
    }
}

fn attachment(kind: &'static str, name: &'static str, body: String) -> Response {
    let disposition = HeaderValue::from_static(name);
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(kind)), (header::CONTENT_DISPOSITION, disposition)],
        body,
    )
        .into_response()
}

/// The flows page's query as CSV: its key columns, then the sums, versions and decisions.
async fn flows_csv(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<FlowsQuery>,
) -> Result<Response, Failure> {
    signed(&state, &headers).await?;
    let (by, rows, truncated) = export_rows(&state, &q.normalised()).await?;
    let hosts = hostnames_of(&state, &rows).await?;
    let mut out = key_headers(by).join(",");
    out.push_str(",connections,packets,bytes,first_seen,last_seen,versions,decisions\n");
    for row in &rows {
        let line = flow_line(by, row, &hosts);
        let mut fields: Vec<String> = line.cells.iter().map(|c| csv_field(&c.text)).collect();
        fields.extend([
            line.connections.to_string(),
            line.packets.to_string(),
            line.bytes.to_string(),
            row.first_seen.to_rfc3339(),
            row.last_seen.to_rfc3339(),
            csv_field(&line.versions),
            csv_field(&line.decisions),
        ]);
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    if truncated {
        out.push_str(&format!("# stopped after {EXPORT_ROWS} rows: narrow the query\n"));
    }
    Ok(attachment("text/csv; charset=utf-8", "attachment; filename=\"innerwall-flows.csv\"", out))
}

/// The flows page's query as JSON: the rows as `flows rollup --json` prints them.
async fn flows_json(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<FlowsQuery>,
) -> Result<Response, Failure> {
    signed(&state, &headers).await?;
    let q = q.normalised();
    let (by, rows, truncated) = export_rows(&state, &q).await?;
    let body = serde_json::json!({"by": by.name(), "rows": rows, "truncated": truncated});
    Ok(attachment("application/json", "attachment; filename=\"innerwall-flows.json\"", body.to_string()))
}

// ---- map ---------------------------------------------------------------------------------

/// The most edges the map's table lists (the heaviest).
const MAP_TABLE_ROWS: usize = 200;

#[derive(Debug, Clone, Default, Deserialize)]
struct MapQuery {
    #[serde(default)]
    key: String,
    #[serde(default)]
    key2: String,
    #[serde(default)]
    scope: String,
    #[serde(default)]
    since: String,
    #[serde(default)]
    until: String,
}

/// An edge's ends and decision.
type EdgeKey = (String, String, &'static str);
/// The selectors an edge's flows link narrows by: the destination's and the peer's.
type EdgeSelectors = (Option<String>, Option<String>);

/// An edge and where it leads (its flows on the flows page).
struct Linked<T> {
    href: String,
    edge: map::Edge,
    path: T,
}

#[derive(Template)]
#[template(path = "map.html")]
struct MapPage {
    who: Option<Who>,
    q: MapQuery,
    error: Option<String>,
    /// The whole hours drawn.
    drawn: String,
    /// Records not summed for the map yet left out (too many to read at once).
    pending_left_out: i64,
    truncated: bool,
    max_sums: i64,
    max_pending: i64,
    layout: Option<MapLayout>,
    edges: Vec<Linked<()>>,
    /// Edges the table leaves out.
    more_edges: usize,
}

struct MapLayout {
    width: f64,
    height: f64,
    nodes: Vec<map::Node>,
    paths: Vec<Linked<map::Path>>,
}

/// A group's name from `labels` by the page's keys: `app=db`, `app=db,env=prod`, `(no app)`.
fn group_of(labels: &std::collections::BTreeMap<String, String>, keys: &[&str]) -> (String, Option<String>) {
    let mut parts = Vec::new();
    for key in keys {
        match labels.get(*key) {
            Some(value) => parts.push(format!("{key}={value}")),
            None => return (format!("(no {key})"), None),
        }
    }
    let selector = parts.join(",");
    (selector.clone(), Some(selector))
}

/// Flows between groups of a label (and a second one): managed peers and destinations by their
/// labels then, address groups by name, other addresses as one group; summed per decision from
/// the map's hourly pre-aggregate ([`flows::edges`]), grouped here, and drawn in
/// layers ([`map::layout`]); beyond [`map::MAX_GROUPS`] groups the page asks for a filter.
async fn map_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(mut q): axum::extract::Query<MapQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    if q.key.trim().is_empty() {
        q.key = "app".into();
    }
    if q.since.trim().is_empty() {
        q.since = "24h".into();
    }
    let mut page = MapPage {
        who: Some(Who::from(&session)),
        q: q.clone(),
        error: None,
        drawn: String::new(),
        pending_left_out: 0,
        truncated: false,
        max_sums: flows::MAX_EDGE_SUMS,
        max_pending: flows::MAX_PENDING_RECORDS,
        layout: None,
        edges: Vec::new(),
        more_edges: 0,
    };
    let keys: Vec<&str> = [q.key.trim(), q.key2.trim()].into_iter().filter(|k| !k.is_empty()).collect();
    for key in &keys {
        if let Err(e) = key.parse::<innerwall_wire::labels::LabelKey>() {
            page.error = Some(format!("label key {key:?}: {e}"));
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
    }
    let parsed = FlowsQuery { since: q.since.clone(), until: q.until.clone(), ..FlowsQuery::default() }
        .normalised()
        .range()
        .and_then(|range| match q.scope.trim() {
            "" => Ok((range, None)),
            text => Ok((range, Some(flows::parse_selector(text)?))),
        });
    let (range, scope) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            page.error = Some(e.to_string());
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
    };
    let read = flows::edges(&state.pool, range.0, range.1, flows::MAX_PENDING_RECORDS).await?;
    page.drawn = format!("{} – {} UTC", read.from.format(TIME), read.to.format(TIME));
    page.pending_left_out = read.pending_left_out;
    page.truncated = read.truncated;
    // Each edge with the selectors its flows link narrows by: the destination's and the peer's.
    let mut links: std::collections::BTreeMap<EdgeKey, EdgeSelectors> = std::collections::BTreeMap::new();
    let in_scope = |labels: &std::collections::BTreeMap<String, String>| match &scope {
        None => true,
        Some(selector) => {
            let parsed: Option<std::collections::BTreeMap<_, _>> =
                labels.iter().map(|(k, v)| Some((k.parse().ok()?, v.parse().ok()?))).collect();
            parsed.is_some_and(|labels| selector.selects(&labels))
        }
    };
    let edges = map::aggregate(read.sums.iter().filter(|s| in_scope(&s.destination)).map(|s| {
        let (to, to_selector) = group_of(&s.destination, &keys);
        let (from, from_selector) = match &s.peer {
            flows::Peer::Labelled(then) => group_of(then, &keys),
            flows::Peer::Group(name) => (format!("group {name}"), None),
            flows::Peer::Other => ("other addresses".to_owned(), None),
        };
        let decision = s.decision.name();
        links.insert((from.clone(), to.clone(), decision), (to_selector, from_selector));
        map::Edge { from, to, decision, connections: s.connections, flows: s.records }
    }));
    let href = |e: &map::Edge| {
        let (to, from) = links.get(&(e.from.clone(), e.to.clone(), e.decision)).cloned().unwrap_or_default();
        let query = FlowsQuery {
            by: Grouping::SrcDst.name().into(),
            scope: to.unwrap_or_default(),
            peer: from.unwrap_or_default(),
            decision: e.decision.into(),
            since: q.since.clone(),
            until: q.until.clone(),
            ..FlowsQuery::default()
        };
        query.link("/flows", None)
    };
    match map::layout(&edges) {
        Some(layout) => {
            page.layout = Some(MapLayout {
                width: layout.width,
                height: layout.height,
                nodes: layout.nodes,
                paths: layout
                    .paths
                    .into_iter()
                    .map(|p| Linked { href: href(&p.edge), edge: p.edge.clone(), path: p })
                    .collect(),
            })
        }
        None => {
            page.error = Some(format!(
                "the flows name more than {} groups; narrow the map with a scope (To) or a shorter range",
                map::MAX_GROUPS
            ))
        }
    }
    // The table lists the heaviest edges; the drawing has them all.
    let mut heaviest: Vec<&map::Edge> = edges.iter().collect();
    heaviest.sort_by(|a, b| b.connections.cmp(&a.connections).then_with(|| a.cmp(b)));
    page.more_edges = heaviest.len().saturating_sub(MAP_TABLE_ROWS);
    page.edges = heaviest
        .into_iter()
        .take(MAP_TABLE_ROWS)
        .map(|e| Linked { href: href(e), edge: e.clone(), path: () })
        .collect();
    Ok(html(&page))
}

// ---- policy and drafts -------------------------------------------------------------------

/// The range a draft's page replays recorded flows over.
const DRAFT_IMPACT_SINCE: &str = "7d";
/// Rows of each kind a draft's impact names per workload.
const DRAFT_IMPACT_TOP: usize = 5;

struct RulesetLine {
    spec: crate::policy::spec::RulesetSpec,
    version: i64,
    scope: String,
}

#[derive(Template)]
#[template(path = "policy.html")]
struct PolicyPage {
    who: Option<Who>,
    drafts: Vec<DraftSummary>,
    rulesets: Vec<RulesetLine>,
    services: Vec<store::ServiceView>,
    groups: Vec<store::AddressGroupView>,
    may_edit: bool,
    csrf: String,
}

/// The authored model (rulesets, services, address groups) and the drafts, with the form that
/// starts one for editors.
async fn policy_page(State(state): State<ApiState>, headers: HeaderMap) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let mut conn = state.pool.acquire().await.map_err(Error::from)?;
    let rulesets = store::list_rulesets(&mut conn)
        .await?
        .into_iter()
        .map(|r| RulesetLine {
            scope: r
                .spec
                .scope
                .iter()
                .map(|(k, vs)| format!("{k} in ({})", vs.join(", ")))
                .collect::<Vec<_>>()
                .join(" and "),
            version: r.version,
            spec: r.spec,
        })
        .collect();
    let page = PolicyPage {
        who: Some(Who::from(&session)),
        drafts: drafts::list(&state.pool).await?,
        rulesets,
        services: store::list_services(&mut conn).await?,
        groups: store::list_address_groups(&mut conn).await?,
        may_edit: session.operator.role.allows(Role::Editor),
        csrf: session.csrf.clone(),
    };
    Ok(html(&page))
}

#[derive(Deserialize)]
struct NewDraftForm {
    csrf: String,
    name: String,
    #[serde(default)]
    note: String,
    #[serde(default)]
    changes: String,
}

/// A new draft (editor) with the changes of its change file, parsed before anything is
/// written: `drafts::create`, then `drafts::add`, as `draft create` and `draft add -f`.
async fn new_draft(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Form(form): Form<NewDraftForm>,
) -> Result<Response, Failure> {
    let session = writer(&state, &headers, Role::Editor, &form.csrf).await?;
    let actor = session.operator.actor();
    let file = match form.changes.trim().is_empty() {
        true => None,
        false => Some(drafts::parse_change_file("the change file", &form.changes)?),
    };
    drafts::create(&state.pool, &actor, &form.name, &form.note).await?;
    if let Some(file) = file {
        drafts::add(&state.pool, &actor, &form.name, &file, &state.limits.counts).await?;
    }
    Ok(Redirect::to(&format!("/drafts/{}", encode(&form.name))).into_response())
}

/// One workload's impact as the draft page shows it.
struct ImpactLine {
    id: String,
    hostname: String,
    from: u64,
    to: u64,
    delta: usize,
    newly_blocked: u64,
    blocked_connections: u64,
    newly_allowed: u64,
    unchanged: u64,
    coverage: String,
    top_blocked: Vec<String>,
}

struct ImpactView {
    blockers: Vec<String>,
    rows: Vec<ImpactLine>,
}

#[derive(Template)]
#[template(path = "draft.html")]
struct DraftPage {
    who: Option<Who>,
    d: DraftView,
    /// Each change with what it writes, as a change file has it.
    changes: Vec<(drafts::DraftChange, String)>,
    error: Option<String>,
    impact: Option<ImpactView>,
    since: &'static str,
    tests: Option<RunReport>,
    may_commit: bool,
    csrf: String,
}

/// A draft: its changes with their bases; for an open draft, what a commit now would do (the
/// render's versions and deltas, its blockers, the recorded flows it would newly block or
/// allow over [`DRAFT_IMPACT_SINCE`]) and every policy test's result on its render. Each of
/// the two previews is an expensive operation, bounded as the API bounds it.
async fn draft_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let actor = session.operator.actor();
    let d = drafts::show(&state.pool, &name).await?;
    let changes = d
        .changes
        .iter()
        .map(|c| {
            (c.clone(), serde_norway::to_string(&c.change).unwrap_or_else(|e| format!("(not shown: {e})")))
        })
        .collect();
    let mut page = DraftPage {
        who: Some(Who::from(&session)),
        changes,
        error: None,
        impact: None,
        since: DRAFT_IMPACT_SINCE,
        tests: None,
        may_commit: d.committed_at.is_none() && session.operator.role.allows(Role::Editor),
        csrf: session.csrf.clone(),
        d,
    };
    if page.d.committed_at.is_some() || page.d.changes.is_empty() {
        return Ok(html(&page));
    }
    let since = humantime::parse_duration(DRAFT_IMPACT_SINCE).expect("a fixed duration");
    let range = crate::foresight::Range::ending_at(chrono::Utc::now(), since)?;
    let counts = &state.limits.counts;
    let preview = async {
        authoring::charge_expensive(&state.pool, Expensive::Render, &actor, &state.limits.expensive).await?;
        let (render, impact) =
            drafts::impact(&state.pool, &actor, &name, counts, range, DRAFT_IMPACT_TOP).await?;
        authoring::charge_expensive(&state.pool, Expensive::Render, &actor, &state.limits.expensive).await?;
        let tests = drafts::run_tests(&state.pool, &actor, &name, counts).await?;
        Ok::<_, Error>((render, impact, tests))
    };
    match preview.await {
        Ok((render, impact, tests)) => {
            let hosts: std::collections::BTreeMap<String, (String, u64, u64, String)> = impact
                .workloads
                .iter()
                .map(|w| {
                    let coverage = format!("{:.0}%", w.coverage.ratio * 100.0);
                    (
                        w.id.to_string(),
                        (w.hostname.clone(), w.replayed.newly_allowed, w.replayed.unchanged, coverage),
                    )
                })
                .collect();
            let blocked: std::collections::BTreeMap<String, &crate::foresight::WorkloadImpact> =
                impact.workloads.iter().map(|w| (w.id.to_string(), w)).collect();
            let rows = render
                .workloads
                .iter()
                .map(|r| {
                    let id = r.workload.to_string();
                    let w = blocked.get(&id);
                    let (hostname, newly_allowed, unchanged, coverage) =
                        hosts.get(&id).cloned().unwrap_or_else(|| (id.clone(), 0, 0, "-".into()));
                    ImpactLine {
                        hostname,
                        from: r.from_version,
                        to: r.to_version,
                        delta: r.delta_changes,
                        newly_blocked: w.map_or(0, |w| w.replayed.newly_blocked),
                        blocked_connections: w.map_or(0, |w| w.replayed.blocked_connections),
                        newly_allowed,
                        unchanged,
                        coverage,
                        top_blocked: w.map_or_else(Vec::new, |w| {
                            w.replayed
                                .top_blocked
                                .iter()
                                .map(|b| {
                                    format!(
                                        "{} → {}/{} ({} conns)",
                                        b.src_address, b.protocol, b.dst_port, b.connections
                                    )
                                })
                                .collect()
                        }),
                        id,
                    }
                })
                .collect();
            page.impact = Some(ImpactView { blockers: render.blockers, rows });
            page.tests = Some(tests);
        }
        Err(e)
            if matches!(
                e.kind(),
                crate::error::Kind::Invalid | crate::error::Kind::RateLimited | crate::error::Kind::Stale
            ) =>
        {
            page.error = Some(e.to_string())
        }
        Err(e) => return Err(e.into()),
    }
    Ok(html(&page))
}

#[derive(Deserialize)]
struct CommitForm {
    csrf: String,
    expect_version: i64,
}

#[derive(Template)]
#[template(path = "committed.html")]
struct CommittedPage {
    who: Option<Who>,
    draft: String,
    changes: usize,
    promotions: Vec<uuid::Uuid>,
    moved: Vec<(String, String, u64)>,
}

/// Commits the draft at the version the page showed (editor): `drafts::commit`, as `draft
/// commit --expect-version`; the page names each workload's new version.
async fn commit_draft(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(form): Form<CommitForm>,
) -> Result<Response, Failure> {
    let session = writer(&state, &headers, Role::Editor, &form.csrf).await?;
    let done = drafts::commit(
        &state.pool,
        &session.operator.actor(),
        &name,
        form.expect_version,
        &state.limits.counts,
    )
    .await?;
    let ids: Vec<uuid::Uuid> = done.changed.iter().map(|c| c.workload.uuid()).collect();
    let hosts = store::hostnames(&mut *state.pool.acquire().await.map_err(Error::from)?, &ids).await?;
    let moved = done
        .changed
        .iter()
        .map(|c| {
            let id = c.workload.uuid();
            (id.to_string(), hosts.get(&id).cloned().unwrap_or_else(|| id.to_string()), c.version)
        })
        .collect();
    let page = CommittedPage {
        who: Some(Who::from(&session)),
        draft: done.value.draft,
        changes: done.value.changes,
        promotions: done.value.promotions,
        moved,
    };
    Ok(html(&page))
}

// ---- suggestions -------------------------------------------------------------------------

/// One suggestion as its table shows it.
struct SuggestionLine {
    id: String,
    acceptable: bool,
    state: String,
    to: String,
    port: String,
    from: String,
    service: String,
    volume: String,
    sources: usize,
    days: String,
    coverage: String,
    rule_coverage: String,
    note: String,
}

#[derive(Template)]
#[template(path = "suggestions.html")]
struct SuggestionsPage {
    who: Option<Who>,
    scope: String,
    since: String,
    error: Option<String>,
    found: Option<Vec<SuggestionLine>>,
    may_accept: bool,
    csrf: String,
}

#[derive(Deserialize)]
struct SuggestionsQuery {
    #[serde(default)]
    scope: String,
    #[serde(default)]
    since: String,
}

fn suggestion_line(s: &suggest::Suggestion) -> SuggestionLine {
    let e = &s.evidence;
    let (state, mut note) = match &s.state {
        suggest::State::Learning { reason } => ("learning".to_owned(), reason.clone()),
        suggest::State::Stable => ("stable".to_owned(), String::new()),
        suggest::State::Accepted { draft } => (format!("accepted ({draft})"), String::new()),
    };
    if !s.new_since_ignored.is_empty() {
        note = format!("was ignored; new since: {}", s.new_since_ignored.join(", "));
    }
    SuggestionLine {
        id: s.id.clone(),
        acceptable: s.is_rule() && !matches!(s.state, suggest::State::Accepted { .. }),
        state,
        to: suggest::group_text(&s.group),
        port: format!("{}/{}", s.protocol, s.port),
        from: match &s.peer {
            suggest::SuggestedPeer::Workloads(labels) => suggest::group_text(labels),
            suggest::SuggestedPeer::AddressGroup(g) => format!("group {g}"),
            suggest::SuggestedPeer::Cidrs(c) => c.join(" "),
            suggest::SuggestedPeer::NeedsAddressGroup { addresses } => {
                format!("needs an address group ({addresses} addresses)")
            }
        },
        service: format!("{}{}", s.service.name, if s.service.exists { "" } else { " (new)" }),
        volume: format!("{}/{}", e.connections, e.flows),
        sources: e.sources.len(),
        days: format!("{} of {}", e.days_seen, e.days_in_range),
        coverage: format!("{:.0}%", e.coverage * 100.0),
        rule_coverage: format!(
            "{:.0}% → {:.0}%",
            e.rule_coverage_before * 100.0,
            e.rule_coverage_after * 100.0
        ),
        note,
    }
}

/// Suggested rules for a scope (`suggest::run`, as `innerwall suggest` and `GET
/// /api/v1/suggestions`, charged as one expensive operation), with the form that accepts the
/// checked ones into a draft for editors.
async fn suggestions_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<SuggestionsQuery>,
) -> Result<Response, Failure> {
    let session = signed(&state, &headers).await?;
    let mut page = SuggestionsPage {
        who: Some(Who::from(&session)),
        since: if q.since.trim().is_empty() { "14d".into() } else { q.since.clone() },
        scope: q.scope,
        error: None,
        found: None,
        may_accept: session.operator.role.allows(Role::Editor),
        csrf: session.csrf.clone(),
    };
    if page.scope.trim().is_empty() {
        return Ok(html(&page));
    }
    let run = async {
        let since = duration("since", &page.since).map_err(Error::Invalid)?;
        let request = suggest::Request {
            scope: page.scope.clone(),
            range: suggest::range_since(chrono::Utc::now(), since)?,
            excluded_keys: Default::default(),
            max_breadth: suggest::DEFAULT_MAX_BREADTH,
        };
        request.check()?;
        authoring::charge_expensive(
            &state.pool,
            Expensive::Render,
            &session.operator.actor(),
            &state.limits.expensive,
        )
        .await?;
        suggest::run(&state.pool, &request).await
    };
    match run.await {
        Ok(found) => page.found = Some(found.suggestions.iter().map(suggestion_line).collect()),
        Err(e) if matches!(e.kind(), crate::error::Kind::Invalid | crate::error::Kind::RateLimited) => {
            page.error = Some(e.to_string());
            return Ok((StatusCode::BAD_REQUEST, html(&page)).into_response());
        }
        Err(e) => return Err(e.into()),
    }
    Ok(html(&page))
}

/// The checked suggestions into a draft (editor): `suggest::accept`, as `innerwall suggest
/// accept … --into-draft`; then the draft's page, which shows their impact.
async fn accept_suggestions(
    State(state): State<ApiState>,
    headers: HeaderMap,
    // Repeated `ids` fields: the form as its pairs.
    Form(pairs): Form<Vec<(String, String)>>,
) -> Result<Response, Failure> {
    let field =
        |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap_or_default();
    let session = writer(&state, &headers, Role::Editor, &field("csrf")).await?;
    let ids: Vec<String> = pairs.iter().filter(|(k, _)| k == "ids").map(|(_, v)| v.clone()).collect();
    if ids.is_empty() {
        return Err(Failure::Invalid("check at least one suggestion to accept".into()));
    }
    let draft = field("draft");
    suggest::accept(&state.pool, &session.operator.actor(), &ids, &draft, &state.limits.counts).await?;
    Ok(Redirect::to(&format!("/drafts/{}", encode(&draft))).into_response())
}
