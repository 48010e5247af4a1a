//! Enforcement (ENF-1..ENF-7): the [`PolicyStore`] the sync loop hands every complete next
//! policy to, its Linux backend (persist, then install into `table inet innerwall` through
//! netlink), fail-static restore, the kill switch, drift detection and repair, and status.
//!
//! - [`desired`]: pure — policy → desired table, its nft rendering, CIDR merging, element diff.
//! - [`persist`]: the persisted policy: durable, checksummed, binary (not the JSON policy of
//!   the dev commands, `crate::policy_json`).
//! - [`netlink`]: the netfilter socket (one `sendmsg` per batch, dumps, generation id).
//! - [`nft`]: the batches (full replace, element update, delete) built with nftnl.
//! - [`state`]: the table's normalized state, comparison, and readback from the kernel.
//! - [`linux`]: [`LinuxPolicyStore`], the backend that ties them together.
//! - [`store`]: the [`PolicyStore`] contract, [`EnforceError`], and the in-memory store.
//! - [`status`]: what `innerwall-agent status` reports.

pub mod desired;
pub mod linux;
pub mod netlink;
pub mod nft;
pub mod persist;
pub mod state;
pub mod status;
pub mod store;

pub use linux::{
    KillSwitchReport, LinuxPolicyStore, ReleaseReport, Restored, kill_switch, release_kill_switch,
};
pub use netlink::NetlinkError;
pub use persist::{PersistError, PersistedPolicy};
pub use store::{EnforceError, Installed, MemoryPolicyStore, PolicyStore, TamperEvent};

/// Default state directory of the agent.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/innerwall-agent";
