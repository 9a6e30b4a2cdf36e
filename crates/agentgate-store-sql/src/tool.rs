//! A tool execution's ending, written once: a result computed outside the
//! store, a failure, or a side effect run in the same transaction as the
//! success mark.
//!
//! The store supplies the statements ([`ToolEndingSql`]): the one-statement
//! ending of the common case, and the reads and writes of the step's
//! transaction, which ends the execution when the fast path could not, runs
//! a same-transaction effect, or explains a refusal through
//! `decide::check_execution`. This module runs a step again after a
//! transient conflict, except an effect that already ran: its transaction
//! failed after the effect was applied, so running the step again could
//! apply it twice (the caller learns the error instead).

use std::any::Any;

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::decide::{check_execution, CheckedLease};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::ExecutionId;
use agentgate_core::model::LeaseRef;
use agentgate_core::store::{Completion, SqlEffect};
use serde_json::Value;

use crate::lease::Holder;
use crate::query::{On, Statement};
use crate::rows::Columns;
use crate::{Retry, StepTx};

/// How a tool execution ends: the state it ends in, and the value its
/// column keeps, as every SQL store stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutionEnding<'a> {
    /// Succeeded with this result (the `result` column).
    Succeeded(&'a CanonicalJson),
    /// Failed with this error (the `error` column).
    Failed(&'a CanonicalJson),
}

impl<'a> ExecutionEnding<'a> {
    /// The state it ends in, the column its value goes to, and the value.
    pub fn columns(self) -> (&'static str, &'static str, &'a CanonicalJson) {
        match self {
            Self::Succeeded(result) => ("succeeded", "result", result),
            Self::Failed(error) => ("failed", "error", error),
        }
    }
}

/// The SQL a store supplies for an execution's ending.
pub trait ToolEndingSql: StepTx {
    /// Ends the execution `$2` of the turn `$3` as `state`, writing `$1`
    /// into `column`, in one autocommit statement whose condition is the
    /// whole check: the execution is running under the fence of the live
    /// lease `holder` holds (its credential bound as `$4`).
    fn end_execution_sql(holder: &Holder, state: &str, column: &str) -> String;
}

/// The common case of an ending: one statement; `false` when it changed no
/// row (the step's transaction then ends the execution or explains why
/// not).
async fn end_fast<S: ToolEndingSql>(
    sql: &S,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    ending: ExecutionEnding<'_>,
) -> Result<bool> {
    let Some(holder) = Holder::of(sql.leases(), lease).await? else {
        return Ok(false);
    };
    let (state, column, value) = ending.columns();
    let statement = Statement::new(S::end_execution_sql(&holder, state, column))
        .text(value.as_str())
        .text(execution_id.as_str())
        .text(lease.turn_id.as_str())
        .arg(holder.credential());
    match sql.execute(On::Write, statement).await? {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(Error::corrupt(format!(
            "ending one execution changed {n} rows"
        ))),
    }
}

/// The execution's `(state, fence)` if it is one of the caller's turn.
async fn execution_row<S: ToolEndingSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
) -> Result<Option<(String, i64)>> {
    let statement = Statement::new(
        "SELECT state, fence FROM ag_tool_executions WHERE execution_id = $1 AND turn_id = $2",
    )
    .text(execution_id.as_str())
    .text(lease.turn_id.as_str());
    let row = sql.fetch_optional(On::Conn(S::conn(tx)), statement).await?;
    row.map(|row| {
        let row = S::columns(&row);
        Ok((row.text_required("state")?, row.int_required("fence")?))
    })
    .transpose()
}

/// Ends the execution, running under `live`'s fence, with `ending` inside
/// `tx`; the rows written.
async fn end_in<S: ToolEndingSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &CheckedLease,
    ending: ExecutionEnding<'_>,
) -> Result<u64> {
    let (state, column, value) = ending.columns();
    let statement = Statement::new(format!(
        "UPDATE ag_tool_executions SET state = '{state}', {column} = $1, updated_at_ms = $2 \
         WHERE execution_id = $3 AND turn_id = $4 AND state = 'running' AND fence = $5"
    ))
    .text(value.as_str())
    .int(live.now_ms)
    .text(execution_id.as_str())
    .text(lease.turn_id.as_str())
    .int(live.fence.0);
    sql.execute(On::Conn(S::conn(tx)), statement).await
}

/// Checks that the execution is the caller's to end (running under `live`'s
/// fence); explains why not.
async fn check<S: ToolEndingSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &CheckedLease,
) -> Result<()> {
    let row = execution_row(sql, tx, lease, execution_id).await?;
    check_execution(
        execution_id.as_str(),
        row.as_ref().map(|(state, fence)| (state.as_str(), *fence)),
        live.fence.0,
    )
}

/// Ends the execution inside `tx` after [`check`] passed; a row that
/// changed meanwhile (this holder's own one-statement ending, which takes
/// no session lock on every store) is explained, or is a conflict that runs
/// the step again.
async fn end_checked<S: ToolEndingSql>(
    sql: &S,
    tx: &mut S::Tx,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    live: &CheckedLease,
    ending: ExecutionEnding<'_>,
) -> Result<()> {
    if end_in(sql, tx, lease, execution_id, live, ending).await? == 1 {
        return Ok(());
    }
    check(sql, tx, lease, execution_id, live).await?;
    Err(Error::conflict(format!(
        "tool execution {execution_id} changed while it was being ended"
    )))
}

/// One run of an ending with a value computed outside the store: the
/// one-statement fast path, else the step's transaction, which ends the
/// execution or explains the refusal (`lease_lost`, `not_found`).
async fn end_tool_once<S: ToolEndingSql>(
    sql: &S,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    ending: ExecutionEnding<'_>,
) -> Result<()> {
    if end_fast(sql, lease, execution_id, ending).await? {
        return Ok(());
    }
    let (mut tx, live) = sql.open(lease).await?;
    check(sql, &mut tx, lease, execution_id, &live).await?;
    end_checked(sql, &mut tx, lease, execution_id, &live, ending).await?;
    sql.commit(tx).await
}

/// One run of a completion whose effect runs in the step's transaction, so
/// the effect commits exactly when the success mark does. Sets `applied`
/// before the effect runs.
async fn complete_with_effect_once<S: ToolEndingSql>(
    sql: &S,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    effect: &mut dyn SqlEffect,
    applied: &mut bool,
) -> Result<CanonicalJson> {
    let (mut tx, live) = sql.open(lease).await?;
    check(sql, &mut tx, lease, execution_id, &live).await?;
    *applied = true;
    let value = effect
        .apply(S::conn(&mut tx) as &mut (dyn Any + Send))
        .await
        .map_err(Error::Effect)?;
    let result = CanonicalJson::new("result", &value)?;
    let ending = ExecutionEnding::Succeeded(&result);
    // A miss drops `tx`, which rolls the effect back with the mark.
    end_checked(sql, &mut tx, lease, execution_id, &live, ending).await?;
    sql.commit(tx).await?;
    Ok(result)
}

/// Completes an execution; its stored result back.
///
/// # Errors
/// As the store's steps; an effect's own error as `Effect`.
pub async fn complete_tool<S: ToolEndingSql>(
    sql: &S,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    completion: Completion<'_>,
) -> Result<Value> {
    let mut retry = Retry::new();
    match completion {
        Completion::Result(result) => loop {
            let ending = ExecutionEnding::Succeeded(&result);
            match end_tool_once(sql, lease, execution_id, ending).await {
                Err(error) => retry.after(error).await?,
                Ok(()) => return result.to_value("tool result"),
            }
        },
        Completion::Effect(effect) => loop {
            let mut applied = false;
            match complete_with_effect_once(sql, lease, execution_id, &mut *effect, &mut applied)
                .await
            {
                Err(error) if applied => return Err(error),
                Err(error) => retry.after(error).await?,
                Ok(result) => return result.to_value("tool result"),
            }
        },
    }
}

/// Fails an execution with `error`.
///
/// # Errors
/// As the store's step.
pub async fn fail_tool<S: ToolEndingSql>(
    sql: &S,
    lease: &LeaseRef,
    execution_id: &ExecutionId,
    error: &CanonicalJson,
) -> Result<()> {
    let mut retry = Retry::new();
    loop {
        let ending = ExecutionEnding::Failed(error);
        match end_tool_once(sql, lease, execution_id, ending).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}
