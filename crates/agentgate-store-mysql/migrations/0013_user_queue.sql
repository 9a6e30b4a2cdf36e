-- agentgate schema v13 (MySQL/MariaDB): a user's queued turns are counted
-- across their sessions (docs/protocol.md §7, MAX_USER_QUEUE), under the
-- user's row lock every begin takes first; this index makes that count
-- read the user's turns by their queue number (MySQL has no partial
-- index). Idempotent, like every MySQL migration.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND index_name = 'ag_turns_user_queue') = 0,
              'CREATE INDEX ag_turns_user_queue ON ag_turns (user_id, queue_seq)', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
