//! End-to-end tests across crates. One test binary; one module per capability.

mod agent_restart;
mod binaries;
mod enroll;
mod flows;
mod plane;
mod sync;
mod unauthenticated;
