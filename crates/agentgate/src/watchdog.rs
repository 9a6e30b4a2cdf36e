//! The watchdog: renews a turn's lease every TTL/3 and fires the turn's
//! cancellation signal the moment the lease is lost, or when it could not be
//! renewed and its local deadline is near.
//!
//! The local deadline is measured from when a renewal was *sent* (monotonic
//! clock), so it is never later than the store's expiry; the signal fires a
//! safety margin before it, so a holder stops before anyone can take over.

use agentgate_core::limits::RETRY_DIVISOR;
use agentgate_core::limits::SAFETY_MARGIN_DIVISOR;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentgate_core::error::{ErrorKind, Result};
use agentgate_core::ids::TurnId;
use agentgate_core::model::LeaseRef;
use agentgate_core::store::{LeaseStatus, Store};
use tokio::sync::watch;
use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::sync::CancellationToken;

/// The watchdog of one turn. Dropping it stops it.
#[derive(Debug)]
pub(crate) struct Watchdog {
    stop: CancellationToken,
    /// The instant the watchdog will give up at, moved on by each renewal:
    /// how long the holder may still act on the lease (an ending's retries
    /// stop there).
    give_up_at: watch::Receiver<Instant>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Watchdog {
    /// Starts renewing `lease`, granted at `granted_at` (local instant taken
    /// before the grant was requested) for `lease_ttl`.
    pub(crate) fn spawn(
        store: Arc<dyn Store>,
        lease: LeaseRef,
        lease_ttl: Duration,
        granted_at: Instant,
        lease_expires_in: Duration,
        lost: CancellationToken,
        cancel: CancelSignal,
    ) -> Self {
        let stop = CancellationToken::new();
        let task_stop = stop.clone();
        let (publish, give_up_at) = watch::channel(deadline(
            granted_at,
            lease_expires_in,
            lease_ttl / SAFETY_MARGIN_DIVISOR,
        ));
        tokio::spawn(async move {
            let heartbeat = || store.heartbeat(&lease);
            let schedule = Schedule {
                lease_ttl,
                granted_at,
                lease_expires_in,
            };
            tokio::select! {
                // Stop first: a watchdog stopped in the instant its renewal
                // fell due sends no heartbeat for an ended turn, and the
                // order does not depend on select!'s random draw (the
                // simulation replays a seed exactly).
                biased;
                () = task_stop.cancelled() => {}
                () = renew(heartbeat, &lease.turn_id, schedule, (&lost, &cancel), &publish) => {}
            }
        });
        Self { stop, give_up_at }
    }

    /// The local instant after which this holder must not count on its lease.
    pub(crate) fn give_up_at(&self) -> Instant {
        *self.give_up_at.borrow()
    }
}

/// When a lease granted or renewed by a request sent at `sent_at` for
/// `expires_in` is given up: `margin` before its local deadline.
fn deadline(sent_at: Instant, expires_in: Duration, margin: Duration) -> Instant {
    (sent_at + expires_in)
        .checked_sub(margin)
        .unwrap_or(sent_at)
}

/// The lease the watchdog starts from.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    lease_ttl: Duration,
    granted_at: Instant,
    lease_expires_in: Duration,
}

/// How a holder learns of a cancel request: the flag it reads, and the
/// signal its work stops on. The lease stays renewed: the holder still has
/// to end the turn.
#[derive(Clone, Debug)]
pub(crate) struct CancelSignal {
    pub(crate) requested: Arc<AtomicBool>,
    pub(crate) stop: CancellationToken,
}

impl CancelSignal {
    /// Records the request and fires the stop signal (once).
    pub(crate) fn fire(&self) {
        if !self.requested.swap(true, Ordering::SeqCst) {
            self.stop.cancel();
        }
    }
}

/// The turns a [`crate::Gate`] holds in this process, by id and fence, so
/// a cancel requested through that gate reaches a local holder at once;
/// a holder elsewhere learns it on its next heartbeat. An entry lives as
/// long as its `Turn`, so the map holds at most the live turns.
#[derive(Clone, Debug, Default)]
pub(crate) struct LocalTurns(
    Arc<std::sync::Mutex<std::collections::HashMap<(String, i64), CancelSignal>>>,
);

impl LocalTurns {
    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<(String, i64), CancelSignal>> {
        // A panic while holding this lock leaves the map consistent (every
        // operation is one insert, remove or read), so a poisoned lock is used.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn add(&self, turn_id: &TurnId, fence: i64, signal: CancelSignal) {
        self.map()
            .insert((turn_id.as_str().to_owned(), fence), signal);
    }

    pub(crate) fn remove(&self, turn_id: &TurnId, fence: i64) {
        self.map().remove(&(turn_id.as_str().to_owned(), fence));
    }

    /// Signals every local holder of `turn_id` (the store recorded the
    /// request first, so the flag is true).
    pub(crate) fn fire(&self, turn_id: &TurnId) {
        for ((id, _), signal) in self.map().iter() {
            if id == turn_id.as_str() {
                signal.fire();
            }
        }
    }
}

/// Renews by calling `heartbeat` every TTL/3 until the lease is lost or its
/// deadline passes, then fires `lost`; a renewal that reports a cancel
/// request fires `cancel` and goes on renewing. Publishes each new give-up
/// instant.
async fn renew<F, Fut>(
    mut heartbeat: F,
    turn_id: &TurnId,
    schedule: Schedule,
    (lost, cancel): (&CancellationToken, &CancelSignal),
    publish: &watch::Sender<Instant>,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<LeaseStatus>>,
{
    let period = schedule.lease_ttl / 3;
    let margin = schedule.lease_ttl / SAFETY_MARGIN_DIVISOR;
    let retry = schedule.lease_ttl / RETRY_DIVISOR;
    let mut sent_at = schedule.granted_at;
    let mut expires_in = schedule.lease_expires_in;
    let mut next = sent_at + period;
    loop {
        let give_up_at = deadline(sent_at, expires_in, margin);
        publish.send_replace(give_up_at);
        if next >= give_up_at {
            next = give_up_at;
        }
        sleep_until(next).await;
        let attempt_at = Instant::now();
        if attempt_at >= give_up_at {
            tracing::warn!(%turn_id, "lease could not be renewed before its deadline; cancelling turn");
            lost.cancel();
            return;
        }
        match timeout_at(give_up_at, heartbeat()).await {
            Ok(Ok(status)) => {
                if status.cancel_requested && !cancel.requested.load(Ordering::SeqCst) {
                    tracing::info!(%turn_id, "a cancel was requested; signalling the turn");
                    cancel.fire();
                }
                sent_at = attempt_at;
                expires_in =
                    Duration::from_millis(u64::try_from(status.lease_expires_in_ms).unwrap_or(0));
                next = sent_at + period;
            }
            Ok(Err(error))
                if matches!(error.kind(), ErrorKind::LeaseLost | ErrorKind::NotFound) =>
            {
                tracing::warn!(%turn_id, %error, "lease lost; cancelling turn");
                lost.cancel();
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(%turn_id, %error, "heartbeat failed; retrying");
                next = Instant::now() + retry;
            }
            Err(_elapsed) => next = Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The deadline arithmetic, on tokio's paused clock: every instant below
    //! is exact, because the scripted heartbeats answer without I/O and the
    //! clock only jumps from timer to timer.
    #![allow(clippy::unwrap_used)]
    use std::future::pending;
    use std::sync::Mutex;

    use agentgate_core::error::Error;

    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    /// What one run of the watchdog did.
    #[derive(Debug)]
    struct Run {
        /// When each heartbeat was sent, from the grant.
        sent: Vec<Duration>,
        /// When the cancellation signal fired, from the grant.
        cancelled: Option<Duration>,
        /// The last give-up instant published, from the grant.
        give_up: Duration,
        /// Whether a cancel request was signalled.
        cancel_signalled: bool,
    }

    /// Runs the watchdog for at most `limit` on a lease granted now for the
    /// TTL, answering heartbeat number `n` (from 0) with `answer(n)`; `None`
    /// never answers.
    async fn run(answer: impl Fn(usize) -> Option<Result<LeaseStatus>>, limit: Duration) -> Run {
        let granted_at = Instant::now();
        let sent = Mutex::new(Vec::new());
        let lost = CancellationToken::new();
        let (publish, give_up) = watch::channel(granted_at);
        let heartbeat = || {
            let mut sent = sent.lock().unwrap();
            sent.push(granted_at.elapsed());
            let reply = answer(sent.len() - 1);
            async move {
                match reply {
                    Some(reply) => reply,
                    None => pending().await,
                }
            }
        };
        let schedule = Schedule {
            lease_ttl: TTL,
            granted_at,
            lease_expires_in: TTL,
        };
        let turn_id = TurnId::new("t-watchdog").unwrap();
        let cancel = CancelSignal {
            requested: Arc::new(AtomicBool::new(false)),
            stop: lost.child_token(),
        };
        let watched = renew(heartbeat, &turn_id, schedule, (&lost, &cancel), &publish);
        let returned = tokio::time::timeout(limit, watched).await.is_ok();
        let cancelled = lost.is_cancelled().then(|| granted_at.elapsed());
        // The watchdog returns exactly when it cancels.
        assert_eq!(returned, cancelled.is_some());
        let give_up = *give_up.borrow() - granted_at;
        Run {
            sent: sent.into_inner().unwrap(),
            cancelled,
            give_up,
            cancel_signalled: cancel.stop.is_cancelled() && cancel.requested.load(Ordering::SeqCst),
        }
    }

    fn renewed(ms: i64) -> Option<Result<LeaseStatus>> {
        Some(Ok(LeaseStatus {
            lease_expires_in_ms: ms,
            cancel_requested: false,
        }))
    }

    fn secs(list: &[u64]) -> Vec<Duration> {
        list.iter().copied().map(Duration::from_secs).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_ttl() {
        let run = run(|_| renewed(30_000), Duration::from_secs(95)).await;
        assert_eq!(run.sent, secs(&[10, 20, 30, 40, 50, 60, 70, 80, 90]));
        assert_eq!(run.cancelled, None);
        // Last renewal sent at 90 s for 30 s, minus the 6 s margin.
        assert_eq!(run.give_up, Duration::from_secs(114));
    }

    /// A renewal that reports a cancel request signals the turn's holder,
    /// and the lease goes on being renewed: the holder still ends the turn.
    #[tokio::test(start_paused = true)]
    async fn a_cancel_request_signals_the_holder_and_renewals_go_on() {
        let run = run(
            |n| {
                Some(Ok(LeaseStatus {
                    lease_expires_in_ms: 30_000,
                    cancel_requested: n >= 1,
                }))
            },
            Duration::from_secs(45),
        )
        .await;
        assert!(run.cancel_signalled, "{run:?}");
        assert_eq!(run.cancelled, None, "the lease is not lost");
        assert_eq!(run.sent, secs(&[10, 20, 30, 40]));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_renewals_cancel_a_safety_margin_before_the_local_deadline() {
        let run = run(|_| Some(Err(Error::store("down"))), Duration::from_secs(60)).await;
        // First renewal at TTL/3, then a retry every TTL/10, none past the
        // give-up instant: the TTL minus a fifth of it.
        assert_eq!(run.sent, secs(&[10, 13, 16, 19, 22]));
        assert_eq!(run.cancelled, Some(Duration::from_secs(24)));
        assert_eq!(run.give_up, Duration::from_secs(24));
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_runs_from_when_the_last_renewal_was_sent() {
        let run = run(
            |n| {
                if n == 0 {
                    renewed(30_000)
                } else {
                    Some(Err(Error::store("down")))
                }
            },
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(run.sent, secs(&[10, 20, 23, 26, 29, 32]));
        assert_eq!(run.cancelled, Some(Duration::from_secs(10 + 30 - 6)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_stores_remaining_lease_sets_the_deadline_not_the_ttl() {
        // The store says only 12 s are left (its clock, not ours): give up
        // at 10 + 12 - 6 s, before the next renewal would be due.
        let run = run(
            |n| {
                if n == 0 {
                    renewed(12_000)
                } else {
                    renewed(30_000)
                }
            },
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(run.sent, secs(&[10]));
        assert_eq!(run.cancelled, Some(Duration::from_secs(16)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_cancels_at_once() {
        let run = run(
            |n| {
                if n < 2 {
                    renewed(30_000)
                } else {
                    Some(Err(Error::LeaseLost {
                        reason: "taken over",
                    }))
                }
            },
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(run.sent, secs(&[10, 20, 30]));
        assert_eq!(run.cancelled, Some(Duration::from_secs(30)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_renewal_is_cut_at_the_give_up_instant() {
        let run = run(|_| None, Duration::from_secs(60)).await;
        assert_eq!(run.sent, secs(&[10]));
        assert_eq!(run.cancelled, Some(Duration::from_secs(24)));
    }
}
