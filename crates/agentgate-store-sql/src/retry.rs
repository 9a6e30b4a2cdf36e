//! The bounded re-run of a protocol step after a transient conflict with
//! another transaction (deadlock, serialization failure, lock timeout).
//!
//! A store marks such errors with [`Error::conflict`] when it maps its
//! driver's errors; the schedule itself ([`should_retry`], [`backoff`]) is
//! the core's. Each re-run is a new transaction, so a retry never repeats a
//! committed write.

use agentgate_core::error::{Error, Result};
use agentgate_core::retry::{backoff, should_retry};
use tokio::time::Instant;

/// The retry budget of one protocol step: at most
/// [`agentgate_core::limits::MAX_STORE_RETRIES`] re-runs, and none once the
/// step has spent [`agentgate_core::limits::STORE_ACQUIRE_TIMEOUT`].
#[derive(Debug)]
pub struct Retry {
    retries: u32,
    started: Instant,
}

impl Default for Retry {
    fn default() -> Self {
        Self::new()
    }
}

impl Retry {
    /// A fresh budget, its clock starting now.
    pub fn new() -> Self {
        Self {
            retries: 0,
            started: Instant::now(),
        }
    }

    /// Takes a failed run of the step: `Ok(())` after a backoff means "run
    /// it again"; `Err` is the step's answer.
    ///
    /// # Errors
    /// `error` itself when it is not a conflict or the budget is spent.
    pub async fn after(&mut self, error: Error) -> Result<()> {
        if !should_retry(&error, self.retries, self.started.elapsed()) {
            return Err(error);
        }
        self.retries += 1;
        tracing::debug!(retry = self.retries, %error, "running a store step again");
        tokio::time::sleep(backoff(self.retries)).await;
        Ok(())
    }
}

/// A driver error as the engine's: `conflict` (run the step again) when the
/// database error is one `is_conflict` names, else `store_unavailable`;
/// the source is kept for logs.
pub fn map_driver_error(
    error: sqlx::Error,
    is_conflict: impl FnOnce(&dyn sqlx::error::DatabaseError) -> bool,
) -> Error {
    if error.as_database_error().is_some_and(is_conflict) {
        Error::conflict(error)
    } else {
        Error::store(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentgate_core::limits::MAX_STORE_RETRIES;

    #[tokio::test]
    async fn retry_gives_up_after_the_bound() {
        let mut retry = Retry::new();
        for _ in 0..MAX_STORE_RETRIES {
            retry
                .after(Error::conflict("deadlock"))
                .await
                .expect("within the bound");
        }
        let last = retry.after(Error::conflict("deadlock")).await;
        assert!(last.is_err());
        let other = Retry::new().after(Error::PayloadMismatch).await;
        assert!(matches!(other, Err(Error::PayloadMismatch)));
    }
}
