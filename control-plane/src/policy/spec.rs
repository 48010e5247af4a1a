//! Authored objects as operators write them (services, address groups, rulesets from YAML or
//! JSON) and as registration receives them (a new workload, its reported addresses), with the
//! checks that need no database. `authoring` writes them; `store` reads them back for display.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Cidr;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::policy::model::{Selector, ServiceEntry, validate_name};

/// Bounds on what operators author (issue 11): one change renders the estate, so its size and
/// counts are bounded like anything else that arrives from outside.
pub const MAX_DESCRIPTION: usize = 1_024;
pub const MAX_SERVICE_ENTRIES: usize = 64;
pub const MAX_GROUP_CIDRS: usize = 10_000;
pub const MAX_RULES: usize = 500;
pub const MAX_PEERS_PER_RULE: usize = 100;
pub const MAX_SERVICES_PER_RULE: usize = 50;
pub const MAX_SELECTOR_KEYS: usize = 16;
pub const MAX_SELECTOR_VALUES: usize = 64;
pub const MAX_LABELS: usize = 64;
/// Estate ranges: every render checks each reported address against each.
pub const MAX_ESTATE_RANGES: usize = 1_024;
/// Ranges one provisioning token narrows its workloads to.
pub const MAX_TOKEN_RANGES: usize = 64;
/// The largest ruleset file the CLI reads.
pub const MAX_RULESET_FILE: u64 = 1024 * 1024;

/// A ruleset file's text (YAML or JSON) read from `origin`: at most [`MAX_RULESET_FILE`] bytes,
/// parsed by [`crate::policy::file::parse`] (no anchors or aliases, bounded nodes). Validation
/// ([`validate_ruleset`]) is the authoring call's, as for the API.
pub fn parse_ruleset_file(origin: &str, text: &str) -> Result<RulesetSpec, Error> {
    if text.len() as u64 > MAX_RULESET_FILE {
        return Err(Error::Invalid(format!(
            "{origin} is larger than the {MAX_RULESET_FILE} bytes a ruleset file may have"
        )));
    }
    crate::policy::file::parse(origin, text)
}

fn at_most(what: &str, count: usize, max: usize) -> Result<(), Error> {
    if count > max {
        return Err(Error::Invalid(format!("{what}: {count} is more than the {max} allowed")));
    }
    Ok(())
}

fn description(what: &str, text: &str) -> Result<(), Error> {
    at_most(&format!("{what}: description bytes"), text.len(), MAX_DESCRIPTION)?;
    crate::input::text(&format!("{what}: description"), text, MAX_DESCRIPTION)
}

fn selector_size(what: &str, map: &BTreeMap<String, Vec<String>>) -> Result<(), Error> {
    at_most(&format!("{what}: selector keys"), map.len(), MAX_SELECTOR_KEYS)?;
    map.iter()
        .try_for_each(|(k, v)| at_most(&format!("{what}: values of {k:?}"), v.len(), MAX_SELECTOR_VALUES))
}

/// An estate range's description, and room for one more range beside `existing`.
pub fn check_estate_range(existing: usize, text: &str) -> Result<(), Error> {
    description("estate range", text)?;
    at_most("estate ranges", existing + 1, MAX_ESTATE_RANGES)
}

/// A token's address ranges.
pub fn check_token_ranges(count: usize) -> Result<(), Error> {
    at_most("token address ranges", count, MAX_TOKEN_RANGES)
}

/// Label sets (a token's, a workload's after an edit) are bounded.
pub fn check_label_count(what: &str, count: usize) -> Result<(), Error> {
    at_most(&format!("{what}: labels"), count, MAX_LABELS)
}

impl ServiceSpec {
    pub fn check(&self) -> Result<(), Error> {
        let what = format!("service {:?}", self.name);
        description(&what, &self.description)?;
        at_most(&format!("{what}: entries"), self.entries.len(), MAX_SERVICE_ENTRIES)
    }
}

impl AddressGroupSpec {
    pub fn check(&self) -> Result<(), Error> {
        let what = format!("address group {:?}", self.name);
        description(&what, &self.description)?;
        at_most(&format!("{what}: cidrs"), self.cidrs.len(), MAX_GROUP_CIDRS)
    }
}

/// At most this many routable addresses are accepted from one host.
pub const MAX_ADDRESSES: usize = 256;
/// At most this many reported interface addresses are looked at, routable or not: a Docker or
/// Kubernetes node carries hundreds of link-local veth addresses, which are dropped before the
/// routable cap counts, but the work done on one report stays bounded.
pub const MAX_REPORTED_ADDRESSES: usize = 1_024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    pub name: String,
    pub description: String,
    pub entries: Vec<ServiceEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressGroupSpec {
    pub name: String,
    pub description: String,
    pub cidrs: BTreeSet<Cidr>,
}

/// A ruleset as an operator writes it (YAML or JSON file), and as `ruleset show` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RulesetSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// `key: [values]`, ANDed across keys; the workloads this ruleset protects.
    pub scope: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Unique within the ruleset; keeps the rule's identity (and rendered ids) across edits.
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "yes")]
    pub enabled: bool,
    pub peers: Vec<PeerSpec>,
    /// Service names.
    pub services: Vec<String>,
}

/// Exactly one of the three, written as a one-key map: `{workloads: {app: [web]}}`,
/// `{address_group: vpn}` or `{cidr: 10.0.0.0/8}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PeerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workloads: Option<BTreeMap<String, Vec<String>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
}

/// A peer after checking that exactly one kind is given.
pub(crate) enum PeerRef<'a> {
    Workloads(&'a BTreeMap<String, Vec<String>>),
    AddressGroup(&'a str),
    Cidr(&'a str),
}

impl PeerSpec {
    pub fn workloads(map: BTreeMap<String, Vec<String>>) -> Self {
        PeerSpec { workloads: Some(map), ..Default::default() }
    }

    pub fn address_group(name: &str) -> Self {
        PeerSpec { address_group: Some(name.to_owned()), ..Default::default() }
    }

    pub fn cidr(text: &str) -> Self {
        PeerSpec { cidr: Some(text.to_owned()), ..Default::default() }
    }

    pub(crate) fn kind(&self, context: &str) -> Result<PeerRef<'_>, Error> {
        match (&self.workloads, &self.address_group, &self.cidr) {
            (Some(map), None, None) => Ok(PeerRef::Workloads(map)),
            (None, Some(name), None) => Ok(PeerRef::AddressGroup(name)),
            (None, None, Some(text)) => Ok(PeerRef::Cidr(text)),
            _ => Err(Error::Invalid(format!(
                "{context}: each peer needs exactly one of workloads, address_group or cidr"
            ))),
        }
    }
}

fn yes() -> bool {
    true
}

pub(crate) fn selector_of(map: &BTreeMap<String, Vec<String>>) -> Result<Selector, Error> {
    Ok(Selector::from_strings(map.iter().map(|(k, v)| (k.clone(), v.clone())))?)
}

/// Validates everything in the spec before anything is written.
pub fn validate_ruleset(spec: &RulesetSpec) -> Result<(), Error> {
    validate_name("ruleset", &spec.name)?;
    let what = format!("ruleset {:?}", spec.name);
    description(&what, &spec.description)?;
    selector_size(&format!("{what} scope"), &spec.scope)?;
    at_most(&format!("{what}: rules"), spec.rules.len(), MAX_RULES)?;
    for rule in &spec.rules {
        let what = format!("{what} rule {:?}", rule.name);
        description(&what, &rule.description)?;
        at_most(&format!("{what}: peers"), rule.peers.len(), MAX_PEERS_PER_RULE)?;
        at_most(&format!("{what}: services"), rule.services.len(), MAX_SERVICES_PER_RULE)?;
        for map in rule.peers.iter().filter_map(|p| p.workloads.as_ref()) {
            selector_size(&format!("{what} peer"), map)?;
        }
    }
    if selector_of(&spec.scope)?.is_empty() {
        return Err(Error::Invalid(format!(
            "ruleset {:?}: the scope selector is empty and would match nothing; name at least one label",
            spec.name
        )));
    }
    let mut names = BTreeSet::new();
    for rule in &spec.rules {
        validate_name("rule", &rule.name)?;
        if !names.insert(&rule.name) {
            return Err(Error::Invalid(format!(
                "ruleset {:?}: rule {:?} appears twice",
                spec.name, rule.name
            )));
        }
        let context = format!("ruleset {:?} rule {:?}", spec.name, rule.name);
        if rule.peers.is_empty() || rule.services.is_empty() {
            return Err(Error::Invalid(format!("{context} needs at least one peer and one service")));
        }
        for peer in &rule.peers {
            match peer.kind(&context)? {
                PeerRef::Workloads(map) if selector_of(map)?.is_empty() => {
                    return Err(Error::Invalid(format!(
                        "{context}: an empty workloads selector matches nothing"
                    )));
                }
                PeerRef::Cidr(text) => {
                    Cidr::parse(text)?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// What registration needs; enrollment (issue 4) supplies it from the token and host facts.
#[derive(Debug, Clone)]
pub struct NewWorkload {
    pub id: WorkloadId,
    pub hostname: String,
    pub labels: Vec<Label>,
    pub addresses: BTreeSet<IpAddr>,
}

/// Addresses a workload can be reached at, from its reported interfaces: loopback,
/// link-local, unspecified and multicast addresses are dropped; malformed ones are refused.
/// At most [`MAX_ADDRESSES`] routable addresses out of at most [`MAX_REPORTED_ADDRESSES`].
pub fn routable_addresses(facts: &innerwall_wire::identity::HostFacts) -> Result<BTreeSet<IpAddr>, Error> {
    let mut out = BTreeSet::new();
    let texts = facts.interfaces.iter().flat_map(|i| i.addresses.iter());
    for (n, text) in texts.enumerate() {
        if n >= MAX_REPORTED_ADDRESSES {
            return Err(Error::Invalid(format!(
                "more than {MAX_REPORTED_ADDRESSES} interface addresses reported"
            )));
        }
        let addr = text.split_once('/').map_or(text.as_str(), |(a, _)| a);
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| Error::Invalid(format!("interface address {text:?} is not an address")))?;
        let link_local = match ip {
            IpAddr::V4(v4) => v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_unicast_link_local(),
        };
        if !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || link_local) {
            out.insert(ip.to_canonical());
            if out.len() > MAX_ADDRESSES {
                return Err(Error::Invalid(format!("more than {MAX_ADDRESSES} routable addresses reported")));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruleset(rules: Vec<RuleSpec>) -> RulesetSpec {
        RulesetSpec {
            name: "web".into(),
            description: String::new(),
            enabled: true,
            scope: [("app".to_owned(), vec!["web".to_owned()])].into(),
            rules,
        }
    }

    fn rule(peers: usize, services: usize) -> RuleSpec {
        RuleSpec {
            name: "r".into(),
            description: String::new(),
            enabled: true,
            peers: vec![PeerSpec::cidr("10.0.0.0/8"); peers],
            services: vec!["web".into(); services],
        }
    }

    #[test]
    fn authored_objects_are_bounded() {
        let check = |spec: RulesetSpec, want: &str| {
            let got = validate_ruleset(&spec).map_err(|e| e.to_string());
            match got {
                Ok(()) => assert_eq!(want, "", "accepted"),
                Err(e) => assert!(!want.is_empty() && e.contains(want), "{e} lacks {want:?}"),
            }
        };
        check(ruleset(vec![rule(MAX_PEERS_PER_RULE, MAX_SERVICES_PER_RULE)]), "");
        let mut long = ruleset(vec![]);
        long.description = "x".repeat(MAX_DESCRIPTION + 1);
        check(long, "ruleset \"web\": description bytes: 1025 is more than the 1024 allowed");
        check(
            ruleset(vec![rule(MAX_PEERS_PER_RULE + 1, 1)]),
            "rule \"r\": peers: 101 is more than the 100 allowed",
        );
        check(ruleset(vec![rule(1, MAX_SERVICES_PER_RULE + 1)]), "services: 51 is more than the 50 allowed");
        let many: Vec<RuleSpec> =
            (0..=MAX_RULES).map(|n| RuleSpec { name: format!("r{n}"), ..rule(1, 1) }).collect();
        check(ruleset(many), "rules: 501 is more than the 500 allowed");
        let mut wide = ruleset(vec![]);
        wide.scope =
            [("app".to_owned(), (0..=MAX_SELECTOR_VALUES).map(|n| format!("v{n}")).collect())].into();
        check(wide, "values of \"app\": 65 is more than the 64 allowed");

        let service =
            ServiceSpec { name: "s".into(), description: "x".repeat(MAX_DESCRIPTION + 1), entries: vec![] };
        assert!(service.check().unwrap_err().to_string().contains("description bytes"));
        let group = AddressGroupSpec {
            name: "g".into(),
            description: String::new(),
            cidrs: (0..=MAX_GROUP_CIDRS as u32)
                .map(|n| Cidr::host(std::net::Ipv4Addr::from(0x0a00_0000 + n).into()).unwrap())
                .collect(),
        };
        assert!(
            group.check().unwrap_err().to_string().contains("cidrs: 10001 is more than the 10000 allowed")
        );
        assert!(check_label_count("workload w", MAX_LABELS).is_ok());
        assert!(check_label_count("workload w", MAX_LABELS + 1).is_err());
    }

    fn facts(addresses: impl IntoIterator<Item = String>) -> innerwall_wire::identity::HostFacts {
        let interface = innerwall_wire::identity::NetworkInterface {
            name: "eth0".into(),
            addresses: addresses.into_iter().collect(),
            ..Default::default()
        };
        innerwall_wire::identity::HostFacts { interfaces: vec![interface], ..Default::default() }
    }

    #[test]
    fn only_routable_addresses_count_against_the_cap() {
        let veths = (0..500u32).map(|n| format!("fe80::{n:x}/64"));
        let link_local_v4 = (0..500u32).map(|n| format!("169.254.{}.{}/16", n / 250, n % 250 + 1));
        let routable = ["10.1.0.5/24".to_owned(), "::ffff:10.1.0.6".to_owned(), "127.0.0.1/8".to_owned()];
        let got = routable_addresses(&facts(veths.chain(link_local_v4).chain(routable))).unwrap();
        let want: BTreeSet<IpAddr> = ["10.1.0.5".parse().unwrap(), "10.1.0.6".parse().unwrap()].into();
        assert_eq!(got, want);

        let at_cap = (0..MAX_ADDRESSES as u32).map(|n| format!("10.2.{}.{}", n / 250, n % 250 + 1));
        assert_eq!(routable_addresses(&facts(at_cap)).unwrap().len(), MAX_ADDRESSES);
        let over = (0..=MAX_ADDRESSES as u32).map(|n| format!("10.2.{}.{}", n / 250, n % 250 + 1));
        let err = routable_addresses(&facts(over)).unwrap_err().to_string();
        assert_eq!(err, "more than 256 routable addresses reported");
        let flood = (0..=MAX_REPORTED_ADDRESSES as u32).map(|n| format!("fe80::{n:x}"));
        let err = routable_addresses(&facts(flood)).unwrap_err().to_string();
        assert_eq!(err, "more than 1024 interface addresses reported");
        let err = routable_addresses(&facts(["banana".to_owned()])).unwrap_err().to_string();
        assert_eq!(err, "interface address \"banana\" is not an address");
    }
}
