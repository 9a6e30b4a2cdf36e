//! Unit tests of the pure decisions: every row of the begin table (docs/protocol.md §3.1), the
//! session, pending and permit gates, confirmations and tool claims, each
//! with its failure side and its boundary (live means `expires_at > now`).

use super::*;
use crate::error::ErrorKind;

/// The store's clock in every test.
const NOW: i64 = 1_000_000;
const USER: &str = "alice";
const SESSION: &str = "session-1";
const FINGERPRINT: &str = "fingerprint-1";
/// The request's own turn, when one is recorded.
const OWN: &str = "turn-own";
/// Another turn of the same session.
const OTHER: &str = "turn-other";
/// A turn awaiting confirmation.
const PENDING: &str = "turn-pending";
/// The continuation that confirmed [`PENDING`].
const CONTINUATION: &str = "turn-continuation";

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn turn(turn_id: &str, state: TurnState, attempt: u32) -> TurnSnapshot {
    TurnSnapshot {
        turn_id: turn_id.to_owned(),
        session_id: SESSION.to_owned(),
        fingerprint: FINGERPRINT.to_owned(),
        state,
        attempt,
        retryable: false,
        confirmed_by: None,
    }
}

fn retryable(mut snapshot: TurnSnapshot) -> TurnSnapshot {
    snapshot.retryable = true;
    snapshot
}

fn holder(turn_id: &str, lease_expires_at_ms: i64) -> HolderSnapshot {
    HolderSnapshot {
        turn_id: turn_id.to_owned(),
        lease_expires_at_ms,
    }
}

fn pending(turn_id: &str, expires_at_ms: i64) -> PendingSnapshot {
    PendingSnapshot {
        turn_id: turn_id.to_owned(),
        expires_at_ms,
    }
}

/// Everything a begin reads, owned, with defaults for an idle session of
/// [`USER`], no recorded turn and a free permit.
struct Begin {
    resume_only: bool,
    user_id: &'static str,
    fingerprint: &'static str,
    confirms: Option<&'static str>,
    session: Option<SessionSnapshot>,
    turn: Option<TurnSnapshot>,
    confirm_target: Option<TurnSnapshot>,
    continuation: Option<TurnSnapshot>,
    load: UserLoad,
    queue_head: Option<&'static str>,
    queue_len: u32,
    /// The user's queued turns in other sessions.
    queued_elsewhere: u32,
    enqueue: Option<QueueMode>,
}

impl Begin {
    fn new() -> Self {
        Self {
            resume_only: false,
            user_id: USER,
            fingerprint: FINGERPRINT,
            confirms: None,
            session: Some(SessionSnapshot {
                user_id: USER.to_owned(),
                holder: None,
                pending: None,
            }),
            turn: None,
            confirm_target: None,
            continuation: None,
            load: UserLoad {
                cap: 5,
                live: 0,
                soonest_expiry_ms: None,
            },
            queue_head: None,
            queue_len: 0,
            queued_elsewhere: 0,
            enqueue: None,
        }
    }

    /// `count` turns of the user queued in their other sessions.
    fn queued_elsewhere(mut self, count: u32) -> Self {
        self.queued_elsewhere = count;
        self
    }

    /// `len` turns queued on the session, `head` first.
    fn queue(mut self, head: &'static str, len: u32) -> Self {
        self.queue_head = Some(head);
        self.queue_len = len;
        self
    }

    fn enqueue(mut self, mode: QueueMode) -> Self {
        self.enqueue = Some(mode);
        self
    }

    fn session_mut(&mut self) -> &mut SessionSnapshot {
        self.session
            .as_mut()
            .expect("the builder starts with a session; tests that drop it do so last")
    }

    fn no_session(mut self) -> Self {
        self.session = None;
        self
    }

    fn session_user(mut self, user_id: &str) -> Self {
        self.session_mut().user_id = user_id.to_owned();
        self
    }

    fn holder(mut self, turn_id: &str, lease_expires_at_ms: i64) -> Self {
        self.session_mut().holder = Some(holder(turn_id, lease_expires_at_ms));
        self
    }

    fn pending(mut self, turn_id: &str, expires_at_ms: i64) -> Self {
        self.session_mut().pending = Some(pending(turn_id, expires_at_ms));
        self
    }

    fn turn(mut self, snapshot: TurnSnapshot) -> Self {
        self.turn = Some(snapshot);
        self
    }

    fn fingerprint(mut self, fingerprint: &'static str) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    fn confirms(mut self, target: Option<TurnSnapshot>) -> Self {
        self.confirms = Some(PENDING);
        self.confirm_target = target;
        self
    }

    fn continuation(mut self, snapshot: TurnSnapshot) -> Self {
        self.continuation = Some(snapshot);
        self
    }

    fn load(mut self, cap: u32, live: u32, soonest_expiry_ms: Option<i64>) -> Self {
        self.load = UserLoad {
            cap,
            live,
            soonest_expiry_ms,
        };
        self
    }

    fn decide(&self) -> BeginDecision {
        decide_begin(&self.facts())
    }

    fn facts(&self) -> BeginFacts<'_> {
        BeginFacts {
            now_ms: NOW,
            user_id: self.user_id,
            session_id: SESSION,
            fingerprint: self.fingerprint,
            confirms: self.confirms,
            session: self.session.as_ref(),
            turn: self.turn.as_ref(),
            confirm_target: self.confirm_target.as_ref(),
            continuation: self.continuation.as_ref(),
            load: self.load,
            resume_only: self.resume_only,
            queue: QueueFacts {
                head: self.queue_head,
                len: self.queue_len,
                // A session's queued turns are its owner's.
                user_len: if self
                    .session
                    .as_ref()
                    .is_some_and(|s| s.user_id != self.user_id)
                {
                    self.queued_elsewhere
                } else {
                    self.queue_len + self.queued_elsewhere
                },
            },
            enqueue: self.enqueue,
        }
    }
}

fn assert_start(decision: BeginDecision, kind: StartKind, attempt: u32) {
    match decision {
        BeginDecision::Start {
            kind: got_kind,
            attempt: got_attempt,
        } => assert_eq!((got_kind, got_attempt), (kind, attempt)),
        other => panic!("expected Start {kind:?} attempt {attempt}, got {other:?}"),
    }
}

fn assert_replay(decision: BeginDecision, turn_id: &str) {
    match decision {
        BeginDecision::Replay { turn_id: got } => assert_eq!(got, turn_id),
        other => panic!("expected Replay of {turn_id}, got {other:?}"),
    }
}

fn rejected(decision: BeginDecision) -> Error {
    match decision {
        BeginDecision::Reject(error) => error,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// Asserts a conflict's kind, the turn it names and its retry-after.
fn assert_conflict(decision: BeginDecision, kind: ErrorKind, turn_id: &str, retry_after: Duration) {
    let error = rejected(decision);
    assert_eq!(error.kind(), kind, "{error:?}");
    assert_eq!(error.active_turn_id(), Some(turn_id), "{error:?}");
    assert_eq!(error.retry_after(), Some(retry_after), "{error:?}");
}

fn assert_expired(decision: BeginDecision) {
    let error = rejected(decision);
    assert_eq!(error.kind(), ErrorKind::ConfirmationExpired, "{error:?}");
}

fn assert_not_found(decision: BeginDecision) {
    let error = rejected(decision);
    assert_eq!(error.kind(), ErrorKind::NotFound, "{error:?}");
}

fn assert_at_capacity(decision: BeginDecision, cap: u32, retry_after: Duration) {
    match rejected(decision) {
        Error::UserAtCapacity {
            cap: got_cap,
            retry_after: got_retry_after,
        } => assert_eq!((got_cap, got_retry_after), (cap, retry_after)),
        other => panic!("expected user_at_capacity, got {other:?}"),
    }
}

const ALL_TURN_STATES: [TurnState; 5] = [
    TurnState::Running,
    TurnState::Succeeded,
    TurnState::Failed,
    TurnState::AwaitingConfirmation,
    TurnState::Confirmed,
];

// ---- the begin table (docs/protocol.md §3.1) -----------------------------

#[test]
fn a_new_request_starts_attempt_one() {
    assert_start(Begin::new().decide(), StartKind::New, 1);
}

#[test]
fn a_new_request_on_a_session_that_does_not_exist_yet_starts_attempt_one() {
    assert_start(Begin::new().no_session().decide(), StartKind::New, 1);
}

#[test]
fn a_repeat_with_another_fingerprint_is_a_payload_mismatch_in_every_state() {
    for state in ALL_TURN_STATES {
        // A live own lease and a live pending confirmation must not mask it.
        let decision = Begin::new()
            .turn(retryable(turn(OWN, state, 2)))
            .holder(OWN, NOW + 5_000)
            .pending(OWN, NOW + 5_000)
            .fingerprint("fingerprint-2")
            .decide();
        let error = rejected(decision);
        assert_eq!(
            error.kind(),
            ErrorKind::PayloadMismatch,
            "{state:?}: {error:?}"
        );
    }
}

#[test]
fn a_payload_mismatch_is_reported_before_attempts_are_exhausted() {
    let decision = Begin::new()
        .turn(retryable(turn(OWN, TurnState::Failed, MAX_TURN_ATTEMPTS)))
        .fingerprint("fingerprint-2")
        .decide();
    assert_eq!(rejected(decision).kind(), ErrorKind::PayloadMismatch);
}

#[test]
fn a_succeeded_turn_replays_without_a_lease_even_when_the_gates_are_shut() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Succeeded, 1))
        .holder(OTHER, NOW + 5_000)
        .load(1, 1, Some(NOW + 5_000))
        .decide();
    assert_replay(decision, OWN);
}

#[test]
fn a_confirmed_turn_replays_its_own_view() {
    let mut confirmed = turn(OWN, TurnState::Confirmed, 1);
    confirmed.confirmed_by = Some(CONTINUATION.to_owned());
    assert_replay(Begin::new().turn(confirmed).decide(), OWN);
}

#[test]
fn a_failed_non_retryable_turn_replays_even_at_the_attempt_limit() {
    for attempt in [1, MAX_TURN_ATTEMPTS] {
        let decision = Begin::new()
            .turn(turn(OWN, TurnState::Failed, attempt))
            .decide();
        assert_replay(decision, OWN);
    }
}

#[test]
fn a_failed_retryable_turn_restarts_with_the_next_attempt() {
    let decision = Begin::new()
        .turn(retryable(turn(OWN, TurnState::Failed, 3)))
        .decide();
    assert_start(decision, StartKind::Restart, 4);
}

#[test]
fn a_running_turn_under_its_own_live_lease_is_in_flight_for_the_remaining_lease() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, 1))
        .holder(OWN, NOW + 1_500)
        .decide();
    assert_conflict(decision, ErrorKind::RequestInFlight, OWN, ms(1_500));
}

#[test]
fn a_lease_with_one_millisecond_left_is_still_live() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, 1))
        .holder(OWN, NOW + 1)
        .decide();
    assert_conflict(decision, ErrorKind::RequestInFlight, OWN, ms(1));
}

#[test]
fn a_running_turn_whose_lease_expires_exactly_now_is_taken_over() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, 2))
        .holder(OWN, NOW)
        .decide();
    assert_start(decision, StartKind::Takeover, 3);
}

#[test]
fn a_running_turn_whose_lease_expired_long_ago_or_was_cleared_is_taken_over() {
    for session in [
        Begin::new().holder(OWN, NOW - 60_000),
        Begin::new(), // the holder row is gone
    ] {
        let decision = session.turn(turn(OWN, TurnState::Running, 1)).decide();
        assert_start(decision, StartKind::Takeover, 2);
    }
}

#[test]
fn a_takeover_waits_for_another_turn_that_took_the_session_meanwhile() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, 1))
        .holder(OTHER, NOW + 2_000)
        .decide();
    assert_conflict(decision, ErrorKind::SessionBusy, OTHER, ms(2_000));
}

#[test]
fn an_awaiting_turn_with_a_live_pending_confirmation_is_awaiting_confirmation() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::AwaitingConfirmation, 1))
        .pending(OWN, NOW + 86_400_000)
        .decide();
    assert_conflict(
        decision,
        ErrorKind::AwaitingConfirmation,
        OWN,
        ms(86_400_000),
    );
}

#[test]
fn an_awaiting_turn_whose_pending_confirmation_has_one_millisecond_left_still_waits() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::AwaitingConfirmation, 1))
        .pending(OWN, NOW + 1)
        .decide();
    assert_conflict(decision, ErrorKind::AwaitingConfirmation, OWN, ms(1));
}

#[test]
fn an_awaiting_turn_whose_pending_confirmation_expired_replays() {
    for expires_at_ms in [NOW, NOW - 1] {
        let decision = Begin::new()
            .turn(turn(OWN, TurnState::AwaitingConfirmation, 1))
            .pending(OWN, expires_at_ms)
            .decide();
        assert_replay(decision, OWN);
    }
}

#[test]
fn an_awaiting_turn_replays_when_the_session_waits_on_another_turn() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::AwaitingConfirmation, 1))
        .pending(OTHER, NOW + 5_000)
        .decide();
    assert_replay(decision, OWN);
}

// ---- attempt limit ---------------------------------------------------------

#[test]
fn the_last_allowed_attempt_starts_and_the_one_after_exhausts() {
    let last = MAX_TURN_ATTEMPTS - 1;
    assert_start(
        Begin::new()
            .turn(retryable(turn(OWN, TurnState::Failed, last)))
            .decide(),
        StartKind::Restart,
        MAX_TURN_ATTEMPTS,
    );
    assert_start(
        Begin::new()
            .turn(turn(OWN, TurnState::Running, last))
            .holder(OWN, NOW)
            .decide(),
        StartKind::Takeover,
        MAX_TURN_ATTEMPTS,
    );
    for snapshot in [
        retryable(turn(OWN, TurnState::Failed, MAX_TURN_ATTEMPTS)),
        turn(OWN, TurnState::Running, MAX_TURN_ATTEMPTS),
    ] {
        let decision = Begin::new().turn(snapshot).holder(OWN, NOW).decide();
        assert!(
            matches!(decision, BeginDecision::Exhaust),
            "expected Exhaust, got {decision:?}"
        );
    }
}

#[test]
fn a_live_own_lease_at_the_attempt_limit_is_in_flight_not_exhausted() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, MAX_TURN_ATTEMPTS))
        .holder(OWN, NOW + 700)
        .decide();
    assert_conflict(decision, ErrorKind::RequestInFlight, OWN, ms(700));
}

// ---- gates -----------------------------------------------------------------

#[test]
fn another_live_holder_makes_the_session_busy_for_its_remaining_lease() {
    let decision = Begin::new().holder(OTHER, NOW + 2_500).decide();
    assert_conflict(decision, ErrorKind::SessionBusy, OTHER, ms(2_500));
}

#[test]
fn a_holder_whose_lease_expires_exactly_now_no_longer_holds_the_session() {
    for lease_expires_at_ms in [NOW, NOW - 1] {
        let decision = Begin::new().holder(OTHER, lease_expires_at_ms).decide();
        assert_start(decision, StartKind::New, 1);
    }
}

#[test]
fn a_restart_passes_the_session_gate_too() {
    let decision = Begin::new()
        .turn(retryable(turn(OWN, TurnState::Failed, 1)))
        .holder(OTHER, NOW + 900)
        .decide();
    assert_conflict(decision, ErrorKind::SessionBusy, OTHER, ms(900));
}

#[test]
fn a_live_pending_confirmation_of_another_turn_blocks_a_brand_new_request() {
    let decision = Begin::new().pending(PENDING, NOW + 60_000).decide();
    assert_conflict(
        decision,
        ErrorKind::AwaitingConfirmation,
        PENDING,
        ms(60_000),
    );
}

#[test]
fn a_live_pending_confirmation_blocks_a_restart_of_an_older_turn() {
    let decision = Begin::new()
        .turn(retryable(turn(OWN, TurnState::Failed, 1)))
        .pending(PENDING, NOW + 60_000)
        .decide();
    assert_conflict(
        decision,
        ErrorKind::AwaitingConfirmation,
        PENDING,
        ms(60_000),
    );
}

#[test]
fn a_pending_confirmation_is_reported_before_a_busy_session() {
    let decision = Begin::new()
        .pending(PENDING, NOW + 60_000)
        .holder(OTHER, NOW + 1_000)
        .decide();
    assert_conflict(
        decision,
        ErrorKind::AwaitingConfirmation,
        PENDING,
        ms(60_000),
    );
}

#[test]
fn an_expired_pending_confirmation_no_longer_blocks_new_requests() {
    for expires_at_ms in [NOW, NOW - 1] {
        let decision = Begin::new().pending(PENDING, expires_at_ms).decide();
        assert_start(decision, StartKind::New, 1);
    }
}

#[test]
fn a_user_at_the_cap_is_at_capacity_until_the_soonest_lease_expires() {
    let decision = Begin::new().load(3, 3, Some(NOW + 4_200)).decide();
    assert_at_capacity(decision, 3, ms(4_200));
}

#[test]
fn a_user_over_a_lowered_cap_is_at_capacity() {
    let decision = Begin::new().load(2, 5, Some(NOW + 10)).decide();
    assert_at_capacity(decision, 2, ms(10));
}

#[test]
fn a_user_one_below_the_cap_may_start() {
    let decision = Begin::new().load(3, 2, Some(NOW + 4_200)).decide();
    assert_start(decision, StartKind::New, 1);
}

#[test]
fn capacity_retry_after_is_never_zero() {
    // A soonest expiry at or before now (the store counted a lease that just
    // ran out), or none at all, still asks for at least 1 ms.
    for soonest_expiry_ms in [Some(NOW), Some(NOW - 500), None] {
        let decision = Begin::new().load(1, 1, soonest_expiry_ms).decide();
        assert_at_capacity(decision, 1, ms(1));
    }
}

#[test]
fn a_takeover_needs_a_free_permit() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Running, 1))
        .holder(OWN, NOW)
        .load(2, 2, Some(NOW + 300))
        .decide();
    assert_at_capacity(decision, 2, ms(300));
}

#[test]
fn a_busy_session_is_reported_before_a_full_user() {
    let decision = Begin::new()
        .holder(OTHER, NOW + 800)
        .load(1, 1, Some(NOW + 800))
        .decide();
    assert_conflict(decision, ErrorKind::SessionBusy, OTHER, ms(800));
}

// ---- session ownership -----------------------------------------------------

#[test]
fn a_session_bound_to_another_user_is_not_found() {
    assert_not_found(Begin::new().session_user("mallory").decide());
}

#[test]
fn another_users_session_with_a_queue_is_not_found_not_corrupt() {
    // Its queued turns are its owner's, none the requester's: the session
    // is not this user's to see, which is no corrupt state (found by
    // schemathesis: a 503 `corrupt row` for another user's queued session).
    assert_not_found(
        Begin::new()
            .session_user("mallory")
            .queue("turn_q", 2)
            .enqueue(QueueMode::Enqueue)
            .decide(),
    );
}

#[test]
fn a_users_session_queue_longer_than_their_queued_turns_is_corrupt() {
    let facts = Begin::new().queue("turn_q", 3);
    let decision = decide_begin(&BeginFacts {
        queue: QueueFacts {
            head: Some("turn_q"),
            len: 3,
            user_len: 2,
        },
        ..facts.facts()
    });
    match decision {
        BeginDecision::Reject(error) => assert!(error.to_string().contains("corrupt"), "{error}"),
        other => panic!("expected corrupt, got {other:?}"),
    }
}

#[test]
fn another_users_session_leaks_nothing_about_its_turns() {
    // Neither a replay nor a mismatch nor a conflict: any of those would tell
    // the caller the session exists.
    for (state, fingerprint) in [
        (TurnState::Succeeded, FINGERPRINT),
        (TurnState::Succeeded, "fingerprint-2"),
        (TurnState::Running, FINGERPRINT),
    ] {
        let decision = Begin::new()
            .session_user("mallory")
            .holder(OWN, NOW + 1_000)
            .turn(turn(OWN, state, 1))
            .fingerprint(fingerprint)
            .decide();
        assert_not_found(decision);
    }
}

// ---- confirmations ---------------------------------------------------------

fn awaiting_target() -> TurnSnapshot {
    turn(PENDING, TurnState::AwaitingConfirmation, 1)
}

fn confirmed_target() -> TurnSnapshot {
    let mut target = turn(PENDING, TurnState::Confirmed, 1);
    target.confirmed_by = Some(CONTINUATION.to_owned());
    target
}

#[test]
fn confirming_the_live_pending_turn_starts_a_new_turn() {
    let decision = Begin::new()
        .pending(PENDING, NOW + 1)
        .confirms(Some(awaiting_target()))
        .decide();
    assert_start(decision, StartKind::New, 1);
}

#[test]
fn a_confirmation_still_needs_a_free_permit() {
    let decision = Begin::new()
        .pending(PENDING, NOW + 60_000)
        .confirms(Some(awaiting_target()))
        .load(1, 1, Some(NOW + 50))
        .decide();
    assert_at_capacity(decision, 1, ms(50));
}

#[test]
fn confirming_an_unknown_turn_is_not_found() {
    let decision = Begin::new()
        .pending(PENDING, NOW + 60_000)
        .confirms(None)
        .decide();
    assert_not_found(decision);
}

#[test]
fn confirming_a_turn_of_another_session_is_not_found() {
    let mut elsewhere = awaiting_target();
    elsewhere.session_id = "session-2".to_owned();
    let decision = Begin::new()
        .pending(PENDING, NOW + 60_000)
        .confirms(Some(elsewhere))
        .decide();
    assert_not_found(decision);
}

#[test]
fn confirming_an_expired_pending_confirmation_is_confirmation_expired() {
    for expires_at_ms in [NOW, NOW - 1] {
        let decision = Begin::new()
            .pending(PENDING, expires_at_ms)
            .confirms(Some(awaiting_target()))
            .decide();
        assert_expired(decision);
    }
}

#[test]
fn confirming_an_awaiting_turn_the_session_moved_on_from_is_confirmation_expired() {
    // The session waits on another turn, or on nothing: the target's
    // pending confirmation ran out (only then can the session move on).
    for session in [Begin::new().pending(OTHER, NOW + 60_000), Begin::new()] {
        let decision = session.confirms(Some(awaiting_target())).decide();
        assert_expired(decision);
    }
}

#[test]
fn confirming_a_turn_that_is_not_awaiting_confirmation_is_not_found() {
    for state in [TurnState::Running, TurnState::Succeeded, TurnState::Failed] {
        let decision = Begin::new()
            .pending(PENDING, NOW + 60_000)
            .confirms(Some(turn(PENDING, state, 1)))
            .decide();
        assert_not_found(decision);
    }
}

#[test]
fn a_second_confirmation_while_the_continuation_runs_is_in_flight_as_the_continuation() {
    let decision = Begin::new()
        .holder(CONTINUATION, NOW + 3_000)
        .confirms(Some(confirmed_target()))
        .continuation(turn(CONTINUATION, TurnState::Running, 1))
        .decide();
    assert_conflict(
        decision,
        ErrorKind::RequestInFlight,
        CONTINUATION,
        ms(3_000),
    );
}

#[test]
fn a_second_confirmation_while_the_continuations_lease_is_dead_waits_a_second() {
    // Only the continuation's own client can take it over; this caller is
    // told to come back after a bounded pause instead of spinning.
    let decision = Begin::new()
        .holder(CONTINUATION, NOW)
        .confirms(Some(confirmed_target()))
        .continuation(turn(CONTINUATION, TurnState::Running, 1))
        .decide();
    assert_conflict(decision, ErrorKind::RequestInFlight, CONTINUATION, ms(1000));
}

#[test]
fn a_second_confirmation_after_the_continuation_ended_replays_the_continuation() {
    for state in [TurnState::Succeeded, TurnState::Failed] {
        let decision = Begin::new()
            .confirms(Some(confirmed_target()))
            .continuation(turn(CONTINUATION, state, 1))
            .decide();
        assert_replay(decision, CONTINUATION);
    }
}

#[test]
fn a_confirmed_target_without_its_continuation_is_not_found() {
    let decision = Begin::new().confirms(Some(confirmed_target())).decide();
    assert_not_found(decision);
}

#[test]
fn a_repeat_of_a_confirmation_request_follows_its_own_turn() {
    // Once the confirmation created its turn, a repeat of the same request
    // is judged by that turn, not by the target.
    let decision = Begin::new()
        .holder(OWN, NOW + 1_200)
        .confirms(Some(confirmed_target()))
        .turn(turn(OWN, TurnState::Running, 1))
        .decide();
    assert_conflict(decision, ErrorKind::RequestInFlight, OWN, ms(1_200));
}

// ---- tool claims -----------------------------------------------------------

const FENCE: Fence = Fence(42);
const LEASE_EXPIRES_AT_MS: i64 = NOW + 20_000;

fn execution(state: ToolState, attempt: u32, fence: Fence) -> ExecutionSnapshot {
    ExecutionSnapshot {
        execution_id: "exec-1".to_owned(),
        state,
        attempt,
        fence,
    }
}

fn claim(existing: Option<ExecutionSnapshot>) -> ToolDecision {
    decide_tool_claim(existing.as_ref(), None, FENCE, LEASE_EXPIRES_AT_MS, NOW)
}

fn assert_reclaim(decision: ToolDecision, attempt: u32, previous: PreviousOutcome) {
    match decision {
        ToolDecision::Reclaim {
            attempt: got_attempt,
            previous: got_previous,
        } => assert_eq!((got_attempt, got_previous), (attempt, previous)),
        other => panic!("expected Reclaim attempt {attempt} {previous:?}, got {other:?}"),
    }
}

fn tool_rejected(decision: ToolDecision) -> Error {
    match decision {
        ToolDecision::Reject(error) => error,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn a_first_tool_claim_inserts() {
    let decision = claim(None);
    assert!(matches!(decision, ToolDecision::Insert), "{decision:?}");
}

#[test]
fn a_succeeded_execution_is_cached_whatever_its_fence_or_attempts() {
    for snapshot in [
        execution(ToolState::Succeeded, 1, FENCE),
        execution(ToolState::Succeeded, 3, Fence(FENCE.0 - 1)),
        execution(ToolState::Succeeded, MAX_TOOL_ATTEMPTS, FENCE),
    ] {
        let decision = claim(Some(snapshot));
        assert!(matches!(decision, ToolDecision::Cached), "{decision:?}");
    }
}

#[test]
fn a_failed_execution_is_reclaimed_with_previous_failed() {
    for fence in [FENCE, Fence(FENCE.0 - 1)] {
        let decision = claim(Some(execution(ToolState::Failed, 2, fence)));
        assert_reclaim(decision, 3, PreviousOutcome::Failed);
    }
}

#[test]
fn a_running_execution_under_the_callers_own_fence_is_in_flight() {
    let decision = claim(Some(execution(ToolState::Running, 3, FENCE)));
    match tool_rejected(decision) {
        Error::ToolInFlight {
            execution_id,
            attempt,
            retry_after,
        } => {
            assert_eq!(execution_id, "exec-1");
            assert_eq!(attempt, 3, "the running attempt");
            assert_eq!(retry_after, ms(20_000));
        }
        other => panic!("expected tool_in_flight, got {other:?}"),
    }
}

#[test]
fn a_tool_in_flight_retry_after_is_never_zero() {
    let decision = decide_tool_claim(
        Some(&execution(ToolState::Running, 1, FENCE)),
        None,
        FENCE,
        NOW,
        NOW,
    );
    let error = tool_rejected(decision);
    assert_eq!(error.kind(), ErrorKind::ToolInFlight, "{error:?}");
    assert_eq!(error.retry_after(), Some(ms(1)));
}

#[test]
fn a_cancelled_turn_claims_no_tool_not_even_a_cached_one() {
    for existing in [
        None,
        Some(execution(ToolState::Succeeded, 1, FENCE)),
        Some(execution(ToolState::Failed, 1, FENCE)),
        Some(execution(ToolState::Running, 1, Fence(FENCE.0 - 1))),
    ] {
        let decision = decide_tool_claim(existing.as_ref(), Some("t1"), FENCE, NOW + 1, NOW);
        let error = tool_rejected(decision);
        assert_eq!(error.kind(), ErrorKind::TurnCancelled, "{existing:?}");
        assert_eq!(error.retry_after(), None);
    }
}

#[test]
fn a_running_execution_under_an_older_fence_is_reclaimed_with_previous_unknown() {
    let decision = claim(Some(execution(ToolState::Running, 1, Fence(FENCE.0 - 1))));
    assert_reclaim(decision, 2, PreviousOutcome::Unknown);
}

#[test]
fn the_last_tool_attempt_is_reclaimed_and_the_one_after_is_exhausted() {
    let older = Fence(FENCE.0 - 1);
    assert_reclaim(
        claim(Some(execution(
            ToolState::Failed,
            MAX_TOOL_ATTEMPTS - 1,
            FENCE,
        ))),
        MAX_TOOL_ATTEMPTS,
        PreviousOutcome::Failed,
    );
    for snapshot in [
        execution(ToolState::Failed, MAX_TOOL_ATTEMPTS, FENCE),
        execution(ToolState::Running, MAX_TOOL_ATTEMPTS, older),
    ] {
        match tool_rejected(claim(Some(snapshot))) {
            Error::AttemptsExhausted { what } => assert!(what.contains("exec-1"), "{what}"),
            other => panic!("expected attempts_exhausted, got {other:?}"),
        }
    }
}

#[test]
fn an_execution_in_flight_at_the_attempt_limit_is_in_flight_not_exhausted() {
    let decision = claim(Some(execution(
        ToolState::Running,
        MAX_TOOL_ATTEMPTS,
        FENCE,
    )));
    assert_eq!(tool_rejected(decision).kind(), ErrorKind::ToolInFlight);
}

fn row_facts() -> RowLeaseFacts<'static> {
    RowLeaseFacts {
        turn_running: true,
        holder_turn_id: Some("t1"),
        lease_token_hash: Some("d1"),
        fence: Some(7),
        lease_expires_at_ms: Some(2_000),
        now_ms: 1_000,
    }
}

fn lost_reason(result: Result<CheckedLease, Error>) -> &'static str {
    match result {
        Err(Error::LeaseLost { reason }) => reason,
        other => panic!("expected lease_lost, got {other:?}"),
    }
}

#[test]
fn row_lease_live_and_every_refusal() {
    let live = check_row_lease(&row_facts(), "t1", "d1").expect("live");
    assert_eq!(
        live,
        CheckedLease {
            fence: Fence(7),
            lease_expires_at_ms: 2_000,
            now_ms: 1_000
        }
    );
    let ended = RowLeaseFacts {
        turn_running: false,
        ..row_facts()
    };
    assert_eq!(
        lost_reason(check_row_lease(&ended, "t1", "d1")),
        "turn already ended"
    );
    assert_eq!(
        lost_reason(check_row_lease(&row_facts(), "t2", "d1")),
        "taken over or released"
    );
    assert_eq!(
        lost_reason(check_row_lease(&row_facts(), "t1", "d2")),
        "wrong lease token"
    );
    let expired = RowLeaseFacts {
        now_ms: 2_000,
        ..row_facts()
    };
    assert_eq!(
        lost_reason(check_row_lease(&expired, "t1", "d1")),
        "lease expired"
    );
}

#[test]
fn layer_lease_needs_the_newest_fence() {
    let held = crate::lease::LiveLease {
        session_id: "s".into(),
        fence: Fence(7),
        expires_in_ms: 500,
    };
    let live = check_layer_lease(Some(&held), true, 7, Some(7), 1_000).expect("live");
    assert_eq!(live.lease_expires_at_ms, 1_500);
    assert_eq!(
        lost_reason(check_layer_lease(Some(&held), false, 7, Some(7), 1_000)),
        "turn already ended"
    );
    assert_eq!(
        lost_reason(check_layer_lease(None, true, 7, Some(7), 1_000)),
        "lease expired, taken over or released"
    );
    assert_eq!(
        lost_reason(check_layer_lease(Some(&held), true, 7, Some(8), 1_000)),
        "superseded by a newer fence"
    );
}

#[test]
fn an_abandoned_turn_restarts_with_the_next_attempt_and_exhausts_at_the_limit() {
    let decision = Begin::new()
        .turn(turn(OWN, TurnState::Abandoned, 2))
        .decide();
    assert_start(decision, StartKind::Restart, 3);
    let exhausted = Begin::new()
        .turn(turn(OWN, TurnState::Abandoned, MAX_TURN_ATTEMPTS))
        .decide();
    assert!(matches!(exhausted, BeginDecision::Exhaust), "{exhausted:?}");
}

#[test]
fn an_abandoned_turn_restarts_only_through_the_session_and_permit_gates() {
    let busy = Begin::new()
        .turn(turn(OWN, TurnState::Abandoned, 1))
        .holder(OTHER, NOW + 700)
        .decide();
    assert_conflict(busy, ErrorKind::SessionBusy, OTHER, ms(700));
}

mod orphans {
    use super::*;
    use crate::ids::{ClientRequestId, Fence, LeaseToken, SessionId, TurnId, UserId};
    use crate::model::{BeginOutcome, Grant};

    fn grant() -> Grant {
        Grant {
            turn_id: TurnId::new("turn-1").unwrap(),
            session_id: SessionId::new(SESSION).unwrap(),
            user_id: UserId::new(USER).unwrap(),
            client_request_id: ClientRequestId::new("msg-1").unwrap(),
            lease_token: LeaseToken::generate(),
            fence: Fence(7),
            attempt: 2,
            takeover: true,
            lease_expires_in_ms: 30_000,
            confirmation: None,
        }
    }

    #[test]
    fn a_started_begin_is_a_claim() {
        let step = orphan_claim_step(Ok(BeginOutcome::Started(grant()))).unwrap();
        assert_eq!(step.map(|g| g.fence), Some(Fence(7)));
    }

    #[test]
    fn someone_else_holding_the_turn_or_session_or_permits_passes() {
        let refusals = [
            Error::RequestInFlight {
                active_turn_id: OWN.into(),
                retry_after: ms(1),
            },
            Error::SessionBusy {
                active_turn_id: OTHER.into(),
                retry_after: ms(1),
            },
            Error::UserAtCapacity {
                cap: 1,
                retry_after: ms(1),
            },
        ];
        for refusal in refusals {
            assert!(orphan_claim_step(Err(refusal)).unwrap().is_none());
        }
    }

    #[test]
    fn store_errors_and_a_fingerprint_mismatch_are_errors_not_passes() {
        let unavailable = orphan_claim_step(Err(Error::store("down"))).unwrap_err();
        assert_eq!(unavailable.kind(), ErrorKind::StoreUnavailable);
        let mismatch = orphan_claim_step(Err(Error::PayloadMismatch)).unwrap_err();
        assert!(mismatch.to_string().contains("corrupt"), "{mismatch}");
    }

    #[test]
    fn abandonment_is_due_exactly_at_the_grace() {
        assert!(!abandon_due(NOW, NOW + 299_999, 300_000));
        assert!(abandon_due(NOW, NOW + 300_000, 300_000));
        assert!(abandon_due(i64::MIN, NOW, 300_000));
    }
}

#[test]
fn a_resume_claim_takes_over_only_a_running_turn_and_replays_an_ended_one() {
    let mut claim = Begin::new().turn(turn(OWN, TurnState::Running, 1));
    claim.resume_only = true;
    assert_start(claim.decide(), StartKind::Takeover, 2);
    for ended in [
        retryable(turn(OWN, TurnState::Failed, 1)),
        turn(OWN, TurnState::Abandoned, 1),
        turn(OWN, TurnState::Succeeded, 1),
    ] {
        let mut stale = Begin::new().turn(ended);
        stale.resume_only = true;
        assert_replay(stale.decide(), OWN);
    }
}

mod layer_acquired {
    use crate::decide::layer_acquired;
    use crate::error::ErrorKind;
    use crate::lease::Acquired;

    #[test]
    fn a_grant_returns_the_remaining_lease() {
        let granted = Acquired::Granted {
            lease_expires_in_ms: 900,
        };
        assert_eq!(layer_acquired(granted, "t-1", 3).expect("granted"), 900);
    }

    #[test]
    fn the_requests_own_turn_holding_is_in_flight_and_another_is_busy() {
        let busy = |holder: &str| Acquired::Busy {
            holder_turn_id: holder.to_owned(),
            expires_in_ms: 0,
        };
        let own = layer_acquired(busy("t-1"), "t-1", 3).expect_err("refused");
        assert_eq!(own.kind(), ErrorKind::RequestInFlight);
        let other = layer_acquired(busy("t-2"), "t-1", 3).expect_err("refused");
        assert_eq!(other.kind(), ErrorKind::SessionBusy);
        // A retry-after of zero would invite a hot loop: at least 1 ms.
        assert_eq!(
            other.retry_after(),
            Some(std::time::Duration::from_millis(1))
        );
    }

    #[test]
    fn a_full_user_is_at_capacity_with_its_cap() {
        let full = Acquired::AtCapacity {
            soonest_expires_in_ms: 250,
        };
        let error = layer_acquired(full, "t-1", 3).expect_err("refused");
        assert_eq!(error.kind(), ErrorKind::UserAtCapacity);
        assert_eq!(
            error.retry_after(),
            Some(std::time::Duration::from_millis(250))
        );
    }
}

#[test]
fn the_abandoned_and_released_errors_are_stored_in_canonical_form() {
    for (text, code) in [
        (crate::decide::ABANDONED_ERROR, "abandoned"),
        (crate::decide::RELEASED_ERROR, "released"),
    ] {
        let value: serde_json::Value = serde_json::from_str(text).expect("valid JSON");
        let canonical = crate::canonical::CanonicalJson::new("error", &value).expect("canonical");
        assert_eq!(canonical.as_str(), text);
        assert_eq!(value["code"], code);
    }
}

#[test]
fn a_stored_load_outside_u32_is_corrupt_and_no_cap_row_is_the_default() {
    let load = UserLoad::read(None, 5, 2, Some(NOW + 10)).expect("valid");
    assert_eq!(
        (load.cap, load.live, load.soonest_expiry_ms),
        (5, 2, Some(NOW + 10))
    );
    assert_eq!(UserLoad::read(Some(1), 5, 0, None).expect("valid").cap, 1);
    for (cap, live) in [(Some(-1), 0), (Some(i64::MAX), 0), (None, -1)] {
        let error = UserLoad::read(cap, 5, live, None).expect_err("corrupt");
        assert_eq!(error.kind(), ErrorKind::StoreUnavailable);
        assert!(error.to_string().contains("corrupt"), "{error}");
    }
}

#[test]
fn a_reserved_fence_must_be_newer_than_the_sessions() {
    assert_eq!(reserved_fence(None, 7).expect("no reservation"), None);
    assert_eq!(
        reserved_fence(Some(Fence(8)), 7).expect("newer"),
        Some(Fence(8))
    );
    for stale in [7, 3] {
        let error = reserved_fence(Some(Fence(stale)), 7).expect_err("overtaken");
        assert!(error.is_conflict(), "{error}");
    }
}

#[test]
fn an_execution_is_the_callers_to_end_only_while_running_under_its_fence() {
    assert!(check_execution("exec-1", Some(("running", 4)), 4).is_ok());
    let missing = check_execution("exec-1", None, 4).expect_err("no row");
    assert_eq!(missing.kind(), ErrorKind::NotFound);
    for (row, reason) in [
        (("succeeded", 4), "tool execution already ended"),
        (("failed", 4), "tool execution already ended"),
        (("running", 5), "tool execution claimed by a newer lease"),
        (("running", 3), "tool execution claimed by a newer lease"),
    ] {
        let error = check_execution("exec-1", Some(row), 4).expect_err("refused");
        assert!(
            matches!(error, Error::LeaseLost { reason: r } if r == reason),
            "{row:?}: {error}"
        );
    }
}

fn busy(turn_id: &str, retry_after: Duration) -> Error {
    Error::SessionBusy {
        active_turn_id: turn_id.to_owned(),
        retry_after,
    }
}

fn policy(policy: BusyPolicy, wait_ms: u64) -> OnBusy {
    OnBusy::new(policy, Some(wait_ms)).expect("within the limit")
}

#[test]
fn reject_refuses_a_busy_session_at_once() {
    let step = busy_step(&busy("t1", ms(900)), OnBusy::REJECT, ms(0), None);
    assert_eq!(step, BusyStep::Refuse);
}

#[test]
fn wait_polls_at_most_the_poll_limit_and_never_past_its_bound() {
    let wait = policy(BusyPolicy::Wait, 2_000);
    // A long lease left: the poll limit.
    assert_eq!(
        busy_step(&busy("t1", ms(30_000)), wait, ms(0), None),
        BusyStep::Wait {
            poll: crate::limits::MAX_BUSY_POLL
        }
    );
    // A lease about to expire: until then.
    assert_eq!(
        busy_step(&busy("t1", ms(40)), wait, ms(0), None),
        BusyStep::Wait { poll: ms(40) }
    );
    // Close to the bound: only what is left of it.
    assert_eq!(
        busy_step(&busy("t1", ms(30_000)), wait, ms(1_900), None),
        BusyStep::Wait { poll: ms(100) }
    );
    // The bound ran out.
    assert_eq!(
        busy_step(&busy("t1", ms(30_000)), wait, ms(2_000), None),
        BusyStep::Refuse
    );
}

#[test]
fn only_a_busy_session_or_a_transient_conflict_waits() {
    let wait = policy(BusyPolicy::Wait, 2_000);
    let in_flight = Error::RequestInFlight {
        active_turn_id: "t1".into(),
        retry_after: ms(100),
    };
    let outage = Error::store("connection refused");
    for error in [in_flight, outage, Error::PayloadMismatch] {
        assert_eq!(
            busy_step(&error, wait, ms(0), None),
            BusyStep::Refuse,
            "{error}"
        );
    }
    let contended = Error::conflict("the session kept changing");
    assert_eq!(
        busy_step(&contended, wait, ms(1_800), None),
        BusyStep::Wait { poll: ms(200) }
    );
}

#[test]
fn interrupt_asks_each_holder_once() {
    let interrupt = policy(BusyPolicy::Interrupt, 5_000);
    assert_eq!(
        busy_step(&busy("t1", ms(30_000)), interrupt, ms(0), None),
        BusyStep::Interrupt {
            turn_id: "t1".into(),
            poll: crate::limits::MAX_BUSY_POLL
        }
    );
    assert_eq!(
        busy_step(&busy("t1", ms(30_000)), interrupt, ms(10), Some("t1")),
        BusyStep::Wait {
            poll: crate::limits::MAX_BUSY_POLL
        }
    );
    // Another turn took the session meanwhile: it is asked too.
    assert!(matches!(
        busy_step(&busy("t2", ms(30_000)), interrupt, ms(10), Some("t1")),
        BusyStep::Interrupt { turn_id, .. } if turn_id == "t2"
    ));
}

#[test]
fn a_busy_policy_is_bounded() {
    let max = crate::limits::MAX_BUSY_WAIT.as_millis() as u64;
    assert!(OnBusy::new(BusyPolicy::Wait, Some(max)).is_ok());
    let over = OnBusy::new(BusyPolicy::Wait, Some(max + 1)).expect_err("over the limit");
    assert_eq!(over.kind(), ErrorKind::InvalidRequest);
    let stray = OnBusy::new(BusyPolicy::Reject, Some(10)).expect_err("reject waits for nothing");
    assert_eq!(stray.kind(), ErrorKind::InvalidRequest);
    assert_eq!(
        OnBusy::new(BusyPolicy::Interrupt, None)
            .expect("default")
            .wait,
        crate::limits::DEFAULT_BUSY_WAIT
    );
}

#[test]
fn a_release_ends_the_running_holder_the_row_names() {
    assert_eq!(release_target(None, None, None).expect("no holder"), None);
    assert_eq!(
        release_target(Some("t1"), Some("running"), None).expect("held"),
        Some("t1")
    );
    for state in [Some("succeeded"), Some("abandoned"), None] {
        let error = release_target(Some("t1"), state, None).expect_err("a holder that ended");
        assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{state:?}");
        assert!(error.to_string().contains("corrupt"), "{error}");
    }
}

#[test]
fn a_release_of_one_holder_passes_over_a_session_held_by_another() {
    assert_eq!(
        release_target(Some("t1"), Some("running"), Some("t1")).expect("that holder"),
        Some("t1")
    );
    assert_eq!(
        release_target(Some("t2"), Some("running"), Some("t1")).expect("another holder"),
        None
    );
    assert_eq!(
        release_target(None, None, Some("t1")).expect("no holder"),
        None
    );
}

#[test]
fn a_cancel_is_ignored_once_its_grace_has_passed() {
    assert!(!cancel_ignored(1_000, 1_999, 1_000));
    assert!(cancel_ignored(1_000, 2_000, 1_000));
    assert!(cancel_ignored(i64::MIN, i64::MAX, 1_000), "saturates");
}

// ------------------------------------------------------------ the queue

#[test]
fn a_busy_session_queues_a_new_request_that_asks_and_refuses_one_that_does_not() {
    let busy = Begin::new().holder(OTHER, NOW + 5_000);
    assert!(matches!(
        busy.decide(),
        BeginDecision::Reject(Error::SessionBusy { .. })
    ));
    let queued = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .enqueue(QueueMode::Enqueue);
    assert!(matches!(
        queued.decide(),
        BeginDecision::Enqueue { supersede: false }
    ));
    let superseding = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queue("turn-queued", 3)
        .enqueue(QueueMode::Supersede);
    assert!(matches!(
        superseding.decide(),
        BeginDecision::Enqueue { supersede: true }
    ));
}

#[test]
fn a_free_session_starts_a_request_that_asked_to_queue() {
    let free = Begin::new().enqueue(QueueMode::Enqueue);
    assert_start(free.decide(), StartKind::New, 1);
    // An expired holder is no holder: the request starts, as without a queue.
    let expired = Begin::new().holder(OTHER, NOW).enqueue(QueueMode::Enqueue);
    assert_start(expired.decide(), StartKind::New, 1);
}

#[test]
fn a_waiting_queue_is_never_jumped() {
    // The session is free, its head about to be taken: a new request queues
    // behind it, or is refused naming it.
    let queued = Begin::new()
        .queue("turn-head", 1)
        .enqueue(QueueMode::Enqueue);
    assert!(matches!(
        queued.decide(),
        BeginDecision::Enqueue { supersede: false }
    ));
    match Begin::new().queue("turn-head", 1).decide() {
        BeginDecision::Reject(Error::SessionBusy {
            active_turn_id,
            retry_after,
        }) => {
            assert_eq!(active_turn_id, "turn-head");
            assert_eq!(retry_after, DEAD_CONTINUATION_RETRY);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_queue_refuses_with_its_bound_and_the_holders_remaining_lease() {
    let limit = crate::limits::MAX_SESSION_QUEUE;
    let below = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queue("turn-head", limit - 1)
        .enqueue(QueueMode::Enqueue);
    assert!(matches!(below.decide(), BeginDecision::Enqueue { .. }));
    let full = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queue("turn-head", limit)
        .enqueue(QueueMode::Enqueue);
    match full.decide() {
        BeginDecision::Reject(Error::QueueFull {
            limit: got,
            retry_after,
        }) => {
            assert_eq!(got, limit);
            assert_eq!(retry_after, ms(5_000));
        }
        other => panic!("{other:?}"),
    }
    // A supersede empties the queue it joins: never refused for its length.
    let superseding = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queue("turn-head", limit)
        .enqueue(QueueMode::Supersede);
    assert!(matches!(
        superseding.decide(),
        BeginDecision::Enqueue { supersede: true }
    ));
}

#[test]
fn a_restart_does_not_jump_a_waiting_queue_but_a_takeover_goes_first() {
    for state in [TurnState::Failed, TurnState::Abandoned] {
        let mut failed = turn(OWN, state, 1);
        failed.retryable = true;
        match Begin::new().turn(failed).queue("turn-head", 1).decide() {
            BeginDecision::Reject(Error::SessionBusy { active_turn_id, .. }) => {
                assert_eq!(active_turn_id, "turn-head");
            }
            other => panic!("{state:?}: {other:?}"),
        }
    }
    // The queue waits behind the expired holder, which its retry resumes.
    let orphan = Begin::new()
        .turn(turn(OWN, TurnState::Running, 1))
        .holder(OWN, NOW)
        .queue("turn-head", 1);
    assert_start(orphan.decide(), StartKind::Takeover, 2);
}

#[test]
fn only_a_running_turn_is_interrupted() {
    assert!(interruptible(TurnState::Running));
    for state in [
        TurnState::Queued,
        TurnState::Succeeded,
        TurnState::Cancelled,
    ] {
        assert!(!interruptible(state));
    }
}

#[test]
fn a_pending_confirmation_refuses_a_request_that_asked_to_queue() {
    let pending = Begin::new()
        .pending(PENDING, NOW + 1_000)
        .queue("turn-head", 1)
        .enqueue(QueueMode::Enqueue);
    assert!(matches!(
        pending.decide(),
        BeginDecision::Reject(Error::AwaitingConfirmation { .. })
    ));
}

#[test]
fn a_queued_head_starts_only_on_a_free_session() {
    let head = turn(OWN, TurnState::Queued, 0);
    let free = Begin::new().turn(head.clone()).queue(OWN, 2);
    assert_start(free.decide(), StartKind::Dequeue, 1);
    // A recovery worker's claim of a stalled queue starts it the same way.
    let mut claim = Begin::new().turn(head.clone()).queue(OWN, 2);
    claim.resume_only = true;
    assert_start(claim.decide(), StartKind::Dequeue, 1);
    for busy in [
        Begin::new()
            .turn(head.clone())
            .queue(OWN, 2)
            .holder(OTHER, NOW + 1),
        Begin::new()
            .turn(head.clone())
            .queue(OWN, 2)
            .pending(PENDING, NOW + 1),
    ] {
        assert!(matches!(
            busy.decide(),
            BeginDecision::Queued { turn_id } if turn_id == OWN
        ));
    }
    // The user's cap still gates it.
    let full = Begin::new()
        .turn(head)
        .queue(OWN, 2)
        .load(1, 1, Some(NOW + 10));
    assert!(matches!(
        full.decide(),
        BeginDecision::Reject(Error::UserAtCapacity { .. })
    ));
}

#[test]
fn a_queued_turn_behind_the_head_answers_its_place() {
    let behind = Begin::new()
        .turn(turn(OWN, TurnState::Queued, 0))
        .queue("turn-head", 2);
    assert!(matches!(
        behind.decide(),
        BeginDecision::Queued { turn_id } if turn_id == OWN
    ));
    let mismatch = Begin::new()
        .turn(turn(OWN, TurnState::Queued, 0))
        .queue(OWN, 1)
        .fingerprint("another");
    assert!(matches!(
        mismatch.decide(),
        BeginDecision::Reject(Error::PayloadMismatch)
    ));
}

#[test]
fn a_superseded_turn_replays() {
    let superseded = Begin::new().turn(turn(OWN, TurnState::Superseded, 0));
    assert!(matches!(
        superseded.decide(),
        BeginDecision::Replay { turn_id } if turn_id == OWN
    ));
}

#[test]
fn the_queueing_policies_do_not_wait() {
    for policy in [BusyPolicy::Enqueue, BusyPolicy::Supersede] {
        let on_busy = OnBusy::new(policy, None).expect("no bound");
        assert_eq!(on_busy.wait, Duration::ZERO);
        assert!(OnBusy::new(policy, Some(10)).is_err());
        let busy = Error::SessionBusy {
            active_turn_id: OTHER.into(),
            retry_after: ms(10),
        };
        assert_eq!(
            busy_step(&busy, on_busy, Duration::ZERO, None),
            BusyStep::Refuse
        );
    }
}

#[test]
fn a_session_default_applies_only_to_a_busy_session_and_never_as_reject() {
    let enqueue = OnBusy::new(BusyPolicy::Enqueue, None).expect("policy");
    let busy_error = busy("t1", ms(900));
    assert_eq!(session_policy(&busy_error, Some(enqueue)), Some(enqueue));
    // Nothing set, or `reject` set: the first attempt's answer stands.
    assert_eq!(session_policy(&busy_error, None), None);
    assert_eq!(session_policy(&busy_error, Some(OnBusy::REJECT)), None);
    // Any other refusal is not the session's to handle.
    for other in [
        Error::RequestInFlight {
            active_turn_id: "t1".to_owned(),
            retry_after: ms(900),
        },
        Error::UserAtCapacity {
            cap: 1,
            retry_after: ms(900),
        },
        Error::invalid("bad"),
    ] {
        assert_eq!(session_policy(&other, Some(enqueue)), None, "{other}");
    }
}

#[test]
fn supersede_interrupts_only_a_running_holder_other_than_itself() {
    let plain = OnBusy::new(BusyPolicy::Supersede, None).expect("policy");
    let interrupting = plain.interrupting().expect("supersede interrupts");
    let running = Some(("holder", TurnState::Running));
    assert!(supersede_interrupts(interrupting, "queued", running));
    assert!(!supersede_interrupts(plain, "queued", running), "not asked");
    assert!(
        !supersede_interrupts(interrupting, "holder", running),
        "a handoff already started the queued turn itself"
    );
    assert!(!supersede_interrupts(interrupting, "queued", None));
    assert!(!supersede_interrupts(
        interrupting,
        "queued",
        Some(("holder", TurnState::Succeeded))
    ));
    for other in [BusyPolicy::Enqueue, BusyPolicy::Wait, BusyPolicy::Reject] {
        let on_busy = OnBusy::new(other, None).expect("policy");
        assert_eq!(
            on_busy.interrupting().expect_err("only supersede").kind(),
            ErrorKind::InvalidRequest
        );
    }
}

#[test]
fn a_users_full_queues_refuse_an_enqueue_in_any_session_but_not_a_replacing_supersede() {
    let limit = crate::limits::MAX_USER_QUEUE;
    let below = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queued_elsewhere(limit - 1)
        .enqueue(QueueMode::Enqueue);
    assert!(matches!(below.decide(), BeginDecision::Enqueue { .. }));
    for mode in [QueueMode::Enqueue, QueueMode::Supersede] {
        // An empty session's queue grows by one either way.
        let full = Begin::new()
            .holder(OTHER, NOW + 5_000)
            .queued_elsewhere(limit)
            .enqueue(mode);
        match full.decide() {
            BeginDecision::Reject(Error::UserQueueFull {
                limit: got,
                retry_after,
            }) => {
                assert_eq!(got, limit);
                assert_eq!(retry_after, ms(5_000));
            }
            other => panic!("{mode:?}: {other:?}"),
        }
    }
    // A supersede that replaces this session's queued turns adds none.
    let replacing = Begin::new()
        .holder(OTHER, NOW + 5_000)
        .queue("turn-head", 3)
        .queued_elsewhere(limit - 3)
        .enqueue(QueueMode::Supersede);
    assert!(matches!(
        replacing.decide(),
        BeginDecision::Enqueue { supersede: true }
    ));
}
