-- Rollback (issue 31): the authored source of each rendered version — the rulesets that selected
-- the workload with their rules, and the services and address groups those name — so an earlier
-- version's source can be rendered again. Stored in parts (`policy::source::Part`: one ruleset,
-- service or group, canonical JSON by SHA-256, written once however many sources name it) and a
-- source as its parts' digests concatenated in order, by the SHA-256 of that. Versions rendered
-- before this migration have none and cannot be rolled back to.
CREATE TABLE policy_source_parts (
    digest bytea PRIMARY KEY,
    part jsonb NOT NULL
);
CREATE TABLE policy_sources (
    digest bytea PRIMARY KEY,
    parts bytea NOT NULL CHECK (length(parts) % 32 = 0)
);
-- No foreign key: a publish writes thousands of history rows at once, and a check per row cost
-- it more than the rows; sources are only deleted under the render lock every publish holds
-- (retention), when no history row names them.
ALTER TABLE workload_policy_history ADD COLUMN source_digest bytea;
CREATE INDEX workload_policy_history_source ON workload_policy_history (source_digest);
-- A workload pinned by a rollback renders from this source (and not from the rulesets) until
-- unpinned; pinned_version is the version whose source it is.
ALTER TABLE workloads ADD COLUMN pinned_source bytea REFERENCES policy_sources (digest),
    ADD COLUMN pinned_version bigint;
