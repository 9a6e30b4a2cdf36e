//! The caller's lease, checked inside a step's transaction, written once.
//!
//! A step's full path reads one row ([`LeaseSql::read_lease`]: the turn's
//! state and fence, its session's holder, token digest, fence and expiry,
//! and the store's clock), locking the session's row where the store locks
//! rows, and the core judges it: [`check_row_lease`] when the lease lives in
//! the session row, [`check_layer_lease`] when an external lease layer holds
//! it (the rows must then agree that the layer's fence is the session's
//! newest: that is what stops a holder whose layer lease vanished after a
//! newer turn was granted). A turn with no session row is explained by
//! whether the turn exists at all.

use agentgate_core::decide::{check_layer_lease, check_row_lease, CheckedLease, RowLeaseFacts};
use agentgate_core::error::{Error, Result};
use agentgate_core::lease::{LeaseLayer, LiveLease};
use agentgate_core::model::LeaseRef;

use crate::rows::Columns;

/// The columns [`LeaseSql::read_lease`] selects, under these names, from
/// the turn `t` and its session `s`.
pub const LEASE_COLUMNS: &str = "t.session_id, t.state, t.fence AS turn_fence, \
    s.holder_turn_id, s.lease_token_hash, s.fence AS session_fence, s.lease_expires_at_ms";

/// Who says whether a lease is live.
#[derive(Debug)]
pub enum Authority {
    /// The session row's holder, token digest and expiry.
    Rows,
    /// The external lease layer, asked before the step's transaction: what
    /// it holds for the caller (`None`: nothing).
    Layer(Option<LiveLease>),
}

impl Authority {
    /// Asks the store's layer, if it has one, about `lease`.
    ///
    /// # Errors
    /// The layer's error.
    pub async fn ask(layer: Option<&dyn LeaseLayer>, lease: &LeaseRef) -> Result<Self> {
        match layer {
            None => Ok(Self::Rows),
            Some(layer) => Ok(Self::Layer(
                layer
                    .holds(lease.turn_id.as_str(), &lease.token.digest_hex())
                    .await?,
            )),
        }
    }
}

/// The row a lease check reads ([`LEASE_COLUMNS`] and the clock).
#[derive(Debug)]
pub struct LeaseRow {
    /// The turn's session.
    pub session_id: String,
    /// The turn's state.
    pub state: String,
    /// The turn's fence.
    pub turn_fence: i64,
    /// The session's holder.
    pub holder_turn_id: Option<String>,
    /// The holder's token digest.
    pub lease_token_hash: Option<String>,
    /// The session's newest fence.
    pub session_fence: i64,
    /// The session lease's expiry (none with a lease layer, or released).
    pub lease_expires_at_ms: Option<i64>,
    /// The store's clock.
    pub now_ms: i64,
}

impl LeaseRow {
    /// Decodes a row of [`LEASE_COLUMNS`] and `now_ms`.
    ///
    /// # Errors
    /// As [`Columns`]; `corrupt` for a NULL the schema forbids.
    pub fn read(row: &impl Columns) -> Result<Self> {
        Ok(Self {
            session_id: row.text_required("session_id")?,
            state: row.text_required("state")?,
            turn_fence: row.int_required("turn_fence")?,
            holder_turn_id: row.text("holder_turn_id")?,
            lease_token_hash: row.text("lease_token_hash")?,
            session_fence: row.int_required("session_fence")?,
            lease_expires_at_ms: row.int("lease_expires_at_ms")?,
            now_ms: row.int_required("now_ms")?,
        })
    }
}

/// The SQL a store supplies for a lease check.
#[async_trait::async_trait]
pub trait LeaseSql: Sync {
    /// The store's connection type.
    type Conn: Send;

    /// Reads [`LEASE_COLUMNS`] and the store's clock as `now_ms` for the
    /// turn `turn_id` joined to its session's row, locking that row until
    /// the transaction ends when `lock`; `None` when the turn or its
    /// session's row does not exist.
    async fn read_lease(
        &self,
        conn: &mut Self::Conn,
        turn_id: &str,
        lock: bool,
    ) -> Result<Option<LeaseRow>>;

    /// Whether the turn exists at all.
    async fn turn_exists(&self, conn: &mut Self::Conn, turn_id: &str) -> Result<bool>;
}

/// Checks that `lease` is the live holder of its session, as `authority`
/// says; explains why not. Returns the verdict and the row it judged.
///
/// # Errors
/// `lease_lost` with the reason, `not_found` for an unknown turn, or the
/// store's error.
pub async fn check_lease<S: LeaseSql>(
    sql: &S,
    conn: &mut S::Conn,
    lease: &LeaseRef,
    authority: &Authority,
    lock: bool,
) -> Result<(CheckedLease, LeaseRow)> {
    let turn_id = lease.turn_id.as_str();
    let Some(row) = sql.read_lease(conn, turn_id, lock).await? else {
        return Err(if sql.turn_exists(conn, turn_id).await? {
            Error::LeaseLost {
                reason: "taken over or released",
            }
        } else {
            Error::not_found(format!("turn {turn_id}"))
        });
    };
    let running = row.state == "running";
    let checked = match authority {
        Authority::Layer(held) => check_layer_lease(
            held.as_ref(),
            running,
            row.turn_fence,
            Some(row.session_fence),
            row.now_ms,
        )?,
        Authority::Rows => {
            let facts = RowLeaseFacts {
                turn_running: running,
                holder_turn_id: row.holder_turn_id.as_deref(),
                lease_token_hash: row.lease_token_hash.as_deref(),
                fence: Some(row.session_fence),
                lease_expires_at_ms: row.lease_expires_at_ms,
                now_ms: row.now_ms,
            };
            check_row_lease(&facts, turn_id, &lease.token.digest_hex())?
        }
    };
    Ok((checked, row))
}
