-- agentgate schema v13 (PostgreSQL): a user's queued turns are counted
-- across their sessions (docs/protocol.md §7, MAX_USER_QUEUE), under the
-- user's row lock every begin takes first; this index makes that count
-- read only the user's queued turns.
CREATE INDEX ag_turns_user_queue ON ag_turns (user_id) WHERE queue_seq IS NOT NULL;
