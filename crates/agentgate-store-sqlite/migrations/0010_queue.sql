-- agentgate schema v10 (SQLite): a session's queue (on_busy: enqueue and
-- supersede). A queued turn is a turn row in state 'queued' with its place
-- in the session's queue in queue_seq (NULL for every other turn; a start
-- of the head clears it). The partial index serves the head, the length
-- and the positions, all per session. The one-statement begins
-- (src/begin.rs) fall back while the session has a queued turn, so a new
-- request never jumps a queue.
ALTER TABLE ag_turns ADD COLUMN queue_seq INTEGER;
CREATE INDEX ag_turns_queue ON ag_turns (session_id, queue_seq) WHERE queue_seq IS NOT NULL;
