//! Confirmations beyond the approve path: a rejection, a repeated answer
//! (the same answer replays, another answer under the same request id is
//! refused typed), and a confirmation racing new messages and a contrary
//! confirmation in the same session.

use std::collections::BTreeMap;

use agentgate::{Begun, Config, Decision, Error, ErrorKind, TurnState};
use agentgate_core::ids::{SessionId, UserId};
use serde_json::json;

use super::{must_start, report, storm};
use crate::Target;

/// Rounds of the race; each is a fresh session.
const RACE_ROUNDS: usize = 20;

/// New messages racing each pair of confirmations.
const MESSAGES: usize = 8;

fn decision_name(decision: Decision) -> &'static str {
    decision.as_str()
}

/// A rejection starts one continuation carrying `reject` and the pending
/// action; the pending turn becomes `confirmed` by it. Repeating the same
/// answer with the same request id replays the continuation; the other
/// answer under that request id is refused `payload_mismatch` and writes
/// nothing; the other answer under a new request id replays the first
/// answer's continuation (docs/protocol.md §3.6: a second confirmation replays), whose
/// context still says `reject`. The session then takes messages again.
pub async fn confirmation_rejected_and_repeated(target: &Target) {
    let gate = target.gate(Config::default()).await;
    let (user, session) = ("reject-user", "reject-session");
    let pending = json!({"action": "create_transaction", "amount": 9000});
    let first = must_start(&gate, user, session, "big").await;
    let pending_turn = first.id().to_string();
    first.await_confirmation(&pending).await.expect("await");

    let Begun::Started(continuation) = gate
        .confirm(user, session, "reject-1", &pending_turn, Decision::Reject)
        .await
        .expect("reject")
    else {
        panic!("a rejection starts a continuation");
    };
    let context = continuation.confirmation().expect("context").clone();
    assert_eq!(context.decision, Decision::Reject);
    assert_eq!(context.pending, pending);
    assert_eq!(context.turn_id.as_str(), pending_turn);
    let continuation_id = continuation.id().clone();
    let answer = json!({"dropped": true});
    continuation.succeed(&answer).await.expect("succeed");

    // The same answer again, same request id: the continuation replays.
    let Begun::Replay(again) = gate
        .confirm(user, session, "reject-1", &pending_turn, Decision::Reject)
        .await
        .expect("repeat")
    else {
        panic!("a repeated rejection replays");
    };
    assert_eq!(again.turn_id, continuation_id);
    assert_eq!(again.response, Some(answer.clone()));
    assert_eq!(
        again.confirmation.as_ref().map(|c| c.decision),
        Some(Decision::Reject)
    );

    // The other answer under the same request id: refused, typed.
    let mismatch = gate
        .confirm(user, session, "reject-1", &pending_turn, Decision::Approve)
        .await
        .expect_err("a changed answer under the same request id");
    assert_eq!(mismatch.kind(), ErrorKind::PayloadMismatch, "{mismatch}");

    // The other answer under a new request id: the first answer stands.
    let Begun::Replay(late) = gate
        .confirm(user, session, "approve-2", &pending_turn, Decision::Approve)
        .await
        .expect("a second confirmation")
    else {
        panic!("a second confirmation of a decided turn replays");
    };
    assert_eq!(late.turn_id, continuation_id);
    assert_eq!(
        late.confirmation.as_ref().map(|c| c.decision),
        Some(Decision::Reject),
        "the first answer stands"
    );

    // Nothing was written by the refused or replayed answers.
    let store = gate.store();
    let session_view = store
        .session(&SessionId::new(session).expect("id"))
        .await
        .expect("view")
        .expect("session");
    assert!(session_view.holder.is_none(), "no lease was taken");
    assert!(session_view.pending_confirmation.is_none());
    assert_eq!(
        store
            .user(&UserId::new(user).expect("id"))
            .await
            .expect("user")
            .live_turns,
        0
    );
    let original = store
        .turn(&agentgate::TurnId::new(&pending_turn).expect("id"))
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(original.state, TurnState::Confirmed);
    assert_eq!(original.confirmed_by, Some(continuation_id));
    let next = must_start(&gate, user, session, "next").await;
    next.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("continuation_started_reject".to_owned(), 1),
        ("same_answer_replayed".to_owned(), 1),
        ("changed_answer_payload_mismatch".to_owned(), 1),
        ("second_answer_replayed_first".to_owned(), 1),
    ];
    report(
        target,
        "confirmation_rejected_and_repeated",
        &counts.into_iter().collect(),
    );
}

/// One outcome of the race, by task.
fn class(result: &Result<Begun, Error>) -> String {
    match result {
        Ok(Begun::Started(_)) => "started".into(),
        Ok(Begun::Replay(_)) => "replay".into(),
        Ok(Begun::Queued(_)) => "queued".into(),
        Err(error) => error.kind().code().into(),
    }
}

/// Per round, behind a barrier: an approval, a rejection (each with its own
/// request id) and 8 new messages on a session awaiting confirmation.
/// Exactly one task starts, and it is one of the confirmations; the other
/// confirmation gets `request_in_flight` naming the winner's continuation;
/// each new message gets `awaiting_confirmation` naming the pending turn
/// (decided before the confirmation) or `session_busy` naming the
/// continuation (after). Once the continuation ends, the losing
/// confirmation's retry replays the winner's answer.
pub async fn confirmation_races_a_new_message(target: &Target) {
    let gate = target.gate(Config::default()).await;
    let user = "crace-user";
    let mut counts = BTreeMap::new();
    for round in 0..RACE_ROUNDS {
        let session = format!("crace-session-{round}");
        let first = must_start(&gate, user, &session, "big").await;
        let pending_turn = first.id().to_string();
        first
            .await_confirmation(&json!({"round": round}))
            .await
            .expect("await");
        let decisions = [Decision::Approve, Decision::Reject];
        let results = storm(MESSAGES + 2, |i| {
            let (gate, session, pending_turn) =
                (gate.clone(), session.clone(), pending_turn.clone());
            async move {
                match decisions.get(i) {
                    Some(&decision) => {
                        gate.confirm(
                            user,
                            &session,
                            &format!("answer-{}", decision_name(decision)),
                            &pending_turn,
                            decision,
                        )
                        .await
                    }
                    None => {
                        gate.begin(user, &session, &format!("m{i}"), &json!({"m": i}))
                            .await
                    }
                }
            }
        })
        .await;
        let classes: Vec<String> = results.iter().map(class).collect();
        let mut results = results.into_iter();
        let confirms: Vec<_> = results.by_ref().take(2).collect();
        let messages: Vec<_> = results.collect();
        let winner_index = confirms
            .iter()
            .position(|r| matches!(r, Ok(Begun::Started(_))))
            .unwrap_or_else(|| panic!("no confirmation started: {classes:?}"));
        let mut confirms = confirms.into_iter();
        let (winner, loser) = if winner_index == 0 {
            (confirms.next(), confirms.next())
        } else {
            let loser = confirms.next();
            (confirms.next(), loser)
        };
        let Some(Ok(Begun::Started(winner))) = winner else {
            unreachable!("found above")
        };
        let winner_decision = decisions[winner_index];
        let loser_decision = decisions[1 - winner_index];
        let continuation = winner.id().to_string();
        let loser_error = loser
            .expect("two confirmations")
            .err()
            .unwrap_or_else(|| panic!("both confirmations started or replayed: {classes:?}"));
        assert_eq!(
            loser_error.kind(),
            ErrorKind::RequestInFlight,
            "{loser_error}"
        );
        assert_eq!(loser_error.active_turn_id(), Some(continuation.as_str()));
        *counts
            .entry("loser_request_in_flight".to_owned())
            .or_insert(0) += 1;
        *counts
            .entry(format!("won_{}", decision_name(winner_decision)))
            .or_insert(0) += 1;
        for message in messages {
            let error = match message {
                Ok(other) => panic!(
                    "a new message got {} past a pending confirmation",
                    class(&Ok(other))
                ),
                Err(error) => error,
            };
            match error.kind() {
                ErrorKind::AwaitingConfirmation => {
                    assert_eq!(error.active_turn_id(), Some(pending_turn.as_str()));
                }
                ErrorKind::SessionBusy => {
                    assert_eq!(error.active_turn_id(), Some(continuation.as_str()));
                }
                other => panic!("a new message got {}: {error}", other.code()),
            }
            *counts
                .entry(format!("message_{}", error.kind().code()))
                .or_insert(0) += 1;
        }
        assert_eq!(
            winner.confirmation().map(|c| c.decision),
            Some(winner_decision)
        );
        let answer = json!({"decided": decision_name(winner_decision)});
        winner.succeed(&answer).await.expect("succeed");
        let Begun::Replay(replayed) = gate
            .confirm(
                user,
                &session,
                &format!("answer-{}", decision_name(loser_decision)),
                &pending_turn,
                loser_decision,
            )
            .await
            .expect("the loser's retry")
        else {
            panic!("the loser's retry replays the winner");
        };
        assert_eq!(replayed.turn_id.as_str(), continuation);
        assert_eq!(replayed.response, Some(answer));
        *counts.entry("loser_retry_replayed".to_owned()).or_insert(0) += 1;
    }
    report(target, "confirmation_races_a_new_message", &counts);
}
