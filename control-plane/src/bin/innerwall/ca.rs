//! `innerwall ca`: creating the certificate authority's files, rotating to a new root and
//! retiring the old one (IDN-8).

use std::path::Path;

use anyhow::Context;
use clap::Subcommand;
use innerwall_control_plane::identity::ca::{self, FileCa};
use innerwall_control_plane::identity::rotation;

use crate::ctx::{Ctx, Database};
use crate::output::{escape, print_json};

#[derive(Debug, Subcommand)]
pub enum CaCmd {
    /// Create the root key (0600) and a 10-year self-signed certificate in --ca-dir.
    Init,
    /// Add a new root (next.key, next.crt): workload certificates are issued by it from now on,
    /// and agents take the bundle of both roots at their next renewal. Copy --ca-dir to every
    /// replica afterwards; running replicas re-read it within seconds.
    Rotate,
    /// Remove the old root: the new one replaces ca.key and ca.crt, and replicas present server
    /// certificates of it. Refused while a live workload holds a certificate of another root,
    /// naming them, unless --force (which strands them: they must enroll again).
    Retire {
        #[arg(long)]
        force: bool,
    },
}

pub async fn run(
    cmd: &CaCmd,
    dir: &Path,
    database: &Database,
    json: bool,
    page_size: u32,
) -> anyhow::Result<()> {
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
        CaCmd::Rotate => {
            let ctx = Ctx::connect(database, json, page_size).await?;
            let change = rotation::rotate(&ctx.pool, dir, &ctx.actor).await?;
            if json {
                return print_json(&change);
            }
            println!("added root {} beside {}", change.new_sha256, change.old_sha256);
            println!(
                "copy {} to every replica; agents take the new bundle at their next renewal, then run `innerwall ca retire`",
                dir.display()
            );
        }
        CaCmd::Retire { force } => {
            let ctx = Ctx::connect(database, json, page_size).await?;
            let retired = rotation::retire(&ctx.pool, dir, &ctx.actor, *force).await?;
            if json {
                return print_json(&retired);
            }
            println!(
                "retired root {}; {} is the root now",
                retired.change.old_sha256, retired.change.new_sha256
            );
            for h in &retired.stranded {
                println!("stranded (must enroll again): {} ({})", escape(&h.hostname), h.id);
            }
            println!(
                "copy {} to every replica; give new agents {}",
                dir.display(),
                dir.join(ca::CA_CERT_FILE).display()
            );
        }
    }
    Ok(())
}
