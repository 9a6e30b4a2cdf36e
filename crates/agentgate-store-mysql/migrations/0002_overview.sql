-- agentgate schema v2 (MySQL/MariaDB): indexes for the operator overview,
-- which lists the latest turns and tool executions. MySQL has no CREATE
-- INDEX IF NOT EXISTS, so each index is created only when information_schema
-- lacks it: the migration stays idempotent if a node dies halfway.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND index_name = 'ag_turns_updated') = 0,
              'CREATE INDEX ag_turns_updated ON ag_turns (updated_at_ms)', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_tool_executions'
                 AND index_name = 'ag_tool_executions_updated') = 0,
              'CREATE INDEX ag_tool_executions_updated ON ag_tool_executions (updated_at_ms)', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
