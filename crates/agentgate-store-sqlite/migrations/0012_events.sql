-- agentgate schema v12 (SQLite): a turn's event log (SPEC §4, events).
--
-- One row an event, numbered 1, 2, … per turn (event_id), appended by the
-- turn's holder under its lease and fence in one step, which also counts
-- them on the turn (event_count, event_bytes: the bounds the engine checks;
-- NULL on turns that have none). Events are deleted with their turn by the
-- sweeper. `data` is canonical JSON text.
CREATE TABLE ag_turn_events (
    turn_id       TEXT NOT NULL,
    event_id      INTEGER NOT NULL,
    attempt       INTEGER NOT NULL,
    name          TEXT NOT NULL,
    data          TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (turn_id, event_id)
) WITHOUT ROWID;
ALTER TABLE ag_turns ADD COLUMN event_count INTEGER;
ALTER TABLE ag_turns ADD COLUMN event_bytes INTEGER;
