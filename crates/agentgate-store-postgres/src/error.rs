//! PostgreSQL and sqlx errors mapped to the engine's portable [`Error`], and
//! which of them mark a transient conflict for the shared retry.
//!
//! Every driver failure is `store_unavailable`. A few SQLSTATEs mean "another
//! transaction got in the way; the same step run again will go through":
//! `40001` (serialization failure), `40P01` (deadlock detected), `23505`
//! (unique violation: two steps inserted the same key at once) and `55P03`
//! (our `lock_timeout` fired). Those are wrapped in [`agentgate_core::retry::Conflict`] and the whole
//! step is run again, in a new transaction, at most
//! [`agentgate_core::limits::MAX_STORE_RETRIES`] times. Each of them aborts the transaction before it
//! commits, so a retry never repeats a committed write. An I/O error is *not*
//! retried: it may have hit the `COMMIT` after the server applied it.

use agentgate_core::error::Error;
use agentgate_store_sql::retry::map_driver_error;

/// SQLSTATEs after which the step is run again.
const CONFLICT_CODES: &[&str] = &["40001", "40P01", "23505", "55P03"];

/// Maps a sqlx error to `store_unavailable`, keeping the source for logs and
/// marking transient conflicts for the shared retry (`agentgate_store_sql::Retry`).
pub(crate) fn map_sqlx(error: sqlx::Error) -> Error {
    map_driver_error(error, |db| {
        db.code()
            .is_some_and(|code| CONFLICT_CODES.contains(&code.as_ref()))
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
