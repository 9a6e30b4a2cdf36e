-- agentgate schema v6 (SQLite): the common begin in one statement.
--
-- A SQLite statement writes one table, but the triggers it fires run inside
-- it, atomically. `ag_begin_new` is a request table that is always empty
-- outside a statement: the begin's one statement inserts a row into it only
-- when its `WHERE` finds that nothing but a new start can come of the begin
-- (src/begin.rs lists each condition and the fact of `decide_begin` it
-- stands for), and the trigger below writes that start (the store-wide fence
-- counter, the session's grant, the turn) and deletes the request row again.
-- An insert of no row fires nothing and writes nothing: the begin then falls
-- back to the full read-decide-write path. The single writer serialises the
-- statement's reads and its trigger's writes against every other step.
CREATE TABLE ag_begin_new (
    turn_id             TEXT NOT NULL,
    session_id          TEXT NOT NULL,
    user_id             TEXT NOT NULL,
    client_request_id   TEXT NOT NULL,
    token_hash          TEXT NOT NULL,
    fingerprint         TEXT NOT NULL,
    payload             TEXT,
    fence               INTEGER NOT NULL,
    now_ms              INTEGER NOT NULL,
    lease_expires_at_ms INTEGER NOT NULL
);
CREATE TRIGGER ag_begin_new_grant AFTER INSERT ON ag_begin_new
BEGIN
    -- The fence was read as the counter + 1 by the same statement, under
    -- the single writer: the counter moves to it, and only grows.
    UPDATE ag_fence SET value = NEW.fence WHERE id = 1 AND value = NEW.fence - 1;
    SELECT RAISE(ABORT, 'agentgate corrupt: the fence counter moved under a one-statement begin')
    WHERE (SELECT value FROM ag_fence WHERE id = 1) IS NOT NEW.fence;
    INSERT INTO ag_sessions (session_id, user_id, holder_turn_id, lease_token_hash, fence,
                             lease_expires_at_ms, updated_at_ms)
    VALUES (NEW.session_id, NEW.user_id, NEW.turn_id, NEW.token_hash, NEW.fence,
            NEW.lease_expires_at_ms, NEW.now_ms)
    ON CONFLICT (session_id) DO UPDATE SET holder_turn_id = excluded.holder_turn_id,
        lease_token_hash = excluded.lease_token_hash, fence = excluded.fence,
        lease_expires_at_ms = excluded.lease_expires_at_ms, updated_at_ms = excluded.updated_at_ms;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, state,
                          attempt, fence, created_at_ms, updated_at_ms, payload)
    VALUES (NEW.turn_id, NEW.session_id, NEW.user_id, NEW.client_request_id, NEW.fingerprint,
            'running', 1, NEW.fence, NEW.now_ms, NEW.now_ms, NEW.payload);
    DELETE FROM ag_begin_new WHERE rowid = NEW.rowid;
END;
