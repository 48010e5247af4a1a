//! `innerwall backup create|verify|restore` (issue 32): the library's `backup` calls, with
//! progress on a terminal and a summary at the end.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use innerwall_control_plane::backup::{self, Manifest, Sources};

use crate::ctx::Database;

#[derive(Debug, Subcommand)]
pub enum BackupCmd {
    /// Write a backup (the database, the CA directory and the configuration file) to FILE, a
    /// new file with mode 0600; encrypted with a passphrase when --passphrase-file is given.
    Create {
        file: PathBuf,
        #[command(flatten)]
        passphrase: Passphrase,
    },
    /// Check a backup: every member against its manifest's SHA-256, the dump readable.
    Verify {
        file: PathBuf,
        #[command(flatten)]
        passphrase: Passphrase,
    },
    /// Restore a backup into this host's database (which must hold no control plane yet) and
    /// CA directory (which must be empty or the same CA).
    Restore {
        file: PathBuf,
        /// Write the backup's configuration file here (not written without it).
        #[arg(long, value_name = "PATH")]
        config_out: Option<PathBuf>,
        /// Replace a database that holds a control plane, a different CA and an existing
        /// configuration file.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        passphrase: Passphrase,
    },
}

#[derive(Debug, clap::Args)]
pub struct Passphrase {
    /// The backup's passphrase (at least 12 bytes), read from FILE, or standard input with `-`;
    /// never a flag's value. An encrypted backup needs it to be verified or restored.
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
}

impl Passphrase {
    fn read(&self) -> anyhow::Result<Option<String>> {
        self.passphrase_file
            .as_deref()
            .map(|path| crate::read_secret(path, "--passphrase-file", "the backup's passphrase"))
            .transpose()
    }
}

fn summary(verb: &str, file: &Path, manifest: &Manifest, json: bool) {
    if json {
        println!("{}", serde_json::json!({ "file": file, "manifest": manifest }));
        return;
    }
    let bytes: u64 = manifest.members.iter().map(|m| m.bytes).sum();
    println!(
        "{verb} {}: {} members, {bytes} bytes; schema version {}, {} workload(s); written {} by innerwall {}",
        file.display(),
        manifest.members.len(),
        manifest.schema_version,
        manifest.workloads,
        manifest.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
        manifest.version
    );
}

pub async fn run(
    cmd: &BackupCmd,
    database: &Database,
    ca_dir: &Path,
    config: Option<&Path>,
    actor: &str,
    json: bool,
) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Create { file, passphrase } => {
            let passphrase = passphrase.read()?;
            let pool = database.connect().await?;
            let url = database.url().await?;
            let sources = Sources { database_url: &url, ca_dir, config };
            let manifest = backup::create(
                &pool,
                actor,
                &sources,
                file,
                passphrase.as_deref().map(str::as_bytes),
                &crate::output::progress,
            )
            .await?;
            summary("backup", file, &manifest, json);
        }
        BackupCmd::Verify { file, passphrase } => {
            let manifest = backup::verify(
                file,
                passphrase.read()?.as_deref().map(str::as_bytes),
                &crate::output::progress,
            )?;
            summary("verified", file, &manifest, json);
        }
        BackupCmd::Restore { file, config_out, force, passphrase } => {
            let passphrase = passphrase.read()?;
            let url = database.url().await?;
            let target = Sources { database_url: &url, ca_dir, config: config_out.as_deref() };
            let manifest = backup::restore(
                file,
                &target,
                actor,
                *force,
                passphrase.as_deref().map(str::as_bytes),
                &crate::output::progress,
            )
            .await?;
            summary("restored", file, &manifest, json);
        }
    }
    Ok(())
}
