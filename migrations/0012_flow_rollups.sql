-- Flow review rollups (issue 15 item 1, FLOW-6, PERF-8).
--
-- Raw records stay the source of truth. `flow_rollups` holds them pre-aggregated per hour (of
-- the window's start, UTC) and per key, one batch of closed-hour windows at a time, written by
-- `flows::roll_up` off the ingest path (PERF-7: ingest writes nothing more than before). Each
-- window says whether its records are in the rollups (`rolled_up`), set in the transaction that
-- adds them, so a review adds the rollups of whole hours to the raw records of windows not yet
-- rolled up and of the partial hours at the ends of its range, and is exact at every moment.
--
-- `flow_windows` is partitioned by day like the records, created on demand and dropped whole by
-- retention. Its key includes the partition key; a window is still stored once per (workload,
-- window id): ingest also refuses an id the workload already used on another day.
--
-- Records and gaps get their position in the window (`ordinal`), so a listing pages by a unique
-- key; rows stored before this migration have 0 and page by their flow key after it.

ALTER TABLE flow_windows RENAME TO flow_windows_unpartitioned;
ALTER INDEX flow_windows_pkey RENAME TO flow_windows_unpartitioned_pkey;
ALTER INDEX flow_windows_start RENAME TO flow_windows_unpartitioned_start;

CREATE TABLE flow_windows (
    workload_id         uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    window_id           uuid NOT NULL,
    window_start        timestamptz NOT NULL,
    window_end          timestamptz NOT NULL,
    policy_version      bigint NOT NULL CHECK (policy_version >= 0),
    mode                smallint NOT NULL CHECK (mode BETWEEN 1 AND 3),
    record_count        integer NOT NULL,
    gap_count           integer NOT NULL,
    received_at         timestamptz NOT NULL DEFAULT now(),
    packets             bigint NOT NULL DEFAULT 0 CHECK (packets >= 0),
    bytes               bigint NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    new_connections     bigint NOT NULL DEFAULT 0 CHECK (new_connections >= 0),
    observed_records    integer NOT NULL DEFAULT 0 CHECK (observed_records >= 0),
    allowed_records     integer NOT NULL DEFAULT 0 CHECK (allowed_records >= 0),
    would_block_records integer NOT NULL DEFAULT 0 CHECK (would_block_records >= 0),
    blocked_records     integer NOT NULL DEFAULT 0 CHECK (blocked_records >= 0),
    -- Its records are in flow_rollups.
    rolled_up           boolean NOT NULL DEFAULT false,
    PRIMARY KEY (workload_id, window_id, window_start),
    CHECK (window_start <= window_end)
) PARTITION BY RANGE (window_start);
CREATE INDEX flow_windows_start ON flow_windows (window_start);
-- What the roll-up job and reviews look for: few rows (the open hour, late windows).
CREATE INDEX flow_windows_pending ON flow_windows (window_start) WHERE NOT rolled_up;

CREATE TABLE flow_rollups (
    hour            timestamptz NOT NULL,
    workload_id     uuid NOT NULL,
    policy_version  bigint NOT NULL,
    decision        smallint NOT NULL,
    matched_rule_id text NOT NULL,
    peer_kind       smallint NOT NULL,
    peer_key        text NOT NULL,
    peer_labels     jsonb NOT NULL,
    src_address     inet NOT NULL,
    dst_address     inet NOT NULL,
    dst_port        integer NOT NULL,
    protocol        smallint NOT NULL,
    -- Raw records summed into this row.
    records         bigint NOT NULL CHECK (records > 0),
    new_connections bigint NOT NULL,
    packets         bigint NOT NULL,
    bytes           bigint NOT NULL,
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL
) PARTITION BY RANGE (hour);
CREATE INDEX flow_rollups_workload ON flow_rollups (workload_id, hour);
CREATE INDEX flow_rollups_hour ON flow_rollups (hour);

-- A partition of the new tables for every day that has records or windows.
DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT to_date(substring(c.relname FROM '_(\d{8})$'), 'YYYYMMDD')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname = 'flow_records' AND c.relname ~ '_\d{8}$'
        UNION
        SELECT (window_start AT TIME ZONE 'UTC')::date FROM flow_windows_unpartitioned
    LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_windows FOR VALUES FROM (%L) TO (%L)',
                       'flow_windows_' || to_char(day, 'YYYYMMDD'), day, day + 1);
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_rollups FOR VALUES FROM (%L) TO (%L)',
                       'flow_rollups_' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
END
$$;

INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode, record_count,
    gap_count, received_at, packets, bytes, new_connections, observed_records, allowed_records,
    would_block_records, blocked_records)
SELECT workload_id, window_id, window_start, window_end, policy_version, mode, record_count, gap_count,
    received_at, packets, bytes, new_connections, observed_records, allowed_records, would_block_records,
    blocked_records
FROM flow_windows_unpartitioned;
DROP TABLE flow_windows_unpartitioned;

ALTER TABLE flow_records ADD COLUMN ordinal integer NOT NULL DEFAULT 0 CHECK (ordinal >= 0);
ALTER TABLE flow_gaps ADD COLUMN ordinal integer NOT NULL DEFAULT 0 CHECK (ordinal >= 0);
