//! The reference app (docs/protocol.md §11) over HTTP against the real binary: pages and
//! assets, the event stream of a turn, refusals with their real status before
//! any stream, confirmations, both disconnect policies, the dashboard's data,
//! and the API key, `--no-app` and bad-input edges.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod app_client;
#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::time::{Duration, Instant};

use app_client::{last, AppClient, Opened};
use serde_json::{json, Value};
use support::{scratch, Server};

/// How long a test waits for a turn to end by itself: many turns' worth.
const TURN_DEADLINE: Duration = Duration::from_secs(20);

async fn open_stream(app: &AppClient, body: &Value) -> app_client::EventStream {
    match app
        .open("/app/messages", body)
        .await
        .expect("the server answers")
    {
        Opened::Stream(stream) => stream,
        Opened::Refused(refused) => panic!("refused: {refused:?}"),
    }
}

/// Polls the transcript until no turn of the session runs.
async fn until_idle(app: &AppClient, user: &str, session: &str) -> Value {
    let deadline = Instant::now() + TURN_DEADLINE;
    loop {
        let transcript = app.transcript(user, session).await.expect("transcript");
        if transcript["running"] == false {
            return transcript;
        }
        assert!(Instant::now() < deadline, "still running: {transcript}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn holder(server: &Server, session: &str) -> Value {
    let session = server
        .client()
        .get(&format!("/v1/sessions/{session}"))
        .await;
    session.body["session"]["holder"].clone()
}

#[tokio::test]
async fn pages_and_assets_are_served_with_a_strict_policy() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let http = reqwest::Client::new();
    for (path, content_type) in [
        ("/", "text/html; charset=utf-8"),
        ("/dashboard", "text/html; charset=utf-8"),
        ("/assets/app.js", "text/javascript; charset=utf-8"),
        ("/assets/dashboard.js", "text/javascript; charset=utf-8"),
        ("/assets/common.js", "text/javascript; charset=utf-8"),
        ("/assets/style.css", "text/css; charset=utf-8"),
        ("/assets/favicon.svg", "image/svg+xml"),
    ] {
        let response = http
            .get(format!("{}{path}", server.base))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        assert_eq!(response.headers()["content-type"], content_type, "{path}");
        let policy = response.headers()["content-security-policy"]
            .to_str()
            .unwrap();
        assert!(policy.contains("script-src 'self'"), "{path}: {policy}");
        assert_eq!(response.headers()["x-content-type-options"], "nosniff");
    }
    let client = server.client();
    client
        .get("/assets/../Cargo.toml")
        .await
        .expect(404, "not_found");
    client.get("/assets/nope.js").await.expect(404, "not_found");
    client
        .post("/app/sessions", None, &json!({}))
        .await
        .expect(405, "method_not_allowed");
    // The app is not part of the v1 contract: the document does not list it.
    let document = client.get("/openapi.json").await;
    let paths = document.body["paths"].as_object().unwrap();
    assert!(paths.keys().all(|p| !p.starts_with("/app")), "{paths:?}");
}

#[tokio::test]
async fn a_turn_streams_its_events_and_refusals_come_before_any_stream() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "300"]);
    let app = AppClient::new(&server.base);
    let message = AppClient::message("alice", "s1", "m1", "中午吃粉花了 35");
    let mut stream = open_stream(&app, &message).await;
    let (name, started) = stream.next().await.unwrap().expect("a first event");
    assert_eq!(name, "started");
    assert_eq!(started["attempt"], 1);
    let turn_id = started["turn_id"].as_str().unwrap().to_owned();

    // Another message in the busy session: 409 with the usual body, no stream.
    let busy = app.send("alice", "s1", "m2", "taxi 18").await.unwrap();
    assert_eq!(busy.refusal(), (409, "session_busy"));
    let app_client::Sent::Refused {
        body, retry_after, ..
    } = &busy
    else {
        unreachable!()
    };
    assert_eq!(body["error"]["active_turn_id"], turn_id.as_str());
    assert!(body["error"]["retry_after_ms"].as_u64().unwrap() >= 1);
    assert!(retry_after.unwrap() >= 1);
    // The same message again (a double click): this very request is running.
    let again = app
        .send("alice", "s1", "m1", "中午吃粉花了 35")
        .await
        .unwrap();
    assert_eq!(again.refusal(), (409, "request_in_flight"));

    let events = stream.rest().await.unwrap();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["tool_call", "tool_result", "delta", "final"] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
    assert_eq!(names.last(), Some(&"final"));
    let outcome = &last(&events, "final").unwrap()["outcome"];
    assert_eq!(outcome["state"], "succeeded");
    assert_eq!(outcome["replayed"], false);
    let entries = app.entries("alice").await.unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(
        (&entries[0]["amount_cents"], &entries[0]["category"]),
        (&json!(3500), &json!("餐饮"))
    );

    // A retry of the answered message replays: one final event, no booking.
    let replay = app
        .send("alice", "s1", "m1", "中午吃粉花了 35")
        .await
        .unwrap()
        .events();
    assert_eq!(replay.len(), 1, "{replay:?}");
    assert_eq!(replay[0].0, "final");
    assert_eq!(replay[0].1["outcome"]["replayed"], true);
    assert_eq!(replay[0].1["outcome"]["turn_id"], turn_id.as_str());
    // The same id with another text is a client bug.
    let mismatch = app.send("alice", "s1", "m1", "taxi 99").await.unwrap();
    assert_eq!(mismatch.refusal(), (422, "payload_mismatch"));
    assert_eq!(app.entries("alice").await.unwrap().len(), 1);

    let (status, sessions) = app.get("/app/sessions?user_id=alice").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(sessions["sessions"][0]["session_id"], "s1");
    assert_eq!(sessions["sessions"][0]["title"], "中午吃粉花了 35");
    let transcript = app.transcript("alice", "s1").await.unwrap();
    assert_eq!(transcript["turns"].as_array().unwrap().len(), 1);
    assert_eq!(transcript["turns"][0]["state"], "succeeded");
    // Another user reads nothing of alice's: her session is not found.
    let (status, other) = app
        .get("/app/transcript?user_id=mallory&session_id=s1")
        .await
        .unwrap();
    assert_eq!(
        (status, &other["error"]["code"]),
        (404, &json!("not_found"))
    );
    assert!(app.entries("mallory").await.unwrap().is_empty());
}

#[tokio::test]
async fn a_user_over_their_cap_gets_429_before_any_stream() {
    let dir = scratch();
    let server = Server::start(
        dir.path(),
        &["--think-time-ms", "300", "--max-turns-per-user", "1"],
    );
    let app = AppClient::new(&server.base);
    let stream = open_stream(&app, &AppClient::message("carol", "s1", "m1", "taxi 18")).await;
    let capped = app.send("carol", "s2", "m1", "午饭 20").await.unwrap();
    assert_eq!(capped.refusal(), (429, "user_at_capacity"));
    let app_client::Sent::Refused { retry_after, .. } = capped else {
        unreachable!()
    };
    assert!(retry_after.unwrap() >= 1);
    let events = stream.rest().await.unwrap();
    assert_eq!(
        last(&events, "final").unwrap()["outcome"]["state"],
        "succeeded"
    );
    // The permit came back with the turn's end.
    let later = app
        .send("carol", "s2", "m1", "午饭 20")
        .await
        .unwrap()
        .events();
    assert!(last(&later, "final").is_some());
    assert_eq!(app.entries("carol").await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirmation_blocks_new_messages_and_approving_twice_books_once() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "0"]);
    let app = AppClient::new(&server.base);
    let events = app
        .send("dave", "s1", "m1", "new laptop 6999")
        .await
        .unwrap()
        .events();
    let waiting = last(&events, "awaiting_confirmation").expect("a pending card");
    let pending_turn = waiting["turn_id"].as_str().unwrap().to_owned();
    assert_eq!(waiting["pending"][0]["amount_cents"], 699_900);
    assert!(app.entries("dave").await.unwrap().is_empty());
    let transcript = app.transcript("dave", "s1").await.unwrap();
    assert_eq!(transcript["pending"]["turn_id"], pending_turn.as_str());

    let blocked = app.send("dave", "s1", "m2", "午饭 20").await.unwrap();
    assert_eq!(blocked.refusal(), (409, "awaiting_confirmation"));
    let app_client::Sent::Refused { body, .. } = &blocked else {
        unreachable!()
    };
    assert_eq!(body["error"]["active_turn_id"], pending_turn.as_str());

    // Two tabs approve at once, each with its own answer id.
    let (a, b) = tokio::join!(
        app.confirm("dave", "s1", "tab-a", &pending_turn, "approve"),
        app.confirm("dave", "s1", "tab-b", &pending_turn, "approve"),
    );
    let mut finals = 0;
    for sent in [a.unwrap(), b.unwrap()] {
        match sent {
            app_client::Sent::Streamed(events) => {
                let outcome = &last(&events, "final").expect("a final event")["outcome"];
                assert_eq!(outcome["state"], "succeeded", "{events:?}");
                finals += 1;
            }
            refused => assert_eq!(refused.refusal(), (409, "request_in_flight")),
        }
    }
    assert!(finals >= 1);
    until_idle(&app, "dave", "s1").await;
    let entries = app.entries("dave").await.unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["amount_cents"], 699_900);
    // A late approval from a third tab replays the decision: still one entry.
    let late = app
        .confirm("dave", "s1", "tab-c", &pending_turn, "approve")
        .await
        .unwrap();
    if let app_client::Sent::Streamed(events) = late {
        assert_eq!(last(&events, "final").unwrap()["outcome"]["replayed"], true);
    }
    assert_eq!(app.entries("dave").await.unwrap().len(), 1);
    // The session takes messages again.
    let next = app
        .send("dave", "s1", "m2", "午饭 20")
        .await
        .unwrap()
        .events();
    assert!(last(&next, "final").is_some());
    assert_eq!(app.entries("dave").await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_reject_learns_that_the_approve_was_applied() {
    let dir = scratch();
    let server = Server::start(
        dir.path(),
        &["--think-time-ms", "0", "--confirmation-ttl-ms", "120000"],
    );
    let app = AppClient::new(&server.base);
    let (_, settings) = app.get("/app/settings").await.unwrap();
    assert_eq!(settings["confirmation_ttl_ms"], 120_000);
    let events = app
        .send("gina", "s1", "m1", "new laptop 6999")
        .await
        .unwrap()
        .events();
    let waiting = last(&events, "awaiting_confirmation").expect("a pending card");
    let pending_turn = waiting["turn_id"].as_str().unwrap().to_owned();
    // The card's deadline: the flag's TTL, counted down on the store's clock.
    let transcript = app.transcript("gina", "s1").await.unwrap();
    let expires_in_ms = transcript["pending"]["expires_in_ms"].as_i64().unwrap();
    assert!(
        (100_000..=120_000).contains(&expires_in_ms),
        "{expires_in_ms}"
    );

    let approved = app
        .confirm("gina", "s1", "tab-a", &pending_turn, "approve")
        .await
        .unwrap()
        .events();
    let outcome = &last(&approved, "final").expect("a final event")["outcome"];
    assert_eq!(outcome["decision"], "approve");
    assert_eq!(outcome["client_request_id"], "tab-a");
    // Another tab rejects afterwards: the server replays the approve, and
    // says whose answer it was, so that tab can tell the person the truth.
    let late = app
        .confirm("gina", "s1", "tab-b", &pending_turn, "reject")
        .await
        .unwrap()
        .events();
    let replayed = &last(&late, "final").expect("a replay")["outcome"];
    assert_eq!(replayed["replayed"], true);
    assert_eq!(replayed["decision"], "approve");
    assert_eq!(replayed["client_request_id"], "tab-a");
    assert_eq!(app.entries("gina").await.unwrap().len(), 1);
    // The transcript names each turn's request id, for a retry as itself.
    let transcript = app.transcript("gina", "s1").await.unwrap();
    assert_eq!(transcript["turns"][0]["client_request_id"], "m1");
    assert!(transcript["pending"].is_null());
}

#[tokio::test]
async fn on_disconnect_finish_lets_the_turn_end_and_release_its_lease() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "400"]);
    let app = AppClient::new(&server.base);
    let mut stream = open_stream(&app, &AppClient::message("erin", "s1", "m1", "taxi 18")).await;
    assert_eq!(stream.next().await.unwrap().unwrap().0, "started");
    drop(stream); // the tab closes
    let transcript = until_idle(&app, "erin", "s1").await;
    assert_eq!(transcript["turns"][0]["state"], "succeeded");
    assert!(transcript["turns"][0]["reply"]["text"]
        .as_str()
        .unwrap()
        .contains("18"));
    assert_eq!(app.entries("erin").await.unwrap().len(), 1);
    assert_eq!(holder(&server, "s1").await, Value::Null, "lease released");
}

#[tokio::test]
async fn on_disconnect_cancel_cancels_releases_and_a_resend_books_once() {
    let dir = scratch();
    let think_ms = 1500;
    let server = Server::start(
        dir.path(),
        &[
            "--think-time-ms",
            &think_ms.to_string(),
            "--on-disconnect",
            "cancel",
        ],
    );
    let app = AppClient::new(&server.base);
    let message = AppClient::message("fred", "s1", "m1", "taxi 18");
    let mut stream = open_stream(&app, &message).await;
    assert_eq!(stream.next().await.unwrap().unwrap().0, "started");
    let dropped = Instant::now();
    drop(stream);
    // Released well before the turn (three rounds of 1.5 s) could have ended.
    while holder(&server, "s1").await != Value::Null {
        assert!(
            dropped.elapsed() < Duration::from_millis(think_ms * 2),
            "the cancelled turn still holds its lease"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let transcript = until_idle(&app, "fred", "s1").await;
    assert_eq!(transcript["turns"][0]["state"], "failed");
    assert_eq!(transcript["turns"][0]["error"]["code"], "cancelled");
    assert!(app.entries("fred").await.unwrap().is_empty());
    // Sending the same message again resumes it as attempt 2, once.
    let events = app
        .send("fred", "s1", "m1", "taxi 18")
        .await
        .unwrap()
        .events();
    assert_eq!(events[0].1["attempt"], 2, "{events:?}");
    assert_eq!(
        last(&events, "final").unwrap()["outcome"]["state"],
        "succeeded"
    );
    assert_eq!(app.entries("fred").await.unwrap().len(), 1);
    let logs = server.logs();
    assert!(logs.contains("app turn failed"), "{logs}");
}

#[tokio::test]
async fn the_dashboard_shows_holders_permits_and_counters() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "300"]);
    let app = AppClient::new(&server.base);
    let stream = open_stream(&app, &AppClient::message("gina", "s1", "m1", "taxi 18")).await;
    let busy = app.send("gina", "s1", "m2", "午饭 20").await.unwrap();
    assert_eq!(busy.refusal(), (409, "session_busy"));
    let (status, dashboard) = app.get("/app/dashboard").await.unwrap();
    assert_eq!(status, 200, "{dashboard}");
    let live = dashboard["live"].as_array().unwrap();
    assert_eq!(live.len(), 1, "{dashboard}");
    assert_eq!(live[0]["user_id"], "gina");
    assert_eq!(live[0]["session_id"], "s1");
    assert!(live[0]["fence"].as_i64().unwrap() >= 1);
    let remaining = live[0]["lease_expires_in_ms"].as_i64().unwrap();
    assert!(remaining > 0 && remaining <= 30_000, "{remaining}");
    assert_eq!(
        dashboard["permits"][0],
        json!({"user_id": "gina", "live_turns": 1, "max_turns_per_user": 5})
    );
    assert_eq!(dashboard["recent_turns"][0]["state"], "running");
    assert!(dashboard["recent_turns"][0].get("response").is_none());
    assert_eq!(dashboard["counters"]["conflicts"]["session_busy"], 1);
    assert_eq!(dashboard["counters"]["live_turns"], 1);
    stream.rest().await.unwrap();
    let replay = app.send("gina", "s1", "m1", "taxi 18").await.unwrap();
    assert!(matches!(replay, app_client::Sent::Streamed(_)));
    let (_, dashboard) = app.get("/app/dashboard").await.unwrap();
    assert_eq!(dashboard["live"], json!([]));
    assert_eq!(dashboard["permits"][0]["live_turns"], 0);
    assert_eq!(dashboard["counters"]["replays"], 1);
    assert_eq!(dashboard["counters"]["turn_endings"]["succeeded"], 1);
    assert_eq!(dashboard["counters"]["live_turns"], 0);
    let tools: Vec<&str> = dashboard["recent_executions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tool"].as_str().unwrap())
        .collect();
    assert!(tools.contains(&"create_transaction"), "{tools:?}");
    let metrics = server.client().get("/metrics").await.text;
    assert!(metrics.contains("agentgate_conflicts_total{code=\"session_busy\"} 1"));
}

/// Sends `text` with `on_busy` `policy`; asserts the 202 of a queued
/// message and returns its body.
async fn enqueue(app: &AppClient, user: &str, request: &str, text: &str, policy: &str) -> Value {
    let mut body = AppClient::message(user, "s1", request, text);
    body["on_busy"] = json!(policy);
    match app.open("/app/messages", &body).await.unwrap() {
        Opened::Refused(app_client::Sent::Refused {
            status: 202,
            body,
            retry_after,
            ..
        }) => {
            assert!(
                retry_after.unwrap() >= 1,
                "a queued message says when to look again"
            );
            assert_eq!(body["queued"], true, "{body}");
            body
        }
        Opened::Refused(other) => panic!("not queued: {other:?}"),
        Opened::Stream(_) => panic!("a queued message is not streamed"),
    }
}

/// Polls the transcript until the turn of `request` is in `state`.
async fn until_state(app: &AppClient, user: &str, request: &str, state: &str) -> Value {
    let deadline = Instant::now() + TURN_DEADLINE;
    loop {
        let transcript = app.transcript(user, "s1").await.unwrap();
        let turn = transcript["turns"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["client_request_id"] == request)
            .cloned();
        if turn.as_ref().is_some_and(|t| t["state"] == state) {
            return transcript;
        }
        assert!(
            Instant::now() < deadline,
            "{request} never {state}: {transcript}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn queued_messages_wait_show_on_the_dashboard_cancel_and_are_handed_off_in_order() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "300"]);
    let app = AppClient::new(&server.base);
    let stream = open_stream(&app, &AppClient::message("quinn", "s1", "m1", "lunch 35")).await;
    let second = enqueue(&app, "quinn", "m2", "taxi 18", "enqueue").await;
    let third = enqueue(&app, "quinn", "m3", "coffee 12", "enqueue").await;
    assert_eq!(second["turn"]["position"], 1);
    assert_eq!(third["turn"]["position"], 2);
    assert_eq!(third["turn"]["client_request_id"], "m3");
    let third_id = third["turn"]["turn_id"].as_str().unwrap().to_owned();

    // The page's data: the queued messages in the transcript, in order, with
    // their positions.
    let transcript = app.transcript("quinn", "s1").await.unwrap();
    let turns: Vec<(&str, &str)> = transcript["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["user_text"].as_str().unwrap(),
                t["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        turns,
        [
            ("lunch 35", "running"),
            ("taxi 18", "queued"),
            ("coffee 12", "queued")
        ]
    );
    let positions: Vec<(&str, u64)> = transcript["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            (
                q["client_request_id"].as_str().unwrap(),
                q["position"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(positions, [("m2", 1), ("m3", 2)]);

    // The dashboard lists the session's queue behind its holder.
    let (_, dashboard) = app.get("/app/dashboard").await.unwrap();
    let queues = dashboard["queues"].as_array().unwrap();
    assert_eq!(queues.len(), 1, "{dashboard}");
    assert_eq!(queues[0]["session_id"], "s1");
    assert_eq!(queues[0]["holder_turn_id"], dashboard["live"][0]["turn_id"]);
    let queued: Vec<&str> = queues[0]["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["client_request_id"].as_str().unwrap())
        .collect();
    assert_eq!(queued, ["m2", "m3"]);

    // Cancel: another user's cancel finds nothing; the owner's ends it at
    // once, never having run.
    let client = server.client();
    client
        .post(
            &format!("/app/stop?user_id=mallory&turn_id={third_id}"),
            None,
            &json!({}),
        )
        .await
        .expect(404, "not_found");
    let cancelled = client
        .post(
            &format!("/app/stop?user_id=quinn&turn_id={third_id}"),
            None,
            &json!({}),
        )
        .await;
    assert_eq!(cancelled.status, 200, "{}", cancelled.text);
    assert_eq!(cancelled.body["state"], "cancelled");
    assert_eq!(cancelled.body["attempt"], 0);

    // The first message's stream ends with its own reply, not the queue's.
    let events = stream.rest().await.unwrap();
    let last_event = events.last().unwrap();
    assert_eq!(last_event.0, "final", "{events:?}");
    assert_eq!(last_event.1["outcome"]["client_request_id"], "m1");

    // The handoff runs the second message with no page streaming it,
    // counted as a live turn of this node while it runs.
    let deadline = Instant::now() + TURN_DEADLINE;
    loop {
        let transcript = app.transcript("quinn", "s1").await.unwrap();
        let (_, dashboard) = app.get("/app/dashboard").await.unwrap();
        let second_state = transcript["turns"][1]["state"].clone();
        assert_ne!(second_state, "succeeded", "never seen live: {dashboard}");
        if second_state == "running" && dashboard["counters"]["live_turns"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{transcript}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let transcript = until_state(&app, "quinn", "m2", "succeeded").await;
    let states: Vec<&str> = transcript["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["succeeded", "succeeded", "cancelled"]);
    assert_eq!(transcript["turns"][2]["attempt"], 0);
    assert_eq!(transcript["queue"], json!([]));
    let mut amounts: Vec<i64> = app
        .entries("quinn")
        .await
        .unwrap()
        .iter()
        .map(|e| e["amount_cents"].as_i64().unwrap())
        .collect();
    amounts.sort_unstable();
    assert_eq!(amounts, [1800, 3500], "the cancelled message never booked");
    // And it ended: nothing is counted live any more.
    let deadline = Instant::now() + TURN_DEADLINE;
    loop {
        let (_, dashboard) = app.get("/app/dashboard").await.unwrap();
        let counters = &dashboard["counters"];
        if counters["turn_endings"]["succeeded"] == 2 {
            assert_eq!(counters["live_turns"], 0, "{counters}");
            break;
        }
        assert!(Instant::now() < deadline, "{counters}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = server.client().get("/metrics").await.text;
    assert!(
        metrics.contains("agentgate_begins_total{outcome=\"queued\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("agentgate_begins_total{outcome=\"handoff\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_full_queue_is_refused_429_queue_full_before_any_stream() {
    let dir = scratch();
    // A reply long enough to queue a full queue behind it.
    let server = Server::start(dir.path(), &["--think-time-ms", "5000"]);
    let app = AppClient::new(&server.base);
    let _stream = open_stream(&app, &AppClient::message("rhea", "s1", "m0", "lunch 35")).await;
    let limit = agentgate::limits::MAX_SESSION_QUEUE;
    for n in 1..=limit {
        let queued = enqueue(
            &app,
            "rhea",
            &format!("m{n}"),
            &format!("taxi {n}"),
            "enqueue",
        )
        .await;
        assert_eq!(queued["turn"]["position"], n);
    }
    let mut body = AppClient::message("rhea", "s1", "over", "coffee 12");
    body["on_busy"] = json!("enqueue");
    let Opened::Refused(full) = app.open("/app/messages", &body).await.unwrap() else {
        panic!("a full queue opens no stream");
    };
    assert_eq!(full.refusal(), (429, "queue_full"));
    let app_client::Sent::Refused { retry_after, .. } = full else {
        unreachable!()
    };
    assert!(retry_after.unwrap() >= 1);
    let transcript = app.transcript("rhea", "s1").await.unwrap();
    assert_eq!(
        transcript["queue"].as_array().unwrap().len(),
        limit as usize
    );
    assert!(
        transcript["turns"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["user_text"] != "coffee 12"),
        "the refused message is not recorded"
    );
}

#[tokio::test]
async fn keys_no_app_and_bad_input() {
    let dir = scratch();
    let key = "app-test-key-0123456789";
    let keyed = Server::start(dir.path(), &["--api-key", key]);
    let client = keyed.client();
    client.get("/").await.expect(200, "");
    client
        .get("/app/sessions?user_id=a")
        .await
        .expect(401, "unauthorized");
    client
        .with_key(key)
        .get("/app/sessions?user_id=a")
        .await
        .expect(200, "");
    drop(keyed);

    let plain = scratch();
    let server = Server::start(plain.path(), &["--no-app"]);
    let client = server.client();
    client.get("/").await.expect(404, "not_found");
    client.get("/dashboard").await.expect(404, "not_found");
    client
        .get("/app/sessions?user_id=a")
        .await
        .expect(404, "not_found");
    client.get("/healthz").await.expect(200, "");
    drop(server);

    let dir = scratch();
    let server = Server::start(dir.path(), &["--think-time-ms", "0"]);
    let client = server.client();
    let long = "x".repeat(129);
    for (body, what) in [
        (
            json!({"user_id": "a", "session_id": "s", "client_request_id": "m", "text": "  "}),
            "empty text",
        ),
        (
            json!({"user_id": "a", "session_id": long, "client_request_id": "m", "text": "taxi 1"}),
            "long session id",
        ),
        (
            json!({"user_id": "a", "session_id": "s", "client_request_id": "m", "text": "taxi 1", "extra": 1}),
            "unknown field",
        ),
        (
            json!({"user_id": "a", "session_id": "s", "text": "taxi 1"}),
            "missing request id",
        ),
        (
            json!({"user_id": "a", "session_id": "s", "client_request_id": "m", "text": "x".repeat(2001)}),
            "text over the limit",
        ),
    ] {
        let reply = client.post("/app/messages", None, &body).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{what}: {}",
            reply.text
        );
    }
    let bad_confirm = json!({"user_id": "a", "session_id": "s", "client_request_id": "c", "turn_id": "turn_nope", "decision": "maybe"});
    client
        .post("/app/confirmations", None, &bad_confirm)
        .await
        .expect(400, "invalid_request");
    let no_pending = json!({"user_id": "a", "session_id": "s", "client_request_id": "c", "turn_id": "turn_nope", "decision": "approve"});
    client
        .post("/app/confirmations", None, &no_pending)
        .await
        .expect(404, "not_found");
    client
        .get("/app/ledger")
        .await
        .expect(400, "invalid_request");
    client
        .get(&format!("/app/ledger?user_id={long}"))
        .await
        .expect(400, "invalid_request");
}

#[test]
fn help_lists_the_app_flags_with_their_env() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_agentgate"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--model",
        "AGENTGATE_MODEL",
        "--model-url",
        "AGENTGATE_MODEL_URL",
        "--model-name",
        "AGENTGATE_MODEL_NAME",
        "--think-time-ms",
        "AGENTGATE_THINK_TIME_MS",
        "--confirm-threshold",
        "AGENTGATE_CONFIRM_THRESHOLD",
        "--on-disconnect",
        "AGENTGATE_ON_DISCONNECT",
        "--no-app",
        "offline",
        "finish",
    ] {
        assert!(help.contains(flag), "help lacks {flag}:\n{help}");
    }
    let dir = scratch();
    let store = format!("sqlite://{}", dir.path().join("x.db").display());
    for (extra, message) in [
        (&["--model", "openai"][..], "--model-url"),
        (
            &[
                "--model",
                "openai",
                "--model-url",
                "ftp://x",
                "--model-name",
                "m",
            ][..],
            "http",
        ),
        (&["--think-time-ms", "600000"][..], "think time"),
        (&["--confirm-threshold", "999999999999"][..], "threshold"),
        (&["--on-disconnect", "later"][..], "later"),
    ] {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--store", &store];
        args.extend_from_slice(extra);
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_agentgate"))
            .args(&args)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{extra:?} must fail");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
}
