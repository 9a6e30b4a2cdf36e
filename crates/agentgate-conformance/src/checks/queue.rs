//! The second message's queue (docs/protocol.md §7.3, §3.8): `enqueue` and `supersede` on a
//! busy session, the handoff of the queue's head to the caller that ends
//! the holder, and what else starts a queued turn: a recovery worker's
//! claim after the holder was killed, or after the handoff was declined.
//! Each check drains the queue the way a worker does (end, then
//! [`Gate::take_next`]) and checks every message ran exactly once, in the
//! order the store accepted them.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use agentgate::model::{OrphanFilter, QueuedTurn};
use agentgate::{Begun, BusyPolicy, ErrorKind, Gate, OnBusy, SessionId, TurnState};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::{command, config, must_start, report, short_ttl, storm, SHORT_TTL};
use crate::holder::Holder;
use crate::Target;

/// Messages queued at once behind one holder: the whole queue's bound.
const QUEUED: usize = agentgate::limits::MAX_SESSION_QUEUE as usize;

/// Messages queued one by one before the superseding storm.
const EARLY: usize = 5;

/// Superseding messages released together.
const SUPERSEDERS: usize = 10;

fn policy(policy: BusyPolicy) -> OnBusy {
    OnBusy::new(policy, None).expect("no bound")
}

fn session_id(session: &str) -> SessionId {
    SessionId::new(session).expect("session id")
}

/// Begins `request` under `mode`, which must queue it.
async fn queue(
    gate: &Gate,
    user: &str,
    session: &str,
    request: &str,
    mode: BusyPolicy,
) -> QueuedTurn {
    let (begun, _) = gate
        .begin_on_busy(&command(user, session, request), policy(mode))
        .await
        .unwrap_or_else(|error| panic!("{request} queues: {error}"));
    match begun {
        Begun::Queued(queued) => queued,
        Begun::Started(turn) => panic!("{request} started on a held session: {:?}", turn.id()),
        Begun::Replay(view) => panic!("{request} replayed: {view:?}"),
    }
}

/// The request a drained turn's payload names.
fn request_of(payload: &Value) -> String {
    payload["text"]
        .as_str()
        .unwrap_or_else(|| panic!("a payload of this check: {payload}"))
        .to_owned()
}

/// Drains `session` as one worker does: take the head, succeed it, take
/// the next; the requests in the order they ran.
async fn drain(gate: &Gate, session: &str) -> Vec<String> {
    let mut ran = Vec::new();
    while let Some(next) = gate
        .take_next(&session_id(session))
        .await
        .expect("take next")
    {
        assert_eq!(next.turn.attempt(), 1, "a queued turn starts at attempt 1");
        assert!(next.journal.is_empty(), "a queued turn ran no tool before");
        let request = request_of(&next.payload);
        next.turn
            .succeed(&json!({"answer": request}))
            .await
            .expect("the handed-off turn ends");
        ran.push(request);
        assert!(ran.len() <= QUEUED + 1, "the queue drains: {ran:?}");
    }
    ran
}

/// Repeats `request` and expects its stored turn in `state`.
async fn replays(gate: &Gate, user: &str, session: &str, request: &str, state: TurnState) {
    let begun = gate
        .begin(user, session, request, &json!({"text": request}))
        .await
        .unwrap_or_else(|error| panic!("repeat of {request}: {error}"));
    match begun {
        Begun::Replay(view) => assert_eq!(view.state, state, "{request}: {view:?}"),
        Begun::Started(turn) => panic!("the repeat of {request} started {:?}", turn.id()),
        Begun::Queued(queued) => panic!("the repeat of {request} is still queued: {queued:?}"),
    }
}

/// 100 messages behind a barrier on one held session with `enqueue`: each
/// is queued, with the positions 1..=100 each given once; the session view
/// lists them in that order; one more is refused `queue_full` with a
/// retry-after and changes nothing; a plain begin is `session_busy` and a
/// repeat of a queued message answers its own place. The holder's caller
/// then drains the queue through handoffs: every message runs exactly
/// once, in position order, and its repeat replays its answer.
pub async fn enqueue_storm_runs_each_once_in_order(target: &Target) {
    let gate = target.gate(config()).await;
    let (user, session) = ("queue-user", "queue-storm");
    let holder = must_start(&gate, user, session, "holder").await;
    let answers = storm(QUEUED, |i| {
        let gate = gate.clone();
        async move {
            queue(
                &gate,
                user,
                session,
                &format!("m{i:03}"),
                BusyPolicy::Enqueue,
            )
            .await
        }
    })
    .await;
    let mut by_position: BTreeMap<u32, String> = BTreeMap::new();
    for queued in &answers {
        assert!(!queued.retry_after.is_zero());
        let previous = by_position.insert(queued.position, queued.client_request_id.to_string());
        assert!(
            previous.is_none(),
            "position {} given twice",
            queued.position
        );
    }
    let expected: Vec<u32> = (1..=QUEUED as u32).collect();
    assert_eq!(
        by_position.keys().copied().collect::<Vec<_>>(),
        expected,
        "gap-free"
    );
    let order: Vec<String> = by_position.values().cloned().collect();

    let view = gate
        .store()
        .session(&session_id(session))
        .await
        .expect("view")
        .expect("session");
    let listed: Vec<(u32, String)> = view
        .queue
        .iter()
        .map(|e| (e.position, e.client_request_id.to_string()))
        .collect();
    let expected: Vec<(u32, String)> = by_position.clone().into_iter().collect();
    assert_eq!(
        listed, expected,
        "the view lists the queue in position order"
    );

    let full = gate
        .begin_on_busy(
            &command(user, session, "one-too-many"),
            policy(BusyPolicy::Enqueue),
        )
        .await
        .map(|_| ())
        .expect_err("the queue is full");
    assert_eq!(full.kind(), ErrorKind::QueueFull, "{full}");
    assert!(full.retry_after().is_some_and(|r| !r.is_zero()));
    let busy = gate
        .begin(user, session, "plain", &json!({"text": "plain"}))
        .await
        .map(|_| ())
        .expect_err("the session is held");
    assert_eq!(busy.kind(), ErrorKind::SessionBusy, "{busy}");
    let again = queue(&gate, user, session, &order[41], BusyPolicy::Reject).await;
    assert_eq!(again.position, 42, "a repeat answers its own place");

    holder
        .succeed(&json!("held"))
        .await
        .expect("the holder ends");
    let ran = drain(&gate, session).await;
    assert_eq!(ran, order, "every message ran once, in the order accepted");
    for request in [&order[0], &order[QUEUED - 1]] {
        replays(&gate, user, session, request, TurnState::Succeeded).await;
    }
    // The refused message left no turn: sent again on the drained session,
    // it starts as new.
    let late = must_start(&gate, user, session, "one-too-many").await;
    assert_eq!(late.attempt(), 1);
    late.succeed(&json!("late")).await.expect("ended");
    let mut counts = BTreeMap::new();
    counts.insert("queued".to_owned(), answers.len());
    counts.insert("ran_in_order".to_owned(), ran.len());
    counts.insert("queue_full".to_owned(), 1);
    report(target, "enqueue_storm_runs_each_once_in_order", &counts);
}

/// 5 messages queued one by one, then 10 `supersede`s released together
/// behind a barrier: after the storm exactly one message waits, the last
/// one the store accepted, and every other ended `superseded` (a repeat
/// replays it). The handoff runs the survivor alone.
pub async fn supersede_keeps_only_the_newest(target: &Target) {
    let gate = target.gate(config()).await;
    let (user, session) = ("supersede-user", "supersede");
    let holder = must_start(&gate, user, session, "holder").await;
    for i in 0..EARLY {
        let queued = queue(
            &gate,
            user,
            session,
            &format!("early{i}"),
            BusyPolicy::Enqueue,
        )
        .await;
        assert_eq!(queued.position as usize, i + 1);
    }
    let answers = storm(SUPERSEDERS, |i| {
        let gate = gate.clone();
        async move {
            queue(
                &gate,
                user,
                session,
                &format!("late{i}"),
                BusyPolicy::Supersede,
            )
            .await
        }
    })
    .await;
    assert!(
        answers.iter().all(|q| q.position == 1),
        "each supersede heads the queue"
    );
    let view = gate
        .store()
        .session(&session_id(session))
        .await
        .expect("view")
        .expect("session");
    let [survivor] = view.queue.as_slice() else {
        panic!("exactly one message waits: {:?}", view.queue);
    };
    let survivor = survivor.client_request_id.to_string();
    holder
        .succeed(&json!("held"))
        .await
        .expect("the holder ends");
    assert_eq!(drain(&gate, session).await, vec![survivor.clone()]);
    let mut superseded = 0;
    for request in (0..EARLY)
        .map(|i| format!("early{i}"))
        .chain((0..SUPERSEDERS).map(|i| format!("late{i}")))
        .filter(|r| *r != survivor)
    {
        replays(&gate, user, session, &request, TurnState::Superseded).await;
        superseded += 1;
    }
    replays(&gate, user, session, &survivor, TurnState::Succeeded).await;
    let mut counts = BTreeMap::new();
    counts.insert("superseded".to_owned(), superseded);
    counts.insert("ran".to_owned(), 1);
    report(target, "supersede_keeps_only_the_newest", &counts);
}

/// A queued turn's cancel removes it from the queue at once (no holder to
/// ask): it ends `cancelled`, the positions behind it close up, a repeat
/// replays the cancel, and the drain skips it. A handoff declined (the
/// ending did not take the next turn) leaves the head queued on a free
/// session, where neither a new message nor a repeat of the queue's tail
/// can jump it, and a recovery worker's claim starts it.
pub async fn a_queued_turn_is_cancelled_or_claimed(target: &Target) {
    let gate = target.gate(config()).await;
    let (user, session) = ("queue-cancel-user", "queue-cancel");
    let holder = must_start(&gate, user, session, "holder").await;
    let mut ids = BTreeMap::new();
    for request in ["a", "b", "c"] {
        ids.insert(
            request,
            queue(&gate, user, session, request, BusyPolicy::Enqueue)
                .await
                .turn_id,
        );
    }
    let cancelled = gate
        .request_cancel(&ids["b"])
        .await
        .expect("cancel")
        .expect("the queued turn");
    assert_eq!(cancelled.state, TurnState::Cancelled, "{cancelled:?}");
    assert!(cancelled.cancel_requested_at_ms.is_some());
    let behind = queue(&gate, user, session, "c", BusyPolicy::Enqueue).await;
    assert_eq!(
        behind.position, 2,
        "the queue closed up behind the cancelled turn"
    );
    replays(&gate, user, session, "b", TurnState::Cancelled).await;

    // Declined: the holder ends without taking the next turn.
    holder
        .succeed(&json!("held"))
        .await
        .expect("the holder ends");
    let jumped = gate
        .begin(user, session, "jumper", &json!({"text": "jumper"}))
        .await
        .map(|_| ())
        .expect_err("a free session with a waiting queue is not jumped");
    assert_eq!(jumped.kind(), ErrorKind::SessionBusy, "{jumped}");
    assert_eq!(jumped.active_turn_id(), Some(ids["a"].as_str()));
    // Nor by its own tail: a repeat of the second queued request answers
    // its place behind the head; only the head may start.
    let tail = queue(&gate, user, session, "c", BusyPolicy::Enqueue).await;
    assert_eq!(
        (tail.turn_id.as_str(), tail.position),
        (ids["c"].as_str(), 2),
        "the tail waits behind the head on a free session"
    );
    let claimed = gate
        .claim_orphan(&OrphanFilter::default())
        .await
        .expect("claim")
        .expect("the stalled queue's head");
    assert_eq!(claimed.turn.id(), &ids["a"]);
    assert_eq!(request_of(&claimed.payload), "a");
    claimed.turn.succeed(&json!("a")).await.expect("ended");
    assert_eq!(drain(&gate, session).await, vec!["c".to_owned()]);
    let mut counts = BTreeMap::new();
    counts.insert("cancelled_queued".to_owned(), 1);
    counts.insert("claimed_head".to_owned(), 1);
    report(target, "a_queued_turn_is_cancelled_or_claimed", &counts);
}

/// A holder process with 5 messages queued behind it is killed with
/// SIGKILL: nothing starts while its lease lives; after the TTL a recovery
/// worker takes the orphan over, ends it, and drains the queue through
/// handoffs, every message once and in order.
pub async fn a_killed_holders_queue_drains_after_takeover(target: &Target, holder: &Holder) {
    let gate = target.gate(short_ttl()).await;
    let (user, session) = ("queue-kill-user", "queue-kill-session");
    let mut child = holder
        .command()
        .arg(&target.store_url)
        .arg(target.redis_url.as_deref().unwrap_or("-"))
        .args([user, session, "r1"])
        .arg(SHORT_TTL.as_millis().to_string())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the holder reports in time")
        .expect("read the holder")
        .expect("the holder printed a line");
    assert!(
        ready.starts_with("HOLDING "),
        "unexpected holder line {ready:?}"
    );
    let order: Vec<String> = (0..EARLY).map(|i| format!("q{i}")).collect();
    for (i, request) in order.iter().enumerate() {
        let queued = queue(&gate, user, session, request, BusyPolicy::Enqueue).await;
        assert_eq!(queued.position as usize, i + 1);
    }
    child.start_kill().expect("SIGKILL the holder");
    let status = child.wait().await.expect("reap the holder");
    assert!(!status.success(), "the holder was killed, not finished");
    let filter = OrphanFilter::default();
    let deadline = tokio::time::Instant::now() + SHORT_TTL * 10;
    let recovered = loop {
        if let Some(recovered) = gate.claim_orphan(&filter).await.expect("claim") {
            break recovered;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the orphan is claimable after its TTL"
        );
        tokio::time::sleep(SHORT_TTL / 4).await;
    };
    assert!(
        recovered.turn.is_takeover(),
        "the killed holder's turn comes first"
    );
    assert_eq!(request_of(&recovered.payload), "r1");
    recovered.turn.succeed(&json!("r1")).await.expect("ended");
    assert_eq!(
        drain(&gate, session).await,
        order,
        "drained once each, in order"
    );
    replays(&gate, user, session, "r1", TurnState::Succeeded).await;
    let mut counts = BTreeMap::new();
    counts.insert("drained_after_takeover".to_owned(), order.len());
    report(
        target,
        "a_killed_holders_queue_drains_after_takeover",
        &counts,
    );
}

/// Rounds of each race in [`queue_races_cancel_supersede_and_handoff`].
const RACE_ROUNDS: usize = 20;

/// Three races, `RACE_ROUNDS` rounds each, every pair released by a
/// barrier: (1) the handoff of a queue's only message races its cancel —
/// the message either ends `cancelled` and never starts, or starts and is
/// asked to stop (never both "cancelled" and started); (2) a `supersede`,
/// a repeat of a queued message and that message's cancel race — every
/// answer is a protocol answer (never `corrupt` or an outage), and exactly
/// the superseder waits after; (3) the handoff races a `supersede` — the
/// handoff never returns nothing while a message waits on a free session.
pub async fn queue_races_cancel_supersede_and_handoff(target: &Target) {
    let gate = target.gate(config()).await;
    let user = "queue-race-user";
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for round in 0..RACE_ROUNDS {
        let session = format!("race-cancel-{round}");
        let holder = must_start(&gate, user, &session, "holder").await;
        let queued = queue(&gate, user, &session, "q", BusyPolicy::Enqueue).await;
        holder.succeed(&json!("held")).await.expect("ended");
        let (taken, cancelled) = {
            let (g1, g2) = (gate.clone(), gate.clone());
            let id = session_id(&session);
            let turn_id = queued.turn_id.clone();
            let both = storm(2, move |i| {
                let (g1, g2, id, turn_id) = (g1.clone(), g2.clone(), id.clone(), turn_id.clone());
                async move {
                    if i == 0 {
                        (Some(g1.take_next(&id).await.expect("take next")), None)
                    } else {
                        (
                            None,
                            Some(g2.request_cancel(&turn_id).await.expect("cancel")),
                        )
                    }
                }
            })
            .await;
            let mut both = both.into_iter();
            let (taken, _) = both.next().expect("the handoff");
            let (_, cancelled) = both.next().expect("the cancel");
            (
                taken.flatten(),
                cancelled.flatten().expect("the turn exists"),
            )
        };
        match taken {
            Some(next) => {
                assert_eq!(
                    cancelled.state,
                    TurnState::Running,
                    "started, then asked to stop"
                );
                assert!(cancelled.cancel_requested_at_ms.is_some());
                next.turn
                    .end_cancelled(&json!("stopped"))
                    .await
                    .expect("ended");
                *counts.entry("cancel_after_start".to_owned()).or_default() += 1;
            }
            None => {
                assert_eq!(cancelled.state, TurnState::Cancelled, "{cancelled:?}");
                replays(&gate, user, &session, "q", TurnState::Cancelled).await;
                *counts.entry("cancelled_queued".to_owned()).or_default() += 1;
            }
        }
    }
    for round in 0..RACE_ROUNDS {
        let session = format!("race-supersede-{round}");
        let holder = must_start(&gate, user, &session, "holder").await;
        let mut ids = Vec::new();
        for i in 0..4 {
            ids.push(
                queue(&gate, user, &session, &format!("q{i}"), BusyPolicy::Enqueue)
                    .await
                    .turn_id,
            );
        }
        let victim = ids[3].clone();
        let answers = storm(3, |i| {
            let (gate, session, victim) = (gate.clone(), session.clone(), victim.clone());
            async move {
                let class = match i {
                    0 => gate
                        .begin_on_busy(
                            &command(user, &session, "newest"),
                            policy(BusyPolicy::Supersede),
                        )
                        .await
                        .map(|(begun, _)| begun_class(&begun)),
                    1 => gate
                        .begin(user, &session, "q3", &json!({"text": "q3"}))
                        .await
                        .map(|begun| begun_class(&begun)),
                    _ => gate
                        .request_cancel(&victim)
                        .await
                        .map(|view| format!("cancel:{:?}", view.map(|v| v.state))),
                };
                class.unwrap_or_else(|error| panic!("round {i}: {error}"))
            }
        })
        .await;
        for class in answers {
            *counts.entry(class).or_default() += 1;
        }
        let view = gate
            .store()
            .session(&session_id(&session))
            .await
            .expect("view")
            .expect("session");
        let waiting: Vec<String> = view
            .queue
            .iter()
            .map(|e| e.client_request_id.to_string())
            .collect();
        assert_eq!(waiting, ["newest"], "only the superseder waits");
        holder.succeed(&json!("held")).await.expect("ended");
        assert_eq!(drain(&gate, &session).await, ["newest"]);
    }
    let mut stranded = 0;
    for round in 0..RACE_ROUNDS {
        let session = format!("race-handoff-{round}");
        let holder = must_start(&gate, user, &session, "holder").await;
        queue(&gate, user, &session, "q", BusyPolicy::Enqueue).await;
        holder.succeed(&json!("held")).await.expect("ended");
        let results = storm(2, |i| {
            let (gate, session) = (gate.clone(), session.clone());
            async move {
                if i == 0 {
                    gate.take_next(&session_id(&session))
                        .await
                        .expect("take next")
                        .map(|next| next.turn)
                } else {
                    gate.begin_on_busy(
                        &command(user, &session, "newest"),
                        policy(BusyPolicy::Supersede),
                    )
                    .await
                    .expect("supersede");
                    None
                }
            }
        })
        .await;
        let taken = results.into_iter().flatten().next();
        let view = gate
            .store()
            .session(&session_id(&session))
            .await
            .expect("view")
            .expect("session");
        if taken.is_none() && view.holder.is_none() && !view.queue.is_empty() {
            stranded += 1;
        }
        if let Some(turn) = taken {
            turn.succeed(&json!("ran")).await.expect("ended");
        }
        drain(&gate, &session).await;
    }
    assert_eq!(
        stranded, 0,
        "a handoff returned nothing while a message waited on a free session"
    );
    report(target, "queue_races_cancel_supersede_and_handoff", &counts);
}

/// What a begin answered, as a class for the report.
fn begun_class(begun: &Begun) -> String {
    match begun {
        Begun::Started(_) => "started".to_owned(),
        Begun::Replay(view) => format!("replay:{}", view.state.as_str()),
        Begun::Queued(_) => "queued".to_owned(),
    }
}

/// What a queue must not do: a retry of an earlier failed request does not
/// jump a waiting queue (it is `session_busy` naming the head, and the
/// handoff still gets the head); an `interrupt` never cancels a queued
/// message (it waits behind the queue); superseded turns are swept with
/// the rest after the result retention.
pub async fn queue_is_not_jumped_interrupted_or_kept(target: &Target) {
    let gate = target.gate(config()).await;
    let user = "queue-rules-user";
    let mut counts = BTreeMap::new();

    let session = "queue-restart";
    let failed = must_start(&gate, user, session, "r").await;
    failed
        .fail(&json!({"code": "boom"}), true)
        .await
        .expect("failed");
    let holder = must_start(&gate, user, session, "holder").await;
    let head = queue(&gate, user, session, "q", BusyPolicy::Enqueue).await;
    holder.succeed(&json!("held")).await.expect("ended");
    let jumped = gate
        .begin(user, session, "r", &json!({"text": "r"}))
        .await
        .map(|begun| begun_class(&begun))
        .expect_err("a restart does not jump the queue");
    assert_eq!(jumped.kind(), ErrorKind::SessionBusy, "{jumped}");
    assert_eq!(jumped.active_turn_id(), Some(head.turn_id.as_str()));
    assert_eq!(drain(&gate, session).await, ["q"]);
    counts.insert("restart_waited".to_owned(), 1);

    let session = "queue-interrupt";
    let holder = must_start(&gate, user, session, "holder").await;
    let mut queued = Vec::new();
    for i in 0..3 {
        queued.push(
            queue(&gate, user, session, &format!("q{i}"), BusyPolicy::Enqueue)
                .await
                .turn_id,
        );
    }
    // Without a lease layer the first busy answer names the live holder,
    // which is interrupted; with one the rows cannot show the holder live
    // and the answer names the queue's head, so nothing is interrupted and
    // the holder ends by itself. Either way no queued message is touched.
    let stopping = tokio::spawn(async move {
        let signal = holder.cancellation();
        let asked = tokio::time::timeout(Duration::from_secs(5), signal.cancelled()).await;
        if asked.is_ok() {
            holder
                .end_cancelled(&json!("stopped"))
                .await
                .expect("ended");
        } else {
            holder.succeed(&json!("held")).await.expect("ended");
        }
    });
    let interrupt = OnBusy::new(BusyPolicy::Interrupt, Some(1_500)).expect("bound");
    let answer = gate
        .begin_on_busy(&command(user, session, "interrupter"), interrupt)
        .await
        .map(|(begun, _)| begun_class(&begun));
    stopping.await.expect("the holder was interrupted");
    let error = answer.expect_err("the interrupter waits behind the queue");
    assert_eq!(error.kind(), ErrorKind::SessionBusy, "{error}");
    for turn_id in &queued {
        let view = gate
            .store()
            .turn(turn_id)
            .await
            .expect("view")
            .expect("turn");
        assert_eq!(
            view.state,
            TurnState::Queued,
            "an interrupt cancelled a queued message"
        );
    }
    assert_eq!(drain(&gate, session).await, ["q0", "q1", "q2"]);
    counts.insert("queue_kept_by_interrupt".to_owned(), queued.len());

    let retention = agentgate::limits::MIN_RETENTION;
    let swept = target
        .gate(agentgate::Config {
            result_retention: retention,
            ..config()
        })
        .await;
    let session = "queue-sweep";
    let holder = must_start(&swept, user, session, "holder").await;
    let superseded = queue(&swept, user, session, "old", BusyPolicy::Enqueue).await;
    queue(&swept, user, session, "new", BusyPolicy::Supersede).await;
    holder.succeed(&json!("held")).await.expect("ended");
    assert_eq!(drain(&swept, session).await, ["new"]);
    tokio::time::sleep(retention + Duration::from_millis(1_100)).await;
    for _ in 0..10 {
        let report = swept.store().sweep().await.expect("sweep");
        if report.turns == 0 && report.sessions == 0 {
            break;
        }
    }
    let kept = swept.store().turn(&superseded.turn_id).await.expect("view");
    assert!(
        kept.is_none(),
        "a superseded turn outlived the retention: {kept:?}"
    );
    counts.insert("superseded_swept".to_owned(), 1);
    report(target, "queue_is_not_jumped_interrupted_or_kept", &counts);
}

/// Held sessions one user's storm queues across.
const USER_SESSIONS: usize = 3;

/// Enqueues released together across them: more than the user's bound,
/// fewer than the sessions' bounds together, so only the user's bound
/// refuses.
const USER_STORM: usize = agentgate::limits::MAX_USER_QUEUE as usize + 50;

/// One user holds three sessions, and 250 enqueues behind a barrier are
/// spread over them (84, 83, 83: below each session's bound of 100).
/// Exactly [`agentgate::limits::MAX_USER_QUEUE`] (200) are queued and the
/// rest refused `queue_full` with a retry-after: the count is taken under
/// the user's lock, so concurrent begins in different sessions never
/// overshoot it. The sessions' views list exactly the queued ones, and
/// another user is not affected.
pub async fn a_users_queues_are_bounded_across_sessions(target: &Target) {
    let gate = target.gate(config()).await;
    let user = "queue-hoarder";
    let sessions: Vec<String> = (0..USER_SESSIONS).map(|i| format!("hoard-{i}")).collect();
    let mut holders = Vec::new();
    for session in &sessions {
        holders.push(must_start(&gate, user, session, "holder").await);
    }
    let answers = storm(USER_STORM, |i| {
        let gate = gate.clone();
        let session = sessions[i % USER_SESSIONS].clone();
        async move {
            gate.begin_on_busy(
                &command(user, &session, &format!("m{i:03}")),
                policy(BusyPolicy::Enqueue),
            )
            .await
            .map(|(begun, _)| begun)
        }
    })
    .await;
    let (mut queued, mut refused) = (0, 0);
    for answer in answers {
        match answer {
            Ok(Begun::Queued(_)) => queued += 1,
            Ok(other) => panic!("an enqueue on a held session did not queue: {other:?}"),
            Err(error) => {
                assert_eq!(error.kind(), ErrorKind::QueueFull, "{error}");
                assert!(error.retry_after().is_some_and(|r| !r.is_zero()));
                refused += 1;
            }
        }
    }
    let bound = agentgate::limits::MAX_USER_QUEUE as usize;
    assert_eq!(queued, bound, "exactly the user's bound is queued");
    assert_eq!(refused, USER_STORM - bound);
    let mut listed = 0;
    for session in &sessions {
        let view = gate
            .store()
            .session(&session_id(session))
            .await
            .expect("view")
            .expect("session");
        listed += view.queue.len();
    }
    assert_eq!(
        listed, bound,
        "the sessions' queues hold what was answered queued"
    );

    // Another user still queues.
    let other = must_start(&gate, "queue-neighbour", "neighbour", "holder").await;
    queue(
        &gate,
        "queue-neighbour",
        "neighbour",
        "n1",
        BusyPolicy::Enqueue,
    )
    .await;
    other.succeed(&json!("held")).await.expect("ended");
    for holder in holders {
        holder.succeed(&json!("held")).await.expect("ended");
    }
    let mut counts = BTreeMap::new();
    counts.insert("queued".to_owned(), queued);
    counts.insert("queue_full".to_owned(), refused);
    counts.insert("listed".to_owned(), listed);
    report(
        target,
        "a_users_queues_are_bounded_across_sessions",
        &counts,
    );
}
