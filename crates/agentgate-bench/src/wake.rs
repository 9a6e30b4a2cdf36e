//! The wake row (issue 13's `wait`): how soon a waiting begin starts after
//! the holder of its session ends, against the store's raw notification
//! round trip, in the same run, on the same store.
//!
//! Each round: a holder starts a turn on node A (one `Gate`); a waiter
//! begins a second message on the same session with `on_busy: wait`,
//! either through the same `Gate` ("same node": the in-process watch wakes
//! it) or through a second one on the same store ("other node": on
//! PostgreSQL the ending's `NOTIFY`, elsewhere the bounded poll). Once the
//! waiter is waiting, the holder ends its turn; the figure is from the
//! ending's call to the waiter's grant, so it holds the ending's own round
//! trip, the wake and the waiter's begin. The raw baseline is the bare
//! notification: on PostgreSQL a `pg_notify` on one connection until a
//! `LISTEN`ing connection has it; SQLite and MySQL have none, so no
//! baseline (their other-node wake is the poll's).

use std::time::Duration;

use agentgate::model::BeginCommand;
use agentgate::{Begun, BusyPolicy, ClientRequestId, Config, Gate, OnBusy, SessionId, UserId};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::stats::{Samples, StepLatency};
use crate::target::{Dialect, Target};

/// How long a waiter is given to make its first attempt and start waiting
/// before the holder ends.
const SETTLE: Duration = Duration::from_millis(30);

/// The bound on each raw step.
const RAW_TIMEOUT: Duration = Duration::from_secs(5);

/// The waiter's bound.
const WAIT_MS: u64 = 10_000;

/// What the wake row measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Wake {
    /// Rounds per mode.
    pub rounds: usize,
    /// Ending called → waiter granted, the waiter on the holder's node.
    pub same_node: StepLatency,
    /// The same, the waiter on another node (store handle).
    pub other_node: StepLatency,
    /// Of the other-node waiters, how many a notification woke (the rest
    /// found the session free on their poll).
    pub other_node_woken: usize,
    /// The raw notification round trip, where the store has one.
    pub raw_notify: Option<StepLatency>,
    /// `other_node.p50_ms` ÷ `raw_notify.p50_ms`.
    pub other_node_to_raw_p50: Option<f64>,
}

fn command(session: &str, request: &str) -> Result<BeginCommand> {
    let id = |e: agentgate::Error| BenchError::Options(format!("wake ids: {e}"));
    BeginCommand::new(
        UserId::new("wake-user").map_err(id)?,
        SessionId::new(session).map_err(id)?,
        ClientRequestId::new(request).map_err(id)?,
        &json!({"text": request}),
        None,
    )
    .map_err(id)
}

fn started(begun: Begun) -> Result<agentgate::Turn> {
    match begun {
        Begun::Started(turn) => Ok(turn),
        Begun::Replay(view) => Err(BenchError::Options(format!(
            "wake: a new request replayed {}",
            view.turn_id
        ))),
        Begun::Queued(queued) => Err(BenchError::Options(format!(
            "wake: a new request queued {}",
            queued.turn_id
        ))),
    }
}

/// One round: the latency from the holder's ending call to the waiter's
/// grant, and whether a notification woke the waiter.
async fn round(holder: &Gate, waiter: &Gate, session: &str) -> Result<(Duration, bool)> {
    let first = started(holder.begin_command(&command(session, "first")?).await?)?;
    let second = command(session, "second")?;
    let on_busy = OnBusy::new(BusyPolicy::Wait, Some(WAIT_MS))?;
    let waiter = waiter.clone();
    let waiting = tokio::spawn(async move {
        let (begun, report) = waiter.begin_on_busy(&second, on_busy).await?;
        let granted = Instant::now();
        started(begun)?
            .succeed(&json!("second"))
            .await
            .map_err(|e| e.error)?;
        Ok::<_, BenchError>((granted, report.woken > 0))
    });
    tokio::time::sleep(SETTLE).await;
    let ending = Instant::now();
    first.succeed(&json!("first")).await.map_err(|e| e.error)?;
    let (granted, woken) = waiting
        .await
        .map_err(|e| BenchError::Options(format!("wake waiter: {e}")))??;
    Ok((granted.saturating_duration_since(ending), woken))
}

/// The raw `pg_notify` → `LISTEN` round trip, `rounds` times: one plain
/// connection sends, a listener on a connection of its own receives.
pub(crate) async fn raw_postgres(store_url: &str, rounds: usize) -> Result<StepLatency> {
    use sqlx::postgres::{PgConnection, PgListener};
    use sqlx::Connection as _;
    let map = |e: sqlx::Error| BenchError::Options(format!("raw notify: {e}"));
    let bounded = |what: &'static str| {
        move |_| BenchError::Options(format!("raw notify: {what} took over {RAW_TIMEOUT:?}"))
    };
    let mut sender = tokio::time::timeout(RAW_TIMEOUT, PgConnection::connect(store_url))
        .await
        .map_err(bounded("connecting"))?
        .map_err(map)?;
    let mut listener = tokio::time::timeout(RAW_TIMEOUT, PgListener::connect(store_url))
        .await
        .map_err(bounded("connecting the listener"))?
        .map_err(map)?;
    listener.listen("agentgate_bench_wake").await.map_err(map)?;
    let mut samples = Samples::default();
    for n in 0..rounds {
        let payload = n.to_string();
        let sent = Instant::now();
        tokio::time::timeout(
            RAW_TIMEOUT,
            sqlx::query("SELECT pg_notify('agentgate_bench_wake', $1)")
                .bind(&payload)
                .execute(&mut sender),
        )
        .await
        .map_err(bounded("a notify"))?
        .map_err(map)?;
        let got = tokio::time::timeout(RAW_TIMEOUT, listener.recv())
            .await
            .map_err(bounded("a notification"))?
            .map_err(map)?;
        if got.payload() != payload {
            return Err(BenchError::Options(format!(
                "raw notify: got {:?}, sent {payload}",
                got.payload()
            )));
        }
        samples.push(sent.elapsed());
    }
    let _ = sender.close().await;
    Ok(samples.summary())
}

/// Two gates on `target`'s store (and Redis): two nodes of one cluster,
/// each with its own pools, listener and subscriber.
pub(crate) async fn two_nodes(target: &Target, config: &Config) -> Result<(Gate, Gate)> {
    let open = || {
        Gate::connect(
            &target.store_url,
            target.redis_url.as_deref(),
            config.clone(),
        )
    };
    Ok((open().await?, open().await?))
}

/// The raw `PUBLISH` → `SUBSCRIBE` round trip on Redis, `rounds` times:
/// one connection publishes, a subscriber on a connection of its own
/// receives.
pub(crate) async fn raw_redis(redis_url: &str, rounds: usize) -> Result<StepLatency> {
    use tokio_stream::StreamExt as _;
    let map = |e: redis::RedisError| BenchError::Options(format!("raw publish: {e}"));
    let bounded = |what: &'static str| {
        move |_| BenchError::Options(format!("raw publish: {what} took over {RAW_TIMEOUT:?}"))
    };
    // The layer's URL may carry `?key_prefix=`; redis-rs knows no such
    // parameter.
    let url = redis_url.split('?').next().unwrap_or(redis_url);
    let client = redis::Client::open(url).map_err(map)?;
    let mut sender = tokio::time::timeout(RAW_TIMEOUT, client.get_multiplexed_async_connection())
        .await
        .map_err(bounded("connecting"))?
        .map_err(map)?;
    let mut subscriber = tokio::time::timeout(RAW_TIMEOUT, client.get_async_pubsub())
        .await
        .map_err(bounded("connecting the subscriber"))?
        .map_err(map)?;
    subscriber
        .subscribe("agentgate_bench_wake")
        .await
        .map_err(map)?;
    let mut messages = subscriber.on_message();
    let mut samples = Samples::default();
    for n in 0..rounds {
        let payload = n.to_string();
        let sent = Instant::now();
        let _: i64 = tokio::time::timeout(
            RAW_TIMEOUT,
            redis::cmd("PUBLISH")
                .arg("agentgate_bench_wake")
                .arg(&payload)
                .query_async(&mut sender),
        )
        .await
        .map_err(bounded("a publish"))?
        .map_err(map)?;
        let got = tokio::time::timeout(RAW_TIMEOUT, messages.next())
            .await
            .map_err(bounded("a message"))?
            .ok_or_else(|| BenchError::Options("raw publish: the subscription closed".into()))?;
        let got: String = got.get_payload().map_err(map)?;
        if got != payload {
            return Err(BenchError::Options(format!(
                "raw publish: got {got:?}, sent {payload}"
            )));
        }
        samples.push(sent.elapsed());
    }
    Ok(samples.summary())
}

/// The raw notification round trip other nodes are woken by on `target`:
/// PostgreSQL's `NOTIFY`, else the Redis layer's pub/sub, else none (they
/// poll).
pub(crate) async fn raw_notification(
    target: &Target,
    rounds: usize,
) -> Result<Option<StepLatency>> {
    match (target.dialect, target.redis_url.as_deref()) {
        (Dialect::Postgres, _) => Ok(Some(raw_postgres(&target.store_url, rounds).await?)),
        (Dialect::Sqlite | Dialect::MySql, Some(redis_url)) => {
            Ok(Some(raw_redis(redis_url, rounds).await?))
        }
        (Dialect::Sqlite | Dialect::MySql, None) => Ok(None),
    }
}

/// Runs the row (`rounds` per mode; 0 skips it).
///
/// # Errors
/// Any failure of a begin, an ending or the raw notification.
pub(crate) async fn measure(
    target: &Target,
    config: &Config,
    rounds: usize,
) -> Result<Option<Wake>> {
    if rounds == 0 {
        return Ok(None);
    }
    let (node_a, node_b) = two_nodes(target, config).await?;
    let mut same = Samples::default();
    let mut other = Samples::default();
    let mut woken = 0;
    for n in 0..rounds {
        let (latency, _) = round(&node_a, &node_a, &format!("wake-same-{n}")).await?;
        same.push(latency);
        let (latency, was_woken) = round(&node_a, &node_b, &format!("wake-other-{n}")).await?;
        other.push(latency);
        woken += usize::from(was_woken);
    }
    let raw_notify = raw_notification(target, rounds).await?;
    let other_node = other.summary();
    let other_node_to_raw_p50 = raw_notify
        .as_ref()
        .filter(|raw| raw.p50_ms > 0.0)
        .map(|raw| other_node.p50_ms / raw.p50_ms);
    Ok(Some(Wake {
        rounds,
        same_node: same.summary(),
        other_node,
        other_node_woken: woken,
        raw_notify,
        other_node_to_raw_p50,
    }))
}
