-- The flow partitions' upkeep as the schema's owner (issue 32: a least-privilege runtime role).
--
-- Creating a partition of a table or dropping one needs ownership of it, which a replica's role
-- should not have: it reads and writes rows and nothing more. These two functions run as their
-- owner (the role that migrates) and do exactly the upkeep the replicas do: create the daily
-- partition `<table>_<yyyymmdd>` of a partitioned table of this schema, and drop such a daily
-- partition. Anything else is refused. `search_path` is pinned to the schema they are created in
-- (temporary objects last), so no object a caller creates can stand in for ours. Only
-- roles granted EXECUTE may call them (`innerwall migrate --runtime-role ROLE` grants it).
CREATE FUNCTION innerwall_ensure_partition(parent text, day date) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    schema text := current_schema();
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.relname = parent AND n.nspname = schema AND c.relkind = 'p'
    ) THEN
        RAISE EXCEPTION 'not a partitioned table of schema %: %', schema, parent;
    END IF;
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L)',
        schema, parent || '_' || to_char(day, 'YYYYMMDD'), schema, parent, day, day + 1
    );
END
$$;

CREATE FUNCTION innerwall_drop_partition(partition text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    schema text := current_schema();
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        JOIN pg_class p ON p.oid = i.inhparent
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.relname = partition AND n.nspname = schema AND p.relkind = 'p'
          AND partition = p.relname || '_' || substring(partition FROM '_([0-9]{8})$')
    ) THEN
        RAISE EXCEPTION 'not a daily partition of schema %: %', schema, partition;
    END IF;
    EXECUTE format('DROP TABLE %I.%I', schema, partition);
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION innerwall_ensure_partition(text, date) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION innerwall_drop_partition(text) SET search_path = %I, pg_temp', current_schema());
END
$$;

REVOKE ALL ON FUNCTION innerwall_ensure_partition(text, date) FROM PUBLIC;
REVOKE ALL ON FUNCTION innerwall_drop_partition(text) FROM PUBLIC;
