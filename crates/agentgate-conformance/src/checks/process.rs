//! A real child process holds a lease and is killed with SIGKILL: the lease
//! is not acquirable before its TTL and is acquirable after, by a takeover
//! that sees the child's tool call as unknown.

use std::process::Stdio;
use std::time::Duration;

use agentgate::{ErrorKind, PreviousOutcome, ToolStep};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

use super::{report, short_ttl, start_within, SHORT_TTL};
use crate::Target;

/// Spawns `holder_exe` on the target, waits until it holds the lease and has
/// claimed a tool, kills it with SIGKILL, and takes over.
///
/// # Panics
/// When any step of the scenario does not hold.
pub async fn sigkilled_holder_is_taken_over_after_ttl(target: &Target, holder_exe: &str) {
    let gate = target.gate(short_ttl()).await;
    let mut child = tokio::process::Command::new(holder_exe)
        .arg(&target.store_url)
        .arg(target.redis_url.as_deref().unwrap_or("-"))
        .args(["kill-user", "kill-session", "r1"])
        .arg(SHORT_TTL.as_millis().to_string())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the holder reports in time")
        .expect("read the holder")
        .expect("the holder printed a line");
    let fence: i64 = ready
        .strip_prefix("HOLDING ")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("unexpected holder line {ready:?}"));

    // While the child lives, its watchdog keeps the lease past several TTLs.
    tokio::time::sleep(SHORT_TTL * 2).await;
    let busy = gate
        .begin("kill-user", "kill-session", "r2", &json!(2))
        .await
        .expect_err("held by the child");
    assert_eq!(busy.kind(), ErrorKind::SessionBusy);

    child.start_kill().expect("SIGKILL the holder");
    let killed_at = tokio::time::Instant::now();
    let status = child.wait().await.expect("reap the holder");
    assert!(!status.success(), "the holder was killed, not finished");
    // Right after the kill the lease is still live: not acquirable before its TTL.
    let early = gate
        .begin("kill-user", "kill-session", "r1", &json!({"text": "r1"}))
        .await
        .expect_err("still leased");
    assert_eq!(early.kind(), ErrorKind::RequestInFlight, "{early}");
    let taker = start_within(&gate, "kill-user", "kill-session", "r1", SHORT_TTL * 4).await;
    let waited = killed_at.elapsed();
    assert!(
        waited <= SHORT_TTL + Duration::from_secs(2),
        "taken over {waited:?} after the kill"
    );
    assert!(taker.is_takeover());
    assert_eq!(taker.attempt(), 2);
    assert!(taker.fence().0 > fence);
    match taker
        .tool("book", &json!({"amount": 18}))
        .await
        .expect("claim")
    {
        ToolStep::Execute(execution) => {
            assert_eq!(execution.previous_outcome(), Some(PreviousOutcome::Unknown));
            execution
                .complete(&json!({"entry": 1}))
                .await
                .expect("complete");
        }
        ToolStep::Cached(_) => panic!("the killed holder never completed the call"),
    }
    taker.succeed(&json!("done")).await.expect("succeed");
    let counts = [
        ("killed".to_owned(), 1),
        ("refused_before_ttl".to_owned(), 1),
        ("takeover_after_ttl".to_owned(), 1),
        (
            "takeover_ms".to_owned(),
            usize::try_from(waited.as_millis()).unwrap_or(usize::MAX),
        ),
    ];
    report(
        target,
        "sigkilled_holder_is_taken_over_after_ttl",
        &counts.into_iter().collect(),
    );
}
