//! The watchdog: renews a turn's lease every TTL/3 and fires the turn's
//! cancellation signal the moment the lease is lost, or when it could not be
//! renewed and its local deadline is near.
//!
//! The local deadline is measured from when a renewal was *sent* (monotonic
//! clock), so it is never later than the store's expiry; the signal fires a
//! safety margin before it, so a holder stops before anyone can take over.

use std::sync::Arc;
use std::time::Duration;

use agentgate_core::error::ErrorKind;
use agentgate_core::model::LeaseRef;
use agentgate_core::store::Store;
use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::sync::CancellationToken;

/// The watchdog of one turn. Dropping it stops it.
#[derive(Debug)]
pub(crate) struct Watchdog {
    stop: CancellationToken,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Fraction of the TTL kept in reserve: the signal fires this long before the
/// local deadline, leaving the holder time to stop before a takeover.
const SAFETY_MARGIN_DIVISOR: u32 = 5;

/// Retries of a failed renewal run this often (as a fraction of the TTL), so
/// a store blip shorter than the margin costs nothing.
const RETRY_DIVISOR: u32 = 10;

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
    ) -> Self {
        let stop = CancellationToken::new();
        let task_stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = task_stop.cancelled() => {}
                () = renew(store.as_ref(), &lease, lease_ttl, granted_at, lease_expires_in, &lost) => {}
            }
        });
        Self { stop }
    }
}

async fn renew(
    store: &dyn Store,
    lease: &LeaseRef,
    lease_ttl: Duration,
    mut sent_at: Instant,
    mut expires_in: Duration,
    lost: &CancellationToken,
) {
    let period = lease_ttl / 3;
    let margin = lease_ttl / SAFETY_MARGIN_DIVISOR;
    let retry = lease_ttl / RETRY_DIVISOR;
    let mut next = sent_at + period;
    loop {
        let give_up_at = (sent_at + expires_in)
            .checked_sub(margin)
            .unwrap_or(sent_at);
        if next >= give_up_at {
            next = give_up_at;
        }
        sleep_until(next).await;
        let attempt_at = Instant::now();
        if attempt_at >= give_up_at {
            tracing::warn!(turn_id = %lease.turn_id, "lease could not be renewed before its deadline; cancelling turn");
            lost.cancel();
            return;
        }
        match timeout_at(give_up_at, store.heartbeat(lease)).await {
            Ok(Ok(status)) => {
                sent_at = attempt_at;
                expires_in =
                    Duration::from_millis(u64::try_from(status.lease_expires_in_ms).unwrap_or(0));
                next = sent_at + period;
            }
            Ok(Err(error))
                if matches!(error.kind(), ErrorKind::LeaseLost | ErrorKind::NotFound) =>
            {
                tracing::warn!(turn_id = %lease.turn_id, %error, "lease lost; cancelling turn");
                lost.cancel();
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(turn_id = %lease.turn_id, %error, "heartbeat failed; retrying");
                next = Instant::now() + retry;
            }
            Err(_elapsed) => next = Instant::now(),
        }
    }
}
