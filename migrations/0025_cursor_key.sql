-- The key that authenticates list cursors (issue 26 item 5, REL-1): a cursor handed out by one
-- replica is a keyed MAC over the list it belongs to and the key it carries, so any replica
-- behind the balancer can check it and a forged, tampered or other list's cursor is refused.
-- One row, created once here from the server's random source (two v4 UUIDs, 244 random bits,
-- hashed to 32 bytes); every replica reads it, none writes it.
CREATE TABLE cursor_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    key      bytea   NOT NULL CHECK (octet_length(key) = 32)
);

INSERT INTO cursor_key (key)
SELECT sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8'));
