-- Promotion records (issue 15, FLOW-8): every mode change made on a named set — who, when, why,
-- the set as it was resolved (each workload with the mode it left), the count the operator
-- expected, and for a move to enforcement the verdict it stood on with its inputs, or the
-- override and its reason. Written in the transaction that flips the modes.
CREATE TABLE promotions (
    id              uuid PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    actor           text NOT NULL,
    reason          text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 1024),
    override_reason text CHECK (char_length(override_reason) BETWEEN 1 AND 1024),
    to_mode         smallint NOT NULL CHECK (to_mode BETWEEN 1 AND 3),
    scope           text NOT NULL,
    expected_count  integer NOT NULL CHECK (expected_count >= 0),
    workloads       jsonb NOT NULL,
    verdict         jsonb
);
CREATE INDEX promotions_at ON promotions (at);
