//! The JSON policy: a hand-writable JSON form of a `WorkloadPolicy`, read by the hidden dev
//! commands `apply-file` and `render-file` (tests, the demo, break-glass debugging); canonical
//! bytes are accepted too. Not the persisted policy (`enforce::persist`), which is binary and
//! checksummed and only the agent writes.
//!
//! ```json
//! {"version": 3, "mode": "enforcement",
//!  "rules": [{"id": "web/tcp", "ports": ["80", "8000-8010"], "peers": ["10.0.0.0/24", "fd00::/64"]}]}
//! ```

use innerwall_wire::policy::{Cidr, Mode, PolicyError, PortRange, ResolvedRule, RuleId, WorkloadPolicy};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyJson {
    pub version: u64,
    pub mode: String,
    #[serde(default)]
    pub rules: Vec<RuleJson>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleJson {
    pub id: String,
    #[serde(default)]
    pub ports: Vec<String>,
    #[serde(default)]
    pub peers: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyJsonError {
    #[error("policy JSON does not parse: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid policy: {0}")]
    Policy(#[from] PolicyError),
    #[error("port range {0:?}: write N or N-M")]
    Ports(String),
}

impl PolicyJson {
    pub fn to_policy(&self) -> Result<WorkloadPolicy, PolicyJsonError> {
        let mode: Mode = self.mode.parse()?;
        let mut rules = Vec::new();
        for r in &self.rules {
            let id = RuleId::parse(&r.id)?;
            let mut ports = Vec::new();
            for p in &r.ports {
                let bad = || PolicyJsonError::Ports(p.clone());
                let (a, b) = p.split_once('-').unwrap_or((p, p));
                let (a, b) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
                ports.push(PortRange::new(a, b)?);
            }
            let peers = r.peers.iter().map(|c| Cidr::parse(c)).collect::<Result<Vec<_>, _>>()?;
            rules.push(ResolvedRule::new(id, ports, peers)?);
        }
        Ok(WorkloadPolicy::new(self.version, mode, rules)?)
    }

    pub fn from_policy(policy: &WorkloadPolicy) -> PolicyJson {
        PolicyJson {
            version: policy.version(),
            mode: policy.mode().to_string(),
            rules: policy
                .rules()
                .map(|r| RuleJson {
                    id: r.id().to_string(),
                    ports: r.ports().iter().map(ToString::to_string).collect(),
                    peers: r.peers().iter().map(ToString::to_string).collect(),
                })
                .collect(),
        }
    }
}

/// Parses what `apply-file` / `render-file` read: a JSON policy when it starts with `{`,
/// canonical bytes otherwise.
pub fn parse(bytes: &[u8]) -> Result<WorkloadPolicy, PolicyJsonError> {
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
        serde_json::from_slice::<PolicyJson>(bytes)?.to_policy()
    } else {
        Ok(WorkloadPolicy::from_canonical_bytes(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_canonical_forms_parse_to_the_same_policy() {
        let text = r#"{"version": 3, "mode": "simulation", "rules": [
            {"id": "web/tcp", "ports": ["443", "80-81"], "peers": ["10.0.0.7/32", "fd00::/64"]},
            {"id": "ping/icmp", "peers": ["10.0.0.0/8"]}]}"#;
        let policy = parse(text.as_bytes()).unwrap();
        assert_eq!(policy.version(), 3);
        assert_eq!(policy.rules().len(), 2);
        assert_eq!(parse(&policy.canonical_bytes()).unwrap(), policy);
        let back = serde_json::to_string(&PolicyJson::from_policy(&policy)).unwrap();
        assert_eq!(parse(back.as_bytes()).unwrap(), policy);
        assert!(parse(br#"{"version": 1, "mode": "enforce"}"#).unwrap_err().to_string().contains("mode"));
        assert!(
            parse(br#"{"version": 1, "mode": "enforcement", "rules": [{"id": "a/tcp", "ports": ["x"]}]}"#)
                .is_err()
        );
        // Peers are CIDRs by the one rule: a bare address or host bits are refused, named.
        for (peer, canonical) in [("10.0.0.7", "10.0.0.7/32"), ("10.0.0.7/8", "10.0.0.0/8")] {
            let text = format!(
                r#"{{"version": 1, "mode": "simulation", "rules": [{{"id": "p/icmp", "peers": ["{peer}"]}}]}}"#
            );
            let err = parse(text.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(&format!("write {canonical}")), "{err}");
        }
    }
}
