//! The lease holder run as a child process (by `agentgate-holder` and by
//! `agentgate hold`): begins a turn, claims a tool, prints
//! `HOLDING <turn_id> <fence>`, then holds the lease, its watchdog renewing
//! it, until the process is killed.

use std::time::Duration;

use agentgate::{Begun, BoxError, Config, Gate, ToolStep};
use serde_json::json;

/// Holds a lease on `session` for `request` until killed.
///
/// # Errors
/// When the store cannot be opened, the request was already answered, or the
/// lease is lost while holding.
pub async fn hold(
    store_url: &str,
    redis_url: Option<&str>,
    user: &str,
    session: &str,
    request: &str,
    lease_ttl: Duration,
) -> Result<(), BoxError> {
    let config = Config {
        lease_ttl,
        ..Config::default()
    };
    let gate = Gate::connect(store_url, redis_url, config).await?;
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
    turn.cancellation().cancelled().await;
    drop(execution);
    Err("lease lost while holding".into())
}

/// Parses `<store_url> <redis_url or -> <user> <session> <request> <ttl_ms>`
/// and holds.
///
/// # Errors
/// On bad arguments, or as [`hold`].
pub async fn hold_from_args(args: &[String]) -> Result<(), BoxError> {
    let [store_url, redis_url, user, session, request, ttl_ms] = args else {
        return Err(
            "usage: <store_url> <redis_url or -> <user> <session> <request> <ttl_ms>".into(),
        );
    };
    let redis_url = Some(redis_url.as_str()).filter(|url| *url != "-");
    let ttl = Duration::from_millis(ttl_ms.parse()?);
    hold(store_url, redis_url, user, session, request, ttl).await
}
