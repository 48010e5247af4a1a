//! What every command handler gets: the database, the output format, who is acting, and where
//! the CA lives — built once from the global flags, so handlers never see the parsed command
//! line.

use std::path::{Path, PathBuf};

use anyhow::Context;
use innerwall_control_plane::postgres::{self, Pools, PoolsConfig, Supervisor};
use sqlx::PgPool;

/// Where the database is: `--database-url`, or the embedded cluster under `--state-dir`.
#[derive(Debug)]
pub struct Database {
    pub url: Option<String>,
    pub state_dir: PathBuf,
}

impl Database {
    /// Connects and applies migrations, starting the embedded cluster first when no URL is given.
    pub async fn connect(&self) -> anyhow::Result<PgPool> {
        Ok(postgres::connect(&self.url().await?).await?)
    }

    /// A replica's pools (one per job, sized by `config`); on the embedded cluster also its
    /// [`Supervisor`], for the caller to run beside the service.
    pub async fn connect_pools(&self, config: &PoolsConfig) -> anyhow::Result<(Pools, Option<Supervisor>)> {
        let url = self.url().await?;
        let pools = Pools::connect(&url, config).await?;
        let supervisor = match &self.url {
            Some(_) => None,
            None => Some(
                Supervisor::new(&self.state_dir, url)
                    .await
                    .context("while starting to supervise the embedded database")?,
            ),
        };
        Ok((pools, supervisor))
    }

    async fn url(&self) -> anyhow::Result<String> {
        match &self.url {
            Some(url) => Ok(url.clone()),
            None => postgres::embedded(&self.state_dir).await.with_context(|| {
                format!("while starting the embedded database in {}", self.state_dir.display())
            }),
        }
    }
}

/// The context of a command that works on the database.
#[derive(Debug)]
pub struct Ctx {
    pub pool: PgPool,
    /// `--json`: print JSON instead of tables.
    pub json: bool,
    /// `--page-size`: rows per page a list command reads.
    pub page_size: u32,
    /// Who the audit log names for changes made here (`cli:<user>`).
    pub actor: String,
    pub ca_dir: PathBuf,
}

impl Ctx {
    pub async fn connect(
        database: &Database,
        json: bool,
        page_size: u32,
        ca_dir: &Path,
    ) -> anyhow::Result<Ctx> {
        Ok(Ctx {
            pool: database.connect().await?,
            json,
            page_size,
            actor: actor(),
            ca_dir: ca_dir.to_owned(),
        })
    }
}

/// The operator behind this command: under sudo the invoking user, not root.
fn actor() -> String {
    let user =
        std::env::var("SUDO_USER").or_else(|_| std::env::var("USER")).unwrap_or_else(|_| "unknown".into());
    format!("cli:{user}")
}
