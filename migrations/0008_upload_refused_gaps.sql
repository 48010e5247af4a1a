-- Evidence gap kind 5, upload-refused: the control plane refused a window (its times were
-- outside the range it accepts); the agent reports the refused window's interval as a gap on a
-- later window instead of dropping it silently.
ALTER TABLE flow_gaps DROP CONSTRAINT flow_gaps_kind_check;
ALTER TABLE flow_gaps ADD CONSTRAINT flow_gaps_kind_check CHECK (kind BETWEEN 1 AND 5);
