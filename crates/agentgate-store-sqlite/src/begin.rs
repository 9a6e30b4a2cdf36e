//! The begin step: SQLite's dialect of the shared begin
//! (`agentgate_store_sql::begin`): the facts read in one statement (the
//! shared `read_unlocked`), the grant's rows, and the one-statement common
//! cases.
//! The full path reads, decides and applies in one `BEGIN IMMEDIATE`
//! transaction: the single writer is what the other stores' row locks are.
//! The session lease and the user's permit are one row write, so they are
//! taken together or not at all.
//!
//! The common case is one autocommit statement (`BeginTx::begin_new_sql`): a request
//! with no turn yet and no confirmation, on a free session of the caller (or
//! a new one), by a user below its cap, without a lease layer. It inserts a
//! request row into `ag_begin_new` only when its `WHERE` holds, and that
//! table's trigger (migration 0006) writes what [`write_grant`] writes
//! for a new turn: the fence counter, the session's
//! grant, the turn. The single writer makes the statement's reads and its
//! trigger's writes one atomic step. It grants only when `decide_begin`
//! would answer `Start { New, attempt 1 }` on the same facts; otherwise it
//! inserts nothing, writes nothing, and the full path below decides. It
//! never refuses. The conditions are PostgreSQL's `ag_begin_new`'s, checked
//! against `decide_begin` over every combination of the facts by
//! `agentgate-store-postgres`'s `fast_path_implies_a_new_start`:
//!
//! | the statement checks | fact `decide_begin` reads | why it starts |
//! |---|---|---|
//! | the command has no confirmation (checked here) | `confirms: None` | with no turn, `(None, None)` goes straight to `gate_start(New, 1)` |
//! | no lease layer (checked here) | leases in the rows | the row expiry is the lease, as read in the statement |
//! | no turn for `(session_id, client_request_id)` | `turn: None` | no replay, restart, takeover or exhaustion |
//! | no session row of another user | `session.user_id == user_id` | no `not_found` |
//! | no holder on the session row (`holder_turn_id IS NULL`) | `session.holder: None` | no `session_busy` (an expired holder falls back) |
//! | no pending confirmation (`pending_turn_id IS NULL`) | `session.pending: None` | no `awaiting_confirmation` (an expired one falls back) |
//! | no turn queued on the session (`queue_seq IS NOT NULL`) | `queue.head: None` | `decide_new` neither queues nor refuses for a waiting queue |
//! | the cap (the user row's, else the configured default) is in `0..=u32::MAX` | `UserLoad::read` succeeds | no `corrupt` |
//! | live leases of the user `<` cap | `load.live < load.cap` | no `user_at_capacity` |
//!
//! Calls into SQLite: the common case is the one statement; anything else is
//! that statement (inserting nothing) and then the full path.
//!
//! With an external lease layer (Redis) the begin is the shared layered one
//! (`agentgate_store_sql::begin::layered`), so the single writer never waits
//! on the layer: it decides on a reader snapshot, takes a fence (one
//! autocommit statement), acquires the layer's lease and permit with it, and
//! only then writes the grant. The grant is written only if the same start
//! still holds, the session's fence is still below the new one (fences grow
//! per session) and the layer's lease has not lapsed on this process's clock
//! meanwhile; otherwise the layer's lease is given back and the begin decides
//! afresh, at most `MAX_STORE_RETRIES` times. A new request's grant is one
//! autocommit statement (`LayeredBeginSql::grant_layered_new_sql`, migration 0008) whose `WHERE`
//! is that check; anything else takes the writer to decide again and apply
//! the start with the layer's lease held (`Lease::Held`).

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::Fence;
use agentgate_core::model::BeginCommand;
use agentgate_core::plant::{self, Plant};
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::{
    grant_session, read_unlocked, write_turn, BeginSql, BeginTx, GrantRows, Held, Locked,
};
use agentgate_store_sql::rows::Columns;
use sqlx::sqlite::SqliteRow;
use sqlx::SqliteConnection;

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::steps::Sql;
use crate::NOW_MS;

pub(crate) async fn now_ms(conn: &mut SqliteConnection) -> Result<i64> {
    sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
}

#[async_trait::async_trait]
impl BeginTx for Sql<'_> {
    /// The common case in one autocommit statement (the module docs list
    /// when it grants): an `INSERT` into the request table `ag_begin_new`,
    /// whose trigger writes the fence, the grant and the turn.
    fn begin_new_sql() -> String {
        let sql = format!(

        "INSERT INTO ag_begin_new (turn_id, session_id, user_id, client_request_id, token_hash, \
           fingerprint, payload, fence, now_ms, lease_expires_at_ms) \
         SELECT $4, $1, $2, $3, $5, $6, $7, f.value + 1, c.now_ms, c.now_ms + $8 \
         FROM ag_fence f, (SELECT {NOW_MS} AS now_ms, \
                 COALESCE((SELECT max_turns FROM ag_users WHERE user_id = $2), $9) AS cap) c \
         WHERE f.id = 1 \
           AND NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = $1 AND client_request_id = $3) \
           AND NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = $1 AND queue_seq IS NOT NULL) \
           AND NOT EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = $1 \
                           AND (user_id <> $2 OR holder_turn_id IS NOT NULL \
                                OR pending_turn_id IS NOT NULL)) \
           AND c.cap BETWEEN 0 AND {cap_max} \
           AND (SELECT COUNT(*) FROM ag_sessions \
                WHERE user_id = $2 AND lease_expires_at_ms > c.now_ms) < c.cap \
         RETURNING fence",
            cap_max = u32::MAX
        );
        let sql = plant::edit(
            Plant::SqliteBeginCapOffByOne,
            sql,
            ") < c.cap",
            ") <= c.cap",
        );
        plant::edit(
            Plant::SqliteBeginOverHolder,
            sql,
            "user_id <> $2 OR holder_turn_id IS NOT NULL",
            "user_id <> $2",
        )
        .into_owned()
    }

    fn granted_fence(&self, rows: &[SqliteRow]) -> Result<Option<i64>> {
        match rows {
            [] => Ok(None),
            [row] => Cols(row).int_required("fence").map(Some),
            more => Err(Error::corrupt(format!(
                "a one-statement begin granted {}",
                more.len()
            ))),
        }
    }
}

#[async_trait::async_trait]
impl BeginSql for Sql<'_> {
    /// SQLite locks no rows: the caller holds the single writer (or, for a
    /// layered begin's first look, a reader's snapshot).
    async fn lock_and_read(
        &self,
        conn: &mut SqliteConnection,
        command: &BeginCommand,
    ) -> Result<Locked> {
        read_unlocked(self, conn, command).await
    }

    async fn write_grant(&self, tx: &mut SqliteConnection, rows: &GrantRows<'_>) -> Result<Fence> {
        write_grant(self, tx, rows).await
    }
}

#[async_trait::async_trait]
impl LayeredBeginSql for Sql<'_> {
    /// On the single writer: SQLite writes through nothing else.
    async fn reserve_fence(&self, _reader: &mut SqliteConnection) -> Result<Fence> {
        next_fence(&mut *self.0.writer_connection().await?).await
    }

    /// On the single writer, as [`LayeredBeginSql::reserve_fence`].
    const GRANT_ON_WRITER: bool = true;

    /// With a lease layer, the common grant in one autocommit statement: a new
    /// request, no confirmation (both checked by the caller), the layer's lease
    /// already held under `held.fence`. It inserts a request row into
    /// `ag_begin_layered`, whose trigger (migration 0008) writes what the
    /// shared `apply` writes for a new turn with a held lease (no row expiry),
    /// only when the locked path under the writer would write that start:
    ///
    /// | the statement checks | what the locked path reads | why it writes this start |
    /// |---|---|---|
    /// | no turn for `(session_id, client_request_id)` | `turn: None`, the snapshot's (none) | the same turn, and `decide_begin` has no replay, restart, takeover or exhaustion |
    /// | no session row of another user | `session.user_id == user_id` | no `not_found` |
    /// | no holder named on the session row | `session.holder: None` | no `session_busy` |
    /// | no turn queued on the session | `queue.head: None` | no `enqueue`, no `session_busy` for a queue's head |
    /// | no pending confirmation | `session.pending: None` | no `awaiting_confirmation` |
    /// | the session's fence is below `held.fence` | `session_fence < fence` | no newer grant came between the fence and the write |
    /// | the cap is in `0..=u32::MAX`, the rows' live leases below it | `UserLoad::read`, `load.live < load.cap` | no `corrupt`, no `user_at_capacity` |
    ///
    /// It answers the fence it wrote under, or no row when it wrote nothing
    /// and the full path must decide.
    fn grant_layered_new_sql() -> String {
        format!(
            "INSERT INTO ag_begin_layered (turn_id, session_id, user_id, client_request_id, \
           token_hash, fingerprint, payload, fence, now_ms) \
         SELECT $4, $1, $2, $3, $5, $6, $7, $8, c.now_ms \
         FROM (SELECT {NOW_MS} AS now_ms, \
                 COALESCE((SELECT max_turns FROM ag_users WHERE user_id = $2), $9) AS cap) c \
         WHERE NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = $1 AND client_request_id = $3) \
           AND NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = $1 AND queue_seq IS NOT NULL) \
           AND NOT EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = $1 \
                           AND (user_id <> $2 OR holder_turn_id IS NOT NULL \
                                OR pending_turn_id IS NOT NULL OR fence >= $8)) \
           AND c.cap BETWEEN 0 AND {cap_max} \
           AND (SELECT COUNT(*) FROM ag_sessions \
                WHERE user_id = $2 AND lease_expires_at_ms > c.now_ms) < c.cap \
         RETURNING fence",
            cap_max = u32::MAX
        )
    }

    fn layered_granted(rows: &[SqliteRow], held: &Held) -> Result<bool> {
        let fences = rows
            .iter()
            .map(|row| Cols(row).int_required("fence"))
            .collect::<Result<Vec<i64>>>()?;
        match fences.as_slice() {
            [] => Ok(false),
            [fence] if *fence == held.fence.0 => Ok(true),
            other => Err(Error::corrupt(format!(
                "a one-statement layered grant under fence {} wrote {other:?}",
                held.fence.0
            ))),
        }
    }
}

pub(crate) async fn next_fence(conn: &mut SqliteConnection) -> Result<Fence> {
    let value: i64 =
        sqlx::query_scalar("UPDATE ag_fence SET value = value + 1 WHERE id = 1 RETURNING value")
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
    Ok(Fence(value))
}

/// The grant on the session's row (`begin::grant_session`), created on
/// first use: SQLite locks none, so none was made before.
const GRANT_SESSION: &str = "INSERT INTO ag_sessions (session_id, user_id, holder_turn_id, \
     lease_token_hash, fence, lease_expires_at_ms, updated_at_ms) \
     VALUES ($1, $2, $3, $4, $5, $6, $7) \
     ON CONFLICT (session_id) DO UPDATE SET holder_turn_id = $3, lease_token_hash = $4, \
     fence = $5, lease_expires_at_ms = $6, updated_at_ms = $7, \
     pending_turn_id = CASE WHEN $8 THEN NULL ELSE pending_turn_id END, \
     pending_expires_at_ms = CASE WHEN $8 THEN NULL ELSE pending_expires_at_ms END";

/// Writes a grant ([`GrantRows`]): the fence (the reserved one, else the
/// next of the counter), the session's row (created on first use: SQLite
/// locks none, so none was made before), and the turn's row (inserted, or
/// restarted under the new fence).
async fn write_grant(
    sql: &Sql<'_>,
    tx: &mut SqliteConnection,
    rows: &GrantRows<'_>,
) -> Result<Fence> {
    let fence = match rows.reserved {
        Some(fence) => fence,
        None => next_fence(tx).await?,
    };
    grant_session(sql, tx, GRANT_SESSION, rows, fence).await?;
    write_turn(sql, tx, rows, fence).await?;
    Ok(fence)
}

#[cfg(test)]
mod tests;
