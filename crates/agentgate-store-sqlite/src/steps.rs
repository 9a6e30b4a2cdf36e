//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the SQLite clock.
//!
//! The common case of each step is as few calls into SQLite as its writes:
//! a heartbeat, a first tool claim and a tool completion or failure with a
//! result are one autocommit statement each, whose `WHERE` carries the whole
//! lease check ([`live_fence`]); so is a turn ending: the turn's update
//! (`RETURNING` its view), whose trigger releases the session's row in the
//! same statement (migration 0007).
//! When such a statement changes no row, the step falls back to reading the
//! state in a transaction, which either explains the refusal (`lease_lost`,
//! `not_found`, a cached result, a tool in flight) or does the rarer work
//! (a reclaim, a same-transaction effect). SQLite has one writer, so a
//! single statement's check and write see the same state.

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, Fence};

use agentgate_core::limits::FAST_ATTEMPTS;
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::model::{Ending, ExecutionEnding, LeaseRef, ToolCall, TurnView};
use sqlx::query::Query;
use sqlx::sqlite::SqliteArguments;
use sqlx::{Sqlite, SqliteConnection, Transaction};

use agentgate_store_sql::claim::ClaimSql;
use agentgate_store_sql::heartbeat::HeartbeatSql;
use agentgate_store_sql::lease::{self, Authority, LeaseRow, LeaseSql, LEASE_COLUMNS};
use agentgate_store_sql::tool::ToolEndingSql;
use agentgate_store_sql::StepTx;

use crate::error::map_sqlx;
use crate::rows::{turn_view, Cols, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

/// A live lease, as checked inside a step's transaction.
pub(crate) use agentgate_core::decide::CheckedLease as LiveLease;

/// Checks that `lease` is the live holder of its session; explains why not.
pub(crate) async fn check_lease(
    store: &SqliteStore,
    conn: &mut SqliteConnection,
    lease: &LeaseRef,
) -> Result<LiveLease> {
    let authority = Authority::ask(store.leases.as_deref(), lease).await?;
    check_as(conn, lease, &authority).await
}

/// [`check_lease`] as `authority` says. SQLite locks no rows: a step's write
/// transaction holds the single writer.
async fn check_as(
    conn: &mut SqliteConnection,
    lease: &LeaseRef,
    authority: &Authority,
) -> Result<LiveLease> {
    let (checked, _) = lease::check_lease(&Rows, conn, lease, authority, false).await?;
    Ok(checked)
}

/// The lease check's SQL.
struct Rows;

#[async_trait::async_trait]
impl LeaseSql for Rows {
    type Conn = SqliteConnection;

    async fn read_lease(
        &self,
        conn: &mut SqliteConnection,
        turn_id: &str,
        _lock: bool,
    ) -> Result<Option<LeaseRow>> {
        let row = sqlx::query(&format!(
            "SELECT {LEASE_COLUMNS}, {NOW_MS} AS now_ms \
             FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
             WHERE t.turn_id = ?"
        ))
        .bind(turn_id)
        .fetch_optional(conn)
        .await
        .map_err(map_sqlx)?;
        row.map(|row| LeaseRow::read(&Cols(&row))).transpose()
    }

    async fn turn_exists(&self, conn: &mut SqliteConnection, turn_id: &str) -> Result<bool> {
        let exists = sqlx::query_scalar::<_, i64>("SELECT 1 FROM ag_turns WHERE turn_id = ?")
            .bind(turn_id)
            .fetch_optional(conn)
            .await
            .map_err(map_sqlx)?;
        Ok(exists.is_some())
    }
}

/// What a one-statement step binds as `?2` to prove its lease inside the
/// statement (`?1` is always the turn id); see [`live_fence`].
enum Proof {
    /// The lease lives in the session row: the token's digest.
    Token(String),
    /// The lease lives in the layer, which holds it under this fence.
    Layer(Fence),
}

impl Proof {
    /// The caller's proof, or `None` when the layer says it holds no lease
    /// (the step then goes straight to explaining the refusal).
    async fn of(store: &SqliteStore, lease: &LeaseRef) -> Result<Option<Self>> {
        let digest = lease.token.digest_hex();
        match &store.leases {
            None => Ok(Some(Self::Token(digest))),
            Some(layer) => Ok(layer
                .holds(lease.turn_id.as_str(), &digest)
                .await?
                .map(|live| Self::Layer(live.fence))),
        }
    }

    /// A scalar subquery: the fence of the caller's lease when it is live,
    /// else NULL, so `fence = {live_fence}` fails for a lost lease. The turn
    /// must be running; in the row, the session must name it as holder with
    /// this token's digest and an expiry after the store's now; with a
    /// layer, the layer's fence must be the turn's and the session's newest.
    fn live_fence(&self) -> String {
        match self {
            Self::Token(_) => format!(
                "(SELECT s.fence FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
                 WHERE t.turn_id = ?1 AND t.state = 'running' AND s.holder_turn_id = ?1 \
                 AND s.lease_token_hash = ?2 AND s.lease_expires_at_ms > {NOW_MS})"
            ),
            Self::Layer(_) => "(SELECT t.fence FROM ag_turns t JOIN ag_sessions s \
                 ON s.session_id = t.session_id WHERE t.turn_id = ?1 AND t.state = 'running' \
                 AND t.fence = ?2 AND s.fence = t.fence)"
                .to_owned(),
        }
    }

    /// `sql` (which uses [`Proof::live_fence`]) with `?1` and `?2` bound.
    fn query<'q>(
        &self,
        sql: &'q str,
        lease: &'q LeaseRef,
    ) -> Query<'q, Sqlite, SqliteArguments<'q>> {
        let query = sqlx::query(sql).bind(lease.turn_id.as_str());
        match self {
            Self::Token(digest) => query.bind(digest.clone()),
            Self::Layer(fence) => query.bind(fence.0),
        }
    }
}

/// The error for a step whose statement kept changing no row while every
/// explanation found the lease live: the state is moving under it.
fn unsettled(step: &str) -> Error {
    Error::conflict(format!("{step}: the lease's state changed during the step"))
}

/// Opens a step's write transaction and checks the lease in it. With an
/// external layer the layer is asked first, before the write lock is taken,
/// so SQLite's single writer never waits on a Redis round trip; the fence
/// check inside the transaction still guards every write.
pub(crate) async fn locked_step(
    store: &SqliteStore,
    lease: &LeaseRef,
) -> Result<(Transaction<'static, Sqlite>, LiveLease)> {
    let authority = Authority::ask(store.leases.as_deref(), lease).await?;
    let mut tx = store.write().await?;
    let live = check_as(&mut tx, lease, &authority).await?;
    Ok((tx, live))
}

#[async_trait::async_trait]
impl HeartbeatSql for Sql<'_> {
    /// One autocommit statement on the writer renews session lease and
    /// permit (the same row).
    async fn renew_row_lease(&self, lease: &LeaseRef, ttl_ms: i64) -> Result<bool> {
        let renewed = sqlx::query(&format!(
            "UPDATE ag_sessions SET lease_expires_at_ms = {NOW_MS} + ?1, updated_at_ms = {NOW_MS} \
             WHERE session_id = (SELECT session_id FROM ag_turns WHERE turn_id = ?2) \
             AND holder_turn_id = ?2 AND lease_token_hash = ?3 AND lease_expires_at_ms > {NOW_MS}"
        ))
        .bind(ttl_ms)
        .bind(lease.turn_id.as_str())
        .bind(lease.token.digest_hex())
        .execute(&self.0.writer)
        .await
        .map_err(map_sqlx)?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn explain_lease(&self, lease: &LeaseRef) -> Result<()> {
        let mut conn = self.0.reader.acquire().await.map_err(map_sqlx)?;
        check_lease(self.0, &mut conn, lease).await.map(drop)
    }
}

#[async_trait::async_trait]
impl StepTx for Sql<'_> {
    async fn open(&self, lease: &LeaseRef) -> Result<(Self::Tx, LiveLease)> {
        locked_step(self.0, lease).await
    }
}

#[async_trait::async_trait]
impl ClaimSql for Sql<'_> {
    /// One autocommit statement: inserts when the lease is live, no cancel
    /// was requested, the call has no execution yet and the turn is below
    /// its bound. SQLite has one
    /// writer, so the statement's check and write see the same state.
    async fn first_claim(
        &self,
        lease: &LeaseRef,
        call: &ToolCall,
        execution_id: &ExecutionId,
        key: &str,
    ) -> Result<bool> {
        let Some(proof) = Proof::of(self.0, lease).await? else {
            return Ok(false);
        };
        let sql = format!(
            "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, \
             idempotency_key, state, attempt, fence, claim_seq, created_at_ms, updated_at_ms) \
             SELECT ?3, ?1, ?4, ?5, ?6, 'running', 1, live.fence, live.executions + 1, \
               {NOW_MS}, {NOW_MS} \
             FROM (SELECT {} AS fence, \
                     (SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = ?1) AS executions) live \
             WHERE live.fence IS NOT NULL AND live.executions < ?7 \
               AND NOT EXISTS (SELECT 1 FROM ag_turns c \
                               WHERE c.turn_id = ?1 AND c.cancel_requested_at_ms IS NOT NULL) \
             ON CONFLICT DO NOTHING",
            proof.live_fence()
        );
        let inserted = proof
            .query(&sql, lease)
            .bind(execution_id.as_str())
            .bind(call.tool.as_str())
            .bind(call.args_hash.as_hex())
            .bind(key)
            .bind(i64::from(MAX_EXECUTIONS_PER_TURN))
            .execute(&self.0.writer)
            .await
            .map_err(map_sqlx)?;
        Ok(inserted.rows_affected() == 1)
    }
}

/// The store as the shared tool ending sees it. SQLite marks no error a
/// conflict, so the shared step never runs one of these again.
pub(crate) struct Sql<'a>(pub(crate) &'a SqliteStore);

#[async_trait::async_trait]
impl ToolEndingSql for Sql<'_> {
    async fn end_fast(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        ending: ExecutionEnding<'_>,
    ) -> Result<bool> {
        let Some(proof) = Proof::of(self.0, lease).await? else {
            return Ok(false);
        };
        let (state, column, json) = ending.columns();
        let sql = format!(
            "UPDATE ag_tool_executions SET state = '{state}', {column} = ?3, \
             updated_at_ms = {NOW_MS} WHERE execution_id = ?4 AND turn_id = ?1 \
             AND state = 'running' AND fence = {}",
            proof.live_fence()
        );
        let updated = proof
            .query(&sql, lease)
            .bind(json.as_str())
            .bind(execution_id.as_str())
            .execute(&self.0.writer)
            .await
            .map_err(map_sqlx)?;
        Ok(updated.rows_affected() == 1)
    }
}

pub(crate) async fn end_turn(
    store: &SqliteStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let mut ended = None;
    for _ in 0..FAST_ATTEMPTS {
        if let Some(view) = try_end(store, lease, ending).await? {
            ended = Some(view);
            break;
        }
        let mut conn = store.reader.acquire().await.map_err(map_sqlx)?;
        check_lease(store, &mut conn, lease).await?;
    }
    let view = ended.ok_or_else(|| unsettled("turn ending"))?;
    if let Some(layer) = &store.leases {
        // After the commit the ending is durable: a release that fails only
        // leaves a lease that expires by itself, so it is not the caller's
        // error.
        if let Err(error) = layer
            .release(lease.turn_id.as_str(), &lease.token.digest_hex())
            .await
        {
            tracing::warn!(%error, turn_id = %lease.turn_id, "could not release an ended turn's lease");
        }
    }
    Ok(view)
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
    let columns = ending.columns();
    let Some(proof) = Proof::of(store, lease).await? else {
        return Ok(None);
    };
    // Below 0: release only; 0 or more: also record the pending
    // confirmation for that long (see the migration).
    let end_release = match columns.pending {
        Some(_) => agentgate_core::config::duration_ms(store.config.confirmation_ttl),
        None => RELEASE_ONLY,
    };
    let sql = format!(
        "UPDATE ag_turns SET state = ?3, response = ?4, error = ?5, retryable = ?6, \
         pending = COALESCE(?7, pending), updated_at_ms = {NOW_MS}, ended_at_ms = {NOW_MS}, \
         end_release = ?8 \
         WHERE turn_id = ?1 AND state = 'running' AND fence = {} RETURNING {TURN_COLUMNS}",
        proof.live_fence()
    );
    // Read to the end (`fetch_all`), so the statement runs to completion and
    // its autocommit transaction commits before the view is returned.
    let rows = proof
        .query(&sql, lease)
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
