//! Orphans: running turns whose lease is gone without an ending. Listing
//! them and ending one `abandoned` are written once
//! (`agentgate_store_sql::orphans`); this store supplies the lock that
//! orders an abandon with a takeover.
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

use agentgate_core::error::Result;
use agentgate_core::ids::Fence;
use agentgate_store_sql::orphans::OrphanSql;
use agentgate_store_sql::query::Run;

use crate::error::map_sqlx;
use crate::steps::Sql;

#[async_trait::async_trait]
impl OrphanSql for Sql<'_> {
    const ANNOUNCE_RELEASE: Option<&'static str> = Some(crate::notify::ANNOUNCE);

    const LOCK_SESSION: Option<&'static str> =
        Some("SELECT 1 AS locked FROM ag_sessions WHERE session_id = $1 FOR UPDATE");

    async fn next_fence(&self, conn: &mut <Self as Run>::Conn) -> Result<Fence> {
        let value: i64 = sqlx::query_scalar("SELECT nextval('ag_fence_seq')")
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(Fence(value))
    }
}
