-- Auto-demotion guard (issue 31): for a workload's first minutes of enforcement, blocked flows
-- from a (source, protocol, port) its promotion's evidence range showed allowed demote it to
-- simulation. One row per workload, written by the promotion that enforced it (replaced by the
-- next), deleted when it leaves enforcement otherwise; a tripped row keeps the flows that
-- tripped it and the demotion's promotion record.
CREATE TABLE enforcement_guards (
    workload_id   uuid PRIMARY KEY REFERENCES workloads (id) ON DELETE CASCADE,
    promotion_id  uuid NOT NULL REFERENCES promotions (id),
    since         timestamptz NOT NULL,
    until         timestamptz NOT NULL,
    evidence_from timestamptz NOT NULL,
    evidence_to   timestamptz NOT NULL,
    threshold     integer NOT NULL CHECK (threshold >= 1),
    unseen        boolean NOT NULL DEFAULT false,
    tripped_at    timestamptz,
    demotion_id   uuid REFERENCES promotions (id),
    evidence      jsonb
);
