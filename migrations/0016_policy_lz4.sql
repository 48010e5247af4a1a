-- Rendered policies are written in bulk (a first render of 10,000 workloads writes 55 MB to each
-- of the two tables below) and read whole on every render. pglz, the default TOAST compression,
-- spent most of that write (PERF-1); lz4 compresses these protobuf bytes about as well at a
-- fraction of the CPU. Rows already stored stay as they are (both methods are read transparently).
-- A server built without lz4 keeps pglz: the schema works either way.
DO $$
BEGIN
    ALTER TABLE workload_policies ALTER COLUMN policy SET COMPRESSION lz4;
    ALTER TABLE workload_policy_history ALTER COLUMN policy SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no lz4: rendered policies stay pglz-compressed';
END
$$;
