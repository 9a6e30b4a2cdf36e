//! A step runs to its end and nothing acknowledged is lost
//! (docs/protocol.md §4.7, §4.8) when a caller stops waiting. A step cut off
//! at any await point (a client that hung up, a caller's `timeout`) must
//! leave no transaction open on its pooled connection, and must have
//! happened once or not at all; a repeat of it tells which. And through
//! [`agentgate::Gate`], a step whose caller stopped waiting runs to its end.
//!
//! The bare store runs on a pool of one connection, so every step reuses
//! the connection the cut-off step left behind: a connection handed out
//! inside a transaction would swallow the next acknowledged write, and the
//! witness (a second handle on the same database) would not find it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use agentgate::{Config, ErrorKind, OrphanFilter, RunToEnd, ToolName, ToolState, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Ending, Grant, LeaseRef, NewEvent, QueueMode, ToolCall, ToolClaim,
};
use agentgate_core::store::{all_executions, Completion, Store};
use serde_json::json;

use super::report;
use crate::Target;

/// Cut-off steps per target: every kind about a hundred times, at await
/// points spread over each step's whole length.
const ROUNDS: usize = 1_200;

/// A step is cut after 0 to this many of its polls that returned
/// `Pending` (its awaits on the network, a lock or a task), early ones
/// more often.
const MAX_CUT_POLLS: u32 = 24;

/// The store's lease: long enough that no lease of a round expires while
/// it runs, except the orphans', which are waited out once.
const TTL: Duration = Duration::from_secs(2);

/// The kinds of step cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Begin,
    Heartbeat,
    Claim,
    Complete,
    End,
    Cancel,
    Enqueue,
    Handoff,
    Append,
    OrphanClaim,
}

const KINDS: [Kind; 10] = [
    Kind::Begin,
    Kind::Heartbeat,
    Kind::Claim,
    Kind::Complete,
    Kind::End,
    Kind::Cancel,
    Kind::Enqueue,
    Kind::Handoff,
    Kind::Append,
    Kind::OrphanClaim,
];

/// Runs `step` until it finishes or has returned `Pending` `polls` times
/// more, then drops it there: `None` when it was cut off.
async fn cut_after<F: Future>(polls: u32, step: F) -> Option<F::Output> {
    let mut step = std::pin::pin!(step);
    let mut left = polls;
    std::future::poll_fn(move |cx| match step.as_mut().poll(cx) {
        Poll::Ready(answer) => Poll::Ready(Some(answer)),
        Poll::Pending if left == 0 => Poll::Ready(None),
        Poll::Pending => {
            left -= 1;
            Poll::Pending
        }
    })
    .await
}

/// A small deterministic generator; the seed is printed, so a failing run
/// can be read back.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    BeginCommand::new(
        UserId::new(user).expect("id"),
        SessionId::new(session).expect("id"),
        ClientRequestId::new(request).expect("id"),
        &json!({"text": request}),
        None,
    )
    .expect("command")
}

fn call(n: usize) -> ToolCall {
    ToolCall::new(ToolName::new("book").expect("name"), &json!({"amount": n})).expect("call")
}

fn lease(grant: &Grant) -> LeaseRef {
    LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    }
}

fn canonical(value: &serde_json::Value) -> CanonicalJson {
    CanonicalJson::new("value", value).expect("json")
}

fn succeed(n: usize) -> Ending {
    Ending::Succeed {
        response: canonical(&json!({"round": n})),
    }
}

async fn start(store: &dyn Store, command: &BeginCommand) -> Grant {
    match store.begin(command).await.expect("a well-behaved begin") {
        BeginOutcome::Started(grant) => grant,
        other => panic!("a fresh request starts, got {other:?}"),
    }
}

async fn execute(store: &dyn Store, held: &LeaseRef, n: usize) -> agentgate::ExecutionId {
    match store
        .claim_tool(held, &call(n))
        .await
        .expect("a well-behaved claim")
    {
        ToolClaim::Execute { execution_id, .. } => execution_id,
        other => panic!("a first claim executes, got {other:?}"),
    }
}

/// What the witness reads of a turn.
async fn turn_state(witness: &dyn Store, grant: &Grant) -> TurnState {
    witness
        .turn(&grant.turn_id)
        .await
        .expect("witness read")
        .expect("the turn exists")
        .state
}

/// The most pending polls [`a_cut_statement_never_costs_its_connection`]
/// cuts each step after: past a step's last await point on loopback.
const SWEPT_POLLS: u32 = 12;

/// How many times [`a_cut_statement_never_costs_its_connection`] sweeps:
/// where a cut lands within an await point varies with timing, so one
/// sweep catches a driver that loses its place only sometimes.
const SWEEPS: usize = 8;

/// How long the write after a cut may wait for the pool's one connection:
/// far below the pool's acquire timeout, far above a reconnect.
const AFTER_CUT_BOUND: Duration = Duration::from_secs(5);

/// The cut checks' bare store (a pool of one connection, cut by its
/// callers), a gate on the same target whose store is the witness, and
/// their config.
async fn bare_store_and_witness(target: &Target) -> (Arc<dyn Store>, agentgate::Gate, Config) {
    let config = Config {
        lease_ttl: TTL,
        store_connections: 1,
        max_turns_per_user: 1_000,
        // Far above the checks: nothing is abandoned by the sweeper.
        orphan_grace: Duration::from_secs(3_600),
        ..Config::default()
    };
    let bare = agentgate::gate::open_bare_store(
        &target.store_url,
        target.redis_url.as_deref(),
        config.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("open {} store: {e}", target.name));
    let witness_gate = target.gate(config.clone()).await;
    (bare, witness_gate, config)
}

/// Cuts a step of every kind but the orphan claim after each of 0 to
/// [`SWEPT_POLLS`] pending polls, [`SWEEPS`] times over (a sweep, not a sample: every await point
/// of each step, a statement's prepare and its answer included), on a bare
/// store whose pool holds one connection (through [`RunToEnd`] with a lease
/// layer, where a bare step spans two servers), each checked as in
/// [`a_cut_off_step_leaves_nothing_behind`]. After each cut a write must be
/// answered within [`AFTER_CUT_BOUND`]: the connection the cut step held
/// was rolled back or closed, never kept by a driver waiting for an answer
/// that does not come (sqlx's MySQL driver, cut mid-statement, used to
/// keep it for good).
pub async fn a_cut_statement_never_costs_its_connection(target: &Target) {
    let (store, witness_gate, _) = bare_store_and_witness(target).await;
    let witness = witness_gate.store().as_ref();
    let server = mysql_server(target).await;
    let to_end = target
        .redis_url
        .is_some()
        .then(|| Arc::new(RunToEnd::new(Arc::clone(&store))));
    let store = match &to_end {
        Some(to_end) => Arc::clone(to_end) as Arc<dyn Store>,
        None => store,
    };
    let settle = Settle {
        to_end: to_end.as_deref(),
        server: server.as_ref(),
    };
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (sweep, polls) in (0..SWEEPS).flat_map(|sweep| (0..=SWEPT_POLLS).map(move |p| (sweep, p))) {
        for (round, kind) in KINDS.into_iter().enumerate() {
            if kind == Kind::OrphanClaim {
                continue;
            }
            let phase = format!("swept-{sweep}-{polls}");
            let cut = cut_one(kind, store.as_ref(), &settle, witness, &phase, round, polls).await;
            if !matches!(cut, Cut::Answered) {
                *counts.entry(format!("{kind:?}.cut")).or_default() += 1;
            }
            let write = tokio::time::timeout(
                AFTER_CUT_BOUND,
                store.set_user_cap(&UserId::new("after-cut").expect("id"), None),
            )
            .await;
            assert!(
                matches!(write, Ok(Ok(()))),
                "a write after a {kind:?} cut after {polls} polls: {write:?}"
            );
        }
    }
    report(
        target,
        "a_cut_statement_never_costs_its_connection",
        &counts,
    );
}

/// One well-behaved turn on the bare store (its pool's one connection is
/// the one the cut-off step left): begun, a tool booked, ended. Every
/// answer is acknowledged, so the witness must find all of it committed.
async fn well_behaved(store: &dyn Store, witness: &dyn Store, tag: &str) {
    let grant = start(
        store,
        &command(&format!("wb-{tag}"), &format!("wb-{tag}"), "r"),
    )
    .await;
    let held = lease(&grant);
    let execution = execute(store, &held, 1).await;
    store
        .complete_tool(&held, &execution, Completion::Result(canonical(&json!(1))))
        .await
        .expect("a well-behaved completion");
    store
        .end_turn(&held, &succeed(0))
        .await
        .expect("a well-behaved ending");
    let state = turn_state(witness, &grant).await;
    assert_eq!(
        state,
        TurnState::Succeeded,
        "an acknowledged ending after a cut-off step is not in the store ({tag}: {state:?})"
    );
    let executions = all_executions(witness, &grant.turn_id)
        .await
        .expect("witness read");
    assert!(
        executions.len() == 1 && executions[0].state == ToolState::Succeeded,
        "an acknowledged tool completion after a cut-off step is not in the store: {executions:?}"
    );
}

/// How each kind's cut-off steps went.
#[derive(Default)]
struct Tally {
    answered: usize,
    cut_happened: usize,
    cut_not: usize,
    cut_unobserved: usize,
}

/// Cuts off steps of every kind (begin, heartbeat, tool claim and
/// completion, ending, cancel, enqueue, handoff, event append, orphan
/// claim) at random await points, on a pool of one connection, with a
/// well-behaved turn after each on the same pool and another beside them
/// all along. On a bare SQL store (1,200 cuts): no transaction is left
/// open, every acknowledged write is found by a second handle, and every
/// cut-off step happened once or not at all, as its repeat tells. Through
/// [`RunToEnd`] (600 cuts, on every target: with a lease layer a bare step
/// spans two servers, and only running it to its end keeps it whole): the
/// same, and a cut-off step still runs to its end.
pub async fn a_cut_off_step_leaves_nothing_behind(target: &Target) {
    let (bare, witness_gate, config) = bare_store_and_witness(target).await;
    let witness = Arc::clone(witness_gate.store());
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    println!(
        "conformance {} a_cut_off_step_leaves_nothing_behind: seed {seed}",
        target.name
    );
    let mut rng = Rng(seed);

    // Orphans for the claim rounds of both phases, made first so one wait
    // covers them all.
    let mut orphans = Vec::new();
    for i in 0..2 * (ROUNDS / KINDS.len() + 1) {
        let user = format!("orphan-{i}");
        orphans.push(start(bare.as_ref(), &command(&user, &user, "r")).await);
    }
    tokio::time::sleep(TTL + Duration::from_millis(300)).await;

    let server = mysql_server(target).await;
    let mut counts = BTreeMap::new();
    if target.redis_url.is_none() {
        let phase = Phase {
            name: "bare",
            store: Arc::clone(&bare),
            to_end: None,
            max_polls: MAX_CUT_POLLS,
            server: server.clone(),
            witness: Arc::clone(&witness),
        };
        phase
            .attack(ROUNDS, &mut rng, &mut orphans, &mut counts)
            .await;
    }
    let to_end = Arc::new(RunToEnd::new(Arc::clone(&bare)));
    let phase = Phase {
        name: "run_to_end",
        store: Arc::clone(&to_end) as Arc<dyn Store>,
        to_end: Some(to_end),
        // A caller of `RunToEnd` waits on its step's task, a poll or two.
        max_polls: 2,
        server,
        witness: Arc::clone(&witness),
    };
    phase
        .attack(ROUNDS / 2, &mut rng, &mut orphans, &mut counts)
        .await;

    let through_gate = cut_through_the_gate(target, &config, witness.as_ref()).await;
    counts.insert("gate_endings_run_to_end".into(), through_gate);
    let hygiene = &agentgate_store_sql::tx::HYGIENE;
    counts.insert(
        "process_rolled_back".into(),
        hygiene_count(hygiene.rolled_back()),
    );
    counts.insert(
        "process_poisoned_closed".into(),
        hygiene_count(hygiene.poisoned_closed()),
    );
    report(target, "a_cut_off_step_leaves_nothing_behind", &counts);
}

/// The store one phase cuts steps of, and the handle that checks them.
struct Phase {
    name: &'static str,
    store: Arc<dyn Store>,
    /// Set when `store` is this [`RunToEnd`].
    to_end: Option<Arc<RunToEnd>>,
    /// Cuts come after 0 to this many pending polls.
    max_polls: u32,
    /// See [`Settle::server`].
    server: Option<sqlx::MySqlPool>,
    witness: Arc<dyn Store>,
}

impl Phase {
    /// Cuts off `rounds` steps, the kinds in turn, with a well-behaved
    /// worker beside them; adds its counts. At least a quarter of them
    /// must have been cut off, or the phase attacked too little.
    async fn attack(
        &self,
        rounds: usize,
        rng: &mut Rng,
        orphans: &mut Vec<Grant>,
        counts: &mut BTreeMap<String, usize>,
    ) {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let beside_done = Arc::new(AtomicUsize::new(0));
        let beside = {
            let (store, witness, stop, done) = (
                Arc::clone(&self.store),
                Arc::clone(&self.witness),
                Arc::clone(&stop),
                Arc::clone(&beside_done),
            );
            let name = self.name;
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let n = done.load(Ordering::Relaxed);
                    well_behaved(
                        store.as_ref(),
                        witness.as_ref(),
                        &format!("{name}-beside-{n}"),
                    )
                    .await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        let (store, witness) = (self.store.as_ref(), self.witness.as_ref());
        let settle = Settle {
            to_end: self.to_end.as_deref(),
            server: self.server.as_ref(),
        };
        let mut tallies: BTreeMap<String, Tally> = BTreeMap::new();
        for round in 0..rounds {
            let kind = KINDS[round % KINDS.len()];
            // Biased toward early await points, where most steps are cut.
            let reach = rng.below(u64::from(self.max_polls) + 1);
            let polls = u32::try_from(rng.below(reach + 1)).expect("small");
            let tag = format!("{}-{round}", self.name);
            let happened = match kind {
                Kind::OrphanClaim => {
                    let orphan = orphans.pop().expect("an orphan per claim round");
                    cut_orphan_claim(store, &settle, witness, &orphan, polls).await
                }
                _ => cut_one(kind, store, &settle, witness, self.name, round, polls).await,
            };
            let tally = tallies.entry(format!("{kind:?}")).or_default();
            match happened {
                Cut::Answered => tally.answered += 1,
                Cut::Happened => tally.cut_happened += 1,
                Cut::NotAtAll => tally.cut_not += 1,
                Cut::Unobserved => tally.cut_unobserved += 1,
            }
            well_behaved(store, witness, &format!("{tag}-after")).await;
        }
        stop.store(true, Ordering::Relaxed);
        beside.await.expect("the well-behaved worker");
        let name = self.name;
        for (kind, tally) in &tallies {
            counts.insert(format!("{name}.{kind}.answered"), tally.answered);
            counts.insert(format!("{name}.{kind}.cut_happened"), tally.cut_happened);
            counts.insert(format!("{name}.{kind}.cut_not_at_all"), tally.cut_not);
            if tally.cut_unobserved > 0 {
                counts.insert(format!("{name}.{kind}.cut"), tally.cut_unobserved);
            }
        }
        counts.insert(
            format!("{name}.well_behaved_beside"),
            beside_done.load(Ordering::Relaxed),
        );
        let cut: usize = tallies
            .values()
            .map(|t| t.cut_happened + t.cut_not + t.cut_unobserved)
            .sum();
        assert!(
            cut >= rounds / 4,
            "{name}: only {cut} of {rounds} steps were cut off: the check attacked too little"
        );
    }
}

fn hygiene_count(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// How a cut-off step went.
enum Cut {
    /// It finished before its cut: its answer was checked against the store.
    Answered,
    /// Cut off, and it had happened (the witness and the repeat agree).
    Happened,
    /// Cut off, and it had not happened at all.
    NotAtAll,
    /// Cut off where its repeat cannot tell (a heartbeat: renewed or not,
    /// the lease lives and the next renewal succeeds).
    Unobserved,
}

/// Cuts off one step of `kind` after `polls` pending polls, on a fixture of
/// its own, and checks what it left.
async fn cut_one(
    kind: Kind,
    store: &dyn Store,
    settle: &Settle<'_>,
    witness: &dyn Store,
    phase: &str,
    round: usize,
    polls: u32,
) -> Cut {
    let user = format!("cut-{phase}-{round}");
    let begin = command(&user, &user, "r");
    match kind {
        Kind::Begin => {
            let answer = cut_after(polls, store.begin(&begin)).await;
            settle.wait(store).await;
            let held_before = session_holder(witness, &begin).await;
            match answer {
                Some(Ok(BeginOutcome::Started(grant))) => {
                    assert_eq!(
                        held_before.as_ref(),
                        Some(&grant.turn_id),
                        "an answered begin is not held"
                    );
                    store
                        .end_turn(&lease(&grant), &succeed(round))
                        .await
                        .expect("end");
                    Cut::Answered
                }
                Some(other) => panic!("a fresh begin answered {other:?}"),
                None => match store.begin(&begin).await {
                    Ok(BeginOutcome::Started(grant)) => {
                        assert!(
                            held_before.is_none(),
                            "the repeat started, but the cut begin had been granted"
                        );
                        store
                            .end_turn(&lease(&grant), &succeed(round))
                            .await
                            .expect("end");
                        Cut::NotAtAll
                    }
                    Err(e) if e.kind() == ErrorKind::RequestInFlight => {
                        assert!(
                            held_before.is_some(),
                            "the repeat is in flight, but the witness found no holder"
                        );
                        Cut::Happened
                    }
                    other => panic!("the repeat of a cut begin answered {other:?}"),
                },
            }
        }
        Kind::Heartbeat => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let answer = cut_after(polls, store.heartbeat(&held)).await;
            settle.wait(store).await;
            if let Some(answer) = &answer {
                answer.as_ref().expect("an answered heartbeat");
            }
            store
                .heartbeat(&held)
                .await
                .expect("the lease survives a cut heartbeat");
            store.end_turn(&held, &succeed(round)).await.expect("end");
            if answer.is_some() {
                Cut::Answered
            } else {
                Cut::Unobserved
            }
        }
        Kind::Claim => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let answer = cut_after(polls, store.claim_tool(&held, &call(round))).await;
            settle.wait(store).await;
            let before = all_executions(witness, &grant.turn_id)
                .await
                .expect("witness read");
            let outcome = match answer {
                Some(answer) => {
                    let ToolClaim::Execute { execution_id, .. } =
                        answer.expect("an answered claim")
                    else {
                        panic!("a first claim executes");
                    };
                    assert!(
                        before.len() == 1
                            && before[0].execution_id == execution_id
                            && before[0].state == ToolState::Running,
                        "an answered claim is not in the store: {before:?}"
                    );
                    Cut::Answered
                }
                None => match store.claim_tool(&held, &call(round)).await {
                    Ok(ToolClaim::Execute { .. }) => {
                        assert!(
                            before.is_empty(),
                            "the repeat executes, but the cut claim was stored: {before:?}"
                        );
                        Cut::NotAtAll
                    }
                    Err(e) if e.kind() == ErrorKind::ToolInFlight => {
                        assert_eq!(
                            before.len(),
                            1,
                            "the repeat is in flight, but the witness found {before:?}"
                        );
                        Cut::Happened
                    }
                    other => panic!("the repeat of a cut claim answered {other:?}"),
                },
            };
            store.end_turn(&held, &succeed(round)).await.expect("end");
            outcome
        }
        Kind::Complete => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let execution = execute(store, &held, round).await;
            let result = canonical(&json!({"booked": round}));
            let answer = cut_after(
                polls,
                store.complete_tool(&held, &execution, Completion::Result(result.clone())),
            )
            .await;
            settle.wait(store).await;
            let before = all_executions(witness, &grant.turn_id)
                .await
                .expect("witness read");
            assert_eq!(before.len(), 1, "one execution: {before:?}");
            let done = before[0].state == ToolState::Succeeded;
            let outcome = match answer {
                Some(answer) => {
                    answer.expect("an answered completion");
                    assert!(
                        done,
                        "an answered completion is not in the store: {before:?}"
                    );
                    Cut::Answered
                }
                None => match store
                    .complete_tool(&held, &execution, Completion::Result(result))
                    .await
                {
                    Ok(_) => {
                        assert!(
                            !done,
                            "the repeat completed, but the cut completion was stored"
                        );
                        Cut::NotAtAll
                    }
                    Err(e) if e.kind() == ErrorKind::LeaseLost => {
                        assert!(
                            done,
                            "the repeat is refused, but the witness found {before:?}"
                        );
                        Cut::Happened
                    }
                    Err(e) => panic!("the repeat of a cut completion answered {e}"),
                },
            };
            let again = store.claim_tool(&held, &call(round)).await.expect("claim");
            assert!(
                matches!(again, ToolClaim::Cached { .. }),
                "a completed execution is cached: {again:?}"
            );
            store.end_turn(&held, &succeed(round)).await.expect("end");
            outcome
        }
        Kind::End => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let answer = cut_after(polls, store.end_turn(&held, &succeed(round))).await;
            settle.wait(store).await;
            let state = turn_state(witness, &grant).await;
            match answer {
                Some(answer) => {
                    answer.expect("an answered ending");
                    assert_eq!(
                        state,
                        TurnState::Succeeded,
                        "an answered ending is not in the store"
                    );
                    Cut::Answered
                }
                None => match store.end_turn(&held, &succeed(round)).await {
                    Ok(_) => {
                        assert_eq!(
                            state,
                            TurnState::Running,
                            "the repeat ended the turn, but the cut ending was stored"
                        );
                        Cut::NotAtAll
                    }
                    Err(e) if e.kind() == ErrorKind::LeaseLost => {
                        assert_eq!(
                            state,
                            TurnState::Succeeded,
                            "the repeat is refused, but the turn is {state:?}"
                        );
                        Cut::Happened
                    }
                    Err(e) => panic!("the repeat of a cut ending answered {e}"),
                },
            }
        }
        Kind::Cancel => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let answer = cut_after(polls, store.request_cancel(&grant.turn_id)).await;
            settle.wait(store).await;
            let asked = witness
                .turn(&grant.turn_id)
                .await
                .expect("witness read")
                .expect("turn")
                .cancel_requested_at_ms;
            let outcome = match answer {
                Some(answer) => {
                    answer.expect("an answered cancel");
                    assert!(asked.is_some(), "an answered cancel is not in the store");
                    Cut::Answered
                }
                None => {
                    let view = store
                        .request_cancel(&grant.turn_id)
                        .await
                        .expect("cancel")
                        .expect("turn");
                    if let Some(at) = asked {
                        assert_eq!(
                            view.cancel_requested_at_ms,
                            Some(at),
                            "a repeated cancel is recorded once"
                        );
                        Cut::Happened
                    } else {
                        Cut::NotAtAll
                    }
                }
            };
            let status = store.heartbeat(&held).await.expect("heartbeat");
            assert!(status.cancel_requested, "the holder learns the cancel");
            store
                .end_turn(
                    &held,
                    &Ending::Cancel {
                        partial: canonical(&json!({})),
                    },
                )
                .await
                .expect("end cancelled");
            outcome
        }
        Kind::Enqueue => {
            let grant = start(store, &begin).await;
            let queued = command(&user, &user, "q").queued(Some(QueueMode::Enqueue));
            let answer = cut_after(polls, store.begin(&queued)).await;
            settle.wait(store).await;
            let before = queue_of(witness, &begin).await;
            let outcome = match answer {
                Some(answer) => {
                    let BeginOutcome::Queued(entry) = answer.expect("an answered enqueue") else {
                        panic!("a begin on a busy session queues");
                    };
                    assert_eq!(
                        before,
                        vec![entry.turn_id],
                        "an answered enqueue is not in the store"
                    );
                    Cut::Answered
                }
                None => {
                    let repeat = store.begin(&queued).await;
                    let Ok(BeginOutcome::Queued(entry)) = repeat else {
                        panic!("the repeat of a cut enqueue queues, got {repeat:?}");
                    };
                    let after = queue_of(witness, &begin).await;
                    assert_eq!(after, vec![entry.turn_id.clone()], "queued once");
                    if before.is_empty() {
                        Cut::NotAtAll
                    } else {
                        assert_eq!(
                            before,
                            vec![entry.turn_id],
                            "the repeat found the cut enqueue"
                        );
                        Cut::Happened
                    }
                }
            };
            store
                .end_turn(&lease(&grant), &succeed(round))
                .await
                .expect("end");
            outcome
        }
        Kind::Handoff => {
            let grant = start(store, &begin).await;
            let queued = command(&user, &user, "q").queued(Some(QueueMode::Enqueue));
            let BeginOutcome::Queued(entry) = store.begin(&queued).await.expect("enqueue") else {
                panic!("a begin on a busy session queues");
            };
            store
                .end_turn(&lease(&grant), &succeed(round))
                .await
                .expect("end");
            let session = SessionId::new(&user).expect("id");
            let answer = cut_after(polls, take_next(store, &session)).await;
            settle.wait(store).await;
            let holder = session_holder(witness, &begin).await;
            let outcome = match answer {
                Some(answer) => {
                    let claimed = answer
                        .expect("an answered handoff")
                        .expect("the head starts");
                    assert_eq!(
                        holder.as_ref(),
                        Some(&claimed.grant.turn_id),
                        "an answered handoff is not held"
                    );
                    store
                        .end_turn(&lease(&claimed.grant), &succeed(round))
                        .await
                        .expect("end");
                    Cut::Answered
                }
                None => match take_next(store, &session).await {
                    Ok(Some(claimed)) => {
                        assert!(
                            holder.is_none(),
                            "the repeat took the head, but the cut handoff had"
                        );
                        assert_eq!(claimed.grant.turn_id, entry.turn_id);
                        store
                            .end_turn(&lease(&claimed.grant), &succeed(round))
                            .await
                            .expect("end");
                        Cut::NotAtAll
                    }
                    repeat @ (Ok(None) | Err(_)) => {
                        let view = witness.turn(&entry.turn_id).await;
                        assert_eq!(holder.as_ref(), Some(&entry.turn_id), "the repeat found no head ({repeat:?}), but nothing holds the session; the head is {view:?}");
                        Cut::Happened
                    }
                },
            };
            outcome
        }
        Kind::Append => {
            let grant = start(store, &begin).await;
            let held = lease(&grant);
            let events: Vec<NewEvent> = (0..3)
                .map(|i| NewEvent::new("delta", &json!({"i": i})).expect("event"))
                .collect();
            let answer = cut_after(polls, store.append_events(&held, &events)).await;
            settle.wait(store).await;
            let before = event_count(witness, &grant).await;
            let outcome = match answer {
                Some(answer) => {
                    assert_eq!(answer.expect("an answered append"), 3);
                    assert_eq!(before, 3, "an answered append is not in the store");
                    Cut::Answered
                }
                None => {
                    let last = store.append_events(&held, &events).await.expect("append");
                    assert!(
                        before == 0 || before == 3,
                        "an append is whole or nothing, found {before}"
                    );
                    assert_eq!(
                        last,
                        before + 3,
                        "the repeat appends after what the cut one left"
                    );
                    if before == 0 {
                        Cut::NotAtAll
                    } else {
                        Cut::Happened
                    }
                }
            };
            store.end_turn(&held, &succeed(round)).await.expect("end");
            outcome
        }
        Kind::OrphanClaim => unreachable!("orphan claims have a fixture of their own"),
    }
}

/// Cuts off the claim of `orphan` (filtered to its user).
async fn cut_orphan_claim(
    store: &dyn Store,
    settle: &Settle<'_>,
    witness: &dyn Store,
    orphan: &Grant,
    polls: u32,
) -> Cut {
    let filter = OrphanFilter {
        user_ids: vec![orphan.user_id.clone()],
        ..OrphanFilter::default()
    };
    let answer = cut_after(polls, store.claim_orphan(&filter)).await;
    settle.wait(store).await;
    let view = witness
        .turn(&orphan.turn_id)
        .await
        .expect("witness read")
        .expect("turn");
    match answer {
        Some(answer) => {
            let claimed = answer
                .expect("an answered claim")
                .expect("the orphan is claimed");
            assert_eq!(claimed.grant.turn_id, orphan.turn_id);
            assert_eq!(
                view.attempt, 2,
                "an answered orphan claim is not in the store"
            );
            store
                .end_turn(&lease(&claimed.grant), &succeed(0))
                .await
                .expect("end");
            Cut::Answered
        }
        None => {
            let repeat = store.claim_orphan(&filter).await.expect("claim");
            if view.attempt == 1 {
                let claimed = repeat.expect("the repeat claims the orphan the cut claim left");
                store
                    .end_turn(&lease(&claimed.grant), &succeed(0))
                    .await
                    .expect("end");
                Cut::NotAtAll
            } else {
                assert_eq!(view.attempt, 2, "claimed once");
                assert!(
                    repeat.is_none(),
                    "a claimed orphan is not claimed again while its lease lives"
                );
                Cut::Happened
            }
        }
    }
}

/// Steps cut off in a caller that goes through a [`agentgate::Gate`]
/// ([`agentgate::RunToEnd`]) run to their end: 50 endings whose callers
/// stop waiting at once are all found ended.
async fn cut_through_the_gate(target: &Target, config: &Config, witness: &dyn Store) -> usize {
    let gate = target.gate(config.clone()).await;
    let store = Arc::clone(gate.store());
    let mut grants = Vec::new();
    let mut cut = 0;
    for i in 0..50 {
        let user = format!("gate-{i}");
        let grant = start(store.as_ref(), &command(&user, &user, "r")).await;
        // Cut at its first poll: almost always before its task answers (a
        // task on another worker may, rarely, finish first; that ending
        // was simply answered).
        if cut_after(0, store.end_turn(&lease(&grant), &succeed(i)))
            .await
            .is_none()
        {
            cut += 1;
        }
        grants.push(grant);
    }
    assert!(
        cut >= 25,
        "only {cut} of 50 endings were cut before their answer: the attack did not run"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut ended = 0;
    for grant in &grants {
        loop {
            if turn_state(witness, grant).await == TurnState::Succeeded {
                ended += 1;
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "an ending whose caller stopped waiting never ran to its end"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    ended
}

/// A connection to the scratch database's server where the store closes
/// a cut connection instead of rolling it back (MySQL): see
/// [`Settle::server`].
async fn mysql_server(target: &Target) -> Option<sqlx::MySqlPool> {
    if !target.store_url.starts_with("mysql:") {
        return None;
    }
    Some(
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&target.store_url)
            .await
            .expect("a connection to the scratch database's server"),
    )
}

/// What [`Settle::wait`] waits on.
struct Settle<'a> {
    /// Set when the phase's store is this [`RunToEnd`].
    to_end: Option<&'a RunToEnd>,
    /// The scratch database's server, on a store that closes a cut
    /// connection instead of rolling it back (MySQL: see
    /// `agentgate_store_sql::tx::AfterCut`): its statement may still run
    /// after the pool has a connection again.
    server: Option<&'a sqlx::MySqlPool>,
}

impl Settle<'_> {
    /// Waits until the cut-off step is over: through [`RunToEnd`], until
    /// its task ended; then until whatever it left on the pool's one
    /// connection is finished (a write on the same pool can only start
    /// after it); then, where the cut connection was closed, until the
    /// server runs no statement of the scratch database.
    async fn wait(&self, store: &dyn Store) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        if let Some(to_end) = self.to_end {
            while to_end.steps_in_flight() > 0 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "a step whose caller stopped waiting never ended"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        store
            .set_user_cap(&UserId::new("settle").expect("id"), None)
            .await
            .expect("a write after a cut-off step");
        let Some(server) = self.server else {
            return;
        };
        loop {
            let running: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.processlist \
                 WHERE db = DATABASE() AND id <> CONNECTION_ID() AND command <> 'Sleep'",
            )
            .fetch_one(server)
            .await
            .expect("the server's process list");
            if running == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "a closed connection's statement never ended on the server"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// The handoff of a session's queue head.
async fn take_next(
    store: &dyn Store,
    session: &SessionId,
) -> agentgate::Result<Option<agentgate_core::model::ClaimedOrphan>> {
    Ok(
        agentgate_core::store::take_next_timed(store, session, || ())
            .await?
            .map(|(claimed, ())| claimed),
    )
}

async fn session_holder(witness: &dyn Store, begin: &BeginCommand) -> Option<agentgate::TurnId> {
    witness
        .session(&begin.session_id)
        .await
        .expect("witness read")
        .and_then(|s| s.holder)
        .map(|h| h.turn_id)
}

async fn queue_of(witness: &dyn Store, begin: &BeginCommand) -> Vec<agentgate::TurnId> {
    witness
        .session(&begin.session_id)
        .await
        .expect("witness read")
        .map(|s| s.queue.into_iter().map(|q| q.turn_id).collect())
        .unwrap_or_default()
}

async fn event_count(witness: &dyn Store, grant: &Grant) -> u64 {
    witness
        .events(&grant.turn_id, 0, 100)
        .await
        .expect("witness read")
        .map_or(0, |page| page.events.len() as u64)
}
