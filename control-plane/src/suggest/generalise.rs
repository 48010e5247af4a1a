//! From recorded flows no rule admitted to the narrowest label rules that cover them (FLOW-9),
//! pure: the caller reads the flows, the estate and the stored decisions; this module groups,
//! generalises, judges breadth, names the evidence and fingerprints each suggestion. The same
//! input gives the same output, in the same order.
//!
//! Destinations are grouped by their labels now minus the excluded keys (the role). Per group
//! and (protocol, port), managed sources are generalised to the conjunction of the label values
//! every observed source label set shares (the narrowest selector covering them all; any
//! smaller conjunction selects a superset), kept when its breadth (live workloads it selects
//! now ÷ observed source workloads) is within the bound, else one rule per observed label set.
//! Unmanaged sources take the smallest existing address group holding every observed address,
//! else host routes (at most [`MAX_HOST_ROUTES`]), else no rule: "needs an address group".

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Cidr, Protocol};
use serde::{Deserialize, Serialize};

use crate::policy::model::ServiceEntry;
use crate::policy::spec::{PeerSpec, RuleSpec, RulesetSpec};

/// Labels as stored: key to value.
pub type Labels = BTreeMap<String, String>;

/// The default bound on a selector's breadth (live workloads it selects ÷ observed sources).
pub const DEFAULT_MAX_BREADTH: f64 = 2.0;
/// The most host routes one suggested rule carries before it asks for an address group.
pub const MAX_HOST_ROUTES: usize = 16;
/// Evidence younger than this (of gap-free time) keeps a suggestion `learning`.
pub const LEARNING_MS: i64 = 72 * 3_600_000;
/// Linux's default `net.ipv4.ip_local_port_range`, for a host that did not report its own.
pub const DEFAULT_EPHEMERAL: (u16, u16) = (32_768, 60_999);

/// A managed source: the workload and its labels when the flow was recorded.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Managed {
    pub id: WorkloadId,
    pub labels: Labels,
}

/// One recorded flow key towards a destination, summed over the range: the input.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub destination: WorkloadId,
    pub address: IpAddr,
    /// The workload that held `address` when the flow was recorded, if any.
    pub managed: Option<Managed>,
    pub protocol: Protocol,
    /// 0 for protocols without ports.
    pub port: u16,
    pub connections: u64,
    pub records: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    /// The UTC days (days since the epoch) it was seen on.
    pub days: BTreeSet<i64>,
}

/// A destination in scope, as it stands now.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    /// How evidence names it: its hostname and id.
    pub hostname: String,
    pub labels: Labels,
    /// Its host's ephemeral port range (inclusive).
    pub ephemeral: (u16, u16),
    /// Gap-free share of the range (0..=1).
    pub coverage: f64,
    /// Gap-free hours of evidence at the range's end, newest first, up to [`LEARNING_MS`].
    pub recent_gap_free_ms: i64,
    /// Connections recorded towards it in the range that the applied version admits, and all.
    pub admitted_connections: u64,
    pub connections: u64,
}

/// What the estate holds now that suggestions are written in terms of.
#[derive(Debug, Clone, Default)]
pub struct Estate {
    /// Every live workload's labels now (breadth counts these).
    pub labels: BTreeMap<WorkloadId, Labels>,
    pub address_groups: BTreeMap<String, BTreeSet<Cidr>>,
    pub services: BTreeMap<String, Vec<ServiceEntry>>,
}

/// What an operator asked for.
#[derive(Debug, Clone)]
pub struct Params {
    /// Label keys that identify a host, not a role: left out of groups and selectors.
    pub excluded_keys: BTreeSet<String>,
    pub max_breadth: f64,
    pub from_ms: i64,
    pub to_ms: i64,
}

/// A suggestion some operator ignored: not shown again unless a source outside these appears.
pub type Ignored = BTreeMap<(String, Protocol, u16), BTreeSet<String>>;

/// Who a suggested rule admits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SuggestedPeer {
    /// Workloads with every one of these labels.
    Workloads(Labels),
    /// An existing address group holding every observed address.
    AddressGroup(String),
    /// Host routes of the observed addresses.
    Cidrs(Vec<String>),
    /// More addresses than host routes allow: an operator should name them in a group first.
    NeedsAddressGroup { addresses: usize },
}

/// The service a suggested rule names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SuggestedService {
    pub name: String,
    /// Whether the service exists with exactly this entry; if not, accepting creates it.
    pub exists: bool,
    /// `tcp:5432`, `icmp`, …
    pub entry: String,
}

/// Why a suggestion is or is not final yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum State {
    /// Changed within the last 72 h of gap-free evidence.
    Learning {
        reason: String,
    },
    Stable,
    /// Written into a draft.
    Accepted {
        draft: String,
    },
}

/// The evidence behind one suggested rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Evidence {
    pub flows: u64,
    pub connections: u64,
    /// Every observed source: a workload's id with its labels then, or an address.
    pub sources: Vec<String>,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    pub days_seen: usize,
    pub days_in_range: usize,
    /// Gap-free share of the range, the least of the group's destinations.
    pub coverage: f64,
    /// Live workloads the selector picks now ÷ observed source workloads (workload peers only).
    pub breadth: Option<f64>,
    /// Admitted ÷ all recorded connections towards the group, at the applied versions, before
    /// and with this rule.
    pub rule_coverage_before: f64,
    pub rule_coverage_after: f64,
}

/// One suggested rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Suggestion {
    /// Stable over runs: 12 hex digits of SHA-256 over (group, protocol/port, peer).
    pub id: String,
    /// The destination group: the ruleset's scope.
    pub group: Labels,
    pub destinations: Vec<String>,
    pub protocol: String,
    pub port: u16,
    pub peer: SuggestedPeer,
    pub service: SuggestedService,
    #[serde(flatten)]
    pub state: State,
    /// Sources an ignored suggestion of the same group and port did not have.
    pub new_since_ignored: Vec<String>,
    pub evidence: Evidence,
    /// SHA-256 (hex) of the evidence as shown: written on the accepted rule.
    pub evidence_digest: String,
}

impl Suggestion {
    /// The key an ignore is recorded under.
    pub fn ignore_key(&self) -> (String, Protocol, u16) {
        (group_text(&self.group), self.protocol.parse().expect("written from a Protocol"), self.port)
    }

    /// Whether it can become a rule (a peer too wide for host routes cannot).
    pub fn is_rule(&self) -> bool {
        !matches!(self.peer, SuggestedPeer::NeedsAddressGroup { .. })
    }
}

/// Flows left out, by why and destination, never silently.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Excluded {
    pub reason: String,
    pub destination: String,
    pub flows: u64,
    pub connections: u64,
}

/// Everything one run proposes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Suggestions {
    pub from_ms: i64,
    pub to_ms: i64,
    pub suggestions: Vec<Suggestion>,
    pub excluded: Vec<Excluded>,
    /// Suggestions held back because an operator ignored them and no new source appeared.
    pub ignored: usize,
}

/// `key=value,…` of a group, the text its fingerprint and ignores use.
pub fn group_text(group: &Labels) -> String {
    group.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

fn role(labels: &Labels, excluded: &BTreeSet<String>) -> Labels {
    labels.iter().filter(|(k, _)| !excluded.contains(*k)).map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// How a source is named in evidence and ignores.
pub fn source_text(o: &Observation) -> String {
    match &o.managed {
        Some(m) => format!("{} {{{}}}", m.id, group_text(&m.labels)),
        None => o.address.to_string(),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

fn protocol_entry(protocol: Protocol, port: u16) -> String {
    match protocol.has_ports() {
        true => format!("{protocol}:{port}"),
        false => protocol.to_string(),
    }
}

fn service_for(estate: &Estate, protocol: Protocol, port: u16) -> SuggestedService {
    let entry = protocol_entry(protocol, port);
    let exact = |entries: &Vec<ServiceEntry>| {
        let [e] = entries.as_slice() else { return false };
        e.protocol == protocol
            && match protocol.has_ports() {
                true => matches!(e.ports.as_slice(), [r] if r.start() == port && r.end() == port),
                false => e.ports.is_empty(),
            }
    };
    if let Some((name, _)) = estate.services.iter().find(|(_, entries)| exact(entries)) {
        return SuggestedService { name: name.clone(), exists: true, entry };
    }
    let plain = entry.replace(':', "-");
    let name = match estate.services.contains_key(&plain) {
        false => plain,
        true => format!("suggested-{plain}"),
    };
    SuggestedService { name, exists: false, entry }
}

fn host_route(a: IpAddr) -> Cidr {
    Cidr::host(a).expect("a recorded source address is a valid host route")
}

/// The smallest existing group holding every address (fewest addresses, then name).
fn group_holding(estate: &Estate, addresses: &BTreeSet<IpAddr>) -> Option<String> {
    estate
        .address_groups
        .iter()
        .filter(|(_, cidrs)| addresses.iter().all(|a| cidrs.iter().any(|c| c.contains(a))))
        .min_by_key(|(name, cidrs)| (cidrs.iter().map(size).fold(0u128, u128::saturating_add), *name))
        .map(|(name, _)| name.clone())
}

/// The addresses a CIDR spans (saturating for IPv6).
fn size(c: &Cidr) -> u128 {
    let net = c.net();
    let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1u128.checked_shl(host_bits).unwrap_or(u128::MAX)
}

fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The observations of one suggested rule.
struct Cluster<'a> {
    peer: SuggestedPeer,
    breadth: Option<f64>,
    observed: Vec<&'a Observation>,
}

/// The role labels of a managed source, if it has any: without them it goes by address.
fn role_of(o: &Observation, excluded: &BTreeSet<String>) -> Option<Labels> {
    o.managed.as_ref().map(|m| role(&m.labels, excluded)).filter(|r| !r.is_empty())
}

/// Splits one group × (protocol, port)'s observations into rules.
fn clusters<'a>(obs: &[&'a Observation], estate: &Estate, params: &Params) -> Vec<Cluster<'a>> {
    let mut out = Vec::new();
    let (managed, unmanaged): (Vec<&Observation>, Vec<&Observation>) =
        obs.iter().partition(|o| role_of(o, &params.excluded_keys).is_some());
    let breadth_of = |selector: &Labels, observed: &[&Observation]| {
        let ids: BTreeSet<WorkloadId> =
            observed.iter().filter_map(|o| o.managed.as_ref().map(|m| m.id)).collect();
        let selected = estate.labels.values().filter(|l| selects(selector, l)).count();
        selected as f64 / ids.len().max(1) as f64
    };
    if !managed.is_empty() {
        let sets: BTreeSet<Labels> =
            managed.iter().filter_map(|o| role_of(o, &params.excluded_keys)).collect();
        let mut shared = sets.first().cloned().unwrap_or_default();
        shared.retain(|k, v| sets.iter().all(|s| s.get(k) == Some(v)));
        let whole = (!shared.is_empty()).then(|| breadth_of(&shared, &managed));
        match whole {
            Some(breadth) if breadth <= params.max_breadth || sets.len() == 1 => out.push(Cluster {
                peer: SuggestedPeer::Workloads(shared),
                breadth: Some(breadth),
                observed: managed,
            }),
            _ => {
                for set in sets {
                    let observed: Vec<&Observation> = managed
                        .iter()
                        .copied()
                        .filter(|o| role_of(o, &params.excluded_keys).as_ref() == Some(&set))
                        .collect();
                    let breadth = breadth_of(&set, &observed);
                    out.push(Cluster {
                        peer: SuggestedPeer::Workloads(set),
                        breadth: Some(breadth),
                        observed,
                    });
                }
            }
        }
    }
    if !unmanaged.is_empty() {
        let addresses: BTreeSet<IpAddr> = unmanaged.iter().map(|o| o.address).collect();
        let peer = match group_holding(estate, &addresses) {
            Some(name) => SuggestedPeer::AddressGroup(name),
            None if addresses.len() <= MAX_HOST_ROUTES => {
                SuggestedPeer::Cidrs(addresses.iter().map(|a| host_route(*a).to_string()).collect())
            }
            None => SuggestedPeer::NeedsAddressGroup { addresses: addresses.len() },
        };
        out.push(Cluster { peer, breadth: None, observed: unmanaged });
    }
    out
}

fn peer_text(peer: &SuggestedPeer) -> String {
    match peer {
        SuggestedPeer::Workloads(l) => format!("workloads:{}", group_text(l)),
        SuggestedPeer::AddressGroup(g) => format!("address-group:{g}"),
        SuggestedPeer::Cidrs(c) => format!("cidrs:{}", c.join(",")),
        SuggestedPeer::NeedsAddressGroup { addresses } => format!("needs-address-group:{addresses}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The suggestion's id: the first 12 hex digits of SHA-256 over group, protocol/port and peer.
pub fn fingerprint(group: &Labels, protocol: Protocol, port: u16, peer: &SuggestedPeer) -> String {
    let text = format!("{}\n{}\n{}", group_text(group), protocol_entry(protocol, port), peer_text(peer));
    sha256_hex(text.as_bytes())[..12].to_owned()
}

const DAY_MS: i64 = 86_400_000;

fn days_in_range(from_ms: i64, to_ms: i64) -> usize {
    let first = from_ms.div_euclid(DAY_MS);
    let last = (to_ms - 1).div_euclid(DAY_MS);
    (last - first + 1).max(0) as usize
}

/// Groups, generalises and judges: the suggestions for `observed` (flows no rule of the applied
/// version admitted, gap and suspect ones already excluded by the caller) towards
/// `destinations`. Flows to a destination's ephemeral ports are excluded here and reported.
/// `accepted` maps ids to the draft they went into; `ignored` holds the sources each ignored
/// (group, protocol, port) had.
pub fn suggest(
    observed: &[Observation],
    destinations: &BTreeMap<WorkloadId, Destination>,
    estate: &Estate,
    params: &Params,
    accepted: &BTreeMap<String, String>,
    ignored: &Ignored,
    mut excluded: Vec<Excluded>,
) -> Suggestions {
    // (group, protocol, port) → observations.
    let mut by_group: BTreeMap<(Labels, Protocol, u16), Vec<&Observation>> = BTreeMap::new();
    let mut ephemeral: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for o in observed {
        let Some(d) = destinations.get(&o.destination) else { continue };
        if o.protocol.has_ports() && (d.ephemeral.0..=d.ephemeral.1).contains(&o.port) {
            let e = ephemeral.entry(d.hostname.clone()).or_default();
            e.0 += o.records;
            e.1 += o.connections;
            continue;
        }
        by_group.entry((role(&d.labels, &params.excluded_keys), o.protocol, o.port)).or_default().push(o);
    }
    for (destination, (flows, connections)) in ephemeral {
        excluded.push(Excluded {
            reason: "to the host's ephemeral port range (replies or dynamic ports: never a rule)".into(),
            destination,
            flows,
            connections,
        });
    }
    let total_days = days_in_range(params.from_ms, params.to_ms);
    let mut suggestions = Vec::new();
    let mut held_back = 0;
    for ((group, protocol, port), obs) in &by_group {
        if group.is_empty() {
            for o in obs {
                excluded.push(Excluded {
                    reason: "its destination has no role labels (every key excluded): no scope to write a rule for"
                        .into(),
                    destination: destinations[&o.destination].hostname.clone(),
                    flows: o.records,
                    connections: o.connections,
                });
            }
            continue;
        }
        let members: Vec<&Destination> = destinations
            .iter()
            .filter(|(_, d)| role(&d.labels, &params.excluded_keys) == *group)
            .map(|(_, d)| d)
            .collect();
        let coverage = members.iter().map(|d| d.coverage).fold(1.0f64, f64::min);
        let recent = members.iter().map(|d| d.recent_gap_free_ms).min().unwrap_or(0);
        let admitted: u64 = members.iter().map(|d| d.admitted_connections).sum();
        let all: u64 = members.iter().map(|d| d.connections).sum();
        let share = |n: u64| if all == 0 { 1.0 } else { n as f64 / all as f64 };
        for cluster in clusters(obs, estate, params) {
            let sources: BTreeSet<String> = cluster.observed.iter().map(|o| source_text(o)).collect();
            let key = (group_text(group), *protocol, *port);
            let new_since_ignored: Vec<String> = match ignored.get(&key) {
                Some(known) => {
                    let new: Vec<String> = sources.difference(known).cloned().collect();
                    if new.is_empty() {
                        held_back += 1;
                        continue;
                    }
                    new
                }
                None => Vec::new(),
            };
            let connections: u64 = cluster.observed.iter().map(|o| o.connections).sum();
            let first_seen_ms = cluster.observed.iter().map(|o| o.first_seen_ms).min().unwrap_or(0);
            let days: BTreeSet<i64> = cluster.observed.iter().flat_map(|o| o.days.iter().copied()).collect();
            let evidence = Evidence {
                flows: cluster.observed.iter().map(|o| o.records).sum(),
                connections,
                sources: sources.into_iter().collect(),
                first_seen_ms,
                last_seen_ms: cluster.observed.iter().map(|o| o.last_seen_ms).max().unwrap_or(0),
                days_seen: days.len(),
                days_in_range: total_days,
                coverage,
                breadth: cluster.breadth,
                rule_coverage_before: share(admitted),
                rule_coverage_after: share(admitted + connections),
            };
            // Newest source first seen within the learning period, or too little evidence.
            let newest = cluster
                .observed
                .iter()
                .max_by_key(|o| (o.first_seen_ms, std::cmp::Reverse(source_text(o))))
                .expect("a cluster has observations");
            let id = fingerprint(group, *protocol, *port, &cluster.peer);
            let state = if let Some(draft) = accepted.get(&id) {
                State::Accepted { draft: draft.clone() }
            } else if recent < LEARNING_MS {
                State::Learning {
                    reason: format!(
                        "only {} h of gap-free evidence at the range's end (72 h make it stable)",
                        recent / 3_600_000
                    ),
                }
            } else if newest.first_seen_ms > params.to_ms - LEARNING_MS {
                State::Learning {
                    reason: format!(
                        "source {} first seen {} h before the range's end (72 h make it stable)",
                        source_text(newest),
                        (params.to_ms - newest.first_seen_ms) / 3_600_000
                    ),
                }
            } else {
                State::Stable
            };
            let digest = sha256_hex(&serde_json::to_vec(&evidence).expect("plain data serializes"));
            let mut hosts: Vec<String> = members.iter().map(|d| d.hostname.clone()).collect();
            hosts.sort();
            hosts.dedup();
            suggestions.push(Suggestion {
                id,
                group: group.clone(),
                destinations: hosts,
                protocol: protocol.to_string(),
                port: *port,
                peer: cluster.peer,
                service: service_for(estate, *protocol, *port),
                state,
                new_since_ignored,
                evidence,
                evidence_digest: digest,
            });
        }
    }
    excluded.sort_by(|a, b| (&a.reason, &a.destination).cmp(&(&b.reason, &b.destination)));
    Suggestions { from_ms: params.from_ms, to_ms: params.to_ms, suggestions, excluded, ignored: held_back }
}

/// The name of the ruleset a group's suggestions go into: `suggested-` and the group's values,
/// or its digest when those do not make a valid name.
pub fn ruleset_name(group: &Labels) -> String {
    let values: Vec<&str> = group.values().map(String::as_str).collect();
    let name = format!("suggested-{}", values.join("-"));
    match crate::policy::model::validate_name("ruleset", &name) {
        Ok(()) => name,
        Err(_) => format!("suggested-{}", &sha256_hex(group_text(group).as_bytes())[..12]),
    }
}

/// A suggested rule as the ruleset file writes it: named by its id, its evidence in the
/// description. `None` for a suggestion that is no rule.
pub fn rule_spec(s: &Suggestion) -> Option<RuleSpec> {
    let peers = match &s.peer {
        SuggestedPeer::Workloads(labels) => {
            vec![PeerSpec::workloads(labels.iter().map(|(k, v)| (k.clone(), vec![v.clone()])).collect())]
        }
        SuggestedPeer::AddressGroup(name) => vec![PeerSpec::address_group(name)],
        SuggestedPeer::Cidrs(cidrs) => cidrs.iter().map(|c| PeerSpec::cidr(c)).collect(),
        SuggestedPeer::NeedsAddressGroup { .. } => return None,
    };
    Some(RuleSpec {
        name: format!("suggested-{}", s.id),
        description: format!("suggestion {} (evidence sha256:{})", s.id, &s.evidence_digest[..16]),
        enabled: true,
        peers,
        services: vec![s.service.name.clone()],
    })
}

/// The rulesets (one per destination group, rules in id order) the rule-ready `suggestions`
/// make; `base` holds existing rulesets by name, whose other rules are kept.
pub fn rulesets(suggestions: &[&Suggestion], base: &BTreeMap<String, RulesetSpec>) -> Vec<RulesetSpec> {
    let mut out: BTreeMap<String, RulesetSpec> = BTreeMap::new();
    for s in suggestions {
        let Some(rule) = rule_spec(s) else { continue };
        let name = ruleset_name(&s.group);
        let set = out.entry(name.clone()).or_insert_with(|| {
            base.get(&name).cloned().unwrap_or_else(|| RulesetSpec {
                name: name.clone(),
                description: format!("rules suggested from recorded flows towards {}", group_text(&s.group)),
                enabled: true,
                scope: s.group.iter().map(|(k, v)| (k.clone(), vec![v.clone()])).collect(),
                rules: Vec::new(),
            })
        });
        set.rules.retain(|r| r.name != rule.name);
        set.rules.push(rule);
        set.rules.sort_by(|a, b| a.name.cmp(&b.name));
    }
    out.into_values().collect()
}

/// The suggestions as ruleset files (YAML, one per destination group, by ruleset name), each
/// rule's evidence as comments above it: what `ruleset create -f` reads.
pub fn ruleset_files(suggestions: &Suggestions) -> Vec<(String, String)> {
    let ready: Vec<&Suggestion> = suggestions.suggestions.iter().filter(|s| s.is_rule()).collect();
    let mut files = Vec::new();
    for set in rulesets(&ready, &BTreeMap::new()) {
        let mut out = String::new();
        for s in ready.iter().filter(|s| ruleset_name(&s.group) == set.name) {
            let e = &s.evidence;
            out.push_str(&format!(
                "# suggested-{}: {} {} from {}: {} flows, {} connections, {} sources, seen on {} of {} days, coverage {:.0}%{}\n",
                s.id,
                s.protocol,
                s.port,
                peer_text(&s.peer),
                e.flows,
                e.connections,
                e.sources.len(),
                e.days_seen,
                e.days_in_range,
                e.coverage * 100.0,
                e.breadth.map(|b| format!(", breadth {b:.2}")).unwrap_or_default()
            ));
            if !s.service.exists {
                out.push_str(&format!(
                    "#   needs service {} ({}): innerwall service create {} --entry {}\n",
                    s.service.name, s.service.entry, s.service.name, s.service.entry
                ));
            }
        }
        out.push_str(&serde_norway::to_string(&set).expect("plain data serializes"));
        files.push((set.name, out));
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000;
    const TO: i64 = 20 * DAY_MS;
    const FROM: i64 = TO - 14 * DAY_MS;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn id(n: u128) -> WorkloadId {
        WorkloadId::from_uuid(uuid::Uuid::from_u128(n)).unwrap()
    }

    fn params() -> Params {
        Params { excluded_keys: BTreeSet::new(), max_breadth: DEFAULT_MAX_BREADTH, from_ms: FROM, to_ms: TO }
    }

    fn destination(name: &str, l: Labels) -> Destination {
        Destination {
            hostname: name.into(),
            labels: l,
            ephemeral: DEFAULT_EPHEMERAL,
            coverage: 1.0,
            recent_gap_free_ms: LEARNING_MS,
            admitted_connections: 90,
            connections: 100,
        }
    }

    /// A flow from workload `src` (labels then) or address, seen on `days` (days before the end).
    fn seen(
        dst: u128,
        src: Option<(u128, Labels)>,
        address: [u8; 4],
        port: u16,
        days: &[i64],
    ) -> Observation {
        let days: BTreeSet<i64> = days.iter().map(|d| TO.div_euclid(DAY_MS) - 1 - d).collect();
        Observation {
            destination: id(dst),
            address: IpAddr::from(address),
            managed: src.map(|(n, labels)| Managed { id: id(n), labels }),
            protocol: Protocol::Tcp,
            port,
            connections: 5,
            records: 2,
            first_seen_ms: days.first().unwrap() * DAY_MS + HOUR,
            last_seen_ms: days.last().unwrap() * DAY_MS + 2 * HOUR,
            days,
        }
    }

    struct World {
        destinations: BTreeMap<WorkloadId, Destination>,
        estate: Estate,
    }

    /// Destination 1 (`app=db`), web sources 10 (prod) and 11 (staging), and `extra` more live
    /// web workloads nobody saw.
    fn world(extra: u128) -> World {
        let db = labels(&[("app", "db")]);
        let mut estate = Estate::default();
        estate.labels.insert(id(1), db.clone());
        estate.labels.insert(id(10), labels(&[("app", "web"), ("env", "prod")]));
        estate.labels.insert(id(11), labels(&[("app", "web"), ("env", "staging")]));
        for n in 0..extra {
            estate.labels.insert(id(100 + n), labels(&[("app", "web"), ("env", "dev")]));
        }
        estate
            .services
            .insert("postgres".into(), vec![ServiceEntry::new(Protocol::Tcp, vec![port(5432)]).unwrap()]);
        World { destinations: BTreeMap::from([(id(1), destination("db-1", db))]), estate }
    }

    fn port(p: u16) -> innerwall_wire::policy::PortRange {
        innerwall_wire::policy::PortRange::single(p).unwrap()
    }

    fn web_flows() -> Vec<Observation> {
        vec![
            seen(
                1,
                Some((10, labels(&[("app", "web"), ("env", "prod")]))),
                [10, 0, 0, 10],
                5432,
                &[3, 4, 5, 6],
            ),
            seen(1, Some((11, labels(&[("app", "web"), ("env", "staging")]))), [10, 0, 0, 11], 5432, &[4]),
        ]
    }

    fn run(w: &World, flows: &[Observation], ignored: &Ignored) -> Suggestions {
        suggest(flows, &w.destinations, &w.estate, &params(), &BTreeMap::new(), ignored, Vec::new())
    }

    #[test]
    fn sources_sharing_a_role_become_one_selector_within_the_breadth_bound() {
        let out = run(&world(2), &web_flows(), &Ignored::new());
        let [s] = out.suggestions.as_slice() else { panic!("{out:#?}") };
        assert_eq!(s.peer, SuggestedPeer::Workloads(labels(&[("app", "web")])));
        assert_eq!(s.evidence.breadth, Some(2.0), "4 web workloads now, 2 observed");
        assert_eq!((s.evidence.days_seen, s.evidence.days_in_range), (4, 14));
        assert_eq!(
            s.service,
            SuggestedService { name: "postgres".into(), exists: true, entry: "tcp:5432".into() }
        );
        assert_eq!(s.group, labels(&[("app", "db")]));
        assert_eq!(s.evidence.connections, 10);
        assert!(
            (s.evidence.rule_coverage_before - 0.9).abs() < 1e-9 && s.evidence.rule_coverage_after == 1.0
        );
        assert_eq!(s.state, State::Stable);
    }

    #[test]
    fn too_broad_a_selector_becomes_one_rule_per_observed_label_set() {
        let out = run(&world(3), &web_flows(), &Ignored::new());
        let peers: Vec<&SuggestedPeer> = out.suggestions.iter().map(|s| &s.peer).collect();
        assert_eq!(
            peers,
            [
                &SuggestedPeer::Workloads(labels(&[("app", "web"), ("env", "prod")])),
                &SuggestedPeer::Workloads(labels(&[("app", "web"), ("env", "staging")])),
            ]
        );
        assert!(out.suggestions.iter().all(|s| s.evidence.breadth == Some(1.0)));
        // Sources sharing nothing never give the empty selector.
        let mut flows = web_flows();
        flows[1].managed = Some(Managed { id: id(11), labels: labels(&[("team", "ops")]) });
        let out = run(&world(0), &flows, &Ignored::new());
        assert_eq!(out.suggestions.len(), 2, "{out:#?}");
        assert!(
            out.suggestions.iter().all(|s| matches!(&s.peer, SuggestedPeer::Workloads(l) if !l.is_empty()))
        );
    }

    #[test]
    fn unmanaged_sources_use_a_group_holding_them_else_host_routes_else_say_so() {
        let mut w = world(0);
        let flows: Vec<Observation> = (1..=3).map(|n| seen(1, None, [192, 0, 2, n], 5432, &[1])).collect();
        let out = run(&w, &flows, &Ignored::new());
        assert_eq!(
            out.suggestions[0].peer,
            SuggestedPeer::Cidrs(vec!["192.0.2.1/32".into(), "192.0.2.2/32".into(), "192.0.2.3/32".into()])
        );
        w.estate.address_groups.insert("wide".into(), BTreeSet::from([Cidr::parse("192.0.0.0/16").unwrap()]));
        w.estate
            .address_groups
            .insert("narrow".into(), BTreeSet::from([Cidr::parse("192.0.2.0/24").unwrap()]));
        w.estate
            .address_groups
            .insert("partial".into(), BTreeSet::from([Cidr::parse("192.0.2.1/32").unwrap()]));
        let out = run(&w, &flows, &Ignored::new());
        assert_eq!(out.suggestions[0].peer, SuggestedPeer::AddressGroup("narrow".into()));
        let many: Vec<Observation> = (1..=17).map(|n| seen(1, None, [198, 51, 100, n], 5432, &[1])).collect();
        let out = run(&w, &many, &Ignored::new());
        assert_eq!(out.suggestions[0].peer, SuggestedPeer::NeedsAddressGroup { addresses: 17 });
        assert!(!out.suggestions[0].is_rule() && rule_spec(&out.suggestions[0]).is_none());
        assert!(ruleset_files(&out).is_empty(), "no rule wider than what was seen");
    }

    #[test]
    fn ephemeral_ports_are_excluded_and_reported_and_new_ports_need_a_service() {
        let w = world(0);
        let mut flows = web_flows();
        flows[1].port = 40_000;
        flows[0].port = 8080;
        let out = run(&w, &flows, &Ignored::new());
        let [s] = out.suggestions.as_slice() else { panic!("{out:#?}") };
        assert_eq!(
            s.service,
            SuggestedService { name: "tcp-8080".into(), exists: false, entry: "tcp:8080".into() }
        );
        let [e] = out.excluded.as_slice() else { panic!("{out:#?}") };
        assert!(e.reason.contains("ephemeral") && e.destination == "db-1" && e.connections == 5, "{e:?}");
    }

    #[test]
    fn recent_sources_and_short_evidence_keep_a_suggestion_learning() {
        let mut w = world(0);
        let mut flows = web_flows();
        flows[1].first_seen_ms = TO - 5 * HOUR;
        let out = run(&w, &flows, &Ignored::new());
        let State::Learning { reason } = &out.suggestions[0].state else { panic!("{out:#?}") };
        assert!(reason.contains("first seen 5 h before"), "{reason}");
        w.destinations.get_mut(&id(1)).unwrap().recent_gap_free_ms = 10 * HOUR;
        let out = run(&w, &web_flows(), &Ignored::new());
        assert!(
            matches!(&out.suggestions[0].state, State::Learning { reason } if reason.contains("only 10 h"))
        );
    }

    #[test]
    fn an_ignored_suggestion_returns_only_with_a_new_source_named() {
        let w = world(2);
        let first = run(&w, &web_flows(), &Ignored::new());
        let s = &first.suggestions[0];
        let ignored = Ignored::from([(s.ignore_key(), s.evidence.sources.iter().cloned().collect())]);
        let again = run(&w, &web_flows(), &ignored);
        assert_eq!((again.suggestions.len(), again.ignored), (0, 1));
        let mut flows = web_flows();
        flows.push(seen(
            1,
            Some((12, labels(&[("app", "web"), ("env", "prod")]))),
            [10, 0, 0, 12],
            5432,
            &[1],
        ));
        let back = run(&w, &flows, &ignored);
        assert_eq!(back.suggestions.len(), 1, "{back:#?}");
        assert_eq!(back.suggestions[0].new_since_ignored, [format!("{} {{app=web,env=prod}}", id(12))]);
    }

    #[test]
    fn the_same_flows_give_the_same_bytes_and_a_ruleset_file() {
        let w = world(3);
        let a = run(&w, &web_flows(), &Ignored::new());
        let mut reversed = web_flows();
        reversed.reverse();
        let b = run(&w, &reversed, &Ignored::new());
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
        let files = ruleset_files(&a);
        assert_eq!(files, ruleset_files(&b));
        let [(name, text)] = files.as_slice() else { panic!("{files:?}") };
        assert_eq!(name, "suggested-db");
        let spec = crate::policy::spec::parse_ruleset_file("suggested", text).unwrap();
        crate::policy::spec::validate_ruleset(&spec).unwrap();
        assert_eq!(spec.rules.len(), 2);
        assert!(text.contains("seen on 4 of 14 days") && text.contains("seen on 1 of 14 days"), "{text}");
    }
}
