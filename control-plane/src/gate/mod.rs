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
pub use verdict::{MAX_EVIDENCE, Outcome, Params, Verdict};

/// Serializes a workload id as its UUID text (the wire crate has no serde).
pub(crate) fn serialize_id<S: serde::Serializer>(
    id: &innerwall_wire::identity::WorkloadId,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}

/// A name from a closed set (a mode, a sync state, a gap kind) as its `name()` spells it. Fields
/// of this type are read back through [`mode_name`] and its siblings; the alias keeps serde's
/// derive from taking a `&'static str` field for text borrowed from the input.
pub type Name = &'static str;

/// Reads a workload id from its UUID text.
pub(crate) fn deserialize_id<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<innerwall_wire::identity::WorkloadId, D::Error> {
    let text = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
    text.parse().map_err(serde::de::Error::custom)
}

/// Reads a name from a closed set as the `&'static str` the set spells it with, so a verdict or
/// a promotion record read back (by the remote CLI) is the value that was written.
fn static_name<'de, D: serde::Deserializer<'de>>(
    d: D,
    names: impl IntoIterator<Item = &'static str>,
) -> Result<&'static str, D::Error> {
    let text = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
    let known: Vec<&'static str> = names.into_iter().collect();
    known
        .iter()
        .find(|n| **n == text)
        .copied()
        .ok_or_else(|| serde::de::Error::custom(format!("unknown name {text:?}; expected one of {known:?}")))
}

/// A mode's name, or `unknown` (a stored record whose mode this build does not know).
pub(crate) fn mode_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    use innerwall_wire::policy::Mode;
    static_name(d, Mode::ALL.map(Mode::name).into_iter().chain(["unknown"]))
}

pub(crate) fn state_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    use innerwall_wire::sync::SyncState;
    static_name(d, SyncState::ALL.map(SyncState::name))
}

pub(crate) fn gap_kind_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    use innerwall_wire::flows::GapKind;
    static_name(d, GapKind::ALL.map(GapKind::name))
}
