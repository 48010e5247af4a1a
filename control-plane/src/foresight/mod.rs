//! Change with foresight (issue 27, POL-8, POL-10): what an operator change does before it is
//! acknowledged. `replay` (pure) and `impact` (reading) replay each workload's recorded flows
//! through the policy its agent applied and a proposed (or another stored) one, with the
//! evidence's coverage; `policy_tests` holds the named assertions beside the policy and their
//! pure evaluation over a rendering; `commit` is the one operator commit, which refuses any change
//! that breaks a policy test, inside the change's own transaction. Declares and re-exports only.

pub mod commit;
pub mod drafts;
pub mod impact;
pub mod policy_tests;
pub mod replay;

pub use commit::{
    TestSetRow, commit, commit_touching, create_test_set, delete_test_set, list_test_sets, run_policy_tests,
    show_test_set, update_test_set,
};
pub use impact::{Impact, MAX_TOP, Range, WorkloadImpact, impact, replay};
pub use policy_tests::{RunReport, TestResult, TestSetSpec};
