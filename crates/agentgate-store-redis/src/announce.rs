//! Announcements between nodes over Redis pub/sub: a session released, a
//! turn's event log grown. They wake the waiting begins and event
//! followers of every node sharing the store, where the SQL store has no
//! notification of its own (SQLite across processes, MySQL).
//!
//! Two channels under the key prefix: `<prefix>released` (payload: the
//! session id) and `<prefix>events` (payload: the turn id). Publishing is
//! best effort, after the SQL write committed: a waiter or follower that
//! misses one finds the change by its bounded poll. One subscriber task
//! per layer, on its own connection, reconnecting with a doubling pause;
//! while it is not subscribed it says so ([`Announced::listening`]), and
//! each time it subscribes it wakes every watch, since what was announced
//! meanwhile reached no one.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use agentgate_core::lease::Announced;
use agentgate_core::limits::STORE_ACQUIRE_TIMEOUT;
use redis::aio::ConnectionManager;
use tokio::task::AbortHandle;
use tokio_stream::StreamExt as _;

/// The first pause before a lost subscription is tried again.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(100);
/// The longest pause between tries.
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(5);

/// The channels of one key prefix.
#[derive(Clone, Debug)]
pub(crate) struct Channels {
    released: String,
    events: String,
}

impl Channels {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            released: format!("{prefix}released"),
            events: format!("{prefix}events"),
        }
    }

    pub(crate) async fn released(&self, connection: &ConnectionManager, session_id: &str) {
        publish(connection, &self.released, session_id).await;
    }

    pub(crate) async fn events(&self, connection: &ConnectionManager, turn_id: &str) {
        publish(connection, &self.events, turn_id).await;
    }
}

/// Publishes `payload` on `channel`; a failure is logged, not returned.
async fn publish(connection: &ConnectionManager, channel: &str, payload: &str) {
    let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
        .arg(channel)
        .arg(payload)
        .query_async(&mut connection.clone())
        .await;
    if let Err(error) = sent {
        tracing::debug!(channel, %error, "not announced; other nodes poll");
    }
}

/// The layer's subscriber task, stopped with the layer.
#[derive(Debug, Default)]
pub(crate) struct Subscriber {
    task: OnceLock<AbortHandle>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

impl Subscriber {
    /// Starts delivering to `to`, unless a delivery runs already.
    pub(crate) fn start(
        &self,
        client: &redis::Client,
        channels: &Channels,
        to: Arc<dyn Announced>,
    ) {
        self.task
            .get_or_init(|| tokio::spawn(run(client.clone(), channels.clone(), to)).abort_handle());
    }
}

async fn run(client: redis::Client, channels: Channels, to: Arc<dyn Announced>) {
    let mut pause = RESUBSCRIBE_MIN;
    loop {
        let mut subscribed = false;
        match subscribe_once(&client, &channels, to.as_ref(), &mut subscribed).await {
            Ok(never) => match never {},
            Err(error) => {
                to.listening(false);
                tracing::warn!(%error, "redis announcements lost; waiters and followers poll meanwhile");
            }
        }
        // A subscription that held starts the next pauses over.
        if subscribed {
            pause = RESUBSCRIBE_MIN;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RESUBSCRIBE_MAX);
    }
}

async fn subscribe_once(
    client: &redis::Client,
    channels: &Channels,
    to: &dyn Announced,
    subscribed: &mut bool,
) -> redis::RedisResult<std::convert::Infallible> {
    let mut pubsub = tokio::time::timeout(STORE_ACQUIRE_TIMEOUT, client.get_async_pubsub())
        .await
        .map_err(|_| {
            redis::RedisError::from((redis::ErrorKind::Io, "timed out connecting to redis"))
        })??;
    pubsub
        .subscribe(&[channels.released.as_str(), channels.events.as_str()])
        .await?;
    to.listening(true);
    *subscribed = true;
    let mut messages = pubsub.on_message();
    while let Some(message) = messages.next().await {
        let Ok(id) = message.get_payload::<String>() else {
            tracing::warn!("an announcement with a payload that is not text; ignored");
            continue;
        };
        if message.get_channel_name() == channels.events {
            to.events(&id);
        } else {
            to.released(&id);
        }
    }
    Err(redis::RedisError::from((
        redis::ErrorKind::Io,
        "the subscription's connection closed",
    )))
}
