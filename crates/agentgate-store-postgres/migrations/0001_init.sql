-- agentgate schema v1 (PostgreSQL). Times are store-clock milliseconds since
-- the Unix epoch (BIGINT, as in the SQLite store); JSON columns hold RFC 8785
-- canonical text (TEXT, not jsonb: jsonb would re-order and re-spell it).
-- Identifiers use COLLATE "C": byte-exact comparison and byte order, like
-- SQLite's BINARY collation.

-- The store-wide fence counter. CACHE 1 (the default) is required: with a
-- per-connection cache, two connections would hand out interleaved ranges and
-- a later grant could get a lower fence. Sequences are WAL-logged ahead, so
-- after a crash the counter skips forward, never back.
CREATE SEQUENCE ag_fence_seq AS BIGINT MINVALUE 1 NO CYCLE CACHE 1;

-- One row per user that ever began a turn: the lock every begin of that user
-- takes first, so the permit count cannot race, and the cap override
-- (NULL: the configured default).
CREATE TABLE ag_users (
    user_id   TEXT COLLATE "C" PRIMARY KEY,
    max_turns BIGINT
);

-- One row per session: its user binding, its lease (the user's permit is the
-- lease itself: a user's live permits are its sessions with a live lease) and
-- its pending confirmation.
CREATE TABLE ag_sessions (
    session_id            TEXT COLLATE "C" PRIMARY KEY,
    user_id               TEXT COLLATE "C" NOT NULL,
    holder_turn_id        TEXT COLLATE "C",
    lease_token_hash      TEXT COLLATE "C",
    fence                 BIGINT NOT NULL DEFAULT 0,
    lease_expires_at_ms   BIGINT,
    pending_turn_id       TEXT COLLATE "C",
    pending_expires_at_ms BIGINT,
    updated_at_ms         BIGINT NOT NULL
);
CREATE INDEX ag_sessions_user_lease ON ag_sessions (user_id, lease_expires_at_ms);

CREATE TABLE ag_turns (
    turn_id           TEXT COLLATE "C" PRIMARY KEY,
    session_id        TEXT COLLATE "C" NOT NULL,
    user_id           TEXT COLLATE "C" NOT NULL,
    client_request_id TEXT COLLATE "C" NOT NULL,
    fingerprint       TEXT COLLATE "C" NOT NULL,
    state             TEXT COLLATE "C" NOT NULL,
    attempt           BIGINT NOT NULL,
    fence             BIGINT NOT NULL,
    response          TEXT,
    error             TEXT,
    retryable         BOOLEAN,
    pending           TEXT,
    confirms_turn_id  TEXT COLLATE "C",
    decision          TEXT COLLATE "C",
    confirmed_by      TEXT COLLATE "C",
    created_at_ms     BIGINT NOT NULL,
    updated_at_ms     BIGINT NOT NULL,
    ended_at_ms       BIGINT,
    UNIQUE (session_id, client_request_id)
);
CREATE INDEX ag_turns_sweep ON ag_turns (state, updated_at_ms);
CREATE INDEX ag_turns_ended ON ag_turns (ended_at_ms);

CREATE TABLE ag_tool_executions (
    execution_id    TEXT COLLATE "C" PRIMARY KEY,
    turn_id         TEXT COLLATE "C" NOT NULL,
    tool            TEXT COLLATE "C" NOT NULL,
    args_hash       TEXT COLLATE "C" NOT NULL,
    idempotency_key TEXT COLLATE "C" NOT NULL,
    state           TEXT COLLATE "C" NOT NULL,
    attempt         BIGINT NOT NULL,
    fence           BIGINT NOT NULL,
    result          TEXT,
    error           TEXT,
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL,
    UNIQUE (turn_id, tool, args_hash)
);
