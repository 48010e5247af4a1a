//! The policy stream (SYNC-1..SYNC-11): the per-stream state machine (pure), the gateway that
//! drives one per agent with its batched heartbeat writes, the NOTIFY bridge between replicas, and the liveness sweep every
//! replica runs.

pub mod beats;
pub mod bridge;
pub mod gateway;
pub mod liveness;
pub mod session;
