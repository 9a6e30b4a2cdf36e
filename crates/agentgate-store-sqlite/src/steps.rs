//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the SQLite clock.
//!
//! The common case of each step is as few calls into SQLite as its writes:
//! a heartbeat, a first tool claim and a tool completion or failure with a
//! result are one autocommit statement each, whose `WHERE` carries the whole
//! lease check ([`live_fence`]); a turn ending is `BEGIN IMMEDIATE`, the
//! turn's update (`RETURNING` its view), the session's release, `COMMIT`.
//! When such a statement changes no row, the step falls back to reading the
//! state in a transaction, which either explains the refusal (`lease_lost`,
//! `not_found`, a cached result, a tool in flight) or does the rarer work
//! (a reclaim, a same-transaction effect). SQLite has one writer, so a
//! single statement's check and write see the same state.

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::decide::{
    self, check_layer_lease, check_row_lease, decide_tool_claim, RowLeaseFacts, ToolDecision,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, Fence};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::limits::FAST_ATTEMPTS;
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::model::{
    idempotency_key, Ending, ExecutionEnding, LeaseRef, PreviousOutcome, ToolCall, ToolClaim,
    TurnView,
};
use agentgate_core::store::{Completion, LeaseStatus, SqlEffect};
use serde_json::Value;
use sqlx::query::Query;
use sqlx::sqlite::SqliteArguments;
use sqlx::{Row, Sqlite, SqliteConnection, Transaction};

use agentgate_store_sql::heartbeat::{self, HeartbeatSql};
use agentgate_store_sql::tool::{self, ToolEndingSql};

use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_snapshot, turn_view, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

/// A live lease, as checked inside a step's transaction.
pub(crate) use agentgate_core::decide::CheckedLease as LiveLease;

/// Checks that `lease` is the live holder of its session; explains why not.
pub(crate) async fn check_lease(
    store: &SqliteStore,
    conn: &mut SqliteConnection,
    lease: &LeaseRef,
) -> Result<LiveLease> {
    match &store.leases {
        Some(layer) => {
            let held = layer
                .holds(lease.turn_id.as_str(), &lease.token.digest_hex())
                .await?;
            check_external(held, conn, lease).await
        }
        None => check_in_row(conn, lease).await,
    }
}

/// What a one-statement step binds as `?2` to prove its lease inside the
/// statement (`?1` is always the turn id); see [`live_fence`].
enum Proof {
    /// The lease lives in the session row: the token's digest.
    Token(String),
    /// The lease lives in the layer, which holds it under this fence.
    Layer(Fence),
}

impl Proof {
    /// The caller's proof, or `None` when the layer says it holds no lease
    /// (the step then goes straight to explaining the refusal).
    async fn of(store: &SqliteStore, lease: &LeaseRef) -> Result<Option<Self>> {
        let digest = lease.token.digest_hex();
        match &store.leases {
            None => Ok(Some(Self::Token(digest))),
            Some(layer) => Ok(layer
                .holds(lease.turn_id.as_str(), &digest)
                .await?
                .map(|live| Self::Layer(live.fence))),
        }
    }

    /// A scalar subquery: the fence of the caller's lease when it is live,
    /// else NULL, so `fence = {live_fence}` fails for a lost lease. The turn
    /// must be running; in the row, the session must name it as holder with
    /// this token's digest and an expiry after the store's now; with a
    /// layer, the layer's fence must be the turn's and the session's newest.
    fn live_fence(&self) -> String {
        match self {
            Self::Token(_) => format!(
                "(SELECT s.fence FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
                 WHERE t.turn_id = ?1 AND t.state = 'running' AND s.holder_turn_id = ?1 \
                 AND s.lease_token_hash = ?2 AND s.lease_expires_at_ms > {NOW_MS})"
            ),
            Self::Layer(_) => "(SELECT t.fence FROM ag_turns t JOIN ag_sessions s \
                 ON s.session_id = t.session_id WHERE t.turn_id = ?1 AND t.state = 'running' \
                 AND t.fence = ?2 AND s.fence = t.fence)"
                .to_owned(),
        }
    }

    /// `sql` (which uses [`Proof::live_fence`]) with `?1` and `?2` bound.
    fn query<'q>(
        &self,
        sql: &'q str,
        lease: &'q LeaseRef,
    ) -> Query<'q, Sqlite, SqliteArguments<'q>> {
        let query = sqlx::query(sql).bind(lease.turn_id.as_str());
        match self {
            Self::Token(digest) => query.bind(digest.clone()),
            Self::Layer(fence) => query.bind(fence.0),
        }
    }
}

/// The error for a step whose statement kept changing no row while every
/// explanation found the lease live: the state is moving under it.
fn unsettled(step: &str) -> Error {
    Error::conflict(format!("{step}: the lease's state changed during the step"))
}

/// Opens a step's write transaction and checks the lease in it. With an
/// external layer the layer is asked first, before the write lock is taken,
/// so SQLite's single writer never waits on a Redis round trip; the fence
/// check inside the transaction still guards every write.
pub(crate) async fn locked_step(
    store: &SqliteStore,
    lease: &LeaseRef,
) -> Result<(Transaction<'static, Sqlite>, LiveLease)> {
    let held = match &store.leases {
        Some(layer) => Some(
            layer
                .holds(lease.turn_id.as_str(), &lease.token.digest_hex())
                .await?,
        ),
        None => None,
    };
    let mut tx = store.write().await?;
    let live = match held {
        Some(held) => check_external(held, &mut tx, lease).await?,
        None => check_in_row(&mut tx, lease).await?,
    };
    Ok((tx, live))
}

/// With an external lease layer: the layer must hold the lease, and the
/// SQL rows must agree that its fence is the session's newest. The second
/// check is what stops a holder whose layer lease vanished (Redis restarted)
/// after a newer turn was granted.
async fn check_external(
    held: Option<agentgate_core::lease::LiveLease>,
    conn: &mut SqliteConnection,
    lease: &LeaseRef,
) -> Result<LiveLease> {
    let row: Option<(String, i64, Option<i64>, i64)> = sqlx::query_as(&format!(
        "SELECT t.state, t.fence, s.fence, {NOW_MS} FROM ag_turns t \
         LEFT JOIN ag_sessions s ON s.session_id = t.session_id WHERE t.turn_id = ?"
    ))
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let (state, turn_fence, session_fence, now) =
        row.ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
    check_layer_lease(
        held.as_ref(),
        state == "running",
        turn_fence,
        session_fence,
        now,
    )
}

/// Leases in the session rows: the row must name this turn, this token's
/// digest, and an expiry after the store's now.
async fn check_in_row(conn: &mut SqliteConnection, lease: &LeaseRef) -> Result<LiveLease> {
    let row = sqlx::query(&format!(
        "SELECT t.state, s.holder_turn_id, s.lease_token_hash, s.fence, \
         s.lease_expires_at_ms, {NOW_MS} AS now_ms FROM ag_turns t \
         LEFT JOIN ag_sessions s ON s.session_id = t.session_id WHERE t.turn_id = ?"
    ))
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?
    .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
    let get = |column: &str| row.try_get::<Option<String>, _>(column).map_err(map_sqlx);
    let number = |column: &str| row.try_get::<Option<i64>, _>(column).map_err(map_sqlx);
    let (state, holder, token_hash) = (
        get("state")?,
        get("holder_turn_id")?,
        get("lease_token_hash")?,
    );
    let facts = RowLeaseFacts {
        turn_running: state.as_deref() == Some("running"),
        holder_turn_id: holder.as_deref(),
        lease_token_hash: token_hash.as_deref(),
        fence: number("fence")?,
        lease_expires_at_ms: number("lease_expires_at_ms")?,
        now_ms: number("now_ms")?.ok_or_else(|| corrupt("the store's clock read NULL"))?,
    };
    check_row_lease(&facts, lease.turn_id.as_str(), &lease.token.digest_hex())
}

pub(crate) async fn heartbeat(store: &SqliteStore, lease: &LeaseRef) -> Result<LeaseStatus> {
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
        sqlx::query_scalar("SELECT state FROM ag_turns WHERE turn_id = ?")
            .bind(lease.turn_id.as_str())
            .fetch_optional(&self.0.reader)
            .await
            .map_err(map_sqlx)
    }

    /// One autocommit statement on the writer renews session lease and
    /// permit (the same row).
    async fn renew_row_lease(&self, lease: &LeaseRef, ttl_ms: i64) -> Result<bool> {
        let renewed = sqlx::query(&format!(
            "UPDATE ag_sessions SET lease_expires_at_ms = {NOW_MS} + ?1, updated_at_ms = {NOW_MS} \
             WHERE session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?2) \
             AND holder_turn_id = ?2 AND lease_token_hash = ?3 AND lease_expires_at_ms > {NOW_MS}"
        ))
        .bind(ttl_ms)
        .bind(lease.turn_id.as_str())
        .bind(lease.token.digest_hex())
        .execute(&self.0.writer)
        .await
        .map_err(map_sqlx)?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn explain_lease(&self, lease: &LeaseRef) -> Result<()> {
        let mut conn = self.0.reader.acquire().await.map_err(map_sqlx)?;
        check_lease(self.0, &mut conn, lease).await.map(drop)
    }
}

pub(crate) async fn claim_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<ToolClaim> {
    if let Some(claim) = first_claim(store, lease, call).await? {
        return Ok(claim);
    }
    // Not a first claim (or a lost lease, or the turn's execution limit):
    // read the execution and let `decide_tool_claim` say.
    let (mut tx, live) = locked_step(store, lease).await?;
    let existing = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = ? AND tool = ? AND args_hash = ?"
    ))
    .bind(lease.turn_id.as_str())
    .bind(call.tool.as_str())
    .bind(call.args_hash.as_hex())
    .fetch_optional(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let snapshot = match &existing {
        Some(row) => Some(
            execution_snapshot(row)?.ok_or_else(|| corrupt("an execution row without its id"))?,
        ),
        None => None,
    };
    let key = idempotency_key(&lease.turn_id, call);
    let claim = match decide_tool_claim(
        snapshot.as_ref(),
        live.fence,
        live.lease_expires_at_ms,
        live.now_ms,
    ) {
        ToolDecision::Reject(error) => return Err(error),
        ToolDecision::Cached => {
            let row = existing.ok_or_else(|| corrupt("cached without row"))?;
            let result: Option<String> = row.try_get("result").map_err(map_sqlx)?;
            ToolClaim::Cached {
                execution_id: ExecutionId::new(
                    row.try_get::<String, _>("execution_id").map_err(map_sqlx)?,
                )?,
                result: serde_json::from_str(result.as_deref().unwrap_or("null"))
                    .map_err(|e| corrupt(format!("tool result: {e}")))?,
            }
        }
        ToolDecision::Insert => insert_execution(&mut tx, lease, call, &key, &live).await?,
        ToolDecision::Reclaim { attempt, previous } => {
            let execution_id = snapshot
                .map(|s| s.execution_id)
                .ok_or_else(|| corrupt("reclaiming an execution the step did not read"))?;
            let reclaimed = sqlx::query(
                "UPDATE ag_tool_executions SET state = 'running', attempt = ?1, fence = ?2, \
                 error = NULL, updated_at_ms = ?3 WHERE execution_id = ?4",
            )
            .bind(attempt)
            .bind(live.fence.0)
            .bind(live.now_ms)
            .bind(&execution_id)
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx)?;
            Error::expect_rows(reclaimed.rows_affected(), 1, "reclaiming the execution")?;
            execute(execution_id, key, attempt, Some(previous))?
        }
    };
    tx.commit().await.map_err(map_sqlx)?;
    Ok(claim)
}

/// A first claim of a call, in one statement: inserts the execution when
/// the lease is live, the call has no execution yet and the turn is under its
/// execution limit — exactly the case where `decide_tool_claim` says
/// `Insert`. `None` when it inserted nothing.
async fn first_claim(
    store: &SqliteStore,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<Option<ToolClaim>> {
    let Some(proof) = Proof::of(store, lease).await? else {
        return Ok(None);
    };
    let execution_id = ExecutionId::generate();
    let key = idempotency_key(&lease.turn_id, call);
    let sql = format!(
        "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, \
         idempotency_key, state, attempt, fence, created_at_ms, updated_at_ms) \
         SELECT ?3, ?1, ?4, ?5, ?6, 'running', 1, live.fence, {NOW_MS}, {NOW_MS} \
         FROM (SELECT {} AS fence) live WHERE live.fence IS NOT NULL \
         AND (SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = ?1) < ?7 \
         ON CONFLICT DO NOTHING",
        proof.live_fence()
    );
    let inserted = proof
        .query(&sql, lease)
        .bind(execution_id.as_str())
        .bind(call.tool.as_str())
        .bind(call.args_hash.as_hex())
        .bind(key.as_str())
        .bind(i64::from(MAX_EXECUTIONS_PER_TURN))
        .execute(&store.writer)
        .await
        .map_err(map_sqlx)?;
    if inserted.rows_affected() == 0 {
        return Ok(None);
    }
    execute(execution_id.as_str().to_owned(), key, 1, None).map(Some)
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
    tx: &mut SqliteConnection,
    lease: &LeaseRef,
    call: &ToolCall,
    key: &str,
    live: &LiveLease,
) -> Result<ToolClaim> {
    let existing: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = ?")
            .bind(lease.turn_id.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(map_sqlx)?;
    if existing >= i64::from(MAX_EXECUTIONS_PER_TURN) {
        return Err(Error::invalid(format!(
            "turn {} has {existing} tool executions, the limit is {MAX_EXECUTIONS_PER_TURN}",
            lease.turn_id
        )));
    }
    let execution_id = ExecutionId::generate();
    let inserted = sqlx::query(
        "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, idempotency_key, \
         state, attempt, fence, created_at_ms, updated_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, 'running', 1, ?6, ?7, ?7)",
    )
    .bind(execution_id.as_str())
    .bind(lease.turn_id.as_str())
    .bind(call.tool.as_str())
    .bind(call.args_hash.as_hex())
    .bind(key)
    .bind(live.fence.0)
    .bind(live.now_ms)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    Error::expect_rows(inserted.rows_affected(), 1, "the new execution")?;
    execute(execution_id.as_str().to_owned(), key.to_owned(), 1, None)
}

/// Checks that `execution_id` belongs to the turn and runs under `live`'s fence.
async fn check_execution(
    conn: &mut SqliteConnection,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &LiveLease,
) -> Result<()> {
    let row: Option<(String, i64)> = sqlx::query_as(
        "SELECT state, fence FROM ag_tool_executions WHERE execution_id = ? AND turn_id = ?",
    )
    .bind(execution_id.as_str())
    .bind(lease.turn_id.as_str())
    .fetch_optional(conn)
    .await
    .map_err(map_sqlx)?;
    decide::check_execution(
        execution_id.as_str(),
        row.as_ref().map(|(state, fence)| (state.as_str(), *fence)),
        live.fence.0,
    )
}

pub(crate) async fn complete_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    completion: Completion<'_>,
) -> Result<Value> {
    tool::complete_tool(&Sql(store), lease, execution_id, completion).await
}

/// The store as the shared tool ending sees it. SQLite marks no error a
/// conflict, so the shared step never runs one of these again.
struct Sql<'a>(&'a SqliteStore);

#[async_trait::async_trait]
impl ToolEndingSql for Sql<'_> {
    /// Ends a running execution under a live lease in one autocommit statement;
    /// when that changes no row, explains why (or, if nothing is wrong any more,
    /// runs it again).
    async fn end_tool_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        ending: ExecutionEnding<'_>,
    ) -> Result<()> {
        let store = self.0;
        let (state, column, json) = ending.columns();
        for _ in 0..FAST_ATTEMPTS {
            if let Some(proof) = Proof::of(store, lease).await? {
                let sql = format!(
                    "UPDATE ag_tool_executions SET state = '{state}', {column} = ?3, \
                     updated_at_ms = {NOW_MS} WHERE execution_id = ?4 AND turn_id = ?1 \
                     AND state = 'running' AND fence = {}",
                    proof.live_fence()
                );
                let updated = proof
                    .query(&sql, lease)
                    .bind(json.as_str())
                    .bind(execution_id.as_str())
                    .execute(&store.writer)
                    .await
                    .map_err(map_sqlx)?;
                if updated.rows_affected() == 1 {
                    return Ok(());
                }
            }
            let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
            let live = check_lease(store, &mut conn, lease).await?;
            check_execution(&mut conn, lease, execution_id, &live).await?;
        }
        Err(unsettled("tool completion"))
    }

    /// The same-transaction case: the lease and the execution are checked, the
    /// caller's effect runs and the success mark is written in one write
    /// transaction, so the effect commits exactly when the mark does.
    async fn complete_with_effect_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        effect: &mut dyn SqlEffect,
        applied: &mut bool,
    ) -> Result<CanonicalJson> {
        let store = self.0;
        let (mut tx, live) = locked_step(store, lease).await?;
        check_execution(&mut tx, lease, execution_id, &live).await?;
        *applied = true;
        let connection: &mut SqliteConnection = &mut tx;
        let value = effect.apply(connection).await.map_err(Error::Effect)?;
        let result = CanonicalJson::new("result", &value)?;
        let completed = sqlx::query(
            "UPDATE ag_tool_executions SET state = 'succeeded', result = ?1, updated_at_ms = ?2 \
             WHERE execution_id = ?3 AND state = 'running' AND fence = ?4",
        )
        .bind(result.as_str())
        .bind(live.now_ms)
        .bind(execution_id.as_str())
        .bind(live.fence.0)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        // `check_execution` read it running under this fence, under the writer.
        Error::expect_rows(completed.rows_affected(), 1, "completing the execution")?;
        tx.commit().await.map_err(map_sqlx)?;
        Ok(result)
    }
}

pub(crate) async fn fail_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    error: &CanonicalJson,
) -> Result<()> {
    tool::fail_tool(&Sql(store), lease, execution_id, error).await
}

pub(crate) async fn end_turn(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let mut ended = None;
    for _ in 0..FAST_ATTEMPTS {
        if let Some(view) = try_end(store, lease, ending).await? {
            ended = Some(view);
            break;
        }
        let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
        check_lease(store, &mut conn, lease).await?;
    }
    let view = ended.ok_or_else(|| unsettled("turn ending"))?;
    if let Some(layer) = &store.leases {
        // After the commit the ending is durable: a release that fails only
        // leaves a lease that expires by itself, so it is not the caller's
        // error.
        if let Err(error) = layer
            .release(lease.turn_id.as_str(), &lease.token.digest_hex())
            .await
        {
            tracing::warn!(%error, turn_id = %lease.turn_id, "could not release an ended turn's lease");
        }
    }
    Ok(view)
}

/// Ends the turn and releases its session lease and permit (one row) in one
/// write transaction of two statements; `None`, with nothing written, when
/// the lease is not live.
async fn try_end(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<Option<TurnView>> {
    let columns = ending.columns();
    let Some(proof) = Proof::of(store, lease).await? else {
        return Ok(None);
    };
    let sql = format!(
        "UPDATE ag_turns SET state = ?3, response = ?4, error = ?5, retryable = ?6, \
         pending = COALESCE(?7, pending), updated_at_ms = {NOW_MS}, ended_at_ms = {NOW_MS} \
         WHERE turn_id = ?1 AND state = 'running' AND fence = {} RETURNING {TURN_COLUMNS}",
        proof.live_fence()
    );
    let mut tx = store.write().await?;
    let row = proof
        .query(&sql, lease)
        .bind(columns.state)
        .bind(columns.response)
        .bind(columns.error)
        .bind(columns.retryable)
        .bind(columns.pending)
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_sqlx)?;
    // No row: the lease is not live; dropping `tx` rolls back (nothing was
    // written).
    let Some(row) = row else { return Ok(None) };
    let view = turn_view(&row)?;
    let pending_ttl_ms = columns
        .pending
        .map(|_| agentgate_core::config::duration_ms(store.config.confirmation_ttl));
    // Release session lease and permit (one row) in the same transaction; an
    // ending that awaits confirmation records the pending turn on the session.
    sqlx::query(
        "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
         lease_expires_at_ms = NULL, updated_at_ms = ?1, \
         pending_turn_id = CASE WHEN ?2 IS NULL THEN pending_turn_id ELSE ?3 END, \
         pending_expires_at_ms = CASE WHEN ?2 IS NULL THEN pending_expires_at_ms ELSE ?1 + ?2 END \
         WHERE session_id = ?4 AND holder_turn_id = ?3",
    )
    .bind(view.updated_at_ms)
    .bind(pending_ttl_ms)
    .bind(lease.turn_id.as_str())
    .bind(view.session_id.as_str())
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok(Some(view))
}
