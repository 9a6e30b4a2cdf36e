-- agentgate schema v7 (MySQL/MariaDB): each tool execution's place among
-- its turn's executions, in the order they were claimed. A turn's journal
-- and its pages of executions are read in this order; before, they were
-- ordered by the store-clock millisecond of creation, and two claims made
-- in the same millisecond came back in the order of their random ids. A
-- claim numbers its row after the executions it counted under the session's
-- lock; the unique index makes two claims that counted the same number
-- collide (1062: the step runs again) instead of sharing it. Rows claimed
-- before v7 are numbered by creation time, then id: the order they were
-- shown in until now. Idempotent if a node dies halfway: the column and the
-- index are added only when missing, and only unnumbered rows are numbered.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_tool_executions'
                 AND column_name = 'claim_seq') = 0,
              'ALTER TABLE ag_tool_executions ADD COLUMN claim_seq BIGINT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
UPDATE ag_tool_executions e JOIN (
    SELECT execution_id,
           ROW_NUMBER() OVER (PARTITION BY turn_id ORDER BY created_at_ms, execution_id) AS seq
    FROM ag_tool_executions) n ON n.execution_id = e.execution_id
SET e.claim_seq = n.seq
WHERE e.claim_seq IS NULL;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_tool_executions'
                 AND index_name = 'ag_tool_executions_claim_seq') = 0,
              'ALTER TABLE ag_tool_executions MODIFY claim_seq BIGINT NOT NULL, ADD UNIQUE KEY ag_tool_executions_claim_seq (turn_id, claim_seq)',
              'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
