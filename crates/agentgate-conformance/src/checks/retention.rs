//! Retention of what is not a finished turn: an expired running turn (its
//! holder crashed), a turn awaiting a confirmation nobody gave, and the
//! sessions they leave behind are swept by the settings of `Config`
//! (`orphan_grace`, `result_retention`, `confirmation_ttl`), in Redis mode
//! too, with their event logs, while a live turn (and its log), its
//! session and the user's cap override stay.

use std::collections::BTreeMap;
use std::time::Duration;

use agentgate::{Config, ToolName, TurnState};
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{
    BeginCommand, BeginOutcome, LeaseRef, NewEvent, SweepReport, ToolCall,
};
use agentgate_core::store::all_executions;
use serde_json::json;
use tokio::time::Instant;

use super::{must_start, report};
use crate::Target;

/// The crashed holder's lease.
const TTL: Duration = Duration::from_millis(200);

/// Orphan grace and result retention: the shortest each may be.
const GRACE: Duration = agentgate_core::limits::MIN_ORPHAN_GRACE;
const RETENTION: Duration = agentgate_core::limits::MIN_RETENTION;

/// Longer than the retention, so that "kept for `confirmation_ttl` plus
/// `result_retention`" differs measurably from "kept for the retention".
const CONFIRMATION_TTL: Duration = Duration::from_secs(2);

/// Margin added to every wait, for store round trips.
const MARGIN: Duration = Duration::from_millis(300);

const USER: &str = "retain-user";

fn add(total: &mut SweepReport, report: &SweepReport) {
    total.abandoned += report.abandoned;
    total.turns += report.turns;
    total.executions += report.executions;
    total.events += report.events;
    total.sessions += report.sessions;
}

/// A user (cap override 3) has three sessions: `crashed` runs a turn
/// straight on the store whose holder crashes mid-tool, `pending` ends its
/// turn awaiting a confirmation nobody gives, `live` holds a turn with a
/// watchdog (on a gate with a long TTL) throughout.
///
/// - Right away, and one TTL later (the crashed lease expired, its grace
///   not run out), a sweep abandons and deletes nothing.
/// - After the grace, a sweep abandons the crashed turn (kept as
///   `abandoned`), and deletes nothing else: the pending turn ended longer
///   than `result_retention` ago but is kept for `confirmation_ttl` plus
///   `result_retention`.
/// - After the retention of both, sweeps delete both turns, the crashed
///   turn's executions and both sessions; the live turn, its session, its
///   permit and the user's cap override (configuration, not a record) stay.
pub async fn retention_sweeps_expired_turns_and_sessions(target: &Target) {
    let config = Config {
        lease_ttl: TTL,
        orphan_grace: GRACE,
        result_retention: RETENTION,
        confirmation_ttl: CONFIRMATION_TTL,
        // No background sweep interferes with the counts below.
        sweep_interval: Duration::from_secs(3600),
        ..Config::default()
    };
    let gate = target.gate(config.clone()).await;
    let long = target
        .gate(Config {
            lease_ttl: Duration::from_secs(30),
            ..config
        })
        .await;
    let store = gate.store();
    let user = UserId::new(USER).expect("id");
    store.set_user_cap(&user, Some(3)).await.expect("override");

    let live = must_start(&long, USER, "retain-live", "r").await;
    // Each turn logs events: they go with their turn, and only then.
    live.emit_all(&[("live", &json!(1)), ("live", &json!(2))])
        .await
        .expect("live events");

    let pending = must_start(&gate, USER, "retain-pending", "r").await;
    let pending_id = pending.id().clone();
    pending
        .emit_all(&[
            ("asked", &json!(1)),
            ("asked", &json!(2)),
            ("asked", &json!(3)),
        ])
        .await
        .expect("pending events");
    // The pending turn's ending lands between these two instants.
    let pending_asked = Instant::now();
    pending
        .await_confirmation(&json!({"amount": 1}))
        .await
        .expect("await");
    let pending_ended = Instant::now();

    let BeginOutcome::Started(crashed) = store
        .begin(
            &BeginCommand::new(
                user.clone(),
                SessionId::new("retain-crashed").expect("id"),
                ClientRequestId::new("r").expect("id"),
                &json!({"text": "r"}),
                None,
            )
            .expect("command"),
        )
        .await
        .expect("begin")
    else {
        panic!("a fresh request starts");
    };
    let held = LeaseRef {
        turn_id: crashed.turn_id.clone(),
        token: crashed.lease_token.clone(),
    };
    store
        .claim_tool(
            &held,
            &ToolCall::new(ToolName::new("book").expect("name"), &json!({"a": 1})).expect("call"),
        )
        .await
        .expect("claim");
    store
        .append_events(
            &held,
            &[NewEvent::new("crashed", &json!(1)).expect("event")],
        )
        .await
        .expect("crashed event");
    let crashed_granted = Instant::now();
    // The holder crashes here: no heartbeat, no ending, no release.

    let at_once = store.sweep().await.expect("sweep");
    assert_eq!(at_once, SweepReport::default(), "nothing is due at once");
    tokio::time::sleep_until(crashed_granted + TTL + MARGIN).await;
    // The lease expired (on Redis, this listing also records when the turn
    // was first found unheld), the grace has not run out.
    let expired = store.sweep().await.expect("sweep");
    assert_eq!(
        expired,
        SweepReport::default(),
        "an expired turn is not abandoned before its grace"
    );
    let orphan_seen = Instant::now();

    tokio::time::sleep_until(orphan_seen + GRACE + MARGIN).await;
    let abandoning = store.sweep().await.expect("sweep");
    let abandoned_at = Instant::now();
    assert!(
        pending_asked.elapsed() < CONFIRMATION_TTL + RETENTION,
        "the machine was too slow for this check: {:?} since the confirmation was asked",
        pending_asked.elapsed()
    );
    assert_eq!(abandoning.abandoned, 1, "the crashed turn is abandoned");
    assert_eq!(
        (
            abandoning.turns,
            abandoning.executions,
            abandoning.events,
            abandoning.sessions
        ),
        (0, 0, 0, 0),
        "nothing is deleted yet: {abandoning:?}"
    );
    let kept_events = store
        .events(&crashed.turn_id, 0, 10)
        .await
        .expect("events")
        .expect("kept");
    assert_eq!(
        kept_events.events.len(),
        1,
        "an abandoned turn keeps its log"
    );
    let view = store
        .turn(&crashed.turn_id)
        .await
        .expect("view")
        .expect("kept");
    assert_eq!(view.state, TurnState::Abandoned);
    let kept = store.turn(&pending_id).await.expect("view").expect("kept");
    assert_eq!(
        kept.state,
        TurnState::AwaitingConfirmation,
        "kept past result_retention while its confirmation_ttl runs"
    );

    let due = (abandoned_at + RETENTION).max(pending_ended + CONFIRMATION_TTL + RETENTION);
    tokio::time::sleep_until(due + MARGIN).await;
    let mut swept = SweepReport::default();
    for _ in 0..5 {
        let report = store.sweep().await.expect("sweep");
        add(&mut swept, &report);
        if report == SweepReport::default() {
            break;
        }
    }
    assert_eq!(
        (
            swept.abandoned,
            swept.turns,
            swept.executions,
            swept.events,
            swept.sessions
        ),
        (0, 2, 1, 4, 2),
        "both turns, the crashed turn's execution, both turns' events and both sessions: {swept:?}"
    );
    assert!(store
        .events(&crashed.turn_id, 0, 10)
        .await
        .expect("events")
        .is_none());
    assert!(store.turn(&crashed.turn_id).await.expect("view").is_none());
    assert!(store.turn(&pending_id).await.expect("view").is_none());
    assert!(all_executions(store.as_ref(), &crashed.turn_id)
        .await
        .expect("executions")
        .is_empty());
    for session in ["retain-crashed", "retain-pending"] {
        let view = store
            .session(&SessionId::new(session).expect("id"))
            .await
            .expect("view");
        assert!(view.is_none(), "session {session} is swept");
    }
    let live_session = store
        .session(live.session_id())
        .await
        .expect("view")
        .expect("the live session is kept");
    assert_eq!(
        live_session.holder.map(|h| h.turn_id),
        Some(live.id().clone())
    );
    assert!(store.turn(live.id()).await.expect("view").is_some());
    let live_events = store
        .events(live.id(), 0, 10)
        .await
        .expect("events")
        .expect("the live turn");
    assert_eq!(live_events.events.len(), 2, "the live turn's log stays");
    let user_view = store.user(&user).await.expect("user");
    assert_eq!(user_view.live_turns, 1, "only the live turn holds a permit");
    assert_eq!(user_view.max_turns_per_user, 3, "the cap override stays");
    live.succeed(&json!("ok")).await.expect("succeed");

    let mut counts = BTreeMap::new();
    counts.insert("abandoned".to_owned(), abandoning.abandoned);
    counts.insert("swept_turns".to_owned(), swept.turns);
    counts.insert("swept_executions".to_owned(), swept.executions);
    counts.insert("swept_events".to_owned(), swept.events);
    counts.insert("swept_sessions".to_owned(), swept.sessions);
    counts.insert("kept_live".to_owned(), 1);
    let counts = counts
        .into_iter()
        .map(|(k, v)| (k, usize::try_from(v).expect("small")))
        .collect();
    report(
        target,
        "retention_sweeps_expired_turns_and_sessions",
        &counts,
    );
}
