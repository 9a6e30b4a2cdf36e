//! The clients: devices sending each session's messages (several devices
//! per session send the same messages with the same request ids, as a
//! client that retries or a user on two devices would), recovery workers
//! claiming orphans, and the downstream ledger tools book into. All drive
//! the real `agentgate` library ([`Gate`], [`Turn`], its watchdog and drop
//! handler) against the fault-injecting store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentgate::{
    Begun, Decision, ErrorKind, Gate, OrphanFilter, PreviousOutcome, ToolStep, Turn, TurnState,
    TurnView,
};
use agentgate_core::ids::TurnId;
use serde_json::{json, Value};
pub use tokio_util_free::Stop;

use crate::faults::Faulty;
use crate::history::{Event, History};
use crate::rng::Rng;
use crate::store::Clock;

/// Begins one request tries before its device gives up on it.
const MAX_TRIES: u32 = 30;

/// A tiny stop flag (the sim needs no cancellation crate).
mod tokio_util_free {
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Set once, read by workers between claims.
    #[derive(Debug, Default)]
    pub struct Stop(AtomicBool);

    impl Stop {
        /// Asks workers to stop.
        pub fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }

        /// Whether stop was asked.
        pub fn is_set(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }
}

/// The shape of one run, drawn from its seed (swarm testing: each seed
/// also picks which faults are on and how hard).
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Users.
    pub users: u32,
    /// Each user's cap.
    pub cap: u32,
    /// Sessions per user.
    pub sessions_per_user: u32,
    /// Messages per session, sent in order.
    pub messages: u32,
    /// Devices per session sending the same messages.
    pub devices: u32,
    /// Recovery workers claiming orphans.
    pub workers: u32,
    /// Per mille of tool executions whose holder crashes.
    pub crash: u32,
    /// Per mille of tool executions whose holder freezes past the TTL.
    pub pause: u32,
    /// Per mille of messages that end awaiting confirmation.
    pub confirm: u32,
    /// Per mille of tool runs the downstream refuses (the execution is
    /// marked failed; the turn retries the tool or fails retryably).
    pub tool_failure: u32,
    /// Per mille of tool claims its holder sends again: once the first was
    /// answered execute (a client retrying a claim whose answer it lost, so
    /// the store must refuse it `tool_in_flight`), and once the execution
    /// completed (cached, with the stored result).
    pub repeat: u32,
    /// Per mille of `session_busy` and `request_in_flight` answers (another
    /// device's turn is running) on which the device presses Stop:
    /// it asks the holder's turn to cancel (docs/protocol.md §3.7), and the
    /// holder, told by heartbeat or by a refused claim, ends it `cancelled`.
    pub cancel: u32,
    /// Nodes: gates on the one store, each device and recovery worker on
    /// one of them (so a Stop pressed on one node reaches a holder on
    /// another only through the store).
    pub nodes: u32,
}

impl Scenario {
    /// The scenario for a seed's generator.
    pub fn draw(rng: &mut Rng) -> Self {
        let pick = |rng: &mut Rng, options: &[u32]| {
            options[usize::try_from(rng.range(0, options.len() as u64 - 1)).unwrap_or(0)]
        };
        Self {
            users: pick(rng, &[1, 2, 3]),
            cap: pick(rng, &[1, 2]),
            sessions_per_user: pick(rng, &[1, 2, 3]),
            messages: pick(rng, &[1, 2, 3]),
            devices: pick(rng, &[1, 2, 3]),
            workers: pick(rng, &[0, 1, 2]),
            crash: pick(rng, &[0, 30, 100]),
            pause: pick(rng, &[0, 30, 100]),
            confirm: pick(rng, &[0, 250]),
            tool_failure: pick(rng, &[0, 50, 150]),
            // Drawn by `crate::Plan::of` from a generator of its own.
            repeat: 0,
            cancel: 0,
            nodes: 1,
        }
    }
}

/// The downstream system tools book into: it deduplicates by the
/// idempotency key the library hands out (docs/protocol.md §4.4) and records every
/// arrival, with the sender's fence, in the history.
#[derive(Debug, Default)]
pub struct Ledger {
    bookings: Mutex<BTreeMap<String, u64>>,
}

impl Ledger {
    fn book(&self, ctx: &Ctx, key: &str, fence: i64, attempt: u32) -> u64 {
        let mut bookings = self
            .bookings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let next = bookings.len() as u64 + 1;
        let (booking, first) = match bookings.get(key) {
            Some(&booking) => (booking, false),
            None => {
                bookings.insert(key.to_owned(), next);
                (next, true)
            }
        };
        ctx.history.push(
            ctx.clock.now_ms(),
            Event::Effect {
                key: key.to_owned(),
                fence,
                attempt,
                booking,
                first,
            },
        );
        booking
    }

    fn lookup(&self, key: &str) -> Option<u64> {
        self.bookings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .copied()
    }
}

/// What every client task shares.
#[derive(Debug)]
pub struct Ctx {
    /// The library over the faulty store: one gate per node
    /// ([`Scenario::nodes`]), each with its own step tasks, watchdogs,
    /// waiters and sweeper, all on the one store.
    pub gates: Vec<Gate>,
    /// The faulty store, for client-side crashes and pauses.
    pub faulty: Arc<Faulty>,
    /// The downstream ledger.
    pub ledger: Ledger,
    /// The run's history.
    pub history: History,
    /// The store clock.
    pub clock: Clock,
    /// The scenario.
    pub scenario: Scenario,
    /// Stops the recovery workers.
    pub stop: Stop,
    /// Decides which claims their holder repeats: a generator of its own
    /// (`crate::Plan::repeats`), apart from the clients' own.
    pub repeats: Mutex<Rng>,
}

impl Ctx {
    fn observe(&self, view: &TurnView) {
        self.history.push(
            self.clock.now_ms(),
            Event::Replay {
                turn: view.turn_id.to_string(),
                state: view.state.as_str(),
                response: view
                    .response
                    .as_ref()
                    .filter(|_| view.state == TurnState::Succeeded)
                    .map(Value::to_string),
                observed: true,
            },
        );
    }

    /// Whether the holder repeats the claim it just made
    /// ([`Scenario::repeat`]).
    fn repeat(&self) -> bool {
        self.scenario.repeat > 0
            && self
                .repeats
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .chance(self.scenario.repeat)
    }

    fn ttl(&self) -> Duration {
        self.gates[0].config().lease_ttl
    }
}

enum Request {
    Message { id: String, payload: Value },
    Confirm { id: String, pending: String },
}

/// One device, on node `node`: sends its session's messages in order.
pub async fn device(ctx: Arc<Ctx>, mut rng: Rng, user: String, session: String, node: usize) {
    let gate = &ctx.gates[node % ctx.gates.len()];
    tokio::time::sleep(Duration::from_millis(rng.range(0, 500))).await;
    for m in 0..ctx.scenario.messages {
        // The payload is the message: the same for every device, so a
        // repeat matches the first request's fingerprint.
        let mut shape = Rng::new(seed_of(&session, m));
        let payload = json!({
            "session": session,
            "m": m,
            "tools": shape.range(0, 3),
            "confirm": shape.chance(ctx.scenario.confirm),
        });
        let message = Message {
            user: &user,
            session: &session,
            id: format!("m{m}"),
            payload,
        };
        send(&ctx, gate, &mut rng, message).await;
    }
}

fn seed_of(session: &str, m: u32) -> u64 {
    session.bytes().fold(u64::from(m), |h, b| {
        h.wrapping_mul(31).wrapping_add(u64::from(b))
    })
}

/// One message a device sends.
struct Message<'a> {
    user: &'a str,
    session: &'a str,
    id: String,
    payload: Value,
}

async fn send(ctx: &Ctx, gate: &Gate, rng: &mut Rng, message: Message<'_>) {
    let Message {
        user,
        session,
        id,
        payload,
    } = message;
    let mut request = Request::Message { id, payload };
    for _ in 0..MAX_TRIES {
        let begun = match &request {
            Request::Message { id, payload } => gate.begin(user, session, id, payload).await,
            Request::Confirm { id, pending } => {
                gate.confirm(user, session, id, pending, Decision::Approve)
                    .await
            }
        };
        let ended = match begun {
            Ok(Begun::Replay(view)) => {
                ctx.observe(&view);
                Some(view)
            }
            Ok(Begun::Queued(queued)) => panic!("the workload never queues: {queued:?}"),
            Ok(Begun::Started(turn)) => {
                let payload = match &request {
                    Request::Message { payload, .. } => payload.clone(),
                    Request::Confirm { .. } => Value::Null,
                };
                run_turn(ctx, rng, turn, &payload).await
            }
            Err(error) if error.kind() == ErrorKind::NotFound => return,
            Err(error) => {
                if let (ErrorKind::SessionBusy | ErrorKind::RequestInFlight, Some(holder)) =
                    (error.kind(), error.active_turn_id())
                {
                    if ctx.scenario.cancel > 0 && rng.chance(ctx.scenario.cancel) {
                        // Stop: the turn ends cancelled; this request's
                        // retry then starts on the freed session.
                        if let Ok(holder) = TurnId::new(holder) {
                            let _ = gate.request_cancel(&holder).await;
                        }
                    }
                }
                let wait = error
                    .retry_after()
                    .unwrap_or(Duration::from_millis(100))
                    .min(Duration::from_secs(1));
                tokio::time::sleep(wait + Duration::from_millis(rng.range(0, 100))).await;
                None
            }
        };
        match (ended, &request) {
            (None, _) => {}
            (Some(view), Request::Message { id, .. })
                if view.state == TurnState::AwaitingConfirmation =>
            {
                request = Request::Confirm {
                    id: format!("{id}-ok"),
                    pending: view.turn_id.to_string(),
                };
            }
            (Some(_), _) => return,
        }
    }
}

/// Runs a granted turn: its tools, then its ending. `None` when the turn
/// was given up (lease lost, store trouble, a crash): the caller retries.
async fn run_turn(ctx: &Ctx, rng: &mut Rng, turn: Turn, payload: &Value) -> Option<TurnView> {
    let continuation = turn.confirmation().is_some();
    let tag = if continuation {
        json!({"confirms": turn.confirmation().map(|c| c.turn_id.to_string())})
    } else {
        json!({"session": payload["session"], "m": payload["m"]})
    };
    let tools = if continuation {
        1
    } else {
        payload["tools"].as_u64().unwrap_or(0)
    };
    let mut results = Vec::new();
    let stopped = |i: u64| json!({"tag": tag, "stopped_before": i});
    for i in 0..tools {
        if turn.cancel_requested() {
            let _ = turn.end_cancelled(&stopped(i)).await;
            return None;
        }
        // Progress for the turn's followers, fenced like every write.
        match turn.emit("tool", &json!({"tag": tag, "i": i})).await {
            Err(error) if error.kind() == ErrorKind::LeaseLost => return None,
            _ => {}
        }
        let args = json!({"tag": tag, "i": i});
        let mut tries = 0;
        let result = loop {
            match turn.tool("book", &args).await {
                Ok(ToolStep::Cached(result)) => break result,
                Ok(ToolStep::Execute(execution)) => {
                    if ctx.repeat() {
                        // The holder claims the call again, as a client does
                        // whose first answer was lost: the store must refuse
                        // it `tool_in_flight`, never answer execute again.
                        // Whatever it answers, this holder goes on with the
                        // execution it holds; the checker judges the answer
                        // from the history (check::Claims).
                        let _ = turn.tool("book", &args).await;
                    }
                    let key = execution.idempotency_key().to_owned();
                    let attempt = execution.attempt();
                    let fence = turn.fence().0;
                    let result = if execution.previous_outcome() == Some(PreviousOutcome::Unknown) {
                        // The tool's verify policy: ask the ledger whether
                        // the dead attempt's effect landed.
                        ctx.ledger.lookup(&key).map(|b| json!({"booking": b}))
                    } else {
                        None
                    };
                    let result = match result {
                        Some(result) => result,
                        None => {
                            if rng.chance(ctx.scenario.crash) {
                                // The process dies around the call: cut
                                // off from the store for good, with or
                                // without its effect having landed.
                                ctx.faulty.partition(fence, None);
                                if rng.chance(500) {
                                    ctx.ledger.book(ctx, &key, fence, attempt);
                                }
                                return None;
                            }
                            if rng.chance(ctx.scenario.pause) {
                                // The process freezes (GC, swap, VM
                                // migration) past its TTL, watchdog and
                                // all, then carries on as if nothing
                                // happened.
                                let frozen = ctx.ttl() * 3;
                                ctx.faulty.partition(
                                    fence,
                                    Some(i64::try_from(frozen.as_millis()).unwrap_or(i64::MAX)),
                                );
                                tokio::time::sleep(frozen).await;
                                // Awake, it reports progress as if it still
                                // held the turn: a zombie's append, which
                                // the store must refuse (the checker holds
                                // every landed append to a live lease).
                                let _ = turn.emit("resumed", &json!({"i": i})).await;
                            }
                            tokio::time::sleep(Duration::from_millis(rng.range(0, 50))).await;
                            if rng.chance(ctx.scenario.tool_failure) {
                                // The downstream refused before booking.
                                if execution
                                    .fail(&json!({"message": "refused"}))
                                    .await
                                    .is_err()
                                {
                                    return None;
                                }
                                if rng.chance(500) {
                                    continue;
                                }
                                // Give the turn up as a retryable failure:
                                // the client's repeat restarts it.
                                let _ = turn.fail(&json!({"message": "tool refused"}), true).await;
                                return None;
                            }
                            json!({"booking": ctx.ledger.book(ctx, &key, fence, attempt)})
                        }
                    };
                    match execution.complete(&result).await {
                        Ok(stored) => {
                            if ctx.repeat() {
                                // Claimed again after the success (a retry
                                // of a claim whose answer was lost after
                                // the tool completed): cached, the stored
                                // result, and nothing runs.
                                if let Ok(ToolStep::Cached(cached)) = turn.tool("book", &args).await
                                {
                                    break cached;
                                }
                            }
                            break stored;
                        }
                        Err(_) => return None,
                    }
                }
                Err(error) if error.kind() == ErrorKind::TurnCancelled => {
                    let _ = turn.end_cancelled(&stopped(i)).await;
                    return None;
                }
                Err(error) if error.kind() == ErrorKind::StoreUnavailable && tries < 3 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(_) => return None,
            }
        };
        results.push(result);
    }
    let fence = turn.fence().0;
    let ended = if !continuation && payload["confirm"] == json!(true) {
        turn.await_confirmation(&json!({"action": tag})).await
    } else {
        turn.succeed(&json!({"tag": tag, "fence": fence, "results": results}))
            .await
    };
    match ended {
        Ok(view) => {
            ctx.observe(&view);
            Some(view)
        }
        Err(_) => None,
    }
}

/// A recovery worker: claims orphans and resumes them until stopped.
pub async fn worker(ctx: Arc<Ctx>, mut rng: Rng, node: usize) {
    let gate = &ctx.gates[node % ctx.gates.len()];
    let filter = OrphanFilter {
        min_orphaned_ms: 500,
        ..OrphanFilter::default()
    };
    while !ctx.stop.is_set() {
        tokio::time::sleep(Duration::from_millis(rng.range(300, 1000))).await;
        if let Ok(Some(recovered)) = gate.claim_orphan(&filter).await {
            let payload = recovered.payload.clone();
            run_turn(&ctx, &mut rng, recovered.turn, &payload).await;
        }
    }
}
