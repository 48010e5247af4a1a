-- Every label set a workload has had, with when it held (FLOW-5: "a snapshot of its labels as
-- they were then"). Flow ingest resolves a peer's labels as of the flow's first packet, not as
-- of the upload, so a flow seen before a relabel keeps the labels it was seen under. One row per
-- label_version; the open row (valid_to NULL) is the current set. Written by the same
-- transaction that changes the labels.
CREATE TABLE workload_label_history (
    workload_id   uuid NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    label_version bigint NOT NULL,
    labels        jsonb NOT NULL,
    valid_from    timestamptz NOT NULL,
    valid_to      timestamptz,
    PRIMARY KEY (workload_id, label_version),
    CHECK (valid_to IS NULL OR valid_from <= valid_to)
);
CREATE UNIQUE INDEX workload_label_history_open ON workload_label_history (workload_id) WHERE valid_to IS NULL;
CREATE INDEX workload_label_history_time ON workload_label_history (workload_id, valid_from);

-- What is known for workloads registered before this migration: their labels now, since they
-- were registered (earlier changes were not recorded).
INSERT INTO workload_label_history (workload_id, label_version, labels, valid_from)
SELECT w.id, w.label_version,
       COALESCE((SELECT jsonb_object_agg(l.key, l.value) FROM workload_labels l WHERE l.workload_id = w.id), '{}'),
       w.created_at
FROM workloads w;
