-- agentgate schema v8 (SQLite): a begin with a lease layer writes its grant
-- in one statement.
--
-- With a lease layer (Redis) the begin takes its fence (one autocommit
-- statement), then the layer's lease and permit, and then writes the grant
-- to the rows. `ag_begin_layered` is a request table like v6's
-- `ag_begin_new`, always empty outside a statement: the grant's one
-- statement inserts a row only when its `WHERE` finds that the full path
-- would write a new start under that fence (src/begin.rs lists each
-- condition), and the trigger below writes what the full path writes (the
-- session's grant, with no row expiry: the layer keeps the lease; the turn)
-- and deletes the request row again. It does not touch the fence counter:
-- the fence was taken before the layer was asked. An insert of no row fires
-- nothing: the begin then decides again under the writer.
CREATE TABLE ag_begin_layered (
    turn_id             TEXT NOT NULL,
    session_id          TEXT NOT NULL,
    user_id             TEXT NOT NULL,
    client_request_id   TEXT NOT NULL,
    token_hash          TEXT NOT NULL,
    fingerprint         TEXT NOT NULL,
    payload             TEXT,
    fence               INTEGER NOT NULL,
    now_ms              INTEGER NOT NULL
);
CREATE TRIGGER ag_begin_layered_grant AFTER INSERT ON ag_begin_layered
BEGIN
    INSERT INTO ag_sessions (session_id, user_id, holder_turn_id, lease_token_hash, fence,
                             lease_expires_at_ms, updated_at_ms)
    VALUES (NEW.session_id, NEW.user_id, NEW.turn_id, NEW.token_hash, NEW.fence, NULL, NEW.now_ms)
    ON CONFLICT (session_id) DO UPDATE SET holder_turn_id = excluded.holder_turn_id,
        lease_token_hash = excluded.lease_token_hash, fence = excluded.fence,
        lease_expires_at_ms = NULL, updated_at_ms = excluded.updated_at_ms;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, state,
                          attempt, fence, created_at_ms, updated_at_ms, payload)
    VALUES (NEW.turn_id, NEW.session_id, NEW.user_id, NEW.client_request_id, NEW.fingerprint,
            'running', 1, NEW.fence, NEW.now_ms, NEW.now_ms, NEW.payload);
    DELETE FROM ag_begin_layered WHERE rowid = NEW.rowid;
END;
