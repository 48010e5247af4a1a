-- The flow keys an impact replays, read in key order (issue 27, PERF-9).
--
-- An impact sums every rollup row of its range towards its workloads per flow key (workload,
-- source, peer with the digest of its labels then, port, protocol). Reading the rows from the
-- heap and sorting them on that key spilled hundreds of megabytes to disk at 1,000 workloads
-- over 7 days. This index holds the key in that order and the sums an impact reads, so
-- `foresight::impact` reads it alone (an index-only scan: the rollups are written once and
-- vacuumed) and sums each key as its rows pass, with no sort and no hash table. The label sets
-- themselves are read only for the rows a report shows (by `flow_rollups_peer_service`).
CREATE INDEX flow_rollups_impact
    ON flow_rollups (workload_id, src_address, peer_kind, peer_key, peer_digest, dst_port, protocol, hour)
    INCLUDE (new_connections, records, first_seen, last_seen);
