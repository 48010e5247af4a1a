//! The OpenAPI 3.1 document, generated from the code: each handler's `#[utoipa::path]` (path,
//! method, parameters, bodies, its particular answers), then completed from the router's mount
//! table — every operation's security (the operator token with the role the route is mounted
//! with; none for the document itself) and the problem answers every operation can give (401
//! and 403 behind a role, 404 with a path parameter, 413 and 415 with a body, 400, 500, 503).
//! Served at [`PATH`] and checked in as `control-plane/openapi.json`; a test (in `router`) fails
//! when the two differ (regenerate with `INNERWALL_BLESS=1 cargo test -p innerwall-control-plane
//! --lib openapi_document_is_checked_in`), and another holds the document to the mounted routes.

use utoipa::OpenApi as _;
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::path::{HttpMethod, Operation, OperationBuilder};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, OpenApi, Ref, RefOr};

use super::Route;
use super::problem::{PROBLEM_JSON, Problem, ProblemType};
use super::{
    audit, catalog, drafts, estate, flows, gate, impact, management, operators, policy_tests, render, staged,
    suggestions, tokens, workloads,
};
use crate::identity::operators::Role;

/// Where the document is served.
pub const PATH: &str = "/api/v1/openapi.json";
/// The security scheme's name in the document.
pub const SECURITY_SCHEME: &str = "operator_token";
/// Where the document is checked in, relative to the crate.
pub const CHECKED_IN: &str = "openapi.json";

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "Innerwall operator API",
        version = "1",
        description = "Operate an Innerwall estate over HTTPS: workloads, the authored policy model, \
            estate ranges, provisioning tokens, flow evidence, verdicts and promotions, the audit log. \
            Lists answer a page (`rows`, `truncated`, `next_cursor`): pass `next_cursor` back as `cursor` for the next. Authenticate with \
            `Authorization: Bearer iwo_…` (mint a token on a control-plane host with `innerwall operator \
            token mint --name NAME --role viewer|editor|promoter|admin`); each operation names the role it \
            needs as the scope of its security requirement. Conditional writes need `If-Match` with the \
            `ETag` read (428 without, 412 with `current_version` when stale). Every error is an RFC 9457 \
            problem document (`application/problem+json`) whose `type` is one of `ProblemType`."
    ),
    paths(
        workloads::list, workloads::show, workloads::labels, workloads::put_labels, workloads::policy,
        workloads::history, workloads::history_version, workloads::resend_snapshot, workloads::retire, workloads::deny,
        workloads::release_address, workloads::sync_statuses, workloads::sync_status, impact::replay,
        catalog::list_services, catalog::create_service, catalog::show_service, catalog::update_service,
        catalog::delete_service, catalog::list_groups, catalog::create_group, catalog::show_group,
        catalog::update_group, catalog::delete_group, catalog::list_rulesets, catalog::create_ruleset,
        catalog::show_ruleset, catalog::update_ruleset, catalog::delete_ruleset,
        staged::list, staged::show, staged::stage, staged::unstage, staged::promote,
        policy_tests::list, policy_tests::create, policy_tests::show, policy_tests::update,
        policy_tests::delete, policy_tests::run,
        drafts::list, drafts::create, drafts::show, drafts::discard, drafts::add, drafts::render,
        drafts::impact, drafts::tests, drafts::commit,
        suggestions::list, suggestions::accept, suggestions::ignore,
        estate::list, estate::add, estate::remove, management::show, management::narrow,
        management::narrow_workload, render::render,
        tokens::list, tokens::mint, tokens::revoke,
        flows::list_records, flows::gaps, flows::rollup,
        gate::verdict, gate::list, gate::show, gate::promote, gate::confirm, gate::rollback, gate::unpin,
        operators::list, operators::mint, operators::revoke, audit::list,
    ),
    components(schemas(Problem, ProblemType, Role)),
    tags(
        (name = "workloads", description = "Enrolled hosts: labels, convergence, rendered policy, lifecycle"),
        (name = "catalog", description = "The authored model: services, address groups, rulesets"),
        (name = "policy-tests", description = "Policy tests: named assertions every operator commit must pass"),
        (name = "drafts", description = "Drafts: stored sets of changes, rendered, replayed and tested before one checked commit"),
        (name = "suggestions", description = "Suggested rules from recorded flows, with their evidence, accepted into a draft or ignored"),
        (name = "estate-ranges", description = "The address ranges whose reported workload addresses may become peers"),
        (name = "management", description = "Management access every workload keeps whatever its policy says (the failsafe rule)"),
        (name = "render", description = "Render every workload on request"),
        (name = "provisioning-tokens", description = "Tokens hosts enroll with"),
        (name = "flows", description = "Flow evidence: records, gaps, rollups"),
        (name = "gate", description = "Verdicts and promotions: the evidence gate"),
        (name = "operator-tokens", description = "The tokens of this API (admins only)"),
        (name = "audit", description = "The audit log: who changed what, and when"),
        (name = "meta", description = "This document"),
    )
)]
struct Handlers;

fn operation_mut<'a>(doc: &'a mut OpenApi, path: &str, method: &str) -> Option<&'a mut Operation> {
    let item = doc.paths.paths.get_mut(path)?;
    match method {
        "GET" => item.get.as_mut(),
        "POST" => item.post.as_mut(),
        "PUT" => item.put.as_mut(),
        "DELETE" => item.delete.as_mut(),
        _ => None,
    }
}

/// Every (path, method) the document lists.
pub fn operations(doc: &OpenApi) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for (path, item) in &doc.paths.paths {
        for (method, op) in [
            ("GET", &item.get),
            ("POST", &item.post),
            ("PUT", &item.put),
            ("DELETE", &item.delete),
            ("PATCH", &item.patch),
            ("HEAD", &item.head),
            ("OPTIONS", &item.options),
            ("TRACE", &item.trace),
        ] {
            if op.is_some() {
                out.push((path.clone(), method));
            }
        }
    }
    out.sort();
    out
}

/// The document for the mounted `routes`.
pub fn document(routes: &[Route]) -> OpenApi {
    let mut doc = Handlers::openapi();
    let own = OperationBuilder::new()
        .tag("meta")
        .summary(Some("This document"))
        .operation_id(Some("openapi"))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The OpenAPI 3.1 document of this API")
                .content("application/json", ContentBuilder::new().build())
                .build(),
        )
        .build();
    doc.paths.add_path_operation(PATH, vec![HttpMethod::Get], own);

    let components = doc.components.get_or_insert_with(Components::new);
    let mut bearer = Http::new(HttpAuthScheme::Bearer);
    bearer.bearer_format = Some("iwo_ operator token".into());
    bearer.description = Some(
        "An operator token, minted with `innerwall operator token mint`. Its role must be the scope \
         an operation names or a later one: viewer < editor < promoter < admin."
            .into(),
    );
    components.security_schemes.insert(SECURITY_SCHEME.into(), SecurityScheme::Http(bearer));
    let problem = ResponseBuilder::new()
        .description("A problem document; `type` says which (see ProblemType)")
        .content(PROBLEM_JSON, ContentBuilder::new().schema(Some(Ref::from_schema_name("Problem"))).build())
        .build();
    components.responses.insert("Problem".into(), RefOr::T(problem));

    for route in routes {
        let Some(op) = operation_mut(&mut doc, route.path, route.method) else {
            // Undocumented: `openapi_covers_mounted_routes` names it.
            continue;
        };
        let mut statuses = vec!["400", "500", "503"];
        match route.role {
            Some(role) => {
                op.security = Some(vec![SecurityRequirement::new(SECURITY_SCHEME, [role.name()])]);
                statuses.extend(["401", "403"]);
                let needs = format!("Needs the `{role}` role.");
                op.description = Some(match op.description.take() {
                    Some(text) if !text.is_empty() => format!("{text}\n\n{needs}"),
                    _ => needs,
                });
            }
            None => op.security = Some(vec![SecurityRequirement::default()]),
        }
        if route.path.contains('{') {
            statuses.push("404");
        }
        if op.request_body.is_some() {
            statuses.extend(["413", "415"]);
        }
        for status in statuses {
            op.responses
                .responses
                .entry(status.into())
                .or_insert_with(|| RefOr::Ref(Ref::from_response_name("Problem")));
        }
    }
    doc
}

/// The document as served and checked in: pretty JSON with sorted keys, one trailing newline.
pub fn json(routes: &[Route]) -> String {
    let value = serde_json::to_value(document(routes)).expect("the document serializes");
    let mut text = serde_json::to_string_pretty(&value).expect("a value serializes");
    text.push('\n');
    text
}
