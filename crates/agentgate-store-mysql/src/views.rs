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

use agentgate_core::error::Result;
use agentgate_core::model::SweepReport;
use agentgate_store_sql::views::{Cutoffs, ViewSql};
use sqlx::MySqlConnection;

use crate::error::map_sqlx;
use crate::steps::Sql;
use crate::{MySqlStore, NOW_MS};

#[async_trait::async_trait]
impl ViewSql for Sql<'_> {
    const CLAIM_SEQ: &'static str = "COALESCE(claim_seq, 0)";
    const STORED_BYTES: &'static str =
        "CAST(COALESCE(OCTET_LENGTH(result), 0) + COALESCE(OCTET_LENGTH(error), 0) AS SIGNED)";
    const SET_CAP: &'static str = "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, $2) \
         ON DUPLICATE KEY UPDATE max_turns = $2";
    const CLEAR_CAP: &'static str = "INSERT INTO ag_users (user_id, max_turns) VALUES ($1, NULL) \
         ON DUPLICATE KEY UPDATE max_turns = NULL";
}

/// Turns a sweep may delete: ended before the cutoff (awaiting ones only once
/// their confirmation expired too). A running turn is never deleted: once
/// orphaned past its grace it is ended `abandoned` first and kept for the
/// retention like any ending. Binds: cutoff, pending cutoff.
const SWEEPABLE_TURNS: &str =
    "((t.state IN ('succeeded', 'failed', 'confirmed', 'abandoned', 'cancelled', 'superseded') \
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
    let mut conn = store.held().await?;
    let now = sqlx::query_scalar::<_, i64>(&format!("SELECT {NOW_MS}"))
        .fetch_one(&mut *conn)
        .await;
    conn.release();
    let now = now.map_err(map_sqlx)?;
    let cutoffs = Cutoffs::new(now, &store.config);
    let (turns, executions, events) = sweep_turns(store, cutoffs).await?;
    let sessions = sweep_sessions(store, cutoffs).await?;
    sweep_users(store, cutoffs).await?;
    Ok(SweepReport::deleted(turns, executions, events, sessions))
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

/// Deletes due turns with their executions and events: the three counts.
async fn sweep_turns(store: &MySqlStore, at: Cutoffs) -> Result<(u64, u64, u64)> {
    let candidates = fetch_ids(
        store,
        sqlx::query_scalar(&format!(
            "SELECT t.turn_id FROM ag_turns t WHERE {SWEEPABLE_TURNS} ORDER BY t.turn_id LIMIT ?"
        ))
        .bind(at.cutoff_ms)
        .bind(at.pending_cutoff_ms)
        .bind(at.batch),
    )
    .await?;
    if candidates.is_empty() {
        return Ok((0, 0, 0));
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
    // A turn's events go with it.
    let events = delete_in(&mut tx, "ag_turn_events", "turn_id", &doomed).await?;
    let turns = delete_in(&mut tx, "ag_turns", "turn_id", &doomed).await?;
    tx.commit().await.map_err(map_sqlx)?;
    Ok((turns, executions, events))
}

async fn sweep_sessions(store: &MySqlStore, at: Cutoffs) -> Result<u64> {
    let candidates = fetch_ids(
        store,
        sqlx::query_scalar(&format!(
            "SELECT s.session_id FROM ag_sessions s WHERE {SWEEPABLE_SESSIONS} LIMIT ?"
        ))
        .bind(at.cutoff_ms)
        .bind(at.now_ms)
        .bind(at.now_ms)
        .bind(at.batch),
    )
    .await?;
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
    let candidates = fetch_ids(
        store,
        sqlx::query_scalar(&format!(
            "SELECT u.user_id FROM ag_users u WHERE {SWEEPABLE_USERS} LIMIT ?"
        ))
        .bind(at.batch),
    )
    .await?;
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

/// The ids one sweep query selects, on a connection held through it.
async fn fetch_ids(
    store: &MySqlStore,
    query: sqlx::query::QueryScalar<'_, sqlx::MySql, Vec<u8>, sqlx::mysql::MySqlArguments>,
) -> Result<Vec<Vec<u8>>> {
    let mut conn = store.held().await?;
    let ids = query.fetch_all(&mut *conn).await;
    conn.release();
    ids.map_err(map_sqlx)
}
