-- agentgate schema v13 (SQLite): a user's queued turns are counted across
-- their sessions (docs/protocol.md §7, MAX_USER_QUEUE) by a begin, inside
-- the single writer; this index makes that count read only the user's
-- queued turns.
CREATE INDEX ag_turns_user_queue ON ag_turns (user_id) WHERE queue_seq IS NOT NULL;
