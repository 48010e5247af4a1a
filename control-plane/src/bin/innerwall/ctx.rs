//! What every command handler gets: the database, the output format, who is acting, and where
//! the CA lives — built once from the global flags, so handlers never see the parsed command
//! line.

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::Context;
use innerwall_control_plane::postgres::{self, Create, Pools, PoolsConfig, Session, Supervisor};
use sqlx::PgPool;

/// Where the database is: `--database-url`, or the embedded cluster under `--state-dir`.
#[derive(Debug)]
pub struct Database {
    pub url: Option<String>,
    pub state_dir: PathBuf,
    /// Whether a missing embedded cluster is created (`--init`, `migrate`); otherwise a state
    /// directory without one is refused, naming it.
    pub create: Create,
    /// This command's use of the embedded cluster, once opened: a server it started is stopped
    /// when the command ends ([`Database::end`], or the drop on any other way out).
    session: Mutex<Option<Session>>,
}

impl Database {
    pub fn new(url: Option<String>, state_dir: PathBuf, create: Create) -> Database {
        Database { url, state_dir, create, session: Mutex::new(None) }
    }

    /// Ends this command's use of the embedded cluster: stops the server if this command started
    /// it and no other command or `serve` uses it now.
    pub fn end(&self) -> anyhow::Result<()> {
        let session = self.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(session) = session {
            session.end().context("while stopping the embedded database this command started")?;
        }
        Ok(())
    }

    /// Connects and applies migrations, starting the embedded cluster first when no URL is given.
    pub async fn connect(&self) -> anyhow::Result<PgPool> {
        let url = self.url().await?;
        self.dump_before_migrating(&url).await?;
        Ok(postgres::connect(&url).await?)
    }

    /// [`Database::connect`] that says what it migrated (`innerwall migrate`).
    pub async fn migrate(&self) -> anyhow::Result<(PgPool, postgres::Migrated)> {
        let url = self.url().await?;
        self.dump_before_migrating(&url).await?;
        let pool = postgres::pool_options()
            .connect(&url)
            .await
            .map_err(|source| postgres::Error::Connect { url: postgres::redact_url(&url), source })?;
        let migrated = postgres::migrate(&pool, &url, &crate::output::progress).await?;
        Ok((pool, migrated))
    }

    /// A dump under `<state-dir>/backups` before migrations this build brings are applied.
    async fn dump_before_migrating(&self, url: &str) -> anyhow::Result<()> {
        let dir = self.state_dir.join("backups");
        let dumped = innerwall_control_plane::backup::before_migrating(url, &dir)
            .await
            .context("while dumping the database before migrating it (nothing was migrated)")?;
        if let Some(path) = dumped {
            tracing::info!(
                target: crate::logs::NOTICE,
                "innerwall: new migrations to apply; the database was dumped to {} first",
                path.display()
            );
        }
        Ok(())
    }

    /// A replica's pools (one per job, sized by `config`); on the embedded cluster also its
    /// [`Supervisor`], for the caller to run beside the service.
    /// The embedded cluster is created if missing and keeps running after `serve`.
    pub async fn connect_pools(&self, config: &PoolsConfig) -> anyhow::Result<(Pools, Option<Supervisor>)> {
        let url = match &self.url {
            Some(url) => url.clone(),
            None => postgres::embedded(&self.state_dir).await.with_context(|| {
                format!("while starting the embedded database in {}", self.state_dir.display())
            })?,
        };
        self.dump_before_migrating(&url).await?;
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

    /// The database's URL, starting the embedded cluster (for this command) when no URL is given.
    pub async fn url(&self) -> anyhow::Result<String> {
        if let Some(url) = &self.url {
            return Ok(url.clone());
        }
        if let Some(session) = &*self.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Ok(session.url().to_owned());
        }
        let session = Session::open(&self.state_dir, self.create).await.map_err(|e| match e {
            postgres::Error::NoCluster { .. } => anyhow::Error::new(e),
            e => anyhow::Error::new(e)
                .context(format!("while starting the embedded database in {}", self.state_dir.display())),
        })?;
        let url = session.url().to_owned();
        *self.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(session);
        Ok(url)
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
}

impl Ctx {
    pub async fn connect(database: &Database, json: bool, page_size: u32) -> anyhow::Result<Ctx> {
        Ok(Ctx { pool: database.connect().await?, json, page_size, actor: actor() })
    }
}

/// The operator behind this command, as the audit log names it: `cli:<user>`, the user name of
/// the process's real uid (`uid:<n>` when it has no passwd entry). Never `$USER` or
/// `$SUDO_USER`, which whoever runs the command sets at will; under sudo that is `cli:root`.
pub fn actor() -> String {
    let uid = nix::unistd::getuid();
    let user = match nix::unistd::User::from_uid(uid) {
        Ok(Some(user)) => user.name,
        Ok(None) | Err(_) => format!("uid:{uid}"),
    };
    format!("cli:{user}")
}
