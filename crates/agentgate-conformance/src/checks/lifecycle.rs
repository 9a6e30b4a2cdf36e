//! Endings, restarts, dropped turns and the retention sweeper.

use std::sync::Arc;
use std::time::Duration;

use agentgate::{Begun, Config, ErrorKind, Gate, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome, Ending, LeaseRef};
use agentgate_core::store::all_executions;
use serde_json::json;

use super::{config, must_start, report, start_within};
use crate::faulty::Faulty;
use crate::Target;

/// fail(retryable) → a repeat restarts (attempt 2, not a takeover);
/// fail(final) → a repeat replays the failure; an ended turn refuses more.
pub async fn endings_and_restarts(target: &Target) {
    let gate = target.gate(config()).await;
    let turn = must_start(&gate, "end-user", "end-session", "retry-me").await;
    let view = turn
        .fail(&json!({"code": "llm_timeout"}), true)
        .await
        .expect("fail");
    assert_eq!(view.state, TurnState::Failed);
    assert_eq!(view.retryable, Some(true));
    let again = must_start(&gate, "end-user", "end-session", "retry-me").await;
    assert_eq!(again.attempt(), 2);
    assert!(!again.is_takeover());
    let id = again.id().clone();
    again
        .fail(&json!({"code": "bad_request"}), false)
        .await
        .expect("fail");
    match gate
        .begin(
            "end-user",
            "end-session",
            "retry-me",
            &json!({"text": "retry-me"}),
        )
        .await
    {
        Ok(Begun::Replay(view)) => {
            assert_eq!(view.turn_id, id);
            assert_eq!(view.state, TurnState::Failed);
            assert_eq!(view.error, Some(json!({"code": "bad_request"})));
            assert_eq!(view.retryable, Some(false));
        }
        other => panic!("a final failure replays, got {:?}", other.map(|_| ())),
    }
    // An ended turn's lease is gone: a heartbeat is refused. Driven through
    // the store, so the token outlives the ending that consumes a `Turn`.
    let store = std::sync::Arc::clone(gate.store());
    let command = BeginCommand::new(
        UserId::new("end-user").expect("id"),
        SessionId::new("end-session").expect("id"),
        ClientRequestId::new("once").expect("id"),
        &json!({"text": "once"}),
        None,
    )
    .expect("command");
    let BeginOutcome::Started(grant) = store.begin(&command).await.expect("begin") else {
        panic!("a new request starts");
    };
    let lease = LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    };
    store.heartbeat(&lease).await.expect("a live lease renews");
    let response = CanonicalJson::new("response", &json!("done")).expect("json");
    let view = store
        .end_turn(&lease, &Ending::Succeed { response })
        .await
        .expect("succeed");
    assert_eq!(view.state, TurnState::Succeeded);
    let refused = store
        .heartbeat(&lease)
        .await
        .expect_err("an ended turn's lease renews no more");
    assert_eq!(refused.kind(), ErrorKind::LeaseLost, "{refused}");
    let user = store
        .user(&UserId::new("end-user").expect("id"))
        .await
        .expect("user");
    assert_eq!(user.live_turns, 0);
    let counts = [
        ("restarted".to_owned(), 1),
        ("final_failure_replayed".to_owned(), 1),
        ("heartbeat_after_end_refused".to_owned(), 1),
    ];
    report(
        target,
        "endings_and_restarts",
        &counts.into_iter().collect(),
    );
}

/// A turn dropped without an ending is released in the background: the
/// session frees at once (not after the TTL) and a repeat restarts it.
pub async fn dropped_turn_is_released(target: &Target) {
    let gate = target.gate(config()).await;
    let turn = must_start(&gate, "drop-user", "drop-session", "r1").await;
    let id = turn.id().clone();
    let dropped = std::time::Instant::now();
    drop(turn);
    // The default TTL is 30 s; this must happen long before it.
    let next = start_within(
        &gate,
        "drop-user",
        "drop-session",
        "r2",
        Duration::from_secs(5),
    )
    .await;
    let released_after = dropped.elapsed();
    next.succeed(&json!("ok")).await.expect("succeed");
    let view = gate.store().turn(&id).await.expect("view").expect("turn");
    assert_eq!(view.state, TurnState::Failed);
    assert_eq!(view.retryable, Some(true));
    assert_eq!(
        view.error.as_ref().and_then(|e| e.get("code")),
        Some(&json!("dropped"))
    );
    let restarted = must_start(&gate, "drop-user", "drop-session", "r1").await;
    let restarted_attempt = usize::try_from(restarted.attempt()).unwrap_or(0);
    assert_eq!(restarted_attempt, 2);
    restarted.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        (
            "released_after_ms".to_owned(),
            usize::try_from(released_after.as_millis()).unwrap_or(usize::MAX),
        ),
        ("restart_attempt".to_owned(), restarted_attempt),
    ];
    report(
        target,
        "dropped_turn_is_released",
        &counts.into_iter().collect(),
    );
}

/// Finished records are deleted after `result_retention`, in bounded
/// batches; live ones are kept.
pub async fn retention_sweeper(target: &Target) {
    let retention = Duration::from_secs(1);
    let gate = target
        .gate(Config {
            result_retention: retention,
            confirmation_ttl: retention,
            sweep_batch: 2,
            ..Config::default()
        })
        .await;
    let mut ended = Vec::new();
    for i in 0..5 {
        let turn = must_start(&gate, "sweep-user", &format!("sweep-s{i}"), "r").await;
        if let agentgate::ToolStep::Execute(execution) =
            turn.tool("t", &json!(i)).await.expect("claim")
        {
            execution.complete(&json!(i)).await.expect("complete");
        }
        ended.push(turn.id().clone());
        turn.succeed(&json!(i)).await.expect("succeed");
    }
    let live = must_start(&gate, "sweep-user", "sweep-live", "r").await;
    let store = gate.store();
    let early = store.sweep().await.expect("sweep");
    assert_eq!(early.turns, 0, "nothing is swept before its retention");
    tokio::time::sleep(retention + Duration::from_millis(300)).await;
    let first = store.sweep().await.expect("sweep");
    assert_eq!(
        first.turns, 2,
        "one batch deletes at most sweep_batch turns"
    );
    let mut swept = first.turns;
    for _ in 0..5 {
        swept += store.sweep().await.expect("sweep").turns;
    }
    assert_eq!(swept, 5);
    for id in &ended {
        assert!(store.turn(id).await.expect("view").is_none(), "{id} swept");
        assert!(all_executions(store.as_ref(), id)
            .await
            .expect("executions")
            .is_empty());
    }
    let kept_live = usize::from(store.turn(live.id()).await.expect("view").is_some());
    assert_eq!(kept_live, 1, "a live turn is kept");
    let busy = gate
        .begin("sweep-user", "sweep-live", "r2", &json!(1))
        .await
        .expect_err("held");
    assert_eq!(busy.kind(), ErrorKind::SessionBusy);
    live.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        (
            "swept_turns".to_owned(),
            usize::try_from(swept).expect("a small count"),
        ),
        ("kept_live".to_owned(), kept_live),
    ];
    report(target, "retention_sweeper", &counts.into_iter().collect());
}

/// The operator overview shows live holders with their users, and the
/// latest turns and tool executions, newest first; never a lease token.
pub async fn overview_shows_holders_and_activity(target: &Target) {
    let gate = target.gate(config()).await;
    let done = must_start(&gate, "ov-user", "ov-done", "r").await;
    if let agentgate::ToolStep::Execute(execution) = done.tool("t", &json!(1)).await.expect("claim")
    {
        execution.complete(&json!("ok")).await.expect("complete");
    }
    let done_id = done.id().clone();
    done.succeed(&json!("ok")).await.expect("succeed");
    let live = must_start(&gate, "ov-user", "ov-live", "r").await;
    let overview = gate.store().overview(50).await.expect("overview");
    let holder = overview
        .live
        .iter()
        .find(|l| &l.holder.turn_id == live.id())
        .expect("the live turn is listed");
    assert_eq!(holder.user_id.as_str(), "ov-user");
    assert_eq!(holder.holder.fence, live.fence());
    assert!(holder.holder.lease_expires_in_ms > 0);
    assert!(
        overview.live.iter().all(|l| l.holder.turn_id != done_id),
        "an ended turn holds nothing"
    );
    assert_eq!(
        overview.recent_turns.first().map(|t| &t.turn_id),
        Some(live.id()),
        "newest first"
    );
    assert!(overview.recent_turns.iter().any(|t| t.turn_id == done_id));
    assert!(overview
        .recent_executions
        .iter()
        .any(|e| e.turn_id == done_id));
    let text = serde_json::to_string(&overview).expect("json");
    assert!(!text.contains("lt_"), "no lease token in an overview");
    let capped = gate.store().overview(1).await.expect("overview");
    assert!(capped.recent_turns.len() <= 1);
    live.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("live_listed".to_owned(), overview.live.len()),
        ("recent_turns".to_owned(), overview.recent_turns.len()),
    ];
    report(
        target,
        "overview_shows_holders_and_activity",
        &counts.into_iter().collect(),
    );
}

/// Nodes that open a fresh store at the same moment all succeed and agree:
/// the schema is migrated once, under the store's migration lock. Each node
/// is a thread with its own runtime, like a process of its own.
pub async fn concurrent_opens_migrate_once(target: &Target) {
    const NODES: usize = 8;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(NODES));
    let threads: Vec<_> = (0..NODES)
        .map(|_| {
            let (store_url, redis_url) = (target.store_url.clone(), target.redis_url.clone());
            let barrier = std::sync::Arc::clone(&barrier);
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                barrier.wait();
                runtime
                    .block_on(agentgate::Gate::connect(
                        &store_url,
                        redis_url.as_deref(),
                        config(),
                    ))
                    .map(drop)
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for thread in threads {
        let opened = tokio::task::block_in_place(|| thread.join()).expect("a node thread");
        opened.unwrap_or_else(|e| panic!("a concurrent open failed: {e}"));
    }
    // Migrated once: every version recorded exactly once, none missing
    // (a second run of a migration would have failed its node's open on the
    // version's key, or left a gap).
    let (rows, distinct, highest) = schema_versions(&target.store_url).await;
    assert_eq!(rows, distinct, "a schema version recorded twice");
    assert_eq!(rows, highest, "versions 1..={highest}, each once");
    // Every node sees one store: a turn begun on one is in flight on another.
    let first = target.gate(config()).await;
    let second = target.gate(config()).await;
    let turn = must_start(&first, "open-user", "open-session", "r").await;
    let busy = second
        .begin("open-user", "open-session", "r", &json!({"text": "r"}))
        .await
        .expect_err("in flight on every node");
    assert_eq!(busy.kind(), ErrorKind::RequestInFlight);
    turn.succeed(&json!("ok")).await.expect("succeed");
    let counts = [
        ("nodes".to_owned(), NODES),
        (
            "schema_versions_recorded".to_owned(),
            usize::try_from(rows).unwrap_or(0),
        ),
    ];
    report(
        target,
        "concurrent_opens_migrate_once",
        &counts.into_iter().collect(),
    );
}

/// A computed answer survives a store blip at the ending: a few refused
/// endings are retried while the lease is live, and an ending that still
/// cannot be stored hands the turn back, lease held, to be ended again.
pub async fn ending_survives_a_store_blip(target: &Target) {
    let real = target.gate(config()).await;
    let faulty = Arc::new(Faulty::new(Arc::clone(real.store())));
    let gate = Gate::with_store(Arc::clone(&faulty) as Arc<dyn agentgate::store::Store>);

    // A short blip: the ending is retried and lands.
    let turn = must_start(&gate, "blip-user", "blip-session", "r1").await;
    faulty.fail_endings(3);
    let view = turn
        .succeed(&json!("answer one"))
        .await
        .expect("a blip shorter than the retries costs nothing");
    assert_eq!(view.state, TurnState::Succeeded);
    let retried = faulty.endings_refused();
    assert_eq!(retried, 3, "each injected fault was met by one retry");
    match real
        .begin("blip-user", "blip-session", "r1", &json!({"text": "r1"}))
        .await
    {
        Ok(Begun::Replay(done)) => assert_eq!(done.response, Some(json!("answer one"))),
        other => panic!("the answer replays, got {:?}", other.map(|_| ())),
    }

    // A long outage: the turn comes back inside the error, still holding
    // the session, and its answer is stored once the store is back.
    let turn = must_start(&gate, "blip-user", "blip-session", "r2").await;
    let turn_id = turn.id().clone();
    faulty.fail_endings(u32::MAX);
    let refused = turn
        .succeed(&json!("answer two"))
        .await
        .expect_err("an outage outlasts the retries");
    assert_eq!(refused.kind(), ErrorKind::StoreUnavailable, "{refused}");
    let turn = refused.turn.expect("the turn is handed back");
    let held = real
        .store()
        .session(turn.session_id())
        .await
        .expect("view")
        .expect("session")
        .holder
        .expect("the handed-back turn still holds the session");
    assert_eq!(held.turn_id, turn_id);
    let outage = faulty.endings_refused() - retried;
    assert!(outage > 1, "the outage was retried, {outage} attempts");
    faulty.fail_endings(0);
    let view = turn
        .succeed(&json!("answer two"))
        .await
        .expect("stored once the store is back");
    assert_eq!(view.turn_id, turn_id);
    match real
        .begin("blip-user", "blip-session", "r2", &json!({"text": "r2"}))
        .await
    {
        Ok(Begun::Replay(done)) => assert_eq!(done.response, Some(json!("answer two"))),
        other => panic!("the answer replays, got {:?}", other.map(|_| ())),
    }
    let counts = [
        (
            "blip_endings_refused".to_owned(),
            usize::try_from(retried).expect("small"),
        ),
        (
            "outage_endings_refused".to_owned(),
            usize::try_from(outage).expect("small"),
        ),
    ];
    report(
        target,
        "ending_survives_a_store_blip",
        &counts.into_iter().collect(),
    );
}

/// The store's schema version table, read through the store's own pool
/// (its own URL parsing and TLS): its rows, its distinct versions and its
/// highest version.
async fn schema_versions(store_url: &str) -> (i64, i64, i64) {
    const QUERY: &str =
        "SELECT COUNT(*), COUNT(DISTINCT version), MAX(version) FROM ag_schema_version";
    type Row = (i64, i64, Option<i64>);
    let row: Row = if store_url.starts_with("postgres") {
        let store = agentgate_store_postgres::PostgresStore::open(store_url, config())
            .await
            .expect("the store opens");
        sqlx::query_as(QUERY).fetch_one(store.pool()).await
    } else if store_url.starts_with("mysql") || store_url.starts_with("mariadb") {
        let store = agentgate_store_mysql::MySqlStore::open(store_url, config())
            .await
            .expect("the store opens");
        sqlx::query_as(QUERY).fetch_one(store.pool()).await
    } else {
        let store = agentgate_store_sqlite::SqliteStore::open(store_url, config())
            .await
            .expect("the store opens");
        sqlx::query_as(QUERY).fetch_one(store.pool()).await
    }
    .expect("the schema versions");
    (row.0, row.1, row.2.unwrap_or(0))
}
