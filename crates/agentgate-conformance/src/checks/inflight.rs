//! Fencing (docs/protocol.md §4.5) under a race: the old holder's writes in flight while a
//! takeover lands. Each round, a holder that stopped heartbeating fires tool
//! completions, tool failures, heartbeats and endings spread around the
//! instant its lease expires, while a retry polls for the takeover and the
//! taker claims and completes the same tools at once. No old write may land
//! after the takeover's grant.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Begun, Config, ErrorKind, Fence, PreviousOutcome, ToolName, ToolState, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, ExecutionId, SessionId, TurnId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome, Ending, LeaseRef, ToolCall, ToolClaim};
use agentgate_core::store::all_executions;
use agentgate_core::store::{Completion, Store};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::{report, storm};
use crate::Target;

/// Rounds; each is a fresh session.
const ROUNDS: usize = 30;

/// The old holder's lease: short, so that 30 rounds stay fast.
const TTL: Duration = Duration::from_millis(300);

/// The taker's lease (its grants come from a gate with this TTL).
const TAKER_TTL: Duration = Duration::from_secs(5);

/// Executions the old holder claims: the first half it completes, the
/// second half it fails, in flight.
const EXECUTIONS: usize = 6;

/// Store-clock milliseconds are whole: a bound is checked with this slack.
const CLOCK_SLACK: Duration = Duration::from_millis(2);

/// Where the payload of a round's request comes from.
fn payload(round: usize) -> Value {
    json!({"text": "r1", "round": round})
}

fn tool_name(e: usize) -> String {
    format!("t{e}")
}

fn tool_args(round: usize, e: usize) -> Value {
    json!({"round": round, "e": e})
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shot {
    Complete(usize),
    Fail(usize),
    Heartbeat,
    EndSucceed,
    EndFail,
}

/// The old holder's writes, each with its firing time in ms relative to
/// the moment its lease expires at the earliest. Heartbeats fire from that
/// moment on (one landing earlier would renew the lease and postpone the
/// race past every other write); endings fire last.
const SHOTS: [(Shot, i64); 12] = [
    (Shot::Complete(0), -30),
    (Shot::Fail(3), -20),
    (Shot::Complete(1), -10),
    (Shot::Fail(4), 0),
    (Shot::Heartbeat, 0),
    (Shot::Complete(2), 10),
    (Shot::Heartbeat, 10),
    (Shot::Fail(5), 20),
    (Shot::Heartbeat, 20),
    (Shot::EndSucceed, 30),
    (Shot::Heartbeat, 30),
    (Shot::EndFail, 40),
];

/// One old write as fired.
struct Fired {
    shot: Shot,
    sent: Instant,
    landed: bool,
}

/// What the taker saw when it claimed an execution.
#[derive(Debug, PartialEq)]
enum Seen {
    Cached(Value),
    Execute(Option<PreviousOutcome>),
}

/// The retry that polls for the takeover.
enum Taker {
    Started {
        answered: Instant,
        fence: Fence,
        turn_id: TurnId,
        seen: Vec<Seen>,
        /// Errors of the taker's own writes (none expected).
        errors: Vec<String>,
    },
    Replayed(Box<agentgate::TurnView>),
}

enum Out {
    Taker(Box<Taker>),
    Shot(Fired),
}

async fn fire(
    store: &Arc<dyn Store>,
    old: &LeaseRef,
    executions: &[ExecutionId],
    shot: Shot,
) -> Result<(), agentgate::Error> {
    let json = |what: &str, value: Value| CanonicalJson::new(what, &value).expect("json");
    match shot {
        Shot::Complete(e) => store
            .complete_tool(
                old,
                &executions[e],
                Completion::Result(json("result", json!({"old": e}))),
            )
            .await
            .map(drop),
        Shot::Fail(e) => {
            store
                .fail_tool(old, &executions[e], &json("error", json!({"old": e})))
                .await
        }
        Shot::Heartbeat => store.heartbeat(old).await.map(drop),
        Shot::EndSucceed => store
            .end_turn(
                old,
                &Ending::Succeed {
                    response: json("response", json!("old")),
                },
            )
            .await
            .map(drop),
        Shot::EndFail => store
            .end_turn(
                old,
                &Ending::Fail {
                    error: json("error", json!("old")),
                    retryable: false,
                },
            )
            .await
            .map(drop),
    }
}

async fn take_over(gate: agentgate::Gate, session: String, round: usize) -> Taker {
    let deadline = Instant::now() + Duration::from_secs(15);
    let turn = loop {
        match gate
            .begin("inflight-user", &session, "r1", &payload(round))
            .await
        {
            Ok(Begun::Started(turn)) => break turn,
            Ok(Begun::Replay(view)) => return Taker::Replayed(Box::new(view)),
            Ok(Begun::Queued(queued)) => panic!("round {round}: a plain begin queued {queued:?}"),
            Err(error)
                if error.kind() == ErrorKind::RequestInFlight && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(error) => panic!("round {round}: the retry got {error}"),
        }
    };
    let answered = Instant::now();
    let mut seen = Vec::new();
    let mut errors = Vec::new();
    // The taker's own writes, at once: they race the old holder's later shots.
    for e in 0..EXECUTIONS {
        match turn.tool(&tool_name(e), &tool_args(round, e)).await {
            Ok(agentgate::ToolStep::Cached(value)) => seen.push(Seen::Cached(value)),
            Ok(agentgate::ToolStep::Execute(execution)) => {
                seen.push(Seen::Execute(execution.previous_outcome()));
                if let Err(error) = execution.complete(&json!({"taker": e})).await {
                    errors.push(format!("complete t{e}: {error}"));
                }
            }
            Err(error) => {
                errors.push(format!("claim t{e}: {error}"));
                seen.push(Seen::Execute(None));
            }
        }
    }
    let fence = turn.fence();
    let turn_id = turn.id().clone();
    if let Err(error) = turn.succeed(&json!("taker")).await {
        errors.push(format!("succeed: {}", error.error));
    }
    Taker::Started {
        answered,
        fence,
        turn_id,
        seen,
        errors,
    }
}

/// The old holder's setup: claims the round's tools and renews its lease
/// once; the executions and when the renewal was sent, or `None` when the
/// lease ran out first (only `lease_lost` is tolerated).
async fn set_up(
    store: &dyn Store,
    old: &LeaseRef,
    round: usize,
) -> Option<(Vec<ExecutionId>, Instant)> {
    let lost = |error: agentgate_core::error::Error| {
        assert_eq!(error.kind(), ErrorKind::LeaseLost, "setup: {error}");
    };
    let mut executions = Vec::new();
    for e in 0..EXECUTIONS {
        let call = ToolCall::new(
            ToolName::new(tool_name(e)).expect("name"),
            &tool_args(round, e),
        )
        .expect("call");
        match store.claim_tool(old, &call).await {
            Ok(ToolClaim::Execute { execution_id, .. }) => executions.push(execution_id),
            Ok(other) => panic!("a first claim executes, got {other:?}"),
            Err(error) => {
                lost(error);
                return None;
            }
        }
    }
    let renewed = Instant::now();
    match store.heartbeat(old).await {
        Ok(_) => Some((executions, renewed)),
        Err(error) => {
            lost(error);
            None
        }
    }
}

/// 30 rounds. Each: a holder begins straight on the store, claims six
/// tools, heartbeats once and stops. Behind a barrier, a retry polls
/// `begin` every millisecond from just before the lease can expire, and
/// twelve tasks fire the old holder's writes (three completions, three
/// failures, four heartbeats, two endings) spread from 30 ms before to
/// 40 ms after that moment (shifted per round). The taker, once granted,
/// claims and completes the six tools and ends the turn at once.
///
/// Every old write either lands or is refused `lease_lost`. Each landed one
/// must have landed before the takeover's grant, checked against what the
/// taker and the store saw: a landed write was not sent after the grant
/// came back; a landed ending means the retry replays instead of taking
/// over; a landed heartbeat renewed the lease for a full TTL, so the grant
/// cannot come back sooner; a landed completion is the taker's cached
/// result; a landed failure makes the taker's claim `failed`, a refused
/// one `unknown`. The store then holds the taker's fence on the turn and
/// on every execution it ran, and the taker's results. The count of old
/// writes that landed after the takeover is asserted to be 0.
pub async fn old_writes_in_flight_during_takeover(target: &Target) {
    let gate = target
        .gate(Config {
            lease_ttl: TTL,
            ..Config::default()
        })
        .await;
    // The taker runs on a gate of its own whose grants live far longer, so
    // that on a loaded machine its own lease never runs out mid-round: a
    // refusal of the taker's writes can then only be the old holder's doing.
    let taker_gate = target
        .gate(Config {
            lease_ttl: TAKER_TTL,
            ..Config::default()
        })
        .await;
    let store = Arc::clone(gate.store());
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut after_takeover: Vec<String> = Vec::new();
    // A round whose holder lost its 300 ms lease before its setup was done
    // (a claim or the heartbeat refused on a loaded machine) attacks
    // nothing, so it is set up again on a fresh session, at most
    // `ROUNDS` times in all.
    let mut redone = 0;
    let mut round = 0;
    while round < ROUNDS {
        let session = format!("inflight-session-{round}-{redone}");
        let command = BeginCommand::new(
            UserId::new("inflight-user").expect("id"),
            SessionId::new(&session).expect("id"),
            ClientRequestId::new("r1").expect("id"),
            &payload(round),
            None,
        )
        .expect("command");
        let BeginOutcome::Started(grant) = store.begin(&command).await.expect("begin") else {
            panic!("a fresh request starts");
        };
        let old = LeaseRef {
            turn_id: grant.turn_id.clone(),
            token: grant.lease_token.clone(),
        };
        let Some((executions, renewed)) = set_up(store.as_ref(), &old, round).await else {
            redone += 1;
            assert!(
                redone <= ROUNDS,
                "{redone} rounds lost their lease during setup"
            );
            continue;
        };
        // The lease expires no sooner than this.
        let expiry = renewed + TTL;
        let shift = (i64::try_from(round % 7).expect("small") - 3) * 8;
        let at = move |offset_ms: i64| {
            let ms = offset_ms + shift;
            let magnitude = Duration::from_millis(ms.unsigned_abs());
            if ms < 0 {
                expiry - magnitude
            } else {
                expiry + magnitude
            }
        };
        let executions = Arc::new(executions);
        let outs = storm(SHOTS.len() + 1, |i| {
            let (gate, store, old, executions, session) = (
                taker_gate.clone(),
                Arc::clone(&store),
                old.clone(),
                Arc::clone(&executions),
                session.clone(),
            );
            async move {
                if i == 0 {
                    tokio::time::sleep_until(at(-60)).await;
                    return Out::Taker(Box::new(take_over(gate, session, round).await));
                }
                let (shot, offset) = SHOTS[i - 1];
                tokio::time::sleep_until(at(offset)).await;
                let sent = Instant::now();
                let result = fire(&store, &old, &executions, shot).await;
                if let Err(error) = &result {
                    assert_eq!(
                        error.kind(),
                        ErrorKind::LeaseLost,
                        "an old {shot:?} was refused with {error}"
                    );
                }
                Out::Shot(Fired {
                    shot,
                    sent,
                    landed: result.is_ok(),
                })
            }
        })
        .await;
        let mut outs = outs.into_iter();
        let Some(Out::Taker(taker)) = outs.next() else {
            unreachable!("task 0 is the taker")
        };
        let fired: Vec<Fired> = outs
            .map(|out| match out {
                Out::Shot(fired) => fired,
                Out::Taker(_) => unreachable!("one taker"),
            })
            .collect();
        let landed = fired.iter().filter(|f| f.landed).count();
        *counts.entry("old_writes_landed".to_owned()).or_insert(0) += landed;
        *counts.entry("old_writes_refused".to_owned()).or_insert(0) += fired.len() - landed;
        let endings: Vec<&Fired> = fired
            .iter()
            .filter(|f| f.landed && matches!(f.shot, Shot::EndSucceed | Shot::EndFail))
            .collect();
        assert!(endings.len() <= 1, "round {round}: two endings landed");
        let mut late = |what: String| after_takeover.push(format!("round {round}: {what}"));
        match *taker {
            Taker::Replayed(view) => {
                // The old holder ended the turn before its lease expired.
                let [ending] = endings[..] else {
                    panic!("round {round}: a replay with no old ending landed: {view:?}");
                };
                match ending.shot {
                    Shot::EndSucceed => {
                        assert_eq!(view.state, TurnState::Succeeded);
                        assert_eq!(view.response, Some(json!("old")));
                    }
                    _ => {
                        assert_eq!(view.state, TurnState::Failed);
                        assert_eq!(view.error, Some(json!("old")));
                    }
                }
                *counts
                    .entry("rounds_ended_by_old_holder".to_owned())
                    .or_insert(0) += 1;
            }
            Taker::Started {
                answered,
                fence,
                turn_id,
                seen,
                errors,
            } => {
                *counts.entry("rounds_taken_over".to_owned()).or_insert(0) += 1;
                assert!(fence > grant.fence, "round {round}: the fence grows");
                // A taker's own write refused: an old write landed on its
                // rows, or (under heavy load) its own lease ran out; either
                // way the store checks below say which, so keep the errors
                // for their messages.
                for error in &errors {
                    late(format!("a taker's write was refused: {error}"));
                }
                for f in fired.iter().filter(|f| f.landed) {
                    if f.sent >= answered {
                        late(format!("{:?} sent after the grant landed", f.shot));
                    }
                    match f.shot {
                        Shot::EndSucceed | Shot::EndFail => {
                            late(format!("{:?} landed and the turn was taken over", f.shot));
                        }
                        Shot::Heartbeat if answered + CLOCK_SLACK < f.sent + TTL => {
                            late(format!(
                                "a heartbeat landed {:?} before the grant came back",
                                answered.saturating_duration_since(f.sent)
                            ));
                        }
                        _ => {}
                    }
                }
                let landed_on = |shot: Shot| fired.iter().any(|f| f.shot == shot && f.landed);
                for (e, saw) in seen.iter().enumerate() {
                    let expected = if e < EXECUTIONS / 2 {
                        if landed_on(Shot::Complete(e)) {
                            Seen::Cached(json!({"old": e}))
                        } else {
                            Seen::Execute(Some(PreviousOutcome::Unknown))
                        }
                    } else if landed_on(Shot::Fail(e)) {
                        Seen::Execute(Some(PreviousOutcome::Failed))
                    } else {
                        Seen::Execute(Some(PreviousOutcome::Unknown))
                    };
                    if *saw != expected {
                        late(format!(
                            "t{e}: the taker saw {saw:?}, expected {expected:?}"
                        ));
                    }
                }
                // The store: the taker's fence and results, nothing of the old
                // holder's after the grant.
                let view = store.turn(&turn_id).await.expect("view").expect("turn");
                assert_eq!(
                    view.state,
                    TurnState::Succeeded,
                    "round {round}: taker errors {errors:?}"
                );
                assert_eq!(view.response, Some(json!("taker")), "round {round}");
                assert_eq!(
                    view.fence, fence,
                    "round {round}: the turn has the new fence"
                );
                let rows = all_executions(store.as_ref(), &turn_id)
                    .await
                    .expect("executions");
                assert_eq!(rows.len(), EXECUTIONS, "round {round}");
                for row in rows {
                    let e = executions
                        .iter()
                        .position(|id| *id == row.execution_id)
                        .expect("an old execution");
                    assert_eq!(row.state, ToolState::Succeeded, "round {round} t{e}");
                    if seen[e] == Seen::Cached(json!({"old": e})) {
                        assert_eq!(row.fence, grant.fence, "round {round} t{e}");
                        assert_eq!(row.result, Some(json!({"old": e})));
                    } else {
                        assert_eq!(row.fence, fence, "round {round} t{e}: the new fence");
                        assert_eq!(row.result, Some(json!({"taker": e})), "round {round} t{e}");
                    }
                }
            }
        }
        *counts.entry("rounds".to_owned()).or_insert(0) += 1;
        round += 1;
    }
    counts.insert("setups_redone".to_owned(), redone);
    counts.insert("landed_after_takeover".to_owned(), after_takeover.len());
    assert!(
        after_takeover.is_empty(),
        "old writes landed after the takeover: {after_takeover:#?}"
    );
    assert!(
        counts.get("rounds_taken_over").copied().unwrap_or(0) > 0,
        "no round raced a takeover: {counts:?}"
    );
    assert!(
        counts.get("old_writes_refused").copied().unwrap_or(0) > 0,
        "no old write was in flight at a takeover: {counts:?}"
    );
    report(target, "old_writes_in_flight_during_takeover", &counts);
}
