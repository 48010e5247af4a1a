-- Identity lifecycle (issue 25, IDN-7, IDN-8): which CA issued each workload's current
-- certificate (so an old CA is retired only once nobody holds its certificates), the last
-- renewal failure, and who presents each identity (boot id and certificate key) for clone
-- detection.
ALTER TABLE workloads
    -- SHA-256 of the issuing CA certificate (DER), lower-case hex; NULL: issued before this
    -- migration, so by an unknown CA.
    ADD COLUMN credential_issuer        text,
    ADD COLUMN last_renewal_failed_at   timestamptz,
    ADD COLUMN last_renewal_error       text,
    -- The current clone episode: when it began (audited then) and when a clone was last seen.
    ADD COLUMN clone_started_at         timestamptz,
    ADD COLUMN clone_seen_at            timestamptz;

-- One row per (boot, certificate key) that opened a stream of the workload; at most a few per
-- workload are kept (the oldest are pruned), so a hostile agent inventing boot ids cannot grow it.
CREATE TABLE workload_presenters (
    workload_id   uuid        NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    boot_id       text        NOT NULL,
    key_sha256    text        NOT NULL,
    machine_id    text        NOT NULL DEFAULT '',
    hostname      text        NOT NULL DEFAULT '',
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workload_id, boot_id, key_sha256)
);
