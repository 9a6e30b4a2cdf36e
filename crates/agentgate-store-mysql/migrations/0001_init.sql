-- agentgate schema v1 (MySQL 8 / MariaDB 10.6+). Times are store-clock
-- milliseconds since the Unix epoch (BIGINT, as in the SQLite store); JSON
-- columns hold RFC 8785 canonical text in utf8mb4.
--
-- MySQL DDL is not transactional, so every statement here is idempotent
-- (IF NOT EXISTS, INSERT IGNORE; indexes are declared inside CREATE TABLE)
-- and a migration interrupted half-way is simply run again.
--
-- Identifiers are VARBINARY(128) (128 bytes is MAX_ID_BYTES): compared and
-- ordered byte by byte like SQLite and PostgreSQL. utf8mb4_bin would not do:
-- it is a PAD SPACE collation, so 'a' and 'a ' would be the same session.
-- Hashes and states are ASCII.

-- The store-wide fence counter: one row, only ever incremented, under the
-- row lock of the grant that takes the next value.
CREATE TABLE IF NOT EXISTS ag_fence (
    id    TINYINT NOT NULL PRIMARY KEY,
    value BIGINT NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
INSERT IGNORE INTO ag_fence (id, value) VALUES (1, 0);

-- One row per user that ever began a turn: the lock every begin of that user
-- takes first, so the permit count cannot race, and the cap override
-- (NULL: the configured default).
CREATE TABLE IF NOT EXISTS ag_users (
    user_id   VARBINARY(128) NOT NULL PRIMARY KEY,
    max_turns BIGINT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- One row per session: its user binding, its lease (the user's permit is the
-- lease itself: a user's live permits are its sessions with a live lease) and
-- its pending confirmation.
CREATE TABLE IF NOT EXISTS ag_sessions (
    session_id            VARBINARY(128) NOT NULL PRIMARY KEY,
    user_id               VARBINARY(128) NOT NULL,
    holder_turn_id        VARBINARY(128) NULL,
    lease_token_hash      CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL,
    fence                 BIGINT NOT NULL DEFAULT 0,
    lease_expires_at_ms   BIGINT NULL,
    pending_turn_id       VARBINARY(128) NULL,
    pending_expires_at_ms BIGINT NULL,
    updated_at_ms         BIGINT NOT NULL,
    KEY ag_sessions_user_lease (user_id, lease_expires_at_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS ag_turns (
    turn_id           VARBINARY(128) NOT NULL PRIMARY KEY,
    session_id        VARBINARY(128) NOT NULL,
    user_id           VARBINARY(128) NOT NULL,
    client_request_id VARBINARY(128) NOT NULL,
    fingerprint       CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    state             VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempt           BIGINT NOT NULL,
    fence             BIGINT NOT NULL,
    response          MEDIUMTEXT NULL,
    error             MEDIUMTEXT NULL,
    retryable         BOOLEAN NULL,
    pending           MEDIUMTEXT NULL,
    confirms_turn_id  VARBINARY(128) NULL,
    decision          VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NULL,
    confirmed_by      VARBINARY(128) NULL,
    created_at_ms     BIGINT NOT NULL,
    updated_at_ms     BIGINT NOT NULL,
    ended_at_ms       BIGINT NULL,
    UNIQUE KEY ag_turns_request (session_id, client_request_id),
    KEY ag_turns_sweep (state, updated_at_ms),
    KEY ag_turns_ended (ended_at_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS ag_tool_executions (
    execution_id    VARBINARY(128) NOT NULL PRIMARY KEY,
    turn_id         VARBINARY(128) NOT NULL,
    tool            VARBINARY(128) NOT NULL,
    args_hash       CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    state           VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempt         BIGINT NOT NULL,
    fence           BIGINT NOT NULL,
    result          MEDIUMTEXT NULL,
    error           MEDIUMTEXT NULL,
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL,
    UNIQUE KEY ag_tool_executions_call (turn_id, tool, args_hash)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
