//! The heartbeat, written once: renew the caller's lease and say how long it
//! now lasts, or why it cannot.
//!
//! Without a lease layer the renewal is one statement of the store's whose
//! condition is the whole lease check ([`HeartbeatSql::renew_row_lease_sql`]).
//! With a layer the lease lives in the layer, but its key can outlive the
//! turn (an ending's release in the layer is best effort), so a renewal
//! counts only while the turn still runs in SQL (one read); an ended turn's
//! heartbeat is `lease_lost` (docs/protocol.md §3.0), and its leftover key is released
//! again so the session frees now. A refusal is explained by the store's
//! read-only lease check; nothing was written.
//!
//! A renewal also tells the holder whether its turn was asked to stop
//! (`cancel_requested`), read from the turn's row: the one read of the
//! layered path, one more read after the row path's renewal.

use agentgate_core::error::{Error, Result};
use agentgate_core::model::{LeaseRef, TurnState};
use agentgate_core::plant::{self, Plant};
use agentgate_core::store::LeaseStatus;

use crate::lease::LeaseSql;
use crate::query::{On, Run, Statement};
use crate::rows::Columns;

/// The SQL a store supplies for a heartbeat.
pub trait HeartbeatSql: LeaseSql {
    /// Renews the session row's lease of the turn `$2` to `$1` ms from the
    /// store's now in one statement, conditioned on the session naming the
    /// turn as holder with the token digest `$3` and a lease still live; it
    /// changes one row when it renewed, none otherwise (MySQL: sqlx asks
    /// for found rows, so a renewal within the same millisecond counts).
    /// One statement, its own transaction: the session's lease and the
    /// user's permit are the same row, and the turn needs no write while it
    /// runs.
    fn renew_row_lease_sql() -> String {
        let sql = format!(
            "UPDATE ag_sessions SET lease_expires_at_ms = {now} + $1, updated_at_ms = {now} \
             WHERE session_id = (SELECT session_id FROM ag_turns WHERE turn_id = $2) \
             AND holder_turn_id = $2 AND lease_token_hash = $3 AND lease_expires_at_ms > {now}",
            now = Self::NOW_MS
        );
        let expiry = format!(" AND lease_expires_at_ms > {}", Self::NOW_MS);
        plant::edit(Plant::HeartbeatRenewsExpiredLease, sql, &expiry, "").into_owned()
    }
}

/// Renews the session row's lease in one statement conditioned on the
/// caller holding it, live; whether it did.
async fn renew_row_lease<S: HeartbeatSql>(sql: &S, lease: &LeaseRef, ttl_ms: i64) -> Result<bool> {
    let digest = lease.token.digest_hex();
    let statement = Statement::new(S::renew_row_lease_sql())
        .int(ttl_ms)
        .text(lease.turn_id.as_str())
        .text(&digest);
    match sql.execute(On::Write, statement).await? {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(Error::corrupt(format!("a heartbeat renewed {n} sessions"))),
    }
}

/// Why the caller's lease is not live (read-only): the refusal the lease
/// check gives, or `Ok` if it finds nothing wrong.
async fn explain_lease<S: HeartbeatSql>(sql: &S, lease: &LeaseRef) -> Result<()> {
    crate::lease::explain(sql, lease).await.map(drop)
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
            return match running(sql, lease).await? {
                Some((true, cancel_requested)) => Ok(LeaseStatus {
                    lease_expires_in_ms: remaining,
                    cancel_requested,
                }),
                None => Err(Error::not_found(format!("turn {}", lease.turn_id))),
                Some((false, _)) => {
                    if let Err(error) = layer.release(lease.turn_id.as_str(), &digest).await {
                        tracing::debug!(%error, "releasing an ended turn's leftover lease failed");
                    }
                    Err(Error::LeaseLost {
                        reason: "turn already ended",
                    })
                }
            };
        }
    } else if renew_row_lease(sql, lease, ttl_ms).await? {
        // Renewed, so the turn runs (the renewal's condition says so); a
        // row gone since is an ended-and-swept turn: not found.
        let (_, cancel_requested) = running(sql, lease)
            .await?
            .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
        return Ok(LeaseStatus {
            lease_expires_in_ms: ttl_ms,
            cancel_requested,
        });
    }
    // A lease that was not live for the renewal cannot have become live
    // since: whatever the explanation finds, the answer is a refusal.
    explain_lease(sql, lease).await?;
    Err(Error::LeaseLost {
        reason: "lease expired",
    })
}

/// Whether the turn runs, and whether a cancel was requested for it; `None`
/// when there is no such turn.
async fn running<S: Run>(sql: &S, lease: &LeaseRef) -> Result<Option<(bool, bool)>> {
    let statement =
        Statement::new("SELECT state, cancel_requested_at_ms FROM ag_turns WHERE turn_id = $1")
            .text(lease.turn_id.as_str());
    let Some(row) = sql.fetch_optional(On::Read, statement).await? else {
        return Ok(None);
    };
    let row = S::columns(&row);
    let state: TurnState = row.text_required("state")?.parse()?;
    let cancel_requested = row.int("cancel_requested_at_ms")?.is_some();
    Ok(Some((state == TurnState::Running, cancel_requested)))
}
