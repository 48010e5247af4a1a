//! The authored source of a rendered policy (issue 31, rollback): the rulesets that selected the
//! workload, with their rules, the services and address groups those name, and the management
//! access, as they were when a version was rendered. Stored by content with each new version
//! (`policy_sources`), so a rollback can render an earlier version's source again against the
//! registry as it is now. Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use innerwall_wire::policy::Cidr;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::policy::model::{
    AddressGroup, AuthoredModel, ModelError, Peer, Rule, Ruleset, Selector, Service, ServiceEntry,
};

/// One source, in a canonical JSON form: its SHA-256 names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    rulesets: Vec<SourceRuleset>,
    services: Vec<SourceService>,
    groups: Vec<SourceGroup>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SourceRuleset {
    id: Uuid,
    name: String,
    rules: Vec<SourceRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SourceRule {
    id: Uuid,
    name: String,
    peers: Vec<SourcePeer>,
    services: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SourcePeer {
    Workloads(BTreeMap<String, Vec<String>>),
    AddressGroup(Uuid),
    Cidr(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SourceService {
    id: Uuid,
    name: String,
    entries: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SourceGroup {
    id: Uuid,
    name: String,
    cidrs: Vec<String>,
}

fn selector_map(selector: &Selector) -> BTreeMap<String, Vec<String>> {
    selector
        .matches()
        .iter()
        .map(|(k, vs)| (k.to_string(), vs.iter().map(|v| v.as_str().to_owned()).collect()))
        .collect()
}

impl Source {
    /// The source of a policy rendered from `rulesets` (the enabled rulesets that selected the
    /// workload, in render order; only their enabled rules count). Management access is not part
    /// of it: a workload always keeps the current one, which only narrows.
    pub fn of(model: &AuthoredModel, rulesets: &[&Ruleset]) -> Source {
        let mut services = BTreeSet::new();
        let mut groups = BTreeSet::new();
        let rulesets = rulesets
            .iter()
            .map(|rs| SourceRuleset {
                id: rs.id,
                name: rs.name.clone(),
                rules: rs
                    .rules
                    .iter()
                    .filter(|r| r.enabled)
                    .map(|r| {
                        services.extend(r.services.iter().copied());
                        let peers = r
                            .peers
                            .iter()
                            .map(|p| match p {
                                Peer::Workloads(s) => SourcePeer::Workloads(selector_map(s)),
                                Peer::AddressGroup(g) => {
                                    groups.insert(*g);
                                    SourcePeer::AddressGroup(*g)
                                }
                                Peer::Cidr(c) => SourcePeer::Cidr(c.to_string()),
                            })
                            .collect();
                        SourceRule { id: r.id, name: r.name.clone(), peers, services: r.services.clone() }
                    })
                    .collect(),
            })
            .collect();
        Source {
            rulesets,
            services: services
                .iter()
                .filter_map(|id| model.services.get(id))
                .map(|s| SourceService {
                    id: s.id,
                    name: s.name.clone(),
                    entries: s.entries.iter().map(ToString::to_string).collect(),
                })
                .collect(),
            groups: groups
                .iter()
                .filter_map(|id| model.address_groups.get(id))
                .map(|g| SourceGroup {
                    id: g.id,
                    name: g.name.clone(),
                    cidrs: g.cidrs.iter().map(ToString::to_string).collect(),
                })
                .collect(),
        }
    }

    /// Canonical bytes (JSON; every collection in a fixed order) and their SHA-256.
    pub fn encode(&self) -> (Vec<u8>, Vec<u8>) {
        let bytes = serde_json::to_vec(self).expect("a source is plain data");
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref().to_vec();
        (bytes, digest)
    }

    /// The model this source renders: its rulesets (each applied to whoever it is pinned to,
    /// see `render::render`), services and groups.
    pub fn model(&self) -> Result<AuthoredModel, ModelError> {
        let mut model = AuthoredModel::default();
        for s in &self.services {
            let entries = s.entries.iter().map(|e| ServiceEntry::parse(e)).collect::<Result<_, _>>()?;
            model.services.insert(s.id, Service { id: s.id, name: s.name.clone(), entries });
        }
        for g in &self.groups {
            let cidrs = g.cidrs.iter().map(|c| Cidr::parse_lenient(c)).collect::<Result<_, _>>()?;
            model.address_groups.insert(g.id, AddressGroup { id: g.id, name: g.name.clone(), cidrs });
        }
        for rs in &self.rulesets {
            let mut rules = Vec::new();
            for r in &rs.rules {
                let peers = r
                    .peers
                    .iter()
                    .map(|p| {
                        Ok(match p {
                            SourcePeer::Workloads(m) => Peer::Workloads(Selector::from_strings(m.clone())?),
                            SourcePeer::AddressGroup(g) => Peer::AddressGroup(*g),
                            SourcePeer::Cidr(c) => Peer::Cidr(Cidr::parse_lenient(c)?),
                        })
                    })
                    .collect::<Result<_, ModelError>>()?;
                rules.push(Rule {
                    id: r.id,
                    name: r.name.clone(),
                    enabled: true,
                    peers,
                    services: r.services.clone(),
                });
            }
            model.rulesets.push(Ruleset {
                id: rs.id,
                name: rs.name.clone(),
                enabled: true,
                scope: Selector::default(),
                rules,
            });
        }
        Ok(model)
    }
}
