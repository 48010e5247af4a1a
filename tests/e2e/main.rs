//! End-to-end tests across crates. One test binary; one module per capability.

mod agent_restart;
mod binaries;
mod bounds;
mod console;
mod enroll;
mod evidence;
mod flows;
mod gate;
mod host;
mod identity;
mod installs;
mod kill_switch;
mod metrics;
mod notify;
mod operator_edge;
mod plane;
mod policy_size;
mod remote;
mod remote_fleet;
mod remote_workloads;
mod simulation;
mod states;
mod suggest;
mod sync;
mod unauthenticated;
mod units;
