//! Policy tests (issue 27 item 3, POL-10): named assertions about what the rendered estate
//! admits, kept in test sets beside the rulesets, and their pure evaluation over a
//! [`Rendering`] (no I/O here; `foresight::commit` loads and stores).
//!
//! Assertions (exactly one per test):
//! - `allow: {from | from_cidr, to, service}` — every source address (each accepted address of
//!   every workload `from` selects, or the whole `from_cidr`) × every entry of the service
//!   (protocol, every port) is admitted by every destination's rendered policy.
//! - `deny: {…same shape…}` — none of them is.
//! - `only_from: {to, service, sources: [peer…]}` — every source the destinations' rendered rules
//!   admit on that service lies inside one of the listed sources (the complete list).
//! - `observed` is parsed but refused: it needs the impact engine, not in this build.
//!
//! Admission is judged by `innerwall_wire::flows::decide` itself (the evaluator the agent's
//! records are judged by), on the destination's rendered policy judged as enforcement (a
//! visibility-mode workload is judged by the rules it would enforce). Port ranges and CIDRs are
//! checked exactly, not sampled: `decide` is constant between the edges of the rules' port
//! ranges and peer CIDRs, so judging each edge that falls inside the asserted range decides the
//! whole range.
//!
//! A selector that matches no workload fails the test ("no workload matches from app=web")
//! unless it says `allow_empty: true`. Semantics are strict: any failing test refuses the
//! operator change, a test already failing included (fix the policy or update the set).
//!
//! The NEAREST RULE of an `allow` failure, for its first failing pair: among the rules of the
//! rulesets whose scope selects the destination (enabled or not) that reference the service,
//! the one whose peers fail the fewest selector terms for the source (a CIDR peer is one term;
//! a selector peer against a CIDR source fails all its terms); ties go to an enabled rule, then
//! to the model's order (ruleset name, rule order). Its reason names the failing term ("rule
//! payments/from-web needs app=web, the source has app=api"), or that the rule or its ruleset is
//! disabled; with no candidate, that no ruleset scopes the destination or that none of their
//! rules references the service. For `deny` and `only_from` the nearest rule is the rendered
//! rule that admits the pair.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use innerwall_wire::flows::{Decision, decide};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, WorkloadPolicy};
use serde::{Deserialize, Serialize};

use crate::error::{Error, PolicyTestFailure};
use crate::policy::model::{Peer, RegisteredWorkload, Selector, Service, validate_name};
use crate::policy::publish::Rendering;
use crate::policy::spec::PeerSpec;

/// Most test sets there may be.
pub const MAX_TEST_SETS: usize = 64;
/// Most tests one set may hold.
pub const MAX_TESTS_PER_SET: usize = 200;
/// Most sources one `only_from` lists.
pub const MAX_SOURCES: usize = 100;
/// Most failing pairs one failure lists (`pair_count` counts them all).
pub const MAX_PAIRS: usize = 10;
/// The largest test-set file read.
pub const MAX_TEST_SET_FILE: u64 = 256 * 1024;
/// Most bytes of a description.
pub const MAX_DESCRIPTION: usize = 1_024;
const MAX_SELECTOR_KEYS: usize = 16;
const MAX_SELECTOR_VALUES: usize = 64;

/// A test set as an operator writes it (YAML or JSON), and as `test-set show` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TestSetSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub tests: Vec<TestSpec>,
}

/// One named assertion: exactly one of `allow`, `deny`, `only_from`, `observed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TestSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<FlowSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny: Option<FlowSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub only_from: Option<OnlyFromSpec>,
    /// Parsed so that the refusal is precise; refused until the impact engine is wired into policy tests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedSpec>,
    /// A selector that matches no workload passes instead of failing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_empty: bool,
}

/// From a selector (`from`) or a CIDR (`from_cidr`), to a selector, on a service (by name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<BTreeMap<String, Vec<String>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_cidr: Option<String>,
    pub to: BTreeMap<String, Vec<String>>,
    pub service: String,
}

/// To a selector on a service, the complete list of permitted sources (peers as rulesets write
/// them: `{workloads: {…}}`, `{address_group: …}`, `{cidr: …}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OnlyFromSpec {
    pub to: BTreeMap<String, Vec<String>>,
    pub service: String,
    pub sources: Vec<PeerSpec>,
}

/// No recorded ALLOWED flow to `to` within `since` becomes blocked (needs the impact engine).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ObservedSpec {
    pub to: BTreeMap<String, Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

/// One test's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TestResult {
    pub set: String,
    pub test: String,
    pub assertion: String,
    pub passed: bool,
    /// Why it fails (absent when it passes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<PolicyTestFailure>,
}

/// Every test's result, in set then file order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunReport {
    pub results: Vec<TestResult>,
}

impl RunReport {
    pub fn failures(&self) -> Vec<PolicyTestFailure> {
        self.results.iter().filter_map(|r| r.failure.clone()).collect()
    }

    /// JUnit XML: one `testsuite` per set, one `testcase` per test, a failure's message its
    /// reason and its text the pairs.
    pub fn junit(&self) -> String {
        let mut sets: BTreeMap<&str, Vec<&TestResult>> = BTreeMap::new();
        for r in &self.results {
            sets.entry(&r.set).or_default().push(r);
        }
        let total = self.results.len();
        let failed = self.results.iter().filter(|r| !r.passed).count();
        let mut out = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"innerwall policy tests\" \
             tests=\"{total}\" failures=\"{failed}\">\n"
        );
        for (set, results) in sets {
            let failed = results.iter().filter(|r| !r.passed).count();
            out.push_str(&format!(
                "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failed}\">\n",
                xml(set),
                results.len()
            ));
            for r in results {
                let case = format!("  <testcase classname=\"{}\" name=\"{}\"", xml(set), xml(&r.test));
                match &r.failure {
                    None => out.push_str(&format!("  {case}/>\n")),
                    Some(f) => out.push_str(&format!(
                        "  {case}>\n      <failure type=\"{}\" message=\"{}\">{}</failure>\n    </testcase>\n",
                        xml(&f.assertion),
                        xml(&f.reason),
                        xml(&format!("{} failing pair(s): {}", f.pair_count, f.pairs.join("; ")))
                    )),
                }
            }
            out.push_str("  </testsuite>\n");
        }
        out.push_str("</testsuites>\n");
        out
    }
}

fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// A test-set file's text (YAML or JSON) read from `origin`: at most [`MAX_TEST_SET_FILE`]
/// bytes, parsed by the one parse of operator files (`policy::file`), then checked
/// ([`check_set`]).
pub fn parse_test_set_file(origin: &str, text: &str) -> Result<TestSetSpec, Error> {
    if text.len() as u64 > MAX_TEST_SET_FILE {
        return Err(Error::Invalid(format!(
            "{origin} is larger than the {MAX_TEST_SET_FILE} bytes a test-set file may have"
        )));
    }
    let spec: TestSetSpec = crate::policy::file::parse(origin, text)?;
    check_set(&spec)?;
    Ok(spec)
}

fn at_most(what: &str, count: usize, max: usize) -> Result<(), Error> {
    if count > max {
        return Err(Error::Invalid(format!("{what}: {count} is more than the {max} allowed")));
    }
    Ok(())
}

fn selector(what: &str, map: &BTreeMap<String, Vec<String>>) -> Result<Selector, Error> {
    at_most(&format!("{what}: selector keys"), map.len(), MAX_SELECTOR_KEYS)?;
    for (k, v) in map {
        at_most(&format!("{what}: values of {k:?}"), v.len(), MAX_SELECTOR_VALUES)?;
    }
    if map.is_empty() {
        return Err(Error::Invalid(format!("{what}: an empty selector; name at least one label")));
    }
    Selector::from_strings(map.iter().map(|(k, v)| (k.clone(), v.clone())))
        .map_err(|e| Error::Invalid(format!("{what}: {e}")))
}

/// A checked file's selector (so the error cannot happen, but is a reason if it does).
fn sel_text(map: &BTreeMap<String, Vec<String>>) -> Result<Selector, String> {
    selector("selector", map).map_err(|e| e.to_string())
}

fn cidr(what: &str, text: &str) -> Result<Cidr, Error> {
    Cidr::parse(text).map_err(|e| Error::Invalid(format!("{what}: {e}")))
}

/// Everything about a set that needs no database: names, sizes, text, exactly one assertion
/// per test, selectors and CIDRs that parse, no `observed`.
pub fn check_set(spec: &TestSetSpec) -> Result<(), Error> {
    validate_name("policy test set", &spec.name)?;
    let what = format!("policy test set {:?}", spec.name);
    crate::input::text(&format!("{what}: description"), &spec.description, MAX_DESCRIPTION)?;
    at_most(&format!("{what}: tests"), spec.tests.len(), MAX_TESTS_PER_SET)?;
    let mut names = BTreeSet::new();
    for test in &spec.tests {
        validate_name("policy test", &test.name)?;
        let what = format!("{what} test {:?}", test.name);
        if !names.insert(test.name.as_str()) {
            return Err(Error::Invalid(format!("{what}: the name is used twice in the set")));
        }
        crate::input::text(&format!("{what}: description"), &test.description, MAX_DESCRIPTION)?;
        let given =
            [test.allow.is_some(), test.deny.is_some(), test.only_from.is_some(), test.observed.is_some()];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(Error::Invalid(format!(
                "{what}: needs exactly one of allow, deny, only_from or observed"
            )));
        }
        if test.observed.is_some() {
            return Err(Error::Invalid(format!(
                "{what}: observed tests are not judged yet: the impact engine is not wired into policy tests in this build; check recorded flows with `innerwall workload replay` and write an allow test instead"
            )));
        }
        for flow in [&test.allow, &test.deny].into_iter().flatten() {
            match (&flow.from, &flow.from_cidr) {
                (Some(from), None) => drop(selector(&format!("{what}: from"), from)?),
                (None, Some(text)) => drop(cidr(&format!("{what}: from_cidr"), text)?),
                _ => return Err(Error::Invalid(format!("{what}: needs exactly one of from or from_cidr"))),
            }
            selector(&format!("{what}: to"), &flow.to)?;
            validate_name("service", &flow.service)?;
        }
        if let Some(only) = &test.only_from {
            selector(&format!("{what}: to"), &only.to)?;
            validate_name("service", &only.service)?;
            at_most(&format!("{what}: sources"), only.sources.len(), MAX_SOURCES)?;
            for peer in &only.sources {
                match peer.kind(&what)? {
                    crate::policy::spec::PeerRef::Workloads(map) => {
                        drop(selector(&format!("{what}: source"), map)?)
                    }
                    crate::policy::spec::PeerRef::AddressGroup(name) => validate_name("address group", name)?,
                    crate::policy::spec::PeerRef::Cidr(text) => drop(cidr(&format!("{what}: source"), text)?),
                }
            }
        }
    }
    Ok(())
}

// ---- evaluation ---------------------------------------------------------------------------

/// Evaluates every test of every set (checked by [`check_set`]) over `rendering`.
pub fn evaluate(sets: &[TestSetSpec], rendering: &Rendering) -> RunReport {
    let estate = Estate::new(rendering);
    let mut results = Vec::new();
    for set in sets {
        for test in &set.tests {
            let (assertion, outcome) = estate.run(test);
            let failure = outcome.err().map(|(reason, pairs, pair_count)| PolicyTestFailure {
                set: set.name.clone(),
                test: test.name.clone(),
                assertion: assertion.to_owned(),
                reason,
                pairs,
                pair_count,
            });
            results.push(TestResult {
                set: set.name.clone(),
                test: test.name.clone(),
                assertion: assertion.to_owned(),
                passed: failure.is_none(),
                failure,
            });
        }
    }
    RunReport { results }
}

/// The first (address, port) whose judgement differs from the assertion, with the deciding
/// rule's authored id (a `deny` refused by an admitting rule).
type Refused = (IpAddr, u16, Option<String>);

/// A failure: the reason, the first [`MAX_PAIRS`] pairs, how many pairs in all.
type Failed = (String, Vec<String>, u64);

enum Source<'a> {
    Workload(&'a RegisteredWorkload),
    Cidr(Cidr),
}

struct Estate<'a> {
    r: &'a Rendering,
    services: BTreeMap<&'a str, &'a Service>,
    /// Rendered rule id prefix (the authored rule's id) → "ruleset/rule".
    rule_names: BTreeMap<String, String>,
    /// (label key, value) → the registry's indexes carrying it.
    by_label: BTreeMap<(&'a LabelKey, &'a LabelValue), Vec<usize>>,
    /// Accepted address → its workload.
    by_address: BTreeMap<IpAddr, WorkloadId>,
}

/// Collects failing pairs, keeping the first [`MAX_PAIRS`] and the first one's reason.
#[derive(Default)]
struct Pairs {
    shown: Vec<String>,
    count: u64,
    first_reason: Option<String>,
}

impl Pairs {
    /// Both texts are built only when kept (a failing pair past [`MAX_PAIRS`] costs a count).
    fn push(&mut self, pair: impl FnOnce() -> String, reason: impl FnOnce() -> String) {
        if self.first_reason.is_none() {
            self.first_reason = Some(reason());
        }
        if self.shown.len() < MAX_PAIRS {
            self.shown.push(pair());
        }
        self.count += 1;
    }

    fn result(self) -> Result<(), Failed> {
        match self.first_reason {
            None => Ok(()),
            Some(reason) => Err((reason, self.shown, self.count)),
        }
    }
}

fn term(key: &LabelKey, values: &BTreeSet<LabelValue>) -> String {
    let vs: Vec<&str> = values.iter().map(LabelValue::as_str).collect();
    if vs.len() == 1 { format!("{key}={}", vs[0]) } else { format!("{key} in ({})", vs.join(", ")) }
}

fn terms(s: &Selector) -> String {
    s.matches().iter().map(|(k, v)| term(k, v)).collect::<Vec<_>>().join(",")
}

/// (is IPv4, first address, last address) as numbers.
fn span(c: &Cidr) -> (bool, u128, u128) {
    let net = c.net();
    match (net.network(), net.broadcast()) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (true, u128::from(u32::from(a)), u128::from(u32::from(b))),
        (IpAddr::V6(a), IpAddr::V6(b)) => (false, u128::from(a), u128::from(b)),
        _ => unreachable!("a network and its broadcast share a family"),
    }
}

fn addr(v4: bool, n: u128) -> IpAddr {
    if v4 { IpAddr::V4(Ipv4Addr::from(n as u32)) } else { IpAddr::V6(Ipv6Addr::from(n)) }
}

/// The addresses of `source` at which `decide` can change over `policy`'s peers: its first
/// address and every peer edge inside it.
fn source_points(source: &Cidr, policy: &WorkloadPolicy) -> Vec<IpAddr> {
    let (v4, start, end) = span(source);
    let mut points = BTreeSet::from([start]);
    for rule in policy.rules() {
        for peer in rule.peers() {
            let (pv4, ps, pe) = span(peer);
            if pv4 != v4 {
                continue;
            }
            for edge in [Some(ps), pe.checked_add(1)].into_iter().flatten() {
                if edge > start && edge <= end {
                    points.insert(edge);
                }
            }
        }
    }
    points.into_iter().map(|n| addr(v4, n)).collect()
}

/// The ports of `ports` at which `decide` can change over `policy`'s rules of `protocol`.
fn port_points(protocol: Protocol, ports: &[PortRange], policy: &WorkloadPolicy) -> Vec<u16> {
    if ports.is_empty() {
        return vec![0];
    }
    let mut points = BTreeSet::new();
    for range in ports {
        let (start, end) = (u32::from(range.start()), u32::from(range.end()));
        points.insert(start);
        for rule in policy.rules().filter(|r| r.protocol() == protocol) {
            for p in rule.ports() {
                for edge in [u32::from(p.start()), u32::from(p.end()) + 1] {
                    if edge > start && edge <= end {
                        points.insert(edge);
                    }
                }
            }
        }
    }
    points.into_iter().map(|p| p as u16).collect()
}

/// The policy `decide` judges: a visibility-mode workload by the rules it would enforce.
fn judged(policy: &WorkloadPolicy) -> Cow<'_, WorkloadPolicy> {
    if policy.mode() == Mode::Visibility {
        Cow::Owned(policy.clone().with_mode(Mode::Enforcement))
    } else {
        Cow::Borrowed(policy)
    }
}

impl<'a> Estate<'a> {
    fn new(r: &'a Rendering) -> Self {
        let services = r.model.services.values().map(|s| (s.name.as_str(), s)).collect();
        let mut rule_names = BTreeMap::new();
        for rs in &r.model.rulesets {
            for rule in &rs.rules {
                rule_names.insert(rule.id.to_string(), format!("{}/{}", rs.name, rule.name));
            }
        }
        let mut by_label: BTreeMap<(&LabelKey, &LabelValue), Vec<usize>> = BTreeMap::new();
        let mut by_address = BTreeMap::new();
        for (i, w) in r.registry.iter().enumerate() {
            for label in &w.labels {
                by_label.entry(label).or_default().push(i);
            }
            for a in &w.addresses {
                by_address.insert(*a, w.id);
            }
        }
        Estate { r, services, rule_names, by_label, by_address }
    }

    /// The workloads `s` selects, in registry order: the candidates of its first key's values
    /// (from the label index), each checked against the whole selector.
    fn select(&self, s: &Selector) -> Vec<&'a RegisteredWorkload> {
        let Some((key, values)) = s.matches().iter().next() else { return Vec::new() };
        let mut candidates: Vec<usize> =
            values.iter().filter_map(|v| self.by_label.get(&(key, v))).flatten().copied().collect();
        candidates.sort_unstable();
        candidates.into_iter().map(|i| &self.r.registry[i]).filter(|w| s.selects(&w.labels)).collect()
    }

    fn rule_name(&self, authored: &str) -> String {
        self.rule_names.get(authored).cloned().unwrap_or_else(|| authored.to_owned())
    }

    fn run(&self, test: &TestSpec) -> (&'static str, Result<(), Failed>) {
        let (kind, judged) = if let Some(flow) = &test.allow {
            ("allow", self.flow(test, flow, true))
        } else if let Some(flow) = &test.deny {
            ("deny", self.flow(test, flow, false))
        } else if let Some(only) = &test.only_from {
            ("only_from", self.only_from(test, only))
        } else {
            ("observed", Err(Err("observed tests are not judged yet: the impact engine is not wired into policy tests in this build; check recorded flows with `innerwall workload replay` and write an allow test instead".into())))
        };
        // A reason alone is a failure with no pairs.
        (kind, judged.map_err(|e| e.unwrap_or_else(|reason| (reason, Vec::new(), 0))))
    }

    /// `allow` (`want` admitted) or `deny`. The error is a failure (`Ok`) or a reason alone.
    fn flow(&self, test: &TestSpec, flow: &FlowSpec, want: bool) -> Result<(), Result<Failed, String>> {
        let service = *self
            .services
            .get(flow.service.as_str())
            .ok_or_else(|| Err(format!("service {} does not exist", flow.service)))?;
        let to = selector("to", &flow.to).map_err(|e| Err(e.to_string()))?;
        let sources: Vec<Source<'a>> = match (&flow.from, &flow.from_cidr) {
            (Some(from), _) => {
                let from = selector("from", from).map_err(|e| Err(e.to_string()))?;
                let found = self.select(&from);
                if found.is_empty() {
                    return if test.allow_empty {
                        Ok(())
                    } else {
                        Err(Err(format!("no workload matches from {}", terms(&from))))
                    };
                }
                found.into_iter().map(Source::Workload).collect()
            }
            (None, Some(text)) => {
                vec![Source::Cidr(cidr("from_cidr", text).map_err(|e| Err(e.to_string()))?)]
            }
            (None, None) => return Err(Err("needs from or from_cidr".into())),
        };
        let dsts = self.select(&to);
        if dsts.is_empty() {
            return if test.allow_empty {
                Ok(())
            } else {
                Err(Err(format!("no workload matches to {}", terms(&to))))
            };
        }
        let mut pairs = Pairs::default();
        let mut memo: BTreeMap<(usize, Cidr, usize), Option<Refused>> = BTreeMap::new();
        for dst in dsts {
            let Some(stored) = self.r.rendered.get(&dst.id) else { continue };
            let policy = judged(stored);
            for source in &sources {
                let (label, cidrs): (String, Vec<Cidr>) = match source {
                    Source::Workload(w) => {
                        (w.id.to_string(), w.addresses.iter().filter_map(|a| Cidr::host(*a).ok()).collect())
                    }
                    Source::Cidr(c) => (c.to_string(), vec![*c]),
                };
                if want && cidrs.is_empty() {
                    pairs.push(
                        || format!("{label} → {} (the source has no accepted address)", dst.id),
                        || format!("source {label} has no accepted address for {} to admit", dst.id),
                    );
                }
                for c in &cidrs {
                    for (e, entry) in service.entries.iter().enumerate() {
                        // Workloads the same rulesets select share one rendered policy: judged once.
                        let key = (std::ptr::from_ref::<WorkloadPolicy>(stored) as usize, *c, e);
                        let bad = memo
                            .entry(key)
                            .or_insert_with(|| {
                                for ip in source_points(c, &policy) {
                                    for port in port_points(entry.protocol, &entry.ports, &policy) {
                                        let (decision, rule) =
                                            decide(Some(&policy), ip, port, entry.protocol);
                                        if (decision == Decision::Allowed) != want {
                                            return Some((ip, port, rule.map(|r| r.authored().to_owned())));
                                        }
                                    }
                                }
                                None
                            })
                            .clone();
                        let Some((ip, port, rule)) = bad else { continue };
                        let at = if entry.ports.is_empty() {
                            entry.protocol.to_string()
                        } else {
                            format!("{}:{port}", entry.protocol)
                        };
                        let pair = || format!("{label} ({ip}) → {} {at}", dst.id);
                        pairs.push(pair, || match (want, rule) {
                            (true, _) => format!(
                                "{label} ({ip}) → {} {at} is not admitted: {}",
                                dst.id,
                                self.nearest(dst, source, service)
                            ),
                            (false, rule) => format!(
                                "{label} ({ip}) → {} {at} is admitted by rule {}",
                                dst.id,
                                rule.map_or_else(|| "(unknown)".to_owned(), |r| self.rule_name(&r))
                            ),
                        });
                    }
                }
            }
        }
        pairs.result().map_err(Ok)
    }

    fn only_from(&self, test: &TestSpec, only: &OnlyFromSpec) -> Result<(), Result<Failed, String>> {
        let service = *self
            .services
            .get(only.service.as_str())
            .ok_or_else(|| Err(format!("service {} does not exist", only.service)))?;
        let to = sel_text(&only.to).map_err(Err)?;
        let mut permitted: Vec<Cidr> = Vec::new();
        for peer in &only.sources {
            match peer.kind("source").map_err(|e| Err(e.to_string()))? {
                crate::policy::spec::PeerRef::Workloads(map) => {
                    let s = sel_text(map).map_err(Err)?;
                    let found = self.select(&s);
                    if found.is_empty() && !test.allow_empty {
                        return Err(Err(format!("no workload matches source {}", terms(&s))));
                    }
                    permitted.extend(
                        found.iter().flat_map(|w| w.addresses.iter().filter_map(|a| Cidr::host(*a).ok())),
                    );
                }
                crate::policy::spec::PeerRef::AddressGroup(name) => {
                    let group = self
                        .r
                        .model
                        .address_groups
                        .values()
                        .find(|g| g.name == name)
                        .ok_or_else(|| Err(format!("address group {name} does not exist")))?;
                    permitted.extend(group.cidrs.iter().copied());
                }
                crate::policy::spec::PeerRef::Cidr(text) => {
                    permitted.push(cidr("source", text).map_err(|e| Err(e.to_string()))?);
                }
            }
        }
        let dsts = self.select(&to);
        if dsts.is_empty() {
            return if test.allow_empty {
                Ok(())
            } else {
                Err(Err(format!("no workload matches to {}", terms(&to))))
            };
        }
        let inside = |c: &Cidr| {
            let (v4, s, e) = span(c);
            permitted.iter().any(|p| {
                let (pv4, ps, pe) = span(p);
                pv4 == v4 && ps <= s && e <= pe
            })
        };
        let owner = |c: &Cidr| {
            let (v4, start, end) = span(c);
            if start != end {
                return String::new();
            }
            self.by_address.get(&addr(v4, start)).map_or_else(String::new, |w| format!(" (workload {w})"))
        };
        let mut pairs = Pairs::default();
        for dst in dsts {
            let Some(policy) = self.r.rendered.get(&dst.id) else { continue };
            for rule in policy.rules() {
                let serves = service.entries.iter().any(|e| {
                    e.protocol == rule.protocol()
                        && (e.ports.is_empty()
                            || rule.ports().is_empty()
                            || e.ports.iter().any(|p| {
                                rule.ports().iter().any(|q| p.start() <= q.end() && q.start() <= p.end())
                            }))
                });
                if !serves {
                    continue;
                }
                for peer in rule.peers().iter().filter(|c| !inside(c)) {
                    pairs.push(
                        || format!("{peer}{} → {} {}", owner(peer), dst.id, rule.protocol()),
                        || {
                            format!(
                                "rule {} admits {peer}{} to {} on {}, not among the listed sources",
                                self.rule_name(rule.id().authored()),
                                owner(peer),
                                dst.id,
                                only.service
                            )
                        },
                    );
                }
            }
        }
        pairs.result().map_err(Ok)
    }

    /// Why the nearest rule (module doc) does not admit `source` to `dst` on `service`.
    fn nearest(&self, dst: &RegisteredWorkload, source: &Source<'_>, service: &Service) -> String {
        let scoping: Vec<_> =
            self.r.model.rulesets.iter().filter(|rs| rs.scope.selects(&dst.labels)).collect();
        if scoping.is_empty() {
            return format!("no ruleset scopes workload {}", dst.id);
        }
        // (failing terms, disabled, order) → reason
        let mut best: Option<((usize, bool, usize), String)> = None;
        let mut order = 0;
        for rs in &scoping {
            for rule in rs.rules.iter().filter(|r| r.services.contains(&service.id)) {
                order += 1;
                let name = format!("{}/{}", rs.name, rule.name);
                let (score, why) = rule
                    .peers
                    .iter()
                    .map(|p| self.peer_miss(p, source))
                    .min_by_key(|(s, _)| *s)
                    .unwrap_or((usize::MAX, "has no peers".to_owned()));
                let disabled = !rs.enabled || !rule.enabled;
                let reason = match (score, disabled) {
                    (0, true) if !rs.enabled => {
                        format!("rule {name} names the source, but ruleset {} is disabled", rs.name)
                    }
                    (0, true) => format!("rule {name} names the source, but the rule is disabled"),
                    (0, false) => format!(
                        "rule {name} names the source, yet the rendered policy does not admit it (the source's \
                         address is not accepted, or the rule's service entries differ)"
                    ),
                    _ => format!("rule {name} {why}"),
                };
                let key = (score, disabled, order);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, reason));
                }
            }
        }
        best.map(|(_, r)| r).unwrap_or_else(|| {
            let names: Vec<&str> = scoping.iter().map(|rs| rs.name.as_str()).collect();
            format!(
                "no rule of the rulesets scoping {} ({}) references service {}",
                dst.id,
                names.join(", "),
                service.name
            )
        })
    }

    /// How many terms of `peer` the source fails, and the first in words.
    fn peer_miss(&self, peer: &Peer, source: &Source<'_>) -> (usize, String) {
        let covers = |c: &Cidr| match source {
            Source::Workload(w) => !w.addresses.is_empty() && w.addresses.iter().all(|a| c.contains(a)),
            Source::Cidr(s) => {
                let ((v4, a, b), (cv4, ca, cb)) = (span(s), span(c));
                v4 == cv4 && ca <= a && b <= cb
            }
        };
        let described = match source {
            Source::Workload(w) => format!("workload {}", w.id),
            Source::Cidr(c) => format!("the CIDR {c}"),
        };
        match peer {
            Peer::Workloads(s) => match source {
                Source::Workload(w) => {
                    let failing: Vec<String> = s
                        .matches()
                        .iter()
                        .filter(|(k, vs)| !w.labels.get(*k).is_some_and(|v| vs.contains(v)))
                        .map(|(k, vs)| match w.labels.get(k) {
                            Some(v) => format!("needs {}, the source has {k}={v}", term(k, vs)),
                            None => format!("needs {}, the source has no {k} label", term(k, vs)),
                        })
                        .collect();
                    (failing.len(), failing.into_iter().next().unwrap_or_default())
                }
                Source::Cidr(_) => {
                    (s.matches().len().max(1), format!("admits workloads {}, not {described}", terms(s)))
                }
            },
            Peer::Cidr(c) => {
                if covers(c) {
                    (0, String::new())
                } else {
                    (1, format!("admits {c}, which does not hold {described}"))
                }
            }
            Peer::AddressGroup(id) => match self.r.model.address_groups.get(id) {
                Some(g) if g.cidrs.iter().any(covers) => (0, String::new()),
                Some(g) => (1, format!("admits address group {}, which does not hold {described}", g.name)),
                None => (1, "names a missing address group".to_owned()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::model::{AddressGroup, AuthoredModel, Rule, Ruleset, ServiceEntry};
    use crate::policy::render::render;
    use innerwall_wire::identity::WorkloadId;
    use uuid::Uuid;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn workload(n: u128, labels: &[(&str, &str)], addr: &str, mode: Mode) -> RegisteredWorkload {
        RegisteredWorkload {
            id: WorkloadId::from_uuid(id(0x1000 + n)).unwrap(),
            mode,
            labels: labels
                .iter()
                .map(|(k, v)| (LabelKey::new(k).unwrap(), LabelValue::new(v).unwrap()))
                .collect(),
            addresses: [addr.parse::<IpAddr>().unwrap()].into(),
        }
    }

    fn sel(k: &str, v: &str) -> Selector {
        Selector::from_strings([(k.to_owned(), vec![v.to_owned()])]).unwrap()
    }

    /// payments (visibility) admits web on https (tcp:443-444) and 10.9.0.0/16; a disabled
    /// ruleset would admit api.
    fn rendering(from_web_ports: &str) -> Rendering {
        let https = Service {
            id: id(1),
            name: "https".into(),
            entries: vec![ServiceEntry::parse(from_web_ports).unwrap()],
        };
        let group = AddressGroup {
            id: id(2),
            name: "vpn".into(),
            cidrs: [Cidr::parse("10.9.0.0/16").unwrap()].into(),
        };
        let rule = |n, name: &str, peers, enabled| Rule {
            id: id(n),
            name: name.into(),
            enabled,
            peers,
            services: vec![id(1)],
        };
        let model = AuthoredModel {
            services: [(id(1), https)].into(),
            address_groups: [(id(2), group)].into(),
            rulesets: vec![
                Ruleset {
                    id: id(10),
                    name: "payments".into(),
                    enabled: true,
                    scope: sel("app", "payments"),
                    rules: vec![
                        rule(11, "from-web", vec![Peer::Workloads(sel("app", "web"))], true),
                        rule(12, "from-vpn", vec![Peer::AddressGroup(id(2))], true),
                    ],
                },
                Ruleset {
                    id: id(20),
                    name: "old".into(),
                    enabled: false,
                    scope: sel("app", "payments"),
                    rules: vec![rule(21, "from-api", vec![Peer::Workloads(sel("app", "api"))], true)],
                },
            ],
        };
        let registry = vec![
            workload(1, &[("app", "web")], "10.0.0.1", Mode::Enforcement),
            workload(2, &[("app", "api")], "10.0.0.2", Mode::Enforcement),
            workload(3, &[("app", "payments")], "10.0.0.3", Mode::Visibility),
        ];
        let rendered = render(&model, &registry).unwrap();
        Rendering { model, registry, rendered, changed: Vec::new() }
    }

    fn run(text: &str, r: &Rendering) -> Vec<TestResult> {
        let spec = parse_test_set_file("t", text).unwrap();
        evaluate(&[spec], r).results
    }

    #[test]
    fn allow_and_deny_judge_every_address_and_port_with_decide() {
        let r = rendering("tcp:443-444");
        let results = run(
            "name: s\ntests:\n\
             - {name: web, allow: {from: {app: [web]}, to: {app: [payments]}, service: https}}\n\
             - {name: vpn, allow: {from_cidr: 10.9.0.0/16, to: {app: [payments]}, service: https}}\n\
             - {name: wider, allow: {from_cidr: 10.8.0.0/15, to: {app: [payments]}, service: https}}\n\
             - {name: api, deny: {from: {app: [api]}, to: {app: [payments]}, service: https}}\n\
             - {name: inside-vpn, deny: {from_cidr: 10.9.200.0/24, to: {app: [payments]}, service: https}}\n",
            &r,
        );
        let passed: Vec<(&str, bool)> = results.iter().map(|r| (r.test.as_str(), r.passed)).collect();
        assert_eq!(
            passed,
            [("web", true), ("vpn", true), ("wider", false), ("api", true), ("inside-vpn", false)]
        );
        let wider = results[2].failure.as_ref().unwrap();
        assert!(wider.pairs[0].starts_with("10.8.0.0/15 (10.8.0.0)"), "{wider:?}");
        let inside = results[4].failure.as_ref().unwrap();
        assert!(inside.reason.contains("admitted by rule payments/from-vpn"), "{inside:?}");
    }

    #[test]
    fn a_port_range_partly_admitted_fails_at_its_first_gap() {
        // The service asks 443-445; the rules render 443-445 too, so all pass … then a service
        // entry the rules do not cover (another service's wider range) fails exactly at 446.
        let r = rendering("tcp:443-445");
        let ok = run(
            "name: s\ntests:\n- {name: web, allow: {from: {app: [web]}, to: {app: [payments]}, service: https}}\n",
            &r,
        );
        assert!(ok[0].passed, "{ok:?}");
        let policy = r.rendered.get(&r.registry[2].id).unwrap();
        let ports = [PortRange::new(440, 450).unwrap()];
        let points = port_points(Protocol::Tcp, &ports, policy);
        assert_eq!(points, [440, 443, 446], "the edges of the rule's 443-445 inside 440-450");
    }

    #[test]
    fn the_nearest_rule_names_the_failing_term_or_the_disabled_ruleset() {
        let r = rendering("tcp:443");
        let results = run(
            "name: s\ntests:\n\
             - {name: api, allow: {from: {app: [api]}, to: {app: [payments]}, service: https}}\n\
             - {name: web-to-web, allow: {from: {app: [api]}, to: {app: [web]}, service: https}}\n",
            &r,
        );
        let api = results[0].failure.as_ref().unwrap();
        // The disabled ruleset's rule names api exactly: nearer than from-web (one failing term).
        assert!(
            api.reason.contains("rule old/from-api names the source, but ruleset old is disabled"),
            "{api:?}"
        );
        let none = results[1].failure.as_ref().unwrap();
        assert!(none.reason.contains("no ruleset scopes workload"), "{none:?}");
        let mut r = r;
        r.model.rulesets.truncate(1);
        let results = run(
            "name: s\ntests:\n- {name: api, allow: {from: {app: [api]}, to: {app: [payments]}, service: https}}\n",
            &r,
        );
        let api = results[0].failure.as_ref().unwrap();
        assert!(
            api.reason.contains("rule payments/from-web needs app=web, the source has app=api"),
            "{api:?}"
        );
    }

    #[test]
    fn only_from_names_every_source_outside_the_list_and_empty_selectors_fail() {
        let r = rendering("tcp:443");
        let results = run(
            "name: s\ntests:\n\
             - {name: ok, only_from: {to: {app: [payments]}, service: https, sources: [{workloads: {app: [web]}}, {address_group: vpn}]}}\n\
             - {name: web-only, only_from: {to: {app: [payments]}, service: https, sources: [{workloads: {app: [web]}}]}}\n\
             - {name: nobody, allow: {from: {app: [nobody]}, to: {app: [payments]}, service: https}}\n\
             - {name: nobody-ok, allow_empty: true, allow: {from: {app: [nobody]}, to: {app: [payments]}, service: https}}\n\
             - {name: no-service, deny: {from_cidr: 1.2.3.0/24, to: {app: [payments]}, service: ssh}}\n",
            &r,
        );
        let passed: Vec<bool> = results.iter().map(|r| r.passed).collect();
        assert_eq!(passed, [true, false, false, true, false]);
        let web_only = results[1].failure.as_ref().unwrap();
        assert!(web_only.reason.contains("rule payments/from-vpn admits 10.9.0.0/16"), "{web_only:?}");
        assert_eq!(results[2].failure.as_ref().unwrap().reason, "no workload matches from app=nobody");
        assert_eq!(results[4].failure.as_ref().unwrap().reason, "service ssh does not exist");
    }

    #[test]
    fn bad_files_are_refused_with_what_to_fix() {
        let refused = |text: &str| parse_test_set_file("f", text).unwrap_err().to_string();
        assert!(
            refused("name: s\ntests:\n- {name: a}\n")
                .contains("exactly one of allow, deny, only_from or observed")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, allow: {to: {app: [x]}, service: s}}\n")
                .contains("exactly one of from or from_cidr")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, deny: {from_cidr: nope, to: {app: [x]}, service: s}}\n")
                .contains("from_cidr")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, deny: {from_cidr: 1.2.3.0/24, to: {}, service: s}}\n")
                .contains("an empty selector")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, observed: {to: {app: [x]}}}\n").contains("impact engine")
        );
        assert!(
            refused(&format!("name: s\ndescription: {}\ntests: []\n", "x".repeat(2000)))
                .contains("at most 1024")
        );
        assert!(
            refused(
                "name: s\ntests:\n- {name: a, deny: {from_cidr: 1.2.3.0/24, to: {app: [x]}, service: s}}\n\
                         - {name: a, deny: {from_cidr: 1.2.3.0/24, to: {app: [x]}, service: s}}\n"
            )
            .contains("used twice")
        );
    }

    #[test]
    fn junit_escapes_and_counts() {
        let report = RunReport {
            results: vec![TestResult {
                set: "s".into(),
                test: "t".into(),
                assertion: "allow".into(),
                passed: false,
                failure: Some(PolicyTestFailure {
                    set: "s".into(),
                    test: "t".into(),
                    assertion: "allow".into(),
                    reason: "a <b> & \"c\"".into(),
                    pairs: vec!["x → y".into()],
                    pair_count: 1,
                }),
            }],
        };
        let xml = report.junit();
        assert!(xml.contains("message=\"a &lt;b&gt; &amp; &quot;c&quot;\""), "{xml}");
        assert!(xml.contains("<testsuite name=\"s\" tests=\"1\" failures=\"1\">"), "{xml}");
    }
}
