//! `innerwall token`: minting, listing and revoking provisioning tokens, on this host's
//! database or through a control plane's API ([`Backend`]), printed alike.

use std::path::Path;

use clap::Subcommand;
use innerwall_control_plane::identity::ca;
use innerwall_control_plane::identity::tokens;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Cidr;
use uuid::Uuid;

use crate::backend::Backend;
use crate::duration;
use crate::output::{print_json, print_table};
use crate::requests::Minted;

#[derive(Debug, Subcommand)]
pub enum TokenCmd {
    /// Mint a token; it is printed once, with the enroll command line.
    Mint {
        /// Labels every workload enrolled with this token gets; repeatable.
        #[arg(long = "label", required = true)]
        labels: Vec<Label>,
        /// Validity, e.g. 30d, 12h.
        #[arg(long, default_value = "30d")]
        ttl: String,
        #[arg(long)]
        max_uses: Option<u32>,
        /// Narrow the addresses workloads enrolled with this token may claim to this range
        /// (within the estate ranges); repeatable. Without it, the estate ranges alone decide.
        #[arg(long = "address-range", value_parser = crate::estate::parse_cidr)]
        address_ranges: Vec<Cidr>,
        /// The HOST:PORT agents dial, for the printed enroll command.
        #[arg(long, default_value = "CONTROL-PLANE:7443")]
        server: String,
    },
    List,
    /// Revoke a token: it enrolls nothing more, effective immediately.
    Revoke {
        id: Uuid,
    },
}

/// A `--ttl` as the mint takes it. Parsed here rather than by clap so a bad one fails like the
/// other mint checks (exit status 1), which `tokens::mint` makes on the value. Whole seconds
/// only: the API takes the ttl in seconds, and both modes accept the same values.
fn ttl(text: &str) -> anyhow::Result<chrono::Duration> {
    let ttl = duration::parse("ttl", text)?;
    if ttl.subsec_nanos() != 0 {
        anyhow::bail!("ttl {text:?} is not a whole number of seconds; write e.g. 30d, 12h, 90m or 3600s");
    }
    chrono::Duration::from_std(ttl)
        .map_err(|_| anyhow::anyhow!("ttl {text:?} is too large; write e.g. 30d, 12h, 90m or 3600s"))
}

/// Where the printed enroll command has the host keep the token.
const TOKEN_FILE: &str = "/etc/innerwall-agent/enroll-token";

/// A minted token, printed once with the enroll command line.
fn print_minted(json: bool, minted: &Minted, server: &str, ca_dir: &Path) -> anyhow::Result<()> {
    let Minted { id, token: secret, expires_at } = minted;
    let bundle = ca_dir.join(ca::CA_CERT_FILE);
    // From a file: a token on a command line is in the shell's history and, as an argument,
    // in the process list other users read.
    let save = format!("install -D -m 600 /dev/stdin {TOKEN_FILE}");
    let command = format!(
        "innerwall-agent enroll --server {server} --ca-bundle {} --token-file {TOKEN_FILE}",
        bundle.display()
    );
    if json {
        return print_json(&serde_json::json!({
            "id": id, "token": secret, "expires_at": expires_at, "token_file": TOKEN_FILE,
            "save_token_command": save, "enroll_command": command,
        }));
    }
    println!("token {id} (expires {expires_at}), shown once:\n\n  {secret}\n");
    println!(
        "enroll a host: as root, save the token in a file only root reads (paste it, then Ctrl-D):\n\n  {save}\n"
    );
    println!("then enroll, with the CA certificate delivered with the token:\n\n  {command}\n");
    println!(
        "and delete the file once the host is enrolled; the token is never on a command line, where \
         shell history and other users (in the process list) would see it"
    );
    Ok(())
}

fn print_tokens(json: bool, all: Vec<tokens::TokenView>) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    let rows = all
        .into_iter()
        .map(|t| {
            vec![
                t.id.to_string(),
                format!("iw_{}…", t.prefix_hint),
                t.labels.join(","),
                if t.address_ranges.is_empty() { "estate".into() } else { t.address_ranges.join(" ") },
                t.expires_at.to_rfc3339(),
                format!("{}/{}", t.use_count, t.max_uses.map_or("∞".into(), |m| m.to_string())),
                t.status.to_string(),
            ]
        })
        .collect();
    print_table(&["id", "token", "labels", "address ranges", "expires", "uses", "status"], rows);
    Ok(())
}

fn print_revoked(id: Uuid) {
    println!("token {id} revoked; it enrolls nothing from now on");
}

/// `ca_dir` is where the printed enroll command says the CA bundle is (`--ca-dir`, default
/// `<state-dir>/ca`), with or without `--api`.
pub async fn run(b: &impl Backend, json: bool, ca_dir: &Path, cmd: &TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Mint { labels, ttl: text, max_uses, address_ranges, server } => {
            let minted = b.mint_token(labels, ttl(text)?, *max_uses, address_ranges).await?;
            print_minted(json, &minted, server, ca_dir)?;
        }
        TokenCmd::List => print_tokens(json, b.tokens().await?)?,
        TokenCmd::Revoke { id } => {
            b.revoke_token(*id).await?;
            print_revoked(*id);
        }
    }
    Ok(())
}
