//! MySQL/MariaDB and sqlx errors mapped to the engine's portable [`Error`],
//! and the bounded retry of a protocol step after a transient conflict.
//!
//! Every driver failure is `store_unavailable`. A few server error numbers
//! mean "another transaction got in the way; the same step run again will go
//! through": 1213 (deadlock; InnoDB rolled the transaction back), 1205 (lock
//! wait timeout), 1062 (duplicate key: two steps inserted the same key at
//! once) and 1020 (MariaDB's snapshot-isolation "record has changed"). Those
//! are wrapped in [`Conflict`] and the whole step is run again, in a new
//! transaction, at most [`MAX_STORE_RETRIES`] times. Each of them fails a
//! statement before `COMMIT`, and the step's transaction is rolled back, so a
//! retry never repeats a committed write. An I/O error is *not* retried: it
//! may have hit the `COMMIT` after the server applied it.

use std::time::Duration;

use agentgate_core::error::{Error, Result};
use agentgate_core::limits::{MAX_STORE_RETRIES, STORE_ACQUIRE_TIMEOUT};
use sqlx::mysql::MySqlDatabaseError;
use tokio::time::Instant;

/// Server error numbers after which the step is run again.
const CONFLICT_ERRORS: &[u16] = &[1213, 1205, 1062, 1020];

/// First backoff before a retry; doubled per retry. A deadlock victim's
/// rival commits within a few milliseconds.
const RETRY_BACKOFF_FIRST: Duration = Duration::from_millis(2);

/// Longest backoff between two retries, so that eight retries stay well
/// under a second of waiting.
const RETRY_BACKOFF_MAX: Duration = Duration::from_millis(100);

/// A transient conflict with another transaction; the step may be run again.
#[derive(Debug, thiserror::Error)]
#[error("transient conflict with another transaction: {0}")]
pub(crate) struct Conflict(#[source] sqlx::Error);

/// Maps a sqlx error to `store_unavailable`, keeping the source for logs and
/// marking transient conflicts for [`Retry`].
pub(crate) fn map_sqlx(error: sqlx::Error) -> Error {
    let conflict = error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|e| CONFLICT_ERRORS.contains(&e.number()));
    if conflict {
        Error::store(Conflict(error))
    } else {
        Error::store(error)
    }
}

/// Whether `error` is a transient conflict worth running the step again for.
pub(crate) fn is_conflict(error: &Error) -> bool {
    matches!(error, Error::StoreUnavailable(source) if source.is::<Conflict>())
}

/// A stored value the schema does not allow (a bug or a foreign writer).
pub(crate) fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::store(format!("corrupt row: {what}"))
}

/// The retry budget of one protocol step: at most [`MAX_STORE_RETRIES`]
/// re-runs, and none once the step has spent [`STORE_ACQUIRE_TIMEOUT`].
pub(crate) struct Retry {
    retries: u32,
    started: Instant,
}

impl Retry {
    pub(crate) fn new() -> Self {
        Self {
            retries: 0,
            started: Instant::now(),
        }
    }

    /// Takes a failed run of the step: `Ok(())` after a backoff means "run
    /// it again"; `Err` is the step's answer.
    pub(crate) async fn after(&mut self, error: Error) -> Result<()> {
        if !is_conflict(&error)
            || self.retries >= MAX_STORE_RETRIES
            || self.started.elapsed() >= STORE_ACQUIRE_TIMEOUT
        {
            return Err(error);
        }
        self.retries += 1;
        tracing::debug!(retry = self.retries, %error, "running a store step again");
        tokio::time::sleep(backoff(self.retries)).await;
        Ok(())
    }
}

/// Exponential backoff with jitter in its upper half, so that two steps that
/// deadlocked do not collide again in lockstep.
fn backoff(retry: u32) -> Duration {
    let ceiling = RETRY_BACKOFF_FIRST
        .saturating_mul(1 << retry.saturating_sub(1).min(16))
        .min(RETRY_BACKOFF_MAX);
    let mut byte = [0u8; 1];
    let jitter = if getrandom::fill(&mut byte).is_ok() {
        f64::from(byte[0]) / 255.0
    } else {
        1.0
    };
    ceiling.mul_f64(0.5 + jitter / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        assert!(backoff(1) <= RETRY_BACKOFF_FIRST);
        assert!(backoff(1) >= RETRY_BACKOFF_FIRST / 2);
        assert!(backoff(MAX_STORE_RETRIES) <= RETRY_BACKOFF_MAX);
        assert!(backoff(u32::MAX) <= RETRY_BACKOFF_MAX);
    }

    #[test]
    fn only_conflicts_are_retryable() {
        assert!(!is_conflict(&Error::store("boom")));
        assert!(!is_conflict(&Error::LeaseLost { reason: "x" }));
        assert!(is_conflict(&Error::store(Conflict(
            sqlx::Error::PoolTimedOut
        ))));
    }

    #[tokio::test]
    async fn retry_gives_up_after_the_bound() {
        let mut retry = Retry::new();
        for _ in 0..MAX_STORE_RETRIES {
            retry
                .after(Error::store(Conflict(sqlx::Error::PoolTimedOut)))
                .await
                .expect("within the bound");
        }
        let last = retry
            .after(Error::store(Conflict(sqlx::Error::PoolTimedOut)))
            .await;
        assert!(last.is_err());
        let other = Retry::new().after(Error::PayloadMismatch).await;
        assert!(matches!(other, Err(Error::PayloadMismatch)));
    }
}
