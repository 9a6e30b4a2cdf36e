//! Release notifications across nodes: `LISTEN`/`NOTIFY`.
//!
//! Every step that frees a session (an ending, an abandon, a
//! force-release) calls `pg_notify` on [`CHANNEL`] with the session id
//! inside its own statement or transaction, so the notification is sent at
//! commit and only then. The first waiting begin of a store handle starts
//! one listener task, on a connection of its own (not one of the store's
//! pool), which wakes that handle's waiters. A notification lost while the
//! listener reconnects is made up for: each time it starts listening it
//! wakes every waiter of its handle, which tries again.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use agentgate_core::limits::STORE_ACQUIRE_TIMEOUT;
use agentgate_store_sql::wakeups::Wakeups;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

use crate::PostgresStore;

/// The channel every release is announced on; the payload is the session id.
pub(crate) const CHANNEL: &str = "agentgate_release";

/// What a shared step runs inside the transaction that frees session `$1`.
pub(crate) const ANNOUNCE: &str = "SELECT pg_notify('agentgate_release', $1)";

/// The channel a turn's new events are announced on; the payload is the
/// turn id.
pub(crate) const EVENT_CHANNEL: &str = "agentgate_events";

/// What announces new events of turn `$1`, after their append committed.
const ANNOUNCE_EVENTS: &str = "SELECT pg_notify('agentgate_events', $1)";

/// Tells other nodes' followers that `turn_id`'s log grew (the `announce`
/// of `impl_store!`). A failure is logged, not returned: the events are
/// committed, and a follower that misses the notification re-reads within
/// its poll ([`agentgate_core::limits::EVENT_POLL`]).
pub(crate) async fn announce_events(store: &PostgresStore, turn_id: &agentgate_core::ids::TurnId) {
    let sent = sqlx::query(ANNOUNCE_EVENTS)
        .bind(turn_id.as_str())
        .execute(&store.pool)
        .await;
    if let Err(error) = sent {
        tracing::debug!(%turn_id, %error, "new events not announced; followers poll");
    }
}

/// The shortest and longest pause before the listener connects again after
/// losing its connection.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The running listener of one store handle (and its clones); stopped when
/// the last of them goes.
#[derive(Debug)]
pub(crate) struct Listener {
    task: tokio::task::AbortHandle,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The listener slot a store handle and its clones share.
pub(crate) type Slot = Arc<OnceLock<Listener>>;

/// Starts the store's listener unless it runs already (the `listen` of
/// `impl_store!`).
pub(crate) fn listen(store: &PostgresStore) {
    store.listener.get_or_init(|| {
        let options = (*store.pool.connect_options()).clone();
        let wakeups = (store.wakeups.clone(), store.event_wakeups.clone());
        Listener {
            task: tokio::spawn(run(options, wakeups)).abort_handle(),
        }
    });
}

/// The session releases' wakeups and the turn events' wakeups.
type Both = (Wakeups, Wakeups);

async fn run(options: PgConnectOptions, wakeups: Both) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(STORE_ACQUIRE_TIMEOUT)
        .connect_lazy_with(options);
    let mut pause = RECONNECT_MIN;
    loop {
        match listen_once(&pool, &wakeups).await {
            Ok(never) => match never {},
            Err(error) => {
                wakeups.0.listening(false);
                wakeups.1.listening(false);
                tracing::warn!(%error, "release listener lost its connection; waiters poll meanwhile");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

async fn listen_once(
    pool: &sqlx::PgPool,
    (releases, events): &Both,
) -> Result<std::convert::Infallible, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen_all([CHANNEL, EVENT_CHANNEL]).await?;
    releases.listening(true);
    events.listening(true);
    // `try_recv`, not `recv`: `recv` reconnects by itself, and a
    // reconnect must be seen, to wake the waiters it left unwarned.
    while let Some(notification) = listener.try_recv().await? {
        match notification.channel() {
            EVENT_CHANNEL => events.released(notification.payload()),
            _ => releases.released(notification.payload()),
        }
    }
    Err(sqlx::Error::Protocol(
        "the listening connection closed".to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_announcement_is_on_the_channel_listened_to() {
        assert!(super::ANNOUNCE.contains(&format!("'{}'", super::CHANNEL)));
        assert!(super::ANNOUNCE_EVENTS.contains(&format!("'{}'", super::EVENT_CHANNEL)));
    }
}
