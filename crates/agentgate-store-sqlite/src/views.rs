//! Read-only views (never a lease token) and the retention sweeper.

use agentgate_core::config::{check_cap, Config};
use agentgate_core::error::Result;
use agentgate_core::ids::{TurnId, UserId};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::model::{ExecutionView, SweepReport, TurnView};
use agentgate_store_sql::rows::Columns;
use agentgate_store_sql::views::{
    Cutoffs, HolderRow, SessionRow, UserRows, ViewSql, SESSION_VIEW_COLUMNS,
};

use crate::begin::now_ms;
use crate::error::map_sqlx;
use crate::rows::{execution_view, turn_view, Cols, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

pub(crate) async fn turn(store: &SqliteStore, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id.as_str())
    .fetch_optional(&store.reader)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

/// The store as the shared views see it: every read on the reader pool.
pub(crate) struct Views<'a>(pub(crate) &'a SqliteStore);

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
        sqlx::query_as(
            "SELECT execution_id, COALESCE(claim_seq, 0) AS claim_seq, \
               COALESCE(LENGTH(CAST(result AS BLOB)), 0) + COALESCE(LENGTH(CAST(error AS BLOB)), 0) \
             FROM ag_tool_executions WHERE turn_id = ?1 \
               AND (COALESCE(claim_seq, 0) > ?2 OR (COALESCE(claim_seq, 0) = ?2 AND execution_id > ?3)) \
             ORDER BY COALESCE(claim_seq, 0), execution_id LIMIT ?4",
        )
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_id)
        .bind(fetch)
        .fetch_all(&self.0.reader)
        .await
        .map_err(map_sqlx)
    }

    async fn execution_rows(
        &self,
        turn_id: &str,
        (after_seq, after_id): (i64, &str),
        (last_seq, last_id): (i64, &str),
        limit: i64,
    ) -> Result<Vec<ExecutionView>> {
        let rows = sqlx::query(&format!(
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = ?1 \
               AND (COALESCE(claim_seq, 0) > ?2 OR (COALESCE(claim_seq, 0) = ?2 AND execution_id > ?3)) \
               AND (COALESCE(claim_seq, 0) < ?5 OR (COALESCE(claim_seq, 0) = ?5 AND execution_id <= ?6)) \
             ORDER BY COALESCE(claim_seq, 0), execution_id LIMIT ?4"
        ))
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_id)
        .bind(limit)
        .bind(last_seq)
        .bind(last_id)
        .fetch_all(&self.0.reader)
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
        .fetch_optional(&self.0.reader)
        .await
        .map_err(map_sqlx)?;
        row.map(|row| SessionRow::read(&Cols(&row))).transpose()
    }

    async fn user_rows(&self, user_id: &str) -> Result<UserRows> {
        let mut conn = self.0.reader.acquire().await.map_err(map_sqlx)?;
        let now_ms = now_ms(&mut conn).await?;
        let cap: Option<i64> =
            sqlx::query_scalar("SELECT max_turns FROM ag_users WHERE user_id = ?")
                .bind(user_id)
                .fetch_optional(&mut *conn)
                .await
                .map_err(map_sqlx)?;
        let rows = sqlx::query(
            "SELECT session_id, holder_turn_id, fence, lease_expires_at_ms FROM ag_sessions \
             WHERE user_id = ? AND lease_expires_at_ms > ? ORDER BY lease_expires_at_ms",
        )
        .bind(user_id)
        .bind(now_ms)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        Ok(UserRows {
            cap,
            now_ms,
            holders: rows
                .iter()
                .map(|row| HolderRow::read(&Cols(row)))
                .collect::<Result<_>>()?,
        })
    }

    async fn live_rows(&self, limit: i64) -> Result<(i64, Vec<(String, HolderRow)>)> {
        let mut conn = self.0.reader.acquire().await.map_err(map_sqlx)?;
        let now = now_ms(&mut conn).await?;
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
        sqlx::query_as(
            "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
             ORDER BY updated_at_ms DESC LIMIT ?",
        )
        .bind(limit)
        .fetch_all(&self.0.reader)
        .await
        .map_err(map_sqlx)
    }

    async fn recent(&self, limit: i64) -> Result<(Vec<TurnView>, Vec<ExecutionView>)> {
        let turns = sqlx::query(&format!(
            "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC, fence DESC LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&self.0.reader)
        .await
        .map_err(map_sqlx)?;
        let executions = sqlx::query(&format!(
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC, fence DESC, claim_seq DESC LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&self.0.reader)
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
    let mut tx = store.write().await?;
    let at = Cutoffs::new(now_ms(&mut tx).await?, &store.config);
    let (cutoff, pending_cutoff, now, batch) =
        (at.cutoff_ms, at.pending_cutoff_ms, at.now_ms, at.batch);
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
