//! The SQL dialects of the stores the engine runs on: the app's schema and
//! the few spellings that differ (placeholders, the store clock, insert-or-
//! ignore, the integer cast). Pure text; `db` runs it.
//!
//! Queries are written once with `?` placeholders and `{now_ms}`,
//! `{insert_ignore}`, `{on_conflict_nothing}` and `{bigint}` markers, and
//! [`Dialect::sql`] spells them for one store.

/// A SQL dialect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// SQLite 3.42+ (the engine's embedded store).
    Sqlite,
    /// PostgreSQL 12+.
    Postgres,
    /// MySQL 8 / MariaDB 10.6+.
    MySql,
}

const SQLITE_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS ledger_categories (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        name VARCHAR(64) NOT NULL,
        synonyms TEXT NOT NULL,
        is_default INTEGER NOT NULL DEFAULT 0,
        sort_order INTEGER NOT NULL,
        UNIQUE (type, name))",
    "CREATE TABLE IF NOT EXISTS ledger_entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        amount_cents BIGINT NOT NULL CHECK (amount_cents > 0),
        category VARCHAR(64) NOT NULL,
        note VARCHAR(800) NOT NULL,
        occur_date CHAR(10) NOT NULL,
        created_at_ms BIGINT NOT NULL,
        idempotency_key VARCHAR(64) NOT NULL UNIQUE)",
    "CREATE INDEX IF NOT EXISTS ledger_entries_user ON ledger_entries (user_id, occur_date)",
    "CREATE TABLE IF NOT EXISTS ledger_messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        role VARCHAR(16) NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        data TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        UNIQUE (turn_id, role))",
    "CREATE INDEX IF NOT EXISTS ledger_messages_session ON ledger_messages (user_id, session_id, id)",
];

const POSTGRES_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS ledger_categories (
        id BIGSERIAL PRIMARY KEY,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        name VARCHAR(64) NOT NULL,
        synonyms TEXT NOT NULL,
        is_default INTEGER NOT NULL DEFAULT 0,
        sort_order INTEGER NOT NULL,
        UNIQUE (type, name))",
    "CREATE TABLE IF NOT EXISTS ledger_entries (
        id BIGSERIAL PRIMARY KEY,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        amount_cents BIGINT NOT NULL CHECK (amount_cents > 0),
        category VARCHAR(64) NOT NULL,
        note VARCHAR(800) NOT NULL,
        occur_date CHAR(10) NOT NULL,
        created_at_ms BIGINT NOT NULL,
        idempotency_key VARCHAR(64) NOT NULL UNIQUE)",
    "CREATE INDEX IF NOT EXISTS ledger_entries_user ON ledger_entries (user_id, occur_date)",
    "CREATE TABLE IF NOT EXISTS ledger_messages (
        id BIGSERIAL PRIMARY KEY,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        role VARCHAR(16) NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        data TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        UNIQUE (turn_id, role))",
    "CREATE INDEX IF NOT EXISTS ledger_messages_session ON ledger_messages (user_id, session_id, id)",
];

/// MySQL has no `CREATE INDEX IF NOT EXISTS`, so indexes live in the tables.
const MYSQL_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS ledger_categories (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        name VARCHAR(64) NOT NULL,
        synonyms TEXT NOT NULL,
        is_default INT NOT NULL DEFAULT 0,
        sort_order INT NOT NULL,
        UNIQUE KEY uk_ledger_categories (type, name)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
    "CREATE TABLE IF NOT EXISTS ledger_entries (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        type VARCHAR(16) NOT NULL CHECK (type IN ('income', 'expense')),
        amount_cents BIGINT NOT NULL CHECK (amount_cents > 0),
        category VARCHAR(64) NOT NULL,
        note VARCHAR(800) NOT NULL,
        occur_date CHAR(10) NOT NULL,
        created_at_ms BIGINT NOT NULL,
        idempotency_key VARCHAR(64) NOT NULL,
        UNIQUE KEY uk_ledger_entries_key (idempotency_key),
        KEY ix_ledger_entries_user (user_id, occur_date)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
    "CREATE TABLE IF NOT EXISTS ledger_messages (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        user_id VARCHAR(128) NOT NULL,
        session_id VARCHAR(128) NOT NULL,
        turn_id VARCHAR(128) NOT NULL,
        role VARCHAR(16) NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        data TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        UNIQUE KEY uk_ledger_messages_turn (turn_id, role),
        KEY ix_ledger_messages_session (user_id, session_id, id)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
];

impl Dialect {
    /// The dialect of a store URL's scheme.
    pub(crate) fn of_url(url: &str) -> Option<Self> {
        match url.split(':').next().unwrap_or_default() {
            "sqlite" => Some(Self::Sqlite),
            "postgres" | "postgresql" => Some(Self::Postgres),
            "mysql" | "mariadb" => Some(Self::MySql),
            _ => None,
        }
    }

    /// The app's tables, each statement idempotent.
    pub(crate) fn schema(self) -> &'static [&'static str] {
        match self {
            Self::Sqlite => SQLITE_SCHEMA,
            Self::Postgres => POSTGRES_SCHEMA,
            Self::MySql => MYSQL_SCHEMA,
        }
    }

    /// The store's clock in ms since the Unix epoch (docs/protocol.md §4.6: store time only).
    fn now_ms(self) -> &'static str {
        match self {
            Self::Sqlite => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
            Self::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
            Self::MySql => "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
        }
    }

    /// Spells a query written with `?` and the markers for this dialect.
    pub(crate) fn sql(self, text: &str) -> String {
        let (insert_ignore, on_conflict_nothing, bigint) = match self {
            Self::Sqlite | Self::Postgres => ("INSERT", " ON CONFLICT DO NOTHING", "BIGINT"),
            Self::MySql => ("INSERT IGNORE", "", "SIGNED"),
        };
        let text = text
            .replace("{now_ms}", self.now_ms())
            .replace("{insert_ignore}", insert_ignore)
            .replace("{on_conflict_nothing}", on_conflict_nothing)
            .replace("{bigint}", bigint);
        if self != Self::Postgres {
            return text;
        }
        let mut numbered = String::with_capacity(text.len() + 8);
        let mut index = 0;
        for c in text.chars() {
            if c == '?' {
                index += 1;
                numbered.push_str(&format!("${index}"));
            } else {
                numbered.push(c);
            }
        }
        numbered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_and_markers_are_spelled_per_dialect() {
        let query = "{insert_ignore} INTO t (a, b, c) VALUES (?, ?, {now_ms}){on_conflict_nothing}";
        assert_eq!(
            Dialect::Postgres.sql(query),
            "INSERT INTO t (a, b, c) VALUES ($1, $2, CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)) ON CONFLICT DO NOTHING"
        );
        assert!(Dialect::MySql
            .sql(query)
            .starts_with("INSERT IGNORE INTO t (a, b, c) VALUES (?, ?, CAST(UNIX"));
        assert!(Dialect::Sqlite
            .sql(query)
            .ends_with("unixepoch('subsec') * 1000 AS INTEGER)) ON CONFLICT DO NOTHING"));
        assert_eq!(
            Dialect::MySql.sql("CAST(x AS {bigint})"),
            "CAST(x AS SIGNED)"
        );
    }

    #[test]
    fn urls_pick_a_dialect_and_every_schema_has_the_three_tables() {
        assert_eq!(Dialect::of_url("sqlite://a.db"), Some(Dialect::Sqlite));
        assert_eq!(Dialect::of_url("postgres://h/db"), Some(Dialect::Postgres));
        assert_eq!(Dialect::of_url("mysql://h/db"), Some(Dialect::MySql));
        assert_eq!(Dialect::of_url("redis://h"), None);
        for dialect in [Dialect::Sqlite, Dialect::Postgres, Dialect::MySql] {
            let ddl = dialect.schema().join("\n");
            for table in ["ledger_categories", "ledger_entries", "ledger_messages"] {
                assert!(ddl.contains(table), "{dialect:?} lacks {table}");
            }
            assert!(ddl.contains("idempotency_key"));
        }
    }
}
