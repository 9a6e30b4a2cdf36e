//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the SQLite clock.
//!
//! The common case of each step is as few calls into SQLite as its writes:
//! a heartbeat, a first tool claim and a tool completion or failure with a
//! result are one autocommit statement each, whose `WHERE` carries the whole
//! lease check (`live_fence`); so is a turn ending: the turn's update
//! (`RETURNING` its view), whose trigger releases the session's row in the
//! same statement (migration 0007).
//! When such a statement changes no row, the step falls back to reading the
//! state in a transaction, which either explains the refusal (`lease_lost`,
//! `not_found`, a cached result, a tool in flight) or does the rarer work
//! (a reclaim, a same-transaction effect). SQLite has one writer, so a
//! single statement's check and write see the same state.

use agentgate_core::error::{Error, Result};
use agentgate_core::limits::FAST_ATTEMPTS;
use agentgate_core::model::{Ending, LeaseRef, TurnView};
use agentgate_core::plant::{planted, Plant};
use agentgate_store_sql::tx::Tx;
use sqlx::Sqlite;

use agentgate_store_sql::claim::ClaimSql;
use agentgate_store_sql::heartbeat::HeartbeatSql;
use agentgate_store_sql::lease::{self, release_ended, Holder, LeaseSql, LEASE_COLUMNS};
use agentgate_store_sql::tool::ToolEndingSql;
use agentgate_store_sql::StepTx;

use crate::error::map_sqlx;
use crate::rows::{turn_view, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

/// The caller's lease as a scalar subquery: the fence of its lease when it
/// is live, else NULL, so `fence = {live_fence}` fails for a lost lease.
/// The turn `$turn` must be running; in the row, the session must name it
/// as holder with the token's digest (`$credential`) and an expiry after
/// the store's now; with a layer, the layer's fence (`$credential`) must be
/// the turn's and the session's newest.
fn live_fence(holder: &Holder, turn: u8, credential: u8) -> String {
    match holder {
        Holder::Row { .. } => format!(
            "(SELECT s.fence FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
             WHERE t.turn_id = ${turn} AND t.state = 'running' AND s.holder_turn_id = ${turn} \
             AND s.lease_token_hash = ${credential} AND s.lease_expires_at_ms > {NOW_MS})"
        ),
        Holder::Layer { .. } => format!(
            "(SELECT t.fence FROM ag_turns t JOIN ag_sessions s \
             ON s.session_id = t.session_id WHERE t.turn_id = ${turn} AND t.state = 'running' \
             AND t.fence = ${credential} AND s.fence = t.fence)"
        ),
    }
}

/// The error for a step whose statement kept changing no row while every
/// explanation found the lease live: the state is moving under it.
fn unsettled(step: &str) -> Error {
    Error::conflict(format!("{step}: the lease's state changed during the step"))
}

impl LeaseSql for Sql<'_> {
    /// SQLite locks no rows: a step's write transaction holds the single
    /// writer.
    fn read_lease_sql(_lock: bool) -> String {
        format!(
            "SELECT {LEASE_COLUMNS}, {NOW_MS} AS now_ms \
             FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
             WHERE t.turn_id = $1"
        )
    }
}

impl HeartbeatSql for Sql<'_> {}

/// A step's transaction holds SQLite's single writer; the lease layer, if
/// any, was asked before it was opened, so the writer never waits on a
/// Redis round trip.
#[async_trait::async_trait]
impl StepTx for Sql<'_> {
    async fn transaction(&self) -> Result<Tx<Sqlite>> {
        self.0.write().await
    }
}

impl ClaimSql for Sql<'_> {
    /// One autocommit statement: inserts when the lease is live, no cancel
    /// was requested, the call has no execution yet and the turn is below
    /// its bound. SQLite has one writer, so the statement's check and write
    /// see the same state.
    fn first_claim_sql(holder: &Holder) -> String {
        format!(
            "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, \
             idempotency_key, state, attempt, fence, claim_seq, created_at_ms, updated_at_ms) \
             SELECT $1, $2, $3, $4, $5, 'running', 1, live.fence, live.executions + 1, \
               {NOW_MS}, {NOW_MS} \
             FROM (SELECT {} AS fence, \
                     (SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = $2) AS executions) live \
             WHERE live.fence IS NOT NULL AND live.executions < $7 \
               AND NOT EXISTS (SELECT 1 FROM ag_turns c \
                               WHERE c.turn_id = $2 AND c.cancel_requested_at_ms IS NOT NULL) \
             ON CONFLICT DO NOTHING",
            live_fence(holder, 2, 6)
        )
    }
}

/// The store as the shared steps see it. SQLite marks no error a conflict,
/// so the shared steps never run one of these again.
pub(crate) struct Sql<'a>(pub(crate) &'a SqliteStore);

impl ToolEndingSql for Sql<'_> {
    fn end_execution_sql(holder: &Holder, state: &str, column: &str) -> String {
        format!(
            "UPDATE ag_tool_executions SET state = '{state}', {column} = $1, \
             updated_at_ms = {NOW_MS} WHERE execution_id = $2 AND turn_id = $3 \
             AND state = 'running' AND fence = {}",
            live_fence(holder, 3, 4)
        )
    }
}

pub(crate) async fn end_turn(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let sql = Sql(store);
    for _ in 0..FAST_ATTEMPTS {
        if let Some(view) = try_end(store, lease, ending).await? {
            release_ended(store.leases.as_deref(), lease).await;
            return Ok(view);
        }
        lease::explain(&sql, lease).await?;
    }
    Err(unsettled("turn ending"))
}

/// Ends the turn and releases its session lease and permit (one row) in one
/// autocommit statement: the turn's update sets `end_release`, whose trigger
/// (migration 0007) releases the session row, and records the pending
/// confirmation of an ending that awaits one, inside the same statement.
/// `None`, with nothing written, when the lease is not live.
async fn try_end(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<Option<TurnView>> {
    let columns = agentgate_store_sql::rows::ending_columns(ending);
    let Some(holder) = Holder::of(store.leases.as_deref(), lease).await? else {
        return Ok(None);
    };
    // Below 0: release only; 0 or more: also record the pending
    // confirmation for that long (see the migration).
    let end_release = match columns.pending {
        Some(_) if planted(Plant::SqliteConfirmationTtlTenfold) => {
            agentgate_core::config::duration_ms(store.config.confirmation_ttl) * 10
        }
        Some(_) => agentgate_core::config::duration_ms(store.config.confirmation_ttl),
        None => RELEASE_ONLY,
    };
    let sql = format!(
        "UPDATE ag_turns SET state = $3, response = $4, error = $5, retryable = $6, \
         pending = COALESCE($7, pending), updated_at_ms = {NOW_MS}, ended_at_ms = {NOW_MS}, \
         end_release = $8 \
         WHERE turn_id = $1 AND state = 'running' AND fence = {} RETURNING {TURN_COLUMNS}",
        live_fence(&holder, 1, 2)
    );
    // Read to the end (`fetch_all`), so the statement runs to completion and
    // its autocommit transaction commits before the view is returned.
    let query = sqlx::query(&sql).bind(lease.turn_id.as_str());
    let query = match &holder {
        Holder::Row { token_digest } => query.bind(token_digest.as_str()),
        Holder::Layer { fence } => query.bind(fence.0),
    };
    let rows = query
        .bind(columns.state)
        .bind(columns.response)
        .bind(columns.error)
        .bind(columns.retryable)
        .bind(columns.pending)
        .bind(end_release)
        .fetch_all(&store.writer)
        .await
        .map_err(map_sqlx)?;
    match rows.as_slice() {
        // No row: the lease is not live; nothing was written.
        [] => Ok(None),
        [row] => turn_view(row).map(Some),
        more => Err(Error::corrupt(format!(
            "a turn ending updated {} turns",
            more.len()
        ))),
    }
}

/// `end_release` asking the trigger for a release without a pending
/// confirmation.
const RELEASE_ONLY: i64 = -1;
