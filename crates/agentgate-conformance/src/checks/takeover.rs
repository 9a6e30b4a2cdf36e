//! Fencing (docs/protocol.md §4.5): a holder that stops heartbeating is taken over after its
//! TTL with a higher fence; every call with the old token is refused and
//! changes nothing; a tool it left mid-call is reported as unknown.

use std::collections::BTreeMap;

use agentgate::{ErrorKind, PreviousOutcome, ToolName, ToolState, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome, Ending, LeaseRef, ToolCall, ToolClaim};
use agentgate_core::store::all_executions;
use agentgate_core::store::Completion;
use serde_json::json;

use super::{report, short_ttl, start_within, SHORT_TTL};
use crate::Target;

fn call(tool: &str, args: serde_json::Value) -> ToolCall {
    ToolCall::new(ToolName::new(tool).expect("name"), &args).expect("call")
}

/// A holder stops heartbeating (it drives the store directly, with no
/// watchdog); after the TTL a retry takes over.
pub async fn takeover_fences_the_old_holder(target: &Target) {
    let gate = target.gate(short_ttl()).await;
    let store = gate.store();
    // The payload `start_within` sends for request "r1".
    let payload = json!({"text": "r1"});
    let command = BeginCommand::new(
        UserId::new("takeover-user").expect("id"),
        SessionId::new("takeover-session").expect("id"),
        ClientRequestId::new("r1").expect("id"),
        &payload,
        None,
    )
    .expect("command");
    let BeginOutcome::Started(first) = store.begin(&command).await.expect("begin") else {
        panic!("first begin starts");
    };
    let old = LeaseRef {
        turn_id: first.turn_id.clone(),
        token: first.lease_token.clone(),
    };
    // One tool left mid-call, one completed.
    let ToolClaim::Execute {
        execution_id: interrupted,
        ..
    } = store
        .claim_tool(&old, &call("book", json!({"amount": 18})))
        .await
        .expect("claim")
    else {
        panic!("first claim executes");
    };
    let ToolClaim::Execute {
        execution_id: done, ..
    } = store
        .claim_tool(&old, &call("list_categories", json!({"type": "expense"})))
        .await
        .expect("claim")
    else {
        panic!("first claim executes");
    };
    let categories = CanonicalJson::new("result", &json!(["餐饮", "交通"])).expect("json");
    store
        .complete_tool(&old, &done, Completion::Result(categories))
        .await
        .expect("complete");

    // Before the TTL: the retry is told the request is in flight.
    let early = gate
        .begin("takeover-user", "takeover-session", "r1", &payload)
        .await
        .expect_err("in flight");
    assert_eq!(early.kind(), ErrorKind::RequestInFlight);

    let taker = start_within(
        &gate,
        "takeover-user",
        "takeover-session",
        "r1",
        SHORT_TTL * 4,
    )
    .await;
    assert!(taker.is_takeover());
    assert_eq!(taker.attempt(), 2);
    assert!(
        taker.fence() > first.fence,
        "fence {} > {}",
        taker.fence(),
        first.fence
    );

    // Every call with the old token is refused as lease_lost.
    let mut refused = BTreeMap::new();
    let mut expect_lost = |what: &str, result: Result<(), agentgate::Error>| {
        let error = result.expect_err(what);
        assert_eq!(error.kind(), ErrorKind::LeaseLost, "{what}: {error}");
        *refused
            .entry(format!("lease_lost_{what}"))
            .or_insert(0usize) += 1;
    };
    expect_lost("heartbeat", store.heartbeat(&old).await.map(drop));
    expect_lost(
        "claim",
        store
            .claim_tool(&old, &call("book", json!({"amount": 18})))
            .await
            .map(drop),
    );
    expect_lost(
        "new_claim",
        store
            .claim_tool(&old, &call("email", json!({})))
            .await
            .map(drop),
    );
    let stale = CanonicalJson::new("result", &json!("stale")).expect("json");
    expect_lost(
        "tool_complete",
        store
            .complete_tool(&old, &interrupted, Completion::Result(stale.clone()))
            .await
            .map(drop),
    );
    expect_lost(
        "tool_fail",
        store.fail_tool(&old, &interrupted, &stale).await,
    );
    expect_lost(
        "succeed",
        store
            .end_turn(
                &old,
                &Ending::Succeed {
                    response: stale.clone(),
                },
            )
            .await
            .map(drop),
    );
    expect_lost(
        "fail",
        store
            .end_turn(
                &old,
                &Ending::Fail {
                    error: stale.clone(),
                    retryable: true,
                },
            )
            .await
            .map(drop),
    );
    expect_lost(
        "await_confirmation",
        store
            .end_turn(&old, &Ending::AwaitConfirmation { pending: stale })
            .await
            .map(drop),
    );

    // ...and changed nothing.
    let view = store
        .turn(taker.id())
        .await
        .expect("view")
        .expect("turn exists");
    assert_eq!(view.state, TurnState::Running);
    assert_eq!(view.fence, taker.fence());
    let executions = all_executions(store.as_ref(), taker.id())
        .await
        .expect("executions");
    assert_eq!(executions.len(), 2, "the old holder created no execution");
    let book = executions
        .iter()
        .find(|e| e.execution_id == interrupted)
        .expect("book");
    assert_eq!(book.state, ToolState::Running);
    assert_eq!(book.fence, first.fence);
    assert!(book.result.is_none());
    let session = store
        .session(taker.session_id())
        .await
        .expect("view")
        .expect("session");
    assert_eq!(session.holder.map(|h| h.turn_id), Some(taker.id().clone()));

    // The taker sees the interrupted call as unknown and the finished one cached.
    match taker
        .tool("book", &json!({"amount": 18}))
        .await
        .expect("claim")
    {
        agentgate::ToolStep::Execute(execution) => {
            assert_eq!(execution.previous_outcome(), Some(PreviousOutcome::Unknown));
            assert_eq!(execution.attempt(), 2);
            execution
                .complete(&json!({"entry": 1}))
                .await
                .expect("complete");
        }
        agentgate::ToolStep::Cached(_) => panic!("an interrupted call is not cached"),
    }
    match taker
        .tool("list_categories", &json!({"type": "expense"}))
        .await
        .expect("claim")
    {
        agentgate::ToolStep::Cached(value) => assert_eq!(value, json!(["餐饮", "交通"])),
        agentgate::ToolStep::Execute(_) => panic!("a finished call is cached"),
    }
    taker
        .succeed(&json!("booked"))
        .await
        .expect("the taker ends the turn");
    refused.insert("takeover".to_owned(), 1);
    refused.insert("previous_outcome_unknown".to_owned(), 1);
    report(target, "takeover_fences_the_old_holder", &refused);
}
