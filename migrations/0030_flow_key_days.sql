-- The flow keys an impact replays, summed per UTC day (issue 27, PERF-9).
--
-- An impact sums, per flow key (workload, source, peer with the digest of its labels then,
-- port, protocol), every rollup row of its range. The hourly rollups hardly compress at a busy
-- estate (a key comes back hour after hour), so a week of them is millions of rows to read in
-- key order. `flow_key_days` holds the same sums per key and UTC day: whole days of a range are
-- read from it, the partial days at its ends from `flow_rollups`, exactly as before.
--
-- The roll-up job writes it in the statement that writes `flow_rollups` (an upsert: late windows
-- of a day add to its rows), so the two always agree, and it is partitioned by day and expired
-- with the other flow tables. Its primary key is the impact's read order and covers the sums,
-- so an impact reads the index alone.
CREATE TABLE flow_key_days (
    day             timestamptz NOT NULL,
    workload_id     uuid NOT NULL,
    src_address     inet NOT NULL,
    peer_kind       smallint NOT NULL,
    peer_key        text NOT NULL,
    peer_digest     uuid NOT NULL,
    dst_port        integer NOT NULL,
    protocol        smallint NOT NULL,
    records         bigint NOT NULL CHECK (records > 0),
    new_connections bigint NOT NULL,
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL,
    PRIMARY KEY (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, day)
        INCLUDE (new_connections, records, first_seen, last_seen)
) PARTITION BY RANGE (day);

-- A partition for every day the rollups have, filled from them.
DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT to_date(substring(c.relname FROM '_(\d{8})$'), 'YYYYMMDD')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname = 'flow_rollups' AND c.relname ~ '_\d{8}$'
    LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_key_days FOR VALUES FROM (%L) TO (%L)',
                       'flow_key_days_' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
END
$$;

INSERT INTO flow_key_days (day, workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol,
    records, new_connections, first_seen, last_seen)
SELECT date_trunc('day', hour, 'UTC'), workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port,
       protocol, sum(records), sum(new_connections), min(first_seen), max(last_seen)
FROM flow_rollups GROUP BY 1, 2, 3, 4, 5, 6, 7, 8;
