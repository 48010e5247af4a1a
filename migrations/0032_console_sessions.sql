-- The web console's sign-in sessions (issue 29, OPS-4). An operator signs in with an operator
-- token and gets a session cookie; only the SHA-256 of the cookie's secret is kept. A session
-- is as good as its token: every request re-reads the token's row, so revoking or expiring the
-- token ends its sessions at once, and deleting the token (retention) deletes them. `csrf` is
-- the secret every form of the session carries back.
CREATE TABLE console_sessions (
    secret_hash bytea PRIMARY KEY CHECK (length(secret_hash) = 32),
    token_id    text NOT NULL REFERENCES operator_tokens (id) ON DELETE CASCADE,
    csrf        text NOT NULL CHECK (length(csrf) = 43),
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX console_sessions_expiry ON console_sessions (expires_at);
CREATE INDEX console_sessions_token ON console_sessions (token_id);
