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

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::duration_ms;
use agentgate_core::decide::{
    self, check_layer_lease, check_row_lease, decide_tool_claim, CheckedLease, RowLeaseFacts,
    ToolDecision,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, Fence};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::model::{
    idempotency_key, Ending, ExecutionEnding, LeaseRef, PreviousOutcome, ToolCall, ToolClaim,
    TurnView,
};
use agentgate_core::store::{Completion, LeaseStatus, SqlEffect};
use serde_json::Value;
use sqlx::mysql::MySqlRow;
use sqlx::MySqlConnection;

use crate::error::{corrupt, map_sqlx};
use crate::fast;
use crate::rows::{
    execution_snapshot, get, json, text, turn_view, Cols, EXECUTION_COLUMNS, TURN_COLUMNS,
};
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::heartbeat::{self, HeartbeatSql};
use agentgate_store_sql::rows::Columns;
use agentgate_store_sql::tool::{self, ToolEndingSql};
use agentgate_store_sql::Retry;

/// A live lease, as checked inside a step's transaction.
pub(crate) struct LiveLease {
    pub session_id: String,
    pub fence: Fence,
    pub lease_expires_at_ms: i64,
    pub now_ms: i64,
}

impl LiveLease {
    /// The lease core's verdict accepted, with the session `row` names.
    fn new(row: &MySqlRow, checked: CheckedLease) -> Result<Self> {
        Ok(Self {
            session_id: Cols(row).text_required("session_id")?,
            fence: checked.fence,
            lease_expires_at_ms: checked.lease_expires_at_ms,
            now_ms: checked.now_ms,
        })
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
    match &store.leases {
        Some(layer) => check_external(layer.as_ref(), conn, lease, lock).await,
        None => check_in_row(conn, lease, lock).await,
    }
}

/// With an external lease layer: the layer must hold the lease, and the SQL
/// rows (the session's row locked, so no newer grant commits meanwhile) must
/// agree that its fence is the session's newest. The second check is what
/// stops a holder whose layer lease vanished (Redis restarted) after a newer
/// turn was granted.
async fn check_external(
    layer: &dyn LeaseLayer,
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
    lock: bool,
) -> Result<LiveLease> {
    let held = layer
        .holds(lease.turn_id.as_str(), &lease.token.digest_hex())
        .await?;
    let row = sqlx::query(&format!(
        "SELECT s.session_id, (SELECT state FROM ag_turns WHERE turn_id = ?) AS state, \
         (SELECT fence FROM ag_turns WHERE turn_id = ?) AS turn_fence, \
         s.fence AS session_fence, {NOW_MS} AS now_ms FROM ag_sessions s \
         WHERE s.session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?) {}",
        if lock { "FOR UPDATE" } else { "" }
    ))
    .bind(lease.turn_id.as_str())
    .bind(lease.turn_id.as_str())
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else {
        return Err(missing_turn(conn, lease).await);
    };
    let state = text(&row, "state")?;
    let checked = check_layer_lease(
        held.as_ref(),
        state.as_deref() == Some("running"),
        get(&row, "turn_fence")?,
        Some(get(&row, "session_fence")?),
        get(&row, "now_ms")?,
    )?;
    LiveLease::new(&row, checked)
}

/// Leases in the session rows: the row must name this turn, this token's
/// digest, and an expiry after the store's now.
async fn check_in_row(
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
    lock: bool,
) -> Result<LiveLease> {
    let row = sqlx::query(&format!(
        "SELECT s.session_id, (SELECT state FROM ag_turns WHERE turn_id = ?) AS state, \
         s.holder_turn_id, s.lease_token_hash, s.fence, s.lease_expires_at_ms, {NOW_MS} AS now_ms \
         FROM ag_sessions s \
         WHERE s.session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?) {}",
        if lock { "FOR UPDATE" } else { "" }
    ))
    .bind(lease.turn_id.as_str())
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else {
        return Err(missing_turn(conn, lease).await);
    };
    judge(&row, lease)
}

/// Why a turn has no session row: it does not exist (or the session was
/// swept, which only happens once the turn is gone too).
async fn missing_turn(conn: &mut MySqlConnection, lease: &LeaseRef) -> Error {
    let exists = sqlx::query_scalar::<_, i64>("SELECT 1 FROM ag_turns WHERE turn_id = ?")
        .bind(lease.turn_id.as_str())
        .fetch_optional(conn)
        .await;
    match exists {
        Ok(Some(_)) => Error::LeaseLost {
            reason: "taken over or released",
        },
        Ok(None) => Error::not_found(format!("turn {}", lease.turn_id)),
        Err(error) => map_sqlx(error),
    }
}

fn judge(row: &MySqlRow, lease: &LeaseRef) -> Result<LiveLease> {
    let state = text(row, "state")?;
    let holder = text(row, "holder_turn_id")?;
    let token_hash = text(row, "lease_token_hash")?;
    let facts = RowLeaseFacts {
        turn_running: state.as_deref() == Some("running"),
        holder_turn_id: holder.as_deref(),
        lease_token_hash: token_hash.as_deref(),
        fence: get(row, "fence")?,
        lease_expires_at_ms: get(row, "lease_expires_at_ms")?,
        now_ms: get(row, "now_ms")?,
    };
    let checked = check_row_lease(&facts, lease.turn_id.as_str(), &lease.token.digest_hex())?;
    LiveLease::new(row, checked)
}

pub(crate) async fn heartbeat(store: &MySqlStore, lease: &LeaseRef) -> Result<LeaseStatus> {
    let mut retry = Retry::new();
    loop {
        match heartbeat_once(store, lease).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

async fn heartbeat_once(store: &MySqlStore, lease: &LeaseRef) -> Result<LeaseStatus> {
    heartbeat::heartbeat_once(&Sql(store), lease).await
}

#[async_trait::async_trait]
impl HeartbeatSql for Sql<'_> {
    fn leases(&self) -> Option<&dyn LeaseLayer> {
        self.0.leases.as_deref()
    }

    fn lease_ttl_ms(&self) -> i64 {
        self.0.config.lease_ttl_ms()
    }

    async fn turn_state(&self, lease: &LeaseRef) -> Result<Option<String>> {
        // VARBINARY, as every text column here (see `rows`).
        let state: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT state FROM ag_turns WHERE turn_id = ?")
                .bind(lease.turn_id.as_str())
                .fetch_optional(&self.0.pool)
                .await
                .map_err(map_sqlx)?;
        state
            .map(|s| String::from_utf8(s).map_err(|_| corrupt("a turn's state is not UTF-8")))
            .transpose()
    }

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

pub(crate) async fn claim_tool(
    store: &MySqlStore,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<ToolClaim> {
    let mut retry = Retry::new();
    loop {
        let claim = match fast::claim(store, lease, call).await {
            Ok(Some(claim)) => Ok(claim),
            Ok(None) => claim_once(store, lease, call).await,
            Err(error) => Err(error),
        };
        match claim {
            Err(error) => retry.after(error).await?,
            claim => return claim,
        }
    }
}

async fn claim_once(store: &MySqlStore, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim> {
    let mut tx = store.transaction().await?;
    let live = check_lease(store, &mut tx, lease, true).await?;
    // The execution, if any, and how many the turn has, in one read.
    let row = sqlx::query(&format!(
        "SELECT (SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = ?) AS executions, \
         {EXECUTION_COLUMNS} FROM (SELECT 1) AS one \
         LEFT JOIN ag_tool_executions e ON e.turn_id = ? AND e.tool = ? AND e.args_hash = ?"
    ))
    .bind(lease.turn_id.as_str())
    .bind(lease.turn_id.as_str())
    .bind(call.tool.as_str())
    .bind(call.args_hash.as_hex())
    .fetch_one(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let snapshot = execution_snapshot(&row)?;
    let key = idempotency_key(&lease.turn_id, call);
    let claim = match decide_tool_claim(
        snapshot.as_ref(),
        live.fence,
        live.lease_expires_at_ms,
        live.now_ms,
    ) {
        ToolDecision::Reject(error) => return Err(error),
        ToolDecision::Cached => {
            let result = text(&row, "result")?;
            // Nothing written: dropping `tx` rolls back.
            return Ok(ToolClaim::Cached {
                execution_id: ExecutionId::new(Cols(&row).text_required("execution_id")?)?,
                result: json(result)?.unwrap_or(Value::Null),
            });
        }
        ToolDecision::Insert => {
            let executions: i64 = get(&row, "executions")?;
            insert_execution(&mut tx, lease, call, &key, &live, executions).await?
        }
        ToolDecision::Reclaim { attempt, previous } => {
            let execution_id = snapshot
                .map(|s| s.execution_id)
                .ok_or_else(|| corrupt("reclaiming an execution the step did not read"))?;
            sqlx::query(
                "UPDATE ag_tool_executions SET state = 'running', attempt = ?, fence = ?, \
                 error = NULL, updated_at_ms = ? WHERE execution_id = ?",
            )
            .bind(i64::from(attempt))
            .bind(live.fence.0)
            .bind(live.now_ms)
            .bind(&execution_id)
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx)?;
            execute(execution_id, key, attempt, Some(previous))?
        }
    };
    tx.commit().await.map_err(map_sqlx)?;
    Ok(claim)
}

fn execute(
    execution_id: String,
    key: String,
    attempt: u32,
    previous: Option<PreviousOutcome>,
) -> Result<ToolClaim> {
    Ok(ToolClaim::Execute {
        execution_id: ExecutionId::new(execution_id)?,
        idempotency_key: key,
        attempt,
        previous_outcome: previous,
    })
}

async fn insert_execution(
    tx: &mut MySqlConnection,
    lease: &LeaseRef,
    call: &ToolCall,
    key: &str,
    live: &LiveLease,
    existing: i64,
) -> Result<ToolClaim> {
    if existing >= i64::from(MAX_EXECUTIONS_PER_TURN) {
        return Err(Error::invalid(format!(
            "turn {} has {existing} tool executions, the limit is {MAX_EXECUTIONS_PER_TURN}",
            lease.turn_id
        )));
    }
    let execution_id = ExecutionId::generate();
    sqlx::query(
        "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, idempotency_key, \
         state, attempt, fence, created_at_ms, updated_at_ms) \
         VALUES (?, ?, ?, ?, ?, 'running', 1, ?, ?, ?)",
    )
    .bind(execution_id.as_str())
    .bind(lease.turn_id.as_str())
    .bind(call.tool.as_str())
    .bind(call.args_hash.as_hex())
    .bind(key)
    .bind(live.fence.0)
    .bind(live.now_ms)
    .bind(live.now_ms)
    .execute(tx)
    .await
    .map_err(map_sqlx)?;
    execute(execution_id.as_str().to_owned(), key.to_owned(), 1, None)
}

/// Checks that `execution_id` belongs to the turn and runs under `live`'s
/// fence; explains why not.
async fn check_execution(
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &LiveLease,
) -> Result<()> {
    let row: Option<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT state, fence FROM ag_tool_executions WHERE execution_id = ? AND turn_id = ?",
    )
    .bind(execution_id.as_str())
    .bind(lease.turn_id.as_str())
    .fetch_optional(conn)
    .await
    .map_err(map_sqlx)?;
    let row = match &row {
        Some((state, fence)) => Some((
            std::str::from_utf8(state).map_err(|_| corrupt("an execution's state is not UTF-8"))?,
            *fence,
        )),
        None => None,
    };
    decide::check_execution(execution_id.as_str(), row, live.fence.0)
}

/// Ends a running execution under `live`'s fence with `state` and `column`
/// set to `value`. Zero rows means the execution is not ours to end; the
/// caller explains why with [`check_execution`].
async fn end_execution(
    conn: &mut MySqlConnection,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &LiveLease,
    ended: ExecutionEnding<'_>,
) -> Result<u64> {
    let (state, column, value) = ended.columns();
    let done = sqlx::query(&format!(
        "UPDATE ag_tool_executions SET state = '{state}', {column} = ?, updated_at_ms = ? \
         WHERE execution_id = ? AND turn_id = ? AND state = 'running' AND fence = ?"
    ))
    .bind(value.as_str())
    .bind(live.now_ms)
    .bind(execution_id.as_str())
    .bind(lease.turn_id.as_str())
    .bind(live.fence.0)
    .execute(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn complete_tool(
    store: &MySqlStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    completion: Completion<'_>,
) -> Result<Value> {
    tool::complete_tool(&Sql(store), lease, execution_id, completion).await
}

pub(crate) async fn fail_tool(
    store: &MySqlStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    error: &CanonicalJson,
) -> Result<()> {
    tool::fail_tool(&Sql(store), lease, execution_id, error).await
}

/// The store as the shared tool ending sees it.
struct Sql<'a>(&'a MySqlStore);

#[async_trait::async_trait]
impl ToolEndingSql for Sql<'_> {
    /// Completes or fails an execution with a value computed outside the store:
    /// first the fast path's one statement, then, when it changed no row, the
    /// locking transaction, which does the step or explains the refusal.
    async fn end_tool_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        ending: ExecutionEnding<'_>,
    ) -> Result<()> {
        let store = self.0;
        if fast::end_execution(store, lease, execution_id, ending).await? {
            return Ok(());
        }
        let mut tx = store.transaction().await?;
        let live = check_lease(store, &mut tx, lease, true).await?;
        if end_execution(&mut tx, lease, execution_id, &live, ending).await? != 1 {
            check_execution(&mut tx, lease, execution_id, &live).await?;
            return Err(corrupt(format!(
                "tool execution {execution_id} is running under this lease but was not updated"
            )));
        }
        tx.commit().await.map_err(map_sqlx)
    }

    async fn complete_with_effect_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        effect: &mut dyn SqlEffect,
        applied: &mut bool,
    ) -> Result<CanonicalJson> {
        let store = self.0;
        let mut tx = store.transaction().await?;
        let live = check_lease(store, &mut tx, lease, true).await?;
        check_execution(&mut tx, lease, execution_id, &live).await?;
        *applied = true;
        let connection: &mut MySqlConnection = &mut tx;
        let value = effect.apply(connection).await.map_err(Error::Effect)?;
        let result = CanonicalJson::new("result", &value)?;
        let done = end_execution(
            &mut tx,
            lease,
            execution_id,
            &live,
            ExecutionEnding::Succeeded(&result),
        )
        .await?;
        if done != 1 {
            return Err(corrupt(format!(
                "tool execution {execution_id} changed under the session lock"
            )));
        }
        tx.commit().await.map_err(map_sqlx)?;
        Ok(result)
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
        return Err(corrupt(format!(
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
