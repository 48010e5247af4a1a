-- Suggested rules (FLOW-9, issue 28): each suggestion a run showed, by its fingerprint, so an
-- operator can accept it into a draft or ignore it by id. Shown rows nobody decided on are
-- forgotten after 7 days; accepted and ignored ones keep what they were decided on (an ignored
-- one holds its sources: it returns only when a new source appears).
CREATE TABLE suggestions (
    id          text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{12}$'),
    suggestion  jsonb NOT NULL,
    state       text NOT NULL DEFAULT 'shown' CHECK (state IN ('shown', 'accepted', 'ignored')),
    draft       text,
    decided_by  text,
    decided_at  timestamptz,
    shown_at    timestamptz NOT NULL,
    CHECK ((state = 'accepted') = (draft IS NOT NULL))
);
CREATE INDEX suggestions_decided ON suggestions (state) WHERE state <> 'shown';
CREATE INDEX suggestions_shown ON suggestions (shown_at) WHERE state = 'shown';

-- The ephemeral port range each host reported at enrollment (HostFacts.ephemeral_ports):
-- suggestions never name a port in it. NULL: not reported (Linux's default is assumed).
ALTER TABLE workloads
    ADD COLUMN ephemeral_low integer,
    ADD COLUMN ephemeral_high integer,
    ADD CONSTRAINT workloads_ephemeral_range CHECK (
        (ephemeral_low IS NULL) = (ephemeral_high IS NULL)
        AND (ephemeral_low IS NULL OR 1 <= ephemeral_low AND ephemeral_low <= ephemeral_high AND ephemeral_high <= 65535));
