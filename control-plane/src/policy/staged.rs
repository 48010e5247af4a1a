//! Staged rulesets (issue 31, FLOW-10), pure: a staged ruleset as written resolved against the
//! authored model (services and address groups by name, each rule keeping the id its name has in
//! the ruleset it replaces, or the id its commit would give it), the model with staged rulesets
//! put in force, the staged set between a workload's enforced and pending rules, and the set's
//! id. The render calls these; `safety::staged` stores, lists and promotes.

use std::collections::{BTreeMap, BTreeSet};

use innerwall_wire::policy::{
    Cidr, MAX_STAGED_SET, ResolvedRule, RuleId, Staged, WorkloadPolicy, check_staged_set,
};

use crate::error::Error;
use crate::policy::model::{AuthoredModel, Peer, Rule, Ruleset, StagedRuleset, new_rule_id};
use crate::policy::spec::{PeerRef, RulesetSpec, selector_of, validate_ruleset};

/// `spec` as the ruleset it would become in `model`: checked (`validate_ruleset`), every
/// service and address group it names found by name; the ruleset keeps the id of the one it
/// replaces, each rule the id its name has there (or the id its commit would give a new rule:
/// `new_rule_id`), so the staged rules carry the very ids promoting them enforces.
pub fn resolve(spec: &RulesetSpec, model: &AuthoredModel) -> Result<Ruleset, Error> {
    validate_ruleset(spec)?;
    let current = model.rulesets.iter().find(|r| r.name == spec.name);
    let id_of_rule = |name: &str| {
        current
            .and_then(|rs| rs.rules.iter().find(|r| r.name == name))
            .map_or_else(|| new_rule_id(&spec.name, name), |r| r.id)
    };
    let service = |name: &str| model.services.values().find(|s| s.name == name).map(|s| s.id);
    let group = |name: &str| model.address_groups.values().find(|g| g.name == name).map(|g| g.id);
    let mut rules = Vec::with_capacity(spec.rules.len());
    for rule in &spec.rules {
        let context = format!("ruleset {:?} rule {:?}", spec.name, rule.name);
        let unknown =
            |what: &str, name: &str| Error::Invalid(format!("{context} references unknown {what} {name:?}"));
        let mut peers = Vec::with_capacity(rule.peers.len());
        for peer in &rule.peers {
            peers.push(match peer.kind(&context)? {
                PeerRef::Workloads(map) => Peer::Workloads(selector_of(map)?),
                PeerRef::AddressGroup(name) => {
                    Peer::AddressGroup(group(name).ok_or_else(|| unknown("address group", name))?)
                }
                PeerRef::Cidr(text) => Peer::Cidr(Cidr::parse(text)?),
            });
        }
        let mut services = BTreeSet::new();
        for name in &rule.services {
            services.insert(service(name).ok_or_else(|| unknown("service", name))?);
        }
        rules.push(Rule {
            id: id_of_rule(&rule.name),
            name: rule.name.clone(),
            enabled: rule.enabled,
            peers,
            services: services.into_iter().collect(),
        });
    }
    Ok(Ruleset {
        id: current.map_or_else(|| new_rule_id(&spec.name, ""), |r| r.id),
        name: spec.name.clone(),
        enabled: spec.enabled,
        scope: selector_of(&spec.scope)?,
        rules,
    })
}

impl AuthoredModel {
    /// The model with the staged rulesets `promoted` picks put in force (each replacing the
    /// ruleset of its name, or added after the others), and none staged.
    pub fn with_staged(&self, promoted: impl Fn(&StagedRuleset) -> bool) -> AuthoredModel {
        let mut model = AuthoredModel { staged: Vec::new(), ..self.clone() };
        for staged in self.staged.iter().filter(|s| promoted(s)) {
            match model.rulesets.iter_mut().find(|r| r.name == staged.ruleset.name) {
                Some(current) => *current = staged.ruleset.clone(),
                None => model.rulesets.push(staged.ruleset.clone()),
            }
        }
        model
    }
}

/// The id of the staged set a workload touched by `staged` gets: `<ruleset>:<stage>` for one
/// staged ruleset, when it fits [`MAX_STAGED_SET`]; otherwise `staged:` and 16 hex digits of
/// the SHA-256 of every `<ruleset>:<stage>`, in name order. A new stage is a new id.
pub fn set_id(staged: &[&StagedRuleset]) -> String {
    let names: Vec<String> = staged.iter().map(|s| format!("{}:{}", s.ruleset.name, s.stage)).collect();
    if let [one] = names.as_slice()
        && one.len() <= MAX_STAGED_SET
        && check_staged_set(one).is_ok()
    {
        return one.clone();
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, names.join("\n").as_bytes());
    let hex: String = digest.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("staged:{hex}")
}

/// The staged set `set` that takes `enforced`'s rules to `pending`'s: every rule of `pending`
/// that `enforced` lacks or has otherwise, and every rule of `enforced` that `pending` lacks.
/// `None` when they have the same rules.
pub fn between(
    enforced: &WorkloadPolicy,
    pending: &WorkloadPolicy,
    set: &str,
) -> Result<Option<Staged>, Error> {
    let now: BTreeMap<&RuleId, &ResolvedRule> = enforced.rules().map(|r| (r.id(), r)).collect();
    let then: BTreeMap<&RuleId, &ResolvedRule> = pending.rules().map(|r| (r.id(), r)).collect();
    let upserts: Vec<ResolvedRule> =
        then.iter().filter(|(id, r)| now.get(*id) != Some(*r)).map(|(_, r)| (*r).clone()).collect();
    let removals: Vec<RuleId> =
        now.keys().filter(|id| !then.contains_key(*id)).map(|id| (*id).clone()).collect();
    if upserts.is_empty() && removals.is_empty() {
        return Ok(None);
    }
    Ok(Some(Staged::new(set, upserts, removals)?))
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;
    use crate::policy::model::Service;
    use crate::policy::spec::{PeerSpec, RuleSpec};

    fn spec(name: &str, rules: &[(&str, &str)]) -> RulesetSpec {
        RulesetSpec {
            name: name.into(),
            description: String::new(),
            enabled: true,
            scope: [("app".to_string(), vec!["db".to_string()])].into(),
            rules: rules
                .iter()
                .map(|(rule, service)| RuleSpec {
                    name: (*rule).into(),
                    description: String::new(),
                    enabled: true,
                    peers: vec![PeerSpec { cidr: Some("10.0.0.0/24".into()), ..PeerSpec::default() }],
                    services: vec![(*service).into()],
                })
                .collect(),
        }
    }

    #[test]
    fn a_staged_ruleset_keeps_rule_ids_by_name_and_names_unknown_references() {
        let pg = Service { id: Uuid::from_u128(1), name: "pg".into(), entries: vec![] };
        let mut model = AuthoredModel { services: [(pg.id, pg)].into(), ..AuthoredModel::default() };
        let first = resolve(&spec("db", &[("clients", "pg")]), &model).unwrap();
        assert_eq!(first.rules[0].id, new_rule_id("db", "clients"), "a new rule: the id its commit gives it");
        // Once the ruleset exists with a rule of that name, the staged rule keeps its id.
        let kept = Uuid::from_u128(42);
        model.rulesets.push(Ruleset { rules: vec![Rule { id: kept, ..first.rules[0].clone() }], ..first });
        let again = resolve(&spec("db", &[("clients", "pg"), ("admins", "pg")]), &model).unwrap();
        assert_eq!(again.rules[0].id, kept);
        assert_eq!(again.rules[1].id, new_rule_id("db", "admins"));
        let err = resolve(&spec("db", &[("clients", "ssh")]), &model).unwrap_err().to_string();
        assert!(err.contains("unknown service \"ssh\""), "{err}");
    }

    #[test]
    fn set_ids_name_one_stage_or_digest_several() {
        let staged = |name: &str, stage| StagedRuleset {
            stage,
            ruleset: Ruleset {
                id: Uuid::nil(),
                name: name.into(),
                enabled: true,
                scope: Default::default(),
                rules: vec![],
            },
        };
        assert_eq!(set_id(&[&staged("db", 3)]), "db:3");
        let long = "a".repeat(63);
        let digest = set_id(&[&staged(&long, 12)]);
        assert!(digest.starts_with("staged:") && check_staged_set(&digest).is_ok(), "{digest}");
        let two = set_id(&[&staged("db", 3), &staged("web", 4)]);
        assert_ne!(two, set_id(&[&staged("db", 3), &staged("web", 5)]), "a new stage is a new set");
        assert!(check_staged_set(&two).is_ok());
    }
}
