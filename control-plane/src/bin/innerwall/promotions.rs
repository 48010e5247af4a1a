//! `innerwall promotions`: the records every mode change leaves (FLOW-8) — who, when, why,
//! which workloads, and the verdict a move to enforcement stood on — and the confirmation of a
//! promotion that reverts unless confirmed (FLOW-11); read from the database or a control
//! plane's API ([`Backend`]) and printed by the same functions.

use clap::Subcommand;
use innerwall_control_plane::gate::Promotion;

use crate::backend::Backend;
use crate::output::{escape, print_json, print_table};

#[derive(Debug, Subcommand)]
pub enum PromotionsCmd {
    /// Every record, newest first (all pages).
    List {
        /// Only the newest N records.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
    },
    /// One record with its verdict and evidence.
    Show { id: uuid::Uuid },
    /// Confirm a promotion with a confirm deadline before the deadline, on a fresh verdict at
    /// the promoted version (nothing blocked since the promotion, no gap, covered, SYNCED).
    Confirm {
        id: uuid::Uuid,
        /// Confirm without a SAFE verdict, for this reason (kept on the record).
        #[arg(long = "override")]
        override_reason: Option<String>,
    },
}

fn outcome(p: &Promotion) -> String {
    let verdict = p.verdict.as_ref().and_then(|v| v.get("outcome")).and_then(|o| o.as_str());
    match (verdict, &p.override_reason) {
        (Some(v), Some(_)) => format!("{v} (overridden)"),
        (Some(v), None) => v.to_owned(),
        (None, _) => "-".to_owned(),
    }
}

pub async fn run(b: &impl Backend, json: bool, cmd: &PromotionsCmd) -> anyhow::Result<()> {
    match cmd {
        PromotionsCmd::List { limit } => print_list(json, &b.promotions(*limit).await?),
        PromotionsCmd::Show { id } => print_show(json, &b.promotion(*id).await?),
        PromotionsCmd::Confirm { id, override_reason } => {
            print_show(json, &b.confirm_promotion(*id, override_reason.as_deref()).await?)
        }
    }
}

/// A confirmation in one cell: `-`, or its state with the deadline (pending) or who settled it.
fn confirmation(p: &Promotion) -> String {
    let Some(c) = &p.confirmation else { return "-".to_owned() };
    match (c.state.as_str(), &c.settled_by) {
        ("pending", _) => format!("PENDING until {}", c.deadline.format("%F %T")),
        (state, Some(by)) => format!("{state} by {by}"),
        (state, None) => state.to_owned(),
    }
}

fn print_list(json: bool, all: &[Promotion]) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    let rows = all
        .iter()
        .map(|p| {
            vec![
                p.id.to_string(),
                p.at.format("%F %T").to_string(),
                p.actor.clone(),
                p.to_mode.to_owned(),
                format!("{} ({})", p.scope, p.workloads.len()),
                outcome(p),
                confirmation(p),
                p.reason.clone(),
            ]
        })
        .collect();
    print_table(&["id", "at", "who", "to", "scope (workloads)", "verdict", "confirm", "why"], rows);
    Ok(())
}

fn print_show(json: bool, p: &Promotion) -> anyhow::Result<()> {
    if json {
        return print_json(p);
    }
    println!("promotion {} · {} · by {}", p.id, p.at.format("%F %T"), escape(&p.actor));
    println!(
        "to {} mode · scope {} · expected {} · why: {}",
        p.to_mode,
        escape(&p.scope.to_string()),
        p.expected_count,
        escape(&p.reason)
    );
    if let Some(reason) = &p.override_reason {
        println!("OVERRIDE of the evidence gate: {}", escape(reason));
    }
    for m in &p.workloads {
        println!("  {} (was {})", escape(&m.name().to_string()), m.mode);
    }
    if let Some(c) = &p.confirmation {
        println!("confirm deadline {} · {}", c.deadline.format("%F %T"), confirmation(p));
        if let Some(at) = c.settled_at {
            println!("  settled at {}", at.format("%F %T"));
        }
        for w in &c.workloads {
            let version = w.version.map_or_else(|| "-".to_owned(), |v| format!("v{v}"));
            let agent = w.agent_reverted_at.map_or_else(String::new, |t| {
                format!(" · its agent reverted by itself at {}", t.format("%F %T"))
            });
            println!("  {} {version}: {}{agent}", w.id, w.state);
        }
        if c.state == "pending" {
            println!("confirm with `innerwall promotions confirm {}` before the deadline", p.id);
        }
    }
    match &p.verdict {
        Some(v) => println!("verdict it stood on:\n{}", serde_json::to_string_pretty(v)?),
        None => println!("no verdict: a move away from enforcement needs no evidence"),
    }
    Ok(())
}
