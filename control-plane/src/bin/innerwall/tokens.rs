//! `innerwall token`: minting, listing and revoking provisioning tokens.

use clap::Subcommand;
use innerwall_control_plane::identity::{ca, tokens};
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Cidr;

use crate::ctx::Ctx;
use crate::duration;
use crate::output::{print_json, print_table};

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
        id: uuid::Uuid,
    },
}

pub async fn run(ctx: &Ctx, cmd: &TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Mint { labels, ttl, max_uses, address_ranges, server } => {
            // Parsed here rather than by clap so a bad --ttl fails like the other mint checks
            // (exit status 1), which `tokens::mint` makes on the value.
            let ttl = chrono::Duration::from_std(duration::parse("ttl", ttl)?).map_err(|_| {
                anyhow::anyhow!("ttl {ttl:?} is too large; write e.g. 30d, 12h, 90m or 3600s")
            })?;
            let minted =
                tokens::mint_audited(&ctx.pool, &ctx.actor, labels, ttl, *max_uses, address_ranges).await?;
            let bundle = ctx.ca_dir.join(ca::CA_CERT_FILE);
            // By environment, not as an argument: other users can read a process's arguments.
            let command = format!(
                "INNERWALL_TOKEN={} innerwall-agent enroll --server {server} --ca-bundle {}",
                minted.secret,
                bundle.display()
            );
            if ctx.json {
                return print_json(&serde_json::json!({
                    "id": minted.id, "token": minted.secret, "expires_at": minted.expires_at, "enroll_command": command,
                }));
            }
            println!(
                "token {} (expires {}), shown once:\n\n  {}\n",
                minted.id, minted.expires_at, minted.secret
            );
            println!("enroll a host with:\n\n  {command}\n");
            println!(
                "or save the token in a file only root reads and pass --token-file; never pass --token on a \
                 shared host, where other users can read it in the process list"
            );
        }
        TokenCmd::List => {
            let all = tokens::list(&mut *ctx.pool.acquire().await?).await?;
            if ctx.json {
                return print_json(&all);
            }
            let rows = all
                .into_iter()
                .map(|t| {
                    vec![
                        t.id.to_string(),
                        format!("iw_{}…", t.prefix_hint),
                        t.labels.join(","),
                        if t.address_ranges.is_empty() {
                            "estate".into()
                        } else {
                            t.address_ranges.join(" ")
                        },
                        t.expires_at.to_rfc3339(),
                        format!("{}/{}", t.use_count, t.max_uses.map_or("∞".into(), |m| m.to_string())),
                        t.status.to_string(),
                    ]
                })
                .collect();
            print_table(&["id", "token", "labels", "address ranges", "expires", "uses", "status"], rows);
        }
        TokenCmd::Revoke { id } => {
            tokens::revoke_audited(&ctx.pool, &ctx.actor, *id).await?;
            println!("token {id} revoked; it enrolls nothing from now on");
        }
    }
    Ok(())
}
