//! What `innerwall-agent status` reports: the persisted (applied) policy, and from the kernel
//! the owned table's set sizes and per-rule hit counters, attributed by rule comment.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::desired::{DesiredTable, TERMINAL_DROP, TERMINAL_WOULD_BLOCK, rule_comment};
use super::linux::KILL_SWITCH_MARKER;
use super::nft;
use super::persist::PersistedPolicy;
use super::state::{self, RuleCounter};
use super::store::{EnforceError, now_ms};

#[derive(Debug, Clone, Serialize)]
pub struct RuleHits {
    pub rule: String,
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    pub state_dir: String,
    pub applied_version: Option<u64>,
    pub mode: Option<String>,
    /// A promotion awaiting confirmation: when the host reverts it (unix milliseconds).
    pub revert_at_unix_ms: Option<i64>,
    /// The deadline passed unconfirmed: the policy is enforced as its simulation.
    pub reverted: bool,
    /// The staged set counted beside the enforced rules (FLOW-10): its id and its staged rules.
    pub staged_set: Option<(String, usize)>,
    pub rule_count: Option<usize>,
    /// Why the persisted policy could not be read, if it could not.
    pub persisted_error: Option<String>,
    pub table_present: bool,
    pub kill_switch_engaged: bool,
    /// Whether the kernel table is exactly what the persisted policy installs.
    pub kernel_matches_persisted: Option<bool>,
    /// How the kernel table differs from the persisted policy's, if it does.
    pub differences: Vec<String>,
    /// Intervals per set (merged CIDRs or port ranges).
    pub sets: BTreeMap<String, usize>,
    /// Hits per rule id (summed over address families), in rule order.
    pub rules: Vec<RuleHits>,
    /// Enforcement: packets dropped by the terminal rule.
    pub dropped: Option<RuleCounter>,
    /// Simulation: packets the terminal rule would have blocked.
    pub would_block: Option<RuleCounter>,
}

/// Reads the persisted policy and the kernel table.
pub fn status(state_dir: &Path) -> Result<StatusReport, EnforceError> {
    let (policy, persisted_error) = match PersistedPolicy::new(state_dir).load() {
        Ok(p) => (p, None),
        Err(e) => (None, Some(e.to_string())),
    };
    let table = state::read_table().map_err(EnforceError::Read)?;
    let mut report = StatusReport {
        state_dir: state_dir.display().to_string(),
        applied_version: policy.as_ref().map(|p| p.version()),
        mode: policy.as_ref().map(|p| p.mode().to_string()),
        revert_at_unix_ms: policy.as_ref().and_then(|p| p.revert_at()),
        reverted: policy.as_ref().is_some_and(|p| p.reverted_at(now_ms())),
        staged_set: policy.as_ref().and_then(|p| p.staged()).map(|s| (s.set().to_owned(), s.upserts().len())),
        rule_count: policy.as_ref().map(|p| p.rules().len()),
        persisted_error,
        table_present: table.is_some(),
        kill_switch_engaged: state_dir.join(KILL_SWITCH_MARKER).exists(),
        kernel_matches_persisted: None,
        differences: Vec::new(),
        sets: BTreeMap::new(),
        rules: Vec::new(),
        dropped: None,
        would_block: None,
    };
    let Some(table) = table else { return Ok(report) };
    report.sets = state::interval_counts(&table);
    if let Some(policy) = &policy {
        let expected = nft::expected_state(&DesiredTable::from_policy(&policy.effective_at(now_ms())));
        report.differences = table.differences(&expected);
        report.kernel_matches_persisted = Some(report.differences.is_empty());
    }
    // Rule ids in policy order when known, so rules with no hits still show; comments
    // otherwise.
    let mut hits: BTreeMap<String, RuleCounter> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    if let Some(policy) = &policy {
        for rule in policy.rules() {
            let comment = rule_comment(rule.id().as_str());
            hits.entry(comment.clone()).or_default();
            order.push(comment);
        }
    }
    for rule in &table.rules {
        let (Some(comment), Some(counter)) = (&rule.comment, rule.counter) else { continue };
        let slot = if comment == TERMINAL_DROP {
            report.dropped.get_or_insert_default()
        } else if comment == TERMINAL_WOULD_BLOCK {
            report.would_block.get_or_insert_default()
        } else {
            if !hits.contains_key(comment) {
                order.push(comment.clone());
            }
            hits.entry(comment.clone()).or_default()
        };
        slot.packets += counter.packets;
        slot.bytes += counter.bytes;
    }
    report.rules = order
        .into_iter()
        .map(|rule| {
            let c = hits[&rule];
            RuleHits { rule, packets: c.packets, bytes: c.bytes }
        })
        .collect();
    Ok(report)
}

impl StatusReport {
    /// The human rendering.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "state dir:        {}", self.state_dir);
        match (&self.applied_version, &self.persisted_error) {
            (_, Some(err)) => {
                let _ = writeln!(w, "applied policy:   unreadable: {err}");
            }
            (Some(v), None) => {
                let _ = writeln!(
                    w,
                    "applied policy:   version {v}, mode {}, {} rule(s)",
                    self.mode.as_deref().unwrap_or("?"),
                    self.rule_count.unwrap_or(0)
                );
            }
            (None, None) => {
                let _ = writeln!(w, "applied policy:   none persisted");
            }
        }
        if let Some(at) = self.revert_at_unix_ms {
            let at = u64::try_from(at).map_or_else(
                |_| at.to_string(),
                |ms| {
                    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
                    humantime::format_rfc3339_seconds(t).to_string()
                },
            );
            let _ = match self.reverted {
                true => writeln!(
                    w,
                    "confirm deadline: {at}, PASSED unconfirmed: enforced as its simulation (nothing is dropped)"
                ),
                false => writeln!(w, "confirm deadline: {at}: reverts to simulation then unless confirmed"),
            };
        }
        if let Some((set, rules)) = &self.staged_set {
            let _ = writeln!(
                w,
                "staged set:       {set}: {rules} rule(s) counted (staged:<rule>) beside the enforced ones, never acted on"
            );
        }
        let table = match (self.table_present, self.kernel_matches_persisted) {
            (false, _) => "absent",
            (true, Some(true)) => "present, matches the applied policy",
            (true, Some(false)) => {
                "present, DIFFERS from the applied policy (drift; a running agent repairs it)"
            }
            (true, None) => "present",
        };
        let _ = writeln!(w, "table inet innerwall: {table}");
        for d in &self.differences {
            let _ = writeln!(w, "  - {d}");
        }
        if self.kill_switch_engaged {
            let _ = writeln!(
                w,
                "kill switch:      engaged (`innerwall-agent down`): policies are held, not installed, until `innerwall-agent up`"
            );
        }
        if !self.sets.is_empty() {
            let _ = writeln!(w, "sets (intervals):");
            for (name, n) in &self.sets {
                let _ = writeln!(w, "  {name:<24} {n}");
            }
        }
        if !self.rules.is_empty() {
            let _ = writeln!(w, "rule hits:");
            for r in &self.rules {
                let _ = writeln!(w, "  {:<40} {:>10} packets {:>12} bytes", r.rule, r.packets, r.bytes);
            }
        }
        if let Some(c) = self.dropped {
            let _ = writeln!(w, "dropped:          {} packets, {} bytes", c.packets, c.bytes);
        }
        if let Some(c) = self.would_block {
            let _ = writeln!(w, "would block:      {} packets, {} bytes", c.packets, c.bytes);
        }
        out
    }
}
