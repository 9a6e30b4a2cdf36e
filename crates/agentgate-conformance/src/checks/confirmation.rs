//! The confirmation flow: a pending confirmation is checked inside the same
//! atomic step as the grant, so a message racing the previous turn's
//! `await_confirmation` never slips in; confirmations start exactly one
//! continuation; pending confirmations expire.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Begun, Config, Decision, ErrorKind, TurnState};
use serde_json::json;

use super::{config, must_start, outcome, report, storm};
use crate::Target;

/// Rounds of the race; each is a fresh session.
const RACE_ROUNDS: usize = 20;

/// Messages racing each `await_confirmation`.
const RACERS: usize = 49;

/// One turn ends with `await_confirmation` while 49 new messages race it:
/// each is refused as session_busy (before) or awaiting_confirmation (after),
/// never started.
pub async fn confirmation_race(target: &Target) {
    let gate = target.gate(config()).await;
    let mut counts = BTreeMap::new();
    for round in 0..RACE_ROUNDS {
        let session = format!("race-session-{round}");
        let holder = Arc::new(tokio::sync::Mutex::new(Some(
            must_start(&gate, "race-user", &session, "big").await,
        )));
        let results = storm(RACERS + 1, |i| {
            let (gate, session, holder) = (gate.clone(), session.clone(), Arc::clone(&holder));
            async move {
                if i == 0 {
                    let turn = holder.lock().await.take().expect("one holder");
                    let view = turn
                        .await_confirmation(&json!({"action": "book", "amount": 5000}))
                        .await
                        .expect("await confirmation");
                    assert_eq!(view.state, TurnState::AwaitingConfirmation);
                    return "ended".to_owned();
                }
                outcome(
                    &gate
                        .begin("race-user", &session, &format!("m{i}"), &json!(i))
                        .await,
                )
            }
        })
        .await;
        for class in results {
            assert!(
                ["ended", "session_busy", "awaiting_confirmation"].contains(&class.as_str()),
                "a racing message got {class}"
            );
            *counts.entry(class).or_insert(0) += 1;
        }
        let after = gate
            .begin("race-user", &session, "later", &json!(1))
            .await
            .expect_err("still pending");
        assert_eq!(after.kind(), ErrorKind::AwaitingConfirmation);
    }
    counts.insert("started".to_owned(), 0);
    report(target, "confirmation_race", &counts);
}

/// Approve once, concurrently twice: exactly one continuation starts with the
/// pending action; the other is told it is in flight, then replays it; the
/// original message replays as confirmed; the session takes messages again.
pub async fn confirmation_flow(target: &Target) {
    let gate = target.gate(config()).await;
    let pending = json!({"action": "create_transaction", "amount": 5000});
    let first = must_start(&gate, "confirm-user", "confirm-session", "big").await;
    let pending_turn = first.id().to_string();
    first.await_confirmation(&pending).await.expect("await");
    let blocked = gate
        .begin("confirm-user", "confirm-session", "other", &json!(1))
        .await
        .expect_err("pending");
    assert_eq!(blocked.kind(), ErrorKind::AwaitingConfirmation);
    assert_eq!(blocked.active_turn_id(), Some(pending_turn.as_str()));

    // Two tabs approve at once, with different request ids.
    let results = storm(2, |i| {
        let (gate, pending_turn) = (gate.clone(), pending_turn.clone());
        async move {
            gate.confirm(
                "confirm-user",
                "confirm-session",
                &format!("approve-tab-{i}"),
                &pending_turn,
                Decision::Approve,
            )
            .await
        }
    })
    .await;
    let classes: Vec<String> = results.iter().map(outcome).collect();
    let mut continuation = None;
    let mut loser = None;
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(Begun::Started(turn)) => continuation = Some(turn),
            Err(error) => {
                assert_eq!(error.kind(), ErrorKind::RequestInFlight, "{error}");
                loser = Some(i);
            }
            Ok(Begun::Replay(_)) => panic!("nothing to replay yet: {classes:?}"),
            Ok(Begun::Queued(queued)) => panic!("a confirmation never queues: {queued:?}"),
        }
    }
    let continuation = continuation.expect("exactly one continuation");
    let loser = loser.expect("exactly one refusal");
    let context = continuation
        .confirmation()
        .expect("confirmation context")
        .clone();
    assert_eq!(context.decision, Decision::Approve);
    assert_eq!(context.pending, pending);
    assert_eq!(context.turn_id.as_str(), pending_turn);
    let continuation_id = continuation.id().clone();
    continuation
        .succeed(&json!({"booked": 5000}))
        .await
        .expect("succeed");

    let again = gate
        .confirm(
            "confirm-user",
            "confirm-session",
            &format!("approve-tab-{loser}"),
            &pending_turn,
            Decision::Approve,
        )
        .await
        .expect("second confirmation");
    let Begun::Replay(view) = again else {
        panic!("a second confirmation replays")
    };
    assert_eq!(view.turn_id, continuation_id);
    assert_eq!(view.response, Some(json!({"booked": 5000})));
    let original = gate
        .begin(
            "confirm-user",
            "confirm-session",
            "big",
            &json!({"text": "big"}),
        )
        .await
        .expect("replay");
    let Begun::Replay(original) = original else {
        panic!("the original message replays")
    };
    assert_eq!(original.state, TurnState::Confirmed);
    assert_eq!(original.confirmed_by, Some(continuation_id));
    let rejected = gate
        .confirm(
            "confirm-user",
            "confirm-session",
            "approve-tab-9",
            "turn_nonexistent",
            Decision::Reject,
        )
        .await
        .expect_err("no such pending");
    assert_eq!(rejected.kind(), ErrorKind::NotFound);
    let next = must_start(&gate, "confirm-user", "confirm-session", "next").await;
    next.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("continuations_started".to_owned(), 1),
        ("second_confirmation_in_flight".to_owned(), 1),
        ("second_confirmation_replayed".to_owned(), 1),
    ];
    report(target, "confirmation_flow", &counts.into_iter().collect());
}

/// A pending confirmation expires after `confirmation_ttl`: then new messages
/// start and confirming it is refused `confirmation_expired`, its own code
/// (not `not_found`: the turn is there, its confirmation ran out).
pub async fn pending_confirmation_expires(target: &Target) {
    let ttl = Duration::from_secs(1);
    let gate = target
        .gate(Config {
            confirmation_ttl: ttl,
            ..Config::default()
        })
        .await;
    let first = must_start(&gate, "expire-user", "expire-session", "big").await;
    let pending_turn = first.id().to_string();
    first
        .await_confirmation(&json!({"amount": 5000}))
        .await
        .expect("await");
    let blocked = gate
        .begin("expire-user", "expire-session", "m1", &json!(1))
        .await
        .expect_err("pending");
    assert_eq!(blocked.kind(), ErrorKind::AwaitingConfirmation);
    assert!(blocked.retry_after().is_some_and(|r| r <= ttl));
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let late = gate
        .confirm(
            "expire-user",
            "expire-session",
            "late",
            &pending_turn,
            Decision::Approve,
        )
        .await
        .expect_err("expired");
    assert_eq!(late.kind(), ErrorKind::ConfirmationExpired, "{late}");
    let next = must_start(&gate, "expire-user", "expire-session", "m1").await;
    next.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("refused_while_pending".to_owned(), 1),
        ("started_after_expiry".to_owned(), 1),
    ];
    report(
        target,
        "pending_confirmation_expires",
        &counts.into_iter().collect(),
    );
}
