//! A tool claim, written once: the one-statement first claim, and the full
//! path that reads the call's execution under the session's lock, asks
//! `decide_tool_claim`, and writes what it says.
//!
//! The store supplies the text of its first-claim statement
//! ([`ClaimSql`]: its `WHERE` states the live lease and
//! [`check_execution_room`]'s bound, so it inserts exactly when the full
//! path would say `Insert`) and how it opens a step's write transaction;
//! the lookup, insert and reclaim statements are written here. A first
//! claim that meets a transient conflict (a unique key two claims both
//! inserted, a deadlock) wrote nothing and leaves the call to the full
//! path; a conflict on the full path runs the claim again within
//! [`Retry`]'s budget.

use agentgate_core::decide::{
    check_execution_room, decide_tool_claim, CheckedLease, ExecutionSnapshot, ToolDecision,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::ExecutionId;
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::model::{idempotency_key, LeaseRef, PreviousOutcome, ToolCall, ToolClaim};
use serde_json::Value;

use crate::lease::Holder;
use crate::query::{On, Statement};
use crate::rows::{execution_snapshot, json, Columns, EXECUTION_COLUMNS};
use crate::{Retry, StepTx};

/// What a claim's full path reads in one statement: the call's execution,
/// if any, with its stored result, how many executions the turn has, and
/// whether a cancel was requested for it.
#[derive(Debug)]
pub struct Lookup {
    /// The call's execution.
    pub execution: Option<ExecutionSnapshot>,
    /// Its stored result, as the canonical text it was written as.
    pub result: Option<String>,
    /// The turn's executions, the call's own included.
    pub executions: i64,
    /// Whether a cancel was requested for the turn.
    pub cancel_requested: bool,
}

impl Lookup {
    /// Decodes a row of `executions` and the execution's
    /// [`EXECUTION_COLUMNS`](crate::rows::EXECUTION_COLUMNS) (all `NULL`
    /// when the call has none).
    ///
    /// # Errors
    /// As [`Columns`].
    pub fn read(row: &impl Columns) -> Result<Self> {
        Ok(Self {
            execution: execution_snapshot(row)?,
            result: row.text("result")?,
            executions: row.int_required("executions")?,
            cancel_requested: row.int("cancel_requested_at_ms")?.is_some(),
        })
    }
}

/// The SQL a store supplies for a tool claim.
pub trait ClaimSql: StepTx {
    /// The first claim of a call as one autocommit statement: inserts the
    /// execution `$1` of the turn `$2` (tool `$3`, arguments' hash `$4`,
    /// idempotency key `$5`) running under the live lease's fence, attempt
    /// 1, claim number one past the turn's count, when `holder` (its
    /// credential bound as `$6`) holds the live lease, no cancel was
    /// requested for the turn, the call has no execution and the turn has
    /// fewer than `$7` executions; otherwise it inserts nothing.
    fn first_claim_sql(holder: &Holder) -> String;
}

/// Claims a tool call: the first claim in one statement, else the full
/// path; run again after a transient conflict.
///
/// # Errors
/// The decision's refusal (`lease_lost`, `tool_in_flight`,
/// `attempts_exhausted`, `invalid` at the turn's bound) or the store's error.
pub async fn claim_tool<S: ClaimSql>(
    sql: &S,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<ToolClaim> {
    let mut retry = Retry::new();
    loop {
        let claim = match first_claim(sql, lease, call).await {
            Ok(Some(claim)) => Ok(claim),
            Ok(None) => claim_once(sql, lease, call).await,
            Err(error) => Err(error),
        };
        match claim {
            Err(error) => retry.after(error).await?,
            claim => return claim,
        }
    }
}

async fn first_claim<S: ClaimSql>(
    sql: &S,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<Option<ToolClaim>> {
    let Some(holder) = Holder::of(sql.leases(), lease).await? else {
        return Ok(None);
    };
    let execution_id = ExecutionId::generate();
    let key = idempotency_key(&lease.turn_id, call);
    let statement = Statement::new(S::first_claim_sql(&holder))
        .text(execution_id.as_str())
        .text(lease.turn_id.as_str())
        .text(call.tool.as_str())
        .text(call.args_hash.as_hex())
        .text(&key)
        .arg(holder.credential())
        .int(i64::from(MAX_EXECUTIONS_PER_TURN));
    match sql.execute(On::Write, statement).await {
        // A store whose insert fails on an existing key (MySQL) rather than
        // inserting nothing: the call was claimed before, or another claim
        // of the turn took the same number. Either way the full path
        // decides; so it does after any other conflict of this statement.
        Err(error) if error.is_conflict() => Ok(None),
        Err(error) => Err(error),
        Ok(0) => Ok(None),
        Ok(1) => Ok(Some(execute(execution_id, key, 1, None))),
        Ok(n) => Err(Error::corrupt(format!(
            "a first claim inserted {n} executions"
        ))),
    }
}

/// The full path: lock, read, decide, apply, commit. A refusal or a cached
/// answer writes nothing: the transaction is given up, rolled back.
async fn claim_once<S: ClaimSql>(sql: &S, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim> {
    let (mut tx, live) = sql.open(lease).await?;
    let lookup = lookup(sql, &mut tx, lease, call).await?;
    let key = idempotency_key(&lease.turn_id, call);
    let decision = decide_tool_claim(
        lookup.execution.as_ref(),
        lookup.cancel_requested.then_some(lease.turn_id.as_str()),
        live.fence,
        live.lease_expires_at_ms,
        live.now_ms,
    );
    let claim = match decision {
        ToolDecision::Reject(error) => {
            S::abandon(tx);
            return Err(error);
        }
        ToolDecision::Cached => {
            S::abandon(tx);
            let execution = lookup
                .execution
                .ok_or_else(|| Error::corrupt("a cached claim without its execution"))?;
            return Ok(ToolClaim::Cached {
                execution_id: ExecutionId::new(execution.execution_id)?,
                result: json(lookup.result)?.unwrap_or(Value::Null),
            });
        }
        ToolDecision::Insert => {
            check_execution_room(lease.turn_id.as_str(), lookup.executions)?;
            let execution_id = ExecutionId::generate();
            // Numbered after the executions counted: the number orders the
            // turn's journal, and a one-statement claim of the same turn that
            // counted the same number collides on it (every store keeps it
            // unique per turn) instead of both passing the bound.
            let seq = lookup.executions + 1;
            let written =
                insert(sql, &mut tx, lease, call, (&execution_id, &key), &live, seq).await?;
            Error::expect_rows(written, 1, "the new execution")?;
            execute(execution_id, key, 1, None)
        }
        ToolDecision::Reclaim { attempt, previous } => {
            let read = lookup
                .execution
                .ok_or_else(|| Error::corrupt("a reclaim decided without an execution"))?;
            // An old holder's one-statement ending that was in flight at the
            // takeover may have committed after the lookup; it must not be
            // overwritten (a succeeded execution would run again), so the
            // write is conditioned on the row as read and a miss runs the
            // step again.
            if reclaim(sql, &mut tx, &read, &live, attempt).await? != 1 {
                return Err(Error::conflict(format!(
                    "tool execution {} changed while it was being claimed",
                    read.execution_id
                )));
            }
            execute(
                ExecutionId::new(read.execution_id)?,
                key,
                attempt,
                Some(previous),
            )
        }
    };
    sql.commit(tx).await?;
    Ok(claim)
}

/// Reads the call's execution and the turn's count, inside the claim's
/// transaction.
async fn lookup<S: ClaimSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    call: &ToolCall,
) -> Result<Lookup> {
    let statement = Statement::new(format!(
        "SELECT (SELECT COUNT(*) FROM ag_tool_executions WHERE turn_id = $1) AS executions, \
         (SELECT cancel_requested_at_ms FROM ag_turns WHERE turn_id = $1) AS cancel_requested_at_ms, \
         {EXECUTION_COLUMNS} FROM (SELECT 1) AS one \
         LEFT JOIN ag_tool_executions e ON e.turn_id = $1 AND e.tool = $2 AND e.args_hash = $3"
    ))
    .text(lease.turn_id.as_str())
    .text(call.tool.as_str())
    .text(call.args_hash.as_hex());
    let row = sql.fetch_one(On::Conn(S::conn(tx)), statement).await?;
    let lookup = Lookup::read(&S::columns(&row));
    lookup
}

/// Inserts `execution_id` running under `live`'s fence, attempt 1, numbered
/// `seq` among the turn's executions; the rows written.
async fn insert<S: ClaimSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    call: &ToolCall,
    (execution_id, key): (&ExecutionId, &str),
    live: &CheckedLease,
    seq: i64,
) -> Result<u64> {
    let statement = Statement::new(
        "INSERT INTO ag_tool_executions (execution_id, turn_id, tool, args_hash, idempotency_key, \
         state, attempt, fence, claim_seq, created_at_ms, updated_at_ms) \
         VALUES ($1, $2, $3, $4, $5, 'running', 1, $6, $7, $8, $8)",
    )
    .text(execution_id.as_str())
    .text(lease.turn_id.as_str())
    .text(call.tool.as_str())
    .text(call.args_hash.as_hex())
    .text(key)
    .int(live.fence.0)
    .int(seq)
    .int(live.now_ms);
    sql.execute(On::Conn(S::conn(tx)), statement).await
}

/// Claims `read` again under `live`'s fence as attempt `attempt`, on the
/// condition that its row is still as read (state, fence, attempt); the rows
/// written.
async fn reclaim<S: ClaimSql>(
    sql: &S,
    tx: &mut S::Tx,
    read: &ExecutionSnapshot,
    live: &CheckedLease,
    attempt: u32,
) -> Result<u64> {
    let statement = Statement::new(
        "UPDATE ag_tool_executions SET state = 'running', attempt = $1, fence = $2, \
         error = NULL, updated_at_ms = $3 \
         WHERE execution_id = $4 AND state = $5 AND fence = $6 AND attempt = $7",
    )
    .int(i64::from(attempt))
    .int(live.fence.0)
    .int(live.now_ms)
    .text(&read.execution_id)
    .text(read.state.as_str())
    .int(read.fence.0)
    .int(i64::from(read.attempt));
    sql.execute(On::Conn(S::conn(tx)), statement).await
}

fn execute(
    execution_id: ExecutionId,
    key: String,
    attempt: u32,
    previous: Option<PreviousOutcome>,
) -> ToolClaim {
    ToolClaim::Execute {
        execution_id,
        idempotency_key: key,
        attempt,
        previous_outcome: previous,
    }
}
