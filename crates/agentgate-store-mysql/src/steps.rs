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
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::Fence;

use agentgate_core::model::{Ending, LeaseRef, TurnView};
use agentgate_store_sql::tx::Tx;
use sqlx::{MySql, MySqlConnection};

use crate::error::map_sqlx;
use crate::fast;
use crate::rows::{turn_view, TURN_COLUMNS};
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::claim::ClaimSql;
use agentgate_store_sql::heartbeat::HeartbeatSql;
use agentgate_store_sql::lease::{self, release_ended, Holder, LeaseSql};
use agentgate_store_sql::tool::ToolEndingSql;
use agentgate_store_sql::{Retry, StepTx};

/// A live lease, as checked inside a step's transaction, and its session.
pub(crate) struct LiveLease {
    pub session_id: String,
    pub fence: Fence,
    pub now_ms: i64,
}

/// Checks that `lease` is the live holder of its session, locking the
/// session's row until the transaction ends; explains why not.
async fn check_lease(
    store: &MySqlStore,
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
) -> Result<LiveLease> {
    let (checked, row) = lease::ask_and_check(&Sql(store), conn, lease, true).await?;
    Ok(LiveLease {
        session_id: row.session_id,
        fence: checked.fence,
        now_ms: checked.now_ms,
    })
}

impl LeaseSql for Sql<'_> {
    /// Locks the session's row alone: the turn is read by subqueries, which
    /// InnoDB does not lock, so a step never holds a turn's row while
    /// waiting for its session's (the reverse of a begin's order).
    fn read_lease_sql(lock: bool) -> String {
        format!(
            "SELECT s.session_id, (SELECT state FROM ag_turns WHERE turn_id = $1) AS state, \
             (SELECT fence FROM ag_turns WHERE turn_id = $1) AS turn_fence, \
             s.holder_turn_id, s.lease_token_hash, s.fence AS session_fence, \
             s.lease_expires_at_ms, {NOW_MS} AS now_ms FROM ag_sessions s \
             WHERE s.session_id = (SELECT session_id FROM ag_turns WHERE turn_id = $1) {}",
            if lock { "FOR UPDATE" } else { "" }
        )
    }
}

impl HeartbeatSql for Sql<'_> {}

#[async_trait::async_trait]
impl StepTx for Sql<'_> {
    async fn transaction(&self) -> Result<Tx<MySql>> {
        self.0.transaction().await
    }
}

/// The session's row lock, held by every full-path claim and taken by the
/// one-statement claim's `FOR UPDATE`, keeps the turn's bound and the shared
/// insert's claim number exact.
impl ClaimSql for Sql<'_> {
    fn first_claim_sql(holder: &Holder) -> String {
        fast::claim_sql(holder)
    }
}

/// The store as the shared steps see it.
pub(crate) struct Sql<'a>(pub(crate) &'a MySqlStore);

impl ToolEndingSql for Sql<'_> {
    fn end_execution_sql(holder: &Holder, state: &str, column: &str) -> String {
        fast::end_execution_sql(holder, state, column)
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
                release_ended(store.leases.as_deref(), lease).await;
                return Ok(view);
            }
        }
    }
}

async fn end_turn_once(store: &MySqlStore, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
    let mut tx = store.transaction().await?;
    let live = check_lease(store, &mut tx, lease).await?;
    let now = live.now_ms;
    let columns = agentgate_store_sql::rows::ending_columns(ending);
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
