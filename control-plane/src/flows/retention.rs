//! Retention of flow evidence (FLOW-5): windows, records, gaps, hourly rollups and daily key sums live in daily
//! partitions, created ahead (and on demand) and dropped whole once past the retention. Ingests hold the partition
//! lock shared, so uploads run side by side; creating and dropping partitions holds it exclusively.
//!
//! Creating or dropping a partition locks its parent table exclusively (and `workloads`, which the flow tables
//! reference), and a reader that joins two flow tables locks them in its own order: a partition change that waited
//! on a lock while holding a parent would hold up every reader of that parent, or deadlock with one (a records page
//! reads `flow_records`, then `flow_windows`; creation takes `flow_windows` first). So partition changes wait at
//! most [`DDL_LOCK_TIMEOUT`] for a table lock, well inside the server's deadlock check, give their locks back and
//! try again later: a reader never waits long behind one, and never is the one a deadlock aborts.

use std::future::Future;

use chrono::{DateTime, Duration, NaiveDate, Utc};
use sqlx::{PgConnection, PgPool};

use crate::error::Error;

/// Default retention of flow evidence.
pub const DEFAULT_RETENTION_DAYS: i64 = 30;

/// Key of the transaction-scoped advisory lock partition maintenance takes ("iw-flows").
const PARTITION_LOCK_KEY: i64 = 0x6977_2d66_6c6f_7773;

/// How long a partition change waits for a table's lock before it gives up its own (and retries): well under
/// Postgres's `deadlock_timeout` (1 s by default), so in a lock cycle with a reader the change is the one that yields.
const DDL_LOCK_TIMEOUT: &str = "200ms";

/// Attempts of a partition change whose table locks were busy, with a doubling pause between them from
/// [`DDL_RETRY_PAUSE`]: about three seconds in all before the caller is told to retry later.
const DDL_ATTEMPTS: u32 = 5;
const DDL_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

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

/// Holds the partition lock shared for the rest of this transaction, as ingest and the flow jobs
/// do while they write: they run side by side, and no partition is created or dropped under them
/// (that takes it exclusively, and waits for them as they wait for it).
pub(super) async fn hold_partitions(conn: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(PARTITION_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Takes the partition lock exclusively, then bounds this transaction's waits for table locks by
/// [`DDL_LOCK_TIMEOUT`] (not the advisory wait itself: ingests hold that one for a whole upload).
async fn lock_for_ddl(conn: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(PARTITION_LOCK_KEY).execute(&mut *conn).await?;
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(DDL_LOCK_TIMEOUT)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Runs `change` (one transaction) until it is not refused for a busy table lock, at most
/// [`DDL_ATTEMPTS`] times; then its busy error is the answer.
async fn retry_busy<T, F: Future<Output = Result<T, Error>>>(
    mut change: impl FnMut() -> F,
) -> Result<T, Error> {
    let mut pause = DDL_RETRY_PAUSE;
    for _ in 1..DDL_ATTEMPTS {
        match change().await {
            Err(Error::Database(e)) if crate::error::lock_not_available(&e) => {
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            done => return done,
        }
    }
    change().await
}

/// Creates the daily partitions covering `[from, to]` if missing. Takes the partition lock
/// exclusively (creation and retention exclude each other and every ingest) and waits at most
/// [`DDL_LOCK_TIMEOUT`] for each table lock; call it in a transaction of its own, before the one
/// that writes into the partitions. [`create_partitions`] runs it as that transaction, retried.
pub async fn ensure_partitions(
    conn: &mut PgConnection,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(), Error> {
    lock_for_ddl(conn).await?;
    for day in days(from, to) {
        // As the schema's owner (migration 0035): a replica's role need not own the tables.
        for table in PARTITIONED {
            sqlx::query("SELECT innerwall_ensure_partition($1, $2)")
                .bind(table)
                .bind(day)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

/// Every day from `from`'s to `to`'s.
fn days(from: DateTime<Utc>, to: DateTime<Utc>) -> impl Iterator<Item = NaiveDate> {
    let last = to.date_naive();
    from.date_naive().iter_days().take_while(move |day| *day <= last)
}

/// Creates the daily partitions of every day in `[from, to]` that lacks one, each attempt a
/// transaction of its own, retried while table locks are busy. Nothing is locked when they exist.
pub async fn create_partitions(pool: &PgPool, from: DateTime<Utc>, to: DateTime<Utc>) -> Result<(), Error> {
    let names: Vec<String> = days(from, to).flat_map(partitions).map(|(_, name)| name).collect();
    let exist: bool =
        sqlx::query_scalar("SELECT bool_and(to_regclass(n) IS NOT NULL) FROM unnest($1::text[]) AS n")
            .bind(&names)
            .fetch_one(pool)
            .await?;
    if exist {
        return Ok(());
    }
    retry_busy(|| async {
        let mut tx = pool.begin().await?;
        ensure_partitions(&mut tx, from, to).await?;
        tx.commit().await?;
        Ok(())
    })
    .await
}

/// Today's and tomorrow's partitions, made ahead so that ingest finds them: the replica makes
/// them as it starts, before its tasks run, and its upkeep every minute after.
pub async fn create_partitions_ahead(pool: &PgPool) -> Result<(), Error> {
    let now = Utc::now();
    create_partitions(pool, now, now + Duration::days(1)).await
}

/// At most this many partitions are dropped in one transaction: each `DROP` holds its lock until
/// commit, and a few thousand of them exhaust the lock table ("out of shared memory").
pub const RETENTION_BATCH: usize = 16;

/// The day of daily partition `name` (`<table>_<yyyymmdd>`).
fn partition_day(name: &str) -> Option<NaiveDate> {
    name.rsplit('_').next().and_then(|d| NaiveDate::parse_from_str(d, "%Y%m%d").ok())
}

/// The partitions among `names` whose whole day `[day, day + 1)` is before `cutoff`.
fn expired(names: Vec<String>, cutoff: NaiveDate) -> Vec<String> {
    names.into_iter().filter(|name| partition_day(name).is_some_and(|day| day < cutoff)).collect()
}

/// Drops daily partitions entirely older than `days` (FLOW-5), under the partition lock, in
/// transactions of at most [`RETENTION_BATCH`] partitions. Returns the dropped partitions.
pub async fn apply_retention(pool: &PgPool, days: i64, now: DateTime<Utc>) -> Result<Vec<String>, Error> {
    let cutoff: NaiveDate = (now - Duration::days(days)).date_naive();
    let mut dropped = Vec::new();
    loop {
        let (batch, last) = retry_busy(|| drop_expired(pool, cutoff)).await?;
        dropped.extend(batch);
        if last {
            return Ok(dropped);
        }
    }
}

/// Drops at most [`RETENTION_BATCH`] partitions wholly before `cutoff` in one transaction:
/// those it dropped, and whether they were the last.
async fn drop_expired(pool: &PgPool, cutoff: NaiveDate) -> Result<(Vec<String>, bool), Error> {
    let mut tx = pool.begin().await?;
    lock_for_ddl(&mut tx).await?;
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
    // The roll-up's and the edges' queues are one table each (migrations 0044, 0045): the windows
    // of the days dropped leave them (none while the jobs run, which take the oldest first).
    let windows_dropped = batch
        .iter()
        .filter(|name| name.starts_with("flow_windows_"))
        .filter_map(|name| partition_day(name))
        .max();
    if let Some(day) = windows_dropped {
        for queue in ["flow_pending_windows", "flow_edge_pending"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {queue} WHERE window_start < $1::date + 1"
            )))
            .bind(day)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok((batch, last))
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
