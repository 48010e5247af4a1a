//! `innerwall estate-range`: the estate's workload address ranges (address trust). A reported
//! address is rendered into other workloads' peer sets only if one of these ranges holds it.
//! On this host's database ([`run`]) or through a control plane's API ([`run_remote`]),
//! printed alike.

use clap::Subcommand;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::store::{self, EstateRangeView};
use innerwall_wire::policy::Cidr;

use crate::api::{ApiClient, segment};
use crate::ctx::Ctx;
use crate::output::{Outcome, print_json, print_table, report, report_outcome};
use crate::pages;

#[derive(Debug, Subcommand)]
pub enum EstateRangeCmd {
    /// Every range, smallest address first (all pages).
    List,
    /// Trust addresses in CIDR as workload addresses (e.g. a public range your hosts use).
    Add {
        #[arg(value_parser = parse_cidr)]
        cidr: Cidr,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Stop trusting addresses in CIDR: those only it held leave every peer set.
    Remove {
        #[arg(value_parser = parse_cidr)]
        cidr: Cidr,
    },
}

/// A CIDR as the CLI takes it: the network address and prefix, e.g. `10.0.0.0/8`.
pub fn parse_cidr(text: &str) -> Result<Cidr, String> {
    Cidr::parse(text).map_err(|e| e.to_string())
}

fn print_ranges(json: bool, all: Vec<EstateRangeView>) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    if all.is_empty() {
        println!("no estate ranges: no reported workload address is rendered into any peer set");
    }
    let rows = all
        .into_iter()
        .map(|r| vec![r.cidr, r.description, r.created_at.format("%F %T").to_string()])
        .collect();
    print_table(&["range", "description", "added"], rows);
    Ok(())
}

fn added(cidr: &Cidr) -> String {
    format!("estate range {cidr} added")
}

fn removed(cidr: &Cidr) -> String {
    format!("estate range {cidr} removed")
}

pub async fn run(ctx: &Ctx, cmd: &EstateRangeCmd) -> anyhow::Result<()> {
    let (json, pool, actor) = (ctx.json, &ctx.pool, ctx.actor.as_str());
    match cmd {
        EstateRangeCmd::List => {
            let mut conn = pool.acquire().await?;
            print_ranges(
                json,
                pages::local(ctx.page_size, None, async |r| store::estate_range_page(&mut conn, r).await)
                    .await?,
            )?
        }
        EstateRangeCmd::Add { cidr, description } => {
            let done = innerwall_control_plane::foresight::commit(
                pool,
                actor,
                "estate-range.add",
                &cidr.to_string(),
                async |c| {
                    authoring::add_estate_range(c, *cidr, description).await?;
                    Ok(((), serde_json::json!({"description": description})))
                },
            )
            .await?;
            report(json, &added(cidr), done);
        }
        EstateRangeCmd::Remove { cidr } => {
            let done = innerwall_control_plane::foresight::commit(
                pool,
                actor,
                "estate-range.remove",
                &cidr.to_string(),
                async |c| {
                    authoring::remove_estate_range(c, *cidr).await?;
                    Ok(((), serde_json::json!({})))
                },
            )
            .await?;
            report(json, &removed(cidr), done);
        }
    }
    Ok(())
}

const PATH: &str = "/api/v1/estate-ranges";

/// [`run`] over the API.
pub async fn run_remote(api: &ApiClient, json: bool, cmd: &EstateRangeCmd) -> anyhow::Result<()> {
    match cmd {
        EstateRangeCmd::List => print_ranges(json, pages::remote(api, PATH, None).await?)?,
        EstateRangeCmd::Add { cidr, description } => {
            let body = serde_json::json!({"cidr": cidr.to_string(), "description": description});
            let done: Outcome<()> = api.write("POST", PATH, None, Some(&body)).await?;
            report_outcome(json, &added(cidr), &done);
        }
        EstateRangeCmd::Remove { cidr } => {
            let net = cidr.net();
            let path = format!("{PATH}/{}/{}", segment(&net.network().to_string()), net.prefix_len());
            let done: Outcome<()> = api.write("DELETE", &path, None, None).await?;
            report_outcome(json, &removed(cidr), &done);
        }
    }
    Ok(())
}
