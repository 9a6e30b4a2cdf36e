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

use agentgate_core::config::{check_cap, Config};
use agentgate_core::error::Result;
use agentgate_core::ids::{TurnId, UserId};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::model::{ExecutionView, SweepReport, TurnView};
use agentgate_store_sql::rows::Columns;
use agentgate_store_sql::views::{
    Cutoffs, HolderRow, SessionRow, UserRows, ViewSql, SESSION_VIEW_COLUMNS,
};
use sqlx::MySqlConnection;

use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_view, turn_view, Cols, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::Retry;

pub(crate) async fn turn(store: &MySqlStore, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let pool = &store.pool;
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

/// The store as the shared views see it.
pub(crate) struct Views<'a>(pub(crate) &'a MySqlStore);

#[async_trait::async_trait]
impl ViewSql for Views<'_> {
    fn leases(&self) -> Option<&dyn LeaseLayer> {
        self.0.leases.as_deref()
    }

    fn config(&self) -> &Config {
        &self.0.config
    }

    async fn execution_keys(
        &self,
        turn_id: &str,
        (after_seq, after_id): (i64, &str),
        fetch: i64,
    ) -> Result<Vec<(String, i64, i64)>> {
        let rows = sqlx::query(
            "SELECT execution_id, COALESCE(claim_seq, 0) AS claim_seq, \
               CAST(COALESCE(OCTET_LENGTH(result), 0) + COALESCE(OCTET_LENGTH(error), 0) AS SIGNED) \
               AS stored_bytes \
             FROM ag_tool_executions WHERE turn_id = ? \
               AND (COALESCE(claim_seq, 0) > ? OR (COALESCE(claim_seq, 0) = ? AND execution_id > ?)) \
             ORDER BY COALESCE(claim_seq, 0), execution_id LIMIT ?",
        )
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_seq)
        .bind(after_id)
        .bind(fetch)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                let row = Cols(row);
                Ok((
                    row.text_required("execution_id")?,
                    row.int_required("claim_seq")?,
                    row.int_required("stored_bytes")?,
                ))
            })
            .collect()
    }

    async fn execution_rows(
        &self,
        turn_id: &str,
        (after_seq, after_id): (i64, &str),
        (last_seq, last_id): (i64, &str),
        limit: i64,
    ) -> Result<Vec<ExecutionView>> {
        let rows = sqlx::query(&format!(
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = ? \
               AND (COALESCE(claim_seq, 0) > ? OR (COALESCE(claim_seq, 0) = ? AND execution_id > ?)) \
               AND (COALESCE(claim_seq, 0) < ? OR (COALESCE(claim_seq, 0) = ? AND execution_id <= ?)) \
             ORDER BY COALESCE(claim_seq, 0), execution_id LIMIT ?"
        ))
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_seq)
        .bind(after_id)
        .bind(last_seq)
        .bind(last_seq)
        .bind(last_id)
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        rows.iter().map(execution_view).collect()
    }

    async fn session_row(&self, session_id: &str) -> Result<Option<SessionRow>> {
        let row = sqlx::query(&format!(
            "SELECT {SESSION_VIEW_COLUMNS}, {NOW_MS} AS now_ms FROM ag_sessions \
             WHERE session_id = ?"
        ))
        .bind(session_id)
        .fetch_optional(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        row.map(|row| SessionRow::read(&Cols(&row))).transpose()
    }

    /// One statement, so the cap, the clock and the live holders agree.
    async fn user_rows(&self, user_id: &str) -> Result<UserRows> {
        let rows = sqlx::query(&format!(
            "SELECT (SELECT max_turns FROM ag_users WHERE user_id = ?) AS max_turns, \
               {NOW_MS} AS now_ms, s.session_id, s.holder_turn_id, s.fence, s.lease_expires_at_ms \
             FROM (SELECT 1) AS one LEFT JOIN ag_sessions s \
               ON s.user_id = ? AND s.lease_expires_at_ms > {NOW_MS} \
             ORDER BY s.lease_expires_at_ms"
        ))
        .bind(user_id)
        .bind(user_id)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        let first = Cols(
            rows.first()
                .ok_or_else(|| corrupt("a user's view read no row"))?,
        );
        let mut holders = Vec::with_capacity(rows.len());
        for row in &rows {
            if Cols(row).text("session_id")?.is_some() {
                holders.push(HolderRow::read(&Cols(row))?);
            }
        }
        Ok(UserRows {
            cap: first.int("max_turns")?,
            now_ms: first.int_required("now_ms")?,
            holders,
        })
    }

    async fn live_rows(&self, limit: i64) -> Result<(i64, Vec<(String, HolderRow)>)> {
        let mut conn = self.0.pool.acquire().await.map_err(map_sqlx)?;
        let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
            .fetch_one(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let rows = sqlx::query(
            "SELECT user_id, session_id, holder_turn_id, fence, lease_expires_at_ms \
             FROM ag_sessions WHERE lease_expires_at_ms > ? \
             ORDER BY lease_expires_at_ms DESC LIMIT ?",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        let rows = rows
            .iter()
            .map(|row| {
                let row = Cols(row);
                Ok((row.text_required("user_id")?, HolderRow::read(&row)?))
            })
            .collect::<Result<_>>()?;
        Ok((now, rows))
    }

    async fn holding_sessions(&self, limit: i64) -> Result<Vec<(String, String)>> {
        let rows = sqlx::query(
            "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
             ORDER BY updated_at_ms DESC LIMIT ?",
        )
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                let row = Cols(row);
                Ok((
                    row.text_required("user_id")?,
                    row.text_required("session_id")?,
                ))
            })
            .collect()
    }

    async fn recent(&self, limit: i64) -> Result<(Vec<TurnView>, Vec<ExecutionView>)> {
        let turns = sqlx::query(&format!(
            "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC, fence DESC LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        let executions = sqlx::query(&format!(
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC, fence DESC, claim_seq DESC LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        Ok((
            turns.iter().map(turn_view).collect::<Result<_>>()?,
            executions
                .iter()
                .map(execution_view)
                .collect::<Result<_>>()?,
        ))
    }
}

pub(crate) async fn set_user_cap(
    store: &MySqlStore,
    user_id: &UserId,
    cap: Option<u32>,
) -> Result<()> {
    let pool = &store.pool;
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

pub(crate) async fn sweep(store: &MySqlStore) -> Result<SweepReport> {
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let cutoffs = Cutoffs::new(now, &store.config);
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
    .bind(at.cutoff_ms)
    .bind(at.pending_cutoff_ms)
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
        &[at.cutoff_ms, at.pending_cutoff_ms],
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
    .bind(at.cutoff_ms)
    .bind(at.now_ms)
    .bind(at.now_ms)
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
        &[at.cutoff_ms, at.now_ms, at.now_ms],
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
