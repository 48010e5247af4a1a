//! `innerwall estate-range`: the estate's workload address ranges (address trust). A reported
//! address is rendered into other workloads' peer sets only if one of these ranges holds it.

use clap::Subcommand;
use innerwall_control_plane::policy::{authoring, store};
use innerwall_wire::policy::Cidr;

use crate::ctx::Ctx;
use crate::output::{print_json, print_table, report};

#[derive(Debug, Subcommand)]
pub enum EstateRangeCmd {
    /// The ranges, smallest address first.
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

pub async fn run(ctx: &Ctx, cmd: &EstateRangeCmd) -> anyhow::Result<()> {
    let (json, pool, actor) = (ctx.json, &ctx.pool, ctx.actor.as_str());
    match cmd {
        EstateRangeCmd::List => {
            let all = store::list_estate_ranges(&mut *pool.acquire().await?).await?;
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
        }
        EstateRangeCmd::Add { cidr, description } => {
            let done = authoring::commit(pool, actor, "estate-range.add", &cidr.to_string(), async |c| {
                authoring::add_estate_range(c, *cidr, description).await?;
                Ok(((), serde_json::json!({"description": description})))
            })
            .await?;
            report(json, &format!("estate range {cidr} added"), done);
        }
        EstateRangeCmd::Remove { cidr } => {
            let done = authoring::commit(pool, actor, "estate-range.remove", &cidr.to_string(), async |c| {
                authoring::remove_estate_range(c, *cidr).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(json, &format!("estate range {cidr} removed"), done);
        }
    }
    Ok(())
}
