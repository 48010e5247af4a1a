//! The normalized content of `table inet innerwall` ([`TableState`]) and how two states are
//! compared ([`TableState::differences`], what drift and status report); reading the table back
//! from the kernel over netlink ([`read_table`], generation-checked), and parsing netlink
//! messages — the kernel's dump or the batch `nft` builds — with libnftnl's own parsers.
//!
//! What the safe `nftnl` API lacks (parsing, dump requests) is done with `nftnl_sys` calls,
//! each in a small function with its own `#[allow(unsafe_code)]`.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char};

use nftnl::nftnl_sys as sys;

use super::desired::{Element, TABLE};
use super::netlink::{self, Message, NetlinkError};

const INET: u16 = libc::NFPROTO_INET as u16;

/// A base chain's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChain {
    pub hook: u32,
    pub priority: i32,
    pub policy: Option<u32>,
    pub kind: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainState {
    pub name: String,
    pub base: Option<BaseChain>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    pub name: String,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// Sorted.
    pub elements: Vec<Element>,
}

/// Packets and bytes of a rule's counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RuleCounter {
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone)]
pub struct RuleState {
    pub chain: String,
    /// libnftnl's rendering of each expression; counters are rendered without their values.
    pub exprs: Vec<String>,
    pub comment: Option<String>,
    /// Kernel-assigned; `None` in expected states.
    pub handle: Option<u64>,
    pub counter: Option<RuleCounter>,
}

impl RuleState {
    /// Same match and action (handles and counter values aside).
    pub fn same(&self, other: &RuleState) -> bool {
        self.chain == other.chain && self.exprs == other.exprs && self.comment == other.comment
    }
}

/// The normalized content of `table inet innerwall`.
#[derive(Debug, Clone, Default)]
pub struct TableState {
    pub flags: u32,
    /// Sorted by name.
    pub chains: Vec<ChainState>,
    /// Sorted by name.
    pub sets: Vec<SetState>,
    /// In kernel order.
    pub rules: Vec<RuleState>,
}

impl TableState {
    pub fn set(&self, name: &str) -> Option<&SetState> {
        self.sets.iter().find(|s| s.name == name)
    }

    pub(super) fn normalize(&mut self) {
        self.chains.sort_by(|a, b| a.name.cmp(&b.name));
        self.sets.sort_by(|a, b| a.name.cmp(&b.name));
        for set in &mut self.sets {
            set.elements.sort();
        }
    }

    /// What differs between this installed state and the expected one, one line per finding
    /// (empty when they match).
    pub fn differences(&self, expected: &TableState) -> Vec<String> {
        let mut out = Vec::new();
        if self.flags != expected.flags {
            out.push(format!("table flags are {:#x}, expected {:#x}", self.flags, expected.flags));
        }
        if self.chains != expected.chains {
            let names =
                |s: &TableState| s.chains.iter().map(|c| c.name.clone()).collect::<Vec<_>>().join(",");
            out.push(format!("chains differ: [{}], expected [{}]", names(self), names(expected)));
        }
        let mut seen = Vec::new();
        for want in &expected.sets {
            seen.push(want.name.as_str());
            match self.set(&want.name) {
                None => out.push(format!("set {} is missing", want.name)),
                Some(have)
                    if (have.flags, have.key_type, have.key_len)
                        != (want.flags, want.key_type, want.key_len) =>
                {
                    out.push(format!("set {} was redefined", want.name))
                }
                Some(have) if have.elements != want.elements => {
                    let d = super::desired::element_diff(&have.elements, &want.elements);
                    out.push(format!(
                        "set {}: {} element(s) missing, {} unexpected",
                        want.name,
                        d.add.len(),
                        d.remove.len()
                    ));
                }
                Some(_) => {}
            }
        }
        for have in &self.sets {
            if !seen.contains(&have.name.as_str()) {
                out.push(format!("unexpected set {}", have.name));
            }
        }
        let rules_equal = self.rules.len() == expected.rules.len()
            && self.rules.iter().zip(&expected.rules).all(|(a, b)| a.same(b));
        if !rules_equal {
            let label =
                |r: &RuleState| format!("[{}] {}", r.comment.as_deref().unwrap_or("-"), r.exprs.join(" "));
            let mut detail =
                format!("rules differ ({} installed, {} expected)", self.rules.len(), expected.rules.len());
            let first = (0..self.rules.len().max(expected.rules.len())).find(|&i| {
                match (self.rules.get(i), expected.rules.get(i)) {
                    (Some(a), Some(b)) => !a.same(b),
                    _ => true,
                }
            });
            if let Some(i) = first {
                match (self.rules.get(i), expected.rules.get(i)) {
                    (Some(a), Some(b)) => {
                        detail += &format!("; rule {i} is {} instead of {}", label(a), label(b))
                    }
                    (Some(a), None) => detail += &format!("; extra rule {i}: {}", label(a)),
                    (None, Some(b)) => detail += &format!("; rule {i} missing: {}", label(b)),
                    (None, None) => {}
                }
            }
            out.push(detail);
        }
        out
    }
}

pub(super) fn cstring(text: &str) -> CString {
    CString::new(text).expect("names and comments we build have no NUL")
}

/// Folds one message (ours or the kernel's) into a state; messages of other tables are ignored.
pub(super) fn absorb(state: &mut TableState, msg: &Message) {
    let kind = msg.nft_type() as i32;
    if kind == libc::NFT_MSG_NEWCHAIN {
        if let Some((table, chain)) = parse_chain(msg)
            && table == TABLE
        {
            state.chains.push(chain);
        }
    } else if kind == libc::NFT_MSG_NEWSET {
        if let Some((table, set)) = parse_set(msg)
            && table == TABLE
        {
            state.sets.push(set);
        }
    } else if kind == libc::NFT_MSG_NEWSETELEM {
        if let Some((table, name, elements)) = parse_elements(msg)
            && table == TABLE
            && let Some(set) = state.sets.iter_mut().find(|s| s.name == name)
        {
            set.elements.extend(elements);
        }
    } else if kind == libc::NFT_MSG_NEWRULE
        && let Some((table, rule)) = parse_rule(msg)
        && table == TABLE
    {
        state.rules.push(rule);
    }
}

#[allow(unsafe_code)]
fn string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libnftnl getters return NUL-terminated strings owned by the object, valid until
    // it is freed; we copy immediately.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[allow(unsafe_code)]
fn parse_chain(msg: &Message) -> Option<(String, ChainState)> {
    // SAFETY: the chain is allocated, filled by libnftnl's parser from a complete, aligned
    // message, read with getters guarded by is_set, and freed on every path.
    unsafe {
        let c = sys::nftnl_chain_alloc();
        if c.is_null() {
            return None;
        }
        let out = if sys::nftnl_chain_nlmsg_parse(msg.header(), c) < 0 {
            None
        } else {
            let is = |attr: u32| sys::nftnl_chain_is_set(c, attr as u16);
            let table = string(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TABLE as u16));
            let name = string(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_NAME as u16));
            let base = is(sys::NFTNL_CHAIN_HOOKNUM).then(|| BaseChain {
                hook: sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_HOOKNUM as u16),
                priority: if is(sys::NFTNL_CHAIN_PRIO) {
                    sys::nftnl_chain_get_s32(c, sys::NFTNL_CHAIN_PRIO as u16)
                } else {
                    0
                },
                policy: is(sys::NFTNL_CHAIN_POLICY)
                    .then(|| sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_POLICY as u16)),
                kind: is(sys::NFTNL_CHAIN_TYPE)
                    .then(|| string(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TYPE as u16))),
            });
            Some((table, ChainState { name, base }))
        };
        sys::nftnl_chain_free(c);
        out
    }
}

#[allow(unsafe_code)]
pub(super) fn parse_set(msg: &Message) -> Option<(String, SetState)> {
    // SAFETY: as in parse_chain.
    unsafe {
        let s = sys::nftnl_set_alloc();
        if s.is_null() {
            return None;
        }
        let out = if sys::nftnl_set_nlmsg_parse(msg.header(), s) < 0 {
            None
        } else {
            let u32_attr = |attr: u32| {
                if sys::nftnl_set_is_set(s, attr as u16) { sys::nftnl_set_get_u32(s, attr as u16) } else { 0 }
            };
            let table = string(sys::nftnl_set_get_str(s, sys::NFTNL_SET_TABLE as u16));
            Some((
                table,
                SetState {
                    name: string(sys::nftnl_set_get_str(s, sys::NFTNL_SET_NAME as u16)),
                    flags: u32_attr(sys::NFTNL_SET_FLAGS),
                    key_type: u32_attr(sys::NFTNL_SET_KEY_TYPE),
                    key_len: u32_attr(sys::NFTNL_SET_KEY_LEN),
                    elements: Vec::new(),
                },
            ))
        };
        sys::nftnl_set_free(s);
        out
    }
}

#[allow(unsafe_code)]
fn parse_elements(msg: &Message) -> Option<(String, String, Vec<Element>)> {
    // SAFETY: as in parse_chain; element data pointers are read with the length libnftnl
    // reports and copied before the set (which owns the elements) is freed.
    unsafe {
        let s = sys::nftnl_set_alloc();
        if s.is_null() {
            return None;
        }
        let out = if sys::nftnl_set_elems_nlmsg_parse(msg.header(), s) < 0 {
            None
        } else {
            let table = string(sys::nftnl_set_get_str(s, sys::NFTNL_SET_TABLE as u16));
            let name = string(sys::nftnl_set_get_str(s, sys::NFTNL_SET_NAME as u16));
            let mut elements = Vec::new();
            let iter = sys::nftnl_set_elems_iter_create(s);
            if !iter.is_null() {
                let mut e = sys::nftnl_set_elems_iter_next(iter);
                while !e.is_null() {
                    let mut len = 0u32;
                    let key = sys::nftnl_set_elem_get(e, sys::NFTNL_SET_ELEM_KEY as u16, &mut len);
                    let key = if key.is_null() {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(key.cast::<u8>(), len as usize).to_vec()
                    };
                    let flags = if sys::nftnl_set_elem_is_set(e, sys::NFTNL_SET_ELEM_FLAGS as u16) {
                        sys::nftnl_set_elem_get_u32(e, sys::NFTNL_SET_ELEM_FLAGS as u16)
                    } else {
                        0
                    };
                    elements.push(Element { key, end: flags & libc::NFT_SET_ELEM_INTERVAL_END as u32 != 0 });
                    e = sys::nftnl_set_elems_iter_next(iter);
                }
                sys::nftnl_set_elems_iter_destroy(iter);
            }
            Some((table, name, elements))
        };
        sys::nftnl_set_free(s);
        out
    }
}

/// The comment in nft's rule userdata (TLV: type 0 = comment, NUL-terminated).
fn comment_of(userdata: &[u8]) -> Option<String> {
    let mut rest = userdata;
    while rest.len() >= 2 {
        let (kind, len) = (rest[0], rest[1] as usize);
        let value = rest.get(2..2 + len)?;
        if kind == sys::NFTNL_UDATA_RULE_COMMENT as u8 {
            return Some(String::from_utf8_lossy(value).trim_end_matches('\0').to_owned());
        }
        rest = &rest[2 + len..];
    }
    None
}

#[allow(unsafe_code)]
pub(super) fn parse_rule(msg: &Message) -> Option<(String, RuleState)> {
    // SAFETY: as in parse_chain; expressions belong to the rule and are only read while it
    // lives; snprintf writes at most the buffer length it is given.
    unsafe {
        let r = sys::nftnl_rule_alloc();
        if r.is_null() {
            return None;
        }
        let out = if sys::nftnl_rule_nlmsg_parse(msg.header(), r) < 0 {
            None
        } else {
            let table = string(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_TABLE as u16));
            let chain = string(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_CHAIN as u16));
            let handle = sys::nftnl_rule_is_set(r, sys::NFTNL_RULE_HANDLE as u16)
                .then(|| sys::nftnl_rule_get_u64(r, sys::NFTNL_RULE_HANDLE as u16));
            let mut len = 0u32;
            let udata = sys::nftnl_rule_get_data(r, sys::NFTNL_RULE_USERDATA as u16, &mut len);
            let comment = if udata.is_null() {
                None
            } else {
                comment_of(std::slice::from_raw_parts(udata.cast::<u8>(), len as usize))
            };
            let mut exprs = Vec::new();
            let mut counter = None;
            let iter = sys::nftnl_expr_iter_create(r);
            if !iter.is_null() {
                let mut e = sys::nftnl_expr_iter_next(iter);
                let mut buf = vec![0u8; 4096];
                while !e.is_null() {
                    let name = string(sys::nftnl_expr_get_str(e, sys::NFTNL_EXPR_NAME as u16));
                    if name == "counter" {
                        counter = Some(RuleCounter {
                            packets: sys::nftnl_expr_get_u64(e, sys::NFTNL_EXPR_CTR_PACKETS as u16),
                            bytes: sys::nftnl_expr_get_u64(e, sys::NFTNL_EXPR_CTR_BYTES as u16),
                        });
                        exprs.push(name);
                    } else {
                        let n = sys::nftnl_expr_snprintf(
                            buf.as_mut_ptr().cast(),
                            buf.len(),
                            e,
                            sys::NFTNL_OUTPUT_DEFAULT,
                            0,
                        );
                        let n = (n.max(0) as usize).min(buf.len() - 1);
                        let text = String::from_utf8_lossy(&buf[..n]);
                        exprs.push(format!("{name} {}", text.trim()));
                    }
                    e = sys::nftnl_expr_iter_next(iter);
                }
                sys::nftnl_expr_iter_destroy(iter);
            }
            Some((table, RuleState { chain, exprs, comment, handle, counter }))
        };
        sys::nftnl_rule_free(r);
        out
    }
}

/// A request message for `NFT_MSG_<kind>` on family inet, with the payload `fill` writes.
#[allow(unsafe_code)]
fn request(kind: i32, flags: i32, fill: impl FnOnce(*mut libc::nlmsghdr)) -> Vec<u8> {
    let mut words = vec![0u64; 8192];
    // SAFETY: the buffer (64 KiB) is larger than any request built here; the header pointer
    // returned by libnftnl points into it and its nlmsg_len bounds what we copy out.
    unsafe {
        let nlh = sys::nftnl_nlmsg_build_hdr(words.as_mut_ptr().cast(), kind as u16, INET, flags as u16, 1);
        fill(nlh);
        let len = (*nlh).nlmsg_len as usize;
        std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len).to_vec()
    }
}

#[allow(unsafe_code)]
fn table_filter(kind: i32, flags: i32) -> Vec<u8> {
    let name = cstring(TABLE);
    request(kind, flags, |nlh| {
        // SAFETY: each filter object is allocated, given the table name, serialized into the
        // request and freed.
        unsafe {
            if kind == libc::NFT_MSG_GETTABLE {
                let t = sys::nftnl_table_alloc();
                sys::nftnl_table_set_str(t, sys::NFTNL_TABLE_NAME as u16, name.as_ptr());
                sys::nftnl_table_nlmsg_build_payload(nlh, t);
                sys::nftnl_table_free(t);
            } else if kind == libc::NFT_MSG_GETCHAIN {
                let c = sys::nftnl_chain_alloc();
                sys::nftnl_chain_set_str(c, sys::NFTNL_CHAIN_TABLE as u16, name.as_ptr());
                sys::nftnl_chain_nlmsg_build_payload(nlh, c);
                sys::nftnl_chain_free(c);
            } else if kind == libc::NFT_MSG_GETSET {
                let s = sys::nftnl_set_alloc();
                sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, name.as_ptr());
                sys::nftnl_set_nlmsg_build_payload(nlh, s);
                sys::nftnl_set_free(s);
            } else if kind == libc::NFT_MSG_GETRULE {
                let r = sys::nftnl_rule_alloc();
                sys::nftnl_rule_set_str(r, sys::NFTNL_RULE_TABLE as u16, name.as_ptr());
                sys::nftnl_rule_nlmsg_build_payload(nlh, r);
                sys::nftnl_rule_free(r);
            }
        }
    })
}

#[allow(unsafe_code)]
fn set_elements_request(set: &str) -> Vec<u8> {
    let (table, set) = (cstring(TABLE), cstring(set));
    request(libc::NFT_MSG_GETSETELEM, libc::NLM_F_DUMP, |nlh| {
        // SAFETY: as in table_filter.
        unsafe {
            let s = sys::nftnl_set_alloc();
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, table.as_ptr());
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_NAME as u16, set.as_ptr());
            sys::nftnl_set_elems_nlmsg_build_payload(nlh, s);
            sys::nftnl_set_free(s);
        }
    })
}

#[allow(unsafe_code)]
fn table_flags(msg: &Message) -> Option<(String, u32)> {
    // SAFETY: as in parse_chain.
    unsafe {
        let t = sys::nftnl_table_alloc();
        if t.is_null() {
            return None;
        }
        let out = if sys::nftnl_table_nlmsg_parse(msg.header(), t) < 0 {
            None
        } else {
            let name = string(sys::nftnl_table_get_str(t, sys::NFTNL_TABLE_NAME as u16));
            let flags = if sys::nftnl_table_is_set(t, sys::NFTNL_TABLE_FLAGS as u16) {
                sys::nftnl_table_get_u32(t, sys::NFTNL_TABLE_FLAGS as u16)
            } else {
                0
            };
            Some((name, flags))
        };
        sys::nftnl_table_free(t);
        out
    }
}

/// Reads `table inet innerwall` back from the kernel; `None` when it does not exist. A
/// concurrent change during the reads is detected (generation id before and after) and the
/// read repeated.
pub fn read_table() -> Result<Option<TableState>, NetlinkError> {
    for _ in 0..5 {
        let before = netlink::generation()?;
        let state = read_table_once()?;
        if netlink::generation()? == before {
            return Ok(state);
        }
    }
    Err(NetlinkError::Interrupted(5))
}

fn read_table_once() -> Result<Option<TableState>, NetlinkError> {
    let req = table_filter(libc::NFT_MSG_GETTABLE, libc::NLM_F_ACK);
    let table = match netlink::request(&req, "reading table inet innerwall") {
        Ok(msgs) => msgs,
        Err(e) if e.errno() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut state = TableState {
        flags: table.iter().filter_map(table_flags).find(|(n, _)| n == TABLE).map(|(_, f)| f).unwrap_or(0),
        ..TableState::default()
    };
    for kind in [libc::NFT_MSG_GETCHAIN, libc::NFT_MSG_GETSET] {
        for msg in netlink::dump(&table_filter(kind, libc::NLM_F_DUMP), "dumping table inet innerwall")? {
            absorb(&mut state, &msg);
        }
    }
    let names: Vec<String> = state.sets.iter().map(|s| s.name.clone()).collect();
    for name in names {
        for msg in netlink::dump(&set_elements_request(&name), "dumping set elements")? {
            absorb(&mut state, &msg);
        }
    }
    for msg in netlink::dump(&table_filter(libc::NFT_MSG_GETRULE, libc::NLM_F_DUMP), "dumping rules")? {
        absorb(&mut state, &msg);
    }
    state.normalize();
    Ok(Some(state))
}

/// Whether a network namespace's nftables has `table inet innerwall` (cheap).
pub fn table_exists() -> Result<bool, NetlinkError> {
    let req = table_filter(libc::NFT_MSG_GETTABLE, libc::NLM_F_ACK);
    match netlink::request(&req, "reading table inet innerwall") {
        Ok(_) => Ok(true),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Sizes (intervals) of the peer sets of a state, by set name.
pub fn interval_counts(state: &TableState) -> BTreeMap<String, usize> {
    state.sets.iter().map(|s| (s.name.clone(), s.elements.iter().filter(|e| !e.end).count())).collect()
}
