//! The steps after a grant: heartbeat, tool claims and completions, turn
//! endings. Each is conditioned on the caller's lease token (by its digest)
//! and fence, and on the lease being live on the PostgreSQL clock.
//!
//! Where SQL can state a step's decision exactly, the step is one autocommit
//! statement whose `WHERE` is the whole check (`lease::condition`): a heartbeat,
//! an execution's ending with a result, a turn's ending, the first claim of
//! a call. A statement that changes no row is explained after by the
//! read-only checks (or, for a claim, the full path below decides). Each of
//! them re-checks its conditions on the rows it writes, which READ COMMITTED
//! re-evaluates on the newest version of a row it had to wait for, so an old
//! holder's write never lands after a takeover's (see `end_tool_once`).
//!
//! The full path — a claim that finds the call's execution, a completion
//! with a same-transaction effect — is one transaction that locks the
//! session's row first (`SELECT … FOR UPDATE OF s`), the same row a begin
//! locks second, reads, asks `decide`, and writes, so a takeover and the old
//! holder's step are serialised and the old holder's step reads the new
//! holder and changes nothing.
//!
//! With an external lease layer the layer must hold the lease (one layer
//! call) and the SQL rows must agree that its fence is the session's newest;
//! a heartbeat then touches only the layer, and an ending releases the
//! layer's lease after its commit.
//!
//! Round trips (sqlx's ping when a connection goes back to the pool aside):
//! heartbeat 1; a first claim 1; complete or fail with a result 1; end 1;
//! each + 1 or 2 to explain a refusal. A claim that finds its call's execution
//! (cached, in flight, reclaimed) or meets the bound: 1 + the full path's 4
//! or 5 (`BEGIN`, lock, lookup, [write,] `COMMIT`); a complete with a
//! same-transaction effect 5 plus the effect's own. With a lease layer every
//! step but the heartbeat adds one layer call first, and an ending one more
//! after (the release).

use agentgate_core::config::duration_ms;
use agentgate_core::error::{Error, Result};
use agentgate_core::model::{Ending, LeaseRef, TurnView};

use agentgate_store_sql::tx::Tx;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::Postgres;

use crate::error::map_sqlx;
use crate::lease::{condition, live_fence};
use crate::notify::CHANNEL;
use crate::rows::{turn_view, TURN_COLUMNS};
use crate::{PostgresStore, NOW_MS};
use agentgate_store_sql::claim::ClaimSql;
use agentgate_store_sql::heartbeat::HeartbeatSql;
use agentgate_store_sql::lease::{self, release_ended, Holder};
use agentgate_store_sql::tool::ToolEndingSql;
use agentgate_store_sql::{Retry, StepTx};

impl HeartbeatSql for Sql<'_> {}

#[async_trait::async_trait]
impl StepTx for Sql<'_> {
    async fn transaction(&self) -> Result<Tx<Postgres>> {
        self.0.transaction().await
    }
}

impl ClaimSql for Sql<'_> {
    /// One autocommit `INSERT … SELECT` that writes only under the live
    /// lease and below the turn's bound of executions, and `ON CONFLICT DO
    /// NOTHING`: an existing execution of the call, or another claim of the
    /// turn numbered from the same count (`claim_seq`, which keeps the bound
    /// exact without the session's lock), leaves no row.
    ///
    /// An old holder's insert that races a takeover is ordered before it:
    /// the new holder's claim of the same call either sees the row (an
    /// execution left `running` under an older fence: `previous_outcome:
    /// unknown`) or inserts too and fails on the unique key, and the full
    /// path then sees it.
    fn first_claim_sql(holder: &Holder) -> String {
        format!(
            "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, \
             idempotency_key, state, attempt, fence, claim_seq, created_at_ms, updated_at_ms) \
             SELECT $1, $2, $3, $4, $5, 'running', 1, live.fence, live.executions + 1, \
               {NOW_MS}, {NOW_MS} \
             FROM (SELECT s.fence, \
                     (SELECT COUNT(*) FROM ag_tool_executions e WHERE e.turn_id = $2) AS executions \
                   FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
                   WHERE {} AND t.cancel_requested_at_ms IS NULL) AS live \
             WHERE live.executions < $7 \
             ON CONFLICT DO NOTHING",
            condition(holder, 2, 6)
        )
    }
}

/// The store as the shared steps see it.
pub(crate) struct Sql<'a>(pub(crate) &'a PostgresStore);

impl ToolEndingSql for Sql<'_> {
    /// Why no session lock is needed under READ COMMITTED: the fence
    /// subquery is read from the statement's snapshot, so it may still show
    /// an old holder whose lease a takeover is committing at that moment.
    /// But a takeover never writes an execution; only the new holder's own
    /// later steps do, and each of them changes the row's `fence` (a
    /// reclaim) or its `state` (an ending), or is conditioned on the state
    /// it read (the shared claim's reclaim). If such a write committed before
    /// this statement's snapshot, the row's `fence` or `state` no longer
    /// matches; if it is in flight, this statement waits for its row lock
    /// and PostgreSQL re-checks `state = 'running' AND fence = …` on the
    /// newest version, which fails. If this write commits first, it is
    /// ordered before every write of the new holder, which then sees it (or,
    /// having read before it, fails its conditional write and runs again).
    /// So an old holder's write never lands after a new holder's write on
    /// the same row.
    fn end_execution_sql(holder: &Holder, state: &str, column: &str) -> String {
        format!(
            "UPDATE ag_tool_executions SET state = '{state}', {column} = $1, \
             updated_at_ms = {NOW_MS} \
             WHERE execution_id = $2 AND turn_id = $3 AND state = 'running' AND fence = {}",
            live_fence(holder, 3, 4)
        )
    }
}

pub(crate) async fn end_turn(
    store: &PostgresStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let mut retry = Retry::new();
    loop {
        match end_turn_once(store, lease, ending).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

/// Ends the turn and releases session lease and permit (one row) in one
/// autocommit statement, with the lease check folded in: `live` locks the
/// session's row only if the caller holds it (the lock order of every step,
/// session before turn, so a concurrent takeover queues behind it or it
/// behind the takeover, and after that wait READ COMMITTED re-checks the
/// condition on the newest row, which a committed takeover fails). `ended`
/// requires the turn to be running under that lease's fence, and `released`
/// follows `ended`, so neither writes unless both do. An ending that awaits
/// confirmation records the pending turn on the session, and the release
/// is announced to other nodes' waiters (`pg_notify`, sent at commit).
/// Zero rows are explained after, read-only.
async fn end_turn_once(
    store: &PostgresStore,
    lease: &LeaseRef,
    ending: &Ending,
) -> Result<TurnView> {
    let Some(holder) = Holder::of(store.leases.as_deref(), lease).await? else {
        return Err(explain_turn(store, lease).await);
    };
    let columns = agentgate_store_sql::rows::ending_columns(ending);
    let pending_ttl_ms = columns
        .pending
        .map(|_| duration_ms(store.config.confirmation_ttl));
    let query = format!(
        "WITH live AS ( \
           SELECT s.session_id, s.fence FROM ag_sessions s \
           JOIN ag_turns t ON t.session_id = s.session_id WHERE {} FOR UPDATE OF s), \
         ended AS ( \
           UPDATE ag_turns SET state = $1, response = $2, error = $3, retryable = $4, \
           pending = COALESCE($5, pending), updated_at_ms = {NOW_MS}, ended_at_ms = {NOW_MS} \
           WHERE turn_id = $7 AND state = 'running' AND fence = (SELECT fence FROM live) \
           RETURNING {TURN_COLUMNS}), \
         released AS ( \
           UPDATE ag_sessions s SET holder_turn_id = NULL, lease_token_hash = NULL, \
           lease_expires_at_ms = NULL, updated_at_ms = {NOW_MS}, \
           pending_turn_id = CASE WHEN $6::BIGINT IS NULL THEN s.pending_turn_id ELSE $7 END, \
           pending_expires_at_ms = CASE WHEN $6::BIGINT IS NULL THEN s.pending_expires_at_ms \
             ELSE {NOW_MS} + $6::BIGINT END \
           FROM ended e WHERE s.session_id = e.session_id AND s.holder_turn_id = $7 \
           RETURNING pg_notify('{CHANNEL}', s.session_id)) \
         SELECT {TURN_COLUMNS} FROM ended",
        condition(&holder, 7, 8)
    );
    let query = sqlx::query(&query)
        .bind(columns.state)
        .bind(columns.response)
        .bind(columns.error)
        .bind(columns.retryable)
        .bind(columns.pending)
        .bind(pending_ttl_ms)
        .bind(lease.turn_id.as_str());
    let row = bind_credential(query, &holder)
        .fetch_optional(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let Some(row) = row else {
        return Err(explain_turn(store, lease).await);
    };
    let view = turn_view(&row)?;
    release_ended(store.leases.as_deref(), lease).await;
    Ok(view)
}

/// Why a turn's ending changed no row, read without locks. When the lease
/// now passes, the miss raced a change this read no longer sees, and the
/// step runs again.
async fn explain_turn(store: &PostgresStore, lease: &LeaseRef) -> Error {
    match lease::explain(&Sql(store), lease).await {
        Err(error) => error,
        Ok(_) => Error::conflict(format!(
            "turn {} changed while it was ending",
            lease.turn_id
        )),
    }
}

/// Binds `holder`'s credential to the next placeholder.
fn bind_credential<'q>(
    query: Query<'q, Postgres, PgArguments>,
    holder: &'q Holder,
) -> Query<'q, Postgres, PgArguments> {
    match holder {
        Holder::Row { token_digest } => query.bind(token_digest.as_str()),
        Holder::Layer { fence } => query.bind(fence.0),
    }
}
