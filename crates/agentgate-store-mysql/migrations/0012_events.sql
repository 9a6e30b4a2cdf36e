-- agentgate schema v12 (MySQL/MariaDB): a turn's event log (SPEC §4,
-- events).
--
-- One row an event, numbered 1, 2, … per turn (event_id), appended by the
-- turn's holder under its lease and fence in one step, which also counts
-- them on the turn (event_count, event_bytes: the bounds the engine checks;
-- NULL on turns that have none). Events are deleted with their turn by the
-- sweeper. `data` is canonical JSON text. DDL is not transactional, so each
-- change is made only when missing.
CREATE TABLE IF NOT EXISTS ag_turn_events (
    turn_id       VARBINARY(512) NOT NULL,
    event_id      BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    name          VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    data          MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (turn_id, event_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'event_count') = 0,
              'ALTER TABLE ag_turns ADD COLUMN event_count BIGINT NULL, ADD COLUMN event_bytes BIGINT NULL',
              'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
