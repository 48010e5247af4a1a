-- A render's rows are checked by probing the keys they name (issue 33, item 2; PERF-1, POL-7).
--
-- Migration 0043 checks each statement's new latest and history rows against the workloads and
-- the stored contents. Its queries were spelled `NOT EXISTS`, which the planner turns into an
-- anti join of its choosing, and PL/pgSQL keeps a query's first plan for the session: a
-- connection whose first render was a full one, or whose statistics of `workloads` were stale,
-- hashed every workload and every stored content for each statement. A label change at 10,000
-- workloads with every policy distinct writes 195 latest and 195 history rows: three statements
-- each hashed 10,000 workloads (1.8 ms) or 10,000 contents (2.0 ms), about 8 ms of its 30.
--
-- Below 2,000 rows each row (each distinct digest) is now looked up in its key's index by a
-- scalar subquery, which the planner never turns into a join, whatever it estimates: at most
-- about 2.6 ms (a probe costs about 1.3 us: 100,000 took 130 ms). From 2,000 rows on, a join
-- as before, which costs about as much as hashing the table probed: 1.8 ms for 10,000
-- workloads, so a full render of 10,000 (10,000 rows) is still checked by joins, not by 13 ms
-- of probes per check. What is refused, and the message, are unchanged.
CREATE OR REPLACE FUNCTION innerwall_rows_refer() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    missing text;
    many boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(7599592865562256498); -- "iw-rendr"
    -- A statement of a full render (or of a large part of one): a join costs less than a probe
    -- per row.
    many := (SELECT count(*) FROM new_rows) >= 2000;
    IF 'workload' = ANY (TG_ARGV) THEN
        IF many THEN
            SELECT n.workload_id::text INTO missing FROM new_rows n
            WHERE NOT EXISTS (SELECT 1 FROM workloads w WHERE w.id = n.workload_id);
        ELSE
            SELECT n.workload_id::text INTO missing FROM new_rows n
            WHERE (SELECT w.id FROM workloads w WHERE w.id = n.workload_id) IS NULL LIMIT 1;
        END IF;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
                MESSAGE = format('a %s row refers to workload %s, which does not exist', TG_TABLE_NAME, missing);
        END IF;
    END IF;
    IF 'digest' = ANY (TG_ARGV) THEN
        IF many THEN
            SELECT encode(n.digest, 'hex') INTO missing FROM (SELECT DISTINCT digest FROM new_rows) n
            WHERE NOT EXISTS (SELECT 1 FROM policy_contents c WHERE c.digest = n.digest) LIMIT 1;
        ELSE
            SELECT encode(n.digest, 'hex') INTO missing FROM (SELECT DISTINCT digest FROM new_rows) n
            WHERE (SELECT c.digest FROM policy_contents c WHERE c.digest = n.digest) IS NULL LIMIT 1;
        END IF;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME,
                MESSAGE = format('a %s row refers to policy content %s, which is not stored', TG_TABLE_NAME, missing);
        END IF;
    END IF;
    RETURN NULL;
END
$$;
