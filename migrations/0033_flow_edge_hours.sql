-- The map's pre-aggregate (issue 29, PERF-11).
--
-- The console's map sums a range's flows per (destination group, peer group, decision). Read
-- from `flow_rollups` that is every source–destination row of the range (8 M for a day of
-- 10 M records at 10,000 workloads), tens of seconds. The roll-up job now also sums each hour
-- per destination label set (the workload's labels when its flows were rolled up, within the
-- hour they were recorded), peer group (kind 1: the digest of the peer's labels then; kind 2:
-- the address group's name; kind 0: every other address, '') and decision: about a hundred times
-- fewer rows, read in whole hours and grouped by a label key at query time. Label sets are
-- stored once, by digest (md5 of their jsonb text), so the rows and their grouping carry only
-- digests.
CREATE TABLE flow_label_sets (
    digest uuid PRIMARY KEY,
    labels jsonb NOT NULL
);

CREATE TABLE flow_edge_hours (
    hour            timestamptz NOT NULL,
    dst_digest      uuid NOT NULL,
    peer_kind       smallint NOT NULL,
    peer_group      text NOT NULL,
    decision        smallint NOT NULL,
    records         bigint NOT NULL CHECK (records > 0),
    new_connections bigint NOT NULL,
    PRIMARY KEY (hour, dst_digest, peer_kind, peer_group, decision)
) PARTITION BY RANGE (hour);

-- A partition for every day the rollups have, filled from them (destinations by their labels now).
DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT to_date(substring(c.relname FROM '_(\d{8})$'), 'YYYYMMDD')
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname = 'flow_rollups' AND c.relname ~ '_\d{8}$'
    LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %I PARTITION OF flow_edge_hours FOR VALUES FROM (%L) TO (%L)',
                       'flow_edge_hours_' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
END
$$;

CREATE TEMPORARY TABLE destinations AS
SELECT w.id AS workload_id, COALESCE(jsonb_object_agg(l.key, l.value) FILTER (WHERE l.key IS NOT NULL), '{}'::jsonb) AS labels
FROM workloads w LEFT JOIN workload_labels l ON l.workload_id = w.id GROUP BY w.id;

INSERT INTO flow_label_sets (digest, labels)
SELECT DISTINCT md5(labels::text)::uuid, labels FROM destinations
UNION
SELECT DISTINCT peer_digest, peer_labels FROM flow_rollups WHERE peer_kind = 1
ON CONFLICT DO NOTHING;

INSERT INTO flow_edge_hours (hour, dst_digest, peer_kind, peer_group, decision, records, new_connections)
SELECT r.hour, md5(COALESCE(d.labels, '{}'::jsonb)::text)::uuid, r.peer_kind,
       CASE r.peer_kind WHEN 1 THEN r.peer_digest::text WHEN 2 THEN r.peer_key ELSE '' END,
       r.decision, sum(r.records), sum(r.new_connections)
FROM flow_rollups r LEFT JOIN destinations d ON d.workload_id = r.workload_id
GROUP BY 1, 2, 3, 4, 5;

INSERT INTO flow_label_sets (digest, labels) VALUES (md5('{}'::jsonb::text)::uuid, '{}'::jsonb) ON CONFLICT DO NOTHING;

DROP TABLE destinations;
