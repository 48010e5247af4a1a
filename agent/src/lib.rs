//! The innerwall host agent as a library; `main.rs` is a thin CLI over it.
//!
//! Rooms, each importing only those before it (`cargo xtask check-cycles`):
//! - `error` (how an error chain prints), `private` (files only root reads) and `policy_json`
//!   (the JSON policy of the dev commands `apply-file` / `render-file`): leaves.
//! - `identity`: the credential on disk, dialing the control plane, host facts, enrollment.
//! - `enforce`: the owned nftables table behind the `PolicyStore` contract.
//! - `evidence`: the host's links, eBPF capture, pure flow windows, the upload queue.
//! - `metrics`: what the agent exposes to Prometheus.
//! - `sync`: the policy stream (its core and session) and the `Agent` its tasks share, by role.
//! - `daemon`: `innerwall-agent run`, tying them together, with the tasks beside the stream:
//!   renewal (`daemon::renew`) and the flow evidence loop (`daemon::windows`).

pub mod daemon;
pub mod enforce;
pub mod error;
pub mod evidence;
pub mod identity;
pub mod metrics;
pub mod policy_json;
pub mod private;
pub mod rtnetlink;
pub mod sync;
