-- Drafts (issue 27 item 1, POL-8): a named, stored set of authored changes, each against the
-- version of its object the draft was based on (`base`, JSON: absent, a version, or the
-- workloads and modes a mode change resolved to). One change per object (`object`, e.g.
-- `ruleset/backend`): adding a change to an object the draft already changes replaces it and
-- keeps the first base. Committing applies every change in one checked transaction and marks
-- the draft committed (kept, read-only, for the record); discarding deletes it. Bounded in count
-- by `foresight::drafts::MAX_DRAFTS` and `MAX_CHANGES`.
CREATE TABLE drafts (
    id           uuid PRIMARY KEY,
    name         object_name NOT NULL UNIQUE,
    author       text NOT NULL,
    note         text NOT NULL DEFAULT '',
    version      bigint NOT NULL DEFAULT 1,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    committed_at timestamptz,
    committed_by text
);

CREATE TABLE draft_changes (
    draft_id uuid NOT NULL REFERENCES drafts (id) ON DELETE CASCADE,
    seq      integer NOT NULL,
    object   text NOT NULL,
    change   jsonb NOT NULL,
    base     jsonb NOT NULL,
    PRIMARY KEY (draft_id, seq),
    UNIQUE (draft_id, object)
);
