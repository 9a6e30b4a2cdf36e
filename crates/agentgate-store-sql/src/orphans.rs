//! Orphans, written once: listing running turns whose lease is gone without
//! an ending (for recovery workers and the sweeper), and ending one
//! `abandoned`.
//!
//! With the lease in the session row, the store's candidate query already
//! excludes live leases and filters by orphan age. With a lease layer the
//! rows keep no expiry, so every running turn the filter admits is a
//! candidate, the layer is asked whether it still holds it, and the first
//! listing that finds it unheld records the time on the turn (unless a
//! grant came between); its age is counted from then.

use agentgate_core::error::Result;
use agentgate_core::lease::{held_by, LeaseLayer};
use agentgate_core::limits::MAX_ORPHAN_SCAN;
use agentgate_core::model::{Orphan, OrphanFilter};

use crate::Retry;

/// The SQL a store supplies for orphans.
#[async_trait::async_trait]
pub trait OrphanSql: Sync {
    /// The external lease layer, if the store has one.
    fn leases(&self) -> Option<&dyn LeaseLayer>;

    /// The store's clock.
    async fn now_ms(&self) -> Result<i64>;

    /// The running turns `filter` admits, longest-orphaned first, at most
    /// `limit`: without a layer only those with no live row lease, orphaned
    /// at least `filter.min_orphaned_ms`.
    async fn candidates(
        &self,
        filter: &OrphanFilter,
        limit: u32,
        now_ms: i64,
    ) -> Result<Vec<Orphan>>;

    /// Records when the turn was first seen unheld, if it still runs under
    /// the orphan's fence; the recorded time, or `None` (a grant came
    /// between).
    async fn stamp_orphaned(&self, orphan: &Orphan) -> Result<Option<i64>>;

    /// Ends the turn `abandoned` and releases its session, once, if it still
    /// runs under the orphan's fence with no live row lease; whether it did.
    async fn abandon_once(&self, orphan: &Orphan) -> Result<bool>;
}

/// The orphans `filter` admits, at most `limit` (and [`MAX_ORPHAN_SCAN`]).
///
/// # Errors
/// `invalid_request` for a filter outside its limits; `store_unavailable`.
pub async fn list<S: OrphanSql>(sql: &S, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
    filter.validate()?;
    let limit = limit.min(MAX_ORPHAN_SCAN);
    let now = sql.now_ms().await?;
    let found = sql.candidates(filter, limit, now).await?;
    let Some(layer) = sql.leases() else {
        return Ok(found);
    };
    let min_age = i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX);
    let mut orphans = Vec::with_capacity(found.len());
    for mut orphan in found {
        if held_by(layer, orphan.session_id.as_str(), orphan.turn_id.as_str()).await? {
            continue;
        }
        let Some(since) = sql.stamp_orphaned(&orphan).await? else {
            continue;
        };
        orphan.orphaned_since_ms = since;
        orphan.orphaned_for_ms = now.saturating_sub(since).max(0);
        if orphan.orphaned_for_ms >= min_age {
            orphans.push(orphan);
        }
    }
    Ok(orphans)
}

/// Ends `orphan` `abandoned` unless its lease is live again (in the layer or
/// the rows) or a takeover changed its fence; whether it did.
///
/// # Errors
/// `store_unavailable`.
pub async fn abandon<S: OrphanSql>(sql: &S, orphan: &Orphan) -> Result<bool> {
    if let Some(layer) = sql.leases() {
        if held_by(layer, orphan.session_id.as_str(), orphan.turn_id.as_str()).await? {
            return Ok(false);
        }
    }
    let mut retry = Retry::new();
    loop {
        match sql.abandon_once(orphan).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}
