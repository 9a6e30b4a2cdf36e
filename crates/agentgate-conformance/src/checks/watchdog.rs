//! The watchdog: a long turn keeps its lease by itself; a turn whose lease
//! cannot be renewed is cancelled before the lease expires.

use std::sync::Arc;
use std::time::Duration;

use agentgate::{ErrorKind, Gate};
use serde_json::json;

use super::{must_start, report, short_ttl, SHORT_TTL};
use crate::faulty::Faulty;
use crate::Target;

/// A turn that runs for four TTLs keeps its lease without any call of its own.
pub async fn watchdog_keeps_a_long_turn(target: &Target) {
    let gate = target.gate(short_ttl()).await;
    let turn = must_start(&gate, "long-user", "long-session", "r1").await;
    let mut refusals = 0;
    let mut ttls_survived = 0;
    for _ in 0..4 {
        tokio::time::sleep(SHORT_TTL).await;
        let busy = gate
            .begin("long-user", "long-session", "r2", &json!(2))
            .await
            .expect_err("held");
        assert_eq!(busy.kind(), ErrorKind::SessionBusy, "{busy}");
        refusals += 1;
        assert!(!turn.is_cancelled(), "a renewed lease is not cancelled");
        ttls_survived += 1;
    }
    turn.succeed(&json!("long answer"))
        .await
        .expect("the long turn still holds its lease");
    let counts = [
        ("ttls_survived".to_owned(), ttls_survived),
        ("session_busy".to_owned(), refusals),
    ];
    report(
        target,
        "watchdog_keeps_a_long_turn",
        &counts.into_iter().collect(),
    );
}

/// When every store write fails, the cancellation signal fires while the
/// lease is still live on the store: the holder stops before anyone could
/// take over.
pub async fn watchdog_cancels_when_renewal_fails(target: &Target) {
    let real = target.gate(short_ttl()).await;
    let faulty = Arc::new(Faulty::new(Arc::clone(real.store())));
    let gate = Gate::with_store(Arc::clone(&faulty) as Arc<dyn agentgate::store::Store>);
    let turn = must_start(&gate, "fault-user", "fault-session", "r1").await;
    let cancelled = turn.cancellation();
    faulty.fail_writes();
    tokio::time::timeout(SHORT_TTL * 2, cancelled.cancelled())
        .await
        .expect("the watchdog cancels the turn within the TTL");
    let session = real
        .store()
        .session(turn.session_id())
        .await
        .expect("view")
        .expect("session");
    let holder = session
        .holder
        .expect("the lease has not expired yet when the signal fires");
    assert_eq!(&holder.turn_id, turn.id());
    assert!(holder.lease_expires_in_ms > 0);
    let margin_ms = holder.lease_expires_in_ms;
    drop(turn);
    // After the TTL, the session is free for the next turn.
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(margin_ms).unwrap_or(0) + 50,
    ))
    .await;
    let next = must_start(&real, "fault-user", "fault-session", "r2").await;
    next.succeed(&json!("ok")).await.expect("succeed");
    let counts = [(
        "margin_ms".to_owned(),
        usize::try_from(margin_ms).unwrap_or(0),
    )];
    report(
        target,
        "watchdog_cancels_when_renewal_fails",
        &counts.into_iter().collect(),
    );
}
