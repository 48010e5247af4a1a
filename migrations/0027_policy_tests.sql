-- Policy tests (issue 27 item 3, POL-10): named sets of assertions beside the rulesets, each
-- stored as its checked file (`spec`, JSON), versioned like rulesets (every update and delete
-- names the version it read). Every operator commit evaluates all of them on the rendered
-- estate in its own transaction. Bounded in count by `foresight::policy_tests::MAX_TEST_SETS`.
CREATE TABLE policy_test_sets (
    id          uuid PRIMARY KEY,
    name        object_name NOT NULL UNIQUE,
    description text NOT NULL DEFAULT '',
    spec        jsonb NOT NULL,
    version     bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
