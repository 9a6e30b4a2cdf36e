-- agentgate schema v11 (SQLite): a session's default busy policy, the one a
-- begin that names no `on_busy` follows. NULL: never set (`reject`). The
-- engine reads it only after such a begin found the session busy, so no
-- begin statement changes.
ALTER TABLE ag_sessions ADD COLUMN busy_policy TEXT;
ALTER TABLE ag_sessions ADD COLUMN busy_wait_ms INTEGER;
ALTER TABLE ag_sessions ADD COLUMN busy_interrupt INTEGER;
