-- agentgate schema v11 (PostgreSQL): a session's default busy policy, the
-- one a begin that names no `on_busy` follows. NULL: never set (`reject`).
-- The engine reads it only after such a begin found the session busy, so
-- no begin statement changes. Nullable: a node of the previous release
-- keeps working during a rolling upgrade (it ignores the default).
ALTER TABLE ag_sessions ADD COLUMN busy_policy TEXT COLLATE "C";
ALTER TABLE ag_sessions ADD COLUMN busy_wait_ms BIGINT;
ALTER TABLE ag_sessions ADD COLUMN busy_interrupt BOOLEAN;
