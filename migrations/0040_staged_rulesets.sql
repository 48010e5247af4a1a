-- Staged rulesets (issue 31, FLOW-10). A ruleset can be staged: a new version of it (or a new
-- ruleset) that every workload it touches evaluates beside its enforced rules without acting on
-- it. The render turns each staged ruleset into per-workload staged sets (upserts and removals
-- against the rules in force), the agents decide every flow a second time by them, and
-- `promote-staged` makes a staged ruleset the ruleset once the evidence since its set was
-- acknowledged shows nothing it would block that is allowed now.
CREATE SEQUENCE staged_ruleset_stage;

CREATE TABLE staged_rulesets (
    name       text PRIMARY KEY,
    -- The ruleset as written (`RulesetSpec`), checked when staged.
    spec       jsonb NOT NULL,
    -- Every stage (and every re-stage of the same name) draws a new number: the staged sets it
    -- renders name it, so evidence under an earlier stage never counts for a later one.
    stage      bigint NOT NULL DEFAULT nextval('staged_ruleset_stage'),
    -- The ruleset's version when staged (NULL: a ruleset new to the estate); promoting is refused
    -- if the ruleset moved since.
    base_version bigint,
    staged_by  text NOT NULL,
    staged_at  timestamptz NOT NULL DEFAULT now()
);

-- A promoted staged ruleset, recorded like a workload promotion: who, when, the workloads whose
-- enforced rules it changed (count-pinned), the verdict it stood on, or the override's reason.
CREATE TABLE staged_promotions (
    id              uuid PRIMARY KEY,
    ruleset         text NOT NULL,
    stage           bigint NOT NULL,
    actor           text NOT NULL,
    at              timestamptz NOT NULL DEFAULT now(),
    expect_count    integer NOT NULL,
    workloads       jsonb NOT NULL,
    verdict         jsonb NOT NULL,
    override_reason text
);

-- The staged set a window's records were also decided by, and each record's pending decision.
ALTER TABLE flow_windows ADD COLUMN staged_set text;
ALTER TABLE flow_records
    ADD COLUMN pending_decision smallint,
    ADD COLUMN pending_rule_id  text;
-- The staged set each version carried: a window may only claim its own version's.
ALTER TABLE workload_policy_history ADD COLUMN staged_set text;
