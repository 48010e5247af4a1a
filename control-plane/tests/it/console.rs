//! The web console in a real browser (issue 29): sign-in, roles, CSRF, the security headers.

use innerwall_control_plane::identity::operators::{self, Role, TokenRef};
use innerwall_control_plane::policy::store;
use innerwall_control_plane::testing::fresh_database;
use serde_json::json;

use crate::foresight_api::{Serve, estate, mint};
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
    let writes = |b: &Browser| b.all("form[method=post]:not([action='/sign-out'])").len();
    assert_eq!(writes(&browser), 0, "the fleet page offers a viewer a write");
    browser.goto(&format!("{base}/workloads/{web}"));
    assert!(browser.text().contains("app") && browser.text().contains("web"), "{}", browser.text());
    assert_eq!(writes(&browser), 0, "the workload page offers a viewer a write");
    browser.goto(&format!("{base}/audit"));
    assert!(browser.text().contains("console.sign-in"), "{}", browser.text());

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
