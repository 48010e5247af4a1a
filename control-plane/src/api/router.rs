//! Every route of the API, mounted in one table ([`build`]) with the role it needs. The table is
//! what the router serves and what the OpenAPI document's security is made from, and a test
//! holds the document to it: a route cannot be mounted without a role decision, nor documented
//! without being mounted. Around all routes: the body limit and the request timeout; unknown
//! paths and methods are problem documents (405 with `Allow`).

use axum::Router;
use axum::extract::{Request, State};
use axum::handler::Handler;
use axum::http::{HeaderValue, Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodFilter;

use super::extract::BodyLimit;
use super::problem::ApiError;
use super::{
    ApiLimits, ApiState, Route, audit, auth, catalog, console, drafts, estate, flows, gate, impact,
    management, openapi, operators, policy_tests, render, staged, suggestions, tokens, workloads,
};
use crate::identity::operators::Role;

/// The router being built and the record of what it mounted.
struct Table {
    router: Router<ApiState>,
    routes: Vec<Route>,
    state: ApiState,
}

impl Table {
    /// Mounts `handler` for `method` on `path`, behind [`auth::authorize`] for `role`.
    fn mount<H, T>(mut self, method: &'static str, path: &'static str, role: Option<Role>, handler: H) -> Self
    where
        H: Handler<T, ApiState>,
        T: 'static,
    {
        let filter = match method {
            "GET" => MethodFilter::GET,
            "POST" => MethodFilter::POST,
            "PUT" => MethodFilter::PUT,
            "DELETE" => MethodFilter::DELETE,
            other => panic!("the API mounts no {other} routes"),
        };
        let mut endpoint = axum::routing::on(filter, handler);
        endpoint = match role {
            Some(role) => endpoint
                .route_layer(middleware::from_fn_with_state((self.state.clone(), role), auth::authorize)),
            None => endpoint
                .route_layer(middleware::from_fn_with_state(self.state.clone(), auth::unauthenticated)),
        };
        self.router = self.router.route(path, endpoint);
        self.routes.push(Route { path, method, role });
        self
    }
}

/// The API's router and the routes it mounted.
pub fn build(state: ApiState) -> (Router, Vec<Route>) {
    use Role::{Admin, Editor, Promoter, Viewer};
    let table = Table { router: Router::new(), routes: Vec::new(), state: state.clone() }
        .mount("GET", "/api/v1/workloads", Some(Viewer), workloads::list)
        .mount("GET", "/api/v1/workloads/{id}", Some(Viewer), workloads::show)
        .mount("GET", "/api/v1/workloads/{id}/labels", Some(Viewer), workloads::labels)
        .mount("PUT", "/api/v1/workloads/{id}/labels", Some(Editor), workloads::put_labels)
        .mount("GET", "/api/v1/workloads/{id}/policy", Some(Viewer), workloads::policy)
        .mount("GET", "/api/v1/workloads/{id}/policy/history", Some(Viewer), workloads::history)
        .mount(
            "GET",
            "/api/v1/workloads/{id}/policy/history/{version}",
            Some(Viewer),
            workloads::history_version,
        )
        .mount("GET", "/api/v1/workloads/{id}/replay", Some(Viewer), impact::replay)
        .mount("POST", "/api/v1/workloads/{id}/resend-snapshot", Some(Editor), workloads::resend_snapshot)
        .mount("POST", "/api/v1/workloads/{id}/retire", Some(Admin), workloads::retire)
        .mount("POST", "/api/v1/workloads/{id}/deny", Some(Admin), workloads::deny)
        .mount("POST", "/api/v1/workloads/{id}/unpin", Some(Promoter), gate::unpin)
        .mount("POST", "/api/v1/rollbacks", Some(Promoter), gate::rollback)
        .mount("POST", "/api/v1/workloads/{id}/release-address", Some(Editor), workloads::release_address)
        .mount("GET", "/api/v1/sync-status", Some(Viewer), workloads::sync_statuses)
        .mount("GET", "/api/v1/sync-status/{id}", Some(Viewer), workloads::sync_status)
        .mount("GET", "/api/v1/services", Some(Viewer), catalog::list_services)
        .mount("POST", "/api/v1/services", Some(Editor), catalog::create_service)
        .mount("GET", "/api/v1/services/{name}", Some(Viewer), catalog::show_service)
        .mount("PUT", "/api/v1/services/{name}", Some(Editor), catalog::update_service)
        .mount("DELETE", "/api/v1/services/{name}", Some(Editor), catalog::delete_service)
        .mount("GET", "/api/v1/address-groups", Some(Viewer), catalog::list_groups)
        .mount("POST", "/api/v1/address-groups", Some(Editor), catalog::create_group)
        .mount("GET", "/api/v1/address-groups/{name}", Some(Viewer), catalog::show_group)
        .mount("PUT", "/api/v1/address-groups/{name}", Some(Editor), catalog::update_group)
        .mount("DELETE", "/api/v1/address-groups/{name}", Some(Editor), catalog::delete_group)
        .mount("GET", "/api/v1/rulesets", Some(Viewer), catalog::list_rulesets)
        .mount("POST", "/api/v1/rulesets", Some(Editor), catalog::create_ruleset)
        .mount("GET", "/api/v1/rulesets/{name}", Some(Viewer), catalog::show_ruleset)
        .mount("PUT", "/api/v1/rulesets/{name}", Some(Editor), catalog::update_ruleset)
        .mount("DELETE", "/api/v1/rulesets/{name}", Some(Editor), catalog::delete_ruleset)
        .mount("GET", "/api/v1/staged-rulesets", Some(Viewer), staged::list)
        .mount("POST", "/api/v1/staged-rulesets", Some(Editor), staged::stage)
        .mount("GET", "/api/v1/staged-rulesets/{name}", Some(Viewer), staged::show)
        .mount("DELETE", "/api/v1/staged-rulesets/{name}", Some(Editor), staged::unstage)
        .mount("POST", "/api/v1/staged-rulesets/{name}/promote", Some(Promoter), staged::promote)
        .mount("GET", "/api/v1/policy-test-sets", Some(Viewer), policy_tests::list)
        .mount("POST", "/api/v1/policy-test-sets", Some(Editor), policy_tests::create)
        .mount("GET", "/api/v1/policy-test-sets/{name}", Some(Viewer), policy_tests::show)
        .mount("PUT", "/api/v1/policy-test-sets/{name}", Some(Editor), policy_tests::update)
        .mount("DELETE", "/api/v1/policy-test-sets/{name}", Some(Editor), policy_tests::delete)
        .mount("POST", "/api/v1/policy-tests/run", Some(Viewer), policy_tests::run)
        // Render, impact and tests write nothing but render the whole estate: viewers may ask,
        // within the expensive-operation bounds.
        .mount("GET", "/api/v1/drafts", Some(Viewer), drafts::list)
        .mount("POST", "/api/v1/drafts", Some(Editor), drafts::create)
        .mount("GET", "/api/v1/drafts/{name}", Some(Viewer), drafts::show)
        .mount("DELETE", "/api/v1/drafts/{name}", Some(Editor), drafts::discard)
        .mount("POST", "/api/v1/drafts/{name}/changes", Some(Editor), drafts::add)
        .mount("GET", "/api/v1/drafts/{name}/render", Some(Viewer), drafts::render)
        .mount("POST", "/api/v1/drafts/{name}/impact", Some(Viewer), drafts::impact)
        .mount("POST", "/api/v1/drafts/{name}/tests", Some(Viewer), drafts::tests)
        .mount("POST", "/api/v1/drafts/{name}/commit", Some(Editor), drafts::commit)
        .mount("GET", "/api/v1/suggestions", Some(Viewer), suggestions::list)
        .mount("POST", "/api/v1/suggestions/accept", Some(Editor), suggestions::accept)
        .mount("POST", "/api/v1/suggestions/ignore", Some(Editor), suggestions::ignore)
        // Estate ranges decide which reported addresses enter other hosts' allow sets: a trust
        // decision like retire and deny, so changing them is for admins.
        .mount("GET", "/api/v1/estate-ranges", Some(Viewer), estate::list)
        .mount("POST", "/api/v1/estate-ranges", Some(Admin), estate::add)
        .mount("DELETE", "/api/v1/estate-ranges/{address}/{prefix}", Some(Admin), estate::remove)
        .mount("GET", "/api/v1/management", Some(Viewer), management::show)
        .mount("PUT", "/api/v1/management", Some(Admin), management::narrow)
        .mount("PUT", "/api/v1/workloads/{id}/management", Some(Admin), management::narrow_workload)
        // A render changes no authored object; it is what every editor's change does anyway.
        .mount("POST", "/api/v1/render", Some(Editor), render::render)
        .mount("GET", "/api/v1/provisioning-tokens", Some(Viewer), tokens::list)
        .mount("POST", "/api/v1/provisioning-tokens", Some(Editor), tokens::mint)
        .mount("DELETE", "/api/v1/provisioning-tokens/{id}", Some(Editor), tokens::revoke)
        .mount("GET", "/api/v1/flows", Some(Viewer), flows::list_records)
        .mount("GET", "/api/v1/flows/gaps", Some(Viewer), flows::gaps)
        .mount("GET", "/api/v1/flows/rollup", Some(Viewer), flows::rollup)
        .mount("GET", "/api/v1/verdict", Some(Viewer), gate::verdict)
        .mount("GET", "/api/v1/promotions", Some(Viewer), gate::list)
        .mount("POST", "/api/v1/promotions", Some(Promoter), gate::promote)
        .mount("GET", "/api/v1/promotions/{id}", Some(Viewer), gate::show)
        .mount("POST", "/api/v1/promotions/{id}/confirm", Some(Promoter), gate::confirm)
        .mount("GET", "/api/v1/operator-tokens", Some(Admin), operators::list)
        .mount("POST", "/api/v1/operator-tokens", Some(Admin), operators::mint)
        .mount("DELETE", "/api/v1/operator-tokens/{id}", Some(Admin), operators::revoke)
        .mount("GET", "/api/v1/audit", Some(Viewer), audit::list);
    // The document is made from the table, itself included, and served as made at start.
    let mut routes = table.routes.clone();
    routes.push(Route { path: openapi::PATH, method: "GET", role: None });
    let document = openapi::json(&routes);
    let table = table.mount("GET", openapi::PATH, None, move || async move {
        ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], document).into_response()
    });
    // The console's pages (issue 29) beside the API's routes, with the same edge bounds.
    let router = table
        .router
        .merge(console::router(state.clone()))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.limits, bounded))
        .with_state(state);
    (router, table.routes)
}

/// Around every request: a body within the listener's limit read before anything answers, the
/// body limit for the extractors, the request timeout, and `Cache-Control: no-store` (answers name tokens and
/// evidence; nothing should keep them).
async fn bounded(State(limits): State<ApiLimits>, mut request: Request, next: Next) -> Response {
    request.extensions_mut().insert(BodyLimit(limits.max_body));
    let work = async {
        // A body that declares its length within the listener's limit is read first; a larger
        // or chunked one is left to the route, which may take more (a draft's change file).
        let declared =
            request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_none_or(|n| n == 0 || n > limits.max_body as u64) {
            return next.run(request).await;
        }
        match super::extract::read_body(request, limits.max_body).await {
            Ok((parts, body)) => next.run(Request::from_parts(parts, body.into())).await,
            Err(refused) => refused.into_response(),
        }
    };
    let mut response = match tokio::time::timeout(limits.request_timeout, work).await {
        Ok(response) => response,
        Err(_) => ApiError::Timeout(limits.request_timeout).into_response(),
    };
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::NoRoute(uri.path().chars().take(256).collect())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed { method: method.to_string(), path: uri.path().chars().take(256).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openapi::{CHECKED_IN, json};

    /// The checked-in document is the generated one. `INNERWALL_BLESS=1` rewrites it.
    #[tokio::test]
    async fn openapi_document_is_checked_in() {
        let pool =
            sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://unused@localhost/unused").unwrap();
        let (_, routes) = build(ApiState::new(pool, ApiLimits::default()));
        let generated = json(&routes);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(CHECKED_IN);
        if std::env::var_os("INNERWALL_BLESS").is_some() {
            std::fs::write(&path, &generated).unwrap();
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "{} is not the document the code generates; regenerate it with\n  \
             INNERWALL_BLESS=1 cargo test -p innerwall-control-plane --lib openapi_document_is_checked_in\n\
             and review the diff",
            path.display()
        );
    }
}
