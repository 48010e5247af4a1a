-- Liveness independent of the replica holding a stream (issue 16, SYNC-6): each stream records
-- the silence it tolerates (three of the heartbeat intervals its replica gave the agent), and
-- every replica marks workloads whose last sign of life is older than that OFFLINE, so a
-- replica that dies without closing its streams cannot leave them SYNCED.
ALTER TABLE workloads ADD COLUMN stream_liveness interval;
CREATE INDEX workloads_live_streams ON workloads (last_seen_at) WHERE sync_state <> 4;
