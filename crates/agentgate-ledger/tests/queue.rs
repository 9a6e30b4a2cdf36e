//! The second message's queue in the ledger app (`enqueue`, `supersede`):
//! a message sent while a reply runs is recorded and queued, the worker that
//! ends the reply runs the queue in order (the handoff), each message books
//! exactly once, a cancelled or superseded message never runs, and the
//! recovery worker drains a queue whose worker died or declined the
//! handoff. Ledger rows are counted in SQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use agentgate::{BusyPolicy, Config, OnBusy, TurnId, TurnState};
use agentgate_ledger::{
    ChatOutcome, Handoff, LedgerApp, QueuedMessage, RunningTurn, Started, UserMessage,
};
use common::*;
use tokio_util::sync::CancellationToken;

/// A transcript row as the tests compare it: request id, text, state and
/// attempts.
type Row<'a> = (Option<&'a str>, &'a str, Option<TurnState>, Option<u32>);

fn queued_message(policy: BusyPolicy, request: &str, text: &str) -> UserMessage {
    UserMessage {
        on_busy: OnBusy::new(policy, None).expect("a queue policy takes no bound"),
        ..message("s1", request, text)
    }
}

async fn start_running(app: &LedgerApp, request: &str, text: &str) -> RunningTurn {
    match app
        .start_message(&message("s1", request, text))
        .await
        .expect("start")
    {
        Started::Running(turn) => turn,
        other => panic!("a free session starts the message: {other:?}"),
    }
}

async fn enqueue(app: &LedgerApp, policy: BusyPolicy, request: &str, text: &str) -> QueuedMessage {
    match app
        .start_message(&queued_message(policy, request, text))
        .await
        .expect("queue")
    {
        Started::Queued(queued) => queued,
        other => panic!("a held session queues the message: {other:?}"),
    }
}

async fn state_of(app: &LedgerApp, turn_id: &str) -> (TurnState, u32) {
    let view = app
        .gate()
        .store()
        .turn(&TurnId::new(turn_id).expect("id"))
        .await
        .expect("view")
        .expect("turn");
    (view.state, view.attempt)
}

/// Amounts of the booked entries, in the order they were booked.
async fn booked_in_order(app: &LedgerApp) -> Vec<i64> {
    let mut entries = app.entries("alice").await.expect("entries");
    entries.sort_by_key(|entry| entry.id);
    entries.iter().map(|entry| entry.amount_cents).collect()
}

/// Drains the session's queue, returning the ids and outcomes of the turns
/// it ran, in the order they ended; each was reported started, then ended,
/// before the next started.
async fn drain(app: &LedgerApp) -> Vec<(String, ChatOutcome)> {
    let mut ran = Vec::new();
    let mut running: Option<String> = None;
    let count = app
        .drain_queue("s1", |handoff| match handoff {
            Handoff::Started { turn_id } => {
                assert_eq!(running, None, "one queued turn at a time");
                running = Some(turn_id);
            }
            Handoff::Ended { turn_id, result } => {
                assert_eq!(running.take().as_deref(), Some(turn_id.as_str()));
                ran.push((turn_id, result.expect("a queued turn runs to its end")));
            }
        })
        .await
        .expect("drain");
    assert_eq!(running, None, "every started turn ended");
    assert_eq!(count as usize, ran.len(), "the count is of the turns run");
    ran
}

#[tokio::test]
async fn queued_messages_are_recorded_then_handed_off_in_order_each_booked_once() {
    let store = store();
    let app = offline_app(&store.url).await;
    let first = start_running(&app, "m1", "午饭 35").await;
    let second = enqueue(&app, BusyPolicy::Enqueue, "m2", "打车 18").await;
    let third = enqueue(&app, BusyPolicy::Enqueue, "m3", "咖啡 12").await;
    assert_eq!((second.position, third.position), (1, 2));
    assert_eq!(second.client_request_id, "m2");
    // A repeat of a queued message (a page's resend) is the same queued turn.
    let again = enqueue(&app, BusyPolicy::Enqueue, "m2", "打车 18").await;
    assert_eq!(
        (again.turn_id.as_str(), again.position),
        (second.turn_id.as_str(), 1)
    );

    // Recorded before anything ran: the transcript lists the three in the
    // order they were sent, the queued two never started.
    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    let rows: Vec<Row<'_>> = transcript
        .iter()
        .map(|t| {
            (
                t.client_request_id.as_deref(),
                t.user_text.as_str(),
                t.state,
                t.attempt,
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            (Some("m1"), "午饭 35", Some(TurnState::Running), Some(1)),
            (Some("m2"), "打车 18", Some(TurnState::Queued), Some(0)),
            (Some("m3"), "咖啡 12", Some(TurnState::Queued), Some(0)),
        ]
    );
    assert_eq!(count_entries(&store.url).await, 0, "nothing ran yet");

    let outcome = first
        .run(None, CancellationToken::new())
        .await
        .expect("first");
    assert_eq!(outcome.state, TurnState::Succeeded);
    let ran = drain(&app).await;
    let ids: Vec<&str> = ran.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, [second.turn_id.as_str(), third.turn_id.as_str()]);
    assert!(ran
        .iter()
        .all(|(_, outcome)| outcome.state == TurnState::Succeeded));
    assert_eq!(booked_in_order(&app).await, [3500, 1800, 1200]);
    assert!(drain(&app).await.is_empty(), "nothing is left to hand off");

    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    assert!(transcript
        .iter()
        .all(|t| t.state == Some(TurnState::Succeeded) && t.reply.is_some()));
    // A repeat of a handed-off message replays it: nothing runs twice.
    match app
        .start_message(&queued_message(BusyPolicy::Enqueue, "m2", "打车 18"))
        .await
        .expect("repeat")
    {
        Started::Replay(outcome) => assert_eq!(outcome.state, TurnState::Succeeded),
        other => panic!("an ended message replays: {other:?}"),
    }
    assert_eq!(count_entries(&store.url).await, 3);
}

#[tokio::test]
async fn a_queued_message_cancelled_never_runs_and_the_others_do() {
    let store = store();
    let app = offline_app(&store.url).await;
    let first = start_running(&app, "m1", "午饭 35").await;
    let second = enqueue(&app, BusyPolicy::Enqueue, "m2", "打车 18").await;
    let third = enqueue(&app, BusyPolicy::Enqueue, "m3", "咖啡 12").await;
    let cancelled = app
        .gate()
        .request_cancel(&TurnId::new(second.turn_id.as_str()).expect("id"))
        .await
        .expect("cancel")
        .expect("turn");
    assert_eq!(
        (cancelled.state, cancelled.attempt),
        (TurnState::Cancelled, 0)
    );
    // The queue closed up behind it.
    let moved = enqueue(&app, BusyPolicy::Enqueue, "m3", "咖啡 12").await;
    assert_eq!(
        (moved.turn_id.as_str(), moved.position),
        (third.turn_id.as_str(), 1)
    );

    first
        .run(None, CancellationToken::new())
        .await
        .expect("first");
    let ran = drain(&app).await;
    let ids: Vec<&str> = ran.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, [third.turn_id.as_str()]);
    assert_eq!(booked_in_order(&app).await, [3500, 1200]);
    // Its repeat replays the cancellation; it still never runs.
    match app
        .start_message(&queued_message(BusyPolicy::Enqueue, "m2", "打车 18"))
        .await
        .expect("repeat")
    {
        Started::Replay(outcome) => assert_eq!(outcome.state, TurnState::Cancelled),
        other => panic!("a cancelled message replays: {other:?}"),
    }
    assert_eq!(
        state_of(&app, &second.turn_id).await,
        (TurnState::Cancelled, 0)
    );
    assert_eq!(count_entries(&store.url).await, 2);
}

#[tokio::test]
async fn supersede_runs_the_running_reply_and_the_newest_message_only() {
    let store = store();
    let app = offline_app(&store.url).await;
    let first = start_running(&app, "m1", "午饭 35").await;
    let middle = enqueue(&app, BusyPolicy::Supersede, "m2", "打车 18").await;
    let newest = enqueue(&app, BusyPolicy::Supersede, "m3", "咖啡 12").await;
    assert_eq!(newest.position, 1, "it replaced the one before it");
    assert_eq!(
        state_of(&app, &middle.turn_id).await,
        (TurnState::Superseded, 0)
    );

    first
        .run(None, CancellationToken::new())
        .await
        .expect("first");
    let ran = drain(&app).await;
    let ids: Vec<&str> = ran.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, [newest.turn_id.as_str()]);
    assert_eq!(booked_in_order(&app).await, [3500, 1200]);
    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    let states: Vec<Option<TurnState>> = transcript.iter().map(|t| t.state).collect();
    assert_eq!(
        states,
        [
            Some(TurnState::Succeeded),
            Some(TurnState::Superseded),
            Some(TurnState::Succeeded)
        ]
    );
}

#[tokio::test]
async fn a_queue_left_on_a_free_session_is_claimed_and_drained_by_the_recovery_worker() {
    let store = store();
    let app = offline_app(&store.url).await;
    let first = start_running(&app, "m1", "午饭 35").await;
    let second = enqueue(&app, BusyPolicy::Enqueue, "m2", "打车 18").await;
    let third = enqueue(&app, BusyPolicy::Enqueue, "m3", "咖啡 12").await;
    // Its worker ends the reply and does not hand off (a caller that
    // declines, or dies right after the ending).
    first
        .run(None, CancellationToken::new())
        .await
        .expect("first");
    assert_eq!(
        state_of(&app, &second.turn_id).await,
        (TurnState::Queued, 0)
    );
    let outcomes = app.recover_once().await.expect("recover");
    let ids: Vec<&str> = outcomes.iter().map(|o| o.turn_id.as_str()).collect();
    assert_eq!(ids, [second.turn_id.as_str(), third.turn_id.as_str()]);
    assert_eq!(booked_in_order(&app).await, [3500, 1800, 1200]);
    assert!(app.recover_once().await.expect("again").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_worker_resumes_a_dead_workers_reply_then_drains_its_queue() {
    let store = store();
    let config = Config {
        lease_ttl: SHORT_TTL,
        ..Config::default()
    };
    // The doomed worker, killed once its reply has booked and two
    // messages wait behind it.
    let worker = DoomedWorker::booked(&store.url, config.clone()).await;
    let app = app_on(
        &store.url,
        config,
        Arc::new(agentgate_ledger::OfflineModel::new(Duration::ZERO)),
    )
    .await;
    let second = enqueue(&app, BusyPolicy::Enqueue, "m2", "打车 18").await;
    let third = enqueue(&app, BusyPolicy::Enqueue, "m3", "咖啡 12").await;
    worker.kill();

    // The first looks find the reply's lease still live; bounded.
    let mut outcomes = Vec::new();
    for _ in 0..50 {
        outcomes = app.recover_once().await.expect("recover");
        if !outcomes.is_empty() {
            break;
        }
        tokio::time::sleep(SHORT_TTL / 4).await;
    }
    let states: Vec<(&str, TurnState)> = outcomes
        .iter()
        .map(|o| (o.client_request_id.as_str(), o.state))
        .collect();
    assert_eq!(
        states,
        [
            ("m1", TurnState::Succeeded),
            ("m2", TurnState::Succeeded),
            ("m3", TurnState::Succeeded)
        ],
        "the dead worker's reply resumed first, then its queue in order"
    );
    assert_eq!(outcomes[1].turn_id, second.turn_id);
    assert_eq!(outcomes[2].turn_id, third.turn_id);
    assert_eq!(
        booked_in_order(&app).await,
        [3500, 1800, 1200],
        "the first booking was not made again"
    );
}
