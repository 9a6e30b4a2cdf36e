-- agentgate schema v4 (PostgreSQL): orphan recovery. A turn keeps its
-- request payload, so a recovery worker that takes it over can resume it;
-- where the lease layer keeps no expiry (Redis), `orphaned_at_ms` records
-- when a listing first found the turn without a live lease (NULL once
-- re-granted).
ALTER TABLE ag_turns ADD COLUMN payload TEXT;
ALTER TABLE ag_turns ADD COLUMN orphaned_at_ms BIGINT;
