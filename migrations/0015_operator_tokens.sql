-- Operator tokens (issue 12, OPS-2): bearer credentials of the operator HTTP API, minted on a
-- control-plane host (`innerwall operator token mint`). A token is `iwo_` + its id (8 characters,
-- not secret, the lookup key) + 43 characters of 256 random bits; only the SHA-256 of the whole
-- text is kept (a fast hash is enough for a secret of that entropy: there is nothing to guess).
-- The role says what the token may do: viewer < editor < promoter < admin.
CREATE TABLE operator_tokens (
    id           text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9_-]{8}$'),
    name         text NOT NULL CHECK (name ~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$'),
    role         text NOT NULL CHECK (role IN ('viewer', 'editor', 'promoter', 'admin')),
    token_hash   bytea NOT NULL CHECK (length(token_hash) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    created_by   text NOT NULL,
    expires_at   timestamptz,
    revoked_at   timestamptz,
    last_used_at timestamptz
);
-- A name names one live token, so `revoke NAME` and audit records are unambiguous; a revoked
-- token's name may be minted again.
CREATE UNIQUE INDEX operator_tokens_live_name ON operator_tokens (name) WHERE revoked_at IS NULL;
