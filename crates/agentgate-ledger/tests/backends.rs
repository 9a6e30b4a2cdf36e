//! The whole app on PostgreSQL and MySQL/MariaDB (each on a fresh database of
//! the local server): bookings commit through `SqlTx::Postgres` /
//! `SqlTx::MySql`, replays book nothing, two tabs approving at once book
//! once. Without a server these skip, unless `AGENTGATE_REQUIRE_SERVICES=1`.

mod common;

use std::sync::Arc;

use agentgate::{Config, Decision, ErrorKind, TurnState};
use agentgate_ledger::{ConfirmRequest, LedgerError, Started};
use common::*;
use tokio::sync::Barrier;
use tokio_util::sync::CancellationToken;

async fn exercise(url: &str) {
    let app = offline_app_with(url).await;
    let outcome = app
        .chat(
            &message("s1", "m1", "午饭 35，打车 18"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("chat");
    assert_eq!(outcome.reply.expect("reply").entries.len(), 2);
    let again = app
        .chat(
            &message("s1", "m1", "午饭 35，打车 18"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("replay");
    assert!(again.replayed);
    assert_eq!(app.entries("alice").await.expect("entries").len(), 2);

    let paused = app
        .chat(
            &message("s1", "m2", "房租 3000"),
            None,
            CancellationToken::new(),
        )
        .await
        .expect("pause");
    assert_eq!(paused.state, TurnState::AwaitingConfirmation);
    let barrier = Arc::new(Barrier::new(2));
    let tabs: Vec<_> = (0..2)
        .map(|tab| {
            let (app, barrier, pending_turn_id) =
                (app.clone(), Arc::clone(&barrier), paused.turn_id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let request = ConfirmRequest {
                    user_id: "alice".into(),
                    session_id: "s1".into(),
                    client_request_id: format!("tab-{tab}"),
                    pending_turn_id,
                    decision: Decision::Approve,
                };
                match app.start_confirmation(&request).await {
                    Ok(Started::Running(turn)) => turn
                        .run(None, CancellationToken::new())
                        .await
                        .map(|_| "ran"),
                    Ok(Started::Replay(_)) => Ok("replayed"),
                    Ok(Started::Queued(queued)) => {
                        panic!("a confirmation is never queued: {queued:?}")
                    }
                    Err(LedgerError::Engine(e)) if e.kind() == ErrorKind::RequestInFlight => {
                        Ok("in_flight")
                    }
                    Err(error) => Err(error),
                }
            })
        })
        .collect();
    let mut ran = 0;
    for tab in tabs {
        if tab.await.expect("tab").expect("confirmation") == "ran" {
            ran += 1;
        }
    }
    assert_eq!(ran, 1);
    let totals = app.totals("alice").await.expect("totals");
    assert_eq!(
        totals.expense_cents,
        3500 + 1800 + 300_000,
        "each entry once"
    );
    assert_eq!(app.entries("alice").await.expect("entries").len(), 3);
}

async fn offline_app_with(url: &str) -> agentgate_ledger::LedgerApp {
    app_on(
        url,
        Config::default(),
        Arc::new(agentgate_ledger::OfflineModel::new(
            std::time::Duration::ZERO,
        )),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_on_postgres() {
    use agentgate_store_postgres::testing;
    let Some(url) = testing::fresh_database_url().await else {
        return;
    };
    exercise(&url).await;
    testing::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_on_mysql() {
    use agentgate_store_mysql::testing;
    let Some(url) = testing::fresh_database_url().await else {
        return;
    };
    exercise(&url).await;
    testing::drop_database(&url).await;
}
