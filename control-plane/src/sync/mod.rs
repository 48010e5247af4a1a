//! The policy stream (SYNC-1..SYNC-11): the per-stream state machine (pure), the gateway that
//! drives one per agent (with batched heartbeat writes and shared policy reads), the NOTIFY
//! bridge between replicas, and the liveness sweep every replica runs.

pub mod beats;
pub mod bridge;
pub mod core;
pub mod driver;
pub mod gateway;
pub mod liveness;
pub mod planted;
pub mod reads;
pub mod records;
pub mod session;
pub mod store;
