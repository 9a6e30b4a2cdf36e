//! A child process for the conformance suite: begins a turn, claims a tool,
//! prints `HOLDING <turn_id> <fence>`, then holds the lease (its watchdog
//! renewing it) until it is killed.
//!
//! Usage: `agentgate-holder <store_url> <user> <session> <request> <ttl_ms>`

use std::time::Duration;

use agentgate::{Begun, Config, Gate, ToolStep};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store_url, user, session, request, ttl_ms] = args.as_slice() else {
        return Err(
            "usage: agentgate-holder <store_url> <user> <session> <request> <ttl_ms>".into(),
        );
    };
    let config = Config {
        lease_ttl: Duration::from_millis(ttl_ms.parse()?),
        ..Config::default()
    };
    let gate = Gate::open(store_url, config).await?;
    let Begun::Started(turn) = gate
        .begin(user, session, request, &json!({"text": request}))
        .await?
    else {
        return Err("the request was already answered".into());
    };
    let ToolStep::Execute(execution) = turn.tool("book", &json!({"amount": 18})).await? else {
        return Err("the tool was already done".into());
    };
    println!("HOLDING {} {}", turn.id(), turn.fence());
    // Hold the execution and the turn until SIGKILL; the watchdog renews.
    let cancelled = turn.cancellation();
    cancelled.cancelled().await;
    drop(execution);
    Err("lease lost while holding".into())
}
