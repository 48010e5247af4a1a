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
-- expression). A window is rolled up exactly when it is no longer queued. The queue is one table,
-- not a partition a day like the windows: a replica of the previous release creates the windows'
-- partitions of a new day and not the queue's, and its inserts would fail. Retention deletes the
-- queued windows of the days it drops (none, while the job runs: it takes the oldest first).
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
);

-- A slice of the job (`flows::hourly::PENDING_SLICE`; the modulus is `ROLLUP_SLICES`, and a test
-- checks that the job's condition reads this index).
CREATE INDEX flow_pending_windows_slice
    ON flow_pending_windows ((get_byte(uuid_send(workload_id), 15) % 2), window_start);
-- The readers' ranges, and retention's.
CREATE INDEX flow_pending_windows_start ON flow_pending_windows (window_start);

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
