//! A tool books its effect once (docs/protocol.md §4.4): a tool execution is marked succeeded at most once and never
//! runs again; with a same-transaction effect, the effect happens exactly once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{ErrorKind, PreviousOutcome, ToolState, ToolStep};
use agentgate_core::limits::MAX_EXECUTIONS_PER_TURN;
use agentgate_core::store::all_executions;
use serde_json::json;

use super::{config, must_start, report, storm, STORM_TASKS};
use crate::{ledger, Target};

/// 100 concurrent claims of one call → 1 execute, 99 tool_in_flight; the
/// same args in another key order and number spelling → the cached result.
pub async fn tool_storm(target: &Target) {
    let gate = target.gate(config()).await;
    let turn = Arc::new(must_start(&gate, "tool-user", "tool-session", "r1").await);
    let args = json!({"type": "expense", "amount": 35, "category": "餐饮"});
    let result = json!({"entry_id": 1});
    // Every task claims, then waits until all have claimed; only then does the
    // one executor complete, so every other claim met the call in flight.
    let claimed = Arc::new(tokio::sync::Barrier::new(STORM_TASKS));
    let claims = storm(STORM_TASKS, |_| {
        let (turn, args, result) = (Arc::clone(&turn), args.clone(), result.clone());
        let claimed = Arc::clone(&claimed);
        async move {
            let claim = turn.tool("create_transaction", &args).await;
            claimed.wait().await;
            match claim {
                Ok(ToolStep::Execute(execution)) => {
                    execution.complete(&result).await.expect("complete");
                    Ok("execute")
                }
                Ok(ToolStep::Cached(_)) => Ok("cached"),
                Err(error) => Err(error),
            }
        }
    })
    .await;
    let mut counts = BTreeMap::new();
    for claim in claims {
        match claim {
            Ok(class) => *counts.entry(class.to_owned()).or_default() += 1,
            Err(error) => {
                assert_eq!(error.kind(), ErrorKind::ToolInFlight, "{error}");
                *counts.entry("tool_in_flight".to_owned()).or_default() += 1;
            }
        }
    }
    assert_eq!(
        counts.get("execute"),
        Some(&1),
        "exactly one execute: {counts:?}"
    );
    assert_eq!(
        counts.get("tool_in_flight"),
        Some(&(STORM_TASKS - 1)),
        "{counts:?}"
    );
    let views = all_executions(gate.store().as_ref(), turn.id())
        .await
        .expect("executions");
    assert_eq!(views.len(), 1, "one execution record");
    assert_eq!(views[0].state, ToolState::Succeeded);
    assert_eq!(views[0].result.as_ref(), Some(&result));
    let reordered: serde_json::Value =
        serde_json::from_str(r#"{"category":"\u9910\u996e","amount":35.0,"type":"expense"}"#)
            .expect("json");
    let cached = storm(STORM_TASKS, |_| {
        let (turn, args) = (Arc::clone(&turn), reordered.clone());
        async move {
            match turn.tool("create_transaction", &args).await {
                Ok(ToolStep::Cached(value)) => value,
                other => panic!("expected the cached result, got {other:?}"),
            }
        }
    })
    .await;
    assert!(cached.iter().all(|v| *v == result));
    counts.insert("cached_after_success".to_owned(), cached.len());
    let turn = Arc::try_unwrap(turn).expect("all claims finished");
    turn.succeed(&json!("ok")).await.expect("succeed");
    report(target, "tool_storm", &counts);
}

/// 100 concurrent attempts to book one tool call with the effect in the same
/// SQL transaction → exactly 1 ledger row; an effect that fails after writing
/// rolls back both the row and the success mark.
pub async fn same_transaction_effect(target: &Target) {
    let gate = target.gate(config()).await;
    ledger::prepare(&target.store_url).await;
    let turn = Arc::new(must_start(&gate, "ledger-user", "ledger-session", "r1").await);
    let args = json!({"amount": 35, "note": "lunch"});
    let outcomes = storm(STORM_TASKS, |_| {
        let (turn, args) = (Arc::clone(&turn), args.clone());
        async move {
            // Bounded: a claim that finds the call in flight waits and retries.
            for _ in 0..400 {
                match turn.tool("book", &args).await {
                    Ok(ToolStep::Execute(execution)) => {
                        let value = execution
                            .complete_in_tx(ledger::book("lunch-35".into(), 35, false))
                            .await
                            .expect("the one execution books");
                        return ("booked", value);
                    }
                    Ok(ToolStep::Cached(value)) => return ("cached", value),
                    Err(error) if error.kind() == ErrorKind::ToolInFlight => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(error) => panic!("claim failed: {error}"),
                }
            }
            panic!("the booking never finished");
        }
    })
    .await;
    let booked = outcomes
        .iter()
        .filter(|(class, _)| *class == "booked")
        .count();
    assert_eq!(booked, 1, "exactly one task ran the effect");
    assert!(
        outcomes.iter().all(|(_, value)| *value == outcomes[0].1),
        "everyone sees one result"
    );
    assert_eq!(
        ledger::count(&target.store_url, "lunch-35").await,
        1,
        "exactly one ledger row"
    );

    // A failure after the effect wrote its row rolls both back.
    let dinner = json!({"amount": 99, "note": "dinner"});
    let ToolStep::Execute(execution) = turn.tool("book", &dinner).await.expect("claim") else {
        panic!("a new call executes");
    };
    let failed = execution
        .complete_in_tx(ledger::book("dinner-99".into(), 99, true))
        .await
        .expect_err("the effect fails");
    assert_eq!(failed.kind(), ErrorKind::Effect);
    let rolled_back_rows = ledger::count(&target.store_url, "dinner-99").await;
    assert_eq!(rolled_back_rows, 0, "the row rolled back");
    let ToolStep::Execute(retry) = turn.tool("book", &dinner).await.expect("claim") else {
        panic!("a failed effect is not cached");
    };
    assert_eq!(retry.previous_outcome(), Some(PreviousOutcome::Failed));
    retry
        .complete_in_tx(ledger::book("dinner-99".into(), 99, false))
        .await
        .expect("the retry books");
    let ledger_rows = ledger::count(&target.store_url, "dinner-99").await;
    assert_eq!(ledger_rows, 1);
    let turn = Arc::try_unwrap(turn).expect("all claims finished");
    turn.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("booked".to_owned(), booked),
        ("cached".to_owned(), STORM_TASKS - booked),
        (
            "ledger_rows".to_owned(),
            usize::try_from(ledger_rows).expect("a count is not negative"),
        ),
        (
            "rolled_back_rows".to_owned(),
            usize::try_from(rolled_back_rows).expect("a count is not negative"),
        ),
    ];
    report(
        target,
        "same_transaction_effect",
        &counts.into_iter().collect(),
    );
}

/// A turn one execution short of its limit, then 100 concurrent first claims
/// of distinct calls → exactly 1 executes and 99 are refused with
/// `invalid_request`: a store whose first claim counts the turn's
/// executions without serialising against another claim would let several
/// past the limit.
pub async fn execution_limit_storm(target: &Target) {
    let gate = target.gate(config()).await;
    let turn = Arc::new(must_start(&gate, "limit-user", "limit-session", "r1").await);
    let below = usize::try_from(MAX_EXECUTIONS_PER_TURN - 1).expect("limit fits");
    for n in 0..below {
        match turn.tool("fill", &json!({ "n": n })).await {
            Ok(ToolStep::Execute(_)) => {}
            other => panic!("fill claim {n}: {other:?}"),
        }
    }
    let claims = storm(STORM_TASKS, |n| {
        let turn = Arc::clone(&turn);
        async move {
            match turn.tool("last", &json!({ "n": n })).await {
                Ok(ToolStep::Execute(_)) => Ok(()),
                Ok(ToolStep::Cached(value)) => panic!("distinct calls cannot be cached: {value}"),
                Err(error) => Err(error.kind()),
            }
        }
    })
    .await;
    let mut counts = BTreeMap::new();
    for claim in claims {
        let class = match claim {
            Ok(()) => "execute".to_owned(),
            Err(ErrorKind::InvalidRequest) => "over_the_limit".to_owned(),
            Err(kind) => panic!("unexpected refusal {kind:?}"),
        };
        *counts.entry(class).or_default() += 1;
    }
    assert_eq!(counts.get("execute"), Some(&1), "{counts:?}");
    let views = all_executions(gate.store().as_ref(), turn.id())
        .await
        .expect("executions");
    assert_eq!(
        views.len(),
        below + 1,
        "exactly the limit of executions recorded"
    );
    let turn = Arc::try_unwrap(turn).expect("all claims finished");
    turn.succeed(&json!("ok")).await.expect("succeed");
    report(target, "execution_limit_storm", &counts);
}
