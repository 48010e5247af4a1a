//! Flow evidence (FLOW-2, FLOW-4, FLOW-5): ingest of validated windows from agents, daily
//! partitions with retention, and the queries operators read.

mod ingest;

pub use ingest::*;
