-- The map's edges are summed as windows arrive, not when their hour is rolled up (issue 33;
-- PERF-11, PERF-8).
--
-- Until now the roll-up job summed `flow_edge_hours` beside the rollups, once an hour had closed,
-- so the console's map read the raw records of the open hour (up to an hour of the estate's
-- flows: 60,000–100,000 records at 10,000 workloads) on every draw. Now inserting a window also
-- queues it here, and `flows::sum_edges` (every minute) takes the queued windows off in the
-- transaction that adds their records to `flow_edge_hours`. The map reads the raw records of the
-- windows still queued here, about a minute of the estate's flows, and the roll-up job no longer
-- writes edges at all. A window's edges are summed exactly when it is no longer queued here,
-- whatever the roll-up job has done with it.
--
-- Expand/contract: a replica of the previous release still rolls up, and sums the edges of the
-- windows it rolls up into `flow_edge_hours`. Those windows are queued here too, and their edges
-- are summed by this release's job. So rows reach `flow_edge_hours` only from a transaction
-- that says it is that job (`innerwall.edge_writer`, set locally by `flows::sum_edges`). The
-- trigger below drops every other row, so the previous release's roll-up adds nothing there, and
-- its maps read the same complete edges as this release's. A later release drops the trigger.
--
-- The locks come first, in the order ingest (windows, then the roll-up queue) and the previous
-- release's roll-up (the queue, then edges) take them. Until this commits, ingest waits, so no
-- window is inserted between the copy below and the queue trigger's new body. A roll-up batch
-- of the previous release commits before the copy (its windows' edges stay as it summed them,
-- and its windows are not copied) or waits until after, when its edges are dropped (and its
-- windows were copied).
LOCK TABLE flow_windows, flow_pending_windows, flow_edge_hours IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE flow_edge_pending (
    workload_id  uuid NOT NULL,
    window_id    uuid NOT NULL,
    window_start timestamptz NOT NULL,
    record_count integer NOT NULL
);
-- The job's order (oldest first), the map's ranges and retention's.
CREATE INDEX flow_edge_pending_start ON flow_edge_pending (window_start);

-- The windows not rolled up yet have no edges summed (the previous release summed them with
-- their rollups).
INSERT INTO flow_edge_pending (workload_id, window_id, window_start, record_count)
SELECT workload_id, window_id, window_start, record_count FROM flow_pending_windows;

CREATE OR REPLACE FUNCTION innerwall_queue_windows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO flow_pending_windows (workload_id, window_id, window_start, record_count)
    SELECT workload_id, window_id, window_start, record_count FROM added;
    INSERT INTO flow_edge_pending (workload_id, window_id, window_start, record_count)
    SELECT workload_id, window_id, window_start, record_count FROM added;
    RETURN NULL;
END
$$;

CREATE FUNCTION innerwall_edges_from_their_queue() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('innerwall.edge_writer', true) = 'queue' THEN
        RETURN NEW;
    END IF;
    RETURN NULL;
END
$$;

-- Before each row (cloned to every partition, those made later too): a row it drops is neither
-- inserted nor, under ON CONFLICT, added to the row it would have met.
CREATE TRIGGER flow_edge_hours_from_their_queue BEFORE INSERT ON flow_edge_hours
    FOR EACH ROW EXECUTE FUNCTION innerwall_edges_from_their_queue();
