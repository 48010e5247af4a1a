-- The rows a render writes are checked against their workload (and content) once per statement,
-- not once per row (issue 33, item 3; PERF-1).
--
-- A first full render of 100,000 workloads stores 100,000 address standings and writes 100,000
-- latest rows and 100,000 history rows. Their foreign keys ran a lookup per row: 300,000 for
-- the policy rows (1.5 s of the render's 7 s, more than the rows themselves), and 100,000 more
-- for the standings when the addresses were reported in the same transaction (Postgres checks
-- an updated row's key again if its own transaction inserted it: 0.5 s). The same guarantees,
-- kept by the database, now cost one join per statement:
--
-- * A reported address, a latest row and a history row refer to an existing workload, and a
--   latest or history row's digest to a stored content (the history's digest was unchecked
--   since 0017; it is checked now too). A statement that writes one that does not is refused,
--   with the row named.
-- * A row's workload never changes, nor does a workload's id (the foreign keys' `NO ACTION`
--   refused the latter where a row referred to it): an update that sets either is refused, so
--   an update, such as storing a standing, checks only a digest it sets.
-- * Deleting workloads deletes their addresses, latest and history rows (what `ON DELETE
--   CASCADE` did).
-- * No reference can be deleted between the check and the commit: the check first takes the
--   render lock (`publish::lock_renders`, key "iw-rendr"), which every statement deleting
--   workloads takes too (migration 0041's trigger), and which retention holds while it deletes
--   contents (whose row trigger of 0018 refuses deleting a referenced one). Writers and deleters
--   are serialized in one lock order, where the foreign keys locked each referenced row.
--
-- The previous release writes these rows the same way; its writers take the render lock already
-- (0041's trigger on `workload_addresses`, and every render).

-- Checks a statement's new rows (`new_rows`) against what the arguments name: 'workload' (each
-- row's workload exists), 'digest' (each row's content is stored).
CREATE FUNCTION innerwall_rows_refer() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    missing text;
BEGIN
    PERFORM pg_advisory_xact_lock(7599592865562256498); -- "iw-rendr"
    -- Each query is planned only where it runs: a trigger function is compiled per table.
    IF 'workload' = ANY (TG_ARGV) THEN
        -- A probe of the workloads' key per row, or for many rows one hash join over the
        -- workloads (a render's: 100,000 probes take 130 ms, the join 40). The function keeps
        -- each query's first plan: one query per size, the second planned for all its rows.
        IF (SELECT count(*) FROM new_rows) < 20000 THEN
            SELECT n.workload_id::text INTO missing FROM new_rows n
            WHERE NOT EXISTS (SELECT 1 FROM workloads w WHERE w.id = n.workload_id) LIMIT 1;
        ELSE
            SELECT n.workload_id::text INTO missing FROM new_rows n
            WHERE NOT EXISTS (SELECT 1 FROM workloads w WHERE w.id = n.workload_id);
        END IF;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
                MESSAGE = format('a %s row refers to workload %s, which does not exist', TG_TABLE_NAME, missing);
        END IF;
    END IF;
    IF 'digest' = ANY (TG_ARGV) THEN
        SELECT encode(n.digest, 'hex') INTO missing FROM (SELECT DISTINCT digest FROM new_rows) n
        WHERE NOT EXISTS (SELECT 1 FROM policy_contents c WHERE c.digest = n.digest) LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
                MESSAGE = format('a %s row refers to policy content %s, which is not stored', TG_TABLE_NAME, missing);
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION innerwall_rows_follow_workloads() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM workload_addresses a USING gone g WHERE a.workload_id = g.id;
    DELETE FROM workload_policy_history h USING gone g WHERE h.workload_id = g.id;
    DELETE FROM workload_policies p USING gone g WHERE p.workload_id = g.id;
    RETURN NULL;
END
$$;

-- Refuses the update, saying what never changes (the argument).
CREATE FUNCTION innerwall_workload_is_fixed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
        MESSAGE = format('%s never changes', TG_ARGV[0]);
END
$$;

-- contract: the previous release reads nothing of these constraints; they only checked its
-- writes and cascaded its deletes, which the triggers below check and cascade in the same
-- statements, in this transaction.
ALTER TABLE workload_addresses DROP CONSTRAINT workload_addresses_workload_id_fkey;
-- contract: as above.
ALTER TABLE workload_policies
    DROP CONSTRAINT workload_policies_workload_id_fkey,
    DROP CONSTRAINT workload_policies_digest_fkey;
-- contract: as above.
ALTER TABLE workload_policy_history DROP CONSTRAINT workload_policy_history_workload_id_fkey;

-- One trigger per event: a trigger with transition tables has only one.
CREATE TRIGGER rows_refer AFTER INSERT ON workload_addresses
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_refer('workload');
CREATE TRIGGER rows_refer AFTER INSERT ON workload_policies
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_refer('workload', 'digest');
CREATE TRIGGER rows_refer_updated AFTER UPDATE ON workload_policies
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_refer('digest');
CREATE TRIGGER rows_refer AFTER INSERT ON workload_policy_history
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_refer('workload', 'digest');
CREATE TRIGGER rows_refer_updated AFTER UPDATE ON workload_policy_history
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_refer('digest');

CREATE TRIGGER workload_is_fixed BEFORE UPDATE OF workload_id ON workload_addresses
    FOR EACH ROW WHEN (OLD.workload_id IS DISTINCT FROM NEW.workload_id)
    EXECUTE FUNCTION innerwall_workload_is_fixed('the workload of a workload_addresses row');
CREATE TRIGGER workload_is_fixed BEFORE UPDATE OF workload_id ON workload_policies
    FOR EACH ROW WHEN (OLD.workload_id IS DISTINCT FROM NEW.workload_id)
    EXECUTE FUNCTION innerwall_workload_is_fixed('the workload of a workload_policies row');
CREATE TRIGGER workload_is_fixed BEFORE UPDATE OF workload_id ON workload_policy_history
    FOR EACH ROW WHEN (OLD.workload_id IS DISTINCT FROM NEW.workload_id)
    EXECUTE FUNCTION innerwall_workload_is_fixed('the workload of a workload_policy_history row');
CREATE TRIGGER workload_is_fixed BEFORE UPDATE OF id ON workloads
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id) EXECUTE FUNCTION innerwall_workload_is_fixed('a workload''s id');

CREATE TRIGGER rows_follow AFTER DELETE ON workloads
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION innerwall_rows_follow_workloads();
