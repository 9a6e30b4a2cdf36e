//! Read-only views (never a lease token), cap overrides and the retention
//! sweeper.
//!
//! Views are single statements on the pool, outside any explicit
//! transaction. The sweeper works in three short transactions (turns with
//! their executions, then sessions, then users), so it never holds a turn's
//! row while waiting for a session's row (the reverse of a begin's lock
//! order). Each picks candidates with a plain read, then locks them by
//! primary key with `FOR UPDATE SKIP LOCKED` while re-checking the
//! conditions on the newest row version, so a row a step is changing is left
//! for the next sweep and a row a step changed is not deleted.

use agentgate_core::config::{check_cap, duration_ms};
use agentgate_core::error::Result;
use agentgate_core::ids::{Fence, SessionId, TurnId, UserId};
use agentgate_core::limits::MAX_OVERVIEW_ROWS;
use agentgate_core::model::{
    HolderView, LiveTurn, Overview, PendingView, SessionView, SweepReport, TurnView, UserView,
};
use agentgate_core::page::{assemble, plan, ExecutionPage, ExecutionPageRequest};
use sqlx::{MySqlConnection, MySqlPool};

use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_view, get, text, turn_view, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::Retry;

pub(crate) async fn turn(pool: &MySqlPool, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

pub(crate) async fn executions(
    pool: &MySqlPool,
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
    // execution_id is VARBINARY: it decodes as bytes.
    let keyed: Vec<(Vec<u8>, i64, i64)> = sqlx::query_as(
        "SELECT execution_id, created_at_ms, \
           CAST(COALESCE(LENGTH(result), 0) + COALESCE(LENGTH(error), 0) AS SIGNED) \
         FROM ag_tool_executions WHERE turn_id = ? \
           AND (created_at_ms > ? OR (created_at_ms = ? AND execution_id > ?)) \
         ORDER BY created_at_ms, execution_id LIMIT ?",
    )
    .bind(turn_id.as_str())
    .bind(after_ms)
    .bind(after_ms)
    .bind(after_id)
    .bind(i64::from(page.fetch()))
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let keyed = keyed
        .into_iter()
        .map(|(id, at, bytes)| Ok((String::from_utf8(id).map_err(corrupt)?, at, bytes)))
        .collect::<Result<Vec<_>>>()?;
    let (keys, more) = plan(keyed, page)?;
    let Some(last) = keys.last() else {
        return Ok(ExecutionPage::default());
    };
    let rows = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = ? \
           AND (created_at_ms > ? OR (created_at_ms = ? AND execution_id > ?)) \
           AND (created_at_ms < ? OR (created_at_ms = ? AND execution_id <= ?)) \
         ORDER BY created_at_ms, execution_id LIMIT ?"
    ))
    .bind(turn_id.as_str())
    .bind(after_ms)
    .bind(after_ms)
    .bind(after_id)
    .bind(last.created_at_ms)
    .bind(last.created_at_ms)
    .bind(last.execution_id.as_str())
    .bind(i64::try_from(keys.len()).unwrap_or(i64::MAX))
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
    session_id: String,
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
    store: &MySqlStore,
    session_id: &SessionId,
) -> Result<Option<SessionView>> {
    let pool = &store.pool;
    let row = sqlx::query(&format!(
        "SELECT user_id, holder_turn_id, fence, lease_expires_at_ms, pending_turn_id, \
         pending_expires_at_ms, {NOW_MS} AS now_ms FROM ag_sessions WHERE session_id = ?"
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
        text(&row, "holder_turn_id")?,
        get::<Option<i64>>(&row, "lease_expires_at_ms")?,
    ) {
        (Some(layer), _, _) => layer.holder(session_id.as_str()).await?,
        (None, Some(turn_id), Some(expires)) if expires > now => Some(holder(
            session_id.as_str().to_owned(),
            turn_id,
            fence,
            expires,
            now,
        )?),
        _ => None,
    };
    let pending_confirmation = match (
        text(&row, "pending_turn_id")?,
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
        user_id: UserId::new(
            text(&row, "user_id")?.ok_or_else(|| corrupt("a session without a user"))?,
        )
        .map_err(corrupt)?,
        holder,
        pending_confirmation,
        fence: Fence(fence),
    }))
}

pub(crate) async fn user(store: &MySqlStore, user_id: &UserId) -> Result<UserView> {
    let (pool, config) = (&store.pool, &store.config);
    // One statement: the cap, the clock and the live holders (if any) agree.
    let rows = sqlx::query(&format!(
        "SELECT (SELECT max_turns FROM ag_users WHERE user_id = ?) AS cap, {NOW_MS} AS now_ms, \
         s.session_id, s.holder_turn_id, s.fence, s.lease_expires_at_ms \
         FROM (SELECT 1) AS one LEFT JOIN ag_sessions s \
         ON s.user_id = ? AND s.lease_expires_at_ms > {NOW_MS} \
         ORDER BY s.lease_expires_at_ms"
    ))
    .bind(user_id.as_str())
    .bind(user_id.as_str())
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let mut cap = None;
    let mut holders = Vec::with_capacity(rows.len());
    for row in &rows {
        cap = get::<Option<i64>>(row, "cap")?;
        let now: i64 = get(row, "now_ms")?;
        if let (Some(session_id), Some(turn_id), Some(fence), Some(expires)) = (
            text(row, "session_id")?,
            text(row, "holder_turn_id")?,
            get::<Option<i64>>(row, "fence")?,
            get::<Option<i64>>(row, "lease_expires_at_ms")?,
        ) {
            holders.push(holder(session_id, turn_id, fence, expires, now)?);
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

pub(crate) async fn set_user_cap(
    pool: &MySqlPool,
    user_id: &UserId,
    cap: Option<u32>,
) -> Result<()> {
    if let Some(cap) = cap {
        check_cap(cap)?;
    }
    // The user's row is also the lock every begin of the user takes, so a
    // cleared override is NULL rather than a deleted row; the sweeper drops
    // rows that carry nothing once the user has no sessions.
    let mut retry = Retry::new();
    loop {
        let done = sqlx::query(
            "INSERT INTO ag_users (user_id, max_turns) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE max_turns = ?",
        )
        .bind(user_id.as_str())
        .bind(cap.map(i64::from))
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
/// retention like any ending. Binds: cutoff, pending cutoff.
const SWEEPABLE_TURNS: &str = "((t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned') \
      AND t.ended_at_ms < ?) \
    OR (t.state = 'awaiting_confirmation' AND t.ended_at_ms < ?))";

/// Idle sessions with no turns left lose their user binding after
/// retention. Binds: cutoff, now, now.
const SWEEPABLE_SESSIONS: &str = "(s.updated_at_ms < ? \
    AND (s.lease_expires_at_ms IS NULL OR s.lease_expires_at_ms <= ?) \
    AND (s.pending_expires_at_ms IS NULL OR s.pending_expires_at_ms <= ?) \
    AND NOT EXISTS (SELECT 1 FROM ag_turns t WHERE t.session_id = s.session_id))";

/// User rows that carry no cap override and no session: only a lock that a
/// later begin re-creates.
const SWEEPABLE_USERS: &str = "(u.max_turns IS NULL \
    AND NOT EXISTS (SELECT 1 FROM ag_sessions s WHERE s.user_id = u.user_id))";

/// The time bounds one sweep judges by.
#[derive(Clone, Copy)]
struct Cutoffs {
    now: i64,
    cutoff: i64,
    pending_cutoff: i64,
    batch: i64,
}

pub(crate) async fn sweep(store: &MySqlStore) -> Result<SweepReport> {
    let config = &store.config;
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let cutoff = now - duration_ms(config.result_retention);
    let cutoffs = Cutoffs {
        now,
        cutoff,
        pending_cutoff: cutoff - duration_ms(config.confirmation_ttl),
        batch: i64::from(config.sweep_batch),
    };
    let (turns, executions) = sweep_turns(store, cutoffs).await?;
    let sessions = sweep_sessions(store, cutoffs).await?;
    sweep_users(store, cutoffs).await?;
    Ok(SweepReport {
        abandoned: 0,
        turns,
        executions,
        sessions,
    })
}

/// `n` comma-separated placeholders.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Locks the candidates `ids` of `table` (keyed by `key`) that still satisfy
/// `condition` (bound by `values`), skipping rows a step holds; returns the
/// ids locked.
async fn lock_candidates(
    conn: &mut MySqlConnection,
    table: &str,
    key: &str,
    condition: &str,
    ids: &[Vec<u8>],
    values: &[i64],
) -> Result<Vec<Vec<u8>>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {key} FROM {table} WHERE {key} IN ({}) AND {condition} FOR UPDATE SKIP LOCKED",
        placeholders(ids.len())
    );
    let mut query = sqlx::query_scalar::<_, Vec<u8>>(&sql);
    for id in ids {
        query = query.bind(id.as_slice());
    }
    for value in values {
        query = query.bind(*value);
    }
    query.fetch_all(conn).await.map_err(map_sqlx)
}

/// Deletes the rows of `table` whose `column` is in `ids`.
async fn delete_in(
    conn: &mut MySqlConnection,
    table: &str,
    column: &str,
    ids: &[Vec<u8>],
) -> Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "DELETE FROM {table} WHERE {column} IN ({})",
        placeholders(ids.len())
    );
    let mut query = sqlx::query(&sql);
    for id in ids {
        query = query.bind(id.as_slice());
    }
    Ok(query.execute(conn).await.map_err(map_sqlx)?.rows_affected())
}

async fn sweep_turns(store: &MySqlStore, at: Cutoffs) -> Result<(u64, u64)> {
    let candidates: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT t.turn_id FROM ag_turns t WHERE {SWEEPABLE_TURNS} ORDER BY t.turn_id LIMIT ?"
    ))
    .bind(at.cutoff)
    .bind(at.pending_cutoff)
    .bind(at.batch)
    .fetch_all(&store.pool)
    .await
    .map_err(map_sqlx)?;
    if candidates.is_empty() {
        return Ok((0, 0));
    }
    let mut tx = store.transaction().await?;
    let doomed = lock_candidates(
        &mut tx,
        "ag_turns t",
        "t.turn_id",
        SWEEPABLE_TURNS,
        &candidates,
        &[at.cutoff, at.pending_cutoff],
    )
    .await?;
    let executions = delete_in(&mut tx, "ag_tool_executions", "turn_id", &doomed).await?;
    let turns = delete_in(&mut tx, "ag_turns", "turn_id", &doomed).await?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok((turns, executions))
}

async fn sweep_sessions(store: &MySqlStore, at: Cutoffs) -> Result<u64> {
    let candidates: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT s.session_id FROM ag_sessions s WHERE {SWEEPABLE_SESSIONS} LIMIT ?"
    ))
    .bind(at.cutoff)
    .bind(at.now)
    .bind(at.now)
    .bind(at.batch)
    .fetch_all(&store.pool)
    .await
    .map_err(map_sqlx)?;
    if candidates.is_empty() {
        return Ok(0);
    }
    let mut tx = store.transaction().await?;
    let doomed = lock_candidates(
        &mut tx,
        "ag_sessions s",
        "s.session_id",
        SWEEPABLE_SESSIONS,
        &candidates,
        &[at.cutoff, at.now, at.now],
    )
    .await?;
    let sessions = delete_in(&mut tx, "ag_sessions", "session_id", &doomed).await?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok(sessions)
}

async fn sweep_users(store: &MySqlStore, at: Cutoffs) -> Result<u64> {
    let candidates: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT u.user_id FROM ag_users u WHERE {SWEEPABLE_USERS} LIMIT ?"
    ))
    .bind(at.batch)
    .fetch_all(&store.pool)
    .await
    .map_err(map_sqlx)?;
    if candidates.is_empty() {
        return Ok(0);
    }
    let mut tx = store.transaction().await?;
    let doomed = lock_candidates(
        &mut tx,
        "ag_users u",
        "u.user_id",
        SWEEPABLE_USERS,
        &candidates,
        &[],
    )
    .await?;
    let users = delete_in(&mut tx, "ag_users", "user_id", &doomed).await?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok(users)
}

pub(crate) async fn overview(store: &MySqlStore, limit: u32) -> Result<Overview> {
    let limit = i64::from(limit.min(MAX_OVERVIEW_ROWS));
    let pool = &store.pool;
    let mut live = Vec::new();
    if let Some(layer) = &store.leases {
        // The rows name the last holder; the layer says who is live.
        let rows = sqlx::query(
            "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
             ORDER BY updated_at_ms DESC LIMIT ?",
        )
        .bind(limit)
        .fetch_all(pool)
        .await
        .map_err(map_sqlx)?;
        for row in &rows {
            let (Some(user_id), Some(session_id)) =
                (text(row, "user_id")?, text(row, "session_id")?)
            else {
                continue;
            };
            if let Some(holder) = layer.holder(&session_id).await? {
                live.push(LiveTurn {
                    user_id: UserId::new(user_id).map_err(corrupt)?,
                    holder,
                });
            }
        }
    } else {
        let rows = sqlx::query(&format!(
            "SELECT user_id, session_id, holder_turn_id, fence, lease_expires_at_ms, \
             {NOW_MS} AS now_ms FROM ag_sessions WHERE lease_expires_at_ms > {NOW_MS} \
             ORDER BY lease_expires_at_ms DESC LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(pool)
        .await
        .map_err(map_sqlx)?;
        for row in &rows {
            if let (Some(user_id), Some(session_id), Some(turn_id), Some(expires)) = (
                text(row, "user_id")?,
                text(row, "session_id")?,
                text(row, "holder_turn_id")?,
                get::<Option<i64>>(row, "lease_expires_at_ms")?,
            ) {
                live.push(LiveTurn {
                    user_id: UserId::new(user_id).map_err(corrupt)?,
                    holder: holder(
                        session_id,
                        turn_id,
                        get(row, "fence")?,
                        expires,
                        get(row, "now_ms")?,
                    )?,
                });
            }
        }
    }
    let turns = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC LIMIT ?"
    ))
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let executions = sqlx::query(&format!(
        "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC LIMIT ?"
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
