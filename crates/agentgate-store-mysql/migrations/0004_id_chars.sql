-- agentgate schema v4 (MySQL/MariaDB): ids are limited in characters, not
-- bytes. An id is 1–128 characters (MAX_ID_CHARS, what the OpenAPI
-- document's maxLength counts), so up to 4 × 128 = 512 bytes of UTF-8; the
-- VARBINARY(128) columns of v1 held only 128 bytes (43 × "中" did not fit).
-- Still VARBINARY: compared and ordered byte by byte like SQLite and
-- PostgreSQL. The widest key, ag_tool_executions_call (turn_id, tool,
-- args_hash), is 512 + 512 + 64 = 1088 bytes, under InnoDB's 3072.
-- MODIFY to the same type is a no-op, so the migration stays idempotent if a
-- node dies halfway.
ALTER TABLE ag_users
    MODIFY user_id VARBINARY(512) NOT NULL;
ALTER TABLE ag_sessions
    MODIFY session_id      VARBINARY(512) NOT NULL,
    MODIFY user_id         VARBINARY(512) NOT NULL,
    MODIFY holder_turn_id  VARBINARY(512) NULL,
    MODIFY pending_turn_id VARBINARY(512) NULL;
ALTER TABLE ag_turns
    MODIFY turn_id           VARBINARY(512) NOT NULL,
    MODIFY session_id        VARBINARY(512) NOT NULL,
    MODIFY user_id           VARBINARY(512) NOT NULL,
    MODIFY client_request_id VARBINARY(512) NOT NULL,
    MODIFY confirms_turn_id  VARBINARY(512) NULL,
    MODIFY confirmed_by      VARBINARY(512) NULL;
ALTER TABLE ag_tool_executions
    MODIFY execution_id VARBINARY(512) NOT NULL,
    MODIFY turn_id      VARBINARY(512) NOT NULL,
    MODIFY tool         VARBINARY(512) NOT NULL;
