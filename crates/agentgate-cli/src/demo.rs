//! `agentgate demo`: a self-contained, printed scenario on a temp SQLite file
//! that shows the invariants holding: a 50-way duplicate storm, a tool storm
//! booking through a same-transaction effect, and a takeover after a real
//! holder process is killed with SIGKILL.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentgate::{Begun, BoxError, Config, ErrorKind, Gate, PreviousOutcome, SqlTx, ToolStep};
use agentgate_conformance::checks::{outcome, storm, tally};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

/// Concurrent clients in each storm of the demo.
const DEMO_CLIENTS: usize = 50;

/// The lease TTL of the demo: short so the takeover is quick to watch.
const DEMO_TTL: Duration = Duration::from_millis(1500);

/// Runs the demo, printing what happened and the counts that prove it.
///
/// # Errors
/// When an invariant does not hold (the demo says which) or the store fails.
pub async fn run() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("demo.db").display());
    println!(
        "agentgate demo on {url} (lease TTL {} ms)\n",
        DEMO_TTL.as_millis()
    );
    let gate = Gate::open(
        &url,
        Config {
            lease_ttl: DEMO_TTL,
            ..Config::default()
        },
    )
    .await?;
    duplicate_storm(&gate).await?;
    tool_storm(&gate, &url).await?;
    takeover(&gate, &url).await?;
    println!("\nall invariants held.");
    Ok(())
}

fn check(held: bool, what: &str) -> Result<(), BoxError> {
    if held {
        Ok(())
    } else {
        Err(format!("invariant violated: {what}").into())
    }
}

async fn duplicate_storm(gate: &Gate) -> Result<(), BoxError> {
    println!("1. a user double-clicks: {DEMO_CLIENTS} identical requests arrive at once");
    let payload = json!({"text": "taxi 18 yesterday"});
    let results = storm(DEMO_CLIENTS, |_| {
        let (gate, payload) = (gate.clone(), payload.clone());
        async move { gate.begin("alice", "chat-1", "msg-1", &payload).await }
    })
    .await;
    let counts = tally(
        results
            .iter()
            .map(outcome)
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    println!(
        "   started={} request_in_flight={}",
        counts.get("started").unwrap_or(&0),
        counts.get("request_in_flight").unwrap_or(&0)
    );
    check(counts.get("started") == Some(&1), "exactly one turn starts")?;
    for result in results {
        if let Ok(Begun::Started(turn)) = result {
            turn.succeed(&json!({"text": "booked 18 to 交通"})).await?;
        }
    }
    let replays = storm(DEMO_CLIENTS, |_| {
        let (gate, payload) = (gate.clone(), payload.clone());
        async move { gate.begin("alice", "chat-1", "msg-1", &payload).await }
    })
    .await;
    let replayed = replays
        .iter()
        .filter(|r| matches!(r, Ok(Begun::Replay(_))))
        .count();
    println!("   after the answer: {replayed} retries replayed the stored answer, 0 LLM calls paid twice");
    check(replayed == DEMO_CLIENTS, "every retry replays")
}

async fn tool_storm(gate: &Gate, url: &str) -> Result<(), BoxError> {
    println!("\n2. {DEMO_CLIENTS} workers race to book the same tool call (ledger insert in the tool's transaction)");
    let pool = sqlx::SqlitePool::connect(url).await?;
    sqlx::query("CREATE TABLE demo_ledger (amount INTEGER NOT NULL, note TEXT NOT NULL)")
        .execute(&pool)
        .await?;
    let Begun::Started(turn) = gate
        .begin("alice", "chat-2", "msg-1", &json!({"text": "lunch 35"}))
        .await?
    else {
        return Err("a fresh request starts".into());
    };
    let turn = Arc::new(turn);
    let args = json!({"type": "expense", "amount": 35, "category": "餐饮"});
    let results = storm(DEMO_CLIENTS, |_| {
        let (turn, args) = (Arc::clone(&turn), args.clone());
        async move {
            for _ in 0..200 {
                match turn.tool("create_transaction", &args).await {
                    Ok(ToolStep::Execute(execution)) => {
                        execution.complete_in_tx(book).await?;
                        return Ok::<_, agentgate::Error>("executed");
                    }
                    Ok(ToolStep::Cached(_)) => return Ok("cached"),
                    Err(error) if error.kind() == ErrorKind::ToolInFlight => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(error) => return Err(error),
                }
            }
            Ok("gave up")
        }
    })
    .await;
    let classes: Vec<&str> = results.into_iter().collect::<Result<_, _>>()?;
    let counts = tally(classes);
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM demo_ledger")
        .fetch_one(&pool)
        .await?;
    println!(
        "   executed={} cached={} ledger rows={rows}",
        counts.get("executed").unwrap_or(&0),
        counts.get("cached").unwrap_or(&0)
    );
    check(
        counts.get("executed") == Some(&1) && rows == 1,
        "the side effect is booked exactly once",
    )?;
    Arc::try_unwrap(turn)
        .map_err(|_| "all workers finished")?
        .succeed(&json!("booked"))
        .await?;
    Ok(())
}

fn book(tx: SqlTx<'_>) -> agentgate::store::BoxFuture<'_, Result<serde_json::Value, BoxError>> {
    Box::pin(async move {
        match tx {
            SqlTx::Sqlite(conn) => {
                sqlx::query("INSERT INTO demo_ledger (amount, note) VALUES (35, 'lunch')")
                    .execute(conn)
                    .await?;
                Ok(json!({"booked": 35}))
            }
            other => Err(format!("the demo books on SQLite, not {other:?}").into()),
        }
    })
}

async fn takeover(gate: &Gate, url: &str) -> Result<(), BoxError> {
    println!("\n3. a worker process holds a turn mid-tool-call, then is killed with SIGKILL");
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args([
            "hold",
            url,
            "-",
            "alice",
            "chat-3",
            "msg-1",
            &DEMO_TTL.as_millis().to_string(),
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("holder stdout")?;
    let line = tokio::time::timeout(
        Duration::from_secs(30),
        BufReader::new(stdout).lines().next_line(),
    )
    .await??
    .ok_or("the holder exited early")?;
    let old_fence: i64 = line
        .split_whitespace()
        .nth(2)
        .and_then(|f| f.parse().ok())
        .ok_or("holder line")?;
    println!(
        "   holder pid {} holds the session with fence {old_fence}",
        child.id().unwrap_or(0)
    );
    child.start_kill()?;
    child.wait().await?;
    let killed = Instant::now();
    let payload = json!({"text": "msg-1"});
    let mut refused = 0;
    let turn = loop {
        match gate.begin("alice", "chat-3", "msg-1", &payload).await {
            Ok(Begun::Started(turn)) => break turn,
            Err(error)
                if error.kind() == ErrorKind::RequestInFlight
                    && killed.elapsed() < DEMO_TTL * 3 =>
            {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => return Err(error.into()),
            Ok(Begun::Replay(_)) => return Err("the killed turn cannot have an answer".into()),
            Ok(Begun::Queued(_)) => return Err("the demo never queues".into()),
        }
    };
    println!(
        "   retries refused while the dead lease lived: {refused}; taken over after {} ms",
        killed.elapsed().as_millis()
    );
    println!(
        "   takeover={} attempt={} fence {} > {old_fence}",
        turn.is_takeover(),
        turn.attempt(),
        turn.fence()
    );
    check(
        turn.is_takeover() && turn.fence().0 > old_fence,
        "a takeover gets a higher fence",
    )?;
    let ToolStep::Execute(execution) = turn.tool("book", &json!({"amount": 18})).await? else {
        return Err("the killed holder never completed the call".into());
    };
    println!(
        "   the interrupted tool call is reported previous_outcome={:?}: never a blind re-run",
        execution.previous_outcome()
    );
    check(
        execution.previous_outcome() == Some(PreviousOutcome::Unknown),
        "an interrupted call is unknown",
    )?;
    execution.complete(&json!({"verified": true})).await?;
    turn.succeed(&json!("done")).await?;
    Ok(())
}
