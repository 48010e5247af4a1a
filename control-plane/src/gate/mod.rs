//! The evidence gate (FLOW-7, FLOW-8): is it safe to enforce this scope, and the mode changes
//! that stand on the answer.
//!
//! - [`verdict`]: pure — the verdict on a scope's workloads from their state and evidence,
//!   with replay of older versions' flows through the latest.
//! - [`evidence`]: a scope resolved to the workloads in it now, and the facts the verdict
//!   reads for a range.
//! - [`promote`]: count-pinned mode changes with their promotion records.

pub mod evidence;
pub mod promote;
pub mod verdict;

pub use evidence::{Member, Scope};
pub use promote::{Promotion, Request, judge, promote};
pub use verdict::{Outcome, Params, Verdict};

/// Serializes a workload id as its UUID text (the wire crate has no serde).
pub(crate) fn serialize_id<S: serde::Serializer>(
    id: &innerwall_wire::identity::WorkloadId,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}
