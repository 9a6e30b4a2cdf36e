//! A tool execution's ending, written once: a result computed outside the
//! store, a failure, or a side effect run in the same transaction as the
//! success mark.
//!
//! The store supplies one run of each ([`ToolEndingSql`]); this module runs
//! them again after a transient conflict, except an effect that already
//! ran: its transaction failed after the effect was applied, so running the
//! step again could apply it twice (the caller learns the error instead).

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::error::Result;
use agentgate_core::ids::ExecutionId;
use agentgate_core::model::{ExecutionEnding, LeaseRef};
use agentgate_core::store::{Completion, SqlEffect};
use serde_json::Value;

use crate::Retry;

/// The SQL a store supplies for an execution's ending.
#[async_trait::async_trait]
pub trait ToolEndingSql: Sync {
    /// Ends the caller's running execution with `ending`, once, under its
    /// live lease; an error explains a miss (`lease_lost`, `not_found`).
    async fn end_tool_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        ending: ExecutionEnding<'_>,
    ) -> Result<()>;

    /// Runs `effect` and marks the execution succeeded with its value, in
    /// one transaction, once. Sets `applied` before the effect runs.
    async fn complete_with_effect_once(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        effect: &mut dyn SqlEffect,
        applied: &mut bool,
    ) -> Result<CanonicalJson>;
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
            match sql.end_tool_once(lease, execution_id, ending).await {
                Err(error) => retry.after(error).await?,
                Ok(()) => return result.to_value("tool result"),
            }
        },
        Completion::Effect(effect) => loop {
            let mut applied = false;
            match sql
                .complete_with_effect_once(lease, execution_id, &mut *effect, &mut applied)
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
        match sql.end_tool_once(lease, execution_id, ending).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}
