//! The events row (issue 14): many followers of one turn's event log on
//! one node, what they cost and how soon an event reaches them, against
//! the store's raw notification round trip in the same run.
//!
//! A holder on node A (one `Gate`) appends `events` events one at a time,
//! [`PACE`] apart, then ends the turn; `subscribers` followers on node B (a
//! second `Gate` on the same store: another node's path, woken by
//! PostgreSQL's `NOTIFY`, elsewhere by the poll) each read every event and
//! the ending. The figures: the latency from an append's call to each
//! follower's receipt, this process's resident memory before the followers
//! and with them attached, the store connections open while they follow
//! (PostgreSQL and MySQL: the server's own count for this database), and
//! how many turns node B follows (one feed, however many followers).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use agentgate::events::Followed;
use agentgate::model::BeginCommand;
use agentgate::{Begun, ClientRequestId, Config, SessionId, UserId};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use tokio_stream::StreamExt as _;

use crate::error::{BenchError, Result};
use crate::stats::{Samples, StepLatency};
use crate::target::{Dialect, Target};

/// Pause between appends: the followers read a live tail, not a burst.
const PACE: Duration = Duration::from_millis(20);

/// Longest a follower waits for its next event.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(30);

/// What the events row measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EventsRow {
    /// Followers of the one turn.
    pub subscribers: usize,
    /// Events appended.
    pub events: usize,
    /// Append called → event received, over every follower and event.
    pub delivery: StepLatency,
    /// The raw notification round trip, where the store has one.
    pub raw_notify: Option<StepLatency>,
    /// `delivery.p50_ms` ÷ `raw_notify.p50_ms`.
    pub delivery_to_raw_p50: Option<f64>,
    /// This process's resident memory before the followers, MiB.
    pub rss_before_mib: Option<f64>,
    /// With every follower attached and reading, MiB.
    pub rss_following_mib: Option<f64>,
    /// Store connections open to this database while they follow.
    pub store_connections: Option<i64>,
    /// Turns node B's gate followed while they followed (its feeds).
    pub feeds: usize,
}

fn options(what: &str) -> impl Fn(agentgate::Error) -> BenchError + '_ {
    move |e| BenchError::Options(format!("events row, {what}: {e}"))
}

/// This process's resident set, from `/proc/self/status` (Linux).
fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The store server's count of connections to this database.
async fn store_connections(target: &Target) -> Result<Option<i64>> {
    let map = |e: sqlx::Error| BenchError::Options(format!("events row, connections: {e}"));
    match target.dialect {
        Dialect::Postgres => {
            use sqlx::Connection as _;
            let mut conn = sqlx::postgres::PgConnection::connect(&target.store_url)
                .await
                .map_err(map)?;
            let (count,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()",
            )
            .fetch_one(&mut conn)
            .await
            .map_err(map)?;
            let _ = conn.close().await;
            // Less the connection that asked.
            Ok(Some(count - 1))
        }
        Dialect::MySql => {
            use sqlx::Connection as _;
            let mut conn = sqlx::mysql::MySqlConnection::connect(&target.store_url)
                .await
                .map_err(map)?;
            let (count,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE db = DATABASE()",
            )
            .fetch_one(&mut conn)
            .await
            .map_err(map)?;
            let _ = conn.close().await;
            Ok(Some(count - 1))
        }
        Dialect::Sqlite => Ok(None),
    }
}

/// Runs the row (`subscribers` followers of `events` events; 0 skips it).
///
/// # Errors
/// Any failure of a begin, an append, a follower or the raw notification.
pub(crate) async fn measure(
    target: &Target,
    config: &Config,
    subscribers: usize,
    events: usize,
) -> Result<Option<EventsRow>> {
    if subscribers == 0 || events == 0 {
        return Ok(None);
    }
    let (node_a, node_b) = crate::wake::two_nodes(target, config).await?;
    let id = options("ids");
    let command = BeginCommand::new(
        UserId::new("events-user").map_err(&id)?,
        SessionId::new(format!("events-{}", agentgate::TurnId::generate())).map_err(&id)?,
        ClientRequestId::new("m1").map_err(&id)?,
        &json!("m1"),
        None,
    )
    .map_err(&id)?;
    let Begun::Started(turn) = node_a.begin_command(&command).await? else {
        return Err(BenchError::Options(
            "events row: the turn did not start".into(),
        ));
    };
    let turn_id = turn.id().clone();
    let rss_before_mib = rss_mib();
    // When each event's append was called, by id.
    let sent: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; events + 1]));
    let mut followers = Vec::with_capacity(subscribers);
    for _ in 0..subscribers {
        let mut stream = node_b.follow(&turn_id, 0).map_err(options("follow"))?;
        let sent = Arc::clone(&sent);
        followers.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            loop {
                let item = tokio::time::timeout(FOLLOW_TIMEOUT, stream.next())
                    .await
                    .map_err(|_| BenchError::Options("events row: a follower stalled".into()))?;
                match item {
                    Some(Ok(Followed::Event(event))) => {
                        let at = sent.lock().unwrap_or_else(PoisonError::into_inner)
                            [event.event_id as usize];
                        if let Some(at) = at {
                            samples.push(at.elapsed());
                        }
                    }
                    Some(Ok(Followed::End { .. })) => return Ok::<_, BenchError>(samples),
                    Some(Err(error)) => return Err(options("a follower")(error)),
                    None => return Err(BenchError::Options("events row: a stream closed".into())),
                }
            }
        }));
    }
    let mut rss_following_mib = None;
    let mut connections = None;
    let mut feeds = 0;
    for n in 1..=events {
        sent.lock().unwrap_or_else(PoisonError::into_inner)[n] = Some(Instant::now());
        turn.emit("token", &json!(n))
            .await
            .map_err(options("emit"))?;
        if n == events / 2 {
            rss_following_mib = rss_mib();
            connections = store_connections(target).await?;
            feeds = node_b.followed_turns();
        }
        tokio::time::sleep(PACE).await;
    }
    turn.succeed(&json!("done")).await.map_err(|e| e.error)?;
    let mut delivery = Samples::default();
    for follower in followers {
        let samples = follower
            .await
            .map_err(|e| BenchError::Options(format!("events row follower: {e}")))??;
        delivery.extend(samples);
    }
    let raw_notify = crate::wake::raw_notification(target, events).await?;
    let delivery = delivery.summary();
    let delivery_to_raw_p50 = raw_notify
        .as_ref()
        .filter(|raw| raw.p50_ms > 0.0)
        .map(|raw| delivery.p50_ms / raw.p50_ms);
    Ok(Some(EventsRow {
        subscribers,
        events,
        delivery,
        raw_notify,
        delivery_to_raw_p50,
        rss_before_mib,
        rss_following_mib,
        store_connections: connections,
        feeds,
    }))
}
