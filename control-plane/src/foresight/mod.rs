//! Foresight (POL-8): what a policy change would do to recorded traffic before it ships. The
//! replay of each workload's recorded flows through the policy its agent applied and a proposed
//! (or another stored) one, with the evidence's coverage (`impact`, reading; `replay`, pure).

pub mod impact;
pub mod replay;

pub use impact::{Impact, MAX_TOP, Range, WorkloadImpact, impact, replay};
