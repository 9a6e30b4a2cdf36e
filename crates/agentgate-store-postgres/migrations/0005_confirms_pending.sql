-- agentgate schema v5 (PostgreSQL): a turn begun by a confirmation keeps the
-- action it carries (the confirmed turn's, `confirms_pending`) apart from
-- its own pending action (`pending`), so a continuation that itself awaits a
-- confirmation shows both. Before, one `pending` column held both and an
-- ending that awaited confirmation overwrote the carried action. The
-- carried action is copied back from the confirmed turn, which keeps it;
-- a continuation's `pending` is its own only once it awaited confirmation.
ALTER TABLE ag_turns ADD COLUMN IF NOT EXISTS confirms_pending TEXT;
UPDATE ag_turns c SET confirms_pending = p.pending
FROM ag_turns p WHERE p.turn_id = c.confirms_turn_id;
UPDATE ag_turns SET pending = NULL
WHERE confirms_turn_id IS NOT NULL AND state NOT IN ('awaiting_confirmation', 'confirmed');
