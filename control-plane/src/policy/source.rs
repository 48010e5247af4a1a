//! The authored source of a rendered policy (issue 31, rollback): the rulesets that selected the
//! workload, with their rules, and the services and address groups those name, as they were when
//! a version was rendered, so a rollback can render an earlier version's source again against
//! the registry as it is now. Pure: no I/O.
//!
//! Stored in parts: each ruleset, service and address group as a [`Part`] by content
//! (`policy_source_parts`, written once however many sources name it), and a source as the list
//! of its parts' digests (`policy_sources`). 10,000 distinct policies over 1,000 rulesets store
//! 1,000-odd parts and 10,000 short lists, not 10,000 copies of the rulesets.

use std::collections::{BTreeMap, BTreeSet};

use innerwall_wire::policy::Cidr;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::policy::model::{
    AddressGroup, AuthoredModel, ModelError, Peer, Rule, Ruleset, Selector, Service, ServiceEntry,
};

/// One source: its rulesets in render order, its services and groups in id order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Source {
    rulesets: Vec<SourceRuleset>,
    services: Vec<SourceService>,
    groups: Vec<SourceGroup>,
}

/// One stored part of sources, in a canonical JSON form named by its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    Ruleset(SourceRuleset),
    Service(SourceService),
    Group(SourceGroup),
}

/// A SHA-256.
pub type Digest = [u8; 32];

fn sha256(bytes: &[u8]) -> Digest {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().try_into().expect("32 bytes")
}

impl Part {
    /// Canonical bytes and their SHA-256.
    pub fn encode(&self) -> (Vec<u8>, Digest) {
        let bytes = serde_json::to_vec(self).expect("a part is plain data");
        let digest = sha256(&bytes);
        (bytes, digest)
    }
}

/// A source as stored: its parts' digests, concatenated in order, and their SHA-256.
pub fn source_digest(parts: &[u8]) -> Digest {
    sha256(parts)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRuleset {
    id: Uuid,
    name: String,
    rules: Vec<SourceRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRule {
    id: Uuid,
    name: String,
    peers: Vec<SourcePeer>,
    services: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourcePeer {
    Workloads(BTreeMap<String, Vec<String>>),
    AddressGroup(Uuid),
    Cidr(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceService {
    id: Uuid,
    name: String,
    entries: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceGroup {
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

/// One ruleset as a part, with the services and address groups its enabled rules name.
fn ruleset_part(rs: &Ruleset) -> (Part, BTreeSet<Uuid>, BTreeSet<Uuid>) {
    let mut services = BTreeSet::new();
    let mut groups = BTreeSet::new();
    let rules = rs
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
        .collect();
    (Part::Ruleset(SourceRuleset { id: rs.id, name: rs.name.clone(), rules }), services, groups)
}

/// The sources of one render's policies, each part encoded once however many sources name it.
#[derive(Debug)]
pub struct Sources<'m> {
    model: &'m AuthoredModel,
    rulesets: BTreeMap<usize, (Digest, BTreeSet<Uuid>, BTreeSet<Uuid>)>,
    services: BTreeMap<Uuid, Option<Digest>>,
    groups: BTreeMap<Uuid, Option<Digest>>,
    /// Every part encoded so far: digest → canonical bytes.
    pub parts: BTreeMap<Digest, Vec<u8>>,
}

impl<'m> Sources<'m> {
    pub fn new(model: &'m AuthoredModel) -> Self {
        Sources {
            model,
            rulesets: BTreeMap::new(),
            services: BTreeMap::new(),
            groups: BTreeMap::new(),
            parts: BTreeMap::new(),
        }
    }

    fn add(&mut self, part: &Part) -> Digest {
        let (bytes, digest) = part.encode();
        self.parts.entry(digest).or_insert(bytes);
        digest
    }

    /// The source of a policy rendered from the model's rulesets at `rulesets` (indices, in
    /// render order; only enabled rules count), as stored: its parts' digests, concatenated —
    /// the rulesets', then the services' and the groups' they name, each in id order. Management
    /// access is not part of it: a workload always keeps the current one, which only narrows.
    pub fn source(&mut self, rulesets: &[usize]) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 * (rulesets.len() + 8));
        let (mut services, mut groups) = (BTreeSet::new(), BTreeSet::new());
        for &at in rulesets {
            if !self.rulesets.contains_key(&at) {
                let (part, s, g) = ruleset_part(&self.model.rulesets[at]);
                let digest = self.add(&part);
                self.rulesets.insert(at, (digest, s, g));
            }
            let (digest, s, g) = &self.rulesets[&at];
            out.extend_from_slice(digest);
            services.extend(s.iter().copied());
            groups.extend(g.iter().copied());
        }
        for id in services {
            let digest = match self.services.get(&id) {
                Some(d) => *d,
                None => {
                    let part = self.model.services.get(&id).map(|s| {
                        Part::Service(SourceService {
                            id: s.id,
                            name: s.name.clone(),
                            entries: s.entries.iter().map(ToString::to_string).collect(),
                        })
                    });
                    let d = part.map(|p| self.add(&p));
                    self.services.insert(id, d);
                    d
                }
            };
            out.extend(digest.iter().flatten());
        }
        for id in groups {
            let digest = match self.groups.get(&id) {
                Some(d) => *d,
                None => {
                    let part = self.model.address_groups.get(&id).map(|g| {
                        Part::Group(SourceGroup {
                            id: g.id,
                            name: g.name.clone(),
                            cidrs: g.cidrs.iter().map(ToString::to_string).collect(),
                        })
                    });
                    let d = part.map(|p| self.add(&p));
                    self.groups.insert(id, d);
                    d
                }
            };
            out.extend(digest.iter().flatten());
        }
        out
    }
}

impl Source {
    /// A stored source read back: its parts in order.
    pub fn from_parts(parts: impl IntoIterator<Item = Part>) -> Source {
        let mut source = Source::default();
        for part in parts {
            match part {
                Part::Ruleset(r) => source.rulesets.push(r),
                Part::Service(s) => source.services.push(s),
                Part::Group(g) => source.groups.push(g),
            }
        }
        source
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
