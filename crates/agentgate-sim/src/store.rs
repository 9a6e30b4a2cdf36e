//! [`SimStore`]: an in-memory [`Store`] on tokio's paused clock.
//!
//! Every step is one critical section: it reads a snapshot, asks
//! `agentgate_core::decide` exactly as the SQL stores do (see
//! `agentgate-store-sqlite`'s `begin.rs`, `steps.rs`, `orphans.rs`), applies
//! the answer and records what it did, with no `.await` in between, so a
//! step is atomic. Fences come from one store-wide counter; leases expire on
//! the store's clock (simulated milliseconds past a fixed epoch); the
//! session row holds the lease and the permit, as in the SQL stores.
//!
//! Ids and lease tokens are minted from counters, never from the operating
//! system, so a seed determines them.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::decide::{
    cancel_ignored, cancel_step, check_execution, check_execution_room, check_row_lease,
    decide_begin, decide_tool_claim, release_target, BeginDecision, BeginFacts, CancelStep,
    CheckedLease, ExecutionSnapshot, HolderSnapshot, PendingSnapshot, RowLeaseFacts,
    SessionSnapshot, StartKind, ToolDecision, TurnSnapshot, UserLoad,
};
use agentgate_core::decide::{check_event_append, EventLogFacts, RELEASED_ERROR};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{
    ClientRequestId, ExecutionId, Fence, LeaseToken, SessionId, ToolName, TurnId, UserId,
};
use agentgate_core::limits::{MAX_ORPHAN_SCAN, MAX_OVERVIEW_ROWS};
use agentgate_core::model::{
    idempotency_key, BeginCommand, BeginOutcome, ConfirmationContext, Ending, EventPage,
    ExecutionView, Grant, HolderView, IgnoredCancel, LeaseRef, LiveTurn, NewEvent, OnBusy, Orphan,
    OrphanFilter, Overview, PreviousOutcome, SessionView, SweepReport, ToolCall, ToolClaim,
    ToolState, TurnEvent, TurnState, TurnView, UserView,
};
use agentgate_core::page::{assemble, ExecutionCursor, ExecutionPage, ExecutionPageRequest};
use agentgate_core::store::{Completion, LeaseStatus, ReleaseWatch, SqlEffect, Store};
use async_trait::async_trait;
use serde_json::Value;

use crate::history::{Event, History};

/// The store clock's value when a run starts: a fixed instant, so a seed
/// determines every timestamp.
pub const EPOCH_MS: i64 = 1_700_000_000_000;

/// The error recorded on an abandoned turn (as the SQL stores record it).
const ABANDONED_ERROR: &str = r#"{"code":"abandoned","message":"the turn's holder stopped without an ending and no one resumed it within the orphan grace"}"#;

/// A deliberately broken store, to prove the checker can fail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mutation {
    /// The correct store.
    #[default]
    None,
    /// Begin does not see the session's live holder: grants over it.
    GrantOverLiveHolder,
    /// Tool completion checks neither the lease nor the execution's fence.
    CompleteWithoutFence,
    /// An event append checks no lease: a zombie's progress lands.
    AppendWithoutLease,
    /// A takeover keeps the turn's old fence instead of drawing a new one.
    ReuseFenceOnTakeover,
    /// Begin counts none of the user's live permits.
    IgnorePermits,
    /// A holder's repeat claim of a call it is running under the same lease
    /// is answered execute again (attempt + 1) instead of `tool_in_flight`:
    /// the holder's own repeat claim runs the tool again.
    RerunOwnClaim,
}

/// The store's clock: tokio's (paused) clock since the run started.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    start: tokio::time::Instant,
}

impl Clock {
    /// A clock reading [`EPOCH_MS`] now.
    pub fn start() -> Self {
        Self {
            start: tokio::time::Instant::now(),
        }
    }

    /// Store-clock milliseconds.
    pub fn now_ms(&self) -> i64 {
        let elapsed = tokio::time::Instant::now().duration_since(self.start);
        EPOCH_MS + i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX - EPOCH_MS)
    }
}

#[derive(Clone, Debug)]
struct Holder {
    turn_id: String,
    token_digest: String,
    expires_at_ms: i64,
}

#[derive(Clone, Debug)]
struct SessionRow {
    user_id: String,
    /// Newest fence granted on the session.
    fence: i64,
    holder: Option<Holder>,
    pending: Option<PendingSnapshot>,
    /// Last change of the row (a grant, renewal, release): an idle session
    /// is swept once this is older than the result retention.
    updated_at_ms: i64,
    /// The default busy policy, for begins that name none.
    default_on_busy: Option<OnBusy>,
}

#[derive(Clone, Debug)]
struct TurnRow {
    session_id: String,
    user_id: String,
    client_request_id: String,
    fingerprint: String,
    payload: String,
    state: TurnState,
    attempt: u32,
    fence: i64,
    retryable: Option<bool>,
    response: Option<String>,
    error: Option<String>,
    pending: Option<String>,
    confirmation: Option<ConfirmationContext>,
    confirmed_by: Option<String>,
    created_at_ms: i64,
    updated_at_ms: i64,
    /// When the turn last ended (`None` while it runs): the sweep counts
    /// the result retention from here.
    ended_at_ms: Option<i64>,
    /// With [`OrphanClock::FirstListed`]: when a listing first found the
    /// running turn without a live lease (cleared by a grant).
    orphaned_at_ms: Option<i64>,
    /// When a cancel was requested for the running turn.
    cancel_requested_at_ms: Option<i64>,
}

#[derive(Clone, Debug)]
struct ExecutionRow {
    turn_id: String,
    tool: String,
    key: String,
    state: ToolState,
    attempt: u32,
    fence: i64,
    result: Option<String>,
    error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    fence: i64,
    minted: u64,
    sessions: BTreeMap<String, SessionRow>,
    turns: BTreeMap<String, TurnRow>,
    by_request: BTreeMap<(String, String), String>,
    executions: BTreeMap<String, ExecutionRow>,
    by_call: BTreeMap<(String, String, String), String>,
    caps: BTreeMap<String, u32>,
    /// Which grant each lease token belongs to (turn, fence): how the
    /// history names the caller of a write, whatever the row says.
    tokens: BTreeMap<String, i64>,
    /// The application's rows written by same-transaction effects
    /// ([`SimConnection`]), committed with their executions' success marks.
    effects: Vec<Value>,
    /// Each turn's event log and its bytes.
    events: BTreeMap<String, (Vec<TurnEvent>, u64)>,
}

/// What the simulated store hands a same-transaction effect
/// ([`Completion::Effect`]) as its "connection": the effect's writes are
/// staged here and become visible ([`SimStore::effects`]) only if the
/// execution's success mark commits in the same step, as in a SQL store.
#[derive(Debug, Default)]
pub struct SimConnection {
    writes: Vec<Value>,
}

impl SimConnection {
    /// Stages one application row.
    pub fn write(&mut self, row: Value) {
        self.writes.push(row);
    }
}

/// Since when a running turn without a live lease counts as an orphan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OrphanClock {
    /// Since its lease expired: the SQL stores with the lease in the
    /// session row.
    #[default]
    LeaseExpiry,
    /// Since a listing first found it unheld: the SQL stores with a lease
    /// layer that keeps no expiry in the rows (Redis), which record that
    /// time on the turn (`agentgate_store_sql::orphans`).
    FirstListed,
}

/// Runs a future that must not wait (an effect on a [`SimConnection`] has
/// no I/O) to its end inside a step, which holds the store's lock.
fn ready<T>(mut future: agentgate_core::store::BoxFuture<'_, T>) -> Result<T> {
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(value) => Ok(value),
        std::task::Poll::Pending => Err(Error::invalid(
            "an effect on the simulated store waited: it has no I/O to wait for",
        )),
    }
}

/// The in-memory store.
#[derive(Debug)]
pub struct SimStore {
    config: Config,
    clock: Clock,
    history: History,
    mutation: Mutation,
    orphan_clock: OrphanClock,
    state: Mutex<State>,
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(Value::Null)
}

fn id<T>(made: Result<T>) -> T {
    made.unwrap_or_else(|e| panic!("the sim mints valid ids: {e}"))
}

impl SimStore {
    /// An empty store on `clock`, recording into `history`.
    pub fn new(config: Config, clock: Clock, history: History, mutation: Mutation) -> Self {
        Self {
            config,
            clock,
            history,
            mutation,
            orphan_clock: OrphanClock::LeaseExpiry,
            state: Mutex::new(State::default()),
        }
    }

    /// The same store judging orphan age by `clock` (see [`OrphanClock`]).
    #[must_use]
    pub fn with_orphan_clock(mut self, clock: OrphanClock) -> Self {
        self.orphan_clock = clock;
        self
    }

    /// The application rows committed by same-transaction effects, oldest
    /// first.
    pub fn effects(&self) -> Vec<Value> {
        self.lock().effects.clone()
    }

    /// Records the turns still `running` once the run is over.
    pub fn quiesce(&self) {
        let state = self.lock();
        let running = state
            .turns
            .iter()
            .filter(|(_, row)| row.state == TurnState::Running)
            .map(|(t, _)| t.clone())
            .collect();
        self.record(self.clock.now_ms(), Event::Quiesced { running });
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, now: i64, event: Event) {
        self.history.push(now, event);
    }

    /// Records the store's live holders and permits after an applied step.
    fn facts(&self, state: &State, now: i64) {
        let mut holders = Vec::new();
        let mut live: BTreeMap<String, u32> = BTreeMap::new();
        for (session_id, session) in &state.sessions {
            if let Some(h) = session.holder.as_ref().filter(|h| h.expires_at_ms > now) {
                holders.push((session_id.clone(), session.fence, h.expires_at_ms));
                *live.entry(session.user_id.clone()).or_default() += 1;
            }
        }
        self.record(
            now,
            Event::Facts {
                holders,
                live: live.into_iter().collect(),
            },
        );
    }

    fn cap(&self, state: &State, user_id: &str) -> u32 {
        state
            .caps
            .get(user_id)
            .copied()
            .unwrap_or(self.config.max_turns_per_user)
    }

    fn load(&self, state: &State, user_id: &str, now: i64) -> UserLoad {
        let mut live = 0;
        let mut soonest: Option<i64> = None;
        for session in state.sessions.values().filter(|s| s.user_id == user_id) {
            if let Some(h) = session.holder.as_ref().filter(|h| h.expires_at_ms > now) {
                live += 1;
                soonest = Some(soonest.map_or(h.expires_at_ms, |s| s.min(h.expires_at_ms)));
            }
        }
        UserLoad {
            cap: self.cap(state, user_id),
            live,
            soonest_expiry_ms: soonest,
        }
    }

    /// The caller's lease, checked like the SQL stores' `check_lease`.
    fn check_lease(state: &State, lease: &LeaseRef, now: i64) -> Result<(CheckedLease, String)> {
        let turn = state
            .turns
            .get(lease.turn_id.as_str())
            .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
        let session = state.sessions.get(&turn.session_id);
        let holder = session.and_then(|s| s.holder.as_ref());
        let facts = RowLeaseFacts {
            turn_running: turn.state == TurnState::Running,
            holder_turn_id: holder.map(|h| h.turn_id.as_str()),
            lease_token_hash: holder.map(|h| h.token_digest.as_str()),
            fence: session.map(|s| s.fence),
            lease_expires_at_ms: holder.map(|h| h.expires_at_ms),
            now_ms: now,
        };
        let checked = check_row_lease(&facts, lease.turn_id.as_str(), &lease.token.digest_hex())?;
        Ok((checked, turn.session_id.clone()))
    }

    /// The fence of the grant `lease`'s token came from (0 if none).
    fn caller_fence(state: &State, lease: &LeaseRef) -> i64 {
        state
            .tokens
            .get(&lease.token.digest_hex())
            .copied()
            .unwrap_or(0)
    }

    fn mint(state: &mut State, prefix: &str) -> String {
        state.minted += 1;
        format!("{prefix}_{:08}", state.minted)
    }

    /// Whether the turn was asked to stop (a holder's view shows it).
    fn cancel_requested(state: &State, turn_id: &str) -> bool {
        state.turns.get(turn_id).is_some_and(|row| {
            row.state == TurnState::Running && row.cancel_requested_at_ms.is_some()
        })
    }

    fn view(turn_id: &str, row: &TurnRow) -> TurnView {
        TurnView {
            turn_id: id(TurnId::new(turn_id)),
            session_id: id(SessionId::new(row.session_id.clone())),
            user_id: id(UserId::new(row.user_id.clone())),
            client_request_id: id(ClientRequestId::new(row.client_request_id.clone())),
            state: row.state,
            attempt: row.attempt,
            fence: Fence(row.fence),
            response: row.response.as_deref().map(parse),
            error: row.error.as_deref().map(parse),
            retryable: row.retryable,
            pending: row.pending.as_deref().map(parse),
            confirmation: row.confirmation.clone(),
            confirmed_by: row.confirmed_by.as_deref().map(|t| id(TurnId::new(t))),
            cancel_requested_at_ms: row.cancel_requested_at_ms,
            created_at_ms: row.created_at_ms,
            updated_at_ms: row.updated_at_ms,
        }
    }

    fn execution_view(execution_id: &str, row: &ExecutionRow) -> ExecutionView {
        ExecutionView {
            execution_id: id(ExecutionId::new(execution_id)),
            turn_id: id(TurnId::new(row.turn_id.clone())),
            tool: id(ToolName::new(row.tool.clone())),
            state: row.state,
            attempt: row.attempt,
            fence: Fence(row.fence),
            result: row.result.as_deref().map(parse),
            error: row.error.as_deref().map(parse),
        }
    }

    fn snapshot(turn_id: &str, row: &TurnRow) -> TurnSnapshot {
        TurnSnapshot {
            turn_id: turn_id.to_owned(),
            session_id: row.session_id.clone(),
            fingerprint: row.fingerprint.clone(),
            state: row.state,
            attempt: row.attempt,
            retryable: row.retryable.unwrap_or(false),
            confirmed_by: row.confirmed_by.clone(),
        }
    }

    fn replay(&self, state: &State, turn_id: &str, now: i64) -> Result<BeginOutcome> {
        let row = state
            .turns
            .get(turn_id)
            .ok_or_else(|| Error::corrupt(format!("replay of missing turn {turn_id}")))?;
        self.record(
            now,
            Event::Replay {
                turn: turn_id.to_owned(),
                state: row.state.as_str(),
                response: row.response.clone(),
                observed: false,
            },
        );
        Ok(BeginOutcome::Replay(Self::view(turn_id, row)))
    }

    fn begin_step(
        &self,
        state: &mut State,
        command: &BeginCommand,
        now: i64,
    ) -> Result<BeginOutcome> {
        let session_row = state.sessions.get(command.session_id.as_str());
        let session = session_row.map(|s| SessionSnapshot {
            user_id: s.user_id.clone(),
            holder: match self.mutation {
                Mutation::GrantOverLiveHolder => None,
                _ => s.holder.as_ref().map(|h| HolderSnapshot {
                    turn_id: h.turn_id.clone(),
                    lease_expires_at_ms: h.expires_at_ms,
                }),
            },
            pending: s.pending.clone(),
        });
        let own_turn_id = state
            .by_request
            .get(&(
                command.session_id.as_str().to_owned(),
                command.client_request_id.as_str().to_owned(),
            ))
            .cloned();
        let turn = own_turn_id
            .as_deref()
            .and_then(|t| state.turns.get(t).map(|row| Self::snapshot(t, row)));
        let confirms = command.confirmation.as_ref().map(|c| c.turn_id.as_str());
        let confirm_target = match (confirms, &turn) {
            (Some(target), None) => state
                .turns
                .get(target)
                .map(|row| Self::snapshot(target, row)),
            _ => None,
        };
        let continuation = confirm_target
            .as_ref()
            .and_then(|t| t.confirmed_by.as_deref())
            .and_then(|next| state.turns.get(next).map(|row| Self::snapshot(next, row)));
        let mut load = self.load(state, command.user_id.as_str(), now);
        if self.mutation == Mutation::IgnorePermits {
            load.live = 0;
        }
        let facts = BeginFacts {
            now_ms: now,
            user_id: command.user_id.as_str(),
            session_id: command.session_id.as_str(),
            fingerprint: command.fingerprint.as_hex(),
            confirms,
            session: session.as_ref(),
            turn: turn.as_ref(),
            confirm_target: confirm_target.as_ref(),
            continuation: continuation.as_ref(),
            load,
            resume_only: command.resume_only,
            // The simulation models no queue: `begin` refuses a command
            // that asks for one, so every session's queue is empty.
            queue: agentgate_core::decide::QueueFacts::default(),
            enqueue: None,
        };
        match decide_begin(&facts) {
            BeginDecision::Reject(error) => Err(error),
            BeginDecision::Replay { turn_id } => self.replay(state, &turn_id, now),
            BeginDecision::Exhaust => {
                let turn_id = own_turn_id.unwrap_or_default();
                if let Some(row) = state.turns.get_mut(&turn_id) {
                    row.state = TurnState::Failed;
                    row.retryable = Some(false);
                    row.error = Some(r#"{"code":"attempts_exhausted"}"#.to_owned());
                    row.updated_at_ms = now;
                    row.ended_at_ms = Some(now);
                    row.orphaned_at_ms = None;
                }
                self.record(
                    now,
                    Event::Ended {
                        turn: turn_id.clone(),
                        state: TurnState::Failed.as_str(),
                        response: None,
                    },
                );
                self.replay(state, &turn_id, now)
            }
            BeginDecision::Start { kind, attempt } => {
                Ok(self.start(state, command, own_turn_id, kind, attempt, load.cap, now))
            }
            BeginDecision::Enqueue { .. } | BeginDecision::Queued { .. } => Err(Error::corrupt(
                "the simulation decided a queue it does not model",
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        state: &mut State,
        command: &BeginCommand,
        existing: Option<String>,
        kind: StartKind,
        attempt: u32,
        cap: u32,
        now: i64,
    ) -> BeginOutcome {
        let reused = match (&existing, self.mutation) {
            (Some(t), Mutation::ReuseFenceOnTakeover) if kind == StartKind::Takeover => {
                state.turns.get(t).map(|row| row.fence)
            }
            _ => None,
        };
        let fence = reused.unwrap_or_else(|| {
            state.fence += 1;
            state.fence
        });
        let token = id(LeaseToken::parse(Self::mint(state, "lt")));
        let turn_id = match &existing {
            Some(t) => t.clone(),
            None => Self::mint(state, "turn"),
        };
        let ttl = self.config.lease_ttl_ms();
        let expires_at_ms = now + ttl;
        let confirming = command.confirmation.is_some() && kind == StartKind::New;
        let session_id = command.session_id.as_str().to_owned();
        let session = state
            .sessions
            .entry(session_id.clone())
            .or_insert_with(|| SessionRow {
                user_id: command.user_id.as_str().to_owned(),
                fence: 0,
                holder: None,
                pending: None,
                updated_at_ms: now,
                default_on_busy: None,
            });
        session.fence = fence;
        session.updated_at_ms = now;
        session.holder = Some(Holder {
            turn_id: turn_id.clone(),
            token_digest: token.digest_hex(),
            expires_at_ms,
        });
        if confirming {
            session.pending = None;
        }
        state.tokens.insert(token.digest_hex(), fence);
        let confirmation = if let Some(row) = existing.as_ref().and_then(|t| state.turns.get_mut(t))
        {
            row.state = TurnState::Running;
            row.attempt = attempt;
            row.fence = fence;
            row.error = None;
            row.retryable = None;
            row.updated_at_ms = now;
            row.ended_at_ms = None;
            row.orphaned_at_ms = None;
            row.confirmation.clone()
        } else {
            let confirmation = command.confirmation.as_ref().map(|c| {
                let target = state.turns.get_mut(c.turn_id.as_str());
                let pending = target.map_or(Value::Null, |t| {
                    t.state = TurnState::Confirmed;
                    t.confirmed_by = Some(turn_id.clone());
                    t.updated_at_ms = now;
                    t.pending.as_deref().map_or(Value::Null, parse)
                });
                ConfirmationContext {
                    turn_id: c.turn_id.clone(),
                    decision: c.decision,
                    pending,
                }
            });
            state.by_request.insert(
                (
                    session_id.clone(),
                    command.client_request_id.as_str().to_owned(),
                ),
                turn_id.clone(),
            );
            state.turns.insert(
                turn_id.clone(),
                TurnRow {
                    session_id: session_id.clone(),
                    user_id: command.user_id.as_str().to_owned(),
                    client_request_id: command.client_request_id.as_str().to_owned(),
                    fingerprint: command.fingerprint.as_hex().to_owned(),
                    payload: command.payload.as_str().to_owned(),
                    state: TurnState::Running,
                    attempt,
                    fence,
                    retryable: None,
                    response: None,
                    error: None,
                    pending: None,
                    confirmation: confirmation.clone(),
                    confirmed_by: None,
                    created_at_ms: now,
                    updated_at_ms: now,
                    ended_at_ms: None,
                    orphaned_at_ms: None,
                    cancel_requested_at_ms: None,
                },
            );
            confirmation
        };
        self.record(
            now,
            Event::Grant {
                session: session_id,
                user: command.user_id.as_str().to_owned(),
                turn: turn_id.clone(),
                request: command.client_request_id.as_str().to_owned(),
                fence,
                expires_at_ms,
                cap,
                takeover: kind == StartKind::Takeover,
            },
        );
        BeginOutcome::Started(Grant {
            turn_id: id(TurnId::new(turn_id)),
            session_id: command.session_id.clone(),
            user_id: command.user_id.clone(),
            client_request_id: command.client_request_id.clone(),
            lease_token: token,
            fence: Fence(fence),
            attempt,
            takeover: kind == StartKind::Takeover,
            lease_expires_in_ms: ttl,
            confirmation,
        })
    }

    fn claim_step(
        &self,
        state: &mut State,
        lease: &LeaseRef,
        call: &ToolCall,
        now: i64,
    ) -> Result<ToolClaim> {
        let (live, session) = Self::check_lease(state, lease, now)?;
        let call_key = (
            lease.turn_id.as_str().to_owned(),
            call.tool.as_str().to_owned(),
            call.args_hash.as_hex().to_owned(),
        );
        let existing_id = state.by_call.get(&call_key).cloned();
        let snapshot = existing_id.as_ref().and_then(|e| {
            state.executions.get(e).map(|row| ExecutionSnapshot {
                execution_id: e.clone(),
                state: row.state,
                attempt: row.attempt,
                fence: Fence(row.fence),
            })
        });
        let key = idempotency_key(&lease.turn_id, call);
        let caller = Self::caller_fence(state, lease);
        let cancelled = state
            .turns
            .get(lease.turn_id.as_str())
            .filter(|t| t.cancel_requested_at_ms.is_some())
            .map(|_| lease.turn_id.as_str().to_owned());
        let decision = match decide_tool_claim(
            snapshot.as_ref(),
            cancelled.as_deref(),
            live.fence,
            live.lease_expires_at_ms,
            now,
        ) {
            ToolDecision::Reject(Error::ToolInFlight { attempt, .. })
                if self.mutation == Mutation::RerunOwnClaim =>
            {
                ToolDecision::Reclaim {
                    attempt: attempt + 1,
                    previous: PreviousOutcome::Unknown,
                }
            }
            decision => decision,
        };
        let (execution_id, attempt, previous) = match decision {
            ToolDecision::Reject(error) => return Err(error),
            ToolDecision::Cached => {
                let execution_id = existing_id.unwrap_or_default();
                let result = state
                    .executions
                    .get(&execution_id)
                    .and_then(|row| row.result.as_deref())
                    .map_or(Value::Null, parse);
                return Ok(ToolClaim::Cached {
                    execution_id: id(ExecutionId::new(execution_id)),
                    result,
                });
            }
            ToolDecision::Insert => {
                let count = state
                    .executions
                    .values()
                    .filter(|e| e.turn_id == lease.turn_id.as_str())
                    .count();
                let count = i64::try_from(count).expect("a turn's executions fit in i64");
                check_execution_room(lease.turn_id.as_str(), count)?;
                let execution_id = Self::mint(state, "exec");
                state.by_call.insert(call_key, execution_id.clone());
                state.executions.insert(
                    execution_id.clone(),
                    ExecutionRow {
                        turn_id: lease.turn_id.as_str().to_owned(),
                        tool: call.tool.as_str().to_owned(),
                        key: key.clone(),
                        state: ToolState::Running,
                        attempt: 1,
                        fence: live.fence.0,
                        result: None,
                        error: None,
                    },
                );
                (execution_id, 1, None)
            }
            ToolDecision::Reclaim { attempt, previous } => {
                let execution_id = existing_id.unwrap_or_default();
                if let Some(row) = state.executions.get_mut(&execution_id) {
                    row.state = ToolState::Running;
                    row.attempt = attempt;
                    row.fence = live.fence.0;
                    row.error = None;
                }
                (execution_id, attempt, Some(previous))
            }
        };
        self.record(
            now,
            Event::Write {
                what: "claim_tool",
                session,
                fence: caller,
            },
        );
        self.record(
            now,
            Event::ToolExecute {
                key: key.clone(),
                turn: lease.turn_id.as_str().to_owned(),
                fence: caller,
                attempt,
            },
        );
        Ok(ToolClaim::Execute {
            execution_id: id(ExecutionId::new(execution_id)),
            idempotency_key: key,
            attempt,
            previous_outcome: previous,
        })
    }

    /// Ends a running execution under the caller's live lease and fence.
    fn finish_step(
        &self,
        state: &mut State,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        outcome: std::result::Result<&CanonicalJson, &CanonicalJson>,
        now: i64,
    ) -> Result<()> {
        let unfenced = self.mutation == Mutation::CompleteWithoutFence && outcome.is_ok();
        let (fence, session) = if unfenced {
            let session = state
                .turns
                .get(lease.turn_id.as_str())
                .map(|t| t.session_id.clone())
                .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
            (None, session)
        } else {
            let (live, session) = Self::check_lease(state, lease, now)?;
            (Some(live.fence.0), session)
        };
        let caller = Self::caller_fence(state, lease);
        let row = state
            .executions
            .get_mut(execution_id.as_str())
            .filter(|row| row.turn_id == lease.turn_id.as_str())
            .ok_or_else(|| Error::not_found(format!("tool execution {execution_id}")))?;
        if row.state != ToolState::Running {
            return Err(Error::LeaseLost {
                reason: "tool execution already ended",
            });
        }
        if fence.is_some_and(|f| f != row.fence) {
            return Err(Error::LeaseLost {
                reason: "tool execution claimed by a newer lease",
            });
        }
        let key = row.key.clone();
        match outcome {
            Ok(result) => {
                row.state = ToolState::Succeeded;
                row.result = Some(result.as_str().to_owned());
                self.record(
                    now,
                    Event::Write {
                        what: "complete_tool",
                        session,
                        fence: caller,
                    },
                );
                self.record(
                    now,
                    Event::ToolDone {
                        key,
                        fence: caller,
                        result: result.as_str().to_owned(),
                    },
                );
            }
            Err(error) => {
                row.state = ToolState::Failed;
                row.error = Some(error.as_str().to_owned());
                self.record(
                    now,
                    Event::Write {
                        what: "fail_tool",
                        session,
                        fence: caller,
                    },
                );
            }
        }
        Ok(())
    }

    fn end_step(
        &self,
        state: &mut State,
        lease: &LeaseRef,
        ending: &Ending,
        now: i64,
    ) -> Result<TurnView> {
        let (_, session_id) = Self::check_lease(state, lease, now)?;
        let caller = Self::caller_fence(state, lease);
        let confirmation_ttl = agentgate_core::config::duration_ms(self.config.confirmation_ttl);
        let row = state
            .turns
            .get_mut(lease.turn_id.as_str())
            .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
        let mut pending_until = None;
        match ending {
            Ending::Succeed { response } => {
                row.state = TurnState::Succeeded;
                row.response = Some(response.as_str().to_owned());
            }
            Ending::Fail { error, retryable } => {
                row.state = TurnState::Failed;
                row.error = Some(error.as_str().to_owned());
                row.retryable = Some(*retryable);
            }
            Ending::AwaitConfirmation { pending } => {
                row.state = TurnState::AwaitingConfirmation;
                row.pending = Some(pending.as_str().to_owned());
                pending_until = Some(now + confirmation_ttl);
            }
            Ending::Cancel { partial } => {
                row.state = TurnState::Cancelled;
                row.response = Some(partial.as_str().to_owned());
            }
        }
        row.updated_at_ms = now;
        row.ended_at_ms = Some(now);
        let response = row
            .response
            .clone()
            .filter(|_| row.state == TurnState::Succeeded);
        let view = Self::view(lease.turn_id.as_str(), row);
        if let Some(session) = state.sessions.get_mut(&session_id) {
            if session
                .holder
                .as_ref()
                .is_some_and(|h| h.turn_id == lease.turn_id.as_str())
            {
                session.holder = None;
                session.updated_at_ms = now;
            }
            if let Some(expires_at_ms) = pending_until {
                session.pending = Some(PendingSnapshot {
                    turn_id: lease.turn_id.as_str().to_owned(),
                    expires_at_ms,
                });
            }
        }
        self.record(
            now,
            Event::Write {
                what: "end_turn",
                session: session_id,
                fence: caller,
            },
        );
        self.record(
            now,
            Event::Ended {
                turn: lease.turn_id.as_str().to_owned(),
                state: view.state.as_str(),
                response,
            },
        );
        self.record(now, Event::Release { fence: caller });
        Ok(view)
    }

    /// A running turn's listing as an orphan, unheld since `since`.
    fn orphan(
        turn_id: &str,
        row: &TurnRow,
        session: Option<&SessionRow>,
        since: i64,
        now: i64,
    ) -> Orphan {
        Orphan {
            turn_id: id(TurnId::new(turn_id)),
            session_id: id(SessionId::new(row.session_id.clone())),
            user_id: id(UserId::new(row.user_id.clone())),
            client_request_id: id(ClientRequestId::new(row.client_request_id.clone())),
            fingerprint: agentgate_core::canonical::Digest::from_hex(row.fingerprint.clone()),
            payload: Some(CanonicalJson::from_stored(row.payload.clone())),
            fence: Fence(row.fence),
            attempt: row.attempt,
            orphaned_since_ms: since,
            orphaned_for_ms: now - since,
            superseded: session.is_some_and(|s| s.fence > row.fence),
        }
    }

    /// The orphan listing under [`OrphanClock::FirstListed`], as the SQL
    /// stores list with a lease layer: every running turn the filter admits
    /// whose lease is not live is stamped with the time it was first found
    /// so (kept until a grant), and its age counts from the stamp.
    fn first_listed(
        state: &mut State,
        filter: &OrphanFilter,
        limit: usize,
        now: i64,
        min_age: i64,
    ) -> Vec<Orphan> {
        let candidates: Vec<String> = state
            .turns
            .iter()
            .filter(|(t, row)| {
                row.state == TurnState::Running
                    && (filter.user_ids.is_empty()
                        || filter.user_ids.iter().any(|u| u.as_str() == row.user_id))
                    && (filter.turn_ids.is_empty()
                        || filter.turn_ids.iter().any(|f| f.as_str() == t.as_str()))
            })
            .map(|(t, _)| t.clone())
            .collect();
        let mut found = Vec::new();
        for turn_id in candidates {
            let Some(row) = state.turns.get_mut(&turn_id) else {
                continue;
            };
            let session = state.sessions.get(&row.session_id);
            let held = session
                .and_then(|s| s.holder.as_ref())
                .is_some_and(|h| h.turn_id == turn_id && h.expires_at_ms > now);
            if held {
                continue;
            }
            let since = *row.orphaned_at_ms.get_or_insert(now);
            if now - since >= min_age {
                found.push(Self::orphan(&turn_id, row, session, since, now));
            }
        }
        found.sort_by(|a, b| {
            (a.orphaned_since_ms, a.turn_id.as_str())
                .cmp(&(b.orphaned_since_ms, b.turn_id.as_str()))
        });
        found.truncate(limit);
        found
    }

    /// Completes a running execution with a same-transaction effect: the
    /// checks of [`Self::finish_step`] first (a refused completion runs no
    /// effect), then the effect on a [`SimConnection`], then the success
    /// mark with the effect's value; the effect's writes are committed with
    /// the mark, or dropped with it when the effect fails.
    fn effect_step(
        &self,
        state: &mut State,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        effect: &mut dyn SqlEffect,
        now: i64,
    ) -> Result<CanonicalJson> {
        let (live, _) = Self::check_lease(state, lease, now)?;
        let row = state
            .executions
            .get(execution_id.as_str())
            .filter(|row| row.turn_id == lease.turn_id.as_str());
        check_execution(
            execution_id.as_str(),
            row.map(|row| (row.state.as_str(), row.fence)),
            live.fence.0,
        )?;
        let mut connection = SimConnection::default();
        let value = ready(effect.apply(&mut connection as &mut (dyn std::any::Any + Send)))?
            .map_err(Error::Effect)?;
        let result = CanonicalJson::new("result", &value)?;
        self.finish_step(state, lease, execution_id, Ok(&result), now)?;
        state.effects.extend(connection.writes);
        Ok(result)
    }

    /// Deletes what the SQL stores' sweep deletes (their `SWEEPABLE_TURNS`
    /// and idle-session statements), at most `sweep_batch` of each: turns
    /// that ended more than `result_retention` ago (awaiting ones only once
    /// their confirmation expired too) with their executions, then sessions
    /// idle that long with no lease, no pending confirmation and no turn.
    /// A running turn is never deleted.
    fn sweep_step(&self, state: &mut State, now: i64) -> SweepReport {
        let cutoff = now - agentgate_core::config::duration_ms(self.config.result_retention);
        let pending_cutoff =
            cutoff - agentgate_core::config::duration_ms(self.config.confirmation_ttl);
        let batch = self.config.sweep_batch as usize;
        let doomed: Vec<String> = state
            .turns
            .iter()
            .filter(|(_, row)| match (row.state, row.ended_at_ms) {
                (TurnState::Running, _) | (_, None) => false,
                (TurnState::AwaitingConfirmation, Some(ended)) => ended < pending_cutoff,
                (_, Some(ended)) => ended < cutoff,
            })
            .map(|(t, _)| t.clone())
            .take(batch)
            .collect();
        let mut report = SweepReport::default();
        for turn_id in &doomed {
            if let Some(row) = state.turns.remove(turn_id) {
                state
                    .by_request
                    .remove(&(row.session_id.clone(), row.client_request_id.clone()));
                if let Some((events, _)) = state.events.remove(turn_id) {
                    report.events += events.len() as u64;
                }
                report.turns += 1;
            }
            let executions: Vec<String> = state
                .executions
                .iter()
                .filter(|(_, e)| e.turn_id == *turn_id)
                .map(|(e, _)| e.clone())
                .collect();
            for execution_id in executions {
                state.executions.remove(&execution_id);
                report.executions += 1;
            }
            state.by_call.retain(|(t, _, _), _| t != turn_id);
        }
        let idle: Vec<String> = state
            .sessions
            .iter()
            .filter(|(session_id, s)| {
                s.updated_at_ms < cutoff
                    && s.holder.as_ref().is_none_or(|h| h.expires_at_ms <= now)
                    && s.pending.as_ref().is_none_or(|p| p.expires_at_ms <= now)
                    && !state.turns.values().any(|t| t.session_id == **session_id)
            })
            .map(|(session_id, _)| session_id.clone())
            .take(batch)
            .collect();
        for session_id in idle {
            state.sessions.remove(&session_id);
            report.sessions += 1;
        }
        report
    }

    /// Runs one atomic step: lock, read the clock, decide and apply, record
    /// the store's facts if it changed anything.
    fn step<T>(&self, run: impl FnOnce(&Self, &mut State, i64) -> Result<T>) -> Result<T> {
        let mut state = self.lock();
        let now = self.clock.now_ms();
        let result = run(self, &mut state, now);
        self.facts(&state, now);
        result
    }
}

#[async_trait]
impl Store for SimStore {
    fn config(&self) -> &Config {
        &self.config
    }

    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome> {
        if command.queue.is_some() {
            return Err(Error::invalid(
                "the simulation store does not model session queues (on_busy: enqueue)",
            ));
        }
        self.step(|s, state, now| s.begin_step(state, command, now))
    }

    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus> {
        self.step(|s, state, now| {
            let (_, session_id) = Self::check_lease(state, lease, now)?;
            let caller = Self::caller_fence(state, lease);
            let ttl = s.config.lease_ttl_ms();
            if let Some(row) = state.sessions.get_mut(&session_id) {
                if let Some(h) = row.holder.as_mut() {
                    h.expires_at_ms = now + ttl;
                    row.updated_at_ms = now;
                }
            }
            s.record(
                now,
                Event::Write {
                    what: "heartbeat",
                    session: session_id,
                    fence: caller,
                },
            );
            s.record(
                now,
                Event::Renew {
                    fence: caller,
                    expires_at_ms: now + ttl,
                },
            );
            let cancel_requested = state
                .turns
                .get(lease.turn_id.as_str())
                .is_some_and(|t| t.cancel_requested_at_ms.is_some());
            Ok(LeaseStatus {
                lease_expires_in_ms: ttl,
                cancel_requested,
            })
        })
    }

    async fn claim_tool(&self, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim> {
        self.step(|s, state, now| s.claim_step(state, lease, call, now))
    }

    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value> {
        match completion {
            Completion::Result(result) => {
                self.step(|s, state, now| {
                    s.finish_step(state, lease, execution_id, Ok(&result), now)
                })?;
                Ok(parse(result.as_str()))
            }
            Completion::Effect(effect) => {
                let result = self
                    .step(|s, state, now| s.effect_step(state, lease, execution_id, effect, now))?;
                Ok(parse(result.as_str()))
            }
        }
    }

    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()> {
        self.step(|s, state, now| s.finish_step(state, lease, execution_id, Err(error), now))
    }

    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView> {
        self.step(|s, state, now| s.end_step(state, lease, ending, now))
    }

    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        let state = self.lock();
        Ok(state
            .turns
            .get(turn_id.as_str())
            .map(|row| Self::view(turn_id.as_str(), row)))
    }

    async fn request_cancel(&self, turn_id: &TurnId) -> Result<Option<TurnView>> {
        self.step(|s, state, now| {
            Ok(state.turns.get_mut(turn_id.as_str()).map(|row| {
                match cancel_step(row.state, row.cancel_requested_at_ms.is_some()) {
                    CancelStep::Record => {
                        row.cancel_requested_at_ms = Some(now);
                        row.updated_at_ms = now;
                        s.record(
                            now,
                            Event::CancelRecorded {
                                turn: turn_id.as_str().to_owned(),
                            },
                        );
                    }
                    CancelStep::EndQueued => {
                        unreachable!("the simulated store queues nothing: {row:?}")
                    }
                    CancelStep::Nothing => {}
                }
                Self::view(turn_id.as_str(), row)
            }))
        })
    }

    async fn force_release(
        &self,
        session_id: &SessionId,
        only: Option<&TurnId>,
    ) -> Result<Option<TurnView>> {
        self.step(|s, state, now| {
            let Some(session) = state.sessions.get(session_id.as_str()) else {
                return Ok(None);
            };
            let holder = session.holder.as_ref().map(|h| h.turn_id.clone());
            let holder_state = holder
                .as_ref()
                .and_then(|t| state.turns.get(t))
                .map(|row| row.state.as_str());
            let only = only.map(TurnId::as_str);
            let Some(turn_id) =
                release_target(holder.as_deref(), holder_state, only)?.map(str::to_owned)
            else {
                return Ok(None);
            };
            state.fence += 1;
            let fence = state.fence;
            let session = state
                .sessions
                .get_mut(session_id.as_str())
                .expect("read above, under the same lock");
            session.holder = None;
            session.fence = fence;
            session.updated_at_ms = now;
            let row = state
                .turns
                .get_mut(&turn_id)
                .expect("release_target checked it exists");
            let released_fence = row.fence;
            row.state = TurnState::Abandoned;
            row.error = Some(RELEASED_ERROR.to_owned());
            row.retryable = None;
            row.updated_at_ms = now;
            row.ended_at_ms = Some(now);
            row.orphaned_at_ms = None;
            let view = Self::view(&turn_id, row);
            s.record(
                now,
                Event::Ended {
                    turn: turn_id.clone(),
                    state: TurnState::Abandoned.as_str(),
                    response: None,
                },
            );
            s.record(
                now,
                Event::Release {
                    fence: released_fence,
                },
            );
            Ok(Some(view))
        })
    }

    fn watch_releases(&self, _session_id: &SessionId) -> Box<dyn ReleaseWatch> {
        // The model has no notification: a waiter waits by its poll alone.
        Box::new(PollOnly)
    }

    async fn append_events(&self, lease: &LeaseRef, events: &[NewEvent]) -> Result<u64> {
        self.step(|s, state, now| {
            let caller = Self::caller_fence(state, lease);
            let (live_fence, session) = if s.mutation == Mutation::AppendWithoutLease {
                let turn = state
                    .turns
                    .get(lease.turn_id.as_str())
                    .ok_or_else(|| Error::not_found(format!("turn {}", lease.turn_id)))?;
                (turn.fence, turn.session_id.clone())
            } else {
                let (checked, session) = Self::check_lease(state, lease, now)?;
                (checked.fence.0, session)
            };
            let turn_id = lease.turn_id.as_str();
            let turn = state
                .turns
                .get(turn_id)
                .ok_or_else(|| Error::corrupt(format!("turn {turn_id} vanished")))?;
            let (running, fence, attempt) =
                (turn.state == TurnState::Running, turn.fence, turn.attempt);
            let (log, bytes) = state.events.entry(turn_id.to_owned()).or_default();
            let batch_bytes: u64 = events.iter().map(NewEvent::size).sum();
            let facts = EventLogFacts {
                running,
                fence,
                count: log.len() as u64,
                bytes: *bytes,
            };
            let first = check_event_append(turn_id, facts, live_fence, events.len(), batch_bytes)?;
            for (event, event_id) in events.iter().zip(first..) {
                log.push(TurnEvent {
                    event_id,
                    attempt,
                    name: event.name.clone(),
                    data: event.data.as_str().to_owned(),
                });
            }
            *bytes += batch_bytes;
            s.record(
                now,
                Event::Write {
                    what: "append_events",
                    session,
                    fence: caller,
                },
            );
            Ok(first + events.len() as u64 - 1)
        })
    }

    async fn events(&self, turn_id: &TurnId, after: u64, limit: u32) -> Result<Option<EventPage>> {
        let state = self.lock();
        let Some(turn) = state.turns.get(turn_id.as_str()) else {
            return Ok(None);
        };
        let limit = limit.clamp(1, agentgate_core::limits::MAX_EVENT_PAGE) as usize;
        let events = state
            .events
            .get(turn_id.as_str())
            .map(|(log, _)| {
                log.iter()
                    .filter(|e| e.event_id > after)
                    .take(limit)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Ok(Some(EventPage {
            state: turn.state,
            attempt: turn.attempt,
            events,
        }))
    }

    fn watch_events(&self, _turn_id: &TurnId) -> Box<dyn ReleaseWatch> {
        // As releases: a follower reads again after its poll.
        Box::new(PollOnly)
    }

    async fn executions(
        &self,
        turn_id: &TurnId,
        page: &ExecutionPageRequest,
    ) -> Result<ExecutionPage> {
        let state = self.lock();
        // Minted ids sort in claim order, so the ordering key's number is 0
        // here and the id alone orders the page, oldest first.
        let key = |execution_id: &str| ExecutionCursor {
            claim_seq: 0,
            execution_id: id(ExecutionId::new(execution_id)),
        };
        let after = page.after.as_ref().map(|c| c.execution_id.as_str());
        let mut candidates: Vec<(&String, &ExecutionRow)> = state
            .executions
            .iter()
            .filter(|(e, row)| {
                row.turn_id == turn_id.as_str() && after.is_none_or(|a| e.as_str() > a)
            })
            .take(page.fetch() as usize)
            .collect();
        let more = candidates.len() > page.limit() as usize;
        candidates.truncate(page.limit() as usize);
        let keys: Vec<ExecutionCursor> = candidates.iter().map(|(e, _)| key(e)).collect();
        let rows = candidates
            .iter()
            .map(|(e, row)| Self::execution_view(e, row))
            .collect();
        assemble(rows, &keys, more, page)
    }

    async fn session(&self, session_id: &SessionId) -> Result<Option<SessionView>> {
        let state = self.lock();
        let now = self.clock.now_ms();
        Ok(state
            .sessions
            .get(session_id.as_str())
            .map(|row| SessionView {
                session_id: session_id.clone(),
                user_id: id(UserId::new(row.user_id.clone())),
                holder: row
                    .holder
                    .as_ref()
                    .filter(|h| h.expires_at_ms > now)
                    .map(|h| HolderView {
                        session_id: session_id.clone(),
                        turn_id: id(TurnId::new(h.turn_id.clone())),
                        fence: Fence(row.fence),
                        lease_expires_in_ms: h.expires_at_ms - now,
                        cancel_requested: Self::cancel_requested(&state, &h.turn_id),
                    }),
                pending_confirmation: row.pending.as_ref().filter(|p| p.expires_at_ms > now).map(
                    |p| agentgate_core::model::PendingView {
                        turn_id: id(TurnId::new(p.turn_id.clone())),
                        expires_in_ms: p.expires_at_ms - now,
                    },
                ),
                fence: Fence(row.fence),
                queue: Vec::new(),
                default_on_busy: row.default_on_busy,
            }))
    }

    async fn set_session_policy(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        on_busy: OnBusy,
    ) -> Result<SessionView> {
        {
            let mut state = self.lock();
            let now = self.clock.now_ms();
            let row = state
                .sessions
                .entry(session_id.as_str().to_owned())
                .or_insert_with(|| SessionRow {
                    user_id: user_id.as_str().to_owned(),
                    fence: 0,
                    holder: None,
                    pending: None,
                    updated_at_ms: now,
                    default_on_busy: None,
                });
            if row.user_id != user_id.as_str() {
                return Err(Error::not_found(format!("session {session_id}")));
            }
            row.default_on_busy = Some(on_busy);
            row.updated_at_ms = now;
        }
        let view = self.session(session_id).await?;
        view.ok_or_else(|| Error::corrupt(format!("session {session_id} vanished after its write")))
    }

    /// The simulation queues nothing (its `begin` refuses a queued
    /// command), so no session has a queue head.
    async fn queue_heads(
        &self,
        _session: Option<&SessionId>,
        filter: &OrphanFilter,
        _limit: u32,
    ) -> Result<Vec<Orphan>> {
        filter.validate()?;
        Ok(Vec::new())
    }

    async fn user(&self, user_id: &UserId) -> Result<UserView> {
        let overview = self.overview(MAX_OVERVIEW_ROWS).await?;
        let state = self.lock();
        let holders: Vec<HolderView> = overview
            .live
            .into_iter()
            .filter(|l| l.user_id == *user_id)
            .map(|l| l.holder)
            .collect();
        Ok(UserView {
            user_id: user_id.clone(),
            max_turns_per_user: self.cap(&state, user_id.as_str()),
            live_turns: u32::try_from(holders.len()).unwrap_or(u32::MAX),
            holders,
        })
    }

    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()> {
        if let Some(cap) = cap {
            agentgate_core::config::check_cap(cap)?;
        }
        let mut state = self.lock();
        match cap {
            Some(cap) => state.caps.insert(user_id.as_str().to_owned(), cap),
            None => state.caps.remove(user_id.as_str()),
        };
        Ok(())
    }

    async fn overview(&self, limit: u32) -> Result<Overview> {
        let limit = limit.min(MAX_OVERVIEW_ROWS) as usize;
        let state = self.lock();
        let now = self.clock.now_ms();
        let mut live: Vec<LiveTurn> = state
            .sessions
            .iter()
            .filter_map(|(session_id, row)| {
                let h = row.holder.as_ref().filter(|h| h.expires_at_ms > now)?;
                Some(LiveTurn {
                    user_id: id(UserId::new(row.user_id.clone())),
                    holder: HolderView {
                        session_id: id(SessionId::new(session_id.clone())),
                        turn_id: id(TurnId::new(h.turn_id.clone())),
                        fence: Fence(row.fence),
                        lease_expires_in_ms: h.expires_at_ms - now,
                        cancel_requested: Self::cancel_requested(&state, &h.turn_id),
                    },
                })
            })
            .collect();
        live.sort_by_key(|l| std::cmp::Reverse(l.holder.lease_expires_in_ms));
        live.truncate(limit);
        let mut recent: Vec<(&String, &TurnRow)> = state.turns.iter().collect();
        // As the SQL stores: newest update first, then the newer grant.
        recent.sort_by_key(|(t, row)| {
            (
                std::cmp::Reverse(row.updated_at_ms),
                std::cmp::Reverse(row.fence),
                (*t).clone(),
            )
        });
        Ok(Overview {
            live,
            recent_turns: recent
                .into_iter()
                .take(limit)
                .map(|(t, row)| Self::view(t, row))
                .collect(),
            recent_executions: state
                .executions
                .iter()
                .rev()
                .take(limit)
                .map(|(e, row)| Self::execution_view(e, row))
                .collect(),
        })
    }

    async fn sweep(&self) -> Result<SweepReport> {
        let abandoned = self.abandon_orphans().await?;
        let released = self.release_ignored_cancels().await?;
        let deleted = self.step(|s, state, now| Ok(s.sweep_step(state, now)))?;
        Ok(SweepReport {
            abandoned,
            released,
            ..deleted
        })
    }

    async fn ignored_cancels(&self, limit: u32) -> Result<Vec<IgnoredCancel>> {
        let limit = limit.min(MAX_ORPHAN_SCAN) as usize;
        let state = self.lock();
        let now = self.clock.now_ms();
        let grace_ms = self.config.cancel_grace_ms();
        let mut found: Vec<(i64, &String, &TurnRow)> = state
            .turns
            .iter()
            .filter(|(_, row)| row.state == TurnState::Running)
            .filter(|(turn_id, row)| {
                state
                    .sessions
                    .get(&row.session_id)
                    .and_then(|session| session.holder.as_ref())
                    .is_some_and(|holder| &holder.turn_id == *turn_id)
            })
            .filter_map(|(turn_id, row)| {
                let requested = row.cancel_requested_at_ms?;
                cancel_ignored(requested, now, grace_ms).then_some((requested, turn_id, row))
            })
            .collect();
        found.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        found
            .into_iter()
            .take(limit)
            .map(|(_, turn_id, row)| {
                Ok(IgnoredCancel {
                    session_id: SessionId::new(row.session_id.clone())?,
                    turn_id: TurnId::new(turn_id.clone())?,
                })
            })
            .collect()
    }

    async fn orphans(&self, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
        filter.validate()?;
        let limit = limit.min(MAX_ORPHAN_SCAN) as usize;
        let mut state = self.lock();
        let now = self.clock.now_ms();
        let min_age = i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX);
        if self.orphan_clock == OrphanClock::FirstListed {
            return Ok(Self::first_listed(&mut state, filter, limit, now, min_age));
        }
        let mut found: Vec<Orphan> = state
            .turns
            .iter()
            .filter(|(_, row)| row.state == TurnState::Running)
            .filter(|(_, row)| {
                filter.user_ids.is_empty()
                    || filter.user_ids.iter().any(|u| u.as_str() == row.user_id)
            })
            .filter(|(t, _)| {
                filter.turn_ids.is_empty()
                    || filter.turn_ids.iter().any(|f| f.as_str() == t.as_str())
            })
            .filter_map(|(turn_id, row)| {
                let session = state.sessions.get(&row.session_id);
                let own = session
                    .and_then(|s| s.holder.as_ref())
                    .filter(|h| h.turn_id == *turn_id);
                if own.is_some_and(|h| h.expires_at_ms > now) {
                    return None;
                }
                let since = own.map_or(row.updated_at_ms, |h| h.expires_at_ms);
                if since > now.saturating_sub(min_age) {
                    return None;
                }
                Some(Self::orphan(turn_id, row, session, since, now))
            })
            .collect();
        found.sort_by(|a, b| {
            (a.orphaned_since_ms, a.turn_id.as_str())
                .cmp(&(b.orphaned_since_ms, b.turn_id.as_str()))
        });
        found.truncate(limit);
        Ok(found)
    }

    async fn abandon(&self, orphan: &Orphan) -> Result<bool> {
        self.step(|s, state, now| {
            let Some(row) = state.turns.get_mut(orphan.turn_id.as_str()) else {
                return Ok(false);
            };
            let held = state
                .sessions
                .get(&row.session_id)
                .and_then(|s| s.holder.as_ref())
                .is_some_and(|h| h.turn_id == orphan.turn_id.as_str() && h.expires_at_ms > now);
            if row.state != TurnState::Running || row.fence != orphan.fence.0 || held {
                return Ok(false);
            }
            row.state = TurnState::Abandoned;
            row.error = Some(ABANDONED_ERROR.to_owned());
            row.retryable = None;
            row.updated_at_ms = now;
            row.ended_at_ms = Some(now);
            row.orphaned_at_ms = None;
            let session_id = row.session_id.clone();
            if let Some(session) = state.sessions.get_mut(&session_id) {
                if session
                    .holder
                    .as_ref()
                    .is_some_and(|h| h.turn_id == orphan.turn_id.as_str())
                {
                    session.holder = None;
                    session.updated_at_ms = now;
                }
            }
            s.record(
                now,
                Event::Abandon {
                    fence: orphan.fence.0,
                },
            );
            s.record(
                now,
                Event::Ended {
                    turn: orphan.turn_id.as_str().to_owned(),
                    state: TurnState::Abandoned.as_str(),
                    response: None,
                },
            );
            s.record(
                now,
                Event::Release {
                    fence: orphan.fence.0,
                },
            );
            Ok(true)
        })
    }
}

/// A release watch that is never woken: the waiter's poll alone.
struct PollOnly;

#[async_trait]
impl ReleaseWatch for PollOnly {
    async fn wait(&mut self, max: std::time::Duration) -> bool {
        tokio::time::sleep(max).await;
        false
    }
}
