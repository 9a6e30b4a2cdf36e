-- agentgate schema v5 (MySQL/MariaDB): a turn begun by a confirmation keeps
-- the action it carries (the confirmed turn's, `confirms_pending`) apart
-- from its own pending action (`pending`), so a continuation that itself
-- awaits a confirmation shows both. Before, one `pending` column held both
-- and an ending that awaited confirmation overwrote the carried action. The
-- carried action is copied back from the confirmed turn, which keeps it; a
-- continuation's `pending` is its own only once it awaited confirmation.
-- Idempotent if a node dies halfway: the column is added only when missing,
-- and both updates give the same rows again.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'confirms_pending') = 0,
              'ALTER TABLE ag_turns ADD COLUMN confirms_pending MEDIUMTEXT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
UPDATE ag_turns c JOIN ag_turns p ON p.turn_id = c.confirms_turn_id
SET c.confirms_pending = p.pending;
UPDATE ag_turns SET pending = NULL
WHERE confirms_turn_id IS NOT NULL AND state NOT IN ('awaiting_confirmation', 'confirmed');
