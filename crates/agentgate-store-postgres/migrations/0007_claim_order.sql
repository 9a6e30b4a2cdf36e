-- agentgate schema v7 (PostgreSQL): a turn's journal and its pages of
-- executions are read in claim order (`claim_seq`, v3) instead of by the
-- store-clock millisecond of creation, where two claims made in the same
-- millisecond came back in the order of their random ids. Rows claimed
-- before v3 have no number yet: they are numbered after the turn's highest
-- number (none, for a turn that ended before v3: so 1, 2, …) by creation
-- time, then id (the order they were shown in until now), so no number is
-- taken twice even for a turn that a v2 and a v3 node both wrote to.
UPDATE ag_tool_executions e SET claim_seq = n.seq
FROM (SELECT u.execution_id,
             COALESCE(m.top, 0)
               + ROW_NUMBER() OVER (PARTITION BY u.turn_id ORDER BY u.created_at_ms, u.execution_id) AS seq
      FROM ag_tool_executions u
      LEFT JOIN (SELECT turn_id, MAX(claim_seq) AS top FROM ag_tool_executions
                 GROUP BY turn_id) m ON m.turn_id = u.turn_id
      WHERE u.claim_seq IS NULL) n
WHERE e.execution_id = n.execution_id;
ALTER TABLE ag_tool_executions ALTER COLUMN claim_seq SET NOT NULL;
