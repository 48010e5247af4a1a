//! The flow evidence vocabulary both sides share (FLOW-1..FLOW-3): the decision the installed
//! policy makes about an inbound flow (`decide`, pure), and the window an agent reports —
//! records aggregated under exactly one policy version, plus the gaps that say what could not
//! be recorded. Conversion to and from the wire, and every check on a window that arrives from
//! an agent, live in `convert`.

use std::fmt;
use std::net::IpAddr;

use crate::policy::{Mode, Protocol, RuleId, Version, WorkloadPolicy};

/// The decision the installed policy made (or would make) about a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Decision {
    /// Visibility mode (or no policy yet): nothing was evaluated.
    Observed,
    /// A rule matched; the record names it.
    Allowed,
    /// Simulation mode: enforcement would have dropped it.
    WouldBlock,
    /// Enforcement mode: dropped.
    Blocked,
}

named_enum!(Decision, "decision", {
    Observed => "observed",
    Allowed => "allowed",
    WouldBlock => "would-block",
    Blocked => "blocked",
});

/// Why some evidence is missing (FLOW-2): a review shows these, never silence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GapKind {
    /// The kernel flow map was full; the count is the number of failed inserts.
    MapFull,
    /// The agent was not running; the interval is the time not covered.
    AgentRestart,
    /// Closed windows were dropped from the agent's upload queue.
    UploadBufferOverflow,
    /// A window reached its distinct-key cap; the count is the number of keys not recorded.
    WindowKeyOverflow,
    /// The control plane refused a window; the interval is the refused window's, the count its
    /// records.
    UploadRefused,
    /// Nothing was captured: the capture program is not attached (missing object, no root, an
    /// old kernel) or a drain of its flow map failed; the count is the drains (about one a
    /// second) that captured nothing.
    CaptureUnavailable,
    /// A closed window was lost in the agent's on-disk queue: it could not be written (e.g. a
    /// full disk) or not read back; the interval is the lost window's, the count its records.
    QueueFailed,
    /// Records may have the wrong direction: the count is the UDP datagrams recorded as inbound
    /// that looked like replies to a connection the agent's connection table did not know (an
    /// ephemeral local port answered from a service port: its entry was evicted, or the
    /// conversation is older than the capture). Some of the window's inbound records may be
    /// this host's own conversations.
    SuspectDirection,
}

named_enum!(GapKind, "gap kind", {
    MapFull => "map-full",
    AgentRestart => "agent-restart",
    UploadBufferOverflow => "upload-buffer-overflow",
    WindowKeyOverflow => "window-key-overflow",
    UploadRefused => "upload-refused",
    CaptureUnavailable => "capture-unavailable",
    QueueFailed => "queue-failed",
    SuspectDirection => "suspect-direction",
});

/// One inbound flow key aggregated over a window. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRecord {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// 0 for ICMP and ICMPv6.
    pub dst_port: u16,
    pub protocol: Protocol,
    pub decision: Decision,
    /// The rule that allowed the flow: present exactly when the decision is `Allowed`.
    pub matched_rule: Option<RuleId>,
    pub packets: u64,
    pub bytes: u64,
    /// TCP SYN without ACK; the first packet of a UDP or ICMP key.
    pub new_connections: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    /// Under the window's staged set (FLOW-10): what its pending rules decide. `None` exactly
    /// when the window has no staged set.
    pub pending: Option<Pending>,
}

/// The decision of a staged set's pending rules about a flow, and the rule that allowed it
/// (present exactly when `Allowed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub decision: Decision,
    pub rule: Option<RuleId>,
}

/// What could not be recorded over `[from_ms, to_ms)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvidenceGap {
    pub kind: GapKind,
    pub from_ms: i64,
    pub to_ms: i64,
    pub count: u64,
    /// Why, where there is a reason to give (the control plane's refusal, the error that lost a
    /// queued window, why capture is unavailable); empty otherwise. At most [`MAX_GAP_DETAIL`]
    /// characters.
    pub detail: String,
}

/// The longest gap detail (characters); a window carrying a longer one is refused.
pub const MAX_GAP_DETAIL: usize = 256;

impl EvidenceGap {
    /// A gap without a detail.
    pub fn new(kind: GapKind, from_ms: i64, to_ms: i64, count: u64) -> EvidenceGap {
        EvidenceGap { kind, from_ms, to_ms, count, detail: String::new() }
    }

    /// The gap with `detail`, cut to [`MAX_GAP_DETAIL`] characters.
    pub fn because(mut self, detail: &str) -> EvidenceGap {
        self.detail = detail.chars().take(MAX_GAP_DETAIL).collect();
        self
    }

    /// Widens this gap to cover `other` too (same kind): the interval spans both, the counts
    /// add up, and the later non-empty detail wins.
    pub fn absorb(&mut self, other: EvidenceGap) {
        self.from_ms = self.from_ms.min(other.from_ms);
        self.to_ms = self.to_ms.max(other.to_ms);
        self.count = self.count.saturating_add(other.count);
        if !other.detail.is_empty() {
            self.detail = other.detail;
        }
    }
}

impl fmt::Display for EvidenceGap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} over [{}, {}) ms, count {}", self.kind, self.from_ms, self.to_ms, self.count)?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

/// All evidence for `[start_ms, end_ms)`, evaluated against exactly one policy version (FLOW-3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowWindow {
    /// Chosen by the agent; with the workload identity, the idempotency key of an upload.
    pub id: uuid::Uuid,
    pub start_ms: i64,
    pub end_ms: i64,
    /// 0 when no policy was installed.
    pub policy_version: Version,
    pub mode: Mode,
    pub records: Vec<FlowRecord>,
    pub gaps: Vec<EvidenceGap>,
    /// The staged set of the version it was decided under (FLOW-10), if that version had one.
    pub staged_set: Option<String>,
}

/// Bounds on one window from an agent: beyond them it is refused whole.
pub const MAX_RECORDS: usize = 100_000;
pub const MAX_GAPS: usize = 1_000;

/// Keeps a window's gaps within [`MAX_GAPS`] without losing any: over the bound, the gaps of
/// each kind fold into one that spans them all and sums their counts (coarser, never silent).
pub fn bound_gaps(gaps: Vec<EvidenceGap>) -> Vec<EvidenceGap> {
    if gaps.len() <= MAX_GAPS {
        return gaps;
    }
    let mut folded: std::collections::BTreeMap<GapKind, EvidenceGap> = std::collections::BTreeMap::new();
    for gap in gaps {
        match folded.entry(gap.kind) {
            std::collections::btree_map::Entry::Occupied(mut f) => f.get_mut().absorb(gap),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(gap);
            }
        }
    }
    folded.into_values().collect()
}
pub const MAX_WINDOW_MS: i64 = 24 * 3_600_000;
/// Times outside `[1970-01-01, 10000-01-01)` are refused: they cannot name a daily partition
/// or be stored as a timestamp.
pub const TIME_RANGE_MS: std::ops::Range<i64> = 0..253_402_300_800_000;

/// Why a window from the wire was refused. A refused window is stored nowhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlowError {
    #[error("{0}")]
    Window(String),
    #[error("record {index}: {reason}")]
    Record { index: usize, reason: String },
    #[error("gap {index}: {reason}")]
    Gap { index: usize, reason: String },
}

/// The decision the policy installed at that moment makes (or would make) about a flow, with
/// the rule that allowed it.
pub fn decide(
    policy: Option<&WorkloadPolicy>,
    src: IpAddr,
    dst_port: u16,
    protocol: Protocol,
) -> (Decision, Option<RuleId>) {
    let Some(policy) = policy.filter(|p| p.mode() != Mode::Visibility) else {
        return (Decision::Observed, None);
    };
    let matched = policy.rules().find(|r| {
        r.protocol() == protocol
            && (r.ports().is_empty() || r.ports().iter().any(|p| p.contains(dst_port)))
            && r.peers().iter().any(|c| c.contains(&src))
    });
    match (matched, policy.mode()) {
        (Some(rule), _) => (Decision::Allowed, Some(rule.id().clone())),
        (None, Mode::Simulation) => (Decision::WouldBlock, None),
        (None, _) => (Decision::Blocked, None),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn gaps_over_the_bound_fold_per_kind_and_lose_no_count() {
        let gap = |kind, from_ms, count| EvidenceGap::new(kind, from_ms, from_ms + 10, count);
        let few = vec![gap(GapKind::MapFull, 0, 1), gap(GapKind::MapFull, 50, 2)];
        assert_eq!(bound_gaps(few.clone()), few, "within the bound nothing changes");
        let mut many: Vec<EvidenceGap> =
            (0..MAX_GAPS as i64).map(|i| gap(GapKind::MapFull, i * 100, 1)).collect();
        many.push(gap(GapKind::AgentRestart, 5, 7));
        let bounded = bound_gaps(many);
        assert_eq!(
            bounded,
            [
                EvidenceGap::new(GapKind::MapFull, 0, (MAX_GAPS as i64 - 1) * 100 + 10, MAX_GAPS as u64),
                gap(GapKind::AgentRestart, 5, 7),
            ]
        );
    }

    use super::*;
    use crate::testing::rule;

    fn policy(mode: Mode) -> WorkloadPolicy {
        let db = rule("db", Protocol::Tcp, &[5432], &["10.0.0.0/24"]);
        WorkloadPolicy::new(4, mode, [db, rule("ping", Protocol::Icmp, &[], &["0.0.0.0/0"])]).unwrap()
    }

    #[test]
    fn decisions_follow_mode_and_rules() {
        use Decision::*;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let check = |mode, src, port, proto, want: Decision, rule: &str| {
            let p = policy(mode);
            let (decision, matched) = decide(Some(&p), ip(src), port, proto);
            let matched = matched.map(|r| r.to_string()).unwrap_or_default();
            assert_eq!((decision, matched.as_str()), (want, rule), "{mode} {src} {port} {proto}");
        };
        check(Mode::Enforcement, "10.0.0.9", 5432, Protocol::Tcp, Allowed, "db/tcp");
        check(Mode::Enforcement, "10.0.1.9", 5432, Protocol::Tcp, Blocked, "");
        check(Mode::Enforcement, "10.0.0.9", 5433, Protocol::Tcp, Blocked, "");
        check(Mode::Enforcement, "10.0.0.9", 5432, Protocol::Udp, Blocked, "");
        check(Mode::Simulation, "10.0.1.9", 5432, Protocol::Tcp, WouldBlock, "");
        check(Mode::Simulation, "192.0.2.1", 0, Protocol::Icmp, Allowed, "ping/icmp");
        check(Mode::Visibility, "10.0.1.9", 5432, Protocol::Tcp, Observed, "");
        assert_eq!(decide(None, ip("10.0.0.9"), 5432, Protocol::Tcp), (Observed, None));
    }

    /// The pending rules of a staged set (FLOW-10) decide beside the enforced ones: a staged
    /// narrowing blocks what the rules allow, a staged new rule allows what they block, a staged
    /// removal falls through to the mode's default even when nothing else is left (calico#13416:
    /// the default is not lost when the staged rule is the last), and the enforced decision never
    /// moves.
    #[test]
    fn pending_rules_decide_beside_the_enforced_ones() {
        use crate::policy::Staged;
        use Decision::*;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let narrowed = rule("db", Protocol::Tcp, &[5432], &["10.0.0.0/25"]);
        let new = rule("ssh", Protocol::Tcp, &[22], &["10.9.0.0/16"]);
        let ping = RuleId::new("ping", Protocol::Icmp).unwrap();
        let staged = Staged::new("rs.db:2", [narrowed, new], [ping]).unwrap();
        let p = policy(Mode::Enforcement).with_staged(Some(staged));
        let pending = p.pending().unwrap();
        assert_eq!((pending.version(), pending.mode(), pending.staged()), (4, Mode::Enforcement, None));
        let both = |src, port, proto| {
            let name = |(d, r): (Decision, Option<RuleId>)| (d, r.map(|r| r.to_string()));
            (name(decide(Some(&p), ip(src), port, proto)), name(decide(Some(&pending), ip(src), port, proto)))
        };
        let db = Some("db/tcp".to_owned());
        assert_eq!(
            both("10.0.0.200", 5432, Protocol::Tcp),
            ((Allowed, db.clone()), (Blocked, None)),
            "narrowed"
        );
        assert_eq!(both("10.0.0.9", 5432, Protocol::Tcp), ((Allowed, db.clone()), (Allowed, db)), "still in");
        assert_eq!(
            both("10.9.1.1", 22, Protocol::Tcp),
            ((Blocked, None), (Allowed, Some("ssh/tcp".to_owned()))),
            "a staged new rule admits nothing yet"
        );
        assert_eq!(
            both("192.0.2.1", 0, Protocol::Icmp),
            ((Allowed, Some("ping/icmp".to_owned())), (Blocked, None)),
            "a staged removal falls through to the default"
        );
        // Staged the last rule away: the pending default still holds.
        let db = RuleId::new("db", Protocol::Tcp).unwrap();
        let all = Staged::new("rs.db:3", [], [db, RuleId::new("ping", Protocol::Icmp).unwrap()]).unwrap();
        let emptied = policy(Mode::Simulation).with_staged(Some(all)).pending().unwrap();
        assert_eq!(emptied.rules().len(), 0);
        assert_eq!(decide(Some(&emptied), ip("10.0.0.9"), 5432, Protocol::Tcp), (WouldBlock, None));
        assert_eq!(policy(Mode::Enforcement).pending(), None, "no staged set, no pending rules");
        // A staged set names itself and changes something, and a rule is upserted or removed.
        let id = || RuleId::new("x", Protocol::Tcp).unwrap();
        assert!(Staged::new("Bad Name", [], [id()]).is_err());
        assert!(Staged::new("ok", [], []).is_err());
        assert!(Staged::new("ok", [rule("x", Protocol::Tcp, &[1], &[])], [id()]).is_err());
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for d in Decision::ALL {
            assert_eq!(d.name().parse::<Decision>(), Ok(d));
        }
        assert!("would_block".parse::<Decision>().unwrap_err().to_string().contains("unknown decision"));
        let names: Vec<_> = GapKind::ALL.iter().map(|k| k.to_string()).collect();
        assert_eq!(
            names,
            [
                "map-full",
                "agent-restart",
                "upload-buffer-overflow",
                "window-key-overflow",
                "upload-refused",
                "capture-unavailable",
                "queue-failed",
                "suspect-direction"
            ]
        );
    }
}
