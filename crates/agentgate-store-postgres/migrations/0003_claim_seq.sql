-- agentgate schema v3 (PostgreSQL): each tool execution's place among its
-- turn's executions. A first tool claim is one statement that takes no
-- session lock, so two claims of one turn may count its executions from the
-- same snapshot; numbering the new row after the executions it counted makes
-- two such inserts collide on this index instead of both passing the bound of
-- MAX_EXECUTIONS_PER_TURN, which stays exact. Rows claimed before v3 keep
-- NULL (a unique index admits many NULLs) and are counted all the same.
ALTER TABLE ag_tool_executions ADD COLUMN claim_seq BIGINT;
CREATE UNIQUE INDEX ag_tool_executions_claim_seq ON ag_tool_executions (turn_id, claim_seq);
