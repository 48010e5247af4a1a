//! The Innerwall control plane as a library: the `innerwall` binary is a thin CLI over it, and
//! end-to-end tests drive it directly.

pub mod authoring;
pub mod bridge;
pub mod ca;
pub mod enroll;
pub mod flows;
pub mod gateway;
pub mod model;
pub mod postgres;
pub mod publish;
pub mod render;
pub mod server;
pub mod service;
pub mod session;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokens;
