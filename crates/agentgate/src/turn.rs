//! The [`Turn`] guard: a granted lease with its watchdog, its tools and its
//! endings.
//!
//! A `Turn` ends exactly once, by [`Turn::succeed`], [`Turn::fail`] or
//! [`Turn::await_confirmation`], each consuming it; an ending the store could
//! not take even after retries hands the turn back in an [`EndError`], so a
//! computed answer is never thrown away by a store blip. A `Turn` dropped without an
//! ending (an error path, a panic, a cancelled task) is failed as retryable in
//! the background, so its lease and permit never leak; a crashed process is
//! covered by lease expiry.

use agentgate_core::limits::RELEASE_ATTEMPTS;
use std::future::Future;
use std::sync::Arc;

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::error::{BoxError, Error, ErrorKind, Result};
use agentgate_core::ids::{ExecutionId, Fence, SessionId, ToolName, TurnId, UserId};
use agentgate_core::limits::MAX_STORE_RETRIES;
use agentgate_core::model::{
    ConfirmationContext, Ending, Grant, LeaseRef, NewEvent, PreviousOutcome, ToolCall, ToolClaim,
    TurnState, TurnView,
};
use agentgate_core::plant::{planted, Plant};
use agentgate_core::retry;
use agentgate_core::store::{BoxFuture, Completion, LeaseStatus, Store};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio_util::sync::CancellationToken;

use crate::effect::{ClosureEffect, SqlTx};
use crate::watchdog::{CancelSignal, LocalTurns, Watchdog};

/// A running turn: proof of the session lease and the user's permit.
pub struct Turn {
    store: Arc<dyn Store>,
    grant: Grant,
    lease: LeaseRef,
    /// Fires when the lease is lost.
    lost: CancellationToken,
    /// Whether the holder learned of a cancel request, and the signal
    /// callers stop on ([`Turn::cancellation`]): a child of `lost`, so it
    /// fires on a lost lease too.
    cancel: CancelSignal,
    /// Where the gate finds this turn to signal a cancel at once.
    local: LocalTurns,
    watchdog: Option<Watchdog>,
    /// Set once an ending reached the store (or the lease was found gone).
    ended: bool,
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn")
            .field("turn_id", &self.grant.turn_id)
            .field("fence", &self.grant.fence)
            .field("attempt", &self.grant.attempt)
            .field("takeover", &self.grant.takeover)
            .finish_non_exhaustive()
    }
}

/// Asks a downstream system whether the effect keyed by an idempotency key
/// happened: `Some(result)` if it did.
pub type Verifier =
    Box<dyn Fn(&str) -> BoxFuture<'static, Result<Option<Value>, BoxError>> + Send + Sync>;

/// What to do with a tool execution whose previous attempt died mid-call, so
/// that it may or may not have taken effect.
pub enum ToolPolicy {
    /// The tool is idempotent (or forwards the idempotency key downstream):
    /// run it again.
    Retry,
    /// Ask `verify` whether the effect happened, given the idempotency key:
    /// `Some(result)` completes the execution with it; `None` runs the tool.
    Verify(Verifier),
    /// Do not run it; return `unknown_tool_outcome` so a person decides.
    Fail,
}

impl std::fmt::Debug for ToolPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Retry => "ToolPolicy::Retry",
            Self::Verify(_) => "ToolPolicy::Verify",
            Self::Fail => "ToolPolicy::Fail",
        })
    }
}

/// The answer to [`Turn::tool`].
#[derive(Debug)]
pub enum ToolStep<'t> {
    /// Run the tool, then complete or fail the execution.
    Execute(Execution<'t>),
    /// It already succeeded: its stored result. Do not run it.
    Cached(Value),
}

/// A tool execution claimed for running under this turn's lease.
#[must_use = "complete or fail the execution"]
pub struct Execution<'t> {
    turn: &'t Turn,
    execution_id: ExecutionId,
    idempotency_key: String,
    attempt: u32,
    previous_outcome: Option<PreviousOutcome>,
}

impl std::fmt::Debug for Execution<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("execution_id", &self.execution_id)
            .field("attempt", &self.attempt)
            .field("previous_outcome", &self.previous_outcome)
            .finish_non_exhaustive()
    }
}

impl Execution<'_> {
    /// The execution's id.
    pub fn id(&self) -> &ExecutionId {
        &self.execution_id
    }

    /// Stable across attempts: forward it to the downstream system so it can
    /// deduplicate.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// 1 for the first run, +1 per re-execution.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// `Some(Unknown)` when a previous attempt died mid-call and may have
    /// taken effect; `Some(Failed)` when it reported failure.
    pub fn previous_outcome(&self) -> Option<PreviousOutcome> {
        self.previous_outcome
    }

    /// Marks the execution succeeded with `result`, which later claims return.
    ///
    /// # Errors
    /// `lease_lost` when this turn's lease is gone; `invalid_request` for a
    /// result over the limits; `store_unavailable`.
    pub async fn complete(self, result: &Value) -> Result<Value> {
        let result = CanonicalJson::new("result", result)?;
        self.turn
            .store
            .complete_tool(
                &self.turn.lease,
                &self.execution_id,
                Completion::Result(result),
            )
            .await
    }

    /// Runs `effect` inside the SQL transaction that marks the execution
    /// succeeded; the value it returns becomes the stored result. Both commit
    /// or neither does.
    ///
    /// # Errors
    /// `effect_failed` when `effect` fails (nothing committed; the execution
    /// is marked failed so the next claim runs it again); otherwise as
    /// [`Execution::complete`].
    pub async fn complete_in_tx<F>(self, effect: F) -> Result<Value>
    where
        F: for<'c> FnOnce(SqlTx<'c>) -> BoxFuture<'c, Result<Value, BoxError>> + Send,
    {
        let mut effect = ClosureEffect(Some(effect));
        let result = self
            .turn
            .store
            .complete_tool(
                &self.turn.lease,
                &self.execution_id,
                Completion::Effect(&mut effect),
            )
            .await;
        if let Err(Error::Effect(cause)) = &result {
            // The effect rolled back with its transaction; record the failure
            // so the next claim runs the tool again instead of finding it in
            // flight until the lease expires.
            let error = CanonicalJson::new("error", &json!({"message": cause.to_string()}))?;
            self.turn
                .store
                .fail_tool(&self.turn.lease, &self.execution_id, &error)
                .await?;
        }
        result
    }

    /// Marks the execution failed; the next claim runs it again.
    ///
    /// # Errors
    /// As [`Execution::complete`].
    pub async fn fail(self, error: &Value) -> Result<()> {
        let error = CanonicalJson::new("error", error)?;
        self.turn
            .store
            .fail_tool(&self.turn.lease, &self.execution_id, &error)
            .await
    }
}

impl Turn {
    pub(crate) fn start(
        store: Arc<dyn Store>,
        grant: Grant,
        requested_at: tokio::time::Instant,
        local: LocalTurns,
    ) -> Self {
        let lease = LeaseRef {
            turn_id: grant.turn_id.clone(),
            token: grant.lease_token.clone(),
        };
        let lost = CancellationToken::new();
        let cancel = CancelSignal {
            requested: Arc::new(AtomicBool::new(false)),
            stop: lost.child_token(),
        };
        let watchdog = Watchdog::spawn(
            Arc::clone(&store),
            lease.clone(),
            store.config().lease_ttl,
            requested_at,
            std::time::Duration::from_millis(u64::try_from(grant.lease_expires_in_ms).unwrap_or(0)),
            lost.clone(),
            cancel.clone(),
        );
        local.add(&grant.turn_id, grant.fence.0, cancel.clone());
        Self {
            store,
            grant,
            lease,
            lost,
            cancel,
            local,
            watchdog: Some(watchdog),
            ended: false,
        }
    }

    /// The turn's id.
    pub fn id(&self) -> &TurnId {
        &self.grant.turn_id
    }

    /// The session this turn holds.
    pub fn session_id(&self) -> &SessionId {
        &self.grant.session_id
    }

    /// The user this turn runs for.
    pub fn user_id(&self) -> &UserId {
        &self.grant.user_id
    }

    /// This grant's fence.
    pub fn fence(&self) -> Fence {
        self.grant.fence
    }

    /// 1 for the first start, +1 per takeover or restart.
    pub fn attempt(&self) -> u32 {
        self.grant.attempt
    }

    /// Whether this start took over a turn whose holder's lease expired.
    pub fn is_takeover(&self) -> bool {
        self.grant.takeover
    }

    /// On a confirmation turn: the pending action and the person's decision.
    pub fn confirmation(&self) -> Option<&ConfirmationContext> {
        self.grant.confirmation.as_ref()
    }

    /// Fires when work on the turn must stop: the lease was lost or could
    /// not be renewed in time (any further change will be refused as
    /// `lease_lost`), or a cancel was requested ([`Turn::cancel_requested`]:
    /// end it with [`Turn::end_cancelled`], or drop it, which ends it so).
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.stop.clone()
    }

    /// Whether the cancellation signal has fired.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.stop.is_cancelled()
    }

    /// Whether the holder has learned (on a heartbeat, the watchdog's or
    /// its own, or on a tool claim) that a cancel was requested.
    pub fn cancel_requested(&self) -> bool {
        self.cancel.requested.load(Ordering::SeqCst)
    }

    /// Renews the lease now (the watchdog also does it every TTL/3).
    ///
    /// # Errors
    /// `lease_lost`, `store_unavailable`.
    pub async fn heartbeat(&self) -> Result<LeaseStatus> {
        let status = self.store.heartbeat(&self.lease).await?;
        if status.cancel_requested {
            self.cancel.fire();
        }
        Ok(status)
    }

    /// Appends one event to the turn's log (a streamed token, a status):
    /// fenced like every write, so after a takeover it is refused
    /// `lease_lost` and never seen. Returns its id. Readers follow the log
    /// with [`crate::Gate::follow`], on any node.
    ///
    /// # Errors
    /// `invalid_request` for a bad name or data, or a full log
    /// ([`agentgate_core::limits::MAX_TURN_EVENTS`],
    /// [`agentgate_core::limits::MAX_TURN_EVENT_BYTES`]); `lease_lost`;
    /// `store_unavailable`.
    pub async fn emit(&self, name: &str, data: &Value) -> Result<u64> {
        self.emit_all(&[(name, data)]).await
    }

    /// Appends events in one step (at most
    /// [`agentgate_core::limits::MAX_EVENT_BATCH`]), all or none; the last
    /// one's id.
    ///
    /// # Errors
    /// As [`Turn::emit`].
    pub async fn emit_all(&self, events: &[(&str, &Value)]) -> Result<u64> {
        let events = events
            .iter()
            .map(|(name, data)| NewEvent::new(name, data))
            .collect::<Result<Vec<_>>>()?;
        self.store.append_events(&self.lease, &events).await
    }

    /// Claims the tool execution keyed by `(this turn, tool, args)`.
    ///
    /// # Errors
    /// `invalid_request` for a bad name or args; `tool_in_flight` when the
    /// same call is running under this lease; `lease_lost`; `store_unavailable`.
    pub async fn tool(&self, tool: &str, args: &Value) -> Result<ToolStep<'_>> {
        let call = ToolCall::new(ToolName::new(tool)?, args)?;
        let claim = self.store.claim_tool(&self.lease, &call).await;
        if matches!(&claim, Err(e) if e.kind() == ErrorKind::TurnCancelled)
            && !planted(Plant::CancelledClaimNotSignalled)
        {
            self.cancel.fire();
        }
        Ok(match claim? {
            ToolClaim::Cached { result, .. } => ToolStep::Cached(result),
            ToolClaim::Execute {
                execution_id,
                idempotency_key,
                attempt,
                previous_outcome,
            } => ToolStep::Execute(Execution {
                turn: self,
                execution_id,
                idempotency_key,
                attempt,
                previous_outcome,
            }),
        })
    }

    /// Claims a tool call, applies `policy` to an unknown previous outcome,
    /// runs `run` with the idempotency key, and records its result (or its
    /// error, so the next claim runs it again).
    ///
    /// # Errors
    /// `unknown_tool_outcome` under [`ToolPolicy::Fail`]; `effect_failed`
    /// when `run` fails; otherwise as [`Turn::tool`].
    pub async fn run_tool<F, Fut>(
        &self,
        tool: &str,
        args: &Value,
        policy: &ToolPolicy,
        run: F,
    ) -> Result<Value>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Value, BoxError>>,
    {
        let execution = match self.tool(tool, args).await? {
            ToolStep::Cached(result) => return Ok(result),
            ToolStep::Execute(execution) => execution,
        };
        if execution.previous_outcome == Some(PreviousOutcome::Unknown) {
            match policy {
                ToolPolicy::Retry => {}
                ToolPolicy::Fail => {
                    return Err(Error::UnknownToolOutcome {
                        execution_id: execution.execution_id.to_string(),
                    })
                }
                ToolPolicy::Verify(verify) => {
                    if let Some(result) = verify(&execution.idempotency_key)
                        .await
                        .map_err(Error::Effect)?
                    {
                        return execution.complete(&result).await;
                    }
                }
            }
        }
        match run(execution.idempotency_key.clone()).await {
            Ok(result) => execution.complete(&result).await,
            Err(error) => {
                execution
                    .fail(&json!({"message": error.to_string()}))
                    .await?;
                Err(Error::Effect(error))
            }
        }
    }

    /// Ends the turn with `response`, which repeats of the request replay.
    /// Releases the session lease and the permit in the same step.
    ///
    /// A transient store failure is retried on the engine's retry schedule
    /// while the lease is live; if the ending still cannot be stored, the
    /// turn comes back inside the error, still holding its lease, so the
    /// answer is not lost: end it again or drop it.
    ///
    /// # Errors
    /// `lease_lost` when the lease is gone (the turn may have been taken
    /// over: this holder's answer is discarded); `invalid_request` for a
    /// response over the limits; `store_unavailable`. See [`EndError`].
    pub async fn succeed(self, response: &Value) -> Result<TurnView, EndError> {
        match CanonicalJson::new("response", response) {
            Ok(response) => self.end(Ending::Succeed { response }).await,
            Err(error) => Err(EndError::keeping(self, error)),
        }
    }

    /// Ends the turn with `error`. A repeat of a `retryable` failure restarts
    /// the turn; a repeat of a final one replays the failure.
    ///
    /// # Errors
    /// As [`Turn::succeed`].
    pub async fn fail(self, error: &Value, retryable: bool) -> Result<TurnView, EndError> {
        match CanonicalJson::new("error", error) {
            Ok(error) => self.end(Ending::Fail { error, retryable }).await,
            Err(error) => Err(EndError::keeping(self, error)),
        }
    }

    /// Ends the turn waiting for a person to approve or reject `pending`. New
    /// messages to the session get `awaiting_confirmation` until a
    /// confirmation turn answers it or it expires.
    ///
    /// # Errors
    /// As [`Turn::succeed`].
    pub async fn await_confirmation(self, pending: &Value) -> Result<TurnView, EndError> {
        match CanonicalJson::new("pending", pending) {
            Ok(pending) => self.end(Ending::AwaitConfirmation { pending }).await,
            Err(error) => Err(EndError::keeping(self, error)),
        }
    }

    /// Ends the turn `cancelled`, with what it produced so far (`partial`,
    /// replayed to a repeat of its request), after a cancel request, or of
    /// the holder's own accord. The tools that ran are in its journal.
    ///
    /// # Errors
    /// As [`Turn::succeed`].
    pub async fn end_cancelled(self, partial: &Value) -> Result<TurnView, EndError> {
        match CanonicalJson::new("partial", partial) {
            Ok(partial) => self.end(Ending::Cancel { partial }).await,
            Err(error) => Err(EndError::keeping(self, error)),
        }
    }

    async fn end(mut self, ending: Ending) -> Result<TurnView, EndError> {
        // The watchdog keeps renewing until the ending is stored: a retry
        // below needs a live lease, and a turn handed back must keep it.
        let mut retries: u32 = 0;
        loop {
            let error = match self.store.end_turn(&self.lease, &ending).await {
                Ok(view) => {
                    self.finish();
                    return Ok(view);
                }
                Err(error) => error,
            };
            if matches!(error.kind(), ErrorKind::LeaseLost | ErrorKind::NotFound) {
                self.finish();
                if retries > 0 {
                    if let Some(view) = self.landed_earlier(&ending).await {
                        return Ok(view);
                    }
                }
                return Err(EndError { error, turn: None });
            }
            retries += 1;
            let backoff = retry::backoff(retries);
            let live = self.watchdog.as_ref().is_some_and(|watchdog| {
                tokio::time::Instant::now() + backoff < watchdog.give_up_at()
            });
            if error.kind() != ErrorKind::StoreUnavailable
                || retries > MAX_STORE_RETRIES
                || !live
                || self.lost.is_cancelled()
            {
                return Err(EndError::keeping(self, error));
            }
            tracing::warn!(turn_id = %self.lease.turn_id, retries, %error, "storing a turn's ending failed; retrying");
            tokio::time::sleep(backoff).await;
        }
    }

    /// After a retried ending is refused as `lease_lost`: whether an earlier
    /// attempt committed although its reply was lost. Only this grant holds
    /// its fence, so a turn ended in the requested state under it was ended
    /// by this holder.
    async fn landed_earlier(&self, ending: &Ending) -> Option<TurnView> {
        let expected = match ending {
            Ending::Succeed { .. } => TurnState::Succeeded,
            Ending::Fail { .. } => TurnState::Failed,
            Ending::AwaitConfirmation { .. } => TurnState::AwaitingConfirmation,
            Ending::Cancel { .. } => TurnState::Cancelled,
        };
        let view = self.store.turn(&self.grant.turn_id).await.ok()??;
        (view.fence == self.grant.fence && view.state == expected).then_some(view)
    }

    /// The ending reached the store, or the lease was found gone: nothing is
    /// left for the drop handler to release.
    fn finish(&mut self) {
        self.ended = true;
        self.watchdog.take();
    }
}

/// An ending that was not stored.
///
/// When the turn still holds its lease, `turn` gives the guard back: its
/// answer can be stored by ending it again. Dropping it (or converting this
/// into an [`Error`] with `?`) releases the turn as a retryable failure, as
/// for any turn dropped without an ending.
#[derive(Debug)]
pub struct EndError {
    /// Why the ending was not stored.
    pub error: Error,
    /// The turn, still under its lease and renewing it: after a
    /// `store_unavailable` that outlasted the retries, or an ending refused
    /// as `invalid_request`. `None` when the lease is gone (`lease_lost`).
    pub turn: Option<Box<Turn>>,
}

impl EndError {
    fn keeping(turn: Turn, error: Error) -> Self {
        Self {
            error,
            turn: Some(Box::new(turn)),
        }
    }

    /// The kind of the underlying error.
    pub fn kind(&self) -> ErrorKind {
        self.error.kind()
    }
}

impl std::fmt::Display for EndError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for EndError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl From<EndError> for Error {
    fn from(end: EndError) -> Self {
        end.error
    }
}

/// Ends a turn dropped without an ending: `cancelled` (with no partial
/// response) when its holder had learned of a cancel request, so a retry
/// does not run what a person stopped; else a retryable failure.
async fn release_dropped(store: Arc<dyn Store>, lease: LeaseRef, cancel_requested: bool) {
    let ending = if cancel_requested {
        Ending::Cancel {
            partial: CanonicalJson::new("partial", &Value::Null)
                .expect("null is within the JSON limits"),
        }
    } else {
        Ending::Fail {
            error: CanonicalJson::new(
                "error",
                &json!({"code": "dropped", "message": "turn dropped without an ending"}),
            )
            .expect("a small constant is within the JSON limits"),
            retryable: true,
        }
    };
    for attempt in 1..=RELEASE_ATTEMPTS {
        match store.end_turn(&lease, &ending).await {
            Ok(_) => return,
            Err(error) if matches!(error.kind(), ErrorKind::LeaseLost | ErrorKind::NotFound) => {
                return
            }
            Err(error) => {
                tracing::warn!(turn_id = %lease.turn_id, attempt, %error, "releasing a dropped turn failed");
                tokio::time::sleep(store.config().lease_ttl / 10 * attempt).await;
            }
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.local.remove(&self.grant.turn_id, self.grant.fence.0);
        self.watchdog.take();
        if self.ended {
            return;
        }
        // Whatever still works for this turn must stop.
        self.lost.cancel();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                tracing::debug!(turn_id = %self.lease.turn_id, "turn dropped without an ending; releasing");
                runtime.spawn(release_dropped(
                    Arc::clone(&self.store),
                    self.lease.clone(),
                    self.cancel_requested(),
                ));
            }
            Err(_) => tracing::warn!(
                turn_id = %self.lease.turn_id,
                "turn dropped outside a runtime; its lease will expire after the TTL"
            ),
        }
    }
}
