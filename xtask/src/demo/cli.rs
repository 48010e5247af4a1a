//! The `--json` output the demo reads from `innerwall` and `innerwall-agent`: only the fields it
//! uses, so other fields may come and go (the human tables are not read at all).

use anyhow::{Context, Result};
use serde::{Deserialize, de::DeserializeOwned};

/// Parses the `--json` stdout of `command` (named in the error).
pub fn parse<T: DeserializeOwned>(stdout: &str, command: &str) -> Result<T> {
    serde_json::from_str(stdout).with_context(|| format!("while reading `{command}`"))
}

/// `innerwall token mint --json`.
#[derive(Debug, Deserialize)]
pub struct MintedToken {
    pub token: String,
}

/// A row of `innerwall workload list --json`.
#[derive(Debug, Deserialize)]
pub struct Workload {
    pub id: String,
    pub addresses: Vec<Address>,
}

/// One reported address with its standing (address trust): `accepted` ones are rendered.
#[derive(Debug, Deserialize)]
pub struct Address {
    pub address: String,
    pub standing: String,
}

/// A row of `innerwall workload status --json`.
#[derive(Debug, Deserialize)]
pub struct SyncStatus {
    pub id: String,
    pub state: String,
    pub applied_version: u64,
    /// Absent (null) until the workload has a rendered policy.
    pub latest_version: Option<u64>,
}

impl SyncStatus {
    /// SYNCED, and the version the agent applied is the latest one rendered for it.
    pub fn converged(&self) -> bool {
        self.state == "SYNCED" && self.latest_version == Some(self.applied_version)
    }
}

/// `innerwall workload policy ID --json`.
#[derive(Debug, Deserialize)]
pub struct RenderedPolicy {
    pub version: u64,
    pub rules: Vec<RenderedRule>,
}

#[derive(Debug, Deserialize)]
pub struct RenderedRule {
    pub rule_id: String,
    /// CIDRs.
    pub peers: Vec<String>,
}

/// A row of `innerwall flows list --json`.
#[derive(Debug, Deserialize)]
pub struct FlowRecord {
    pub src_address: String,
    pub dst_port: u64,
    pub decision: u64,
}

impl FlowRecord {
    /// The control plane's decision numbers (`flows::decision_name`).
    pub const ALLOWED: u64 = 2;
    pub const BLOCKED: u64 = 4;
}

/// `innerwall workload verdict --json`.
#[derive(Debug, Deserialize)]
pub struct VerdictJson {
    pub outcome: String,
    pub workloads: Vec<VerdictWorkload>,
}

#[derive(Debug, Deserialize)]
pub struct VerdictWorkload {
    pub id: String,
    pub latest_version: Option<u64>,
    pub reasons: Vec<serde_json::Value>,
}

impl VerdictJson {
    /// Whether a workload's reasons name `addr` among the peers it would block.
    pub fn would_block_from(&self, addr: &str) -> bool {
        self.workloads.iter().flat_map(|w| &w.reasons).any(|r| {
            r["reason"] == "would-block"
                && r["peers"].as_array().is_some_and(|peers| peers.iter().any(|p| p["src"] == addr))
        })
    }

    /// The version the verdict judged for workload `id`.
    pub fn judged_version(&self, id: &str) -> Option<u64> {
        self.workloads.iter().find(|w| w.id == id).and_then(|w| w.latest_version)
    }
}

/// `innerwall-agent status --json`.
#[derive(Debug, Deserialize)]
pub struct AgentStatus {
    pub rules: Vec<RuleHits>,
}

/// One rule's kernel counters.
#[derive(Debug, Deserialize)]
pub struct RuleHits {
    pub packets: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_it_needs_and_ignores_the_rest() {
        let rows: Vec<SyncStatus> = parse(
            r#"[{"id": "5214682e", "hostname": "db", "applied_version": 3, "latest_version": 3,
                 "state": "SYNCED", "detail": "a \"q\" \u00e9", "last_apply_failed_at": null},
                {"id": "77", "hostname": "web", "applied_version": 0, "latest_version": null,
                 "state": "PENDING", "detail": ""}]"#,
            "workload status --json",
        )
        .unwrap();
        assert_eq!(rows[0].id, "5214682e");
        assert!(rows[0].converged());
        assert_eq!(rows[1].latest_version, None);
        assert!(!rows[1].converged());

        let workloads: Vec<Workload> = parse(
            r#"[{"id": "5214682e", "labels": {"app": "batch"},
                 "addresses": [{"address": "10.77.0.30", "standing": "accepted"}], "retired": false}]"#,
            "workload list --json",
        )
        .unwrap();
        assert_eq!(workloads[0].addresses[0].address, "10.77.0.30");
        assert_eq!(workloads[0].addresses[0].standing, "accepted");

        let policy: RenderedPolicy = parse(
            r#"{"workload": "w", "version": 2, "mode": "enforcement", "rules": [
                  {"rule_id": "payments/from-web", "protocol": "tcp", "ports": ["5432"],
                   "peers": ["10.77.0.20/32"]}]}"#,
            "workload policy --json",
        )
        .unwrap();
        assert_eq!((policy.version, policy.rules[0].rule_id.as_str()), (2, "payments/from-web"));
        assert_eq!(policy.rules[0].peers, ["10.77.0.20/32"]);
    }

    #[test]
    fn errors_name_the_command_and_the_problem() {
        let err = parse::<MintedToken>(r#"{"id": "t1"}"#, "token mint --json").unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            "while reading `token mint --json`: missing field `token` at line 1 column 12"
        );
        for bad in ["", "{", "[1,]", "{\"token\" 1}", "\"open", "{\"token\": \"t\"} x"] {
            assert!(parse::<MintedToken>(bad, "token mint --json").is_err(), "{bad:?} parsed");
        }
    }
}
