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
//! - `observed: {to, since}` — no recorded flow towards a workload `to` selects that its agent's
//!   applied policy admitted within `since` (default 7d; humantime, as the CLI's `--since`; at
//!   most the 90 days a replay may look back) is dropped by the rendered policy: the flows are
//!   replayed by `foresight::impact` (read in `foresight::commit::judge`, the only I/O), and the
//!   result judged here. Its failure names the heaviest newly blocked flow (peer, labels then and
//!   now, port, connections, the rule that admitted it at the applied version and why the rendered
//!   policy drops it), lists the heaviest flows as its pairs and counts every newly blocked key.
//!
//! The cost of `observed` tests is bounded: all sets together hold at most
//! [`MAX_OBSERVED_TESTS`], their ranges are replayed once per distinct `since` (over the union of
//! their workloads), and only workloads whose rendered policy differs from the applied one read
//! flows at all; a replay over `foresight::impact::MAX_KEYS` flow keys refuses the commit as an
//! invalid change naming the tests (shorten their `since` or narrow their `to`), writing nothing.
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
use std::time::Duration;

use innerwall_wire::flows::{Decision, decide};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, WorkloadPolicy};
use serde::{Deserialize, Serialize};

use super::impact::{Impact, WorkloadImpact};
use super::replay::ReplayRow;
use crate::error::{Error, PolicyTestFailure};
use crate::policy::model::{Peer, RegisteredWorkload, Rule, Selector, Service, validate_name};
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
/// Most `observed` tests all sets together may hold (each commit replays their recorded flows).
pub const MAX_OBSERVED_TESTS: usize = 16;
/// The range an `observed` test replays when it names none.
pub const DEFAULT_SINCE: Duration = Duration::from_secs(7 * 86_400);
/// The longest range an `observed` test may replay (as `foresight::impact::Range` allows).
pub const MAX_SINCE: Duration = Duration::from_secs(90 * 86_400);
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

/// No recorded flow to `to` that the applied policy admitted within `since` becomes blocked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ObservedSpec {
    pub to: BTreeMap<String, Vec<String>>,
    /// How far back the recorded flows are replayed, as the CLI's `--since` reads it (`7d`,
    /// `12h`, `1h30m`); 7d when absent, at most 90 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

impl ObservedSpec {
    /// The range's length: `since` read by humantime, [`DEFAULT_SINCE`] when absent, longer
    /// than zero and at most [`MAX_SINCE`].
    pub fn since(&self) -> Result<Duration, Error> {
        let Some(text) = &self.since else { return Ok(DEFAULT_SINCE) };
        let since = humantime::parse_duration(text)
            .map_err(|e| Error::Invalid(format!("since {text:?}: {e}; write e.g. 7d, 12h or 90m")))?;
        if since.is_zero() {
            return Err(Error::Invalid(format!("since {text:?} is an empty range; write e.g. 7d")));
        }
        if since > MAX_SINCE {
            return Err(Error::Invalid(format!(
                "since {text:?} is longer than the {} days a replay may look back",
                MAX_SINCE.as_secs() / 86_400
            )));
        }
        Ok(since)
    }
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
/// per test, selectors, CIDRs and ranges that parse, at most [`MAX_OBSERVED_TESTS`] `observed`
/// tests (the bound across sets is checked when a set is stored).
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
        if let Some(observed) = &test.observed {
            selector(&format!("{what}: to"), &observed.to)?;
            observed.since().map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
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
    at_most(&format!("{what}: observed tests"), observed_count(spec), MAX_OBSERVED_TESTS)?;
    Ok(())
}

/// How many `observed` tests `spec` holds.
pub fn observed_count(spec: &TestSetSpec) -> usize {
    spec.tests.iter().filter(|t| t.observed.is_some()).count()
}

// ---- evaluation ---------------------------------------------------------------------------

/// One replay of recorded flows the `observed` tests need: the range's length, the tests it
/// judges (`set/test`), and the rendered policy of every workload their `to` selectors select.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub since: Duration,
    pub tests: Vec<String>,
    pub proposed: BTreeMap<WorkloadId, WorkloadPolicy>,
}

/// The impacts of the [`Replay`]s, by range length: what [`evaluate`] judges `observed` tests by.
pub type Observations = BTreeMap<Duration, Impact>;

/// The replays the `observed` tests of `sets` (checked by [`check_set`]) need over
/// `rendering`: one per distinct `since`, over the union of its tests' workloads (none without
/// `observed` tests).
pub fn replays(sets: &[TestSetSpec], rendering: &Rendering) -> Vec<Replay> {
    let observed: Vec<(&TestSetSpec, &TestSpec, &ObservedSpec)> = sets
        .iter()
        .flat_map(|set| set.tests.iter().filter_map(move |t| t.observed.as_ref().map(|o| (set, t, o))))
        .collect();
    if observed.is_empty() {
        return Vec::new();
    }
    let estate = Estate::new(rendering);
    let mut out: BTreeMap<Duration, Replay> = BTreeMap::new();
    for (set, test, spec) in observed {
        // A test whose range or selector is bad fails in `evaluate`; it needs no replay.
        let (Ok(since), Ok(to)) = (spec.since(), sel_text(&spec.to)) else { continue };
        let replay = out.entry(since).or_insert_with(|| Replay {
            since,
            tests: Vec::new(),
            proposed: BTreeMap::new(),
        });
        replay.tests.push(format!("{}/{}", set.name, test.name));
        for w in estate.select(&to) {
            if let Some(policy) = rendering.rendered.get(&w.id) {
                replay.proposed.entry(w.id).or_insert_with(|| policy.clone());
            }
        }
    }
    out.into_values().collect()
}

/// Evaluates every test of every set (checked by [`check_set`]) over `rendering`, in set then
/// file order: the structural ones by `decide` on the rendered policies, the `observed` ones by
/// `observations` (the impacts of [`replays`]; a test whose range was not replayed fails).
pub fn evaluate(sets: &[TestSetSpec], rendering: &Rendering, observations: &Observations) -> RunReport {
    let estate = Estate::new(rendering);
    let mut results = Vec::new();
    for set in sets {
        for test in &set.tests {
            let (assertion, outcome) = estate.run(test, observations);
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

/// A rendered rule id's authored part (`<authored>/<protocol>`).
fn authored(rule: &str) -> &str {
    rule.rsplit_once('/').map_or(rule, |(a, _)| a)
}

/// Flow labels as stored (`{"app": "web"}`) in words (`app=web,tier=front`).
fn labels_text(labels: &serde_json::Value) -> String {
    match labels.as_object() {
        Some(map) if !map.is_empty() => map
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
            .collect::<Vec<_>>()
            .join(","),
        _ => "no labels".to_owned(),
    }
}

/// A replayed flow's peer: the workload or address group ingest resolved it to and its
/// address; `labels` adds a workload's labels then and now.
fn peer_text(row: &ReplayRow, labels: bool) -> String {
    match row.peer_kind {
        1 if labels => {
            let now = match (&row.labels_now, row.relabelled) {
                (None, _) => ", no longer live".to_owned(),
                (Some(now), true) => format!(", {} now", labels_text(now)),
                (Some(_), false) => " then and now".to_owned(),
            };
            format!(
                "workload {} ({}, labelled {}{now})",
                row.peer_key,
                row.src_address,
                labels_text(&row.labels_then)
            )
        }
        1 => format!("workload {} ({})", row.peer_key, row.src_address),
        2 => format!("address group {} ({})", row.peer_key, row.src_address),
        _ => row.src_address.clone(),
    }
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

    fn run(&self, test: &TestSpec, observations: &Observations) -> (&'static str, Result<(), Failed>) {
        let (kind, judged) = if let Some(flow) = &test.allow {
            ("allow", self.flow(test, flow, true))
        } else if let Some(flow) = &test.deny {
            ("deny", self.flow(test, flow, false))
        } else if let Some(only) = &test.only_from {
            ("only_from", self.only_from(test, only))
        } else if let Some(observed) = &test.observed {
            ("observed", self.observed(test, observed, observations))
        } else {
            ("none", Err(Err("needs exactly one of allow, deny, only_from or observed".into())))
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

    /// `observed`: no flow towards the workloads `to` selects is newly blocked in the replay of
    /// its range.
    fn observed(
        &self,
        test: &TestSpec,
        spec: &ObservedSpec,
        observations: &Observations,
    ) -> Result<(), Result<Failed, String>> {
        let to = sel_text(&spec.to).map_err(Err)?;
        let since = spec.since().map_err(|e| Err(e.to_string()))?;
        let dsts = self.select(&to);
        if dsts.is_empty() {
            return if test.allow_empty {
                Ok(())
            } else {
                Err(Err(format!("no workload matches to {}", terms(&to))))
            };
        }
        let impact = observations.get(&since).ok_or_else(|| {
            Err(format!(
                "the recorded flows of the last {} were not replayed",
                humantime::format_duration(since)
            ))
        })?;
        let selected: BTreeMap<WorkloadId, &RegisteredWorkload> = dsts.iter().map(|w| (w.id, *w)).collect();
        let mut count = 0u64;
        let mut rows: Vec<(&WorkloadImpact, &ReplayRow)> = Vec::new();
        for w in impact.workloads.iter().filter(|w| selected.contains_key(&w.id)) {
            count += w.replayed.newly_blocked;
            rows.extend(w.replayed.top_blocked.iter().map(|r| (w, r)));
        }
        if count == 0 {
            return Ok(());
        }
        // The heaviest first, whichever workload it goes to (ties by workload, then as replayed).
        rows.sort_by_key(|(w, r)| (std::cmp::Reverse(r.connections), w.id));
        let pairs: Vec<String> = rows
            .iter()
            .take(MAX_PAIRS)
            .map(|(w, r)| {
                format!(
                    "{} → {} {}:{} ({} connection(s))",
                    peer_text(r, false),
                    w.id,
                    r.protocol,
                    r.dst_port,
                    r.connections
                )
            })
            .collect();
        let reason = match rows.first() {
            Some((w, r)) => self.newly_blocked(selected[&w.id], w, r),
            None => format!("{count} recorded flow(s) towards {} become blocked", terms(&to)),
        };
        Err(Ok((reason, pairs, count)))
    }

    /// The reason of an `observed` failure: the flow, the rule that admitted it at the applied
    /// version and why the rendered policy drops it.
    fn newly_blocked(&self, dst: &RegisteredWorkload, w: &WorkloadImpact, row: &ReplayRow) -> String {
        let at = format!("{}:{}", row.protocol, row.dst_port);
        let admitted = match (&row.from_rule, w.from_version) {
            (_, 0) => "with nothing applied (which drops nothing)".to_owned(),
            (Some(rule), v) => {
                let name = self.rule_names.get(authored(rule)).unwrap_or(rule);
                format!("at applied version {v} by rule {name}")
            }
            (None, v) => format!("at applied version {v}"),
        };
        let why = self.why_dropped(dst, row, &at);
        format!(
            "{} → {} {at}, {} connection(s) from {} to {}, admitted {admitted}, is newly blocked: {why}",
            peer_text(row, true),
            dst.id,
            row.connections,
            row.first_seen.format("%Y-%m-%d %H:%M"),
            row.last_seen.format("%Y-%m-%d %H:%M"),
        )
    }

    /// Why `dst`'s rendered policy no longer admits the flow of `row`: what changed about the
    /// rule that admitted it (gone, disabled, its ruleset no longer scoping `dst`, no longer on
    /// the port, a peer term the source fails), else the nearest rule serving the port.
    fn why_dropped(&self, dst: &RegisteredWorkload, row: &ReplayRow, at: &str) -> String {
        let source = match row.peer_kind {
            1 => self.r.registry.iter().find(|w| w.id.to_string() == row.peer_key).map(Source::Workload),
            _ => None,
        };
        let source = match (source, row.src_address.parse::<IpAddr>().ok().and_then(|a| Cidr::host(a).ok())) {
            (Some(s), _) => s,
            (None, Some(c)) => Source::Cidr(c),
            (None, None) => {
                return format!("no rule of its rendered policy admits {} on {at}", row.src_address);
            }
        };
        let protocol: Option<Protocol> = row.protocol.parse().ok();
        let serves = |rule: &Rule| {
            rule.services.iter().filter_map(|id| self.r.model.services.get(id)).any(|s| {
                s.entries.iter().any(|e| {
                    Some(e.protocol) == protocol
                        && (e.ports.is_empty() || e.ports.iter().any(|p| p.contains(row.dst_port)))
                })
            })
        };
        let nearest = || self.nearest_by(dst, &source, serves, at);
        let Some(rule) = &row.from_rule else { return nearest() };
        let found = self
            .r
            .model
            .rulesets
            .iter()
            .find_map(|rs| rs.rules.iter().find(|r| r.id.to_string() == authored(rule)).map(|r| (rs, r)));
        let Some((rs, rule)) = found else {
            return format!("the rule is no longer in the model; {}", nearest());
        };
        let name = format!("{}/{}", rs.name, rule.name);
        if !rs.enabled {
            format!("ruleset {} is disabled", rs.name)
        } else if !rule.enabled {
            format!("rule {name} is disabled")
        } else if !rs.scope.selects(&dst.labels) {
            format!(
                "ruleset {} no longer scopes workload {} (it selects {})",
                rs.name,
                dst.id,
                terms(&rs.scope)
            )
        } else if !serves(rule) {
            format!("rule {name} no longer serves {at}")
        } else {
            match rule.peers.iter().map(|p| self.peer_miss(p, &source)).min_by_key(|(n, _)| *n) {
                Some((n, why)) if n > 0 => format!("rule {name} {why}"),
                None => format!("rule {name} has no peers"),
                Some(_) => nearest(),
            }
        }
    }

    /// Why the nearest rule (module doc) does not admit `source` to `dst` on `service`.
    fn nearest(&self, dst: &RegisteredWorkload, source: &Source<'_>, service: &Service) -> String {
        self.nearest_by(
            dst,
            source,
            |r| r.services.contains(&service.id),
            &format!("service {}", service.name),
        )
    }

    /// [`Self::nearest`] among the rules `serves` keeps (`what` names what they serve).
    fn nearest_by(
        &self,
        dst: &RegisteredWorkload,
        source: &Source<'_>,
        serves: impl Fn(&Rule) -> bool,
        what: &str,
    ) -> String {
        let scoping: Vec<_> =
            self.r.model.rulesets.iter().filter(|rs| rs.scope.selects(&dst.labels)).collect();
        if scoping.is_empty() {
            return format!("no ruleset scopes workload {}", dst.id);
        }
        // (failing terms, disabled, order) → reason
        let mut best: Option<((usize, bool, usize), String)> = None;
        let mut order = 0;
        for rs in &scoping {
            for rule in rs.rules.iter().filter(|r| serves(r)) {
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
            format!("no rule of the rulesets scoping {} ({}) references {what}", dst.id, names.join(", "))
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
    use crate::policy::inputs::Outcome;
    use crate::policy::model::{AddressGroup, AuthoredModel, Ruleset, ServiceEntry};
    use crate::policy::render::render;
    use innerwall_wire::identity::WorkloadId;
    use std::sync::Arc;
    use uuid::Uuid;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn workload(n: u128, labels: &[(&str, &str)], addr: &str, mode: Mode) -> RegisteredWorkload {
        RegisteredWorkload {
            id: WorkloadId::from_uuid(id(0x1000 + n)).unwrap(),
            mode,
            revert_at: None,
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
            ..Default::default()
        };
        let registry = vec![
            workload(1, &[("app", "web")], "10.0.0.1", Mode::Enforcement),
            workload(2, &[("app", "api")], "10.0.0.2", Mode::Enforcement),
            workload(3, &[("app", "payments")], "10.0.0.3", Mode::Visibility),
        ];
        let rendered = render(&model, &registry).unwrap();
        Rendering {
            model: model.into(),
            registry: registry.into(),
            rendered,
            changed: Vec::new(),
            narrowed: false,
            inputs: Outcome::Loaded,
        }
    }

    fn run(text: &str, r: &Rendering) -> Vec<TestResult> {
        let spec = parse_test_set_file("t", text).unwrap();
        evaluate(&[spec], r, &Observations::new()).results
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
        Arc::make_mut(&mut r.model).rulesets.truncate(1);
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
            refused("name: s\ntests:\n- {name: a, observed: {to: {app: [x]}, since: soon}}\n")
                .contains("test \"a\": since \"soon\": ")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, observed: {to: {app: [x]}, since: 91d}}\n")
                .contains("longer than the 90 days")
        );
        assert!(
            refused("name: s\ntests:\n- {name: a, observed: {to: {app: [x]}, since: 0s}}\n")
                .contains("an empty range")
        );
        assert!(refused("name: s\ntests:\n- {name: a, observed: {to: {}}}\n").contains("an empty selector"));
        let many: String = (0..=MAX_OBSERVED_TESTS)
            .map(|i| format!("- {{name: o{i}, observed: {{to: {{app: [x]}}}}}}\n"))
            .collect();
        assert!(
            refused(&format!("name: s\ntests:\n{many}"))
                .contains("observed tests: 17 is more than the 16 allowed")
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

    /// An impact listing `dst` with `blocked` newly blocked rows (heaviest first).
    fn observed_impact(dst: WorkloadId, blocked: Vec<ReplayRow>) -> Impact {
        let at = chrono::DateTime::from_timestamp_millis(1_700_000_000_000).unwrap();
        let replayed = crate::foresight::replay::Replayed {
            newly_blocked: blocked.len() as u64 + 5,
            top_blocked: blocked,
            ..Default::default()
        };
        Impact {
            range: crate::foresight::Range { from: at, to: at + chrono::Duration::days(7) },
            top: MAX_PAIRS,
            workloads: vec![WorkloadImpact {
                id: dst,
                hostname: "payments-1".into(),
                from_version: 3,
                from_mode: Some("visibility".into()),
                to_version: None,
                to_mode: "visibility".into(),
                note: None,
                replayed,
                coverage: crate::foresight::replay::coverage(0, 0, &[], &[], 1),
                unseen_admissions: Vec::new(),
                unseen_admission_count: 0,
            }],
            keys: 7,
        }
    }

    fn row(peer: &RegisteredWorkload, port: u16, connections: u64, from_rule: &str) -> ReplayRow {
        let at = chrono::DateTime::from_timestamp_millis(1_700_000_000_000).unwrap();
        ReplayRow {
            src_address: peer.addresses.first().unwrap().to_string(),
            peer_kind: 1,
            peer_key: peer.id.to_string(),
            labels_then: serde_json::json!({"app": "web"}),
            labels_now: Some(serde_json::json!({"app": "web"})),
            relabelled: false,
            dst_port: port,
            protocol: "tcp".into(),
            connections,
            records: 1,
            first_seen: at,
            last_seen: at,
            from_rule: Some(from_rule.into()),
            to_rule: None,
        }
    }

    #[test]
    fn observed_tests_are_judged_by_the_replay_of_their_range() {
        // from-web now names app=api: web's recorded https flows to payments are dropped.
        let mut r = rendering("tcp:443");
        Arc::make_mut(&mut r.model).rulesets[0].rules[0].peers = vec![Peer::Workloads(sel("app", "api"))];
        r.rendered = render(&r.model, &r.registry).unwrap();
        let text = "name: s\ntests:\n\
             - {name: web, allow: {from: {app: [web]}, to: {app: [payments]}, service: https}}\n\
             - {name: flows, observed: {to: {app: [payments]}}}\n\
             - {name: short, observed: {to: {app: [payments]}, since: 1h}}\n\
             - {name: web-flows, observed: {to: {app: [web, api]}, since: 1h}}\n\
             - {name: nobody, observed: {to: {app: [nobody]}}}\n\
             - {name: nobody-ok, allow_empty: true, observed: {to: {app: [nobody]}}}\n";
        let spec = parse_test_set_file("t", text).unwrap();
        let (web, payments) = (&r.registry[0], &r.registry[2]);

        // One replay per distinct range, over the union of its tests' selected workloads.
        let replays = replays(std::slice::from_ref(&spec), &r);
        let planned: Vec<(u64, Vec<&str>, usize)> = replays
            .iter()
            .map(|p| (p.since.as_secs(), p.tests.iter().map(String::as_str).collect(), p.proposed.len()))
            .collect();
        assert_eq!(
            planned,
            [
                (3_600, vec!["s/short", "s/web-flows"], 3),
                (7 * 86_400, vec!["s/flows", "s/nobody", "s/nobody-ok"], 1)
            ]
        );
        assert_eq!(replays[1].proposed.get(&payments.id), r.rendered.get(&payments.id));

        let from_web = format!("{}/tcp", id(11));
        let week =
            observed_impact(payments.id, vec![row(web, 443, 9, &from_web), row(web, 443, 2, &from_web)]);
        let hour = observed_impact(payments.id, Vec::new());
        let hour = Impact { workloads: Vec::new(), ..hour };
        let observations: Observations = [(DEFAULT_SINCE, week), (Duration::from_secs(3_600), hour)].into();
        let results = evaluate(std::slice::from_ref(&spec), &r, &observations).results;
        let outcome: Vec<(&str, &str, bool)> =
            results.iter().map(|t| (t.test.as_str(), t.assertion.as_str(), t.passed)).collect();
        assert_eq!(
            outcome,
            [
                ("web", "allow", false),
                ("flows", "observed", false),
                ("short", "observed", true),
                ("web-flows", "observed", true),
                ("nobody", "observed", false),
                ("nobody-ok", "observed", true),
            ],
            "results in file order, structural and observed alike"
        );
        let flows = results[1].failure.as_ref().unwrap();
        assert_eq!(flows.pair_count, 7, "every newly blocked key counts, not only the rows shown");
        assert_eq!(flows.pairs.len(), 2);
        assert!(flows.pairs[0].ends_with("tcp:443 (9 connection(s))"), "{flows:?}");
        for part in [
            format!(
                "workload {} (10.0.0.1, labelled app=web then and now) → {} tcp:443",
                web.id, payments.id
            ),
            "9 connection(s)".to_owned(),
            "admitted at applied version 3 by rule payments/from-web".to_owned(),
            "is newly blocked: rule payments/from-web needs app=api, the source has app=web".to_owned(),
        ] {
            assert!(flows.reason.contains(&part), "{part:?} in {}", flows.reason);
        }
        assert_eq!(results[4].failure.as_ref().unwrap().reason, "no workload matches to app=nobody");

        // The rule's ruleset disabled, the rule gone: each says so.
        Arc::make_mut(&mut r.model).rulesets[0].enabled = false;
        let results = evaluate(std::slice::from_ref(&spec), &r, &observations).results;
        assert!(results[1].failure.as_ref().unwrap().reason.ends_with("ruleset payments is disabled"));
        Arc::make_mut(&mut r.model).rulesets[0].enabled = true;
        Arc::make_mut(&mut r.model).rulesets[0].rules.remove(0);
        let results = evaluate(std::slice::from_ref(&spec), &r, &observations).results;
        let gone = &results[1].failure.as_ref().unwrap().reason;
        assert!(gone.contains(&format!("admitted at applied version 3 by rule {from_web}")), "{gone}");
        assert!(
            gone.contains(
                "the rule is no longer in the model; rule payments/from-vpn admits address group vpn"
            ),
            "{gone}"
        );

        // A range nobody replayed fails rather than passing unjudged.
        let results = evaluate(std::slice::from_ref(&spec), &r, &Observations::new()).results;
        assert!(results[1].failure.as_ref().unwrap().reason.contains("were not replayed"));
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
