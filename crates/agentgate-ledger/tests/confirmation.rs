//! Confirmation: an entry above the threshold pauses the turn; approving
//! (even from two tabs at once) books it exactly once; rejecting books
//! nothing; the session refuses new messages meanwhile.

mod common;

use std::sync::Arc;

use agentgate::{Decision, ErrorKind, TurnState};
use agentgate_ledger::{ConfirmRequest, LedgerApp, LedgerError, Started};
use common::*;
use tokio::sync::Barrier;
use tokio_util::sync::CancellationToken;

fn confirm(pending_turn_id: &str, request: &str, decision: Decision) -> ConfirmRequest {
    ConfirmRequest {
        user_id: "alice".into(),
        session_id: "s1".into(),
        client_request_id: request.into(),
        pending_turn_id: pending_turn_id.into(),
        decision,
    }
}

/// "午饭 35，买衣服 5000": the lunch is booked, the clothes wait.
async fn pause(app: &LedgerApp, url: &str) -> String {
    let (sender, mut receiver) = events();
    let outcome = app
        .chat(
            &message("s1", "m1", "午饭 35，买衣服 5000"),
            Some(sender),
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert_eq!(outcome.state, TurnState::AwaitingConfirmation);
    let reply = outcome.reply.expect("reply");
    assert_eq!(reply.entries.len(), 1, "the small entry is booked");
    assert_eq!(reply.pending.len(), 1);
    assert_eq!(
        (
            reply.pending[0].category.as_str(),
            reply.pending[0].amount_cents
        ),
        ("购物", 500_000)
    );
    assert!(reply.text.contains("待确认"), "{}", reply.text);
    assert_eq!(count_entries(url).await, 1);
    assert!(names(&drain(&mut receiver)).contains(&"awaiting_confirmation"));

    let blocked = app
        .start_message(&message("s1", "m2", "打车 18"))
        .await
        .expect_err("waiting for confirmation");
    assert_eq!(blocked.engine_kind(), Some(ErrorKind::AwaitingConfirmation));
    let (pending_turn, pending) = app
        .pending_confirmation("alice", "s1")
        .await
        .expect("view")
        .expect("pending");
    assert_eq!(pending_turn, outcome.turn_id);
    assert_eq!(pending.pending.len(), 1);
    assert!(app
        .pending_confirmation("mallory", "s1")
        .await
        .expect("view")
        .is_none());
    outcome.turn_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approving_in_two_tabs_at_once_books_exactly_once() {
    let store = store();
    let app = offline_app(&store.url).await;
    let pending_turn = pause(&app, &store.url).await;

    let barrier = Arc::new(Barrier::new(2));
    let tabs: Vec<_> = (0..2)
        .map(|tab| {
            let (app, barrier, pending_turn) =
                (app.clone(), Arc::clone(&barrier), pending_turn.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.start_confirmation(&confirm(
                    &pending_turn,
                    &format!("approve-tab-{tab}"),
                    Decision::Approve,
                ))
                .await
            })
        })
        .collect();
    let mut running = Vec::new();
    let mut refused = Vec::new();
    for (tab, handle) in tabs.into_iter().enumerate() {
        match handle.await.expect("tab") {
            Ok(Started::Running(turn)) => running.push(turn),
            Ok(Started::Replay(outcome)) => panic!("nothing to replay yet: {outcome:?}"),
            Ok(Started::Queued(queued)) => panic!("a confirmation is never queued: {queued:?}"),
            Err(LedgerError::Engine(error)) => {
                assert_eq!(error.kind(), ErrorKind::RequestInFlight, "{error}");
                refused.push(tab);
            }
            Err(error) => panic!("unexpected {error}"),
        }
    }
    assert_eq!((running.len(), refused.len()), (1, 1));
    let outcome = running
        .remove(0)
        .run(None, CancellationToken::new())
        .await
        .expect("run");
    assert_eq!(outcome.state, TurnState::Succeeded);
    let reply = outcome.reply.expect("reply");
    assert_eq!(reply.entries.len(), 1);
    assert_eq!(reply.entries[0].amount_cents, 500_000);
    assert_eq!(
        count_entries(&store.url).await,
        2,
        "lunch + clothes, each once"
    );

    // The refused tab retries: it sees the first tab's outcome.
    let again = app
        .confirm(
            &confirm(
                &pending_turn,
                &format!("approve-tab-{}", refused[0]),
                Decision::Approve,
            ),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("replay");
    assert!(again.replayed);
    assert_eq!(again.state, TurnState::Succeeded);
    assert_eq!(count_entries(&store.url).await, 2);
    // The original message replays as confirmed; the session takes messages again.
    let original = app
        .chat(
            &message("s1", "m1", "午饭 35，买衣服 5000"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("replay");
    assert_eq!(original.state, TurnState::Confirmed);
    assert!(app
        .pending_confirmation("alice", "s1")
        .await
        .expect("view")
        .is_none());
    app.chat(
        &message("s1", "m3", "打车 18"),
        None,
        CancellationToken::new(),
    )
    .await
    .expect("next message");
    assert_eq!(count_entries(&store.url).await, 3);
    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    assert_eq!(transcript.len(), 3, "message, confirmation, next message");
    assert_eq!(
        transcript[1].confirms.as_deref(),
        Some(pending_turn.as_str())
    );
    assert_eq!(transcript[0].state, Some(TurnState::Confirmed));
}

/// An English message whose entry waits for approval: the approval's
/// reply is English too, though the pending text names the entry's
/// (Chinese) category.
#[tokio::test]
async fn an_english_confirmation_is_answered_in_english() {
    let store = store();
    let app = offline_app(&store.url).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "salary 8000"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert_eq!(outcome.state, TurnState::AwaitingConfirmation);
    let asked = outcome.reply.expect("reply");
    assert_eq!(asked.chinese, Some(false));
    let approved = app
        .confirm(
            &confirm(&outcome.turn_id, "approve-1", Decision::Approve),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("approve");
    assert_eq!(approved.state, TurnState::Succeeded);
    let reply = approved.reply.expect("reply");
    assert_eq!(reply.entries.len(), 1);
    assert!(reply.text.starts_with("Booked: "), "{}", reply.text);
    assert!(!reply.text.contains("已记账"), "{}", reply.text);
}

#[tokio::test]
async fn rejecting_books_nothing() {
    let store = store();
    let app = offline_app(&store.url).await;
    let pending_turn = pause(&app, &store.url).await;
    let outcome = app
        .confirm(
            &confirm(&pending_turn, "reject-1", Decision::Reject),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("reject");
    assert_eq!(outcome.state, TurnState::Succeeded);
    let reply = outcome.reply.expect("reply");
    assert!(reply.entries.is_empty());
    assert!(reply.text.contains("已取消"), "{}", reply.text);
    assert_eq!(count_entries(&store.url).await, 1, "only the lunch");
    // A late approval of the answered confirmation changes nothing.
    let late = app
        .confirm(
            &confirm(&pending_turn, "approve-late", Decision::Approve),
            None,
            CancellationToken::new(),
        )
        .await;
    match late {
        Ok(outcome) => {
            assert!(outcome.replayed && outcome.reply.expect("reply").entries.is_empty())
        }
        Err(error) => assert_eq!(error.engine_kind(), Some(ErrorKind::NotFound)),
    }
    assert_eq!(count_entries(&store.url).await, 1);
    app.chat(
        &message("s1", "m2", "打车 18"),
        None,
        CancellationToken::new(),
    )
    .await
    .expect("next message");
}

#[tokio::test]
async fn a_confirmation_of_nothing_is_not_found() {
    let store = store();
    let app = offline_app(&store.url).await;
    app.chat(
        &message("s1", "m1", "午饭 35"),
        None,
        CancellationToken::new(),
    )
    .await
    .expect("chat");
    let error = app
        .confirm(
            &confirm("turn_nope", "c1", Decision::Approve),
            None,
            CancellationToken::new(),
        )
        .await
        .expect_err("nothing pending");
    assert_eq!(error.engine_kind(), Some(ErrorKind::NotFound));
}
