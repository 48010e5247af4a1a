//! Narrowed renders (POL-7), pure: which workloads' rendered policies a change can touch, so only
//! those are rendered again (`render::render_only`) and every other keeps its policy. Decision 2
//! (seed 003) is kept exactly: the narrowed render equals the full render, which stays for
//! start-up and as the oracle (`narrowed_render_equals_full_render`).
//!
//! A workload's policy is made of the rulesets whose scope selects it (and the staged rulesets
//! touching it, and its pin), their rules' services and address groups, the host routes of the
//! workloads their peer selectors select, its mode, deadline and management access. So a change
//! to one workload touches that workload, and every workload a *consumer* (a ruleset, staged
//! ruleset or pin) applies to with a rule whose peer selectors selected it before or after,
//! unless that rule selected it both times with the same addresses; a change to an address group or a service
//! touches what the consumers naming it apply to; a change to a ruleset touches what its old and
//! new scope (and a staged ruleset of its name) select. An inverted index from label terms,
//! address groups and services to the consumers that mention them finds those consumers without
//! a scan.

use std::collections::{BTreeMap, BTreeSet};

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use uuid::Uuid;

use crate::policy::model::{AuthoredModel, Peer, RegisteredWorkload, Rule, Ruleset, Selector};
use crate::policy::render::LabelIndex;

/// What a change touched, when the change says (POL-7): the publish then renders only the
/// workloads it can touch (`affected`), not the estate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touched {
    /// The workload's labels were edited in this transaction (its label-history row closed in
    /// it holds the labels before).
    Labels(WorkloadId),
    /// The address group of this name was created, changed or deleted.
    AddressGroup(String),
    /// The service of this name was created, changed or deleted.
    Service(String),
    /// The ruleset of this name was created, changed or deleted (narrowed when the replica
    /// kept the inputs from before it: `policy::inputs`).
    Ruleset(String),
    /// This workload was enrolled (registered with its labels, addresses and ranges) in this
    /// transaction, replacing none.
    Enrolled(WorkloadId),
}

/// One change a narrowed render is told of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<'a> {
    /// A workload as it was and as it is (`None`: absent: new, or gone): its labels, addresses,
    /// mode, deadline, pin or management access changed.
    Workload { before: Option<&'a RegisteredWorkload>, after: Option<&'a RegisteredWorkload> },
    /// An address group's CIDRs changed (or it was created or deleted).
    AddressGroup(Uuid),
    /// A service's entries changed (or it was created or deleted).
    Service(Uuid),
    /// A ruleset as it was and as it is (`None`: absent), or a staged one of that name.
    Ruleset { before: Option<&'a Ruleset>, after: Option<&'a Ruleset> },
}

/// Who renders a rule: the workloads a ruleset (or a staged ruleset) applies to, or a pinned
/// workload.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Applies {
    Scopes(Vec<Selector>),
    Workload(WorkloadId),
}

/// A rule of a consumer: (consumer, rule) indices.
type RuleAt = (usize, usize);

/// The consumers of a model with the terms that find them: an inverted index from label terms,
/// address groups and services to the rulesets, staged rulesets and pins whose rules name them.
/// Depends on the model's rules only, so a replica keeps it between renders (`policy::inputs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumers {
    applies: Vec<Applies>,
    /// The peer selectors of the consumers' rules.
    selectors: Vec<Selector>,
    /// Label key → value → the (consumer, rule) pairs with a peer selector (an index into
    /// `selectors`) that names the term.
    by_term: BTreeMap<LabelKey, BTreeMap<LabelValue, Vec<(RuleAt, usize)>>>,
    by_group: BTreeMap<Uuid, BTreeSet<usize>>,
    by_service: BTreeMap<Uuid, BTreeSet<usize>>,
}

impl Consumers {
    pub fn new(model: &AuthoredModel) -> Consumers {
        fn enabled(rs: &Ruleset) -> Vec<&Rule> {
            rs.rules.iter().filter(|r| r.enabled).collect()
        }
        let mut consumers: Vec<(Applies, Vec<&Rule>)> = Vec::new();
        for rs in model.rulesets.iter().filter(|rs| rs.enabled) {
            consumers.push((Applies::Scopes(vec![rs.scope.clone()]), enabled(rs)));
        }
        for staged in &model.staged {
            let mut scopes = vec![staged.ruleset.scope.clone()];
            scopes.extend(
                model.rulesets.iter().filter(|r| r.name == staged.ruleset.name).map(|r| r.scope.clone()),
            );
            consumers.push((Applies::Scopes(scopes), enabled(&staged.ruleset)));
        }
        for (id, pin) in &model.pinned {
            let rules = pin.model.rulesets.iter().flat_map(|rs| &rs.rules).collect();
            consumers.push((Applies::Workload(*id), rules));
        }
        let mut index = Consumers {
            applies: Vec::new(),
            selectors: Vec::new(),
            by_term: BTreeMap::new(),
            by_group: BTreeMap::new(),
            by_service: BTreeMap::new(),
        };
        for (c, (_, rules)) in consumers.iter().enumerate() {
            for (r, rule) in rules.iter().enumerate() {
                for service in &rule.services {
                    index.by_service.entry(*service).or_default().insert(c);
                }
                for peer in &rule.peers {
                    match peer {
                        Peer::AddressGroup(g) => {
                            index.by_group.entry(*g).or_default().insert(c);
                        }
                        Peer::Workloads(selector) => {
                            let at = index.selectors.len();
                            index.selectors.push(selector.clone());
                            for (key, values) in selector.matches() {
                                let by_value = index.by_term.entry(key.clone()).or_default();
                                for value in values {
                                    by_value.entry(value.clone()).or_default().push(((c, r), at));
                                }
                            }
                        }
                        Peer::Cidr(_) => {}
                    }
                }
            }
        }
        index.applies = consumers.into_iter().map(|(applies, _)| applies).collect();
        index
    }

    /// The (consumer, rule) pairs with a peer selector that selects `w`: the rules whose peers
    /// hold its addresses.
    fn selecting(&self, w: &RegisteredWorkload) -> BTreeSet<RuleAt> {
        let mut found = BTreeSet::new();
        for (key, value) in &w.labels {
            let Some(rules) = self.by_term.get(key).and_then(|values| values.get(value)) else { continue };
            for (rule, selector) in rules {
                if !found.contains(rule) && self.selectors[*selector].selects(&w.labels) {
                    found.insert(*rule);
                }
            }
        }
        found
    }
}

/// The workloads of `workloads` (the registry after the changes, in id order) whose rendered
/// policy `changes` can change, given `model` (the authored model after them).
pub fn affected(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    changes: &[Change<'_>],
) -> BTreeSet<WorkloadId> {
    affected_indexed(model, workloads, &LabelIndex::new(workloads), &Consumers::new(model), changes)
}

/// [`affected`], with the [`LabelIndex`] of `workloads` and the [`Consumers`] of `model` at hand.
pub fn affected_indexed(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    labels: &LabelIndex,
    index: &Consumers,
    changes: &[Change<'_>],
) -> BTreeSet<WorkloadId> {
    let mut consumers: BTreeSet<usize> = BTreeSet::new();
    let mut scopes: Vec<&Selector> = Vec::new();
    let mut out: BTreeSet<WorkloadId> = BTreeSet::new();
    for change in changes {
        match change {
            Change::Workload { before, after } => {
                out.extend(before.iter().chain(after.iter()).map(|w| w.id));
                let was = before.map(|w| index.selecting(w)).unwrap_or_default();
                let is = after.map(|w| index.selecting(w)).unwrap_or_default();
                // A rule that holds its addresses both times, the same ones, is as it was.
                let moved = before.map(|w| &w.addresses) != after.map(|w| &w.addresses);
                let rules: Vec<&RuleAt> =
                    if moved { was.union(&is).collect() } else { was.symmetric_difference(&is).collect() };
                consumers.extend(rules.into_iter().map(|(c, _)| *c));
            }
            Change::AddressGroup(g) => consumers.extend(index.by_group.get(g).into_iter().flatten()),
            Change::Service(s) => consumers.extend(index.by_service.get(s).into_iter().flatten()),
            Change::Ruleset { before, after } => {
                scopes.extend(before.iter().chain(after.iter()).map(|rs| &rs.scope));
                let name = before.or(*after).map(|rs| rs.name.as_str());
                for staged in model.staged.iter().filter(|s| Some(s.ruleset.name.as_str()) == name) {
                    scopes.push(&staged.ruleset.scope);
                }
            }
        }
    }
    for c in consumers {
        match &index.applies[c] {
            Applies::Scopes(s) => scopes.extend(s.iter()),
            Applies::Workload(id) => {
                out.insert(*id);
            }
        }
    }
    for scope in scopes {
        out.extend(labels.select(scope).into_iter().map(|i| workloads[i].id));
    }
    out.retain(|id| workloads.binary_search_by_key(id, |w| w.id).is_ok());
    out
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use innerwall_wire::policy::{Cidr, Mode};
    use proptest::prelude::*;
    use proptest::sample::select;

    use super::*;
    use crate::policy::model::{AddressGroup, Pin, Service, ServiceEntry, StagedRuleset};
    use crate::policy::render::{render, render_only};

    const VALUES: &[&str] = &["a", "b", "c"];

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn wid(n: u128) -> WorkloadId {
        WorkloadId::from_uuid(id(0x1000 + n)).unwrap()
    }

    fn sel(key: &str, value: &str) -> Selector {
        Selector::from_strings([(key.to_owned(), vec![value.to_owned()])]).unwrap()
    }

    fn workload(n: u128, app: &str, env: &str, addresses: &[u8]) -> RegisteredWorkload {
        RegisteredWorkload {
            id: wid(n),
            mode: Mode::Enforcement,
            revert_at: None,
            labels: [("app", app), ("env", env)]
                .iter()
                .map(|(k, v)| (LabelKey::new(k).unwrap(), LabelValue::new(v).unwrap()))
                .collect(),
            addresses: addresses.iter().map(|a| IpAddr::from([10, 0, 0, *a])).collect(),
        }
    }

    /// A rule: its peers (0: a selector on app, 1: on env, 2: group, 3: a CIDR), its services.
    type RuleShape = (Vec<(u8, &'static str)>, Vec<u8>, bool);
    /// A ruleset: its scope (key, value), enabled, its rules.
    type SetShape = (bool, &'static str, bool, Vec<RuleShape>);

    fn rule(n: u128, (peers, services, enabled): &RuleShape) -> Rule {
        Rule {
            id: id(n),
            name: format!("r{n}"),
            enabled: *enabled,
            peers: peers
                .iter()
                .map(|(kind, value)| match kind % 4 {
                    0 => Peer::Workloads(sel("app", value)),
                    1 => Peer::Workloads(sel("env", value)),
                    2 => Peer::AddressGroup(id(900 + u128::from(kind / 4 % 2))),
                    _ => Peer::Cidr(Cidr::parse("192.0.2.0/24").unwrap()),
                })
                .collect(),
            services: services.iter().map(|s| id(800 + u128::from(s % 2))).collect(),
        }
    }

    fn ruleset(n: usize, (on_app, value, enabled, rules): &SetShape) -> Ruleset {
        Ruleset {
            id: id(100 + n as u128),
            name: format!("rs{n}"),
            enabled: *enabled,
            scope: sel(if *on_app { "app" } else { "env" }, value),
            rules: rules.iter().enumerate().map(|(k, r)| rule(1000 + (n * 10 + k) as u128, r)).collect(),
        }
    }

    fn model(sets: &[SetShape]) -> AuthoredModel {
        let service = |n: u128, port: u32| Service {
            id: id(800 + n),
            name: format!("s{n}"),
            entries: vec![ServiceEntry::parse(&format!("tcp:{port}")).unwrap()],
        };
        let group = |n: u128, cidr: &str| AddressGroup {
            id: id(900 + n),
            name: format!("g{n}"),
            cidrs: [Cidr::parse(cidr).unwrap()].into(),
        };
        AuthoredModel {
            services: [service(0, 80), service(1, 443)].into_iter().map(|s| (s.id, s)).collect(),
            address_groups: [group(0, "198.51.100.0/24"), group(1, "203.0.113.0/24")]
                .into_iter()
                .map(|g| (g.id, g))
                .collect(),
            rulesets: sets.iter().enumerate().map(|(n, s)| ruleset(n, s)).collect(),
            ..AuthoredModel::default()
        }
    }

    fn rule_shape() -> impl Strategy<Value = RuleShape> {
        (
            prop::collection::vec((0u8..8, select(VALUES)), 0..3),
            prop::collection::vec(0u8..2, 1..3),
            prop::bool::weighted(0.85),
        )
    }

    fn set_shape() -> impl Strategy<Value = SetShape> {
        (any::<bool>(), select(VALUES), prop::bool::weighted(0.85), prop::collection::vec(rule_shape(), 0..3))
    }

    /// One random change of the estate or the model, applied to both.
    #[derive(Debug, Clone)]
    enum Edit {
        Relabel(usize, &'static str, &'static str),
        Readdress(usize, Vec<u8>),
        Add(&'static str, &'static str, Vec<u8>),
        Remove(usize),
        Mode(usize),
        Group(u8),
        Service(u8),
        Ruleset(usize, SetShape),
        DropRuleset(usize),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        let addresses = || prop::collection::vec(1u8..12, 0..3);
        prop_oneof![
            (0usize..16, select(VALUES), select(VALUES)).prop_map(|(i, a, e)| Edit::Relabel(i, a, e)),
            (0usize..16, addresses()).prop_map(|(i, a)| Edit::Readdress(i, a)),
            (select(VALUES), select(VALUES), addresses()).prop_map(|(a, e, x)| Edit::Add(a, e, x)),
            (0usize..16).prop_map(Edit::Remove),
            (0usize..16).prop_map(Edit::Mode),
            (0u8..2).prop_map(Edit::Group),
            (0u8..2).prop_map(Edit::Service),
            (0usize..6, set_shape()).prop_map(|(i, s)| Edit::Ruleset(i, s)),
            (0usize..6).prop_map(Edit::DropRuleset),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// POL-7, decision 2 kept exactly: after any one change, the workloads `affected` names,
        /// rendered alone, get what the full render gives them, and every other workload's full
        /// render is what it was before the change.
        #[test]
        fn narrowed_render_equals_full_render(
            estate in prop::collection::vec((select(VALUES), select(VALUES), prop::collection::vec(1u8..12, 0..3)), 0..12),
            sets in prop::collection::vec(set_shape(), 0..6),
            staged in prop::option::of((0usize..6, set_shape())),
            pinned in any::<bool>(),
            edit in edit(),
        ) {
            let workloads: Vec<RegisteredWorkload> = estate
                .iter()
                .enumerate()
                .map(|(n, (a, e, addrs))| workload(n as u128, a, e, addrs))
                .collect();
            let mut before = model(&sets);
            if let Some((n, shape)) = &staged {
                before.staged.push(StagedRuleset { stage: 1, ruleset: ruleset(*n, shape) });
            }
            if pinned && !workloads.is_empty() {
                before.pinned.insert(workloads[0].id, Pin { digest: vec![], model: model(&sets) });
            }
            let (mut after, mut registry) = (before.clone(), workloads.clone());
            let changes: Vec<Change<'_>>;
            let (old_w, old_rs);
            match &edit {
                Edit::Relabel(i, ..) | Edit::Readdress(i, ..) | Edit::Remove(i) | Edit::Mode(i)
                    if *i >= registry.len() => return Ok(()),
                Edit::Relabel(i, a, e) => {
                    registry[*i].labels = workload(0, a, e, &[]).labels;
                }
                Edit::Readdress(i, addrs) => {
                    registry[*i].addresses = addrs.iter().map(|a| IpAddr::from([10, 0, 0, *a])).collect();
                }
                Edit::Add(a, e, addrs) => registry.push(workload(99, a, e, addrs)),
                Edit::Remove(i) => {
                    registry.remove(*i);
                }
                Edit::Mode(i) => registry[*i].mode = Mode::Simulation,
                Edit::Group(g) => {
                    let group = after.address_groups.get_mut(&id(900 + u128::from(*g))).unwrap();
                    group.cidrs.insert(Cidr::parse("100.64.0.0/10").unwrap());
                }
                Edit::Service(s) => {
                    let service = after.services.get_mut(&id(800 + u128::from(*s))).unwrap();
                    service.entries.push(ServiceEntry::parse("udp:53").unwrap());
                }
                Edit::Ruleset(n, shape) => {
                    let new = ruleset(*n, shape);
                    match after.rulesets.iter_mut().find(|r| r.name == new.name) {
                        Some(current) => *current = new,
                        None => after.rulesets.push(new),
                    }
                }
                Edit::DropRuleset(n) => after.rulesets.retain(|r| r.name != format!("rs{n}")),
            }
            match &edit {
                Edit::Group(g) => changes = vec![Change::AddressGroup(id(900 + u128::from(*g)))],
                Edit::Service(s) => changes = vec![Change::Service(id(800 + u128::from(*s)))],
                Edit::Ruleset(n, _) | Edit::DropRuleset(n) => {
                    let name = format!("rs{n}");
                    old_rs = before.rulesets.iter().find(|r| r.name == name);
                    let new_rs = after.rulesets.iter().find(|r| r.name == name);
                    changes = vec![Change::Ruleset { before: old_rs, after: new_rs }];
                }
                Edit::Add(..) => changes = vec![Change::Workload { before: None, after: registry.last() }],
                Edit::Remove(i) => changes = vec![Change::Workload { before: Some(&workloads[*i]), after: None }],
                Edit::Relabel(i, ..) | Edit::Readdress(i, ..) | Edit::Mode(i) => {
                    old_w = &workloads[*i];
                    changes = vec![Change::Workload { before: Some(old_w), after: Some(&registry[*i]) }];
                }
            }
            let full_before = render(&before, &workloads).unwrap();
            let full_after = render(&after, &registry).unwrap();
            // The label index kept between renders follows a relabel by `relabel`.
            let labels = match &edit {
                Edit::Relabel(i, ..) => {
                    let mut labels = LabelIndex::new(&workloads);
                    labels.relabel(*i, &workloads[*i].labels, &registry[*i].labels);
                    prop_assert_eq!(&labels, &LabelIndex::new(&registry));
                    labels
                }
                _ => LabelIndex::new(&registry),
            };
            let touched = affected_indexed(&after, &registry, &labels, &Consumers::new(&after), &changes);
            prop_assert_eq!(&touched, &affected(&after, &registry, &changes));
            let narrowed = render_only(&after, &registry, &labels, &touched).unwrap();
            prop_assert_eq!(narrowed.len(), touched.len());
            for w in &registry {
                if touched.contains(&w.id) {
                    prop_assert_eq!(narrowed.get(&w.id), full_after.get(&w.id), "{} rendered alone", w.id);
                } else {
                    prop_assert_eq!(full_before.get(&w.id), full_after.get(&w.id), "{} not named but changed by {:?}", w.id, edit);
                }
            }
        }
    }
}
