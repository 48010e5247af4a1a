//! Retention of flow evidence (FLOW-5): windows, records, gaps, hourly rollups and daily key sums live in daily
//! partitions, created on demand and dropped whole once past the retention. Ingests hold the partition lock shared,
//! so uploads run side by side; creating and dropping partitions holds it exclusively.

use chrono::{DateTime, Duration, NaiveDate, Utc};
use sqlx::{PgConnection, PgPool};

use crate::error::Error;

/// Default retention of flow evidence.
pub const DEFAULT_RETENTION_DAYS: i64 = 30;

/// Key of the transaction-scoped advisory lock partition maintenance takes ("iw-flows").
pub(super) const PARTITION_LOCK_KEY: i64 = 0x6977_2d66_6c6f_7773;

/// The partitioned flow tables, each with a partition a day.
const PARTITIONED: [&str; 7] = [
    "flow_windows",
    "flow_records",
    "flow_gaps",
    "flow_rollups",
    "flow_rule_rollups",
    "flow_key_days",
    "flow_edge_hours",
];

/// Each partitioned table with the name of its partition for `day`.
pub(super) fn partitions(day: NaiveDate) -> [(&'static str, String); 7] {
    let suffix = day.format("%Y%m%d");
    PARTITIONED.map(|table| (table, format!("{table}_{suffix}")))
}

/// Creates the daily partitions covering `[from, to]` if missing. Takes the partition lock
/// exclusively (creation and retention exclude each other and every ingest); call it in a
/// transaction of its own, before the one that writes into the partitions.
pub async fn ensure_partitions(
    conn: &mut PgConnection,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *conn).await?;
    let mut day = from.date_naive();
    while day <= to.date_naive() {
        let next = day.succ_opt().expect("dates far from the end of time");
        // As the schema's owner (migration 0035): a replica's role need not own the tables.
        for table in PARTITIONED {
            sqlx::query("SELECT innerwall_ensure_partition($1, $2)")
                .bind(table)
                .bind(day)
                .execute(&mut *conn)
                .await?;
        }
        day = next;
    }
    Ok(())
}

/// At most this many partitions are dropped in one transaction: each `DROP` holds its lock until
/// commit, and a few thousand of them exhaust the lock table ("out of shared memory").
pub const RETENTION_BATCH: usize = 16;

/// The partitions among `names` whose whole day `[day, day + 1)` is before `cutoff`.
fn expired(names: Vec<String>, cutoff: NaiveDate) -> Vec<String> {
    names
        .into_iter()
        .filter(|name| {
            name.rsplit('_')
                .next()
                .and_then(|d| NaiveDate::parse_from_str(d, "%Y%m%d").ok())
                .is_some_and(|day| day < cutoff)
        })
        .collect()
}

/// Drops daily partitions entirely older than `days` (FLOW-5), under the partition lock, in
/// transactions of at most [`RETENTION_BATCH`] partitions. Returns the dropped partitions.
pub async fn apply_retention(pool: &PgPool, days: i64, now: DateTime<Utc>) -> Result<Vec<String>, Error> {
    let cutoff: NaiveDate = (now - Duration::days(days)).date_naive();
    let mut dropped = Vec::new();
    loop {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *tx).await?;
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = ANY($1) ORDER BY 1",
        )
        .bind(PARTITIONED.as_slice())
        .fetch_all(&mut *tx)
        .await?;
        let mut batch = expired(names, cutoff);
        let last = batch.len() <= RETENTION_BATCH;
        batch.truncate(RETENTION_BATCH);
        for name in &batch {
            sqlx::query("SELECT innerwall_drop_partition($1)").bind(name).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        dropped.extend(batch);
        if last {
            return Ok(dropped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_days_before_the_cutoff_expire() {
        let names =
            ["flow_gaps_20261101", "flow_records_20261101", "flow_records_20261102", "flow_records_x"];
        let cutoff = NaiveDate::from_ymd_opt(2026, 11, 2).unwrap();
        assert_eq!(
            expired(names.map(String::from).to_vec(), cutoff),
            ["flow_gaps_20261101", "flow_records_20261101"]
        );
    }
}
