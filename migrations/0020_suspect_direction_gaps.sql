-- Evidence gap kind 8, suspect-direction (issue 25, FLOW-1, FLOW-2): the agent recorded UDP
-- datagrams as inbound that looked like replies to a connection its connection table no longer
-- knew (an ephemeral local port answered from a service port, no entry: evicted, or older than
-- the capture), so some of the window's inbound records may be this host's own conversations.
-- The count is those datagrams; the verdict never calls a window carrying one clean.
ALTER TABLE flow_gaps DROP CONSTRAINT flow_gaps_kind_check;
ALTER TABLE flow_gaps ADD CONSTRAINT flow_gaps_kind_check CHECK (kind BETWEEN 1 AND 8);
