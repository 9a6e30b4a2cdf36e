//! The OpenAI-compatible client against a tiny local chat-completions server
//! on 127.0.0.1:0 returning canned responses: request mapping, response
//! mapping, retries on 5xx, no retry on 401, timeouts.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentgate::{Config, TurnState};
use agentgate_ledger::{LedgerError, OpenAiConfig, OpenAiModel};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use common::*;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// What the fake server saw and what it answers, in order.
#[derive(Default)]
struct Script {
    answers: Vec<(StatusCode, Value, Duration)>,
    requests: Vec<(Option<String>, Value)>,
}

type Shared = Arc<Mutex<Script>>;

async fn completions(
    State(script): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let (status, answer, delay) = {
        let mut script = script.lock().expect("lock");
        let auth = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        script.requests.push((auth, body));
        let index = script.requests.len() - 1;
        script.answers.get(index).cloned().unwrap_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({}),
            Duration::ZERO,
        ))
    };
    tokio::time::sleep(delay).await;
    (status, Json(answer))
}

async fn serve(answers: Vec<(StatusCode, Value, Duration)>) -> (String, Shared) {
    let script: Shared = Arc::new(Mutex::new(Script {
        answers,
        requests: Vec::new(),
    }));
    let router = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(Arc::clone(&script));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (format!("http://{address}/v1"), script)
}

fn client(url: &str, request_timeout: Duration, max_retries: u32) -> Arc<OpenAiModel> {
    let mut config = OpenAiConfig::new(url, "test-model");
    config.api_key = Some("sk-test".into());
    config.request_timeout = request_timeout;
    config.max_retries = max_retries;
    config.retry_backoff = Duration::from_millis(10);
    Arc::new(OpenAiModel::new(config).expect("client"))
}

fn tool_call_answer() -> Value {
    json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": null, "tool_calls": [{
        "id": "call_abc", "type": "function",
        "function": {"name": "create_transaction", "arguments": "{\"type\":\"expense\",\"amount\":35,\"category_name\":\"外卖\"}"}
    }]}}]})
}

fn text_answer(text: &str) -> Value {
    json!({"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]})
}

#[tokio::test]
async fn the_client_maps_requests_and_tool_calls_and_retries_a_500() {
    let (url, script) = serve(vec![
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": "busy"}),
            Duration::ZERO,
        ),
        (StatusCode::OK, tool_call_answer(), Duration::ZERO),
        (
            StatusCode::OK,
            text_answer("记好了：外卖 35 元。"),
            Duration::ZERO,
        ),
    ])
    .await;
    let store = store();
    let app = app_on(
        &store.url,
        Config::default(),
        client(&url, Duration::from_secs(5), 2),
    )
    .await;
    let outcome = app
        .chat(
            &message("s1", "m1", "外卖 35"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    let reply = outcome.reply.expect("reply");
    assert_eq!(reply.text, "记好了：外卖 35 元。");
    assert_eq!(reply.entries.len(), 1);
    assert_eq!(reply.entries[0].category, "餐饮");
    assert_eq!(count_entries(&store.url).await, 1);

    let script = script.lock().expect("lock");
    assert_eq!(
        script.requests.len(),
        3,
        "one retry after the 500, then round 2"
    );
    let (auth, first) = &script.requests[0];
    assert_eq!(auth.as_deref(), Some("Bearer sk-test"));
    assert_eq!(
        first, &script.requests[1].1,
        "the retry repeats the request"
    );
    assert_eq!(first["model"], "test-model");
    assert_eq!(first["tool_choice"], "auto");
    let tools: Vec<&str> = first["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(
        tools,
        ["list_categories", "create_transaction", "search_documents"]
    );
    assert_eq!(first["messages"][0]["role"], "system");
    assert_eq!(
        first["messages"][1],
        json!({"role": "user", "content": "外卖 35"})
    );
    let second_round = script.requests[2].1["messages"]
        .as_array()
        .expect("messages");
    let assistant = &second_round[2];
    assert_eq!(assistant["tool_calls"][0]["id"], "call_abc");
    assert_eq!(
        assistant["tool_calls"][0]["function"]["name"],
        "create_transaction"
    );
    let tool = &second_round[3];
    assert_eq!(tool["role"], "tool");
    assert_eq!(tool["tool_call_id"], "call_abc");
    let result: Value =
        serde_json::from_str(tool["content"].as_str().expect("content")).expect("json");
    assert_eq!(result["ok"], true);
    assert_eq!(result["entry"]["amount_cents"], 3500);
}

#[tokio::test]
async fn a_401_is_not_retried_and_the_turn_fails_retryably() {
    let (url, script) = serve(vec![(
        StatusCode::UNAUTHORIZED,
        json!({"error": {"message": "bad key"}}),
        Duration::ZERO,
    )])
    .await;
    let store = store();
    let app = app_on(
        &store.url,
        Config::default(),
        client(&url, Duration::from_secs(5), 2),
    )
    .await;
    let (sender, mut receiver) = events();
    let error = app
        .chat(
            &message("s1", "m1", "外卖 35"),
            Some(sender),
            CancellationToken::new(),
        )
        .await
        .expect_err("unauthorized");
    assert!(matches!(error, LedgerError::Model(_)), "{error}");
    assert_eq!(error.code(), "model_unavailable");
    assert!(error.to_string().contains("401"));
    assert_eq!(script.lock().expect("lock").requests.len(), 1);
    assert_eq!(names(&drain(&mut receiver)).last(), Some(&"error"));
    let transcript = app.transcript("alice", "s1").await.expect("transcript");
    assert_eq!(transcript[0].state, Some(TurnState::Failed));
    assert_eq!(count_entries(&store.url).await, 0);
}

#[tokio::test]
async fn a_slow_endpoint_times_out_after_bounded_retries() {
    let slow = Duration::from_millis(800);
    let (url, script) = serve(vec![
        (StatusCode::OK, text_answer("late"), slow),
        (StatusCode::OK, text_answer("late"), slow),
        (StatusCode::OK, text_answer("late"), slow),
    ])
    .await;
    let store = store();
    let app = app_on(
        &store.url,
        Config::default(),
        client(&url, Duration::from_millis(150), 1),
    )
    .await;
    let error = app
        .chat(
            &message("s1", "m1", "外卖 35"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect_err("timeout");
    assert!(error.to_string().contains("timed out"), "{error}");
    assert_eq!(
        script.lock().expect("lock").requests.len(),
        2,
        "first try + one retry"
    );
}
