//! The control plane's integration tests: one binary, one module per area.

mod enrollment;
mod flows;
mod identity;
mod postgres;
mod publish;
mod sync;
