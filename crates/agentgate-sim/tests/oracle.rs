//! Every real store against `decide` as the oracle (issue 11).
//!
//! The SQL stores encode decisions in single SQL statements on their fast
//! paths (heartbeat, first tool claim, tool complete/fail, turn endings);
//! `SimStore` applies `agentgate_core::decide`'s answers directly. A property
//! test generates sequences of protocol steps over a small space (2 users,
//! 2 sessions, 3 request ids, 2 payloads, 2 tools × 2 arg sets, caps 1–2),
//! applies each step to a fault-free `SimStore` and to a real store, and
//! compares, step by step:
//!
//! - what the step answered: started (fence, attempt, takeover,
//!   confirmation) or replayed (the whole turn view), the error code (with
//!   the turn or execution it names, and the cap), `execute` (attempt,
//!   previous outcome, idempotency key) or cached (result), stored results,
//!   ended turn views;
//! - the writes it made visible: after every step, the view of every turn
//!   seen so far, its tool executions, both sessions and both users.
//!
//! Generated ids (turns, executions, lease tokens) differ between stores, so
//! they are compared by role: the n-th turn or execution either store shows
//! is `T<n>` / `E<n>`, and fences by their rank among the fences seen.
//! Times (`created_at_ms`, remaining lease and retry-after) are not
//! compared, only that a remaining lease is positive: the two stores read
//! different clocks.
//!
//! Two kinds of cases per store:
//! - `*_agrees_with_decide`: the longest lease TTL, so no lease expires
//!   within a case; `AGENTGATE_ORACLE_CASES` (default 32) cases.
//! - `*_agrees_with_decide_across_lease_expiry`: a 500 ms TTL and sleep
//!   steps of 650 ms. The oracle's clock is tokio's (unpaused: real time)
//!   and the store's is the database's, so nothing drives both; instead
//!   every segment between sleeps must finish within 350 ms, so each lease
//!   is clearly live within its segment and clearly expired after the next
//!   sleep on both clocks (a slower segment rejects the case rather than
//!   fail it). This covers takeovers, expired heartbeats and claims.
//!   `AGENTGATE_ORACLE_EXPIRY_CASES` (default 8) cases.
//!
//! A difference fails with the shrunk step sequence (the steps up to the
//! first difference). SQLite always runs; PostgreSQL, MySQL and the Redis
//! lease layer run when their servers are up (see
//! `agentgate_conformance::targets`). The first difference it found, a store
//! bug now fixed, stays as a fixed case on every store
//! (`a_continuation_awaiting_confirmation_shows_its_own_pending`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentgate::{Config, Error};
use agentgate_conformance::targets::{self, Target};
use agentgate_core::canonical::{canonicalize, CanonicalJson};
use agentgate_core::ids::{ClientRequestId, ExecutionId, SessionId, ToolName, TurnId, UserId};
use agentgate_core::model::{
    idempotency_key, BeginCommand, BeginOutcome, Confirmation, ConfirmationContext, Decision,
    Ending, ExecutionView, LeaseRef, ToolCall, ToolClaim, TurnView,
};
use agentgate_core::store::{all_executions, Completion, Store};
use agentgate_sim::history::History;
use agentgate_sim::store::{Clock, Mutation, SimStore};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestError, TestRunner};
use serde_json::{json, Value};

/// The longest lease TTL allowed: nothing expires within a case.
const LEASE_TTL: Duration = agentgate::limits::MAX_LEASE_TTL;
/// The default cap: 2, so a user's second session can start and a third
/// begin finds the user at capacity only when a cap of 1 is set.
const DEFAULT_CAP: u32 = 2;
/// Cases per store unless `AGENTGATE_ORACLE_CASES` says otherwise.
const DEFAULT_CASES: u32 = 32;
/// The expiry cases' lease TTL: both stores' clocks run in real time (the
/// oracle's is tokio's, unpaused), so leases expire by sleeping.
const SHORT_TTL: Duration = Duration::from_millis(500);
/// A sleep step: past every lease of the segment before it, on both clocks.
const SLEEP: Duration = Duration::from_millis(650);
/// The longest a segment between sleeps may take: every lease granted or
/// renewed in it is then still live (with 150 ms to spare) at its end and
/// expired (by 150 ms) after the next sleep, on both stores. A case whose
/// segment took longer (a loaded machine) proves nothing and is rejected,
/// not failed.
const SEGMENT_BOUND: Duration = Duration::from_millis(350);
/// Expiry cases per store unless `AGENTGATE_ORACLE_EXPIRY_CASES` says
/// otherwise: each sleeps about 1.3 s.
const DEFAULT_EXPIRY_CASES: u32 = 8;
/// Shrinking bound: a failing case on a server store shrinks in seconds.
const MAX_SHRINK_ITERS: u32 = 512;

/// Which lease a post-grant step carries: 0 is the natural one (the latest
/// grant of the execution's turn for a tool finish, else the latest grant),
/// `k > 0` the `(k - 1) % n`-th grant ever made in the case, which is often
/// a stale lease (an ended turn, or an earlier attempt).
type LeaseSel = u8;

#[derive(Clone, Debug)]
enum EndKind {
    Succeed(u8),
    Fail { retryable: bool },
    AwaitConfirmation(u8),
}

#[derive(Clone, Debug)]
enum Op {
    /// No step: what shrinking turns a step that does not matter into.
    Idle,
    /// Only in the expiry cases: wait [`SLEEP`], past every lease granted
    /// or renewed so far.
    Sleep,
    /// The latest begin (or confirmation) again, as a client's retry: after
    /// a sleep, the takeover of a turn whose lease expired.
    Repeat,
    Begin {
        user: u8,
        session: u8,
        request: u8,
        payload: u8,
    },
    /// A begin answering the pending confirmation of the `target`-th turn.
    Confirm {
        user: u8,
        session: u8,
        request: u8,
        target: u8,
        approve: bool,
    },
    SetCap {
        user: u8,
        cap: Option<u32>,
    },
    Heartbeat {
        lease: LeaseSel,
    },
    Claim {
        lease: LeaseSel,
        tool: u8,
        args: u8,
    },
    Complete {
        lease: LeaseSel,
        exec: u8,
        result: u8,
    },
    FailTool {
        lease: LeaseSel,
        exec: u8,
    },
    End {
        lease: LeaseSel,
        how: EndKind,
    },
    ViewTurn {
        turn: u8,
    },
    ViewSession {
        session: u8,
    },
    ViewUser {
        user: u8,
    },
}

fn lease_sel() -> impl Strategy<Value = LeaseSel> {
    prop_oneof![3 => Just(0u8), 1 => 1u8..8]
}

fn user() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(0u8), 1 => Just(1u8)]
}

/// A case: each user's cap set first (1, 2, or the default 2), then 20–40
/// steps; in the expiry cases, some of them sleeps.
fn case(expiry: bool) -> impl Strategy<Value = Vec<Op>> {
    let cap = prop::option::of(1u32..=2);
    let step = if expiry {
        prop_oneof![30 => op(), 2 => Just(Op::Sleep)].boxed()
    } else {
        op().boxed()
    };
    (cap.clone(), cap, prop::collection::vec(step, 20..=40)).prop_map(|(cap0, cap1, ops)| {
        let mut all = vec![
            Op::SetCap { user: 0, cap: cap0 },
            Op::SetCap { user: 1, cap: cap1 },
        ];
        all.extend(ops);
        all
    })
}

fn op() -> impl Strategy<Value = Op> {
    let end = prop_oneof![
        2 => (0u8..2).prop_map(EndKind::Succeed),
        2 => any::<bool>().prop_map(|retryable| EndKind::Fail { retryable }),
        1 => (0u8..2).prop_map(EndKind::AwaitConfirmation),
    ];
    prop_oneof![
        // First, so shrinking replaces the steps a failure does not need.
        1 => Just(Op::Idle),
        // Mostly user 0, so one user holds both sessions and meets its cap;
        // user 1 mostly finds user 0's sessions not its own.
        6 => (user(), 0u8..2, 0u8..3, 0u8..2).prop_map(|(user, session, request, payload)| {
            Op::Begin { user, session, request, payload }
        }),
        3 => Just(Op::Repeat),
        1 => (user(), 0u8..2, 0u8..3, 0u8..6, any::<bool>()).prop_map(
            |(user, session, request, target, approve)| Op::Confirm {
                user, session, request, target, approve
            }
        ),
        1 => (0u8..2, prop::option::of(1u32..=2)).prop_map(|(user, cap)| Op::SetCap { user, cap }),
        2 => lease_sel().prop_map(|lease| Op::Heartbeat { lease }),
        5 => (lease_sel(), 0u8..2, 0u8..2).prop_map(|(lease, tool, args)| Op::Claim { lease, tool, args }),
        4 => (lease_sel(), 0u8..6, 0u8..2).prop_map(|(lease, exec, result)| Op::Complete { lease, exec, result }),
        2 => (lease_sel(), 0u8..6).prop_map(|(lease, exec)| Op::FailTool { lease, exec }),
        4 => (lease_sel(), end).prop_map(|(lease, how)| Op::End { lease, how }),
        1 => (0u8..6).prop_map(|turn| Op::ViewTurn { turn }),
        1 => (0u8..2).prop_map(|session| Op::ViewSession { session }),
        1 => (0u8..2).prop_map(|user| Op::ViewUser { user }),
    ]
}

fn config(expiry: bool) -> Config {
    if expiry {
        Config {
            lease_ttl: SHORT_TTL,
            max_turns_per_user: DEFAULT_CAP,
            // No sweeper may abandon an orphan within a case: the oracle
            // has none running.
            orphan_grace: agentgate::limits::MAX_ORPHAN_GRACE,
            ..Config::default()
        }
    } else {
        Config {
            lease_ttl: LEASE_TTL,
            max_turns_per_user: DEFAULT_CAP,
            ..Config::default()
        }
    }
}

fn canon(value: &Value) -> String {
    canonicalize("value", value).unwrap_or_else(|e| format!("<not canonical: {e}>"))
}

fn opt_canon(value: Option<&Value>) -> String {
    value.map_or_else(|| "-".to_owned(), canon)
}

fn valid<T>(made: agentgate::Result<T>) -> T {
    made.unwrap_or_else(|e| panic!("the test makes valid ids and JSON: {e}"))
}

/// One store's side of a case: the store, and its generated ids by role.
struct Side {
    store: Arc<dyn Store>,
    turns: HashMap<String, usize>,
    turn_ids: Vec<TurnId>,
    execs: HashMap<String, usize>,
    exec_ids: Vec<(ExecutionId, TurnId)>,
    fences: BTreeSet<i64>,
    /// Every lease granted in the case, oldest first.
    grants: Vec<LeaseRef>,
    /// The latest begin command, for [`Op::Repeat`].
    last_begin: Option<BeginCommand>,
}

impl Side {
    fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            turns: HashMap::new(),
            turn_ids: Vec::new(),
            execs: HashMap::new(),
            exec_ids: Vec::new(),
            fences: BTreeSet::new(),
            grants: Vec::new(),
            last_begin: None,
        }
    }

    fn turn(&mut self, id: &str) -> String {
        let next = self.turns.len();
        let role = *self.turns.entry(id.to_owned()).or_insert(next);
        if role == next {
            self.turn_ids.push(valid(TurnId::new(id)));
        }
        format!("T{role}")
    }

    fn exec(&mut self, id: &str, turn: &TurnId) -> String {
        let next = self.execs.len();
        let role = *self.execs.entry(id.to_owned()).or_insert(next);
        if role == next {
            self.exec_ids
                .push((valid(ExecutionId::new(id)), turn.clone()));
        }
        format!("E{role}")
    }

    fn fence(&mut self, fence: i64) -> String {
        self.fences.insert(fence);
        format!("F{}", self.fences.range(..fence).count())
    }

    fn error(&mut self, error: &Error) -> String {
        match error {
            Error::SessionBusy { active_turn_id, .. } => {
                format!("session_busy({})", self.turn(active_turn_id))
            }
            Error::RequestInFlight { active_turn_id, .. } => {
                format!("request_in_flight({})", self.turn(active_turn_id))
            }
            Error::AwaitingConfirmation {
                pending_turn_id, ..
            } => format!("awaiting_confirmation({})", self.turn(pending_turn_id)),
            Error::ToolInFlight { execution_id, .. } => {
                let role = self
                    .execs
                    .get(execution_id)
                    .map_or_else(|| "E?".to_owned(), |r| format!("E{r}"));
                format!("tool_in_flight({role})")
            }
            Error::UserAtCapacity { cap, .. } => format!("user_at_capacity(cap {cap})"),
            Error::StoreUnavailable(source) => format!("store_unavailable({source})"),
            other => format!("error {}", other.kind().code()),
        }
    }

    fn confirmation(&mut self, c: Option<&ConfirmationContext>) -> String {
        match c {
            None => "-".to_owned(),
            Some(c) => format!(
                "{}:{}:{}",
                self.turn(c.turn_id.as_str()),
                c.decision.as_str(),
                canon(&c.pending)
            ),
        }
    }

    fn turn_view(&mut self, v: &TurnView) -> String {
        let turn = self.turn(v.turn_id.as_str());
        let fence = self.fence(v.fence.0);
        let confirmation = self.confirmation(v.confirmation.as_ref());
        let confirmed_by = v
            .confirmed_by
            .as_ref()
            .map_or_else(|| "-".to_owned(), |t| self.turn(t.as_str()));
        format!(
            "{turn} {}/{}/{} {} attempt {} {fence} response {} error {} retryable {:?} \
             pending {} confirmation {confirmation} confirmed_by {confirmed_by}",
            v.session_id,
            v.user_id,
            v.client_request_id,
            v.state.as_str(),
            v.attempt,
            opt_canon(v.response.as_ref()),
            opt_canon(v.error.as_ref()),
            v.retryable,
            opt_canon(v.pending.as_ref()),
        )
    }

    fn execution_view(&mut self, v: &ExecutionView) -> String {
        let exec = self.exec(v.execution_id.as_str(), &v.turn_id);
        let turn = self.turn(v.turn_id.as_str());
        let fence = self.fence(v.fence.0);
        format!(
            "{exec} of {turn} {} {} attempt {} {fence} result {} error {}",
            v.tool,
            v.state.as_str(),
            v.attempt,
            opt_canon(v.result.as_ref()),
            opt_canon(v.error.as_ref()),
        )
    }

    /// The lease a step carries (see [`LeaseSel`]), `None` before any grant.
    fn lease(&self, sel: LeaseSel, of_turn: Option<&TurnId>) -> Option<LeaseRef> {
        if sel == 0 {
            of_turn
                .and_then(|t| self.grants.iter().rev().find(|g| g.turn_id == *t))
                .or(self.grants.last())
                .cloned()
        } else if self.grants.is_empty() {
            None
        } else {
            Some(self.grants[usize::from(sel - 1) % self.grants.len()].clone())
        }
    }

    fn exec_by_role(&self, role: u8) -> Option<(ExecutionId, TurnId)> {
        if self.exec_ids.is_empty() {
            return None;
        }
        Some(self.exec_ids[usize::from(role) % self.exec_ids.len()].clone())
    }

    fn turn_by_role(&self, role: u8) -> Option<TurnId> {
        if self.turn_ids.is_empty() {
            return None;
        }
        Some(self.turn_ids[usize::from(role) % self.turn_ids.len()].clone())
    }
}

/// A case's ids: its own users and sessions, so cases share one real store.
struct Names {
    prefix: String,
}

impl Names {
    fn user(&self, n: u8) -> UserId {
        valid(UserId::new(format!("{}-u{n}", self.prefix)))
    }
    fn session(&self, n: u8) -> SessionId {
        valid(SessionId::new(format!("{}-s{n}", self.prefix)))
    }
    fn request(n: u8) -> ClientRequestId {
        valid(ClientRequestId::new(format!("r{n}")))
    }
}

async fn begin(side: &mut Side, command: &BeginCommand) -> String {
    side.last_begin = Some(command.clone());
    match side.store.begin(command).await {
        Ok(BeginOutcome::Started(grant)) => {
            let turn = side.turn(grant.turn_id.as_str());
            let fence = side.fence(grant.fence.0);
            let confirmation = side.confirmation(grant.confirmation.as_ref());
            let same = grant.session_id == command.session_id
                && grant.user_id == command.user_id
                && grant.client_request_id == command.client_request_id;
            side.grants.push(LeaseRef {
                turn_id: grant.turn_id.clone(),
                token: grant.lease_token.clone(),
            });
            format!(
                "started {turn} {fence} attempt {} takeover {} ids_match {same} lease_live {} confirmation {confirmation}",
                grant.attempt,
                grant.takeover,
                grant.lease_expires_in_ms > 0,
            )
        }
        Ok(BeginOutcome::Replay(view)) => format!("replay {}", side.turn_view(&view)),
        Err(error) => side.error(&error),
    }
}

const NO_LEASE: &str = "skipped: no lease yet";

/// Applies `op` to one side; returns what it answered, normalized.
async fn apply(side: &mut Side, names: &Names, op: &Op) -> String {
    match op {
        Op::Idle => "idle".to_owned(),
        Op::Sleep => "slept".to_owned(),
        Op::Repeat => match side.last_begin.clone() {
            Some(command) => begin(side, &command).await,
            None => "skipped: no begin yet".to_owned(),
        },
        Op::Begin {
            user,
            session,
            request,
            payload,
        } => {
            let command = valid(BeginCommand::new(
                names.user(*user),
                names.session(*session),
                Names::request(*request),
                &json!({ "message": payload }),
                None,
            ));
            begin(side, &command).await
        }
        Op::Confirm {
            user,
            session,
            request,
            target,
            approve,
        } => {
            let turn_id = side
                .turn_by_role(*target)
                .unwrap_or_else(|| valid(TurnId::new("turn_none")));
            let decision = if *approve {
                Decision::Approve
            } else {
                Decision::Reject
            };
            let command = valid(BeginCommand::new(
                names.user(*user),
                names.session(*session),
                Names::request(*request),
                &json!({ "answer": approve }),
                Some(Confirmation { turn_id, decision }),
            ));
            begin(side, &command).await
        }
        Op::SetCap { user, cap } => match side.store.set_user_cap(&names.user(*user), *cap).await {
            Ok(()) => "cap set".to_owned(),
            Err(error) => side.error(&error),
        },
        Op::Heartbeat { lease } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            match side.store.heartbeat(&lease).await {
                Ok(status) => format!("renewed live {}", status.lease_expires_in_ms > 0),
                Err(error) => side.error(&error),
            }
        }
        Op::Claim { lease, tool, args } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            let call = valid(ToolCall::new(
                valid(ToolName::new(format!("tool{tool}"))),
                &json!({ "arg": args }),
            ));
            match side.store.claim_tool(&lease, &call).await {
                Ok(ToolClaim::Execute {
                    execution_id,
                    idempotency_key: key,
                    attempt,
                    previous_outcome,
                }) => {
                    let exec = side.exec(execution_id.as_str(), &lease.turn_id);
                    let key_ok = key == idempotency_key(&lease.turn_id, &call);
                    format!(
                        "execute {exec} attempt {attempt} previous {:?} key_ok {key_ok}",
                        previous_outcome.map(|p| p.as_str())
                    )
                }
                Ok(ToolClaim::Cached {
                    execution_id,
                    result,
                }) => {
                    let exec = side.exec(execution_id.as_str(), &lease.turn_id);
                    format!("cached {exec} result {}", canon(&result))
                }
                Err(error) => side.error(&error),
            }
        }
        Op::Complete {
            lease,
            exec,
            result,
        } => {
            let Some((execution_id, turn_id)) = side.exec_by_role(*exec) else {
                return "skipped: no execution yet".to_owned();
            };
            let Some(lease) = side.lease(*lease, Some(&turn_id)) else {
                return NO_LEASE.to_owned();
            };
            let result = valid(CanonicalJson::new("result", &json!({ "result": result })));
            match side
                .store
                .complete_tool(&lease, &execution_id, Completion::Result(result))
                .await
            {
                Ok(stored) => format!("completed {}", canon(&stored)),
                Err(error) => side.error(&error),
            }
        }
        Op::FailTool { lease, exec } => {
            let Some((execution_id, turn_id)) = side.exec_by_role(*exec) else {
                return "skipped: no execution yet".to_owned();
            };
            let Some(lease) = side.lease(*lease, Some(&turn_id)) else {
                return NO_LEASE.to_owned();
            };
            let error = valid(CanonicalJson::new(
                "error",
                &json!({ "code": "tool_broke" }),
            ));
            match side.store.fail_tool(&lease, &execution_id, &error).await {
                Ok(()) => "failed the execution".to_owned(),
                Err(error) => side.error(&error),
            }
        }
        Op::End { lease, how } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            let ending = match how {
                EndKind::Succeed(n) => Ending::Succeed {
                    response: valid(CanonicalJson::new("response", &json!({ "reply": n }))),
                },
                EndKind::Fail { retryable } => Ending::Fail {
                    error: valid(CanonicalJson::new(
                        "error",
                        &json!({ "code": "turn_broke" }),
                    )),
                    retryable: *retryable,
                },
                EndKind::AwaitConfirmation(n) => Ending::AwaitConfirmation {
                    pending: valid(CanonicalJson::new("pending", &json!({ "action": n }))),
                },
            };
            match side.store.end_turn(&lease, &ending).await {
                Ok(view) => format!("ended {}", side.turn_view(&view)),
                Err(error) => side.error(&error),
            }
        }
        Op::ViewTurn { turn } => {
            let Some(turn_id) = side.turn_by_role(*turn) else {
                return "skipped: no turn yet".to_owned();
            };
            match side.store.turn(&turn_id).await {
                Ok(Some(view)) => side.turn_view(&view),
                Ok(None) => "no such turn".to_owned(),
                Err(error) => side.error(&error),
            }
        }
        Op::ViewSession { session } => session_view(side, &names.session(*session)).await,
        Op::ViewUser { user } => user_view(side, &names.user(*user)).await,
    }
}

async fn session_view(side: &mut Side, session_id: &SessionId) -> String {
    match side.store.session(session_id).await {
        Ok(None) => format!("session {session_id}: none"),
        Ok(Some(v)) => {
            let holder = match &v.holder {
                None => "-".to_owned(),
                Some(h) => {
                    let turn = side.turn(h.turn_id.as_str());
                    let fence = side.fence(h.fence.0);
                    format!("{turn} {fence} live {}", h.lease_expires_in_ms > 0)
                }
            };
            let pending = v
                .pending_confirmation
                .as_ref()
                .map_or_else(|| "-".to_owned(), |p| side.turn(p.turn_id.as_str()));
            let fence = side.fence(v.fence.0);
            format!(
                "session {} of {}: holder {holder} pending {pending} {fence}",
                v.session_id, v.user_id
            )
        }
        Err(error) => side.error(&error),
    }
}

async fn user_view(side: &mut Side, user_id: &UserId) -> String {
    match side.store.user(user_id).await {
        Ok(v) => {
            let mut holders: Vec<String> = Vec::new();
            for h in &v.holders {
                let turn = side.turn(h.turn_id.as_str());
                let fence = side.fence(h.fence.0);
                holders.push(format!("{}:{turn}:{fence}", h.session_id));
            }
            holders.sort();
            format!(
                "user {}: cap {} live {} holders {holders:?}",
                v.user_id, v.max_turns_per_user, v.live_turns
            )
        }
        Err(error) => side.error(&error),
    }
}

/// Every visible record of the case: each turn seen so far with its tool
/// executions (by role: the stores may order same-millisecond executions
/// differently), both sessions, both users.
async fn snapshot(side: &mut Side, names: &Names) -> String {
    let mut out = String::new();
    let mut k = 0;
    while k < side.turn_ids.len() {
        let turn_id = side.turn_ids[k].clone();
        match side.store.turn(&turn_id).await {
            Ok(Some(view)) => out.push_str(&side.turn_view(&view)),
            Ok(None) => out.push_str(&format!("T{k}: none")),
            Err(error) => out.push_str(&side.error(&error)),
        }
        out.push('\n');
        match all_executions(side.store.as_ref(), &turn_id).await {
            Ok(executions) => {
                let mut lines: Vec<(usize, String)> = Vec::new();
                for v in &executions {
                    let line = side.execution_view(v);
                    lines.push((side.execs[v.execution_id.as_str()], line));
                }
                lines.sort();
                for (_, line) in lines {
                    out.push_str("  ");
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            Err(error) => {
                out.push_str(&side.error(&error));
                out.push('\n');
            }
        }
        k += 1;
    }
    for n in 0..2 {
        out.push_str(&session_view(side, &names.session(n)).await);
        out.push('\n');
    }
    for n in 0..2 {
        out.push_str(&user_view(side, &names.user(n)).await);
        out.push('\n');
    }
    out
}

/// Runs `ops` on a fresh oracle and on `real`; the first difference, if any.
/// What kind of answer `answer` is, for the printed tally of what the cases
/// covered: `started` (or `restarted`), `replay`, `execute`, an error code…
fn kind(answer: &str) -> String {
    let mut words = answer.split([' ', '(']);
    match words.next().unwrap_or_default() {
        "error" => words.next().unwrap_or_default().to_owned(),
        "started" if answer.contains(" takeover true ") => "takeover".to_owned(),
        "started" if !answer.contains(" attempt 1 ") => "restarted".to_owned(),
        "execute" if answer.contains("Some(\"unknown\")") => "re-execute unknown".to_owned(),
        "execute" if !answer.contains(" attempt 1 ") => "re-execute".to_owned(),
        "ended" | "replay" => {
            let state = answer
                .split(' ')
                .find(|w| {
                    [
                        "succeeded",
                        "failed",
                        "awaiting_confirmation",
                        "confirmed",
                        "running",
                    ]
                    .contains(w)
                })
                .unwrap_or("?");
            format!("{} {state}", &answer[..answer.find(' ').unwrap_or(0)])
        }
        first => first.to_owned(),
    }
}

/// Why a case did not pass.
enum Failure {
    /// The stores differ at this step.
    Differ(usize, String),
    /// An expiry case's segment took longer than [`SEGMENT_BOUND`]: its
    /// comparisons near lease expiry prove nothing.
    TooSlow(usize),
}

async fn run_case(
    real: &Arc<dyn Store>,
    prefix: String,
    ops: &[Op],
    expiry: bool,
) -> Result<Vec<String>, Failure> {
    let oracle: Arc<dyn Store> = Arc::new(SimStore::new(
        config(expiry),
        Clock::start(),
        History::default(),
        Mutation::None,
    ));
    let names = Names { prefix };
    let mut want = Side::new(oracle);
    let mut got = Side::new(Arc::clone(real));
    let mut kinds = Vec::new();
    let mut segment = Instant::now();
    let in_bound = |segment: Instant, i: usize| {
        if expiry && segment.elapsed() > SEGMENT_BOUND {
            Err(Failure::TooSlow(i))
        } else {
            Ok(())
        }
    };
    for (i, op) in ops.iter().enumerate() {
        if matches!(op, Op::Sleep) {
            tokio::time::sleep(SLEEP).await;
            segment = Instant::now();
        }
        let expected = apply(&mut want, &names, op).await;
        let actual = apply(&mut got, &names, op).await;
        in_bound(segment, i)?;
        if expected != actual {
            return Err(Failure::Differ(
                i,
                format!("step {i} answered differently\n  decide: {expected}\n  store:  {actual}"),
            ));
        }
        kinds.push(kind(&expected));
        if matches!(
            op,
            Op::Idle | Op::ViewTurn { .. } | Op::ViewSession { .. } | Op::ViewUser { .. }
        ) {
            continue;
        }
        let expected = snapshot(&mut want, &names).await;
        let actual = snapshot(&mut got, &names).await;
        in_bound(segment, i)?;
        if expected != actual {
            return Err(Failure::Differ(
                i,
                format!(
                    "after step {i} the visible records differ\n--- decide:\n{expected}--- store:\n{actual}"
                ),
            ));
        }
    }
    Ok(kinds)
}

fn cases(expiry: bool) -> u32 {
    let (var, default) = if expiry {
        ("AGENTGATE_ORACLE_EXPIRY_CASES", DEFAULT_EXPIRY_CASES)
    } else {
        ("AGENTGATE_ORACLE_CASES", DEFAULT_CASES)
    };
    std::env::var(var).ok().map_or(default, |n| {
        n.parse().unwrap_or_else(|e| panic!("{var}={n:?}: {e}"))
    })
}

/// Runs the generated cases on the store `make` opens (skipping when its
/// server is absent, as the conformance targets do).
fn differential<F, Fut>(make: F, expiry: bool)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<Target>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let Some(target) = runtime.block_on(make()) else {
        return;
    };
    let name = target.name;
    let store_url = target.store_url.clone();
    let gate = runtime.block_on(target.gate(config(expiry)));
    let real = Arc::clone(gate.store());
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases(expiry),
        failure_persistence: None,
        max_shrink_iters: MAX_SHRINK_ITERS,
        // An expiry case sleeps: bound the shrinking by time as well.
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    });
    let started = Instant::now();
    let numbered = std::cell::Cell::new(0u32);
    let tally = std::cell::RefCell::new(BTreeMap::<String, u32>::new());
    let too_slow = std::cell::Cell::new(0u32);
    let outcome = runner.run(&case(expiry), |ops| {
        numbered.set(numbered.get() + 1);
        let prefix = format!("oracle{}", numbered.get());
        let kinds = runtime
            .block_on(run_case(&real, prefix, &ops, expiry))
            .map_err(|failure| match failure {
                Failure::TooSlow(step) => {
                    too_slow.set(too_slow.get() + 1);
                    TestCaseError::reject(format!("segment over {SEGMENT_BOUND:?} at step {step}"))
                }
                Failure::Differ(step, difference) => {
                    // The steps up to the first difference: the rest never ran.
                    let steps: String = ops[..=step]
                        .iter()
                        .enumerate()
                        .filter(|(_, op)| !matches!(op, Op::Idle))
                        .map(|(i, op)| format!("  {i}: {op:?}\n"))
                        .collect();
                    TestCaseError::fail(format!("{difference}\nsteps:\n{steps}"))
                }
            })?;
        let mut tally = tally.borrow_mut();
        for kind in kinds {
            *tally.entry(kind).or_default() += 1;
        }
        Ok(())
    });
    runtime.block_on(async move {
        drop(real);
        drop(gate);
        drop(target);
    });
    match outcome {
        Ok(()) => println!(
            "{name}{}: {} cases agree with decide in {:.1}s ({} rejected as too slow); answers compared: {:?}",
            if expiry { " (lease expiry)" } else { "" },
            cases(expiry),
            started.elapsed().as_secs_f64(),
            too_slow.get(),
            tally.borrow()
        ),
        Err(TestError::Fail(reason, _)) => {
            panic!("{name} differs from decide's oracle (shrunk case): {reason}")
        }
        Err(error) => panic!("{name}: {error}"),
    }
    if name == "mysql" {
        assert_took_both_mysql_paths(&store_url);
    }
}

/// The MySQL store (without a lease layer) begins and ends a turn with one
/// `CALL` in the common case and falls back to the full read-decide-write
/// path otherwise; the cases above compared both with decide only if they
/// took both, on this target's own database.
fn assert_took_both_mysql_paths(store_url: &str) {
    let paths = agentgate_store_mysql::testing::fast_paths(store_url);
    println!("mysql fast paths: {paths:?}");
    assert!(
        paths.begins_started > 0
            && paths.begins_declined > 0
            && paths.endings_done > 0
            && paths.endings_declined > 0,
        "the cases missed a fast path or its fallback: {paths:?}"
    );
}

#[test]
fn sqlite_agrees_with_decide() {
    differential(targets::sqlite, false);
}

#[test]
fn sqlite_with_redis_agrees_with_decide() {
    differential(targets::sqlite_redis, false);
}

#[test]
fn postgres_agrees_with_decide() {
    differential(targets::postgres, false);
}

#[test]
fn postgres_with_redis_agrees_with_decide() {
    differential(targets::postgres_redis, false);
}

#[test]
fn mysql_agrees_with_decide() {
    differential(targets::mysql, false);
}

#[test]
fn mysql_with_redis_agrees_with_decide() {
    differential(targets::mysql_redis, false);
}

#[test]
fn sqlite_agrees_with_decide_across_lease_expiry() {
    differential(targets::sqlite, true);
}

#[test]
fn sqlite_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::sqlite_redis, true);
}

#[test]
fn postgres_agrees_with_decide_across_lease_expiry() {
    differential(targets::postgres, true);
}

#[test]
fn postgres_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::postgres_redis, true);
}

#[test]
fn mysql_agrees_with_decide_across_lease_expiry() {
    differential(targets::mysql, true);
}

#[test]
fn mysql_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::mysql_redis, true);
}

/// The first difference this test found (a store bug, fixed by keeping a
/// continuation's carried action in `confirms_pending`), as one fixed case
/// on every store: begin, await confirmation of action 0, confirm it
/// (reject), and have the continuation await confirmation of action 1. The
/// ended view must show `pending` {"action":1} and `confirmation.pending`
/// {"action":0}, as decide's oracle does.
#[test]
fn a_continuation_awaiting_confirmation_shows_its_own_pending() {
    let ops = vec![
        Op::Begin {
            user: 0,
            session: 1,
            request: 0,
            payload: 0,
        },
        Op::End {
            lease: 0,
            how: EndKind::AwaitConfirmation(0),
        },
        Op::Confirm {
            user: 0,
            session: 1,
            request: 1,
            target: 0,
            approve: false,
        },
        Op::End {
            lease: 0,
            how: EndKind::AwaitConfirmation(1),
        },
    ];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    runtime.block_on(async {
        let all = [
            targets::sqlite().await,
            targets::sqlite_redis().await,
            targets::postgres().await,
            targets::postgres_redis().await,
            targets::mysql().await,
            targets::mysql_redis().await,
        ];
        for target in all.into_iter().flatten() {
            let gate = target.gate(config(false)).await;
            if let Err(Failure::Differ(_, difference)) =
                run_case(gate.store(), "fixed".to_owned(), &ops, false).await
            {
                panic!("{} differs from decide's oracle: {difference}", target.name);
            }
        }
    });
}
