//! The caller's lease, checked two ways.
//!
//! - [`check_lease`] reads the session's row (locking it when asked) and
//!   explains a refusal: the full read-decide-write path of a step, and the
//!   explanation after a fast path changed no row.
//! - [`Holder`] states the same check as a SQL condition, so that a step whose
//!   decision SQL can express exactly (an execution's ending, a turn's
//!   ending, a first tool claim) is one statement: the condition is true
//!   exactly when `check_lease` would accept.
//!
//! With an external lease layer both ask the layer first (one layer call) and
//! then require the SQL rows to agree that its fence is the session's newest.

use agentgate_core::error::Result;
use agentgate_core::ids::Fence;
use agentgate_core::model::LeaseRef;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::{PostgresStore, NOW_MS};
use agentgate_store_sql::lease::{self, Authority, LeaseRow, LeaseSql, LEASE_COLUMNS};

/// The caller's credential as a fast-path statement checks it: the token's
/// digest against the session's row, or, with a lease layer, the fence the
/// layer holds for it against the turn's and session's rows.
pub(crate) enum Holder {
    Row { token_digest: String },
    Layer { fence: Fence },
}

impl Holder {
    /// The caller's credential; `None` when the lease layer says the lease is
    /// not held (the caller then explains the refusal with [`check_lease`]).
    pub(crate) async fn of(store: &PostgresStore, lease: &LeaseRef) -> Result<Option<Self>> {
        let digest = lease.token.digest_hex();
        let Some(layer) = &store.leases else {
            return Ok(Some(Self::Row {
                token_digest: digest,
            }));
        };
        let held = layer.holds(lease.turn_id.as_str(), &digest).await?;
        Ok(held.map(|live| Self::Layer { fence: live.fence }))
    }

    /// A `WHERE` condition on `ag_sessions s JOIN ag_turns t` (joined on the
    /// session) that holds exactly when `$turn` is running and holds a live
    /// lease with this credential, bound as `$credential`. On the rows: the
    /// session names the turn and the token's digest, and its expiry is after
    /// the statement's now. With a layer: the layer's fence is the turn's and
    /// the session's, so no newer grant exists.
    pub(crate) fn condition(&self, turn: u8, credential: u8) -> String {
        match self {
            Self::Row { .. } => format!(
                "t.turn_id = ${turn} AND t.state = 'running' AND s.holder_turn_id = ${turn} \
                 AND s.lease_token_hash = ${credential} AND s.lease_expires_at_ms > {NOW_MS}"
            ),
            Self::Layer { .. } => format!(
                "t.turn_id = ${turn} AND t.state = 'running' AND t.fence = ${credential} \
                 AND s.fence = ${credential}"
            ),
        }
    }

    /// The live lease's fence as a scalar subquery: NULL when
    /// [`Holder::condition`] does not hold, so `fence = (…)` is then false.
    pub(crate) fn live_fence(&self, turn: u8, credential: u8) -> String {
        format!(
            "(SELECT s.fence FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
             WHERE {})",
            self.condition(turn, credential)
        )
    }

    /// Binds the credential; call it at the position `condition` was given.
    pub(crate) fn bind<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        match self {
            Self::Row { token_digest } => query.bind(token_digest.as_str()),
            Self::Layer { fence } => query.bind(fence.0),
        }
    }
}

/// A live lease, as checked inside a step's transaction.
pub(crate) use agentgate_core::decide::CheckedLease as LiveLease;

/// Checks that `lease` is the live holder of its session; explains why not.
/// With `lock`, the session's row stays locked until the transaction ends.
pub(crate) async fn check_lease(
    store: &PostgresStore,
    conn: &mut PgConnection,
    lease: &LeaseRef,
    lock: bool,
) -> Result<LiveLease> {
    let authority = Authority::ask(store.leases.as_deref(), lease).await?;
    let (checked, _) = lease::check_lease(&Rows, conn, lease, &authority, lock).await?;
    Ok(checked)
}

/// The lease check's SQL.
struct Rows;

#[async_trait::async_trait]
impl LeaseSql for Rows {
    type Conn = PgConnection;

    async fn read_lease(
        &self,
        conn: &mut PgConnection,
        turn_id: &str,
        lock: bool,
    ) -> Result<Option<LeaseRow>> {
        let row = sqlx::query(&format!(
            "SELECT {LEASE_COLUMNS}, {NOW_MS} AS now_ms \
             FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
             WHERE t.turn_id = $1 {}",
            if lock { "FOR UPDATE OF s" } else { "" }
        ))
        .bind(turn_id)
        .fetch_optional(conn)
        .await
        .map_err(map_sqlx)?;
        row.map(|row| LeaseRow::read(&Cols(&row))).transpose()
    }

    async fn turn_exists(&self, conn: &mut PgConnection, turn_id: &str) -> Result<bool> {
        let exists = sqlx::query_scalar::<_, i32>("SELECT 1 FROM ag_turns WHERE turn_id = $1")
            .bind(turn_id)
            .fetch_optional(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(exists.is_some())
    }
}
