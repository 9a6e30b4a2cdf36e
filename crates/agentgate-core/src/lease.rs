//! The [`LeaseLayer`] trait: where session leases and permits live when they
//! do not live in the SQL rows (the Redis lease layer).
//!
//! With an external lease layer, a SQL store still keeps every durable
//! record, still allocates fences from its own counter (fences must survive
//! a lease layer that forgets, e.g. Redis restarted without persistence), and
//! still records the newest fence per session. Every durable write is
//! conditioned on the writer's fence being that newest fence, so a holder
//! whose lease vanished from the layer can never overwrite a newer turn.
//!
//! A layer keys leases by session and permits by user; each method is one
//! atomic step in the layer (one Redis script) and expiry is judged by the
//! layer's clock (Redis `PEXPIRE` and `TIME`).

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::Result;
use crate::ids::Fence;
use crate::model::HolderView;

/// A request to take a session lease and one of the user's permits together.
#[derive(Clone, Debug)]
pub struct LeaseClaim<'a> {
    /// The session to lease.
    pub session_id: &'a str,
    /// The user whose permit is taken.
    pub user_id: &'a str,
    /// The turn the lease is for.
    pub turn_id: &'a str,
    /// SHA-256 hex of the lease token.
    pub token_digest: &'a str,
    /// The fence the SQL store allocated for this grant.
    pub fence: Fence,
    /// Lease lifetime.
    pub ttl_ms: i64,
    /// The user's cap.
    pub cap: u32,
}

impl<'a> LeaseClaim<'a> {
    /// The claim a begin makes for `turn_id` under `fence`.
    pub fn for_begin(
        command: &'a crate::model::BeginCommand,
        turn_id: &'a str,
        token_digest: &'a str,
        fence: Fence,
        ttl_ms: i64,
        cap: u32,
    ) -> Self {
        Self {
            session_id: command.session_id.as_str(),
            user_id: command.user_id.as_str(),
            turn_id,
            token_digest,
            fence,
            ttl_ms,
            cap,
        }
    }
}

/// What [`LeaseLayer::acquire`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// Lease and permit both taken.
    Granted {
        /// Remaining lease on the layer's clock.
        lease_expires_in_ms: i64,
    },
    /// The session is held; nothing taken.
    Busy {
        /// The holder's turn.
        holder_turn_id: String,
        /// The holder's remaining lease.
        expires_in_ms: i64,
    },
    /// The user holds all permits; nothing taken.
    AtCapacity {
        /// Remaining lease of the user's soonest-expiring permit.
        soonest_expires_in_ms: i64,
    },
}

/// A live lease as the layer knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveLease {
    /// The leased session.
    pub session_id: String,
    /// The grant's fence.
    pub fence: Fence,
    /// Remaining lease on the layer's clock.
    pub expires_in_ms: i64,
}

/// Session leases and user permits kept outside the SQL store.
#[async_trait]
pub trait LeaseLayer: Send + Sync + std::fmt::Debug + 'static {
    /// Takes the session lease and a permit together, or neither.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired>;

    /// Renews the lease and permit of `turn_id` if `token_digest` holds it;
    /// `None` when it does not (lost).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>>;

    /// The live lease of `turn_id` if `token_digest` holds it.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>>;

    /// Releases the lease and permit of `turn_id` if `token_digest` holds
    /// them; a no-op otherwise.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn release(&self, turn_id: &str, token_digest: &str) -> Result<()>;

    /// Drops the lease and permit of `turn_id`, whoever holds its token:
    /// an operator's force-release, after the SQL store bumped the
    /// session's fence (which already refuses the old holder's writes).
    /// A no-op when the layer holds nothing for it.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn revoke(&self, turn_id: &str) -> Result<()>;

    /// The live holder of `session_id`, if any.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>>;

    /// The live holders of `user_id`'s permits.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>>;

    /// Tells every node that `session_id` was released (an ending, an
    /// abandon, a force-release), for the begins waiting on it there. Best
    /// effort: a waiter that misses it finds the session by its bounded
    /// poll. By default no other node hears it.
    async fn announce_release(&self, _session_id: &str) {}

    /// Tells every node that `turn_id`'s event log grew, for its followers
    /// there. Best effort, as [`LeaseLayer::announce_release`].
    async fn announce_events(&self, _turn_id: &str) {}

    /// Starts delivering other nodes' announcements to `to`, once: a later
    /// call while that delivery runs changes nothing. By default nothing
    /// arrives (the store's followers and waiters poll across nodes).
    fn listen(&self, _to: Arc<dyn Announced>) {}
}

/// Where a lease layer delivers other nodes' announcements (a store's
/// in-process wakeups).
pub trait Announced: Send + Sync + 'static {
    /// `session_id` was released on some node.
    fn released(&self, session_id: &str);
    /// `turn_id`'s event log grew on some node.
    fn events(&self, turn_id: &str);
    /// Whether announcements reach this node now: false while the layer
    /// reconnects; turning true must wake every watch, since what was
    /// announced meanwhile reached no one.
    fn listening(&self, listening: bool);
}

/// Before a store records a turn as exhausted: with an external layer the
/// rows do not show whether the turn still runs, so ask the layer; a turn
/// whose lease is live is in flight, not exhausted.
///
/// # Errors
/// `request_in_flight` when `turn_id` holds `session_id`'s lease;
/// `store_unavailable`.
pub async fn refuse_if_held(layer: &dyn LeaseLayer, session_id: &str, turn_id: &str) -> Result<()> {
    match layer.holder(session_id).await? {
        Some(holder) if holder.turn_id.as_str() == turn_id => {
            Err(crate::error::Error::RequestInFlight {
                active_turn_id: turn_id.to_owned(),
                retry_after: crate::decide::retry_after_ms(holder.lease_expires_in_ms),
            })
        }
        _ => Ok(()),
    }
}

/// Whether `turn_id` holds `session_id`'s live lease in the layer: what an
/// orphan listing asks before counting a running turn as orphaned, since the
/// SQL rows keep no expiry when a layer holds the leases.
///
/// # Errors
/// `store_unavailable`.
pub async fn held_by(layer: &dyn LeaseLayer, session_id: &str, turn_id: &str) -> Result<bool> {
    Ok(layer
        .holder(session_id)
        .await?
        .is_some_and(|holder| holder.turn_id.as_str() == turn_id))
}
