//! MySQL/MariaDB and sqlx errors mapped to the engine's portable [`Error`],
//! and which of them mark a transient conflict for the shared retry.
//!
//! Every driver failure is `store_unavailable`. A few server error numbers
//! mean "another transaction got in the way; the same step run again will go
//! through": 1213 (deadlock; InnoDB rolled the transaction back), 1205 (lock
//! wait timeout), 1062 (duplicate key: two steps inserted the same key at
//! once) and 1020 (MariaDB's snapshot-isolation "record has changed"). Those
//! are wrapped in [`agentgate_core::retry::Conflict`] and the whole step is run again, in a new
//! transaction, at most [`agentgate_core::limits::MAX_STORE_RETRIES`] times. Each of them fails a
//! statement before `COMMIT`, and the step's transaction is rolled back, so a
//! retry never repeats a committed write. An I/O error is *not* retried: it
//! may have hit the `COMMIT` after the server applied it.

use agentgate_core::error::Error;
use agentgate_store_sql::retry::map_driver_error;
use sqlx::mysql::MySqlDatabaseError;

/// Server error numbers after which the step is run again.
const CONFLICT_ERRORS: &[u16] = &[1213, 1205, DUPLICATE_KEY, 1020];

/// `ER_DUP_ENTRY`: an insert met an existing unique key.
const DUPLICATE_KEY: u16 = 1062;

/// Maps a sqlx error to `store_unavailable`, keeping the source for logs and
/// marking transient conflicts for the shared retry (`agentgate_store_sql::Retry`).
pub(crate) fn map_sqlx(error: sqlx::Error) -> Error {
    map_driver_error(error, |db| {
        db.try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|e| CONFLICT_ERRORS.contains(&e.number()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_conflict_codes_are_marked_retryable() {
        assert!(!map_sqlx(sqlx::Error::PoolTimedOut).is_conflict());
    }
}
