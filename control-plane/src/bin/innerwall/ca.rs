//! `innerwall ca`: creating the certificate authority's files.

use std::path::Path;

use anyhow::Context;
use clap::Subcommand;
use innerwall_control_plane::identity::ca::{self, FileCa};

#[derive(Debug, Subcommand)]
pub enum CaCmd {
    /// Create the root key (0600) and a 10-year self-signed certificate in --ca-dir.
    Init,
}

pub fn run(cmd: &CaCmd, dir: &Path) -> anyhow::Result<()> {
    match cmd {
        CaCmd::Init => {
            std::fs::create_dir_all(dir).with_context(|| format!("while creating {}", dir.display()))?;
            FileCa::init(dir)?;
            println!(
                "created {} (mode 0600) and {}",
                dir.join(ca::CA_KEY_FILE).display(),
                dir.join(ca::CA_CERT_FILE).display()
            );
            println!(
                "copy this directory to every replica; give agents {}",
                dir.join(ca::CA_CERT_FILE).display()
            );
        }
    }
    Ok(())
}
