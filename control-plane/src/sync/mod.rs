//! The policy stream (SYNC-1..SYNC-11): the per-stream state machine (pure), the gateway that
//! drives one per agent, and the NOTIFY bridge between replicas.

pub mod bridge;
pub mod gateway;
pub mod session;
