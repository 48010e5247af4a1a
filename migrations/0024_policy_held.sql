-- Rendered-policy size bound (issue 26): a workload whose render is over the bound in a render
-- that may not refuse (start-up, repair, inventory, enrollment) keeps its last good version, and
-- this says why; readers show it DEGRADED with this detail (shown.rs). NULL: not held.
ALTER TABLE workloads ADD COLUMN policy_held text;
