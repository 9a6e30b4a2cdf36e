//! An outage is a fast 503, never a hang: a store that stops answering
//! without closing its connections (a network partition, a proxy that
//! blackholes) fails every step within its bound.
//!
//! The real binary runs on PostgreSQL, on MariaDB, and on SQLite with the
//! Redis lease layer, each reached through a TCP proxy this test controls.
//! After a turn has begun and claimed a tool, the proxy stops forwarding
//! (it keeps every connection open and holds what is sent), and every
//! kind of call — a begin, a heartbeat, a tool claim, an ending, a read —
//! must be answered 503 `store_unavailable` with `Retry-After` within
//! [`STEP_BOUND`], and once the proxy forwards again the server recovers
//! by itself. With Redis, the first call after the loss must fail within
//! [`REDIS_BOUND`].
//!
//! Skipped with a printed reason when a server is absent, unless
//! `AGENTGATE_REQUIRE_SERVICES=1`.

#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentgate::limits::STORE_STEP_DEADLINE;
use agentgate_conformance::targets;
use serde_json::json;
use support::{lease, Client, Reply, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The most a call may take to fail while the store is blackholed: the
/// step deadline every step runs under, plus time for the answer to be
/// written on a loaded machine. A bound on a hang, not a performance
/// figure.
const STEP_BOUND: Duration = Duration::from_secs(STORE_STEP_DEADLINE.as_secs() + 5);

/// The most the first call after Redis is lost may take to fail.
const REDIS_BOUND: Duration = Duration::from_secs(1);

/// How long the server may take to serve again once the store answers.
const RECOVERY_BOUND: Duration = Duration::from_secs(40);

/// A TCP proxy to `upstream` that forwards until told to blackhole.
struct Proxy {
    port: u16,
    blackhole: Arc<AtomicBool>,
    severed: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("an address").port();
        let blackhole = Arc::new(AtomicBool::new(false));
        let severed = Arc::new(AtomicBool::new(false));
        let flags = (Arc::clone(&blackhole), Arc::clone(&severed));
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if flags.1.load(Ordering::SeqCst) {
                    continue; // refused: closed at once, as a dead server's port
                }
                let flags = (Arc::clone(&flags.0), Arc::clone(&flags.1));
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (in_read, in_write) = inbound.into_split();
                    let (out_read, out_write) = outbound.into_split();
                    tokio::spawn(forward(
                        in_read,
                        out_write,
                        Arc::clone(&flags.0),
                        Arc::clone(&flags.1),
                    ));
                    forward(out_read, in_write, flags.0, flags.1).await;
                });
            }
        });
        Self {
            port,
            blackhole,
            severed,
        }
    }

    fn blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
    }

    /// As a server that died: every connection closed, new ones closed
    /// at once (`on`), or served again (`!on`).
    fn sever(&self, on: bool) {
        self.severed.store(on, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, holding everything while blackholed: the peer
/// sees an open connection that answers nothing, as across a network
/// partition, and TCP delivers what was held once it heals (nothing is
/// lost inside a stream: TCP does not lose bytes, it retransmits them).
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    blackhole: Arc<AtomicBool>,
    severed: Arc<AtomicBool>,
) {
    let held = || async {
        while blackhole.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let mut buffer = vec![0_u8; 64 * 1024];
    loop {
        held().await;
        // Read in short slices, so a severed proxy closes idle connections
        // too (both halves drop when both directions return).
        let read =
            match tokio::time::timeout(Duration::from_millis(20), from.read(&mut buffer)).await {
                _ if severed.load(Ordering::SeqCst) => return,
                Err(_) => continue,
                Ok(Ok(0) | Err(_)) => return,
                Ok(Ok(read)) => read,
            };
        held().await;
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// `url` with its `:port` replaced by the proxy's.
fn through(url: &str, port: u16, proxy: &Proxy) -> String {
    let from = format!(":{port}");
    assert!(url.contains(&from), "{url} names port {port}");
    url.replacen(&from, &format!(":{}", proxy.port), 1)
}

/// A call's answer and how long it took.
async fn timed<F: std::future::Future<Output = Reply>>(call: F) -> (Reply, Duration) {
    let started = Instant::now();
    let reply = call.await;
    (reply, started.elapsed())
}

/// Every kind of call, at once, while the store is blackholed: each must
/// be a 503 with `Retry-After` within [`STEP_BOUND`]. Returns the slowest.
async fn every_call_fails_fast(client: &Client, turn: &str, token: &str) -> Duration {
    let payload = json!({"text": "hi"});
    let claim_body = json!({"tool": "book", "args": {"n": 2}});
    let ending_body = json!({"response": "done"});
    let empty = json!({});
    let heartbeat = format!("/v1/turns/{turn}/heartbeat");
    let tools = format!("/v1/turns/{turn}/tools");
    let complete = format!("/v1/turns/{turn}/complete");
    let read = format!("/v1/turns/{turn}");
    let (begin, heartbeat, claim, ending, read) = tokio::join!(
        timed(client.begin("bh-user2", "bh-other", "r-1", &payload)),
        timed(client.post(&heartbeat, Some(token), &empty)),
        timed(client.post(&tools, Some(token), &claim_body)),
        timed(client.post(&complete, Some(token), &ending_body)),
        timed(client.get(&read)),
    );
    let mut slowest = Duration::ZERO;
    for (name, (reply, took)) in [
        ("begin", begin),
        ("heartbeat", heartbeat),
        ("claim", claim),
        ("ending", ending),
        ("read", read),
    ] {
        assert_eq!(
            (reply.status, reply.code()),
            (503, "store_unavailable"),
            "{name} while the store is blackholed: {}",
            reply.text
        );
        assert!(reply.retry_after().is_some(), "{name}: a Retry-After");
        assert!(
            took <= STEP_BOUND,
            "{name} took {took:?} to fail, over {STEP_BOUND:?}"
        );
        slowest = slowest.max(took);
    }
    slowest
}

/// Polls a begin until the server serves again after the outage.
async fn recovers(client: &Client) -> Duration {
    let started = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let reply = client
            .begin("bh-after", &format!("bh-after-{n}"), "r-1", &json!({}))
            .await;
        if reply.status == 201 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < RECOVERY_BOUND,
            "still refused {:?} after the store came back: {}",
            started.elapsed(),
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A turn begun and a tool claimed, so every later kind of call has a lease.
async fn a_turn(client: &Client) -> (String, String) {
    let begun = client
        .begin("bh-user", "bh-session", "r-1", &json!({"text": "hi"}))
        .await;
    let (turn, token) = lease(&begun);
    client
        .post(
            &format!("/v1/turns/{turn}/tools"),
            Some(&token),
            &json!({"tool": "book", "args": {"n": 1}}),
        )
        .await
        .expect(201, "");
    (turn, token)
}

fn upstream(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

async fn sql_store(name: &str, store_url: &str, port: u16) {
    let proxy = Proxy::start(upstream(port)).await;
    let dir = support::scratch();
    let server = Server::start_on_store(
        &through(store_url, port, &proxy),
        dir.path().join("server.log"),
        &[],
    );
    let client = server.client();
    let (turn, token) = a_turn(&client).await;
    proxy.blackhole(true);
    let slowest = every_call_fails_fast(&client, &turn, &token).await;
    proxy.blackhole(false);
    let back = recovers(&client).await;
    println!(
        "blackhole {name}: every call failed 503 within {slowest:?} (bound {STEP_BOUND:?}); \
         serving again {back:?} after the store answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_postgres_fails_every_step_within_its_bound() {
    let Some(target) = targets::postgres().await else {
        return;
    };
    sql_store("postgres", &target.store_url, 5432).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_mariadb_fails_every_step_within_its_bound() {
    let Some(target) = targets::mysql().await else {
        return;
    };
    sql_store("mariadb", &target.store_url, 3306).await;
}

/// SQLite with the Redis lease layer behind the proxy: the first call
/// after Redis is lost fails within [`REDIS_BOUND`], and so do the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_redis_fails_the_first_call_within_a_second() {
    let Some(redis) = targets::redis_url().await else {
        return;
    };
    let proxy = Proxy::start(upstream(6379)).await;
    let dir = support::scratch();
    let redis = through(&redis, 6379, &proxy);
    let store = format!("sqlite://{}", dir.path().join("agentgate.db").display());
    let server =
        Server::start_on_store(&store, dir.path().join("server.log"), &["--redis", &redis]);
    let client = server.client();
    let (turn, token) = a_turn(&client).await;
    proxy.blackhole(true);
    let (first, took): (Reply, Duration) = timed(client.post(
        &format!("/v1/turns/{turn}/heartbeat"),
        Some(&token),
        &json!({}),
    ))
    .await;
    assert_eq!(
        (first.status, first.code()),
        (503, "store_unavailable"),
        "{}",
        first.text
    );
    assert!(
        took <= REDIS_BOUND,
        "the first call after Redis was lost took {took:?}, over {REDIS_BOUND:?}"
    );
    let slowest = every_call_fails_fast(&client, &turn, &token).await;
    proxy.blackhole(false);
    let back = recovers(&client).await;

    // Redis dies instead: its connections close, its port refuses.
    let (turn, token) = {
        let begun = client
            .begin("bh-dead", "bh-dead", "r-1", &json!({"text": "hi"}))
            .await;
        lease(&begun)
    };
    proxy.sever(true);
    let (dead, dead_took): (Reply, Duration) = timed(client.post(
        &format!("/v1/turns/{turn}/heartbeat"),
        Some(&token),
        &json!({}),
    ))
    .await;
    assert_eq!(
        (dead.status, dead.code()),
        (503, "store_unavailable"),
        "{}",
        dead.text
    );
    assert!(
        dead_took <= REDIS_BOUND,
        "the first call after Redis died took {dead_took:?}, over {REDIS_BOUND:?}"
    );
    let (again, again_took): (Reply, Duration) = timed(client.post(
        &format!("/v1/turns/{turn}/heartbeat"),
        Some(&token),
        &json!({}),
    ))
    .await;
    assert_eq!(again.status, 503, "{}", again.text);
    assert!(
        again_took <= REDIS_BOUND,
        "the second call after Redis died took {again_took:?}, over {REDIS_BOUND:?}"
    );
    proxy.sever(false);
    let revived = recovers(&client).await;
    println!(
        "blackhole redis (dead): the first call failed in {dead_took:?}, the second in \
         {again_took:?}; serving again {revived:?} after Redis came back"
    );
    println!(
        "blackhole redis: the first call failed in {took:?} (bound {REDIS_BOUND:?}), every call \
         within {slowest:?}; serving again {back:?} after Redis answered"
    );
}
