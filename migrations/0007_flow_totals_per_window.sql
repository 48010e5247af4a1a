-- Flow totals move onto the window row: packets, bytes and new connections summed over the
-- window's records, and its records counted per decision (so "was anything WOULD_BLOCK in this
-- range" reads windows, not records). They replace 0004's cumulative per-peer table, whose
-- upsert cost about 13 µs per key and window at ingest (half of PERF-7's budget), never
-- expired, and answered no time-ranged question; per-peer rollups over time read the records.
DROP TABLE flow_totals;

ALTER TABLE flow_windows
    ADD COLUMN packets             bigint NOT NULL DEFAULT 0 CHECK (packets >= 0),
    ADD COLUMN bytes               bigint NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    ADD COLUMN new_connections     bigint NOT NULL DEFAULT 0 CHECK (new_connections >= 0),
    ADD COLUMN observed_records    integer NOT NULL DEFAULT 0 CHECK (observed_records >= 0),
    ADD COLUMN allowed_records     integer NOT NULL DEFAULT 0 CHECK (allowed_records >= 0),
    ADD COLUMN would_block_records integer NOT NULL DEFAULT 0 CHECK (would_block_records >= 0),
    ADD COLUMN blocked_records     integer NOT NULL DEFAULT 0 CHECK (blocked_records >= 0);

-- Windows stored before this migration get their totals from their records.
UPDATE flow_windows w SET
    packets = r.packets, bytes = r.bytes, new_connections = r.new_connections,
    observed_records = r.observed, allowed_records = r.allowed,
    would_block_records = r.would_block, blocked_records = r.blocked
FROM (
    SELECT workload_id, window_id, sum(packets)::bigint AS packets, sum(bytes)::bigint AS bytes,
           sum(new_connections)::bigint AS new_connections,
           count(*) FILTER (WHERE decision = 1)::integer AS observed,
           count(*) FILTER (WHERE decision = 2)::integer AS allowed,
           count(*) FILTER (WHERE decision = 3)::integer AS would_block,
           count(*) FILTER (WHERE decision = 4)::integer AS blocked
    FROM flow_records GROUP BY workload_id, window_id
) r
WHERE w.workload_id = r.workload_id AND w.window_id = r.window_id;
