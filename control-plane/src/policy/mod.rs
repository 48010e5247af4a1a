//! Policy: the authored model and every mutation of it, the pure renderer, and the publish
//! transaction that versions and announces what changed (POL-1..POL-8).

pub mod addresses;
pub mod authoring;
pub mod file;
pub mod inputs;
pub mod lifecycle;
pub mod model;
pub mod narrow;
pub mod publish;
pub mod render;
pub mod source;
pub mod spec;
pub mod staged;
pub mod store;

/// Runs CPU-bound `work` on a blocking thread, so the caller's Postgres statements proceed
/// meanwhile (a render's work is CPU; its reads and writes wait on Postgres); a panic in it is
/// the caller's.
pub(crate) fn off_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> impl Future<Output = T> {
    let handle = tokio::task::spawn_blocking(work);
    async move { handle.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) }
}
