-- Rollback (issue 31): the authored source of each rendered version (the rulesets that selected
-- the workload with their rules, and the services and address groups those name), stored by
-- content as `policy::source::Source` renders it, so an earlier version's source can be rendered
-- again. Versions rendered before this migration have none and cannot be rolled back to.
CREATE TABLE policy_sources (
    digest bytea PRIMARY KEY,
    source jsonb NOT NULL
);
ALTER TABLE workload_policy_history ADD COLUMN source_digest bytea REFERENCES policy_sources (digest);
CREATE INDEX workload_policy_history_source ON workload_policy_history (source_digest);
-- A workload pinned by a rollback renders from this source (and not from the rulesets) until
-- unpinned; pinned_version is the version whose source it is.
ALTER TABLE workloads ADD COLUMN pinned_source bytea REFERENCES policy_sources (digest),
    ADD COLUMN pinned_version bigint;
