//! The begin step: lock the user's row, then the session's row, read the
//! snapshot, ask `decide_begin`, apply, in one READ COMMITTED transaction.
//!
//! The user's row lock serialises every begin of one user, so the count of
//! live leases read after it cannot race another grant (the permit). The
//! session's row lock serialises every step on the session, so the
//! `(session_id, client_request_id)` insert never meets a concurrent twin.
//! Both rows are created on first use by the locking upserts themselves; a
//! begin that is refused rolls back, so nothing is written.
//!
//! The session lease and the user's permit are one row write (a user's live
//! permits are its sessions with a live lease), so they are taken together or
//! not at all.
//!
//! With an external lease layer the begin is the shared layered one
//! (`agentgate_store_sql::begin::layered`): it decides on a snapshot read
//! without locks, takes a fence from the sequence, acquires the layer's
//! lease and permit with it, and only then writes, so no row lock is held
//! across the Redis round trip. The write is one call of
//! `ag_begin_layered` (migration 0009) for a new request, else this
//! module's full path under the locks with the lease held; a start that no
//! longer holds gives the layer's lease back and decides afresh.
//! `ag_begin_layered` takes `ag_begin_new`'s locks in the same order and
//! grants only when the locked path would write the same start:
//!
//! | `ag_begin_layered` checks | what the locked path reads | why it writes this start |
//! |---|---|---|
//! | no confirmation (checked by the caller) | `confirms: None` | no confirmation chain |
//! | no turn for `(session_id, client_request_id)` | `turn: None`, the snapshot's too | the same turn; no replay, restart, takeover or exhaustion |
//! | the session's `user_id` is the caller's (or the row is new) | `session.user_id == user_id` | no `not_found` |
//! | `holder_turn_id IS NULL`, `pending_turn_id IS NULL` | `session.holder`, `session.pending`: `None` | no `session_busy`, no `awaiting_confirmation` |
//! | no turn queued on the session (`queue_seq IS NOT NULL`, migration 0010) | `queue.head: None` | `decide_new` neither queues nor refuses for a waiting queue |
//! | the session's fence is below the held one | `session_fence < fence` | no newer grant since the fence was taken |
//! | the cap in `0..=u32::MAX`, the rows' live leases below it | `UserLoad::read`, `load.live < load.cap` | no `corrupt`, no `user_at_capacity` |
//!
//! Round trips of a layered new request: the snapshot, the fence, the
//! layer's acquire and the one call: three calls into PostgreSQL and one
//! into Redis (the locked path before it took five and one).
//!
//! The common case is one autocommit statement (`BeginTx::begin_new_sql`, the
//! `ag_begin_new` function of migration 0006): a request with no turn yet
//! and no confirmation, on a free session of the caller (or a new one), by
//! a user below its cap, without a lease layer. The function takes the same
//! locks in the same order, reads the same facts after them (each statement
//! of a VOLATILE PL/pgSQL function takes a fresh snapshot; the migration
//! cites the manual) and writes what the grant statement below writes. It
//! grants only when `decide_begin` would answer `Start { New, attempt 1 }`
//! on the same facts, and otherwise answers "fall back" having written
//! nothing; the full path below then makes the decision. It never refuses.
//! A begin the rows already rule out (a repeat of a request, a held
//! session) falls back before the function takes any lock; a fallback
//! decided under the locks commits without waiting for the WAL flush (it
//! wrote nothing), so no refused begin holds the user's row through a flush.
//! Each condition it checks, and why `decide_begin` starts on it:
//!
//! | `ag_begin_new` checks | fact `decide_begin` reads | why it starts |
//! |---|---|---|
//! | the command has no confirmation (checked here) | `confirms: None` | with no turn, `(None, None)` goes straight to `gate_start(New, 1)` |
//! | no lease layer (checked here) | leases in the rows | the row expiry is the lease, as read below |
//! | no turn for `(session_id, client_request_id)` | `turn: None` | no replay, restart, takeover or exhaustion |
//! | the session's `user_id` is the caller's (or the row is new) | `session.user_id == user_id` | no `not_found` |
//! | `holder_turn_id IS NULL` | `session.holder: None` | no `session_busy` (an expired holder falls back) |
//! | `pending_turn_id IS NULL` | `session.pending: None` | no `awaiting_confirmation` (an expired one falls back) |
//! | no turn queued on the session (`queue_seq IS NOT NULL`, migration 0010) | `queue.head: None` | `decide_new` neither queues nor refuses for a waiting queue |
//! | the cap (the row's, else the configured default) is in `0..=u32::MAX` | `UserLoad::read` succeeds | no `corrupt` |
//! | live leases of the user `<` cap | `load.live < load.cap` | no `user_at_capacity` |
//!
//! `resume_only` only matters when the request's turn exists, which falls
//! back. `fast_path_implies_a_new_start` (the tests below) checks the table
//! against `decide_begin` over every combination of these facts.
//!
//! Round trips: the common case is the one statement (plus sqlx's ping when
//! the connection goes back to the pool). Anything else is that statement,
//! answering "fall back", then the full path: `BEGIN` (with its `SET
//! LOCAL`s, one simple query), the lock statement (user upsert, then session
//! upsert), the facts (clock, permit count, the request's turn; its own
//! statement, so its snapshot is taken after the locks are held and sees
//! every grant that committed while this step waited for them), then for a
//! start one statement that takes the fence and writes the session's grant
//! and the turn, and `COMMIT`: five, plus the layer's acquire when there is
//! one; six with the statement that fell back (a takeover, a restart, a new
//! turn on a session whose holder or pending confirmation expired). A
//! refusal or a replay is the one statement, `BEGIN`, locks, facts and the
//! rollback: five. With a lease layer or a confirmation the one statement is
//! not tried, so those begins cost what they did. A confirmation adds one
//! read of its target (and one more when the target was already confirmed)
//! and one `UPDATE` of it.

use agentgate_core::decide::{SessionSnapshot, UserLoad};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::Fence;
use agentgate_core::model::BeginCommand;
use sqlx::postgres::PgRow;
use sqlx::PgConnection;

use crate::error::map_sqlx;
use crate::rows::{get, session_snapshot, Cols, SESSION_COLUMNS, TURN_COLUMNS};
use crate::steps::Sql;
use crate::{NOW_MS, STEP_LOCK_TIMEOUT};
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::{
    queue_columns, BeginSql, BeginTx, Facts, GrantRows, Held, Locked, QueueRead, TurnRecord,
};
use agentgate_store_sql::rows::Columns;

#[async_trait::async_trait]
impl LayeredBeginSql for Sql<'_> {
    async fn reserve_fence(&self, conn: &mut PgConnection) -> Result<Fence> {
        let value: i64 = sqlx::query_scalar("SELECT nextval('ag_fence_seq')")
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(Fence(value))
    }

    /// One call of `ag_begin_layered` (migration 0009), which takes the
    /// full path's locks in its order and writes only what the full path
    /// would (the layered table in the module docs).
    fn grant_layered_new_sql() -> String {
        format!(
            "SELECT CASE WHEN ag_begin_layered($1, $2, $3, $4, $5, $6, $7, $8, $9, \
             '{STEP_LOCK_TIMEOUT}') THEN 1::BIGINT ELSE 0::BIGINT END AS granted"
        )
    }

    fn layered_granted(rows: &[PgRow], _held: &Held) -> Result<bool> {
        match rows {
            [row] => Ok(Cols(row).int_required("granted")? == 1),
            _ => Err(Error::corrupt(format!(
                "ag_begin_layered answered {} rows, not one",
                rows.len()
            ))),
        }
    }
}

#[async_trait::async_trait]
impl BeginTx for Sql<'_> {
    /// The common case in one call of `ag_begin_new` (the module docs list
    /// when it grants). A conflict (deadlock, lock timeout) is an error for
    /// the caller's retry, like the full path's.
    fn begin_new_sql() -> String {
        format!(
            "SELECT ag_begin_new($1, $2, $3, $4, $5, $6, $7, $8, $9, '{STEP_LOCK_TIMEOUT}') \
             AS fence"
        )
    }

    fn granted_fence(&self, rows: &[PgRow]) -> Result<Option<i64>> {
        match rows {
            [row] => Cols(row).int("fence"),
            _ => Err(Error::corrupt(format!(
                "ag_begin_new answered {} rows, not one",
                rows.len()
            ))),
        }
    }
}

#[async_trait::async_trait]
impl BeginSql for Sql<'_> {
    async fn lock_and_read(&self, tx: &mut PgConnection, command: &BeginCommand) -> Result<Locked> {
        let (cap, session, session_fence) = lock_rows(tx, command).await?;
        let facts = read_facts(tx, command, cap, self.0.config.max_turns_per_user).await?;
        Ok(Locked {
            session: Some(session),
            session_fence,
            facts,
        })
    }

    async fn write_grant(&self, tx: &mut PgConnection, rows: &GrantRows<'_>) -> Result<Fence> {
        grant(tx, rows).await
    }
}

/// Locks the user's row, then the session's row, creating either on first
/// use (the session bound to the caller), in one statement. A fresh session
/// row (no holder, no pending confirmation, the caller's user) decides
/// exactly like no row at all, and is rolled back unless the begin starts.
async fn lock_rows(
    conn: &mut PgConnection,
    command: &BeginCommand,
) -> Result<(Option<i64>, SessionSnapshot, i64)> {
    // `DO UPDATE` with a no-op assignment is what makes an upsert lock an
    // existing row (`DO NOTHING` would not). The session's upsert takes its
    // row from the user's upsert's output, so it cannot run before the
    // user's row is locked: the lock order stays user → session without
    // relying on the unspecified order of sibling `WITH` statements.
    let row = sqlx::query(&format!(
        "WITH u AS (INSERT INTO ag_users (user_id) VALUES ($2) \
           ON CONFLICT (user_id) DO UPDATE SET max_turns = ag_users.max_turns \
           RETURNING user_id, max_turns), \
         s AS (INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
           SELECT $1, u.user_id, 0, {NOW_MS} FROM u \
           ON CONFLICT (session_id) DO UPDATE SET user_id = ag_sessions.user_id \
           RETURNING {SESSION_COLUMNS}, fence) \
         SELECT (SELECT max_turns FROM u) AS max_turns, {SESSION_COLUMNS}, fence FROM s"
    ))
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok((
        get(&row, "max_turns")?,
        session_snapshot(&row)?,
        get(&row, "fence")?,
    ))
}

/// Reads the clock, the user's live permits and the request's turn in one
/// statement, sent after the locks are held so it sees every grant that
/// committed before them.
async fn read_facts(
    conn: &mut PgConnection,
    command: &BeginCommand,
    cap: Option<i64>,
    default_cap: u32,
) -> Result<Facts> {
    let row = sqlx::query(&format!(
        "SELECT {NOW_MS} AS now_ms, permits.live, permits.soonest, {TURN_COLUMNS}, {queue} \
         FROM (SELECT COUNT(*) AS live, MIN(lease_expires_at_ms) AS soonest FROM ag_sessions \
               WHERE user_id = $1 AND lease_expires_at_ms > {NOW_MS}) AS permits \
         LEFT JOIN ag_turns ON ag_turns.session_id = $2 AND ag_turns.client_request_id = $3",
        queue = queue_columns(["$2"; 3], "$1"),
    ))
    .bind(command.user_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.client_request_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(Facts {
        now_ms: get(&row, "now_ms")?,
        load: UserLoad::read(cap, default_cap, get(&row, "live")?, get(&row, "soonest")?)?,
        turn: TurnRecord::read(&crate::rows::Cols(&row))?,
        queue: QueueRead::read(&crate::rows::Cols(&row))?,
    })
}

/// The first half of [`grant`]'s statement: the grant on the session's row
/// (holder, token digest, expiry, the fence reserved by a layered begin or
/// else one from the sequence, and a cleared pending confirmation when the
/// start confirms it), returning the fence as `g`. `$1` session, `$2` turn,
/// `$3` token digest, `$4` expiry (NULL with a lease layer), `$5` now, `$6`
/// confirming, `$7` the reserved fence (NULL: take one; `COALESCE` only
/// evaluates `nextval` when it is NULL).
const GRANT_SESSION: &str = "WITH g AS (UPDATE ag_sessions SET holder_turn_id = $2, \
    lease_token_hash = $3, fence = COALESCE($7, nextval('ag_fence_seq')), \
    lease_expires_at_ms = $4, \
    updated_at_ms = $5, \
    pending_turn_id = CASE WHEN $6 THEN NULL ELSE pending_turn_id END, \
    pending_expires_at_ms = CASE WHEN $6 THEN NULL ELSE pending_expires_at_ms END \
    WHERE session_id = $1 RETURNING fence) ";

/// Writes the grant on the session's row and the turn under its fence (the
/// new turn inserted, or the existing one restarted) in one statement;
/// returns the fence. The session's row is already locked, so the statement
/// only adds the turn's row lock after it.
async fn grant(tx: &mut PgConnection, rows: &GrantRows<'_>) -> Result<Fence> {
    let command = rows.command;
    let sql = if rows.restart {
        format!(
            "{GRANT_SESSION} UPDATE ag_turns SET state = 'running', attempt = $8, \
             fence = g.fence, error = NULL, retryable = NULL, updated_at_ms = $5, \
             ended_at_ms = NULL, orphaned_at_ms = NULL, queue_seq = NULL \
             FROM g WHERE ag_turns.turn_id = $2 \
             RETURNING g.fence"
        )
    } else {
        format!(
            "{GRANT_SESSION} INSERT INTO ag_turns (turn_id, session_id, user_id, \
             client_request_id, fingerprint, state, attempt, fence, confirms_pending, confirms_turn_id, \
             decision, created_at_ms, updated_at_ms, payload) \
             SELECT $2, $1, $9, $10, $11, 'running', $8, g.fence, $12, $13, $14, $5, $5, $15 \
             FROM g RETURNING fence"
        )
    };
    let query = sqlx::query_scalar(&sql)
        .bind(command.session_id.as_str())
        .bind(rows.turn_id.as_str())
        .bind(rows.token_hash)
        .bind(rows.row_expiry)
        .bind(rows.now_ms)
        .bind(rows.confirming)
        .bind(rows.reserved.map(|fence| fence.0))
        .bind(i64::from(rows.attempt));
    // The pending action is copied as the canonical text it is stored as.
    let confirmation = command.confirmation.as_ref();
    let query = if rows.restart {
        query
    } else {
        query
            .bind(command.user_id.as_str())
            .bind(command.client_request_id.as_str())
            .bind(command.fingerprint.as_hex())
            .bind(rows.pending)
            .bind(confirmation.map(|c| c.turn_id.as_str()))
            .bind(confirmation.map(|c| c.decision.as_str()))
            .bind(command.payload.as_str())
    };
    let fence: Option<i64> = query.fetch_optional(tx).await.map_err(map_sqlx)?;
    let fence =
        fence.ok_or_else(|| Error::corrupt(format!("turn {} was not written", rows.turn_id)))?;
    Ok(Fence(fence))
}

#[cfg(test)]
mod tests;
