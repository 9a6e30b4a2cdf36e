//! Every turn ends (docs/protocol.md §4.10). A running turn whose holder died (its lease
//! expired without an ending) is an orphan: recovery workers claim it like
//! a takeover, exactly once however many race, and fenced against the dead
//! holder; one past its attempts ends `failed`; one nobody claims within the
//! grace ends `abandoned`, freeing its session and permit, and a repeat of
//! its request restarts it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, ErrorKind, OrphanFilter, PreviousOutcome, ToolName, ToolStep, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::limits::MAX_TURN_ATTEMPTS;
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Ending, Grant, JournalOutcome, LeaseRef, ToolCall, ToolClaim,
};
use agentgate_core::store::{Completion, Store};
use serde_json::json;

use super::{report, storm, STORM_TASKS};
use crate::Target;

/// Orphans made for the claim storm.
const ORPHANS: usize = 20;

/// A lease short enough that waiting one out keeps the checks fast, long
/// enough that a loaded machine still holds a claimed lease while it checks.
const ORPHAN_TTL: Duration = Duration::from_millis(600);

/// The storm's lease: its claimants' watchdogs renew every third of it
/// while 100 workers contend, so it is longer than [`ORPHAN_TTL`].
const STORM_TTL: Duration = Duration::from_secs(3);

fn orphan_config() -> Config {
    Config {
        lease_ttl: ORPHAN_TTL,
        // Far above the test's waits: nothing is abandoned by accident.
        orphan_grace: Duration::from_secs(3600),
        max_turns_per_user: 1,
        ..Config::default()
    }
}

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    BeginCommand::new(
        UserId::new(user).expect("id"),
        SessionId::new(session).expect("id"),
        ClientRequestId::new(request).expect("id"),
        &json!({"text": request, "session": session}),
        None,
    )
    .expect("command")
}

fn call(tool: &str, args: serde_json::Value) -> ToolCall {
    ToolCall::new(ToolName::new(tool).expect("name"), &args).expect("call")
}

fn lease(grant: &Grant) -> LeaseRef {
    LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    }
}

/// Starts a turn straight on the store (no watchdog: it will die), claims
/// one tool it leaves mid-call and completes another.
async fn dying_holder(store: &Arc<dyn Store>, index: usize) -> Grant {
    let begun = store
        .begin(&command(
            &format!("orphan-user-{index}"),
            &format!("orphan-session-{index}"),
            "r1",
        ))
        .await
        .expect("begin");
    let BeginOutcome::Started(grant) = begun else {
        panic!("a fresh request starts");
    };
    let held = lease(&grant);
    let ToolClaim::Execute { .. } = store
        .claim_tool(&held, &call("book", json!({"amount": index})))
        .await
        .expect("claim")
    else {
        panic!("a first claim executes");
    };
    let ToolClaim::Execute {
        execution_id: done, ..
    } = store
        .claim_tool(&held, &call("list_categories", json!({"type": "expense"})))
        .await
        .expect("claim")
    else {
        panic!("a first claim executes");
    };
    let result = CanonicalJson::new("result", &json!(["餐饮", index])).expect("json");
    store
        .complete_tool(&held, &done, Completion::Result(result))
        .await
        .expect("complete");
    grant
}

/// 100 recovery workers behind a barrier drain 20 orphans through the
/// library (each claim is a `Turn` whose watchdog keeps its lease): each
/// orphan is claimed exactly once, under a higher fence, with its payload
/// and journal; every write of the dead holders is refused afterwards; the
/// claimants resume and end each turn once.
pub async fn orphan_claim_storm(target: &Target) {
    let config = Config {
        lease_ttl: STORM_TTL,
        ..orphan_config()
    };
    let gate = target.gate(config).await;
    let store = Arc::clone(gate.store());
    let mut dead = BTreeMap::new();
    for index in 0..ORPHANS {
        let grant = dying_holder(&store, index).await;
        dead.insert(grant.turn_id.to_string(), grant);
    }
    // Before the TTL nothing is an orphan.
    let none = gate
        .claim_orphan(&OrphanFilter::default())
        .await
        .expect("claim");
    assert!(none.is_none(), "a live turn was claimed as an orphan");
    tokio::time::sleep(STORM_TTL + Duration::from_millis(100)).await;

    let results = storm(STORM_TASKS, |_| {
        let gate = gate.clone();
        async move {
            let mut mine = Vec::new();
            while let Some(claimed) = gate
                .claim_orphan(&OrphanFilter::default())
                .await
                .expect("claim_orphan")
            {
                mine.push(claimed);
            }
            mine
        }
    })
    .await;
    let all: Vec<_> = results.into_iter().flatten().collect();
    let total = all.len();
    // A claim whose lease ran out before its watchdog's first renewal (an
    // overloaded machine) is an orphan again and may be claimed again: that
    // claim's watchdog has cancelled it, under a lower fence. What must hold
    // is one live claim per orphan.
    let (claims, lost): (Vec<_>, Vec<_>) = all.into_iter().partition(|c| !c.turn.is_cancelled());
    let claimed: BTreeSet<String> = claims.iter().map(|c| c.turn.id().to_string()).collect();
    assert_eq!(
        claims.len(),
        ORPHANS,
        "every orphan has exactly one live claim"
    );
    assert_eq!(claimed.len(), ORPHANS, "no orphan has two live claims");
    for stale in &lost {
        let live = claims
            .iter()
            .find(|c| c.turn.id() == stale.turn.id())
            .expect("a lost claim was claimed again");
        assert!(
            stale.turn.fence() < live.turn.fence(),
            "the newer claim has the higher fence"
        );
        let refused = stale
            .turn
            .heartbeat()
            .await
            .expect_err("a lost claim is fenced");
        assert_eq!(refused.kind(), ErrorKind::LeaseLost);
    }
    assert_eq!(claimed, dead.keys().cloned().collect::<BTreeSet<_>>());
    for claim in &claims {
        let old = &dead[claim.turn.id().as_str()];
        assert!(claim.turn.fence() > old.fence, "fence grows on a claim");
        assert_eq!(claim.turn.attempt(), old.attempt + 1);
        assert!(claim.turn.is_takeover(), "a claim is a takeover");
        assert!(claim.orphaned_for_ms >= 0);
        assert_eq!(claim.payload["session"], json!(old.session_id.as_str()));
        let outcomes: Vec<_> = claim.journal.iter().map(|e| &e.outcome).collect();
        assert_eq!(outcomes.len(), 2, "the journal lists both executions");
        assert!(outcomes.contains(&&JournalOutcome::Unknown));
        assert!(outcomes
            .iter()
            .any(|o| matches!(o, JournalOutcome::Succeeded { result } if result[0] == "餐饮")));
    }
    // While the claims hold live leases, there is nothing left to claim.
    let again = gate
        .claim_orphan(&OrphanFilter::default())
        .await
        .expect("claim");
    assert!(again.is_none(), "a claimed turn was claimed again");

    // The dead holders can change nothing.
    let mut refused = 0;
    for grant in dead.values() {
        let old = lease(grant);
        let heartbeat = store.heartbeat(&old).await.expect_err("dead heartbeat");
        let tool = store
            .claim_tool(&old, &call("book", json!({"amount": 999})))
            .await
            .expect_err("dead claim");
        let ending = store
            .end_turn(
                &old,
                &Ending::Succeed {
                    response: CanonicalJson::new("response", &json!("zombie")).expect("json"),
                },
            )
            .await
            .expect_err("dead ending");
        for error in [heartbeat, tool, ending] {
            assert_eq!(error.kind(), ErrorKind::LeaseLost, "{error}");
            refused += 1;
        }
    }
    // The new holders resume: the interrupted tool is re-run as unknown, the
    // completed one is cached, and the turn ends once.
    let mut resumed = 0;
    for claim in claims {
        let index: usize = claim.payload["session"]
            .as_str()
            .and_then(|s| s.rsplit('-').next())
            .and_then(|n| n.parse().ok())
            .expect("session index");
        match claim
            .turn
            .tool("book", &json!({"amount": index}))
            .await
            .expect("resume claim")
        {
            ToolStep::Execute(execution) => {
                assert_eq!(execution.previous_outcome(), Some(PreviousOutcome::Unknown));
                execution
                    .complete(&json!({"booked": index}))
                    .await
                    .expect("complete");
            }
            ToolStep::Cached(_) => panic!("an interrupted tool is not cached"),
        }
        match claim
            .turn
            .tool("list_categories", &json!({"type": "expense"}))
            .await
            .expect("resume claim")
        {
            ToolStep::Cached(result) => assert_eq!(result[1], json!(index)),
            ToolStep::Execute(_) => panic!("a completed tool is cached"),
        }
        let view = claim.turn.succeed(&json!("resumed")).await.expect("end");
        assert_eq!(view.state, TurnState::Succeeded);
        resumed += 1;
    }
    let mut counts = BTreeMap::new();
    counts.insert("orphans".to_owned(), dead.len());
    counts.insert("workers".to_owned(), STORM_TASKS);
    counts.insert("claims".to_owned(), total);
    counts.insert("live_claims".to_owned(), claimed.len());
    counts.insert("claims_lost_to_expiry".to_owned(), lost.len());
    counts.insert("dead_writes_refused".to_owned(), refused);
    counts.insert("resumed".to_owned(), resumed);
    report(target, "orphan_claim_storm", &counts);
}

/// Filters: a user filter claims only that user's orphans, and an age
/// filter claims nothing younger.
pub async fn orphan_filters(target: &Target) {
    let gate = target.gate(orphan_config()).await;
    let store = Arc::clone(gate.store());
    let first = dying_holder(&store, 0).await;
    let second = dying_holder(&store, 1).await;
    tokio::time::sleep(ORPHAN_TTL + Duration::from_millis(100)).await;
    let too_young = OrphanFilter {
        min_orphaned_ms: 3_600_000,
        ..OrphanFilter::default()
    };
    let young = store.claim_orphan(&too_young).await.expect("claim");
    assert!(young.is_none(), "an age filter claimed a younger orphan");
    let only_second = OrphanFilter {
        user_ids: vec![second.user_id.clone()],
        ..OrphanFilter::default()
    };
    let other_turn = OrphanFilter {
        turn_ids: vec![first.turn_id.clone()],
        ..only_second.clone()
    };
    let nothing = store.claim_orphan(&other_turn).await.expect("claim");
    assert!(nothing.is_none(), "user and turn filters both apply");
    let claimed = store
        .claim_orphan(&only_second)
        .await
        .expect("claim")
        .expect("the second user's orphan");
    assert_eq!(claimed.grant.turn_id, second.turn_id);
    assert!(store
        .claim_orphan(&only_second)
        .await
        .expect("claim")
        .is_none());
    let too_many = OrphanFilter {
        user_ids: (0..=agentgate_core::limits::MAX_ORPHAN_FILTER_IDS)
            .map(|i| UserId::new(format!("u{i}")).expect("id"))
            .collect(),
        ..OrphanFilter::default()
    };
    let error = store.claim_orphan(&too_many).await.expect_err("limit");
    assert_eq!(error.kind(), ErrorKind::InvalidRequest);
    let only_first = OrphanFilter {
        turn_ids: vec![first.turn_id.clone()],
        ..OrphanFilter::default()
    };
    let rest = store
        .claim_orphan(&only_first)
        .await
        .expect("claim")
        .expect("the first user's orphan");
    assert_eq!(rest.grant.turn_id, first.turn_id);
    let mut counts = BTreeMap::new();
    counts.insert("filtered_claims".to_owned(), 2);
    report(target, "orphan_filters", &counts);
}

/// An orphan whose holders keep dying is claimed until its attempts run
/// out; then the claim records it failed (`attempts_exhausted`) and there
/// is nothing left to claim.
pub async fn exhausted_orphan_ends_failed(target: &Target) {
    let config = Config {
        lease_ttl: agentgate_core::limits::MIN_LEASE_TTL,
        ..orphan_config()
    };
    let gate = target.gate(config).await;
    let store = Arc::clone(gate.store());
    let BeginOutcome::Started(first) = store
        .begin(&command("exhaust-user", "exhaust-session", "r1"))
        .await
        .expect("begin")
    else {
        panic!("a fresh request starts");
    };
    let mut fences = vec![first.fence];
    let mut claims = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no exhaustion in 30 s"
        );
        tokio::time::sleep(agentgate_core::limits::MIN_LEASE_TTL + Duration::from_millis(20)).await;
        match store
            .claim_orphan(&OrphanFilter::default())
            .await
            .expect("claim")
        {
            // Each claimed holder dies too.
            Some(claimed) => {
                claims += 1;
                fences.push(claimed.grant.fence);
                assert_eq!(
                    claimed.grant.attempt,
                    u32::try_from(claims + 1).expect("small")
                );
            }
            None => break,
        }
    }
    assert_eq!(
        claims,
        usize::try_from(MAX_TURN_ATTEMPTS - 1).expect("small"),
        "claimed until the attempt limit"
    );
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences grow: {fences:?}"
    );
    let view = store
        .turn(&first.turn_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(view.state, TurnState::Failed);
    assert_eq!(
        view.error.as_ref().map(|e| &e["code"]),
        Some(&json!("attempts_exhausted"))
    );
    let mut counts = BTreeMap::new();
    counts.insert("claims_until_exhausted".to_owned(), claims);
    counts.insert(
        "final_attempt".to_owned(),
        usize::try_from(view.attempt).expect("small"),
    );
    report(target, "exhausted_orphan_ends_failed", &counts);
}

/// An orphan nobody claims is ended `abandoned` by the sweeper once its
/// grace is out (not before), which frees its session and the user's
/// permit; a repeat of its request restarts it, and its interrupted tool
/// comes back as `unknown`.
pub async fn unclaimed_orphan_is_abandoned(target: &Target) {
    let grace = agentgate_core::limits::MIN_ORPHAN_GRACE;
    let config = Config {
        orphan_grace: grace,
        ..orphan_config()
    };
    let gate = target.gate(config).await;
    let store = Arc::clone(gate.store());
    let dead = dying_holder(&store, 7).await;
    let user = dead.user_id.as_str().to_owned();
    // The dead holder takes the user's only permit until its lease expires.
    tokio::time::sleep(ORPHAN_TTL + Duration::from_millis(100)).await;
    let early = store.sweep().await.expect("sweep");
    assert_eq!(early.abandoned, 0, "abandoned before its grace");
    let running = store
        .turn(&dead.turn_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(running.state, TurnState::Running);

    tokio::time::sleep(grace + Duration::from_millis(200)).await;
    let report_after = store.sweep().await.expect("sweep");
    assert_eq!(
        report_after.abandoned, 1,
        "the orphan is abandoned after its grace"
    );
    let view = store
        .turn(&dead.turn_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(view.state, TurnState::Abandoned);
    assert_eq!(
        view.error.as_ref().map(|e| &e["code"]),
        Some(&json!("abandoned"))
    );
    let again = store.sweep().await.expect("sweep");
    assert_eq!(
        again.abandoned, 0,
        "an abandoned turn is not abandoned twice"
    );
    // Its session and the user's permit are free: another session of the
    // same user (cap 1) starts, and the session shows no holder.
    let session = store
        .session(&dead.session_id)
        .await
        .expect("view")
        .expect("session");
    assert!(session.holder.is_none(), "the session is released");
    assert_eq!(store.user(&dead.user_id).await.expect("user").live_turns, 0);
    let BeginOutcome::Started(other) = store
        .begin(&command(&user, "orphan-other-session", "r9"))
        .await
        .expect("begin")
    else {
        panic!("the user's permit is free");
    };
    store
        .end_turn(
            &lease(&other),
            &Ending::Fail {
                error: CanonicalJson::new("error", &json!("done")).expect("json"),
                retryable: false,
            },
        )
        .await
        .expect("end");
    // The dead holder still changes nothing.
    let zombie = store.heartbeat(&lease(&dead)).await.expect_err("zombie");
    assert_eq!(zombie.kind(), ErrorKind::LeaseLost);
    // A repeat of the request restarts it, under a higher fence.
    let BeginOutcome::Started(restart) = store
        .begin(&command(&user, dead.session_id.as_str(), "r1"))
        .await
        .expect("begin")
    else {
        panic!("a repeat of an abandoned request restarts it");
    };
    assert_eq!(restart.turn_id, dead.turn_id);
    assert_eq!(restart.attempt, dead.attempt + 1);
    assert!(restart.fence > dead.fence);
    assert!(!restart.takeover, "a restart is not a takeover");
    match store
        .claim_tool(&lease(&restart), &call("book", json!({"amount": 7})))
        .await
        .expect("claim")
    {
        ToolClaim::Execute {
            previous_outcome, ..
        } => assert_eq!(previous_outcome, Some(PreviousOutcome::Unknown)),
        other => panic!("an interrupted tool re-runs as unknown, got {other:?}"),
    }
    let fences = [dead.fence, other.fence, restart.fence];
    assert!(fences.windows(2).all(|w| w[0] < w[1]));
    let mut counts = BTreeMap::new();
    counts.insert(
        "abandoned".to_owned(),
        usize::try_from(report_after.abandoned).expect("small"),
    );
    counts.insert(
        "restart_attempt".to_owned(),
        usize::try_from(restart.attempt).expect("small"),
    );
    report(target, "unclaimed_orphan_is_abandoned", &counts);
}
