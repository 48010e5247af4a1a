//! `innerwall operator token`: the bearer tokens of the operator HTTP API, minted, listed and
//! revoked on a control-plane host (local database), each change audited.

use clap::Subcommand;
use innerwall_control_plane::identity::operators::{self, Role};

use crate::ctx::Ctx;
use crate::duration;
use crate::output::{print_json, print_table};
use crate::pages;

#[derive(Debug, Subcommand)]
pub enum OperatorCmd {
    /// Operator tokens for the HTTP API.
    #[command(subcommand)]
    Token(TokenCmd),
}

#[derive(Debug, Subcommand)]
pub enum TokenCmd {
    /// Mint a token; it is printed once and stored only as a hash.
    Mint {
        /// Who holds it (named in every audit record of its requests): 1-63 of A-Z a-z 0-9 . _ -
        #[arg(long)]
        name: String,
        /// viewer (reads), editor (+ authoring, labels, provisioning tokens), promoter (+ mode
        /// changes), admin (+ retire and deny).
        #[arg(long)]
        role: String,
        /// Validity, e.g. 30d, 12h; without it the token is valid until revoked.
        #[arg(long, value_parser = duration::arg)]
        expires: Option<std::time::Duration>,
    },
    /// Every token, newest first (never a secret; all pages).
    List,
    /// Revoke a token by id, or the live token of that name; effective on its next request.
    Revoke { id_or_name: String },
}

pub async fn run(ctx: &Ctx, cmd: &OperatorCmd) -> anyhow::Result<()> {
    let OperatorCmd::Token(cmd) = cmd;
    match cmd {
        TokenCmd::Mint { name, role, expires } => {
            let role: Role = role.parse()?;
            let expires = expires
                .map(|d| {
                    chrono::Duration::from_std(d)
                        .map_err(|_| anyhow::anyhow!("--expires {d:?} is too large; write e.g. 30d, 12h"))
                })
                .transpose()?;
            let minted = operators::mint_audited(&ctx.pool, &ctx.actor, name, role, expires).await?;
            if ctx.json {
                return print_json(&minted);
            }
            let until = minted.expires_at.map_or("never expires".to_owned(), |t| format!("expires {t}"));
            println!(
                "operator token {} for {} ({}, {until}), shown once:\n",
                minted.id, minted.name, minted.role
            );
            println!("  {}\n", minted.token);
            println!(
                "call the API with `Authorization: Bearer <token>`; keep it in a file only you read, \
                 and revoke it with `innerwall operator token revoke {}`",
                minted.id
            );
        }
        TokenCmd::List => {
            let mut conn = ctx.pool.acquire().await?;
            let all =
                pages::local(ctx.page_size, None, async |r| operators::page(&mut conn, r).await).await?;
            if ctx.json {
                return print_json(&all);
            }
            let when = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or("-".into(), |t| t.format("%F %T").to_string())
            };
            let rows = all
                .into_iter()
                .map(|t| {
                    vec![
                        t.id,
                        t.name,
                        t.role.to_string(),
                        t.status.to_owned(),
                        t.created_at.format("%F %T").to_string(),
                        t.created_by,
                        when(t.expires_at),
                        when(t.last_used_at),
                    ]
                })
                .collect();
            print_table(&["id", "name", "role", "status", "created", "by", "expires", "last used"], rows);
        }
        TokenCmd::Revoke { id_or_name } => {
            let view = operators::revoke_audited(&ctx.pool, &ctx.actor, id_or_name).await?;
            if ctx.json {
                return print_json(&view);
            }
            println!(
                "operator token {} ({}) revoked; it is refused from its next request on",
                view.id, view.name
            );
        }
    }
    Ok(())
}
