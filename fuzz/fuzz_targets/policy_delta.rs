//! A policy and a delta from the wire: decoding, conversion and apply never panic, and
//! whatever is accepted keeps the contract (canonical bytes round-trip; the diff of the result
//! from the base applies back to the same result).
#![no_main]

use innerwall_wire::policy::{PolicyDelta, WorkloadPolicy, diff};
use innerwall_wire::proto;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let _ = WorkloadPolicy::from_canonical_bytes(data);
    let Some((&split, rest)) = data.split_first() else { return };
    let (base, delta) = rest.split_at((split as usize).min(rest.len()));
    let (Ok(base), Ok(delta)) = (proto::WorkloadPolicy::decode(base), proto::PolicyDelta::decode(delta))
    else {
        return;
    };
    let (Ok(base), Ok(delta)) = (WorkloadPolicy::try_from(&base), PolicyDelta::try_from(&delta)) else {
        return;
    };
    assert_eq!(WorkloadPolicy::from_canonical_bytes(&base.canonical_bytes()).as_ref(), Ok(&base));
    if let Ok(next) = base.apply(&delta) {
        assert_eq!(WorkloadPolicy::from_canonical_bytes(&next.canonical_bytes()).as_ref(), Ok(&next));
        assert_eq!(base.apply(&diff(&base, &next)).as_ref(), Ok(&next), "the delta contract");
    }
});
