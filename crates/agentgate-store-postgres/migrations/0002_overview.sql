-- agentgate schema v2 (PostgreSQL): indexes for the operator overview,
-- which lists the latest turns and tool executions.
CREATE INDEX ag_turns_updated ON ag_turns (updated_at_ms);
CREATE INDEX ag_tool_executions_updated ON ag_tool_executions (updated_at_ms);
