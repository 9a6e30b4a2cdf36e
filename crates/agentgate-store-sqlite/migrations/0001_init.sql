-- agentgate schema v1 (SQLite). Times are store-clock milliseconds since the
-- Unix epoch; JSON columns hold RFC 8785 canonical text.

-- The store-wide fence counter: one row, only ever incremented.
CREATE TABLE ag_fence (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    value INTEGER NOT NULL
);
INSERT INTO ag_fence (id, value) VALUES (1, 0);

-- Per-user cap overrides; users without a row get the configured default.
CREATE TABLE ag_users (
    user_id   TEXT PRIMARY KEY,
    max_turns INTEGER NOT NULL
);

-- One row per session: its user binding, its lease (the user's permit is the
-- lease itself: a user's live permits are its sessions with a live lease) and
-- its pending confirmation.
CREATE TABLE ag_sessions (
    session_id            TEXT PRIMARY KEY,
    user_id               TEXT NOT NULL,
    holder_turn_id        TEXT,
    lease_token_hash      TEXT,
    fence                 INTEGER NOT NULL DEFAULT 0,
    lease_expires_at_ms   INTEGER,
    pending_turn_id       TEXT,
    pending_expires_at_ms INTEGER,
    updated_at_ms         INTEGER NOT NULL
);
CREATE INDEX ag_sessions_user_lease ON ag_sessions (user_id, lease_expires_at_ms);

CREATE TABLE ag_turns (
    turn_id           TEXT PRIMARY KEY,
    session_id        TEXT NOT NULL,
    user_id           TEXT NOT NULL,
    client_request_id TEXT NOT NULL,
    fingerprint       TEXT NOT NULL,
    state             TEXT NOT NULL,
    attempt           INTEGER NOT NULL,
    fence             INTEGER NOT NULL,
    response          TEXT,
    error             TEXT,
    retryable         INTEGER,
    pending           TEXT,
    confirms_turn_id  TEXT,
    decision          TEXT,
    confirmed_by      TEXT,
    created_at_ms     INTEGER NOT NULL,
    updated_at_ms     INTEGER NOT NULL,
    ended_at_ms       INTEGER,
    UNIQUE (session_id, client_request_id)
);
CREATE INDEX ag_turns_sweep ON ag_turns (state, updated_at_ms);

CREATE TABLE ag_tool_executions (
    execution_id    TEXT PRIMARY KEY,
    turn_id         TEXT NOT NULL,
    tool            TEXT NOT NULL,
    args_hash       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    state           TEXT NOT NULL,
    attempt         INTEGER NOT NULL,
    fence           INTEGER NOT NULL,
    result          TEXT,
    error           TEXT,
    created_at_ms   INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL,
    UNIQUE (turn_id, tool, args_hash)
);
