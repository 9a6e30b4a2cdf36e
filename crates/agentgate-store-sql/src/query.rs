//! A statement as the shared steps write it, and the one place a store runs
//! it: the dialect binds [`Arg`]s, maps its driver's errors and wraps its
//! rows in [`Columns`]; the SQL text, the arguments and what the rows mean
//! are written once, here and in the step modules.
//!
//! Statements number their placeholders `$1`, `$2`, … (PostgreSQL's and
//! SQLite's form). A store whose driver only knows `?` in order (MySQL)
//! renders them with [`positional`], which repeats an argument used twice.

use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::lease::LeaseLayer;

use crate::rows::Columns;

/// One argument of a statement.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A `BIGINT`.
    Int(i64),
    /// A nullable `BIGINT`.
    OptInt(Option<i64>),
    /// Text.
    Text(&'a str),
    /// Nullable text.
    OptText(Option<&'a str>),
}

/// A statement: SQL with numbered placeholders and its arguments, in
/// placeholder order.
#[derive(Debug)]
pub struct Statement<'a> {
    sql: String,
    args: Vec<Arg<'a>>,
}

impl<'a> Statement<'a> {
    /// A statement with no arguments yet.
    pub fn new(sql: impl Into<String>) -> Self {
        Self {
            sql: sql.into(),
            args: Vec::new(),
        }
    }

    /// Binds the next placeholder to an integer.
    #[must_use]
    pub fn int(mut self, value: i64) -> Self {
        self.args.push(Arg::Int(value));
        self
    }

    /// Binds the next placeholder to a nullable integer.
    #[must_use]
    pub fn opt_int(mut self, value: Option<i64>) -> Self {
        self.args.push(Arg::OptInt(value));
        self
    }

    /// Binds the next placeholder to `arg`.
    #[must_use]
    pub fn arg(mut self, arg: Arg<'a>) -> Self {
        self.args.push(arg);
        self
    }

    /// Binds the next placeholder to text.
    #[must_use]
    pub fn text(mut self, value: &'a str) -> Self {
        self.args.push(Arg::Text(value));
        self
    }

    /// Binds the next placeholder to nullable text.
    #[must_use]
    pub fn opt_text(mut self, value: Option<&'a str>) -> Self {
        self.args.push(Arg::OptText(value));
        self
    }

    /// Adds an argument; its placeholder (`$n`), for SQL built piece by
    /// piece ([`Statement::push`]).
    pub fn bind(&mut self, arg: Arg<'a>) -> String {
        self.args.push(arg);
        format!("${}", self.args.len())
    }

    /// Appends SQL text.
    pub fn push(&mut self, sql: &str) {
        self.sql.push_str(sql);
    }

    /// The SQL, placeholders numbered.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The arguments, in placeholder order.
    pub fn args(&self) -> &[Arg<'a>] {
        &self.args
    }
}

/// `statement` for a driver that binds `?` in order: every `$n` outside a
/// quoted literal becomes `?`, and the arguments are listed in the order the
/// placeholders appear (an argument used twice is bound twice).
///
/// # Errors
/// `corrupt` for a placeholder with no argument (a bug in the statement).
pub fn positional<'a>(statement: &Statement<'a>) -> Result<(String, Vec<Arg<'a>>)> {
    let mut sql = String::with_capacity(statement.sql.len());
    let mut args = Vec::with_capacity(statement.args.len());
    let mut quote = None;
    let mut chars = statement.sql.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"' | '`') => quote = Some(c),
            (None, '$') if chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut number = 0usize;
                while let Some(digit) = chars.peek().and_then(|d| d.to_digit(10)) {
                    number = number * 10 + digit as usize;
                    chars.next();
                }
                let arg = number
                    .checked_sub(1)
                    .and_then(|i| statement.args.get(i))
                    .ok_or_else(|| {
                        Error::corrupt(format!("placeholder ${number} has no argument"))
                    })?;
                args.push(*arg);
                sql.push('?');
                continue;
            }
            _ => {}
        }
        sql.push(c);
    }
    Ok((sql, args))
}

/// `statement` for a driver that binds numbered placeholders (`$n`): as
/// written.
///
/// # Errors
/// Never; the signature matches [`positional`].
pub fn numbered<'a>(statement: &Statement<'a>) -> Result<(String, Vec<Arg<'a>>)> {
    Ok((statement.sql.clone(), statement.args.clone()))
}

/// Where a statement runs: alone on the store's pool (its own implicit
/// transaction), as a read or a write, or on a step's open transaction.
pub enum On<'c, C> {
    /// A read on the pool (SQLite: its reader pool).
    Read,
    /// An autocommit write on the pool (SQLite: its single writer).
    Write,
    /// An open transaction's connection.
    Conn(&'c mut C),
}

/// How a store runs a [`Statement`]: its driver, its error mapping, its
/// rows read through [`Columns`].
#[async_trait::async_trait]
pub trait Run: Sync {
    /// A connection a step's transaction runs on (a same-transaction effect
    /// downcasts it from `Any`).
    type Conn: Send + 'static;
    /// One row as the driver returns it.
    type Row: Send + Sync;
    /// An open transaction (a step's, [`crate::StepTx`]).
    type Tx: Send;
    /// A pooled connection outside any transaction, reading committed state.
    type Reader: std::ops::DerefMut<Target = Self::Conn> + Send;

    /// The store's clock in milliseconds, as an SQL expression.
    const NOW_MS: &'static str;

    /// The 64-bit integer type a `CAST` names.
    const BIGINT: &'static str;

    /// The row's columns.
    fn columns(row: &Self::Row) -> impl Columns + '_;

    /// The external lease layer, if the store has one.
    fn leases(&self) -> Option<&dyn LeaseLayer>;

    /// [`Run::leases`], owned: for work that may outlive the step (a lease
    /// given back after the step was dropped).
    fn shared_leases(&self) -> Option<std::sync::Arc<dyn LeaseLayer>>;

    /// The store's configuration.
    fn config(&self) -> &Config;

    /// An open transaction's connection, for the shared statements.
    fn conn(tx: &mut Self::Tx) -> &mut Self::Conn;

    /// Commits `tx`.
    ///
    /// # Errors
    /// The driver's, mapped.
    async fn commit(&self, tx: Self::Tx) -> Result<()>;

    /// A connection of the pool reads run on ([`On::Read`]).
    ///
    /// # Errors
    /// `store_unavailable` when none can be had in time.
    async fn reader(&self) -> Result<Self::Reader>;

    /// Gives a reader back to its pool once its statements were all
    /// answered; dropped instead, it may be closed ([`crate::tx::Held`]).
    fn release(reader: Self::Reader);

    /// Gives up a transaction whose statements were all answered and that
    /// wrote nothing to keep ([`crate::tx::Tx::abandon`]); dropped instead,
    /// it may be closed.
    fn abandon(tx: Self::Tx);

    /// Runs the statement; the rows it changed.
    async fn execute(&self, on: On<'_, Self::Conn>, statement: Statement<'_>) -> Result<u64>;

    /// Runs the statement; the rows it returned.
    async fn fetch(
        &self,
        on: On<'_, Self::Conn>,
        statement: Statement<'_>,
    ) -> Result<Vec<Self::Row>>;

    /// Runs the statement; its first row, if any.
    async fn fetch_optional(
        &self,
        on: On<'_, Self::Conn>,
        statement: Statement<'_>,
    ) -> Result<Option<Self::Row>> {
        Ok(self.fetch(on, statement).await?.into_iter().next())
    }

    /// Runs the statement; its one row.
    ///
    /// # Errors
    /// `corrupt` when it returned none.
    async fn fetch_one(
        &self,
        on: On<'_, Self::Conn>,
        statement: Statement<'_>,
    ) -> Result<Self::Row> {
        let what = statement.sql().chars().take(60).collect::<String>();
        self.fetch_optional(on, statement)
            .await?
            .ok_or_else(|| Error::corrupt(format!("no row from `{what}…`")))
    }

    /// The store's clock.
    async fn now_ms(&self) -> Result<i64> {
        let row = self
            .fetch_one(
                On::Read,
                Statement::new(format!("SELECT {} AS now_ms", Self::NOW_MS)),
            )
            .await?;
        let now = Self::columns(&row).int_required("now_ms");
        now
    }
}

/// Implements [`Run`] for a store's crate-private wrapper (a tuple struct
/// of the store, which has `config` and `leases` fields), once for every
/// sqlx driver: `render` is [`numbered`] or [`positional`]; `read` and
/// `write` the pools a read and an autocommit write outside a transaction
/// run on; `after_cut` what becomes of a connection whose statement was cut
/// off ([`crate::tx::AfterCut`]).
#[macro_export]
macro_rules! impl_run {
    (
        $wrapper:ident, db = $db:ty, conn = $conn:ty, row = $row:ty, cols = $cols:path,
        now = $now:expr, bigint = $bigint:literal, errors = $map_err:path, render = $render:path,
        read = |$store:ident| $read:expr, write = |$wstore:ident| $write:expr,
        after_cut = $after_cut:expr $(,)?
    ) => {
        #[$crate::async_trait]
        impl $crate::query::Run for $wrapper<'_> {
            type Conn = $conn;
            type Row = $row;
            type Tx = $crate::tx::Tx<$db>;
            type Reader = $crate::tx::Held<$db>;

            const NOW_MS: &'static str = $now;
            const BIGINT: &'static str = $bigint;

            fn columns(row: &$row) -> impl $crate::rows::Columns + '_ {
                $cols(row)
            }

            fn leases(&self) -> Option<&dyn agentgate_core::lease::LeaseLayer> {
                self.0.leases.as_deref()
            }

            fn shared_leases(
                &self,
            ) -> Option<std::sync::Arc<dyn agentgate_core::lease::LeaseLayer>> {
                self.0.leases.clone()
            }

            fn config(&self) -> &agentgate_core::config::Config {
                &self.0.config
            }

            fn conn(tx: &mut Self::Tx) -> &mut $conn {
                tx
            }

            async fn commit(&self, tx: Self::Tx) -> agentgate_core::error::Result<()> {
                tx.commit().await.map_err($map_err)
            }

            fn release(reader: Self::Reader) {
                reader.release();
            }

            fn abandon(tx: Self::Tx) {
                tx.abandon();
            }

            async fn reader(&self) -> agentgate_core::error::Result<Self::Reader> {
                let $store = self.0;
                $crate::tx::Held::acquire($read, $after_cut)
                    .await
                    .map_err($map_err)
            }

            async fn execute(
                &self,
                on: $crate::query::On<'_, $conn>,
                statement: $crate::query::Statement<'_>,
            ) -> agentgate_core::error::Result<u64> {
                let (sql, args) = $render(&statement)?;
                let query = $crate::query::bind_all::<$db>(sqlx::query(&sql), &args);
                let pool = match on {
                    $crate::query::On::Read => {
                        let $store = self.0;
                        $read
                    }
                    $crate::query::On::Write => {
                        let $wstore = self.0;
                        $write
                    }
                    $crate::query::On::Conn(conn) => {
                        let done = query.execute(conn).await.map_err($map_err)?;
                        return Ok(done.rows_affected());
                    }
                };
                let mut held = $crate::tx::Held::acquire(pool, $after_cut)
                    .await
                    .map_err($map_err)?;
                let done = query.execute(&mut *held).await.map_err($map_err);
                if done.as_ref().err().is_none_or($crate::tx::answered) {
                    held.release();
                }
                Ok(done?.rows_affected())
            }

            async fn fetch(
                &self,
                on: $crate::query::On<'_, $conn>,
                statement: $crate::query::Statement<'_>,
            ) -> agentgate_core::error::Result<Vec<$row>> {
                let (sql, args) = $render(&statement)?;
                let query = $crate::query::bind_all::<$db>(sqlx::query(&sql), &args);
                let pool = match on {
                    $crate::query::On::Read => {
                        let $store = self.0;
                        $read
                    }
                    $crate::query::On::Write => {
                        let $wstore = self.0;
                        $write
                    }
                    $crate::query::On::Conn(conn) => {
                        return query.fetch_all(conn).await.map_err($map_err);
                    }
                };
                let mut held = $crate::tx::Held::acquire(pool, $after_cut)
                    .await
                    .map_err($map_err)?;
                let rows = query.fetch_all(&mut *held).await.map_err($map_err);
                if rows.as_ref().err().is_none_or($crate::tx::answered) {
                    held.release();
                }
                rows
            }
        }
    };
}

/// Binds `args` to `query` in order.
pub fn bind_all<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    args: &[Arg<'q>],
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    args.iter().fold(query, |query, arg| match *arg {
        Arg::Int(value) => query.bind(value),
        Arg::OptInt(value) => query.bind(value),
        Arg::Text(value) => query.bind(value),
        Arg::OptText(value) => query.bind(value),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positional_repeats_an_argument_used_twice_and_skips_literals() {
        let statement = Statement::new(
            "SELECT '$1', JSON_EXTRACT(x, '$.code') FROM t WHERE a = $2 OR (a = $2 AND b > $1) LIMIT $3",
        )
        .text("id")
        .int(7)
        .int(10);
        let (sql, args) = positional(&statement).unwrap();
        assert_eq!(
            sql,
            "SELECT '$1', JSON_EXTRACT(x, '$.code') FROM t WHERE a = ? OR (a = ? AND b > ?) LIMIT ?"
        );
        let shown: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
        assert_eq!(shown, ["Int(7)", "Int(7)", "Text(\"id\")", "Int(10)"]);
    }

    #[test]
    fn positional_refuses_a_placeholder_with_no_argument() {
        let statement = Statement::new("SELECT $2").int(1);
        let error = positional(&statement).unwrap_err();
        assert!(
            error.to_string().contains("corrupt row: placeholder $2"),
            "{error}"
        );
    }
}
