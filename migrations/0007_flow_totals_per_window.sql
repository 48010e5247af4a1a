-- Flow totals become one row per window and (peer, service, decision), appended with COPY and
-- partitioned by day like records and gaps, so retention drops them together. The cumulative
-- per-key upsert of 0004 cost about 13 µs per key and window at ingest (half of PERF-7's
-- budget) and grew without bound; a rollup over any time range (FLOW-6) sums these rows.
DROP TABLE flow_totals;

CREATE TABLE flow_totals (
    workload_id     uuid NOT NULL,
    window_id       uuid NOT NULL,
    window_start    timestamptz NOT NULL,
    policy_version  bigint NOT NULL,
    peer_kind       smallint NOT NULL CHECK (peer_kind BETWEEN 0 AND 2),
    peer_key        text NOT NULL,
    dst_port        integer NOT NULL CHECK (dst_port BETWEEN 0 AND 65535),
    protocol        smallint NOT NULL CHECK (protocol BETWEEN 1 AND 4),
    decision        smallint NOT NULL CHECK (decision BETWEEN 1 AND 4),
    -- Within one window (one policy version) a key always matches the same rule.
    matched_rule_id text NOT NULL DEFAULT '',
    packets         bigint NOT NULL CHECK (packets >= 0),
    bytes           bigint NOT NULL CHECK (bytes >= 0),
    new_connections bigint NOT NULL CHECK (new_connections >= 0),
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL,
    -- How many flow records of the window the row sums.
    records         integer NOT NULL CHECK (records >= 1)
) PARTITION BY RANGE (window_start);
CREATE INDEX flow_totals_workload ON flow_totals (workload_id, window_start);
