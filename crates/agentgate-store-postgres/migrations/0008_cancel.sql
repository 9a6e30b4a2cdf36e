-- agentgate schema v8 (PostgreSQL): a turn can be asked to stop. The
-- request is recorded on the turn (store-clock ms), without a lease token;
-- the holder learns it on its next heartbeat and tool claim, and ends the
-- turn `cancelled`. NULL: no request. Nullable, so a node of the previous
-- release still running during a rolling upgrade writes turns as before.
ALTER TABLE ag_turns ADD COLUMN IF NOT EXISTS cancel_requested_at_ms BIGINT;
