//! The second message (docs/protocol.md §7.2, §3.10): a begin on a busy session that waits or
//! interrupts instead of being refused, and an operator's force-release.
//! Waiters in a storm never make two holders and each starts or times out
//! within its bound; an interrupt stops the holder (through its own gate at
//! once, from another by heartbeat) and then starts; a force-release
//! races the holder's ending and ends the turn exactly once, and fences the
//! released holder out of every later write.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentgate::{
    Begun, BusyPolicy, ErrorKind, OnBusy, PreviousOutcome, SessionId, ToolStep, Turn, TurnState,
};
use serde_json::json;

use super::{command, config, must_start, report, short_ttl, storm};
use crate::Target;

/// Waiters released together on one session by [`wait_storm_one_holder_at_a_time`].
const WAITERS: usize = 20;

/// How long each of them holds the session once it starts.
const HOLD: Duration = Duration::from_millis(10);

/// Waiters that time out behind a holder that does not end.
const LATE_WAITERS: usize = 5;

/// Their bound.
const SHORT_WAIT_MS: u64 = 300;

/// How far past its bound a waiter may answer: one attempt of the store's
/// begin after the last wait (generous for a loaded CI machine; what is
/// checked is that the wait is bounded, not how fast a begin is).
const ANSWER_SLACK: Duration = Duration::from_secs(5);

/// Rounds of [`force_release_races_the_ending`].
const ROUNDS: usize = 10;

/// Force-releases per round, racing the holder's ending and each other.
const RELEASES: usize = 5;

fn on_busy(policy: BusyPolicy, wait_ms: u64) -> OnBusy {
    OnBusy::new(policy, Some(wait_ms)).expect("a bound within the limit")
}

fn started(begun: Begun) -> Turn {
    match begun {
        Begun::Started(turn) => turn,
        Begun::Replay(view) => panic!("a new request replayed: {view:?}"),
        Begun::Queued(queued) => panic!("a new request queued: {queued:?}"),
    }
}

/// 20 begins of distinct messages on one session, released together, each
/// waiting up to 20 s: every one starts, one at a time (a counter of live
/// holders never passes 1), in some order. Then 5 waiters bounded at
/// 300 ms behind a holder that does not end: each answers `session_busy`
/// no sooner than its bound and within one begin past it, and the session
/// is still the holder's.
pub async fn wait_storm_one_holder_at_a_time(target: &Target) {
    let gate = target.gate(config()).await;
    let session = "wait-storm";
    let holders = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let results = storm(WAITERS, |i| {
        let (gate, holders, most) = (gate.clone(), Arc::clone(&holders), Arc::clone(&most));
        async move {
            let request = format!("m{i}");
            let (begun, report) = gate
                .begin_on_busy(
                    &command("wait-user", session, &request),
                    on_busy(BusyPolicy::Wait, 20_000),
                )
                .await
                .expect("every waiter starts within 20 s");
            let turn = started(begun);
            let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(HOLD).await;
            holders.fetch_sub(1, Ordering::SeqCst);
            turn.succeed(&json!({"text": request}))
                .await
                .expect("the ending is stored");
            (report.attempts, report.woken)
        }
    })
    .await;
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "one holder at every instant"
    );
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    counts.insert("started".to_owned(), results.len());
    counts.insert(
        "waited".to_owned(),
        results.iter().filter(|(attempts, _)| *attempts > 1).count(),
    );
    counts.insert(
        "wakeups".to_owned(),
        results.iter().map(|(_, woken)| *woken as usize).sum(),
    );
    counts.insert(
        "attempts".to_owned(),
        results.iter().map(|(attempts, _)| *attempts as usize).sum(),
    );
    assert_eq!(results.len(), WAITERS);

    // Behind a holder that does not end, a bounded waiter times out.
    let holder = must_start(&gate, "wait-user", session, "hold").await;
    let bound = Duration::from_millis(SHORT_WAIT_MS);
    let answers = storm(LATE_WAITERS, |i| {
        let gate = gate.clone();
        async move {
            let begun_at = Instant::now();
            let answer = gate
                .begin_on_busy(
                    &command("wait-user", session, &format!("late{i}")),
                    on_busy(BusyPolicy::Wait, SHORT_WAIT_MS),
                )
                .await;
            (answer.map(|(begun, _)| begun), begun_at.elapsed())
        }
    })
    .await;
    for (answer, elapsed) in answers {
        let error = answer.map(|_| ()).expect_err("the holder never ended");
        assert_eq!(error.kind(), ErrorKind::SessionBusy, "{error}");
        assert!(elapsed >= bound, "answered before its bound: {elapsed:?}");
        assert!(elapsed <= bound + ANSWER_SLACK, "waited {elapsed:?}");
        *counts.entry("timed_out".to_owned()).or_default() += 1;
    }
    let view = gate
        .store()
        .session(&SessionId::new(session).expect("id"))
        .await
        .expect("view")
        .expect("session");
    assert_eq!(
        view.holder.map(|h| h.turn_id),
        Some(holder.id().clone()),
        "the timed-out waiters took nothing"
    );
    holder.succeed(&json!("done")).await.expect("ended");
    report(target, "wait_storm_one_holder_at_a_time", &counts);
}

/// Runs `turn` as a cooperative holder: waits for its cancellation signal,
/// then ends it `cancelled`.
fn cooperative(turn: Turn) -> tokio::task::JoinHandle<TurnState> {
    tokio::spawn(async move {
        turn.cancellation().cancelled().await;
        assert!(turn.cancel_requested(), "stopped by a cancel request");
        turn.end_cancelled(&json!({"text": "stopped"}))
            .await
            .expect("the cancelled ending is stored")
            .state
    })
}

/// `interrupt` asks the holder to stop, waits for its ending and starts:
/// through the holder's own gate (signalled at once) and from another gate
/// (the holder's heartbeat tells it, a third of its short TTL away). The
/// interrupted turn ends `cancelled` and the new one starts with a higher
/// fence. A holder that ignores the request makes the interrupter time out
/// with `session_busy`; a force-release then frees the session.
pub async fn interrupt_stops_the_holder_then_starts(target: &Target) {
    let holder_gate = target.gate(short_ttl()).await;
    let other_gate = target.gate(config()).await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (name, interrupter) in [("local", &holder_gate), ("remote", &other_gate)] {
        let session = format!("interrupt-{name}");
        let turn = must_start(&holder_gate, "interrupt-user", &session, "first").await;
        let (first, first_fence) = (turn.id().clone(), turn.fence());
        let holding = cooperative(turn);
        let (begun, report) = interrupter
            .begin_on_busy(
                &command("interrupt-user", &session, "correction"),
                on_busy(BusyPolicy::Interrupt, 20_000),
            )
            .await
            .expect("the interrupter starts within its bound");
        assert_eq!(report.interrupted.as_ref(), Some(&first));
        let next = started(begun);
        assert!(next.fence() > first_fence);
        assert_eq!(holding.await.expect("holder"), TurnState::Cancelled);
        next.succeed(&json!("corrected")).await.expect("ended");
        let view = holder_gate
            .store()
            .turn(&first)
            .await
            .expect("view")
            .expect("turn");
        assert_eq!(view.state, TurnState::Cancelled, "{view:?}");
        *counts.entry(format!("interrupted_{name}")).or_default() += 1;
    }
    // A holder that ignores the request.
    let session = "interrupt-stubborn";
    let stubborn = must_start(&other_gate, "interrupt-user", session, "first").await;
    let answer = holder_gate
        .begin_on_busy(
            &command("interrupt-user", session, "correction"),
            on_busy(BusyPolicy::Interrupt, SHORT_WAIT_MS),
        )
        .await;
    let error = answer.map(|_| ()).expect_err("the holder did not stop");
    assert_eq!(error.kind(), ErrorKind::SessionBusy, "{error}");
    assert!(stubborn.cancel_requested() || stubborn.heartbeat().await.is_ok());
    let released = holder_gate
        .force_release(&SessionId::new(session).expect("id"))
        .await
        .expect("release")
        .expect("the stubborn holder");
    assert_eq!(released.turn_id, *stubborn.id());
    let refused = stubborn.succeed(&json!("late")).await.expect_err("fenced");
    assert_eq!(
        refused.error.kind(),
        ErrorKind::LeaseLost,
        "{}",
        refused.error
    );
    let (begun, _) = holder_gate
        .begin_on_busy(
            &command("interrupt-user", session, "correction"),
            on_busy(BusyPolicy::Interrupt, SHORT_WAIT_MS),
        )
        .await
        .expect("the released session is free");
    started(begun).succeed(&json!("ok")).await.expect("ended");
    counts.insert("timed_out_then_released".to_owned(), 1);
    report(target, "interrupt_stops_the_holder_then_starts", &counts);
}

/// A force-release fences the released holder out: its heartbeat, tool
/// claim, tool completion and ending are all refused `lease_lost`; the
/// session has no holder and a newer fence; the next message starts above
/// it; a repeat of the released request restarts it (attempt 2), and its
/// tool call, left running by the released holder, comes back `Execute`
/// with `previous_outcome: unknown`. Then, 10 rounds: 5 force-releases race
/// the holder's ending, and the turn ends exactly once, as whichever came
/// first says: `succeeded` with no release answered, or `abandoned` with
/// exactly one release answered and the ending refused.
pub async fn force_release_races_the_ending(target: &Target) {
    let gate = target.gate(config()).await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let session = SessionId::new("release-fenced").expect("id");
    let turn = must_start(&gate, "release-user", session.as_str(), "r1").await;
    let first_fence = turn.fence();
    let execution = match turn.tool("book", &json!({"amount": 35})).await {
        Ok(ToolStep::Execute(execution)) => execution,
        other => panic!("a first claim executes, got {:?}", other.map(|_| ())),
    };
    let released = gate
        .store()
        .force_release(&session, None)
        .await
        .expect("release")
        .expect("the holder");
    assert_eq!(released.state, TurnState::Abandoned);
    assert_eq!(&released.turn_id, turn.id());
    let view = gate
        .store()
        .session(&session)
        .await
        .expect("view")
        .expect("session");
    assert!(view.holder.is_none(), "{view:?}");
    assert!(view.fence > first_fence, "the release bumped the fence");
    let lost = |error: agentgate::Error, what: &str| {
        assert_eq!(error.kind(), ErrorKind::LeaseLost, "{what}: {error}");
    };
    lost(
        turn.heartbeat().await.map(|_| ()).expect_err("heartbeat"),
        "heartbeat",
    );
    lost(
        turn.tool("book", &json!({"amount": 1}))
            .await
            .map(|_| ())
            .expect_err("claim"),
        "claim",
    );
    lost(
        execution
            .complete(&json!({"id": 1}))
            .await
            .map(|_| ())
            .expect_err("completion"),
        "completion",
    );
    lost(
        turn.succeed(&json!("late"))
            .await
            .expect_err("ending")
            .error,
        "ending",
    );
    assert!(
        gate.store()
            .force_release(&session, None)
            .await
            .expect("release")
            .is_none(),
        "a second release finds no holder and writes nothing"
    );
    let next = must_start(&gate, "release-user", session.as_str(), "r2").await;
    assert!(next.fence() > view.fence);
    next.succeed(&json!("ok")).await.expect("ended");
    let again = must_start(&gate, "release-user", session.as_str(), "r1").await;
    assert_eq!(again.attempt(), 2, "a released request restarts");
    match again.tool("book", &json!({"amount": 35})).await {
        Ok(ToolStep::Execute(execution)) => {
            assert_eq!(execution.previous_outcome(), Some(PreviousOutcome::Unknown));
            execution.complete(&json!({"id": 7})).await.expect("done");
        }
        other => panic!(
            "the released call executes again, got {:?}",
            other.map(|_| ())
        ),
    }
    again.succeed(&json!("booked")).await.expect("ended");
    counts.insert("fenced_writes_refused".to_owned(), 4);

    for round in 0..ROUNDS {
        let session = SessionId::new(format!("release-race-{round}")).expect("id");
        let turn = must_start(&gate, "release-user", session.as_str(), "r1").await;
        let id = turn.id().clone();
        let turn = Arc::new(Mutex::new(Some(turn)));
        let results = storm(RELEASES + 1, |i| {
            let (gate, turn, session) = (gate.clone(), Arc::clone(&turn), session.clone());
            async move {
                if i == 0 {
                    let turn = turn.lock().expect("lock").take().expect("the turn");
                    return match turn.succeed(&json!("done")).await {
                        Ok(_) => "succeeded",
                        Err(refused) => {
                            assert_eq!(refused.error.kind(), ErrorKind::LeaseLost);
                            "ending_refused"
                        }
                    };
                }
                match gate
                    .store()
                    .force_release(&session, None)
                    .await
                    .expect("release")
                {
                    Some(view) => {
                        assert_eq!(view.state, TurnState::Abandoned);
                        "released"
                    }
                    None => "nothing_held",
                }
            }
        })
        .await;
        let count = |what: &str| results.iter().filter(|r| **r == what).count();
        let state = gate
            .store()
            .turn(&id)
            .await
            .expect("view")
            .expect("turn")
            .state;
        match state {
            TurnState::Succeeded => assert_eq!(
                (count("succeeded"), count("released")),
                (1, 0),
                "{results:?}"
            ),
            TurnState::Abandoned => assert_eq!(
                (count("ending_refused"), count("released")),
                (1, 1),
                "{results:?}"
            ),
            other => panic!("the turn ended {other:?}"),
        }
        *counts.entry(state.as_str().to_owned()).or_default() += 1;
        must_start(&gate, "release-user", session.as_str(), "r2")
            .await
            .succeed(&json!("ok"))
            .await
            .expect("the session is free");
    }
    report(target, "force_release_races_the_ending", &counts);
}

/// A waiter on one node (store handle) behind a holder on another: it
/// starts once the holder ends there. On PostgreSQL the ending's
/// `NOTIFY`, with the Redis layer its pub/sub announcement, wakes it (at
/// least one wake counted: a poll that times out is not one); elsewhere
/// no notification crosses handles and its bounded poll finds the free
/// session. Prints how long after the
/// ending's answer the waiter started, and how.
pub async fn a_release_on_another_node_wakes_a_waiter(target: &Target) {
    let node_a = target.gate(config()).await;
    let node_b = target.gate(config()).await;
    let session = "cross-node-wait";
    let holder = must_start(&node_a, "cross-user", session, "first").await;
    let notified = super::announces_across_nodes(target);
    if notified {
        // Node B's listener connects on its first watch; under a loaded
        // server that can take a while, and a release before it listens
        // would reach the waiter by its poll. So: until it listens, before
        // the waiter's own watch (the listener's start wakes every watch,
        // which must not count as the release's wake).
        let deadline = Instant::now() + Duration::from_secs(30);
        while !node_b
            .store()
            .watch_releases(&SessionId::new(session).expect("id"))
            .across_nodes()
        {
            assert!(
                Instant::now() < deadline,
                "node B's listener never listened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let waiter = {
        let node_b = node_b.clone();
        tokio::spawn(async move {
            let (begun, report) = node_b
                .begin_on_busy(
                    &command("cross-user", session, "second"),
                    on_busy(BusyPolicy::Wait, 20_000),
                )
                .await
                .expect("the waiter starts within its bound");
            (started(begun), report, Instant::now())
        })
    };
    // Long enough for the waiter's first attempt.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!waiter.is_finished(), "it waits while the holder runs");
    holder.succeed(&json!("one")).await.expect("ended");
    let ended_at = Instant::now();
    let (next, busy, started_at) = waiter.await.expect("waiter");
    next.succeed(&json!("two")).await.expect("ended");
    if notified {
        assert!(busy.woken >= 1, "the announcement woke it: {busy:?}");
    }
    let after_ms = started_at.saturating_duration_since(ended_at).as_millis();
    let counts: BTreeMap<String, usize> = [
        ("attempts".to_owned(), busy.attempts as usize),
        ("woken".to_owned(), busy.woken as usize),
        (
            "started_ms_after_the_ending".to_owned(),
            usize::try_from(after_ms).unwrap_or(usize::MAX),
        ),
    ]
    .into_iter()
    .collect();
    report(target, "a_release_on_another_node_wakes_a_waiter", &counts);
}
