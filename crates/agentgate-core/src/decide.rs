//! The pure decisions of the turn protocol (docs/protocol.md §3).
//!
//! A store reads a snapshot inside its atomic step (one SQL transaction),
//! asks these functions what to do, and applies the answer in the same step.
//! Nothing here does I/O or reads a clock: `now_ms` is the store's clock.
//! Every store applies the same decisions, so the begin table of docs/protocol.md §3.1 lives in
//! exactly one place and is unit-tested without a database.

use std::time::Duration;

use crate::error::Error;
use crate::ids::Fence;
use crate::limits::{DEAD_CONTINUATION_RETRY, MAX_TOOL_ATTEMPTS, MAX_TURN_ATTEMPTS};
use crate::model::{BusyPolicy, OnBusy, PreviousOutcome, QueueMode, ToolState, TurnState};
use crate::plant::{planted, Plant};

/// A session's lease as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderSnapshot {
    /// The turn holding (or last holding) the lease.
    pub turn_id: String,
    /// Store-clock expiry, ms since the epoch.
    pub lease_expires_at_ms: i64,
}

/// A session's pending confirmation as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingSnapshot {
    /// The turn awaiting confirmation.
    pub turn_id: String,
    /// Store-clock expiry, ms since the epoch.
    pub expires_at_ms: i64,
}

/// A session row as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionSnapshot {
    /// The user the session is bound to.
    pub user_id: String,
    /// The lease, live or not.
    pub holder: Option<HolderSnapshot>,
    /// The pending confirmation, live or not.
    pub pending: Option<PendingSnapshot>,
}

impl SessionSnapshot {
    /// The holder if its lease is live at `now_ms`.
    pub fn live_holder(&self, now_ms: i64) -> Option<&HolderSnapshot> {
        self.holder
            .as_ref()
            .filter(|h| h.lease_expires_at_ms > now_ms)
    }

    /// The pending confirmation if it has not expired at `now_ms`.
    pub fn live_pending(&self, now_ms: i64) -> Option<&PendingSnapshot> {
        self.pending.as_ref().filter(|p| p.expires_at_ms > now_ms)
    }
}

/// A turn row as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnSnapshot {
    /// The turn.
    pub turn_id: String,
    /// The session it belongs to.
    pub session_id: String,
    /// Its payload fingerprint.
    pub fingerprint: String,
    /// Its state.
    pub state: TurnState,
    /// Attempts so far.
    pub attempt: u32,
    /// For failed turns: whether a repeat restarts it.
    pub retryable: bool,
    /// For confirmed turns: the continuation that took the decision.
    pub confirmed_by: Option<String>,
}

/// The user's permits as read from the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserLoad {
    /// The cap in force for this user.
    pub cap: u32,
    /// Live leases the user holds now.
    pub live: u32,
    /// Store-clock expiry of the soonest-expiring live lease.
    pub soonest_expiry_ms: Option<i64>,
}

impl UserLoad {
    /// The load as a store reads it: the user row's cap override (none: the
    /// configured `default_cap`), the count of live leases and the soonest
    /// expiry among them.
    ///
    /// # Errors
    /// `corrupt` for a stored cap or a count outside `u32`: the engine never
    /// writes one, so it is not read as a default.
    pub fn read(
        cap: Option<i64>,
        default_cap: u32,
        live: i64,
        soonest_expiry_ms: Option<i64>,
    ) -> Result<Self, Error> {
        let cap = match cap {
            None => default_cap,
            Some(cap) => {
                u32::try_from(cap).map_err(|_| Error::corrupt(format!("user cap {cap}")))?
            }
        };
        let live = u32::try_from(live)
            .map_err(|_| Error::corrupt(format!("live-session count {live}")))?;
        Ok(Self {
            cap,
            live,
            soonest_expiry_ms,
        })
    }
}

/// A session's queue as a begin reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueFacts<'a> {
    /// The turn at the head (the lowest queue number), if any is queued.
    pub head: Option<&'a str>,
    /// How many turns are queued.
    pub len: u32,
    /// How many turns the requesting user has queued, in every session
    /// (this one's included).
    pub user_len: u32,
}

/// What a begin found and asked for.
#[derive(Clone, Copy, Debug)]
pub struct BeginFacts<'a> {
    /// The store's clock.
    pub now_ms: i64,
    /// The requesting user.
    pub user_id: &'a str,
    /// The requested session.
    pub session_id: &'a str,
    /// The request's fingerprint.
    pub fingerprint: &'a str,
    /// The turn the request confirms, if it is a confirmation.
    pub confirms: Option<&'a str>,
    /// The session row, if the session exists.
    pub session: Option<&'a SessionSnapshot>,
    /// The turn already recorded for `(session, client_request_id)`.
    pub turn: Option<&'a TurnSnapshot>,
    /// For a confirmation: the turn it confirms.
    pub confirm_target: Option<&'a TurnSnapshot>,
    /// For a confirmation whose target is already confirmed: the continuation.
    pub continuation: Option<&'a TurnSnapshot>,
    /// The user's permits.
    pub load: UserLoad,
    /// A recovery worker's claim: only a `running` turn (or the head of
    /// a queue) may start.
    pub resume_only: bool,
    /// The session's queue.
    pub queue: QueueFacts<'a>,
    /// Whether a busy session queues this request (`None`: refuse it).
    pub enqueue: Option<QueueMode>,
}

/// How a start came about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartKind {
    /// No turn existed: insert it.
    New,
    /// The turn was running under an expired lease: take it over.
    Takeover,
    /// The turn failed retryably: run it again.
    Restart,
    /// The turn waited in the session's queue and is its head: start it.
    Dequeue,
}

/// What a store must do for a begin.
#[derive(Debug)]
pub enum BeginDecision {
    /// Grant a lease and start (or restart) the turn with this attempt number.
    Start {
        /// New, takeover or restart.
        kind: StartKind,
        /// The attempt number to record.
        attempt: u32,
    },
    /// Return this turn's stored view; take no lease.
    Replay {
        /// The turn to replay (the request's own, or a confirmation's continuation).
        turn_id: String,
    },
    /// The turn used all its attempts: record it failed for good, then replay it.
    Exhaust,
    /// Queue the request behind the session's holder and queue (a new turn
    /// `queued`, numbered after the queue's last); with `supersede`, end
    /// every turn queued before it `superseded`. No lease taken.
    Enqueue {
        /// End the turns queued before it.
        supersede: bool,
    },
    /// The request's turn waits in the queue and cannot start yet: answer
    /// its position. Nothing written.
    Queued {
        /// The queued turn.
        turn_id: String,
    },
    /// Refuse; write nothing.
    Reject(Error),
}

fn remaining(until_ms: i64, now_ms: i64) -> Duration {
    retry_after_ms(until_ms.saturating_sub(now_ms))
}

/// A retry-after of `ms` milliseconds, at least 1 ms: a retry-after of zero
/// (or a negative remainder read from a clock) invites a hot loop.
pub fn retry_after_ms(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1))
}

fn decide_existing(facts: &BeginFacts<'_>, turn: &TurnSnapshot) -> BeginDecision {
    if turn.fingerprint != facts.fingerprint && !planted(Plant::ReplayIgnoresPayload) {
        return BeginDecision::Reject(Error::PayloadMismatch);
    }
    let session = facts.session;
    if turn.state == TurnState::Queued {
        return decide_queued(facts, turn);
    }
    if facts.resume_only && turn.state != TurnState::Running {
        // A recovery claim from a stale list: the turn ended meanwhile.
        return replay(turn);
    }
    let kind = match turn.state {
        TurnState::Succeeded
        | TurnState::Confirmed
        | TurnState::Cancelled
        | TurnState::Superseded => return replay(turn),
        TurnState::Queued => unreachable!("decided above"),
        TurnState::Failed if !turn.retryable => return replay(turn),
        TurnState::AwaitingConfirmation => {
            return match session.and_then(|s| s.live_pending(facts.now_ms)) {
                Some(p) if p.turn_id == turn.turn_id => {
                    BeginDecision::Reject(Error::AwaitingConfirmation {
                        pending_turn_id: p.turn_id.clone(),
                        retry_after: remaining(p.expires_at_ms, facts.now_ms),
                    })
                }
                _ => replay(turn),
            };
        }
        TurnState::Running => {
            if let Some(h) = session.and_then(|s| s.live_holder(facts.now_ms)) {
                if h.turn_id == turn.turn_id {
                    return BeginDecision::Reject(Error::RequestInFlight {
                        active_turn_id: turn.turn_id.clone(),
                        retry_after: remaining(h.lease_expires_at_ms, facts.now_ms),
                    });
                }
            }
            StartKind::Takeover
        }
        // A failure the caller may retry, or an orphan the sweeper ended
        // unclaimed: the repeat runs it again (interrupted tools then claim
        // as `unknown`), so nothing a person retries is lost.
        TurnState::Failed | TurnState::Abandoned => StartKind::Restart,
    };
    if turn.attempt >= MAX_TURN_ATTEMPTS && !planted(Plant::AttemptsNeverRunOut) {
        return BeginDecision::Exhaust;
    }
    // A restart is a message sent again: it does not jump the messages
    // waiting in the session's queue (a takeover resumes the turn the queue
    // waits behind, and goes first).
    if let (StartKind::Restart, Some(head)) = (kind, facts.queue.head) {
        let live = session.and_then(|s| s.live_holder(facts.now_ms));
        if live.is_none() {
            return BeginDecision::Reject(Error::SessionBusy {
                active_turn_id: head.to_owned(),
                retry_after: DEAD_CONTINUATION_RETRY,
            });
        }
    }
    gate_start(facts, kind, turn.attempt + 1, Some(&turn.turn_id))
}

/// A repeat (or a claim, or a handoff) of a queued request: its head starts
/// once the session is free, with no live holder and no pending
/// confirmation (a person's answer comes first); every other queued turn,
/// and the head of a busy session, answers its place.
fn decide_queued(facts: &BeginFacts<'_>, turn: &TurnSnapshot) -> BeginDecision {
    let now = facts.now_ms;
    let busy = facts
        .session
        .is_some_and(|s| s.live_holder(now).is_some() || s.live_pending(now).is_some());
    let head = facts.queue.head == Some(turn.turn_id.as_str()) || planted(Plant::QueueJump);
    if busy || !head {
        return BeginDecision::Queued {
            turn_id: turn.turn_id.clone(),
        };
    }
    gate_start(
        facts,
        StartKind::Dequeue,
        turn.attempt + 1,
        Some(&turn.turn_id),
    )
}

/// A new request (not a confirmation). A session that is held, or whose
/// queue is not empty, queues it when asked to (up to
/// [`MAX_SESSION_QUEUE`](crate::limits::MAX_SESSION_QUEUE), and the user
/// up to [`MAX_USER_QUEUE`](crate::limits::MAX_USER_QUEUE) across their
/// sessions); otherwise a
/// queue waiting on a free session is still not jumped: `session_busy`
/// naming its head, which its caller is about to start. A pending
/// confirmation refuses both (the gate below).
fn decide_new(facts: &BeginFacts<'_>) -> BeginDecision {
    let now = facts.now_ms;
    let session = facts.session;
    let held = session.and_then(|s| s.live_holder(now));
    let pending = session.and_then(|s| s.live_pending(now));
    if pending.is_none() && (held.is_some() || facts.queue.head.is_some()) {
        let retry_after = held.map_or(DEAD_CONTINUATION_RETRY, |h| {
            remaining(h.lease_expires_at_ms, now)
        });
        if let Some(mode) = facts.enqueue {
            let limit = crate::limits::MAX_SESSION_QUEUE;
            // A supersede ends every queued turn: it never overfills.
            if mode == QueueMode::Enqueue && facts.queue.len >= limit {
                return BeginDecision::Reject(Error::QueueFull { limit, retry_after });
            }
            // The user's queues grow unless a supersede replaces a turn.
            let limit = crate::limits::MAX_USER_QUEUE;
            let grows = mode == QueueMode::Enqueue || facts.queue.len == 0;
            if grows && facts.queue.user_len >= limit {
                return BeginDecision::Reject(Error::UserQueueFull { limit, retry_after });
            }
            return BeginDecision::Enqueue {
                supersede: mode == QueueMode::Supersede,
            };
        }
        if let (None, Some(head)) = (held, facts.queue.head) {
            return BeginDecision::Reject(Error::SessionBusy {
                active_turn_id: head.to_owned(),
                retry_after,
            });
        }
    }
    gate_start(facts, StartKind::New, 1, None)
}

fn replay(turn: &TurnSnapshot) -> BeginDecision {
    BeginDecision::Replay {
        turn_id: turn.turn_id.clone(),
    }
}

fn decide_confirmation(facts: &BeginFacts<'_>, confirms: &str) -> BeginDecision {
    let Some(target) = facts
        .confirm_target
        .filter(|t| t.session_id == facts.session_id)
    else {
        return BeginDecision::Reject(Error::not_found(format!("pending turn {confirms}")));
    };
    if target.state == TurnState::Confirmed {
        // A second confirmation of the same pending turn: follow the first one.
        return match facts.continuation {
            Some(c) if c.state == TurnState::Running => {
                let retry_after = facts
                    .session
                    .and_then(|s| s.live_holder(facts.now_ms))
                    .filter(|h| h.turn_id == c.turn_id)
                    .map_or(DEAD_CONTINUATION_RETRY, |h| {
                        remaining(h.lease_expires_at_ms, facts.now_ms)
                    });
                BeginDecision::Reject(Error::RequestInFlight {
                    active_turn_id: c.turn_id.clone(),
                    retry_after,
                })
            }
            Some(c) => replay(c),
            None => BeginDecision::Reject(Error::not_found(format!("pending turn {confirms}"))),
        };
    }
    let pending_is_target = facts
        .session
        .and_then(|s| s.live_pending(facts.now_ms))
        .is_some_and(|p| p.turn_id == target.turn_id);
    if target.state != TurnState::AwaitingConfirmation {
        return BeginDecision::Reject(Error::not_found(format!(
            "pending confirmation of turn {confirms}"
        )));
    }
    if !pending_is_target && !planted(Plant::ConfirmAfterExpiry) {
        // Awaiting still, but no longer the session's live pending
        // confirmation: its TTL ran out (only then can the session have
        // moved on), so nothing may be confirmed.
        return BeginDecision::Reject(Error::ConfirmationExpired {
            turn_id: target.turn_id.clone(),
        });
    }
    gate_start(facts, StartKind::New, 1, None)
}

/// The checks every start passes: pending confirmation, session lease, permit.
fn gate_start(
    facts: &BeginFacts<'_>,
    kind: StartKind,
    attempt: u32,
    own_turn: Option<&str>,
) -> BeginDecision {
    let now = facts.now_ms;
    if let Some(session) = facts.session {
        if let Some(p) = session.live_pending(now) {
            if facts.confirms != Some(p.turn_id.as_str()) {
                return BeginDecision::Reject(Error::AwaitingConfirmation {
                    pending_turn_id: p.turn_id.clone(),
                    retry_after: remaining(p.expires_at_ms, now),
                });
            }
        }
        if let Some(h) = session.live_holder(now) {
            debug_assert!(
                own_turn != Some(h.turn_id.as_str()),
                "live own lease is in flight"
            );
            return BeginDecision::Reject(Error::SessionBusy {
                active_turn_id: h.turn_id.clone(),
                retry_after: remaining(h.lease_expires_at_ms, now),
            });
        }
    }
    let load = facts.load;
    let at_cap = if planted(Plant::CapOffByOne) {
        load.live > load.cap
    } else {
        load.live >= load.cap
    };
    if at_cap {
        return BeginDecision::Reject(Error::UserAtCapacity {
            cap: load.cap,
            retry_after: remaining(load.soonest_expiry_ms.unwrap_or(now + 1), now),
        });
    }
    BeginDecision::Start { kind, attempt }
}

/// Decides a begin: docs/protocol.md §3.1's table, then the session, pending and permit gates.
pub fn decide_begin(facts: &BeginFacts<'_>) -> BeginDecision {
    if let Some(session) = facts.session {
        if session.user_id != facts.user_id {
            // Another user's session does not exist as far as this user can tell.
            return BeginDecision::Reject(Error::not_found("session"));
        }
    }
    if facts.queue.user_len < facts.queue.len {
        // Every turn queued on the user's own session is theirs.
        return BeginDecision::Reject(Error::corrupt(format!(
            "a session queue of {} turns, but its user has {} queued",
            facts.queue.len, facts.queue.user_len
        )));
    }
    match (facts.turn, facts.confirms) {
        (Some(turn), _) => decide_existing(facts, turn),
        (None, Some(confirms)) => decide_confirmation(facts, confirms),
        (None, None) => decide_new(facts),
    }
}

/// What one begin of a recovery worker's claim did to the orphan it tried.
///
/// # Errors
/// The begin's error when it is not one of the refusals that mean "someone
/// else has this turn or its session now" (store errors, corruption).
pub fn orphan_claim_step(
    outcome: Result<crate::model::BeginOutcome, Error>,
) -> Result<Option<crate::model::Grant>, Error> {
    use crate::error::ErrorKind;
    use crate::model::BeginOutcome;
    match outcome {
        Ok(BeginOutcome::Started(grant)) => Ok(Some(grant)),
        // It ended meanwhile, or used all its attempts and was just
        // recorded failed for good: nothing to resume. A queued turn that
        // is not (or no longer) the head of a free session waits its turn.
        Ok(BeginOutcome::Replay(_) | BeginOutcome::Queued(_)) => Ok(None),
        // Another worker or the client's own retry took it over, its session
        // is held by another turn, or its user has no free permit: pass.
        Err(error)
            if matches!(
                error.kind(),
                ErrorKind::RequestInFlight
                    | ErrorKind::SessionBusy
                    | ErrorKind::UserAtCapacity
                    | ErrorKind::AwaitingConfirmation
            ) =>
        {
            Ok(None)
        }
        // The resume command repeats the turn's own fingerprint: a mismatch
        // means the stored row is not what was written.
        Err(Error::PayloadMismatch) => Err(Error::corrupt(
            "an orphan's own fingerprint does not match its turn",
        )),
        Err(error) => Err(error),
    }
}

/// What a begin answers after the external lease layer's acquire: the
/// remaining lease when it granted, or the refusal its state implies (the
/// request's own turn still holding it is `request_in_flight`).
///
/// # Errors
/// `request_in_flight`, `session_busy` or `user_at_capacity`, each with the
/// retry-after the layer reported (at least 1 ms).
pub fn layer_acquired(
    acquired: crate::lease::Acquired,
    turn_id: &str,
    cap: u32,
) -> Result<i64, Error> {
    use crate::lease::Acquired;
    let retry = retry_after_ms;
    match acquired {
        Acquired::Granted {
            lease_expires_in_ms,
        } => Ok(lease_expires_in_ms),
        Acquired::Busy {
            holder_turn_id,
            expires_in_ms,
        } if holder_turn_id == turn_id => Err(Error::RequestInFlight {
            active_turn_id: holder_turn_id,
            retry_after: retry(expires_in_ms),
        }),
        Acquired::Busy {
            holder_turn_id,
            expires_in_ms,
        } => Err(Error::SessionBusy {
            active_turn_id: holder_turn_id,
            retry_after: retry(expires_in_ms),
        }),
        Acquired::AtCapacity {
            soonest_expires_in_ms,
        } => Err(Error::UserAtCapacity {
            cap,
            retry_after: retry(soonest_expires_in_ms),
        }),
    }
}

/// The fence a start writes when the fence was taken before the begin's
/// transaction (a store that takes it in autocommit, so no transaction holds
/// the store-wide counter across a lease-layer call): it must be newer than
/// the session's, or a grant that committed in between would be overtaken
/// by an older fence. `None` reserved: the start takes the fence itself.
///
/// # Errors
/// A `conflict` (the step runs again, taking a newer fence) when a newer
/// grant of the session committed after `reserved` was taken.
pub fn reserved_fence(reserved: Option<Fence>, session_fence: i64) -> Result<Option<Fence>, Error> {
    match reserved {
        Some(fence) if fence.0 > session_fence => Ok(Some(fence)),
        Some(_) => Err(Error::conflict(
            "begin: a newer grant of the session committed after the fence was taken",
        )),
        None => Ok(None),
    }
}

/// Whether the caller, holding the live lease with fence `live_fence`, may
/// end execution `execution_id`, whose row reads `(state, fence)` (`None`:
/// no such execution in the caller's turn). What every store answers when an
/// execution's ending finds nothing to change.
///
/// # Errors
/// `not_found` for no row; `lease_lost` when it already ended or a newer
/// lease reclaimed it.
pub fn check_execution(
    execution_id: &str,
    row: Option<(&str, i64)>,
    live_fence: i64,
) -> Result<(), Error> {
    let running = ToolState::Running.as_str();
    match row {
        None => Err(Error::not_found(format!("tool execution {execution_id}"))),
        Some((state, fence)) if state == running && fence == live_fence => Ok(()),
        Some((state, _)) if state != running => Err(Error::LeaseLost {
            reason: "tool execution already ended",
        }),
        Some(_) => Err(Error::LeaseLost {
            reason: "tool execution claimed by a newer lease",
        }),
    }
}

/// Whether a turn that has `executions` tool executions may insert one more
/// (its first claim of a new call): at most
/// [`MAX_EXECUTIONS_PER_TURN`](crate::limits::MAX_EXECUTIONS_PER_TURN) per
/// turn. The SQL stores' one-statement first claims state the same bound in
/// their `WHERE`; change them with it.
///
/// # Errors
/// `invalid` once the turn is at the bound.
pub fn check_execution_room(turn_id: &str, executions: i64) -> Result<(), Error> {
    let limit = crate::limits::MAX_EXECUTIONS_PER_TURN;
    if executions >= i64::from(limit) {
        return Err(Error::invalid(format!(
            "turn {turn_id} has {executions} tool executions, the limit is {limit}"
        )));
    }
    Ok(())
}

/// A turn's event log as an append read it, under the step's lease check.
#[derive(Clone, Copy, Debug)]
pub struct EventLogFacts {
    /// Whether the turn is running.
    pub running: bool,
    /// The turn's fence (its newest grant's).
    pub fence: i64,
    /// Events it holds.
    pub count: u64,
    /// Their bytes (names and data).
    pub bytes: u64,
}

/// Whether the holder of `live_fence` may append `batch` events of
/// `batch_bytes` to the log `facts` describes; the first new event's id.
/// A turn that ended, or that a newer lease took over, refuses (a
/// zombie's events never land after a takeover); a batch over
/// [`crate::limits::MAX_EVENT_BATCH`], or one that would take the turn
/// over [`crate::limits::MAX_TURN_EVENTS`] events or
/// [`crate::limits::MAX_TURN_EVENT_BYTES`] bytes, is refused whole.
///
/// # Errors
/// `lease_lost`; `invalid_request` for an empty or oversized batch or a
/// full log.
pub fn check_event_append(
    turn_id: &str,
    facts: EventLogFacts,
    live_fence: i64,
    batch: usize,
    batch_bytes: u64,
) -> Result<u64, Error> {
    use crate::limits::{MAX_EVENT_BATCH, MAX_TURN_EVENTS, MAX_TURN_EVENT_BYTES};
    if !facts.running {
        return Err(Error::LeaseLost {
            reason: "turn already ended",
        });
    }
    if facts.fence != live_fence {
        return Err(Error::LeaseLost {
            reason: "turn taken over by a newer lease",
        });
    }
    if batch == 0 || batch > MAX_EVENT_BATCH {
        return Err(Error::invalid(format!(
            "an append carries 1 to {MAX_EVENT_BATCH} events, not {batch}"
        )));
    }
    let count = facts.count + batch as u64;
    let bytes = facts.bytes + batch_bytes;
    if count > MAX_TURN_EVENTS || bytes > MAX_TURN_EVENT_BYTES {
        return Err(Error::invalid(format!(
            "turn {turn_id}'s events would be {count} ({bytes} bytes); \
             the limits are {MAX_TURN_EVENTS} events and {MAX_TURN_EVENT_BYTES} bytes"
        )));
    }
    Ok(facts.count + 1)
}

/// The error an orphan ended `abandoned` by the sweeper records, the same
/// on every store.
pub const ABANDONED_ERROR: &str = r#"{"code":"abandoned","message":"the turn's holder stopped without an ending and no one resumed it within the orphan grace"}"#;

/// What a begin under an [`OnBusy`] policy does after an attempt failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BusyStep {
    /// Give the attempt's error to the caller: not a busy session, the
    /// `reject` policy, or the bound ran out.
    Refuse,
    /// Ask `turn_id` (the session's holder) to stop, then wait as below.
    Interrupt {
        /// The holder to interrupt.
        turn_id: String,
        /// Longest to wait before the next attempt.
        poll: Duration,
    },
    /// Wait for a release of the session, at most `poll`, then try again.
    Wait {
        /// Longest to wait before the next attempt.
        poll: Duration,
    },
}

/// The next step of a begin under `on_busy` whose attempt failed with
/// `error`, `elapsed` after the first attempt, having already asked
/// `interrupted` to stop. Only `session_busy` waits, and a transient
/// conflict (the store's begin gave up because the session's state kept
/// changing under it: a storm of waiters on one session does that); a busy
/// request (`request_in_flight`), a full user (`user_at_capacity`), a
/// pending confirmation and an outage are answered at once. The poll is the
/// holder's remaining lease (when it may simply expire), at most
/// [`crate::limits::MAX_BUSY_POLL`], and never past the bound.
pub fn busy_step(
    error: &Error,
    on_busy: OnBusy,
    elapsed: Duration,
    interrupted: Option<&str>,
) -> BusyStep {
    let left = on_busy.wait.saturating_sub(elapsed);
    if on_busy.policy == BusyPolicy::Reject || left.is_zero() {
        return BusyStep::Refuse;
    }
    let (active_turn_id, retry_after) = match error {
        Error::SessionBusy {
            active_turn_id,
            retry_after,
        } => (active_turn_id, *retry_after),
        contended if contended.is_conflict() => {
            return BusyStep::Wait {
                poll: crate::limits::MAX_BUSY_POLL.min(left),
            }
        }
        _ => return BusyStep::Refuse,
    };
    let poll = retry_after
        .min(crate::limits::MAX_BUSY_POLL)
        .min(left)
        .max(Duration::from_millis(1));
    match on_busy.policy {
        BusyPolicy::Interrupt if interrupted != Some(active_turn_id.as_str()) => {
            BusyStep::Interrupt {
                turn_id: active_turn_id.clone(),
                poll,
            }
        }
        _ => BusyStep::Wait { poll },
    }
}

/// Whether an `interrupt` may ask `state`'s turn to stop: only a running
/// one. A `session_busy` can name the head of a waiting queue (a free
/// session whose queue is about to be taken); the interrupter waits
/// behind it, and never cancels a message its sender was told is queued.
pub fn interruptible(state: TurnState) -> bool {
    state == TurnState::Running
}

/// The policy a begin that names none follows, after its first attempt
/// failed with `error`: the session's default (`session_default`, read
/// from its view only then), when the failure is a busy session and a
/// default other than `reject` was set. `None`: answer `error`.
pub fn session_policy(error: &Error, session_default: Option<OnBusy>) -> Option<OnBusy> {
    match (error, session_default) {
        (Error::SessionBusy { .. }, Some(on_busy)) if on_busy.policy != BusyPolicy::Reject => {
            Some(on_busy)
        }
        _ => None,
    }
}

/// Whether a begin that asked `supersede` with `interrupt` and was queued
/// as `queued_turn_id` asks the session's holder (`holder`, its turn id
/// and state) to stop: only a running turn other than its own (a handoff
/// may already have started the queued turn itself).
pub fn supersede_interrupts(
    on_busy: OnBusy,
    queued_turn_id: &str,
    holder: Option<(&str, TurnState)>,
) -> bool {
    on_busy.interrupt
        && on_busy.policy == BusyPolicy::Supersede
        && holder.is_some_and(|(turn_id, state)| turn_id != queued_turn_id && interruptible(state))
}

/// The error a turn ended by an operator's force-release records, the same
/// on every store.
pub const RELEASED_ERROR: &str = r#"{"code":"released","message":"an operator force-released the turn's session; a repeat of its request restarts it"}"#;

/// What a force-release of a session ends, judged from its row under the
/// session's lock: the holder the row names, live or expired (a stuck
/// holder is exactly what an operator releases), which must be a running
/// turn; `None` when the row names no holder, or when the release is of
/// one holder (`only`, as the sweeper releases a turn that ignored its
/// cancel) and the row names another: that turn ended meanwhile, and the
/// session's new holder is not the one to release.
///
/// # Errors
/// `corrupt` when the row names a holder whose turn is missing or no longer
/// running: every ending clears the holder in its own transaction.
pub fn release_target<'a>(
    holder_turn_id: Option<&'a str>,
    holder_state: Option<&str>,
    only: Option<&str>,
) -> Result<Option<&'a str>, Error> {
    match (holder_turn_id, holder_state) {
        (None, _) => Ok(None),
        (Some(turn_id), _) if only.is_some_and(|only| only != turn_id) => Ok(None),
        (Some(turn_id), Some("running")) => Ok(Some(turn_id)),
        (Some(turn_id), state) => Err(Error::corrupt(format!(
            "the session names {turn_id} as its holder, but that turn is {}",
            state.map_or("missing".to_owned(), |s| format!("{s:?}"))
        ))),
    }
}

/// What a cancel request does to a turn (docs/protocol.md §3.7), from its
/// state and whether it was asked before. Every store applies it: the SQL
/// stores as one conditional `UPDATE` (`agentgate_store_sql::views::request_cancel`),
/// checked against this over every state by
/// `agentgate_store_sql::testing::cancel_agrees_with_decide`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelStep {
    /// A queued turn has no holder to ask: it leaves its queue and ends
    /// `cancelled` now.
    EndQueued,
    /// A running turn not asked before: record the request (its time, once);
    /// the holder learns it by heartbeat or by a refused tool claim, and ends
    /// the turn `cancelled`.
    Record,
    /// Asked before, or ended: nothing changes.
    Nothing,
}

/// See [`CancelStep`].
pub fn cancel_step(state: TurnState, requested_before: bool) -> CancelStep {
    match state {
        TurnState::Queued => CancelStep::EndQueued,
        TurnState::Running if !requested_before => CancelStep::Record,
        TurnState::Running
        | TurnState::Succeeded
        | TurnState::Failed
        | TurnState::AwaitingConfirmation
        | TurnState::Confirmed
        | TurnState::Abandoned
        | TurnState::Cancelled
        | TurnState::Superseded => CancelStep::Nothing,
    }
}

/// Whether a turn asked to stop at `requested_at_ms` has had its grace to
/// end itself, and is to be force-released.
pub fn cancel_ignored(requested_at_ms: i64, now_ms: i64, grace_ms: i64) -> bool {
    now_ms.saturating_sub(requested_at_ms) >= grace_ms
}

/// Whether an orphan without a live lease since `orphaned_since_ms` has
/// waited out its grace and is to be ended `abandoned`.
pub fn abandon_due(orphaned_since_ms: i64, now_ms: i64, grace_ms: i64) -> bool {
    now_ms.saturating_sub(orphaned_since_ms) >= grace_ms
}

/// A tool execution row as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionSnapshot {
    /// The execution.
    pub execution_id: String,
    /// Its state.
    pub state: ToolState,
    /// Attempts so far.
    pub attempt: u32,
    /// Fence of the holder that claimed it last.
    pub fence: Fence,
}

/// What a store must do for a tool claim.
#[derive(Debug)]
pub enum ToolDecision {
    /// Insert the execution, running under the caller's fence, attempt 1.
    Insert,
    /// Return the stored result.
    Cached,
    /// Claim it again under the caller's fence.
    Reclaim {
        /// The attempt number to record.
        attempt: u32,
        /// What became of the previous attempt.
        previous: PreviousOutcome,
    },
    /// Refuse; write nothing.
    Reject(Error),
}

/// Decides a tool claim by a caller holding a live lease with `fence`;
/// `cancelled` is the turn's id when a cancel was requested for it.
pub fn decide_tool_claim(
    existing: Option<&ExecutionSnapshot>,
    cancelled: Option<&str>,
    fence: Fence,
    lease_expires_at_ms: i64,
    now_ms: i64,
) -> ToolDecision {
    // A turn asked to stop runs no more tools, not even a cached one: its
    // holder is to end it, not to go on.
    if let Some(turn_id) = cancelled.filter(|_| !planted(Plant::ClaimIgnoresCancel)) {
        return ToolDecision::Reject(Error::TurnCancelled {
            turn_id: turn_id.to_owned(),
        });
    }
    // The SQL stores also state this first case (and the per-turn execution
    // limit, and no cancel request) in one statement for their fast path:
    // the stores' `ClaimSql::first_claim_sql` (MySQL's in `fast.rs`). Change them
    // with it.
    let Some(execution) = existing else {
        return ToolDecision::Insert;
    };
    let previous = match execution.state {
        ToolState::Succeeded => return ToolDecision::Cached,
        ToolState::Failed => PreviousOutcome::Failed,
        // Claimed under this very lease: the holder is running it right now.
        ToolState::Running
            if execution.fence >= fence
                && !(planted(Plant::RepeatClaimRunsAgain) && execution.fence == fence) =>
        {
            return ToolDecision::Reject(Error::ToolInFlight {
                execution_id: execution.execution_id.clone(),
                attempt: execution.attempt,
                retry_after: remaining(lease_expires_at_ms, now_ms),
            });
        }
        // Claimed under an older lease that was taken over: it died mid-call.
        ToolState::Running => PreviousOutcome::Unknown,
    };
    if execution.attempt >= MAX_TOOL_ATTEMPTS {
        return ToolDecision::Reject(Error::AttemptsExhausted {
            what: format!("tool execution {}", execution.execution_id),
        });
    }
    ToolDecision::Reclaim {
        attempt: execution.attempt + 1,
        previous,
    }
}

/// A live lease, as a step checked it on the store's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckedLease {
    /// The grant's fence, which every write of the step is conditioned on.
    pub fence: Fence,
    /// When the lease expires, store-clock milliseconds.
    pub lease_expires_at_ms: i64,
    /// The store's now when it was checked.
    pub now_ms: i64,
}

/// A lease kept in the session row, as a step read it for one turn.
#[derive(Clone, Copy, Debug)]
pub struct RowLeaseFacts<'a> {
    /// Whether the turn is running.
    pub turn_running: bool,
    /// The session's holder (`None` when released or no session row).
    pub holder_turn_id: Option<&'a str>,
    /// The holder's token digest.
    pub lease_token_hash: Option<&'a str>,
    /// The session's newest fence (`None` when no session row).
    pub fence: Option<i64>,
    /// The lease's expiry.
    pub lease_expires_at_ms: Option<i64>,
    /// The store's now.
    pub now_ms: i64,
}

/// Whether the caller (`turn_id`, `token_digest`) holds the live lease in
/// the session row; `lease_lost` says why not.
///
/// # Errors
/// `lease_lost` with the reason.
pub fn check_row_lease(
    facts: &RowLeaseFacts<'_>,
    turn_id: &str,
    token_digest: &str,
) -> Result<CheckedLease, Error> {
    let reason = if !facts.turn_running {
        "turn already ended"
    } else if facts.holder_turn_id != Some(turn_id) {
        "taken over or released"
    } else if facts.lease_token_hash != Some(token_digest) {
        "wrong lease token"
    } else {
        match (facts.lease_expires_at_ms, facts.fence) {
            (Some(expires), Some(fence))
                if expires > facts.now_ms || planted(Plant::LeaseCheckIgnoresExpiry) =>
            {
                return Ok(CheckedLease {
                    fence: Fence(fence),
                    lease_expires_at_ms: expires,
                    now_ms: facts.now_ms,
                })
            }
            _ => "lease expired",
        }
    };
    Err(Error::LeaseLost { reason })
}

/// Whether a lease the external layer reports (`held`) is the turn's live
/// lease: the turn must be running and the layer's fence must be the turn's
/// and the session's newest — what stops a holder whose layer lease vanished
/// (Redis restarted) after a newer turn was granted.
///
/// # Errors
/// `lease_lost` with the reason.
pub fn check_layer_lease(
    held: Option<&crate::lease::LiveLease>,
    turn_running: bool,
    turn_fence: i64,
    session_fence: Option<i64>,
    now_ms: i64,
) -> Result<CheckedLease, Error> {
    let reason = match held {
        _ if !turn_running => "turn already ended",
        None => "lease expired, taken over or released",
        Some(live) if live.fence.0 != turn_fence || session_fence != Some(turn_fence) => {
            "superseded by a newer fence"
        }
        Some(live) => {
            return Ok(CheckedLease {
                fence: live.fence,
                lease_expires_at_ms: now_ms + live.expires_in_ms,
                now_ms,
            })
        }
    };
    Err(Error::LeaseLost { reason })
}

#[cfg(test)]
mod tests;
