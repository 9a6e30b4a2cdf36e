-- agentgate schema v12 (PostgreSQL): a turn's event log (SPEC §4, events).
--
-- One row an event, numbered 1, 2, … per turn (event_id), appended by the
-- turn's holder under its lease and fence in one step, which also counts
-- them on the turn (event_count, event_bytes: the bounds the engine checks,
-- NULL on turns of the previous release, which have none). Events are
-- deleted with their turn by the sweeper. `data` is canonical JSON text.
CREATE TABLE ag_turn_events (
    turn_id       TEXT COLLATE "C" NOT NULL,
    event_id      BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    name          TEXT COLLATE "C" NOT NULL,
    data          TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (turn_id, event_id)
);
ALTER TABLE ag_turns ADD COLUMN event_count BIGINT;
ALTER TABLE ag_turns ADD COLUMN event_bytes BIGINT;
