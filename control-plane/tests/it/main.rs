//! The control plane's integration tests: one binary, one module per area.

mod addresses;
mod answers;
mod api;
mod backup;
mod bounds;
mod cli;
mod config;
mod console;
mod drafts;
mod drafts_edge;
mod enrollment;
mod files;
mod flows;
mod foresight_api;
mod identity;
mod impact;
mod installs;
mod lists;
mod operations;
mod operators;
mod policy_tests;
mod postgres;
mod publish;
mod recorded;
mod retention;
mod schema;
mod states;
mod suggest_api;
mod sync;

/// Polls `done` every 50 ms for up to 15 s; panics naming `what` if it never holds.
pub async fn eventually(what: &str, done: impl AsyncFn() -> bool) {
    for _ in 0..300 {
        if done().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("never happened: {what}");
}
