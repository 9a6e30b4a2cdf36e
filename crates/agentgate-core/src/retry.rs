//! The retry schedule of a protocol step after a transient conflict with
//! another transaction (deadlock, serialization failure, lock timeout).
//!
//! Pure: a store marks conflicts with [`Error::conflict`], asks
//! [`should_retry`] with its own count and elapsed time, and sleeps for
//! [`backoff`] itself. The step is run again in a new transaction.

use std::time::Duration;

use crate::error::{BoxError, Error};
use crate::limits::{MAX_STORE_RETRIES, STORE_ACQUIRE_TIMEOUT};

/// First backoff before a retry; doubled per retry. A deadlock victim's
/// rival commits within a few milliseconds.
pub const RETRY_BACKOFF_FIRST: Duration = Duration::from_millis(2);

/// Longest backoff between two retries, so that [`MAX_STORE_RETRIES`]
/// retries stay well under a second of waiting.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_millis(100);

/// A transient conflict with another transaction; the step may run again.
#[derive(Debug, thiserror::Error)]
#[error("transient conflict with another transaction: {0}")]
pub struct Conflict(#[source] pub BoxError);

impl Error {
    /// A `store_unavailable` that a store may retry: `source` was a
    /// transient conflict that aborted its transaction before commit.
    pub fn conflict(source: impl Into<BoxError>) -> Self {
        Self::store(Conflict(source.into()))
    }

    /// Whether this is a transient conflict worth running the step again for.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::StoreUnavailable(source) if source.is::<Conflict>())
    }
}

/// Whether a step that failed with `error`, after `retries` re-runs and
/// `elapsed` time, should run again: only conflicts, within both bounds.
pub fn should_retry(error: &Error, retries: u32, elapsed: Duration) -> bool {
    error.is_conflict() && retries < MAX_STORE_RETRIES && elapsed < STORE_ACQUIRE_TIMEOUT
}

/// Exponential backoff before re-run number `retry` (from 1), with jitter in
/// its upper half so that two steps that deadlocked do not collide again in
/// lockstep.
pub fn backoff(retry: u32) -> Duration {
    let ceiling = RETRY_BACKOFF_FIRST
        .saturating_mul(1 << retry.saturating_sub(1).min(16))
        .min(RETRY_BACKOFF_MAX);
    let mut byte = [0u8; 1];
    let jitter = if let Some(seeded) = seeded_jitter_byte() {
        f64::from(seeded) / 255.0
    } else if getrandom::fill(&mut byte).is_ok() {
        f64::from(byte[0]) / 255.0
    } else {
        1.0
    };
    ceiling.mul_f64(0.5 + jitter / 2.0)
}

thread_local! {
    /// This thread's seeded jitter state, when a simulation set one.
    static SEEDED_JITTER: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Makes [`backoff`]'s jitter on this thread a fixed sequence drawn from
/// `seed` (`None`: the operating system's randomness again), so a
/// single-threaded simulation on paused time replays exactly.
pub fn seed_jitter(seed: Option<u64>) {
    SEEDED_JITTER.with(|state| state.set(seed));
}

/// The next byte of this thread's seeded jitter (SplitMix64), if seeded.
fn seeded_jitter_byte() -> Option<u8> {
    SEEDED_JITTER.with(|state| {
        let next = state.get()?.wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(Some(next));
        let mut z = next;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Some(((z ^ (z >> 31)) >> 56) as u8)
    })
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
    fn seeded_jitter_repeats_and_unseeds() {
        seed_jitter(Some(7));
        let first: Vec<_> = (1..6).map(backoff).collect();
        seed_jitter(Some(7));
        let second: Vec<_> = (1..6).map(backoff).collect();
        seed_jitter(None);
        assert_eq!(first, second);
        assert!(SEEDED_JITTER.with(std::cell::Cell::get).is_none());
    }

    #[test]
    fn only_conflicts_within_the_bounds_are_retried() {
        let conflict = Error::conflict("deadlock");
        assert!(conflict.is_conflict());
        assert!(!Error::store("boom").is_conflict());
        assert!(!Error::LeaseLost { reason: "x" }.is_conflict());
        assert!(should_retry(&conflict, 0, Duration::ZERO));
        assert!(!should_retry(&conflict, MAX_STORE_RETRIES, Duration::ZERO));
        assert!(!should_retry(&conflict, 0, STORE_ACQUIRE_TIMEOUT));
        assert!(!should_retry(&Error::PayloadMismatch, 0, Duration::ZERO));
    }
}
