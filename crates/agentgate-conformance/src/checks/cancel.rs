//! Cancel (docs/protocol.md §3.7): a request to stop a running
//! turn, made without its lease, races the holder's tool claims and its
//! ending. The turn ends exactly once, no tool runs after the request is
//! seen, none runs twice, and a repeat of the request replays the
//! cancellation instead of running it again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Begun, ErrorKind, ToolState, ToolStep, TurnState};
use agentgate_core::store::all_executions;
use serde_json::json;

use super::{config, must_start, report, short_ttl, start_within, storm};
use crate::Target;

/// Rounds of [`cancel_races_claims_and_ending`].
const ROUNDS: usize = 10;

/// Tool claims per round, each a distinct call, racing the cancel requests.
const CLAIMS: usize = 40;

/// Cancel requests per round, racing the claims and each other.
const CANCELS: usize = 10;

/// Each round: one running turn; 40 claims of distinct tools and 10 cancel
/// requests released together. Every claim either executes (and completes)
/// or is refused `turn_cancelled`; after the storm every claim, even of a
/// call that already succeeded, is refused; the heartbeat says
/// `cancel_requested`; the request's time is recorded once; the holder's
/// ending stores `cancelled` with its partial response, once; the old lease
/// then changes nothing; a repeat of the request replays the cancellation.
pub async fn cancel_races_claims_and_ending(target: &Target) {
    let gate = target.gate(config()).await;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for round in 0..ROUNDS {
        let session = format!("cancel-session-{round}");
        let turn = Arc::new(must_start(&gate, "cancel-user", &session, "r1").await);
        let id = turn.id().clone();
        let results = storm(CLAIMS + CANCELS, |i| {
            let (turn, gate, id) = (Arc::clone(&turn), gate.clone(), id.clone());
            async move {
                if i >= CLAIMS {
                    let view = gate.request_cancel(&id).await.expect("cancel request");
                    let view = view.expect("the turn exists");
                    assert_eq!(view.state, TurnState::Running, "{view:?}");
                    assert!(view.cancel_requested_at_ms.is_some(), "{view:?}");
                    return "cancel_requested";
                }
                match turn.tool("book", &json!({"item": i})).await {
                    Ok(ToolStep::Execute(execution)) => {
                        execution.complete(&json!({"booked": i})).await.expect(
                            "a claimed tool completes: cancel stops claims, not completions",
                        );
                        "executed"
                    }
                    Ok(ToolStep::Cached(_)) => {
                        panic!("a first claim of a distinct call is never cached")
                    }
                    Err(error) => {
                        assert_eq!(error.kind(), ErrorKind::TurnCancelled, "{error}");
                        "turn_cancelled"
                    }
                }
            }
        })
        .await;
        for class in results {
            *counts.entry(class.to_owned()).or_default() += 1;
        }
        // Seen now, whichever way the race went.
        let status = turn.heartbeat().await.expect("the lease is still live");
        assert!(status.cancel_requested, "the heartbeat reports the request");
        assert!(turn.cancel_requested() && turn.is_cancelled());
        let refused = turn.tool("book", &json!({"item": 0})).await;
        assert_eq!(
            refused.as_ref().map(|_| ()).expect_err("refused").kind(),
            ErrorKind::TurnCancelled
        );
        let requested_at = gate
            .store()
            .turn(&id)
            .await
            .expect("view")
            .and_then(|v| v.cancel_requested_at_ms)
            .expect("recorded");
        // Executions: every executed call succeeded once; none is left running.
        let executions = all_executions(gate.store().as_ref(), &id)
            .await
            .expect("executions");
        assert!(
            executions
                .iter()
                .all(|e| e.state == ToolState::Succeeded && e.attempt == 1),
            "{executions:?}"
        );
        let turn = Arc::try_unwrap(turn).expect("every task finished");
        let partial = json!({"text": "stopped", "executed": executions.len()});
        let ended = turn
            .end_cancelled(&partial)
            .await
            .expect("the ending is stored");
        assert_eq!(ended.state, TurnState::Cancelled);
        assert_eq!(ended.response.as_ref(), Some(&partial));
        assert_eq!(
            ended.cancel_requested_at_ms,
            Some(requested_at),
            "recorded once"
        );
        // After the ending: a cancel request changes nothing, the repeat of
        // the request replays the cancellation, and the session is free.
        let again = gate
            .request_cancel(&id)
            .await
            .expect("cancel")
            .expect("turn");
        assert_eq!(again.state, TurnState::Cancelled);
        assert_eq!(again.updated_at_ms, ended.updated_at_ms, "nothing written");
        match gate
            .begin("cancel-user", &session, "r1", &json!({"text": "r1"}))
            .await
        {
            Ok(Begun::Replay(view)) => {
                assert_eq!(view.state, TurnState::Cancelled);
                assert_eq!(view.response.as_ref(), Some(&partial));
            }
            other => panic!(
                "expected a replay of the cancellation, got {:?}",
                other.map(|_| ())
            ),
        }
        must_start(&gate, "cancel-user", &session, "r2")
            .await
            .succeed(&json!("ok"))
            .await
            .expect("the session is free");
        *counts.entry("ended_cancelled_once".to_owned()).or_default() += 1;
    }
    let missing = agentgate::TurnId::new("turn_no_such_turn").expect("id");
    assert!(gate
        .request_cancel(&missing)
        .await
        .expect("answer")
        .is_none());
    assert_eq!(counts.get("cancel_requested"), Some(&(ROUNDS * CANCELS)));
    assert_eq!(
        counts.get("executed").copied().unwrap_or(0)
            + counts.get("turn_cancelled").copied().unwrap_or(0),
        ROUNDS * CLAIMS,
        "{counts:?}"
    );
    report(target, "cancel_races_claims_and_ending", &counts);
}

/// A holder that claims no tool learns of a cancel request made elsewhere
/// from its watchdog's next heartbeat (within a third of the TTL, bounded
/// here by the TTL): its cancellation signal fires while its lease stays
/// live, and dropping it ends the turn `cancelled` (not a retryable failure
/// a retry would run again) and frees the session at once. A request
/// through the holder's own gate signals it at once, before any heartbeat.
pub async fn cancel_is_learned_by_the_watchdog(target: &Target) {
    let gate = target.gate(short_ttl()).await;
    let turn = must_start(&gate, "cancel-watch-user", "cancel-watch", "r1").await;
    let id = turn.id().clone();
    let signal = turn.cancellation();
    // Through the store, as from another node: only the heartbeat can tell
    // this holder.
    gate.store()
        .request_cancel(&id)
        .await
        .expect("cancel")
        .expect("turn");
    assert!(!signal.is_cancelled(), "not told yet");
    let ttl = gate.config().lease_ttl;
    tokio::time::timeout(ttl, signal.cancelled())
        .await
        .expect("the watchdog's heartbeat fires the signal within the TTL");
    assert!(turn.cancel_requested());
    turn.heartbeat().await.expect("the lease is still live");
    drop(turn);
    let next = start_within(
        &gate,
        "cancel-watch-user",
        "cancel-watch",
        "r2",
        Duration::from_secs(5),
    )
    .await;
    next.succeed(&json!("ok")).await.expect("succeed");
    let view = gate.store().turn(&id).await.expect("view").expect("turn");
    assert_eq!(view.state, TurnState::Cancelled, "{view:?}");
    // Through the holder's own gate: signalled at once. With the default
    // TTL its first heartbeat is ten seconds away; this allows a sixth.
    let gate = target.gate(config()).await;
    let turn = must_start(&gate, "cancel-watch-user", "cancel-local", "r1").await;
    let signal = turn.cancellation();
    gate.request_cancel(turn.id())
        .await
        .expect("cancel")
        .expect("turn");
    tokio::time::timeout(gate.config().lease_ttl / 6, signal.cancelled())
        .await
        .expect("a local holder is signalled before any heartbeat");
    assert!(turn.cancel_requested());
    let ended = turn.end_cancelled(&json!(null)).await.expect("ended");
    assert_eq!(ended.state, TurnState::Cancelled);
    // From another node, learned by the holder's own tool claim: refused
    // `turn_cancelled`, and the signal fires at once, so the holder's other
    // tasks stop too (its first heartbeat is ten seconds away).
    let turn = must_start(&gate, "cancel-watch-user", "cancel-claim", "r1").await;
    let signal = turn.cancellation();
    gate.store()
        .request_cancel(turn.id())
        .await
        .expect("cancel")
        .expect("turn");
    assert!(!signal.is_cancelled(), "not told yet");
    let refused = turn.tool("book", &json!({"item": 1})).await;
    assert_eq!(
        refused.as_ref().map(|_| ()).expect_err("refused").kind(),
        ErrorKind::TurnCancelled
    );
    assert!(
        signal.is_cancelled() && turn.cancel_requested(),
        "a claim refused turn_cancelled signals the turn at once"
    );
    let ended = turn.end_cancelled(&json!(null)).await.expect("ended");
    assert_eq!(ended.state, TurnState::Cancelled);
    let counts = [
        ("signalled_by_heartbeat".to_owned(), 1),
        ("dropped_ends_cancelled".to_owned(), 1),
        ("signalled_locally_at_once".to_owned(), 1),
        ("signalled_by_a_refused_claim".to_owned(), 1),
    ];
    report(
        target,
        "cancel_is_learned_by_the_watchdog",
        &counts.into_iter().collect(),
    );
}

/// The cancel grace of [`an_ignored_cancel_is_force_released_after_its_grace`].
const CANCEL_GRACE: Duration = Duration::from_secs(3);

/// A holder that ignores its cancel, and goes on heartbeating, is
/// force-released by the sweep once the cancel grace has passed, and only
/// then: a sweep within the grace releases nothing; the first after it
/// releases exactly that turn, which ends `abandoned` under a newer session
/// fence, every later write of its holder refused `lease_lost`, the session
/// free for the next message at once. A turn asked to stop that ends
/// itself in time is never released, nor is the next holder of its
/// session; a second sweep releases nothing more. The session and user
/// views show the request on the holder (`cancel_requested`), and not on
/// the next holder. A turn asked to stop whose lease lapsed and whose
/// session a new message took is not listed as an ignored cancel.
pub async fn an_ignored_cancel_is_force_released_after_its_grace(target: &Target) {
    let gate = target
        .gate(agentgate::Config {
            cancel_grace: CANCEL_GRACE,
            ..config()
        })
        .await;
    let user = "ignored-cancel-user";
    let stubborn = must_start(&gate, user, "ignored-cancel", "r1").await;
    let polite = must_start(&gate, user, "ignored-cancel-polite", "r1").await;
    let polite_id = polite.id().clone();
    let stubborn_session = agentgate::SessionId::new("ignored-cancel").expect("id");
    let holder = |view: Option<agentgate::SessionView>| {
        view.expect("session").holder.expect("the session is held")
    };
    let before = holder(gate.store().session(&stubborn_session).await.expect("view"));
    assert!(!before.cancel_requested, "{before:?}");
    let asked = std::time::Instant::now();
    for id in [stubborn.id(), &polite_id] {
        gate.store()
            .request_cancel(id)
            .await
            .expect("cancel")
            .expect("the turn exists");
    }
    // Every view that shows the holder shows the request.
    let shown = holder(gate.store().session(&stubborn_session).await.expect("view"));
    assert!(shown.cancel_requested, "{shown:?}");
    let user_view = gate
        .store()
        .user(&agentgate::UserId::new(user).expect("id"))
        .await
        .expect("view");
    assert_eq!(user_view.holders.len(), 2, "{user_view:?}");
    assert!(
        user_view.holders.iter().all(|h| h.cancel_requested),
        "{user_view:?}"
    );
    let early = gate.store().sweep().await.expect("sweep");
    assert!(
        asked.elapsed() < CANCEL_GRACE,
        "the early sweep came within the grace"
    );
    assert_eq!(early.released, 0, "nothing is released within the grace");
    stubborn
        .heartbeat()
        .await
        .expect("still held within the grace");
    // The polite one stops, and its session passes to a new message that
    // runs on past the grace: neither is the sweep's to release.
    polite
        .end_cancelled(&json!({"partial": "stopped"}))
        .await
        .expect("ended in time");
    let next = must_start(&gate, user, "ignored-cancel-polite", "r2").await;

    tokio::time::sleep(CANCEL_GRACE.saturating_sub(asked.elapsed()) + Duration::from_millis(200))
        .await;
    let due = gate.store().sweep().await.expect("sweep");
    assert_eq!(due.released, 1, "exactly the turn that ignored its cancel");
    let view = gate
        .store()
        .turn(stubborn.id())
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(view.state, TurnState::Abandoned, "{view:?}");
    let session = gate
        .store()
        .session(&agentgate::SessionId::new("ignored-cancel").expect("id"))
        .await
        .expect("view")
        .expect("session");
    assert!(session.holder.is_none(), "{session:?}");
    assert!(session.fence > stubborn.fence(), "{session:?}");
    let refused = stubborn.heartbeat().await.expect_err("released");
    assert_eq!(refused.kind(), ErrorKind::LeaseLost, "{refused}");
    let refused = stubborn
        .tool("book", &json!({"late": true}))
        .await
        .map(|_| ())
        .expect_err("released");
    assert_eq!(refused.kind(), ErrorKind::LeaseLost, "{refused}");
    let refused = stubborn
        .succeed(&json!("late"))
        .await
        .expect_err("released");
    assert_eq!(
        refused.error.kind(),
        ErrorKind::LeaseLost,
        "{}",
        refused.error
    );
    let after = must_start(&gate, user, "ignored-cancel", "r2").await;

    next.heartbeat()
        .await
        .expect("the next holder keeps its session");
    let next_holder = holder(
        gate.store()
            .session(&agentgate::SessionId::new("ignored-cancel-polite").expect("id"))
            .await
            .expect("view"),
    );
    assert_eq!(next_holder.turn_id, *next.id());
    assert!(!next_holder.cancel_requested, "a new holder was not asked");
    let polite_view = gate
        .store()
        .turn(&polite_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(polite_view.state, TurnState::Cancelled, "{polite_view:?}");
    let again = gate.store().sweep().await.expect("sweep");
    assert_eq!(again.released, 0, "released once");
    next.succeed(&json!("ok")).await.expect("ended");
    after.succeed(&json!("ok")).await.expect("ended");

    // Asked to stop, then its lease lapsed (no watchdog: a bare store
    // begin) and a new message took its session: an orphan, not listed as
    // an ignored cancel even past the grace, so it crowds out no one.
    let short = target
        .gate(agentgate::Config {
            cancel_grace: agentgate::limits::MIN_CANCEL_GRACE,
            ..super::short_ttl()
        })
        .await;
    let payload = json!({"text": "r1"});
    let command = agentgate::model::BeginCommand::new(
        agentgate::UserId::new("lapsed-cancel-user").expect("id"),
        agentgate::SessionId::new("lapsed-cancel").expect("id"),
        agentgate::ClientRequestId::new("r1").expect("id"),
        &payload,
        None,
    )
    .expect("command");
    let agentgate::model::BeginOutcome::Started(lapsed) =
        short.store().begin(&command).await.expect("begin")
    else {
        panic!("a first begin starts");
    };
    short
        .store()
        .request_cancel(&lapsed.turn_id)
        .await
        .expect("cancel")
        .expect("the turn exists");
    let taker = start_within(
        &short,
        "lapsed-cancel-user",
        "lapsed-cancel",
        "r2",
        Duration::from_secs(10),
    )
    .await;
    tokio::time::sleep(agentgate::limits::MIN_CANCEL_GRACE + Duration::from_millis(200)).await;
    let listed = short.store().ignored_cancels(128).await.expect("listing");
    assert!(
        listed
            .iter()
            .all(|ignored| ignored.turn_id != lapsed.turn_id),
        "{listed:?}"
    );
    let lapsed_view = short
        .store()
        .turn(&lapsed.turn_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(lapsed_view.state, TurnState::Running, "an orphan");
    taker
        .heartbeat()
        .await
        .expect("the taker keeps its session");
    taker.succeed(&json!("ok")).await.expect("ended");

    let counts = [
        ("released_within_grace".to_owned(), early.released as usize),
        ("released_after_grace".to_owned(), due.released as usize),
        ("writes_refused_after".to_owned(), 3),
        ("ended_in_time_kept".to_owned(), 1),
        ("next_holder_kept".to_owned(), 1),
        ("lapsed_orphans_listed".to_owned(), listed.len()),
    ];
    report(
        target,
        "an_ignored_cancel_is_force_released_after_its_grace",
        &counts.into_iter().collect(),
    );
}
