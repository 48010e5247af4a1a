-- Rate bounds of expensive operator operations (issue 26 item 6): a token bucket per operation
-- and actor (`who`), and one per operation for everyone (`who` = ''), shared by the CLI and
-- every replica's API, so the bound holds however the operation is asked for. One row per
-- operation and actor: bounded by the operators and tokens there are.
CREATE TABLE operation_buckets (
    operation text NOT NULL,
    who       text NOT NULL,
    tokens    double precision NOT NULL,
    at        timestamptz NOT NULL,
    PRIMARY KEY (operation, who)
);
