//! Integration tests of the wire crate's public API. One test binary; one module per subject.

mod contract;
