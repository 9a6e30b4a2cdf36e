//! The app's own tables in the engine's database: categories, ledger entries
//! and chat messages. Owns the app's connection pool, the schema and seeding
//! at open, the UI queries, and the ledger insert that runs inside a tool
//! execution's SQL transaction ([`insert_entry`]).
//!
//! One [`Pool`] variant per store kind (SQLite, PostgreSQL, MySQL/MariaDB);
//! every query is written once and runs on each variant through `on_pool!`.
//! The ledger insert is written once too (`insert_on!`) and runs on whatever
//! connection the engine's [`SqlTx`] hands over. Deliberately absent: writes to
//! `ledger_entries` from this pool (entries are written only on the engine's
//! transaction).

mod dialect;

use std::str::FromStr;

use agentgate::store::BoxFuture;
use agentgate::{BoxError, SqlTx};
use serde_json::Value;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Row;

pub(crate) use dialect::Dialect;

use crate::category::DEFAULT_CATEGORIES;
use crate::error::{LedgerError, Result};
use crate::limits::{DB_BUSY_TIMEOUT, DB_CONNECTIONS, MAX_LIST_ROWS};
use crate::money::format_cents;
use crate::records::{Category, CategoryTotal, Entry, EntryType, NewEntry, SessionSummary, Totals};

/// The app's connection pool, one variant per store kind.
#[derive(Clone, Debug)]
pub(crate) enum Pool {
    /// The engine's SQLite file, opened a second time (WAL lets the app read
    /// while the engine writes; the app's few writes wait on the busy timeout).
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL database shared with the engine.
    Postgres(sqlx::PgPool),
    /// A MySQL or MariaDB database shared with the engine.
    MySql(sqlx::MySqlPool),
}

/// Runs `$body` with `$pool` bound to the concrete pool of each variant. The
/// body is written once and type-checked per driver.
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match &$db.pool {
            Pool::Sqlite($pool) => $body,
            Pool::Postgres($pool) => $body,
            Pool::MySql($pool) => $body,
        }
    };
}

/// A chat message row.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MessageRow {
    pub(crate) user_id: String,
    pub(crate) session_id: String,
    pub(crate) turn_id: String,
    pub(crate) role: &'static str,
    pub(crate) content: String,
    pub(crate) data: Value,
    pub(crate) created_at_ms: i64,
}

/// The app's tables.
#[derive(Clone, Debug)]
pub(crate) struct LedgerDb {
    dialect: Dialect,
    pool: Pool,
}

const ENTRY_COLUMNS: &str =
    "id, type, amount_cents, category, note, occur_date, session_id, turn_id, created_at_ms";

fn entry_type(text: &str) -> Result<EntryType> {
    EntryType::parse(text)
        .ok_or_else(|| LedgerError::database(format!("unknown entry type {text:?} in ledger")))
}

macro_rules! entry_from_row {
    ($row:expr) => {{
        let row = $row;
        let amount_cents: i64 = row.try_get("amount_cents")?;
        Entry {
            id: row.try_get("id")?,
            kind: entry_type(&row.try_get::<String, _>("type")?)?,
            amount_cents,
            amount: format_cents(amount_cents),
            category: row.try_get("category")?,
            note: row.try_get("note")?,
            occur_date: row.try_get("occur_date")?,
            session_id: row.try_get("session_id")?,
            turn_id: row.try_get("turn_id")?,
            created_at_ms: row.try_get("created_at_ms")?,
        }
    }};
}

impl LedgerDb {
    /// Opens the app's pool on the store at `url`, creates the tables and
    /// seeds the default categories (both idempotent).
    pub(crate) async fn open(url: &str) -> Result<Self> {
        let dialect = Dialect::of_url(url)
            .ok_or_else(|| LedgerError::invalid(format!("unsupported store url {url:?}")))?;
        let pool = match dialect {
            Dialect::Sqlite => {
                let options = SqliteConnectOptions::from_str(url)
                    .map_err(|e| LedgerError::invalid(format!("bad sqlite url: {e}")))?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(DB_BUSY_TIMEOUT);
                Pool::Sqlite(
                    SqlitePoolOptions::new()
                        .max_connections(DB_CONNECTIONS)
                        .acquire_timeout(agentgate::limits::STORE_ACQUIRE_TIMEOUT)
                        .connect_with(options)
                        .await?,
                )
            }
            Dialect::Postgres => Pool::Postgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(DB_CONNECTIONS)
                    .acquire_timeout(agentgate::limits::STORE_ACQUIRE_TIMEOUT)
                    .connect(url)
                    .await?,
            ),
            Dialect::MySql => Pool::MySql(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(DB_CONNECTIONS)
                    .acquire_timeout(agentgate::limits::STORE_ACQUIRE_TIMEOUT)
                    .connect(&url.replacen("mariadb:", "mysql:", 1))
                    .await?,
            ),
        };
        let db = Self { dialect, pool };
        db.migrate().await?;
        Ok(db)
    }

    async fn migrate(&self) -> Result<()> {
        for statement in self.dialect.schema() {
            on_pool!(self, pool => sqlx::query(statement).execute(pool).await.map(drop))?;
        }
        let insert = self.dialect.sql(
            "{insert_ignore} INTO ledger_categories (type, name, synonyms, is_default, sort_order) \
             VALUES (?, ?, ?, ?, ?){on_conflict_nothing}",
        );
        for (order, seed) in (0_i32..).zip(DEFAULT_CATEGORIES) {
            let synonyms = serde_json::to_string(seed.synonyms)
                .map_err(|e| LedgerError::database(e.to_string()))?;
            on_pool!(self, pool => sqlx::query(&insert)
                .bind(seed.kind.as_str())
                .bind(seed.name)
                .bind(synonyms)
                .bind(i32::from(seed.is_default))
                .bind(order)
                .execute(pool)
                .await
                .map(drop))?;
        }
        Ok(())
    }

    /// The categories, of one type or all, in display order.
    pub(crate) async fn categories(&self, kind: Option<EntryType>) -> Result<Vec<Category>> {
        let sql = self.dialect.sql(
            "SELECT type, name, synonyms, is_default FROM ledger_categories \
             WHERE (? = '' OR type = ?) ORDER BY sort_order, id",
        );
        let kind = kind.map_or("", EntryType::as_str);
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql).bind(kind).bind(kind).fetch_all(pool).await?;
            rows.iter()
                .map(|row| {
                    let synonyms: String = row.try_get("synonyms")?;
                    Ok(Category {
                        kind: entry_type(&row.try_get::<String, _>("type")?)?,
                        name: row.try_get("name")?,
                        synonyms: serde_json::from_str(&synonyms).unwrap_or_default(),
                        is_default: row.try_get::<i32, _>("is_default")? != 0,
                    })
                })
                .collect()
        })
    }

    /// Records a chat message once per `(turn, role)`: a replay or a retry
    /// writing it again changes nothing.
    pub(crate) async fn insert_message(&self, message: &MessageRow) -> Result<()> {
        let sql = self.dialect.sql(
            "{insert_ignore} INTO ledger_messages \
             (user_id, session_id, turn_id, role, content, data, created_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, {now_ms}){on_conflict_nothing}",
        );
        let data = message.data.to_string();
        on_pool!(self, pool => sqlx::query(&sql)
            .bind(&message.user_id)
            .bind(&message.session_id)
            .bind(&message.turn_id)
            .bind(message.role)
            .bind(&message.content)
            .bind(&data)
            .execute(pool)
            .await
            .map(drop))?;
        Ok(())
    }

    /// A user's sessions, most recent first, titled by their first message.
    pub(crate) async fn sessions(&self, user_id: &str) -> Result<Vec<SessionSummary>> {
        // A session's first row is its first turn's user message: the user
        // row is written when a turn starts, before any answer.
        let sql = self.dialect.sql(
            "SELECT s.session_id AS session_id, s.turns AS turns, s.last_at AS last_at, \
                    f.content AS title \
             FROM (SELECT session_id, \
                          CAST(SUM(CASE WHEN role = 'user' THEN 1 ELSE 0 END) AS {bigint}) AS turns, \
                          MAX(created_at_ms) AS last_at, MIN(id) AS first_id \
                   FROM ledger_messages WHERE user_id = ? GROUP BY session_id) s \
             JOIN ledger_messages f ON f.id = s.first_id \
             ORDER BY s.last_at DESC, s.session_id LIMIT ?",
        );
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql)
                .bind(user_id)
                .bind(i64::from(MAX_LIST_ROWS))
                .fetch_all(pool)
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(SessionSummary {
                        session_id: row.try_get("session_id")?,
                        title: row.try_get("title")?,
                        turns: row.try_get("turns")?,
                        last_message_at_ms: row.try_get("last_at")?,
                    })
                })
                .collect()
        })
    }

    /// A session's messages, oldest first (the latest [`MAX_LIST_ROWS`] × 2).
    pub(crate) async fn messages(
        &self,
        user_id: &str,
        session_id: &str,
    ) -> Result<Vec<MessageRow>> {
        let sql = self.dialect.sql(
            "SELECT user_id, session_id, turn_id, role, content, data, created_at_ms FROM ( \
               SELECT * FROM ledger_messages WHERE user_id = ? AND session_id = ? \
               ORDER BY id DESC LIMIT ?) recent ORDER BY id",
        );
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql)
                .bind(user_id)
                .bind(session_id)
                .bind(i64::from(MAX_LIST_ROWS) * 2)
                .fetch_all(pool)
                .await?;
            rows.iter()
                .map(|row| {
                    let role: String = row.try_get("role")?;
                    let data: String = row.try_get("data")?;
                    Ok(MessageRow {
                        user_id: row.try_get("user_id")?,
                        session_id: row.try_get("session_id")?,
                        turn_id: row.try_get("turn_id")?,
                        role: if role == "user" { "user" } else { "assistant" },
                        content: row.try_get("content")?,
                        data: serde_json::from_str(&data).unwrap_or(Value::Null),
                        created_at_ms: row.try_get("created_at_ms")?,
                    })
                })
                .collect()
        })
    }

    /// Turns whose user message is recorded but whose reply is not, newest
    /// first, at most `limit`: the app's turns a recovery worker may have to
    /// resume.
    pub(crate) async fn unanswered_turns(&self, limit: u32) -> Result<Vec<String>> {
        let sql = self.dialect.sql(
            "SELECT m.turn_id FROM ledger_messages m WHERE m.role = 'user' \
             AND NOT EXISTS (SELECT 1 FROM ledger_messages a \
             WHERE a.turn_id = m.turn_id AND a.role = 'assistant') \
             ORDER BY m.id DESC LIMIT ?",
        );
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql)
                .bind(i64::from(limit))
                .fetch_all(pool)
                .await?;
            rows.iter()
                .map(|row| Ok(row.try_get::<String, _>("turn_id")?))
                .collect()
        })
    }

    /// The entry booked under a tool execution's idempotency key, if any:
    /// how a resumed turn reconciles a booking whose outcome is unknown.
    pub(crate) async fn entry_by_key(&self, idempotency_key: &str) -> Result<Option<Entry>> {
        let sql = self.dialect.sql(&format!(
            "SELECT {ENTRY_COLUMNS} FROM ledger_entries WHERE idempotency_key = ?"
        ));
        on_pool!(self, pool => {
            let row = sqlx::query(&sql)
                .bind(idempotency_key)
                .fetch_optional(pool)
                .await?;
            Ok(match row {
                Some(row) => Some(entry_from_row!(&row)),
                None => None,
            })
        })
    }

    /// A user's entries, newest first (at most [`MAX_LIST_ROWS`]).
    pub(crate) async fn entries(&self, user_id: &str) -> Result<Vec<Entry>> {
        let sql = self.dialect.sql(&format!(
            "SELECT {ENTRY_COLUMNS} FROM ledger_entries WHERE user_id = ? \
             ORDER BY occur_date DESC, id DESC LIMIT ?"
        ));
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql)
                .bind(user_id)
                .bind(i64::from(MAX_LIST_ROWS))
                .fetch_all(pool)
                .await?;
            rows.iter().map(|row| Ok(entry_from_row!(row))).collect()
        })
    }

    /// The entries one turn of the user booked, oldest first (at most
    /// [`MAX_LIST_ROWS`]): what a stopped reply had already done.
    pub(crate) async fn entries_of_turn(&self, user_id: &str, turn_id: &str) -> Result<Vec<Entry>> {
        let sql = self.dialect.sql(&format!(
            "SELECT {ENTRY_COLUMNS} FROM ledger_entries WHERE user_id = ? AND turn_id = ? \
             ORDER BY id LIMIT ?"
        ));
        on_pool!(self, pool => {
            let rows = sqlx::query(&sql)
                .bind(user_id)
                .bind(turn_id)
                .bind(i64::from(MAX_LIST_ROWS))
                .fetch_all(pool)
                .await?;
            rows.iter().map(|row| Ok(entry_from_row!(row))).collect()
        })
    }

    /// A user's totals per category and overall.
    pub(crate) async fn totals(&self, user_id: &str) -> Result<Totals> {
        let sql = self.dialect.sql(
            "SELECT type, category, CAST(COUNT(*) AS {bigint}) AS entries, \
                    CAST(SUM(amount_cents) AS {bigint}) AS cents \
             FROM ledger_entries WHERE user_id = ? \
             GROUP BY type, category ORDER BY cents DESC, category",
        );
        let categories: Vec<CategoryTotal> = on_pool!(self, pool => {
            let rows = sqlx::query(&sql).bind(user_id).fetch_all(pool).await?;
            rows.iter()
                .map(|row| {
                    let cents: i64 = row.try_get("cents")?;
                    Ok(CategoryTotal {
                        kind: entry_type(&row.try_get::<String, _>("type")?)?,
                        category: row.try_get("category")?,
                        count: row.try_get("entries")?,
                        amount_cents: cents,
                        amount: format_cents(cents),
                    })
                })
                .collect::<Result<_>>()
        })?;
        let sum = |kind: EntryType| {
            categories
                .iter()
                .filter(|c| c.kind == kind)
                .map(|c| c.amount_cents)
                .sum::<i64>()
        };
        let (income_cents, expense_cents) = (sum(EntryType::Income), sum(EntryType::Expense));
        Ok(Totals {
            income: format_cents(income_cents),
            expense: format_cents(expense_cents),
            income_cents,
            expense_cents,
            categories,
        })
    }
}

/// Who and what a ledger insert books, and the idempotency key of the tool
/// execution it belongs to.
#[derive(Clone, Debug)]
pub(crate) struct EntryInsert {
    pub(crate) user_id: String,
    pub(crate) session_id: String,
    pub(crate) turn_id: String,
    pub(crate) idempotency_key: String,
    pub(crate) entry: NewEntry,
}

const INSERT_ENTRY: &str = "INSERT INTO ledger_entries \
    (user_id, session_id, turn_id, type, amount_cents, category, note, occur_date, created_at_ms, idempotency_key) \
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, {now_ms}, ?)";

/// Inserts an entry on `$conn` (a `&mut` connection of any driver) and
/// reads it back: `RETURNING` where the dialect has it, `LAST_INSERT_ID()` on
/// MySQL. Evaluates to `Result<Entry, BoxError>`.
macro_rules! insert_on {
    ($dialect:expr, $conn:expr, $insert:expr) => {{
        let (dialect, conn, insert): (Dialect, _, &EntryInsert) = ($dialect, $conn, $insert);
        async move {
            let row = if dialect == Dialect::MySql {
                bind_entry(sqlx::query(&dialect.sql(INSERT_ENTRY)), insert)
                    .execute(&mut *conn)
                    .await?;
                let select = format!(
                    "SELECT {ENTRY_COLUMNS} FROM ledger_entries WHERE id = LAST_INSERT_ID()"
                );
                sqlx::query(&select).fetch_one(&mut *conn).await?
            } else {
                let sql = dialect.sql(&format!("{INSERT_ENTRY} RETURNING {ENTRY_COLUMNS}"));
                bind_entry(sqlx::query(&sql), insert)
                    .fetch_one(&mut *conn)
                    .await?
            };
            Ok::<Entry, BoxError>(entry_from_row!(&row))
        }
        .await
    }};
}

/// The side effect of `create_transaction`: inserts the entry on the
/// engine's connection, inside the transaction that marks the tool execution
/// succeeded, and returns the tool result (`{"ok": true, "entry": …}`).
pub(crate) fn insert_entry(
    insert: EntryInsert,
) -> impl for<'c> FnOnce(SqlTx<'c>) -> BoxFuture<'c, Result<Value, BoxError>> + Send {
    move |tx: SqlTx<'_>| {
        Box::pin(async move {
            let entry = match tx {
                SqlTx::Sqlite(conn) => insert_on!(Dialect::Sqlite, conn, &insert)?,
                SqlTx::Postgres(conn) => insert_on!(Dialect::Postgres, conn, &insert)?,
                SqlTx::MySql(conn) => insert_on!(Dialect::MySql, conn, &insert)?,
                other => {
                    return Err(format!("the ledger cannot book on {other:?} yet").into());
                }
            };
            Ok(serde_json::json!({"ok": true, "entry": entry}))
        }) as BoxFuture<'_, Result<Value, BoxError>>
    }
}

fn bind_entry<'q, DB: sqlx::Database>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    insert: &'q EntryInsert,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    query
        .bind(insert.user_id.as_str())
        .bind(insert.session_id.as_str())
        .bind(insert.turn_id.as_str())
        .bind(insert.entry.kind.as_str())
        .bind(insert.entry.amount_cents)
        .bind(insert.entry.category.as_str())
        .bind(insert.entry.note.as_str())
        .bind(insert.entry.occur_date.as_str())
        .bind(insert.idempotency_key.as_str())
}

#[cfg(test)]
mod tests {
    //! The app's SQL on every dialect: SQLite on a temp file, PostgreSQL and
    //! MySQL/MariaDB on a fresh database of the local servers (the store
    //! crates' `testing` helpers: `AGENTGATE_TEST_POSTGRES_URL`,
    //! `AGENTGATE_TEST_MYSQL_URL`). Without a server those skip, unless
    //! `AGENTGATE_REQUIRE_SERVICES=1`.

    use super::*;

    fn insert(key: &str, amount_cents: i64) -> EntryInsert {
        EntryInsert {
            user_id: "alice".into(),
            session_id: "s1".into(),
            turn_id: "turn_1".into(),
            idempotency_key: key.into(),
            entry: NewEntry {
                kind: EntryType::Expense,
                amount_cents,
                category: "餐饮".into(),
                note: "午饭".into(),
                occur_date: "2024-05-01".into(),
            },
        }
    }

    async fn book(db: &LedgerDb, insert: &EntryInsert) -> std::result::Result<Entry, BoxError> {
        let dialect = db.dialect;
        on_pool!(db, pool => {
            let mut tx = pool.begin().await?;
            let entry = insert_on!(dialect, &mut *tx, insert)?;
            tx.commit().await?;
            Ok(entry)
        })
    }

    fn message(role: &'static str, content: &str) -> MessageRow {
        MessageRow {
            user_id: "alice".into(),
            session_id: "s1".into(),
            turn_id: "turn_1".into(),
            role,
            content: content.into(),
            data: serde_json::json!({"k": 1}),
            created_at_ms: 0,
        }
    }

    async fn exercise(url: &str) {
        let db = LedgerDb::open(url).await.expect("open");
        LedgerDb::open(url)
            .await
            .expect("opening again is idempotent");
        let categories = db.categories(None).await.expect("categories");
        assert_eq!(categories.len(), DEFAULT_CATEGORIES.len(), "seeded once");
        let income = db
            .categories(Some(EntryType::Income))
            .await
            .expect("income");
        assert!(income.iter().all(|c| c.kind == EntryType::Income));
        assert!(categories[0].synonyms.iter().any(|s| s == "午饭"));

        for _ in 0..2 {
            db.insert_message(&message("user", "午饭 35"))
                .await
                .expect("message");
        }
        db.insert_message(&message("assistant", "ok"))
            .await
            .expect("reply");
        let rows = db.messages("alice", "s1").await.expect("messages");
        assert_eq!(
            rows.iter().map(|r| r.role).collect::<Vec<_>>(),
            ["user", "assistant"]
        );
        assert_eq!(rows[0].data["k"], 1);
        assert!(
            rows[0].created_at_ms > 1_600_000_000_000,
            "store clock in ms"
        );
        let sessions = db.sessions("alice").await.expect("sessions");
        assert_eq!(sessions.len(), 1);
        assert_eq!(
            (sessions[0].title.as_str(), sessions[0].turns),
            ("午饭 35", 1)
        );
        assert!(db.sessions("bob").await.expect("sessions").is_empty());

        let entry = book(&db, &insert("agk_1", 3500)).await.expect("book");
        assert_eq!(
            (
                entry.amount_cents,
                entry.amount.as_str(),
                entry.occur_date.as_str()
            ),
            (3500, "35.00", "2024-05-01")
        );
        book(&db, &insert("agk_1", 3500))
            .await
            .expect_err("the idempotency key is unique");
        book(&db, &insert("agk_2", 1250)).await.expect("book");
        book(&db, &insert("agk_3", 0))
            .await
            .expect_err("amounts are above zero");
        assert_eq!(db.entries("alice").await.expect("entries").len(), 2);
        let totals = db.totals("alice").await.expect("totals");
        assert_eq!(
            (totals.expense_cents, totals.expense.as_str()),
            (4750, "47.50")
        );
        assert_eq!(totals.categories.len(), 1);
        assert_eq!(totals.categories[0].count, 2);
        assert_eq!(
            db.totals("bob").await.expect("totals"),
            Totals {
                income: "0.00".into(),
                expense: "0.00".into(),
                ..Totals::default()
            }
        );
    }

    #[tokio::test]
    async fn sqlite_dialect() {
        let dir = tempfile::tempdir().expect("dir");
        exercise(&format!("sqlite://{}", dir.path().join("l.db").display())).await;
    }

    #[tokio::test]
    async fn postgres_dialect() {
        use agentgate_store_postgres::testing;
        let Some(url) = testing::fresh_database_url().await else {
            return;
        };
        exercise(&url).await;
        testing::drop_database(&url).await;
    }

    #[tokio::test]
    async fn mysql_dialect() {
        use agentgate_store_mysql::testing;
        let Some(url) = testing::fresh_database_url().await else {
            return;
        };
        exercise(&url).await;
        testing::drop_database(&url).await;
    }
}
