//! Read-only views (never a lease token) and the retention sweeper.

use agentgate_core::error::Result;
use agentgate_core::model::SweepReport;
use agentgate_store_sql::views::{Cutoffs, ViewSql};

use crate::begin::now_ms;
use crate::error::map_sqlx;
use crate::steps::Sql;
use crate::SqliteStore;

#[async_trait::async_trait]
impl ViewSql for Sql<'_> {
    const CLAIM_SEQ: &'static str = "COALESCE(claim_seq, 0)";
    const STORED_BYTES: &'static str =
        "(COALESCE(LENGTH(CAST(result AS BLOB)), 0) + COALESCE(LENGTH(CAST(error AS BLOB)), 0))";
    const SET_CAP: &'static str = "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, $2) \
         ON CONFLICT (user_id) DO UPDATE SET max_turns = excluded.max_turns";
    /// SQLite's user row is no lock (the single writer is), so it goes.
    const CLEAR_CAP: &'static str = "DELETE FROM ag_users WHERE user_id = $1";
}

/// Turns a sweep may delete: ended before the cutoff (awaiting ones only once
/// their confirmation expired too). A running turn is never deleted: once
/// orphaned past its grace it is ended `abandoned` first, then kept for the
/// retention like any ending, so a repeat of its request still finds it.
const SWEEPABLE_TURNS: &str = "SELECT turn_id FROM ag_turns t WHERE \
    (t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned', 'cancelled', 'superseded') AND t.ended_at_ms < ?1) \
    OR (t.state = 'awaiting_confirmation' AND t.ended_at_ms < ?2) \
    ORDER BY t.turn_id \
    LIMIT ?3";

pub(crate) async fn sweep(store: &SqliteStore) -> Result<SweepReport> {
    let mut tx = store.write().await?;
    let at = Cutoffs::new(now_ms(&mut tx).await?, &store.config);
    let (cutoff, pending_cutoff, now, batch) =
        (at.cutoff_ms, at.pending_cutoff_ms, at.now_ms, at.batch);
    // Executions and events first: the turn rows they name select them.
    let mut deleted = [0_u64; 3];
    for (count, table) in
        deleted
            .iter_mut()
            .zip(["ag_tool_executions", "ag_turn_events", "ag_turns"])
    {
        *count = sqlx::query(&format!(
            "DELETE FROM {table} WHERE turn_id IN ({SWEEPABLE_TURNS})"
        ))
        .bind(cutoff)
        .bind(pending_cutoff)
        .bind(batch)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?
        .rows_affected();
    }
    let [executions, events, turns] = deleted;
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
    Ok(SweepReport::deleted(turns, executions, events, sessions))
}
