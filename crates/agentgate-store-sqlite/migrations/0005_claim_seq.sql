-- agentgate schema v5 (SQLite): each tool execution's place among its
-- turn's executions, in the order they were claimed. A turn's journal and
-- its pages of executions are read in this order; before, they were ordered
-- by the store-clock millisecond of creation, and two claims made in the
-- same millisecond came back in the order of their random ids. The single
-- writer numbers a claim after the executions it counts, so the number is
-- exact; the unique index keeps it so. Rows claimed before v5 are numbered
-- by creation time, then id: the order they were shown in until now.
ALTER TABLE ag_tool_executions ADD COLUMN claim_seq INTEGER;
UPDATE ag_tool_executions SET claim_seq = (
    SELECT COUNT(*) FROM ag_tool_executions e
    WHERE e.turn_id = ag_tool_executions.turn_id
      AND (e.created_at_ms < ag_tool_executions.created_at_ms
           OR (e.created_at_ms = ag_tool_executions.created_at_ms
               AND e.execution_id <= ag_tool_executions.execution_id)));
CREATE UNIQUE INDEX ag_tool_executions_claim_seq ON ag_tool_executions (turn_id, claim_seq);
