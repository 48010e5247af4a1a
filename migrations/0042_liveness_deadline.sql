-- The liveness sweep reads only the rows past their deadline (issue 33, item 1; SYNC-6).
--
-- Until now the sweep's condition, `last_seen_at + stream_liveness < now()`, could use no index:
-- every replica read every live stream's row once per heartbeat interval, whatever had changed.
-- An index on the deadline itself lets the sweep read only the rows whose deadline has passed.
--
-- Postgres indexes only immutable expressions, and `timestamptz + interval` is only stable: an
-- interval's days and months add differently across a time zone's offset changes. An interval of
-- microseconds alone adds the same everywhere, and a stream's liveness is always one
-- (`make_interval(secs => …)`, `sync::store`); the check below keeps it so, which is what makes
-- this function's IMMUTABLE true.
CREATE FUNCTION innerwall_silent_after(last_seen timestamptz, liveness interval) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT last_seen + liveness $$;

ALTER TABLE workloads ADD CONSTRAINT workloads_stream_liveness_in_seconds CHECK (
    stream_liveness IS NULL
    OR (date_part('year', stream_liveness) = 0 AND date_part('month', stream_liveness) = 0
        AND date_part('day', stream_liveness) = 0)
);

CREATE INDEX workloads_silent_after ON workloads (innerwall_silent_after(last_seen_at, stream_liveness))
    WHERE sync_state <> 4 AND stream_liveness IS NOT NULL;

-- The sweep's index until now, superseded: every heartbeat moves `last_seen_at`, so each index on
-- it is written once per heartbeat. The previous release's sweep reads the table without it.
DROP INDEX workloads_live_streams;
