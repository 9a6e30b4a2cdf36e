//! A session's default busy policy (docs/protocol.md §7.4): what a
//! begin that names no policy does on a busy session, set once per
//! conversation; and `supersede` that also interrupts the running turn.

use std::collections::BTreeMap;
use std::time::Duration;

use agentgate::model::TurnState;
use agentgate::{BusyPolicy, ErrorKind, Gate, OnBusy, SessionId, SessionView};
use serde_json::json;

use super::{command, config, must_start, report, storm};
use crate::Target;

/// Messages sent at once, naming no policy, behind one holder.
const UNNAMED: usize = 20;

/// The bound of the `wait` default: far above a loaded machine's ending.
const WAIT_MS: u64 = 15_000;

async fn set(gate: &Gate, user: &str, session: &str, on_busy: OnBusy) -> SessionView {
    gate.set_session_policy(user, session, on_busy)
        .await
        .unwrap_or_else(|error| panic!("{user} sets {session}'s policy: {error}"))
}

async fn view(gate: &Gate, session: &str) -> SessionView {
    gate.store()
        .session(&SessionId::new(session).expect("session id"))
        .await
        .expect("view")
        .expect("the session exists")
}

/// The requests the session's queue drains, one worker taking each head.
async fn drain(gate: &Gate, session: &str) -> Vec<String> {
    let session = SessionId::new(session).expect("session id");
    let mut ran = Vec::new();
    while let Some(next) = gate.take_next(&session).await.expect("take next") {
        let request = next.payload["text"].as_str().expect("text").to_owned();
        next.turn.succeed(&json!(request)).await.expect("ends");
        ran.push(request);
        assert!(ran.len() <= UNNAMED + 1, "the queue drains: {ran:?}");
    }
    ran
}

/// A session's default set before its first use binds it to the setter;
/// another user's set is `not_found` and changes nothing. With the default
/// `enqueue`, 20 begins naming no policy, behind a barrier on the held
/// session, are each queued, positions 1..=20 once each, and drain in that
/// order; a begin naming `reject` is still refused. With the default
/// `wait`, a begin naming none waits for the holder's ending and starts.
/// With the default `supersede` + interrupt, a begin naming none is queued
/// and the running holder is asked to stop; its ending hands over the
/// newest message.
pub async fn session_default_policy_applies_to_unnamed_begins(target: &Target) {
    let gate = target.gate(config()).await;
    let (user, other, session) = ("policy-user", "policy-other", "policy");
    let enqueue = OnBusy::new(BusyPolicy::Enqueue, None).expect("policy");
    let fresh = set(&gate, user, session, enqueue).await;
    assert_eq!(fresh.user_id.as_str(), user, "bound to its setter");
    assert_eq!(fresh.default_on_busy, Some(enqueue));
    assert!(fresh.holder.is_none() && fresh.queue.is_empty());
    let wait = OnBusy::new(BusyPolicy::Wait, Some(WAIT_MS)).expect("policy");
    let refused = gate.set_session_policy(other, session, wait).await;
    assert_eq!(
        refused.expect_err("another user's session").kind(),
        ErrorKind::NotFound
    );
    let unchanged = view(&gate, session).await;
    assert_eq!(unchanged.user_id.as_str(), user);
    assert_eq!(unchanged.default_on_busy, Some(enqueue));

    let holder = must_start(&gate, user, session, "holder").await;
    let positions = storm(UNNAMED, |i| {
        let gate = gate.clone();
        async move {
            let (outcome, report) = gate
                .begin_outcome_by_session(&command(user, session, &format!("m{i:02}")))
                .await
                .unwrap_or_else(|error| panic!("m{i:02}: {error}"));
            assert_eq!(report.session_default, Some(enqueue), "m{i:02}");
            match outcome {
                agentgate::model::BeginOutcome::Queued(queued) => queued.position,
                other => panic!("m{i:02} was not queued: {other:?}"),
            }
        }
    })
    .await;
    let mut sorted = positions.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=UNNAMED as u32).collect::<Vec<_>>(), "gap-free");
    let named = gate
        .begin_on_busy(&command(user, session, "named"), OnBusy::REJECT)
        .await
        .map(|_| ())
        .expect_err("a named reject overrides the default");
    assert_eq!(named.kind(), ErrorKind::SessionBusy);
    let order: Vec<String> = view(&gate, session)
        .await
        .queue
        .iter()
        .map(|entry| entry.client_request_id.to_string())
        .collect();
    holder.succeed(&json!("held")).await.expect("ends");
    assert_eq!(drain(&gate, session).await, order, "in the accepted order");

    set(&gate, user, session, wait).await;
    let holder = must_start(&gate, user, session, "holder2").await;
    let waiter = {
        let gate = gate.clone();
        tokio::spawn(async move {
            gate.begin_by_session(&command(user, session, "waiter"))
                .await
                .map(|(begun, report)| match begun {
                    agentgate::Begun::Started(turn) => (turn, report.session_default),
                    other => panic!("the waiter did not start: {other:?}"),
                })
        })
    };
    // The waiter is parked, not refused, while the holder runs.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "the waiter waits for the holder");
    holder.succeed(&json!("held")).await.expect("ends");
    let (running, followed) = waiter.await.expect("task").expect("the waiter starts");
    assert_eq!(followed, Some(wait));

    let supersede = OnBusy::new(BusyPolicy::Supersede, None)
        .and_then(OnBusy::interrupting)
        .expect("policy");
    set(&gate, user, session, supersede).await;
    for request in ["draft", "correction"] {
        let (outcome, _) = gate
            .begin_outcome_by_session(&command(user, session, request))
            .await
            .unwrap_or_else(|error| panic!("{request}: {error}"));
        assert!(
            matches!(outcome, agentgate::model::BeginOutcome::Queued(ref q) if q.position == 1),
            "{request} heads the queue alone: {outcome:?}"
        );
    }
    let asked = gate.store().turn(running.id()).await.expect("view");
    assert!(
        asked.is_some_and(|view| view.cancel_requested_at_ms.is_some()),
        "the holder was asked to stop"
    );
    let ended = running.end_cancelled(&json!({})).await.expect("ends");
    assert_eq!(ended.state, TurnState::Cancelled);
    assert_eq!(drain(&gate, session).await, vec!["correction".to_owned()]);

    let mut counts = BTreeMap::new();
    counts.insert("queued_by_default".to_owned(), UNNAMED);
    counts.insert("waited_by_default".to_owned(), 1);
    counts.insert("superseded_and_interrupted".to_owned(), 1);
    report(
        target,
        "session_default_policy_applies_to_unnamed_begins",
        &counts,
    );
}
