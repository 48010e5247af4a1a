//! The kernel side of `table inet innerwall`, through the `nftnl` crate: building the
//! full-replace batch (add+delete+add table, chain, interval sets with their elements, rules),
//! the element-only batch of a peer delta and the kill switch's delete, and sending them. The
//! expected [`TableState`] is derived by parsing the very messages a full replace would send,
//! with the same libnftnl parsers that parse the kernel's dump (in `state`), so the comparison
//! is exact and needs no second model of nftables.
//!
//! What the safe `nftnl` API lacks (interval flags, interval-end elements, `range`) is done
//! with `nftnl_sys` calls on the crate's objects, each in a small function with its own
//! `#[allow(unsafe_code)]`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::ptr::NonNull;

use innerwall_wire::policy::{Mode, Protocol};
use nftnl::expr::{
    Bitwise, Cmp, CmpOp, Conntrack, Counter, Expression, Icmpv6HeaderField, Ipv4HeaderField, Ipv6HeaderField,
    Meta, NetworkHeaderField, Payload, TcpHeaderField, TransportHeaderField, UdpHeaderField, Verdict,
};
use nftnl::set::{Set, SetKey};
use nftnl::{Batch, Chain, ChainType, Hook, MsgType, Policy, ProtoFamily, Rule, Table, nftnl_sys as sys};

use super::desired::{
    CHAIN, DesiredTable, Element, ElementDiff, Family, ND_TYPES, PortMatch, RuleSpec, SetSpec, TABLE,
    WOULD_BLOCK_CT_MARK,
};
use super::netlink::{self, Message, NetlinkError};
use super::state::{TableState, absorb, cstring, parse_rule, parse_set};

const NFPROTO_IPV4: u8 = libc::NFPROTO_IPV4 as u8;
const NFPROTO_IPV6: u8 = libc::NFPROTO_IPV6 as u8;

/// A finalized batch: the bytes to send in one `sendmsg`, and the seq whose ack means the
/// whole batch committed.
pub struct BuiltBatch {
    bytes: Vec<u8>,
    last_seq: u32,
}

impl std::fmt::Debug for BuiltBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltBatch")
            .field("bytes", &self.bytes.len())
            .field("last_seq", &self.last_seq)
            .finish()
    }
}

impl BuiltBatch {
    fn finish(batch: Batch) -> BuiltBatch {
        let fin = batch.finalize();
        let mut bytes = Vec::new();
        for page in &fin {
            bytes.extend_from_slice(page);
        }
        let last_seq = fin.sequence_numbers().end - 1;
        BuiltBatch { bytes, last_seq }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn messages(&self) -> Vec<Message> {
        netlink::split(&self.bytes).expect("a batch we built splits")
    }

    /// Sends the batch; it commits entirely or not at all.
    pub fn send(&self) -> Result<(), NetlinkError> {
        let messages = self.messages();
        netlink::send_batch(&self.bytes, messages.len(), self.last_seq, |seq| {
            let position = messages.iter().position(|m| m.seq == seq);
            match position {
                Some(i) => format!("message {i} of the batch ({})", describe(&messages[i])),
                None => format!("the batch (seq {seq})"),
            }
        })
    }
}

/// A set key whose type and length are set per set (`KeyKind`) after creation.
struct AnyKey;

impl SetKey for AnyKey {
    const TYPE: u32 = 0;
    const LEN: u32 = 0;
    fn data(&self) -> Box<[u8]> {
        Box::new([])
    }
}

/// The whole table as one batch: add table (so the delete cannot fail), delete it, add it
/// again with its chain, sets, elements and rules.
pub fn full_replace_batch(desired: &DesiredTable) -> BuiltBatch {
    let table = Table::new(cstring(TABLE), ProtoFamily::Inet);
    let mut batch = Batch::new();
    batch.add(&table, MsgType::Add);
    batch.add(&table, MsgType::Del);
    batch.add(&table, MsgType::Add);
    let mut chain = Chain::new(cstring(CHAIN), &table);
    chain.set_hook(Hook::In, 0);
    chain.set_type(ChainType::Filter);
    chain.set_policy(Policy::Accept);
    batch.add(&chain, MsgType::Add);
    let mut set_ids = BTreeMap::new();
    for (i, spec) in desired.sets.iter().enumerate() {
        let id = i as u32 + 1;
        set_ids.insert(spec.name.clone(), id);
        let set = new_set(&table, spec, id);
        batch.add(&set, MsgType::Add);
        for e in spec.elements() {
            add_element(&set, &e);
        }
        batch.add_iter(set.elems_iter(), MsgType::Add);
    }
    for spec in &desired.rules {
        let rule = build_rule(&chain, spec, &set_ids);
        batch.add(&rule, MsgType::Add);
    }
    BuiltBatch::finish(batch)
}

/// Element deletions, then additions, for the named sets of the installed table.
pub fn element_batch(desired: &DesiredTable, update: &BTreeMap<String, ElementDiff>) -> BuiltBatch {
    let table = Table::new(cstring(TABLE), ProtoFamily::Inet);
    let mut batch = Batch::new();
    for (op, pick) in [(MsgType::Del, true), (MsgType::Add, false)] {
        for (name, diff) in update {
            let Some(spec) = desired.set(name) else { continue };
            let elements = if pick { &diff.remove } else { &diff.add };
            if elements.is_empty() {
                continue;
            }
            let set = new_set(&table, spec, 0);
            for e in elements {
                add_element(&set, e);
            }
            batch.add_iter(set.elems_iter(), op);
        }
    }
    BuiltBatch::finish(batch)
}

/// Deleting the table, as the kill switch does.
pub fn delete_table_batch() -> BuiltBatch {
    let table = Table::new(cstring(TABLE), ProtoFamily::Inet);
    let mut batch = Batch::new();
    batch.add(&table, MsgType::Del);
    BuiltBatch::finish(batch)
}

/// The state the kernel holds after `full_replace_batch(desired)` commits: the batch's own
/// table, chain, set and rule messages parsed back, and each set's elements as built.
/// (libnftnl numbers the elements it builds 1, 2, 3…, which its own parser refuses, so element
/// messages are not parsed back.)
pub fn expected_state(desired: &DesiredTable) -> TableState {
    let mut state = TableState::default();
    let shape = desired.shape();
    for msg in full_replace_batch(&shape).messages() {
        absorb(&mut state, &msg);
    }
    for set in &mut state.sets {
        if let Some(spec) = desired.set(&set.name) {
            set.elements = spec.elements();
        }
    }
    state.normalize();
    state
}

#[allow(unsafe_code)]
fn new_set<'t>(table: &'t Table, spec: &SetSpec, id: u32) -> Set<'t, AnyKey> {
    let name = cstring(&spec.name);
    let set = Set::<AnyKey>::new_named(&name, id, table, ProtoFamily::Inet);
    let p = set.as_ptr().as_ptr();
    // SAFETY: p is the live nftnl_set owned by `set`; these setters copy plain integers.
    unsafe {
        sys::nftnl_set_set_u32(p, sys::NFTNL_SET_FLAGS as u16, libc::NFT_SET_INTERVAL as u32);
        sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_TYPE as u16, spec.kind.nft_type());
        sys::nftnl_set_set_u32(p, sys::NFTNL_SET_KEY_LEN as u16, spec.kind.key_len() as u32);
    }
    set
}

#[allow(unsafe_code)]
fn add_element(set: &Set<'_, AnyKey>, element: &Element) {
    // SAFETY: the element is allocated here, filled with data libnftnl copies, and handed to
    // the set, which owns and frees it.
    unsafe {
        let elem = sys::nftnl_set_elem_alloc();
        assert!(!elem.is_null(), "out of memory allocating a set element");
        sys::nftnl_set_elem_set(
            elem,
            sys::NFTNL_SET_ELEM_KEY as u16,
            element.key.as_ptr().cast(),
            element.key.len() as u32,
        );
        if element.end {
            sys::nftnl_set_elem_set_u32(
                elem,
                sys::NFTNL_SET_ELEM_FLAGS as u16,
                libc::NFT_SET_ELEM_INTERVAL_END as u32,
            );
        }
        sys::nftnl_set_elem_add(set.as_ptr().as_ptr(), elem);
    }
}

/// `lookup` with an explicit (zero) flags attribute, as the kernel dumps it.
struct LookupExpr {
    set: CString,
    id: u32,
}

impl Expression for LookupExpr {
    #[allow(unsafe_code)]
    fn to_expr(&self, _rule: &Rule) -> NonNull<sys::nftnl_expr> {
        // SAFETY: a fresh expression filled with integers and a string libnftnl copies.
        unsafe {
            let expr = NonNull::new(sys::nftnl_expr_alloc(c"lookup".as_ptr())).expect("out of memory");
            let p = expr.as_ptr();
            sys::nftnl_expr_set_u32(p, sys::NFTNL_EXPR_LOOKUP_SREG as u16, libc::NFT_REG_1 as u32);
            sys::nftnl_expr_set_str(p, sys::NFTNL_EXPR_LOOKUP_SET as u16, self.set.as_ptr());
            sys::nftnl_expr_set_u32(p, sys::NFTNL_EXPR_LOOKUP_SET_ID as u16, self.id);
            sys::nftnl_expr_set_u32(p, sys::NFTNL_EXPR_LOOKUP_FLAGS as u16, 0);
            expr
        }
    }
}

/// `range eq reg 1 from..to` (missing from the safe API).
struct RangeExpr {
    from: Vec<u8>,
    to: Vec<u8>,
}

impl Expression for RangeExpr {
    #[allow(unsafe_code)]
    fn to_expr(&self, _rule: &Rule) -> NonNull<sys::nftnl_expr> {
        // SAFETY: a fresh expression; the data buffers are copied by libnftnl.
        unsafe {
            let expr = NonNull::new(sys::nftnl_expr_alloc(c"range".as_ptr())).expect("out of memory");
            let p = expr.as_ptr();
            sys::nftnl_expr_set_u32(p, sys::NFTNL_EXPR_RANGE_SREG as u16, libc::NFT_REG_1 as u32);
            sys::nftnl_expr_set_u32(p, sys::NFTNL_EXPR_RANGE_OP as u16, libc::NFT_RANGE_EQ as u32);
            sys::nftnl_expr_set(
                p,
                sys::NFTNL_EXPR_RANGE_FROM_DATA as u16,
                self.from.as_ptr().cast(),
                self.from.len() as u32,
            );
            sys::nftnl_expr_set(
                p,
                sys::NFTNL_EXPR_RANGE_TO_DATA as u16,
                self.to.as_ptr().cast(),
                self.to.len() as u32,
            );
            expr
        }
    }
}

fn build_rule<'c>(chain: &'c Chain<'_>, spec: &RuleSpec, set_ids: &BTreeMap<String, u32>) -> Rule<'c> {
    let mut rule = Rule::new(chain);
    // A set the table does not define (only in a deliberately broken test table) gets an id no
    // set has, so the kernel refuses the batch at this rule.
    let lookup =
        |name: &str| LookupExpr { set: cstring(name), id: set_ids.get(name).copied().unwrap_or(u32::MAX) };
    match spec {
        RuleSpec::Loopback => {
            rule.add_expr(&Meta::Iif);
            rule.add_expr(&Cmp::new(CmpOp::Eq, 1u32)); // lo is ifindex 1 in every namespace
            rule.add_expr(&Verdict::Accept);
        }
        RuleSpec::EstablishedRelated => {
            let mask = (nftnl::expr::States::ESTABLISHED | nftnl::expr::States::RELATED).bits();
            rule.add_expr(&Conntrack::State);
            rule.add_expr(&Bitwise::new(mask, 0u32));
            rule.add_expr(&Cmp::new(CmpOp::Neq, 0u32));
            rule.add_expr(&Verdict::Accept);
        }
        RuleSpec::NeighbourDiscovery => {
            rule.add_expr(&Meta::NfProto);
            rule.add_expr(&Cmp::new(CmpOp::Eq, NFPROTO_IPV6));
            rule.add_expr(&Meta::L4Proto);
            rule.add_expr(&Cmp::new(CmpOp::Eq, libc::IPPROTO_ICMPV6 as u8));
            rule.add_expr(&Payload::Transport(TransportHeaderField::Icmpv6(Icmpv6HeaderField::Type)));
            rule.add_expr(&RangeExpr { from: vec![ND_TYPES.0], to: vec![ND_TYPES.1] });
            rule.add_expr(&Verdict::Accept);
        }
        RuleSpec::Policy { family, protocol, set, ports, staged, .. } => {
            rule.add_expr(&Meta::NfProto);
            match family {
                Family::V4 => {
                    rule.add_expr(&Cmp::new(CmpOp::Eq, NFPROTO_IPV4));
                    rule.add_expr(&Payload::Network(NetworkHeaderField::Ipv4(Ipv4HeaderField::Saddr)));
                }
                Family::V6 => {
                    rule.add_expr(&Cmp::new(CmpOp::Eq, NFPROTO_IPV6));
                    rule.add_expr(&Payload::Network(NetworkHeaderField::Ipv6(Ipv6HeaderField::Saddr)));
                }
            }
            rule.add_expr(&lookup(set));
            let l4 = match protocol {
                Protocol::Tcp => libc::IPPROTO_TCP,
                Protocol::Udp => libc::IPPROTO_UDP,
                Protocol::Icmp => libc::IPPROTO_ICMP,
                Protocol::Icmpv6 => libc::IPPROTO_ICMPV6,
            } as u8;
            rule.add_expr(&Meta::L4Proto);
            rule.add_expr(&Cmp::new(CmpOp::Eq, l4));
            if !matches!(ports, PortMatch::None) {
                let dport = match protocol {
                    Protocol::Udp => Payload::Transport(TransportHeaderField::Udp(UdpHeaderField::Dport)),
                    _ => Payload::Transport(TransportHeaderField::Tcp(TcpHeaderField::Dport)),
                };
                rule.add_expr(&dport);
            }
            match ports {
                PortMatch::None => {}
                PortMatch::Range(a, b) if a == b => rule.add_expr(&Cmp::new(CmpOp::Eq, &a.to_be_bytes()[..])),
                PortMatch::Range(a, b) => {
                    rule.add_expr(&RangeExpr { from: a.to_be_bytes().to_vec(), to: b.to_be_bytes().to_vec() })
                }
                PortMatch::Set(name) => rule.add_expr(&lookup(name)),
            }
            rule.add_expr(&Counter);
            // A staged rule counts and lets the packet go on to the enforced rules (FLOW-10).
            if !staged {
                rule.add_expr(&Verdict::Accept);
            }
        }
        RuleSpec::Terminal(Mode::Simulation) => {
            rule.add_expr(&Counter);
            rule.add_expr(&Conntrack::Mark { set: false });
            rule.add_expr(&Bitwise::new(!WOULD_BLOCK_CT_MARK, WOULD_BLOCK_CT_MARK));
            rule.add_expr(&Conntrack::Mark { set: true });
            rule.add_expr(&Verdict::Accept);
        }
        RuleSpec::Terminal(_) => {
            rule.add_expr(&Counter);
            rule.add_expr(&Verdict::Drop);
        }
    }
    if let Some(comment) = spec.comment() {
        rule.set_comment(cstring(&comment)).expect("comments are kept under the 128-byte limit");
    }
    rule
}

/// A short description of a batch message, for errors.
fn describe(msg: &Message) -> String {
    let kind = msg.nft_type() as i32;
    let verb = |add: bool| if add { "add" } else { "delete" };
    if kind == libc::NFT_MSG_NEWTABLE || kind == libc::NFT_MSG_DELTABLE {
        format!("{} table inet {TABLE}", verb(kind == libc::NFT_MSG_NEWTABLE))
    } else if kind == libc::NFT_MSG_NEWCHAIN {
        format!("add chain {CHAIN}")
    } else if kind == libc::NFT_MSG_NEWSET {
        format!("add set {}", parse_set(msg).map(|(_, s)| s.name).unwrap_or_default())
    } else if kind == libc::NFT_MSG_NEWSETELEM || kind == libc::NFT_MSG_DELSETELEM {
        // Read the attributes directly: libnftnl cannot parse the element lists it builds.
        let payload = msg.bytes();
        let attrs = netlink::attributes(payload.get(20..).unwrap_or_default());
        let name = attrs
            .iter()
            .find(|(t, _)| *t == 2) // NFTA_SET_ELEM_LIST_SET
            .map(|(_, v)| String::from_utf8_lossy(v).trim_end_matches('\0').to_owned())
            .unwrap_or_default();
        let n = attrs.iter().find(|(t, _)| *t == 3).map_or(0, |(_, v)| netlink::attributes(v).len());
        format!("{} {n} element(s) of set {name}", verb(kind == libc::NFT_MSG_NEWSETELEM))
    } else if kind == libc::NFT_MSG_NEWRULE {
        let comment = parse_rule(msg).and_then(|(_, r)| r.comment);
        format!("add rule{}", comment.map(|c| format!(" \"{c}\"")).unwrap_or_default())
    } else {
        format!("message type {kind}")
    }
}

/// The kill switch's kernel half: delete `table inet innerwall` and nothing else. `Ok(false)`
/// when there was no such table.
pub fn delete_table() -> Result<bool, NetlinkError> {
    match delete_table_batch().send() {
        Ok(()) => Ok(true),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}
