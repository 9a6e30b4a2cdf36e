-- agentgate schema v7 (PostgreSQL): a turn's journal and its pages of
-- executions are read in claim order (`claim_seq`, v3) instead of by the
-- store-clock millisecond of creation, where two claims made in the same
-- millisecond came back in the order of their random ids. Rows claimed
-- before v3 have no number yet: they are numbered by creation time, then id
-- (the order they were shown in until now). They are older than every
-- numbered row of their turn, and a numbered row counted them, so the
-- numbers stay unique within the turn.
UPDATE ag_tool_executions e SET claim_seq = n.seq
FROM (SELECT execution_id,
             ROW_NUMBER() OVER (PARTITION BY turn_id ORDER BY created_at_ms, execution_id) AS seq
      FROM ag_tool_executions WHERE claim_seq IS NULL) n
WHERE e.execution_id = n.execution_id;
ALTER TABLE ag_tool_executions ALTER COLUMN claim_seq SET NOT NULL;
