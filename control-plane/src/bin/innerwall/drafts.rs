//! `innerwall draft …` (issue 27 items 1 and 2, POL-8): named, stored sets of authored changes,
//! rendered, replayed against recorded flows and committed through one checked transaction —
//! on this host's database (`foresight::drafts`, default count bounds) or through a control
//! plane's API ([`Backend`]), printed alike. `draft impact` prints and exits as `workload replay`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use innerwall_control_plane::api::drafts::DraftImpact;
use innerwall_control_plane::foresight::drafts::{
    self, Base, ChangeFile, ChangeSpec, DraftCommitted, DraftRender, DraftSummary, DraftView,
};

use crate::backend::Backend;
use crate::output::{print_json, print_table, report};
use crate::replay::{self, ReplayArgs, WIDTH, line};

#[derive(Debug, Subcommand)]
pub enum DraftCmd {
    /// Create an empty draft.
    Create {
        name: String,
        /// Why the draft exists (at most 1,024 characters).
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Every draft, open and committed.
    List,
    /// A draft's changes, each with the version of its object it was based on.
    Show { name: String },
    /// Add the changes of a change file (YAML or JSON, `-` for stdin), each against its object's
    /// version now; a change to an object the draft already changes replaces that change.
    Add {
        name: String,
        #[arg(short, long)]
        file: PathBuf,
    },
    /// What committing the draft now would do: per workload, the version it would advance from
    /// and to and the changes its delta carries; and what would refuse the commit. Writes nothing.
    Render { name: String },
    /// Replay the flows recorded towards every workload whose policy the draft changes through
    /// the applied and the drafted policy. Exits 1 if anything becomes newly blocked (unless
    /// --accept-blocks) or the evidence covers less of the range than --min-coverage.
    Impact {
        name: String,
        #[command(flatten)]
        args: ReplayArgs,
    },
    /// Delete the draft.
    Discard {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
    /// Apply every change of the draft in one checked transaction (refused, changing nothing, if
    /// an object moved since its change was added, a mode change's gate refuses, or a policy test
    /// fails); the draft is kept, marked committed.
    Commit {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
}

#[derive(Debug, Args)]
pub struct Expect {
    /// Required: the version `draft show` printed; refused if the draft moved on since.
    #[arg(long, value_name = "VERSION")]
    expect_version: Option<i64>,
}

impl Expect {
    /// Refused here, before anything is read or written, without `--expect-version`.
    fn required(&self, verb: &str, name: &str) -> anyhow::Result<i64> {
        self.expect_version.with_context(|| {
            format!(
                "draft {verb} {name:?} needs --expect-version VERSION, the version `draft show` printed; nothing was written"
            )
        })
    }
}

/// A change file's text, bounded by [`drafts::MAX_CHANGE_FILE`], parsed as every operator file is.
fn read_change_file(path: &Path) -> anyhow::Result<ChangeFile> {
    let (origin, text) = crate::file::read_bounded(path, drafts::MAX_CHANGE_FILE)?;
    Ok(drafts::parse_change_file(&origin, &text)?)
}

pub async fn run(b: &impl Backend, json: bool, cmd: &DraftCmd) -> anyhow::Result<()> {
    match cmd {
        DraftCmd::Create { name, note } => print_view(json, &b.create_draft(name, note).await?),
        DraftCmd::List => print_list(json, &b.drafts().await?),
        DraftCmd::Show { name } => print_view(json, &b.draft(name).await?),
        DraftCmd::Add { name, file } => {
            print_view(json, &b.add_to_draft(name, &read_change_file(file)?).await?)
        }
        DraftCmd::Render { name } => print_render(json, &b.render_draft(name).await?),
        DraftCmd::Impact { name, args } => print_impact(json, &b.draft_impact(name, args).await?, args),
        DraftCmd::Discard { name, expect } => {
            let expected = expect.required("discard", name)?;
            report(json, &format!("draft {name} discarded"), &b.discard_draft(name, expected).await?);
            Ok(())
        }
        DraftCmd::Commit { name, expect } => {
            let expected = expect.required("commit", name)?;
            let done = b.commit_draft(name, expected).await?;
            report(json, &committed(&done.result), &done);
            Ok(())
        }
    }
}

/// The line a commit prints above the versions it advanced.
fn committed(done: &DraftCommitted) -> String {
    let mut text = format!("draft {} committed: {} change(s)", done.draft, done.changes);
    if !done.promotions.is_empty() {
        let ids: Vec<String> = done.promotions.iter().map(ToString::to_string).collect();
        text.push_str(&format!("; promotion(s) {}", ids.join(", ")));
    }
    text
}

fn print_list(json: bool, all: &[DraftSummary]) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    const HEADERS: [&str; 6] = ["name", "version", "changes", "state", "author", "note"];
    let mut rows: Vec<Vec<String>> = all
        .iter()
        .map(|d| {
            vec![
                d.name.clone(),
                d.version.to_string(),
                d.changes.to_string(),
                if d.committed_at.is_some() { "committed" } else { "open" }.into(),
                d.author.clone(),
                d.note.clone(),
            ]
        })
        .collect();
    // The note gets what the other columns (each two spaces apart) leave of 80, at least a few
    // characters; `draft show` prints it whole.
    let used: usize = (0..HEADERS.len() - 1)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).chain([HEADERS[i].len()]).max().unwrap_or(0) + 2)
        .sum();
    let room = WIDTH.saturating_sub(used).max(MIN_NOTE);
    for row in &mut rows {
        row[5] = cut(&row[5], room);
    }
    print_table(&HEADERS, rows);
    Ok(())
}

/// The fewest characters of a note `draft list` shows, however wide the other columns are.
const MIN_NOTE: usize = 8;

/// `text` cut to `max` characters, an ellipsis saying it was cut.
fn cut(text: &str, max: usize) -> String {
    match text.chars().count() > max {
        true => format!("{}…", text.chars().take(max - 1).collect::<String>()),
        false => text.to_owned(),
    }
}

/// A change's kind as a person reads it.
fn kind(change: &ChangeSpec) -> &'static str {
    match change.mode.as_ref().map(|m| m.to.as_str()) {
        Some("enforcement") => "to enforcement",
        Some("simulation") => "to simulation",
        Some(_) => "to visibility",
        None => change.kind(),
    }
}

/// A base short enough for a column (a mode change's members are counted; `--json` lists them).
fn base(base: &Base) -> String {
    match base {
        Base::Absent => "absent".into(),
        Base::Version(v) => format!("v{v}"),
        Base::Members(ms) => format!("{} workload(s)", ms.len()),
    }
}

fn print_view(json: bool, view: &DraftView) -> anyhow::Result<()> {
    if json {
        return print_json(view);
    }
    let state = match (&view.committed_at, &view.committed_by) {
        (Some(at), by) => {
            format!("committed {} by {}", at.format("%Y-%m-%d %H:%M"), by.as_deref().unwrap_or("?"))
        }
        (None, _) => "open".into(),
    };
    line(&format!("draft {} version {} by {}, {state}", view.name, view.version, view.author));
    if !view.note.is_empty() {
        line(&format!("note: {}", view.note));
    }
    if view.changes.is_empty() {
        line("no changes yet: add some with `innerwall draft add NAME -f change.yaml`");
        return Ok(());
    }
    let rows = view
        .changes
        .iter()
        .map(|c| vec![c.seq.to_string(), c.object.clone(), kind(&c.change).into(), base(&c.base)])
        .collect();
    print_table(&["seq", "object", "change", "based on"], rows);
    Ok(())
}

fn print_render_text(render: &DraftRender) {
    line(&format!("draft {} version {}", render.draft, render.draft_version));
    if render.workloads.is_empty() {
        line("no workload's policy version would change");
    } else {
        let rows = render
            .workloads
            .iter()
            .map(|w| {
                let from = if w.from_version == 0 { "none".into() } else { format!("v{}", w.from_version) };
                vec![
                    w.workload.to_string(),
                    format!("{from} -> v{}", w.to_version),
                    w.mode.clone(),
                    if w.from_version == 0 { "snapshot".into() } else { w.delta_changes.to_string() },
                ]
            })
            .collect();
        print_table(&["workload", "version", "mode", "changes"], rows);
    }
    if render.would_commit() {
        line("a commit now would pass");
    } else {
        line("a commit now would be refused:");
        for b in &render.blockers {
            line(&format!("  {b}"));
        }
        for t in &render.failing_tests {
            let why = t.failure.as_ref().map_or("", |f| f.reason.as_str());
            line(&format!("  test {}/{} fails: {why}", t.set, t.test));
        }
    }
}

/// A render for people or `--json`. It succeeds whatever the blockers say (they are printed):
/// a render answers a question, `draft commit` is what refuses.
fn print_render(json: bool, render: &DraftRender) -> anyhow::Result<()> {
    if json {
        return print_json(render);
    }
    print_render_text(render);
    Ok(())
}

/// The render and the replay, then the replay's exit status (`workload replay`'s).
fn print_impact(json: bool, answer: &DraftImpact, args: &ReplayArgs) -> anyhow::Result<()> {
    if json {
        print_json(answer)?;
    } else {
        print_render_text(&answer.render);
        println!();
        replay::print_text(&answer.impact);
    }
    replay::judge(&answer.impact, args)
}
