//! `innerwall operator token`: the bearer tokens of the operator HTTP API, minted, listed and
//! revoked on a control-plane host (local database), each change audited.

use clap::Subcommand;
use innerwall_control_plane::identity::operators::{self, Expiry, MintedOperatorToken, Role, TokenRef};

use crate::ctx::Ctx;
use crate::duration;
use crate::output::{self, print_json, print_table};
use crate::pages;

/// `--expires`: a duration, or `never`.
fn expires_arg(text: &str) -> Result<Expiry, String> {
    if text.trim() == "never" {
        return Ok(Expiry::Never);
    }
    let d = duration::arg(text).map_err(|e| format!("{e}, or never"))?;
    chrono::Duration::from_std(d)
        .map(Expiry::After)
        .map_err(|_| format!("{text:?} is too large; write e.g. 90d, 12h, or never"))
}

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
        /// (a value beginning with "-" is read as a name, so it is refused with the reason).
        #[arg(long, allow_hyphen_values = true)]
        name: String,
        /// viewer (reads), editor (+ authoring, labels, provisioning tokens), promoter (+ mode
        /// changes), admin (+ retire and deny).
        #[arg(long)]
        role: String,
        /// Validity, e.g. 30d, 12h (at most three years), or `never` for a token valid until
        /// revoked (listed as expiring never).
        #[arg(long, default_value = "90d", value_parser = expires_arg)]
        expires: Expiry,
    },
    /// Every token, newest first (never a secret; all pages).
    List,
    /// Revoke a token, by --id or by --name (the live token of that name); effective on its
    /// next request.
    #[command(group = clap::ArgGroup::new("which").required(true).args(["id", "name"]))]
    Revoke {
        /// The token's id, as the list shows it (8 characters; one in 64 begins with "-", so
        /// the value is never read as a flag).
        #[arg(long, allow_hyphen_values = true)]
        id: Option<String>,
        /// The name of a live token.
        #[arg(long, allow_hyphen_values = true)]
        name: Option<String>,
    },
}

/// What a mint prints: the token (with `--json` as JSON), once.
fn minted_text(json: bool, minted: &MintedOperatorToken) -> anyhow::Result<String> {
    if json {
        return Ok(format!("{}\n", serde_json::to_string_pretty(minted)?));
    }
    let until = minted.expires_at.map_or("never expires".to_owned(), |t| format!("expires {t}"));
    Ok(format!(
        "operator token {} for {} ({}, {until}), shown once:\n\n  {}\n\n\
         call the API with `Authorization: Bearer <token>` (the CLI: --token-file FILE or \
         INNERWALL_API_TOKEN); keep it in a file only you read, and revoke it with \
         `innerwall operator token revoke --id {}`\n",
        minted.id, minted.name, minted.role, minted.token, minted.id
    ))
}

pub async fn run(ctx: &Ctx, cmd: &OperatorCmd) -> anyhow::Result<()> {
    let OperatorCmd::Token(cmd) = cmd;
    match cmd {
        TokenCmd::Mint { name, role, expires } => {
            let role: Role = role.parse()?;
            output::stdout_can_show()
                .map_err(|e| anyhow::anyhow!("{e}: the token would be shown nowhere; nothing was minted"))?;
            let minted = operators::mint_audited(&ctx.pool, &ctx.actor, name, role, *expires).await?;
            // A token whose secret no one saw is of no use and must not stay live: written in
            // one piece and flushed, and revoked if that fails.
            let text = minted_text(ctx.json, &minted)?;
            if let Err(e) = output::write_all(&text) {
                let reason = format!("its secret could not be written to stdout: {e}");
                let revoked = operators::revoke_audited(
                    &ctx.pool,
                    &ctx.actor,
                    &TokenRef::Id(minted.id.clone()),
                    Some(&reason),
                )
                .await;
                match revoked {
                    Ok(_) => anyhow::bail!(
                        "cannot write the new operator token to stdout ({e}); token {} was revoked at once, \
                         since no one could see it: mint again with stdout open to a terminal or a file",
                        minted.id
                    ),
                    Err(revoke) => anyhow::bail!(
                        "cannot write the new operator token to stdout ({e}), and revoking it failed ({revoke}): \
                         revoke it with `innerwall operator token revoke --id {}`",
                        minted.id
                    ),
                }
            }
        }
        TokenCmd::List => {
            let mut conn = ctx.pool.acquire().await?;
            let all =
                pages::local(ctx.page_size, None, async |r| operators::page(&mut conn, r).await).await?;
            if ctx.json {
                return print_json(&all);
            }
            let when = |t: Option<chrono::DateTime<chrono::Utc>>, none: &str| {
                t.map_or(none.into(), |t| t.format("%F %T").to_string())
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
                        when(t.expires_at, "never"),
                        when(t.last_used_at, "-"),
                    ]
                })
                .collect();
            print_table(&["id", "name", "role", "status", "created", "by", "expires", "last used"], rows);
        }
        TokenCmd::Revoke { id, name } => {
            let which = match (id, name) {
                (Some(id), _) => TokenRef::Id(id.clone()),
                (None, Some(name)) => TokenRef::Name(name.clone()),
                (None, None) => anyhow::bail!("give the token's --id or its --name"),
            };
            let view = operators::revoke_audited(&ctx.pool, &ctx.actor, &which, None).await?;
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
