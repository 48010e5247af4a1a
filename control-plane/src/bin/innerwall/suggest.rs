//! `innerwall suggest …` (issue 28, FLOW-9): suggested rules from the flows recorded towards a
//! scope that no rule of the applied version admits, with their evidence; `accept` writes them
//! into a draft, `ignore` holds them back until a new source appears. On this host's database
//! (`suggest::run`, `accept`, `ignore`) or through the API ([`Backend`]), printed alike.

use anyhow::Context;
use clap::{Args, Subcommand};
use innerwall_control_plane::suggest::{self, Accepted, State, SuggestedPeer, Suggestions};

use crate::backend::Backend;
use crate::output::{print_json, print_table};
use crate::requests::SuggestArgs;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SuggestCmd {
    #[command(subcommand)]
    action: Option<SuggestAction>,
    #[command(flatten)]
    args: SuggestArgs,
}

#[derive(Debug, Subcommand)]
enum SuggestAction {
    /// Write suggestions into a draft (created if missing): their services that do not exist and
    /// each group's `suggested-…` ruleset with the rules added.
    Accept {
        #[arg(required = true, value_name = "ID")]
        ids: Vec<String>,
        #[arg(long, value_name = "DRAFT")]
        into_draft: String,
    },
    /// Hold suggestions back until a source they did not have appears.
    Ignore {
        #[arg(required = true, value_name = "ID")]
        ids: Vec<String>,
    },
}

pub async fn run(b: &impl Backend, json: bool, cmd: &SuggestCmd) -> anyhow::Result<()> {
    match &cmd.action {
        Some(SuggestAction::Accept { ids, into_draft }) => {
            print_accepted(json, &b.accept_suggestions(ids, into_draft).await?)
        }
        Some(SuggestAction::Ignore { ids }) => {
            b.ignore_suggestions(ids).await?;
            print_ignored(json, ids)
        }
        None => print_suggestions(json, &b.suggestions(&cmd.args).await?, &cmd.args),
    }
}

fn print_accepted(json: bool, done: &Accepted) -> anyhow::Result<()> {
    if json {
        return print_json(done);
    }
    println!("accepted {} into draft {}: {}", done.ids.join(", "), done.draft, done.objects.join(", "));
    println!(
        "next: innerwall draft impact {} ; innerwall draft commit {} --expect-version …",
        done.draft, done.draft
    );
    Ok(())
}

fn print_ignored(json: bool, ids: &[String]) -> anyhow::Result<()> {
    if json {
        return print_json(&serde_json::json!({"ignored": ids}));
    }
    println!("ignored {} until a new source appears", ids.join(", "));
    Ok(())
}

fn peer(p: &SuggestedPeer) -> String {
    match p {
        SuggestedPeer::Workloads(labels) => suggest::group_text(labels),
        SuggestedPeer::AddressGroup(g) => format!("group {g}"),
        SuggestedPeer::Cidrs(c) => c.join(" "),
        SuggestedPeer::NeedsAddressGroup { addresses } => {
            format!("needs an address group ({addresses} addresses)")
        }
    }
}

fn print_suggestions(json: bool, out: &Suggestions, args: &SuggestArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, text) in suggest::ruleset_files(out) {
            let path = dir.join(format!("{name}.yaml"));
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            crate::output::note(format_args!("wrote {}", path.display()));
        }
    }
    if json {
        return print_json(out);
    }
    let rows = out
        .suggestions
        .iter()
        .map(|s| {
            let e = &s.evidence;
            let state = match &s.state {
                State::Learning { .. } => "learning".to_owned(),
                State::Stable => "stable".to_owned(),
                State::Accepted { draft } => format!("accepted ({draft})"),
            };
            vec![
                s.id.clone(),
                state,
                suggest::group_text(&s.group),
                format!("{}/{}", s.protocol, s.port),
                peer(&s.peer),
                format!("{}{}", s.service.name, if s.service.exists { "" } else { " (new)" }),
                format!("{}/{}", e.connections, e.flows),
                e.sources.len().to_string(),
                format!("{} of {}", e.days_seen, e.days_in_range),
                format!("{:.0}%", e.coverage * 100.0),
                e.breadth.map_or_else(|| "-".into(), |b| format!("{b:.2}")),
                format!("{:.0}% → {:.0}%", e.rule_coverage_before * 100.0, e.rule_coverage_after * 100.0),
            ]
        })
        .collect();
    print_table(
        &[
            "id",
            "state",
            "to",
            "port",
            "from",
            "service",
            "conns/flows",
            "sources",
            "days",
            "coverage",
            "breadth",
            "rule coverage",
        ],
        rows,
    );
    for s in &out.suggestions {
        if let State::Learning { reason } = &s.state {
            println!("{} learning: {reason}", s.id);
        }
        if !s.new_since_ignored.is_empty() {
            println!("{} was ignored; new since: {}", s.id, s.new_since_ignored.join(", "));
        }
    }
    for e in &out.excluded {
        println!(
            "excluded: {} flows ({} connections) to {}: {}",
            e.flows, e.connections, e.destination, e.reason
        );
    }
    if out.ignored > 0 {
        println!("{} ignored suggestion(s) held back (no new source)", out.ignored);
    }
    Ok(())
}
