-- Sync state 5, suspended (issue 16, ENF-6, SYNC-6): the kill switch is engaged on the host
-- (`innerwall-agent down`). The agent keeps and persists the versions it is sent but installs
-- none of them until `innerwall-agent up`, so the workload is never shown SYNCED meanwhile.
ALTER TABLE workloads DROP CONSTRAINT workloads_sync_state_check;
ALTER TABLE workloads ADD CONSTRAINT workloads_sync_state_check CHECK (sync_state BETWEEN 1 AND 5);

-- Evidence gap kinds 6, capture-unavailable (the capture program is not attached, or a drain of
-- its flow map failed), and 7, queue-failed (a closed window could not be written to the
-- agent's queue, or not read back from it) (issue 16, FLOW-2): losses that were silent.
ALTER TABLE flow_gaps DROP CONSTRAINT flow_gaps_kind_check;
ALTER TABLE flow_gaps ADD CONSTRAINT flow_gaps_kind_check CHECK (kind BETWEEN 1 AND 7);

-- Why a gap is there, where the agent has a reason to give (the control plane's refusal of a
-- window, the error that lost a queued one, why capture is unavailable); at most 256 characters.
ALTER TABLE flow_gaps ADD COLUMN detail text NOT NULL DEFAULT '' CHECK (char_length(detail) <= 256);
