//! Read-only views (never a lease token), cap overrides and the retention
//! sweeper.
//!
//! Views are single statements on the pool, outside any explicit
//! transaction. The sweeper runs three statements, each its own transaction,
//! so it never holds a turn's row while waiting for a session's row (the
//! reverse of a begin's lock order). Each deletes with `FOR UPDATE SKIP
//! LOCKED`, so a row a step is changing is left for the next sweep, and
//! re-checks its conditions on the row's own columns, which READ COMMITTED
//! re-evaluates on the newest version of a row it had to wait for.

use agentgate_core::config::{check_cap, duration_ms};
use agentgate_core::error::Result;
use agentgate_core::ids::{Fence, SessionId, TurnId, UserId};
use agentgate_core::limits::MAX_OVERVIEW_ROWS;
use agentgate_core::model::{
    HolderView, LiveTurn, Overview, PendingView, SessionView, SweepReport, TurnView, UserView,
};
use agentgate_core::page::{assemble, plan, ExecutionPage, ExecutionPageRequest};
use sqlx::PgPool;

use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_view, get, turn_view, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{PostgresStore, NOW_MS};
use agentgate_store_sql::Retry;

pub(crate) async fn turn(pool: &PgPool, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = $1"
    ))
    .bind(turn_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

pub(crate) async fn executions(
    pool: &PgPool,
    turn_id: &TurnId,
    page: &ExecutionPageRequest,
) -> Result<ExecutionPage> {
    // A keyset page in two reads: the ordering keys and sizes of up to
    // limit + 1 rows after the cursor (no result is read), then the full
    // rows of the ones the page takes, so a page never reads more results
    // than it returns.
    let (after_ms, after_id) = page.after.as_ref().map_or((i64::MIN, ""), |c| {
        (c.created_at_ms, c.execution_id.as_str())
    });
    let keyed: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT execution_id, created_at_ms, \
           (COALESCE(OCTET_LENGTH(result), 0) + COALESCE(OCTET_LENGTH(error), 0))::BIGINT \
         FROM ag_tool_executions WHERE turn_id = $1 \
           AND (created_at_ms > $2 OR (created_at_ms = $2 AND execution_id > $3)) \
         ORDER BY created_at_ms, execution_id LIMIT $4",
    )
    .bind(turn_id.as_str())
    .bind(after_ms)
    .bind(after_id)
    .bind(i64::from(page.fetch()))
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let (keys, more) = plan(keyed, page)?;
    let Some(last) = keys.last() else {
        return Ok(ExecutionPage::default());
    };
    let rows = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = $1 \
           AND (created_at_ms > $2 OR (created_at_ms = $2 AND execution_id > $3)) \
           AND (created_at_ms < $5 OR (created_at_ms = $5 AND execution_id <= $6)) \
         ORDER BY created_at_ms, execution_id LIMIT $4"
    ))
    .bind(turn_id.as_str())
    .bind(after_ms)
    .bind(after_id)
    .bind(i64::try_from(keys.len()).unwrap_or(i64::MAX))
    .bind(last.created_at_ms)
    .bind(last.execution_id.as_str())
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let rows = rows
        .iter()
        .map(execution_view)
        .collect::<Result<Vec<_>>>()?;
    assemble(rows, &keys, more, page)
}

fn holder(
    session_id: &str,
    turn_id: String,
    fence: i64,
    expires_at_ms: i64,
    now_ms: i64,
) -> Result<HolderView> {
    Ok(HolderView {
        session_id: SessionId::new(session_id).map_err(corrupt)?,
        turn_id: TurnId::new(turn_id).map_err(corrupt)?,
        fence: Fence(fence),
        lease_expires_in_ms: expires_at_ms - now_ms,
    })
}

pub(crate) async fn session(
    store: &PostgresStore,
    session_id: &SessionId,
) -> Result<Option<SessionView>> {
    let pool = &store.pool;
    let row = sqlx::query(&format!(
        "SELECT user_id, holder_turn_id, fence, lease_expires_at_ms, pending_turn_id, \
         pending_expires_at_ms, {NOW_MS} AS now_ms FROM ag_sessions WHERE session_id = $1"
    ))
    .bind(session_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else { return Ok(None) };
    let now: i64 = get(&row, "now_ms")?;
    let fence: i64 = get(&row, "fence")?;
    let holder = match (
        &store.leases,
        get::<Option<String>>(&row, "holder_turn_id")?,
        get::<Option<i64>>(&row, "lease_expires_at_ms")?,
    ) {
        (Some(layer), _, _) => layer.holder(session_id.as_str()).await?,
        (None, Some(turn_id), Some(expires)) if expires > now => {
            Some(holder(session_id.as_str(), turn_id, fence, expires, now)?)
        }
        _ => None,
    };
    let pending_confirmation = match (
        get::<Option<String>>(&row, "pending_turn_id")?,
        get::<Option<i64>>(&row, "pending_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(expires)) if expires > now => Some(PendingView {
            turn_id: TurnId::new(turn_id).map_err(corrupt)?,
            expires_in_ms: expires - now,
        }),
        _ => None,
    };
    Ok(Some(SessionView {
        session_id: session_id.clone(),
        user_id: UserId::new(get::<String>(&row, "user_id")?).map_err(corrupt)?,
        holder,
        pending_confirmation,
        fence: Fence(fence),
    }))
}

/// Cap override, clock, then one live holder's session, turn, fence and
/// expiry (all NULL when the user holds none).
type UserRow = (
    Option<i64>,
    i64,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

pub(crate) async fn user(store: &PostgresStore, user_id: &UserId) -> Result<UserView> {
    let (pool, config) = (&store.pool, &store.config);
    // One statement: the cap, the clock and the live holders (if any) agree.
    let rows: Vec<UserRow> = sqlx::query_as(&format!(
        "SELECT (SELECT max_turns FROM ag_users WHERE user_id = $1), {NOW_MS}, \
             s.session_id, s.holder_turn_id, s.fence, s.lease_expires_at_ms \
             FROM (SELECT 1) AS one LEFT JOIN ag_sessions s \
             ON s.user_id = $1 AND s.lease_expires_at_ms > {NOW_MS} \
             ORDER BY s.lease_expires_at_ms"
    ))
    .bind(user_id.as_str())
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let cap = rows.first().and_then(|row| row.0);
    let mut holders = Vec::with_capacity(rows.len());
    for (_, now, session_id, turn_id, fence, expires) in rows {
        if let (Some(session_id), Some(turn_id), Some(fence), Some(expires)) =
            (session_id, turn_id, fence, expires)
        {
            holders.push(holder(&session_id, turn_id, fence, expires, now)?);
        }
    }
    if let Some(layer) = &store.leases {
        // The rows keep no expiry then: the layer knows the live holders.
        holders = layer.user_holders(user_id.as_str()).await?;
    }
    Ok(UserView {
        user_id: user_id.clone(),
        max_turns_per_user: cap
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(config.max_turns_per_user),
        live_turns: u32::try_from(holders.len()).unwrap_or(u32::MAX),
        holders,
    })
}

pub(crate) async fn set_user_cap(pool: &PgPool, user_id: &UserId, cap: Option<u32>) -> Result<()> {
    if let Some(cap) = cap {
        check_cap(cap)?;
    }
    // The user's row is also the lock every begin of the user takes, so a
    // cleared override is NULL rather than a deleted row; the sweeper drops
    // rows that carry nothing once the user has no sessions.
    let mut retry = Retry::new();
    loop {
        let done = sqlx::query(
            "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, $2) \
             ON CONFLICT (user_id) DO UPDATE SET max_turns = EXCLUDED.max_turns",
        )
        .bind(user_id.as_str())
        .bind(cap.map(i64::from))
        .execute(pool)
        .await;
        match done {
            Ok(_) => return Ok(()),
            Err(error) => retry.after(map_sqlx(error)).await?,
        }
    }
}

/// Turns a sweep may delete: ended before the cutoff (awaiting ones only once
/// their confirmation expired too). A running turn is never deleted: once
/// orphaned past its grace it is ended `abandoned` first and kept for the
/// retention like any ending. `$1` cutoff, `$2` pending cutoff, `$3` batch.
const SWEEP_TURNS: &str = "WITH doomed AS ( \
      SELECT turn_id FROM ag_turns t WHERE \
        (t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned') AND t.ended_at_ms < $1) \
        OR (t.state = 'awaiting_confirmation' AND t.ended_at_ms < $2) \
      ORDER BY t.turn_id LIMIT $3 FOR UPDATE SKIP LOCKED), \
    gone AS (DELETE FROM ag_turns t USING doomed d WHERE t.turn_id = d.turn_id RETURNING t.turn_id), \
    gone_executions AS (DELETE FROM ag_tool_executions e USING gone g \
      WHERE e.turn_id = g.turn_id RETURNING 1) \
    SELECT (SELECT COUNT(*) FROM gone), (SELECT COUNT(*) FROM gone_executions)";

/// Idle sessions with no turns left lose their user binding after
/// retention. `$1` cutoff, `$2` now, `$3` batch. A begin that granted since
/// changed `updated_at_ms` and the lease, which the outer `WHERE` re-checks.
const SWEEP_SESSIONS: &str = "DELETE FROM ag_sessions WHERE session_id IN ( \
      SELECT s.session_id FROM ag_sessions s WHERE s.updated_at_ms < $1 \
      AND (s.lease_expires_at_ms IS NULL OR s.lease_expires_at_ms <= $2) \
      AND (s.pending_expires_at_ms IS NULL OR s.pending_expires_at_ms <= $2) \
      AND NOT EXISTS (SELECT 1 FROM ag_turns t WHERE t.session_id = s.session_id) \
      LIMIT $3 FOR UPDATE SKIP LOCKED) \
    AND updated_at_ms < $1 AND (lease_expires_at_ms IS NULL OR lease_expires_at_ms <= $2)";

/// Users rows that carry no cap override and no session: only a lock that a
/// later begin re-creates. `$1` batch.
const SWEEP_USERS: &str = "DELETE FROM ag_users WHERE user_id IN ( \
      SELECT u.user_id FROM ag_users u WHERE u.max_turns IS NULL \
      AND NOT EXISTS (SELECT 1 FROM ag_sessions s WHERE s.user_id = u.user_id) \
      LIMIT $1 FOR UPDATE SKIP LOCKED) \
    AND max_turns IS NULL";

pub(crate) async fn sweep(store: &PostgresStore) -> Result<SweepReport> {
    let config = &store.config;
    let pool = &store.pool;
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    let cutoff = now - duration_ms(config.result_retention);
    let pending_cutoff = cutoff - duration_ms(config.confirmation_ttl);
    let batch = i64::from(config.sweep_batch);
    let (turns, executions): (i64, i64) = sqlx::query_as(SWEEP_TURNS)
        .bind(cutoff)
        .bind(pending_cutoff)
        .bind(batch)
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    let sessions = sqlx::query(SWEEP_SESSIONS)
        .bind(cutoff)
        .bind(now)
        .bind(batch)
        .execute(pool)
        .await
        .map_err(map_sqlx)?
        .rows_affected();
    sqlx::query(SWEEP_USERS)
        .bind(batch)
        .execute(pool)
        .await
        .map_err(map_sqlx)?;
    let count = |n: i64| u64::try_from(n).map_err(|_| corrupt(format!("count {n}")));
    Ok(SweepReport {
        abandoned: 0,
        turns: count(turns)?,
        executions: count(executions)?,
        sessions,
    })
}

pub(crate) async fn overview(store: &PostgresStore, limit: u32) -> Result<Overview> {
    let limit = i64::from(limit.min(MAX_OVERVIEW_ROWS));
    let pool = &store.pool;
    let live = match &store.leases {
        Some(layer) => {
            // The rows name the last holder; the layer says who is live.
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
                 ORDER BY updated_at_ms DESC LIMIT $1",
            )
            .bind(limit)
            .fetch_all(pool)
            .await
            .map_err(map_sqlx)?;
            let mut live = Vec::with_capacity(rows.len());
            for (user_id, session_id) in rows {
                if let Some(holder) = layer.holder(&session_id).await? {
                    live.push(LiveTurn {
                        user_id: UserId::new(user_id).map_err(corrupt)?,
                        holder,
                    });
                }
            }
            live
        }
        None => {
            let rows: Vec<(String, String, String, i64, i64, i64)> = sqlx::query_as(&format!(
                "SELECT user_id, session_id, holder_turn_id, fence, lease_expires_at_ms, {NOW_MS} \
                 FROM ag_sessions WHERE lease_expires_at_ms > {NOW_MS} \
                 ORDER BY lease_expires_at_ms DESC LIMIT $1"
            ))
            .bind(limit)
            .fetch_all(pool)
            .await
            .map_err(map_sqlx)?;
            rows.into_iter()
                .map(|(user_id, session_id, turn_id, fence, expires, now)| {
                    Ok(LiveTurn {
                        user_id: UserId::new(user_id).map_err(corrupt)?,
                        holder: holder(&session_id, turn_id, fence, expires, now)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let turns = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC LIMIT $1"
    ))
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let executions = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC LIMIT $1"
    ))
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(Overview {
        live,
        recent_turns: turns.iter().map(turn_view).collect::<Result<_>>()?,
        recent_executions: executions
            .iter()
            .map(execution_view)
            .collect::<Result<_>>()?,
    })
}
