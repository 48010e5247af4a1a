//! Flow evidence (FLOW-2, FLOW-4..FLOW-6): ingest of validated windows from agents (`ingest`,
//! written with the crate's binary `COPY`), daily partitions with retention (`retention`), the
//! hourly pre-aggregation of closed hours (`hourly`), and what operators read: records and gaps
//! (`query`) and rollups (`rollup`), a bounded page at a time (`page`), and flows between label
//! sets for the map (`edges`), summed as windows arrive.

mod edges;
mod hourly;
mod ingest;
pub mod installs;
mod page;
mod query;
mod retention;
mod rollup;

pub use edges::{
    EDGE_BATCH_RECORDS, EDGE_BATCH_WINDOWS, EdgeSum, Edges, MAX_EDGE_SUMS, MAX_PENDING_RECORDS, Peer, edges,
    sum_edges,
};
pub use hourly::{PENDING_SLICE, ROLLUP_BATCH_RECORDS, ROLLUP_BATCH_WINDOWS, roll_up};
pub use ingest::{IngestError, Ingested, OnBlocked, Telemetry, TimeBounds, ingest, ingest_with};
pub use page::{MAX_PAGE, Page, PageRequest};
pub use query::{FlowRow, GapRow, RecordFilter, WindowTotals, gaps, list, window_totals};
pub use retention::{
    DEFAULT_RETENTION_DAYS, RETENTION_BATCH, apply_retention, create_partitions, create_partitions_ahead,
    ensure_partitions,
};
pub use rollup::{Grouping, RollupFilter, RollupRow, parse_selector, rollup, workloads_in};
pub(crate) use rollup::{Source, sources};
