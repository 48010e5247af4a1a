-- Registry, authored policy, rendered policy with history, sync status, audit (issue 3).
-- Enums are stored as their protobuf numbers (innerwall.agent.v1):
--   mode: 1 visibility, 2 simulation, 3 enforcement
--   protocol: 1 tcp, 2 udp, 3 icmp, 4 icmpv6
--   sync_state: 1 pending, 2 synced, 3 degraded, 4 offline

CREATE DOMAIN label_key AS text
    CHECK (VALUE ~ '^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$');
CREATE DOMAIN label_value AS text
    CHECK (VALUE ~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$');
CREATE DOMAIN object_name AS text
    CHECK (VALUE ~ '^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$');
-- A label selector: [{"key": k, "values": [v, …]}, …], ANDed; validated by the application.
CREATE DOMAIN label_selector AS jsonb
    CHECK (jsonb_typeof(VALUE) = 'array');

CREATE TABLE provisioning_tokens (
    id           uuid PRIMARY KEY,
    token_hash   bytea NOT NULL UNIQUE,
    prefix_hint  text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    max_uses     integer CHECK (max_uses IS NULL OR max_uses > 0),
    use_count    integer NOT NULL DEFAULT 0 CHECK (use_count >= 0),
    revoked_at   timestamptz
);

CREATE TABLE provisioning_token_labels (
    token_id uuid NOT NULL REFERENCES provisioning_tokens (id) ON DELETE CASCADE,
    key      label_key NOT NULL,
    value    label_value NOT NULL,
    PRIMARY KEY (token_id, key)
);

CREATE TABLE workloads (
    id                    uuid PRIMARY KEY,
    hostname              text NOT NULL DEFAULT '',
    enrolled_by_token     uuid REFERENCES provisioning_tokens (id) ON DELETE SET NULL,
    mode                  smallint NOT NULL DEFAULT 1 CHECK (mode BETWEEN 1 AND 3),
    -- Advances on every label edit; edits are conditional on the version read (IDN-6).
    label_version         bigint NOT NULL DEFAULT 1 CHECK (label_version >= 1),
    created_at            timestamptz NOT NULL DEFAULT now(),
    retired_at            timestamptz,
    denied_at             timestamptz,
    -- Convergence state (SYNC-6); the latest version is workload_policies.version.
    applied_version       bigint NOT NULL DEFAULT 0 CHECK (applied_version >= 0),
    sync_state            smallint NOT NULL DEFAULT 4 CHECK (sync_state BETWEEN 1 AND 4),
    sync_detail           text NOT NULL DEFAULT '',
    last_seen_at          timestamptz,
    last_acked_at         timestamptz,
    last_snapshot_sent_at timestamptz,
    last_apply_failed_at  timestamptz
);

CREATE TABLE workload_labels (
    workload_id uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    key         label_key NOT NULL,
    value       label_value NOT NULL,
    PRIMARY KEY (workload_id, key)
);
CREATE INDEX workload_labels_key_value ON workload_labels (key, value);

CREATE TABLE workload_addresses (
    workload_id uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    address     inet NOT NULL CHECK (masklen(address) = CASE family(address) WHEN 4 THEN 32 ELSE 128 END),
    PRIMARY KEY (workload_id, address)
);

CREATE TABLE workload_listening_services (
    workload_id  uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    protocol     smallint NOT NULL CHECK (protocol BETWEEN 1 AND 4),
    port         integer NOT NULL CHECK (port BETWEEN 0 AND 65535),
    address      text NOT NULL DEFAULT '',
    process_name text NOT NULL DEFAULT '',
    PRIMARY KEY (workload_id, protocol, port, address)
);

-- Authored model (POL-1). Every object carries a version for conditional writes (POL-8).

CREATE TABLE services (
    id          uuid PRIMARY KEY,
    name        object_name NOT NULL UNIQUE,
    description text NOT NULL DEFAULT '',
    version     bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE service_entries (
    service_id uuid NOT NULL REFERENCES services (id) ON DELETE CASCADE,
    ordinal    integer NOT NULL,
    protocol   smallint NOT NULL CHECK (protocol BETWEEN 1 AND 4),
    port_start integer,
    port_end   integer,
    PRIMARY KEY (service_id, ordinal),
    CONSTRAINT service_entry_ports CHECK (
        (protocol IN (1, 2) AND port_start BETWEEN 1 AND 65535 AND port_end BETWEEN port_start AND 65535)
        OR (protocol IN (3, 4) AND port_start IS NULL AND port_end IS NULL))
);

CREATE TABLE address_groups (
    id          uuid PRIMARY KEY,
    name        object_name NOT NULL UNIQUE,
    description text NOT NULL DEFAULT '',
    version     bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE address_group_cidrs (
    group_id uuid NOT NULL REFERENCES address_groups (id) ON DELETE CASCADE,
    cidr     cidr NOT NULL,
    PRIMARY KEY (group_id, cidr)
);

CREATE TABLE rulesets (
    id          uuid PRIMARY KEY,
    name        object_name NOT NULL UNIQUE,
    description text NOT NULL DEFAULT '',
    enabled     boolean NOT NULL DEFAULT true,
    scope       label_selector NOT NULL,
    version     bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE rules (
    -- Kept across ruleset edits by (ruleset, name): the prefix of resolved rule ids.
    id          uuid PRIMARY KEY,
    ruleset_id  uuid NOT NULL REFERENCES rulesets (id) ON DELETE CASCADE,
    ordinal     integer NOT NULL,
    name        object_name NOT NULL,
    description text NOT NULL DEFAULT '',
    enabled     boolean NOT NULL DEFAULT true,
    UNIQUE (ruleset_id, ordinal),
    UNIQUE (ruleset_id, name)
);

CREATE TABLE rule_peers (
    rule_id          uuid NOT NULL REFERENCES rules (id) ON DELETE CASCADE,
    ordinal          integer NOT NULL,
    selector         label_selector,
    address_group_id uuid REFERENCES address_groups (id) ON DELETE RESTRICT,
    cidr             cidr,
    PRIMARY KEY (rule_id, ordinal),
    CONSTRAINT rule_peer_exactly_one CHECK (num_nonnulls(selector, address_group_id, cidr) = 1)
);
CREATE INDEX rule_peers_address_group ON rule_peers (address_group_id) WHERE address_group_id IS NOT NULL;

CREATE TABLE rule_services (
    rule_id    uuid NOT NULL REFERENCES rules (id) ON DELETE CASCADE,
    service_id uuid NOT NULL REFERENCES services (id) ON DELETE RESTRICT,
    PRIMARY KEY (rule_id, service_id)
);
CREATE INDEX rule_services_service ON rule_services (service_id);

-- Rendered policy (POL-5): the latest per workload, and every version ever persisted.

CREATE TABLE workload_policies (
    workload_id uuid PRIMARY KEY REFERENCES workloads (id) ON DELETE CASCADE,
    version     bigint NOT NULL CHECK (version >= 1),
    policy      bytea NOT NULL,
    rendered_at timestamptz NOT NULL
);

CREATE TABLE workload_policy_history (
    workload_id uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    version     bigint NOT NULL CHECK (version >= 1),
    policy      bytea NOT NULL,
    rendered_at timestamptz NOT NULL,
    PRIMARY KEY (workload_id, version)
);

-- Every committed authored change (POL-8): who, when, what, resulting workload versions.
CREATE TABLE audit_log (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at                timestamptz NOT NULL DEFAULT now(),
    actor             text NOT NULL,
    action            text NOT NULL,
    subject           text NOT NULL,
    detail            jsonb NOT NULL DEFAULT '{}',
    workload_versions jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_at ON audit_log (at);
