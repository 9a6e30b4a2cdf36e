-- agentgate schema v7 (MySQL/MariaDB): each tool execution's place among
-- its turn's executions, in the order they were claimed. A turn's journal
-- and its pages of executions are read in this order; before, they were
-- ordered by the store-clock millisecond of creation, and two claims made
-- in the same millisecond came back in the order of their random ids. A
-- claim numbers its row after the executions it counted under the session's
-- lock; the unique index makes two claims that counted the same number
-- collide (1062: the claim decides again on its full path) instead of
-- sharing it.
--
-- The column stays nullable: a node of the previous release, still running
-- during a rolling upgrade, inserts executions without a number, and the
-- pages read a missing number as 0 (first, then by id). Rows claimed before
-- v7 are numbered after the turn's highest number (none yet, so 1, 2, …) by
-- creation time, then id: the order they were shown in until now, and never
-- a number already taken, so a rerun after a node died halfway is safe. The
-- column and the index are added only when missing.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_tool_executions'
                 AND column_name = 'claim_seq') = 0,
              'ALTER TABLE ag_tool_executions ADD COLUMN claim_seq BIGINT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
UPDATE ag_tool_executions e JOIN (
    SELECT u.execution_id,
           COALESCE(m.top, 0)
             + ROW_NUMBER() OVER (PARTITION BY u.turn_id ORDER BY u.created_at_ms, u.execution_id) AS seq
    FROM ag_tool_executions u
    LEFT JOIN (SELECT turn_id, MAX(claim_seq) AS top FROM ag_tool_executions
               GROUP BY turn_id) m ON m.turn_id = u.turn_id
    WHERE u.claim_seq IS NULL) n ON n.execution_id = e.execution_id
SET e.claim_seq = n.seq;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_tool_executions'
                 AND index_name = 'ag_tool_executions_claim_seq') = 0,
              'ALTER TABLE ag_tool_executions ADD UNIQUE KEY ag_tool_executions_claim_seq (turn_id, claim_seq)',
              'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
