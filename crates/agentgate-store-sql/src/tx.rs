//! A step's transaction that never goes back to the pool open.
//!
//! sqlx's own `Transaction` counts a transaction as open only once its
//! `BEGIN` was answered. A step dropped while its `BEGIN` is on the wire
//! (a client that hung up, a caller's `timeout`) therefore left the
//! connection inside a transaction the pool did not know about, and the
//! next step that borrowed the connection ran its writes inside it: they
//! were answered, then rolled back or never committed (upstream sqlx issues
//! #2054 and #4393). The pool's release ping does not look at the
//! transaction status either.
//!
//! [`Tx`] counts the transaction open from before its `BEGIN` is sent until
//! its `COMMIT` or `ROLLBACK` is answered. Dropped open after the driver
//! counted its `BEGIN` (an error path, or a cut mid-statement), the driver's
//! own rollback is queued, as sqlx's `Transaction` does. Dropped while the
//! driver had not counted it (cut mid-`BEGIN`), the connection goes to a
//! background task that lets the driver drain the answer still on the wire,
//! then ends whatever transaction the server has, and gives the connection
//! back to the pool only once that is answered, within [`ROLLBACK_BOUND`];
//! otherwise the connection is closed and counted
//! ([`Hygiene::poisoned_closed`]). So a pooled connection is never handed
//! out inside a transaction, whatever the driver does.
//!
//! That recovery needs a driver whose protocol state survives a cut, and
//! sqlx's MySQL driver (0.8.6) does not: it records a statement's pending
//! answer before the statement is sent, and a cut while a statement is
//! being prepared leaves part of the prepare's answer unread. The next use
//! of such a connection (sqlx's own return-to-pool ping first, which has no
//! time bound) then waits for an answer that never comes, and the pool
//! loses the connection for good. A store says which recovery its driver
//! can take ([`AfterCut`]): MySQL's step connections dropped open are
//! closed (see [`close_cut`]), never pooled again, unless the step gave
//! them up with every statement answered ([`Tx::abandon`]);
//! and a statement it runs on the pool outside a transaction holds its
//! connection through [`Held`], which closes it when cut off.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, TransactionManager as _};

/// How long a dropped transaction's `ROLLBACK` may take (the driver first
/// drains an answer still in flight, which waits for its statement's own
/// lock timeout) before its connection is closed instead of reused.
pub const ROLLBACK_BOUND: Duration = Duration::from_secs(10);

/// What happened to transactions dropped open, process-wide (exported as
/// metrics by the service).
#[derive(Debug, Default)]
pub struct Hygiene {
    rolled_back: AtomicU64,
    poisoned_closed: AtomicU64,
}

impl Hygiene {
    /// Transactions dropped open whose connection was rolled back and
    /// returned to its pool.
    pub fn rolled_back(&self) -> u64 {
        self.rolled_back.load(Ordering::Relaxed)
    }

    /// Connections closed instead of pooled again: their transaction
    /// could not be ended (its `ROLLBACK` failed or took past
    /// [`ROLLBACK_BOUND`], or no runtime was left to send it), or their
    /// driver cannot take a cut ([`AfterCut::Close`]) and they were dropped
    /// inside a transaction or a statement.
    pub fn poisoned_closed(&self) -> u64 {
        self.poisoned_closed.load(Ordering::Relaxed)
    }
}

/// The process-wide counters of every SQL store.
pub static HYGIENE: Hygiene = Hygiene {
    rolled_back: AtomicU64::new(0),
    poisoned_closed: AtomicU64::new(0),
};

/// A driver's way to send one text query (a `ROLLBACK` the driver does not
/// know it needs) on its connection; each store supplies its own, written
/// for its concrete connection type.
pub type RawSql<DB> = for<'c> fn(
    &'c mut <DB as Database>::Connection,
    &'static str,
) -> BoxFuture<'c, Result<(), sqlx::Error>>;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What becomes of a step's connection dropped inside its transaction
/// (see the [module documentation](self)).
pub enum AfterCut<DB: Database> {
    /// The transaction is rolled back on the connection, which goes back
    /// to its pool: the driver's protocol state survives a cut (PostgreSQL,
    /// SQLite). `RawSql` sends the `ROLLBACK` the driver does not know it
    /// needs.
    RollBack(RawSql<DB>),
    /// The connection is closed (the server ends whatever it was sent,
    /// then rolls back an open transaction): the driver's protocol state
    /// may not survive a cut (MySQL).
    Close,
}

impl<DB: Database> Clone for AfterCut<DB> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<DB: Database> Copy for AfterCut<DB> {}

/// An open transaction on a pooled connection (see the
/// [module documentation](self)). Derefs to the driver's connection.
pub struct Tx<DB: Database> {
    /// `None` only inside `drop`.
    conn: Option<PoolConnection<DB>>,
    /// From before `BEGIN` is sent until `COMMIT` or `ROLLBACK` is answered.
    open: bool,
    /// Every statement sent was answered ([`Tx::abandon`]): the driver is
    /// in step with the server whatever [`AfterCut`] says.
    settled: bool,
    after_cut: AfterCut<DB>,
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").field("open", &self.open).finish()
    }
}

impl<DB: Database> Tx<DB> {
    /// Takes a connection from `pool` and opens a transaction on it with
    /// `begin` (one text query: `BEGIN` and the settings that go with it);
    /// `after_cut` says what becomes of the connection if the step is cut
    /// off (or fails) before its `COMMIT` is answered.
    ///
    /// # Errors
    /// The driver's; the connection is then rolled back or closed.
    pub async fn begin(
        pool: &Pool<DB>,
        begin: &'static str,
        after_cut: AfterCut<DB>,
    ) -> Result<Self, sqlx::Error> {
        let conn = pool.acquire().await?;
        let mut tx = Self {
            conn: Some(conn),
            open: true,
            settled: false,
            after_cut,
        };
        <DB::TransactionManager>::begin(&mut tx, Some(begin.into())).await?;
        Ok(tx)
    }

    /// Commits. Only an answered `COMMIT` closes the transaction; on an
    /// error (or a drop while it is in flight) the connection is rolled
    /// back or closed.
    ///
    /// # Errors
    /// The driver's.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        <DB::TransactionManager>::commit(&mut self).await?;
        self.open = false;
        Ok(())
    }

    /// Gives the transaction up once every statement it sent was answered
    /// (a refusal, a replay, an error the server returned: [`answered`]):
    /// it is rolled
    /// back on its connection, which goes back to the pool, whatever
    /// [`AfterCut`] says. The `ROLLBACK` is queued ahead of the
    /// connection's next use, so this costs no round trip now.
    pub fn abandon(mut self) {
        self.settled = true;
    }

    /// Rolls back now (a drop does the same in the background).
    ///
    /// # Errors
    /// The driver's.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        <DB::TransactionManager>::rollback(&mut self).await?;
        self.open = false;
        Ok(())
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.conn
            .as_ref()
            .expect("a step's connection is taken only on drop")
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn
            .as_mut()
            .expect("a step's connection is taken only on drop")
    }
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if !self.open {
            return;
        }
        let raw = match self.after_cut {
            AfterCut::RollBack(raw) => raw,
            AfterCut::Close if self.settled => {
                <DB::TransactionManager>::start_rollback(&mut conn);
                HYGIENE.rolled_back.fetch_add(1, Ordering::Relaxed);
                return;
            }
            AfterCut::Close => {
                close_cut(conn);
                return;
            }
        };
        if <DB::TransactionManager>::get_transaction_depth(&conn) > 0 {
            // The driver knows the transaction: its rollback goes out ahead
            // of the connection's next use, as sqlx's `Transaction` does.
            <DB::TransactionManager>::start_rollback(&mut conn);
            HYGIENE.rolled_back.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            conn.close_on_drop();
            HYGIENE.poisoned_closed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        runtime.spawn(roll_back(conn, raw));
    }
}

/// A pooled connection lent to statements outside a transaction. Given
/// back with [`Held::release`] once its last statement was answered, it
/// goes back to the pool. Dropped before that (its caller stopped waiting
/// in the middle of a statement, or returned an error), it is closed when
/// its driver cannot take a cut ([`AfterCut::Close`]), and pooled as usual
/// otherwise. Derefs to the driver's connection.
pub struct Held<DB: Database> {
    /// `None` only inside `drop` and after `release`.
    conn: Option<PoolConnection<DB>>,
    close_unless_released: bool,
}

impl<DB: Database> Held<DB> {
    /// Takes a connection from `pool`.
    ///
    /// # Errors
    /// The pool's (`PoolTimedOut` when none is free in time).
    pub async fn acquire(pool: &Pool<DB>, after_cut: AfterCut<DB>) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: Some(pool.acquire().await?),
            close_unless_released: matches!(after_cut, AfterCut::Close),
        })
    }

    /// Gives the connection back to its pool: its statements were all
    /// answered.
    pub fn release(mut self) {
        self.close_unless_released = false;
    }
}

impl<DB: Database> std::fmt::Debug for Held<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").finish_non_exhaustive()
    }
}

impl<DB: Database> Deref for Held<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.conn
            .as_ref()
            .expect("a held connection is taken only on drop")
    }
}

impl<DB: Database> DerefMut for Held<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn
            .as_mut()
            .expect("a held connection is taken only on drop")
    }
}

impl<DB: Database> Drop for Held<DB> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.close_unless_released {
            close_cut(conn);
        }
    }
}

/// Whether a step's error leaves its connection in step with the server:
/// any error but `store_unavailable` (a refusal the decision gave, a
/// conflict or a constraint the server answered). A `store_unavailable`
/// may be a broken or desynchronized connection, so the connection is not
/// given back ([`Tx::abandon`], [`Held::release`]) after one.
pub fn answered(error: &agentgate_core::error::Error) -> bool {
    error.kind() != agentgate_core::error::ErrorKind::StoreUnavailable
}

/// Closes a connection whose driver cannot take a cut
/// ([`AfterCut::Close`]) without reading from it: a driver that lost its
/// place in the protocol may wait forever for an answer, or misread one
/// (sqlx's MySQL driver then panics). Closing cancels nothing on the
/// server: whatever was sent (or still sat in the driver's write buffer,
/// which the close flushes) runs to its end, a `COMMIT` included, and an
/// open transaction is rolled back after it. So the pool may hand out a
/// new connection while the cut statement still runs. That is a
/// concurrent request like any other: a step's writes are conditioned on
/// the rows they find (keys, fences, states), so the cut step and its
/// repeat never both take effect. The exception is an administrator's cap
/// (`set_user_cap`), last writer wins: a cut set may land after a later
/// one, and setting it again settles it.
fn close_cut<DB: Database>(mut conn: PoolConnection<DB>) {
    HYGIENE.poisoned_closed.fetch_add(1, Ordering::Relaxed);
    conn.close_on_drop();
}

/// Ends the transaction a [`Tx`] cut off mid-`BEGIN` may have left on
/// `conn`: a ping first lets the driver drain the `BEGIN`'s answer (and
/// count it, where its worker does: SQLite), then the driver's rollback if
/// it counted one, else a plain `ROLLBACK` for a server that is inside a
/// transaction the driver never counted. Answered within
/// [`ROLLBACK_BOUND`], the connection goes back to its pool; anything else
/// closes it.
fn roll_back<DB: Database>(
    mut conn: PoolConnection<DB>,
    raw: RawSql<DB>,
) -> BoxFuture<'static, ()> {
    Box::pin(async move {
        let end = async {
            sqlx::Connection::ping(&mut *conn).await?;
            if <DB::TransactionManager>::get_transaction_depth(&conn) > 0 {
                <DB::TransactionManager>::rollback(&mut conn).await
            } else {
                raw(&mut conn, "ROLLBACK").await
            }
        };
        let ended = tokio::time::timeout(ROLLBACK_BOUND, end).await;
        if matches!(ended, Ok(Ok(()))) || matches!(&ended, Ok(Err(e)) if no_transaction(e)) {
            HYGIENE.rolled_back.fetch_add(1, Ordering::Relaxed);
        } else {
            tracing::warn!(
                "closing a store connection whose abandoned transaction could not be rolled back"
            );
            conn.close_on_drop();
            HYGIENE.poisoned_closed.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Whether `error` says there was no transaction to roll back (SQLite's
/// answer when the step was cut off before its `BEGIN` ran; PostgreSQL and
/// MySQL answer such a `ROLLBACK` with success): the connection is clean.
fn no_transaction(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|e| e.message().contains("no transaction is active"))
}

/// Writes a store's [`RawSql`] for its concrete connection type:
/// `raw_sql_fn!(raw_sql, sqlx::PgConnection);`.
#[macro_export]
macro_rules! raw_sql_fn {
    ($name:ident, $conn:ty) => {
        /// One text query on a connection: the `ROLLBACK` of a step's
        /// transaction cut off mid-`BEGIN` (see
        /// [`agentgate_store_sql::tx`]).
        fn $name<'c>(
            conn: &'c mut $conn,
            sql: &'static str,
        ) -> $crate::tx::BoxFuture<'c, ::std::result::Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::Executor::execute(conn, sqlx::raw_sql(sql)).await?;
                Ok(())
            })
        }
    };
}
