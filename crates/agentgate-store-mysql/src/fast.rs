//! Fast paths: the common case of a step as one round trip, so the step
//! needs no `BEGIN`, no separate locking read and no `COMMIT` from the app.
//!
//! - a first begin (a new turn on a free session, no confirmation, no
//!   external lease layer): one `CALL ag_begin_fast` ([`begin_sql`]);
//! - a first tool claim: `INSERT … SELECT … FOR UPDATE` (docs/protocol.md §3.3: no
//!   execution yet → Execute);
//! - a tool completion or failure with a plain result: a multi-table
//!   `UPDATE` of the execution;
//! - a turn ending: one `CALL ag_end_turn_fast` under a lease in the session
//!   row; with an external layer, one multi-table `UPDATE` of the turn and
//!   its session after one plain read of the turn for the view.
//!
//! The two procedures come from migration 0006. Each runs its own
//! transaction inside the `CALL` (sent in autocommit, so it owns the
//! transaction): it commits the common case, and otherwise rolls back having
//! written nothing; an error rolls back before it is raised again. Their
//! answer is a row set: the begin's one row holds the new fence, or NULL for
//! "wrote nothing"; the ending returns the ended turn's row, or no row.
//! sqlx reads a `CALL`'s result sets like a multi-statement query's (it
//! follows `SERVER_MORE_RESULTS_EXISTS` to the final OK packet, so the
//! connection is left clean and an error raised after the rows, such as a
//! failed `COMMIT`, still fails the fetch); it names the first result set's
//! columns from the prepare, which for a `CALL` announces none, so those
//! rows are read by position (`rows::Positional`).
//!
//! The shared steps (`agentgate_store_sql`) run these statements; when one
//! changed no row (or met an existing row), the step's full
//! read-decide-write path runs, which either does the step or explains the
//! refusal. A fast path never refuses by itself, so every answer other than
//! the common case comes from `agentgate_core::decide` and the full path's
//! checks; [`begin_sql`] maps each condition of its procedure to
//! `decide_begin`'s answer.
//!
//! Why the old holder can never write after a takeover: InnoDB reads the
//! joined turn and session rows of the claim and completion statements with
//! locking reads (the claim `FOR UPDATE`; a multi-table `UPDATE` takes
//! shared record locks on the rows it only reads, even at READ COMMITTED,
//! unlike an `INSERT … SELECT` or a single-table `UPDATE`'s subquery, which
//! read a snapshot), and holds them until the statement commits; the ending
//! procedure reads the session row `FOR UPDATE` and holds it until its
//! commit. A takeover writes the session row under an exclusive lock. Either
//! the takeover committed first, and the locking read sees its holder and
//! fence (a locking read always reads the newest committed row), so the
//! step matches no row; or the step locked the row first, and the takeover
//! waits for its commit, so the write is ordered before the takeover and the
//! new holder sees it. As on the full path, the lease is judged on the
//! server's clock at the start of the locking statement.
//!
//! The claim and completion statements lock rows in the order the optimizer
//! joins them (the execution, its turn, the session: primary-key lookups
//! from the bound ids), which is not a begin's session-then-turn order; a
//! takeover racing its old holder's statement can therefore deadlock, which
//! InnoDB breaks by rolling one back, and that step goes on to its full path
//! (which refuses the old holder or goes through). The procedures keep the
//! full paths' order: the begin the user's row, the session's, the fence
//! counter, then the turn; the ending the session's row, then the turn.
//!
//! With an external lease layer the layer is asked first, as on the full
//! path, and the statements require the turn's fence to be the layer's and
//! the session's newest; a begin then always takes the full path (the
//! layer's acquire decides busy and capacity).
//!
//! Round trips (each step also costs the pool's release ping, as every
//! checkout does): begin 1, claim 1, complete or fail 1, end 1, so a turn
//! of one tool call is 4 statements; when a procedure declines, its `CALL`
//! comes on top of the full path's. With an external layer: no begin fast
//! path, end 2 (the turn read, the update), each step plus one layer call.

use agentgate_core::error::{Error, Result};
use agentgate_core::model::{Ending, LeaseRef, TurnView};
use agentgate_core::plant::{self, Plant};
use agentgate_store_sql::lease::Holder;
use agentgate_store_sql::rows;
use sqlx::mysql::MySqlRow;
use sqlx::Row;

use crate::error::map_sqlx;
use crate::rows::{get, Cols, Positional, TurnRow, TURN_COLUMNS};
use crate::{MySqlStore, NOW_MS};

/// The condition on the turn `t` and its session `s` (joined on
/// `s.session_id = t.session_id`) for the caller to be the live holder of
/// its turn's session: the same checks as the full path's lease check, in
/// SQL. `turn` and `credential` are the placeholders of the turn id and of
/// `holder`'s credential (the token's digest, unexpired on the server's
/// clock; or the layer's fence, which the rows must agree is the turn's and
/// the session's newest).
pub(crate) fn condition(holder: &Holder, turn: &str, credential: &str) -> String {
    let common = format!(
        "t.turn_id = {turn} AND t.state = 'running' \
         AND s.holder_turn_id = t.turn_id AND s.fence = t.fence"
    );
    match holder {
        Holder::Row { .. } => plant::edit(
            Plant::MysqlFastLeaseIgnoresExpiry,
            format!(
                "{common} AND s.lease_token_hash = {credential} AND s.lease_expires_at_ms > {NOW_MS}"
            ),
            &format!(" AND s.lease_expires_at_ms > {NOW_MS}"),
            "",
        )
        .into_owned(),
        Holder::Layer { .. } => format!("{common} AND t.fence = {credential}"),
    }
}

/// A first claim of `call` (see `ClaimSql::first_claim_sql`): inserts the
/// execution as running under the session's fence when the caller holds the
/// lease, the turn has no execution of this call and fewer than the bound
/// in all. A duplicate key (the call was claimed before: cached, in flight
/// or to reclaim) fails the statement, and the full path decides.
///
/// `FOR UPDATE` locks the turn and the session exclusively: without it an
/// `INSERT … SELECT` at READ COMMITTED reads a snapshot and locks nothing.
/// The count is correlated with the locked turn so that it is evaluated
/// after the locks are granted; the statement's snapshot is taken at its
/// first non-locking read, the count, so it sees every claim that held the
/// session's lock before. (An uncorrelated count is evaluated once before
/// the join, from a snapshot taken before any lock wait, and two concurrent
/// claims could both pass the limit.) The row is numbered after the count
/// (`claim_seq`, unique per turn): two claims that counted the same number
/// collide on it and the second decides on the full path.
pub(crate) fn claim_sql(holder: &Holder) -> String {
    format!(
        "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, \
         idempotency_key, state, attempt, fence, claim_seq, created_at_ms, updated_at_ms) \
         SELECT $1, t.turn_id, $3, $4, $5, 'running', 1, t.fence, \
           (SELECT COUNT(*) FROM ag_tool_executions x WHERE x.turn_id = t.turn_id) + 1, \
           {NOW_MS}, {NOW_MS} \
         FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
         WHERE {} AND t.cancel_requested_at_ms IS NULL \
           AND (SELECT COUNT(*) FROM ag_tool_executions x WHERE x.turn_id = t.turn_id) < $7 \
         FOR UPDATE",
        condition(holder, "$2", "$6")
    )
}

/// Ends a running execution claimed under the caller's live lease (see
/// `ToolEndingSql::end_execution_sql`): no row changes when the caller is
/// not the holder, the execution is not running, or it was claimed under an
/// older fence.
pub(crate) fn end_execution_sql(holder: &Holder, state: &str, column: &str) -> String {
    format!(
        "UPDATE ag_tool_executions e JOIN ag_turns t ON t.turn_id = e.turn_id \
         JOIN ag_sessions s ON s.session_id = t.session_id \
         SET e.state = '{state}', e.{column} = $1, e.updated_at_ms = {NOW_MS} \
         WHERE e.execution_id = $2 AND e.state = 'running' AND e.fence = t.fence AND {}",
        condition(holder, "$3", "$4")
    )
}

/// Ends the caller's running turn and releases its session (lease and
/// permit, one row) in one statement. `None` when it changed no row.
///
/// The view: the turn is read first, plainly, and the update requires the
/// turn still running under the fence read. A running turn's row changes
/// only by its ending (it leaves `running`) or by a new grant (a new fence),
/// so every column the update does not set is still as read, and the view is
/// the row read with the update's `SET` applied, exactly what a read-back in
/// the same transaction would give. A read-back after the commit would not:
/// a begin may restart a failed turn in between.
pub(crate) async fn end_turn(
    store: &MySqlStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<Option<TurnView>> {
    let Some(holder) = Holder::of(store.leases.as_deref(), lease).await? else {
        return Ok(None);
    };
    if let Holder::Row { token_digest } = &holder {
        return end_turn_in_row(store, lease, token_digest, ending).await;
    }
    // One connection for both statements: a second checkout costs sqlx's
    // release ping.
    let mut conn = store.held().await?;
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS}, {NOW_MS} AS now_ms FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(lease.turn_id.as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else {
        conn.release();
        return Ok(None);
    };
    let now: i64 = get(&row, "now_ms")?;
    let mut turn = TurnRow::read(&Cols(&row))?;
    if turn.state != "running" {
        conn.release();
        return Ok(None);
    }
    let columns = agentgate_store_sql::rows::ending_columns(ending);
    let confirmation_ttl_ms = agentgate_core::config::duration_ms(store.config.confirmation_ttl);
    let pending_expires = columns.pending.map(|_| now + confirmation_ttl_ms);
    // Assignments only use bound values and their own table's columns: a
    // multi-table `UPDATE` does not promise an order across tables.
    let sql = format!(
        "UPDATE ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
         SET t.state = ?, t.response = ?, t.error = ?, t.retryable = ?, \
         t.pending = COALESCE(?, t.pending), t.updated_at_ms = ?, t.ended_at_ms = ?, \
         s.holder_turn_id = NULL, s.lease_token_hash = NULL, s.lease_expires_at_ms = NULL, \
         s.updated_at_ms = ?, s.pending_turn_id = IF(? IS NULL, s.pending_turn_id, ?), \
         s.pending_expires_at_ms = COALESCE(?, s.pending_expires_at_ms) \
         WHERE t.fence = ? AND {}",
        condition(&holder, "?", "?")
    );
    let query = sqlx::query(&sql)
        .bind(columns.state)
        .bind(columns.response)
        .bind(columns.error)
        .bind(columns.retryable)
        .bind(columns.pending)
        .bind(now)
        .bind(now)
        .bind(now)
        .bind(pending_expires)
        .bind(lease.turn_id.as_str())
        .bind(pending_expires)
        .bind(turn.fence);
    let query = query.bind(lease.turn_id.as_str());
    let query = match &holder {
        Holder::Row { token_digest } => query.bind(token_digest.as_str()),
        Holder::Layer { fence } => query.bind(fence.0),
    };
    let done = query.execute(&mut *conn).await;
    conn.release();
    let done = done.map_err(map_sqlx)?;
    // The server counts the rows it found in both tables (sqlx asks for
    // found rows); any match is the one turn and its one session.
    match done.rows_affected() {
        0 => return Ok(None),
        1 | 2 => {}
        n => return Err(Error::corrupt(format!("ending one turn changed {n} rows"))),
    }
    turn.state = columns.state.to_owned();
    turn.response = columns.response.map(str::to_owned);
    turn.error = columns.error.map(str::to_owned);
    turn.retryable = columns.retryable;
    turn.pending = columns.pending.map(str::to_owned).or(turn.pending);
    turn.updated_at_ms = now;
    turn.view().map(Some)
}

/// A first begin as one `CALL` of `ag_begin_fast` (migration 0006), its
/// arguments as `BeginTx::begin_new_sql` numbers them: a new
/// turn on a free session of the caller's, below the user's cap, no
/// confirmation. `None` when the procedure wrote nothing (any other case);
/// the caller then runs the full path. Only without an external lease
/// layer: with one, the layer's acquire decides busy and capacity.
///
/// What the procedure starts is exactly what `decide_begin` starts on the
/// facts the full path would read under the same locks (user row, session
/// row, then the fence counter, read after the locks at READ COMMITTED):
///
/// | procedure requires | `decide_begin` on those facts |
/// |---|---|
/// | the session row's `user_id` is the caller (or the row is new) | not `not_found` |
/// | no turn for `(session_id, client_request_id)` | `decide_existing` not taken |
/// | no confirmation in the command (checked here, before the call) | `decide_confirmation` not taken: `gate_start(New, 1)` |
/// | `pending_turn_id` NULL, or its expiry NULL or ≤ now | `live_pending` is `None`: no `awaiting_confirmation` |
/// | `holder_turn_id` NULL | `live_holder` is `None`: no `session_busy` |
/// | cap (`ag_users.max_turns`, else the configured default) in `0..=u32::MAX` | `UserLoad::read` is not `corrupt` |
/// | live permits < cap | no `user_at_capacity` |
///
/// Then `decide_begin` answers `Start { New, attempt: 1 }`, and the
/// procedure writes what the full path's start writes for it: the next
/// fence, the session's holder, token digest, expiry (now + TTL) and fence,
/// and the turn `running`, attempt 1. `resume_only` changes nothing when
/// there is no turn. A session whose holder's lease expired also decides
/// `Start` but is left to the full path, like every other case: the
/// procedure only ever starts or writes nothing, never refuses.
///
/// Before taking any lock the procedure declines a request whose turn is
/// already recorded or whose session is held, read plainly: those cases
/// decline under the locks anyway, so a duplicate storm does not queue on
/// the user's and session's locks twice. A stale plain read only lets a case
/// through to the checks under the locks, which decide.
pub(crate) fn begin_sql() -> String {
    "CALL ag_begin_fast($2, $1, $3, $4, $6, $7, $5, $8, $9)".to_owned()
}

/// The fence `ag_begin_fast`'s one row says it granted under, `None` when
/// it wrote nothing (the row holds NULL).
pub(crate) fn begin_granted(store: &MySqlStore, rows: &[MySqlRow]) -> Result<Option<i64>> {
    let [row] = rows else {
        return Err(Error::corrupt(format!(
            "ag_begin_fast returned {} rows, not one",
            rows.len()
        )));
    };
    let fence: Option<i64> = row.try_get(0).map_err(map_sqlx)?;
    note(
        store,
        match fence {
            Some(_) => Taken::BeginStarted,
            None => Taken::BeginDeclined,
        },
    );
    Ok(fence)
}

/// An ending under a lease kept in the session row, as one `CALL` of
/// `ag_end_turn_fast` (migration 0006): under the session's row lock it
/// checks what the full path's lease check accepts (`check_row_lease`: the
/// turn running under the session's fence, this turn the holder, this
/// token's digest, unexpired on the server clock), ends the turn, releases
/// the session (recording the pending confirmation when the ending awaits
/// one) and returns the turn's row as written, read before the commit.
/// `None` when any check failed; the procedure then wrote nothing, and the
/// full path explains the refusal.
async fn end_turn_in_row(
    store: &MySqlStore,
    lease: &LeaseRef,
    token_digest: &str,
    ending: &Ending,
) -> Result<Option<TurnView>> {
    let columns = agentgate_store_sql::rows::ending_columns(ending);
    let confirmation_ttl_ms = agentgate_core::config::duration_ms(store.config.confirmation_ttl);
    let call = sqlx::query("CALL ag_end_turn_fast(?, ?, ?, ?, ?, ?, ?, ?)")
        .bind(lease.turn_id.as_str())
        .bind(token_digest)
        .bind(columns.state)
        .bind(columns.response)
        .bind(columns.error)
        .bind(columns.retryable)
        .bind(columns.pending)
        .bind(confirmation_ttl_ms);
    let mut conn = store.held().await?;
    let rows = call.fetch_all(&mut *conn).await;
    conn.release();
    let rows = rows.map_err(map_sqlx)?;
    match rows.as_slice() {
        [] => {
            note(store, Taken::EndDeclined);
            Ok(None)
        }
        [row] => {
            let view = rows::turn_view(&Positional::new(row, TURN_COLUMNS)?)?;
            note(store, Taken::EndEnded);
            Ok(Some(view))
        }
        more => Err(Error::corrupt(format!(
            "ag_end_turn_fast returned {} rows for one turn",
            more.len()
        ))),
    }
}

/// Which way a procedure call went, counted for test suites (feature
/// `testing`) so that they can show that they took both the procedures'
/// common case and their fallback.
#[derive(Clone, Copy)]
pub(crate) enum Taken {
    /// `ag_begin_fast` started the turn.
    BeginStarted,
    /// `ag_begin_fast` wrote nothing; the full begin ran.
    BeginDeclined,
    /// `ag_end_turn_fast` ended the turn.
    EndEnded,
    /// `ag_end_turn_fast` wrote nothing; the full ending ran.
    EndDeclined,
}

#[cfg(any(test, feature = "testing"))]
fn note(store: &MySqlStore, taken: Taken) {
    crate::testing::count(&store.database, taken);
}

#[cfg(not(any(test, feature = "testing")))]
fn note(_: &MySqlStore, _: Taken) {}

#[cfg(test)]
mod tests {
    use super::TURN_COLUMNS;

    /// The ending procedure's row is read by position in `TURN_COLUMNS`, so
    /// the procedure must select exactly those columns, in that order.
    #[test]
    fn the_ending_procedure_selects_the_turn_columns_in_order() {
        let migration = include_str!("../migrations/0008_cancel.sql");
        let body = &migration[migration
            .find("CREATE PROCEDURE ag_end_turn_fast")
            .expect("the ending procedure")..];
        let select = &body[body.find("SELECT turn_id").expect("its final SELECT") + 7..];
        let list = &select[..select.find("FROM ag_turns").expect("its FROM")];
        let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(words(list), words(TURN_COLUMNS));
    }
}
