//! docs/protocol.md §4.1–§4.3 under storms: one turn per session, N per user (lease and
//! permit both or neither), one turn record per request with replay.

use std::collections::BTreeMap;

use agentgate::{Begun, ClientRequestId, Config, ErrorKind, SessionId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome};
use serde_json::json;

use super::{
    config, must_start, outcome, report, short_ttl, start_within, started, storm, tally, SHORT_TTL,
    STORM_TASKS,
};
use crate::Target;

/// 100 identical begins → 1 started, 99 request_in_flight; after success
/// every duplicate replays the stored response; another payload → mismatch.
pub async fn duplicate_storm(target: &Target) {
    let gate = target.gate(config()).await;
    let payload = json!({"text": "taxi 18", "n": [1, 2.50]});
    let results = storm(STORM_TASKS, |_| {
        let (gate, payload) = (gate.clone(), payload.clone());
        async move {
            gate.begin("dup-user", "dup-session", "dup-request", &payload)
                .await
        }
    })
    .await;
    let mut counts = tally(
        results
            .iter()
            .map(outcome)
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    let (mut turns, rest) = started(results);
    assert_eq!(turns.len(), 1, "exactly one start: {counts:?}");
    let turn = turns.pop().expect("one start");
    for refused in &rest {
        let error = refused.as_ref().expect_err("the rest are refused");
        assert_eq!(error.kind(), ErrorKind::RequestInFlight, "{error}");
        assert_eq!(error.active_turn_id(), Some(turn.id().as_str()));
        let retry = error.retry_after().expect("a retry-after");
        assert!(retry <= gate.config().lease_ttl && !retry.is_zero());
    }
    let turn_id = turn.id().clone();
    let answer = json!({"text": "booked 18 to transport"});
    turn.succeed(&answer).await.expect("succeed");

    // Same payload spelled differently: key order and number spelling.
    let respelled: serde_json::Value =
        serde_json::from_str(r#"{"n":[1.0,2.5],"text":"taxi 18"}"#).expect("json");
    let replays = storm(STORM_TASKS, |_| {
        let (gate, payload) = (gate.clone(), respelled.clone());
        async move {
            gate.begin("dup-user", "dup-session", "dup-request", &payload)
                .await
        }
    })
    .await;
    for replay in &replays {
        match replay {
            Ok(Begun::Replay(view)) => {
                assert_eq!(view.turn_id, turn_id);
                assert_eq!(view.response.as_ref(), Some(&answer));
            }
            other => panic!("expected a replay, got {}", outcome(other)),
        }
    }
    *counts.entry("replay_after_success".into()).or_default() += replays.len();
    let mismatch = gate
        .begin(
            "dup-user",
            "dup-session",
            "dup-request",
            &json!({"text": "taxi 19"}),
        )
        .await
        .expect_err("a changed payload is refused");
    assert_eq!(mismatch.kind(), ErrorKind::PayloadMismatch);
    *counts.entry("payload_mismatch".into()).or_default() += 1;
    report(target, "duplicate_storm", &counts);
}

/// 100 different requests on one session → 1 started, 99 session_busy
/// naming the holder; the user's permits show one live turn.
pub async fn session_storm(target: &Target) {
    let gate = target.gate(config()).await;
    let results = storm(STORM_TASKS, |i| {
        let gate = gate.clone();
        async move {
            gate.begin(
                "storm-user",
                "storm-session",
                &format!("req-{i}"),
                &json!({"i": i}),
            )
            .await
        }
    })
    .await;
    let counts = tally(
        results
            .iter()
            .map(outcome)
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    let (mut turns, rest) = started(results);
    assert_eq!(turns.len(), 1, "exactly one start: {counts:?}");
    let turn = turns.pop().expect("one start");
    for refused in &rest {
        let error = refused.as_ref().expect_err("the rest are refused");
        assert_eq!(error.kind(), ErrorKind::SessionBusy, "{error}");
        assert_eq!(error.active_turn_id(), Some(turn.id().as_str()));
        assert!(error
            .retry_after()
            .is_some_and(|r| r <= gate.config().lease_ttl));
    }
    let user = gate
        .store()
        .user(&UserId::new("storm-user").expect("id"))
        .await
        .expect("user");
    assert_eq!(user.live_turns, 1, "a refused begin took no permit");
    turn.succeed(&json!("done")).await.expect("succeed");
    let next = must_start(&gate, "storm-user", "storm-session", "after").await;
    next.succeed(&json!("done")).await.expect("succeed");
    report(target, "session_storm", &counts);
}

/// 2×cap sessions of one user at once → exactly cap started, the rest
/// user_at_capacity, and no session lease left behind by a rejected one.
/// Then a per-user override is honoured the same way.
pub async fn user_capacity_storm(target: &Target) {
    let cap = config().max_turns_per_user;
    let gate = target.gate(Config::default()).await;
    let mut counts = BTreeMap::new();
    for (round, cap) in [(0, cap), (1, 2)] {
        let user = format!("cap-user-{round}");
        if round == 1 {
            gate.store()
                .set_user_cap(&UserId::new(&user).expect("id"), Some(cap))
                .await
                .expect("override");
        }
        let sessions = 2 * cap as usize;
        let results = storm(sessions, |i| {
            let (gate, user) = (gate.clone(), user.clone());
            async move {
                gate.begin(&user, &format!("{user}-s{i}"), "r", &json!(null))
                    .await
            }
        })
        .await;
        let classes: Vec<String> = results.iter().map(outcome).collect();
        let (turns, rest) = started(results);
        assert_eq!(turns.len(), cap as usize, "cap {cap}: {classes:?}");
        for refused in &rest {
            let error = refused.as_ref().expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::UserAtCapacity, "{error}");
            assert!(error.retry_after().is_some());
        }
        for (i, class) in classes.iter().enumerate() {
            let session = SessionId::new(format!("{user}-s{i}")).expect("id");
            let view = gate.store().session(&session).await.expect("session view");
            if class == "started" {
                assert!(
                    view.and_then(|v| v.holder).is_some(),
                    "a started session is held"
                );
            } else {
                assert!(
                    view.and_then(|v| v.holder).is_none(),
                    "a rejected session holds no lease"
                );
            }
        }
        let user_view = gate
            .store()
            .user(&UserId::new(&user).expect("id"))
            .await
            .expect("user");
        assert_eq!(user_view.live_turns, cap);
        assert_eq!(user_view.max_turns_per_user, cap);
        for turn in turns {
            turn.succeed(&json!("ok")).await.expect("succeed");
        }
        let freed = gate
            .store()
            .user(&UserId::new(&user).expect("id"))
            .await
            .expect("user");
        assert_eq!(freed.live_turns, 0, "endings release the permits");
        *counts.entry(format!("cap{cap}_started")).or_default() += cap as usize;
        *counts.entry(format!("cap{cap}_at_capacity")).or_default() += rest.len();
    }
    report(target, "user_capacity_storm", &counts);
}

/// Fences from one store-wide counter: every grant's fence is higher than
/// every earlier one, across sessions, users, takeovers and a reopened store.
pub async fn fences_only_grow(target: &Target) {
    /// Takeovers per store opening: each waits out one short TTL.
    const TAKEOVERS: usize = 2;
    let mut last = 0;
    let mut grants = 0;
    let mut takeovers = 0;
    let mut next = |fence: agentgate::Fence, grants: &mut usize| {
        assert!(fence.0 > last, "fence {fence} after {last}");
        last = fence.0;
        *grants += 1;
    };
    for reopen in 0..2 {
        let gate = target.gate(config()).await;
        for i in 0..20 {
            let turn = must_start(
                &gate,
                &format!("fence-user-{}", i % 3),
                &format!("fence-u{}-s{}", i % 3, i % 4),
                &format!("r{reopen}-{i}"),
            )
            .await;
            next(turn.fence(), &mut grants);
            turn.succeed(&json!(i)).await.expect("succeed");
        }
        // Takeovers: a holder that never renews (driven through the store,
        // with no watchdog) is taken over after the TTL, under a new fence.
        let short = target.gate(short_ttl()).await;
        for t in 0..TAKEOVERS {
            let request = format!("t{reopen}-{t}");
            let command = BeginCommand::new(
                UserId::new("fence-taken-user").expect("id"),
                SessionId::new("fence-taken-session").expect("id"),
                ClientRequestId::new(request.as_str()).expect("id"),
                &json!({"text": request}),
                None,
            )
            .expect("command");
            let BeginOutcome::Started(silent) = short.store().begin(&command).await.expect("begin")
            else {
                panic!("a new request starts");
            };
            next(silent.fence, &mut grants);
            let taker = start_within(
                &short,
                "fence-taken-user",
                "fence-taken-session",
                &request,
                SHORT_TTL * 4,
            )
            .await;
            assert!(
                taker.is_takeover(),
                "the silent holder's turn is taken over"
            );
            assert_eq!(taker.id(), &silent.turn_id);
            next(taker.fence(), &mut grants);
            takeovers += 1;
            taker.succeed(&json!(t)).await.expect("succeed");
        }
    }
    report(
        target,
        "fences_only_grow",
        &[
            ("grants".to_owned(), grants),
            ("takeovers".to_owned(), takeovers),
        ]
        .into_iter()
        .collect(),
    );
}
