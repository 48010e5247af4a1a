-- Each sync stream that opens takes the next epoch of its workload; a stream records state and
-- marks OFFLINE only while it is still the newest, so an old stream ending on one replica never
-- overwrites the state of a newer stream on another (SYNC-6, IDN-7).
ALTER TABLE workloads ADD COLUMN stream_epoch bigint NOT NULL DEFAULT 0;
