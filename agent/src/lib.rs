//! The innerwall host agent as a library; `main.rs` is a thin CLI over it.
//!
//! - Identity and enrollment: `identity` (the credential on disk), `enroll`, `renew`; `facts`
//!   (what this host reports about itself); `connect` (run configuration and dialing).
//! - Policy: `sync` (the policy stream), `enforce` (the owned nftables table), `policy_json`
//!   (the JSON policy form of the dev commands `apply-file` / `render-file`).
//! - Flow evidence: `capture` (the eBPF program), `links` (interfaces as they come and go),
//!   `flows` (pure windows), `evidence` (the capture loop and window lifecycle), `telemetry`
//!   (queue and upload).
//! - `daemon`: `innerwall-agent run`, tying them together; `metrics`: what it exposes to
//!   Prometheus; `error`: how an error chain prints.

pub mod capture;
pub mod connect;
pub mod daemon;
pub mod enforce;
pub mod enroll;
pub mod error;
pub mod evidence;
pub mod facts;
pub mod flows;
pub mod identity;
pub mod links;
pub mod metrics;
pub mod policy_json;
pub mod private;
pub mod renew;
pub mod sync;
pub mod telemetry;
