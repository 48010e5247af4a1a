//! A private Postgres server for the benchmarks whose figure depends on durability (flow ingest,
//! heartbeat writes): initialized and started as `innerwall`'s embedded cluster is, not as the
//! test harness's (which turns `fsync`, `synchronous_commit` and `full_page_writes` off).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use innerwall_control_plane::postgres::{self, Cluster, SUPERUSER};
use sqlx::{Connection, PgConnection};

/// A private server initialized and started the way `innerwall`'s embedded cluster is (durable
/// initdb, no settings overridden), as a child that dies with this process.
pub struct ProductionServer {
    cluster: Cluster,
    server: postgres::ChildServer,
    pub url: String,
}

impl ProductionServer {
    pub async fn start() -> anyhow::Result<Self> {
        // Named like the harness's clusters, so a run that dies midway is cleaned up by the next.
        let short = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let root = std::env::temp_dir().join(format!("innerwall-pgtest-{}-{short}", std::process::id()));
        let cluster = Cluster::new(&root)?;
        cluster.init(true)?;
        let port = postgres::pick_free_port()?;
        let server = cluster.spawn_child(port, &[])?;
        // Over TCP with the password, as the control plane reaches the embedded cluster.
        let url = postgres::database_url(SUPERUSER, &cluster.password()?, port, "postgres");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(conn) = PgConnection::connect(&url).await {
                let _ = conn.close().await;
                break;
            }
            if let Some(status) = server.exit_status() {
                bail!("the bench server exited ({status}); see {}", cluster.log_file().display());
            }
            if Instant::now() > deadline {
                server.kill();
                bail!(
                    "the bench server did not accept connections in 60 s; see {}",
                    cluster.log_file().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(ProductionServer { cluster, server, url })
    }

    pub fn stop(self) -> anyhow::Result<()> {
        self.server.kill();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.server.exit_status().is_none() {
            if Instant::now() > deadline {
                bail!("the bench server (pid {}) did not exit", self.server.pid());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_dir_all(self.cluster.root())
            .with_context(|| format!("removing {}", self.cluster.root().display()))
    }
}
