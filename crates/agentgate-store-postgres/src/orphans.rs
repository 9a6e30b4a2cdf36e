//! Orphans: running turns whose lease is gone without an ending. Listing
//! them for recovery workers and the sweeper, and ending one `abandoned`.
//!
//! The claim itself is not here: a claim is a begin that repeats the
//! orphan's own request (`Store::claim_orphan`), so the begin step decides
//! it. This module only finds orphans and abandons them.
//!
//! With the lease in the session row, a turn is an orphan when the row does
//! not name it as a holder with an expiry after the store's now, and it has
//! been one since that expiry. With an external lease layer the row keeps
//! no expiry, so the layer is asked, and the first listing that finds the
//! turn unheld records the time on the turn (`orphaned_at_ms`).

use agentgate_core::decide::ABANDONED_ERROR;
use agentgate_core::error::Result;
use agentgate_core::lease::LeaseLayer;
use agentgate_core::model::{Orphan, OrphanFilter};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, QueryBuilder};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::{PostgresStore, NOW_MS};
use agentgate_store_sql::orphans::OrphanSql;

/// When the turn last had a live lease, as far as the rows tell: the
/// session's expiry while the row names it, else the recorded orphan time,
/// else its last grant.
const ORPHANED_SINCE: &str = "CASE WHEN s.holder_turn_id = t.turn_id \
    AND s.lease_expires_at_ms IS NOT NULL THEN s.lease_expires_at_ms \
    ELSE COALESCE(t.orphaned_at_ms, t.updated_at_ms) END";

fn orphan(row: &PgRow, now: i64) -> Result<Orphan> {
    agentgate_store_sql::rows::orphan(&Cols(row), now)
}

/// The running turns `filter` admits, as orphan candidates with their
/// orphan time, longest-orphaned first. With leases in the rows only turns
/// without a live row lease qualify; with a layer every running turn does,
/// and the layer is asked afterwards.
async fn candidates(
    store: &PostgresStore,
    filter: &OrphanFilter,
    limit: u32,
    now: i64,
) -> Result<Vec<Orphan>> {
    let mut sql = QueryBuilder::<Postgres>::new(format!(
        "SELECT t.turn_id, t.session_id, t.user_id, t.client_request_id, t.fingerprint, \
         t.payload, t.fence, t.attempt, {ORPHANED_SINCE} AS orphaned_since_ms, \
         CAST(CASE WHEN COALESCE(s.fence, 0) > t.fence THEN 1 ELSE 0 END AS BIGINT) AS superseded \
         FROM ag_turns t LEFT JOIN ag_sessions s ON s.session_id = t.session_id \
         WHERE t.state = 'running'"
    ));
    if store.leases.is_none() {
        sql.push(" AND NOT (s.holder_turn_id IS NOT DISTINCT FROM t.turn_id AND COALESCE(s.lease_expires_at_ms, 0) > ")
            .push_bind(now)
            .push(")")
            .push(format!(" AND {ORPHANED_SINCE} <= "))
            .push_bind(now.saturating_sub(i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX)));
    }
    if !filter.user_ids.is_empty() {
        let users: Vec<&str> = filter.user_ids.iter().map(|u| u.as_str()).collect();
        sql.push(" AND t.user_id = ANY(").push_bind(users).push(")");
    }
    if !filter.turn_ids.is_empty() {
        let turns: Vec<&str> = filter.turn_ids.iter().map(|t| t.as_str()).collect();
        sql.push(" AND t.turn_id = ANY(").push_bind(turns).push(")");
    }
    sql.push(" ORDER BY orphaned_since_ms, t.turn_id LIMIT ")
        .push_bind(i64::from(limit));
    let rows = sql.build().fetch_all(&store.pool).await.map_err(map_sqlx)?;
    rows.iter().map(|row| orphan(row, now)).collect()
}

/// The store as the shared orphan steps see it.
pub(crate) struct Sql<'a>(pub(crate) &'a PostgresStore);

#[async_trait::async_trait]
impl OrphanSql for Sql<'_> {
    fn leases(&self) -> Option<&dyn LeaseLayer> {
        self.0.leases.as_deref()
    }

    async fn now_ms(&self) -> Result<i64> {
        sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
            .fetch_one(&self.0.pool)
            .await
            .map_err(map_sqlx)
    }

    async fn candidates(
        &self,
        filter: &OrphanFilter,
        limit: u32,
        now_ms: i64,
    ) -> Result<Vec<Orphan>> {
        candidates(self.0, filter, limit, now_ms).await
    }

    /// First seen unheld: record since when, unless a grant came between.
    async fn stamp_orphaned(&self, orphan: &Orphan) -> Result<Option<i64>> {
        let stamped: Option<i64> = sqlx::query_scalar(&format!(
            "UPDATE ag_turns SET orphaned_at_ms = COALESCE(orphaned_at_ms, {NOW_MS}) \
             WHERE turn_id = $1 AND state = 'running' AND fence = $2 RETURNING orphaned_at_ms"
        ))
        .bind(orphan.turn_id.as_str())
        .bind(orphan.fence.0)
        .fetch_optional(&self.0.pool)
        .await
        .map_err(map_sqlx)?
        .flatten();
        Ok(stamped)
    }

    /// One transaction that locks the session row first, as a begin does, so
    /// a concurrent takeover and this step are ordered: the turn ends only if
    /// it still runs under the orphan's fence with no live row lease (a
    /// takeover changes the fence), and the session is released only if it
    /// still names the turn.
    async fn abandon_once(&self, orphan: &Orphan) -> Result<bool> {
        let store = self.0;
        let mut tx = store.transaction().await?;
        let now: i64 = sqlx::query_scalar(&format!(
            "SELECT {NOW_MS} FROM (SELECT 1) one LEFT JOIN \
             (SELECT 1 FROM ag_sessions WHERE session_id = $1 FOR UPDATE) s ON true"
        ))
        .bind(orphan.session_id.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        let ended = sqlx::query(
            "UPDATE ag_turns t SET state = 'abandoned', error = $3, retryable = NULL, \
             updated_at_ms = $4, ended_at_ms = $4, orphaned_at_ms = NULL \
             WHERE t.turn_id = $1 AND t.state = 'running' AND t.fence = $2 AND NOT EXISTS ( \
             SELECT 1 FROM ag_sessions s WHERE s.session_id = t.session_id \
             AND s.holder_turn_id = $1 AND s.lease_expires_at_ms > $4)",
        )
        .bind(orphan.turn_id.as_str())
        .bind(orphan.fence.0)
        .bind(ABANDONED_ERROR)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?
        .rows_affected();
        if ended == 0 {
            return Ok(false);
        }
        assert_eq!(ended, 1, "turn_id is the primary key");
        sqlx::query(
            "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
             lease_expires_at_ms = NULL, updated_at_ms = $3 \
             WHERE session_id = $1 AND holder_turn_id = $2",
        )
        .bind(orphan.session_id.as_str())
        .bind(orphan.turn_id.as_str())
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;
        tx.commit().await.map_err(map_sqlx)?;
        Ok(true)
    }
}
