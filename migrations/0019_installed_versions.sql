-- Evidence only from who holds an address now and for versions that were real (issue 25,
-- FLOW-5, FLOW-7).

-- An address is accepted for at most one workload, and only for a live one. Retiring or
-- deny-listing a workload clears its standings (it is not judged any more: `authoring::retire`,
-- `authoring::deny`), and address trust never accepts an address two live workloads claim; this
-- constraint makes a second accepted claim impossible whatever the code does. Deferred: a render
-- moves an address from one workload to another in one statement, in either row order.
UPDATE workload_addresses a SET standing = NULL
FROM workloads w
WHERE w.id = a.workload_id AND (w.retired_at IS NOT NULL OR w.denied_at IS NOT NULL);
UPDATE workload_addresses SET standing = 4
WHERE standing = 1
  AND address IN (SELECT address FROM workload_addresses WHERE standing = 1 GROUP BY address HAVING count(*) > 1);
ALTER TABLE workload_addresses ADD CONSTRAINT workload_addresses_accepted_once
    EXCLUDE USING btree (address WITH =) WHERE (standing = 1) DEFERRABLE INITIALLY DEFERRED;

-- Which versions each workload's agent installed, and when (server clock): written when the
-- agent acknowledges a version APPLIED or HELD, and when a Hello reports a version applied whose
-- acknowledgement was lost with its connection. A window is accepted only under a version
-- installed here, in that version's mode, within [installed_from, the next version's
-- installed_by] widened by the clock skew ingest allows.
--   installed_from: no later than the true install (an ack: the time it arrived; a Hello's
--     report: when the version was rendered, since the install itself may lie before a partition).
--   installed_by: no earlier than the true install (the ack's or the Hello's arrival).
-- A second report of the same version keeps the earliest of each.
CREATE TABLE workload_installs (
    workload_id    uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    version        bigint NOT NULL CHECK (version >= 1),
    mode           smallint NOT NULL CHECK (mode BETWEEN 1 AND 3),
    installed_from timestamptz NOT NULL,
    installed_by   timestamptz NOT NULL,
    PRIMARY KEY (workload_id, version),
    CHECK (installed_from <= installed_by)
);

-- What agents run today was installed at the latest when it was last acknowledged: a window
-- captured under it and uploaded after the upgrade is accepted. The mode is the workload's now,
-- the best this migration knows (the content holds the version's own, which SQL cannot read).
INSERT INTO workload_installs (workload_id, version, mode, installed_from, installed_by)
SELECT w.id, w.applied_version, w.mode, h.rendered_at, GREATEST(h.rendered_at, COALESCE(w.last_acked_at, now()))
FROM workloads w JOIN workload_policy_history h ON h.workload_id = w.id AND h.version = w.applied_version
WHERE w.applied_version >= 1 AND w.retired_at IS NULL AND w.denied_at IS NULL;

-- One workload's windows may not overlap: ingest looks for one that does by (workload, start).
CREATE INDEX flow_windows_workload_start ON flow_windows (workload_id, window_start);
