-- Sync state 5, suspended (issue 16, ENF-6, SYNC-6): the kill switch is engaged on the host
-- (`innerwall-agent down`). The agent keeps and persists the versions it is sent but installs
-- none of them until `innerwall-agent up`, so the workload is never shown SYNCED meanwhile.
ALTER TABLE workloads DROP CONSTRAINT workloads_sync_state_check;
ALTER TABLE workloads ADD CONSTRAINT workloads_sync_state_check CHECK (sync_state BETWEEN 1 AND 5);
