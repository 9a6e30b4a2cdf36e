-- agentgate schema v7 (SQLite): a turn's ending in one statement.
--
-- Ending a turn writes two tables: the turn's row, and its session's row,
-- whose lease and the user's permit the ending releases (and, for an ending
-- that awaits a confirmation, where the pending confirmation is recorded).
-- A SQLite statement writes one table, but the triggers it fires run inside
-- it, atomically. The ending's one statement updates the turn (conditioned
-- on the caller's live lease) and sets `end_release`, which asks the trigger
-- below to release the session in the same statement and clears the column
-- again; no other statement sets it, so nothing else fires the trigger.
-- `end_release` is NULL outside that statement; during it, below 0 means
-- "release", 0 or more "release and record the turn as the session's
-- pending confirmation, expiring that many ms after the ending".
ALTER TABLE ag_turns ADD COLUMN end_release INTEGER;
CREATE TRIGGER ag_turn_end_release AFTER UPDATE OF end_release ON ag_turns
WHEN NEW.end_release IS NOT NULL
BEGIN
    UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL,
        lease_expires_at_ms = NULL, updated_at_ms = NEW.updated_at_ms,
        pending_turn_id = CASE WHEN NEW.end_release < 0 THEN pending_turn_id ELSE NEW.turn_id END,
        pending_expires_at_ms = CASE WHEN NEW.end_release < 0 THEN pending_expires_at_ms
                                     ELSE NEW.updated_at_ms + NEW.end_release END
    WHERE session_id = NEW.session_id AND holder_turn_id = NEW.turn_id;
    UPDATE ag_turns SET end_release = NULL WHERE turn_id = NEW.turn_id;
END;
