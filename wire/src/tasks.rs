//! Long-lived tasks under one shutdown token, on both sides: the agent's daemon (drift check,
//! renewal, metrics, flow upload) and a control-plane replica (bridge, upkeep, liveness sweep,
//! certificate renewal, metrics). Cancelling the token ends each at its next await; nothing is
//! aborted mid-write, and [`Tasks::stop`] waits for every one, a bounded wait each.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Tasks spawned under one token.
#[derive(Debug, Default)]
pub struct Tasks {
    token: CancellationToken,
    running: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
}

/// How long [`Tasks::stop`] waits for each task once the token is cancelled.
pub const STOP_WAIT: Duration = Duration::from_secs(5);

impl Tasks {
    /// The token every task runs under (for work that ends itself on it, like a server's
    /// graceful shutdown).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Runs `task` until it ends or the token is cancelled.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let token = self.token.clone();
        let handle = tokio::spawn(async move { token.run_until_cancelled_owned(task).await.unwrap_or(()) });
        self.running.push((name, handle));
    }

    /// Cancels the token and waits for every task; returns the names of those that failed or
    /// did not stop in time (each logged).
    pub async fn stop(self) -> Vec<&'static str> {
        self.token.cancel();
        let mut trouble = Vec::new();
        for (name, task) in self.running {
            match tokio::time::timeout(STOP_WAIT, task).await {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => tracing::warn!("task {name} failed: {e}"),
                Err(_) => tracing::warn!("task {name} did not stop within {STOP_WAIT:?}"),
            }
            trouble.push(name);
        }
        trouble
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task ends at the token, one that would never end too, and `stop` waits for each.
    #[tokio::test]
    async fn one_token_stops_every_task() {
        let mut tasks = Tasks::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<&'static str>(4);
        let (started, mut running) = tokio::sync::mpsc::channel::<()>(4);
        for name in ["forever", "also forever"] {
            let (tx, started) = (tx.clone(), started.clone());
            tasks.spawn(name, async move {
                let _guard = Dropped(tx, name);
                started.send(()).await.expect("the test listens");
                std::future::pending::<()>().await;
            });
        }
        drop(tx);
        for _ in 0..2 {
            running.recv().await.expect("each task started");
        }
        assert!(tasks.stop().await.is_empty(), "every task stopped in time");
        let mut dropped = Vec::new();
        while let Some(name) = rx.recv().await {
            dropped.push(name);
        }
        dropped.sort_unstable();
        assert_eq!(dropped, ["also forever", "forever"], "each task's state was dropped");
    }

    /// Says its name when dropped (the task it lives in ended).
    struct Dropped(tokio::sync::mpsc::Sender<&'static str>, &'static str);

    impl Drop for Dropped {
        fn drop(&mut self) {
            let _ = self.0.try_send(self.1);
        }
    }
}
