//! The chaos run of docs/protocol.md §11: 200 scripted conversations from 20 users
//! against the real binary — every message sent twice at once (a double
//! click), two tabs typing into one session, large entries approved from two
//! tabs at once — with the server SIGKILLed halfway and restarted on the same
//! SQLite store. Then the ledger is counted in SQL: every message booked
//! exactly once, no double-booked entry.
//!
//! A plain `main` (`harness = false` in Cargo.toml), so its counts are
//! printed by every `cargo test`, not captured. Bounded: each message gives
//! up after [`MAX_ATTEMPTS`], and the run takes well under a minute.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod app_client;
#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use app_client::{last, AppClient, Sent};
use serde_json::Value;
use sqlx::Row as _;
use support::{scratch, Server};

const USERS: usize = 20;
const CONVERSATIONS_PER_USER: usize = 10;
const CONVERSATIONS: usize = USERS * CONVERSATIONS_PER_USER;
/// Every third conversation ends with a large entry that needs approval.
const CONFIRM_EVERY: usize = 3;
/// Offline model think time per round: short, so 200 conversations fit in
/// seconds, but long enough that duplicates and tabs overlap a running turn.
const THINK_TIME_MS: &str = "15";
/// Short lease, so turns orphaned by the SIGKILL are taken over quickly.
const LEASE_TTL_MS: &str = "1000";
/// Sends of one message (each refusal, broken stream or dead server costs
/// one) before the run fails: about 60 s of retrying.
const MAX_ATTEMPTS: usize = 600;
/// Pause before re-sending a refused message or after a transport error.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Confirmation threshold in yuan; large entries are above it.
const THRESHOLD_YUAN: i64 = 1000;

/// What the run saw, for the report.
#[derive(Default)]
struct Tally {
    requests: AtomicUsize,
    transport_errors: AtomicUsize,
    broken_streams: AtomicUsize,
    takeovers_seen: AtomicUsize,
    refusals: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    fn refused(&self, code: &str) {
        *self
            .refusals
            .lock()
            .unwrap()
            .entry(code.to_owned())
            .or_insert(0) += 1;
    }
}

/// The server's current address; replaced when it is restarted.
type Base = Arc<RwLock<String>>;

struct Run {
    base: Base,
    tally: Tally,
}

impl Run {
    fn client(&self) -> AppClient {
        AppClient::new(&self.base.read().unwrap())
    }

    /// Sends one message until it has an answer: the turn's final outcome
    /// (a reply, or a pending confirmation). Refusals that mean "wait" are
    /// retried with the same request id, as the page does.
    async fn deliver(&self, user: &str, session: &str, request: &str, text: &str) -> Value {
        for _ in 0..MAX_ATTEMPTS {
            self.tally.requests.fetch_add(1, Ordering::Relaxed);
            let sent = self.client().send(user, session, request, text).await;
            if let Some(outcome) = self.settle(sent) {
                return outcome;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        panic!("{user}/{session}/{request}: no answer after {MAX_ATTEMPTS} attempts");
    }

    /// Approves a pending confirmation until it has an answer.
    async fn approve(&self, user: &str, session: &str, request: &str, turn_id: &str) -> Value {
        for _ in 0..MAX_ATTEMPTS {
            self.tally.requests.fetch_add(1, Ordering::Relaxed);
            let sent = self
                .client()
                .confirm(user, session, request, turn_id, "approve")
                .await;
            if let Some(outcome) = self.settle(sent) {
                return outcome;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        panic!("{user}/{session}/{request}: approval unanswered after {MAX_ATTEMPTS} attempts");
    }

    /// The outcome of one send, or `None` to send again.
    fn settle(&self, sent: Result<Sent, reqwest::Error>) -> Option<Value> {
        match sent {
            Err(_) => {
                // The server is down (killed) or the stream broke mid-turn.
                self.tally.transport_errors.fetch_add(1, Ordering::Relaxed);
                None
            }
            Ok(Sent::Refused {
                status, code, body, ..
            }) => {
                self.tally.refused(&code);
                match (status, code.as_str()) {
                    (409, "session_busy" | "request_in_flight") | (429, _) | (503, _) => None,
                    _ => panic!("unexpected refusal {status}: {body}"),
                }
            }
            Ok(Sent::Streamed(events)) => {
                if let Some(started) = last(&events, "started") {
                    if started["takeover"] == true {
                        self.tally.takeovers_seen.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if let Some(pending) = last(&events, "awaiting_confirmation") {
                    return Some(serde_json::json!({
                        "state": "awaiting_confirmation",
                        "turn_id": pending["turn_id"],
                    }));
                }
                if let Some(done) = last(&events, "final") {
                    return Some(done["outcome"].clone());
                }
                // An `error` event (the lease was lost to a takeover, the
                // store hiccuped) or a stream cut by the kill: send again.
                self.tally.broken_streams.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

/// One conversation: a double-clicked message, two tabs typing at once, and
/// (every [`CONFIRM_EVERY`]th) a large entry approved from two tabs at once.
/// Returns the number of entries it must have booked.
async fn conversation(run: &Run, user: &str, index: usize) -> usize {
    let session = format!("{user}-c{index}");
    // Amounts are unique within the session, so any double booking shows as
    // two entries of one amount.
    let base = 100 + i64::try_from(index).unwrap() * 10;
    let first = format!("taxi {}", base + 1);
    let (a, b) = tokio::join!(
        run.deliver(user, &session, "m1", &first),
        run.deliver(user, &session, "m1", &first),
    );
    assert_eq!(a["turn_id"], b["turn_id"], "a duplicate is the same turn");
    let tab_a = format!("午饭 {}", base + 2);
    let tab_b = format!("coffee {}", base + 3);
    let (a, b) = tokio::join!(
        run.deliver(user, &session, "m2a", &tab_a),
        run.deliver(user, &session, "m2b", &tab_b),
    );
    assert_ne!(a["turn_id"], b["turn_id"]);
    if !index.is_multiple_of(CONFIRM_EVERY) {
        return 3;
    }
    let big = format!("laptop {}", THRESHOLD_YUAN * 3 + base);
    let pending = run.deliver(user, &session, "m3", &big).await;
    let turn_id = pending["turn_id"].as_str().unwrap().to_owned();
    if pending["state"] == "awaiting_confirmation" {
        let (a, b) = tokio::join!(
            run.approve(user, &session, "approve-tab-a", &turn_id),
            run.approve(user, &session, "approve-tab-b", &turn_id),
        );
        assert_eq!(a["turn_id"], b["turn_id"], "one continuation turn");
    }
    4
}

/// SIGKILLs the server once half the conversations are done, and restarts
/// it on the same store.
async fn chaos_monkey(mut server: Server, run: Arc<Run>, done: Arc<AtomicUsize>) -> Server {
    while done.load(Ordering::Relaxed) < CONVERSATIONS / 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();
    println!(
        "chaos: SIGKILLed the server after {} conversations",
        done.load(Ordering::Relaxed)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let restarted = tokio::task::spawn_blocking(move || server.restart())
        .await
        .expect("restart");
    *run.base.write().unwrap() = restarted.base.clone();
    println!("chaos: restarted on the same store at {}", restarted.base);
    restarted
}

struct Counts {
    entries: i64,
    duplicate_keys: i64,
    duplicate_requests: i64,
    duplicate_amounts: i64,
    takeover_turns: i64,
    /// Turns still `running` (live or orphaned) or ended `abandoned` after
    /// every conversation was answered: docs/protocol.md §4.10 says none.
    unfinished_turns: i64,
    /// Recorded user messages of the app with no reply recorded.
    unanswered_messages: i64,
}

async fn count(store: &std::path::Path) -> Counts {
    let url = format!("sqlite://{}?mode=ro", store.display());
    let pool = sqlx::SqlitePool::connect(&url)
        .await
        .expect("open the store");
    let scalar = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(sql)
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .get::<i64, _>(0)
        }
    };
    Counts {
        entries: scalar("SELECT COUNT(*) FROM ledger_entries").await,
        // The tool execution's idempotency key (UNIQUE: a second line of defence).
        duplicate_keys: scalar(
            "SELECT COUNT(*) FROM (SELECT idempotency_key FROM ledger_entries \
             GROUP BY idempotency_key HAVING COUNT(*) > 1)",
        )
        .await,
        // One message: (user, session, client_request_id, amount).
        duplicate_requests: scalar(
            "SELECT COUNT(*) FROM (SELECT e.user_id, t.session_id, t.client_request_id, \
             e.amount_cents FROM ledger_entries e JOIN ag_turns t ON t.turn_id = e.turn_id \
             GROUP BY 1, 2, 3, 4 HAVING COUNT(*) > 1)",
        )
        .await,
        // Amounts are unique per session by construction: this also catches
        // two confirmation turns (different request ids) booking one entry.
        duplicate_amounts: scalar(
            "SELECT COUNT(*) FROM (SELECT user_id, session_id, amount_cents \
             FROM ledger_entries GROUP BY 1, 2, 3 HAVING COUNT(*) > 1)",
        )
        .await,
        takeover_turns: scalar("SELECT COUNT(*) FROM ag_turns WHERE attempt > 1").await,
        unfinished_turns: scalar(
            "SELECT COUNT(*) FROM ag_turns WHERE state IN ('running', 'abandoned')",
        )
        .await,
        unanswered_messages: scalar(
            "SELECT COUNT(*) FROM ledger_messages m WHERE m.role = 'user' AND NOT EXISTS \
             (SELECT 1 FROM ledger_messages a WHERE a.turn_id = m.turn_id AND a.role = 'assistant')",
        )
        .await,
    }
}

async fn chaos() -> Result<(), String> {
    let started = Instant::now();
    let dir = scratch();
    let threshold = THRESHOLD_YUAN.to_string();
    let server = Server::start(
        dir.path(),
        &[
            "--think-time-ms",
            THINK_TIME_MS,
            "--lease-ttl-ms",
            LEASE_TTL_MS,
            "--confirm-threshold",
            &threshold,
        ],
    );
    let store = server.store.clone();
    let run = Arc::new(Run {
        base: Arc::new(RwLock::new(server.base.clone())),
        tally: Tally::default(),
    });
    let done = Arc::new(AtomicUsize::new(0));
    let monkey = tokio::spawn(chaos_monkey(server, Arc::clone(&run), Arc::clone(&done)));
    let mut users = Vec::new();
    for user in 0..USERS {
        let run = Arc::clone(&run);
        let done = Arc::clone(&done);
        users.push(tokio::spawn(async move {
            let user = format!("user{user:02}");
            let mut expected = 0;
            for index in 0..CONVERSATIONS_PER_USER {
                expected += conversation(&run, &user, index).await;
                done.fetch_add(1, Ordering::Relaxed);
            }
            expected
        }));
    }
    let mut expected = 0;
    let mut users_finished = 0;
    for user in users {
        expected += user.await.map_err(|e| format!("a user task failed: {e}"))?;
        users_finished += 1;
    }
    let server = monkey
        .await
        .map_err(|e| format!("the chaos task failed: {e}"))?;
    let counts = count(&store).await;
    let (_, dashboard) = AppClient::new(&server.base)
        .get("/app/dashboard")
        .await
        .map_err(|e| e.to_string())?;
    drop(server);

    let tally = &run.tally;
    println!("chaos: conversations     {}", done.load(Ordering::Relaxed));
    println!("chaos: users finished    {users_finished} of {USERS}");
    println!(
        "chaos: requests sent     {}",
        tally.requests.load(Ordering::Relaxed)
    );
    println!(
        "chaos: refusals          {:?}",
        tally.refusals.lock().unwrap()
    );
    println!(
        "chaos: transport errors  {} (the SIGKILL)",
        tally.transport_errors.load(Ordering::Relaxed)
    );
    println!(
        "chaos: broken streams    {}",
        tally.broken_streams.load(Ordering::Relaxed)
    );
    println!(
        "chaos: takeovers         {} seen by clients, {} turns restarted or taken over in SQL",
        tally.takeovers_seen.load(Ordering::Relaxed),
        counts.takeover_turns
    );
    println!("chaos: live leases left  {}", dashboard["live"]);
    println!("chaos: turns unfinished  {}", counts.unfinished_turns);
    println!("chaos: unanswered msgs   {}", counts.unanswered_messages);
    println!("chaos: entries expected  {expected}");
    println!("chaos: entries           {}", counts.entries);
    println!(
        "chaos: duplicates        {} by idempotency key, {} by (user, session, client_request_id, amount), {} by (user, session, amount)",
        counts.duplicate_keys, counts.duplicate_requests, counts.duplicate_amounts
    );
    println!(
        "chaos: duplicates = {}",
        counts.duplicate_keys + counts.duplicate_requests + counts.duplicate_amounts
    );
    println!("chaos: took {:.1} s", started.elapsed().as_secs_f64());

    let mut failures = Vec::new();
    if done.load(Ordering::Relaxed) != CONVERSATIONS {
        failures.push(format!(
            "{} conversations, expected {CONVERSATIONS}",
            done.load(Ordering::Relaxed)
        ));
    }
    if counts.duplicate_keys + counts.duplicate_requests + counts.duplicate_amounts != 0 {
        failures.push("double-booked entries".to_owned());
    }
    if counts.entries != i64::try_from(expected).unwrap() {
        failures.push(format!("{} entries, expected {expected}", counts.entries));
    }
    // Every conversation ended, so no turn may still hold a lease: a leak
    // here is a session locked until its TTL for a person who is done.
    let live_left = dashboard["live"].as_array().map(Vec::len);
    if live_left != Some(0) {
        failures.push(format!("live leases left: {}", dashboard["live"]));
    }
    if counts.unfinished_turns != 0 {
        failures.push(format!(
            "{} turns left running, orphaned or abandoned",
            counts.unfinished_turns
        ));
    }
    if counts.unanswered_messages != 0 {
        failures.push(format!(
            "{} accepted messages have no reply",
            counts.unanswered_messages
        ));
    }
    if tally.transport_errors.load(Ordering::Relaxed) == 0 {
        failures.push("the kill hit no request: the run proved nothing".to_owned());
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

fn main() -> ExitCode {
    // Listing tests (`cargo test -- --list`): this binary is one check.
    if std::env::args().any(|a| a == "--list") {
        println!("chaos: test");
        return ExitCode::SUCCESS;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(chaos()) {
        Ok(()) => {
            println!("chaos: 1 passed, 0 failed");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("chaos: FAILED: {failure}");
            println!("chaos: 0 passed, 1 failed");
            ExitCode::FAILURE
        }
    }
}
