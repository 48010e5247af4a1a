-- Address trust (issue 11): an address a workload reports enters other workloads' peer sets
-- only when it lies in an estate range, within the ranges its enrolling token allowed (if the
-- token named any), and no other live workload claims it. Every reported address is kept with
-- its standing, so a refused one is shown with its reason, never dropped.

-- The estate's workload address ranges, set by operators. Seeded with the private ranges so an
-- estate on private addressing works as before; public addresses need an explicit range.
CREATE TABLE estate_ranges (
    cidr        cidr PRIMARY KEY,
    description text NOT NULL DEFAULT '' CHECK (length(description) <= 1024),
    created_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO estate_ranges (cidr, description) VALUES
    ('10.0.0.0/8', 'RFC 1918 private (default)'),
    ('172.16.0.0/12', 'RFC 1918 private (default)'),
    ('192.168.0.0/16', 'RFC 1918 private (default)'),
    ('fc00::/7', 'RFC 4193 unique local (default)');

-- Optional narrowing per provisioning token, copied to each workload it enrolls (so revoking or
-- deleting the token never widens what the workload may claim).
CREATE TABLE provisioning_token_ranges (
    token_id uuid NOT NULL REFERENCES provisioning_tokens (id) ON DELETE CASCADE,
    cidr     cidr NOT NULL,
    PRIMARY KEY (token_id, cidr)
);
CREATE TABLE workload_ranges (
    workload_id uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    cidr        cidr NOT NULL,
    PRIMARY KEY (workload_id, cidr)
);

-- Standing of a reported address, written by every render: 1 accepted, 2 outside the estate
-- ranges, 3 outside the enrolling token's ranges, 4 claimed by another live workload as well.
-- NULL: not judged yet (never rendered, never matched at ingest).
ALTER TABLE workload_addresses
    ADD COLUMN standing smallint CHECK (standing BETWEEN 1 AND 4);
CREATE INDEX workload_addresses_address ON workload_addresses (address);

-- When the workload's reported addresses last changed: inventory renders at most once per
-- interval per workload, across streams and replicas.
ALTER TABLE workloads ADD COLUMN addresses_changed_at timestamptz;
