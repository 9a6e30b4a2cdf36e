//! Read-only views (never a lease token) and the retention sweeper.

use agentgate_core::config::{check_cap, duration_ms};
use agentgate_core::error::Result;
use agentgate_core::ids::{Fence, SessionId, TurnId, UserId};
use agentgate_core::limits::MAX_OVERVIEW_ROWS;
use agentgate_core::model::{
    HolderView, LiveTurn, Overview, PendingView, SessionView, SweepReport, TurnView, UserView,
};
use agentgate_core::page::{assemble, plan, ExecutionPage, ExecutionPageRequest};
use sqlx::{Row, SqliteConnection, SqlitePool};

use crate::begin::now_ms;
use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_view, turn_view, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

pub(crate) async fn turn(conn: &mut SqliteConnection, turn_id: &str) -> Result<Option<TurnView>> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id)
    .fetch_optional(conn)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

pub(crate) async fn executions(
    pool: &SqlitePool,
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
           COALESCE(LENGTH(CAST(result AS BLOB)), 0) + COALESCE(LENGTH(CAST(error AS BLOB)), 0) \
         FROM ag_tool_executions WHERE turn_id = ?1 \
           AND (created_at_ms > ?2 OR (created_at_ms = ?2 AND execution_id > ?3)) \
         ORDER BY created_at_ms, execution_id LIMIT ?4",
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
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = ?1 \
           AND (created_at_ms > ?2 OR (created_at_ms = ?2 AND execution_id > ?3)) \
           AND (created_at_ms < ?5 OR (created_at_ms = ?5 AND execution_id <= ?6)) \
         ORDER BY created_at_ms, execution_id LIMIT ?4"
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
    store: &SqliteStore,
    session_id: &SessionId,
) -> Result<Option<SessionView>> {
    let pool = &store.reader;
    let row = sqlx::query(&format!(
        "SELECT user_id, holder_turn_id, fence, lease_expires_at_ms, pending_turn_id, \
         pending_expires_at_ms, {NOW_MS} AS now_ms FROM ag_sessions WHERE session_id = ?"
    ))
    .bind(session_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else { return Ok(None) };
    let get_i64 = |c: &str| row.try_get::<Option<i64>, _>(c).map_err(map_sqlx);
    let get_text = |c: &str| row.try_get::<Option<String>, _>(c).map_err(map_sqlx);
    let now = get_i64("now_ms")?.ok_or_else(|| corrupt("the store's clock read NULL"))?;
    let fence = get_i64("fence")?.ok_or_else(|| corrupt("a session without a fence"))?;
    let holder = match (
        &store.leases,
        get_text("holder_turn_id")?,
        get_i64("lease_expires_at_ms")?,
    ) {
        (Some(layer), _, _) => layer.holder(session_id.as_str()).await?,
        (None, Some(turn_id), Some(expires)) if expires > now => {
            Some(holder(session_id.as_str(), turn_id, fence, expires, now)?)
        }
        _ => None,
    };
    let pending_confirmation = match (
        get_text("pending_turn_id")?,
        get_i64("pending_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(expires)) if expires > now => Some(PendingView {
            turn_id: TurnId::new(turn_id).map_err(corrupt)?,
            expires_in_ms: expires - now,
        }),
        _ => None,
    };
    Ok(Some(SessionView {
        session_id: session_id.clone(),
        user_id: UserId::new(
            get_text("user_id")?.ok_or_else(|| corrupt("a session without a user"))?,
        )
        .map_err(corrupt)?,
        holder,
        pending_confirmation,
        fence: Fence(fence),
    }))
}

pub(crate) async fn user(store: &SqliteStore, user_id: &UserId) -> Result<UserView> {
    let config = &store.config;
    let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
    let now = now_ms(&mut conn).await?;
    let cap: Option<i64> = sqlx::query_scalar("SELECT max_turns FROM ag_users WHERE user_id = ?")
        .bind(user_id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_sqlx)?;
    let holders = match &store.leases {
        Some(layer) => layer.user_holders(user_id.as_str()).await?,
        None => live_holders(&mut conn, user_id, now).await?,
    };
    Ok(UserView {
        user_id: user_id.clone(),
        max_turns_per_user: cap
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(config.max_turns_per_user),
        live_turns: u32::try_from(holders.len()).unwrap_or(u32::MAX),
        holders,
    })
}

async fn live_holders(
    conn: &mut SqliteConnection,
    user_id: &UserId,
    now: i64,
) -> Result<Vec<HolderView>> {
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT session_id, holder_turn_id, fence, lease_expires_at_ms FROM ag_sessions \
         WHERE user_id = ? AND lease_expires_at_ms > ? ORDER BY lease_expires_at_ms",
    )
    .bind(user_id.as_str())
    .bind(now)
    .fetch_all(conn)
    .await
    .map_err(map_sqlx)?;
    rows.into_iter()
        .map(|(session_id, turn_id, fence, expires)| {
            holder(&session_id, turn_id, fence, expires, now)
        })
        .collect()
}

pub(crate) async fn set_user_cap(
    store: &SqliteStore,
    user_id: &UserId,
    cap: Option<u32>,
) -> Result<()> {
    if let Some(cap) = cap {
        check_cap(cap)?;
    }
    let mut tx = store.write().await?;
    match cap {
        Some(cap) => sqlx::query(
            "INSERT INTO ag_users (user_id, max_turns) VALUES (?1, ?2) \
             ON CONFLICT (user_id) DO UPDATE SET max_turns = ?2",
        )
        .bind(user_id.as_str())
        .bind(cap),
        None => sqlx::query("DELETE FROM ag_users WHERE user_id = ?").bind(user_id.as_str()),
    }
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    tx.commit().await.map_err(map_sqlx)
}

/// Turns a sweep may delete: ended before the cutoff (awaiting ones only once
/// their confirmation expired too). A running turn is never deleted: once
/// orphaned past its grace it is ended `abandoned` first, then kept for the
/// retention like any ending, so a repeat of its request still finds it.
const SWEEPABLE_TURNS: &str = "SELECT turn_id FROM ag_turns t WHERE \
    (t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned') AND t.ended_at_ms < ?1) \
    OR (t.state = 'awaiting_confirmation' AND t.ended_at_ms < ?2) \
    ORDER BY t.turn_id \
    LIMIT ?3";

pub(crate) async fn sweep(store: &SqliteStore) -> Result<SweepReport> {
    let config = &store.config;
    let mut tx = store.write().await?;
    let now = now_ms(&mut tx).await?;
    let cutoff = now - duration_ms(config.result_retention);
    let pending_cutoff = cutoff - duration_ms(config.confirmation_ttl);
    let batch = i64::from(config.sweep_batch);
    let executions = sqlx::query(&format!(
        "DELETE FROM ag_tool_executions WHERE turn_id IN ({SWEEPABLE_TURNS})"
    ))
    .bind(cutoff)
    .bind(pending_cutoff)
    .bind(batch)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?
    .rows_affected();
    let turns = sqlx::query(&format!(
        "DELETE FROM ag_turns WHERE turn_id IN ({SWEEPABLE_TURNS})"
    ))
    .bind(cutoff)
    .bind(pending_cutoff)
    .bind(batch)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?
    .rows_affected();
    // Idle sessions with no turns left lose their user binding after retention.
    let sessions = sqlx::query(
        "DELETE FROM ag_sessions WHERE session_id IN (SELECT s.session_id FROM ag_sessions s \
         WHERE s.updated_at_ms < ?1 AND (s.lease_expires_at_ms IS NULL OR s.lease_expires_at_ms <= ?2) \
         AND (s.pending_expires_at_ms IS NULL OR s.pending_expires_at_ms <= ?2) \
         AND NOT EXISTS (SELECT 1 FROM ag_turns t WHERE t.session_id = s.session_id) LIMIT ?3)",
    )
    .bind(cutoff)
    .bind(now)
    .bind(batch)
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?
    .rows_affected();
    tx.commit().await.map_err(map_sqlx)?;
    Ok(SweepReport {
        abandoned: 0,
        turns,
        executions,
        sessions,
    })
}

pub(crate) async fn overview(store: &SqliteStore, limit: u32) -> Result<Overview> {
    let limit = i64::from(limit.min(MAX_OVERVIEW_ROWS));
    let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
    let now = now_ms(&mut conn).await?;
    let live = match &store.leases {
        Some(layer) => {
            // The rows name the last holder; the layer says who is live.
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
                 ORDER BY updated_at_ms DESC LIMIT ?",
            )
            .bind(limit)
            .fetch_all(&mut *conn)
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
            let rows: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
                "SELECT user_id, session_id, holder_turn_id, fence, lease_expires_at_ms \
                 FROM ag_sessions WHERE lease_expires_at_ms > ? \
                 ORDER BY lease_expires_at_ms DESC LIMIT ?",
            )
            .bind(now)
            .bind(limit)
            .fetch_all(&mut *conn)
            .await
            .map_err(map_sqlx)?;
            rows.into_iter()
                .map(|(user_id, session_id, turn_id, fence, expires)| {
                    Ok(LiveTurn {
                        user_id: UserId::new(user_id).map_err(corrupt)?,
                        holder: holder(&session_id, turn_id, fence, expires, now)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let turns = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC LIMIT ?"
    ))
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let executions = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC LIMIT ?"
    ))
    .bind(limit)
    .fetch_all(&mut *conn)
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
