//! Resumable turn streams served by any node: two `agentgate serve`
//! processes on one store (PostgreSQL, MariaDB, and SQLite with the Redis
//! lease layer: one database file, two processes). Each round, a holder
//! writes 1,000 events through node A while a reader follows the turn
//! through node B, drops its connection at seeded random points, and
//! resumes on A or B with `Last-Event-ID`; the events it read, joined,
//! equal the written sequence exactly, and the stream ends with `end`.
//!
//! Skipped with a printed reason when a server is absent, unless
//! `AGENTGATE_REQUIRE_SERVICES=1`.

#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::time::Duration;

use agentgate_conformance::Target;
use serde_json::{json, Value};
use support::{lease, Client, Server};

/// Rounds per store.
const ROUNDS: u64 = 100;

/// Events a round writes.
const EVENTS: u64 = 1_000;

/// Events per append.
const BATCH: u64 = 50;

/// Pause between appends, so the reader follows a live tail.
const APPEND_PAUSE: Duration = Duration::from_millis(3);

/// Longest a reader waits for its next bytes before failing the round.
const READ_LIMIT: Duration = Duration::from_secs(20);

/// A seeded xorshift: the round's cuts replay from its seed.
struct Cuts(u64);

impl Cuts {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

/// One SSE event as the reader parsed it.
#[derive(Debug)]
struct Sse {
    id: Option<u64>,
    event: String,
    data: Value,
}

fn parse(block: &str) -> Option<Sse> {
    let (mut id, mut event, mut data) = (None, "message".to_owned(), None);
    for line in block.lines() {
        if let Some(value) = line.strip_prefix("id: ") {
            id = Some(value.parse().expect("numeric id"));
        } else if let Some(value) = line.strip_prefix("event: ") {
            event = value.to_owned();
        } else if let Some(value) = line.strip_prefix("data: ") {
            data = Some(serde_json::from_str(value).expect("JSON data"));
        }
    }
    // A comment-only block (a keep-alive) carries no data.
    data.map(|data| Sse { id, event, data })
}

/// Reads `client`'s stream of `turn` after `after` until `take` events were
/// read (then drops the connection) or the stream's `end`; what it read and
/// whether it saw the end.
async fn read(client: &Client, turn: &str, after: u64, take: u64) -> (Vec<Sse>, bool) {
    let mut response = client
        .get_stream(&format!("/v1/turns/{turn}/events"), Some(after))
        .await;
    assert_eq!(response.status(), 200);
    let mut buffer = String::new();
    let mut events = Vec::new();
    loop {
        let chunk = tokio::time::timeout(READ_LIMIT, response.chunk())
            .await
            .expect("the stream moves within its limit")
            .expect("the stream reads");
        let Some(chunk) = chunk else {
            return (events, false);
        };
        buffer.push_str(std::str::from_utf8(&chunk).expect("UTF-8"));
        while let Some(at) = buffer.find("\n\n") {
            let block: String = buffer.drain(..at + 2).collect();
            let Some(event) = parse(&block) else { continue };
            if event.event == "end" {
                assert_eq!(event.data["state"], "succeeded");
                events.push(event);
                return (events, true);
            }
            events.push(event);
            if events.len() as u64 >= take {
                return (events, false);
            }
        }
    }
}

async fn write(client: Client, turn: String, token: String) {
    for start in (0..EVENTS).step_by(BATCH as usize) {
        let events: Vec<Value> = (start..start + BATCH)
            .map(|i| json!({"event": "token", "data": {"i": i}}))
            .collect();
        client
            .post(
                &format!("/v1/turns/{turn}/events"),
                Some(&token),
                &json!({"events": events}),
            )
            .await
            .expect(200, "");
        tokio::time::sleep(APPEND_PAUSE).await;
    }
    client
        .post(
            &format!("/v1/turns/{turn}/complete"),
            Some(&token),
            &json!({"response": "done"}),
        )
        .await
        .expect(200, "");
}

async fn round(clients: &[Client; 2], round: u64) -> usize {
    let session = format!("stream-{round}");
    let (turn, token) = lease(
        &clients[0]
            .begin("streamer", &session, "m1", &json!("m1"))
            .await,
    );
    let writer = tokio::spawn(write(clients[0].clone(), turn.clone(), token));
    let mut cuts = Cuts(0x9E37_79B9_7F4A_7C15 ^ (round + 1));
    let (mut seen, mut after, mut drops) = (Vec::new(), 0u64, 0usize);
    // Node B first; each resume on A or B as the seed says.
    let mut node = 1;
    loop {
        let take = 1 + cuts.next(400);
        let (events, ended) = read(&clients[node], &turn, after, take).await;
        for event in &events {
            if let Some(id) = event.id {
                assert_eq!(id, after + 1, "round {round}: ids follow on without a gap");
                after = id;
                seen.push(event.data["data"]["i"].as_u64().expect("i"));
            }
        }
        if ended {
            break;
        }
        drops += 1;
        assert!(drops < 1_000, "round {round}: the reader gets somewhere");
        node = usize::from(cuts.next(2) == 1);
    }
    writer.await.expect("the writer ends");
    assert_eq!(seen, (0..EVENTS).collect::<Vec<u64>>(), "round {round}");
    drops
}

async fn scenario(target: Target) {
    let dir = support::scratch();
    let mut args = vec!["--max-turns-per-user", "1000"];
    if let Some(redis) = &target.redis_url {
        args.extend(["--redis", redis.as_str()]);
    }
    let a = Server::start_on_store(&target.store_url, dir.path().join("node-a.log"), &args);
    let b = Server::start_on_store(&target.store_url, dir.path().join("node-b.log"), &args);
    let clients = [a.client(), b.client()];
    let mut drops = 0;
    for n in 0..ROUNDS {
        drops += round(&clients, n).await;
    }
    println!(
        "event streams on {}: {ROUNDS} rounds of {EVENTS} events, {drops} dropped connections resumed, every sequence exact",
        target.name
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_resumed_on_either_node_of_postgres_misses_and_repeats_nothing() {
    let Some(target) = agentgate_conformance::targets::postgres().await else {
        return;
    };
    scenario(target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_resumed_on_either_node_of_mariadb_misses_and_repeats_nothing() {
    let Some(target) = agentgate_conformance::targets::mysql().await else {
        return;
    };
    scenario(target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_resumed_on_either_node_of_sqlite_with_redis_misses_and_repeats_nothing() {
    let Some(target) = agentgate_conformance::targets::sqlite_redis().await else {
        return;
    };
    scenario(target).await;
}
