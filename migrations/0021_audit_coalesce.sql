-- Reports an agent can repeat (tamper, identity clone) are coalesced (REL-1): one audit row per
-- workload and kind within an hour, counting what it stands for, instead of a row per report.
-- `count` is 1 for every other record; `last_at` is when a coalesced row last grew.
ALTER TABLE audit_log
    ADD COLUMN count bigint NOT NULL DEFAULT 1 CHECK (count >= 1),
    ADD COLUMN last_at timestamptz;
CREATE INDEX audit_log_coalesce ON audit_log (subject, action, at);
