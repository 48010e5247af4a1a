-- Commit-confirmed promotion (issue 31, FLOW-11). A promotion to enforcement may carry a confirm
-- deadline: its workloads' policies are rendered with it, the agents hold it, and unless
-- `promotions confirm` comes first, each agent enforces the policy as its simulation from the
-- deadline on, by itself, and the control plane demotes the workloads when it sees the deadline
-- pass. The promotion record keeps the deadline and how it was settled (confirmed by whom, with
-- which verdict; or reverted by the deadline); one row per workload keeps the version the
-- promotion rendered, its state, and when its agent reported having reverted on its own.
ALTER TABLE promotions
    ADD COLUMN confirm_deadline   timestamptz,
    ADD COLUMN confirm_settled_at timestamptz,
    ADD COLUMN confirm_settled_by text,
    ADD COLUMN confirm_verdict    jsonb;

CREATE TABLE promotion_confirmations (
    promotion_id      uuid NOT NULL REFERENCES promotions (id),
    workload_id       uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    -- The version the promotion rendered for the workload (set in the promotion's transaction).
    version           bigint,
    -- pending | confirmed | reverted | superseded (a later mode change of the workload came first)
    state             text NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'confirmed', 'reverted', 'superseded')),
    agent_reverted_at timestamptz,
    PRIMARY KEY (promotion_id, workload_id)
);

-- At most one pending confirmation per workload: what its policy renders with.
CREATE UNIQUE INDEX promotion_confirmations_pending ON promotion_confirmations (workload_id)
    WHERE state = 'pending';

-- Whom a confirm deadline may be given: agents that say they hold one (a capability in Hello).
ALTER TABLE workloads ADD COLUMN agent_capabilities text[] NOT NULL DEFAULT '{}';
