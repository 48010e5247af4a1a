//! The console's review page end to end (issue 29): agents running the real sync loop deliver
//! evidence through the real ingest; a promoter reads the verdict in headless Chromium, accepts
//! the suggested rule for the blocked peer into a draft and commits it from the page, sees the
//! verdict go from UNSAFE to SAFE on the evidence that follows, and promotes from the page with
//! the count it showed; a workload joining the scope between viewing and clicking refuses the
//! promotion (match-count-mismatch on the page) and changes nothing.

use std::time::Duration;

use chrono::SecondsFormat;
use innerwall_control_plane::api::{ApiConfig, ApiTls, server};
use innerwall_control_plane::identity::operators::{self, Expiry, Role};
use innerwall_control_plane::testing::browser::Browser;
use innerwall_wire::convert::WireEnum;
use innerwall_wire::policy::Mode;

use crate::gate::{BATCH, SECOND, WEB, synced, unsafe_db};
use crate::plane::Plane;

fn screenshots() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console")
}

fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).unwrap().to_rfc3339_opts(SecondsFormat::Millis, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_promotion_pins_the_count() {
    let plane = Plane::start().await;
    let (a, b, _, base) = unsafe_db(&plane).await;
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: ApiTls::FromCa { names: vec!["localhost".into()], lifetime: Duration::from_secs(3600) },
        limits: Default::default(),
    };
    let api = server::start(plane.pool().clone(), plane.signer.clone(), config).await.unwrap();
    let url = format!("https://localhost:{}", api.local_addr.port());
    let token = operators::mint_audited(plane.pool(), "cli:test", "pat", Role::Promoter, Expiry::Never)
        .await
        .unwrap()
        .token;
    let modes = || async {
        let rows: Vec<(uuid::Uuid, i16)> = sqlx::query_as("SELECT id, mode FROM workloads ORDER BY id")
            .fetch_all(plane.pool())
            .await
            .unwrap();
        let promotions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM promotions").fetch_one(plane.pool()).await.unwrap();
        (rows, promotions)
    };

    let browser = Browser::start();
    browser.goto(&format!("{url}/sign-in"));
    browser.type_into(&browser.one("#token"), &token);
    browser.click(&browser.one("form.sign-in button"));
    browser.wait_for("/fleet");
    let review = |span: &str, until: i64| {
        format!(
            "{url}/review?scope=app%3Ddb&since={span}&min={span}&until={}",
            time(until).replace(':', "%3A")
        )
    };
    let outcome =
        |b: &Browser| b.script("return document.getElementById('outcome').innerText;", serde_json::json!([]));

    // Ten seconds of evidence: web is allowed, batch would be blocked.
    browser.goto(&review("10s", base + 10 * SECOND));
    browser.wait_for("Verdict");
    assert_eq!(outcome(&browser), "UNSAFE", "{}", browser.text());
    assert!(browser.text().contains(BATCH), "the reasons name the blocked peer:\n{}", browser.text());
    browser.screenshot(&screenshots().join("review-unsafe.png"));

    // The fix, from the evidence: the suggested rule for batch, accepted into a draft from the
    // page, the draft's impact read, and committed; then evidence under it: SAFE.
    browser.click(&browser.one("a[href^='/suggestions']"));
    browser.wait_for("Suggested rules");
    browser.goto(&format!("{url}/suggestions?scope=app%3Ddb&since=2d"));
    browser.wait_for("Accept the checked ones");
    let rows = browser.script(
        "return [...document.querySelectorAll('table.suggestions tbody tr')].filter(r => r.cells.length > 2).map(r => [r.cells[1].innerText, r.cells[5].innerText]);",
        serde_json::json!([]),
    );
    let batch = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r[1] == "app=batch,team=data")
        .unwrap_or_else(|| panic!("no suggestion for batch: {rows}"));
    let id = batch[0].as_str().unwrap();
    browser.click(&browser.one(&format!("input[name=ids][value='{id}']")));
    let draft = browser.one("#draft");
    browser.clear(&draft);
    browser.type_into(&draft, "batch-to-db");
    browser.click(&browser.one("form.accept button"));
    browser.wait_for("What a commit now would do");
    assert!(browser.text().contains("A commit now would pass"), "{}", browser.text());
    browser.screenshot(&screenshots().join("suggested-draft.png"));
    browser.click(&browser.one("form.promote button"));
    browser.wait_for("Versions moved");
    synced(&plane, &[&a, &b]).await;
    for host in [&a, &b] {
        host.deliver(base + 10 * SECOND, base + 15 * SECOND, &[WEB, BATCH], &[]).await;
    }
    browser.goto(&review("15s", base + 15 * SECOND));
    browser.wait_for("Verdict");
    assert_eq!(outcome(&browser), "SAFE", "{}", browser.text());
    assert!(browser.text().contains("Change 2 workload(s)"), "{}", browser.text());
    browser.screenshot(&screenshots().join("review-safe.png"));

    // A third workload joins the scope between viewing and clicking: refused, nothing changes.
    let before = modes().await;
    let third = plane.register("db-3", &["app=cache"], "10.9.0.10").await;
    plane.relabel(third, 1, "app=db").await;
    let with_third = modes().await;
    browser.type_into(&browser.one("#reason"), "the evidence is clean");
    browser.click(&browser.one("form.promote button"));
    browser.wait_for("match-count-mismatch");
    assert!(browser.text().contains("3 workload(s) matched, you expected 2"), "{}", browser.text());
    assert_eq!(modes().await, with_third, "a refused promotion changed a mode or left a record");
    assert_eq!(with_third.1, before.1);

    // It leaves the scope again; the page's promotion now flips exactly the two it showed.
    plane.relabel(third, 2, "app=cache").await;
    browser.goto(&review("15s", base + 15 * SECOND));
    browser.wait_for("Verdict");
    browser.type_into(&browser.one("#reason"), "the evidence is clean");
    browser.click(&browser.one("form.promote button"));
    browser.wait_for("Promotion record");
    assert_eq!(
        browser.script("return document.getElementById('to-mode').innerText;", serde_json::json!([])),
        "enforcement"
    );
    let (rows, promotions) = modes().await;
    let enforcing: std::collections::BTreeSet<uuid::Uuid> =
        rows.iter().filter(|(_, mode)| *mode == Mode::Enforcement.code()).map(|(id, _)| *id).collect();
    assert_eq!(enforcing, [a.id.uuid(), b.id.uuid()].into());
    assert_eq!(promotions, before.1 + 1);
    let actor: String = sqlx::query_scalar("SELECT actor FROM promotions ORDER BY at DESC LIMIT 1")
        .fetch_one(plane.pool())
        .await
        .unwrap();
    assert!(actor.starts_with("operator:pat/"), "{actor}");
    browser.screenshot(&screenshots().join("promotion.png"));
    api.stop(Duration::from_secs(1)).await;
}
