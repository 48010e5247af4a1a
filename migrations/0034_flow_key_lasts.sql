-- The last rolled-up hour of every impact flow key (issue 27, PERF-9).
--
-- An impact replays only the flow keys whose decision can differ between a workload's applied
-- and proposed policy (those matching a rule the two do not share, and those whose peer was
-- relabelled); every other key of the range is `unchanged`, and only counted. Counting the
-- distinct keys of a range from `flow_key_days` groups every key-day row of it (1.7 M for a week
-- at 1,000 workloads). A key has a rolled-up hour in `[from, to)` when nothing is rolled up at
-- or after `to` (a range ending now) exactly when its last rolled-up hour is at or after `from`,
-- so the count is one range of this table's index per workload.
--
-- One row per key (workload, source, peer with the digest of its labels then, port, protocol)
-- and the latest hour a rollup of it was written for. A trigger on `flow_rollups` writes it in
-- the statement that writes the rollups, whichever release's roll-up job runs it (the previous
-- release keeps rolling up while this one migrates); the job deletes the rows whose hour is older
-- than every rollup left (their partitions expired). Not partitioned: a key's row moves forward.
-- The tables this migration changes, locked first and in the order the roll-up job writes them
-- (windows, then rollups): a previous release's job running while this migrates then finishes
-- before it, or waits for it, instead of deadlocking with it (the trigger below locks the
-- rollups, the index swap the windows).
LOCK TABLE flow_windows IN ACCESS EXCLUSIVE MODE;
LOCK TABLE flow_rollups IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE flow_key_lasts (
    workload_id     uuid NOT NULL,
    src_address     inet NOT NULL,
    peer_kind       smallint NOT NULL,
    peer_key        text NOT NULL,
    peer_digest     uuid NOT NULL,
    dst_port        integer NOT NULL,
    protocol        smallint NOT NULL,
    last_hour       timestamptz NOT NULL,
    -- With the hour: whether a key of the range's raw parts is rolled up in it, from the index.
    PRIMARY KEY (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol) INCLUDE (last_hour)
);

-- The impact's count: per workload, the keys last rolled up from an hour on.
CREATE INDEX flow_key_lasts_recent ON flow_key_lasts (workload_id, last_hour);
-- The keys of workload peers among them, whole: the impact finds those relabelled since.
CREATE INDEX flow_key_lasts_peers ON flow_key_lasts (workload_id, last_hour)
    INCLUDE (src_address, peer_key, peer_digest, dst_port, protocol) WHERE peer_kind = 1;
-- The job's expiry of keys older than the oldest rollup.
CREATE INDEX flow_key_lasts_hour ON flow_key_lasts (last_hour);

-- Every statement that writes rollups moves their keys' last hours forward (a late window's older
-- hour moves none back).
CREATE FUNCTION innerwall_flow_key_lasts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO flow_key_lasts AS l (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port,
        protocol, last_hour)
    SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, max(hour)
    FROM added GROUP BY 1, 2, 3, 4, 5, 6, 7
    ON CONFLICT (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol)
    DO UPDATE SET last_hour = EXCLUDED.last_hour WHERE l.last_hour < EXCLUDED.last_hour;
    RETURN NULL;
END
$$;

CREATE TRIGGER flow_key_lasts AFTER INSERT ON flow_rollups
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION innerwall_flow_key_lasts();

INSERT INTO flow_key_lasts (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, last_hour)
SELECT workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, max(hour)
FROM flow_rollups GROUP BY 1, 2, 3, 4, 5, 6, 7;

-- The windows an impact (or a suggestion) reads for its evidence coverage, from the index alone:
-- a week of a 1,000-workload estate is 1.4 M windows, and reading their rows touched ~470 MB of
-- pages (evicting what the rest of the impact reads) where the index holds ~60 MB. It replaces
-- the index of the same key without the end (migration 0019).
CREATE INDEX flow_windows_workload_span ON flow_windows (workload_id, window_start) INCLUDE (window_end);
DROP INDEX flow_windows_workload_start;
