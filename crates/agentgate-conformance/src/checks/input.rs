//! Bad input of every kind is refused with a typed error and writes nothing.

use std::collections::BTreeMap;

use agentgate::limits::{MAX_ID_CHARS, MAX_JSON_BYTES, MAX_JSON_DEPTH};
use agentgate::{Begun, Config, Decision, ErrorKind, Gate, SessionId, ToolStep, UserId};
use agentgate_core::ids::ClientRequestId;
use agentgate_core::ids::LeaseToken;
use agentgate_core::model::{BeginCommand, BeginOutcome, LeaseRef, QueueMode};
use agentgate_core::store::all_executions;
use serde_json::{json, Value};

use super::{config, must_start, report};
use crate::Target;

/// `depth` arrays, one inside the other, around a scalar: nesting `depth`
/// as [`MAX_JSON_DEPTH`] counts it.
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |inner, _| json!([inner]))
}

async fn nothing_written(gate: &Gate, user: &str, session: &str) {
    let user_view = gate
        .store()
        .user(&UserId::new(user).expect("id"))
        .await
        .expect("user");
    assert_eq!(user_view.live_turns, 0, "no permit taken for {session}");
    let session_view = gate
        .store()
        .session(&SessionId::new(session).expect("id"))
        .await
        .expect("view");
    assert!(session_view.is_none(), "no session row for {session}");
}

/// Every bad id, payload, token and reference is refused and writes nothing.
pub async fn bad_input_changes_nothing(target: &Target) {
    let gate = target.gate(config()).await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let long = "x".repeat(MAX_ID_CHARS + 1);
    let bad_begins: Vec<(&str, String, String, String, Value)> = vec![
        (
            "empty_user",
            String::new(),
            "in-s".into(),
            "r".into(),
            json!(1),
        ),
        (
            "long_user",
            long.clone(),
            "in-s".into(),
            "r".into(),
            json!(1),
        ),
        (
            "empty_session",
            "in-u".into(),
            String::new(),
            "r".into(),
            json!(1),
        ),
        (
            "long_session",
            "in-u".into(),
            long.clone(),
            "r".into(),
            json!(1),
        ),
        (
            "control_session",
            "in-u".into(),
            "in-\u{7}s".into(),
            "r".into(),
            json!(1),
        ),
        (
            "empty_request",
            "in-u".into(),
            "in-s".into(),
            String::new(),
            json!(1),
        ),
        (
            "long_request",
            "in-u".into(),
            "in-s".into(),
            long.clone(),
            json!(1),
        ),
        (
            "deep_payload",
            "in-u".into(),
            "in-s".into(),
            "r".into(),
            nested(MAX_JSON_DEPTH + 1),
        ),
        (
            "large_payload",
            "in-u".into(),
            "in-s".into(),
            "r".into(),
            json!("x".repeat(MAX_JSON_BYTES)),
        ),
    ];
    for (what, user, session, request, payload) in &bad_begins {
        let error = gate
            .begin(user, session, request, payload)
            .await
            .err()
            .unwrap_or_else(|| panic!("{what} accepted"));
        assert_eq!(error.kind(), ErrorKind::InvalidRequest, "{what}: {error}");
        *counts.entry("invalid_request".into()).or_default() += 1;
    }
    nothing_written(&gate, "in-u", "in-s").await;
    // At the limits exactly, the same inputs are accepted: ids of
    // MAX_ID_CHARS four-byte characters (512 bytes of UTF-8) and a payload
    // nested exactly MAX_JSON_DEPTH deep.
    let at_limit = "😀".repeat(MAX_ID_CHARS);
    let turn = must_start(&gate, &at_limit, &at_limit, &at_limit).await;
    let deepest = gate
        .begin("in-u-deep", "in-s-deep", "r", &nested(MAX_JSON_DEPTH))
        .await;
    let Ok(Begun::Started(deepest)) = deepest else {
        panic!("a payload exactly MAX_JSON_DEPTH deep is accepted");
    };
    deepest
        .succeed(&nested(MAX_JSON_DEPTH))
        .await
        .expect("a response exactly MAX_JSON_DEPTH deep is accepted");

    // Tool and ending input over the limits.
    let big = json!("x".repeat(MAX_JSON_BYTES));
    for (what, result) in [
        ("empty_tool", turn.tool("", &json!({})).await.map(drop)),
        ("long_tool", turn.tool(&long, &json!({})).await.map(drop)),
        (
            "deep_args",
            turn.tool("t", &nested(MAX_JSON_DEPTH + 1)).await.map(drop),
        ),
        ("large_args", turn.tool("t", &big).await.map(drop)),
    ] {
        let error = result.expect_err(what);
        assert_eq!(error.kind(), ErrorKind::InvalidRequest, "{what}: {error}");
        *counts.entry("invalid_request".into()).or_default() += 1;
    }
    assert!(
        all_executions(gate.store().as_ref(), turn.id())
            .await
            .expect("executions")
            .is_empty(),
        "no execution written"
    );
    let ToolStep::Execute(execution) = turn.tool("t", &json!({})).await.expect("claim") else {
        panic!("executes")
    };
    let error = execution.complete(&big).await.expect_err("large result");
    assert_eq!(error.kind(), ErrorKind::InvalidRequest);
    let views = all_executions(gate.store().as_ref(), turn.id())
        .await
        .expect("executions");
    assert_eq!(
        views[0].state,
        agentgate::ToolState::Running,
        "a refused completion changes nothing"
    );

    // Wrong token, unknown turn, another user's session, unknown confirmation.
    let store = gate.store();
    let wrong = LeaseRef {
        turn_id: turn.id().clone(),
        token: LeaseToken::generate(),
    };
    let error = store.heartbeat(&wrong).await.expect_err("wrong token");
    assert_eq!(error.kind(), ErrorKind::LeaseLost);
    let unknown = LeaseRef {
        turn_id: agentgate::TurnId::generate(),
        token: LeaseToken::generate(),
    };
    assert_eq!(
        store.heartbeat(&unknown).await.expect_err("unknown").kind(),
        ErrorKind::NotFound
    );
    let foreign = gate
        .begin("intruder", &at_limit, "r2", &json!(1))
        .await
        .expect_err("another user's session");
    assert_eq!(foreign.kind(), ErrorKind::NotFound);
    let confirm = gate
        .confirm("in-u", "in-s2", "c", "turn_unknown", Decision::Approve)
        .await
        .expect_err("nothing pending");
    assert_eq!(confirm.kind(), ErrorKind::NotFound);
    nothing_written(&gate, "intruder", "in-s2").await;
    for code in [
        "lease_lost",
        "not_found_turn",
        "not_found_foreign_session",
        "not_found_confirmation",
    ] {
        counts.insert(code.into(), 1);
    }
    turn.succeed(&json!("ok"))
        .await
        .expect("the holder is unaffected");

    // Another user's session with a queue is as unknown as any other: a
    // begin of every queue mode is `not_found`, never a `corrupt` read of
    // a queue that is not the caller's (a 503 schemathesis found).
    let queued_at = SessionId::new("in-sq").expect("id");
    let ask = |user: &str, request: &str, queue: Option<QueueMode>| {
        BeginCommand::new(
            UserId::new(user).expect("id"),
            queued_at.clone(),
            ClientRequestId::new(request).expect("id"),
            &json!(request),
            None,
        )
        .expect("command")
        .queued(queue)
    };
    let BeginOutcome::Started(holder) = store.begin(&ask("in-u", "h", None)).await.expect("hold")
    else {
        panic!("a fresh session starts");
    };
    let queued = store
        .begin(&ask("in-u", "q", Some(QueueMode::Enqueue)))
        .await
        .expect("enqueue");
    assert!(matches!(queued, BeginOutcome::Queued(_)), "{queued:?}");
    for queue in [None, Some(QueueMode::Enqueue), Some(QueueMode::Supersede)] {
        let error = store
            .begin(&ask("intruder", "x", queue))
            .await
            .expect_err("another user's queued session");
        assert_eq!(error.kind(), ErrorKind::NotFound, "{queue:?}: {error}");
    }
    *counts.entry("not_found_foreign_queue".into()).or_default() += 3;
    let held = LeaseRef {
        turn_id: holder.turn_id.clone(),
        token: holder.lease_token.clone(),
    };
    let response =
        agentgate_core::canonical::CanonicalJson::new("response", &json!("ok")).expect("json");
    store
        .end_turn(&held, &agentgate_core::model::Ending::Succeed { response })
        .await
        .expect("the holder ends");

    // Settings out of range are refused before anything opens.
    let bad = Config {
        lease_ttl: std::time::Duration::from_millis(1),
        ..Config::default()
    };
    let error = Gate::open(&target.store_url, bad)
        .await
        .expect_err("ttl out of range");
    assert_eq!(error.kind(), ErrorKind::InvalidRequest);
    let cap = store
        .set_user_cap(&UserId::new("in-u").expect("id"), Some(0))
        .await
        .expect_err("cap 0");
    assert_eq!(cap.kind(), ErrorKind::InvalidRequest);
    *counts.entry("invalid_request".into()).or_default() += 3;
    report(target, "bad_input_changes_nothing", &counts);
}
