-- Reading the audit log back (issue 25, POL-8, OPS-2): `audit list --actor/--action/--object`
-- walks the records newest first by id; each filter has an index in that order, so a page of
-- one actor's records does not scan everyone else's.
CREATE INDEX audit_log_actor ON audit_log (actor, id);
CREATE INDEX audit_log_action ON audit_log (action, id);
CREATE INDEX audit_log_subject ON audit_log (subject, id);
