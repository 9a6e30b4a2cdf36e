//! Invariant: a crashed holder's permit comes back by lease expiry alone.
//! A user with cap 1 whose only holder crashed (no ending, no release, no
//! heartbeat) is refused another session until the holder's lease TTL has
//! passed, with a `retry_after` within that TTL, and granted one after it.

use std::collections::BTreeMap;
use std::time::Duration;

use agentgate::{Begun, Config, ErrorKind};
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome, LeaseRef};
use serde_json::json;
use tokio::time::Instant;

use super::{report, storm};
use crate::Target;

/// The crashed holder's lease: short, so the check waits little.
const CRASH_TTL: Duration = Duration::from_millis(400);

/// Other sessions of the same user racing for its one permit, each phase.
const CONTENDERS: usize = 20;

const USER: &str = "permit-user";

/// A user with cap 1 starts a turn straight on the store and crashes (it
/// never heartbeats, ends or releases). Before the TTL, 20 other sessions of
/// the user racing behind a barrier are all refused `user_at_capacity` with
/// a `retry_after` of at most the TTL, and none is granted earlier than one
/// TTL after the crashed begin was sent. After the TTL, 20 more racing
/// sessions get exactly one grant (cap 1) and 19 `user_at_capacity`; the
/// crashed holder's heartbeat is then `lease_lost`.
pub async fn permit_freed_by_lease_expiry_after_a_crash(target: &Target) {
    let gate = target
        .gate(Config {
            lease_ttl: CRASH_TTL,
            max_turns_per_user: 1,
            ..Config::default()
        })
        .await;
    let store = gate.store();
    let command = BeginCommand::new(
        UserId::new(USER).expect("id"),
        SessionId::new("permit-crashed").expect("id"),
        ClientRequestId::new("r1").expect("id"),
        &json!({"text": "r1"}),
        None,
    )
    .expect("command");
    let sent = Instant::now();
    let BeginOutcome::Started(crashed) = store.begin(&command).await.expect("begin") else {
        panic!("a fresh request starts");
    };
    let granted = Instant::now();
    // The holder has crashed: from here on nothing renews or releases it.

    let early = storm(CONTENDERS, |i| {
        let gate = gate.clone();
        async move {
            let result = gate
                .begin(
                    USER,
                    &format!("permit-early-{i}"),
                    "r",
                    &json!({"text": "r"}),
                )
                .await;
            (result, Instant::now())
        }
    })
    .await;
    let mut counts = BTreeMap::new();
    for (result, answered) in early {
        match result {
            Err(error) => {
                assert_eq!(error.kind(), ErrorKind::UserAtCapacity, "{error}");
                let retry = error
                    .retry_after()
                    .expect("user_at_capacity has retry_after");
                assert!(
                    !retry.is_zero() && retry <= CRASH_TTL,
                    "retry_after {retry:?} is within the crashed holder's TTL"
                );
                // A refusal answered before the lease can have expired is
                // the claim of this check; one answered later (an overloaded
                // machine) proves nothing and is counted apart.
                let key = if answered < sent + CRASH_TTL {
                    "refused_before_ttl"
                } else {
                    "refused_late"
                };
                *counts.entry(key.to_owned()).or_insert(0) += 1;
            }
            Ok(Begun::Started(turn)) => {
                assert!(
                    answered >= sent + CRASH_TTL,
                    "a permit was granted {:?} after the crashed holder's begin, before its TTL",
                    answered - sent
                );
                *counts.entry("started_late".to_owned()).or_insert(0) += 1;
                turn.succeed(&json!("ok")).await.expect("succeed");
            }
            Ok(Begun::Replay(view)) => panic!("a fresh request replayed {view:?}"),
            Ok(Begun::Queued(queued)) => panic!("a plain begin queued {queued:?}"),
        }
    }
    assert!(
        counts.get("refused_before_ttl").copied().unwrap_or(0) > 0,
        "no contender was answered within the TTL: {counts:?}"
    );

    // After the TTL (measured from when the grant came back, so the lease
    // has certainly expired on the store's clock) the permit is free.
    tokio::time::sleep_until(granted + CRASH_TTL + Duration::from_millis(50)).await;
    let late = storm(CONTENDERS, |i| {
        let gate = gate.clone();
        async move {
            gate.begin(
                USER,
                &format!("permit-late-{i}"),
                "r",
                &json!({"text": "r"}),
            )
            .await
        }
    })
    .await;
    let mut winners = Vec::new();
    for result in late {
        match result {
            Ok(Begun::Started(turn)) => winners.push(turn),
            Ok(Begun::Replay(view)) => panic!("a fresh request replayed {view:?}"),
            Ok(Begun::Queued(queued)) => panic!("a plain begin queued {queued:?}"),
            Err(error) => {
                assert_eq!(error.kind(), ErrorKind::UserAtCapacity, "{error}");
                *counts
                    .entry("refused_after_ttl_cap_taken".to_owned())
                    .or_insert(0) += 1;
            }
        }
    }
    assert_eq!(winners.len(), 1, "cap 1: exactly one grant after the TTL");
    let winner = winners.pop().expect("one winner");
    let user = store
        .user(&UserId::new(USER).expect("id"))
        .await
        .expect("user");
    assert_eq!(
        user.live_turns, 1,
        "the crashed holder's permit is not counted"
    );
    assert_eq!(
        user.holders.iter().map(|h| &h.turn_id).collect::<Vec<_>>(),
        vec![winner.id()]
    );
    let zombie = store
        .heartbeat(&LeaseRef {
            turn_id: crashed.turn_id.clone(),
            token: crashed.lease_token.clone(),
        })
        .await
        .expect_err("the crashed holder's lease is gone");
    assert_eq!(zombie.kind(), ErrorKind::LeaseLost);
    winner.succeed(&json!("ok")).await.expect("succeed");
    counts.insert("granted_after_ttl".to_owned(), 1);
    report(
        target,
        "permit_freed_by_lease_expiry_after_a_crash",
        &counts,
    );
}
