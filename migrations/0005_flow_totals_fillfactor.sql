-- PERF-7: every ingested window updates one flow_totals row per (peer, service, decision) it
-- saw, and the primary key never changes. Free room on each page lets those updates stay HOT
-- (no new index entry, dead versions pruned in place) instead of growing the primary key by one
-- entry per update. Applies to pages written from now on; existing pages fill up as before.
ALTER TABLE flow_totals SET (fillfactor = 50);
