//! The innerwall host agent as a library: enrollment and the credential (`enroll`,
//! `identity`), the policy stream (`sync`), enforcement into the owned nftables table
//! (`enforce`), the `run` daemon (`daemon`) and the JSON policy form of the dev command
//! `apply-file` (`policy_file`). `main.rs` is a thin CLI over it.

pub mod capture;
pub mod daemon;
pub mod enforce;
pub mod enroll;
pub mod flows;
pub mod identity;
pub mod policy_file;
pub mod sync;
pub mod telemetry;
