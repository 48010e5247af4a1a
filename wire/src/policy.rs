//! The rendered per-workload policy (POL-2) in canonical form (POL-3), and the one diff/apply
//! implementation both sides of the stream share (SYNC-1).
//!
//! Every value here is canonical by construction: fields are private and constructors validate
//! and normalize, so two equal policies always serialize to the same bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Weak};

use ipnet::IpNet;

/// Per-workload policy version. 0 means "no policy"; the first rendered version is 1.
pub type Version = u64;

/// How a workload's policy is enforced (ENF-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    Visibility,
    Simulation,
    Enforcement,
}

named_enum!(Mode, "mode", {
    Visibility => "visibility",
    Simulation => "simulation",
    Enforcement => "enforcement",
});

/// The protocol of one resolved rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Icmp,
    Icmpv6,
}

named_enum!(Protocol, "protocol", { Tcp => "tcp", Udp => "udp", Icmp => "icmp", Icmpv6 => "icmpv6" });

impl Protocol {
    /// TCP and UDP rules match port ranges; ICMP and ICMPv6 rules have none.
    pub fn has_ports(self) -> bool {
        matches!(self, Protocol::Tcp | Protocol::Udp)
    }
}

/// An inclusive port range within 1..=65535.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    start: u16,
    end: u16,
}

impl PortRange {
    /// Every port: how "all TCP" is written, so the empty list is never ambiguous.
    pub const ALL: PortRange = PortRange { start: 1, end: 65535 };

    pub fn new(start: u32, end: u32) -> Result<Self, PolicyError> {
        let bad = |reason| PolicyError::PortRange { start, end, reason };
        if start == 0 || end == 0 {
            return Err(bad("port 0 is not a port"));
        }
        if start > 65535 || end > 65535 {
            return Err(bad("ports go up to 65535"));
        }
        if start > end {
            return Err(bad("start is after end"));
        }
        Ok(PortRange { start: start as u16, end: end as u16 })
    }

    pub fn single(port: u16) -> Result<Self, PolicyError> {
        Self::new(port.into(), port.into())
    }

    pub fn start(self) -> u16 {
        self.start
    }

    pub fn end(self) -> u16 {
        self.end
    }

    pub fn contains(self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.start == self.end {
            write!(f, "{}", self.start)
        } else {
            write!(f, "{}-{}", self.start, self.end)
        }
    }
}

/// Sorts and merges overlapping or adjacent ranges (POL-3).
pub fn merge_ports(ports: impl IntoIterator<Item = PortRange>) -> Vec<PortRange> {
    let mut sorted: Vec<PortRange> = ports.into_iter().collect();
    sorted.sort();
    let mut merged: Vec<PortRange> = Vec::with_capacity(sorted.len());
    for r in sorted {
        match merged.last_mut() {
            Some(last) if u32::from(r.start) <= u32::from(last.end) + 1 => {
                last.end = last.end.max(r.end);
            }
            _ => merged.push(r),
        }
    }
    merged
}

/// A network prefix with no host bits set, written in its one canonical spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr(IpNet);

impl Cidr {
    /// The one parse of a CIDR from anywhere (the wire, the CLI, the API, files): `addr/len`
    /// with no host bits, in canonical spelling. Anything else is refused, naming the canonical
    /// form when there is one (`10.0.0.1/8` → the network is `10.0.0.0/8`; `010.0.0.0/8` →
    /// `10.0.0.0/8`; `2001:DB8::/32` → `2001:db8::/32`; a bare `10.0.0.1` → `10.0.0.1/32`).
    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let Ok(net) = text.parse::<IpNet>() else {
            return Err(match Self::read_loosely(text) {
                Some((net, bare)) => {
                    let reason = if bare {
                        "has no prefix length"
                    } else if net.trunc() != net {
                        "has host bits set"
                    } else {
                        "is not in canonical spelling"
                    };
                    not_canonical(text, net, reason)
                }
                None => cidr_error(text, "not an address/prefix-length"),
            });
        };
        if net.trunc() != net {
            return Err(not_canonical(text, net, "has host bits set"));
        }
        let cidr = Self::checked(net, || text.to_owned())?;
        if cidr.text() != text {
            return Err(not_canonical(text, net, "is not in canonical spelling"));
        }
        Ok(cidr)
    }

    /// What `text` most plausibly means, for naming the canonical form of a refused spelling:
    /// surrounding space, leading zeros (read as decimal), a bare address; whether it was bare.
    /// Never accepted as such.
    fn read_loosely(text: &str) -> Option<(IpNet, bool)> {
        let text = text.trim();
        let (addr, len) = match text.split_once('/') {
            Some((a, l)) => (a.trim(), Some(l.trim())),
            None => (text, None),
        };
        let addr: IpAddr = addr.parse().ok().or_else(|| {
            let octets: Vec<u8> = addr
                .split('.')
                .map(|o| {
                    if o.is_empty() || o.len() > 4 || !o.bytes().all(|b| b.is_ascii_digit()) {
                        None
                    } else {
                        o.parse().ok()
                    }
                })
                .collect::<Option<_>>()?;
            <[u8; 4]>::try_from(octets).ok().map(IpAddr::from)
        })?;
        let bare = len.is_none();
        let len = match len {
            None => {
                if addr.is_ipv4() {
                    32
                } else {
                    128
                }
            }
            Some(l) if !l.is_empty() && l.len() <= 4 && l.bytes().all(|b| b.is_ascii_digit()) => {
                l.parse().ok()?
            }
            Some(_) => return None,
        };
        Some((IpNet::new(addr, len).ok()?, bare))
    }

    /// For values stored before [`Cidr::parse`] refused non-canonical spellings (and for
    /// Postgres' own `cidr::text`): a bare address is a host route and host bits are cleared
    /// (`10.1.2.3/24` → `10.1.2.0/24`). Never for new input.
    pub fn parse_lenient(text: &str) -> Result<Self, PolicyError> {
        let text = text.trim();
        let net = match text.parse::<IpNet>() {
            Ok(net) => net.trunc(),
            Err(_) => match text.parse::<IpAddr>() {
                Ok(ip) => IpNet::from(ip),
                Err(_) => return Err(cidr_error(text, "not an address or address/prefix-length")),
            },
        };
        Self::checked(net, || text.to_owned())
    }

    /// The host route (/32 or /128) of one address, as managed peers are rendered.
    pub fn host(ip: IpAddr) -> Result<Self, PolicyError> {
        Self::checked(IpNet::from(ip), || ip.to_string())
    }

    /// `text` is what the caller was given, spelled only when refused: a render makes a host
    /// route for every managed peer.
    fn checked(net: IpNet, text: impl FnOnce() -> String) -> Result<Self, PolicyError> {
        if let IpNet::V6(v6) = net
            && v6.addr().to_ipv4_mapped().is_some()
            && v6.prefix_len() >= 96
        {
            return Err(PolicyError::Cidr {
                text: text(),
                reason: "IPv4-mapped IPv6 prefixes never match; write the IPv4 prefix",
            });
        }
        Ok(Cidr(net))
    }

    /// The canonical spelling, exactly as `Display` writes it, without the formatting machinery
    /// for IPv4: every persisted policy is encoded on every render to compare it, millions of
    /// prefixes at fleet scale (PERF-1).
    pub fn text(&self) -> String {
        let mut text = Vec::with_capacity(18);
        self.push_text(&mut text);
        String::from_utf8(text).expect("a prefix is spelled in ASCII")
    }

    /// Appends [`Cidr::text`] to `out`, allocating nothing for IPv4.
    pub fn push_text(&self, out: &mut Vec<u8>) {
        let IpNet::V4(net) = self.0 else {
            use std::io::Write;
            write!(out, "{}", self.0).expect("writing to a Vec does not fail");
            return;
        };
        for (i, octet) in net.addr().octets().into_iter().enumerate() {
            if i > 0 {
                out.push(b'.');
            }
            push_decimal(out, octet);
        }
        out.push(b'/');
        push_decimal(out, net.prefix_len());
    }

    pub fn net(&self) -> IpNet {
        self.0
    }

    pub fn is_ipv4(&self) -> bool {
        matches!(self.0, IpNet::V4(_))
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.0.contains(ip)
    }
}

/// Appends `n` in decimal, without leading zeros.
fn push_decimal(text: &mut Vec<u8>, n: u8) {
    if n >= 100 {
        text.push(b'0' + n / 100);
    }
    if n >= 10 {
        text.push(b'0' + n / 10 % 10);
    }
    text.push(b'0' + n % 10);
}

/// A refused spelling with the canonical form named: the network of `net` (its host bits
/// cleared), and for host bits also the one address as a host route.
fn not_canonical(text: &str, net: IpNet, reason: &'static str) -> PolicyError {
    let network = Cidr(net.trunc()).text();
    let canonical = if net.trunc() == net {
        network
    } else {
        format!("{network} (the network), or {} for the one address", Cidr(IpNet::from(net.addr())).text())
    };
    PolicyError::CidrNotCanonical { text: text.chars().take(64).collect(), reason, canonical }
}

fn cidr_error(text: &str, reason: &'static str) -> PolicyError {
    PolicyError::Cidr { text: text.to_owned(), reason }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The id of a resolved rule: `<authored-rule-id>/<protocol>` (POL-2). Provenance is recovered
/// by splitting it, and by no other rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleId {
    text: String,
    protocol: Protocol,
}

/// Longest authored rule id accepted; authored ids are uuids or short names.
pub const MAX_AUTHORED_RULE_ID_LEN: usize = 128;

impl RuleId {
    pub fn new(authored: &str, protocol: Protocol) -> Result<Self, PolicyError> {
        Self::parse(&format!("{authored}/{protocol}"))
    }

    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let bad = |reason| PolicyError::RuleId { text: text.to_owned(), reason };
        let (authored, proto) = text.rsplit_once('/').ok_or_else(|| bad("must be <rule>/<protocol>"))?;
        let protocol = proto.parse().map_err(|_| bad("protocol must be tcp, udp, icmp or icmpv6"))?;
        if authored.is_empty() || authored.len() > MAX_AUTHORED_RULE_ID_LEN {
            return Err(bad("authored rule id must be 1-128 characters"));
        }
        if !authored.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b)) {
            return Err(bad("authored rule id may contain only A-Z a-z 0-9 . _ : -"));
        }
        Ok(RuleId { text: text.to_owned(), protocol })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The id of the authored rule this was rendered from.
    pub fn authored(&self) -> &str {
        &self.text[..self.text.len() - self.protocol.name().len() - 1]
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }
}

impl fmt::Display for RuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// One resolved inbound rule: peers, exactly one protocol (the id's), and port ranges.
///
/// The peers are shared by clones (a render resolves a ruleset's rules once and gives them to
/// every workload it selects); a change copies them first if they are shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResolvedRule {
    id: RuleId,
    ports: Vec<PortRange>,
    peers: Arc<BTreeSet<Cidr>>,
}

impl ResolvedRule {
    pub fn new(
        id: RuleId,
        ports: impl IntoIterator<Item = PortRange>,
        peers: impl IntoIterator<Item = Cidr>,
    ) -> Result<Self, PolicyError> {
        Self::with_peer_set(id, ports, Arc::new(peers.into_iter().collect()))
    }

    /// [`ResolvedRule::new`] with peers already collected, shared with whoever else holds them
    /// (a renderer gives one authored rule's peers to its rule of each protocol).
    pub fn with_peer_set(
        id: RuleId,
        ports: impl IntoIterator<Item = PortRange>,
        peers: Arc<BTreeSet<Cidr>>,
    ) -> Result<Self, PolicyError> {
        let ports = merge_ports(ports);
        match (id.protocol().has_ports(), ports.is_empty()) {
            (true, true) => return Err(PolicyError::PortsRequired { rule: id.to_string() }),
            (false, false) => return Err(PolicyError::PortsNotAllowed { rule: id.to_string() }),
            _ => {}
        }
        Ok(ResolvedRule { id, ports, peers })
    }

    pub fn id(&self) -> &RuleId {
        &self.id
    }

    pub fn protocol(&self) -> Protocol {
        self.id.protocol()
    }

    /// Sorted, merged; empty exactly for ICMP and ICMPv6.
    pub fn ports(&self) -> &[PortRange] {
        &self.ports
    }

    pub fn peers(&self) -> &BTreeSet<Cidr> {
        &self.peers
    }
}

/// The complete rendered policy of one workload at one version.
///
/// Everything but the version is its content, held behind an `Arc`: a clone shares it, and so
/// can any two policies that read the same (a replica's streams share the content of every
/// workload rendered alike, [`WeakContent`]); a change copies it first if it is shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkloadPolicy {
    version: Version,
    content: Arc<Content>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Content {
    mode: Mode,
    rules: BTreeMap<RuleId, ResolvedRule>,
    /// A promotion awaiting confirmation (FLOW-11): from this moment on (unix milliseconds) the
    /// policy is enforced in simulation, unless a later version clears it.
    revert_at_ms: Option<i64>,
    /// Rules staged beside the enforced ones (FLOW-10).
    staged: Option<Staged>,
}

/// A policy's content, not kept alive by this handle: what a cache of contents holds, so that
/// the content goes when the last policy holding it does.
#[derive(Debug, Clone)]
pub struct WeakContent(Weak<Content>);

impl WeakContent {
    /// The content under `version`, if some policy still holds it.
    pub fn upgrade(&self, version: Version) -> Option<WorkloadPolicy> {
        self.0.upgrade().map(|content| WorkloadPolicy { version, content })
    }

    /// Whether some policy still holds the content.
    pub fn is_held(&self) -> bool {
        self.0.strong_count() > 0
    }
}

/// The most characters a staged set's id has.
pub const MAX_STAGED_SET: usize = 64;

/// A staged set's id: 1 to [`MAX_STAGED_SET`] characters of a-z 0-9 . _ : - (as a policy and a
/// flow window carry it).
pub fn check_staged_set(set: &str) -> Result<(), PolicyError> {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "._:-".contains(c);
    if set.is_empty() || set.len() > MAX_STAGED_SET || !set.chars().all(allowed) {
        return Err(PolicyError::Staged {
            set: set.chars().take(MAX_STAGED_SET).collect(),
            reason: "its id is 1 to 64 characters of a-z 0-9 . _ : -",
        });
    }
    Ok(())
}

/// A staged set (FLOW-10): changes to a policy's rules that are evaluated beside them and never
/// acted on — the pending policy is the rules with `removals` taken out and `upserts` put in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Staged {
    set: String,
    upserts: BTreeMap<RuleId, ResolvedRule>,
    removals: BTreeSet<RuleId>,
}

impl Staged {
    /// A staged set named `set` (1 to [`MAX_STAGED_SET`] characters of a-z 0-9 . _ : -) that
    /// changes something, with no rule both upserted and removed.
    pub fn new(
        set: &str,
        upserts: impl IntoIterator<Item = ResolvedRule>,
        removals: impl IntoIterator<Item = RuleId>,
    ) -> Result<Staged, PolicyError> {
        check_staged_set(set)?;
        let bad = |reason| PolicyError::Staged { set: set.to_owned(), reason };
        let mut map = BTreeMap::new();
        for rule in upserts {
            if let Some(dup) = map.insert(rule.id.clone(), rule) {
                return Err(PolicyError::DuplicateRule { rule: dup.id.to_string() });
            }
        }
        let removals: BTreeSet<RuleId> = removals.into_iter().collect();
        if removals.iter().any(|id| map.contains_key(id)) {
            return Err(bad("a rule is both upserted and removed"));
        }
        if map.is_empty() && removals.is_empty() {
            return Err(bad("it changes nothing"));
        }
        Ok(Staged { set: set.to_owned(), upserts: map, removals })
    }

    /// The set's id.
    pub fn set(&self) -> &str {
        &self.set
    }

    /// Rules added or replaced, in id order.
    pub fn upserts(&self) -> impl ExactSizeIterator<Item = &ResolvedRule> {
        self.upserts.values()
    }

    /// Rule ids removed, in order.
    pub fn removals(&self) -> impl ExactSizeIterator<Item = &RuleId> {
        self.removals.iter()
    }
}

impl WorkloadPolicy {
    pub fn new(
        version: Version,
        mode: Mode,
        rules: impl IntoIterator<Item = ResolvedRule>,
    ) -> Result<Self, PolicyError> {
        let mut map = BTreeMap::new();
        for rule in rules {
            if let Some(dup) = map.insert(rule.id.clone(), rule) {
                return Err(PolicyError::DuplicateRule { rule: dup.id.to_string() });
            }
        }
        Ok(WorkloadPolicy {
            version,
            content: Arc::new(Content { mode, rules: map, revert_at_ms: None, staged: None }),
        })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    pub fn mode(&self) -> Mode {
        self.content.mode
    }

    /// A handle on this policy's content that does not keep it alive.
    pub fn weak_content(&self) -> WeakContent {
        WeakContent(Arc::downgrade(&self.content))
    }

    /// Whether `other` holds the very content this one does (then they differ at most in their
    /// versions).
    pub fn shares_content(&self, other: &WorkloadPolicy) -> bool {
        Arc::ptr_eq(&self.content, &other.content)
    }

    fn content_mut(&mut self) -> &mut Content {
        Arc::make_mut(&mut self.content)
    }

    /// The same content under another version (a render re-stamps before persisting).
    pub fn with_version(mut self, version: Version) -> Self {
        self.version = version;
        self
    }

    /// The same rules under another mode.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        if self.content.mode != mode {
            self.content_mut().mode = mode;
        }
        self
    }

    /// The same policy with a revert deadline (unix milliseconds; `None`: none). A deadline is
    /// a moment after the epoch: anything else is refused.
    pub fn with_revert_at(mut self, at_ms: Option<i64>) -> Result<Self, PolicyError> {
        if let Some(at) = at_ms
            && at <= 0
        {
            return Err(PolicyError::RevertDeadline { at_ms: at });
        }
        if self.content.revert_at_ms != at_ms {
            self.content_mut().revert_at_ms = at_ms;
        }
        Ok(self)
    }

    /// The same policy with rules staged beside its own (`None`: none).
    pub fn with_staged(mut self, staged: Option<Staged>) -> Self {
        if self.content.staged != staged {
            self.content_mut().staged = staged;
        }
        self
    }

    /// The staged set, if any (FLOW-10).
    pub fn staged(&self) -> Option<&Staged> {
        self.content.staged.as_ref()
    }

    /// The pending policy of the staged set: the same version and mode, its rules with the
    /// staged removals taken out and the upserts put in (no staged set, no deadline of its own).
    pub fn pending(&self) -> Option<WorkloadPolicy> {
        let staged = self.content.staged.as_ref()?;
        let mut rules = self.content.rules.clone();
        rules.retain(|id, _| !staged.removals.contains(id));
        rules.extend(staged.upserts.iter().map(|(id, r)| (id.clone(), r.clone())));
        let content = Content { mode: self.content.mode, rules, revert_at_ms: None, staged: None };
        Some(WorkloadPolicy { version: self.version, content: Arc::new(content) })
    }

    /// When an unconfirmed promotion reverts (unix milliseconds), if one is pending.
    pub fn revert_at(&self) -> Option<i64> {
        self.content.revert_at_ms
    }

    /// Whether the revert deadline of an enforcing policy has passed at `now_ms`: it is then
    /// enforced as its simulation (the agent's table, and the decisions flows are judged with).
    pub fn reverted_at(&self, now_ms: i64) -> bool {
        self.content.mode == Mode::Enforcement && self.content.revert_at_ms.is_some_and(|at| now_ms >= at)
    }

    /// The policy as enforced at `now_ms`: itself, or its simulation once its revert deadline
    /// passed ([`reverted_at`](Self::reverted_at)).
    pub fn effective_at(&self, now_ms: i64) -> std::borrow::Cow<'_, WorkloadPolicy> {
        if self.reverted_at(now_ms) {
            std::borrow::Cow::Owned(self.clone().with_mode(Mode::Simulation))
        } else {
            std::borrow::Cow::Borrowed(self)
        }
    }

    /// Rules in id order.
    pub fn rules(&self) -> impl ExactSizeIterator<Item = &ResolvedRule> {
        self.content.rules.values()
    }

    pub fn rule(&self, id: &RuleId) -> Option<&ResolvedRule> {
        self.content.rules.get(id)
    }

    /// Applies a delta as a unit: either every change applies and the result carries
    /// `to_version`, or nothing does and `self` is untouched (SYNC-1, SYNC-4).
    pub fn apply(&self, delta: &PolicyDelta) -> Result<WorkloadPolicy, ApplyError> {
        if delta.from_version != self.version {
            return Err(ApplyError::BaseMismatch { held: self.version, from: delta.from_version });
        }
        let (from, to) = (delta.from_version, delta.to_version);
        if to < from || (to == from && !delta.changes.is_empty()) {
            return Err(ApplyError::VersionNotAdvanced { from, to });
        }
        let mut next = self.clone();
        if !delta.changes.is_empty() {
            let content = next.content_mut();
            for change in &delta.changes {
                content.apply(change)?;
            }
        }
        next.version = to;
        Ok(next)
    }
}

impl Content {
    fn apply(&mut self, change: &Change) -> Result<(), ApplyError> {
        match change {
            Change::SetMode(mode) => self.mode = *mode,
            Change::SetStaged(staged) => self.staged = staged.clone(),
            Change::SetRevertAt(at) => {
                if let Some(at_ms) = *at
                    && at_ms <= 0
                {
                    return Err(ApplyError::Malformed(PolicyError::RevertDeadline { at_ms }));
                }
                self.revert_at_ms = *at;
            }
            Change::UpsertRule(rule) => {
                self.rules.insert(rule.id.clone(), rule.clone());
            }
            Change::RemoveRule(id) => {
                self.rules.remove(id).ok_or_else(|| ApplyError::UnknownRule { rule: id.to_string() })?;
            }
            Change::AddPeers { rule, peers } | Change::RemovePeers { rule, peers } => {
                let adding = matches!(change, Change::AddPeers { .. });
                if peers.is_empty() {
                    return Err(ApplyError::EmptyPeerChange { rule: rule.to_string() });
                }
                let target = self
                    .rules
                    .get_mut(rule)
                    .ok_or_else(|| ApplyError::UnknownRule { rule: rule.to_string() })?;
                let target = Arc::make_mut(&mut target.peers);
                for peer in peers {
                    let changed = if adding { target.insert(*peer) } else { target.remove(peer) };
                    if !changed {
                        let (rule, cidr) = (rule.to_string(), peer.to_string());
                        return Err(if adding {
                            ApplyError::PeerPresent { rule, cidr }
                        } else {
                            ApplyError::PeerAbsent { rule, cidr }
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

/// One change of a delta.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Change {
    /// Insert the rule, or replace the rule with that id.
    UpsertRule(ResolvedRule),
    RemoveRule(RuleId),
    /// Every peer must be absent before; refused otherwise.
    AddPeers {
        rule: RuleId,
        peers: BTreeSet<Cidr>,
    },
    /// Every peer must be present before; refused otherwise.
    RemovePeers {
        rule: RuleId,
        peers: BTreeSet<Cidr>,
    },
    SetMode(Mode),
    /// The revert deadline of a promotion awaiting confirmation (`None` clears it).
    SetRevertAt(Option<i64>),
    /// The staged set, whole (`None` clears it).
    SetStaged(Option<Staged>),
}

/// The changes that take the policy at `from_version` to the policy at `to_version`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PolicyDelta {
    pub from_version: Version,
    pub to_version: Version,
    pub changes: Vec<Change>,
}

impl PolicyDelta {
    /// True exactly when the delta takes a policy to itself.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty() && self.from_version == self.to_version
    }
}

/// The minimal change list from `a` to `b` (SYNC-1): the mode first, then the revert deadline,
/// then the staged set (whole), then per rule in id order
/// a removal, an upsert (new rule, or its ports changed), or peer removals and additions.
/// A rule whose peers all go stays as an empty rule; only its absence from `b` removes it.
pub fn diff(a: &WorkloadPolicy, b: &WorkloadPolicy) -> PolicyDelta {
    let (from_version, to_version) = (a.version, b.version);
    if a.shares_content(b) {
        return PolicyDelta { from_version, to_version, changes: Vec::new() };
    }
    let (a, b) = (&*a.content, &*b.content);
    let mut changes = Vec::new();
    if a.mode != b.mode {
        changes.push(Change::SetMode(b.mode));
    }
    if a.revert_at_ms != b.revert_at_ms {
        changes.push(Change::SetRevertAt(b.revert_at_ms));
    }
    if a.staged != b.staged {
        changes.push(Change::SetStaged(b.staged.clone()));
    }
    let ids: BTreeSet<&RuleId> = a.rules.keys().chain(b.rules.keys()).collect();
    for id in ids {
        match (a.rules.get(id), b.rules.get(id)) {
            (Some(_), None) => changes.push(Change::RemoveRule(id.clone())),
            (None, Some(new)) => changes.push(Change::UpsertRule(new.clone())),
            (Some(old), Some(new)) if old.ports != new.ports => changes.push(Change::UpsertRule(new.clone())),
            (Some(old), Some(new)) if Arc::ptr_eq(&old.peers, &new.peers) => {}
            (Some(old), Some(new)) => {
                let removed: BTreeSet<Cidr> = old.peers.difference(&new.peers).copied().collect();
                let added: BTreeSet<Cidr> = new.peers.difference(&old.peers).copied().collect();
                if !removed.is_empty() {
                    changes.push(Change::RemovePeers { rule: id.clone(), peers: removed });
                }
                if !added.is_empty() {
                    changes.push(Change::AddPeers { rule: id.clone(), peers: added });
                }
            }
            (None, None) => unreachable!("id came from one of the maps"),
        }
    }
    PolicyDelta { from_version, to_version, changes }
}

/// A value that cannot be part of a rendered policy. The message names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("cidr {text:?}: {reason}")]
    Cidr { text: String, reason: &'static str },
    #[error("cidr {text:?} {reason}; write {canonical}")]
    CidrNotCanonical { text: String, reason: &'static str, canonical: String },
    #[error("port range {start}-{end}: {reason}")]
    PortRange { start: u32, end: u32, reason: &'static str },
    #[error("rule id {text:?}: {reason}")]
    RuleId { text: String, reason: &'static str },
    #[error("rule {rule}: tcp and udp rules need at least one port range (all ports is 1-65535)")]
    PortsRequired { rule: String },
    #[error("rule {rule}: icmp and icmpv6 rules take no ports")]
    PortsNotAllowed { rule: String },
    #[error("rule {rule}: its protocol field says {protocol} but its id says otherwise")]
    ProtocolMismatch { rule: String, protocol: String },
    #[error("rule {rule} appears twice")]
    DuplicateRule { rule: String },
    #[error("unknown {what} {text:?}")]
    UnknownName { what: &'static str, text: String },
    #[error("{field}: unknown or unspecified enum value {value}")]
    Enum { field: &'static str, value: i32 },
    #[error("{field} is missing")]
    Missing { field: &'static str },
    #[error("revert deadline {at_ms} is not a moment after 1970 (unix milliseconds)")]
    RevertDeadline { at_ms: i64 },
    #[error("staged set {set:?}: {reason}")]
    Staged { set: String, reason: &'static str },
    #[error("policy bytes do not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("policy bytes are not in canonical form (re-encoding differs)")]
    NotCanonical,
}

/// Why a delta was refused. A refused delta changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("delta is based on version {from} but version {held} is held")]
    BaseMismatch { held: Version, from: Version },
    #[error("delta from version {from} to {to} does not advance the version")]
    VersionNotAdvanced { from: Version, to: Version },
    #[error("rule {rule} is not in the policy")]
    UnknownRule { rule: String },
    #[error("rule {rule} already has peer {cidr}")]
    PeerPresent { rule: String, cidr: String },
    #[error("rule {rule} has no peer {cidr} to remove")]
    PeerAbsent { rule: String, cidr: String },
    #[error("peer change for rule {rule} lists no peers")]
    EmptyPeerChange { rule: String },
    #[error("malformed delta: {0}")]
    Malformed(#[from] PolicyError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|c| Cidr::parse(c).unwrap()).collect()
    }

    #[test]
    fn ports_merge_overlapping_and_adjacent_ranges() {
        let r = |a, b| PortRange::new(a, b).unwrap();
        let merged =
            merge_ports([r(80, 80), r(443, 443), r(81, 90), r(85, 86), r(1000, 2000), r(2001, 2001)]);
        let text: Vec<String> = merged.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["80-90", "443", "1000-2001"]);
    }

    #[test]
    fn port_range_rejects_zero_overflow_and_reversed() {
        for (a, b, why) in [(0, 1, "port 0"), (1, 65536, "65535"), (10, 9, "start is after end")] {
            let e = PortRange::new(a, b).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(PortRange::new(65535, 65535).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn cidr_text_is_its_display(bits: u32, len in 0u8..=32, v6: u128, len6 in 0u8..=128) {
            let v4 = Cidr(IpNet::V4(ipnet::Ipv4Net::new(bits.into(), len).unwrap().trunc()));
            proptest::prop_assert_eq!(v4.text(), v4.to_string());
            let v6 = Cidr(IpNet::V6(ipnet::Ipv6Net::new(v6.into(), len6).unwrap().trunc()));
            proptest::prop_assert_eq!(v6.text(), v6.to_string());
        }
    }

    #[test]
    fn cidr_text_spells_every_octet_width() {
        for text in ["0.0.0.0/0", "9.10.99.100/32", "255.255.255.255/32", "10.200.1.0/24", "fd00::/64"] {
            assert_eq!(Cidr::parse(text).unwrap().text(), text);
        }
    }

    #[test]
    fn cidr_strict_and_lenient_parsing() {
        assert_eq!(Cidr::parse("10.0.0.0/24").unwrap().to_string(), "10.0.0.0/24");
        assert_eq!(Cidr::parse("fd00::/64").unwrap().to_string(), "fd00::/64");
        for bad in
            ["10.0.0.1/24", "10.0.0.0", "10.0.0.0/33", "FD00::/64", "fd00:0::/64", "x", "", "10.0.0.0/024"]
        {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
        assert!(Cidr::parse("::ffff:10.0.0.1/128").unwrap_err().to_string().contains("IPv4-mapped"));
        assert_eq!(Cidr::parse_lenient("10.0.0.7/24").unwrap().to_string(), "10.0.0.0/24");
        assert_eq!(Cidr::parse_lenient("10.0.0.7").unwrap().to_string(), "10.0.0.7/32");
        assert_eq!(Cidr::parse_lenient("FD00::1").unwrap().to_string(), "fd00::1/128");
        assert!(Cidr::parse_lenient("10.0.0.300").is_err());
    }

    #[test]
    fn refused_cidrs_name_their_canonical_form() {
        let cases = [
            (
                "10.0.0.1/8",
                "cidr \"10.0.0.1/8\" has host bits set; write 10.0.0.0/8 (the network), or 10.0.0.1/32 for the one address",
            ),
            ("010.0.0.0/8", "cidr \"010.0.0.0/8\" is not in canonical spelling; write 10.0.0.0/8"),
            ("10.0.0.0/08", "cidr \"10.0.0.0/08\" is not in canonical spelling; write 10.0.0.0/8"),
            (" 10.0.0.0/8", "cidr \" 10.0.0.0/8\" is not in canonical spelling; write 10.0.0.0/8"),
            ("10.0.0.7", "cidr \"10.0.0.7\" has no prefix length; write 10.0.0.7/32"),
            ("2001:DB8::/32", "cidr \"2001:DB8::/32\" is not in canonical spelling; write 2001:db8::/32"),
            (
                "2001:0db8:0:0::/32",
                "cidr \"2001:0db8:0:0::/32\" is not in canonical spelling; write 2001:db8::/32",
            ),
            (
                "2001:db8::1/32",
                "cidr \"2001:db8::1/32\" has host bits set; write 2001:db8::/32 (the network), or 2001:db8::1/128 for the one address",
            ),
            (
                "010.0.0.1/8",
                "cidr \"010.0.0.1/8\" has host bits set; write 10.0.0.0/8 (the network), or 10.0.0.1/32 for the one address",
            ),
        ];
        for (text, message) in cases {
            assert_eq!(Cidr::parse(text).unwrap_err().to_string(), message, "{text}");
        }
        for nonsense in ["banana", "10.0.0.0/33", "10.0.0.256/8", "1.2.3/8", "10.0.0.0/", "10.0.0.0/-1"] {
            let err = Cidr::parse(nonsense).unwrap_err();
            assert!(matches!(err, PolicyError::Cidr { .. }), "{nonsense}: {err}");
        }
        // A refusal's canonical form is itself accepted, as that exact spelling.
        for canonical in ["10.0.0.0/8", "2001:db8::/32", "10.0.0.7/32", "0.0.0.0/0", "::/0"] {
            assert_eq!(Cidr::parse(canonical).unwrap().text(), canonical);
        }
    }

    #[test]
    fn rule_id_carries_protocol_and_provenance() {
        let id = RuleId::new("3f1c-a", Protocol::Icmpv6).unwrap();
        assert_eq!(id.as_str(), "3f1c-a/icmpv6");
        assert_eq!(id.authored(), "3f1c-a");
        assert_eq!(id.protocol(), Protocol::Icmpv6);
        for bad in ["r1", "r1/", "/tcp", "r1/TCP", "r1/sctp", "r 1/tcp", "r1/tcp/", "r/1/tcp"] {
            assert!(RuleId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn resolved_rule_port_shape_follows_protocol() {
        let tcp = RuleId::new("r", Protocol::Tcp).unwrap();
        let icmp = RuleId::new("r", Protocol::Icmp).unwrap();
        assert!(matches!(ResolvedRule::new(tcp, [], []), Err(PolicyError::PortsRequired { .. })));
        assert!(matches!(
            ResolvedRule::new(icmp.clone(), [PortRange::ALL], []),
            Err(PolicyError::PortsNotAllowed { .. })
        ));
        assert!(ResolvedRule::new(icmp, [], cidrs(&["10.0.0.0/8"])).is_ok());
    }

    /// Copies and re-versioned policies share one content; changing one copies it first, so the
    /// others never see the change, and a content goes with the last policy holding it.
    #[test]
    fn policies_share_their_content_until_one_changes() {
        let id = RuleId::new("r", Protocol::Tcp).unwrap();
        let rule =
            ResolvedRule::new(id.clone(), [PortRange::single(22).unwrap()], cidrs(&["10.0.0.0/8"])).unwrap();
        let first = WorkloadPolicy::new(4, Mode::Enforcement, [rule]).unwrap();
        let second = first.clone().with_version(9).with_mode(Mode::Enforcement);
        assert!(second.shares_content(&first), "a new version and the same mode copy nothing");
        assert_eq!(diff(&first, &second).changes, vec![], "shared content: nothing changes");

        let delta = PolicyDelta {
            from_version: 9,
            to_version: 10,
            changes: vec![Change::AddPeers {
                rule: id.clone(),
                peers: cidrs(&["192.0.2.0/24"]).into_iter().collect(),
            }],
        };
        let third = second.apply(&delta).unwrap();
        assert!(!third.shares_content(&second));
        assert_eq!(second.rule(&id).unwrap().peers().len(), 1, "the shared content is untouched");
        assert_eq!(first.rule(&id).unwrap().peers().len(), 1);
        assert_eq!(third.rule(&id).unwrap().peers().len(), 2);
        assert_eq!(diff(&second, &third), delta, "unshared contents are compared");
        let simulated = first.clone().with_mode(Mode::Simulation);
        assert!(!simulated.shares_content(&first));
        assert_eq!(first.mode(), Mode::Enforcement);
        // Another content, the same rules: their peers are still one set.
        assert!(std::ptr::eq(simulated.rule(&id).unwrap().peers(), first.rule(&id).unwrap().peers()));
        assert!(!std::ptr::eq(third.rule(&id).unwrap().peers(), first.rule(&id).unwrap().peers()));
        assert_eq!(diff(&first, &simulated).changes, vec![Change::SetMode(Mode::Simulation)]);

        let weak = third.weak_content();
        let again = weak.upgrade(11).expect("held by `third`");
        assert!(again.shares_content(&third) && again.version() == 11);
        drop((third, again));
        assert!(!weak.is_held() && weak.upgrade(12).is_none(), "the content went with its last holder");
    }

    #[test]
    fn duplicate_rule_ids_are_refused() {
        let id = RuleId::new("r", Protocol::Udp).unwrap();
        let rule = ResolvedRule::new(id, [PortRange::single(53).unwrap()], []).unwrap();
        let e = WorkloadPolicy::new(1, Mode::Enforcement, [rule.clone(), rule]).unwrap_err();
        assert_eq!(e, PolicyError::DuplicateRule { rule: "r/udp".into() });
    }

    #[test]
    fn a_revert_deadline_turns_enforcement_into_its_simulation_once_passed() {
        let id = RuleId::new("r", Protocol::Tcp).unwrap();
        let rule = ResolvedRule::new(id, [PortRange::single(22).unwrap()], cidrs(&["10.0.0.0/8"])).unwrap();
        let enforced = WorkloadPolicy::new(4, Mode::Enforcement, [rule]).unwrap();
        let pending = enforced.clone().with_revert_at(Some(1_000)).unwrap();
        assert!(!pending.reverted_at(999));
        assert_eq!(pending.effective_at(999).mode(), Mode::Enforcement);
        assert!(pending.reverted_at(1_000));
        let reverted = pending.effective_at(1_000);
        assert_eq!(reverted.mode(), Mode::Simulation);
        assert_eq!((reverted.version(), reverted.rules().len()), (4, 1), "same version and rules");
        // Without a deadline, or outside enforcement, nothing reverts.
        assert!(!enforced.reverted_at(i64::MAX));
        assert!(!pending.clone().with_mode(Mode::Simulation).reverted_at(i64::MAX));
        // The deadline is content: it changes the bytes, and a delta sets and clears it.
        assert_ne!(pending.canonical_bytes(), enforced.canonical_bytes());
        let set = diff(&enforced, &pending.clone().with_version(5));
        assert_eq!(set.changes, vec![Change::SetRevertAt(Some(1_000))]);
        let cleared = diff(&pending, &enforced.clone().with_version(5));
        assert_eq!(cleared.changes, vec![Change::SetRevertAt(None)]);
        assert_eq!(pending.apply(&cleared).unwrap().revert_at(), None);
        // A moment before 1970 is refused, by the constructor and by a delta alike.
        assert_eq!(
            enforced.clone().with_revert_at(Some(0)).unwrap_err(),
            PolicyError::RevertDeadline { at_ms: 0 }
        );
        let bad =
            PolicyDelta { from_version: 4, to_version: 5, changes: vec![Change::SetRevertAt(Some(-5))] };
        assert!(matches!(
            enforced.apply(&bad),
            Err(ApplyError::Malformed(PolicyError::RevertDeadline { at_ms: -5 }))
        ));
    }
}
