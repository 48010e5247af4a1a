-- States judged when read, and retention of the control plane's own tables (issue 25).

-- When a liveness sweep last ran, on any replica (REL-3): a reader that shows a workload OFFLINE
-- because its last heartbeat is older than its stream's liveness says how long no replica has
-- swept (with none running, the stored row still says what the dead replica last wrote). One row.
CREATE TABLE liveness_sweeps (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    swept_at timestamptz NOT NULL
);

-- Retention deletes policy contents no row refers to. Contents stay immutable and a referenced
-- content still cannot be deleted: the statement-level refusal of 0017 now covers UPDATE and
-- TRUNCATE, and a row-level check refuses deleting a content that a latest or history row
-- refers to. The check runs after the row is locked, with a fresh snapshot, so it sees a render
-- that committed meanwhile (retention also holds the render lock while it deletes).
DROP TRIGGER policy_contents_are_kept ON policy_contents;
CREATE TRIGGER policy_contents_are_kept BEFORE UPDATE OR TRUNCATE ON policy_contents
    FOR EACH STATEMENT EXECUTE FUNCTION policy_contents_are_kept();

CREATE FUNCTION policy_contents_delete_orphans_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM workload_policies WHERE digest = OLD.digest)
       OR EXISTS (SELECT 1 FROM workload_policy_history WHERE digest = OLD.digest) THEN
        RAISE EXCEPTION 'policy content % is referred to by a rendered policy: referenced contents are never changed or deleted',
            encode(OLD.digest, 'hex');
    END IF;
    RETURN OLD;
END
$$;
CREATE TRIGGER policy_contents_delete_orphans_only BEFORE DELETE ON policy_contents
    FOR EACH ROW EXECUTE FUNCTION policy_contents_delete_orphans_only();

-- What the check above and the orphan search look up by.
CREATE INDEX workload_policies_digest ON workload_policies (digest);
CREATE INDEX workload_policy_history_digest ON workload_policy_history (digest);

-- Retention finds old closed label sets, expired tokens and long-retired workloads by time.
CREATE INDEX workload_label_history_closed ON workload_label_history (valid_to) WHERE valid_to IS NOT NULL;
CREATE INDEX workloads_retired ON workloads (retired_at) WHERE retired_at IS NOT NULL;
