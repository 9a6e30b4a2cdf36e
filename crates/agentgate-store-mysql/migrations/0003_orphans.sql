-- agentgate schema v3 (MySQL/MariaDB): orphan recovery. A turn keeps its
-- request payload, so a recovery worker that takes it over can resume it;
-- where the lease layer keeps no expiry (Redis), `orphaned_at_ms` records
-- when a listing first found the turn without a live lease (NULL once
-- re-granted). MySQL has no ADD COLUMN IF NOT EXISTS, so the columns are
-- added only when information_schema lacks them: the migration stays
-- idempotent if a node dies halfway.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'payload') = 0,
              'ALTER TABLE ag_turns ADD COLUMN payload MEDIUMTEXT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'orphaned_at_ms') = 0,
              'ALTER TABLE ag_turns ADD COLUMN orphaned_at_ms BIGINT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
