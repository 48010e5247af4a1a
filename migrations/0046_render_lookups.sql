-- Two questions every render asks, answered from indexes of the few rows they look for (issue 33;
-- PERF-1, POL-7): a label change's render rewrote 195 policies in 39 ms, of which these two
-- questions took 4.
--
-- The policy contents stored with their version inside. Contents stored before they were shared
-- (migration 0017) kept the policy's version in their bytes; every content stored since is a
-- policy at version 0. Canonical bytes are one-to-one with policies, so a render tells a changed
-- policy by its digest alone, and reads and decodes a stored content only when it holds a version
-- (its first byte is the version's protobuf tag, 0x08). Asking that of each content a render
-- compares read the first byte of each, most of them compressed out of line; this index holds
-- only the versioned ones (none, in an estate rendered since 0017). The expression is the one
-- `store::load_versioned_contents` asks.
CREATE INDEX policy_contents_versioned ON policy_contents (digest)
    WHERE substring(policy FROM 1 FOR 1) = '\x08'::bytea;

-- The workloads whose policy is held over the rendered-policy bound (migration 0024): every
-- render clears the holds it no longer needs, and there are none but in a misconfigured estate.
CREATE INDEX workloads_policy_held ON workloads (id) WHERE policy_held IS NOT NULL;
