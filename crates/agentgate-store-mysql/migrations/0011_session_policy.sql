-- agentgate schema v11 (MySQL/MariaDB): a session's default busy policy,
-- the one a begin that names no `on_busy` follows. NULL: never set
-- (`reject`). The engine reads it only after such a begin found the
-- session busy, so no begin statement or procedure changes. The columns
-- are added only when missing (DDL is not transactional), nullable so a
-- node of the previous release keeps working during a rolling upgrade.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_sessions'
                 AND column_name = 'busy_policy') = 0,
              'ALTER TABLE ag_sessions ADD COLUMN busy_policy VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NULL, ADD COLUMN busy_wait_ms BIGINT NULL, ADD COLUMN busy_interrupt BOOLEAN NULL',
              'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
