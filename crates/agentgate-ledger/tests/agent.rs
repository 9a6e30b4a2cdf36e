//! The agent loop with the offline model on a temp SQLite file: bookings,
//! several entries, replays, crashes after the booking, validation errors
//! fed back to the model. Ledger rows are counted in SQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, ErrorKind, ToolState, TurnState};
use agentgate_ledger::model::{ModelReply, ToolCallRequest};
use agentgate_ledger::{AgentEvent, EntryType, LedgerError, Started};
use common::*;
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn the_seed_sentence_books_one_expense_of_35_to_dining() {
    let store = store();
    let app = offline_app(&store.url).await;
    let (sender, mut receiver) = events();
    let outcome = app
        .chat(
            &message("s1", "m1", "中午吃粉花了 35"),
            Some(sender),
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert_eq!(outcome.state, TurnState::Succeeded);
    assert!(!outcome.replayed);
    let reply = outcome.reply.expect("reply");
    assert_eq!(reply.entries.len(), 1);
    let entry = &reply.entries[0];
    assert_eq!(
        (entry.kind, entry.amount_cents, entry.category.as_str()),
        (EntryType::Expense, 3500, "餐饮")
    );
    assert_eq!(entry.amount, "35.00");
    assert!(reply.text.contains("餐饮"), "{}", reply.text);
    assert_eq!(count_entries(&store.url).await, 1);
    assert_eq!(
        scalar(&store.url, "SELECT COUNT(*) FROM ledger_entries WHERE category = '餐饮' AND amount_cents = 3500 AND type = 'expense'").await,
        1
    );

    let seen = drain(&mut receiver);
    let kinds = names(&seen);
    assert_eq!(kinds.first(), Some(&"started"));
    assert_eq!(kinds.last(), Some(&"final"));
    let calls: Vec<&str> = seen
        .iter()
        .filter_map(|e| match e {
            AgentEvent::ToolCall { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(calls, ["list_categories", "create_transaction"]);
    assert!(kinds.contains(&"delta"));

    // The turn's event log in the engine holds what was streamed up to the
    // ending, in order, as the same JSON: what a reader on any node, or a
    // page after a reload, replays. (The ending's own `final` follows the
    // log's end.)
    let logged = event_log(&app, &outcome.turn_id).await;
    let live: Vec<(u32, String, serde_json::Value)> = seen[..seen.len() - 1]
        .iter()
        .map(|e| {
            (
                1,
                e.name().to_owned(),
                serde_json::to_value(e).expect("json"),
            )
        })
        .collect();
    assert_eq!(logged, live);

    // The page's views agree.
    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    assert_eq!(transcript.len(), 1);
    assert_eq!(transcript[0].user_text, "中午吃粉花了 35");
    assert_eq!(transcript[0].state, Some(TurnState::Succeeded));
    assert_eq!(
        transcript[0].reply.as_ref().map(|r| r.entries.len()),
        Some(1)
    );
    let sessions = app.sessions("alice").await.expect("sessions");
    assert_eq!(sessions.len(), 1);
    assert_eq!(
        (sessions[0].title.as_str(), sessions[0].turns),
        ("中午吃粉花了 35", 1)
    );
    let totals = app.totals("alice").await.expect("totals");
    assert_eq!(totals.expense_cents, 3500);
    assert_eq!(totals.categories[0].category, "餐饮");
    assert_eq!(app.entries("alice").await.expect("entries").len(), 1);
    assert!(app
        .transcript("mallory", "s1")
        .await
        .expect("transcript")
        .is_empty());
    assert!(app.entries("mallory").await.expect("entries").is_empty());
}

#[tokio::test]
async fn two_entries_in_one_message_book_two() {
    let store = store();
    let app = offline_app(&store.url).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "午饭 35，打车 18"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    let entries = outcome.reply.expect("reply").entries;
    let booked: Vec<(&str, i64)> = entries
        .iter()
        .map(|e| (e.category.as_str(), e.amount_cents))
        .collect();
    assert_eq!(booked, [("餐饮", 3500), ("交通", 1800)]);
    assert_eq!(count_entries(&store.url).await, 2);

    let outcome = app
        .chat(
            &message("s1", "m2", "发工资 800 yesterday"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    let entry = outcome.reply.expect("reply").entries.remove(0);
    assert_eq!(
        (entry.kind, entry.category.as_str()),
        (EntryType::Income, "工资")
    );
    let created_day = entry.created_at_ms.div_euclid(86_400_000);
    let local_today = agentgate_ledger::date::Date::at_unix_ms(entry.created_at_ms, 480);
    assert_eq!(
        entry.occur_date,
        local_today.add_days(-1).to_string(),
        "created on day {created_day}"
    );
    assert_eq!(count_entries(&store.url).await, 3);
}

#[tokio::test]
async fn a_retried_request_replays_without_calling_the_model_or_booking() {
    let store = store();
    let model = Counting::offline();
    let app = app_on(&store.url, Config::default(), model.clone()).await;
    let first = app
        .chat(
            &message("s1", "m1", "打车 18"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("first");
    let rounds = model.rounds();
    assert_eq!(rounds, 3);
    let (sender, mut receiver) = events();
    let again = app
        .chat(
            &message("s1", "m1", "打车 18"),
            Some(sender),
            CancellationToken::new(),
        )
        .await
        .expect("again");
    assert!(again.replayed);
    assert_eq!(again.reply, first.reply);
    assert_eq!(model.rounds(), rounds, "a replay does not call the model");
    assert_eq!(count_entries(&store.url).await, 1);
    assert_eq!(names(&drain(&mut receiver)), ["final"]);
    // The transcript holds the turn once.
    assert_eq!(
        scalar(&store.url, "SELECT COUNT(*) FROM ledger_messages").await,
        2
    );

    // Same request id, other text: refused, nothing booked.
    let mismatch = app
        .chat(
            &message("s1", "m1", "打车 19"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect_err("mismatch");
    assert_eq!(mismatch.engine_kind(), Some(ErrorKind::PayloadMismatch));
    assert_eq!(count_entries(&store.url).await, 1);
}

/// Waits out `request_in_flight` (the dead holder's lease) and retries.
async fn retry_until_started(
    app: &agentgate_ledger::LedgerApp,
    text: &str,
) -> agentgate_ledger::RunningTurn {
    for _ in 0..50 {
        match app.start_message(&message("s1", "m1", text)).await {
            Ok(Started::Running(turn)) => return turn,
            Ok(Started::Replay(outcome)) => panic!("nothing ended yet: {outcome:?}"),
            Ok(Started::Queued(queued)) => {
                panic!("a rejecting message is never queued: {queued:?}")
            }
            Err(LedgerError::Engine(error)) if error.kind() == ErrorKind::RequestInFlight => {
                tokio::time::sleep(error.retry_after().unwrap_or(SHORT_TTL).min(SHORT_TTL)).await;
            }
            Err(error) => panic!("unexpected {error}"),
        }
    }
    panic!("the abandoned turn was never taken over");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_booking_is_taken_over_and_books_nothing_new() {
    let store = store();
    let config = Config {
        lease_ttl: SHORT_TTL,
        ..Config::default()
    };
    let worker = DoomedWorker::booked(&store.url, config.clone()).await;
    assert_eq!(
        count_entries(&store.url).await,
        1,
        "the booking committed before the crash"
    );
    worker.kill();

    // The client retries the same request on another node.
    let app = app_on(
        &store.url,
        config,
        Arc::new(agentgate_ledger::OfflineModel::new(Duration::ZERO)),
    )
    .await;
    let turn = retry_until_started(&app, "午饭 35").await;
    assert_eq!(turn.attempt(), 2);
    let (sender, mut receiver) = events();
    let outcome = turn
        .run(Some(sender), CancellationToken::new())
        .await
        .expect("run");
    assert_eq!(outcome.state, TurnState::Succeeded);
    assert_eq!(count_entries(&store.url).await, 1, "nothing new booked");
    let seen = drain(&mut receiver);
    assert!(
        matches!(
            seen.first(),
            Some(AgentEvent::Started {
                attempt: 2,
                takeover: true,
                ..
            })
        ),
        "the dead worker's lease expired and was taken over: {:?}",
        seen.first()
    );
    let cached: Vec<bool> = seen
        .iter()
        .filter_map(|e| match e {
            AgentEvent::ToolResult { name, cached, .. } if name == "create_transaction" => {
                Some(*cached)
            }
            _ => None,
        })
        .collect();
    assert_eq!(cached, [true], "the booking came from the engine's record");
    assert_eq!(outcome.reply.expect("reply").entries.len(), 1);

    // The log holds the dead worker's events (attempt 1) and then the
    // takeover's, which start over with their own `started`.
    let logged = event_log(&app, &outcome.turn_id).await;
    let attempts: Vec<u32> = logged.iter().map(|(attempt, _, _)| *attempt).collect();
    let first_of_two = attempts
        .iter()
        .position(|a| *a == 2)
        .expect("attempt 2 logged");
    assert!(
        first_of_two > 0,
        "the dead worker's events are kept: {attempts:?}"
    );
    assert!(
        attempts[..first_of_two].iter().all(|a| *a == 1),
        "{attempts:?}"
    );
    assert!(
        attempts[first_of_two..].iter().all(|a| *a == 2),
        "{attempts:?}"
    );
    assert_eq!(logged[first_of_two].1, "started");
    let resumed: Vec<(u32, String, serde_json::Value)> = seen[..seen.len() - 1]
        .iter()
        .map(|e| {
            (
                2,
                e.name().to_owned(),
                serde_json::to_value(e).expect("json"),
            )
        })
        .collect();
    assert_eq!(logged[first_of_two..], resumed[..]);
}

/// A turn's whole event log: (attempt, name, data) per event, in id order.
async fn event_log(
    app: &agentgate_ledger::LedgerApp,
    turn_id: &str,
) -> Vec<(u32, String, serde_json::Value)> {
    let turn_id = agentgate::TurnId::new(turn_id).expect("id");
    let page = app
        .gate()
        .store()
        .events(&turn_id, 0, agentgate::limits::MAX_EVENT_PAGE)
        .await
        .expect("events")
        .expect("the turn");
    assert_ne!(
        page.state,
        agentgate::TurnState::Running,
        "read after the ending"
    );
    page.events
        .into_iter()
        .map(|e| {
            let data = serde_json::from_str(&e.data).expect("event json");
            (e.attempt, e.name, data)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_dropped_after_booking_is_released_and_the_retry_books_nothing_new() {
    let store = store();
    let (model, booked) = HangAfterBooking::new();
    let app = app_on(&store.url, Config::default(), model).await;
    let task = tokio::spawn({
        let app = app.clone();
        async move {
            app.chat(
                &message("s1", "m1", "打车 18"),
                None,
                CancellationToken::new(),
            )
            .await
        }
    });
    booked.await.expect("booked");
    task.abort();
    assert!(task.await.expect_err("aborted").is_cancelled());
    assert_eq!(count_entries(&store.url).await, 1);

    // The dropped turn is failed as retryable in the background; the retry
    // restarts it (on a fresh app: the hanging model is spent).
    let retry_app = offline_app(&store.url).await;
    let mut outcome = None;
    for _ in 0..50 {
        match retry_app
            .chat(
                &message("s1", "m1", "打车 18"),
                None,
                CancellationToken::new(),
            )
            .await
        {
            Ok(done) => {
                outcome = Some(done);
                break;
            }
            Err(error) if error.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(error) => panic!("unexpected {error}"),
        }
    }
    assert_eq!(outcome.expect("retried").state, TurnState::Succeeded);
    assert_eq!(count_entries(&store.url).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_cancel_releases_the_lease_and_the_retry_resumes() {
    let store = store();
    let (model, booked) = HangAfterBooking::new();
    let app = app_on(&store.url, Config::default(), model).await;
    let cancel = CancellationToken::new();
    let Started::Running(turn) = app
        .start_message(&message("s1", "m1", "地铁 4"))
        .await
        .expect("start")
    else {
        panic!("fresh request");
    };
    let run = tokio::spawn(turn.run(None, cancel.clone()));
    booked.await.expect("booked");
    cancel.cancel();
    let error = run.await.expect("joined").expect_err("cancelled");
    assert!(matches!(error, LedgerError::Cancelled), "{error}");
    // Released at once: the session takes the retry immediately.
    let session = app
        .gate()
        .store()
        .session(&agentgate::SessionId::new("s1").expect("id"))
        .await
        .expect("view")
        .expect("session");
    assert!(session.holder.is_none());
    let retry_app = offline_app(&store.url).await;
    let outcome = retry_app
        .chat(
            &message("s1", "m1", "地铁 4"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("retry");
    assert_eq!(outcome.reply.expect("reply").entries[0].category, "交通");
    assert_eq!(count_entries(&store.url).await, 1);
}

/// A cancel requested through the engine (the app's gate, as its stop
/// button sends it) reaches the agent's turn: the reply stops, the turn ends `cancelled` (not a retryable failure), the booking
/// already made stays booked once, and a repeat of the message replays the
/// cancellation instead of running again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_cancel_stops_the_reply_and_the_repeat_replays_it() {
    let store = store();
    let (model, booked) = HangAfterBooking::new();
    let config = Config {
        lease_ttl: std::time::Duration::from_millis(900),
        ..Config::default()
    };
    let app = app_on(&store.url, config, model).await;
    let Started::Running(turn) = app
        .start_message(&message("s1", "m1", "地铁 4"))
        .await
        .expect("start")
    else {
        panic!("fresh request");
    };
    let turn_id = agentgate::TurnId::new(turn.turn_id()).expect("id");
    let run = tokio::spawn(turn.run(None, CancellationToken::new()));
    booked.await.expect("booked");
    app.gate()
        .request_cancel(&turn_id)
        .await
        .expect("request")
        .expect("turn");
    let error = tokio::time::timeout(std::time::Duration::from_secs(5), run)
        .await
        .expect("stopped within a few heartbeats")
        .expect("joined")
        .expect_err("cancelled");
    assert!(matches!(error, LedgerError::Cancelled), "{error}");
    let view = app
        .gate()
        .store()
        .turn(&turn_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(view.state, TurnState::Cancelled, "{view:?}");
    assert_eq!(
        count_entries(&store.url).await,
        1,
        "the booking made stays, once"
    );
    match app
        .start_message(&message("s1", "m1", "地铁 4"))
        .await
        .expect("repeat")
    {
        Started::Replay(outcome) => assert_eq!(outcome.state, TurnState::Cancelled),
        Started::Running(_) => panic!("a cancelled message must not run again"),
        Started::Queued(queued) => panic!("a rejecting message is never queued: {queued:?}"),
    }
    assert_eq!(count_entries(&store.url).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_message_while_one_runs_is_refused_as_session_busy() {
    let store = store();
    let (model, booked) = HangAfterBooking::new();
    let app = app_on(&store.url, Config::default(), model).await;
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (app, cancel) = (app.clone(), cancel.clone());
        async move {
            app.chat(&message("s1", "m1", "午饭 35"), None, cancel)
                .await
        }
    });
    booked.await.expect("booked");
    let busy = app
        .start_message(&message("s1", "m2", "打车 18"))
        .await
        .expect_err("busy");
    assert_eq!(busy.engine_kind(), Some(ErrorKind::SessionBusy));
    let in_flight = app
        .start_message(&message("s1", "m1", "午饭 35"))
        .await
        .expect_err("in flight");
    assert_eq!(in_flight.engine_kind(), Some(ErrorKind::RequestInFlight));
    cancel.cancel();
    let _ = running.await;
    assert_eq!(count_entries(&store.url).await, 1);
}

#[tokio::test]
async fn validation_errors_go_back_to_the_model_as_tool_errors() {
    let store = store();
    let app = offline_app(&store.url).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "午饭 0"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("a validation error is not a crash");
    assert_eq!(outcome.state, TurnState::Succeeded);
    let reply = outcome.reply.expect("reply");
    assert!(reply.entries.is_empty());
    assert!(
        reply.text.contains("没有记账") && reply.text.contains("greater than 0"),
        "{}",
        reply.text
    );
    let turn_id = agentgate::TurnId::new(outcome.turn_id).expect("id");
    let executions = agentgate::store::all_executions(app.gate().store().as_ref(), &turn_id)
        .await
        .expect("executions");
    let create: Vec<ToolState> = executions
        .iter()
        .filter(|e| e.tool.as_str() == "create_transaction")
        .map(|e| e.state)
        .collect();
    assert_eq!(
        create,
        [ToolState::Failed],
        "the refused call is recorded as failed"
    );

    let outcome = app
        .chat(
            &message("s1", "m2", "午饭 35 2024-13-45"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert!(outcome.reply.expect("reply").text.contains("not a date"));
    assert_eq!(count_entries(&store.url).await, 0);
}

fn call(id: &str, name: &str, arguments: serde_json::Value) -> ToolCallRequest {
    ToolCallRequest {
        id: id.into(),
        name: name.into(),
        arguments,
    }
}

#[tokio::test]
async fn a_model_corrects_its_call_after_a_tool_error() {
    let store = store();
    let model = Scripted::new(vec![
        ModelReply {
            text: String::new(),
            tool_calls: vec![
                call(
                    "a",
                    "create_transaction",
                    json!({"type": "spend", "amount": 35, "category_name": "外卖"}),
                ),
                call("b", "delete_everything", json!({})),
            ],
        },
        ModelReply {
            text: String::new(),
            tool_calls: vec![call(
                "c",
                "create_transaction",
                json!({"type": "expense", "amount": "35", "category_name": "外卖"}),
            )],
        },
        ModelReply {
            text: "记好了：外卖 35 元。".into(),
            tool_calls: vec![],
        },
    ]);
    let app = app_on(&store.url, Config::default(), model.clone()).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "外卖 35"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert_eq!(
        outcome.reply.as_ref().map(|r| r.text.as_str()),
        Some("记好了：外卖 35 元。")
    );
    assert_eq!(count_entries(&store.url).await, 1);
    let seen = model.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 3);
    let second_round = serde_json::to_string(&seen[1]).expect("json");
    assert!(
        second_round.contains("type must be"),
        "round 2 sees the validation error"
    );
    assert!(
        second_round.contains("unknown tool"),
        "round 2 sees the unknown tool"
    );
    let third_round = serde_json::to_string(&seen[2]).expect("json");
    assert!(
        third_round.contains("\\\"category\\\":\\\"餐饮\\\""),
        "synonym 外卖 → 餐饮: {third_round}"
    );
}

#[tokio::test]
async fn the_last_round_is_text_only_and_a_silent_model_gets_a_summary() {
    let store = store();
    let model = Scripted::new(vec![
        ModelReply {
            text: String::new(),
            tool_calls: vec![call("a", "list_categories", json!({"type": "expense"}))],
        },
        ModelReply {
            text: String::new(),
            tool_calls: vec![call(
                "b",
                "create_transaction",
                json!({"type": "expense", "amount": 12, "note": "地铁"}),
            )],
        },
        // Ignores tool_choice none and calls again: not run.
        ModelReply {
            text: String::new(),
            tool_calls: vec![call(
                "c",
                "create_transaction",
                json!({"type": "expense", "amount": 99}),
            )],
        },
    ]);
    let app = app_on(&store.url, Config::default(), model).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "地铁 12"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    let reply = outcome.reply.expect("reply");
    assert_eq!(reply.entries.len(), 1);
    assert!(reply.text.contains("交通"), "{}", reply.text);
    assert_eq!(count_entries(&store.url).await, 1);
}

#[tokio::test]
async fn bad_input_is_refused_before_the_engine() {
    let store = store();
    let app = offline_app(&store.url).await;
    let empty = app
        .start_message(&message("s1", "m1", "   "))
        .await
        .expect_err("empty");
    assert_eq!(empty.code(), "invalid_request");
    let long = "午".repeat(agentgate_ledger::limits::MAX_MESSAGE_CHARS + 1);
    assert!(app
        .start_message(&message("s1", "m1", &long))
        .await
        .is_err());
    let mut zoned = message("s1", "m1", "午饭 35");
    zoned.utc_offset_minutes = Some(15 * 60);
    assert!(app.start_message(&zoned).await.is_err());
    assert!(app.sessions("alice").await.expect("sessions").is_empty());
}

#[tokio::test]
async fn no_amount_gets_help_and_books_nothing() {
    let store = store();
    let app = offline_app(&store.url).await;
    let outcome = app
        .chat(&message("s1", "m1", "你好"), None, CancellationToken::new())
        .await
        .expect("chat");
    assert!(outcome.reply.expect("reply").text.contains("没看到金额"));
    assert_eq!(count_entries(&store.url).await, 0);
}
