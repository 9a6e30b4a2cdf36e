//! SQLite and sqlx errors mapped to the engine's portable [`Error`].
//!
//! Every driver failure is `store_unavailable`: the protocol's own refusals
//! are decided before any write, inside the `IMMEDIATE` transaction, so a
//! constraint violation here is a bug or a foreign writer, not a race to
//! report as a conflict. SQLITE_BUSY after the busy timeout means another
//! process holds the write lock too long; the caller may retry.

use agentgate_core::error::Error;

/// Maps a sqlx error to `store_unavailable`, keeping the source for logs.
pub(crate) fn map_sqlx(error: sqlx::Error) -> Error {
    Error::store(error)
}

/// Whether `error` is SQLite's "database is locked / busy" (SQLITE_BUSY and
/// its extended codes), which a retry may get past.
pub(crate) fn is_busy(error: &Error) -> bool {
    let Error::StoreUnavailable(source) = error else {
        return false;
    };
    match source.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(db)) => db
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == SQLITE_BUSY || code & 0xff == SQLITE_LOCKED),
        _ => false,
    }
}

/// SQLite's primary result code for a lock held by another connection.
const SQLITE_BUSY: i32 = 5;

/// SQLite's primary result code for a lock conflict within one connection's
/// shared cache.
const SQLITE_LOCKED: i32 = 6;
