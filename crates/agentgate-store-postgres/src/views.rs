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

use agentgate_core::error::{Error, Result};
use agentgate_core::model::SweepReport;
use agentgate_store_sql::views::{Cutoffs, ViewSql};

use crate::error::map_sqlx;
use crate::steps::Sql;
use crate::{PostgresStore, NOW_MS};

#[async_trait::async_trait]
impl ViewSql for Sql<'_> {
    const CLAIM_SEQ: &'static str = "claim_seq";
    const STORED_BYTES: &'static str =
        "(COALESCE(OCTET_LENGTH(result), 0) + COALESCE(OCTET_LENGTH(error), 0))::BIGINT";
    const SET_CAP: &'static str = "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, $2) \
         ON CONFLICT (user_id) DO UPDATE SET max_turns = EXCLUDED.max_turns";
    const CLEAR_CAP: &'static str = "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, NULL) \
         ON CONFLICT (user_id) DO UPDATE SET max_turns = NULL";
}

/// Turns a sweep may delete: ended before the cutoff (awaiting ones only once
/// their confirmation expired too). A running turn is never deleted: once
/// orphaned past its grace it is ended `abandoned` first and kept for the
/// retention like any ending. `$1` cutoff, `$2` pending cutoff, `$3` batch.
const SWEEP_TURNS: &str = "WITH doomed AS ( \
      SELECT turn_id FROM ag_turns t WHERE \
        (t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned', 'cancelled', 'superseded') AND t.ended_at_ms < $1) \
        OR (t.state = 'awaiting_confirmation' AND t.ended_at_ms < $2) \
      ORDER BY t.turn_id LIMIT $3 FOR UPDATE SKIP LOCKED), \
    gone AS (DELETE FROM ag_turns t USING doomed d WHERE t.turn_id = d.turn_id RETURNING t.turn_id), \
    gone_executions AS (DELETE FROM ag_tool_executions e USING gone g \
      WHERE e.turn_id = g.turn_id RETURNING 1), \
    gone_events AS (DELETE FROM ag_turn_events v USING gone g WHERE v.turn_id = g.turn_id \
      RETURNING 1) \
    SELECT (SELECT COUNT(*) FROM gone), (SELECT COUNT(*) FROM gone_executions), \
      (SELECT COUNT(*) FROM gone_events)";

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
    let (turns, executions, events): (i64, i64, i64) = sqlx::query_as(SWEEP_TURNS)
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
    let count = |n: i64| u64::try_from(n).map_err(|_| Error::corrupt(format!("count {n}")));
    Ok(SweepReport::deleted(
        count(turns)?,
        count(executions)?,
        count(events)?,
        sessions,
    ))
}
