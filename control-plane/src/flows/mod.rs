//! Flow evidence (FLOW-2, FLOW-4, FLOW-5): ingest of validated windows from agents (`ingest`,
//! with its binary `COPY` encoder in `copy`), daily partitions with retention (`retention`),
//! and the queries operators read (`query`).

mod copy;
mod ingest;
mod query;
mod retention;

pub use ingest::{Ingested, Telemetry, TimeBounds, ingest};
pub use query::{FlowRow, GapRow, gaps, list};
pub use retention::{DEFAULT_RETENTION_DAYS, RETENTION_BATCH, apply_retention, ensure_partitions};
