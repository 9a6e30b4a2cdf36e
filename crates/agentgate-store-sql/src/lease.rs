//! The caller's lease, checked inside a step's transaction, written once.
//!
//! A step's full path reads one row ([`LeaseSql::read_lease_sql`]: the turn's
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
use agentgate_core::ids::Fence;
use agentgate_core::lease::{LeaseLayer, LiveLease};
use agentgate_core::model::LeaseRef;

use crate::query::{Arg, On, Run, Statement};
use crate::rows::Columns;

/// The columns [`LeaseSql::read_lease_sql`] selects, under these names, from
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
pub trait LeaseSql: Run {
    /// Reads [`LEASE_COLUMNS`] and the store's clock as `now_ms` for the
    /// turn `$1` joined to its session's row, locking that row until the
    /// transaction ends when `lock`; no row when the turn or its session's
    /// row does not exist.
    fn read_lease_sql(lock: bool) -> String;
}

/// Checks that `lease` is the live holder of its session, as `authority`
/// says; explains why not. Returns the verdict and the row it judged.
///
/// # Errors
/// `lease_lost` with the reason, `not_found` for an unknown turn, or the
/// store's error.
pub async fn check_lease<S: LeaseSql + ?Sized>(
    sql: &S,
    conn: &mut S::Conn,
    lease: &LeaseRef,
    authority: &Authority,
    lock: bool,
) -> Result<(CheckedLease, LeaseRow)> {
    let turn_id = lease.turn_id.as_str();
    let read = Statement::new(S::read_lease_sql(lock)).text(turn_id);
    let Some(row) = sql.fetch_optional(On::Conn(&mut *conn), read).await? else {
        let exists = Statement::new("SELECT 1 AS found FROM ag_turns WHERE turn_id = $1");
        return Err(
            if sql
                .fetch_optional(On::Conn(conn), exists.text(turn_id))
                .await?
                .is_some()
            {
                Error::LeaseLost {
                    reason: "taken over or released",
                }
            } else {
                Error::not_found(format!("turn {turn_id}"))
            },
        );
    };
    let row = LeaseRow::read(&S::columns(&row))?;
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

/// [`check_lease`] after asking the store's lease layer, if it has one.
///
/// # Errors
/// As [`Authority::ask`] and [`check_lease`].
pub async fn ask_and_check<S: LeaseSql>(
    sql: &S,
    conn: &mut S::Conn,
    lease: &LeaseRef,
    lock: bool,
) -> Result<(CheckedLease, LeaseRow)> {
    let authority = Authority::ask(sql.leases(), lease).await?;
    check_lease(sql, conn, lease, &authority, lock).await
}

/// Why the caller's lease is not live, read-only on a reader connection
/// outside any transaction: the refusal the check gives, or the lease as it
/// found it live (a step's statement that changed no row then raced a
/// change this read no longer sees).
///
/// # Errors
/// As [`ask_and_check`], or no reader in time.
pub async fn explain<S: LeaseSql>(sql: &S, lease: &LeaseRef) -> Result<CheckedLease> {
    let mut conn = sql.reader().await?;
    let answer = ask_and_check(sql, &mut conn, lease, false).await;
    // Its usual answer is a refusal (the lease is lost or unknown): the
    // reader goes back either way, unless the connection may be broken.
    if answer.as_ref().err().is_none_or(crate::tx::answered) {
        S::release(conn);
    }
    answer.map(|(checked, _)| checked)
}

/// The caller's credential as a one-statement step checks it inside its
/// own `WHERE`: the token's digest against the session's row, or, with a
/// lease layer, the fence the layer holds the lease under, against the
/// turn's and the session's rows (no newer grant exists). The store states
/// the condition in its SQL ([`crate::claim::ClaimSql`],
/// [`crate::tool::ToolEndingSql`]); it holds exactly when
/// [`check_lease`] would accept.
#[derive(Debug)]
pub enum Holder {
    /// The lease lives in the session's row: this token's digest, unexpired
    /// on the store's clock.
    Row {
        /// The token's digest.
        token_digest: String,
    },
    /// The layer holds the lease under this fence.
    Layer {
        /// The layer's fence.
        fence: Fence,
    },
}

impl Holder {
    /// The caller's credential; `None` when the layer holds no lease for it
    /// (the step then explains the refusal with [`check_lease`]).
    ///
    /// # Errors
    /// The layer's error.
    pub async fn of(layer: Option<&dyn LeaseLayer>, lease: &LeaseRef) -> Result<Option<Self>> {
        let digest = lease.token.digest_hex();
        let Some(layer) = layer else {
            return Ok(Some(Self::Row {
                token_digest: digest,
            }));
        };
        let held = layer.holds(lease.turn_id.as_str(), &digest).await?;
        Ok(held.map(|live| Self::Layer { fence: live.fence }))
    }

    /// The credential, bound where the store's condition names it.
    pub fn credential(&self) -> Arg<'_> {
        match self {
            Self::Row { token_digest } => Arg::Text(token_digest),
            Self::Layer { fence } => Arg::Int(fence.0),
        }
    }
}

/// Releases an ended turn's lease in the layer, after the ending's commit.
/// Not an error of the step: the ending is durable, and a lease whose
/// release failed expires by itself.
pub async fn release_ended(layer: Option<&dyn LeaseLayer>, lease: &LeaseRef) {
    let Some(layer) = layer else { return };
    let digest = lease.token.digest_hex();
    if let Err(error) = layer.release(lease.turn_id.as_str(), &digest).await {
        tracing::warn!(%error, turn_id = %lease.turn_id, "could not release an ended turn's lease");
    }
}
