//! A replay's flags, printer and exit status, shared by `workload replay` (two stored versions)
//! and `draft impact` (the applied versions and a draft's render): 80-column text or `--json`,
//! then exit 1 if anything becomes newly blocked (unless `--accept-blocks`) or the evidence
//! covers less of the range than `--min-coverage`.

use anyhow::bail;
use innerwall_control_plane::foresight::{self, Impact, Range};

use crate::duration;
use crate::output::{escape, print_json};

/// The range and thresholds of a replay.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The recorded range: from this long ago until now (at most 90 days).
    #[arg(long, default_value = "7d", value_parser = duration::arg)]
    pub since: std::time::Duration,
    /// Rows of each kind shown per workload (1..=100).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Fail when a workload's evidence covers less than this share of the range's hours (0..=1).
    #[arg(long, default_value_t = DEFAULT_MIN_COVERAGE)]
    min_coverage: f64,
    /// Newly blocked flows do not fail the command (they are still listed).
    #[arg(long)]
    accept_blocks: bool,
}

/// The coverage a replay needs by default: nine hours in ten gap-free, so one lost hour in a
/// short range fails it while a long range tolerates a few restarts.
pub const DEFAULT_MIN_COVERAGE: f64 = 0.9;

impl ReplayArgs {
    pub fn range(&self) -> anyhow::Result<Range> {
        self.check()?;
        Ok(Range::ending_at(chrono::Utc::now(), self.since)?)
    }

    fn check(&self) -> anyhow::Result<()> {
        if !(0.0..=1.0).contains(&self.min_coverage) {
            bail!(
                "--min-coverage {} is not between 0 and 1 (e.g. 0.9 for nine hours in ten)",
                self.min_coverage
            );
        }
        if self.top == 0 || self.top > foresight::MAX_TOP {
            bail!("--top {} is not between 1 and {}", self.top, foresight::MAX_TOP);
        }
        Ok(())
    }
}

/// A replay for people (80 columns) or `--json`; then fails (exit 1, with the reason) if
/// anything becomes newly blocked without `--accept-blocks`, or coverage is below the minimum.
pub fn print(json: bool, impact: &Impact, args: &ReplayArgs) -> anyhow::Result<()> {
    if json {
        print_json(impact)?;
    } else {
        print_text(impact);
    }
    judge(impact, args)
}

/// The exit status of a replay: an error (exit 1, with the reason) if anything becomes newly
/// blocked without `--accept-blocks`, or a workload's coverage is below the minimum.
pub fn judge(impact: &Impact, args: &ReplayArgs) -> anyhow::Result<()> {
    let blocked = impact.newly_blocked();
    if blocked > 0 && !args.accept_blocks {
        bail!(
            "{blocked} recorded flow key(s) would become newly blocked; pass --accept-blocks to accept them"
        );
    }
    if let Some(w) = impact.workloads.iter().find(|w| w.coverage.ratio < args.min_coverage) {
        bail!(
            "the evidence of {} covers {:.0}% of the range, below --min-coverage {}; replay a range it covers or lower the minimum",
            w.id,
            w.coverage.ratio * 100.0,
            args.min_coverage
        );
    }
    Ok(())
}

/// The widest line a replay prints for people.
pub const WIDTH: usize = 80;

/// `text` escaped and cut to [`WIDTH`] characters (an ellipsis says it was cut).
pub fn line(text: &str) {
    let text = escape(text);
    match text.chars().count() > WIDTH {
        true => println!("{}…", text.chars().take(WIDTH - 1).collect::<String>()),
        false => println!("{text}"),
    }
}

pub fn print_text(impact: &Impact) {
    let time = |t: &chrono::DateTime<chrono::Utc>| t.format("%m-%d %H:%M").to_string();
    line(&format!(
        "replay of the flows recorded from {} to {} UTC",
        impact.range.from.format("%Y-%m-%d %H:%M"),
        impact.range.to.format("%Y-%m-%d %H:%M")
    ));
    for w in &impact.workloads {
        let r = &w.replayed;
        let to = w.to_version.map_or("proposed".to_owned(), |v| format!("v{v}"));
        let from_mode = w.from_mode.as_deref().unwrap_or("nothing applied");
        line(&format!("{} ({})", w.hostname, w.id));
        line(&format!("  v{} ({from_mode}) -> {to} ({})", w.from_version, w.to_mode));
        line(&format!(
            "  newly blocked {} ({} conns), newly allowed {}, unchanged {}",
            r.newly_blocked, r.blocked_connections, r.newly_allowed, r.unchanged
        ));
        let c = &w.coverage;
        line(&format!(
            "  coverage {:.0}% ({} of {} hours gap-free), {} gap(s)",
            c.ratio * 100.0,
            c.gap_free_hours,
            c.hours,
            c.gap_count
        ));
        for g in &c.gaps {
            line(&format!(
                "    gap {} {} .. {}, count {} {}",
                g.kind,
                time(&g.from),
                time(&g.to),
                g.count,
                g.detail
            ));
        }
        if let Some(note) = &w.note {
            line(&format!("  {note}"));
        }
        for (title, rows) in [("newly blocked", &r.top_blocked), ("newly allowed", &r.top_allowed)] {
            if !rows.is_empty() {
                line(&format!("  {title} (top {}):", rows.len()));
            }
            for row in rows {
                line(&format!(
                    "    {} -> {}/{}  {} conns  {} .. {}",
                    peer(row),
                    row.dst_port,
                    row.protocol,
                    row.connections,
                    time(&row.first_seen),
                    time(&row.last_seen)
                ));
                let rule = |r: &Option<String>| r.clone().unwrap_or_else(|| "none".into());
                line(&format!("      rule then {}, now {}", rule(&row.from_rule), rule(&row.to_rule)));
            }
        }
        if r.relabelled > 0 {
            line(&format!("  {} flow key(s) from peers relabelled since:", r.relabelled));
            for row in &r.top_relabelled {
                let now = row.labels_now.as_ref().map_or("(no longer live)".to_owned(), ToString::to_string);
                line(&format!("    {} then {} now {now}", row.src_address, row.labels_then));
            }
        }
        if w.unseen_admission_count > 0 {
            line(&format!("  {} new admission(s) no recorded flow used:", w.unseen_admission_count));
            for a in &w.unseen_admissions {
                line(&format!("    {} from {} {} {}", a.rule, a.cidr, a.protocol, a.ports.join(",")));
            }
        }
    }
    if impact.workloads.is_empty() {
        line("no workload's policy changes");
    }
}

/// A replayed flow's peer: its address, with the workload's labels then or the group's name.
fn peer(row: &foresight::replay::ReplayRow) -> String {
    match row.peer_kind {
        1 => format!("{} {}", row.src_address, row.labels_then),
        2 => format!("{} ({})", row.src_address, row.peer_key),
        _ => row.src_address.clone(),
    }
}
