-- Flow evidence (FLOW-2..FLOW-5). One row per uploaded window (the idempotency key), records and
-- gaps partitioned by day so retention drops whole partitions; totals per peer and service.
-- Enums are protobuf numbers: decision 1 observed, 2 allowed, 3 would-block, 4 blocked;
-- gap kind 1 map-full, 2 agent-restart, 3 upload-buffer-overflow, 4 window-key-overflow;
-- peer_kind 0 bare address, 1 workload, 2 address group.

CREATE TABLE flow_windows (
    workload_id    uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    window_id      uuid NOT NULL,
    window_start   timestamptz NOT NULL,
    window_end     timestamptz NOT NULL,
    policy_version bigint NOT NULL CHECK (policy_version >= 0),
    mode           smallint NOT NULL CHECK (mode BETWEEN 1 AND 3),
    record_count   integer NOT NULL,
    gap_count      integer NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workload_id, window_id),
    CHECK (window_start <= window_end)
);
CREATE INDEX flow_windows_start ON flow_windows (window_start);

CREATE TABLE flow_records (
    workload_id     uuid NOT NULL,
    window_id       uuid NOT NULL,
    window_start    timestamptz NOT NULL,
    policy_version  bigint NOT NULL,
    src_address     inet NOT NULL,
    dst_address     inet NOT NULL,
    dst_port        integer NOT NULL CHECK (dst_port BETWEEN 0 AND 65535),
    protocol        smallint NOT NULL CHECK (protocol BETWEEN 1 AND 4),
    decision        smallint NOT NULL CHECK (decision BETWEEN 1 AND 4),
    matched_rule_id text NOT NULL DEFAULT '',
    packets         bigint NOT NULL CHECK (packets >= 0),
    bytes           bigint NOT NULL CHECK (bytes >= 0),
    new_connections bigint NOT NULL CHECK (new_connections >= 0),
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL,
    peer_kind       smallint NOT NULL CHECK (peer_kind BETWEEN 0 AND 2),
    peer_key        text NOT NULL,
    -- The peer's labels as they were at ingest: "which scope was this flow in then".
    peer_labels     jsonb NOT NULL DEFAULT '{}'
) PARTITION BY RANGE (window_start);
CREATE INDEX flow_records_workload ON flow_records (workload_id, window_start);

CREATE TABLE flow_gaps (
    workload_id uuid NOT NULL,
    window_id   uuid NOT NULL,
    window_start timestamptz NOT NULL,
    kind        smallint NOT NULL CHECK (kind BETWEEN 1 AND 4),
    gap_from    timestamptz NOT NULL,
    gap_to      timestamptz NOT NULL,
    count       bigint NOT NULL CHECK (count >= 0),
    CHECK (gap_from <= gap_to)
) PARTITION BY RANGE (window_start);
CREATE INDEX flow_gaps_workload ON flow_gaps (workload_id, window_start);

CREATE TABLE flow_totals (
    workload_id     uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    peer_key        text NOT NULL,
    dst_port        integer NOT NULL,
    protocol        smallint NOT NULL,
    decision        smallint NOT NULL,
    packets         bigint NOT NULL,
    bytes           bigint NOT NULL,
    new_connections bigint NOT NULL,
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL,
    windows         bigint NOT NULL,
    PRIMARY KEY (workload_id, peer_key, dst_port, protocol, decision)
);
