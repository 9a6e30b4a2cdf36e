-- agentgate schema v9 (SQLite): a turn can be asked to stop. The request
-- is recorded on the turn (store-clock ms), without a lease token; the
-- holder learns it on its next heartbeat and tool claim, and ends the turn
-- `cancelled` (a state, like the others, kept in `state`). NULL: no request.
ALTER TABLE ag_turns ADD COLUMN cancel_requested_at_ms INTEGER;
