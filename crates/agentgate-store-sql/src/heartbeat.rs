//! The heartbeat, written once: renew the caller's lease and say how long it
//! now lasts, or why it cannot.
//!
//! Without a lease layer the renewal is one statement of the store's whose
//! condition is the whole lease check ([`HeartbeatSql::renew_row_lease`]).
//! With a layer the lease lives in the layer, but its key can outlive the
//! turn (an ending's release in the layer is best effort), so a renewal
//! counts only while the turn still runs in SQL (one read); an ended turn's
//! heartbeat is `lease_lost` (SPEC §5), and its leftover key is released
//! again so the session frees now. A refusal is explained by the store's
//! read-only lease check; nothing was written.

use agentgate_core::error::{Error, Result};
use agentgate_core::model::{LeaseRef, TurnState};
use agentgate_core::store::LeaseStatus;

/// The SQL a store supplies for a heartbeat.
#[async_trait::async_trait]
pub trait HeartbeatSql: crate::query::Run {
    /// The turn's state as stored; `None` when there is no such turn.
    async fn turn_state(&self, lease: &LeaseRef) -> Result<Option<String>>;

    /// Renews the session row's lease in one statement conditioned on the
    /// caller holding it, live; whether it did.
    async fn renew_row_lease(&self, lease: &LeaseRef, ttl_ms: i64) -> Result<bool>;

    /// Why the caller's lease is not live (read-only): the refusal the
    /// store's lease check gives, or `Ok` if it finds nothing wrong.
    async fn explain_lease(&self, lease: &LeaseRef) -> Result<()>;
}

/// Renews the caller's lease, run again after a transient conflict.
///
/// # Errors
/// As [`heartbeat_once`].
pub async fn heartbeat<S: HeartbeatSql>(sql: &S, lease: &LeaseRef) -> Result<LeaseStatus> {
    let mut retry = crate::Retry::new();
    loop {
        match heartbeat_once(sql, lease).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

/// One heartbeat.
///
/// # Errors
/// `lease_lost`, `not_found` (no such turn), `store_unavailable`.
pub async fn heartbeat_once<S: HeartbeatSql>(sql: &S, lease: &LeaseRef) -> Result<LeaseStatus> {
    let ttl_ms = sql.config().lease_ttl_ms();
    if let Some(layer) = sql.leases() {
        let digest = lease.token.digest_hex();
        if let Some(remaining) = layer.renew(lease.turn_id.as_str(), &digest, ttl_ms).await? {
            return match sql.turn_state(lease).await?.as_deref() {
                Some(state) if state == TurnState::Running.as_str() => Ok(LeaseStatus {
                    lease_expires_in_ms: remaining,
                }),
                None => Err(Error::not_found(format!("turn {}", lease.turn_id))),
                Some(_) => {
                    if let Err(error) = layer.release(lease.turn_id.as_str(), &digest).await {
                        tracing::debug!(%error, "releasing an ended turn's leftover lease failed");
                    }
                    Err(Error::LeaseLost {
                        reason: "turn already ended",
                    })
                }
            };
        }
    } else if sql.renew_row_lease(lease, ttl_ms).await? {
        return Ok(LeaseStatus {
            lease_expires_in_ms: ttl_ms,
        });
    }
    // A lease that was not live for the renewal cannot have become live
    // since: whatever the explanation finds, the answer is a refusal.
    sql.explain_lease(lease).await?;
    Err(Error::LeaseLost {
        reason: "lease expired",
    })
}
