//! [`Faulty`]: a store wrapper that injects seeded faults around every step
//! and records each call, fault and return in the history.
//!
//! Faults: `store_unavailable` before a step (nothing applied), a lost reply
//! (the step applied, the caller gets `store_unavailable`), latency before
//! and after a step, and partitions: calls carrying a crashed or paused
//! holder's lease never reach the store, which is how the store sees a
//! process that died or froze (its watchdog stops renewing with it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ExecutionId, SessionId, TurnId, UserId};
use agentgate_core::model::{
    idempotency_key, BeginCommand, BeginOutcome, Ending, IgnoredCancel, LeaseRef, Orphan,
    OrphanFilter, Overview, SessionView, SweepReport, ToolCall, ToolClaim, TurnView, UserView,
};
use agentgate_core::page::{ExecutionPage, ExecutionPageRequest};
use agentgate_core::store::{Completion, LeaseStatus, ReleaseWatch, Store};
use async_trait::async_trait;
use serde_json::Value;

use crate::history::{ClaimAnswer, Event, Fault, FinishAnswer, History, Observed};
use crate::rng::Rng;
use crate::store::Clock;

/// How often each fault strikes, per mille of calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// `store_unavailable` before the step.
    pub unavailable: u32,
    /// Step applied, reply lost.
    pub lost_reply: u32,
    /// A delay of up to `max_latency_ms` before and after the step.
    pub latency: u32,
    /// The longest injected delay.
    pub max_latency_ms: u64,
}

#[derive(Debug)]
struct Inner {
    rng: Rng,
    next_call: u64,
    /// Lease token digest -> fence, learned from grants passing through.
    fences: BTreeMap<String, i64>,
    /// Fence -> session.
    sessions: BTreeMap<i64, String>,
    /// Execution id -> idempotency key, learned from claims.
    keys: BTreeMap<String, String>,
    /// Fence -> store-clock instant until which its holder is partitioned
    /// (`i64::MAX`: crashed for good).
    partitioned: BTreeMap<i64, i64>,
    counts: BTreeMap<Fault, u64>,
}

/// The fault-injecting wrapper.
#[derive(Debug)]
pub struct Faulty {
    inner: Arc<dyn Store>,
    clock: Clock,
    history: History,
    rates: FaultRates,
    state: Mutex<Inner>,
}

impl Faulty {
    /// Wraps `inner`; `rng` decides every fault.
    pub fn new(
        inner: Arc<dyn Store>,
        clock: Clock,
        history: History,
        rates: FaultRates,
        rng: Rng,
    ) -> Self {
        Self {
            inner,
            clock,
            history,
            rates,
            state: Mutex::new(Inner {
                rng,
                next_call: 0,
                fences: BTreeMap::new(),
                sessions: BTreeMap::new(),
                keys: BTreeMap::new(),
                partitioned: BTreeMap::new(),
                counts: BTreeMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Cuts the holder of `fence` off the store for `for_ms` (`None`: for
    /// good, a crash).
    pub fn partition(&self, fence: i64, for_ms: Option<i64>) {
        let until = for_ms.map_or(i64::MAX, |ms| self.clock.now_ms() + ms);
        let what = if for_ms.is_some() { "pause" } else { "crash" };
        self.lock().partitioned.insert(fence, until);
        self.history
            .push(self.clock.now_ms(), Event::Client { what, fence });
    }

    /// How many faults of each kind were injected.
    pub fn counts(&self) -> BTreeMap<Fault, u64> {
        self.lock().counts.clone()
    }

    fn fault(&self, inner: &mut Inner, call: u64, fault: Fault) {
        *inner.counts.entry(fault).or_default() += 1;
        self.history
            .push(self.clock.now_ms(), Event::Fault { call, fault });
    }

    async fn latency(&self, call: u64) {
        let delay = {
            let mut inner = self.lock();
            if !inner.rng.chance(self.rates.latency) {
                return;
            }
            let delay = inner.rng.range(1, self.rates.max_latency_ms.max(1));
            self.fault(&mut inner, call, Fault::Latency);
            delay
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }

    /// Records the call; injects latency, a partition or an outage before it.
    async fn before(
        &self,
        op: &'static str,
        subject: &str,
        lease: Option<&LeaseRef>,
    ) -> Result<u64> {
        let call = {
            let mut inner = self.lock();
            inner.next_call += 1;
            inner.next_call
        };
        self.history.push(
            self.clock.now_ms(),
            Event::Call {
                call,
                op,
                subject: subject.to_owned(),
            },
        );
        self.latency(call).await;
        let mut inner = self.lock();
        let now = self.clock.now_ms();
        let cut = lease
            .and_then(|l| inner.fences.get(&l.token.digest_hex()).copied())
            .and_then(|fence| inner.partitioned.get(&fence).copied())
            .is_some_and(|until| until > now);
        if cut {
            self.fault(&mut inner, call, Fault::Partitioned);
            drop(inner);
            return Err(self.refuse(call, Error::store("injected: partitioned from the store")));
        }
        if inner.rng.chance(self.rates.unavailable) {
            self.fault(&mut inner, call, Fault::Unavailable);
            drop(inner);
            return Err(self.refuse(call, Error::store("injected: store unavailable")));
        }
        Ok(call)
    }

    /// Injects a lost reply and latency after the step; records the return.
    async fn after<T: std::fmt::Debug>(
        &self,
        call: u64,
        result: Result<T>,
        observed: impl FnOnce(&T) -> Option<Observed> + Send,
    ) -> Result<T> {
        let lost = {
            let mut inner = self.lock();
            let lost = result.is_ok() && inner.rng.chance(self.rates.lost_reply);
            if lost {
                self.fault(&mut inner, call, Fault::LostReply);
            }
            lost
        };
        self.latency(call).await;
        if lost {
            return self.returned(call, Err(Error::store("injected: reply lost")));
        }
        if let Some(what) = result.as_ref().ok().and_then(observed) {
            self.history
                .push(self.clock.now_ms(), Event::Observed { call, what });
        }
        self.returned(call, result)
    }

    /// A write the holder of `lease` saw succeed.
    fn wrote(&self, what: &'static str, lease: &LeaseRef) -> Option<Observed> {
        let inner = self.lock();
        let fence = *inner.fences.get(&lease.token.digest_hex())?;
        Some(Observed::Wrote {
            what,
            session: inner.sessions.get(&fence)?.clone(),
            fence,
        })
    }

    fn returned<T: std::fmt::Debug>(&self, call: u64, result: Result<T>) -> Result<T> {
        let text = match &result {
            Ok(_) => "ok".to_owned(),
            Err(error) => error.kind().code().to_owned(),
        };
        self.history
            .push(self.clock.now_ms(), Event::Return { call, result: text });
        result
    }

    fn refuse(&self, call: u64, error: Error) -> Error {
        self.history.push(
            self.clock.now_ms(),
            Event::Return {
                call,
                result: error.kind().code().to_owned(),
            },
        );
        error
    }

    /// Records what the store answered a tool claim, before a lost reply
    /// can hide it from the caller.
    fn claimed(&self, call: u64, lease: &LeaseRef, tool: &ToolCall, result: &Result<ToolClaim>) {
        let Some(fence) = self.lock().fences.get(&lease.token.digest_hex()).copied() else {
            return;
        };
        let answer = match result {
            Ok(ToolClaim::Execute { attempt, .. }) => ClaimAnswer::Execute { attempt: *attempt },
            Ok(ToolClaim::Cached { result, .. }) => ClaimAnswer::Cached {
                result: result.to_string(),
            },
            Err(error) => ClaimAnswer::Refused {
                code: error.kind().code(),
            },
        };
        self.history.push(
            self.clock.now_ms(),
            Event::ToolClaimed {
                call,
                key: idempotency_key(&lease.turn_id, tool),
                fence,
                answer,
            },
        );
    }

    /// Records what the store answered a tool completion or failure.
    fn finished(
        &self,
        call: u64,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        outcome: std::result::Result<FinishAnswer, &Error>,
    ) {
        let (fence, key) = {
            let inner = self.lock();
            let fence = inner.fences.get(&lease.token.digest_hex()).copied();
            let key = inner.keys.get(execution_id.as_str()).cloned();
            match (fence, key) {
                (Some(fence), Some(key)) => (fence, key),
                _ => return,
            }
        };
        let outcome = outcome.unwrap_or_else(|error| FinishAnswer::Refused {
            code: error.kind().code(),
        });
        self.history.push(
            self.clock.now_ms(),
            Event::ToolFinished {
                call,
                key,
                fence,
                outcome,
            },
        );
    }

    fn learn(&self, outcome: &Result<BeginOutcome>) {
        if let Ok(BeginOutcome::Started(grant)) = outcome {
            let mut inner = self.lock();
            inner
                .fences
                .insert(grant.lease_token.digest_hex(), grant.fence.0);
            inner
                .sessions
                .insert(grant.fence.0, grant.session_id.to_string());
        }
    }
}

#[async_trait]
impl Store for Faulty {
    fn config(&self) -> &Config {
        self.inner.config()
    }

    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome> {
        let subject = format!("{}/{}", command.session_id, command.client_request_id);
        let call = self.before("begin", &subject, None).await?;
        let outcome = self.inner.begin(command).await;
        self.learn(&outcome);
        self.after(call, outcome, |outcome| match outcome {
            BeginOutcome::Started(grant) => Some(Observed::Granted {
                session: grant.session_id.to_string(),
                fence: grant.fence.0,
            }),
            BeginOutcome::Replay(_) | BeginOutcome::Queued(_) => None,
        })
        .await
    }

    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus> {
        let call = self
            .before("heartbeat", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self.inner.heartbeat(lease).await;
        self.after(call, result, |_| self.wrote("heartbeat", lease))
            .await
    }

    async fn claim_tool(&self, lease: &LeaseRef, tool: &ToolCall) -> Result<ToolClaim> {
        let call = self
            .before("claim_tool", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self.inner.claim_tool(lease, tool).await;
        if let Ok(ToolClaim::Execute {
            execution_id,
            idempotency_key,
            ..
        }) = &result
        {
            self.lock()
                .keys
                .insert(execution_id.to_string(), idempotency_key.clone());
        }
        self.claimed(call, lease, tool, &result);
        self.after(call, result, |claim| match claim {
            ToolClaim::Execute { .. } => self.wrote("claim_tool", lease),
            ToolClaim::Cached { .. } => None,
        })
        .await
    }

    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value> {
        let call = self
            .before("complete_tool", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self
            .inner
            .complete_tool(lease, execution_id, completion)
            .await;
        self.finished(
            call,
            lease,
            execution_id,
            result.as_ref().map(|value| FinishAnswer::Succeeded {
                result: value.to_string(),
            }),
        );
        self.after(call, result, |value| {
            let inner = self.lock();
            let fence = *inner.fences.get(&lease.token.digest_hex())?;
            Some(Observed::Completed {
                session: inner.sessions.get(&fence)?.clone(),
                key: inner.keys.get(execution_id.as_str())?.clone(),
                fence,
                result: value.to_string(),
            })
        })
        .await
    }

    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()> {
        let call = self
            .before("fail_tool", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self.inner.fail_tool(lease, execution_id, error).await;
        self.finished(
            call,
            lease,
            execution_id,
            result.as_ref().map(|()| FinishAnswer::Failed),
        );
        self.after(call, result, |_| self.wrote("fail_tool", lease))
            .await
    }

    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
        let call = self
            .before("end_turn", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self.inner.end_turn(lease, ending).await;
        self.after(call, result, |_| self.wrote("end_turn", lease))
            .await
    }

    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let call = self.before("turn", turn_id.as_str(), None).await?;
        let result = self.inner.turn(turn_id).await;
        self.after(call, result, |_| None).await
    }

    async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let call = self
            .before("request_cancel", turn_id.as_str(), None)
            .await?;
        let result = self.inner.request_cancel(turn_id).await;
        self.after(call, result, |_| None).await
    }

    async fn executions(
        &self,
        turn_id: &TurnId,
        page: &ExecutionPageRequest,
    ) -> Result<ExecutionPage> {
        let call = self.before("executions", turn_id.as_str(), None).await?;
        let result = self.inner.executions(turn_id, page).await;
        self.after(call, result, |_| None).await
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
        let call = self
            .before("append_events", lease.turn_id.as_str(), Some(lease))
            .await?;
        let result = self.inner.append_events(lease, events).await;
        self.after(call, result, |_| self.wrote("append_events", lease))
            .await
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
        self.inner
            .set_session_policy(user_id, session_id, on_busy)
            .await
    }
    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()> {
        self.inner.set_user_cap(user_id, cap).await
    }

    async fn overview(&self, limit: u32) -> Result<Overview> {
        self.inner.overview(limit).await
    }

    async fn sweep(&self) -> Result<SweepReport> {
        let call = self.before("sweep", "", None).await?;
        // The inner store's sweep runs its own orphans/abandon steps.
        let result = self.inner.sweep().await;
        self.after(call, result, |_| None).await
    }

    async fn queue_heads(
        &self,
        session: Option<&SessionId>,
        filter: &OrphanFilter,
        limit: u32,
    ) -> Result<Vec<Orphan>> {
        let call = self.before("queue_heads", "", None).await?;
        let result = self.inner.queue_heads(session, filter, limit).await;
        self.after(call, result, |_| None).await
    }

    async fn orphans(&self, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
        let call = self.before("orphans", "", None).await?;
        let result = self.inner.orphans(filter, limit).await;
        self.after(call, result, |_| None).await
    }

    async fn force_release(
        &self,
        session_id: &SessionId,
        only: Option<&TurnId>,
    ) -> Result<Option<TurnView>> {
        let call = self
            .before("force_release", session_id.as_str(), None)
            .await?;
        let result = self.inner.force_release(session_id, only).await;
        self.after(call, result, |_| None).await
    }

    async fn ignored_cancels(&self, limit: u32) -> Result<Vec<IgnoredCancel>> {
        let call = self.before("ignored_cancels", "", None).await?;
        let result = self.inner.ignored_cancels(limit).await;
        self.after(call, result, |_| None).await
    }

    fn watch_releases(&self, session_id: &SessionId) -> Box<dyn ReleaseWatch> {
        self.inner.watch_releases(session_id)
    }

    async fn abandon(&self, orphan: &Orphan) -> Result<bool> {
        let call = self
            .before("abandon", orphan.turn_id.as_str(), None)
            .await?;
        let result = self.inner.abandon(orphan).await;
        self.after(call, result, |_| None).await
    }
}
