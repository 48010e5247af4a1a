-- No lock-out (issue 31): the management access every workload's render admits whatever its
-- policy says, as the failsafe rule `failsafe:management/<protocol>`. The row without a
-- workload is the estate's (seeded by `serve --management-cidr`); a row with one is that
-- workload's narrowing of it. Services are in the service-entry text (`tcp:22`, `udp:161`).
CREATE TABLE management_access (
    workload_id uuid UNIQUE REFERENCES workloads (id) ON DELETE CASCADE,
    cidrs cidr[] NOT NULL CHECK (cardinality(cidrs) BETWEEN 1 AND 64),
    services text[] NOT NULL CHECK (cardinality(services) BETWEEN 1 AND 4),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL
);
-- At most one estate row.
CREATE UNIQUE INDEX management_access_estate ON management_access ((true)) WHERE workload_id IS NULL;
