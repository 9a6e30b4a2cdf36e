//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the SQLite clock.

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::decide::{decide_tool_claim, ToolDecision};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, Fence};
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::model::{
    idempotency_key, Ending, LeaseRef, PreviousOutcome, ToolCall, ToolClaim, TurnView,
};
use agentgate_core::store::{Completion, LeaseStatus};
use serde_json::Value;
use sqlx::{Row, Sqlite, SqliteConnection, Transaction};

use crate::begin::now_ms;
use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_snapshot, turn_view, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

/// A live lease, as checked inside a step's transaction.
pub(crate) struct LiveLease {
    pub session_id: String,
    pub fence: Fence,
    pub lease_expires_at_ms: i64,
    pub now_ms: i64,
}

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
    let now = now_ms(conn).await?;
    let row: Option<(String, String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT t.session_id, t.state, t.fence, s.fence FROM ag_turns t \
         LEFT JOIN ag_sessions s ON s.session_id = t.session_id WHERE t.turn_id = ?",
    )
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let (session_id, state, turn_fence, session_fence) =
        row.ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
    let reason = match held {
        _ if state != "running" => "turn already ended",
        None => "lease expired, taken over or released",
        Some(live) if live.fence.0 != turn_fence || session_fence != Some(turn_fence) => {
            "superseded by a newer fence"
        }
        Some(live) => {
            return Ok(LiveLease {
                session_id,
                fence: live.fence,
                lease_expires_at_ms: now + live.expires_in_ms,
                now_ms: now,
            })
        }
    };
    Err(Error::LeaseLost { reason })
}

/// Leases in the session rows: the row must name this turn, this token's
/// digest, and an expiry after the store's now.
async fn check_in_row(conn: &mut SqliteConnection, lease: &LeaseRef) -> Result<LiveLease> {
    let now = now_ms(conn).await?;
    let row = sqlx::query(
        "SELECT t.session_id, t.state, s.holder_turn_id, s.lease_token_hash, s.fence, \
         s.lease_expires_at_ms FROM ag_turns t LEFT JOIN ag_sessions s ON s.session_id = t.session_id \
         WHERE t.turn_id = ?",
    )
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?
    .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
    let state: String = row.try_get("state").map_err(map_sqlx)?;
    let holder: Option<String> = row.try_get("holder_turn_id").map_err(map_sqlx)?;
    let token_hash: Option<String> = row.try_get("lease_token_hash").map_err(map_sqlx)?;
    let expires: Option<i64> = row.try_get("lease_expires_at_ms").map_err(map_sqlx)?;
    let reason = if state != "running" {
        "turn already ended"
    } else if holder.as_deref() != Some(lease.turn_id.as_str()) {
        "taken over or released"
    } else if token_hash.as_deref() != Some(lease.token.digest_hex().as_str()) {
        "wrong lease token"
    } else if expires.is_none_or(|e| e <= now) {
        "lease expired"
    } else {
        return Ok(LiveLease {
            session_id: row.try_get("session_id").map_err(map_sqlx)?,
            fence: Fence(row.try_get("fence").map_err(map_sqlx)?),
            lease_expires_at_ms: expires.unwrap_or(now),
            now_ms: now,
        });
    };
    Err(Error::LeaseLost { reason })
}

pub(crate) async fn heartbeat(store: &SqliteStore, lease: &LeaseRef) -> Result<LeaseStatus> {
    let ttl_ms = store.config.lease_ttl_ms();
    if let Some(layer) = &store.leases {
        // The lease lives in the layer; a heartbeat never touches SQL.
        let digest = lease.token.digest_hex();
        if let Some(remaining) = layer.renew(lease.turn_id.as_str(), &digest, ttl_ms).await? {
            return Ok(LeaseStatus {
                lease_expires_in_ms: remaining,
            });
        }
        let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
        check_lease(store, &mut conn, lease).await?;
        return Err(Error::LeaseLost {
            reason: "lease expired",
        });
    }
    let mut tx = store.write().await?;
    // One statement renews session lease, permit (the same row) and turn.
    let renewed = sqlx::query(&format!(
        "UPDATE ag_sessions SET lease_expires_at_ms = {NOW_MS} + ?1, updated_at_ms = {NOW_MS} \
         WHERE session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?2) \
         AND holder_turn_id = ?2 AND lease_token_hash = ?3 AND lease_expires_at_ms > {NOW_MS}"
    ))
    .bind(ttl_ms)
    .bind(lease.turn_id.as_str())
    .bind(lease.token.digest_hex())
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    if renewed.rows_affected() == 0 {
        // Explain the refusal; nothing was written.
        check_lease(store, &mut tx, lease).await?;
        return Err(Error::LeaseLost {
            reason: "lease expired",
        });
    }
    tx.commit().await.map_err(map_sqlx)?;
    Ok(LeaseStatus {
        lease_expires_in_ms: ttl_ms,
    })
}

pub(crate) async fn claim_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<ToolClaim> {
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
    let snapshot = existing.as_ref().map(execution_snapshot).transpose()?;
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
            let execution_id = snapshot.map(|s| s.execution_id).unwrap_or_default();
            sqlx::query(
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
    sqlx::query(
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
    match row {
        None => Err(Error::not_found(format!("tool execution {execution_id}"))),
        Some((state, fence)) if state == "running" && fence == live.fence.0 => Ok(()),
        Some((state, _)) if state != "running" => Err(Error::LeaseLost {
            reason: "tool execution already ended",
        }),
        Some(_) => Err(Error::LeaseLost {
            reason: "tool execution claimed by a newer lease",
        }),
    }
}

pub(crate) async fn complete_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    completion: Completion<'_>,
) -> Result<Value> {
    let (mut tx, live) = locked_step(store, lease).await?;
    check_execution(&mut tx, lease, execution_id, &live).await?;
    let result = match completion {
        Completion::Result(json) => json,
        Completion::Effect(effect) => {
            let connection: &mut SqliteConnection = &mut tx;
            let value = effect.apply(connection).await.map_err(Error::Effect)?;
            CanonicalJson::new("result", &value)?
        }
    };
    sqlx::query(
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
    tx.commit().await.map_err(map_sqlx)?;
    serde_json::from_str(result.as_str()).map_err(|e| corrupt(format!("tool result: {e}")))
}

pub(crate) async fn fail_tool(
    store: &SqliteStore,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    error: &CanonicalJson,
) -> Result<()> {
    let (mut tx, live) = locked_step(store, lease).await?;
    check_execution(&mut tx, lease, execution_id, &live).await?;
    sqlx::query(
        "UPDATE ag_tool_executions SET state = 'failed', error = ?1, updated_at_ms = ?2 \
         WHERE execution_id = ?3 AND state = 'running' AND fence = ?4",
    )
    .bind(error.as_str())
    .bind(live.now_ms)
    .bind(execution_id.as_str())
    .bind(live.fence.0)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    tx.commit().await.map_err(map_sqlx)
}

pub(crate) async fn end_turn(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let (mut tx, live) = locked_step(store, lease).await?;
    let now = live.now_ms;
    let (state, response, error, retryable, pending) = match ending {
        Ending::Succeed { response } => ("succeeded", Some(response.as_str()), None, None, None),
        Ending::Fail { error, retryable } => {
            ("failed", None, Some(error.as_str()), Some(*retryable), None)
        }
        Ending::AwaitConfirmation { pending } => (
            "awaiting_confirmation",
            None,
            None,
            None,
            Some(pending.as_str()),
        ),
    };
    sqlx::query(
        "UPDATE ag_turns SET state = ?1, response = ?2, error = ?3, retryable = ?4, \
         pending = COALESCE(?5, pending), updated_at_ms = ?6, ended_at_ms = ?6 \
         WHERE turn_id = ?7 AND state = 'running' AND fence = ?8",
    )
    .bind(state)
    .bind(response)
    .bind(error)
    .bind(retryable)
    .bind(pending)
    .bind(now)
    .bind(lease.turn_id.as_str())
    .bind(live.fence.0)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let pending_expires =
        pending.map(|_| now + agentgate_core::config::duration_ms(store.config.confirmation_ttl));
    // Release session lease and permit (one row) in the same transaction; an
    // ending that awaits confirmation records the pending turn on the session.
    sqlx::query(
        "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
         lease_expires_at_ms = NULL, updated_at_ms = ?1, \
         pending_turn_id = CASE WHEN ?2 IS NULL THEN pending_turn_id ELSE ?3 END, \
         pending_expires_at_ms = CASE WHEN ?2 IS NULL THEN pending_expires_at_ms ELSE ?2 END \
         WHERE session_id = ?4 AND holder_turn_id = ?3",
    )
    .bind(now)
    .bind(pending_expires)
    .bind(lease.turn_id.as_str())
    .bind(&live.session_id)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(lease.turn_id.as_str())
    .fetch_one(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let view = turn_view(&row)?;
    tx.commit().await.map_err(map_sqlx)?;
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
