-- Rendered policies stored by content (PERF-1, POL-5). Workloads that the same rulesets select,
-- in the same mode, have the same policy: an estate of 10,000 workloads in 500 apps has ~500
-- distinct policies, yet its first render wrote 55 MB of them twice (latest and history). A
-- policy's content — its canonical bytes without the version, which is the row's — is now stored
-- once under its SHA-256, and the latest and history rows refer to it.

CREATE TABLE policy_contents (
    digest bytea PRIMARY KEY CHECK (digest = sha256(policy)),
    policy bytea NOT NULL
);

DO $$
BEGIN
    ALTER TABLE policy_contents ALTER COLUMN policy SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no lz4: policy contents stay pglz-compressed';
END
$$;

-- Rows rendered before this keep their bytes as their content, the version inside them (readers
-- take the row's version, which is the same). Such a row is compared by decoding it until its
-- workload's policy next changes.
INSERT INTO policy_contents (digest, policy)
SELECT sha256(policy), policy FROM workload_policy_history
UNION
SELECT sha256(policy), policy FROM workload_policies;

ALTER TABLE workload_policies ADD COLUMN digest bytea REFERENCES policy_contents (digest);
UPDATE workload_policies SET digest = sha256(policy);
ALTER TABLE workload_policies ALTER COLUMN digest SET NOT NULL, DROP COLUMN policy;

-- History rows are copied on the server from the latest rows, whose foreign key has checked the
-- digest, and contents are never deleted (below): checking each copy again cost a first render of
-- 10,000 distinct policies ~40 ms.
ALTER TABLE workload_policy_history ADD COLUMN digest bytea;
UPDATE workload_policy_history SET digest = sha256(policy);
ALTER TABLE workload_policy_history ALTER COLUMN digest SET NOT NULL, DROP COLUMN policy;

-- A content, once stored, stays what it is for as long as anything may refer to it.
CREATE FUNCTION policy_contents_are_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'policy contents are never changed or deleted: history refers to them';
END
$$;
CREATE TRIGGER policy_contents_are_kept BEFORE UPDATE OR DELETE OR TRUNCATE ON policy_contents
    FOR EACH STATEMENT EXECUTE FUNCTION policy_contents_are_kept();
