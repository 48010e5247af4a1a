-- The windows the roll-up job has still to roll up are a queue of their own (issue 33, item 6;
-- PERF-8).
--
-- Until now the job marked each window it rolled up (`rolled_up = true`). `rolled_up` is in the
-- predicate of the pending windows' index, so each mark was a new version of the window's row
-- with an entry in every index of `flow_windows` (730 ms of a 2.1 s batch of 50,000 windows of
-- one record), and left a dead version of every window for vacuum: the largest table was written
-- twice. And a slice of the job asked for its oldest pending windows with a condition the planner
-- had no statistics for, so it guessed that 1 in 200 passed it, not 1 in 2, and read and sorted
-- every pending window of every partition once per batch.
--
-- Now inserting a window queues it here (the trigger below, in the inserting statement), and the
-- job deletes from here what it rolls up, in the transaction that writes the rollups, reading a
-- slice's oldest windows in order from its own index (Postgres gathers statistics on an indexed
-- expression). The queue is partitioned by day like the windows, so retention drops a day of it
-- with the day's windows. A window is rolled up exactly when it is no longer queued.
--
-- Expand/contract: `rolled_up` stays for the previous release and is true for every window from
-- here on, queued or not, so a replica of that release finds nothing to roll up (it would roll up
-- again what this release did) and reads a queued window's hour from the rollups alone until it
-- is upgraded (its reviews can miss the windows of closed hours not rolled up yet; they never
-- count one twice). A later release drops the column.
--
-- Its one lock on a table a replica uses comes first and whole (a default and a trigger need it
-- whole): taken later, behind a previous release's roll-up batch that read `flow_windows` and
-- waits to update it, the two would deadlock. Held briefly: only the windows pending are copied.
LOCK TABLE flow_windows IN ACCESS EXCLUSIVE MODE;

CREATE TABLE flow_pending_windows (
    workload_id  uuid NOT NULL,
    window_id    uuid NOT NULL,
    window_start timestamptz NOT NULL,
    record_count integer NOT NULL
) PARTITION BY RANGE (window_start);

-- A slice of the job (`flows::hourly::PENDING_SLICE`; the modulus is `ROLLUP_SLICES`, and a test
-- checks that the job's condition reads this index).
CREATE INDEX flow_pending_windows_slice
    ON flow_pending_windows ((get_byte(uuid_send(workload_id), 15) % 2), window_start);
-- The readers' ranges.
CREATE INDEX flow_pending_windows_start ON flow_pending_windows (window_start);

DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT to_date(substring(c.relname FROM '_(\d{8})$'), 'YYYYMMDD')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname = 'flow_windows' AND c.relname ~ '_\d{8}$'
    LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_pending_windows FOR VALUES FROM (%L) TO (%L)',
                       'flow_pending_windows_' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
END
$$;

-- No window is inserted between the copy and the trigger (the lock above).
INSERT INTO flow_pending_windows (workload_id, window_id, window_start, record_count)
SELECT workload_id, window_id, window_start, record_count FROM flow_windows WHERE NOT rolled_up;
UPDATE flow_windows SET rolled_up = true WHERE NOT rolled_up;
ALTER TABLE flow_windows ALTER COLUMN rolled_up SET DEFAULT true;

CREATE FUNCTION innerwall_queue_windows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO flow_pending_windows (workload_id, window_id, window_start, record_count)
    SELECT workload_id, window_id, window_start, record_count FROM added;
    RETURN NULL;
END
$$;

-- Statement-level: ingest inserts a window a statement (or none, when it is a retry), the
-- benchmarks' loaders many.
CREATE TRIGGER flow_windows_queued AFTER INSERT ON flow_windows
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION innerwall_queue_windows();

-- `flow_windows_pending` (the windows `NOT rolled_up`) stays, empty from here on and so free to
-- keep: the previous release's job and readers find their nothing in it.
