//! The begin step: lock the user's row, then the session's row, read the
//! snapshot, ask `decide_begin`, apply, in one READ COMMITTED transaction.
//!
//! The user's row lock serialises every begin of one user, so the count of
//! live leases read after it cannot race another grant (the permit). The
//! session's row lock serialises every step on the session, so the
//! `(session_id, client_request_id)` insert never meets a concurrent twin.
//! Both rows are created on first use by the locking upsert itself; a begin
//! that is refused rolls back, so nothing is written.
//!
//! The session lease and the user's permit are one row write (a user's live
//! permits are its sessions with a live lease), so they are taken together or
//! not at all.
//!
//! The fence counter is one row that every grant in the database locks until
//! it commits, so it is taken last, right before the two writes that need
//! it: grants of different users queue on it for two statements and a
//! commit only.
//!
//! With an external lease layer the begin is the shared layered one
//! (`agentgate_store_sql::begin::layered`): it decides on a snapshot read
//! without locks, takes a fence from the counter in its own autocommit
//! statement, acquires the layer's lease and permit with it, and only then
//! writes, so neither the counter's row nor a session's row is locked
//! across the Redis round trip. The write is one `CALL` of
//! `ag_begin_layered` (migration 0009) for a new request, else the full
//! path below under the locks with the lease held; a start that no longer
//! holds (a grant committed meanwhile, whose fence is newer) gives the
//! layer's lease back and decides afresh. `ag_begin_layered` takes the full
//! path's locks in its order and grants only when the full path would
//! write the same start: no confirmation (checked by the caller), no turn
//! for the request, the session the caller's with no holder named and no
//! pending confirmation, the session's fence below the held one, the cap
//! in range and not reached in the rows (which keep no expiry under a
//! layer). `tests` checks both answers against the full path.
//!
//! Without an external lease layer a begin first tries `fast::begin_sql`: one
//! `CALL` of a stored procedure that takes the same locks in the same
//! order, reads the same facts after them and starts the turn when the
//! facts are the common case (a new turn on a free session of the caller's,
//! below the cap, no confirmation), or writes nothing. Only then does the
//! full path below run; `fast::begin_sql` says why both always agree with
//! `decide_begin`.
//!
//! Round trips: the common case 1 (the `CALL`). The full path: `BEGIN`,
//! user upsert, session upsert, session lock, facts (clock, cap, permit
//! count, the request's turn), then for a start the fence, the session
//! grant and the turn write, and `COMMIT`: nine, plus the declined `CALL`
//! before it (none for a confirmation or with a lease layer, which skip
//! it). A confirmation adds one read of its target (and one more when the
//! target was already confirmed) and one `UPDATE` of it.

use agentgate_core::decide::{SessionSnapshot, UserLoad};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::Fence;
use agentgate_core::model::BeginCommand;
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, Row};

use crate::error::map_sqlx;
use crate::fast;
use crate::rows::{get, session_snapshot, Cols, SESSION_COLUMNS, TURN_COLUMNS};
use crate::steps::Sql;
use crate::NOW_MS;
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::{
    grant_session, queue_columns, write_turn, BeginSql, BeginTx, Facts, GrantRows, Held, Locked,
    QueueRead, TurnRecord,
};

#[async_trait::async_trait]
impl LayeredBeginSql for Sql<'_> {
    /// In autocommit, so the counter's row lock is not held across the
    /// layer's round trip.
    async fn reserve_fence(&self, conn: &mut MySqlConnection) -> Result<Fence> {
        next_fence(conn).await
    }

    /// One `CALL` of `ag_begin_layered` (migration 0009), which takes the
    /// full path's locks in its order and writes only what the full path
    /// would (the layered table in the module docs).
    fn grant_layered_new_sql() -> String {
        "CALL ag_begin_layered($2, $1, $3, $4, $6, $7, $5, $8, $9)".to_owned()
    }

    /// Its one row holds 1 when it wrote the grant, 0 when nothing.
    fn layered_granted(rows: &[MySqlRow], _held: &Held) -> Result<bool> {
        let [row] = rows else {
            return Err(Error::corrupt(format!(
                "ag_begin_layered returned {} rows, not one",
                rows.len()
            )));
        };
        match row.try_get::<i64, _>(0).map_err(map_sqlx)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(Error::corrupt(format!(
                "ag_begin_layered answered {other}, not 0 or 1"
            ))),
        }
    }
}

#[async_trait::async_trait]
impl BeginTx for Sql<'_> {
    fn begin_new_sql() -> String {
        fast::begin_sql()
    }

    fn granted_fence(&self, rows: &[MySqlRow]) -> Result<Option<i64>> {
        fast::begin_granted(self.0, rows)
    }
}

#[async_trait::async_trait]
impl BeginSql for Sql<'_> {
    async fn lock_and_read(
        &self,
        tx: &mut MySqlConnection,
        command: &BeginCommand,
    ) -> Result<Locked> {
        lock_user(tx, command.user_id.as_str()).await?;
        let (session, session_fence) = lock_session(tx, command).await?;
        let facts = read_facts(tx, command, self.0.config.max_turns_per_user).await?;
        Ok(Locked {
            session: Some(session),
            session_fence,
            facts,
        })
    }

    async fn write_grant(&self, tx: &mut MySqlConnection, rows: &GrantRows<'_>) -> Result<Fence> {
        let fence = match rows.reserved {
            Some(fence) => fence,
            None => next_fence(tx).await?,
        };
        grant_session(self, tx, GRANT_SESSION, rows, fence).await?;
        write_turn(self, tx, rows, fence).await?;
        Ok(fence)
    }
}

/// Locks the user's row, creating it on first use. A duplicate key under
/// `ON DUPLICATE KEY UPDATE` takes an exclusive lock on the existing row.
async fn lock_user(conn: &mut MySqlConnection, user_id: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO ag_users (user_id) VALUES (?) \
         ON DUPLICATE KEY UPDATE max_turns = max_turns",
    )
    .bind(user_id)
    .execute(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

/// Locks the session's row, creating it bound to the caller on first use. A
/// fresh row (no holder, no pending confirmation, the caller's user) decides
/// exactly like no row at all, and is rolled back unless the begin starts.
async fn lock_session(
    conn: &mut MySqlConnection,
    command: &BeginCommand,
) -> Result<(SessionSnapshot, i64)> {
    sqlx::query(&format!(
        "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
         VALUES (?, ?, 0, {NOW_MS}) ON DUPLICATE KEY UPDATE user_id = user_id"
    ))
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .execute(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let row = sqlx::query(&format!(
        "SELECT {SESSION_COLUMNS}, fence FROM ag_sessions WHERE session_id = ? FOR UPDATE"
    ))
    .bind(command.session_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok((session_snapshot(&row)?, get(&row, "fence")?))
}

/// Reads the clock, the cap override, the user's live permits and the
/// request's turn in one statement, sent after the locks are held so it sees
/// every grant that committed before them.
async fn read_facts(
    conn: &mut MySqlConnection,
    command: &BeginCommand,
    default_cap: u32,
) -> Result<Facts> {
    let row = sqlx::query(&format!(
        "SELECT {NOW_MS} AS now_ms, (SELECT max_turns FROM ag_users WHERE user_id = ?) AS cap, \
         {queue}, permits.live, permits.soonest, {TURN_COLUMNS} \
         FROM (SELECT COUNT(*) AS live, MIN(lease_expires_at_ms) AS soonest FROM ag_sessions \
               WHERE user_id = ? AND lease_expires_at_ms > {NOW_MS}) AS permits \
         LEFT JOIN ag_turns ON ag_turns.session_id = ? AND ag_turns.client_request_id = ?",
        queue = queue_columns(["?"; 3], "?"),
    ))
    .bind(command.user_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.client_request_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(Facts {
        now_ms: get(&row, "now_ms")?,
        load: UserLoad::read(
            get(&row, "cap")?,
            default_cap,
            get(&row, "live")?,
            get(&row, "soonest")?,
        )?,
        turn: TurnRecord::read(&Cols(&row))?,
        queue: QueueRead::read(&Cols(&row))?,
    })
}

/// Takes the next fence: inside a transaction the counter row's exclusive
/// lock is held until the grant commits (in autocommit, for that statement
/// only), and `LAST_INSERT_ID(expr)` hands the new value back in the
/// same round trip.
pub(crate) async fn next_fence(conn: &mut MySqlConnection) -> Result<Fence> {
    let done = sqlx::query("UPDATE ag_fence SET value = LAST_INSERT_ID(value + 1) WHERE id = 1")
        .execute(conn)
        .await
        .map_err(map_sqlx)?;
    let value = i64::try_from(done.last_insert_id()).unwrap_or(0);
    if done.rows_affected() != 1 || value <= 0 {
        return Err(Error::corrupt("the fence counter row is missing"));
    }
    Ok(Fence(value))
}

/// The grant on the session's row (`begin::grant_session`), whose row is
/// locked: holder, token digest, expiry, fence, and a cleared pending
/// confirmation when this start confirms it. The session exists: the
/// begin's lock created it.
const GRANT_SESSION: &str = "UPDATE ag_sessions SET holder_turn_id = $3, lease_token_hash = $4, \
     fence = $5, lease_expires_at_ms = $6, updated_at_ms = $7, \
     pending_turn_id = IF($8, NULL, pending_turn_id), \
     pending_expires_at_ms = IF($8, NULL, pending_expires_at_ms) \
     WHERE session_id = $1";

#[cfg(test)]
mod tests;
