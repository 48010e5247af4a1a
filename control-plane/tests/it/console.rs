//! The web console in a real browser (issue 29): sign-in, roles, CSRF, the security headers;
//! the map and the flows behind its edges.

use chrono::Utc;
use innerwall_control_plane::identity::operators::{self, Role, TokenRef};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::fresh_database;
use innerwall_wire::identity::WorkloadId;
use serde_json::json;

use crate::cli::foresight_cli;
use crate::foresight_api::{Serve, estate, mint};
use crate::recorded::{HOUR, applied_in_simulation, flow_to, ingest, rule_for};
use innerwall_control_plane::testing::browser::Browser;

/// Where the tests leave their screenshots.
fn screenshots() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console")
}

/// Signs `browser` in with `token` from the sign-in page.
fn sign_in(browser: &Browser, base: &str, token: &str) {
    browser.goto(&format!("{base}/sign-in"));
    let field = browser.one("#token");
    browser.clear(&field);
    browser.type_into(&field, token);
    browser.click(&browser.one("form.sign-in button"));
}

/// A form POST from the page (same origin, with the session's cookie), answering its status.
const POST: &str = "const [path, body] = arguments;
    return fetch(path, {method: 'POST', headers: {'Content-Type': 'application/x-www-form-urlencoded'},
                        body: new URLSearchParams(body)}).then(r => r.status);";

#[tokio::test]
async fn console_signin_and_roles() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    let web = estate(pool).await;
    let labels = || async {
        let view = store::workload_view(&mut pool.acquire().await.unwrap(), web).await.unwrap();
        (serde_json::to_value(view.labels).unwrap(), view.label_version)
    };
    let viewer = mint(pool, "vera", Role::Viewer).await;
    let editor = mint(pool, "ed", Role::Editor).await;
    let serve = Serve::start(&db.url);
    let base = format!("https://localhost:{}", serve.addr.port());

    // The headers every console page carries, signed in or not.
    let page = serve.call("GET", "/sign-in", "", &[], None).await;
    assert_eq!(page.status, 200);
    let csp = page.headers.get("content-security-policy").expect("a CSP header").to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"), "{csp}");
    assert_eq!(page.headers.get("x-frame-options").unwrap(), "DENY");
    assert_eq!(page.headers.get("x-content-type-options").unwrap(), "nosniff");

    let browser = Browser::start();
    // Not signed in: every page leads to the sign-in page.
    browser.goto(&format!("{base}/fleet"));
    browser.wait_for("/sign-in");

    // A bad token signs no one in, and says why.
    sign_in(&browser, &base, "iwo_not-a-token");
    browser.wait_for("operator token is malformed");
    assert!(browser.url().ends_with("/sign-in"), "{}", browser.url());

    // A viewer signs in and sees the fleet, and is offered no write.
    sign_in(&browser, &base, &viewer);
    browser.wait_for("/fleet");
    let text = browser.text();
    for host in ["web-1", "api-1", "payments-1", "db-1"] {
        assert!(text.contains(host), "the fleet page names {host}:\n{text}");
    }
    assert!(text.contains("vera · viewer"), "{text}");
    browser.screenshot(&screenshots().join("fleet-viewer.png"));
    // The table follows the fleet while the page is open: a label change made elsewhere shows
    // without a reload.
    browser.script("window.stayed = true;", json!([]));
    let api: uuid::Uuid = sqlx::query_scalar("SELECT id FROM workloads WHERE hostname = 'api-1'")
        .fetch_one(pool)
        .await
        .unwrap();
    let api = WorkloadId::from_uuid(api).unwrap();
    innerwall_control_plane::operations::change_labels(
        pool,
        "cli:test",
        api,
        1,
        &["env=staging".parse().unwrap()],
        &[],
    )
    .await
    .unwrap();
    browser.wait_for("env=staging");
    assert_eq!(
        browser.script("return window.stayed === true;", json!([])),
        json!(true),
        "the page was reloaded"
    );
    let writes = |b: &Browser| b.all("form[method=post]:not([action='/sign-out'])").len();
    assert_eq!(writes(&browser), 0, "the fleet page offers a viewer a write");
    browser.goto(&format!("{base}/workloads/{web}"));
    assert!(browser.text().contains("app") && browser.text().contains("web"), "{}", browser.text());
    assert_eq!(writes(&browser), 0, "the workload page offers a viewer a write");
    browser.goto(&format!("{base}/audit"));
    assert!(browser.text().contains("console.sign-in"), "{}", browser.text());
    browser.goto(&format!("{base}/audit?action=console.sign-in&since=1h"));
    let actions = browser.script(
        "return [...document.querySelectorAll('table.audit tbody tr')].map(r => r.cells[2].innerText);",
        json!([]),
    );
    assert_eq!(actions, json!(["console.sign-in"]), "the filter keeps the one sign-in");

    // Nothing the pages loaded came from another origin.
    let loaded =
        browser.script("return performance.getEntriesByType('resource').map(e => e.name);", json!([]));
    let loaded: Vec<&str> = loaded.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(!loaded.is_empty(), "the style sheet is a resource");
    assert!(loaded.iter().all(|url| url.starts_with(&base)), "{loaded:?}");

    // Writes the server refuses, changing nothing: without the CSRF token, with a wrong one,
    // and with the viewer's own (the role).
    let before = labels().await;
    let path = format!("/workloads/{web}/labels");
    let body = |csrf: &str| json!({"csrf": csrf, "expect_label_version": before.1.to_string(), "labels": "app=evil"});
    let csrf = browser.attribute(&browser.one("form.who input[name=csrf]"), "value").unwrap();
    let no_csrf = json!({"expect_label_version": before.1.to_string(), "labels": "app=evil"});
    for (what, form, refused) in [
        ("no CSRF token", no_csrf, 422),
        ("a wrong CSRF token", body("x".repeat(43).as_str()), 403),
        ("a viewer's session", body(&csrf), 403),
    ] {
        let status = browser.script(POST, json!([path, form]));
        assert_eq!(status, json!(refused), "a write with {what}");
    }
    assert_eq!(labels().await, before, "a refused write changed the labels");

    // An editor is offered the label form, and it works.
    let editing = Browser::start();
    sign_in(&editing, &base, &editor);
    editing.wait_for("/fleet");
    editing.goto(&format!("{base}/workloads/{web}"));
    let form = editing.one("form.labels-edit textarea");
    editing.clear(&form);
    editing.type_into(&form, "app=web\ntier=front\nenv=prod");
    editing.click(&editing.one("form.labels-edit button"));
    editing.wait_for("env");
    let after = labels().await;
    assert_eq!(after.0, json!({"app": "web", "tier": "front", "env": "prod"}));
    assert_eq!(after.1, before.1 + 1);
    let audited: String = sqlx::query_scalar(
        "SELECT actor FROM audit_log WHERE action = 'workload.label' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(audited.starts_with("operator:ed/"), "{audited}");
    editing.screenshot(&screenshots().join("workload-editor.png"));

    // Forms over their bound are refused before they are read, changing nothing: 16 KiB for
    // every form, a change file's size (form-encoded) for a new draft.
    let csrf = editing.attribute(&editing.one("form.who input[name=csrf]"), "value").unwrap();
    let padded = format!("app=web\ntier={}", "x".repeat(17 * 1024));
    let huge = json!({"csrf": csrf, "expect_label_version": after.1.to_string(), "labels": padded});
    assert_eq!(editing.script(POST, json!([path, huge])), json!(413), "a 17 KiB label form");
    assert_eq!(labels().await, after, "the refused form changed the labels");
    let draft = |changes: String| json!({"csrf": csrf, "name": "big", "note": "", "changes": changes});
    let status = editing.script(POST, json!(["/drafts", draft(format!("# {}", "x".repeat(20 * 1024)))]));
    assert_ne!(status, json!(413), "a change file of 20 KiB is within the drafts' bound");
    let over = 3 * innerwall_control_plane::foresight::drafts::MAX_CHANGE_FILE as usize + 8192;
    let status = editing.script(POST, json!(["/drafts", draft("x".repeat(over))]));
    assert_eq!(status, json!(413), "a form larger than any change file");
    let drafts: i64 = sqlx::query_scalar("SELECT count(*) FROM drafts").fetch_one(pool).await.unwrap();
    assert_eq!(drafts, 0, "no refused form made a draft");

    // Revoking the viewer's token ends its session and its sign-ins.
    operators::revoke_audited(pool, "cli:test", &TokenRef::Name("vera".into()), None).await.unwrap();
    browser.goto(&format!("{base}/fleet"));
    browser.wait_for("/sign-in");
    sign_in(&browser, &base, &viewer);
    browser.wait_for("was revoked");

    // A form sent from another site is refused before anything runs.
    let forged = serve
        .call(
            "POST",
            "/sign-out",
            "",
            &[("origin", "https://evil.example")],
            Some(("application/x-www-form-urlencoded", b"csrf=x".to_vec())),
        )
        .await;
    assert_eq!(forged.status, 403);
}

/// Flows through the real ingest towards db-1 (`app=db`): api-1 allowed by its rule, web-1
/// would-block. The map draws both edges with their decisions and counts; each opens its
/// flows, which name the rule (or none) and the version.
#[tokio::test]
async fn console_flow_map_shows_decisions() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    let start = Utc::now().timestamp_millis() - 2 * HOUR;
    let (db1, policy) = applied_in_simulation(pool, "db-1", start - HOUR).await;
    let version = policy.version();
    let rule = rule_for(&policy, 5432);
    let flows = vec![
        flow_to("10.0.0.2", "10.0.0.4", 5432, Some(&rule), 3, start),
        flow_to("10.0.0.1", "10.0.0.4", 5432, None, 2, start),
    ];
    ingest(pool, db1, version, start, flows, vec![]).await;
    let viewer = mint(pool, "vera", Role::Viewer).await;
    let serve = Serve::start(&db.url);
    let base = format!("https://localhost:{}", serve.addr.port());

    let browser = Browser::start();
    sign_in(&browser, &base, &viewer);
    browser.wait_for("/fleet");
    browser.goto(&format!("{base}/map?key=app&since=24h"));
    browser.wait_for("Edges");
    let rows = browser.script(
        "return [...document.querySelectorAll('table.edges tbody tr')].map(r => [...r.cells].slice(0, 5).map(c => c.innerText));",
        json!([]),
    );
    assert_eq!(
        rows,
        json!([["app=api", "app=db", "allowed", "3", "1"], ["app=web", "app=db", "would-block", "2", "1"]]),
        "{}",
        browser.text()
    );
    let strokes = browser.script(
        "return [...document.querySelectorAll('svg.map path')].map(p => p.getAttribute('stroke')).sort();",
        json!([]),
    );
    assert_eq!(strokes, json!(["#1a7f37", "#b42318"]), "one green and one red edge");
    browser.screenshot(&screenshots().join("map.png"));

    // The would-block edge opens its flows: no rule decided them, under the applied version.
    browser.click(&browser.one("svg.map a.edge:has(path[stroke='#b42318'])"));
    browser.wait_for("10.0.0.1");
    assert!(browser.url().contains("/flows?by=src-dst"), "{}", browser.url());
    let text = browser.text();
    assert!(text.contains("would-block") && text.contains(&format!("v{version}")), "{text}");
    assert!(!text.contains("10.0.0.2"), "the allowed flows are not this edge's: {text}");
    // The allowed one names its rule.
    browser.goto(&format!("{base}/map?key=app&since=24h"));
    browser.wait_for("Edges");
    browser.click(&browser.one("svg.map a.edge:has(path[stroke='#1a7f37'])"));
    browser.wait_for("10.0.0.2");
    browser.goto(&format!("{base}/flows?by=rule-peer&decision=allowed&since=24h"));
    browser.wait_for(&rule);
    browser.screenshot(&screenshots().join("flows.png"));

    // The destination's page: its rules by name, what each version changed, its verdict and
    // the flows of the day with their decisions and version.
    browser.goto(&format!("{base}/workloads/{db1}"));
    browser.wait_for("Rendered rules");
    let names = browser.script(
        "return [...document.querySelectorAll('table.rules tbody tr')].map(r => [r.cells[0].innerText, r.cells[1].innerText]);",
        json!([]),
    );
    assert!(
        names.as_array().unwrap().iter().any(|r| r[1] == json!(rule) && r[0].as_str().unwrap().contains('/')),
        "{names}"
    );
    let versions =
        browser.script("return document.querySelectorAll('table.versions tbody tr').length;", json!([]));
    assert_eq!(versions, json!(version), "one row per version");
    let text = browser.text();
    assert!(text.contains("Verdict over the last 24 h") && text.contains(&format!("v{version}")), "{text}");
    let decisions = browser.script(
        "return [...document.querySelectorAll('table.flows tbody tr')].map(r => r.cells[8].innerText).sort();",
        json!([]),
    );
    assert_eq!(decisions, json!(["allowed", "would-block"]), "{text}");
    browser.screenshot(&screenshots().join("workload.png"));

    // The export is the same query, as CSV and JSON; it needs a session too.
    let fetch = "return fetch(arguments[0]).then(r => r.text());";
    let csv = browser.script(fetch, json!(["/flows/export.csv?by=rule-peer&since=24h"]));
    let csv = csv.as_str().unwrap();
    assert!(csv.starts_with("Rule,Peer,connections,"), "{csv}");
    assert!(csv.contains(&rule) && csv.contains("would-block") && csv.lines().count() == 3, "{csv}");
    let exported =
        browser.script(fetch, json!(["/flows/export.json?by=rule-peer&since=24h&decision=would-block"]));
    let exported: serde_json::Value = serde_json::from_str(exported.as_str().unwrap()).unwrap();
    assert_eq!(
        (exported["rows"].as_array().unwrap().len(), &exported["truncated"]),
        (1, &json!(false)),
        "{exported}"
    );
    let anonymous = serve.call("GET", "/flows/export.csv?by=rule-peer&since=24h", "", &[], None).await;
    assert_eq!(anonymous.status, 303, "an export needs a session");

    // A range that ends before the flows holds none of them; one around them holds both.
    let at = |ms: i64| {
        let t = chrono::DateTime::from_timestamp_millis(ms).unwrap().to_rfc3339();
        t.replace('+', "%2B")
    };
    let rows = |until: String| {
        let path = format!("/flows/export.csv?by=rule-peer&since=1h&until={until}");
        browser.script(fetch, json!([path])).as_str().unwrap().lines().count()
    };
    assert_eq!(rows(at(start - 60_000)), 1, "only the header before the flows");
    assert_eq!(rows(at(start + 30 * 60_000)), 3, "both flows within the hour before");
    let status = "return fetch(arguments[0]).then(r => r.status);";
    assert_eq!(browser.script(status, json!(["/flows?until=yesterday"])), json!(400), "a bad end is refused");
}

/// A draft made on the policy page shows its impact on recorded flows and the policy tests'
/// results; committing it from the page moves exactly the versions the CLI then shows.
#[tokio::test]
async fn console_draft_impact() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    let spec = innerwall_control_plane::foresight::policy_tests::parse_test_set_file(
        "tests",
        crate::foresight_api::TESTS,
    )
    .unwrap();
    innerwall_control_plane::foresight::create_test_set(pool, "cli:test", &spec).await.unwrap();
    // api-1 reached db-1 on tcp/6432, which no rule admits yet.
    let start = Utc::now().timestamp_millis() - 2 * HOUR;
    let (db1, policy) = applied_in_simulation(pool, "db-1", start - HOUR).await;
    let version = policy.version();
    ingest(pool, db1, version, start, vec![flow_to("10.0.0.2", "10.0.0.4", 6432, None, 4, start)], vec![])
        .await;
    let editor = mint(pool, "ed", Role::Editor).await;
    let serve = Serve::start(&db.url);
    let base = format!("https://localhost:{}", serve.addr.port());

    let browser = Browser::start();
    sign_in(&browser, &base, &editor);
    browser.wait_for("/fleet");
    browser.goto(&format!("{base}/policy"));
    browser.wait_for("New draft");
    browser.type_into(&browser.one("#name"), "pgbouncer");
    browser.type_into(&browser.one("#note"), "postgres through pgbouncer too");
    browser.type_into(
        &browser.one("#changes"),
        "changes:\n  - service:\n      name: postgres\n      members: [tcp:5432, tcp:6432]\n",
    );
    browser.click(&browser.one("form.draft-new button"));
    browser.wait_for("What a commit now would do");
    assert!(browser.url().ends_with("/drafts/pgbouncer"), "{}", browser.url());
    let text = browser.text();
    assert!(text.contains("A commit now would pass"), "{text}");
    let change = browser.script("return document.querySelector('pre.change').innerText;", json!([]));
    assert!(change.as_str().unwrap().contains("tcp:6432"), "the draft shows what it writes: {change}");
    let row = browser.script(
        "return [...document.querySelectorAll('table.impact tbody tr')].map(r => [...r.cells].map(c => c.innerText));",
        json!([]),
    );
    let rows = row.as_array().unwrap();
    let db_row = rows.iter().find(|r| r[0] == "db-1").unwrap_or_else(|| panic!("no db-1 row: {row}"));
    assert_eq!(
        (&db_row[1], &db_row[3], &db_row[4]),
        (&json!(format!("v{version} → v{}", version + 1)), &json!("0"), &json!("1")),
        "{row}"
    );
    let results = browser.script(
        "return [...document.querySelectorAll('table.tests tbody tr')].map(r => r.cells[3].innerText);",
        json!([]),
    );
    assert_eq!(results, json!(["pass", "pass", "pass"]), "{}", browser.text());
    browser.screenshot(&screenshots().join("draft.png"));

    // Commit from the page: it names the versions it moved, and they are what the CLI shows.
    browser.click(&browser.one("form.promote button"));
    browser.wait_for("Versions moved");
    let moved = browser.script(
        "return [...document.querySelectorAll('table.moved tbody tr')].map(r => [r.cells[0].querySelector('a').getAttribute('href').split('/').pop(), r.cells[1].innerText]);",
        json!([]),
    );
    let moved = moved.as_array().unwrap();
    assert!(!moved.is_empty(), "the commit moved no version");
    let (code, out, err) =
        foresight_cli(&["--database-url".to_owned(), db.url.clone()], &["--json", "workload", "list"]);
    assert_eq!(code, Some(0), "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    for m in moved {
        let w = listed.as_array().unwrap().iter().find(|w| w["id"] == m[0]).unwrap();
        assert_eq!(json!(format!("v{}", w["latest_version"])), m[1], "{w}");
    }
    assert!(
        moved.iter().any(|m| m[0] == json!(db1.to_string()) && m[1] == json!(format!("v{}", version + 1)))
    );
    browser.goto(&format!("{base}/drafts/pgbouncer"));
    browser.wait_for("committed");
    assert!(browser.all("form.promote").is_empty(), "a committed draft offers no commit");
}
