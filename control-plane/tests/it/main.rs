//! The control plane's integration tests: one binary, one module per area.

mod postgres;
mod publish;
