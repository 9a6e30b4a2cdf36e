//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the server's clock.
//!
//! Every step but the heartbeat locks the session's row first (`SELECT …
//! FOR UPDATE` of the session alone: the turn is read by a subquery, which
//! InnoDB does not lock, so a step never holds a turn's row while waiting for
//! its session's, the reverse of a begin's order). A takeover and the old
//! holder's step are serialised, and the old holder's step reads the new
//! holder and changes nothing: a locking read always reads the newest row. A
//! step's lease is judged at the start of its locking statement.
//!
//! With an external lease layer the layer must hold the lease (one layer
//! call) and the SQL rows must agree that its fence is the session's newest;
//! a heartbeat then touches only the layer, and an ending releases the
//! layer's lease after its commit.
//!
//! A first claim, a completion or failure with a plain result, and an ending
//! first try the one-statement fast path of `fast`; the locking transaction
//! below runs only when it changed no row, and either does the step or
//! explains the refusal.
//!
//! Round trips: heartbeat 1 (2 when refused, to say why); claim 1 on the fast
//! path, else 1 + 5 (`BEGIN`, lock, lookup, write, `COMMIT`; 4 when cached
//! or refused); complete or fail with a result 1, else 1 + 4; complete with
//! a same-transaction effect 5 plus the effect's own; end 1 (one `CALL`; 2
//! with an external layer), else that + 6 (no `UPDATE … RETURNING`: the
//! view is read back).

use agentgate_core::config::duration_ms;
use agentgate_core::decide::CheckedLease;
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, Fence};

use agentgate_core::model::{Ending, ExecutionEnding, LeaseRef, ToolCall, TurnView};
use sqlx::MySqlConnection;

use crate::error::map_sqlx;
use crate::fast;
use crate::rows::{turn_view, Cols, TURN_COLUMNS};
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::claim::ClaimSql;
use agentgate_store_sql::heartbeat::HeartbeatSql;
use agentgate_store_sql::lease::{self, Authority, LeaseRow, LeaseSql};
use agentgate_store_sql::tool::ToolEndingSql;
use agentgate_store_sql::{Retry, StepTx};

/// A live lease, as checked inside a step's transaction, and its session.
pub(crate) struct LiveLease {
    pub session_id: String,
    pub fence: Fence,
    pub lease_expires_at_ms: i64,
    pub now_ms: i64,
}

impl LiveLease {
    /// The core's verdict this lease was built from.
    fn checked(&self) -> CheckedLease {
        CheckedLease {
            fence: self.fence,
            lease_expires_at_ms: self.lease_expires_at_ms,
            now_ms: self.now_ms,
        }
    }
}

/// Checks that `lease` is the live holder of its session; explains why not.
/// With `lock`, the session's row stays locked until the transaction ends.
pub(crate) async fn check_lease(
    store: &MySqlStore,
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
    lock: bool,
) -> Result<LiveLease> {
    let authority = Authority::ask(store.leases.as_deref(), lease).await?;
    let (checked, row) = lease::check_lease(&Rows, conn, lease, &authority, lock).await?;
    Ok(LiveLease {
        session_id: row.session_id,
        fence: checked.fence,
        lease_expires_at_ms: checked.lease_expires_at_ms,
        now_ms: checked.now_ms,
    })
}

/// The lease check's SQL.
struct Rows;

#[async_trait::async_trait]
impl LeaseSql for Rows {
    type Conn = MySqlConnection;

    /// Locks the session's row alone: the turn is read by subqueries, which
    /// InnoDB does not lock, so a step never holds a turn's row while
    /// waiting for its session's (the reverse of a begin's order).
    async fn read_lease(
        &self,
        conn: &mut MySqlConnection,
        turn_id: &str,
        lock: bool,
    ) -> Result<Option<LeaseRow>> {
        let row = sqlx::query(&format!(
            "SELECT s.session_id, (SELECT state FROM ag_turns WHERE turn_id = ?) AS state, \
             (SELECT fence FROM ag_turns WHERE turn_id = ?) AS turn_fence, \
             s.holder_turn_id, s.lease_token_hash, s.fence AS session_fence, \
             s.lease_expires_at_ms, {NOW_MS} AS now_ms FROM ag_sessions s \
             WHERE s.session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?) {}",
            if lock { "FOR UPDATE" } else { "" }
        ))
        .bind(turn_id)
        .bind(turn_id)
        .bind(turn_id)
        .fetch_optional(conn)
        .await
        .map_err(map_sqlx)?;
        row.map(|row| LeaseRow::read(&Cols(&row))).transpose()
    }

    async fn turn_exists(&self, conn: &mut MySqlConnection, turn_id: &str) -> Result<bool> {
        let exists = sqlx::query_scalar::<_, i64>("SELECT 1 FROM ag_turns WHERE turn_id = ?")
            .bind(turn_id)
            .fetch_optional(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(exists.is_some())
    }
}

#[async_trait::async_trait]
impl HeartbeatSql for Sql<'_> {
    /// One statement, its own transaction: renews session lease and permit
    /// (the same row); the turn needs no write while it runs. sqlx asks for
    /// "found rows", so a renewal within the same millisecond still counts.
    async fn renew_row_lease(&self, lease: &LeaseRef, ttl_ms: i64) -> Result<bool> {
        let renewed = sqlx::query(&format!(
            "UPDATE ag_sessions SET lease_expires_at_ms = {NOW_MS} + ?, updated_at_ms = {NOW_MS} \
             WHERE session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?) \
             AND holder_turn_id = ? AND lease_token_hash = ? AND lease_expires_at_ms > {NOW_MS}"
        ))
        .bind(ttl_ms)
        .bind(lease.turn_id.as_str())
        .bind(lease.turn_id.as_str())
        .bind(lease.token.digest_hex())
        .execute(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn explain_lease(&self, lease: &LeaseRef) -> Result<()> {
        let mut conn = self.0.pool.acquire().await.map_err(map_sqlx)?;
        check_lease(self.0, &mut conn, lease, false).await.map(drop)
    }
}

#[async_trait::async_trait]
impl StepTx for Sql<'_> {
    async fn open(&self, lease: &LeaseRef) -> Result<(Self::Tx, CheckedLease)> {
        let mut tx = self.0.transaction().await?;
        let live = check_lease(self.0, &mut tx, lease, true).await?;
        Ok((tx, live.checked()))
    }
}

/// The session's row lock, held by every full-path claim and taken by the
/// one-statement claim's `FOR UPDATE`, keeps the turn's bound and the shared
/// insert's claim number exact.
#[async_trait::async_trait]
impl ClaimSql for Sql<'_> {
    async fn first_claim(
        &self,
        lease: &LeaseRef,
        call: &ToolCall,
        execution_id: &ExecutionId,
        key: &str,
    ) -> Result<bool> {
        fast::claim(self.0, lease, call, execution_id, key).await
    }
}

/// The store as the shared tool ending sees it.
pub(crate) struct Sql<'a>(pub(crate) &'a MySqlStore);

#[async_trait::async_trait]
impl ToolEndingSql for Sql<'_> {
    async fn end_fast(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        ending: ExecutionEnding<'_>,
    ) -> Result<bool> {
        fast::end_execution(self.0, lease, execution_id, ending).await
    }
}

/// Releases session lease and permit (one row) in the ending's transaction;
/// an ending that awaits confirmation records the pending turn on the
/// session. Assignments run left to right in MySQL, so the pending turn is
/// bound rather than read from the holder column being cleared.
async fn release_session(
    tx: &mut MySqlConnection,
    lease: &LeaseRef,
    live: &LiveLease,
    pending_expires: Option<i64>,
) -> Result<()> {
    let now = live.now_ms;
    sqlx::query(
        "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
         lease_expires_at_ms = NULL, updated_at_ms = ?, \
         pending_turn_id = IF(? IS NULL, pending_turn_id, ?), \
         pending_expires_at_ms = COALESCE(?, pending_expires_at_ms) \
         WHERE session_id = ? AND holder_turn_id = ?",
    )
    .bind(now)
    .bind(pending_expires)
    .bind(lease.turn_id.as_str())
    .bind(pending_expires)
    .bind(&live.session_id)
    .bind(lease.turn_id.as_str())
    .execute(tx)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

pub(crate) async fn end_turn(
    store: &MySqlStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let mut retry = Retry::new();
    loop {
        let view = match fast::end_turn(store, lease, ending).await {
            Ok(Some(view)) => Ok(view),
            Ok(None) => end_turn_once(store, lease, ending).await,
            Err(error) => Err(error),
        };
        match view {
            Err(error) => retry.after(error).await?,
            Ok(view) => {
                release_layer(store, lease).await;
                return Ok(view);
            }
        }
    }
}

/// Releases an ended turn's lease in the external layer, after the ending's
/// commit. Not an error of the step: the ending is durable, and a lease
/// whose release failed expires by itself.
async fn release_layer(store: &MySqlStore, lease: &LeaseRef) {
    if let Some(layer) = &store.leases {
        let digest = lease.token.digest_hex();
        if let Err(error) = layer.release(lease.turn_id.as_str(), &digest).await {
            tracing::warn!(%error, turn_id = %lease.turn_id, "could not release an ended turn's lease");
        }
    }
}

async fn end_turn_once(store: &MySqlStore, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
    let mut tx = store.transaction().await?;
    let live = check_lease(store, &mut tx, lease, true).await?;
    let now = live.now_ms;
    let columns = ending.columns();
    let pending_expires = columns
        .pending
        .map(|_| now + duration_ms(store.config.confirmation_ttl));
    let ended = sqlx::query(
        "UPDATE ag_turns SET state = ?, response = ?, error = ?, retryable = ?, \
         pending = COALESCE(?, pending), updated_at_ms = ?, ended_at_ms = ? \
         WHERE turn_id = ? AND state = 'running' AND fence = ?",
    )
    .bind(columns.state)
    .bind(columns.response)
    .bind(columns.error)
    .bind(columns.retryable)
    .bind(columns.pending)
    .bind(now)
    .bind(now)
    .bind(lease.turn_id.as_str())
    .bind(live.fence.0)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    if ended.rows_affected() != 1 {
        return Err(Error::corrupt(format!(
            "turn {} holds its session but is not running under its fence",
            lease.turn_id
        )));
    }
    release_session(&mut tx, lease, &live, pending_expires).await?;
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(lease.turn_id.as_str())
    .fetch_one(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let view = turn_view(&row)?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok(view)
}
