-- Credential bookkeeping for enrollment and renewal (issue 4), and the host facts an operator
-- needs to recognize a workload. The certificate itself is never stored.
ALTER TABLE workloads
    ADD COLUMN credential_serial     text NOT NULL DEFAULT '',
    ADD COLUMN credential_expires_at timestamptz,
    ADD COLUMN last_renewed_at       timestamptz,
    ADD COLUMN machine_id            text NOT NULL DEFAULT '',
    ADD COLUMN os                    text NOT NULL DEFAULT '',
    ADD COLUMN agent_version         text NOT NULL DEFAULT '';
