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

use agentgate_core::config::{check_cap, Config};
use agentgate_core::error::Result;
use agentgate_core::ids::{TurnId, UserId};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::model::{ExecutionView, SweepReport, TurnView};
use agentgate_store_sql::rows::Columns;
use agentgate_store_sql::views::{
    Cutoffs, HolderRow, SessionRow, UserRows, ViewSql, SESSION_VIEW_COLUMNS,
};

use crate::error::{corrupt, map_sqlx};
use crate::rows::{execution_view, get, turn_view, Cols, EXECUTION_COLUMNS, TURN_COLUMNS};
use crate::{PostgresStore, NOW_MS};
use agentgate_store_sql::Retry;

pub(crate) async fn turn(store: &PostgresStore, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let pool = &store.pool;
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = $1"
    ))
    .bind(turn_id.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_view).transpose()
}

/// The store as the shared views see it.
pub(crate) struct Views<'a>(pub(crate) &'a PostgresStore);

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
            "SELECT execution_id, claim_seq, \
               (COALESCE(OCTET_LENGTH(result), 0) + COALESCE(OCTET_LENGTH(error), 0))::BIGINT \
             FROM ag_tool_executions WHERE turn_id = $1 \
               AND (claim_seq > $2 OR (claim_seq = $2 AND execution_id > $3)) \
             ORDER BY claim_seq, execution_id LIMIT $4",
        )
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_id)
        .bind(fetch)
        .fetch_all(&self.0.pool)
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
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = $1 \
               AND (claim_seq > $2 OR (claim_seq = $2 AND execution_id > $3)) \
               AND (claim_seq < $5 OR (claim_seq = $5 AND execution_id <= $6)) \
             ORDER BY claim_seq, execution_id LIMIT $4"
        ))
        .bind(turn_id)
        .bind(after_seq)
        .bind(after_id)
        .bind(limit)
        .bind(last_seq)
        .bind(last_id)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        rows.iter().map(execution_view).collect()
    }

    async fn session_row(&self, session_id: &str) -> Result<Option<SessionRow>> {
        let row = sqlx::query(&format!(
            "SELECT {SESSION_VIEW_COLUMNS}, {NOW_MS} AS now_ms FROM ag_sessions \
             WHERE session_id = $1"
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
            "SELECT (SELECT max_turns FROM ag_users WHERE user_id = $1) AS max_turns, \
               {NOW_MS} AS now_ms, s.session_id, s.holder_turn_id, s.fence, s.lease_expires_at_ms \
             FROM (SELECT 1) AS one LEFT JOIN ag_sessions s \
               ON s.user_id = $1 AND s.lease_expires_at_ms > {NOW_MS} \
             ORDER BY s.lease_expires_at_ms"
        ))
        .bind(user_id)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        let first = rows
            .first()
            .ok_or_else(|| corrupt("a user's view read no row"))?;
        let mut holders = Vec::with_capacity(rows.len());
        for row in &rows {
            if Cols(row).text("session_id")?.is_some() {
                holders.push(HolderRow::read(&Cols(row))?);
            }
        }
        Ok(UserRows {
            cap: get(first, "max_turns")?,
            now_ms: get(first, "now_ms")?,
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
             FROM ag_sessions WHERE lease_expires_at_ms > $1 \
             ORDER BY lease_expires_at_ms DESC LIMIT $2",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        let rows = rows
            .iter()
            .map(|row| Ok((get(row, "user_id")?, HolderRow::read(&Cols(row))?)))
            .collect::<Result<_>>()?;
        Ok((now, rows))
    }

    async fn holding_sessions(&self, limit: i64) -> Result<Vec<(String, String)>> {
        sqlx::query_as(
            "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
             ORDER BY updated_at_ms DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)
    }

    async fn recent(&self, limit: i64) -> Result<(Vec<TurnView>, Vec<ExecutionView>)> {
        let turns = sqlx::query(&format!(
            "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC, fence DESC LIMIT $1"
        ))
        .bind(limit)
        .fetch_all(&self.0.pool)
        .await
        .map_err(map_sqlx)?;
        let executions = sqlx::query(&format!(
            "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions ORDER BY updated_at_ms DESC, fence DESC, claim_seq DESC LIMIT $1"
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
    store: &PostgresStore,
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
    let pool = &store.pool;
    let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    let at = Cutoffs::new(now, &store.config);
    let (turns, executions): (i64, i64) = sqlx::query_as(SWEEP_TURNS)
        .bind(at.cutoff_ms)
        .bind(at.pending_cutoff_ms)
        .bind(at.batch)
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    let sessions = sqlx::query(SWEEP_SESSIONS)
        .bind(at.cutoff_ms)
        .bind(at.now_ms)
        .bind(at.batch)
        .execute(pool)
        .await
        .map_err(map_sqlx)?
        .rows_affected();
    sqlx::query(SWEEP_USERS)
        .bind(at.batch)
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
