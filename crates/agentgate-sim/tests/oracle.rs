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
//!   confirmation, remaining lease) or replayed (the whole turn view), the
//!   error code (with the turn or execution it names, the cap, and the
//!   retry-after), `execute` (attempt,
//!   previous outcome, idempotency key) or cached (result), stored results,
//!   ended turn views; orphan listings (turn, request, payload, fence,
//!   attempt, superseded), abandonments, a recovery worker's claims (the
//!   grant, the payload, the tool journal), sweep reports;
//! - the writes it made visible: after every step, the view of every turn
//!   seen so far, its tool executions, both sessions and both users; after
//!   a completion whose effect writes a ledger row in the store's own
//!   transaction (`Completion::Effect`), the case's ledger rows (an effect
//!   that fails after its write must leave none).
//!
//! Generated ids (turns, executions, lease tokens) differ between stores, so
//! they are compared by role: the n-th turn or execution either store shows
//! is `T<n>` / `E<n>`, and fences by their rank among the fences seen.
//! Times are compared at a grain: a remaining lease, a renewal's and a
//! retry-after are rounded up to 10 s ([`GRAIN`]), since the two stores
//! read different clocks a moment apart (`created_at_ms` is not compared).
//!
//! Steps also cover a cancel request and an operator's force-release
//! (made without the lease), event appends (a stale lease's is a zombie's)
//! and event reads. Where both sides would share a bug in `decide`, steps
//! are held to the protocol directly as well ([`Rules`], [`expected_repeat`]).
//!
//! Three kinds of cases per store:
//! - `*_agrees_with_decide`: the longest lease TTL, so no lease expires
//!   within a case; `AGENTGATE_ORACLE_CASES` (default 32) cases.
//! - `*_agrees_with_decide_across_lease_expiry`: a 500 ms TTL and sleep
//!   steps of 650 ms. The oracle's clock is tokio's (unpaused: real time)
//!   and the store's is the database's, so nothing drives both; instead
//!   every segment between sleeps must finish within 350 ms, so each lease
//!   is clearly live within its segment and clearly expired after the next
//!   sleep on both clocks (a slower segment rejects the case rather than
//!   fail it). This covers takeovers, expired heartbeats and claims,
//!   orphans listed, abandoned and claimed by a recovery worker, and a turn
//!   that ran out of attempts. `AGENTGATE_ORACLE_EXPIRY_CASES` (default 8)
//!   cases.
//! - `*_agrees_with_decide_across_retention`: the shortest confirmation
//!   TTL, result retention and orphan grace (1 s each), a 1 s lease TTL,
//!   and segments of at most 800 ms separated by sleeps of 2.15 s, past
//!   every one of those (and their sums) begun before the sleep: late
//!   confirmations, sweeps that delete ended turns, their executions and
//!   idle sessions and abandon orphans past their grace, what stays (running
//!   turns, what ended in the current segment). Each case runs on a fresh
//!   store, so the sweep's counts are the case's alone.
//!   `AGENTGATE_ORACLE_RETENTION_CASES` (default 2) cases.
//!
//! `SimStore` models what the stores do beyond `decide`: the effect's
//! writes committed with the success mark, the sweep's deletions, and,
//! where a lease layer keeps no expiry in the rows (the Redis targets), an
//! orphan's age counted from the listing that first found it unheld
//! (`OrphanClock::FirstListed`). One fixed timed case on every store
//! (`expiry_confirmation_orphans_and_sweep_agree_on_every_store`) reaches
//! for certain what the generated cases reach by chance.
//!
//! `decide` cannot be its own oracle for what it gets wrong, so one step
//! kind is also held to the protocol directly: [`Op::ClaimAgain`], the same
//! holder claiming a call twice under one lease, must be refused
//! `tool_in_flight` while its first execution runs (never execute again),
//! answered cached with the stored result after the holder completed it,
//! and run again (attempt + 1) after the holder failed it
//! (docs/protocol.md §2.4, §3.3; [`expected_repeat`]). Both stores are held to
//! that, the simulated one included.
//!
//! A difference fails with the shrunk step sequence (the steps up to the
//! first difference). SQLite always runs; PostgreSQL, MySQL and the Redis
//! lease layer run when their servers are up (see
//! `agentgate_conformance::targets`). The first difference it found, a store
//! bug now fixed, stays as a fixed case on every store
//! (`a_continuation_awaiting_confirmation_shows_its_own_pending`).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentgate::{BoxError, Config, Error};
use agentgate_conformance::targets::{self, Target};
use agentgate_core::canonical::{canonicalize, CanonicalJson};
use agentgate_core::ids::{ClientRequestId, ExecutionId, SessionId, ToolName, TurnId, UserId};
use agentgate_core::model::{
    idempotency_key, BeginCommand, BeginOutcome, Confirmation, ConfirmationContext, Decision,
    Ending, ExecutionView, LeaseRef, NewEvent, Orphan, OrphanFilter, ToolCall, ToolClaim, TurnView,
};
use agentgate_core::store::{all_executions, BoxFuture, Completion, SqlEffect, Store};
use agentgate_sim::history::History;
use agentgate_sim::store::{Clock, Mutation, OrphanClock, SimConnection, SimStore};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestError, TestRunner};
use serde_json::{json, Value};
use sqlx::Connection;

#[path = "support/plants.rs"]
mod plants;

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
/// The retention cases' confirmation TTL, result retention and orphan
/// grace: the shortest each may be (1 s), so a sleep can outlast them.
const RETENTION_TTLS: Duration = agentgate::limits::MIN_RETENTION;
/// A retention case's sleep: past everything a segment started, with
/// 150 ms to spare on both clocks: a lease ([`RETENTION_TTLS`] too), a
/// pending confirmation (1 s), an orphan's grace counted from its lease's
/// expiry (1 + 1 s), a turn's retention (1 s), an awaiting turn's
/// (retention + confirmation TTL, 2 s).
const LONG_SLEEP: Duration = Duration::from_millis(2150);
/// The longest a retention case's segment may take: each of those is then
/// clearly unexpired (by 200 ms) within its own segment, and a segment has
/// time for the slower steps (running a turn out of its attempts is some
/// thirty of them).
const RETENTION_SEGMENT_BOUND: Duration = Duration::from_millis(800);
/// Retention cases per store unless `AGENTGATE_ORACLE_RETENTION_CASES` says
/// otherwise: each sleeps 2–4 s on a fresh store.
const DEFAULT_RETENTION_CASES: u32 = 2;
/// Shrinking bound: a failing case on a server store shrinks in seconds.
const MAX_SHRINK_ITERS: u32 = 512;

/// Which lease a post-grant step carries: 0 is the natural one (the latest
/// grant of the execution's turn for a tool finish, else the latest grant),
/// `k > 0` the `(k - 1) % n`-th grant ever made in the case, which is often
/// a stale lease (an ended turn, or an earlier attempt).
type LeaseSel = u8;

/// The three kinds of cases (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// No lease expires within a case.
    Steady,
    /// Leases expire: sleeps of [`SLEEP`].
    Expiry,
    /// Leases, pending confirmations, orphan graces and result retention
    /// run out: sleeps of [`LONG_SLEEP`], sweeps, a fresh store per case.
    Retention,
}

impl Kind {
    /// Whether its steps are bound in time ([`SEGMENT_BOUND`]).
    fn timed(self) -> bool {
        self != Self::Steady
    }

    /// The longest a segment between sleeps may take.
    fn bound(self) -> Duration {
        match self {
            Self::Retention => RETENTION_SEGMENT_BOUND,
            Self::Steady | Self::Expiry => SEGMENT_BOUND,
        }
    }

    fn sleep(self) -> Duration {
        match self {
            Self::Retention => LONG_SLEEP,
            Self::Steady | Self::Expiry => SLEEP,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Steady => "",
            Self::Expiry => " (lease expiry)",
            Self::Retention => " (retention)",
        }
    }
}

/// What the holder does between a claim and its repeat ([`Op::ClaimAgain`]).
#[derive(Clone, Debug)]
enum Between {
    /// Nothing: the first execution is still running.
    Nothing,
    /// Completes the first execution with this result.
    Complete(u8),
    /// Fails the first execution.
    Fail,
}

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
    /// Only in the timed cases: wait [`Kind::sleep`], past every lease
    /// granted or renewed so far (and in the retention cases past every
    /// confirmation TTL, orphan grace and retention begun so far).
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
    /// A claim, then (when it was answered execute) the holder completes or
    /// fails that execution or does nothing, then the same claim under the
    /// same lease again, as a client whose answer was lost: the repeat's
    /// answer is held to [`expected_repeat`].
    ClaimAgain {
        lease: LeaseSel,
        tool: u8,
        args: u8,
        between: Between,
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
    /// `Store::orphans` of the case's users (or of one), of one turn or
    /// any, of any age or only those orphaned an hour (none).
    Orphans {
        user: Option<u8>,
        turn: Option<u8>,
        aged: bool,
    },
    /// `Store::abandon` of one orphan of the latest listing (it may have
    /// been taken over or ended since).
    Abandon {
        orphan: u8,
    },
    /// `Store::claim_orphan` of one turn: a begin that resumes it.
    ClaimOrphan {
        turn: u8,
    },
    /// A completion whose effect books a ledger row in the store's own
    /// transaction, failing after the write when `fail` (rolled back).
    CompleteEffect {
        lease: LeaseSel,
        exec: u8,
        amount: u8,
        fail: bool,
    },
    /// Fails the latest grant's turn retryably and repeats the latest begin,
    /// again and again, until a step does something else: the turn runs out
    /// of attempts (`MAX_TURN_ATTEMPTS`), its next repeat is exhausted.
    RunOutAttempts,
    /// Only in the retention cases: `Store::sweep`.
    Sweep,
    /// `Store::request_cancel` of the `turn`-th turn, made without its
    /// lease (from another node or an operator): a running turn records the
    /// request once, an ended one changes nothing; later claims of the turn
    /// are refused `turn_cancelled` and its heartbeat reports it.
    Cancel {
        turn: u8,
    },
    /// `Store::force_release` of a session's holder (only of the
    /// `only`-th turn when given): the operator's release, which fences
    /// every later write of that holder.
    ForceRelease {
        session: u8,
        only: Option<u8>,
    },
    /// `Store::append_events` of `count` events under a lease (a stale one
    /// is a zombie's append, which must be refused).
    Emit {
        lease: LeaseSel,
        count: u8,
    },
    /// `Store::events` of the `turn`-th turn after the event id `after`.
    ReadEvents {
        turn: u8,
        after: u8,
    },
}

fn lease_sel() -> impl Strategy<Value = LeaseSel> {
    prop_oneof![3 => Just(0u8), 1 => 1u8..8]
}

fn user() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(0u8), 1 => Just(1u8)]
}

/// A case: each user's cap set first (1, 2, or the default 2) or, in half
/// the cases, not at all, so a user's first begin also finds no user row
/// (the common first use); then 20–40 steps; in the expiry cases, some of them sleeps. A retention case is two
/// or three segments of 8–16 steps with one sleep between each two.
fn case(kind: Kind) -> BoxedStrategy<Vec<Op>> {
    let cap = prop::option::of(prop::option::of(1u32..=2));
    let steps = match kind {
        Kind::Steady => prop::collection::vec(op(), 20..=40).boxed(),
        // A sleep is mostly followed by a look for orphans.
        Kind::Expiry => prop::collection::vec(
            prop_oneof![
                30 => op().prop_map(|op| vec![op]),
                3 => recovery_op().prop_map(|op| vec![op]),
                1 => Just(vec![Op::Sleep]),
                1 => recovery_op().prop_map(|op| vec![Op::Sleep, op]),
            ],
            20..=40,
        )
        .prop_map(|steps| steps.into_iter().flatten().collect())
        .boxed(),
        // Turns started, tools claimed, turns ended (some awaiting a
        // confirmation) before the sleep; after it, what ran out: orphans,
        // late confirmations, sweeps. A third segment, after a second sleep,
        // sees orphans first listed in the second (a lease layer counts
        // their grace from then).
        Kind::Retention => {
            let setup = prop::collection::vec(
                prop_oneof![
                    4 => begin_op(),
                    4 => claim_op(),
                    2 => claim_again_op(),
                    2 => effect_op(),
                    2 => complete_op(),
                    3 => end_op(),
                    2 => op(),
                ],
                10..=16,
            );
            // Each starts with a listing or a claim, before any sweep
            // abandons what the sleep orphaned.
            let after = || {
                (
                    recovery_op(),
                    prop::collection::vec(
                        prop_oneof![
                            3 => recovery_op(),
                            2 => confirm_op(),
                            2 => Just(Op::Sweep),
                            2 => begin_op(),
                            1 => Just(Op::Repeat),
                            3 => op(),
                        ],
                        8..=14,
                    ),
                )
                    .prop_map(|(first, rest)| {
                        let mut all = vec![first];
                        all.extend(rest);
                        all
                    })
            };
            (setup, after(), prop::option::weighted(0.25, after()))
                .prop_map(|(first, second, third)| {
                    let mut all = first;
                    for next in std::iter::once(second).chain(third) {
                        all.push(Op::Sleep);
                        all.extend(next);
                    }
                    all
                })
                .boxed()
        }
    };
    (cap.clone(), cap, steps)
        .prop_map(|(cap0, cap1, ops)| {
            let mut all: Vec<Op> = [(0, cap0), (1, cap1)]
                .into_iter()
                .filter_map(|(user, cap)| cap.map(|cap| Op::SetCap { user, cap }))
                .collect();
            all.extend(ops);
            all
        })
        .boxed()
}

/// The steps that matter once leases have expired: listing, abandoning and
/// claiming orphans.
fn recovery_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::option::of(user()), prop::option::of(0u8..6), prop::bool::weighted(0.1))
            .prop_map(|(user, turn, aged)| Op::Orphans { user, turn, aged }),
        2 => (0u8..4).prop_map(|orphan| Op::Abandon { orphan }),
        2 => (0u8..6).prop_map(|turn| Op::ClaimOrphan { turn }),
    ]
}

// Mostly user 0, so one user holds both sessions and meets its cap; user 1
// mostly finds user 0's sessions not its own.
fn begin_op() -> impl Strategy<Value = Op> {
    (user(), 0u8..2, 0u8..3, 0u8..2).prop_map(|(user, session, request, payload)| Op::Begin {
        user,
        session,
        request,
        payload,
    })
}

fn confirm_op() -> impl Strategy<Value = Op> {
    (user(), 0u8..2, 0u8..3, 0u8..6, any::<bool>()).prop_map(
        |(user, session, request, target, approve)| Op::Confirm {
            user,
            session,
            request,
            target,
            approve,
        },
    )
}

fn claim_op() -> impl Strategy<Value = Op> {
    (lease_sel(), 0u8..2, 0u8..2).prop_map(|(lease, tool, args)| Op::Claim { lease, tool, args })
}

fn claim_again_op() -> impl Strategy<Value = Op> {
    let between = prop_oneof![
        2 => Just(Between::Nothing),
        1 => (0u8..2).prop_map(Between::Complete),
        1 => Just(Between::Fail),
    ];
    (lease_sel(), 0u8..2, 0u8..2, between).prop_map(|(lease, tool, args, between)| Op::ClaimAgain {
        lease,
        tool,
        args,
        between,
    })
}

fn complete_op() -> impl Strategy<Value = Op> {
    (lease_sel(), 0u8..6, 0u8..2).prop_map(|(lease, exec, result)| Op::Complete {
        lease,
        exec,
        result,
    })
}

fn effect_op() -> impl Strategy<Value = Op> {
    (lease_sel(), 0u8..6, 0u8..3, prop::bool::weighted(0.3)).prop_map(
        |(lease, exec, amount, fail)| Op::CompleteEffect {
            lease,
            exec,
            amount,
            fail,
        },
    )
}

fn end_op() -> impl Strategy<Value = Op> {
    let end = prop_oneof![
        2 => (0u8..2).prop_map(EndKind::Succeed),
        2 => any::<bool>().prop_map(|retryable| EndKind::Fail { retryable }),
        1 => (0u8..2).prop_map(EndKind::AwaitConfirmation),
    ];
    (lease_sel(), end).prop_map(|(lease, how)| Op::End { lease, how })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // First, so shrinking replaces the steps a failure does not need.
        1 => Just(Op::Idle),
        6 => begin_op(),
        3 => Just(Op::Repeat),
        1 => confirm_op(),
        1 => (0u8..2, prop::option::of(1u32..=2)).prop_map(|(user, cap)| Op::SetCap { user, cap }),
        2 => lease_sel().prop_map(|lease| Op::Heartbeat { lease }),
        5 => claim_op(),
        2 => claim_again_op(),
        4 => complete_op(),
        2 => effect_op(),
        2 => (lease_sel(), 0u8..6).prop_map(|(lease, exec)| Op::FailTool { lease, exec }),
        4 => end_op(),
        1 => (0u8..6).prop_map(|turn| Op::ViewTurn { turn }),
        1 => (0u8..2).prop_map(|session| Op::ViewSession { session }),
        1 => (0u8..2).prop_map(|user| Op::ViewUser { user }),
        1 => Just(Op::RunOutAttempts),
        1 => (0u8..6).prop_map(|turn| Op::Cancel { turn }),
        1 => (0u8..2, prop::option::weighted(0.3, 0u8..6))
            .prop_map(|(session, only)| Op::ForceRelease { session, only }),
        2 => (lease_sel(), 1u8..4).prop_map(|(lease, count)| Op::Emit { lease, count }),
        1 => (0u8..6, 0u8..4).prop_map(|(turn, after)| Op::ReadEvents { turn, after }),
    ]
}

fn config(kind: Kind) -> Config {
    match kind {
        Kind::Steady => Config {
            lease_ttl: LEASE_TTL,
            max_turns_per_user: DEFAULT_CAP,
            ..Config::default()
        },
        Kind::Expiry => Config {
            lease_ttl: SHORT_TTL,
            max_turns_per_user: DEFAULT_CAP,
            // No sweeper may abandon an orphan within a case: the oracle
            // has none running.
            orphan_grace: agentgate::limits::MAX_ORPHAN_GRACE,
            ..Config::default()
        },
        Kind::Retention => Config {
            lease_ttl: RETENTION_TTLS,
            max_turns_per_user: DEFAULT_CAP,
            confirmation_ttl: RETENTION_TTLS,
            result_retention: RETENTION_TTLS,
            orphan_grace: RETENTION_TTLS,
            // Sweeps are the case's own steps: the gate's background
            // sweeper never runs within one.
            sweep_interval: agentgate::limits::MAX_RETENTION,
            ..Config::default()
        },
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
    /// The latest orphan listing, by role, for [`Op::Abandon`].
    last_orphans: Vec<Orphan>,
    /// The fingerprint of the begin that created each turn: what an orphan
    /// listing must show. (Not compared across stores: a confirmation's
    /// fingerprint covers the confirmed turn's id, which differs.)
    fingerprints: HashMap<String, String>,
    /// Where the store's same-transaction effects land.
    ledger: Ledger,
    /// How the latest step broke the protocol on this store, where the
    /// test checks it directly ([`expected_repeat`], [`Rules`]).
    broken: Option<String>,
    /// What the protocol rules held directly need to remember.
    rules: Rules,
}

/// Rules of docs/protocol.md the oracle holds both sides to directly, not
/// through `decide` (which both sides share, so a bug in it makes them
/// agree): the independent reference for what `decide` itself could get
/// wrong. Each is a fact of the case's own history.
///
/// - A request id names one turn of its session: a begin of the same
///   `(session, request)` by the turn's user with another payload is
///   refused `payload_mismatch` (§3.1), whatever state the turn is in. (Not
///   after a sweep, which may have deleted the turn.)
/// - A turn whose cancel was recorded (§3.7) has every later tool claim
///   refused: none executes, none answers cached.
/// - No turn starts an attempt past `MAX_TURN_ATTEMPTS` (§3.1).
/// - A pending confirmation left before a sleep longer than the
///   confirmation TTL confirms nothing after it (§3.5): no continuation
///   starts.
#[derive(Default)]
struct Rules {
    /// Sleeps so far, and how long each was.
    sleeps: u32,
    sleep: Duration,
    /// Turns that ended awaiting a confirmation, with the sleeps before.
    awaiting: HashMap<String, u32>,
    /// `(session, request)` → the user and fingerprint of the turn it names.
    requests: HashMap<(String, String), (String, String)>,
    /// Turns whose cancel request was recorded.
    cancelled: BTreeSet<String>,
    /// Whether a sweep ran (turns may be gone).
    swept: bool,
}

impl Side {
    fn new(store: Arc<dyn Store>, ledger: Ledger) -> Self {
        Self {
            store,
            last_orphans: Vec::new(),
            fingerprints: HashMap::new(),
            ledger,
            broken: None,
            rules: Rules::default(),
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
            Error::SessionBusy {
                active_turn_id,
                retry_after,
            } => format!(
                "session_busy({}) retry {}",
                self.turn(active_turn_id),
                within(*retry_after)
            ),
            Error::RequestInFlight {
                active_turn_id,
                retry_after,
            } => format!(
                "request_in_flight({}) retry {}",
                self.turn(active_turn_id),
                within(*retry_after)
            ),
            Error::AwaitingConfirmation {
                pending_turn_id,
                retry_after,
            } => format!(
                "awaiting_confirmation({}) retry {}",
                self.turn(pending_turn_id),
                within(*retry_after)
            ),
            Error::ToolInFlight {
                execution_id,
                retry_after,
                ..
            } => {
                let role = self
                    .execs
                    .get(execution_id)
                    .map_or_else(|| "E?".to_owned(), |r| format!("E{r}"));
                format!("tool_in_flight({role}) retry {}", within(*retry_after))
            }
            Error::UserAtCapacity { cap, retry_after } => {
                format!("user_at_capacity(cap {cap}) retry {}", within(*retry_after))
            }
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
             pending {} confirmation {confirmation} confirmed_by {confirmed_by} cancel_requested {}",
            v.session_id,
            v.user_id,
            v.client_request_id,
            v.state.as_str(),
            v.attempt,
            opt_canon(v.response.as_ref()),
            opt_canon(v.error.as_ref()),
            v.retryable,
            opt_canon(v.pending.as_ref()),
            v.cancel_requested_at_ms.is_some(),
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

    /// A listing of orphans, by role; kept for [`Op::Abandon`].
    fn orphans(&mut self, found: Vec<Orphan>) -> String {
        let mut listed: Vec<(String, String, Orphan)> = Vec::new();
        for orphan in found {
            let turn = self.turn(orphan.turn_id.as_str());
            let fence = self.fence(orphan.fence.0);
            let line = format!(
                "{turn} {}/{}/{} attempt {} {fence} payload {} fingerprint_ok {} superseded {} age_ok {}",
                orphan.session_id,
                orphan.user_id,
                orphan.client_request_id,
                orphan.attempt,
                orphan.payload.as_ref().map_or("-", |p| p.as_str()),
                self.fingerprints.get(orphan.turn_id.as_str()).map(String::as_str)
                    == Some(orphan.fingerprint.as_hex()),
                orphan.superseded,
                orphan.orphaned_for_ms >= 0,
            );
            listed.push((turn, line, orphan));
        }
        listed.sort_by(|a, b| (a.0.len(), &a.0).cmp(&(b.0.len(), &b.0)));
        let lines: Vec<String> = listed.iter().map(|(_, line, _)| line.clone()).collect();
        self.last_orphans = listed.into_iter().map(|(_, _, orphan)| orphan).collect();
        if lines.is_empty() {
            "orphans: none".to_owned()
        } else {
            format!("orphans: {lines:?}")
        }
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

/// Where a side's same-transaction effects land: the simulated store's
/// committed effects, or the real store's ledger table
/// (`agentgate_conformance::ledger`).
enum Ledger {
    Sim(Arc<SimStore>),
    Sql(String),
}

/// The ledger rows the case `prefix` booked, sorted.
async fn booked(ledger: &Ledger, prefix: &str) -> Vec<(String, i64)> {
    let mut rows: Vec<(String, i64)> = match ledger {
        Ledger::Sim(sim) => sim
            .effects()
            .iter()
            .map(|row| {
                (
                    row["entry_key"].as_str().unwrap_or("?").to_owned(),
                    row["amount"].as_i64().unwrap_or(-1),
                )
            })
            .collect(),
        Ledger::Sql(url) => sql_booked(url, &format!("{prefix}/%")).await,
    };
    rows.sort();
    rows
}

async fn sql_booked(url: &str, like: &str) -> Vec<(String, i64)> {
    let sql = "SELECT entry_key, amount FROM conformance_ledger WHERE entry_key LIKE ?";
    let rows = match url.split(':').next().unwrap_or_default() {
        "sqlite" => {
            let mut conn = sqlx::SqliteConnection::connect(url).await.expect("connect");
            sqlx::query_as(sql).bind(like).fetch_all(&mut conn).await
        }
        "postgres" | "postgresql" => {
            let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
            sqlx::query_as(
                "SELECT entry_key, amount FROM conformance_ledger WHERE entry_key LIKE $1",
            )
            .bind(like)
            .fetch_all(&mut conn)
            .await
        }
        "mysql" | "mariadb" => {
            // The test database's default character set is binary: the key
            // reads back as bytes.
            let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
            sqlx::query_as::<_, (Vec<u8>, i64)>(sql)
                .bind(like)
                .fetch_all(&mut conn)
                .await
                .map(|rows| {
                    rows.into_iter()
                        .map(|(key, amount)| (String::from_utf8_lossy(&key).into_owned(), amount))
                        .collect()
                })
        }
        other => panic!("no ledger for store scheme {other}"),
    };
    rows.unwrap_or_else(|e| panic!("read the ledger: {e}"))
}

/// A tool's effect in the store's own transaction: one ledger row, then,
/// with `fail_after`, an error (so the row must be rolled back with the
/// success mark).
struct Booking {
    entry_key: String,
    amount: i64,
    fail_after: bool,
}

impl SqlEffect for Booking {
    fn apply<'a>(
        &'a mut self,
        connection: &'a mut (dyn Any + Send),
    ) -> BoxFuture<'a, Result<Value, BoxError>> {
        Box::pin(async move {
            let insert = "INSERT INTO conformance_ledger (entry_key, amount) VALUES (?, ?)";
            if connection.is::<SimConnection>() {
                let sim = connection
                    .downcast_mut::<SimConnection>()
                    .expect("checked by is::<SimConnection>()");
                sim.write(json!({ "entry_key": self.entry_key, "amount": self.amount }));
            } else if connection.is::<sqlx::SqliteConnection>() {
                let conn = connection
                    .downcast_mut::<sqlx::SqliteConnection>()
                    .expect("checked by is::<SqliteConnection>()");
                sqlx::query(insert)
                    .bind(&self.entry_key)
                    .bind(self.amount)
                    .execute(conn)
                    .await?;
            } else if connection.is::<sqlx::PgConnection>() {
                let conn = connection
                    .downcast_mut::<sqlx::PgConnection>()
                    .expect("checked by is::<PgConnection>()");
                sqlx::query("INSERT INTO conformance_ledger (entry_key, amount) VALUES ($1, $2)")
                    .bind(&self.entry_key)
                    .bind(self.amount)
                    .execute(conn)
                    .await?;
            } else if connection.is::<sqlx::MySqlConnection>() {
                let conn = connection
                    .downcast_mut::<sqlx::MySqlConnection>()
                    .expect("checked by is::<MySqlConnection>()");
                sqlx::query(insert)
                    .bind(&self.entry_key)
                    .bind(self.amount)
                    .execute(conn)
                    .await?;
            } else {
                return Err("a connection the oracle's effect does not know".into());
            }
            if self.fail_after {
                return Err("the effect failed after its write".into());
            }
            Ok(json!({ "booked": self.entry_key, "amount": self.amount }))
        })
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
    let answer = begin_answer(side, command).await;
    let key = (
        command.session_id.as_str().to_owned(),
        command.client_request_id.as_str().to_owned(),
    );
    let user = command.user_id.as_str();
    let fingerprint = command.fingerprint.as_hex();
    match side.rules.requests.get(&key) {
        Some((owner, first))
            if owner == user
                && first != fingerprint
                && !side.rules.swept
                && answer != "error payload_mismatch" =>
        {
            side.broken = Some(format!(
                "request {}/{} names a turn begun with another payload: a begin with this one \
                 must be refused payload_mismatch (docs/protocol.md §3.1), not answered {answer}",
                key.0, key.1
            ));
        }
        None if answer.starts_with("started ") => {
            side.rules
                .requests
                .insert(key, (user.to_owned(), fingerprint.to_owned()));
        }
        _ => {}
    }
    let limit = agentgate::limits::MAX_TURN_ATTEMPTS;
    if let Some(attempt) = answer
        .strip_prefix("started ")
        .and_then(|rest| rest.split(" attempt ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok())
    {
        if attempt > limit {
            side.broken = Some(format!(
                "a turn started attempt {attempt}, past MAX_TURN_ATTEMPTS ({limit}): {answer}"
            ));
        }
    }
    answer
}

async fn begin_answer(side: &mut Side, command: &BeginCommand) -> String {
    match side.store.begin(command).await {
        Ok(BeginOutcome::Started(grant)) => {
            side.fingerprints
                .entry(grant.turn_id.as_str().to_owned())
                .or_insert_with(|| command.fingerprint.as_hex().to_owned());
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
                "started {turn} {fence} attempt {} takeover {} ids_match {same} lease {} confirmation {confirmation}",
                grant.attempt,
                grant.takeover,
                within_ms(grant.lease_expires_in_ms),
            )
        }
        Ok(BeginOutcome::Replay(view)) => format!("replay {}", side.turn_view(&view)),
        // The oracle's commands never queue (the simulation models no
        // queue); a queued answer is a difference like any other.
        Ok(BeginOutcome::Queued(queued)) => format!("queued at {}", queued.position),
        Err(error) => side.error(&error),
    }
}

const NO_LEASE: &str = "skipped: no lease yet";

/// The grain time values are compared at: both stores read their own clock
/// (real time on both), a moment apart, so a remaining lease or a
/// retry-after is compared as the multiple of [`GRAIN`] it rounds up to.
/// A remaining time read within a case is its full length (a lease TTL, a
/// confirmation TTL) less the case's few seconds at most, so it rounds to
/// the same grain on both: a store that keeps a lease or a confirmation for
/// the wrong length, or answers a retry-after of the wrong thing, differs.
const GRAIN: Duration = Duration::from_secs(10);

/// `remaining` as "≤ n s", rounded up to [`GRAIN`]; "none" when not positive.
fn within(remaining: Duration) -> String {
    let grain = GRAIN.as_millis();
    match remaining.as_millis() {
        0 => "none".to_owned(),
        ms => format!("<={}s", ms.div_ceil(grain) * grain / 1000),
    }
}

/// [`within`] of a count of milliseconds (a negative count is none).
fn within_ms(ms: i64) -> String {
    within(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

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
                Some(Confirmation {
                    turn_id: turn_id.clone(),
                    decision,
                }),
            ));
            let answer = begin(side, &command).await;
            let asked = turn_id.as_str();
            let expired = side.rules.awaiting.get(asked).is_some_and(|at| {
                *at < side.rules.sleeps && side.rules.sleep > side.store.config().confirmation_ttl
            });
            if expired && answer.starts_with("started ") {
                side.broken = Some(format!(
                    "a confirmation of {}, pending since before a sleep longer than the \
                     confirmation TTL, started a continuation: {answer} (docs/protocol.md §3.5)",
                    side.turn(asked)
                ));
            }
            answer
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
                Ok(status) => format!(
                    "renewed for {} cancel_requested {}",
                    within_ms(status.lease_expires_in_ms),
                    status.cancel_requested
                ),
                Err(error) => side.error(&error),
            }
        }
        Op::Claim { lease, tool, args } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            claim(side, &lease, &tool_call(*tool, *args)).await.0
        }
        Op::ClaimAgain {
            lease,
            tool,
            args,
            between,
        } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            Box::pin(claim_again(side, &lease, &tool_call(*tool, *args), between)).await
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
                Ok(view) => {
                    if view.state == agentgate::TurnState::AwaitingConfirmation {
                        let sleeps = side.rules.sleeps;
                        side.rules
                            .awaiting
                            .insert(view.turn_id.as_str().to_owned(), sleeps);
                    }
                    format!("ended {}", side.turn_view(&view))
                }
                Err(error) => side.error(&error),
            }
        }
        Op::Cancel { turn } => {
            let Some(turn_id) = side.turn_by_role(*turn) else {
                return "skipped: no turn yet".to_owned();
            };
            match side.store.request_cancel(&turn_id).await {
                Ok(Some(view)) => {
                    if view.cancel_requested_at_ms.is_some() {
                        side.rules.cancelled.insert(turn_id.as_str().to_owned());
                    }
                    format!("cancel {}", side.turn_view(&view))
                }
                Ok(None) => "no such turn".to_owned(),
                Err(error) => side.error(&error),
            }
        }
        Op::ForceRelease { session, only } => {
            let only = match only {
                None => None,
                Some(role) => match side.turn_by_role(*role) {
                    Some(turn_id) => Some(turn_id),
                    None => return "skipped: no turn yet".to_owned(),
                },
            };
            match side
                .store
                .force_release(&names.session(*session), only.as_ref())
                .await
            {
                Ok(Some(view)) => format!("released {}", side.turn_view(&view)),
                Ok(None) => "released nothing".to_owned(),
                Err(error) => side.error(&error),
            }
        }
        Op::Emit { lease, count } => {
            let Some(lease) = side.lease(*lease, None) else {
                return NO_LEASE.to_owned();
            };
            let events: Vec<NewEvent> = (0..*count)
                .map(|n| valid(NewEvent::new("progress", &json!({ "n": n }))))
                .collect();
            match side.store.append_events(&lease, &events).await {
                Ok(last) => format!("appended through {last}"),
                Err(error) => side.error(&error),
            }
        }
        Op::ReadEvents { turn, after } => {
            let Some(turn_id) = side.turn_by_role(*turn) else {
                return "skipped: no turn yet".to_owned();
            };
            match side.store.events(&turn_id, u64::from(*after), 100).await {
                Ok(Some(page)) => format!(
                    "events of a {} turn, attempt {}: {:?}",
                    page.state.as_str(),
                    page.attempt,
                    page.events
                        .iter()
                        .map(|e| format!("{}@{} {} {}", e.event_id, e.attempt, e.name, e.data))
                        .collect::<Vec<_>>()
                ),
                Ok(None) => "no such turn".to_owned(),
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
        Op::Orphans { user, turn, aged } => {
            Box::pin(list_orphans(side, names, *user, *turn, *aged)).await
        }
        Op::Abandon { orphan } => {
            if side.last_orphans.is_empty() {
                return "skipped: no orphan listed".to_owned();
            }
            let orphan = side.last_orphans[usize::from(*orphan) % side.last_orphans.len()].clone();
            let turn = side.turn(orphan.turn_id.as_str());
            match side.store.abandon(&orphan).await {
                Ok(done) => format!("abandoned {done} {turn}"),
                Err(error) => side.error(&error),
            }
        }
        Op::ClaimOrphan { turn } => Box::pin(claim_orphan(side, names, *turn)).await,
        Op::CompleteEffect {
            lease,
            exec,
            amount,
            fail,
        } => {
            let Some((execution_id, turn_id)) = side.exec_by_role(*exec) else {
                return "skipped: no execution yet".to_owned();
            };
            let Some(lease) = side.lease(*lease, Some(&turn_id)) else {
                return NO_LEASE.to_owned();
            };
            let role = side.execs[execution_id.as_str()];
            let mut booking = Booking {
                entry_key: format!("{}/E{role}", names.prefix),
                amount: i64::from(*amount),
                fail_after: *fail,
            };
            let answer = match side
                .store
                .complete_tool(&lease, &execution_id, Completion::Effect(&mut booking))
                .await
            {
                Ok(stored) => format!("booked {}", canon(&stored)),
                Err(error) => side.error(&error),
            };
            let ledger = booked(&side.ledger, &names.prefix).await;
            format!("{answer} ledger {ledger:?}")
        }
        Op::RunOutAttempts => Box::pin(run_out_attempts(side)).await,
        Op::Sweep => {
            side.rules.swept = true;
            match side.store.sweep().await {
                Ok(report) => format!(
                    "swept abandoned {} turns {} executions {} sessions {}",
                    report.abandoned, report.turns, report.executions, report.sessions
                ),
                Err(error) => side.error(&error),
            }
        }
    }
}

/// The call `tool{tool}` with args `{"arg": args}`.
fn tool_call(tool: u8, args: u8) -> ToolCall {
    valid(ToolCall::new(
        valid(ToolName::new(format!("tool{tool}"))),
        &json!({ "arg": args }),
    ))
}

/// A claim's answer, as far as [`expected_repeat`] needs it.
#[derive(Clone, Debug)]
enum Claimed {
    Execute {
        exec: String,
        execution_id: ExecutionId,
        attempt: u32,
    },
    Cached {
        exec: String,
        result: String,
    },
    Refused,
}

/// Claims `call` under `lease`: the normalized answer, and what it was.
async fn claim(side: &mut Side, lease: &LeaseRef, call: &ToolCall) -> (String, Claimed) {
    let (answer, claimed) = claim_answer(side, lease, call).await;
    if side.rules.cancelled.contains(lease.turn_id.as_str())
        && !matches!(claimed, Claimed::Refused)
        && side.broken.is_none()
    {
        side.broken = Some(format!(
            "a claim of turn {} after its cancel was recorded was answered {answer}: every \
             later claim is refused (docs/protocol.md §3.7)",
            side.turn(lease.turn_id.as_str())
        ));
    }
    (answer, claimed)
}

async fn claim_answer(side: &mut Side, lease: &LeaseRef, call: &ToolCall) -> (String, Claimed) {
    match side.store.claim_tool(lease, call).await {
        Ok(ToolClaim::Execute {
            execution_id,
            idempotency_key: key,
            attempt,
            previous_outcome,
        }) => {
            let exec = side.exec(execution_id.as_str(), &lease.turn_id);
            let key_ok = key == idempotency_key(&lease.turn_id, call);
            (
                format!(
                    "execute {exec} attempt {attempt} previous {:?} key_ok {key_ok}",
                    previous_outcome.map(|p| p.as_str())
                ),
                Claimed::Execute {
                    exec,
                    execution_id,
                    attempt,
                },
            )
        }
        Ok(ToolClaim::Cached {
            execution_id,
            result,
        }) => {
            let exec = side.exec(execution_id.as_str(), &lease.turn_id);
            let result = canon(&result);
            (
                format!("cached {exec} result {result}"),
                Claimed::Cached { exec, result },
            )
        }
        Err(error) => (side.error(&error), Claimed::Refused),
    }
}

/// [`Op::ClaimAgain`]: claim, do `between` to an execution it started,
/// claim again under the same lease; the repeat's answer is held to
/// [`expected_repeat`] (a violation is left in `side.broken`).
async fn claim_again(
    side: &mut Side,
    lease: &LeaseRef,
    call: &ToolCall,
    between: &Between,
) -> String {
    let (first, claimed) = claim(side, lease, call).await;
    let mid = match (&claimed, between) {
        (Claimed::Execute { execution_id, .. }, Between::Complete(n)) => {
            let result = valid(CanonicalJson::new("result", &json!({ "result": n })));
            match side
                .store
                .complete_tool(lease, execution_id, Completion::Result(result))
                .await
            {
                Ok(stored) => format!("completed {}", canon(&stored)),
                Err(error) => side.error(&error),
            }
        }
        (Claimed::Execute { execution_id, .. }, Between::Fail) => {
            let error = valid(CanonicalJson::new(
                "error",
                &json!({ "code": "tool_broke" }),
            ));
            match side.store.fail_tool(lease, execution_id, &error).await {
                Ok(()) => "failed the execution".to_owned(),
                Err(error) => side.error(&error),
            }
        }
        _ => "-".to_owned(),
    };
    let (again, _) = claim(side, lease, call).await;
    let ttl = side.store.config().lease_ttl;
    let (want_mid, want_again) = expected_repeat(&claimed, &first, between, ttl);
    let broke = |what: &str, got: &str, want: &str| {
        let how = if want.starts_with("tool_in_flight") && got.starts_with("execute") {
            "the holder's repeat of a claim still running under its own lease was answered \
             execute: the tool would run twice"
        } else {
            "the holder's repeat claim under one lease"
        };
        format!(
            "{how} (docs/protocol.md §2.4): first claim answered {first}; {what} answered {got}, \
             the protocol says {want}"
        )
    };
    if let Some(want) = want_mid.filter(|want| *want != mid) {
        side.broken = Some(broke(
            "then the holder's completion or failure",
            &mid,
            &want,
        ));
    } else if let Some(want_again) = want_again.filter(|want| *want != again) {
        let what = if mid == "-" {
            "the repeat".to_owned()
        } else {
            format!("after {mid}, the repeat")
        };
        side.broken = Some(broke(&what, &again, &want_again));
    }
    format!("repeated claim: {first} | {mid} | {again}")
}

/// What the protocol (docs/protocol.md §2.4, §3.3, §3.4) says a holder's
/// repeat of its own claim under the same live lease answers, from the
/// first claim's answer and what the holder did between, and not from
/// `decide`: (what `between` must answer, when it ran; what the repeat must
/// answer).
///
/// - First answered execute, nothing between: the execution runs under
///   the caller's own fence, so `tool_in_flight` naming it, to retry when
///   the lease (granted or renewed within the case: its whole TTL) ends;
///   never execute.
/// - First answered execute, completed with `r` (which must succeed: it is
///   running under the caller's fence): cached, `r`.
/// - First answered execute, failed (which must succeed): execute again,
///   attempt + 1, previous outcome failed; `attempts_exhausted` past
///   `MAX_TOOL_ATTEMPTS`.
/// - First answered cached: cached again, the same result (a stored result
///   never changes).
/// - First refused: the same refusal (a refusal writes nothing, and within
///   one step the lease neither starts nor stops being live), but for
///   `store_unavailable`, which decided nothing.
fn expected_repeat(
    first: &Claimed,
    first_text: &str,
    between: &Between,
    lease_ttl: Duration,
) -> (Option<String>, Option<String>) {
    let (mid, again) = match (first, between) {
        // Retry when the holder's lease ends: granted or renewed within the
        // case, it has its whole TTL left, to the grain.
        (Claimed::Execute { exec, .. }, Between::Nothing) => (
            None,
            format!("tool_in_flight({exec}) retry {}", within(lease_ttl)),
        ),
        (Claimed::Execute { exec, .. }, Between::Complete(n)) => {
            let result = canon(&json!({ "result": n }));
            (
                Some(format!("completed {result}")),
                format!("cached {exec} result {result}"),
            )
        }
        (Claimed::Execute { exec, attempt, .. }, Between::Fail) => (
            Some("failed the execution".to_owned()),
            if *attempt >= agentgate::limits::MAX_TOOL_ATTEMPTS {
                "error attempts_exhausted".to_owned()
            } else {
                format!(
                    "execute {exec} attempt {} previous Some(\"failed\") key_ok true",
                    attempt + 1
                )
            },
        ),
        (Claimed::Cached { exec, result }, _) => (None, format!("cached {exec} result {result}")),
        (Claimed::Refused, _) if first_text.starts_with("store_unavailable") => {
            return (None, None)
        }
        (Claimed::Refused, _) => (None, first_text.to_owned()),
    };
    (mid, Some(again))
}

/// The orphans of the case's users (or of `user`), of one turn or any.
async fn list_orphans(
    side: &mut Side,
    names: &Names,
    user: Option<u8>,
    turn: Option<u8>,
    aged: bool,
) -> String {
    let user_ids = match user {
        Some(user) => vec![names.user(user)],
        None => vec![names.user(0), names.user(1)],
    };
    let turn_ids = match turn {
        None => Vec::new(),
        Some(role) => match side.turn_by_role(role) {
            Some(turn_id) => vec![turn_id],
            None => return "skipped: no turn yet".to_owned(),
        },
    };
    let filter = OrphanFilter {
        min_orphaned_ms: if aged { 3_600_000 } else { 0 },
        user_ids,
        turn_ids,
    };
    match side
        .store
        .orphans(&filter, agentgate::limits::MAX_ORPHAN_SCAN)
        .await
    {
        Ok(found) => side.orphans(found),
        Err(error) => side.error(&error),
    }
}

/// A recovery worker's claim of one turn of the case.
async fn claim_orphan(side: &mut Side, names: &Names, turn: u8) -> String {
    let Some(turn_id) = side.turn_by_role(turn) else {
        return "skipped: no turn yet".to_owned();
    };
    let filter = OrphanFilter {
        min_orphaned_ms: 0,
        user_ids: vec![names.user(0), names.user(1)],
        turn_ids: vec![turn_id],
    };
    let claimed = match side.store.claim_orphan(&filter).await {
        Ok(None) => return "claimed none".to_owned(),
        Ok(Some(claimed)) => claimed,
        Err(error) => return side.error(&error),
    };
    let grant = &claimed.grant;
    let turn = side.turn(grant.turn_id.as_str());
    let fence = side.fence(grant.fence.0);
    let confirmation = side.confirmation(grant.confirmation.as_ref());
    side.grants.push(LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    });
    let mut journal = Vec::new();
    for entry in &claimed.journal {
        let exec = side.exec(entry.execution_id.as_str(), &grant.turn_id);
        let outcome = serde_json::to_string(&entry.outcome).unwrap_or_default();
        journal.push(format!(
            "{exec} {} attempt {} {outcome}",
            entry.tool, entry.attempt
        ));
    }
    journal.sort();
    format!(
        "claimed {turn} {fence} attempt {} takeover {} lease {} confirmation {confirmation} \
         payload {} journal {journal:?}",
        grant.attempt,
        grant.takeover,
        within_ms(grant.lease_expires_in_ms),
        canon(&claimed.payload),
    )
}

/// [`Op::RunOutAttempts`]: fail the latest grant retryably, repeat the
/// latest begin, until either does something else or the turn runs its
/// last attempt (`MAX_TURN_ATTEMPTS`): its next repeat, or a recovery
/// worker's claim once it is orphaned, finds its attempts exhausted.
async fn run_out_attempts(side: &mut Side) -> String {
    let mut answers: Vec<String> = Vec::new();
    // One round past the last attempt: its failure's repeat is exhausted.
    for _ in 0..=agentgate::limits::MAX_TURN_ATTEMPTS {
        let (Some(lease), Some(command)) = (side.grants.last().cloned(), side.last_begin.clone())
        else {
            answers.push("skipped: no begin yet".to_owned());
            break;
        };
        let ending = Ending::Fail {
            error: valid(CanonicalJson::new(
                "error",
                &json!({ "code": "turn_broke" }),
            )),
            retryable: true,
        };
        let ended = match side.store.end_turn(&lease, &ending).await {
            Ok(view) => format!("ended {}", side.turn_view(&view)),
            Err(error) => side.error(&error),
        };
        let go_on = ended.starts_with("ended");
        answers.push(ended);
        if !go_on {
            break;
        }
        let again = begin(side, &command).await;
        let go_on = again.starts_with("started");
        answers.push(again);
        if !go_on {
            break;
        }
    }
    format!("ran {} steps: {}", answers.len(), answers.join(" | "))
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
fn answer_kind(answer: &str) -> String {
    let mut words = answer.split([' ', '(']);
    match words.next().unwrap_or_default() {
        "error" => words.next().unwrap_or_default().to_owned(),
        "ran" => format!(
            "ran out: {}",
            answer_kind(
                answer
                    .split_once(" steps: ")
                    .map_or("", |(_, steps)| steps)
                    .rsplit(" | ")
                    .next()
                    .unwrap_or_default()
            )
        ),
        "orphans:" if answer == "orphans: none" => "orphans none".to_owned(),
        "orphans:" => "orphans listed".to_owned(),
        "abandoned" => answer.split(' ').take(2).collect::<Vec<_>>().join(" "),
        "claimed" if answer == "claimed none" => "claimed none".to_owned(),
        "repeated" => format!(
            "repeated claim: {}",
            answer_kind(answer.rsplit(" | ").next().unwrap_or_default())
        ),
        "swept"
            if answer.ends_with(" turns 0 executions 0 sessions 0")
                && answer.contains("abandoned 0 ") =>
        {
            "swept nothing".to_owned()
        }
        "swept" => "swept".to_owned(),
        "released" if answer == "released nothing" => "released nothing".to_owned(),
        "released" => "released a holder".to_owned(),
        "cancel" => format!(
            "cancel of a {} turn",
            answer.split(' ').nth(3).unwrap_or("?")
        ),
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

/// A real store opened for the oracle: its gate, its ledger table.
struct Opened {
    store: Arc<dyn Store>,
    ledger_url: String,
    /// Orphan age on the store: from the lease's expiry, or from the first
    /// listing where a lease layer keeps no expiry in the rows.
    orphan_clock: OrphanClock,
    _gate: agentgate::Gate,
    _target: Target,
}

async fn open(target: Target, kind: Kind) -> Opened {
    let gate = target.gate(config(kind)).await;
    // After the gate: it creates the SQLite file the ledger goes in.
    agentgate_conformance::ledger::prepare(&target.store_url).await;
    Opened {
        store: Arc::clone(gate.store()),
        ledger_url: target.store_url.clone(),
        orphan_clock: if target.redis_url.is_some() {
            OrphanClock::FirstListed
        } else {
            OrphanClock::LeaseExpiry
        },
        _gate: gate,
        _target: target,
    }
}

/// Runs `ops` on a fresh oracle and on `real`: each step's answers, or
/// why not. The first `prelude` steps are not bound in time and the first
/// segment's clock starts after them: only for a prelude whose one live
/// lease the next step renews (a turn run out of its attempts, which takes
/// some thirty steps).
async fn run_case(
    real: &Opened,
    prefix: String,
    ops: &[Op],
    kind: Kind,
    prelude: usize,
) -> Result<Vec<String>, Failure> {
    let sim = Arc::new(
        SimStore::new(
            config(kind),
            Clock::start(),
            History::default(),
            Mutation::None,
        )
        .with_orphan_clock(real.orphan_clock),
    );
    let oracle: Arc<dyn Store> = Arc::clone(&sim) as Arc<dyn Store>;
    let names = Names { prefix };
    let mut want = Side::new(oracle, Ledger::Sim(sim));
    let mut got = Side::new(
        Arc::clone(&real.store),
        Ledger::Sql(real.ledger_url.clone()),
    );
    let mut kinds = Vec::new();
    let mut segment = Instant::now();
    let in_bound = |segment: Instant, i: usize| {
        if kind.timed() && i >= prelude && segment.elapsed() > kind.bound() {
            Err(Failure::TooSlow(i))
        } else {
            Ok(())
        }
    };
    for (i, op) in ops.iter().enumerate() {
        if i == prelude {
            segment = Instant::now();
        }
        if matches!(op, Op::Sleep) {
            tokio::time::sleep(kind.sleep()).await;
            segment = Instant::now();
            for side in [&mut want, &mut got] {
                side.rules.sleeps += 1;
                side.rules.sleep = kind.sleep();
            }
        }
        let expected = Box::pin(apply(&mut want, &names, op)).await;
        let actual = Box::pin(apply(&mut got, &names, op)).await;
        in_bound(segment, i)?;
        for (side, which) in [(&mut want, "decide's oracle"), (&mut got, "the store")] {
            if let Some(broken) = side.broken.take() {
                return Err(Failure::Differ(
                    i,
                    format!("step {i} broke the protocol on {which}: {broken}"),
                ));
            }
        }
        if expected != actual {
            return Err(Failure::Differ(
                i,
                format!("step {i} answered differently\n  decide: {expected}\n  store:  {actual}"),
            ));
        }
        kinds.push(answer_kind(&expected));
        if matches!(
            op,
            Op::Idle
                | Op::ViewTurn { .. }
                | Op::ViewSession { .. }
                | Op::ViewUser { .. }
                | Op::ReadEvents { .. }
        ) {
            continue;
        }
        let expected = Box::pin(snapshot(&mut want, &names)).await;
        let actual = Box::pin(snapshot(&mut got, &names)).await;
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

fn cases(kind: Kind) -> u32 {
    let (var, default) = match kind {
        Kind::Steady => ("AGENTGATE_ORACLE_CASES", DEFAULT_CASES),
        Kind::Expiry => ("AGENTGATE_ORACLE_EXPIRY_CASES", DEFAULT_EXPIRY_CASES),
        Kind::Retention => ("AGENTGATE_ORACLE_RETENTION_CASES", DEFAULT_RETENTION_CASES),
    };
    std::env::var(var).ok().map_or(default, |n| {
        n.parse().unwrap_or_else(|e| panic!("{var}={n:?}: {e}"))
    })
}

/// What [`agree`] found on one target.
enum Agreement {
    /// The target's server is absent: nothing ran.
    Absent,
    /// Every case agreed: the summary line.
    Agreed(String),
    /// A case differed: the (shrunk, when asked) steps and the difference.
    Differs(String),
}

/// Runs `cases` generated cases on the store `make` opens: one store for
/// every case, except that each retention case gets a fresh one (a sweep
/// counts and deletes every old enough row of the store, not only the
/// case's). A failing case is shrunk when `shrink` says so.
fn agree<F, Fut>(make: F, kind: Kind, cases: u32, shrink: bool) -> Agreement
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<Target>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let Some(target) = runtime.block_on(make()) else {
        return Agreement::Absent;
    };
    let name = target.name;
    let store_url = target.store_url.clone();
    let shared = runtime.block_on(open(target, kind));
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: if shrink { MAX_SHRINK_ITERS } else { 0 },
        // An expiry case sleeps: bound the shrinking by time as well.
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    });
    let started = Instant::now();
    let numbered = std::cell::Cell::new(0u32);
    let tally = std::cell::RefCell::new(BTreeMap::<String, u32>::new());
    let too_slow = std::cell::Cell::new(0u32);
    let outcome = runner.run(&case(kind), |ops| {
        numbered.set(numbered.get() + 1);
        let prefix = format!("oracle{}", numbered.get());
        let fresh = (kind == Kind::Retention).then(|| {
            runtime.block_on(async {
                let target = make()
                    .await
                    .unwrap_or_else(|| panic!("{name} answered a moment ago"));
                open(target, kind).await
            })
        });
        let real = fresh.as_ref().unwrap_or(&shared);
        let ran = runtime.block_on(Box::pin(run_case(real, prefix, &ops, kind, 0)));
        runtime.block_on(async move { drop(fresh) });
        let kinds = ran.map_err(|failure| match failure {
            Failure::TooSlow(step) => {
                too_slow.set(too_slow.get() + 1);
                TestCaseError::reject(format!("segment over {:?} at step {step}", kind.bound()))
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
    runtime.block_on(async move { drop(shared) });
    match outcome {
        Ok(()) => {
            // A retention case runs on a fresh database of its own, which
            // these counts (of the shared one) do not see.
            if name == "mysql" && kind != Kind::Retention {
                assert_took_both_mysql_paths(&store_url);
            }
            Agreement::Agreed(format!(
                "{name}{}: {cases} cases agree with decide in {:.1}s ({} rejected as too slow); answers compared: {:?}",
                kind.label(),
                started.elapsed().as_secs_f64(),
                too_slow.get(),
                tally.borrow()
            ))
        }
        Err(TestError::Fail(reason, _)) => Agreement::Differs(format!(
            "{name}{} fails the oracle at case {}: {reason}",
            kind.label(),
            numbered.get()
        )),
        Err(error) => panic!("{name}: {error}"),
    }
}

/// The generated cases on the store `make` opens (skipping when its server
/// is absent, as the conformance targets do), shrunk when one fails.
fn differential<F, Fut>(make: F, kind: Kind)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<Target>>,
{
    let _unplanted = plants::unplanted();
    match agree(make, kind, cases(kind), true) {
        Agreement::Absent => {}
        Agreement::Agreed(summary) => println!("{summary}"),
        Agreement::Differs(reason) => panic!("{reason}"),
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
    differential(targets::sqlite, Kind::Steady);
}

#[test]
fn sqlite_with_redis_agrees_with_decide() {
    differential(targets::sqlite_redis, Kind::Steady);
}

#[test]
fn postgres_agrees_with_decide() {
    differential(targets::postgres, Kind::Steady);
}

#[test]
fn postgres_with_redis_agrees_with_decide() {
    differential(targets::postgres_redis, Kind::Steady);
}

#[test]
fn mysql_agrees_with_decide() {
    differential(targets::mysql, Kind::Steady);
}

#[test]
fn mysql_with_redis_agrees_with_decide() {
    differential(targets::mysql_redis, Kind::Steady);
}

#[test]
fn sqlite_agrees_with_decide_across_lease_expiry() {
    differential(targets::sqlite, Kind::Expiry);
}

#[test]
fn sqlite_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::sqlite_redis, Kind::Expiry);
}

#[test]
fn postgres_agrees_with_decide_across_lease_expiry() {
    differential(targets::postgres, Kind::Expiry);
}

#[test]
fn postgres_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::postgres_redis, Kind::Expiry);
}

#[test]
fn mysql_agrees_with_decide_across_lease_expiry() {
    differential(targets::mysql, Kind::Expiry);
}

#[test]
fn mysql_with_redis_agrees_with_decide_across_lease_expiry() {
    differential(targets::mysql_redis, Kind::Expiry);
}

#[test]
fn sqlite_agrees_with_decide_across_retention() {
    differential(targets::sqlite, Kind::Retention);
}

#[test]
fn sqlite_with_redis_agrees_with_decide_across_retention() {
    differential(targets::sqlite_redis, Kind::Retention);
}

#[test]
fn postgres_agrees_with_decide_across_retention() {
    differential(targets::postgres, Kind::Retention);
}

#[test]
fn postgres_with_redis_agrees_with_decide_across_retention() {
    differential(targets::postgres_redis, Kind::Retention);
}

#[test]
fn mysql_agrees_with_decide_across_retention() {
    differential(targets::mysql, Kind::Retention);
}

#[test]
fn mysql_with_redis_agrees_with_decide_across_retention() {
    differential(targets::mysql_redis, Kind::Retention);
}

/// The first difference this test found (a store bug, fixed by keeping a
/// continuation's carried action in `confirms_pending`), as one fixed case
/// on every store: begin, await confirmation of action 0, confirm it
/// (reject), and have the continuation await confirmation of action 1. The
/// ended view must show `pending` {"action":1} and `confirmation.pending`
/// {"action":0}, as decide's oracle does.
#[test]
fn a_continuation_awaiting_confirmation_shows_its_own_pending() {
    let _unplanted = plants::unplanted();
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
            let name = target.name;
            let opened = open(target, Kind::Steady).await;
            if let Err(Failure::Differ(_, difference)) =
                run_case(&opened, "fixed".to_owned(), &ops, Kind::Steady, 0).await
            {
                panic!("{name} differs from decide's oracle: {difference}");
            }
        }
    });
}

/// A holder's repeats of its own claims, one of each kind, in a fixed case:
/// refused `tool_in_flight` while the first execution runs (and a plain
/// claim of it too), cached after its completion, executed again after its
/// failure, the same refusal once the turn ended.
fn repeat_claim_ops() -> Vec<Op> {
    let again = |tool, args, between| Op::ClaimAgain {
        lease: 0,
        tool,
        args,
        between,
    };
    vec![
        Op::Begin {
            user: 0,
            session: 0,
            request: 0,
            payload: 0,
        },
        again(0, 0, Between::Nothing),
        Op::Claim {
            lease: 0,
            tool: 0,
            args: 0,
        },
        Op::Complete {
            lease: 0,
            exec: 0,
            result: 1,
        },
        again(0, 0, Between::Nothing),
        again(1, 0, Between::Complete(0)),
        again(1, 1, Between::Fail),
        again(1, 1, Between::Nothing),
        Op::End {
            lease: 0,
            how: EndKind::Succeed(0),
        },
        again(0, 1, Between::Nothing),
    ]
}

/// [`repeat_claim_ops`] on every store: each agrees with decide's oracle and
/// keeps [`expected_repeat`].
#[test]
fn a_holders_repeat_claims_agree_on_every_store() {
    let _unplanted = plants::unplanted();
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
            let name = target.name;
            let opened = open(target, Kind::Steady).await;
            match run_case(
                &opened,
                "repeat".to_owned(),
                &repeat_claim_ops(),
                Kind::Steady,
                0,
            )
            .await
            {
                Ok(kinds) => println!("{name}: the repeat claims keep the protocol: {kinds:?}"),
                Err(Failure::Differ(_, difference)) => {
                    panic!("{name} fails the oracle: {difference}")
                }
                Err(Failure::TooSlow(_)) => unreachable!("a steady case is not timed"),
            }
        }
    });
}

/// The repeat-claim expectation does not lean on `decide`: a store that
/// answers a holder's repeat of a running claim with execute again (a
/// `SimStore` broken on purpose, as `decide` itself could be) is caught.
#[test]
fn the_repeat_claim_check_catches_a_store_running_a_claim_twice() {
    let _unplanted = plants::unplanted();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let broken = runtime.block_on(async {
        let sim = Arc::new(SimStore::new(
            config(Kind::Steady),
            Clock::start(),
            History::default(),
            Mutation::RerunOwnClaim,
        ));
        let mut side = Side::new(Arc::clone(&sim) as Arc<dyn Store>, Ledger::Sim(sim));
        let names = Names {
            prefix: "mutated".to_owned(),
        };
        for op in repeat_claim_ops() {
            Box::pin(apply(&mut side, &names, &op)).await;
            if let Some(broken) = side.broken.take() {
                return broken;
            }
        }
        panic!("the repeat-claim check missed a store running a holder's repeat claim again");
    });
    println!("caught: {broken}");
    assert!(
        broken.contains("was answered execute: the tool would run twice"),
        "{broken}"
    );
}

/// The fixed timed case's untimed prelude (see [`run_case`]): T0 begins
/// and runs out of attempts (its last attempt running).
const PRELUDE: usize = 2;

/// One timed case, the same on every store (all six at once, each on a
/// fresh store, so the sleep is paid once), that reaches for certain what
/// the generated retention cases reach by chance.
///
/// Prelude: T0 fails and restarts until it runs its last attempt. Before
/// the sleep: T0 renews its lease and claims tools, and one effect fails
/// after its write (rolled back); T1 books a ledger row in its own
/// transaction and awaits a confirmation; T2 and T3 (another user) start,
/// T2 claims a tool; then T0, T2, T3 stop heartbeating. No orphan yet, and
/// a sweep deletes nothing.
///
/// After the sleep: the late approval of T1 finds no pending confirmation,
/// and T1's own repeat replays it; the listing shows T0, T2, T3; claiming
/// T0 finds its attempts exhausted (recorded failed, nothing claimed);
/// claiming T2 resumes it (its journal: an interrupted execution);
/// abandoning T2 from the stale listing does nothing; the sweep deletes T1,
/// its execution and its idle session, and abandons T3 where its grace ran
/// out since its lease expired (not where a lease layer first saw it
/// unheld in this segment); T2 re-executes its interrupted tool and ends;
/// a new turn starts on the swept session.
#[test]
fn expiry_confirmation_orphans_and_sweep_agree_on_every_store() {
    let _unplanted = plants::unplanted();
    let begin = |user, session, request, payload| Op::Begin {
        user,
        session,
        request,
        payload,
    };
    let claim = |tool, args| Op::Claim {
        lease: 0,
        tool,
        args,
    };
    let listing = Op::Orphans {
        user: None,
        turn: None,
        aged: false,
    };
    let ops = vec![
        begin(0, 1, 1, 0),
        Op::RunOutAttempts,
        Op::Heartbeat { lease: 0 },
        claim(1, 0),
        claim(0, 1),
        Op::CompleteEffect {
            lease: 0,
            exec: 1,
            amount: 1,
            fail: true,
        },
        begin(0, 0, 0, 0),
        claim(0, 0),
        Op::CompleteEffect {
            lease: 0,
            exec: 2,
            amount: 2,
            fail: false,
        },
        Op::End {
            lease: 0,
            how: EndKind::AwaitConfirmation(0),
        },
        begin(1, 2, 0, 1),
        claim(1, 1),
        begin(1, 3, 1, 1),
        listing.clone(),
        Op::Sweep,
        Op::Sleep,
        Op::Confirm {
            user: 0,
            session: 0,
            request: 2,
            target: 1,
            approve: true,
        },
        begin(0, 0, 0, 0),
        listing,
        Op::ClaimOrphan { turn: 0 },
        Op::ClaimOrphan { turn: 2 },
        Op::Abandon { orphan: 1 },
        Op::Sweep,
        claim(1, 1),
        Op::Complete {
            lease: 0,
            exec: 3,
            result: 1,
        },
        Op::End {
            lease: 0,
            how: EndKind::Succeed(1),
        },
        begin(0, 0, 2, 1),
    ];
    let threads: Vec<_> = (0..6)
        .map(|n| {
            let ops = ops.clone();
            std::thread::spawn(move || fixed_timed_case(n, &ops))
        })
        .collect();
    let mut failures = Vec::new();
    for thread in threads {
        if let Err(panic) = thread.join() {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            failures.push(message);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Tries at most this many times a timed fixed case whose segment ran over
/// [`RETENTION_SEGMENT_BOUND`] (a loaded machine), each on a fresh store.
const FIXED_TRIES: u32 = 3;

/// Runs `ops` as a retention case on the `n`-th target, on fresh stores.
fn fixed_timed_case(n: usize, ops: &[Op]) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    runtime.block_on(async {
        for _ in 0..FIXED_TRIES {
            let target = match n {
                0 => targets::sqlite().await,
                1 => targets::sqlite_redis().await,
                2 => targets::postgres().await,
                3 => targets::postgres_redis().await,
                4 => targets::mysql().await,
                _ => targets::mysql_redis().await,
            };
            let Some(target) = target else {
                return;
            };
            let name = target.name;
            let opened = open(target, Kind::Retention).await;
            match Box::pin(run_case(
                &opened,
                "fixed".to_owned(),
                ops,
                Kind::Retention,
                PRELUDE,
            ))
            .await
            {
                Ok(kinds) => {
                    println!("{name}: the fixed timed case agrees with decide: {kinds:?}");
                    return;
                }
                Err(Failure::TooSlow(step)) => {
                    eprintln!(
                        "{name}: segment over {RETENTION_SEGMENT_BOUND:?} at step {step}; again"
                    );
                }
                Err(Failure::Differ(_, difference)) => {
                    panic!("{name} differs from decide's oracle: {difference}");
                }
            }
        }
        panic!(
            "target {n}: every try ran over {RETENTION_SEGMENT_BOUND:?}: the machine is too loaded"
        );
    });
}
