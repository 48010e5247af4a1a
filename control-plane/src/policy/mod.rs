//! Policy: the authored model and every mutation of it, the pure renderer, and the publish
//! transaction that versions and announces what changed (POL-1..POL-8).

pub mod addresses;
pub mod authoring;
pub mod file;
pub mod inputs;
pub mod lifecycle;
pub mod model;
pub mod narrow;
pub mod publish;
pub mod render;
pub mod source;
pub mod spec;
pub mod staged;
pub mod store;
