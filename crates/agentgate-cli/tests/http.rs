//! Black-box tests of `agentgate serve` (docs/protocol.md §10): the real binary on a free
//! port with a temp SQLite store, attacked over HTTP by many concurrent
//! clients. Every test asserts the refusal side as well as the success side.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{lease, scratch, storm, tally, Server};

/// Concurrent clients in each storm.
const STORM: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_storm_starts_one_turn_then_everyone_replays() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let payload = json!({"text": "taxi 18 yesterday"});

    let replies = storm(STORM, |_| {
        let (client, payload) = (client.clone(), payload.clone());
        async move { client.begin("alice", "chat-1", "msg-1", &payload).await }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "request_in_flight".to_owned())),
        Some(&(STORM - 1)),
        "{counts:?}"
    );
    let winner = replies.iter().find(|r| r.status == 201).unwrap();
    let (turn_id, token) = lease(winner);
    let turn = &winner.body["turn"];
    assert_eq!(turn["state"], "running");
    assert_eq!(turn["attempt"], 1);
    assert_eq!(turn["takeover"], false);
    assert_eq!(turn["user_id"], "alice");
    assert_eq!(turn["session_id"], "chat-1");
    assert_eq!(turn["client_request_id"], "msg-1");
    assert!(turn["fence"].as_i64().unwrap() > 0);
    assert!(turn["lease_expires_in_ms"].as_i64().unwrap() > 0);
    for reply in replies.into_iter().filter(|r| r.status == 409) {
        let reply = reply.expect_retry_after();
        assert_eq!(reply.body["error"]["active_turn_id"], turn_id.as_str());
    }

    let response = json!({"text": "booked 18 to transport"});
    let done = client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&token),
            &json!({ "response": response }),
        )
        .await
        .expect(200, "");
    assert_eq!(done.body["turn"]["state"], "succeeded");
    assert_eq!(done.body["turn"]["response"], response);

    let replays = storm(STORM, |_| {
        let (client, payload) = (client.clone(), payload.clone());
        async move { client.begin("alice", "chat-1", "msg-1", &payload).await }
    })
    .await;
    for reply in replays {
        let reply = reply.expect(200, "");
        assert_eq!(reply.body["replay"], true);
        assert_eq!(reply.body["turn"]["turn_id"], turn_id.as_str());
        assert_eq!(reply.body["turn"]["state"], "succeeded");
        assert_eq!(reply.body["turn"]["response"], response);
        assert!(reply.body["turn"].get("lease_token").is_none());
    }
    let user = client.get("/v1/users/alice").await.expect(200, "");
    assert_eq!(user.body["user"]["live_turns"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_storm_admits_one_turn() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let replies = storm(STORM, |i| {
        let client = client.clone();
        async move {
            client
                .begin("bob", "chat-1", &format!("msg-{i}"), &json!({"n": i}))
                .await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "session_busy".to_owned())),
        Some(&(STORM - 1)),
        "{counts:?}"
    );
    let (turn_id, _) = lease(replies.iter().find(|r| r.status == 201).unwrap());
    for reply in replies.into_iter().filter(|r| r.status == 409) {
        let reply = reply.expect_retry_after();
        assert_eq!(reply.body["error"]["active_turn_id"], turn_id.as_str());
    }
    let session = client.get("/v1/sessions/chat-1").await.expect(200, "");
    assert_eq!(
        session.body["session"]["holder"]["turn_id"],
        turn_id.as_str()
    );
    assert!(!session.text.contains("lease_token"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_user_cap_admits_five_of_ten() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--max-turns-per-user", "5"]);
    let client = server.client();
    let replies = storm(10, |i| {
        let client = client.clone();
        async move {
            client
                .begin("carol", &format!("chat-{i}"), "msg-1", &json!({}))
                .await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&5), "{counts:?}");
    assert_eq!(
        counts.get(&(429, "user_at_capacity".to_owned())),
        Some(&5),
        "{counts:?}"
    );
    for reply in replies.iter().filter(|r| r.status == 429) {
        reply.clone().expect_retry_after();
    }
    let user = client.get("/v1/users/carol").await.expect(200, "");
    assert_eq!(user.body["user"]["live_turns"], 5);
    assert_eq!(user.body["user"]["max_turns_per_user"], 5);
    assert!(!user.text.contains("lease_token"));

    // Ending one turn frees one permit: exactly one refused session gets in.
    let (turn_id, token) = lease(replies.iter().find(|r| r.status == 201).unwrap());
    client
        .post(
            &format!("/v1/turns/{turn_id}/fail"),
            Some(&token),
            &json!({"error": "cancelled"}),
        )
        .await
        .expect(200, "");
    let refused: Vec<usize> = (0..10).filter(|i| replies[*i].status == 429).collect();
    client
        .begin(
            "carol",
            &format!("chat-{}", refused[0]),
            "msg-1",
            &json!({}),
        )
        .await
        .expect(201, "");
    client
        .begin(
            "carol",
            &format!("chat-{}", refused[1]),
            "msg-1",
            &json!({}),
        )
        .await
        .expect(429, "user_at_capacity");
    // Another user is not affected.
    client
        .begin("dave", "chat-d", "msg-1", &json!({}))
        .await
        .expect(201, "");
}

/// Three spellings of the same args: key order, whitespace, number spelling.
const SAME_ARGS: [&str; 3] = [
    r#"{"amount":18,"category":"transport","note":"taxi"}"#,
    r#"{"note":"taxi","category":"transport","amount":1.8e1}"#,
    r#"{ "category" : "transport" , "amount" : 18.0, "note": "taxi" }"#,
];

fn tool_body(args: &str) -> String {
    format!(r#"{{"tool":"create_transaction","args":{args}}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tool_storm_with_reordered_args_runs_the_tool_once() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, token) = lease(&client.begin("erin", "chat-1", "msg-1", &json!({})).await);
    let tools = format!("/v1/turns/{turn_id}/tools");

    let replies = storm(30, |i| {
        let (client, tools, token) = (client.clone(), tools.clone(), token.clone());
        async move {
            client
                .post_raw(
                    &tools,
                    Some(&token),
                    tool_body(SAME_ARGS[i % SAME_ARGS.len()]),
                )
                .await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "tool_in_flight".to_owned())),
        Some(&29),
        "{counts:?}"
    );
    for reply in replies.iter().filter(|r| r.status == 409) {
        reply.clone().expect_retry_after();
    }
    let claim = replies.iter().find(|r| r.status == 201).unwrap();
    assert_eq!(claim.body["execute"], true);
    let execution = &claim.body["execution"];
    // Each refusal names the execution it ran into: the one claim's.
    for reply in replies.iter().filter(|r| r.status == 409) {
        assert_eq!(
            reply.body["error"]["execution_id"], execution["execution_id"],
            "{}",
            reply.body
        );
        assert_eq!(reply.body["error"]["attempt"], 1, "{}", reply.body);
    }
    assert_eq!(execution["attempt"], 1);
    assert_eq!(execution["previous_outcome"], Value::Null);
    assert!(execution["idempotency_key"].as_str().unwrap().len() > 8);
    let execution_id = execution["execution_id"].as_str().unwrap().to_owned();

    let result = json!({"entry_id": 7, "amount": 18});
    let done = client
        .post(
            &format!("{tools}/{execution_id}/complete"),
            Some(&token),
            &json!({ "result": result }),
        )
        .await
        .expect(200, "");
    assert_eq!(done.body["execution"]["state"], "succeeded");
    assert_eq!(done.body["execution"]["result"], result);
    // Completing twice is refused: the execution already ended.
    client
        .post(
            &format!("{tools}/{execution_id}/complete"),
            Some(&token),
            &json!({"result": {"entry_id": 8}}),
        )
        .await
        .expect(409, "lease_lost");

    for args in SAME_ARGS {
        let cached = client
            .post_raw(&tools, Some(&token), tool_body(args))
            .await
            .expect(200, "");
        assert_eq!(cached.body["execute"], false);
        assert_eq!(
            cached.body["execution"]["execution_id"],
            execution_id.as_str()
        );
        assert_eq!(cached.body["execution"]["state"], "succeeded");
        assert_eq!(cached.body["execution"]["result"], result);
    }
    // Different args are a different execution.
    let other = client
        .post_raw(
            &tools,
            Some(&token),
            tool_body(r#"{"amount":19,"category":"transport","note":"taxi"}"#),
        )
        .await
        .expect(201, "");
    assert_ne!(
        other.body["execution"]["execution_id"],
        execution_id.as_str()
    );
    // A failed execution is handed out again with previous_outcome failed.
    let other_id = other.body["execution"]["execution_id"]
        .as_str()
        .unwrap()
        .to_owned();
    client
        .post(
            &format!("{tools}/{other_id}/fail"),
            Some(&token),
            &json!({"error": "bank timeout"}),
        )
        .await
        .expect(200, "");
    let again = client
        .post_raw(
            &tools,
            Some(&token),
            tool_body(r#"{"note":"taxi","amount":19,"category":"transport"}"#),
        )
        .await
        .expect(201, "");
    assert_eq!(again.body["execution"]["previous_outcome"], "failed");
    assert_eq!(again.body["execution"]["attempt"], 2);

    let view = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(view.body["executions"].as_array().unwrap().len(), 2);
    assert!(!view.text.contains(&token));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_payload_mismatch() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let payload = json!({"text": "lunch 35", "amount": 35});
    let (turn_id, token) = lease(&client.begin("frank", "chat-1", "msg-1", &payload).await);

    // While running: the same payload conflicts, another one mismatches.
    client
        .begin("frank", "chat-1", "msg-1", &payload)
        .await
        .expect(409, "request_in_flight")
        .expect_retry_after();
    client
        .begin("frank", "chat-1", "msg-1", &json!({"text": "lunch 36"}))
        .await
        .expect(422, "payload_mismatch");

    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&token),
            &json!({"response": {"text": "booked"}}),
        )
        .await
        .expect(200, "");
    // The same payload in another spelling replays; another payload does not.
    let raw = r#"{"client_request_id":"msg-1","payload":{"amount":3.5e1,"text":"lunch 35"},"session_id":"chat-1","user_id":"frank"}"#;
    let replay = client
        .post_raw("/v1/turns", None, raw)
        .await
        .expect(200, "");
    assert_eq!(replay.body["replay"], true);
    assert_eq!(replay.body["turn"]["response"], json!({"text": "booked"}));
    client
        .begin("frank", "chat-1", "msg-1", &json!({"text": "lunch 36"}))
        .await
        .expect(422, "payload_mismatch");

    // A retryable failure restarts on repeat; a final one replays the failure.
    let (turn_id, token) = lease(&client.begin("frank", "chat-1", "msg-2", &json!(2)).await);
    client
        .post(
            &format!("/v1/turns/{turn_id}/fail"),
            Some(&token),
            &json!({"error": "model timeout", "retryable": true}),
        )
        .await
        .expect(200, "");
    let restart = client
        .begin("frank", "chat-1", "msg-2", &json!(2))
        .await
        .expect(201, "");
    assert_eq!(restart.body["turn"]["attempt"], 2);
    assert_eq!(restart.body["turn"]["takeover"], false);
    let (turn_id, token) = lease(&restart);
    let failed = client
        .post(
            &format!("/v1/turns/{turn_id}/fail"),
            Some(&token),
            &json!({"error": "bad input"}),
        )
        .await
        .expect(200, "");
    assert_eq!(failed.body["turn"]["state"], "failed");
    let replay = client
        .begin("frank", "chat-1", "msg-2", &json!(2))
        .await
        .expect(200, "");
    assert_eq!(replay.body["turn"]["state"], "failed");
    assert_eq!(replay.body["turn"]["error"], "bad input");
}

/// A cancel over HTTP, as a page's stop button sends it: no lease token,
/// idempotent, checked against the owner; the holder learns it on its
/// heartbeat and tool claim, ends the turn `cancelled` with its partial
/// answer, and a repeat of the request replays that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_over_http_is_learned_by_the_holder_and_replayed() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, token) = lease(&client.begin("gina", "chat-c", "msg-1", &json!("hi")).await);
    let cancel = format!("/v1/turns/{turn_id}/cancel");
    let heartbeat = format!("/v1/turns/{turn_id}/heartbeat");
    let beat = client
        .post(&heartbeat, Some(&token), &json!({}))
        .await
        .expect(200, "");
    assert_eq!(beat.body["cancel_requested"], false);
    // Another user's turn is not found, and nothing is written.
    client
        .post(&format!("{cancel}?user_id=mallory"), None, &json!({}))
        .await
        .expect(404, "not_found");
    let beat = client
        .post(&heartbeat, Some(&token), &json!({}))
        .await
        .expect(200, "");
    assert_eq!(beat.body["cancel_requested"], false);
    let first = client
        .post(&format!("{cancel}?user_id=gina"), None, &json!({}))
        .await
        .expect(200, "");
    assert_eq!(first.body["turn"]["state"], "running");
    let at = first.body["turn"]["cancel_requested_at_ms"]
        .as_i64()
        .expect("recorded");
    let second = client.post(&cancel, None, &json!({})).await.expect(200, "");
    assert_eq!(
        second.body["turn"]["cancel_requested_at_ms"], at,
        "idempotent"
    );
    let beat = client
        .post(&heartbeat, Some(&token), &json!({}))
        .await
        .expect(200, "");
    assert_eq!(beat.body["cancel_requested"], true);
    client
        .post(
            &format!("/v1/turns/{turn_id}/tools"),
            Some(&token),
            &json!({"tool": "book", "args": {"amount": 1}}),
        )
        .await
        .expect(409, "turn_cancelled");
    // The holder's ending needs its lease; a wrong token changes nothing.
    let end = format!("/v1/turns/{turn_id}/end-cancelled");
    client
        .post(
            &end,
            Some("lt_wrong_token_wrong_token_wrong"),
            &json!({"partial": "x"}),
        )
        .await
        .expect(409, "lease_lost");
    let ended = client
        .post(
            &end,
            Some(&token),
            &json!({"partial": {"text": "I was saying"}}),
        )
        .await
        .expect(200, "");
    assert_eq!(ended.body["turn"]["state"], "cancelled");
    client
        .post(&heartbeat, Some(&token), &json!({}))
        .await
        .expect(409, "lease_lost");
    let after = client.post(&cancel, None, &json!({})).await.expect(200, "");
    assert_eq!(after.body["turn"]["state"], "cancelled");
    let replay = client
        .begin("gina", "chat-c", "msg-1", &json!("hi"))
        .await
        .expect(200, "");
    assert_eq!(replay.body["turn"]["state"], "cancelled");
    assert_eq!(
        replay.body["turn"]["response"],
        json!({"text": "I was saying"})
    );
    client
        .post("/v1/turns/turn_nope/cancel", None, &json!({}))
        .await
        .expect(404, "not_found");
    // The session is free for the next message.
    client
        .begin("gina", "chat-c", "msg-2", &json!("next"))
        .await
        .expect(201, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_and_missing_lease_tokens() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, token) = lease(&client.begin("gina", "chat-1", "msg-1", &json!({})).await);
    let heartbeat = format!("/v1/turns/{turn_id}/heartbeat");
    let wrong = "lt_0000000000000000000000000000000000000000000000000000000000000000";

    client
        .post(&heartbeat, None, &json!({}))
        .await
        .expect(400, "invalid_request");
    client
        .post(&heartbeat, Some(wrong), &json!({}))
        .await
        .expect(409, "lease_lost");
    client
        .post(&heartbeat, Some(&"x".repeat(4096)), &json!({}))
        .await
        .expect(400, "invalid_request");
    let beat = client
        .post_raw(&heartbeat, Some(&token), "")
        .await
        .expect(200, "");
    assert!(beat.body["lease_expires_in_ms"].as_i64().unwrap() > 0);

    let tools = format!("/v1/turns/{turn_id}/tools");
    let call = json!({"tool": "send_email", "args": {"to": "a@example.com"}});
    client
        .post(&tools, None, &call)
        .await
        .expect(400, "invalid_request");
    client
        .post(&tools, Some(wrong), &call)
        .await
        .expect(409, "lease_lost");
    for ending in ["complete", "fail", "await-confirmation"] {
        let body = json!({"response": 1, "error": 1, "pending": 1});
        let body = match ending {
            "complete" => json!({"response": body["response"]}),
            "fail" => json!({"error": body["error"]}),
            _ => json!({"pending": body["pending"]}),
        };
        let path = format!("/v1/turns/{turn_id}/{ending}");
        client
            .post(&path, None, &body)
            .await
            .expect(400, "invalid_request");
        client
            .post(&path, Some(wrong), &body)
            .await
            .expect(409, "lease_lost");
    }
    // Another turn's token is just as wrong.
    let (_, other_token) = lease(&client.begin("gina", "chat-2", "msg-1", &json!({})).await);
    client
        .post(&heartbeat, Some(&other_token), &json!({}))
        .await
        .expect(409, "lease_lost");

    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&token),
            &json!({"response": "done"}),
        )
        .await
        .expect(200, "");
    // After the ending the token changes nothing.
    client
        .post(&heartbeat, Some(&token), &json!({}))
        .await
        .expect(409, "lease_lost");
    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&token),
            &json!({"response": "again"}),
        )
        .await
        .expect(409, "lease_lost");
    client
        .post(&tools, Some(&token), &call)
        .await
        .expect(409, "lease_lost");
    // An unknown turn is not found.
    client
        .post("/v1/turns/turn_nope/heartbeat", Some(&token), &json!({}))
        .await
        .expect(404, "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_400_413_404_never_500() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let begin = |body: &str| {
        let (client, body) = (client.clone(), body.to_owned());
        async move { client.post_raw("/v1/turns", None, body).await }
    };
    for body in [
        "",
        "{",
        "not json",
        "[]",
        "null",
        r#"{"user_id":"u","session_id":"s"}"#,
        r#"{"user_id":"u","client_request_id":"r"}"#,
        r#"{"user_id":5,"session_id":"s","client_request_id":"r"}"#,
        r#"{"user_id":"","session_id":"s","client_request_id":"r"}"#,
        r#"{"user_id":"u","session_id":"s","client_request_id":"r","surprise":1}"#,
        r#"{"user_id":"u","session_id":"s","client_request_id":"r","confirmation":{"turn_id":"t","decision":"maybe"}}"#,
        "{\"user_id\":\"u\\u0000\",\"session_id\":\"s\",\"client_request_id\":\"r\"}",
    ] {
        begin(body).await.expect(400, "invalid_request");
    }
    // Ids of several KB, in the body and in the path.
    let long = "x".repeat(5000);
    for field in ["user_id", "session_id", "client_request_id"] {
        let mut body = json!({"user_id": "u", "session_id": "s", "client_request_id": "r"});
        body[field] = json!(long);
        let reply = client
            .post("/v1/turns", None, &body)
            .await
            .expect(400, "invalid_request");
        assert!(reply.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(field));
        assert!(reply.text.len() < 2000, "the long id is not echoed back");
    }
    client
        .get(&format!("/v1/turns/{long}"))
        .await
        .expect(400, "invalid_request");
    client
        .get(&format!("/v1/sessions/{long}"))
        .await
        .expect(400, "invalid_request");

    // A body of several MiB is refused before it is parsed.
    let huge = format!(
        r#"{{"user_id":"u","session_id":"s","client_request_id":"r","payload":"{}"}}"#,
        "a".repeat(3 * 1024 * 1024)
    );
    begin(&huge).await.expect(413, "payload_too_large");
    // A payload over the engine's JSON depth limit is refused as input.
    let deep = format!("{}1{}", "[".repeat(100), "]".repeat(100));
    begin(&format!(
        r#"{{"user_id":"u","session_id":"s","client_request_id":"r","payload":{deep}}}"#
    ))
    .await
    .expect(400, "invalid_request");

    // Missing fields after begin.
    let (turn_id, token) = lease(&client.begin("hank", "chat-1", "msg-1", &json!({})).await);
    let tools = format!("/v1/turns/{turn_id}/tools");
    for body in [
        r#"{"tool":"t"}"#,
        r#"{"args":{}}"#,
        r#"{"tool":"","args":{}}"#,
    ] {
        client
            .post_raw(&tools, Some(&token), body)
            .await
            .expect(400, "invalid_request");
    }
    client
        .post_raw(&format!("/v1/turns/{turn_id}/complete"), Some(&token), "{}")
        .await
        .expect(400, "invalid_request");
    client
        .post(
            &format!("{tools}/exec_nope/complete"),
            Some(&token),
            &json!({"result": 1}),
        )
        .await
        .expect(404, "not_found");

    // Unknown records, other users' records, unknown routes and methods.
    client
        .get("/v1/turns/turn_nope")
        .await
        .expect(404, "not_found");
    client
        .get("/v1/sessions/nope")
        .await
        .expect(404, "not_found");
    client
        .get("/v1/sessions/chat-1?user_id=hank")
        .await
        .expect(200, "");
    client
        .get("/v1/sessions/chat-1?user_id=ivan")
        .await
        .expect(404, "not_found");
    client
        .get(&format!("/v1/turns/{turn_id}?user_id=hank"))
        .await
        .expect(200, "");
    client
        .get(&format!("/v1/turns/{turn_id}?user_id=ivan"))
        .await
        .expect(404, "not_found");
    client
        .get("/v1/users/hank?user_id=ivan")
        .await
        .expect(404, "not_found");
    client
        .begin("ivan", "chat-1", "msg-9", &json!({}))
        .await
        .expect(404, "not_found");
    client.get("/v1/nope").await.expect(404, "not_found");
    client
        .get("/v1/turns")
        .await
        .expect(405, "method_not_allowed");
    // JSON must say so: a page elsewhere can make a browser send text/plain
    // (or no type) without asking first, never application/json.
    for content_type in [Some("text/plain"), None] {
        let mut request = reqwest::Client::new()
            .post(format!("{}/v1/turns", server.base))
            .body(r#"{"user_id":"jo","session_id":"s-jo","client_request_id":"r"}"#);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        let reply = request.send().await.unwrap();
        assert_eq!(reply.status().as_u16(), 415, "{content_type:?}");
    }
    client
        .begin("jo", "s-jo", "r", &json!({}))
        .await
        .expect(201, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_v1_but_not_healthz() {
    let dir = scratch();
    let key_file = dir.path().join("keys");
    std::fs::write(&key_file, "# ops\nfile-key-0123456789abcdef\n").unwrap();
    let server = Server::start_with_env(
        dir.path(),
        &["--api-key", "flag-key-0123456789abcdef"],
        &[("AGENTGATE_API_KEY_FILE", key_file.to_str().unwrap())],
    );
    let anonymous = server.client();
    let wrong = anonymous.with_key("flag-key-0123456789abcdeX");
    let flagged = anonymous.with_key("flag-key-0123456789abcdef");
    let filed = anonymous.with_key("file-key-0123456789abcdef");

    let reply = anonymous
        .begin("kim", "chat-1", "msg-1", &json!({}))
        .await
        .expect(401, "unauthorized");
    assert_eq!(reply.headers["www-authenticate"], "Bearer");
    wrong
        .begin("kim", "chat-1", "msg-1", &json!({}))
        .await
        .expect(401, "unauthorized");
    anonymous
        .get("/v1/users/kim")
        .await
        .expect(401, "unauthorized");
    let (turn_id, token) = lease(&flagged.begin("kim", "chat-1", "msg-1", &json!({})).await);
    anonymous
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(401, "unauthorized");
    filed
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(200, "");
    filed.get("/v1/users/kim").await.expect(200, "");

    let health = anonymous.get("/healthz").await.expect(200, "");
    assert_eq!(health.body["status"], "ok");
    anonymous.get("/metrics").await.expect(200, "");
    anonymous.get("/openapi.json").await.expect(200, "");

    // Neither keys nor lease tokens reach the logs (debug level included).
    let logs = server.logs();
    assert!(logs.contains("turn started"), "the server logged: {logs}");
    for secret in [
        "flag-key-0123456789abcdef",
        "file-key-0123456789abcdef",
        token.as_str(),
    ] {
        assert!(!logs.contains(secret), "a secret was logged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmation_round_trip() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, token) = lease(
        &client
            .begin("lee", "chat-1", "msg-1", &json!("spend 900"))
            .await,
    );
    let pending = json!({"action": "create_transaction", "amount": 900});
    let waiting = client
        .post(
            &format!("/v1/turns/{turn_id}/await-confirmation"),
            Some(&token),
            &json!({ "pending": pending }),
        )
        .await
        .expect(200, "");
    assert_eq!(waiting.body["turn"]["state"], "awaiting_confirmation");

    let blocked = client
        .begin("lee", "chat-1", "msg-2", &json!("hello?"))
        .await
        .expect(409, "awaiting_confirmation")
        .expect_retry_after();
    assert_eq!(blocked.body["error"]["active_turn_id"], turn_id.as_str());
    let session = client.get("/v1/sessions/chat-1").await.expect(200, "");
    assert_eq!(
        session.body["session"]["pending_confirmation"]["turn_id"],
        turn_id.as_str()
    );

    let confirm = json!({
        "user_id": "lee", "session_id": "chat-1", "client_request_id": "confirm-1",
        "confirmation": {"turn_id": turn_id, "decision": "approve"},
    });
    let started = client
        .post("/v1/turns", None, &confirm)
        .await
        .expect(201, "");
    let context = &started.body["turn"]["confirmation"];
    assert_eq!(context["turn_id"], turn_id.as_str());
    assert_eq!(context["decision"], "approve");
    assert_eq!(context["pending"], pending);
    client
        .post("/v1/turns", None, &confirm)
        .await
        .expect(409, "request_in_flight");
    let (next_id, next_token) = lease(&started);
    client
        .post(
            &format!("/v1/turns/{next_id}/complete"),
            Some(&next_token),
            &json!({"response": "booked 900"}),
        )
        .await
        .expect(200, "");
    let replay = client
        .post("/v1/turns", None, &confirm)
        .await
        .expect(200, "");
    assert_eq!(replay.body["turn"]["turn_id"], next_id.as_str());
    // Confirming a turn that awaits nothing is not found.
    let mut bogus = confirm.clone();
    bogus["client_request_id"] = json!("confirm-2");
    bogus["confirmation"]["turn_id"] = json!("turn_nope");
    client
        .post("/v1/turns", None, &bogus)
        .await
        .expect(404, "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_then_takeover_with_unknown_tool_outcome() {
    const TTL_MS: u64 = 1500;
    let dir = scratch();
    let mut server = Server::start(dir.path(), &["--lease-ttl-ms", &TTL_MS.to_string()]);
    let client = server.client();
    let payload = json!({"text": "pay rent 1200"});
    let first = client.begin("mia", "chat-1", "msg-1", &payload).await;
    let (turn_id, old_token) = lease(&first);
    let old_fence = first.body["turn"]["fence"].as_i64().unwrap();
    let tools = format!("/v1/turns/{turn_id}/tools");
    let call = json!({"tool": "pay", "args": {"amount": 1200, "to": "landlord"}});
    let claimed = client
        .post(&tools, Some(&old_token), &call)
        .await
        .expect(201, "");
    let execution_id = claimed.body["execution"]["execution_id"].clone();
    let key = claimed.body["execution"]["idempotency_key"].clone();
    client
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&old_token),
            &json!({}),
        )
        .await
        .expect(200, "");

    server.kill();
    let server = server.restart();
    let client = server.client();

    // The dead holder's lease is still live: the repeat is in flight.
    let in_flight = client
        .begin("mia", "chat-1", "msg-1", &payload)
        .await
        .expect(409, "request_in_flight")
        .expect_retry_after();
    assert_eq!(in_flight.body["error"]["active_turn_id"], turn_id.as_str());
    // Wait as a client would: for the advertised time, then retry (bounded).
    let mut takeover = in_flight;
    for _ in 0..10 {
        if takeover.status == 201 {
            break;
        }
        let wait_ms = takeover.body["error"]["retry_after_ms"].as_u64().unwrap();
        assert!(wait_ms <= TTL_MS, "never asked to wait longer than a TTL");
        tokio::time::sleep(Duration::from_millis(wait_ms + 50)).await;
        takeover = client.begin("mia", "chat-1", "msg-1", &payload).await;
    }
    let takeover = takeover.expect(201, "");
    let turn = &takeover.body["turn"];
    assert_eq!(turn["turn_id"], turn_id.as_str());
    assert_eq!(turn["takeover"], true);
    assert_eq!(turn["attempt"], 2);
    assert!(turn["fence"].as_i64().unwrap() > old_fence);
    let (_, new_token) = lease(&takeover);
    assert_ne!(new_token, old_token);

    // The old holder can change nothing.
    client
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&old_token),
            &json!({}),
        )
        .await
        .expect(409, "lease_lost");
    client
        .post(
            &format!("{tools}/{}/complete", execution_id.as_str().unwrap()),
            Some(&old_token),
            &json!({"result": "paid"}),
        )
        .await
        .expect(409, "lease_lost");
    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&old_token),
            &json!({"response": 1}),
        )
        .await
        .expect(409, "lease_lost");

    // The interrupted tool is handed out again, flagged unknown.
    let reclaimed = client
        .post(&tools, Some(&new_token), &call)
        .await
        .expect(201, "");
    let execution = &reclaimed.body["execution"];
    assert_eq!(execution["previous_outcome"], "unknown");
    assert_eq!(execution["attempt"], 2);
    assert_eq!(execution["execution_id"], execution_id);
    assert_eq!(execution["idempotency_key"], key);

    let metrics = client.get("/metrics").await.text;
    assert!(metrics.contains("agentgate_takeovers_total 1"), "{metrics}");
    assert!(
        metrics.contains("agentgate_unknown_tool_outcomes_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"agentgate_conflicts_total{code="lease_lost"} 3"#),
        "{metrics}"
    );
    assert!(!server.logs().contains(&new_token));
}

/// A worker that died mid-turn, with nobody retrying its request: a recovery
/// worker claims the orphan over HTTP, gets its payload and tool journal,
/// and resumes it; the dead holder is fenced; a second claim finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_claim_over_http() {
    const TTL_MS: u64 = 1000;
    let dir = scratch();
    let server = Server::start(
        dir.path(),
        &["--lease-ttl-ms", &TTL_MS.to_string(), "--no-app"],
    );
    let client = server.client();
    let payload = json!({"text": "refund 40 to nora"});
    let first = client.begin("nora", "chat-9", "msg-1", &payload).await;
    let (turn_id, old_token) = lease(&first);
    let old_fence = first.body["turn"]["fence"].as_i64().unwrap();
    let tools = format!("/v1/turns/{turn_id}/tools");
    let interrupted = json!({"tool": "refund", "args": {"amount": 40}});
    let done = json!({"tool": "lookup", "args": {"who": "nora"}});
    client
        .post(&tools, Some(&old_token), &interrupted)
        .await
        .expect(201, "");
    let looked = client
        .post(&tools, Some(&old_token), &done)
        .await
        .expect(201, "");
    let lookup_id = looked.body["execution"]["execution_id"]
        .as_str()
        .unwrap()
        .to_owned();
    client
        .post(
            &format!("{tools}/{lookup_id}/complete"),
            Some(&old_token),
            &json!({"result": {"account": 7}}),
        )
        .await
        .expect(200, "");

    // While the lease is live there is no orphan, and the turn is not one.
    client
        .post("/v1/orphans/claim", None, &json!({}))
        .await
        .expect(204, "");
    let view = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(view.body["orphaned"], false);

    // The worker dies (no heartbeat): after the TTL the turn is an orphan.
    tokio::time::sleep(Duration::from_millis(TTL_MS + 200)).await;
    let view = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(view.body["turn"]["state"], "running");
    assert_eq!(view.body["orphaned"], true);
    let metrics = client.get("/metrics").await.text;
    assert!(metrics.contains("agentgate_orphaned_turns 1"), "{metrics}");
    // Filters: bad ones are 400; another user's filter finds nothing.
    client
        .post(
            "/v1/orphans/claim",
            None,
            &json!({"user_ids": ["x".repeat(129)]}),
        )
        .await
        .expect(400, "invalid_request");
    client
        .post("/v1/orphans/claim", None, &json!({"surprise": 1}))
        .await
        .expect(400, "invalid_request");
    client
        .post(
            "/v1/orphans/claim",
            None,
            &json!({"user_ids": ["someone-else"]}),
        )
        .await
        .expect(204, "");

    let claimed = client
        .post("/v1/orphans/claim", None, &json!({"user_ids": ["nora"]}))
        .await
        .expect(201, "");
    let turn = &claimed.body["turn"];
    assert_eq!(turn["turn_id"], turn_id.as_str());
    assert_eq!(turn["takeover"], true);
    assert_eq!(turn["attempt"], 2);
    assert!(turn["fence"].as_i64().unwrap() > old_fence);
    assert_eq!(claimed.body["payload"], payload);
    assert!(claimed.body["orphaned_for_ms"].as_i64().unwrap() >= 0);
    let journal = claimed.body["journal"].as_array().unwrap();
    assert_eq!(journal.len(), 2, "{journal:?}");
    assert_eq!(journal[0]["tool"], "refund");
    assert_eq!(journal[0]["outcome"], "unknown");
    assert_eq!(journal[1]["tool"], "lookup");
    assert_eq!(journal[1]["outcome"], "succeeded");
    assert_eq!(journal[1]["result"], json!({"account": 7}));
    let new_token = turn["lease_token"].as_str().unwrap().to_owned();
    // Nothing else to claim; the dead holder is fenced.
    client
        .post("/v1/orphans/claim", None, &json!({}))
        .await
        .expect(204, "");
    client
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&old_token),
            &json!({}),
        )
        .await
        .expect(409, "lease_lost");
    // The claimant resumes: the interrupted tool comes back as unknown, the
    // completed one is cached; the turn ends once.
    let again = client
        .post(&tools, Some(&new_token), &interrupted)
        .await
        .expect(201, "");
    assert_eq!(again.body["execution"]["previous_outcome"], "unknown");
    let cached = client
        .post(&tools, Some(&new_token), &done)
        .await
        .expect(200, "");
    assert_eq!(cached.body["execution"]["result"], json!({"account": 7}));
    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&new_token),
            &json!({"response": "refunded"}),
        )
        .await
        .expect(200, "");
    let view = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(view.body["orphaned"], false);
    let metrics = client.get("/metrics").await.text;
    assert!(
        metrics.contains(r#"agentgate_begins_total{outcome="orphan_claim"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains("agentgate_orphaned_turns 0"), "{metrics}");
    assert!(metrics.contains("agentgate_turns_abandoned 0"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_openapi_and_health_over_http() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, _) = lease(&client.begin("nia", "chat-1", "msg-1", &json!({})).await);
    client
        .begin("nia", "chat-1", "msg-2", &json!({}))
        .await
        .expect(409, "session_busy");
    client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");

    let metrics = client.get("/metrics").await.expect(200, "");
    let content_type = metrics.headers["content-type"].to_str().unwrap();
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    let text = metrics.text;
    for needle in [
        r#"agentgate_begins_total{outcome="started"} 1"#,
        r#"agentgate_begins_total{outcome="session_busy"} 1"#,
        r#"agentgate_conflicts_total{code="session_busy"} 1"#,
        "agentgate_live_turns 1",
        r#"route="/v1/turns/{turn_id}""#,
        r#"agentgate_http_request_duration_seconds_bucket{method="POST",route="/v1/turns",status="201""#,
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    assert!(!text.contains(&turn_id), "raw ids never become labels");
    assert!(text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .all(|l| l.starts_with("agentgate_")));

    let document = client.get("/openapi.json").await.expect(200, "");
    assert_eq!(document.body["openapi"], "3.1.0");
    assert!(document.body["paths"]["/v1/turns"]["post"].is_object());
    client.get("/healthz").await.expect(200, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serves_with_the_redis_lease_layer() {
    // Skips (printing why) when no Redis answers, unless CI requires it.
    let Some(redis) = agentgate_conformance::targets::redis_url().await else {
        return;
    };
    let dir = scratch();
    let server = Server::start(dir.path(), &["--redis", &redis]);
    let client = server.client();
    let replies = storm(20, |i| {
        let client = client.clone();
        async move {
            client
                .begin("olga", "chat-1", &format!("msg-{i}"), &json!(i))
                .await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "session_busy".to_owned())),
        Some(&19),
        "{counts:?}"
    );
    let winner = replies.iter().position(|r| r.status == 201).unwrap();
    let (turn_id, token) = lease(&replies[winner]);
    let user = client.get("/v1/users/olga").await.expect(200, "");
    assert_eq!(user.body["user"]["live_turns"], 1);
    client
        .post(
            &format!("/v1/turns/{turn_id}/complete"),
            Some(&token),
            &json!({"response": "ok"}),
        )
        .await
        .expect(200, "");
    client
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(409, "lease_lost");
    let replay = client
        .begin("olga", "chat-1", &format!("msg-{winner}"), &json!(winner))
        .await
        .expect(200, "");
    assert_eq!(replay.body["turn"]["response"], "ok");
    let user = client.get("/v1/users/olga").await.expect(200, "");
    assert_eq!(user.body["user"]["live_turns"], 0);
    assert!(!server.logs().contains(&token));
}

#[test]
fn sigterm_stops_the_server_gracefully() {
    let dir = scratch();
    let mut server = Server::start(dir.path(), &[]);
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = server
        .wait_exit(Duration::from_secs(10))
        .expect("the server exits after SIGTERM");
    assert!(exit.success(), "clean exit, got {exit:?}");
    assert!(server.logs().contains("shutdown requested"));
}

fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_agentgate"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn bad_flags_fail_fast_with_a_clear_message() {
    let dir = scratch();
    let store = format!("sqlite://{}", dir.path().join("x.db").display());
    let cases: [(&[&str], &str); 4] = [
        (&["--lease-ttl-ms", "5"], "lease_ttl"),
        (&["--max-turns-per-user", "0"], "max_turns_per_user"),
        (&["--api-key", "short"], "API key"),
        (&["--max-body-bytes", "0"], "max body bytes"),
    ];
    for (extra, message) in cases {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--store", &store];
        args.extend_from_slice(extra);
        let output = run_cli(&args, &[]);
        assert!(!output.status.success(), "{extra:?} must fail");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
    let output = run_cli(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "postgres://u:pw@localhost/db",
        ],
        &[],
    );
    assert!(!output.status.success());
    assert!(!String::from_utf8_lossy(&output.stderr).contains(":pw@"));
}

#[test]
fn help_lists_every_flag_with_its_env_but_never_a_secret() {
    let output = run_cli(
        &["serve", "--help"],
        &[("AGENTGATE_API_KEY", "env-secret-0123456789")],
    );
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--listen",
        "AGENTGATE_LISTEN",
        "--store",
        "AGENTGATE_STORE",
        "--redis",
        "AGENTGATE_REDIS",
        "--lease-ttl-ms",
        "AGENTGATE_LEASE_TTL_MS",
        "--max-turns-per-user",
        "AGENTGATE_MAX_TURNS_PER_USER",
        "--api-key",
        "AGENTGATE_API_KEY",
        "--api-key-file",
        "--max-body-bytes",
        "127.0.0.1:7700",
        "sqlite://agentgate.db",
        "30000",
    ] {
        assert!(help.contains(flag), "help lacks {flag}:\n{help}");
    }
    assert!(!help.contains("env-secret"));
}

/// The second message over HTTP: a begin with `on_busy: "wait"` is answered
/// when the holder ends (201, after the ending, not before); one with
/// `interrupt` asks the holder to stop, and the holder, told by its
/// heartbeat, ends `cancelled`; a bad policy or bound is a typed 400 that
/// changes nothing; and a force-release ends a holder that does not answer,
/// after which its every write is `lease_lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_message_waits_interrupts_and_a_stuck_holder_is_released() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let begin = |request: &str, extra: Value| {
        let mut body = json!({
            "user_id": "hana", "session_id": "chat-w", "client_request_id": request,
            "payload": {"text": request},
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    // An unknown policy, a bound over the limit, a bound for reject, a
    // negative bound: each refused, and no turn recorded.
    for bad in [
        json!({"on_busy": "queue"}),
        json!({"on_busy": "wait", "wait_ms": 20_001}),
        json!({"on_busy": "reject", "wait_ms": 10}),
        json!({"on_busy": "wait", "wait_ms": -1}),
    ] {
        client
            .post("/v1/turns", None, &begin("bad", bad))
            .await
            .expect(400, "invalid_request");
    }
    client
        .get("/v1/sessions/chat-w")
        .await
        .expect(404, "not_found");
    let (first, token) = lease(&client.begin("hana", "chat-w", "m1", &json!("m1")).await);
    client
        .post("/v1/turns", None, &begin("m2", json!({})))
        .await
        .expect(409, "session_busy");
    // A waiter, answered once the holder ends.
    let waiter = {
        let client = client.clone();
        let body = begin("m2", json!({"on_busy": "wait", "wait_ms": 15_000}));
        tokio::spawn(async move { client.post("/v1/turns", None, &body).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "it waits while the holder runs");
    // The node counts it while it waits (between its attempts, woken or
    // polled: read until one read catches it between two attempts).
    let mut seen_waiting = false;
    for _ in 0..50 {
        let metrics = client.get("/metrics").await.text;
        if metrics.contains("\nagentgate_waiting_begins 1\n") {
            seen_waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_waiting, "the waiting begin is counted while it waits");
    client
        .post(
            &format!("/v1/turns/{first}/complete"),
            Some(&token),
            &json!({"response": "one"}),
        )
        .await
        .expect(200, "");
    let second = waiter.await.unwrap().expect(201, "");
    let (second_id, second_token) = lease(&second);
    let metrics = client.get("/metrics").await.text;
    assert!(
        metrics.contains("\nagentgate_waiting_begins 0\n"),
        "no begin waits once it started"
    );
    // An interrupter: the holder learns it on its heartbeat and stops.
    let interrupter = {
        let client = client.clone();
        let body = begin("m3", json!({"on_busy": "interrupt", "wait_ms": 15_000}));
        tokio::spawn(async move { client.post("/v1/turns", None, &body).await })
    };
    let heartbeat = format!("/v1/turns/{second_id}/heartbeat");
    let mut told = false;
    for _ in 0..100 {
        let beat = client
            .post(&heartbeat, Some(&second_token), &json!({}))
            .await
            .expect(200, "");
        if beat.body["cancel_requested"] == true {
            told = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(told, "the interrupt reached the holder's heartbeat");
    client
        .post(
            &format!("/v1/turns/{second_id}/end-cancelled"),
            Some(&second_token),
            &json!({"partial": "two, stopped"}),
        )
        .await
        .expect(200, "");
    let third = interrupter.await.unwrap().expect(201, "");
    let (third_id, third_token) = lease(&third);
    let view = client
        .get(&format!("/v1/turns/{second_id}"))
        .await
        .expect(200, "");
    assert_eq!(view.body["turn"]["state"], "cancelled");
    // The third holder stops answering: an operator releases the session.
    let release = "/v1/sessions/chat-w/release";
    client
        .post(&format!("{release}?user_id=mallory"), None, &json!({}))
        .await
        .expect(404, "not_found");
    let released = client
        .post(&format!("{release}?user_id=hana"), None, &json!({}))
        .await
        .expect(200, "");
    assert_eq!(released.body["released"]["turn_id"], third_id.as_str());
    assert_eq!(released.body["released"]["state"], "abandoned");
    assert_eq!(released.body["released"]["error"]["code"], "released");
    let again = client.post(release, None, &json!({})).await.expect(200, "");
    assert_eq!(again.body["released"], Value::Null, "nothing held");
    for (path, body) in [
        (format!("/v1/turns/{third_id}/heartbeat"), json!({})),
        (
            format!("/v1/turns/{third_id}/tools"),
            json!({"tool": "book", "args": {}}),
        ),
        (
            format!("/v1/turns/{third_id}/complete"),
            json!({"response": "late"}),
        ),
    ] {
        client
            .post(&path, Some(&third_token), &body)
            .await
            .expect(409, "lease_lost");
    }
    client
        .post("/v1/sessions/no-such/release", None, &json!({}))
        .await
        .expect(404, "not_found");
    let metrics = client.get("/metrics").await.text;
    for line in [
        "agentgate_busy_begins_total{outcome=\"started_after_wait\",policy=\"wait\"} 1",
        "agentgate_busy_begins_total{outcome=\"started_after_wait\",policy=\"interrupt\"} 1",
        "agentgate_force_releases_total 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}

/// Reads SSE blocks from `response` until `count` events with data were
/// read; their `(id, event, data)`.
async fn sse_events(
    response: &mut reqwest::Response,
    count: usize,
) -> Vec<(Option<String>, String, Value)> {
    let mut buffer = String::new();
    let mut events = Vec::new();
    while events.len() < count {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("the stream moves")
            .expect("reads")
            .expect("not closed before the events");
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(at) = buffer.find("\n\n") {
            let block: String = buffer.drain(..at + 2).collect();
            let (mut id, mut event, mut data) = (None, String::new(), None);
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("event: ") {
                    event = v.to_owned();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str(v).unwrap());
                }
            }
            if let Some(data) = data {
                events.push((id, event, data));
            }
        }
    }
    events
}

/// A turn's events over HTTP: a follower opened before any event sees the
/// holder's appends live, with ids 1, 2, 3 and the attempt beside each
/// datum; bad appends and a bad `Last-Event-ID` are 400 and append
/// nothing, an unknown turn 404, a wrong token 409; a follower with
/// `on_disconnect=cancel` that goes away asks the turn to stop (the
/// holder's heartbeat reports it); after the ending a resume after id 1
/// gets events 2 and 3, then `end` with the ending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_events_stream_live_resume_and_cancel_on_disconnect() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn, token) = lease(&client.begin("ines", "chat-e", "m1", &json!("m1")).await);
    let path = format!("/v1/turns/{turn}/events");
    let mut live = client
        .get_stream(&format!("{path}?on_disconnect=cancel"), None)
        .await;
    assert_eq!(live.status(), 200);
    let append = |events: Value| json!({ "events": events });
    let appended = client
        .post(
            &path,
            Some(&token),
            &append(json!([{"event": "token", "data": "Hel"}, {"event": "token", "data": "lo"}])),
        )
        .await
        .expect(200, "");
    assert_eq!(appended.body["last_event_id"], 2);
    for bad in [
        json!([]),
        json!([{"event": "to ken", "data": 1}]),
        json!([{"event": "token"}]),
        Value::Array((0..501).map(|i| json!({"event": "t", "data": i})).collect()),
    ] {
        client
            .post(&path, Some(&token), &append(bad))
            .await
            .expect(400, "invalid_request");
    }
    client
        .post(
            &path,
            Some("lt_wrong"),
            &append(json!([{"event": "t", "data": 1}])),
        )
        .await
        .expect(409, "lease_lost");
    client
        .post(
            &path,
            Some(&token),
            &append(json!([{"event": "token", "data": "!"}])),
        )
        .await
        .expect(200, "");
    let seen = sse_events(&mut live, 3).await;
    let ids: Vec<_> = seen.iter().map(|(id, _, _)| id.clone().unwrap()).collect();
    assert_eq!(ids, ["1", "2", "3"], "nothing refused landed");
    assert_eq!(seen[0].1, "token");
    assert_eq!(seen[2].2, json!({"attempt": 1, "data": "!"}));
    drop(live);
    let mut asked = false;
    for _ in 0..100 {
        let beat = client
            .post(
                &format!("/v1/turns/{turn}/heartbeat"),
                Some(&token),
                &json!({}),
            )
            .await
            .expect(200, "");
        if beat.body["cancel_requested"] == true {
            asked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(asked, "the follower's going away asked the turn to stop");
    client
        .post(
            &format!("/v1/turns/{turn}/end-cancelled"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(200, "");
    let bad_resume = client.http_get_with(&path, &[("Last-Event-ID", "x")]).await;
    assert_eq!(bad_resume, 400);
    let missing = client.get("/v1/turns/turn_nope/events").await;
    assert_eq!(missing.status, 404);
    let mut resumed = client.get_stream(&path, Some(1)).await;
    let rest = sse_events(&mut resumed, 3).await;
    assert_eq!(rest[0].0.as_deref(), Some("2"));
    assert_eq!(rest[1].0.as_deref(), Some("3"));
    assert_eq!(rest[2].1, "end");
    assert_eq!(rest[2].2, json!({"state": "cancelled", "attempt": 1}));
}

/// A session's default policy over HTTP: a contradictory body is 400 and
/// sets nothing; the session's user sets `enqueue` (the view shows it),
/// another user's set is 404; then a message naming no `on_busy` on the
/// held session is queued (202) by that default, one naming `reject` is
/// still 409; with the default `supersede` + `interrupt_running` a message
/// naming none replaces the queued one and the holder's heartbeat reports
/// the cancel request; its ending hands over only the newest message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_default_policy_handles_messages_that_name_none() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let path = "/v1/sessions/chat-p/policy";
    for bad in [
        json!({"user_id": "ines", "on_busy": "reject", "wait_ms": 10}),
        json!({"user_id": "ines", "on_busy": "enqueue", "interrupt_running": true}),
        json!({"user_id": "ines", "on_busy": "sometimes"}),
        json!({"user_id": "ines"}),
    ] {
        client.put(path, &bad).await.expect(400, "invalid_request");
    }
    client
        .get("/v1/sessions/chat-p")
        .await
        .expect(404, "not_found");
    let set = client
        .put(path, &json!({"user_id": "ines", "on_busy": "enqueue"}))
        .await
        .expect(200, "");
    assert_eq!(
        set.body["session"]["default_policy"],
        json!({"on_busy": "enqueue", "wait_ms": null, "interrupt_running": false})
    );
    client
        .put(path, &json!({"user_id": "zoe", "on_busy": "wait"}))
        .await
        .expect(404, "not_found");
    let (turn_id, token) = lease(&client.begin("ines", "chat-p", "m1", &json!("m1")).await);
    let message = |request: &str| {
        json!({"user_id": "ines", "session_id": "chat-p", "client_request_id": request,
               "payload": {"text": request}})
    };
    let queued = client
        .post("/v1/turns", None, &message("m2"))
        .await
        .expect(202, "");
    assert_eq!(queued.body["turn"]["position"], 1);
    let mut named = message("m3");
    named["on_busy"] = json!("reject");
    client
        .post("/v1/turns", None, &named)
        .await
        .expect(409, "session_busy");
    client
        .post(
            "/v1/turns",
            None,
            &json!({"user_id": "ines", "session_id": "chat-p",
            "client_request_id": "m3", "wait_ms": 100}),
        )
        .await
        .expect(400, "invalid_request");
    client
        .put(
            path,
            &json!({"user_id": "ines", "on_busy": "supersede", "interrupt_running": true}),
        )
        .await
        .expect(200, "");
    let newest = client
        .post("/v1/turns", None, &message("m4"))
        .await
        .expect(202, "");
    assert_eq!(newest.body["turn"]["position"], 1);
    let view = client.get("/v1/sessions/chat-p").await.expect(200, "");
    let waiting: Vec<&str> = view.body["session"]["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["client_request_id"].as_str().unwrap())
        .collect();
    assert_eq!(waiting, ["m4"]);
    let beat = client
        .post(
            &format!("/v1/turns/{turn_id}/heartbeat"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(200, "");
    assert_eq!(beat.body["cancel_requested"], true, "{}", beat.text);
    let ended = client
        .post(
            &format!("/v1/turns/{turn_id}/end-cancelled"),
            Some(&token),
            &json!({"take_next": true}),
        )
        .await
        .expect(200, "");
    assert_eq!(ended.body["turn"]["state"], "cancelled");
    assert_eq!(ended.body["next"]["payload"]["text"], "m4");
    let replay = client
        .post("/v1/turns", None, &message("m2"))
        .await
        .expect(200, "");
    assert_eq!(replay.body["turn"]["state"], "superseded");
}

/// Three messages sent with `on_busy: enqueue` while the first runs: each
/// 202 with its position and a `Retry-After`, listed by the session view;
/// a plain message is 409 `session_busy`, a repeat of a queued one answers
/// its place again; one cancelled queued message leaves the queue at once.
/// Then one worker drains the session through the endings' handoffs
/// (`take_next: true`): each ending hands it the next message's lease and
/// payload, in order, with a higher fence, until the queue is empty; a
/// repeat of each replays its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_then_the_endings_hand_off_the_queue_in_order() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let begin = |request: &str, on_busy: &str| {
        json!({
            "user_id": "ines", "session_id": "chat-q", "client_request_id": request,
            "payload": {"text": request}, "on_busy": on_busy,
        })
    };
    for bad in [json!({"on_busy": "enqueue", "wait_ms": 10})] {
        let mut body = begin("bad", "enqueue");
        body.as_object_mut()
            .unwrap()
            .extend(bad.as_object().unwrap().clone());
        client
            .post("/v1/turns", None, &body)
            .await
            .expect(400, "invalid_request");
    }
    let (mut turn_id, mut token) = lease(&client.begin("ines", "chat-q", "m1", &json!("m1")).await);
    let mut queued = Vec::new();
    for (i, request) in ["m2", "m3", "gone", "m4"].into_iter().enumerate() {
        let reply = client
            .post("/v1/turns", None, &begin(request, "enqueue"))
            .await
            .expect(202, "");
        assert!(
            reply.retry_after().is_some_and(|s| s >= 1),
            "{}",
            reply.text
        );
        assert_eq!(reply.body["queued"], true);
        assert_eq!(reply.body["turn"]["state"], "queued");
        assert_eq!(reply.body["turn"]["position"], i + 1);
        queued.push(reply.body["turn"]["turn_id"].as_str().unwrap().to_owned());
    }
    client
        .post("/v1/turns", None, &begin("plain", "reject"))
        .await
        .expect(409, "session_busy");
    let again = client
        .post("/v1/turns", None, &begin("m3", "reject"))
        .await
        .expect(202, "");
    assert_eq!(again.body["turn"]["position"], 2);
    let cancelled = client
        .post(&format!("/v1/turns/{}/cancel", queued[2]), None, &json!({}))
        .await
        .expect(200, "");
    assert_eq!(cancelled.body["turn"]["state"], "cancelled");
    let view = client.get("/v1/sessions/chat-q").await.expect(200, "");
    let listed: Vec<(String, u64)> = view.body["session"]["queue"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["client_request_id"].as_str().unwrap().to_owned(),
                e["position"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("m2".to_owned(), 1),
            ("m3".to_owned(), 2),
            ("m4".to_owned(), 3)
        ]
    );
    let mut ran = Vec::new();
    let mut fence = 0;
    loop {
        let ended = client
            .post(
                &format!("/v1/turns/{turn_id}/complete"),
                Some(&token),
                &json!({"response": {"for": turn_id}, "take_next": true}),
            )
            .await
            .expect(200, "");
        assert_eq!(ended.body["turn"]["state"], "succeeded");
        let next = &ended.body["next"];
        if next.is_null() {
            break;
        }
        assert_eq!(next["turn"]["state"], "running");
        assert!(next["turn"]["fence"].as_i64().unwrap() > fence);
        fence = next["turn"]["fence"].as_i64().unwrap();
        ran.push(next["payload"]["text"].as_str().unwrap().to_owned());
        turn_id = next["turn"]["turn_id"].as_str().unwrap().to_owned();
        token = next["turn"]["lease_token"].as_str().unwrap().to_owned();
    }
    assert_eq!(ran, ["m2", "m3", "m4"]);
    let view = client.get("/v1/sessions/chat-q").await.expect(200, "");
    assert_eq!(view.body["session"]["queue"], json!([]));
    assert_eq!(view.body["session"]["holder"], Value::Null);
    for request in ["m2", "m4"] {
        let replay = client
            .post("/v1/turns", None, &begin(request, "enqueue"))
            .await
            .expect(200, "");
        assert_eq!(replay.body["turn"]["state"], "succeeded");
    }
    let metrics = client.get("/metrics").await.text;
    for line in [
        "agentgate_busy_begins_total{outcome=\"queued\",policy=\"enqueue\"} 4",
        "agentgate_begins_total{outcome=\"handoff\"} 3",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}

/// Past `--confirmation-ttl-ms`, `GET /v1/turns/{id}` says the pending
/// confirmation expired (`confirmation_expired: true`, the state still
/// `awaiting_confirmation`), and an approval is refused 409
/// `confirmation_expired`, its own code, not a 404 `not_found`: the turn is
/// there, its confirmation ran out. Nothing starts; a new message does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_confirmation_says_so() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--confirmation-ttl-ms", "1000"]);
    let client = server.client();
    let (turn_id, token) = lease(
        &client
            .begin("lou", "chat-1", "msg-1", &json!("spend 900"))
            .await,
    );
    client
        .post(
            &format!("/v1/turns/{turn_id}/await-confirmation"),
            Some(&token),
            &json!({ "pending": {"amount": 900} }),
        )
        .await
        .expect(200, "");
    let fresh = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(fresh.body["confirmation_expired"], json!(false));
    // Past the 1 s TTL.
    tokio::time::sleep(std::time::Duration::from_millis(1_300)).await;
    let expired = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert_eq!(expired.body["turn"]["state"], "awaiting_confirmation");
    assert_eq!(
        expired.body["confirmation_expired"],
        json!(true),
        "{}",
        expired.text
    );
    let confirm = json!({
        "user_id": "lou", "session_id": "chat-1", "client_request_id": "confirm-1",
        "confirmation": {"turn_id": turn_id, "decision": "approve"},
    });
    let refused = client
        .post("/v1/turns", None, &confirm)
        .await
        .expect(409, "confirmation_expired");
    assert!(refused.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("expired"));
    client
        .begin("lou", "chat-1", "msg-2", &json!("again"))
        .await
        .expect(201, "");
}

/// SIGTERM drains: a request in flight when the signal arrives (a begin
/// waiting for a busy session) still gets its whole answer, not a reset;
/// then the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_requests_in_flight() {
    let dir = scratch();
    let mut server = Server::start(dir.path(), &[]);
    let client = server.client();
    lease(&client.begin("tess", "chat-t", "m1", &json!("m1")).await);
    let body = json!({
        "user_id": "tess", "session_id": "chat-t", "client_request_id": "m2",
        "payload": "m2", "on_busy": "wait", "wait_ms": 2_000,
    });
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move { client.post("/v1/turns", None, &body).await })
    };
    // It is in flight once the node counts it waiting.
    let mut waiting = false;
    for _ in 0..100 {
        if client
            .get("/metrics")
            .await
            .text
            .contains("\nagentgate_waiting_begins 1\n")
        {
            waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(waiting, "the begin waits in the server");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Its wait ends with the holder still holding: a whole 409 answer.
    let answer = waiter.await.unwrap();
    assert_eq!(answer.status, 409, "{}", answer.text);
    assert_eq!(answer.code(), "session_busy", "{}", answer.text);
    let exit = tokio::task::block_in_place(|| server.wait_exit(Duration::from_secs(35)))
        .expect("the server exits once drained");
    assert!(exit.success(), "clean exit, got {exit:?}");
    assert!(server.logs().contains("shutdown requested"));
}
