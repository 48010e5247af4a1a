-- Rollups that answer a first page without reading the whole range (issue 15, PERF-8).
--
-- A review pages groups in key order, so the first page needs only the rows of its first groups:
-- each grouping that has many groups (rule-peer, src-dst, dst-service, peer-service) gets an
-- index in its key order, and `flows::rollup` reads each source in that order and stops after a
-- page of groups. A peer's labels take part in the order through their digest (`peer_digest`,
-- the md5 of the canonical jsonb text), as a label set can be larger than a btree entry allows.
--
-- The rule grouping has a handful of groups, so any page of it reads the whole range: the
-- estate-wide reviews by rule read `flow_rule_rollups`, the rollups summed over workloads, peers
-- and addresses (a few rows per hour), written by the roll-up job in the same transaction as
-- `flow_rollups`, partitioned and expired with it.

-- The partial hours at a range's ends are read from raw records by window start: a BRIN index
-- (records arrive in about time order) costs ingest next to nothing (PERF-7), unlike a btree.
CREATE INDEX flow_records_start ON flow_records USING brin (window_start)
    WITH (pages_per_range = 16, autosummarize = on);

ALTER TABLE flow_rollups
    ADD COLUMN peer_digest uuid GENERATED ALWAYS AS (md5(peer_labels::text)::uuid) STORED;

DROP INDEX flow_rollups_workload;
CREATE INDEX flow_rollups_workload ON flow_rollups (workload_id, dst_port, protocol, hour);
CREATE INDEX flow_rollups_rule_peer ON flow_rollups (matched_rule_id, peer_kind, peer_key, peer_digest, hour);
CREATE INDEX flow_rollups_src_dst
    ON flow_rollups (src_address, peer_kind, peer_key, peer_digest, workload_id, dst_address, hour);
CREATE INDEX flow_rollups_peer_service ON flow_rollups (peer_kind, peer_key, peer_digest, dst_port, protocol, hour);

CREATE TABLE flow_rule_rollups (
    hour            timestamptz NOT NULL,
    policy_version  bigint NOT NULL,
    decision        smallint NOT NULL,
    matched_rule_id text NOT NULL,
    records         bigint NOT NULL CHECK (records > 0),
    new_connections bigint NOT NULL,
    packets         bigint NOT NULL,
    bytes           bigint NOT NULL,
    first_seen      timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL
) PARTITION BY RANGE (hour);
CREATE INDEX flow_rule_rollups_hour ON flow_rule_rollups (hour);

DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT to_date(substring(c.relname FROM '_(\d{8})$'), 'YYYYMMDD')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname = 'flow_rollups' AND c.relname ~ '_\d{8}$'
    LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_rule_rollups FOR VALUES FROM (%L) TO (%L)',
                       'flow_rule_rollups_' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
END
$$;

INSERT INTO flow_rule_rollups (hour, policy_version, decision, matched_rule_id, records, new_connections, packets,
    bytes, first_seen, last_seen)
SELECT hour, policy_version, decision, matched_rule_id, sum(records), sum(new_connections), sum(packets), sum(bytes),
       min(first_seen), max(last_seen)
FROM flow_rollups GROUP BY 1, 2, 3, 4;
