//! Running a tool's side effect inside the SQL transaction that marks the
//! tool execution succeeded.
//!
//! When the effect lives in the same database as agentgate's records (a
//! ledger entry, an order row), the effect and the success mark commit
//! together or not at all: exactly once, even across crashes and takeovers.
//! The store hands its native connection to the closure as a [`SqlTx`].

use std::any::Any;

use agentgate_core::error::BoxError;
use agentgate_core::store::{BoxFuture, SqlEffect};
use serde_json::Value;

/// The store's connection with the transaction open. Write your side effect
/// with it; do not commit or roll back (the store does).
#[non_exhaustive]
pub enum SqlTx<'c> {
    /// An embedded SQLite store.
    #[cfg(feature = "sqlite")]
    Sqlite(&'c mut sqlx::SqliteConnection),
    /// A PostgreSQL store.
    #[cfg(feature = "postgres")]
    Postgres(&'c mut sqlx::PgConnection),
    /// A MySQL or MariaDB store.
    #[cfg(feature = "mysql")]
    MySql(&'c mut sqlx::MySqlConnection),
    #[doc(hidden)]
    _Unreachable(
        std::marker::PhantomData<&'c mut ()>,
        std::convert::Infallible,
    ),
}

impl std::fmt::Debug for SqlTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(_) => f.write_str("SqlTx::Sqlite"),
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => f.write_str("SqlTx::Postgres"),
            #[cfg(feature = "mysql")]
            Self::MySql(_) => f.write_str("SqlTx::MySql"),
            Self::_Unreachable(_, never) => match *never {},
        }
    }
}

impl<'c> SqlTx<'c> {
    fn from_any(connection: &'c mut (dyn Any + Send)) -> Result<Self, BoxError> {
        #[cfg(feature = "sqlite")]
        if connection.is::<sqlx::SqliteConnection>() {
            let conn = connection
                .downcast_mut::<sqlx::SqliteConnection>()
                .expect("checked by is::<SqliteConnection>()");
            return Ok(Self::Sqlite(conn));
        }
        #[cfg(feature = "postgres")]
        if connection.is::<sqlx::PgConnection>() {
            let conn = connection
                .downcast_mut::<sqlx::PgConnection>()
                .expect("checked by is::<PgConnection>()");
            return Ok(Self::Postgres(conn));
        }
        #[cfg(feature = "mysql")]
        if connection.is::<sqlx::MySqlConnection>() {
            let conn = connection
                .downcast_mut::<sqlx::MySqlConnection>()
                .expect("checked by is::<MySqlConnection>()");
            return Ok(Self::MySql(conn));
        }
        let _ = connection;
        Err("this store keeps no SQL transaction a side effect can join".into())
    }
}

/// Adapts a closure to the store's [`SqlEffect`].
pub(crate) struct ClosureEffect<F>(pub(crate) Option<F>);

impl<F> SqlEffect for ClosureEffect<F>
where
    F: for<'c> FnOnce(SqlTx<'c>) -> BoxFuture<'c, Result<Value, BoxError>> + Send,
{
    fn apply<'a>(
        &'a mut self,
        connection: &'a mut (dyn Any + Send),
    ) -> BoxFuture<'a, Result<Value, BoxError>> {
        let Some(effect) = self.0.take() else {
            return Box::pin(async { Err("a side effect is applied at most once".into()) });
        };
        match SqlTx::from_any(connection) {
            Ok(tx) => effect(tx),
            Err(error) => Box::pin(async move { Err(error) }),
        }
    }
}
