//! [`RunToEnd`]: every protocol step, once started, runs to its end
//! whoever stops waiting for it (docs/protocol.md §4.7).
//!
//! A caller can stop waiting at any await point: hyper drops an HTTP
//! handler's future when its client hangs up, and a library caller may wrap
//! a call in `select!` or `timeout`. Dropping a store step halfway used to
//! drop its transaction halfway too. [`RunToEnd`] runs each step as a task
//! of its own and hands the caller only the task's answer, so dropping the
//! caller drops the wait, never the step: the step commits (its answer is
//! then what a repeat of the same request finds) or fails on its own.
//!
//! Every step also has a deadline, [`STORE_STEP_DEADLINE`]: a store that
//! stops answering without closing (a proxy that blackholes) fails each
//! step with `store_unavailable` within that bound instead of hanging a
//! worker. A step cut off by its deadline happened once or not at all (its
//! transaction is rolled back, or its connection closed: see
//! `agentgate_store_sql::tx`), and its repeat tells which.
//!
//! One step is not moved to a task: a tool completion whose effect runs in
//! the store's transaction ([`Completion::Effect`]) borrows the caller's
//! effect, so it runs in the caller's task. Dropped halfway, its
//! transaction (effect and success mark together) rolls back whole, so it
//! happened not at all and the execution stays claimed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, SessionId, TurnId, UserId};
use agentgate_core::limits::STORE_STEP_DEADLINE;
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Ending, EventPage, IgnoredCancel, LeaseRef, NewEvent, OnBusy,
    Orphan, OrphanFilter, Overview, SessionView, SweepReport, ToolCall, ToolClaim, TurnView,
    UserView,
};
use agentgate_core::page::{ExecutionPage, ExecutionPageRequest};
use agentgate_core::plant::{planted, Plant};
use agentgate_core::store::{Completion, LeaseStatus, ReleaseWatch, Store};
use async_trait::async_trait;
use serde_json::Value;

/// A store whose every step runs to its end in a task of its own, within
/// [`STORE_STEP_DEADLINE`] (see the [module documentation](self)).
/// [`crate::Gate`] wraps every store it is given in one.
#[derive(Debug)]
pub struct RunToEnd {
    inner: Arc<dyn Store>,
    in_flight: Arc<AtomicUsize>,
}

impl RunToEnd {
    /// Wraps `inner`; a store already wrapped is not wrapped twice by
    /// [`crate::Gate`].
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            in_flight: Arc::default(),
        }
    }

    /// Steps running now, their callers waiting or not.
    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Runs `step` on the inner store in a task of its own and waits for
    /// its answer; dropping this future leaves the task running.
    async fn run<T, F>(&self, step: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'s> FnOnce(&'s dyn Store) -> agentgate_core::store::BoxFuture<'s, Result<T>>
            + Send
            + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let running = InFlight::enter(&self.in_flight);
        if planted(Plant::StepRunsInCallersFuture) {
            let answer = within_deadline(step(inner.as_ref())).await;
            drop(running);
            return answer;
        }
        let task = tokio::spawn(async move {
            let answer = within_deadline(step(inner.as_ref())).await;
            drop(running);
            answer
        });
        match task.await {
            Ok(answer) => answer,
            Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
            Err(_) => Err(Error::store("the runtime shut down while a store step ran")),
        }
    }
}

/// One running step, counted until it is dropped (a panic included).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `step`, or `store_unavailable` once it has run for
/// [`STORE_STEP_DEADLINE`].
pub(crate) async fn within_deadline<T>(
    step: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(STORE_STEP_DEADLINE, step).await {
        Ok(answer) => answer,
        Err(_) => Err(Error::store(format!(
            "the store did not answer a step within {STORE_STEP_DEADLINE:?}"
        ))),
    }
}

#[async_trait]
impl Store for RunToEnd {
    fn config(&self) -> &Config {
        self.inner.config()
    }

    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome> {
        let command = command.clone();
        self.run(move |s| Box::pin(async move { s.begin(&command).await }))
            .await
    }

    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus> {
        let lease = lease.clone();
        self.run(move |s| Box::pin(async move { s.heartbeat(&lease).await }))
            .await
    }

    async fn claim_tool(&self, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim> {
        let (lease, call) = (lease.clone(), call.clone());
        self.run(move |s| Box::pin(async move { s.claim_tool(&lease, &call).await }))
            .await
    }

    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value> {
        match completion {
            Completion::Result(result) => {
                let (lease, execution_id) = (lease.clone(), execution_id.clone());
                self.run(move |s| {
                    Box::pin(async move {
                        s.complete_tool(&lease, &execution_id, Completion::Result(result))
                            .await
                    })
                })
                .await
            }
            effect @ Completion::Effect(_) => {
                within_deadline(self.inner.complete_tool(lease, execution_id, effect)).await
            }
        }
    }

    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()> {
        let (lease, execution_id, error) = (lease.clone(), execution_id.clone(), error.clone());
        self.run(move |s| Box::pin(async move { s.fail_tool(&lease, &execution_id, &error).await }))
            .await
    }

    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
        let (lease, ending) = (lease.clone(), ending.clone());
        self.run(move |s| Box::pin(async move { s.end_turn(&lease, &ending).await }))
            .await
    }

    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let turn_id = turn_id.clone();
        self.run(move |s| Box::pin(async move { s.turn(&turn_id).await }))
            .await
    }

    async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let turn_id = turn_id.clone();
        self.run(move |s| Box::pin(async move { s.request_cancel(&turn_id).await }))
            .await
    }

    async fn force_release(
        &self,
        session_id: &SessionId,
        only: Option<&TurnId>,
    ) -> Result<Option<TurnView>> {
        let (session_id, only) = (session_id.clone(), only.cloned());
        self.run(move |s| {
            Box::pin(async move { s.force_release(&session_id, only.as_ref()).await })
        })
        .await
    }

    async fn ignored_cancels(&self, limit: u32) -> Result<Vec<IgnoredCancel>> {
        self.run(move |s| Box::pin(async move { s.ignored_cancels(limit).await }))
            .await
    }

    fn watch_releases(&self, session_id: &SessionId) -> Box<dyn ReleaseWatch> {
        self.inner.watch_releases(session_id)
    }

    async fn executions(
        &self,
        turn_id: &TurnId,
        page: &ExecutionPageRequest,
    ) -> Result<ExecutionPage> {
        let (turn_id, page) = (turn_id.clone(), page.clone());
        self.run(move |s| Box::pin(async move { s.executions(&turn_id, &page).await }))
            .await
    }

    async fn session(&self, session_id: &SessionId) -> Result<Option<SessionView>> {
        let session_id = session_id.clone();
        self.run(move |s| Box::pin(async move { s.session(&session_id).await }))
            .await
    }

    async fn user(&self, user_id: &UserId) -> Result<UserView> {
        let user_id = user_id.clone();
        self.run(move |s| Box::pin(async move { s.user(&user_id).await }))
            .await
    }

    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()> {
        let user_id = user_id.clone();
        self.run(move |s| Box::pin(async move { s.set_user_cap(&user_id, cap).await }))
            .await
    }

    async fn append_events(&self, lease: &LeaseRef, events: &[NewEvent]) -> Result<u64> {
        let (lease, events) = (lease.clone(), events.to_vec());
        self.run(move |s| Box::pin(async move { s.append_events(&lease, &events).await }))
            .await
    }

    async fn events(&self, turn_id: &TurnId, after: u64, limit: u32) -> Result<Option<EventPage>> {
        let turn_id = turn_id.clone();
        self.run(move |s| Box::pin(async move { s.events(&turn_id, after, limit).await }))
            .await
    }

    fn watch_events(&self, turn_id: &TurnId) -> Box<dyn ReleaseWatch> {
        self.inner.watch_events(turn_id)
    }

    async fn set_session_policy(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        on_busy: OnBusy,
    ) -> Result<SessionView> {
        let (user_id, session_id) = (user_id.clone(), session_id.clone());
        self.run(move |s| {
            Box::pin(async move { s.set_session_policy(&user_id, &session_id, on_busy).await })
        })
        .await
    }

    async fn overview(&self, limit: u32) -> Result<Overview> {
        self.run(move |s| Box::pin(async move { s.overview(limit).await }))
            .await
    }

    async fn sweep(&self) -> Result<SweepReport> {
        self.run(move |s| Box::pin(async move { s.sweep().await }))
            .await
    }

    async fn orphans(&self, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
        let filter = filter.clone();
        self.run(move |s| Box::pin(async move { s.orphans(&filter, limit).await }))
            .await
    }

    async fn queue_heads(
        &self,
        session: Option<&SessionId>,
        filter: &OrphanFilter,
        limit: u32,
    ) -> Result<Vec<Orphan>> {
        let (session, filter) = (session.cloned(), filter.clone());
        self.run(move |s| {
            Box::pin(async move { s.queue_heads(session.as_ref(), &filter, limit).await })
        })
        .await
    }

    async fn abandon(&self, orphan: &Orphan) -> Result<bool> {
        let orphan = orphan.clone();
        self.run(move |s| Box::pin(async move { s.abandon(&orphan).await }))
            .await
    }
}
