-- The generation of the render's inputs (issue 33, POL-7, PERF-1).
--
-- A render reads the whole authored model and registry. A replica keeps what it read between
-- renders (`policy::inputs`) and reuses it only when nothing it read changed since, but the
-- change being published: `generation` names the committed state of every table a render reads,
-- and every statement that writes one of them gives it a new random value, once per transaction
-- (and once more after each publish in it).
--
-- The trigger runs before the statement and first takes the render lock (`publish::lock_renders`,
-- key "iw-rendr"), so writes to the inputs are serialized with renders and with each other, in a
-- single lock order (the render lock, then rows): while a render holds the lock no other
-- transaction has an uncommitted write to its inputs, and the generation it reads names what it
-- reads. Random, not a sequence: a value a rolled-back transaction drew is never committed by
-- another, and a restored or cloned database names its state by the value it was dumped with.
--
-- Transaction-local settings tell the publish what its own transaction wrote since it began or
-- since its last publish: `innerwall.inputs_pending` ('yes'), `innerwall.inputs_base` (the
-- generation before) and `innerwall.inputs_tables` (the tables, comma-separated). The previous
-- release ignores all of it; its writes bump the generation like this release's.
CREATE TABLE render_inputs (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    generation uuid NOT NULL
);
INSERT INTO render_inputs (one, generation) VALUES (true, gen_random_uuid());

CREATE FUNCTION innerwall_render_inputs_written() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    tables text := coalesce(current_setting('innerwall.inputs_tables', true), '');
BEGIN
    IF coalesce(current_setting('innerwall.inputs_pending', true), '') <> 'yes' THEN
        PERFORM pg_advisory_xact_lock(7599592865562256498); -- "iw-rendr"
        PERFORM set_config('innerwall.inputs_base', (SELECT generation::text FROM render_inputs), true);
        UPDATE render_inputs SET generation = gen_random_uuid();
        PERFORM set_config('innerwall.inputs_pending', 'yes', true);
        tables := '';
    END IF;
    IF NOT TG_TABLE_NAME = ANY (string_to_array(tables, ',')) THEN
        PERFORM set_config('innerwall.inputs_tables',
                           CASE tables WHEN '' THEN TG_TABLE_NAME ELSE tables || ',' || TG_TABLE_NAME END, true);
    END IF;
    RETURN NULL;
END
$$;

-- Every table `store::load_model` and `store::load_registry` read; of `workloads` and
-- `promotions`, the columns they read (heartbeats and state writes touch others).
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON services
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON service_entries
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON address_groups
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON address_group_cidrs
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON rulesets
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON rules
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON rule_peers
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON rule_services
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON staged_rulesets
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON management_access
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON workload_labels
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON workload_addresses
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON workload_ranges
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON estate_ranges
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON promotion_confirmations
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR DELETE OR TRUNCATE ON workloads
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs_columns BEFORE UPDATE OF id, mode, retired_at, denied_at, pinned_source ON workloads
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs BEFORE INSERT OR DELETE OR TRUNCATE ON promotions
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
CREATE TRIGGER render_inputs_columns BEFORE UPDATE OF id, confirm_deadline ON promotions
    FOR EACH STATEMENT EXECUTE FUNCTION innerwall_render_inputs_written();
