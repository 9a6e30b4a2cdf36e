//! A store wrapper whose writes can be switched to fail, to prove the
//! watchdog cancels a turn whose lease cannot be renewed, and whose turn
//! endings can be made to fail a number of times, to prove an ending survives
//! a store blip. It wraps a real store; only the failure is injected.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use agentgate::store::{Completion, LeaseStatus, ReleaseWatch, Store};
use agentgate::{
    Config, Error, ExecutionId, Result, SessionId, SessionView, TurnId, TurnView, UserId, UserView,
};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Ending, IgnoredCancel, LeaseRef, Orphan, OrphanFilter, SweepReport,
    ToolCall, ToolClaim,
};
use agentgate_core::page::{ExecutionPage, ExecutionPageRequest};
use async_trait::async_trait;
use serde_json::Value;

/// A real store, with heartbeats that fail while [`Faulty::fail_writes`] is set.
#[derive(Debug)]
pub struct Faulty {
    inner: Arc<dyn Store>,
    failing: AtomicBool,
    /// Turn endings still to refuse; `u32::MAX` refuses them all.
    endings_to_fail: AtomicU32,
    /// Turn endings refused so far: what a check measured, not what it asked.
    endings_refused: AtomicU32,
}

impl Faulty {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            failing: AtomicBool::new(false),
            endings_to_fail: AtomicU32::new(0),
            endings_refused: AtomicU32::new(0),
        }
    }

    /// Makes the next `count` turn endings fail with `store_unavailable`
    /// before reaching the store (`u32::MAX`: every one until called again).
    pub fn fail_endings(&self, count: u32) {
        self.endings_to_fail.store(count, Ordering::SeqCst);
    }

    /// How many turn endings were refused by [`Faulty::fail_endings`].
    pub fn endings_refused(&self) -> u32 {
        self.endings_refused.load(Ordering::SeqCst)
    }

    fn check_ending(&self) -> Result<()> {
        let refuse = self
            .endings_to_fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| match left {
                0 => None,
                u32::MAX => Some(u32::MAX),
                n => Some(n - 1),
            })
            .is_ok();
        if refuse {
            self.endings_refused.fetch_add(1, Ordering::SeqCst);
            return Err(Error::store("injected ending fault"));
        }
        Ok(())
    }

    /// Makes every later write fail with `store_unavailable`.
    pub fn fail_writes(&self) {
        self.failing.store(true, Ordering::SeqCst);
    }

    fn check(&self) -> Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(Error::store("injected fault"));
        }
        Ok(())
    }
}

#[async_trait]
impl Store for Faulty {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome> {
        self.check()?;
        self.inner.begin(command).await
    }
    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus> {
        self.check()?;
        self.inner.heartbeat(lease).await
    }
    async fn claim_tool(&self, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim> {
        self.check()?;
        self.inner.claim_tool(lease, call).await
    }
    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value> {
        self.check()?;
        self.inner
            .complete_tool(lease, execution_id, completion)
            .await
    }
    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()> {
        self.check()?;
        self.inner.fail_tool(lease, execution_id, error).await
    }
    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
        self.check()?;
        self.check_ending()?;
        self.inner.end_turn(lease, ending).await
    }
    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        self.inner.turn(turn_id).await
    }
    async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        self.inner.request_cancel(turn_id).await
    }
    async fn force_release(
        &self,
        session_id: &SessionId,
        only: Option<&TurnId>,
    ) -> Result<Option<TurnView>> {
        self.check()?;
        self.inner.force_release(session_id, only).await
    }
    async fn ignored_cancels(&self, limit: u32) -> Result<Vec<IgnoredCancel>> {
        self.check()?;
        self.inner.ignored_cancels(limit).await
    }
    fn watch_releases(&self, session_id: &SessionId) -> Box<dyn ReleaseWatch> {
        self.inner.watch_releases(session_id)
    }
    async fn executions(
        &self,
        turn_id: &TurnId,
        page: &ExecutionPageRequest,
    ) -> Result<ExecutionPage> {
        self.inner.executions(turn_id, page).await
    }
    async fn session(&self, session_id: &SessionId) -> Result<Option<SessionView>> {
        self.inner.session(session_id).await
    }
    async fn user(&self, user_id: &UserId) -> Result<UserView> {
        self.inner.user(user_id).await
    }
    async fn append_events(
        &self,
        lease: &LeaseRef,
        events: &[agentgate_core::model::NewEvent],
    ) -> Result<u64> {
        self.check()?;
        self.inner.append_events(lease, events).await
    }

    async fn events(
        &self,
        turn_id: &TurnId,
        after: u64,
        limit: u32,
    ) -> Result<Option<agentgate_core::model::EventPage>> {
        self.inner.events(turn_id, after, limit).await
    }

    fn watch_events(&self, turn_id: &TurnId) -> Box<dyn agentgate_core::store::ReleaseWatch> {
        self.inner.watch_events(turn_id)
    }

    async fn set_session_policy(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        on_busy: agentgate_core::model::OnBusy,
    ) -> Result<SessionView> {
        self.check()?;
        self.inner
            .set_session_policy(user_id, session_id, on_busy)
            .await
    }
    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()> {
        self.check()?;
        self.inner.set_user_cap(user_id, cap).await
    }
    async fn overview(&self, limit: u32) -> Result<agentgate_core::model::Overview> {
        self.inner.overview(limit).await
    }
    async fn sweep(&self) -> Result<SweepReport> {
        self.check()?;
        self.inner.sweep().await
    }

    async fn orphans(&self, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
        self.inner.orphans(filter, limit).await
    }

    async fn queue_heads(
        &self,
        session: Option<&SessionId>,
        filter: &OrphanFilter,
        limit: u32,
    ) -> Result<Vec<Orphan>> {
        self.inner.queue_heads(session, filter, limit).await
    }

    async fn abandon(&self, orphan: &Orphan) -> Result<bool> {
        self.check()?;
        self.inner.abandon(orphan).await
    }
}
