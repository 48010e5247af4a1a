//! The delta contract (SYNC-1), executable: for every change variant alone, in combination, and
//! for random policy pairs, `apply(a, diff(a, b))` is `b` byte for byte, a second diff is empty,
//! and the diff is empty exactly when `a == b`. A delta on the wrong base is refused untouched.

use std::collections::{BTreeMap, BTreeSet};

use innerwall_wire::policy::{
    ApplyError, Change, Cidr, Mode, PolicyDelta, PortRange, Protocol, ResolvedRule, RuleId, Staged,
    WorkloadPolicy, diff,
};
use innerwall_wire::proto;
use proptest::prelude::*;
use proptest::sample::select;

// Small pools make the interesting collisions (same rule id, same peer) frequent.
const CIDRS: &[&str] = &[
    "10.0.0.1/32",
    "10.0.0.2/32",
    "10.0.1.0/24",
    "10.0.0.0/16",
    "192.168.7.9/32",
    "0.0.0.0/0",
    "fd00::1/128",
    "fd00::2/128",
    "fd00:1::/64",
    "2001:db8::/32",
];
const AUTHORED: &[&str] = &["r1", "r2", "r3", "b7c1e0d2-4f7a-4c55-9a0e-1d2c3b4a5f60", "web.https:v2"];

fn cidr() -> impl Strategy<Value = Cidr> {
    select(CIDRS).prop_map(|c| Cidr::parse(c).unwrap())
}

fn rule_id() -> impl Strategy<Value = RuleId> {
    (select(AUTHORED), select(&Protocol::ALL[..])).prop_map(|(a, p)| RuleId::new(a, p).unwrap())
}

fn port_range() -> impl Strategy<Value = PortRange> {
    prop_oneof![
        9 => (1u32..200, 0u32..5).prop_map(|(s, len)| PortRange::new(s, s + len).unwrap()),
        1 => Just(PortRange::ALL),
    ]
}

fn ports_for(protocol: Protocol) -> BoxedStrategy<Vec<PortRange>> {
    if protocol.has_ports() {
        prop::collection::vec(port_range(), 1..4).boxed()
    } else {
        Just(Vec::new()).boxed()
    }
}

fn rule_with_id(id: RuleId) -> impl Strategy<Value = ResolvedRule> {
    let protocol = id.protocol();
    (ports_for(protocol), prop::collection::btree_set(cidr(), 0..6))
        .prop_map(move |(ports, peers)| ResolvedRule::new(id.clone(), ports, peers).unwrap())
}

fn rule() -> impl Strategy<Value = ResolvedRule> {
    rule_id().prop_flat_map(rule_with_id)
}

fn mode() -> impl Strategy<Value = Mode> {
    select(&Mode::ALL[..])
}

/// A revert deadline (FLOW-11) about one policy in three carries.
fn revert_at() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![2 => Just(None), 1 => (1i64..4_000_000_000_000).prop_map(Some)]
}

/// A staged set (FLOW-10) about one policy in three carries: upserts and removals, disjoint.
fn staged() -> impl Strategy<Value = Option<Staged>> {
    let set = (
        select(&["rs.db:1", "rs.db:2", "web:7"][..]),
        prop::collection::vec(rule(), 0..3),
        prop::collection::vec(rule_id(), 0..3),
    )
        .prop_map(|(set, upserts, removals)| {
            let upserts: BTreeMap<RuleId, ResolvedRule> =
                upserts.into_iter().map(|r| (r.id().clone(), r)).collect();
            let removals: Vec<RuleId> = removals.into_iter().filter(|id| !upserts.contains_key(id)).collect();
            Staged::new(set, upserts.into_values(), removals).ok()
        });
    prop_oneof![2 => Just(None), 1 => set]
}

fn policy() -> impl Strategy<Value = WorkloadPolicy> {
    (1u64..1000, mode(), prop::collection::vec(rule(), 0..8), revert_at(), staged()).prop_map(
        |(version, mode, rules, revert_at, staged)| {
            let unique: BTreeMap<RuleId, ResolvedRule> =
                rules.into_iter().map(|r| (r.id().clone(), r)).collect();
            WorkloadPolicy::new(version, mode, unique.into_values())
                .unwrap()
                .with_revert_at(revert_at)
                .unwrap()
                .with_staged(staged)
        },
    )
}

/// `p`'s version, mode, revert deadline and staged set over other rules.
fn with_rules(p: &WorkloadPolicy, rules: impl IntoIterator<Item = ResolvedRule>) -> WorkloadPolicy {
    WorkloadPolicy::new(p.version(), p.mode(), rules)
        .unwrap()
        .with_revert_at(p.revert_at())
        .unwrap()
        .with_staged(p.staged().cloned())
}

/// The same content under a later version, as a render would stamp it.
fn bumped(content: WorkloadPolicy, base: &WorkloadPolicy, by: u64) -> WorkloadPolicy {
    content.with_version(base.version() + by)
}

/// The three properties of the contract, plus minimality and a lossless trip through protobuf.
fn check_contract(a: &WorkloadPolicy, b: &WorkloadPolicy) -> PolicyDelta {
    let delta = diff(a, b);
    let applied = a.apply(&delta).unwrap_or_else(|e| panic!("apply(a, diff(a, b)) refused: {e}\n{delta:#?}"));
    assert_eq!(applied.canonical_bytes(), b.canonical_bytes(), "apply(a, diff(a, b)) != b");
    assert_eq!(&applied, b);
    assert!(diff(b, &applied).is_empty(), "second diff not empty: {:#?}", diff(b, &applied));
    assert_eq!(delta.is_empty(), a == b, "diff empty exactly when a == b");
    assert_eq!(a.canonical_bytes() == b.canonical_bytes(), a == b, "equal policies, equal bytes");
    assert_minimal(a, b, &delta);

    let wire = proto::PolicyDelta::from(&delta);
    assert_eq!(PolicyDelta::try_from(&wire).unwrap(), delta, "delta survives the wire");
    let decoded = WorkloadPolicy::from_canonical_bytes(&b.canonical_bytes()).unwrap();
    assert_eq!(&decoded, b, "policy survives canonical bytes");
    delta
}

/// No change is redundant: each says something true about a → b, and each rule is touched once.
fn assert_minimal(a: &WorkloadPolicy, b: &WorkloadPolicy, delta: &PolicyDelta) {
    let mode_changes = delta.changes.iter().filter(|c| matches!(c, Change::SetMode(_))).count();
    assert_eq!(mode_changes, usize::from(a.mode() != b.mode()), "set_mode iff modes differ");
    let deadline_changes = delta.changes.iter().filter(|c| matches!(c, Change::SetRevertAt(_))).count();
    assert_eq!(
        deadline_changes,
        usize::from(a.revert_at() != b.revert_at()),
        "set_revert_at iff deadlines differ"
    );
    let staged_changes = delta.changes.iter().filter(|c| matches!(c, Change::SetStaged(_))).count();
    assert_eq!(staged_changes, usize::from(a.staged() != b.staged()), "set_staged iff staged sets differ");
    let mut touched: BTreeMap<&RuleId, Vec<&Change>> = BTreeMap::new();
    for change in &delta.changes {
        match change {
            Change::SetMode(_) | Change::SetRevertAt(_) | Change::SetStaged(_) => {}
            Change::UpsertRule(rule) => {
                let old = a.rule(rule.id());
                assert!(
                    old.is_none_or(|old| old.ports() != rule.ports()),
                    "upsert only for new rules or new ports"
                );
                touched.entry(rule.id()).or_default().push(change);
            }
            Change::RemoveRule(id) => {
                assert!(a.rule(id).is_some() && b.rule(id).is_none(), "remove only what goes");
                touched.entry(id).or_default().push(change);
            }
            Change::AddPeers { rule, peers } | Change::RemovePeers { rule, peers } => {
                assert!(!peers.is_empty());
                let adding = matches!(change, Change::AddPeers { .. });
                let old = a.rule(rule).expect("peer change on a rule a has").peers();
                assert!(peers.iter().all(|p| old.contains(p) != adding), "peer change must change something");
                touched.entry(rule).or_default().push(change);
            }
        }
    }
    for (id, changes) in touched {
        let peer_only =
            changes.iter().all(|c| matches!(c, Change::AddPeers { .. } | Change::RemovePeers { .. }));
        assert!(changes.len() == 1 || (peer_only && changes.len() == 2), "rule {id} touched redundantly");
    }
}

/// Changes of exactly one variant kind, for the per-variant properties.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    SetMode,
    SetRevertAt,
    SetStaged,
    UpsertNew,
    UpsertPorts,
    RemoveRule,
    AddPeers,
    RemovePeers,
}

fn kind_of(change: &Change, a: &WorkloadPolicy) -> Kind {
    match change {
        Change::SetMode(_) => Kind::SetMode,
        Change::SetRevertAt(_) => Kind::SetRevertAt,
        Change::SetStaged(_) => Kind::SetStaged,
        Change::UpsertRule(r) if a.rule(r.id()).is_some() => Kind::UpsertPorts,
        Change::UpsertRule(_) => Kind::UpsertNew,
        Change::RemoveRule(_) => Kind::RemoveRule,
        Change::AddPeers { .. } => Kind::AddPeers,
        Change::RemovePeers { .. } => Kind::RemovePeers,
    }
}

fn replace_rule(p: &WorkloadPolicy, rule: ResolvedRule) -> WorkloadPolicy {
    let id = rule.id().clone();
    let rules = p.rules().filter(|r| *r.id() != id).cloned().chain([rule]);
    with_rules(p, rules)
}

/// Applies one mutation of `kind` to `p`, driven by `seed`; `None` if `p` offers no target.
fn mutate(p: &WorkloadPolicy, kind: Kind, seed: &Seed) -> Option<WorkloadPolicy> {
    let rules: Vec<&ResolvedRule> = p.rules().collect();
    let pick = |n: usize| (n > 0).then(|| seed.index % n);
    match kind {
        Kind::SetMode => {
            let others: Vec<Mode> = Mode::ALL.into_iter().filter(|m| *m != p.mode()).collect();
            Some(p.clone().with_mode(others[seed.index % 2]))
        }
        Kind::SetRevertAt => {
            let at = match p.revert_at() {
                Some(_) if seed.index.is_multiple_of(2) => None,
                Some(at) => Some(at + 1 + (seed.index % 600_000) as i64),
                None => Some(1_700_000_000_000 + (seed.index % 600_000) as i64),
            };
            Some(p.clone().with_revert_at(at).unwrap())
        }
        Kind::SetStaged => {
            let staged = match p.staged() {
                Some(_) if seed.index.is_multiple_of(2) => None,
                _ => {
                    Some(Staged::new(&format!("set:{}", seed.index % 1000), [seed.rule.clone()], []).unwrap())
                }
            };
            (p.staged() != staged.as_ref()).then(|| p.clone().with_staged(staged))
        }
        Kind::UpsertNew => {
            if p.rule(seed.rule.id()).is_some() {
                return None;
            }
            Some(replace_rule(p, seed.rule.clone()))
        }
        Kind::UpsertPorts => {
            let candidates: Vec<ResolvedRule> = rules
                .iter()
                .filter(|r| r.protocol().has_ports())
                .map(|r| {
                    ResolvedRule::new(r.id().clone(), seed.ports.clone(), r.peers().iter().copied()).unwrap()
                })
                .filter(|new| new.ports() != p.rule(new.id()).unwrap().ports())
                .collect();
            Some(replace_rule(p, candidates.get(pick(candidates.len())?)?.clone()))
        }
        Kind::RemoveRule => {
            let gone = rules.get(pick(rules.len())?)?.id().clone();
            Some(with_rules(p, p.rules().filter(|r| *r.id() != gone).cloned()))
        }
        Kind::AddPeers | Kind::RemovePeers => {
            let adding = kind == Kind::AddPeers;
            let old = rules.get(pick(rules.len())?)?;
            let peers: BTreeSet<Cidr> = if adding {
                old.peers().union(&seed.peers).copied().collect()
            } else {
                old.peers().difference(&seed.peers).copied().collect()
            };
            if &peers == old.peers() {
                return None;
            }
            Some(replace_rule(p, ResolvedRule::new(old.id().clone(), old.ports().to_vec(), peers).unwrap()))
        }
    }
}

#[derive(Debug, Clone)]
struct Seed {
    index: usize,
    rule: ResolvedRule,
    ports: Vec<PortRange>,
    peers: BTreeSet<Cidr>,
}

fn seed() -> impl Strategy<Value = Seed> {
    (
        any::<usize>(),
        rule(),
        prop::collection::vec(port_range(), 1..3),
        prop::collection::btree_set(cidr(), 1..4),
    )
        .prop_map(|(index, rule, ports, peers)| Seed { index, rule, ports, peers })
}

fn check_single_variant(a: &WorkloadPolicy, kind: Kind, seed: &Seed, bump: u64) -> Result<(), TestCaseError> {
    let Some(b) = mutate(a, kind, seed) else {
        return Err(TestCaseError::reject("policy offers no target for this variant"));
    };
    let b = bumped(b, a, bump);
    let delta = check_contract(a, &b);
    prop_assert!(!delta.changes.is_empty());
    for change in &delta.changes {
        prop_assert_eq!(kind_of(change, a), kind, "{:?}", change);
    }
    Ok(())
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, max_global_rejects: cases * 20, ..ProptestConfig::default() }
}

macro_rules! single_variant {
    ($name:ident, $kind:expr) => {
        proptest! {
            #![proptest_config(config(1000))]
            #[test]
            fn $name(a in policy(), seed in seed(), bump in 1u64..4) {
                check_single_variant(&a, $kind, &seed, bump)?;
            }
        }
    };
}

single_variant!(diff_apply_contract_set_mode, Kind::SetMode);
single_variant!(diff_apply_contract_set_revert_at, Kind::SetRevertAt);
single_variant!(diff_apply_contract_set_staged, Kind::SetStaged);
single_variant!(diff_apply_contract_upsert_new_rule, Kind::UpsertNew);
single_variant!(diff_apply_contract_upsert_changed_ports, Kind::UpsertPorts);
single_variant!(diff_apply_contract_remove_rule, Kind::RemoveRule);
single_variant!(diff_apply_contract_add_peers, Kind::AddPeers);
single_variant!(diff_apply_contract_remove_peers, Kind::RemovePeers);

const KINDS: [Kind; 8] = [
    Kind::SetMode,
    Kind::SetRevertAt,
    Kind::SetStaged,
    Kind::UpsertNew,
    Kind::UpsertPorts,
    Kind::RemoveRule,
    Kind::AddPeers,
    Kind::RemovePeers,
];

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn diff_apply_contract_combinations(
        a in policy(),
        steps in prop::collection::vec((select(&KINDS[..]), seed()), 1..8),
        bump in 1u64..4,
    ) {
        let mut b = a.clone();
        for (kind, seed) in &steps {
            b = mutate(&b, *kind, seed).unwrap_or(b);
        }
        let b = if b == a { b } else { bumped(b, &a, bump) };
        check_contract(&a, &b);
    }

    #[test]
    fn diff_apply_contract_random_pairs(a in policy(), b in policy(), bump in 1u64..4) {
        check_contract(&a, &bumped(b, &a, bump));
        check_contract(&a, &a.clone());
    }

    #[test]
    fn diff_apply_contract_chain_of_versions(versions in prop::collection::vec(policy(), 2..6)) {
        // Consecutive versions as a stream carries them: snapshot, then deltas from its tip.
        let mut held = versions[0].clone().with_version(1);
        for (i, next) in versions.iter().enumerate().skip(1) {
            let next = next.clone().with_version(i as u64 + 1);
            held = held.apply(&diff(&held, &next)).unwrap();
            prop_assert_eq!(held.canonical_bytes(), next.canonical_bytes());
        }
    }

    #[test]
    fn apply_refuses_wrong_base(a in policy(), b in policy(), offset in 1u64..5, later in any::<bool>()) {
        let b = bumped(b, &a, 1);
        let delta = diff(&a, &b);
        let held_version = if later { a.version() + offset } else { a.version().saturating_sub(offset) };
        prop_assume!(held_version != a.version());
        // Same content, other version: the content would apply, the base is still wrong.
        let held = a.clone().with_version(held_version);
        let before = held.canonical_bytes();
        prop_assert_eq!(
            held.apply(&delta),
            Err(ApplyError::BaseMismatch { held: held_version, from: a.version() })
        );
        prop_assert_eq!(held.canonical_bytes(), before, "refused apply must leave the input untouched");
    }
}

fn rule_of(id: &str, ports: &[(u32, u32)], peers: &[&str]) -> ResolvedRule {
    ResolvedRule::new(
        RuleId::parse(id).unwrap(),
        ports.iter().map(|&(s, e)| PortRange::new(s, e).unwrap()),
        peers.iter().map(|c| Cidr::parse(c).unwrap()),
    )
    .unwrap()
}

fn peers_of(list: &[&str]) -> BTreeSet<Cidr> {
    list.iter().map(|c| Cidr::parse(c).unwrap()).collect()
}

#[test]
fn apply_refuses_bad_deltas_as_a_unit() {
    let base = WorkloadPolicy::new(
        7,
        Mode::Simulation,
        [rule_of("web/tcp", &[(443, 443)], &["10.0.0.1/32"]), rule_of("ping/icmp", &[], &[])],
    )
    .unwrap();
    let before = base.canonical_bytes();
    let web = RuleId::parse("web/tcp").unwrap();
    let ghost = RuleId::parse("ghost/udp").unwrap();
    let good_first = Change::AddPeers { rule: web.clone(), peers: peers_of(&["10.0.0.2/32"]) };
    let cases: Vec<(Vec<Change>, ApplyError)> = vec![
        (vec![Change::RemoveRule(ghost.clone())], ApplyError::UnknownRule { rule: "ghost/udp".into() }),
        (
            vec![good_first.clone(), Change::AddPeers { rule: ghost, peers: peers_of(&["10.0.0.9/32"]) }],
            ApplyError::UnknownRule { rule: "ghost/udp".into() },
        ),
        (
            vec![
                good_first.clone(),
                Change::AddPeers { rule: web.clone(), peers: peers_of(&["10.0.0.1/32"]) },
            ],
            ApplyError::PeerPresent { rule: "web/tcp".into(), cidr: "10.0.0.1/32".into() },
        ),
        (
            vec![
                Change::SetMode(Mode::Enforcement),
                Change::RemovePeers { rule: web.clone(), peers: peers_of(&["10.9.9.9/32"]) },
            ],
            ApplyError::PeerAbsent { rule: "web/tcp".into(), cidr: "10.9.9.9/32".into() },
        ),
        (
            vec![Change::RemovePeers { rule: web, peers: BTreeSet::new() }],
            ApplyError::EmptyPeerChange { rule: "web/tcp".into() },
        ),
    ];
    for (changes, expected) in cases {
        let delta = PolicyDelta { from_version: 7, to_version: 8, changes };
        assert_eq!(base.apply(&delta), Err(expected));
        assert_eq!(base.canonical_bytes(), before, "refused apply must leave the input untouched");
    }
    for (from, to) in [(7, 7), (7, 6)] {
        let delta = PolicyDelta {
            from_version: from,
            to_version: to,
            changes: vec![Change::SetMode(Mode::Enforcement)],
        };
        assert_eq!(base.apply(&delta), Err(ApplyError::VersionNotAdvanced { from, to }));
    }
}

#[test]
fn apply_refuses_malformed_wire_delta() {
    let wire = proto::PolicyDelta {
        from_version: 1,
        to_version: 2,
        changes: vec![proto::DeltaChange {
            change: Some(proto::delta_change::Change::AddPeers(proto::PeerChange {
                rule_id: "web/tcp".into(),
                peer_cidrs: vec!["10.0.0.0/33".into()],
            })),
        }],
    };
    let err = PolicyDelta::try_from(&wire).map_err(ApplyError::from).unwrap_err();
    assert_eq!(err.to_string(), "malformed delta: cidr \"10.0.0.0/33\": not an address/prefix-length");
}

#[test]
fn emptying_a_rule_keeps_it_and_peer_only_changes_stay_peer_changes() {
    let a = WorkloadPolicy::new(
        1,
        Mode::Enforcement,
        [rule_of("db/tcp", &[(5432, 5432)], &["10.0.0.1/32", "fd00::1/128"])],
    )
    .unwrap();
    let b = WorkloadPolicy::new(2, Mode::Enforcement, [rule_of("db/tcp", &[(5432, 5432)], &[])]).unwrap();
    let delta = check_contract(&a, &b);
    let db = RuleId::parse("db/tcp").unwrap();
    assert_eq!(
        delta.changes,
        vec![Change::RemovePeers { rule: db, peers: peers_of(&["10.0.0.1/32", "fd00::1/128"]) }]
    );
}
