-- Rendered policy rows are checked against their workload and content once per statement, not
-- once per row (issue 33, item 3; PERF-1).
--
-- A first full render of 100,000 workloads writes 100,000 latest rows and 100,000 history rows.
-- Their foreign keys ran 300,000 row checks, each its own lookup and row lock: 1.5 s of the
-- render's 7 s, more than the rows themselves. The same guarantees, kept by the database, now
-- cost one join per statement:
--
-- * A latest or history row refers to an existing workload, and its digest to a stored content
--   (the history's digest was unchecked since 0017; it is checked now too). A statement that
--   writes one that does not is refused, with the row named.
-- * Deleting workloads deletes their latest and history rows (what `ON DELETE CASCADE` did), and
--   a workload's id never changes (what the foreign keys' `NO ACTION` on update refused where a
--   row referred to it).
-- * No reference can be deleted between the check and the commit: the check first takes the
--   render lock (`publish::lock_renders`, key "iw-rendr"), which every statement deleting
--   workloads takes too (migration 0041's trigger), and which retention holds while it deletes
--   contents (whose row trigger of 0018 refuses deleting a referenced one). Writers and deleters
--   are serialized in one lock order, where the foreign keys locked each referenced row.
--
-- The previous release writes rows the same way; its renders hold the render lock already.

CREATE FUNCTION innerwall_policy_rows_refer() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    missing text;
BEGIN
    PERFORM pg_advisory_xact_lock(7599592865562256498); -- "iw-rendr"
    SELECT n.workload_id::text INTO missing FROM new_rows n
    WHERE NOT EXISTS (SELECT 1 FROM workloads w WHERE w.id = n.workload_id) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
            MESSAGE = format('a %s row refers to workload %s, which does not exist', TG_TABLE_NAME, missing);
    END IF;
    SELECT encode(n.digest, 'hex') INTO missing FROM (SELECT DISTINCT digest FROM new_rows) n
    WHERE NOT EXISTS (SELECT 1 FROM policy_contents c WHERE c.digest = n.digest) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
            MESSAGE = format('a %s row refers to policy content %s, which is not stored', TG_TABLE_NAME, missing);
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION innerwall_policy_rows_follow_workloads() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM workload_policy_history h USING gone g WHERE h.workload_id = g.id;
    DELETE FROM workload_policies p USING gone g WHERE p.workload_id = g.id;
    RETURN NULL;
END
$$;

CREATE FUNCTION innerwall_workload_id_is_fixed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
        MESSAGE = format('workload %s cannot change its id', OLD.id);
END
$$;

ALTER TABLE workload_policies
    DROP CONSTRAINT workload_policies_workload_id_fkey,
    DROP CONSTRAINT workload_policies_digest_fkey;
ALTER TABLE workload_policy_history DROP CONSTRAINT workload_policy_history_workload_id_fkey;

-- One trigger per event: a trigger with transition tables has only one.
CREATE TRIGGER policy_rows_refer_inserted AFTER INSERT ON workload_policies
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_policy_rows_refer();
CREATE TRIGGER policy_rows_refer_updated AFTER UPDATE ON workload_policies
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_policy_rows_refer();
CREATE TRIGGER policy_rows_refer_inserted AFTER INSERT ON workload_policy_history
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_policy_rows_refer();
CREATE TRIGGER policy_rows_refer_updated AFTER UPDATE ON workload_policy_history
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_policy_rows_refer();

CREATE TRIGGER policy_rows_follow AFTER DELETE ON workloads
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION innerwall_policy_rows_follow_workloads();
CREATE TRIGGER id_is_fixed BEFORE UPDATE OF id ON workloads
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id) EXECUTE FUNCTION innerwall_workload_id_is_fixed();
