//! Suggestions over the operator API (issue 28): viewers ask, editors accept and ignore; the
//! remote CLI prints what the local one prints. Flows through the real ingest path.

use chrono::{SecondsFormat, Utc};
use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::Range;
use innerwall_control_plane::identity::operators::Role;
use innerwall_control_plane::suggest;
use innerwall_control_plane::testing::fresh_database;
use serde_json::{Value, json};

use crate::cli::foresight_cli;
use crate::foresight_api::{Serve, estate, mint};
use crate::recorded::{HOUR, applied_in_simulation, flow_to, ingest};

fn cli(args: &[String]) -> Vec<u8> {
    let (code, out, err) = foresight_cli(args, &[]);
    assert_eq!(code, Some(0), "{args:?}: {err}");
    out.into_bytes()
}

#[tokio::test]
async fn suggestion_routes_over_http() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    // db-1 (`app=db`) applied its latest version in simulation; web-1 reached it on postgres,
    // which only api and 10.9.0.0/16 may.
    let start = Utc::now().timestamp_millis() - 2 * HOUR;
    let (db1, policy) = applied_in_simulation(pool, "db-1", start - HOUR).await;
    let version = policy.version();
    ingest(pool, db1, version, start, vec![flow_to("10.0.0.1", "10.0.0.4", 5432, None, 3, start)], vec![])
        .await;

    let viewer = mint(pool, "vera", Role::Viewer).await;
    let editor = mint(pool, "ed", Role::Editor).await;
    let serve = Serve::start(&db.url);
    let until = Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true);
    let path = format!("/api/v1/suggestions?scope=app%3Ddb&until={until}");
    let reply = serve.get(&path, &viewer).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let body: Value = reply.json();
    let suggestions = body["suggestions"].as_array().unwrap();
    assert_eq!(suggestions.len(), 1, "{body}");
    let s = &suggestions[0];
    assert_eq!(s["peer"], json!({"workloads": {"app": "web", "tier": "front"}}), "{s}");
    assert_eq!(
        (s["service"]["name"].as_str(), s["service"]["exists"].as_bool()),
        (Some("postgres"), Some(true))
    );
    assert_eq!(s["evidence"]["connections"], 3);
    let id = s["id"].as_str().unwrap().to_owned();

    // A bad query is 400 before anything is read.
    assert_eq!(serve.get("/api/v1/suggestions", &viewer).await.status, 400);
    assert_eq!(serve.get("/api/v1/suggestions?scope=app%3Ddb&max_breadth=0.5", &viewer).await.status, 400);

    // Viewers may not accept or ignore; editors may. Nothing is written by the refusals.
    let audits = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log WHERE action LIKE 'suggestion.%'")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let accept = json!({"ids": [id], "draft": "suggested"});
    assert_eq!(serve.write("POST", "/api/v1/suggestions/accept", &viewer, None, &accept).await.status, 403);
    let bad = json!({"ids": ["not-an-id"]});
    assert_eq!(serve.write("POST", "/api/v1/suggestions/ignore", &editor, None, &bad).await.status, 400);
    assert_eq!(audits().await, 0);
    let reply = serve.write("POST", "/api/v1/suggestions/accept", &editor, None, &accept).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["objects"], json!(["ruleset/suggested-db-back"]));
    let draft = serve.get("/api/v1/drafts/suggested", &viewer).await;
    assert_eq!(draft.json()["changes"][0]["object"], "ruleset/suggested-db-back", "{draft:?}");
    assert_eq!(audits().await, 1);

    // The remote CLI prints what the local one prints, byte for byte.
    let args = |extra: &[String]| -> Vec<String> {
        let mut all = extra.to_vec();
        all.extend(["--json", "suggest", "--scope", "app=db", "--until", &until].map(str::to_owned));
        all
    };
    let local = cli(&args(&["--database-url".to_owned(), db.url.clone()]));
    let remote = cli(&args(&serve.remote(&viewer)));
    assert_eq!(String::from_utf8_lossy(&local), String::from_utf8_lossy(&remote));
    let shown: Value = serde_json::from_slice(&local).unwrap();
    assert_eq!(shown["suggestions"][0]["state"], "accepted", "{shown}");
}

/// A run past [`suggest::MAX_SUGGESTIONS`] is refused with the bound named, and stores nothing:
/// the suggestions the run at the bound stored stay as they were.
#[tokio::test]
async fn a_run_past_its_suggestion_bound_is_refused() {
    let db = fresh_database().await.unwrap();
    let pool = &db.pool;
    estate(pool).await;
    let start = Utc::now().timestamp_millis() - 3 * HOUR;
    let (db1, policy) = applied_in_simulation(pool, "db-1", start - HOUR).await;
    let version = policy.version();
    // web-1 reached db-1 on as many ports as one run shows, none of them admitted: one
    // suggestion per port.
    let bound = suggest::MAX_SUGGESTIONS as u32;
    let flows = |ports: std::ops::Range<u32>| {
        ports.map(|p| flow_to("10.0.0.1", "10.0.0.4", 20_000 + p, None, 1, start)).collect()
    };
    ingest(pool, db1, version, start, flows(0..bound), vec![]).await;
    let request = suggest::Request {
        scope: "app=db".into(),
        range: Range::ending_at(Utc::now(), std::time::Duration::from_secs(86_400)).unwrap(),
        excluded_keys: Default::default(),
        max_breadth: 2.0,
    };
    let shown = suggest::run(pool, &request).await.unwrap();
    assert_eq!(shown.suggestions.len(), suggest::MAX_SUGGESTIONS);
    let stored = || async {
        sqlx::query_as::<_, (i64, Option<chrono::DateTime<Utc>>)>(
            "SELECT count(*), max(shown_at) FROM suggestions",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let before = stored().await;
    assert_eq!(before.0, suggest::MAX_SUGGESTIONS as i64);

    // One port more, in the next window: the run is refused and writes nothing.
    ingest(pool, db1, version, start + HOUR, flows(bound..bound + 1), vec![]).await;
    let request = suggest::Request {
        range: Range::ending_at(Utc::now(), std::time::Duration::from_secs(86_400)).unwrap(),
        ..request
    };
    match suggest::run(pool, &request).await {
        Err(Error::Invalid(message)) => assert!(
            message.contains(&format!("{} suggestions are more than the {bound}", bound + 1)),
            "{message}"
        ),
        other => panic!("expected a refusal, got {:?}", other.map(|s| s.suggestions.len())),
    }
    assert_eq!(stored().await, before);
}
