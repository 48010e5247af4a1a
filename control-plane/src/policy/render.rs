//! The renderer (POL-2): authored model + registry → every live workload's rendered policy.
//! A pure function: no I/O, no clock, deterministic output. Versions are the store's business;
//! rendered policies carry version 0 until `publish` stamps them.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{
    Cidr, Mode, PolicyError, PortRange, Protocol, ResolvedRule, RuleId, WorkloadPolicy,
};
use uuid::Uuid;

use crate::policy::model::{
    AuthoredModel, FAILSAFE_RULE, Management, Peer, RegisteredWorkload, Selector, StagedRuleset,
};
use crate::policy::staged;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("rule {rule} references {what} {id} which does not exist")]
    UnknownReference { rule: Uuid, what: &'static str, id: Uuid },
    #[error("staged set {set}: {reason}")]
    Staged { set: String, reason: String },
    #[error("rule {rule}: {source}")]
    Policy {
        rule: Uuid,
        #[source]
        source: PolicyError,
    },
}

impl From<RenderError> for crate::error::Error {
    fn from(e: RenderError) -> Self {
        crate::error::Error::Render(Box::new(e))
    }
}

/// Workloads by label, so a selector resolves by set intersection instead of a scan (POL-7).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelIndex {
    /// Key → value → the indices of the workloads with that label, ascending.
    postings: BTreeMap<LabelKey, BTreeMap<LabelValue, Vec<usize>>>,
}

impl LabelIndex {
    pub fn new(workloads: &[RegisteredWorkload]) -> Self {
        let mut index = LabelIndex::default();
        for (i, w) in workloads.iter().enumerate() {
            index.add(i, &w.labels);
        }
        index
    }

    fn add(&mut self, i: usize, labels: &BTreeMap<LabelKey, LabelValue>) {
        for (k, v) in labels {
            // A key or value is cloned only the first time it is seen.
            if !self.postings.contains_key(k) {
                self.postings.insert(k.clone(), BTreeMap::new());
            }
            let values = self.postings.get_mut(k).expect("inserted above");
            if !values.contains_key(v) {
                values.insert(v.clone(), Vec::new());
            }
            let list = values.get_mut(v).expect("inserted above");
            if let Err(at) = list.binary_search(&i) {
                list.insert(at, i);
            }
        }
    }

    /// The workload at index `i` relabelled from `was` to `now`.
    pub fn relabel(
        &mut self,
        i: usize,
        was: &BTreeMap<LabelKey, LabelValue>,
        now: &BTreeMap<LabelKey, LabelValue>,
    ) {
        for (k, v) in was {
            let Some(values) = self.postings.get_mut(k) else { continue };
            if let Some(list) = values.get_mut(v) {
                list.retain(|&j| j != i);
                if list.is_empty() {
                    values.remove(v);
                }
            }
            if values.is_empty() {
                self.postings.remove(k);
            }
        }
        self.add(i, now);
    }

    fn postings(&self, key: &LabelKey, value: &LabelValue) -> Option<&Vec<usize>> {
        self.postings.get(key)?.get(value)
    }

    /// Indices of the workloads `selector` selects, ascending. Empty selector → none.
    pub(crate) fn select(&self, selector: &Selector) -> Vec<usize> {
        let mut result: Option<Vec<usize>> = None;
        for (key, values) in selector.matches() {
            // The workloads with any of the key's values: one posting list as it is, or several
            // merged (each workload has one value of a key, so they never overlap).
            let mut lists = values.iter().filter_map(|v| self.postings(key, v));
            let any_value = match (lists.next(), values.len()) {
                (None, _) => Vec::new(),
                (Some(list), 1) => list.clone(),
                (Some(first), _) => {
                    let mut all = first.clone();
                    lists.for_each(|list| all.extend_from_slice(list));
                    all.sort_unstable();
                    all
                }
            };
            let narrowed = match result {
                None => any_value,
                Some(acc) => intersect_sorted(&acc, &any_value),
            };
            if narrowed.is_empty() {
                return narrowed;
            }
            result = Some(narrowed);
        }
        result.unwrap_or_default()
    }
}

/// The values both ascending lists hold, ascending.
fn intersect_sorted(a: &[usize], b: &[usize]) -> Vec<usize> {
    let (mut i, mut j, mut both) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                both.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    both
}

/// Every live workload's rendered policy (version 0). Workloads that the same rulesets select and
/// that are in the same mode have the same policy; it is built once and shared, so an estate of
/// 10,000 workloads in 500 apps renders, encodes and stores ~500 policies, not 10,000.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rendered {
    policies: Vec<WorkloadPolicy>,
    /// Where each of `policies` came from.
    origins: Vec<Origin>,
    /// Each workload's policy: an index into `policies`.
    of: BTreeMap<WorkloadId, usize>,
}

/// What a rendered policy was rendered from: the rulesets that selected its workloads (indices
/// into the model's `rulesets`, in render order), or one workload's rollback pin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Rulesets(Vec<usize>),
    Pinned(WorkloadId),
}

impl Rendered {
    /// The policies workloads share, each once (two groups may still render equal policies).
    pub fn policies(&self) -> &[WorkloadPolicy] {
        &self.policies
    }

    /// Each workload with the index of its policy in [`Rendered::policies`], in id order.
    pub fn shares(&self) -> impl Iterator<Item = (WorkloadId, usize)> + '_ {
        self.of.iter().map(|(id, &i)| (*id, i))
    }

    /// Each workload with its policy, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (WorkloadId, &WorkloadPolicy)> + '_ {
        self.of.iter().map(|(id, &i)| (*id, &self.policies[i]))
    }

    /// Where the policy at `index` of [`Rendered::policies`] came from.
    pub fn origin(&self, index: usize) -> &Origin {
        &self.origins[index]
    }

    pub fn get(&self, id: &WorkloadId) -> Option<&WorkloadPolicy> {
        self.of.get(id).map(|&i| &self.policies[i])
    }

    /// Workloads rendered.
    pub fn len(&self) -> usize {
        self.of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.of.is_empty()
    }
}

/// The most one workload's rendered policy may hold (REL-1): entries (every peer and every port
/// range of every rule: what the agent installs) and canonical bytes. The defaults fit the policy
/// stream's largest message (`wire::sync::MAX_POLICY_MESSAGE`) with room; `serve` and the local
/// CLI set them with `--max-rendered-entries` and `--max-rendered-bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub entries: usize,
    pub bytes: usize,
}

impl Default for Bound {
    fn default() -> Self {
        Bound {
            entries: innerwall_wire::sync::DEFAULT_MAX_RENDERED_ENTRIES,
            bytes: innerwall_wire::sync::DEFAULT_MAX_RENDERED_BYTES,
        }
    }
}

/// A rendered policy over its [`Bound`]: its size, and the rule with the most entries in it (the
/// authored rule's id), the first to look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Oversize {
    pub entries: usize,
    pub bytes: usize,
    pub largest_rule: Option<(Uuid, usize)>,
}

/// Entries of one resolved rule: its peers and its port ranges.
fn entries_of(rule: &ResolvedRule) -> usize {
    rule.peers().len() + rule.ports().len()
}

/// Whether `policy`, `bytes` long in canonical form, is over `bound`, and by what.
pub fn oversize(policy: &WorkloadPolicy, bytes: usize, bound: Bound) -> Option<Oversize> {
    let entries: usize = policy.rules().map(entries_of).sum();
    if entries <= bound.entries && bytes <= bound.bytes {
        return None;
    }
    // Rules of one authored rule (one per protocol) count together.
    let mut per_rule: BTreeMap<&str, usize> = BTreeMap::new();
    for rule in policy.rules() {
        *per_rule.entry(rule.id().authored()).or_default() += entries_of(rule);
    }
    let largest_rule = per_rule
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .and_then(|(id, n)| Uuid::parse_str(id).ok().map(|id| (id, n)));
    Some(Oversize { entries, bytes, largest_rule })
}

/// What workloads that share one rendered policy have in common: the rulesets that select them
/// (indices into the resolved rulesets), their mode, their confirm deadline, their management
/// access.
type ShareKey<'a> = (&'a [usize], Mode, Option<i64>, Option<&'a Management>);

/// Renders the policy of every workload in `workloads` (the live, non-retired registry), with
/// the staged set of each workload a staged ruleset touches (FLOW-10).
pub fn render(model: &AuthoredModel, workloads: &[RegisteredWorkload]) -> Result<Rendered, RenderError> {
    render_indexed(model, workloads, &LabelIndex::new(workloads))
}

/// [`render`] with `index`, the [`LabelIndex`] of `workloads` (kept between renders:
/// `policy::inputs`), instead of building one.
pub fn render_indexed(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
) -> Result<Rendered, RenderError> {
    render_some(model, workloads, index, None)
}

/// [`render`] of the workloads `only` names (POL-7's narrowed render: `policy::narrow` says
/// which a change can touch), each exactly as the full render renders it: peers are still
/// resolved against every workload of `workloads`, found through `index`, the
/// [`LabelIndex`] of `workloads` (kept between renders: `policy::inputs`).
pub fn render_only(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
    only: &BTreeSet<WorkloadId>,
) -> Result<Rendered, RenderError> {
    let at: BTreeSet<usize> =
        workloads.iter().enumerate().filter(|(_, w)| only.contains(&w.id)).map(|(i, _)| i).collect();
    render_some(model, workloads, index, Some(&at))
}

fn render_some(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
    only: Option<&BTreeSet<usize>>,
) -> Result<Rendered, RenderError> {
    let mut rendered = render_in_force(model, workloads, index, only)?;
    if !model.staged.is_empty() {
        stage(&mut rendered, model, workloads, index, only)?;
    }
    Ok(rendered)
}

/// The rules in force: what [`render`] renders before staging, of every workload or of those at
/// the indices `only` holds.
fn render_in_force(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
    only: Option<&BTreeSet<usize>>,
) -> Result<Rendered, RenderError> {
    let wanted = |i: &usize| only.is_none_or(|only| only.contains(i));
    // Each enabled ruleset that selects anyone wanted (the model index of each, and whom it
    // selects), its rules resolved once; each workload's list of them.
    let mut scoped: Vec<(usize, Vec<usize>)> = Vec::new();
    for (at, ruleset) in model.rulesets.iter().enumerate().filter(|(_, rs)| rs.enabled) {
        let mut scope = index.select(&ruleset.scope);
        scope.retain(wanted);
        if !scope.is_empty() {
            scoped.push((at, scope));
        }
    }
    let at: Vec<usize> = scoped.iter().map(|(at, _)| *at).collect();
    let rules = resolve_rulesets(model, workloads, index, &at, resolve_parts(at.len()))?;
    let mut selected_by: Vec<Vec<usize>> = vec![Vec::new(); workloads.len()];
    for (r, (_, scope)) in scoped.iter().enumerate() {
        for &i in scope {
            selected_by[i].push(r);
        }
    }
    let resolved: Vec<(Vec<ResolvedRule>, usize)> = rules.into_iter().zip(at).collect();
    let mut selected = Selected::new(workloads, index);
    let mut shared: BTreeMap<ShareKey, usize> = BTreeMap::new();
    let mut out = Rendered::default();
    let rendering: Box<dyn Iterator<Item = usize>> = match only {
        Some(only) => Box::new(only.iter().copied()),
        None => Box::new(0..workloads.len()),
    };
    for i in rendering {
        let (w, rulesets) = (&workloads[i], &selected_by[i]);
        let management = model.management_for(&w.id);
        if let Some(pin) = model.pinned.get(&w.id) {
            // Its pinned source, every ruleset of it applied, peers resolved as they are now.
            let mut rules = Vec::new();
            for rule in pin.model.rulesets.iter().flat_map(|rs| &rs.rules) {
                rules.extend(resolve_rule(&pin.model, &mut selected, rule)?);
            }
            out.push(w, management, rules, Origin::Pinned(w.id))?;
            continue;
        }
        let i = match shared.entry((rulesets.as_slice(), w.mode, w.revert_at, management)) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let rules = rulesets.iter().flat_map(|&r| resolved[r].0.iter().cloned()).collect();
                let origin = Origin::Rulesets(rulesets.iter().map(|&r| resolved[r].1).collect());
                *e.insert(out.push(w, management, rules, origin)?)
            }
        };
        out.of.insert(w.id, i);
    }
    Ok(out)
}

/// The rules of each ruleset at the indices `rulesets` holds (into the model's rulesets),
/// resolved, in order, or the first ruleset's error. Resolving is most of a render's CPU and each ruleset
/// resolves alone, so they are split into `parts` resolved at once, on threads of their own, each
/// resolving the selectors its rules name once.
fn resolve_rulesets(
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
    rulesets: &[usize],
    parts: usize,
) -> Result<Vec<Vec<ResolvedRule>>, RenderError> {
    let resolve_part = |part: &[usize]| -> Result<Vec<Vec<ResolvedRule>>, RenderError> {
        let mut selected = Selected::new(workloads, index);
        let mut out = Vec::with_capacity(part.len());
        for &at in part {
            let mut rules = Vec::new();
            for rule in model.rulesets[at].rules.iter().filter(|r| r.enabled) {
                rules.extend(resolve_rule(model, &mut selected, rule)?);
            }
            out.push(rules);
        }
        Ok(out)
    };
    if parts <= 1 || rulesets.len() <= 1 {
        return resolve_part(rulesets);
    }
    std::thread::scope(|scope| {
        let parts: Vec<_> = rulesets
            .chunks(rulesets.len().div_ceil(parts))
            .map(|part| scope.spawn(move || resolve_part(part)))
            .collect();
        // Joined in order: an error is the first failing ruleset's, as if resolved in one part.
        let mut all = Vec::with_capacity(rulesets.len());
        for part in parts {
            all.extend(part.join().expect("resolving a rule does not panic")?);
        }
        Ok(all)
    })
}

/// How many parts [`resolve_rulesets`] splits this many rulesets into: one per core from
/// [`PARALLEL_RULESETS`] on (threads cost more than a few rulesets' resolving).
fn resolve_parts(rulesets: usize) -> usize {
    match rulesets < PARALLEL_RULESETS {
        true => 1,
        false => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
    }
}

const PARALLEL_RULESETS: usize = 64;

impl Rendered {
    /// Adds the policy of `rules` and `management` in `w`'s mode (and with its confirm deadline),
    /// as `w`'s; its index (others may share it).
    fn push(
        &mut self,
        w: &RegisteredWorkload,
        management: Option<&Management>,
        rules: Vec<ResolvedRule>,
        origin: Origin,
    ) -> Result<usize, RenderError> {
        let failsafe = management.map(failsafe_rules).transpose()?.unwrap_or_default();
        let policy = WorkloadPolicy::new(0, w.mode, failsafe.into_iter().chain(rules))
            .and_then(|p| p.with_revert_at(w.revert_at))
            .map_err(|source| RenderError::Policy { rule: Uuid::nil(), source })?;
        self.policies.push(policy);
        self.origins.push(origin);
        let i = self.policies.len() - 1;
        self.of.insert(w.id, i);
        Ok(i)
    }
}

/// Gives each workload a staged ruleset touches (its scope, or the scope of the ruleset it
/// replaces, selects the workload) the staged set between its rules in force and the rules it
/// would have with every staged ruleset in force (`staged::between`), named after the staged
/// rulesets touching it (`staged::set_id`). A workload pinned by a rollback renders its pin and
/// stages nothing. Workloads that share a policy, a pending policy and the staged rulesets
/// touching them share the staged policy too.
fn stage(
    out: &mut Rendered,
    model: &AuthoredModel,
    workloads: &[RegisteredWorkload],
    index: &LabelIndex,
    only: Option<&BTreeSet<usize>>,
) -> Result<(), RenderError> {
    let pending = render_in_force(&model.with_staged(|_| true), workloads, index, only)?;
    let mut touching: Vec<Vec<usize>> = vec![Vec::new(); workloads.len()];
    for (s, staged) in model.staged.iter().enumerate() {
        let replaced = model.rulesets.iter().find(|r| r.name == staged.ruleset.name);
        let mut scope: BTreeSet<usize> = BTreeSet::new();
        for ruleset in replaced.into_iter().chain([&staged.ruleset]).filter(|r| r.enabled) {
            scope.extend(index.select(&ruleset.scope));
        }
        for i in scope.into_iter().filter(|i| only.is_none_or(|only| only.contains(i))) {
            touching[i].push(s);
        }
    }
    let mut staged_policies: BTreeMap<(usize, usize, &[usize]), Option<usize>> = BTreeMap::new();
    for (w, touched) in workloads.iter().zip(&touching) {
        if touched.is_empty() || model.pinned.contains_key(&w.id) {
            continue;
        }
        let (base, then) = (out.of[&w.id], pending.of[&w.id]);
        let i = match staged_policies.entry((base, then, touched.as_slice())) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let named: Vec<&StagedRuleset> = touched.iter().map(|&s| &model.staged[s]).collect();
                let set = staged::set_id(&named);
                let staged = staged::between(&out.policies[base], &pending.policies[then], &set)
                    .map_err(|e| RenderError::Staged { set, reason: e.to_string() })?;
                *e.insert(staged.map(|staged| {
                    out.policies.push(out.policies[base].clone().with_staged(Some(staged)));
                    out.origins.push(out.origins[base].clone());
                    out.policies.len() - 1
                }))
            }
        };
        if let Some(i) = i {
            out.of.insert(w.id, i);
        }
    }
    Ok(())
}

/// The failsafe rule of `management`: one resolved rule per protocol, `failsafe:management/<p>`.
fn failsafe_rules(management: &Management) -> Result<Vec<ResolvedRule>, RenderError> {
    let policy_err = |source| RenderError::Policy { rule: Uuid::nil(), source };
    management
        .services()
        .into_iter()
        .map(|entry| {
            let id = RuleId::new(FAILSAFE_RULE, entry.protocol).map_err(policy_err)?;
            ResolvedRule::new(id, entry.ports, management.cidrs().iter().copied()).map_err(policy_err)
        })
        .collect()
}

/// The host routes of the workloads each peer selector selects, resolved once per selector in a
/// render: rules of many rulesets name the same apps, and reading every selected workload's
/// addresses again for each rule was most of a large estate's render (its workloads are spread
/// over memory no cache holds: 100,000 workloads, 50,000 rules).
struct Selected<'a> {
    workloads: &'a [RegisteredWorkload],
    index: &'a LabelIndex,
    /// Looked up, never iterated: a hash map (a B-tree compares selectors' label maps).
    #[allow(clippy::disallowed_types)]
    hosts: std::collections::HashMap<&'a Selector, Vec<Cidr>>,
}

impl<'a> Selected<'a> {
    fn new(workloads: &'a [RegisteredWorkload], index: &'a LabelIndex) -> Self {
        #[allow(clippy::disallowed_types)]
        let hosts = std::collections::HashMap::new();
        Selected { workloads, index, hosts }
    }

    /// The host route of each address of each workload `selector` selects, ascending, each once.
    fn hosts(&mut self, selector: &'a Selector) -> Result<&[Cidr], PolicyError> {
        match self.hosts.entry(selector) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let mut hosts = Vec::new();
                for i in self.index.select(selector) {
                    for addr in &self.workloads[i].addresses {
                        hosts.push(Cidr::host(*addr)?);
                    }
                }
                hosts.sort_unstable();
                hosts.dedup();
                Ok(e.insert(hosts))
            }
        }
    }
}

/// One authored rule → one resolved rule per protocol its services permit, all with the same
/// peers. A rule whose peers resolve to nothing still renders (empty), so peers that appear
/// later arrive as peer additions rather than new rules.
fn resolve_rule<'a>(
    model: &'a AuthoredModel,
    selected: &mut Selected<'a>,
    rule: &'a crate::policy::model::Rule,
) -> Result<Vec<ResolvedRule>, RenderError> {
    let policy_err = |source| RenderError::Policy { rule: rule.id, source };
    // Gathered, then sorted once: inserting them one by one into a set was most of a render.
    let mut peers: Vec<Cidr> = Vec::new();
    for peer in &rule.peers {
        match peer {
            Peer::Cidr(c) => peers.push(*c),
            Peer::AddressGroup(id) => {
                let group = model.address_groups.get(id).ok_or(RenderError::UnknownReference {
                    rule: rule.id,
                    what: "address group",
                    id: *id,
                })?;
                peers.extend(group.cidrs.iter().copied());
            }
            Peer::Workloads(selector) => {
                peers.extend(selected.hosts(selector).map_err(policy_err)?.iter().copied());
            }
        }
    }
    let mut ports: BTreeMap<Protocol, Vec<PortRange>> = BTreeMap::new();
    for id in &rule.services {
        let service = model.services.get(id).ok_or(RenderError::UnknownReference {
            rule: rule.id,
            what: "service",
            id: *id,
        })?;
        for entry in &service.entries {
            ports.entry(entry.protocol).or_default().extend(entry.ports.iter().copied());
        }
    }
    peers.sort_unstable();
    peers.dedup();
    // One set, shared by the rule of each protocol.
    let peers: Arc<BTreeSet<Cidr>> = Arc::new(peers.into_iter().collect());
    let authored = rule.id.to_string();
    ports
        .into_iter()
        .map(|(protocol, ports)| {
            let id = RuleId::new(&authored, protocol).map_err(policy_err)?;
            ResolvedRule::with_peer_set(id, ports, Arc::clone(&peers)).map_err(policy_err)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::policy::model::{AddressGroup, Rule, Ruleset, Service, ServiceEntry};

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn wid(n: u128) -> WorkloadId {
        WorkloadId::from_uuid(id(0x1000 + n)).unwrap()
    }

    fn sel(pairs: &[(&str, &[&str])]) -> Selector {
        Selector::from_strings(
            pairs.iter().map(|(k, vs)| (k.to_string(), vs.iter().map(|v| v.to_string()).collect())),
        )
        .unwrap()
    }

    fn workload(n: u128, labels: &[(&str, &str)], addrs: &[&str]) -> RegisteredWorkload {
        RegisteredWorkload {
            id: wid(n),
            mode: Mode::Enforcement,
            revert_at: None,
            labels: labels
                .iter()
                .map(|(k, v)| (LabelKey::new(k).unwrap(), LabelValue::new(v).unwrap()))
                .collect(),
            addresses: addrs.iter().map(|a| a.parse::<IpAddr>().unwrap()).collect(),
        }
    }

    fn service(n: u128, entries: &[&str]) -> Service {
        Service {
            id: id(n),
            name: format!("s{n}"),
            entries: entries.iter().map(|e| ServiceEntry::parse(e).unwrap()).collect(),
        }
    }

    fn rule(n: u128, peers: Vec<Peer>, services: &[u128]) -> Rule {
        Rule {
            id: id(n),
            name: format!("r{n}"),
            enabled: true,
            peers,
            services: services.iter().map(|&s| id(s)).collect(),
        }
    }

    fn ruleset(n: u128, scope: Selector, rules: Vec<Rule>) -> Ruleset {
        Ruleset { id: id(n), name: format!("rs{n}"), enabled: true, scope, rules }
    }

    /// Renders and prints each workload's policy as `rule: proto ports <- peers` lines.
    fn check(model: &AuthoredModel, workloads: &[RegisteredWorkload], expected: &[(u128, &[&str])]) {
        let rendered = render(model, workloads).unwrap();
        assert_eq!(rendered.len(), workloads.len());
        for (n, lines) in expected {
            let policy = rendered.get(&wid(*n)).unwrap();
            let got: Vec<String> = policy
                .rules()
                .map(|r| {
                    let ports: Vec<String> = r.ports().iter().map(ToString::to_string).collect();
                    let peers: Vec<String> = r.peers().iter().map(ToString::to_string).collect();
                    let short =
                        format!("{}/{}", r.id().authored().trim_start_matches(['0', '-']), r.protocol());
                    format!("{short} {} <- {}", ports.join(","), peers.join(" "))
                })
                .collect();
            assert_eq!(got, *lines, "workload {n}");
        }
    }

    fn db_model(rules: Vec<Rule>) -> AuthoredModel {
        AuthoredModel {
            services: [service(1, &["tcp:5432"]), service(2, &["tcp:80,443", "udp:443", "icmp"])]
                .into_iter()
                .map(|s| (s.id, s))
                .collect(),
            address_groups: [AddressGroup {
                id: id(9),
                name: "vpn".into(),
                cidrs: ["10.8.0.0/16", "fd08::/48"].iter().map(|c| Cidr::parse(c).unwrap()).collect(),
            }]
            .into_iter()
            .map(|g| (g.id, g))
            .collect(),
            rulesets: vec![ruleset(100, sel(&[("app", &["db"])]), rules)],
            ..Default::default()
        }
    }

    fn estate() -> Vec<RegisteredWorkload> {
        vec![
            workload(1, &[("app", "db")], &["10.0.0.1"]),
            workload(2, &[("app", "web")], &["10.0.0.2", "fd00::2"]),
            workload(3, &[("app", "web"), ("env", "dev")], &["10.0.0.3"]),
            workload(4, &[("app", "batch")], &[]),
        ]
    }

    #[test]
    fn selector_peers_render_as_host_routes_of_current_addresses() {
        let model = db_model(vec![rule(10, vec![Peer::Workloads(sel(&[("app", &["web"])]))], &[1])]);
        check(
            &model,
            &estate(),
            &[(1, &["a/tcp 5432 <- 10.0.0.2/32 10.0.0.3/32 fd00::2/128"]), (2, &[]), (4, &[])],
        );
    }

    /// A ruleset's rules are resolved once a render: workloads it selects whose policies differ
    /// (here by mode) hold one set of each rule's peers, not a copy each.
    #[test]
    fn workloads_of_one_ruleset_share_its_resolved_peers() {
        let model = db_model(vec![rule(10, vec![Peer::Workloads(sel(&[("app", &["web"])]))], &[1])]);
        let mut workloads = estate();
        workloads.push(RegisteredWorkload {
            mode: Mode::Simulation,
            ..workload(5, &[("app", "db")], &["10.0.0.5"])
        });
        let rendered = render(&model, &workloads).unwrap();
        let (enforced, simulated) = (rendered.get(&wid(1)).unwrap(), rendered.get(&wid(5)).unwrap());
        assert_ne!(enforced, simulated);
        let (a, b) = (enforced.rules().next().unwrap().peers(), simulated.rules().next().unwrap().peers());
        assert_eq!(a.len(), 3);
        assert!(std::ptr::eq(a, b));
    }

    /// Rulesets resolved in parts on threads of their own (a large render) resolve to exactly what
    /// one part resolves, in order, and fail with the first failing ruleset's error.
    #[test]
    fn rulesets_resolved_in_parts_equal_one_part() {
        let web = || Peer::Workloads(sel(&[("app", &["web"])]));
        let mut model = db_model(Vec::new());
        model.rulesets = (0..7u128)
            .map(|n| {
                let peers = match n % 3 {
                    0 => vec![web()],
                    1 => vec![Peer::AddressGroup(id(9)), web()],
                    _ => vec![Peer::Cidr(Cidr::parse(&format!("192.0.{n}.0/24")).unwrap())],
                };
                ruleset(100 + n, sel(&[("app", &["db"])]), vec![rule(10 + n, peers, &[1, 2])])
            })
            .collect();
        let workloads = estate();
        let index = LabelIndex::new(&workloads);
        let rulesets: Vec<usize> = (0..7).collect();
        let whole = resolve_rulesets(&model, &workloads, &index, &rulesets, 1).unwrap();
        assert_eq!(whole.len(), 7);
        assert_eq!(whole[1].len(), 3, "one rule per protocol");
        for parts in [2, 3, 7, 20] {
            assert_eq!(resolve_rulesets(&model, &workloads, &index, &rulesets, parts).unwrap(), whole);
        }
        // Rulesets 2 and 5 name groups that do not exist: ruleset 2's is the error.
        for (at, group) in [(2, 70), (5, 71)] {
            model.rulesets[at].rules[0].peers.push(Peer::AddressGroup(id(group)));
        }
        for parts in [1, 2, 3, 7] {
            let err = resolve_rulesets(&model, &workloads, &index, &rulesets, parts).unwrap_err();
            assert_eq!(
                err,
                RenderError::UnknownReference { rule: id(12), what: "address group", id: id(70) },
                "{parts} parts"
            );
        }
    }

    #[test]
    fn multi_protocol_rule_splits_into_one_rule_per_protocol() {
        let model = db_model(vec![rule(10, vec![Peer::Cidr(Cidr::parse("192.0.2.0/24").unwrap())], &[1, 2])]);
        check(
            &model,
            &estate(),
            &[(
                1,
                &[
                    "a/icmp  <- 192.0.2.0/24",
                    "a/tcp 80,443,5432 <- 192.0.2.0/24",
                    "a/udp 443 <- 192.0.2.0/24",
                ],
            )],
        );
        // The rule of each protocol holds one set of peers.
        let rendered = render(&model, &estate()).unwrap();
        let rules: Vec<_> = rendered.get(&wid(1)).unwrap().rules().collect();
        assert!(rules.windows(2).all(|w| std::ptr::eq(w[0].peers(), w[1].peers())));
    }

    #[test]
    fn address_groups_cidrs_and_selectors_union() {
        let peers = vec![
            Peer::AddressGroup(id(9)),
            Peer::Cidr(Cidr::parse("10.0.0.2/32").unwrap()),
            Peer::Workloads(sel(&[("app", &["web"]), ("env", &["dev"])])),
        ];
        let model = db_model(vec![rule(10, peers, &[1])]);
        check(&model, &estate(), &[(1, &["a/tcp 5432 <- 10.0.0.2/32 10.0.0.3/32 10.8.0.0/16 fd08::/48"])]);
    }

    #[test]
    fn empty_selector_matches_nothing_as_scope_and_as_peer() {
        let mut model = db_model(vec![rule(10, vec![Peer::Workloads(Selector::default())], &[1])]);
        check(&model, &estate(), &[(1, &["a/tcp 5432 <- "])]);
        model.rulesets[0].scope = Selector::default();
        check(&model, &estate(), &[(1, &[]), (2, &[]), (3, &[]), (4, &[])]);
    }

    #[test]
    fn retired_workloads_vanish_from_peer_sets() {
        let model = db_model(vec![rule(10, vec![Peer::Workloads(sel(&[("app", &["web"])]))], &[1])]);
        // Retirement removes a workload from the registry the renderer is given.
        let live: Vec<_> = estate().into_iter().filter(|w| w.id != wid(2)).collect();
        check(&model, &live, &[(1, &["a/tcp 5432 <- 10.0.0.3/32"])]);
    }

    #[test]
    fn disabled_rulesets_and_rules_render_nothing_and_mode_comes_from_registry() {
        let mut model = db_model(vec![rule(10, vec![], &[1]), rule(11, vec![], &[1])]);
        model.rulesets[0].rules[1].enabled = false;
        let mut workloads = estate();
        workloads[0].mode = Mode::Simulation;
        check(&model, &workloads, &[(1, &["a/tcp 5432 <- "])]);
        assert_eq!(render(&model, &workloads).unwrap().get(&wid(1)).unwrap().mode(), Mode::Simulation);
        model.rulesets[0].enabled = false;
        check(&model, &workloads, &[(1, &[])]);
    }

    #[test]
    fn workloads_the_same_rulesets_select_in_the_same_mode_share_one_policy() {
        let mut model = db_model(vec![rule(10, vec![Peer::Workloads(sel(&[("app", &["db"])]))], &[1])]);
        model.rulesets[0].scope = sel(&[("app", &["web"])]);
        let mut workloads = estate();
        let share = |rendered: &Rendered| -> BTreeMap<WorkloadId, usize> { rendered.shares().collect() };
        let rendered = render(&model, &workloads).unwrap();
        let of = share(&rendered);
        // 2 and 3 (both app=web) share the rule; 1 and 4 (selected by nothing) the empty policy.
        assert_eq!(rendered.policies().len(), 2);
        assert_eq!(of[&wid(2)], of[&wid(3)]);
        assert_eq!(of[&wid(1)], of[&wid(4)]);
        assert_ne!(of[&wid(1)], of[&wid(2)]);
        assert_eq!(rendered.get(&wid(3)).unwrap().rules().len(), 1);

        workloads[2].mode = Mode::Simulation;
        let rendered = render(&model, &workloads).unwrap();
        assert_eq!(rendered.policies().len(), 3);
        let (web, dev) = (rendered.get(&wid(2)).unwrap(), rendered.get(&wid(3)).unwrap());
        assert_eq!((web.mode(), dev.mode()), (Mode::Enforcement, Mode::Simulation));
        assert!(web.rules().eq(dev.rules()));
    }

    fn management(cidrs: &[&str], services: &[&str]) -> Management {
        Management::new(
            cidrs.iter().map(|c| Cidr::parse(c).unwrap()),
            services.iter().map(|e| ServiceEntry::parse(e).unwrap()),
        )
        .unwrap()
    }

    #[test]
    fn management_access_renders_as_the_failsafe_rule_of_every_workload() {
        let mut model = db_model(vec![rule(10, vec![Peer::Workloads(sel(&[("app", &["web"])]))], &[1])]);
        model.management = Some(management(&["192.0.2.0/24", "2001:db8::/48"], &["tcp:22", "udp:161"]));
        let failsafe = [
            "failsafe:management/tcp 22 <- 192.0.2.0/24 2001:db8::/48",
            "failsafe:management/udp 161 <- 192.0.2.0/24 2001:db8::/48",
        ];
        let db: Vec<&str> =
            ["a/tcp 5432 <- 10.0.0.2/32 10.0.0.3/32 fd00::2/128"].into_iter().chain(failsafe).collect();
        // Selected by no ruleset, a workload still keeps its management access.
        check(&model, &estate(), &[(1, &db), (2, &failsafe), (4, &failsafe)]);
        // A narrowing is that workload's alone, and its policy is its own.
        model.management_of.insert(wid(2), management(&["192.0.2.8/29"], &["tcp:22"]));
        check(&model, &estate(), &[(2, &["failsafe:management/tcp 22 <- 192.0.2.8/29"]), (4, &failsafe)]);
        let rendered = render(&model, &estate()).unwrap();
        let of: BTreeMap<WorkloadId, usize> = rendered.shares().collect();
        assert_ne!(of[&wid(2)], of[&wid(4)]);
        assert_eq!(of[&wid(3)], of[&wid(4)]);
        // Without management access, nothing is added.
        model.management = None;
        model.management_of.clear();
        check(&model, &estate(), &[(2, &[])]);
    }

    #[test]
    fn management_access_narrows_and_never_widens() {
        let current = management(&["192.0.2.0/24", "10.9.0.0/16"], &["tcp:22,2200-2299", "udp:161"]);
        let within = |cidrs: &[&str], services: &[&str]| management(cidrs, services).within(&current);
        assert_eq!(within(&["192.0.2.64/26"], &["tcp:22"]), Ok(()));
        assert_eq!(within(&["10.9.3.0/24", "192.0.2.0/24"], &["tcp:2210-2220", "udp:161"]), Ok(()));
        assert_eq!(within(&["192.0.2.0/24", "10.9.0.0/16"], &["tcp:22,2200-2299", "udp:161"]), Ok(()));
        let err = within(&["192.0.0.0/16"], &["tcp:22"]).unwrap_err();
        assert!(err.contains("192.0.0.0/16"), "{err}");
        let err = within(&["192.0.2.0/24"], &["tcp:22-23"]).unwrap_err();
        assert!(err.contains("22-23"), "{err}");
        let err = within(&["192.0.2.0/24"], &["icmp"]).unwrap_err();
        assert!(err.contains("icmp"), "{err}");
        // Adjacent ranges merge, so a narrowing may span them.
        let adjacent = management(&["192.0.2.0/24"], &["tcp:22", "tcp:23"]);
        assert_eq!(management(&["192.0.2.0/24"], &["tcp:22-23"]).within(&adjacent), Ok(()));
        assert_eq!(adjacent, management(&["192.0.2.0/24"], &["tcp:22-23"]));
        // Empty is refused: access can be narrowed, never removed.
        assert!(Management::new([], [ServiceEntry::parse("tcp:22").unwrap()]).is_err());
        assert!(Management::new([Cidr::parse("192.0.2.0/24").unwrap()], []).is_err());
    }

    /// FLOW-10: a staged ruleset gives each workload it touches the staged set between its rules
    /// in force and the rules it would have with the ruleset promoted; the rules in force stay
    /// exactly as they are.
    #[test]
    fn a_staged_ruleset_renders_beside_the_rules_in_force() {
        use crate::policy::model::StagedRuleset;
        let web = Peer::Workloads(sel(&[("app", &["web"])]));
        let dev = Peer::Workloads(sel(&[("env", &["dev"])]));
        let model = db_model(vec![rule(10, vec![web.clone()], &[1])]);
        let in_force = render(&model, &estate()).unwrap();
        // A narrowing of rule 10 to the dev web server, and a new rule 11 from the vpn.
        let staged_rules = vec![rule(10, vec![dev], &[1]), rule(11, vec![Peer::AddressGroup(id(9))], &[1])];
        let mut staged = model.clone();
        staged.staged =
            vec![StagedRuleset { stage: 7, ruleset: ruleset(100, sel(&[("app", &["db"])]), staged_rules) }];
        let rendered = render(&staged, &estate()).unwrap();
        let db = rendered.get(&wid(1)).unwrap();
        assert!(db.rules().eq(in_force.get(&wid(1)).unwrap().rules()), "the rules in force are unchanged");
        let set = db.staged().expect("the db workload is touched");
        assert_eq!(set.set(), "rs100:7");
        let upserts: Vec<String> = set
            .upserts()
            .map(|r| {
                let peers: Vec<String> = r.peers().iter().map(ToString::to_string).collect();
                format!("{} <- {}", r.id().authored().trim_start_matches(['0', '-']), peers.join(" "))
            })
            .collect();
        assert_eq!(upserts, ["a <- 10.0.0.3/32", "b <- 10.8.0.0/16 fd08::/48"]);
        assert_eq!(set.removals().len(), 0);
        let pending = db.pending().unwrap();
        assert_eq!(pending.rules().count(), 2);
        // Workloads it does not touch carry no staged set, and share their policy as before.
        for n in [2, 3, 4] {
            assert_eq!(rendered.get(&wid(n)), in_force.get(&wid(n)), "workload {n}");
        }
        // Removing a rule is a removal; staging the ruleset as it is stages nothing.
        staged.staged[0].ruleset.rules = vec![rule(11, vec![Peer::AddressGroup(id(9))], &[1])];
        let removed = render(&staged, &estate()).unwrap();
        let set = removed.get(&wid(1)).unwrap().staged().unwrap().clone();
        assert_eq!(set.removals().map(|r| r.authored().to_owned()).collect::<Vec<_>>(), [id(10).to_string()]);
        staged.staged[0].ruleset = model.rulesets[0].clone();
        assert_eq!(render(&staged, &estate()).unwrap(), in_force);
        // A staged ruleset new to the estate touches what its own scope selects; two staged
        // rulesets touching one workload name their set by digest.
        let mut new =
            ruleset(200, sel(&[("app", &["web"])]), vec![rule(20, vec![Peer::AddressGroup(id(9))], &[2])]);
        new.name = "web-vpn".into();
        staged.staged = vec![
            StagedRuleset { stage: 3, ruleset: new },
            StagedRuleset { stage: 4, ruleset: ruleset(100, sel(&[("app", &["db", "web"])]), vec![]) },
        ];
        let both = render(&staged, &estate()).unwrap();
        assert_eq!(both.get(&wid(1)).unwrap().staged().unwrap().set(), "rs100:4");
        let web_set = both.get(&wid(2)).unwrap().staged().unwrap().set().to_owned();
        assert!(web_set.starts_with("staged:") && web_set.len() == 23, "{web_set}");
        assert_eq!(both.get(&wid(3)).unwrap().staged(), both.get(&wid(2)).unwrap().staged());
        assert_eq!(both.get(&wid(4)).unwrap().staged(), None);
        // A pinned workload renders its pin and stages nothing.
        staged.pinned.insert(wid(1), crate::policy::model::Pin { digest: vec![], model: model.clone() });
        assert_eq!(render(&staged, &estate()).unwrap().get(&wid(1)).unwrap().staged(), None);
    }

    #[test]
    fn a_pinned_workload_renders_its_source_against_the_registry_as_it_is() {
        use crate::policy::model::Pin;
        use crate::policy::source::{Part, Source, Sources, source_digest};
        let peers = vec![Peer::AddressGroup(id(9)), Peer::Workloads(sel(&[("app", &["web"])]))];
        let mut model = db_model(vec![rule(10, peers, &[1, 2])]);
        model.management = Some(management(&["192.0.2.0/24"], &["tcp:22"]));
        let before = render(&model, &estate()).unwrap();
        let Origin::Rulesets(at) = before.origin(before.shares().find(|(w, _)| *w == wid(1)).unwrap().1)
        else {
            panic!("rendered from rulesets")
        };
        let mut sources = Sources::new(&model);
        let stored = sources.source(at);
        assert_eq!(stored.len() % 32, 0);
        assert_eq!(sources.source(at), stored, "canonical: the same digests again");
        // Read back as a publish stored it: the parts by digest, in the source's order.
        let parts: Vec<Part> =
            stored.chunks(32).map(|d| serde_json::from_slice(&sources.parts[d]).unwrap()).collect();
        assert_eq!(parts.len(), 1 + 2 + 1, "the ruleset, its two services, its group");
        let decoded = Source::from_parts(parts);
        let digest = source_digest(&stored).to_vec();

        // Pinned, the rulesets change and do not reach it; the registry does.
        model.pinned.insert(wid(1), Pin { digest, model: decoded.model().unwrap() });
        model.rulesets[0].rules.clear();
        let mut workloads = estate();
        workloads[1].addresses.insert("10.0.0.9".parse().unwrap());
        let after = render(&model, &workloads).unwrap();
        let expected = render(
            &db_model(vec![rule(
                10,
                vec![Peer::AddressGroup(id(9)), Peer::Workloads(sel(&[("app", &["web"])]))],
                &[1, 2],
            )]),
            &workloads,
        )
        .unwrap();
        let failsafe: Vec<_> = after
            .get(&wid(1))
            .unwrap()
            .rules()
            .filter(|r| r.id().authored() == FAILSAFE_RULE)
            .cloned()
            .collect();
        assert_eq!(failsafe.len(), 1, "the current management access still applies");
        let rules: Vec<_> = after
            .get(&wid(1))
            .unwrap()
            .rules()
            .filter(|r| r.id().authored() != FAILSAFE_RULE)
            .cloned()
            .collect();
        assert!(rules.iter().eq(expected.get(&wid(1)).unwrap().rules()), "{rules:?}");
        assert!(rules.iter().any(|r| r.peers().contains(&Cidr::parse("10.0.0.9/32").unwrap())));
        assert!(matches!(
            after.origin(after.shares().find(|(w, _)| *w == wid(1)).unwrap().1),
            Origin::Pinned(_)
        ));
        assert_eq!(
            after.get(&wid(2)).unwrap().rules().len(),
            1,
            "the others follow the rulesets: the failsafe only"
        );
    }

    mod sharing_equals_one_by_one {
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        const VALUES: &[&str] = &["a", "b", "c"];

        fn app(value: &str) -> Selector {
            sel(&[("app", &[value])])
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(500))]

            /// Sharing is an optimization: each workload gets exactly the policy it would get
            /// rendered on its own, from the rules of every enabled ruleset that selects it.
            #[test]
            fn each_workload_gets_the_policy_rendered_for_it_alone(
                estate in prop::collection::vec(
                    (select(VALUES), select(VALUES), any::<bool>()), 0..10),
                sets in prop::collection::vec(
                    (select(VALUES), select(VALUES), any::<bool>(), 0u8..3), 0..6),
            ) {
                let workloads: Vec<RegisteredWorkload> = estate
                    .iter()
                    .enumerate()
                    .map(|(i, (a, e, simulate))| {
                        let addr = format!("10.0.0.{}", i + 1);
                        let mut w = workload(i as u128, &[("app", a), ("env", e)], &[addr.as_str()]);
                        if *simulate {
                            w.mode = Mode::Simulation;
                        }
                        w
                    })
                    .collect();
                let mut model = db_model(Vec::new());
                model.rulesets = sets
                    .iter()
                    .enumerate()
                    .map(|(j, (scope, peer, enabled, rules))| {
                        let rules = (0..*rules)
                            .map(|k| rule(1000 + 10 * j as u128 + k as u128, vec![Peer::Workloads(app(peer))], &[1, 2]))
                            .collect();
                        Ruleset { enabled: *enabled, ..ruleset(100 + j as u128, app(scope), rules) }
                    })
                    .collect();
                let rendered = render(&model, &workloads).unwrap();
                prop_assert_eq!(rendered.len(), workloads.len());
                let index = LabelIndex::new(&workloads);
                for w in &workloads {
                    // Resolved alone: nothing memoized by another workload's render.
                    let mut selected = Selected::new(&workloads, &index);
                    let mut rules = Vec::new();
                    for rs in model.rulesets.iter().filter(|rs| rs.enabled && rs.scope.selects(&w.labels)) {
                        for r in rs.rules.iter().filter(|r| r.enabled) {
                            rules.extend(resolve_rule(&model, &mut selected, r).unwrap());
                        }
                    }
                    let alone = WorkloadPolicy::new(0, w.mode, rules).unwrap();
                    prop_assert_eq!(rendered.get(&w.id), Some(&alone));
                }
            }
        }
    }

    mod index_equals_scan {
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        const KEYS: &[&str] = &["app", "env", "team"];
        const VALUES: &[&str] = &["a", "b", "c"];

        fn labels() -> impl Strategy<Value = Vec<(&'static str, &'static str)>> {
            prop::collection::vec((select(KEYS), select(VALUES)), 0..3)
        }

        fn selector() -> impl Strategy<Value = Selector> {
            prop::collection::vec((select(KEYS), prop::collection::vec(select(VALUES), 1..3)), 0..3).prop_map(
                |m| {
                    Selector::from_strings(
                        m.into_iter()
                            .map(|(k, vs)| (k.to_string(), vs.iter().map(|v| v.to_string()).collect())),
                    )
                    .unwrap()
                },
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// POL-7: the inverted index is an optimization; it selects exactly what a scan of
            /// every workload with `Selector::selects` would.
            #[test]
            fn label_index_selects_exactly_what_a_full_scan_selects(
                estate in prop::collection::vec(labels(), 0..12),
                sel in selector(),
            ) {
                let workloads: Vec<RegisteredWorkload> =
                    estate.iter().enumerate().map(|(i, l)| workload(i as u128, l, &[])).collect();
                let scan: Vec<usize> =
                    workloads.iter().enumerate().filter(|(_, w)| sel.selects(&w.labels)).map(|(i, _)| i).collect();
                prop_assert_eq!(LabelIndex::new(&workloads).select(&sel), scan);
            }
        }
    }

    #[test]
    fn oversize_counts_peers_and_ports_and_names_the_largest_rule() {
        let peers = vec![Peer::AddressGroup(id(9)), Peer::Workloads(sel(&[("app", &["web"])]))];
        let model = db_model(vec![rule(10, peers, &[2]), rule(11, vec![], &[1])]);
        let rendered = render(&model, &estate()).unwrap();
        let policy = rendered.get(&wid(1)).unwrap();
        // Rule 10: icmp (no ports), tcp (80, 443) and udp (443), each with the 5 peers; rule 11:
        // tcp 5432 alone.
        let entries = 5 + (5 + 2) + (5 + 1) + 1;
        let exact = Bound { entries, bytes: 10_000 };
        assert_eq!(oversize(policy, 100, exact), None, "at the bound is within it");
        let over = oversize(policy, 100, Bound { entries: entries - 1, ..exact }).unwrap();
        assert_eq!((over.entries, over.bytes), (entries, 100));
        assert_eq!(over.largest_rule, Some((id(10), entries - 1)));
        assert!(oversize(policy, 10_001, exact).is_some(), "over in bytes alone");
        let defaults = Bound::default();
        assert!(defaults.bytes * 4 <= innerwall_wire::sync::MAX_POLICY_MESSAGE);
    }

    #[test]
    fn unknown_references_are_errors_not_silence() {
        let model = db_model(vec![rule(10, vec![Peer::AddressGroup(id(77))], &[1])]);
        assert!(matches!(
            render(&model, &estate()),
            Err(RenderError::UnknownReference { what: "address group", .. })
        ));
        let model = db_model(vec![rule(10, vec![], &[78])]);
        assert!(matches!(
            render(&model, &estate()),
            Err(RenderError::UnknownReference { what: "service", .. })
        ));
    }
}
