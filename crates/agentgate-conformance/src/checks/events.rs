//! A turn's event log (docs/protocol.md §9): the holder's appends are fenced,
//! numbered without gaps and bounded; a follower sees every event once, in
//! order, live, and the turn's ending; a reader that drops its stream and
//! resumes after the last id it saw misses nothing and repeats nothing; a
//! zombie's events after a takeover never appear.

use std::collections::BTreeMap;
use std::time::Duration;

use agentgate::events::Followed;
use agentgate::{ErrorKind, Gate, TurnId, TurnState};
use agentgate_core::limits::{MAX_EVENT_BATCH, MAX_EVENT_DATA_BYTES};
use agentgate_core::model::{BeginOutcome, LeaseRef, NewEvent, TurnEvent};
use serde_json::json;
use tokio_stream::StreamExt as _;

use super::{command, report, short_ttl, start_within, storm, SHORT_TTL};
use crate::Target;

/// Appenders released together on one lease.
const APPENDERS: usize = 20;

/// Events each appender's one batch carries.
const PER_BATCH: usize = 10;

/// Where readers cut the stream and resume.
const CUTS: [u64; 6] = [0, 1, 57, 199, 200, 201];

/// Longest a follower may take to see what it is owed.
const FOLLOW_LIMIT: Duration = Duration::from_secs(30);

fn token(data: serde_json::Value) -> NewEvent {
    NewEvent::new("token", &data).expect("a valid event")
}

/// Reads the follower's stream until its end; the events and the ending.
async fn drain(gate: &Gate, turn_id: &TurnId, after: u64) -> (Vec<TurnEvent>, Followed) {
    let mut stream = gate.follow(turn_id, after).expect("follow");
    let mut events = Vec::new();
    loop {
        let item = tokio::time::timeout(FOLLOW_LIMIT, stream.next())
            .await
            .expect("the follower is owed more within its limit")
            .expect("the stream ends with an End, not by closing")
            .expect("no error");
        match item {
            Followed::Event(event) => events.push(event),
            end @ Followed::End { .. } => return (events, end),
        }
    }
}

/// 20 batches of 10 events appended at once on one lease get the ids
/// 1..=200, each batch contiguous; an empty, oversized or over-limit append
/// is refused and changes nothing. After a takeover the old holder's append
/// is refused `lease_lost`; the new holder's event follows with the new
/// attempt. A follower started before the first event sees exactly 1..=201
/// and the ending; readers resuming at any cut see exactly the rest; one
/// that drops its stream mid-way and resumes after its last id sees the
/// same sequence as one that never dropped.
pub async fn events_are_fenced_ordered_and_resumable(target: &Target) {
    let gate = target.gate(short_ttl()).await;
    let store = gate.store().clone();
    let (user, session, request) = ("events-user", "events-session", "r1");
    let BeginOutcome::Started(first) = store
        .begin(&command(user, session, request))
        .await
        .expect("begin")
    else {
        panic!("the first begin starts");
    };
    let old = LeaseRef {
        turn_id: first.turn_id.clone(),
        token: first.lease_token.clone(),
    };
    let turn_id = first.turn_id.clone();
    let early = {
        let gate = gate.clone();
        let turn_id = turn_id.clone();
        tokio::spawn(async move { drain(&gate, &turn_id, 0).await })
    };

    let lasts = storm(APPENDERS, |task| {
        let store = store.clone();
        let old = old.clone();
        async move {
            let batch: Vec<NewEvent> = (0..PER_BATCH)
                .map(|n| token(json!({"task": task, "n": n})))
                .collect();
            store.append_events(&old, &batch).await.expect("append")
        }
    })
    .await;
    let mut sorted = lasts.clone();
    sorted.sort_unstable();
    let expected: Vec<u64> = (1..=APPENDERS as u64)
        .map(|k| k * PER_BATCH as u64)
        .collect();
    assert_eq!(sorted, expected, "each batch's last id, no gap");

    let refused = [
        Vec::new(),
        (0..=MAX_EVENT_BATCH).map(|n| token(json!(n))).collect(),
    ];
    for batch in &refused {
        let error = store.append_events(&old, batch).await.expect_err("refused");
        assert_eq!(
            error.kind(),
            ErrorKind::InvalidRequest,
            "{} events",
            batch.len()
        );
    }
    let big = "x".repeat(MAX_EVENT_DATA_BYTES);
    assert_eq!(
        NewEvent::new("token", &json!(big))
            .expect_err("over")
            .kind(),
        ErrorKind::InvalidRequest
    );
    assert_eq!(
        NewEvent::new("to\nken", &json!(1))
            .expect_err("bad name")
            .kind(),
        ErrorKind::InvalidRequest
    );

    let page = store
        .events(&turn_id, 0, 500)
        .await
        .expect("read")
        .expect("the turn");
    assert_eq!(page.state, TurnState::Running);
    let ids: Vec<u64> = page.events.iter().map(|e| e.event_id).collect();
    assert_eq!(
        ids,
        (1..=200).collect::<Vec<u64>>(),
        "nothing refused landed"
    );
    for block in page.events.chunks(PER_BATCH) {
        let data: Vec<serde_json::Value> = block
            .iter()
            .map(|e| serde_json::from_str(&e.data).expect("json"))
            .collect();
        let task = &data[0]["task"];
        for (n, value) in data.iter().enumerate() {
            assert_eq!(&value["task"], task, "a batch is contiguous");
            assert_eq!(value["n"], n, "in its order");
        }
    }

    // The old holder stops heartbeating; a retry takes over after the TTL.
    let taker = start_within(&gate, user, session, request, SHORT_TTL * 20).await;
    assert_eq!(taker.attempt(), 2);
    let zombie = store
        .append_events(&old, &[token(json!("zombie"))])
        .await
        .expect_err("fenced");
    assert_eq!(zombie.kind(), ErrorKind::LeaseLost);
    let last = taker
        .emit("token", &json!("after the takeover"))
        .await
        .expect("emit");
    assert_eq!(last, 201);
    taker.succeed(&json!("done")).await.expect("ends");

    let (seen, end) = early.await.expect("follower task");
    let ids: Vec<u64> = seen.iter().map(|e| e.event_id).collect();
    assert_eq!(
        ids,
        (1..=201).collect::<Vec<u64>>(),
        "every event once, in order"
    );
    assert!(
        seen.iter().all(|e| e.data != "\"zombie\""),
        "no zombie event"
    );
    assert_eq!(seen[199].attempt, 1);
    assert_eq!(
        seen[200].attempt, 2,
        "the taker's event carries its attempt"
    );
    assert_eq!(
        end,
        Followed::End {
            state: TurnState::Succeeded,
            attempt: 2
        }
    );

    for cut in CUTS {
        let (rest, _) = drain(&gate, &turn_id, cut).await;
        let ids: Vec<u64> = rest.iter().map(|e| e.event_id).collect();
        assert_eq!(
            ids,
            (cut + 1..=201).collect::<Vec<u64>>(),
            "resumed after {cut}"
        );
    }
    // A reader drops its stream after 37 events and resumes after the last
    // one it saw: the two halves are the whole, exactly.
    let mut stream = gate.follow(&turn_id, 0).expect("follow");
    let mut halves = Vec::new();
    while halves.len() < 37 {
        match stream.next().await.expect("more").expect("no error") {
            Followed::Event(event) => halves.push(event),
            end => panic!("ended early: {end:?}"),
        }
    }
    drop(stream);
    let resumed_after = halves.last().expect("37 events").event_id;
    let (rest, _) = drain(&gate, &turn_id, resumed_after).await;
    halves.extend(rest);
    assert_eq!(
        halves, seen,
        "dropped and resumed equals followed throughout"
    );

    let mut counts = BTreeMap::new();
    counts.insert("events".to_owned(), seen.len());
    counts.insert("resumes".to_owned(), CUTS.len() + 1);
    report(target, "events_are_fenced_ordered_and_resumable", &counts);
}

/// Where the target announces across nodes (PostgreSQL `NOTIFY`, the Redis
/// layer's pub/sub) an append on node A wakes a watch of the turn's events
/// on node B; elsewhere node B's watch says it hears only its own node, and
/// its followers find the event by their poll. Either way node B reads the
/// event.
pub async fn an_append_on_another_node_wakes_its_followers(target: &Target) {
    let node_a = target.gate(short_ttl()).await;
    let node_b = target.gate(short_ttl()).await;
    let turn = super::must_start(&node_a, "cross-events", "cross-events", "r").await;
    let store_b = node_b.store();
    let mut watch = store_b.watch_events(turn.id());
    let notified = super::announces_across_nodes(target);
    if notified {
        // Node B's listener subscribes on its first watch.
        let deadline = tokio::time::Instant::now() + FOLLOW_LIMIT;
        while !watch.across_nodes() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "node B never listened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A fresh watch: subscribing woke the first one (what was announced
        // before reached no one), and only the append may wake this one.
        watch = store_b.watch_events(turn.id());
    } else {
        assert!(!watch.across_nodes(), "nothing announces across nodes here");
    }
    turn.emit("token", &json!("across")).await.expect("append");
    let bound = if notified {
        FOLLOW_LIMIT
    } else {
        Duration::from_millis(500)
    };
    let woken = watch.wait(bound).await;
    assert_eq!(woken, notified, "woken by the append on node A");
    let page = store_b
        .events(turn.id(), 0, 10)
        .await
        .expect("read")
        .expect("the turn");
    assert_eq!(page.events.len(), 1);
    assert_eq!(page.events[0].data, r#""across""#);
    turn.succeed(&json!("done")).await.expect("ended");
    let counts = [("woken".to_owned(), usize::from(woken))]
        .into_iter()
        .collect();
    report(
        target,
        "an_append_on_another_node_wakes_its_followers",
        &counts,
    );
}
