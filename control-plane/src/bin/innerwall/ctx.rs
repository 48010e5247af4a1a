//! What every command handler gets: the database, the output format, who is acting, and where
//! the CA lives — built once from the global flags, so handlers never see the parsed command
//! line.

use std::path::{Path, PathBuf};

use anyhow::Context;
use innerwall_control_plane::postgres;
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
        let url = match &self.url {
            Some(url) => url.clone(),
            None => postgres::embedded(&self.state_dir).await.with_context(|| {
                format!("while starting the embedded database in {}", self.state_dir.display())
            })?,
        };
        Ok(postgres::connect(&url).await?)
    }
}

/// The context of a command that works on the database.
#[derive(Debug)]
pub struct Ctx {
    pub pool: PgPool,
    /// `--json`: print JSON instead of tables.
    pub json: bool,
    /// Who the audit log names for changes made here (`cli:<user>`).
    pub actor: String,
    pub ca_dir: PathBuf,
}

impl Ctx {
    pub async fn connect(database: &Database, json: bool, ca_dir: &Path) -> anyhow::Result<Ctx> {
        Ok(Ctx { pool: database.connect().await?, json, actor: actor(), ca_dir: ca_dir.to_owned() })
    }
}

/// The operator behind this command: under sudo the invoking user, not root.
fn actor() -> String {
    let user =
        std::env::var("SUDO_USER").or_else(|_| std::env::var("USER")).unwrap_or_else(|_| "unknown".into());
    format!("cli:{user}")
}
